"""The one decoder every family is: parameters named as the checkpoint's
modules (``model.layers.0.self_attn.q_proj.kernel``), initialised as
transformers initialises them, and run as a stack of pre-norm blocks, with
or without a key/value cache, layer by layer or as a ``lax.scan`` over
stacked layers.

Parameter layout: a ``Linear`` weight is a ``kernel`` ``[in, out]`` (the
checkpoint's ``[out, in]`` transposed; GPT-2's ``Conv1D`` is ``[in, out]``
already), with its ``bias``; norms and embeddings keep the checkpoint's
``weight`` (and ``bias``). Non-scanned layers are a list (``layers.0``,
``layers.1``, ...); scanned ones one subtree whose leaves carry a leading
layer axis (``FSDPConfig(stacked_layers=("model.layers",))``)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fsdp_jax._src.cross_entropy import chunked_cross_entropy
from fsdp_jax._src.loss import WeightedLoss
from fsdp_jax._src.models import layers as L
from fsdp_jax._src.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Names:
  """Module names of one architecture (transformers' attribute names)."""

  root: str = "model"
  embed: str = "embed_tokens"
  positions: Optional[str] = None  # learned position embedding (GPT-2's wpe)
  layers: str = "layers"
  final_norm: str = "norm"
  attn: str = "self_attn"
  qkv: tuple = ("q_proj", "k_proj", "v_proj")
  out: str = "o_proj"
  mlp: str = "mlp"
  mlp_names: tuple = ("gate_proj", "up_proj", "down_proj")
  pre_attn: str = "input_layernorm"
  post_attn: Optional[str] = None
  pre_mlp: str = "post_attention_layernorm"
  post_mlp: Optional[str] = None


LLAMA = Names()
GEMMA = Names(post_attn="post_attention_layernorm", pre_mlp="pre_feedforward_layernorm",
              post_mlp="post_feedforward_layernorm")
GPT2 = Names(root="transformer", embed="wte", positions="wpe", layers="h", final_norm="ln_f",
             attn="attn", out="c_proj", mlp_names=("c_fc", "c_proj"), pre_attn="ln_1",
             pre_mlp="ln_2")


def names_of(cfg: ModelConfig) -> Names:
  if cfg.model_type == "gpt2":
    return GPT2
  return GEMMA if cfg.sandwich_norms else LLAMA


# --------------------------------------------------------------------------
# Parameters


def param_shapes(cfg: ModelConfig, n: Names) -> tuple:
  """``(top-level {path: (shape, init)}, per-layer {path: (shape, init)})``;
  init is ``"normal"``, ``"zeros"`` or ``"ones"``."""
  d, h = cfg.hidden_size, cfg.head_dim
  nq, nkv, f = cfg.num_attention_heads * h, cfg.num_key_value_heads * h, cfg.intermediate_size
  norm_init = "zeros" if cfg.norm == "rms1p" else "ones"

  def linear(prefix, m, k, bias):
    out = {prefix + ("kernel",): ((m, k), "normal")}
    if bias:
      out[prefix + ("bias",)] = ((k,), "zeros")
    return out

  def norm_of(prefix, width):
    out = {prefix + ("weight",): ((width,), norm_init)}
    if cfg.norm == "layer":
      out[prefix + ("bias",)] = ((width,), "zeros")
    return out

  layer = {}
  layer.update(norm_of((n.pre_attn,), d))
  for name, width in zip(n.qkv, (nq, nkv, nkv)):
    layer.update(linear((n.attn, name), d, width, cfg.qkv_bias))
  layer.update(linear((n.attn, n.out), nq, d, cfg.o_bias))
  if cfg.qk_norm:
    layer.update(norm_of((n.attn, "q_norm"), h))
    layer.update(norm_of((n.attn, "k_norm"), h))
  if n.post_attn:
    layer.update(norm_of((n.post_attn,), d))
  layer.update(norm_of((n.pre_mlp,), d))
  if cfg.gated_mlp:
    gate, up, down = n.mlp_names
    layer.update(linear((n.mlp, gate), d, f, cfg.mlp_bias))
    layer.update(linear((n.mlp, up), d, f, cfg.mlp_bias))
    layer.update(linear((n.mlp, down), f, d, cfg.mlp_bias))
  else:
    fc, proj = n.mlp_names
    layer.update(linear((n.mlp, fc), d, f, cfg.mlp_bias))
    layer.update(linear((n.mlp, proj), f, d, cfg.mlp_bias))
  if n.post_mlp:
    layer.update(norm_of((n.post_mlp,), d))
  top = {(n.root, n.embed, "weight"): ((cfg.vocab_size, d), "normal")}
  if n.positions:
    top[(n.root, n.positions, "weight")] = ((cfg.max_positions, d), "normal")
  top.update(norm_of((n.root, n.final_norm), d))
  if not cfg.tie_word_embeddings:
    top[("lm_head", "kernel")] = ((d, cfg.vocab_size), "normal")
  return top, layer


def _nest(flat: dict) -> dict:
  out: dict = {}
  for path, value in flat.items():
    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return out


def _draw(key, spec: dict, dtype, lead: tuple = ()) -> dict:
  """``{path: array}`` of ``spec``'s leaves (``lead + shape`` each): the
  ``"normal"`` ones cut from one draw of ``normal(0, 1)`` (one random
  program however many leaves), the others zeros or ones."""
  sizes = [int(np.prod(shape)) for shape, init in spec.values() if init == "normal"]
  flat = jax.random.normal(key, lead + (sum(sizes),), jnp.float32) if sizes else None
  out, at = {}, 0
  for path, (shape, init) in spec.items():
    if init == "normal":
      n = int(np.prod(shape))
      out[path] = flat[..., at:at + n].reshape(lead + shape)
      at += n
    else:
      out[path] = (jnp.zeros if init == "zeros" else jnp.ones)(lead + shape, jnp.float32)
  return out


def init_params(cfg: ModelConfig, rng, *, dtype=jnp.float32, scan: bool = False) -> dict:
  """Random parameters as transformers initialises them: ``Linear`` and
  embedding weights ``normal(0, initializer_range)``, biases zeros, norm
  weights ones (zeros for Gemma's ``1 + w``). Layer ``i`` draws from
  ``fold_in(rng, i + 1)`` (the rest from ``fold_in(rng, 0)``), so the
  layers of ``init_train_state(init_fn=...)`` share one program."""
  n = names_of(cfg)
  top, layer = param_shapes(cfg, n)
  std = cfg.initializer_range

  def scaled(values: dict, spec: dict) -> dict:
    return {p: (v * std if spec[p][1] == "normal" else v).astype(dtype)
            for p, v in values.items()}

  flat = scaled(_draw(jax.random.fold_in(rng, 0), top, dtype), top)
  if scan:
    keys = jax.vmap(lambda i: jax.random.fold_in(rng, i + 1))(
        jnp.arange(cfg.num_hidden_layers))
    stacked = jax.vmap(lambda k: scaled(_draw(k, layer, dtype), layer))(keys)
    flat[(n.root, n.layers)] = _nest(stacked)
  else:
    flat[(n.root, n.layers)] = [
        _nest(scaled(_draw(jax.random.fold_in(rng, i + 1), layer, dtype), layer))
        for i in range(cfg.num_hidden_layers)]
  return _nest(flat)


# --------------------------------------------------------------------------
# The forward pass


def _block(cfg: ModelConfig, n: Names, p: dict, x, *, tables, q_pos, window, cache, start,
           implementation, q_seg=None, k_seg=None):
  """One decoder layer. ``tables``: ``(cos, sin)`` or None; ``cache``:
  ``(k, v)`` ``[B, S, K, H]`` to write this call's keys and values into at
  ``start`` (then attend over all of it), or None; ``q_seg`` / ``k_seg``:
  the queries' and keys' segment ids (:func:`layers.attend`), or None."""
  b, t, _ = x.shape
  a = p[n.attn]
  h = L.norm(p[n.pre_attn], x, cfg.norm, cfg.norm_eps)
  qn, kn, vn = n.qkv
  q = L.dense(a[qn], h).reshape(b, t, cfg.num_attention_heads, cfg.head_dim)
  k = L.dense(a[kn], h).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
  v = L.dense(a[vn], h).reshape(b, t, cfg.num_key_value_heads, cfg.head_dim)
  if cfg.qk_norm:
    q = L.norm(a["q_norm"], q, cfg.norm, cfg.norm_eps)
    k = L.norm(a["k_norm"], k, cfg.norm, cfg.norm_eps)
  if tables is not None:
    cos, sin = tables
    q, k = L.rotate(q, cos, sin), L.rotate(k, cos, sin)
  k_pos = None
  if cache is not None:
    ck, cv = cache
    k = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype), (0, start, 0, 0))
    v = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype), (0, start, 0, 0))
    cache = (k, v)
    k_pos = jnp.arange(k.shape[1])
  o = L.attend(q, k, v, scale=cfg.attn_scale, softcap=cfg.attn_softcap, q_pos=q_pos,
               k_pos=k_pos, window=window, implementation=implementation, q_seg=q_seg,
               k_seg=k_seg)
  o = L.dense(a[n.out], o.reshape(b, t, cfg.num_attention_heads * cfg.head_dim))
  if n.post_attn:
    o = L.norm(p[n.post_attn], o, cfg.norm, cfg.norm_eps)
  x = x + o
  h = L.norm(p[n.pre_mlp], x, cfg.norm, cfg.norm_eps)
  m = L.mlp(p[n.mlp], h, cfg, n.mlp_names)
  if n.post_mlp:
    m = L.norm(p[n.post_mlp], m, cfg.norm, cfg.norm_eps)
  return x + m, cache


