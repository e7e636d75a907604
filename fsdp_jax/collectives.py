"""The unit all-gather and its gradient reduction.

A unit (or one dtype group of it) is gathered by one primitive,
``fsdp_all_gather``, that takes the device's local shard buffer and returns
the unit's full original leaves. It lowers to: cast to ``param_dtype`` (so the
gather moves compute-precision bytes), one ``all_gather`` over the shard axes,
and the reshapes/slices that undo the padding. It is linear; its transpose is
the unit's gradient reduction: cast to ``reduce_dtype``, pre-divide,
``psum_scatter`` over the shard axes, ``psum`` over the replicate axes
(HYBRID) or over all data axes (NO_SHARD), post-divide, cast back.

Being one primitive matters for FULL_SHARD: the remat policy refuses to save
its outputs, so the backward pass recomputes it (a second all-gather) instead
of keeping the gathered parameters alive from forward to backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fsdp_jax import _compat
from fsdp_jax._compat import Primitive


@dataclasses.dataclass(frozen=True)
class GatherSpec:
  """Static description of one gather (hashable: a primitive parameter).

  ``leaves`` holds, per output leaf, ``(layer_shape, dim0, chunk0, row_numel)``.
  ``chunk`` is the local buffer length per layer (``S``).
  """

  flat: bool
  leaves: tuple[tuple[tuple[int, ...], int, int, int], ...]
  n: int
  chunk: int
  stored_dtype: Any
  compute_dtype: Any
  reduce_dtype: Any
  shard_axes: tuple[str, ...]
  reduce_axes: tuple[str, ...]
  pre_divide: float
  post_divide: float
  reshard: bool
  keep_low_precision_grads: bool
  label: str = ""
  hook: Any = None  # a stateless communication hook replacing reduce_gradient

  def axis_name(self):
    return self.shard_axes[0] if len(self.shard_axes) == 1 else self.shard_axes


def _unpack(g, spec: GatherSpec):
  """(prefix..., N, S) gathered buffer -> list of full leaves."""
  prefix = g.shape[:-2]
  p = len(prefix)
  outs = []
  if spec.flat:
    full = g.reshape(prefix + (spec.n * spec.chunk,))
    off = 0
    for layer_shape, _, _, _ in spec.leaves:
      size = int(np.prod(layer_shape, dtype=np.int64))
      piece = lax.slice_in_dim(full, off, off + size, axis=p)
      outs.append(piece.reshape(prefix + layer_shape))
      off += size
    return outs
  off = 0
  for layer_shape, dim0, chunk0, row in spec.leaves:
    width = chunk0 * row
    piece = lax.slice_in_dim(g, off, off + width, axis=p + 1)
    piece = piece.reshape(prefix + (spec.n * chunk0,) + tuple(layer_shape[1:]))
    if spec.n * chunk0 != dim0:
      piece = lax.slice_in_dim(piece, 0, dim0, axis=p)
    outs.append(piece.reshape(prefix + tuple(layer_shape)))
    off += width
  return outs


def pack_full(cts, spec: GatherSpec, prefix, *, dtype=None, divide: float = 1.0,
              order=None, tiled: bool = False):
  """Inverse layout of :func:`_unpack`: leaves -> (prefix..., N, S), zero padded.

  Each leaf (cast to ``dtype`` and divided by ``divide`` on the way) is written
  into one zeroed buffer with ``dynamic_update_slice``, in ``order`` (leaf
  positions; default last leaf first, roughly the order a backward pass
  produces them): XLA updates the buffer in place, so a leaf's gradient can
  be freed as soon as it is written and a unit's gradient is not held twice
  (the leaves and their concatenation). ``tiled`` (flat parameters only):
  return the buffer as (prefix..., N * S).
  """
  order = list(reversed(range(len(cts)))) if order is None else list(order)
  p = len(prefix)
  dtype = dtype or cts[0].dtype

  def prep(c):
    c = c.astype(dtype)
    return c / jnp.asarray(divide, dtype) if divide != 1.0 else c

  if spec.flat:
    buf = jnp.zeros(prefix + (spec.n * spec.chunk,), dtype)
    offsets = np.cumsum([0] + [int(np.prod(ls, dtype=np.int64)) for ls, _, _, _ in spec.leaves])
    for k in order:
      piece = prep(cts[k]).reshape(prefix + (-1,))
      buf = lax.dynamic_update_slice_in_dim(buf, piece, int(offsets[k]), axis=p)
    return buf if tiled else buf.reshape(prefix + (spec.n, spec.chunk))
  buf = jnp.zeros(prefix + (spec.n, spec.chunk), dtype)
  offsets = np.cumsum([0] + [chunk0 * row for _, _, chunk0, row in spec.leaves])
  for k in order:
    layer_shape, dim0, chunk0, row = spec.leaves[k]
    c = prep(cts[k]).reshape(prefix + (dim0,) + tuple(layer_shape[1:]))
    pad = spec.n * chunk0 - dim0
    if pad:
      c = jnp.pad(c, [(0, 0)] * p + [(0, pad)] + [(0, 0)] * (len(layer_shape) - 1 if layer_shape else 0))
    buf = lax.dynamic_update_slice_in_dim(buf, c.reshape(prefix + (spec.n, chunk0 * row)),
                                          int(offsets[k]), axis=p + 1)
  return buf


def _gather_impl(buf, *, spec: GatherSpec):
  x = buf.astype(spec.compute_dtype) if spec.compute_dtype != buf.dtype else buf
  axis = x.ndim - 1
  if spec.shard_axes:
    # A gather does no arithmetic: 16-bit floats travel as their uint16 bit
    # patterns, which every backend gathers natively (the CPU backend would
    # otherwise widen a bf16 all-gather to f32 and move twice the bytes).
    as_bits = x.dtype.itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating)
    payload = lax.bitcast_convert_type(x, jnp.uint16) if as_bits else x
    g = lax.all_gather(payload, spec.axis_name(), axis=axis, tiled=False)
    if as_bits:
      g = lax.bitcast_convert_type(g, x.dtype)
  else:
    return _unpack(jnp.expand_dims(x, axis), spec)
  # Each unpacked leaf becomes its own buffer, so the gathered buffer dies
  # right after unpacking. Without the barrier XLA fuses leaf slices into late
  # backward-residual fusions (e.g. a LayerNorm scale), each reading the whole
  # gathered unit, which kept every unit alive to the end of the forward pass
  # (FULL_SHARD fp32 at 2.0x the memory floor; 1.16x with it).
  return list(lax.optimization_barrier(_unpack(g, spec)))


def _gather_abstract_eval(buf, *, spec: GatherSpec):
  prefix = buf.shape[:-1]
  return [_compat.ShapedArray(prefix + tuple(layer_shape), spec.compute_dtype)
          for layer_shape, _, _, _ in spec.leaves]


def reduce_gradient(g, spec: GatherSpec, *, tiled: bool = False):
  """The default reduction of a unit's (prefix..., N, S) gradient buffer
  (``tiled``: the same buffer as (prefix..., N * S))."""
  p = g.ndim - (1 if tiled else 2)
  g = g.astype(spec.reduce_dtype)
  if spec.pre_divide != 1.0:
    g = g / jnp.asarray(spec.pre_divide, spec.reduce_dtype)
  if spec.shard_axes:
    r = lax.psum_scatter(g, spec.axis_name(), scatter_dimension=p, tiled=tiled)
  elif tiled:
    r = g
  else:
    r = jnp.squeeze(g, axis=p)
  if spec.reduce_axes:
    r = lax.psum(r, spec.reduce_axes)
  if spec.post_divide != 1.0:
    r = r / jnp.asarray(spec.post_divide, spec.reduce_dtype)
  return r


def _gather_transpose(cts, buf, *, spec: GatherSpec):
  prefix = tuple(buf.aval.shape[:-1])
  cts = [jnp.zeros(prefix + tuple(ls), spec.compute_dtype) if _compat.is_symbolic_zero(c) else c
         for c, (ls, _, _, _) in zip(cts, spec.leaves)]
  with jax.named_scope(f"fsdp_reduce_scatter[{spec.label}]"):
    return [fsdp_reduce_p.bind(*cts, spec=spec, stored_dtype=np.dtype(buf.aval.dtype))]


def pack_gradient(cts, spec: GatherSpec, order=None):
  """A unit's full leaf gradients -> the (prefix..., N, S) buffer it reduces:
  raw for a communication hook; cast to ``reduce_dtype`` and pre-divided leaf
  by leaf otherwise (the same values as on the packed buffer)."""
  prefix = tuple(cts[0].shape[:cts[0].ndim - len(spec.leaves[0][0])])
  if spec.hook is not None:
    return pack_full(list(cts), spec, prefix, order=order)
  # Flat parameters are reduced as one (N * S) vector: reshaping the packed
  # buffer to (N, S) made XLA copy it before its last in-place update.
  return pack_full(list(cts), spec, prefix, dtype=spec.reduce_dtype, divide=spec.pre_divide,
                   order=order, tiled=spec.flat)


def reduce_packed(g, spec: GatherSpec, stored_dtype):
  """The buffer from :func:`pack_gradient` -> this device's reduced shard."""
  if spec.hook is not None:
    from fsdp_jax.hooks import call_hook  # hooks imports this module
    r, _ = call_hook(spec.hook, None, g, spec)
  else:
    r = reduce_gradient(g, dataclasses.replace(spec, pre_divide=1.0), tiled=spec.flat)
  return finish_gradient(r, spec, stored_dtype)


