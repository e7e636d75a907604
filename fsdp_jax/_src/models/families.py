""":func:`from_pretrained`: a model family read from a ``config.json`` into
a :class:`CausalLM` bundle (the functions, the checkpoint's
:class:`~fsdp_jax.pretrained.WeightMap`, the wrap policy, the Megatron
rules, the LoRA targets), and what differs between families: the
checkpoint's fused tensors (Phi-3's ``qkv_proj`` / ``gate_up_proj``, GPT-2's
``c_attn``) and GPT-2's ``Conv1D`` layout."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from fsdp_jax._src.config import FSDPConfig
from fsdp_jax._src.models import checks, decoder
from fsdp_jax._src.models.config import ModelConfig, load_json, read_config
from fsdp_jax._src.pretrained.weight_map import WeightMap, split, transpose
from fsdp_jax._src.tensor import TensorParallel
from fsdp_jax._src.wrap import ModuleWrapPolicy

_ATTENTION = (None, "xla", "cudnn")


@dataclasses.dataclass(frozen=True, eq=False)
class CausalLM:
  """A causal language model of one family, read from a ``config.json``
  (:func:`from_pretrained`): pure functions over a parameter tree named as
  the checkpoint's modules, and what fsdp_jax needs to shard, load, save
  and adapt it.

  Attributes:
    config: the :class:`ModelConfig` (the decoder's options read from
      ``config.json``; ``config.raw`` is the file's dict).
    init_fn: ``init_fn(rng) -> params``, random as transformers initialises
      (for ``init_train_state(init_fn=..., pretrained=...)``, which only
      traces it where the checkpoint covers a leaf).
    apply: ``apply(params, input_ids, *, segment_ids=None, positions=None)
      -> logits`` ``[B, T, vocab]``. Packed rows: ``segment_ids`` ``[B, T]``
      (0: padding, 1, 2, ...: the documents; attention causal within each
      document, sliding windows and soft-capping as for a document alone)
      and ``positions`` ``[B, T]`` (each token's position in its document:
      the rotary or learned positions; default ``arange(T)``).
      ``apply`` and ``loss_fn`` are jitted functions (a step that calls
      them inlines them); ``init_fn`` is plain, for ``init_train_state``
      to trace (``jax.jit(b.init_fn)(key)`` to call it yourself). Both
      refuse, with an error naming the fix: token ids outside the
      vocabulary, read before dispatch where they are concrete (host or
      computed arrays; ``loss_fn.check_batch``, which ``shard_train_step``
      and ``shard_eval_step`` call on each batch), ``labels`` of another
      shape, and parameters of another model (checked as they are traced).
    loss_fn: ``loss_fn(params, batch)``, batch ``{"input_ids", "labels"}``
      (``labels`` default: the input ids), optionally ``"segment_ids"`` and
      ``"positions"`` (packed rows, as ``apply`` takes them; no target is
      taken across a document boundary or on padding, so a packed row's
      loss is the token-weighted sum of its documents' own): transformers'
      causal-LM loss, the labels shifted inside and ``-100`` ignored (the
      head and its cross-entropy computed ``loss_block_tokens`` tokens at
      a time: :func:`~fsdp_jax.chunked_cross_entropy`), as a
      :class:`~fsdp_jax.WeightedLoss` whose ratio is the mean over the
      tokens (``float(loss)``); ``shard_train_step`` reports and
      differentiates the mean over every device's tokens, as one
      ``jax.jit`` over the global batch would.
    weight_map: the checkpoint's names and layout
      (:class:`~fsdp_jax.pretrained.WeightMap`, with the ``config.json`` that
      :func:`~fsdp_jax.pretrained.save` writes back).
    wrap_policy: one FSDP unit per decoder layer (``scan=False``; None with
      ``scan=True``, where ``stacked_layers`` makes the stacked layers one
      unit gathered a layer at a time).
    stacked_layers: ``("model.layers",)`` with ``scan=True``, else ``()``.
    tensor_parallel: the family's Megatron rules
      (:class:`~fsdp_jax.TensorParallel`): heads and the MLP's width split,
      the embedding and head by vocabulary.
    lora_targets: every attention and MLP projection (PEFT's module names).
    scan: whether the layers are stacked and run with ``lax.scan``.
    dtype: the parameters' dtype.
    generation_config: the directory's ``generation_config.json``, or None.

  Example:
    >>> import json, os, tempfile, jax
    >>> from fsdp_jax import models
    >>> d = tempfile.mkdtemp()
    >>> json.dump({"model_type": "llama", "vocab_size": 64, "hidden_size": 16,
    ...            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...            "num_key_value_heads": 2}, open(os.path.join(d, "config.json"), "w"))
    >>> b = models.from_pretrained(d)
    >>> params = jax.jit(b.init_fn)(jax.random.key(0))
    >>> b.apply(params, jax.numpy.zeros((1, 5), "int32")).shape
    (1, 5, 64)
    >>> b.lora_targets[:3]
    ('q_proj', 'k_proj', 'v_proj')
  """

  config: ModelConfig
  init_fn: Callable
  apply: Callable
  loss_fn: Callable
  weight_map: WeightMap
  wrap_policy: Optional[ModuleWrapPolicy]
  stacked_layers: tuple
  tensor_parallel: TensorParallel
  lora_targets: tuple
  scan: bool
  dtype: Any
  generation_config: Optional[dict] = None
  attn_implementation: Optional[str] = None

  def __repr__(self):
    c = self.config
    return (f"CausalLM({c.model_type}: {c.num_hidden_layers} layers, hidden "
            f"{c.hidden_size}, {c.num_attention_heads} heads ({c.num_key_value_heads} "
            f"key/value) of {c.head_dim}, vocabulary {c.vocab_size}, "
            f"{jnp.dtype(self.dtype).name}{', scan' if self.scan else ''})")

  def fsdp_config(self, *, tensor_parallel: bool = False, **kwargs) -> FSDPConfig:
    """``FSDPConfig(auto_wrap_policy=wrap_policy, stacked_layers=...,
    **kwargs)``, with ``tensor_parallel=True`` also the family's rules.

    Example:
      >>> import json, os, tempfile
      >>> from fsdp_jax import models
      >>> d = tempfile.mkdtemp()
      >>> json.dump({"model_type": "gpt2", "vocab_size": 64, "n_embd": 16, "n_layer": 2,
      ...            "n_head": 2}, open(os.path.join(d, "config.json"), "w"))
      >>> models.from_pretrained(d).fsdp_config().auto_wrap_policy
      ModuleWrapPolicy(('transformer.h.*',))
    """
    kwargs.setdefault("auto_wrap_policy", self.wrap_policy)
    kwargs.setdefault("stacked_layers", self.stacked_layers)
    if tensor_parallel:
      kwargs.setdefault("tensor_parallel", self.tensor_parallel)
    return FSDPConfig(**kwargs)


# --------------------------------------------------------------------------
# Checkpoint names


def _rules(cfg: ModelConfig, scan: bool) -> list:
  """The WeightMap rules: every parameter under its checkpoint name
  (``kernel`` <-> ``weight``, transposed unless the checkpoint is GPT-2's
  ``[in, out]``), the fused tensors cut, the buffers dropped."""
  n = decoder.names_of(cfg)
  top, layer = decoder.param_shapes(cfg, n)
  gpt2 = cfg.model_type == "gpt2"
  hf_layer = f"{n.root}.{n.layers}.{{i}}"
  ours = f"{n.root}.{n.layers}" if scan else hf_layer
  fused = _fused(cfg, n)
  skip = {p for _, params, _, _ in fused for p in params}
  rules = []
  # GPT-2's older checkpoints name their tensors without "transformer.":
  # rules for both (saving writes the first).
  spellings = [lambda s: s]
  if gpt2:
    spellings.append(lambda s: s[len("transformer."):] if s.startswith("transformer.") else s)

  def ckpt_of(path):
    name = ".".join(path)
    return name[:-len("kernel")] + "weight" if name.endswith(".kernel") else name

  def layout(path):  # a Linear's [out, in] weight <-> the [in, out] kernel
    return (transpose(),) if path[-1] == "kernel" and not gpt2 else ()

  for spell in spellings:
    rules += [(spell(ckpt_of(path)), ".".join(path), *layout(path)) for path in top]
    rules += [(spell(f"{hf_layer}.{ckpt}"), tuple(f"{ours}.{p}" for p in params), cut, *t)
              for ckpt, params, cut, t in fused]
    rules += [(spell(f"{hf_layer}.{ckpt_of(path)}"), f"{ours}.{'.'.join(path)}", *layout(path))
              for path in layer if ".".join(path) not in skip]
  # Buffers a model recomputes, and a tied head's copy of the embedding.
  rules += [("model.rotary_emb.inv_freq", None),
            ("model.layers.{i}.self_attn.rotary_emb.inv_freq", None)]
  if gpt2:
    rules += [("transformer.h.{i}.attn.bias", None), ("transformer.h.{i}.attn.masked_bias", None),
              ("h.{i}.attn.bias", None), ("h.{i}.attn.masked_bias", None)]
  if cfg.tie_word_embeddings:
    rules.append(("lm_head.weight", None))
  return rules


def _fused(cfg: ModelConfig, n) -> list:
  """``[(checkpoint tensor in a layer, (its parameters), split, transforms)]``
  of the family's fused tensors."""
  h = cfg.head_dim
  qkv = [cfg.num_attention_heads * h, cfg.num_key_value_heads * h, cfg.num_key_value_heads * h]
  if cfg.model_type == "phi3":
    t = (transpose(),)
    return [("self_attn.qkv_proj.weight", tuple(f"self_attn.{p}.kernel" for p in n.qkv),
             split(qkv, axis=0), t),
            ("mlp.gate_up_proj.weight", ("mlp.gate_proj.kernel", "mlp.up_proj.kernel"),
             split([cfg.intermediate_size] * 2, axis=0), t)]
  if cfg.model_type == "gpt2":  # Conv1D: [in, out]
    return [("attn.c_attn.weight", tuple(f"attn.{p}.kernel" for p in n.qkv),
             split(qkv, axis=1), ()),
            ("attn.c_attn.bias", tuple(f"attn.{p}.bias" for p in n.qkv), split(qkv, axis=0), ())]
  return []


def weight_map(cfg: ModelConfig, *, scan: bool = False,
               generation_config: Optional[dict] = None) -> WeightMap:
  """The family's :class:`~fsdp_jax.pretrained.WeightMap` (checkpoint names
  <-> the parameters :func:`decoder.init_params` makes)."""
  return WeightMap(_rules(cfg, scan), fan_in_fan_out=cfg.model_type == "gpt2",
                   config=cfg.raw or None, generation_config=generation_config)


def tensor_parallel(cfg: ModelConfig) -> TensorParallel:
  """Megatron's layout: query/key/value and the MLP's input projections
  split by columns (heads, width), the attention output and MLP output
  projections by rows, the embedding by vocabulary (so the lookup, the tied
  head and the loss run on slices), an untied head by columns."""
  n = decoder.names_of(cfg)
  rules = [(f"*.{p}", "colwise") for p in n.qkv]
  rules.append((f"*.{n.attn}.{n.out}", "rowwise"))
  *ins, out = n.mlp_names
  rules += [(f"*.{n.mlp}.{p}", "colwise") for p in ins]
  rules.append((f"*.{n.mlp}.{out}", "rowwise"))
  rules.append((f"{n.root}.{n.embed}.weight", ("tensor", None)))
  if not cfg.tie_word_embeddings:
    rules.append(("lm_head", "colwise"))
  return TensorParallel(rules=rules)


def lora_targets(cfg: ModelConfig) -> tuple:
  n = decoder.names_of(cfg)
  if cfg.model_type == "gpt2":
    return n.qkv + (f"{n.attn}.{n.out}",) + tuple(f"{n.mlp}.{p}" for p in n.mlp_names)
  return n.qkv + (n.out,) + n.mlp_names


# --------------------------------------------------------------------------
# The bundle


def _dtype(dtype):
  if dtype is None:
    return jnp.dtype(jnp.float32)
  try:
    out = jnp.dtype(dtype)
  except TypeError:
    out = None
  if out is None or not jnp.issubdtype(out, jnp.floating):
    raise ValueError(f"from_pretrained(dtype={dtype!r}): pass a floating-point dtype "
                     "(jnp.float32, jnp.bfloat16, 'bfloat16', ...).")
  return out


def _init(cfg, dtype, scan, rng):
  return decoder.init_params(cfg, rng, dtype=dtype, scan=scan)


def _apply(cfg, scan, implementation, params, input_ids, *, segment_ids=None, positions=None):
  checks.check_params(cfg, scan, params, "apply")
  return decoder.forward(cfg, params, jnp.asarray(input_ids), scan=scan,
                         implementation=implementation, segment_ids=segment_ids,
                         positions=positions)


def _loss(cfg, scan, implementation, block_tokens, params, batch):
  tokens = jnp.asarray(batch["input_ids"])
  labels = batch.get("labels")
  labels = tokens if labels is None else jnp.asarray(labels)
  checks.check_label_shape(tokens.shape, labels.shape)
  checks.check_params(cfg, scan, params, "loss_fn")
  segment_ids, positions = decoder.check_packed(tokens, batch.get("segment_ids"),
                                                batch.get("positions"), "loss_fn")
  labels = decoder.packed_labels(labels, segment_ids)  # no target across documents
  out = decoder.forward(cfg, params, tokens, scan=scan, implementation=implementation,
                        segment_ids=segment_ids, positions=positions,
                        head=block_tokens is None)
  if block_tokens is None:
    return decoder.causal_lm_loss(out, labels)
  return decoder.blocked_causal_lm_loss(cfg, params, out, labels, block_tokens)


# Tokens per block of the loss's head: a block's float32 logits are 512 MiB
# at a 128,256-token vocabulary (Llama 3), an eighth of the 4 GiB an unblocked
# loss holds per copy at 8,192 tokens, and a 1,024-row matmul keeps the
# head's GEMMs as efficient as the unblocked one's.
LOSS_BLOCK_TOKENS = 1024


def from_pretrained(directory, *, dtype=None, scan: bool = False,
                    attn_implementation: Optional[str] = None,
                    loss_block_tokens: Optional[int] = LOSS_BLOCK_TOKENS) -> CausalLM:
  """A model family read from ``directory/config.json``: a :class:`CausalLM`.

  Reads ``config.json`` only (and ``generation_config.json`` where there is
  one): the weights come in through ``init_train_state(init_fn=b.init_fn,
  pretrained=fsdp_jax.pretrained.load(directory, b.weight_map))``, each
  device reading its own slices. Families (``model_type``): ``llama``
  (Llama 2, 3.x with ``rope_type`` ``llama3``), ``mistral`` (sliding
  window), ``qwen2`` (query/key/value biases, tied head), ``qwen3`` (q/k
  norms), ``gemma2`` and ``gemma3_text`` (soft-capping, sliding and full
  layers, scaled embeddings, ``1 + w`` norms), ``phi3`` (fused ``qkv_proj``
  / ``gate_up_proj`` in the checkpoint, cut into ``q_proj``, ... here),
  ``gpt2`` (its fused ``c_attn`` likewise). The numbers are transformers'
  (its modeling code, float32 to rounding).

  Parameters are named as the checkpoint's modules
  (``model.layers.0.self_attn.q_proj.kernel``, ``[in, out]``), so PEFT's
  targets work as written: ``LoRA(targets=("q_proj", "v_proj"))``,
  ``TensorParallel(rules=[("*.o_proj", "rowwise"), ...])``.

  Args:
    directory: a local model directory (what ``save_pretrained`` writes;
      the weights need not be there yet). A Hugging Face Hub id is refused:
      download it first.
    dtype: the parameters' dtype (default float32: full-precision masters;
      a bf16 checkpoint is converted as it is read). Activations follow
      the parameters' dtype (``MixedPrecision(param_dtype=...)`` included).
    scan: stack the layers (one leading layer axis) and run them with
      ``lax.scan``: one compiled layer; ``b.fsdp_config()`` declares them
      ``stacked_layers``, gathered one layer per iteration.
    attn_implementation: :func:`~fsdp_jax.attention`'s
      ``implementation``: None (the blockwise kernel, any backend; the
      default), ``"xla"`` (the same) or ``"cudnn"``
      (``jax.nn.dot_product_attention``'s flash attention on NVIDIA GPUs).
    loss_block_tokens: ``loss_fn`` computes the head and its cross-entropy
      this many tokens at a time (:func:`~fsdp_jax.chunked_cross_entropy`:
      no ``[tokens, vocab]`` logits, forward or backward; default 1024, a
      block's float32 logits 512 MiB at a 128K vocabulary); None: the
      whole ``[batch, length, vocab]`` logits at once, as ``apply``
      returns them.

  Returns:
    A :class:`CausalLM`.

  Raises:
    ValueError: an unsupported ``model_type`` (the error lists the
      supported ones), rope type or activation; a PEFT adapter directory
      (load the base, then ``load_adapter``); a Hub id; a
      ``loss_block_tokens`` that is neither a positive int nor None.

  Example (a directory with only a ``config.json``):
    >>> import json, math, os, tempfile, jax, jax.numpy as jnp
    >>> from fsdp_jax import models
    >>> d = tempfile.mkdtemp()
    >>> json.dump({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16,
    ...            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...            "num_key_value_heads": 2, "head_dim": 8}, open(os.path.join(d, "config.json"), "w"))
    >>> b = models.from_pretrained(d)
    >>> params = jax.jit(b.init_fn)(jax.random.key(0))
    >>> sorted(params["model"]["layers"][0]["self_attn"])
    ['k_norm', 'k_proj', 'o_proj', 'q_norm', 'q_proj', 'v_proj']
    >>> batch = {"input_ids": jnp.ones((2, 6), jnp.int32), "labels": jnp.ones((2, 6), jnp.int32)}
    >>> loss = b.loss_fn(params, batch)  # a WeightedLoss: the sum and the token count
    >>> float(loss.weight), abs(float(loss) - math.log(64)) < 0.5  # near log(vocab) at init
    (10.0, True)
  """
  if loss_block_tokens is not None and (
      isinstance(loss_block_tokens, bool) or not isinstance(loss_block_tokens, int)
      or loss_block_tokens < 1):
    raise ValueError(f"from_pretrained(loss_block_tokens={loss_block_tokens!r}): pass a "
                     "positive int (tokens per block of the loss's head, e.g. 1024) or None "
                     "(the unblocked loss).")
  if attn_implementation not in _ATTENTION:
    raise ValueError(f"from_pretrained(attn_implementation={attn_implementation!r}): pass "
                     "None, 'xla' or 'cudnn'.")
  directory = os.fspath(directory)
  raw, gen = load_json(directory)
  cfg = read_config(raw, os.path.join(directory, "config.json"))
  dtype = _dtype(dtype)
  n = decoder.names_of(cfg)
  return CausalLM(
      config=cfg,
      init_fn=functools.partial(_init, cfg, dtype, bool(scan)),
      apply=checks.Checked(
          jax.jit(functools.partial(_apply, cfg, bool(scan), attn_implementation)),
          functools.partial(checks.check_input_ids, cfg)),
      loss_fn=checks.Checked(
          jax.jit(functools.partial(_loss, cfg, bool(scan), attn_implementation,
                                    loss_block_tokens)),
          functools.partial(checks.check_batch, cfg)),
      weight_map=weight_map(cfg, scan=bool(scan), generation_config=gen),
      wrap_policy=None if scan else ModuleWrapPolicy({f"{n.root}.{n.layers}.*"}),
      stacked_layers=(f"{n.root}.{n.layers}",) if scan else (),
      tensor_parallel=tensor_parallel(cfg), lora_targets=lora_targets(cfg), scan=bool(scan),
      dtype=dtype, generation_config=gen, attn_implementation=attn_implementation)


def cache_spec(b: CausalLM, batch: int, length: int) -> jax.ShapeDtypeStruct:
  """The shape of one of the key/value caches: ``[layers, batch, length,
  key/value heads, head_dim]``."""
  c = b.config
  return jax.ShapeDtypeStruct(
      (c.num_hidden_layers, batch, length, c.num_key_value_heads, c.head_dim), b.dtype)
