"""Block quantization of what a collective moves (ZeRO++'s qwZ and qgZ).

A device quantizes the values it sends, one scale per block of
``block_size`` consecutive values, and ships the quantized values and the
float32 scales as one ``uint8`` payload: every backend moves ``uint8``
natively (the CPU backend widens ``float8`` collectives to ``f16``), so the
compiled program really moves 1 byte per value (half a byte for 4-bit),
plus 4 bytes per block for the scale.

Integer formats round to nearest, or stochastically (``rounding=``; the
default for gradient reductions): ``floor(x / scale + u)`` with ``u`` in
``[0, 1)`` a pseudo-random dither hashed from each value's float32 bits and
its position, so the rounding is unbiased and needs no random state (the same
inputs give the same bytes, on every device and in every run).

``"nf4"`` is QLoRA's NormalFloat4 as bitsandbytes stores it: each value
becomes the index of the nearest of 16 fixed levels (:data:`NF4_LEVELS`,
quantiles of a normal distribution) after dividing by its block's absmax, so
the codes and scales are bitsandbytes' ``quantize_4bit(..., quant_type="nf4")``
bytes for the same flat float32 data.

Layout of one payload row (the last axis of the array sent):
``[quantized values | float32 scales, 4 bytes each]``. The last block may be
partial: its scale covers the values it has, and nothing is sent for the
rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

# dtype name -> (bits, largest representable magnitude used for the scale)
_FORMATS = {
    "int8": (8, 127.0),
    "int4": (4, 7.0),
    "float8_e4m3fn": (8, 448.0),
    "float8_e5m2": (8, 57344.0),
    "nf4": (4, 1.0),
}
_SPELLINGS = ("jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2, or 4-bit as \"int4\" / "
              "jnp.int4 or \"nf4\" (QLoRA's NormalFloat4)")
_ROUNDINGS = (None, "nearest", "stochastic")

# QLoRA's NormalFloat4 levels, exactly bitsandbytes' table
# (``bitsandbytes.functional.get_4bit_type("nf4")``); code i decodes to
# NF4_LEVELS[i] times the block's absmax.
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
# bitsandbytes' decision thresholds: the float32 midpoints of adjacent levels;
# a value on a midpoint takes the lower code (torch.bucketize, right=False).
_LEVELS32 = np.asarray(NF4_LEVELS, np.float32)
NF4_THRESHOLDS = tuple(float(m) for m in (_LEVELS32[:-1] + _LEVELS32[1:]) / np.float32(2))


class _NF4Dtype:
  """What ``Quantization(dtype="nf4").dtype`` holds: NF4 has no numpy dtype,
  so this stands in for one where the code reads ``dtype.name``. Every
  instance equals every other and, as a numpy dtype equals its name, the
  string ``"nf4"`` (any case); nothing else."""

  name = "nf4"

  def __eq__(self, other):
    return isinstance(other, _NF4Dtype) if not isinstance(other, str) else (
        other.lower() == "nf4")

  def __hash__(self):
    return hash("nf4")

  def __repr__(self):
    return "'nf4'"

  def __reduce__(self):
    return (_NF4Dtype, ())


NF4 = _NF4Dtype()


def _canonical(dtype):
  if isinstance(dtype, _NF4Dtype) or (isinstance(dtype, str) and dtype.lower() == "nf4"):
    return NF4
  try:
    d = jnp.dtype(dtype)
  except TypeError:
    d = None
  if d is None or d.name not in _FORMATS:
    raise ValueError(
        f"Quantization(dtype={dtype!r}) is not supported. Fix: pass one of "
        f"{_SPELLINGS}.")
  return d


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quantization:
  """How a collective quantizes what it moves: block-wise, one scale per block.

  Used by ``FSDPConfig(all_gather_quantization=...)`` (ZeRO++'s qwZ: each
  device quantizes its parameter shard before the all-gather and every device
  dequantizes the gathered unit to the compute dtype; the stored master
  shards stay exact) and ``FSDPConfig(reduce_scatter_quantization=...)``
  (qgZ: gradients are quantized, exchanged with all-to-all, dequantized and
  summed in float32).

  Each block of ``block_size`` consecutive values of what a device sends is
  scaled by ``max(|block|) / M`` (``M`` = 127 for int8, 7 for int4, 448 for
  float8_e4m3fn, 57344 for float8_e5m2) and rounded to ``dtype``; the scales
  travel as float32 next to the values. The bytes per value moved are
  ``bits / 8 + 4 / block_size``.

  ``"nf4"`` is QLoRA's 4-bit NormalFloat (Dettmers et al., 2023): each block
  is divided by its absmax (the scale, ``M`` = 1) and each value becomes the
  index of the nearest of bitsandbytes' 16 levels (:data:`NF4_LEVELS`,
  quantiles of a standard normal, so normally distributed weights use the
  codes evenly), packed two per byte. Blocks of 64 are QLoRA's and
  bitsandbytes' default (0.5625 bytes per value); the codes and scales are
  bitsandbytes' ``quantize_4bit(quant_type="nf4")`` bytes for the same data.
  NF4 rounds to nearest only (in a gradient reduction too, where values
  under about 4% of their block's absmax become 0: for gradients prefer int8 or
  int4 with stochastic rounding).

  Rounding to nearest is off by at most half a step (``scale / 2``) but
  biased: a value under half a step always becomes 0. Stochastic rounding
  rounds up with probability equal to the remainder, so the dequantized value
  is right on average (unbiased) and off by less than one step. Gradients
  need the unbiased kind: with round-to-nearest int4 gradients, small
  gradient entries never reach the optimizer.

  Args:
    dtype: ``jnp.int8`` (default), ``jnp.float8_e4m3fn``,
      ``jnp.float8_e5m2``, 4-bit integers spelled ``"int4"`` or
      ``jnp.int4``, or ``"nf4"`` (any case; 4-bit formats pack two values
      per byte). Stored as a ``numpy`` dtype (nf4, which has none, as an
      object whose ``.name`` is ``"nf4"``), so configs built from different
      spellings compare equal.
    block_size: values per scale (a positive int; even for 4-bit formats), or
      ``None`` for one scale per device's whole shard of the unit (per-tensor
      scaling of what the device sends).
    rounding: ``"nearest"``, ``"stochastic"`` (integer formats only; the
      dither is a hash of each value's bits and position, deterministic), or
      ``None`` (default): stochastic in a gradient reduction with an integer
      format, nearest otherwise (all-gathers of weights, float8 formats,
      which XLA's conversion rounds to nearest even, and nf4).

  Raises:
    ValueError: an unsupported dtype or block size, naming the fix.

  Example:
    >>> import jax.numpy as jnp, fsdp_jax
    >>> q = fsdp_jax.Quantization(dtype=jnp.int8, block_size=256)
    >>> q.payload_bytes(1024)   # 1024 int8 values + 4 float32 scales
    1040
    >>> fsdp_jax.Quantization(dtype="int4", block_size=256).payload_bytes(1024)
    528
    >>> fsdp_jax.Quantization(dtype="int4") == fsdp_jax.Quantization(dtype=jnp.int4)
    True
    >>> q.stochastic(gradient=True), q.stochastic(gradient=False)
    (True, False)
    >>> nf4 = fsdp_jax.Quantization(dtype="nf4", block_size=64)
    >>> nf4.payload_bytes(1024)   # 512 bytes of packed codes + 16 float32 scales
    576
    >>> nf4.dtype.name, nf4.bits, nf4 == fsdp_jax.Quantization(dtype="NF4", block_size=64)
    ('nf4', 4, True)
  """

  dtype: Any = jnp.int8
  block_size: Optional[int] = 256
  rounding: Optional[str] = None

  def __post_init__(self):
    object.__setattr__(self, "dtype", _canonical(self.dtype))
    b = self.block_size
    if b is not None:
      if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b <= 0:
        raise ValueError(
            f"Quantization(block_size={b!r}) must be a positive int (values per "
            "scale, e.g. 256), or None for one scale per device's shard.")
      if self.bits == 4 and b % 2:
        raise ValueError(
            f"Quantization(dtype='{self.dtype.name}', block_size={b}): 4-bit values are packed "
            "two per byte, so the block size must be even; e.g. "
            f"block_size={b + 1}.")
      object.__setattr__(self, "block_size", int(b))
    if self.rounding not in _ROUNDINGS:
      raise ValueError(
          f"Quantization(rounding={self.rounding!r}) is not supported. Fix: pass "
          "'nearest', 'stochastic' or None (stochastic for gradients, nearest "
          "for weights).")
    if self.rounding == "stochastic" and not self.integer:
      raise ValueError(
          f"Quantization(dtype={self.dtype.name}, rounding='stochastic'): stochastic "
          "rounding is implemented for the integer formats (int8, int4); float8 "
          "values are rounded to nearest even by XLA's conversion, and nf4 values "
          "to the nearest of its 16 levels. Fix: use dtype=jnp.int8 or 'int4', or "
          "rounding='nearest'.")

  @property
  def bits(self) -> int:
    """Bits per quantized value (8, or 4 for int4 and nf4)."""
    return _FORMATS[self.dtype.name][0]

  @property
  def max_value(self) -> float:
    """The magnitude a block's largest value is scaled to (1 for nf4)."""
    return _FORMATS[self.dtype.name][1]

  @property
  def integer(self) -> bool:
    """Whether the format is an integer one (int8, int4)."""
    return self.dtype.name in ("int8", "int4")

  def stochastic(self, gradient: bool) -> bool:
    """Whether values are rounded stochastically: ``rounding``, or for
    ``None`` the default (stochastic for a gradient reduction in an integer
    format)."""
    if self.rounding is None:
      return gradient and self.integer
    return self.rounding == "stochastic"

  def blocks(self, n: int) -> tuple[int, int]:
    """``(block length, number of blocks)`` for a row of ``n`` values."""
    if self.block_size is None:
      b = max(n, 1)
      if self.bits == 4 and b % 2:
        b += 1
      return b, 1
    return self.block_size, max(-(-n // self.block_size), 1)

  def payload_bytes(self, n: int) -> int:
    """Bytes a device sends for ``n`` values: the packed values and one
    float32 scale per block."""
    _, nb = self.blocks(n)
    return _body_bytes(n, self.bits) + 4 * nb

  def describe(self) -> str:
    """A short description, as ``print(state.plan)`` shows it."""
    block = "one scale per shard" if self.block_size is None else f"blocks of {self.block_size}"
    rounding = "" if self.rounding is None else f", {self.rounding} rounding"
    return f"{self.dtype.name}, {block}{rounding}"


def _body_bytes(n: int, bits: int) -> int:
  return n if bits == 8 else (n + 1) // 2


def _dither(x):
  """Pseudo-random ``[0, 1)`` per element of a float32 array: a hash (the
  murmur3 finalizer) of the value's bits mixed with its position along the
  last axis. Deterministic, and changes whenever the value does."""
  h = lax.bitcast_convert_type(x, jnp.uint32)
  h = h ^ (lax.broadcasted_iota(jnp.uint32, x.shape, x.ndim - 1) * jnp.uint32(0x9E3779B9))
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  h = h ^ (h >> 16)
  return (h >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def _nf4_codes(blocks, amax, n: int):
  """``(..., nb, b)`` float32 blocks -> ``(..., nb * b)`` NF4 codes (uint8,
  0..15) and ``(..., nb)`` scales, as bitsandbytes' ``quantize_4bit``
  computes them: ``x * (1 / absmax)`` in full blocks, ``x / absmax`` in a
  partial last one, and the code is the number of thresholds below the
  value. The divisor is floored at float32's smallest normal (bitsandbytes
  floors it at 1e-38, a subnormal that XLA flushes to zero): an all-zero
  block keeps scale 0 and codes 7, level 0.0, so zeros stay exact. A
  non-finite block gets a NaN scale, so it decodes to NaN."""
  nb, b = blocks.shape[-2:]
  safe = jnp.maximum(amax, jnp.float32(np.finfo(np.float32).tiny))[..., None]
  scaled = blocks * (jnp.float32(1.0) / safe)
  if nb * b != n:
    # XLA rewrites x / broadcast(a) as x * broadcast(1 / a); the barrier
    # keeps the true division (it decides values on a threshold).
    last = blocks[..., -1, :]
    divisor = lax.optimization_barrier(jnp.broadcast_to(safe[..., -1, :], last.shape))
    scaled = scaled.at[..., -1, :].set(last / divisor)
  codes = jnp.zeros(scaled.shape, jnp.uint8)
  for t in NF4_THRESHOLDS:  # a NaN compares false throughout: code 0
    codes = codes + (scaled > jnp.float32(t)).astype(jnp.uint8)
  scale = jnp.where(jnp.isfinite(amax), amax, jnp.float32(jnp.nan))
  return codes.reshape(blocks.shape[:-2] + (nb * b,)), scale


def encode(x, q: Quantization, *, stochastic: bool = False):
  """Quantizes the last axis of ``x`` (``(..., n)``) into ``uint8`` payload
  rows ``(..., q.payload_bytes(n))``, rounding to nearest, or stochastically
  with ``stochastic=True`` (integer formats). Non-finite values give a
  non-finite scale, so they decode to NaN (they are never hidden)."""
  n = x.shape[-1]
  prefix = tuple(x.shape[:-1])
  b, nb = q.blocks(n)
  x = x.astype(jnp.float32)
  if nb * b != n:
    x = jnp.pad(x, [(0, 0)] * len(prefix) + [(0, nb * b - n)])
  blocks = x.reshape(prefix + (nb, b))
  amax = jnp.max(jnp.abs(blocks), axis=-1)
  p = len(prefix)
  name = q.dtype.name
  if stochastic and not q.integer:
    raise ValueError(f"stochastic rounding is for the integer formats, not {name}")
  if name == "nf4":
    codes, scale = _nf4_codes(blocks, amax, n)
  else:
    scale = amax / jnp.float32(q.max_value)
    scale = jnp.where(amax == 0, jnp.float32(1.0), scale)
    scaled = (blocks / scale[..., None]).reshape(prefix + (nb * b,))
  if q.integer:
    # |scaled| <= M, so floor(scaled + u) stays within [-M, M].
    rounded = jnp.floor(scaled + _dither(x)) if stochastic else jnp.round(scaled)
  if name == "int8":
    vals = jnp.clip(rounded, -127, 127).astype(jnp.int8)
    body = lax.bitcast_convert_type(lax.slice_in_dim(vals, 0, n, axis=p), jnp.uint8)
  elif name == "int4":
    vals = (jnp.clip(rounded, -7, 7) + 8).astype(jnp.uint8)
    pairs = lax.slice_in_dim(vals, 0, 2 * _body_bytes(n, 4), axis=p)
    pairs = pairs.reshape(prefix + (_body_bytes(n, 4), 2))
    body = pairs[..., 0] | (pairs[..., 1] << 4)
  elif name == "nf4":  # bitsandbytes' order: the first value in the high nibble
    pairs = lax.slice_in_dim(codes, 0, 2 * _body_bytes(n, 4), axis=p)
    pairs = pairs.reshape(prefix + (_body_bytes(n, 4), 2))
    body = (pairs[..., 0] << 4) | pairs[..., 1]
  else:
    vals = scaled.astype(q.dtype)
    body = lax.bitcast_convert_type(lax.slice_in_dim(vals, 0, n, axis=p), jnp.uint8)
  scale_bytes = lax.bitcast_convert_type(scale, jnp.uint8)  # (..., nb, 4)
  return jnp.concatenate([body, scale_bytes.reshape(prefix + (4 * nb,))], axis=-1)


def decode(payload, q: Quantization, n: int, dtype):
  """Inverse of :func:`encode`: ``(..., payload_bytes(n))`` ``uint8`` rows ->
  ``(..., n)`` values in ``dtype`` (dequantized in float32)."""
  prefix = tuple(payload.shape[:-1])
  p = len(prefix)
  b, nb = q.blocks(n)
  body_len = _body_bytes(n, q.bits)
  body = lax.slice_in_dim(payload, 0, body_len, axis=p)
  scale = lax.bitcast_convert_type(
      lax.slice_in_dim(payload, body_len, body_len + 4 * nb, axis=p).reshape(prefix + (nb, 4)),
      jnp.float32)
  name = q.dtype.name
  if name == "int8":
    vals = lax.bitcast_convert_type(body, jnp.int8).astype(jnp.float32)
  elif name == "int4":
    lo = (body & 15).astype(jnp.float32) - 8.0
    hi = (body >> 4).astype(jnp.float32) - 8.0
    vals = jnp.stack([lo, hi], axis=-1).reshape(prefix + (2 * body_len,))
  elif name == "nf4":
    codes = jnp.stack([body >> 4, body & 15], axis=-1).reshape(prefix + (2 * body_len,))
    vals = jnp.asarray(_LEVELS32)[codes]
  else:
    vals = lax.bitcast_convert_type(body, q.dtype).astype(jnp.float32)
  have = vals.shape[-1]
  if have < nb * b:
    vals = jnp.pad(vals, [(0, 0)] * p + [(0, nb * b - have)])
  x = (vals[..., :nb * b].reshape(prefix + (nb, b)) * scale[..., None]).reshape(prefix + (nb * b,))
  if nb * b != n:
    x = lax.slice_in_dim(x, 0, n, axis=p)
  return x.astype(dtype)