def _reduce_impl(*cts, spec: GatherSpec, stored_dtype):
  """The unit's full leaf gradients -> this device's reduced shard."""
  return reduce_packed(pack_gradient(cts, spec), spec, stored_dtype)


def _reduce_abstract_eval(*cts, spec: GatherSpec, stored_dtype):
  prefix = cts[0].shape[:len(cts[0].shape) - len(spec.leaves[0][0])]
  return _compat.ShapedArray(tuple(prefix) + (spec.chunk,), stored_dtype)


def finish_gradient(r, spec: GatherSpec, stored_dtype):
  """The reduced gradient in the optimizer's dtype: the stored dtype, after
  rounding to ``reduce_dtype`` when ``keep_low_precision_grads``."""
  if spec.keep_low_precision_grads:
    r = r.astype(spec.reduce_dtype)
  return r.astype(stored_dtype)


fsdp_all_gather_p = Primitive("fsdp_all_gather")
fsdp_all_gather_p.multiple_results = True
fsdp_all_gather_p.def_abstract_eval(_gather_abstract_eval)
_compat.register_lowering(fsdp_all_gather_p, _gather_impl, multiple_results=True)
_compat.deflinear(fsdp_all_gather_p, _gather_transpose)


# The transpose of the gather: one equation per unit (and dtype group) in the
# differentiated program, so :mod:`fsdp_jax.schedule` can order reductions
# against gathers and compute.
fsdp_reduce_p = Primitive("fsdp_reduce")
fsdp_reduce_p.def_abstract_eval(_reduce_abstract_eval)
_compat.register_lowering(fsdp_reduce_p, _reduce_impl, multiple_results=False)


