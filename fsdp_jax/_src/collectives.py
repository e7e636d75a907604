"""The unit all-gather and its gradient reduction.

A unit (or one dtype group of it) is gathered by one primitive,
``fsdp_all_gather``, that takes the device's local shards (the flat shard, or
each leaf's rows in the original layout: :func:`local_shapes`) and returns
the unit's full original leaves. It lowers to: cast to ``param_dtype`` (so the
gather moves compute-precision bytes), one ``all_gather`` over the shard axes
(one per leaf in the original layout: :func:`gathers_per_leaf`), and the
reshapes/slices that undo the padding. It is linear; its transpose is
the unit's gradient reduction: cast to ``reduce_dtype``, pre-divide,
``psum_scatter`` over the shard axes, ``psum`` over the replicate axes
(HYBRID) or over all data axes (NO_SHARD), post-divide, cast back.

Being one primitive matters for FULL_SHARD: the remat policy refuses to save
its outputs, so the backward pass recomputes it (a second all-gather) instead
of keeping the gathered parameters alive from forward to backward.

ZeRO++'s policies live here too:

* ``reshard_after_forward=k`` (hpZ): the forward gather also returns this
  device's ``1/k`` slice of the gathered payload (its secondary shard), which
  the step saves for backward; the backward recomputes the unit with
  ``fsdp_group_gather``, an all-gather within the device's group of ``k``.
  The switch is made where ``jax.checkpoint`` splits the step into the saved
  forward and the recomputed backward (:func:`_gather_partial_eval`).
* ``all_gather_quantization`` (qwZ): the payload is the block-quantized shard
  (``uint8``, scales included), dequantized after the gather.
* ``reduce_scatter_quantization`` (qgZ): :func:`reduce_gradient` exchanges
  quantized gradient pieces (rounded stochastically by default: unbiased)
  with all-to-all and sums them in float32.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fsdp_jax._src import _compat
from fsdp_jax._src._compat import Primitive

from fsdp_jax._src import quantization


class LeafLayout(NamedTuple):
  """How one leaf of a gather is laid out (one layer of a stacked unit).

  Example: a ``(5, 3)`` leaf over 2 devices holds 3 rows on each, the last
  one padding:

    >>> from fsdp_jax.custom import LeafLayout
    >>> leaf = LeafLayout(layer_shape=(5, 3), dim0=5, chunk0=3, row_numel=3)
    >>> 2 * leaf.chunk0 - leaf.dim0
    1
  """

  layer_shape: tuple[int, ...]  # the leaf's full shape
  dim0: int  # its first dimension, unpadded (1 for a scalar)
  chunk0: int  # rows of it each device holds: dim0 padded to a multiple of N, over N
  row_numel: int  # elements in one row (the product of the other dimensions)


@dataclasses.dataclass(frozen=True)
class GatherSpec:
  """How one unit (or one dtype group of it) is gathered and its gradient
  reduced: static and hashable (a primitive parameter). A communication hook
  receives one as ``spec``.

  Layout:

  * ``flat``: the unit is one flat parameter (``use_orig_params=False``);
  * ``leaves``: one :class:`LeafLayout` per output leaf, in order;
  * ``n``: devices in the shard group; ``chunk``: the local buffer length
    per layer (``S``: a hook's ``grad`` has shape ``(..., n, chunk)``).

  Precision (PyTorch's ``MixedPrecision``): ``stored_dtype`` (the sharded
  master), ``compute_dtype`` (what the gather moves and the loss sees:
  ``param_dtype``), ``reduce_dtype``; ``keep_low_precision_grads``.

  Reduction: ``shard_axes`` (reduce-scattered over), ``reduce_axes``
  (all-reduced over after it: HYBRID's ``"replicate"``), ``pre_divide`` /
  ``post_divide`` (PyTorch's gradient divide factors), ``axis_sizes``
  (``(mesh axis, size)`` of both), ``hook`` (a stateless communication hook
  replacing :func:`reduce_gradient`, or None).

  Resharding and ZeRO++: ``reshard`` (the backward gathers the unit again),
  ``secondary`` (``k`` under ``reshard_after_forward=k``: the backward
  all-gather runs within groups of ``k`` from a saved ``1/k`` slice; 0
  otherwise), ``gather_quant`` / ``reduce_quant`` (the
  :class:`~fsdp_jax.Quantization` of the all-gather and of the gradient
  reduction, or None). ``label``: the unit's name, for messages.

  Example:

    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> seen = []
    >>> def my_hook(hook_state, grad, spec):  # the default reduction, written out
    ...   seen.append((spec.shard_axes, spec.reduce_dtype, grad.shape, spec.leaves[0].layer_shape))
    ...   return fsdp_jax.custom.reduce_gradient(grad, spec), hook_state
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> config = fsdp_jax.FSDPConfig(comm_hook=my_hook)
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=config)
    >>> step = fsdp_jax.shard_train_step(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
    ...     optax.sgd(0.1), mesh=mesh, config=config)
    >>> state, metrics = step(state, {"x": jnp.ones((2, 4))})
    >>> seen  # one unit: its (N, S) gradient buffer, N = 2 devices
    [(('shard',), dtype('float32'), (2, 4), (4, 2))]
  """

  flat: bool
  leaves: tuple[LeafLayout, ...]
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
  hook: Any = None
  secondary: int = 0
  gather_quant: Any = None
  reduce_quant: Any = None
  axis_sizes: tuple = ()

  def axis_name(self):
    return self.shard_axes[0] if len(self.shard_axes) == 1 else self.shard_axes

  def groups(self) -> list[list[int]]:
    """The secondary groups: ``secondary`` adjacent devices of the shard axes
    (linear index, row-major over ``shard_axes``)."""
    k = self.secondary
    return [[j * k + q for q in range(k)] for j in range(self.n // k)]


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
  dtype = np.dtype(dtype or cts[0].dtype)
  # 16-bit floats are written as their uint16 bit patterns: the CPU backend
  # has no 16-bit float dynamic_update_slice and widens each one to float32,
  # converting the whole buffer there and back around every leaf's update
  # (a bf16 reduce_dtype step took 1.8x the fp32 one; benchmarks/CAUSES.md).
  bits = _as_bits(dtype)
  buf_dtype = np.dtype(np.uint16) if bits else dtype

  def prep(c):
    c = c.astype(dtype)
    c = c / jnp.asarray(divide, dtype) if divide != 1.0 else c
    return lax.bitcast_convert_type(c, jnp.uint16) if bits else c

  def done(buf):
    return lax.bitcast_convert_type(buf, dtype) if bits else buf

  if spec.flat:
    buf = jnp.zeros(prefix + (spec.n * spec.chunk,), buf_dtype)
    offsets = np.cumsum([0] + [int(np.prod(ls, dtype=np.int64)) for ls, _, _, _ in spec.leaves])
    for k in order:
      piece = prep(cts[k]).reshape(prefix + (-1,))
      buf = lax.dynamic_update_slice_in_dim(buf, piece, int(offsets[k]), axis=p)
    buf = done(buf)
    return buf if tiled else buf.reshape(prefix + (spec.n, spec.chunk))
  buf = jnp.zeros(prefix + (spec.n, spec.chunk), buf_dtype)
  offsets = np.cumsum([0] + [chunk0 * row for _, _, chunk0, row in spec.leaves])
  for k in order:
    layer_shape, dim0, chunk0, row = spec.leaves[k]
    c = prep(cts[k]).reshape(prefix + (dim0,) + tuple(layer_shape[1:]))
    pad = spec.n * chunk0 - dim0
    if pad:
      c = jnp.pad(c, [(0, 0)] * p + [(0, pad)] + [(0, 0)] * (len(layer_shape) - 1 if layer_shape else 0))
    buf = lax.dynamic_update_slice_in_dim(buf, c.reshape(prefix + (spec.n, chunk0 * row)),
                                          int(offsets[k]), axis=p + 1)
  return done(buf)


def _as_bits(dtype) -> bool:
  """16-bit floats travel as their uint16 bit patterns."""
  dtype = np.dtype(dtype)
  return dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)


def payload_row(spec: GatherSpec):
  """``(dtype, length)`` of the row each device contributes to its unit's
  all-gather: the quantized bytes and scales (``uint8``), or the shard in
  the compute dtype (16-bit floats as ``uint16``)."""
  if spec.gather_quant is not None:
    return np.dtype(np.uint8), spec.gather_quant.payload_bytes(spec.chunk)
  dtype = np.dtype(spec.compute_dtype)
  return (np.dtype(np.uint16) if _as_bits(dtype) else dtype), spec.chunk


def _encode(buf, spec: GatherSpec):
  """The local shard -> the payload row it is gathered as."""
  if spec.gather_quant is not None:
    q = spec.gather_quant
    return quantization.encode(buf, q, stochastic=q.stochastic(gradient=False))
  x = buf.astype(spec.compute_dtype) if spec.compute_dtype != buf.dtype else buf
  # A gather does no arithmetic: 16-bit floats travel as their uint16 bit
  # patterns, which every backend gathers natively (the CPU backend would
  # otherwise widen a bf16 all-gather to f32 and move twice the bytes).
  return lax.bitcast_convert_type(x, jnp.uint16) if _as_bits(x.dtype) else x


def _decode(g, spec: GatherSpec):
  """Gathered payload rows (prefix..., N, L) -> (prefix..., N, S) values."""
  if spec.gather_quant is not None:
    return quantization.decode(g, spec.gather_quant, spec.chunk, spec.compute_dtype)
  if _as_bits(spec.compute_dtype):
    return lax.bitcast_convert_type(g, spec.compute_dtype)
  return g


def gathers_per_leaf(spec: GatherSpec) -> bool:
  """Whether a unit is gathered leaf by leaf: original-layout units
  (``use_orig_params=True``) whose payload is not quantized and that are not
  resharded onto groups (hpZ).

  Each leaf's local rows are all-gathered on their own, straight into the
  full leaf, as a hand-written ``shard_map`` step does: one gathered unit
  buffer would have to be sliced into its leaves, a copy of the whole unit
  per gather (on the benchmark GPT, 218 MiB per step of 1,062 MiB moved).
  XLA's GPU pipeline has all-gather and reduce-scatter combiners that can
  merge small collectives again (not measured here: no GPU).
  """
  return not spec.flat and spec.gather_quant is None and not spec.secondary


def reduces_per_leaf(spec: GatherSpec) -> bool:
  """Whether a unit's gradient is reduce-scattered leaf by leaf: original
  layout, no communication hook (a hook receives the packed ``(N, S)``
  buffer), no quantized reduction."""
  return not spec.flat and spec.hook is None and spec.reduce_quant is None


def local_prefix(x0, spec: GatherSpec) -> tuple:
  """The leading (layer) axes of a unit's local operands, from the first
  one: a flat unit's (prefix..., S) shard, or an original-layout unit's first
  leaf's (prefix..., chunk0, *layer_shape[1:]) rows."""
  shape = tuple(x0.shape)
  if spec.flat:
    return shape[:-1]
  return shape[:len(shape) - max(1, len(spec.leaves[0].layer_shape))]


def local_shapes(prefix, spec: GatherSpec) -> list:
  """Shapes of a unit's local operands (what :func:`gather` takes and the
  reduction returns): one (prefix..., S) buffer for a flat unit, each leaf's
  (prefix..., chunk0, *layer_shape[1:]) rows in the original layout."""
  prefix = tuple(prefix)
  if spec.flat:
    return [prefix + (spec.chunk,)]
  return [prefix + (chunk0,) + tuple(layer_shape[1:])
          for layer_shape, _, chunk0, _ in spec.leaves]


def concat_rows(locs, spec: GatherSpec):
  """A unit's local operands -> its (prefix..., S) local buffer."""
  if spec.flat:
    (buf,) = locs
    return buf
  prefix = local_prefix(locs[0], spec)
  parts = [x.reshape(prefix + (-1,)) for x in locs]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=len(prefix))


def split_rows(buf, spec: GatherSpec) -> list:
  """Inverse of :func:`concat_rows`."""
  if spec.flat:
    return [buf]
  prefix = tuple(buf.shape[:-1])
  out, off = [], 0
  for shape in local_shapes(prefix, spec):
    width = math.prod(shape[len(prefix):])
    out.append(lax.slice_in_dim(buf, off, off + width, axis=len(prefix)).reshape(shape))
    off += width
  return out


def _gather_leaves(locs, spec: GatherSpec):
  """:func:`gathers_per_leaf`: one tiled ``all_gather`` per leaf."""
  prefix = local_prefix(locs[0], spec)
  p = len(prefix)
  outs = []
  for (layer_shape, dim0, _, _), rows in zip(spec.leaves, locs):
    x = _encode(rows, spec)
    if spec.shard_axes:
      x = lax.all_gather(x, spec.axis_name(), axis=p, tiled=True)
    x = _decode(x, spec)
    if x.shape[p] != dim0:
      x = lax.slice_in_dim(x, 0, dim0, axis=p)
    outs.append(x.reshape(prefix + tuple(layer_shape)))
  # Padded leaves are sliced: the barrier keeps each one its own buffer
  # (see _gather_impl).
  return list(lax.optimization_barrier(outs))


def _gather_impl(*locs, spec: GatherSpec, secondary: bool = False):
  if gathers_per_leaf(spec):
    return _gather_leaves(locs, spec)
  buf = concat_rows(locs, spec)
  if not spec.shard_axes:
    x = buf.astype(spec.compute_dtype) if spec.compute_dtype != buf.dtype else buf
    return _unpack(jnp.expand_dims(x, x.ndim - 1), spec)
  payload = _encode(buf, spec)
  axis = payload.ndim - 1
  g = lax.all_gather(payload, spec.axis_name(), axis=axis, tiled=False)
  outs = _unpack(_decode(g, spec), spec)
  if secondary:
    # hpZ: keep rows [q * N/k, (q + 1) * N/k) of the gathered payload, q this
    # device's place in its group of k; the group's all-gather of these
    # slices is the whole unit again (fsdp_group_gather).
    m = spec.n // spec.secondary
    q = lax.axis_index(spec.axis_name()) % spec.secondary
    outs = outs + [lax.dynamic_slice_in_dim(g, q * m, m, axis=axis)]
  # Each unpacked leaf becomes its own buffer, so the gathered buffer dies
  # right after unpacking. Without the barrier XLA fuses leaf slices into late
  # backward-residual fusions (e.g. a LayerNorm scale), each reading the whole
  # gathered unit, which kept every unit alive to the end of the forward pass
  # (FULL_SHARD fp32 at 2.0x the memory floor; 1.16x with it).
  return list(lax.optimization_barrier(outs))


def _secondary_aval(prefix, spec: GatherSpec):
  dtype, length = payload_row(spec)
  return _compat.ShapedArray(tuple(prefix) + (spec.n // spec.secondary, length), dtype)


def _gather_abstract_eval(*locs, spec: GatherSpec, secondary: bool = False):
  prefix = local_prefix(locs[0], spec)
  outs = [_compat.ShapedArray(prefix + tuple(layer_shape), spec.compute_dtype)
          for layer_shape, _, _, _ in spec.leaves]
  return outs + ([_secondary_aval(prefix, spec)] if secondary else [])


def _group_gather_impl(sec, *, spec: GatherSpec):
  """hpZ's backward all-gather: the secondary slices of a group of
  ``spec.secondary`` devices -> the unit's full leaves."""
  axis = sec.ndim - 2
  g = lax.all_gather(sec, spec.axis_name(), axis=axis, tiled=True,
                     axis_index_groups=spec.groups())
  return list(lax.optimization_barrier(_unpack(_decode(g, spec), spec)))


def _group_gather_abstract_eval(sec, *, spec: GatherSpec):
  prefix = sec.shape[:-2]
  return [_compat.ShapedArray(prefix + tuple(layer_shape), spec.compute_dtype)
          for layer_shape, _, _, _ in spec.leaves]


def reduce_gradient(g, spec: GatherSpec, *, tiled: bool = False):
  """The default reduction of a unit's (prefix..., N, S) gradient buffer
  (``tiled``: the same buffer as (prefix..., N * S)).

  What a communication hook calls to reduce the way FSDP does. Example:

    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> seen = []
    >>> def my_hook(hook_state, grad, spec):  # the default reduction, written out
    ...   seen.append((spec.shard_axes, spec.reduce_dtype, grad.shape))
    ...   return fsdp_jax.custom.reduce_gradient(grad, spec), hook_state
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> config = fsdp_jax.FSDPConfig(comm_hook=my_hook)
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=config)
    >>> step = fsdp_jax.shard_train_step(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
    ...     optax.sgd(0.1), mesh=mesh, config=config)
    >>> state, metrics = step(state, {"x": jnp.ones((2, 4))})
    >>> seen  # one unit: its (N, S) gradient buffer, N = 2 devices
    [(('shard',), dtype('float32'), (2, 4))]
  """
  p = g.ndim - (1 if tiled else 2)
  g = g.astype(spec.reduce_dtype)
  if spec.pre_divide != 1.0:
    g = g / jnp.asarray(spec.pre_divide, spec.reduce_dtype)
  if spec.reduce_quant is not None and spec.shard_axes:
    r = _quantized_reduce(g, spec, p)
    if spec.post_divide != 1.0:
      r = r / jnp.float32(spec.post_divide)
    return r.astype(spec.reduce_dtype)
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


def _exchange_and_sum(x, axis_name, q, axis: int):
  """One qgZ hop: ``x`` holds along ``axis`` one piece per device of
  ``axis_name``; each piece is quantized and sent to its device (all-to-all),
  and the pieces received are dequantized and summed in float32."""
  payload = quantization.encode(x, q, stochastic=q.stochastic(gradient=True))
  recv = lax.all_to_all(payload, axis_name, axis, axis, tiled=True)
  return jnp.sum(quantization.decode(recv, q, x.shape[-1], jnp.float32), axis=axis)


def _quantized_reduce(g, spec: GatherSpec, p: int):
  """qgZ: a unit's (prefix..., N, S) (or tiled (prefix..., N * S)) gradient
  -> this device's summed (prefix..., S) shard in float32.

  One quantized all-to-all over the shard axis; with two shard axes
  (``("replicate", "shard")``: FULL_SHARD over a 2-D mesh) ZeRO++'s two hops,
  the in-node axis (the last) first, then across nodes on partial sums.
  Hybrid strategies then all-reduce across ``"replicate"`` as a quantized
  reduce-scatter (all-to-all) and all-gather: every replica dequantizes the
  same bytes, so replicas stay bitwise identical.
  """
  q = spec.reduce_quant
  sizes = dict(spec.axis_sizes)
  prefix = g.shape[:p]
  x = g.reshape(prefix + (spec.n, spec.chunk)).astype(jnp.float32)
  axes = spec.shard_axes
  if len(axes) == 1:
    r = _exchange_and_sum(x, axes[0], q, p)
  else:
    inner, outer = axes[-1], axes[:-1]
    n_in = sizes[inner]
    x = x.reshape(prefix + (spec.n // n_in, n_in, spec.chunk))
    partial = _exchange_and_sum(x, inner, q, p + 1)  # (prefix..., N / n_in, S)
    r = _exchange_and_sum(partial, outer[0] if len(outer) == 1 else outer, q, p)
  if spec.reduce_axes:
    reps = int(np.prod([sizes[a] for a in spec.reduce_axes]))
    name = spec.reduce_axes[0] if len(spec.reduce_axes) == 1 else spec.reduce_axes
    piece = -(-spec.chunk // reps)
    pad = reps * piece - spec.chunk
    x = jnp.pad(r, [(0, 0)] * p + [(0, pad)]) if pad else r
    mine = _exchange_and_sum(x.reshape(prefix + (reps, piece)), name, q, p)
    gathered = lax.all_gather(quantization.encode(mine, q, stochastic=q.stochastic(gradient=True)),
                              name, axis=p, tiled=False)
    r = quantization.decode(gathered, q, piece, jnp.float32).reshape(prefix + (reps * piece,))
    if pad:
      r = lax.slice_in_dim(r, 0, spec.chunk, axis=p)
  return r


def _gather_transpose(cts, *locs, spec: GatherSpec, secondary: bool = False):
  prefix = local_prefix(locs[0].aval, spec)
  cts = [jnp.zeros(prefix + tuple(ls), spec.compute_dtype) if _compat.is_symbolic_zero(c) else c
         for c, (ls, _, _, _) in zip(cts, spec.leaves)]
  with jax.named_scope(f"fsdp_reduce_scatter[{spec.label}]"):
    return fsdp_reduce_p.bind(*cts, spec=spec, stored_dtype=np.dtype(locs[0].aval.dtype))


def pack_gradient(cts, spec: GatherSpec, order=None):
  """A unit's full leaf gradients -> the (prefix..., N, S) buffer it reduces:
  raw for a communication hook; cast to ``reduce_dtype`` and pre-divided leaf
  by leaf otherwise (the same values as on the packed buffer)."""
  prefix = tuple(cts[0].shape[:cts[0].ndim - len(spec.leaves[0].layer_shape)])
  if spec.hook is not None:
    return pack_full(list(cts), spec, prefix, order=order)
  # Flat parameters are reduced as one (N * S) vector: reshaping the packed
  # buffer to (N, S) made XLA copy it before its last in-place update.
  return pack_full(list(cts), spec, prefix, dtype=spec.reduce_dtype, divide=spec.pre_divide,
                   order=order, tiled=spec.flat)


def reduce_packed(g, spec: GatherSpec, stored_dtype):
  """The buffer from :func:`pack_gradient` -> this device's reduced shard."""
  if spec.hook is not None:
    r, _ = call_hook(spec.hook, None, g, spec)
  else:
    r = reduce_gradient(g, dataclasses.replace(spec, pre_divide=1.0), tiled=spec.flat)
  return finish_gradient(r, spec, stored_dtype)


def _divides_after(spec: GatherSpec) -> bool:
  """Whether the pre-divide can wait for the reduced shard: it is a power of
  two (PyTorch's factor always is), so dividing the sum gives the same bits
  as summing the divided terms, in a dtype whose range no sum of gradients
  overflows (float32, bfloat16, float64). Only float16 keeps the pre-divide
  on the full gradient, where it guards the sum against overflow."""
  pre = spec.pre_divide
  return (pre != 1.0 and float(pre).is_integer() and (int(pre) & (int(pre) - 1)) == 0
          and jnp.finfo(spec.reduce_dtype).maxexp >= 128)


def _reduce_leaves(cts, spec: GatherSpec, stored_dtype):
  """:func:`reduces_per_leaf`: each leaf's gradient is cast, zero padded
  along its first dimension, reduce-scattered on its own (``psum_scatter``,
  tiled) and divided: its local rows. The same sums as the packed buffer's,
  without packing the unit's full gradient first. Over replicate axes
  (HYBRID) or data axes (NO_SHARD) the unit's rows are concatenated and
  all-reduced once before dividing."""
  dtype = np.dtype(spec.reduce_dtype)
  p = cts[0].ndim - len(spec.leaves[0].layer_shape)
  prefix = tuple(cts[0].shape[:p])
  after = _divides_after(spec)
  divides = ([spec.pre_divide] if after else []) + [spec.post_divide]
  divides = [d for d in divides if d != 1.0]

  def divide(x):
    for d in divides:
      x = x / jnp.asarray(d, dtype)
    return finish_gradient(x, spec, stored_dtype)

  parts = []
  for c, (layer_shape, dim0, chunk0, row) in zip(cts, spec.leaves):
    c = c.astype(dtype)
    if spec.pre_divide != 1.0 and not after:
      c = c / jnp.asarray(spec.pre_divide, dtype)
    c = c.reshape(prefix + (dim0,) + tuple(layer_shape[1:]))
    pad = spec.n * chunk0 - dim0
    if pad:
      c = jnp.pad(c, [(0, 0)] * p + [(0, pad)] + [(0, 0)] * (c.ndim - p - 1))
    if spec.shard_axes:
      c = lax.psum_scatter(c, spec.axis_name(), scatter_dimension=p, tiled=True)
    parts.append(c if spec.reduce_axes else divide(c))
  if not spec.reduce_axes:
    return parts
  r = lax.psum(concat_rows(parts, spec), spec.reduce_axes)
  return split_rows(divide(r), spec)


def reduce_leaves(cts, spec: GatherSpec, stored_dtype) -> list:
  """A unit's (or dtype group's) full leaf gradients -> this device's reduced
  local operands (see :func:`local_shapes`), in ``stored_dtype``: what the
  gather's transpose computes (a communication hook on the packed buffer, or
  the default reduction)."""
  if reduces_per_leaf(spec):
    return _reduce_leaves(list(cts), spec, stored_dtype)
  return split_rows(reduce_packed(pack_gradient(cts, spec), spec, stored_dtype), spec)


def _reduce_impl(*cts, spec: GatherSpec, stored_dtype):
  """The unit's full leaf gradients -> this device's reduced local operands."""
  return reduce_leaves(cts, spec, stored_dtype)


def _reduce_abstract_eval(*cts, spec: GatherSpec, stored_dtype):
  prefix = cts[0].shape[:len(cts[0].shape) - len(spec.leaves[0].layer_shape)]
  return [_compat.ShapedArray(s, stored_dtype) for s in local_shapes(prefix, spec)]


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
# differentiated program, so :mod:`fsdp_jax._src.schedule` can order reductions
# against gathers and compute.
fsdp_reduce_p = Primitive("fsdp_reduce")
fsdp_reduce_p.multiple_results = True
fsdp_reduce_p.def_abstract_eval(_reduce_abstract_eval)
_compat.register_lowering(fsdp_reduce_p, _reduce_impl, multiple_results=True)


def _no_eager(name: str):
  def impl(*args, **kwargs):
    raise RuntimeError(
        f"{name} only runs inside fsdp_jax's sharded step (a function traced by "
        "shard_train_step or fsdp_jax.custom.value_and_grad under jax.shard_map); it was "
        "called eagerly. Fix: call it from loss_fn / the custom step, not directly.")
  return impl


fsdp_all_gather_p.def_impl(_no_eager("fsdp_all_gather"))
fsdp_reduce_p.def_impl(_no_eager("fsdp_reduce"))


def spec_of(eqn) -> GatherSpec:
  """The :class:`GatherSpec` of an ``fsdp_all_gather`` / ``fsdp_reduce``
  equation (a parameter of fsdp_jax's own primitives)."""
  return eqn.params["spec"]


# hpZ's backward all-gather (see _gather_partial_eval): never differentiated,
# it only recomputes the unit's values for the backward pass.
fsdp_group_gather_p = Primitive("fsdp_group_gather")
fsdp_group_gather_p.multiple_results = True
fsdp_group_gather_p.def_abstract_eval(_group_gather_abstract_eval)
_compat.register_lowering(fsdp_group_gather_p, _group_gather_impl, multiple_results=True)
fsdp_group_gather_p.def_impl(_no_eager("fsdp_group_gather"))


def _gather_partial_eval(saveable, unks_in, inst_in, eqn):
  """How ``jax.checkpoint`` splits an ``fsdp_all_gather`` into the forward
  (known) and the recomputed backward (staged) parts.

  What the default rule does, except for a unit resharded onto groups
  (``spec.secondary``) whose gather the policy does not save: the forward
  gather also returns the device's secondary slice, saved as the residual,
  and the backward recomputes the unit from it with ``fsdp_group_gather``
  (an all-gather within the group) instead of gathering over the whole shard
  axis again. Everything downstream (other residuals, the reduction) is
  unchanged, and the values are bitwise those of the forward gather.
  """
  n = len(eqn.outvars)
  res = [v for v, inst in zip(eqn.invars, inst_in)
         if not inst and not isinstance(v, _compat.Literal)]
  if any(unks_in):
    return None, eqn, [True] * n, [True] * n, res
  policy = _compat.remat_decision(saveable, eqn)
  if policy == "save":
    return eqn, None, [False] * n, [False] * n, []
  if policy != "recompute":
    raise NotImplementedError(
        f"remat policy {saveable!r} returned {policy!r} for a unit's all-gather; "
        "fsdp_jax's gathers are saved or recomputed, not offloaded.")
  spec = spec_of(eqn)
  if not spec.secondary or is_secondary(eqn):
    return eqn, eqn, [False] * n, [True] * n, res
  prefix = local_prefix(eqn.invars[0].aval, spec)
  sec = _compat.new_var(_secondary_aval(prefix, spec))
  known = _compat.replace_eqn(eqn, outvars=[*eqn.outvars, sec], params={"secondary": True})
  staged = _compat.replace_eqn(eqn, primitive=fsdp_group_gather_p, invars=[sec],
                               params={"spec": spec}, merge_params=False)
  return known, staged, [False] * n, [True] * n, [sec]


def is_secondary(eqn) -> bool:
  """Whether an ``fsdp_all_gather`` equation also returns hpZ's secondary
  slice (its last output; set by :func:`_gather_partial_eval`)."""
  return "secondary" in eqn.params and bool(eqn.params["secondary"])


_compat.register_partial_eval_custom(fsdp_all_gather_p, _gather_partial_eval)

# Each of fsdp_jax's primitives as the JAX function it lowers to (the
# planner evaluates them with local stand-ins for the collectives inside).
IMPLEMENTATIONS = {fsdp_all_gather_p: _gather_impl, fsdp_reduce_p: _reduce_impl,
                   fsdp_group_gather_p: _group_gather_impl}


def gather(locs, spec: GatherSpec):
  """Gathers one unit (or dtype group) from its local operands ``locs`` (see
  :func:`local_shapes`) -> its full leaves."""
  with jax.named_scope(f"fsdp_all_gather[{spec.label}]"):
    return fsdp_all_gather_p.bind(*locs, spec=spec)


# Primitives the FSDP remat recomputes in the backward pass instead of saving
# their outputs: elementwise arithmetic and layout changes, which XLA fuses into
# the backward computations that read them. Without remat XLA does the same on
# its own; saving them (e.g. every intermediate of a GELU) held 2.4x the
# activations of the unsharded program.
RECOMPUTED = _compat.RECOMPUTED_PRIMITIVES  # recomputed by the step's remat


def save_all_but_gathers(prim, *_, **params) -> bool:
  """Saves every residual except the outputs of resharded gathers (steps
  with a stacked unit, and the loop body gathering one layer per iteration)
  and CPU offload's device copies."""
  return not ((prim is fsdp_all_gather_p and params["spec"].reshard)
              or prim.name == "device_put")


def _recomputed_body(jaxpr) -> bool:
  """Whether every equation of ``jaxpr`` is one :data:`RECOMPUTED` primitive
  or a call of such equations."""
  return all(e.primitive.name in RECOMPUTED
             or (e.primitive.name in _compat.CALL_PRIMITIVES
                 and all(_recomputed_body(b) for b in _compat.nested_jaxprs(e)))
             for e in jaxpr.eqns)


def remat_policy(prim, *_, **params) -> bool:
  """Saves what is costly to recompute, except the outputs of resharded
  gathers (re-gathered in the backward pass); elementwise and layout
  primitives are recomputed, and so are calls of nothing else (a
  ``custom_jvp`` activation such as ``jax.nn.softplus``, a jitted one)."""
  if prim is fsdp_all_gather_p:
    return not params["spec"].reshard
  if prim.name in RECOMPUTED:
    return False
  if prim.name in _compat.CALL_PRIMITIVES:
    bodies = _compat.params_jaxprs(params)
    return not (bodies and all(_recomputed_body(b) for b in bodies))
  return True


# --------------------------------------------------------------------------
# The communication-hook contract: how the reductions above call a hook
# (the built-in hooks are in fsdp_jax._src.hooks)


def check_hook(hook) -> None:
  """Validates a hook's signature with a clear error."""
  if not callable(hook):
    raise TypeError(f"comm_hook={hook!r} is not callable. A hook is called as "
                    "hook(state, grad, spec) -> (reduced, new_state); see fsdp_jax.hooks.")
  try:
    hash(hook)
  except TypeError as e:
    raise TypeError(f"comm_hook={hook!r} must be hashable (a function or a frozen "
                    "dataclass): it is static configuration of the compiled step.") from e
  try:
    sig = inspect.signature(hook)
    sig.bind(None, None, None)
  except TypeError as e:
    raise TypeError(
        f"comm_hook {hook!r} has signature {sig}; a hook is called as "
        "hook(state, grad, spec) and returns (reduced, new_state). Example:\n"
        "  def my_hook(state, grad, spec):\n"
        "    return fsdp_jax.custom.reduce_gradient(grad, spec), state") from e
  except ValueError:  # builtins without signatures
    pass
  if getattr(hook, "stateful", False) and not callable(getattr(hook, "init", None)):
    raise TypeError(f"comm_hook {hook!r} is stateful but has no init(shape, dtype) "
                    "method returning its initial state.")


def _hook_name(hook) -> str:
  """How messages name a hook: its qualified name, else its repr."""
  name = getattr(hook, "__qualname__", None)
  if isinstance(name, str):  # a function (instances of hook classes have none)
    module = getattr(hook, "__module__", None)
    return f"{module}.{name}" if module else name
  return repr(hook)


def _describe(x) -> str:
  if isinstance(x, (tuple, list)):
    return f"a {type(x).__name__} of {len(x)} values"
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"an array of shape {tuple(x.shape)} {jnp.dtype(x.dtype).name}"
  return f"a {type(x).__name__}"


def call_hook(hook, state, grad, spec: GatherSpec):
  """Calls ``hook(state, grad, spec)`` and checks what it returns.

  A hook returns ``(reduced, new_state)``: this device's reduced shard of
  shape ``grad.shape[:-2] + grad.shape[-1:]`` in a floating-point dtype, and
  its new state (for a stateful hook: the structure and shapes of ``state``).
  Anything else raises a ``TypeError`` naming the hook, what it returned and
  the fix, instead of a bare unpacking or shape error further on.

  Example:
    >>> import jax.numpy as jnp
    >>> from fsdp_jax._src import collectives
    >>> def forgot_the_state(state, grad, spec):
    ...   return grad[..., 0, :]
    >>> collectives.call_hook(forgot_the_state, None, jnp.ones((2, 3)), spec=None)
    Traceback (most recent call last):
    ...
    TypeError: Fix: return (reduced, state) from comm_hook ...forgot_the_state: ...
  """
  out = hook(state, grad, spec)
  name = _hook_name(hook)
  expected = tuple(grad.shape[:-2]) + tuple(grad.shape[-1:])
  example = ("  def my_hook(state, grad, spec):\n"
             "    reduced = fsdp_jax.custom.reduce_gradient(grad, spec)\n"
             "    return reduced, state")
  if not isinstance(out, tuple) or len(out) != 2:
    raise TypeError(
        f"Fix: return (reduced, state) from comm_hook {name}: it returned "
        f"{_describe(out)} for a gradient of shape {tuple(grad.shape)}, but a hook "
        f"returns a pair: this device's reduced shard (shape {expected}) and its new "
        "state (the state it was given, for a stateless hook). Example:\n" + example)
  reduced, new_state = out
  if not hasattr(reduced, "shape") or tuple(reduced.shape) != expected or \
      not jnp.issubdtype(reduced.dtype, jnp.floating):
    raise TypeError(
        f"Fix: return this device's reduced shard as the first value of comm_hook "
        f"{name}: it returned {_describe(reduced)} for a gradient of shape "
        f"{tuple(grad.shape)} (rows: the parts the {grad.shape[-2]} devices of the "
        f"shard group keep), but the reduced shard has shape {expected} in a "
        "floating-point dtype (reduce_gradient(grad, spec) computes it). Example:\n"
        + example)
  if is_stateful(hook):
    def shapes(tree):
      return jax.tree.map(lambda x: tuple(getattr(x, "shape", ())), tree)
    try:
      same = (jax.tree.structure(new_state) == jax.tree.structure(state)
              and shapes(new_state) == shapes(state))
    except Exception:  # pragma: no cover - exotic state trees
      same = False
    if not same:
      raise TypeError(
          f"Fix: return a new state shaped like the one it was given from stateful "
          f"comm_hook {name}: it got {shapes(state)} and returned "
          f"{shapes(new_state)}.")
  return reduced, new_state


def is_stateful(hook) -> bool:
  return hook is not None and bool(getattr(hook, "stateful", False))