def check_packed(tokens, segment_ids, positions, where: str = "apply") -> tuple:
  """``segment_ids`` and ``positions`` as int32 arrays of ``tokens``' shape
  ``[B, T]`` (or None), else a ValueError naming both shapes."""
  out = []
  for name, value in (("segment_ids", segment_ids), ("positions", positions)):
    if value is None:
      out.append(None)
      continue
    value = jnp.asarray(value)
    if value.shape != tokens.shape or not jnp.issubdtype(value.dtype, jnp.integer):
      raise ValueError(
          f"{where}: {name} has shape {list(value.shape)} ({value.dtype}) where input_ids has "
          f"{list(tokens.shape)}: pass integer {name} of input_ids' shape [batch, length] "
          "(segment_ids: 0 for padding, 1, 2, ... for the documents of a packed row; "
          "positions: each token's position in its document).")
    out.append(value.astype(jnp.int32))
  return tuple(out)


def forward(cfg: ModelConfig, params: dict, tokens, *, scan: bool = False, cache=None,
            start=0, implementation=None, segment_ids=None, positions=None,
            kv_segment_ids=None, head: bool = True):
  """Logits ``[B, T, vocab]`` of ``tokens`` ``[B, T]`` at slots ``start +
  arange(T)`` of their rows; with ``cache`` (``(k, v)``, each ``[layers,
  B, S, K, H]``) also the cache with this call's keys and values written at
  ``start``: ``(logits, cache)``.

  ``positions`` ``[B, T]``: the rotary (GPT-2: learned) positions (default:
  the slots). ``segment_ids`` ``[B, T]``: packed rows, attention causal
  within each segment only (0: padding); with a cache, ``kv_segment_ids``
  ``[B, S]`` are the cached keys' segments (a left-padded prompt's
  padding 0). Causality and sliding windows count slots, which within a
  segment of consecutive positions is transformers' count of positions.
  Without them the program is the unpacked one. ``head=False``: the
  final hidden state ``[B, T, d]`` (after the last norm) instead of the
  logits (:func:`blocked_causal_lm_loss` takes it)."""
  n = names_of(cfg)
  root = params[n.root]
  table = root[n.embed]["weight"]
  segment_ids, positions = check_packed(tokens, segment_ids, positions)
  x = L.embed_tokens(table, tokens, cfg.embed_scale)
  t = tokens.shape[1]
  q_pos = start + jnp.arange(t)
  pos = q_pos if positions is None else positions
  if n.positions:
    x = x + root[n.positions]["weight"][pos]
  tables = {}
  for kind, rope in (cfg.rope or {}).items():
    tables[kind] = L.rotary_tables(rope, pos, x.dtype)
  layers = root[n.layers]
  k_seg = None
  if segment_ids is not None:
    if cache is not None and kv_segment_ids is None:
      raise ValueError("forward: segment_ids with a cache need kv_segment_ids [B, S], the "
                       "cached keys' segments.")
    k_seg = segment_ids if cache is None else jnp.asarray(kv_segment_ids, jnp.int32)
  kw = dict(q_pos=q_pos, start=start, implementation=implementation, q_seg=segment_ids,
            k_seg=k_seg)
  if not scan:
    new_k, new_v = [], []
    for i, p in enumerate(layers):
      kind = cfg.layer_types[i]
      c = None if cache is None else (cache[0][i], cache[1][i])
      x, c = _block(cfg, n, p, x, tables=tables.get(kind), window=cfg.window(kind), cache=c,
                    **kw)
      if c is not None:
        new_k.append(c[0])
        new_v.append(c[1])
    if cache is not None:
      cache = (jnp.stack(new_k), jnp.stack(new_v))
  else:
    x, cache = _scan_layers(cfg, n, layers, x, tables, cache, kw)
  x = L.norm(root[n.final_norm], x, cfg.norm, cfg.norm_eps)
  if not head:  # the final hidden state, for the blocked loss
    return x if cache is None else (x, cache)
  logits = L.softcap(x @ head_kernel(cfg, params), cfg.final_softcap)
  return logits if cache is None else (logits, cache)


