"""The math the families share, in plain JAX: norms, rotary embeddings,
attention (:func:`fsdp_jax.attention`: grouped-query, causal, sliding
windows, soft-capping, packed rows; blockwise past one block), and the MLPs. Each matches transformers' modeling code to
float32 rounding; dtype casts follow it too (norms in float32, softmax in
float32, cos/sin cast to the activations' dtype).

Tensor parallelism splits heads and the MLP's width: everything here cuts
or joins only along the head dimension or the sequence (rotate-half is two
slices and a concatenation of the last axis), so a head-split value stays
split and no ``"tensor"`` all-gather is needed."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax._src import attention
from fsdp_jax._src.models.config import ModelConfig, Rope

def norm(p: dict, x, kind: str, eps: float):
  """RMSNorm (``"rms"``: ``w * x`` cast first, Llama; ``"rms1p"``: ``(1 +
  w) * x`` in float32, Gemma) or LayerNorm (``"layer"``, with its bias)."""
  x32 = x.astype(jnp.float32)
  if kind == "layer":
    mean = jnp.mean(x32, -1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * p["weight"].astype(jnp.float32) + p["bias"].astype(jnp.float32)).astype(x.dtype)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)
  if kind == "rms1p":
    return (y * (1.0 + p["weight"].astype(jnp.float32))).astype(x.dtype)
  return p["weight"] * y.astype(x.dtype)


def dense(p: dict, x):
  """``x @ kernel (+ bias)``; the kernel is ``[in, out]``."""
  y = x @ p["kernel"]
  return y + p["bias"] if "bias" in p else y


def activation(name: str, x):
  if name == "silu":
    return jax.nn.silu(x)
  if name == "gelu_tanh":
    return jax.nn.gelu(x, approximate=True)
  if name == "gelu":
    return jax.nn.gelu(x, approximate=False)
  return jax.nn.relu(x)


def rotary_tables(rope: Rope, positions, dtype) -> tuple:
  """``(cos, sin)`` of shape ``positions.shape + (rotary_dim,)`` for integer
  ``positions`` ``[T]`` or ``[B, T]``
  (transformers' ``RotaryEmbedding.forward``: the angles in float32, the
  halves repeated, times ``attention_scaling``, cast to ``dtype``).
  LongRoPE picks its long frequencies when the largest position (of the
  whole batch, as transformers' ``position_ids``) reaches past the original
  length."""
  inv = jnp.asarray(np.asarray(rope.inv_freq, np.float32))
  if rope.long_inv_freq is not None:
    longer = jnp.max(positions) + 1 > rope.original_max
    inv = jnp.where(longer, jnp.asarray(np.asarray(rope.long_inv_freq, np.float32)), inv)
  freqs = positions.astype(jnp.float32)[..., None] * inv
  emb = jnp.concatenate([freqs, freqs], -1)
  scale = np.float32(rope.attention_scaling)
  return (jnp.cos(emb) * scale).astype(dtype), (jnp.sin(emb) * scale).astype(dtype)


def rotate(x, cos, sin):
  """``x * cos + rotate_half(x) * sin`` on the first ``rotary_dim`` of the
  last axis of ``x`` ``[B, T, heads, head_dim]`` (Phi's partial rotary
  passes the rest through); ``cos``, ``sin`` ``[T, rotary_dim]`` or ``[B, T,
  rotary_dim]`` (positions per row)."""
  d = cos.shape[-1]
  if cos.ndim == 2:
    cos, sin = cos[None], sin[None]
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  rot = x[..., :d]
  half = d // 2
  turned = jnp.concatenate([-rot[..., half:], rot[..., :half]], -1)
  out = rot * cos + turned * sin
  return out if d == x.shape[-1] else jnp.concatenate([out, x[..., d:]], -1)


def attend(q, k, v, *, scale: float, softcap: Optional[float], q_pos, k_pos,
           window=None, implementation=None, q_seg=None, k_seg=None):
  """Causal attention of ``q`` ``[B, T, N, H]`` over ``k``, ``v`` ``[B, S,
  K, H]`` (``N`` a multiple of ``K``: grouped-query) at slots ``q_pos``
  ``[T]`` and ``k_pos`` ``[S]`` of the row (a query attends to the keys at
  its own slot and before; ``k_pos`` None: the keys are at the queries'
  slots). ``window``: attend to the last ``window`` slots only (an int, or
  a traced int for a scan over mixed layers; None: all). ``q_seg``
  ``[B, T]`` / ``k_seg`` ``[B, S]``: segment ids (packed documents, or a
  left-padded prompt's padding as 0); a query attends only to keys of its
  own segment (padding to padding, so no row is empty).

  :func:`fsdp_jax.attention`'s kernel (blocks of queries and keys, never
  the ``[T, S]`` scores past one block; soft-capping ``tanh(s / cap) * cap``
  before the mask, Gemma 2), on the slots (the default positions when the
  keys are the queries' own), or cuDNN's with ``implementation="cudnn"``."""
  positions = {} if k_pos is None else {"q_positions": q_pos, "kv_positions": k_pos}
  if q_seg is not None and k_seg is None:
    k_seg = q_seg
  return attention.attend_local(q, k, v, **positions, q_segment_ids=q_seg,
                                kv_segment_ids=k_seg, causal=True, window=window,
                                soft_cap=softcap, scale=scale, implementation=implementation)


def embed_tokens(table, tokens, scale: Optional[float]):
  """The embedding lookup; Gemma multiplies by ``sqrt(hidden_size)``
  rounded to the table's dtype."""
  x = table[tokens]
  if scale is not None:
    x = x * jnp.asarray(scale, table.dtype)
  return x


def softcap(x, cap: Optional[float]):
  return x if cap is None else jnp.tanh(x / cap) * cap


def mlp(p: dict, x, cfg: ModelConfig, names: tuple):
  """Gated (``down(act(gate(x)) * up(x))``) or plain (``out(act(in(x)))``)."""
  if cfg.gated_mlp:
    gate, up, down = names
    return dense(p[down], activation(cfg.activation, dense(p[gate], x)) * dense(p[up], x))
  fc, proj = names
  return dense(p[proj], activation(cfg.activation, dense(p[fc], x)))