def _no_eager(name: str):
  def impl(*args, **kwargs):
    raise RuntimeError(
        f"{name} only runs inside fsdp_jax's sharded step (a function traced by "
        "shard_train_step or fsdp_jax.value_and_grad under jax.shard_map); it was "
        "called eagerly. Fix: call it from loss_fn / the custom step, not directly.")
  return impl


fsdp_all_gather_p.def_impl(_no_eager("fsdp_all_gather"))
fsdp_reduce_p.def_impl(_no_eager("fsdp_reduce"))


def spec_of(eqn) -> GatherSpec:
  """The :class:`GatherSpec` of an ``fsdp_all_gather`` / ``fsdp_reduce``
  equation (a parameter of fsdp_jax's own primitives)."""
  return eqn.params["spec"]


def gather(buf, spec: GatherSpec):
  """Gathers one unit (or dtype group) from the local buffer ``buf``."""
  with jax.named_scope(f"fsdp_all_gather[{spec.label}]"):
    return fsdp_all_gather_p.bind(buf, spec=spec)


# Primitives the FSDP remat recomputes in the backward pass instead of saving
# their outputs: elementwise arithmetic and layout changes, which XLA fuses into
# the backward computations that read them. Without remat XLA does the same on
# its own; saving them (e.g. every intermediate of a GELU) held 2.4x the
# activations of the unsharded program.
RECOMPUTED = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2",
    "atanh", "broadcast_in_dim", "cbrt", "ceil", "clamp", "convert_element_type", "copy",
    "copy_p", "cos", "cosh", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2",
    "expand_dims", "expm1", "floor", "ge", "gt", "integer_pow", "is_finite", "le", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or",
    "pow", "reduce_precision", "rem", "reshape", "round", "rsqrt", "select_n", "sign",
    "sin", "sinh", "sqrt", "square", "squeeze", "stop_gradient", "sub", "tan", "tanh",
    "transpose", "xor", "slice", "concatenate", "pad", "dynamic_slice", "rev", "split",
})


def save_all_but_gathers(prim, *_, **params) -> bool:
  """Saves every residual except the outputs of resharded gathers (steps
  with a stacked unit, and the loop body gathering one layer per iteration)."""
  return not (prim is fsdp_all_gather_p and params["spec"].reshard)


def remat_policy(prim, *_, **params) -> bool:
  """Saves what is costly to recompute, except the outputs of resharded
  gathers (re-gathered in the backward pass); elementwise and layout
  primitives are recomputed."""
  if prim is fsdp_all_gather_p:
    return not params["spec"].reshard
  return prim.name not in RECOMPUTED