def head_kernel(cfg: ModelConfig, params: dict):
  """The head's ``[d, vocab]`` kernel: ``lm_head.kernel``, or the tied
  embedding table transposed."""
  if cfg.tie_word_embeddings:
    n = names_of(cfg)
    return params[n.root][n.embed]["weight"].T
  return params["lm_head"]["kernel"]


def _scan_layers(cfg: ModelConfig, n: Names, layers: dict, x, tables: dict, cache, kw):
  """The layers as one ``lax.scan`` over their stacked parameters. Where
  sliding and full layers mix, each layer's window and rotary tables are
  picked by a per-layer flag (the window a traced bound of the mask)."""
  kinds = sorted(set(cfg.layer_types))
  mixed = cfg.mixed_layers
  sliding = np.asarray([k == "sliding" for k in cfg.layer_types])
  xs = {"p": layers}
  if mixed:
    xs["sliding"] = jnp.asarray(sliding)
  if cache is not None:
    xs["cache"] = cache

  def body(x, xs):
    if mixed:
      flag = xs["sliding"]
      window = jnp.where(flag, cfg.sliding_window, np.iinfo(np.int32).max)
      tab = None
      if tables:
        tab = tuple(jnp.where(flag, s, f) for s, f in zip(tables["sliding"], tables["full"]))
    else:
      window = cfg.window(kinds[0])
      tab = tables.get(kinds[0])
    x, c = _block(cfg, n, xs["p"], x, tables=tab, window=window, cache=xs.get("cache"), **kw)
    return x, c

  x, new = jax.lax.scan(body, x, xs)
  return x, (new if cache is not None else None)


def packed_labels(labels, segment_ids):
  """``labels`` with ``-100`` where a packed row's next-token prediction
  crosses a document boundary: ``labels[t + 1]`` (the target of position
  ``t``) is dropped where ``segment_ids[t + 1] != segment_ids[t]`` (each
  document's first token) or ``segment_ids[t + 1] == 0`` (padding), so the
  loss is the sum of each document's own loss. Unchanged where
  ``segment_ids`` is None."""
  if segment_ids is None:
    return labels
  seg = jnp.asarray(segment_ids)
  cross = jnp.concatenate(
      [jnp.zeros_like(seg[:, :1], bool), (seg[:, 1:] != seg[:, :-1]) | (seg[:, 1:] == 0)], 1)
  return jnp.where(cross, -100, labels)


def causal_lm_loss(logits, labels):
  """transformers' causal-LM loss: position ``t`` predicts ``labels[t + 1]``,
  ``-100`` ignored, in float32: a :class:`~fsdp_jax.WeightedLoss` (the sum
  over the tokens and their count), whose ratio is the mean."""
  logits = logits[:, :-1].astype(jnp.float32)
  labels = labels[:, 1:]
  valid = labels != -100
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
  return WeightedLoss(total=jnp.sum(jnp.where(valid, ce, 0.0)),
                      weight=jnp.sum(valid).astype(jnp.float32))


def blocked_causal_lm_loss(cfg: ModelConfig, params: dict, hidden, labels, block_tokens: int):
  """:func:`causal_lm_loss` from the final hidden state ``[B, T, d]``, the
  head and its cross-entropy computed ``block_tokens`` tokens at a time
  (:func:`~fsdp_jax.chunked_cross_entropy`): the labels shifted (position
  ``t`` predicts ``labels[t + 1]``; the last position predicts nothing),
  the tied head included, Gemma 2's final soft-capping applied. As in the
  unblocked loss, 16-bit parameters give 16-bit logits (soft-capped in
  16 bits), widened to float32 for the softmax."""
  shifted = jnp.pad(labels[:, 1:], ((0, 0), (0, 1)), constant_values=-100)
  return chunked_cross_entropy(hidden, head_kernel(cfg, params), shifted,
                               block_tokens=block_tokens, soft_cap=cfg.final_softcap)
