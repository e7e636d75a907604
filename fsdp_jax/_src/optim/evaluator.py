"""Evaluating a traced optimizer program on each device's shards
(:class:`ShardedEvaluator`): per-leaf geometry, the evaluator's values, the
rules per primitive, and conversion from and to the stored state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fsdp_jax._src import _compat
from fsdp_jax._src._compat import Literal
from fsdp_jax._src.plan import Plan
from fsdp_jax._src.optim.stored import OptLayout, ShardedOptState, storage_key


# ---------------------------------------------------------------------------
# Per-leaf geometry on one device


class Geometry:
  """Where parameter leaves live in this device's local storage arrays.

  Under tensor parallelism a split leaf's local array is this device's FSDP
  shard of its tensor slice: :meth:`gather` returns the whole logical leaf
  (gathered over the shard axes, then over the tensor axis) and
  :meth:`shard_of` cuts this device's slice, then its shard."""

  def __init__(self, plan: Plan, index=None, place=None):
    self.plan = plan
    self.place = place or (lambda x: x)
    self.axes = plan.axes.shard_axes
    self.n = plan.n if self.axes else 1
    self.tensor = plan.axes.tensor_axes[0] if plan.t > 1 else None
    self._index = index
    self._tensor_index = None
    self._masks: dict = {}
    self._gathers: dict = {}

  @property
  def index(self):
    """This device's position along the shard axes (traced)."""
    if self._index is None:
      if not self.axes:
        self._index = jnp.zeros((), jnp.int32)
      else:
        self._index = lax.axis_index(self.axes[0] if len(self.axes) == 1 else self.axes)
    return self._index

  def _axis_name(self):
    return self.axes[0] if len(self.axes) == 1 else self.axes

  def reduce_axes(self, split: bool) -> tuple:
    """The mesh axes a whole-leaf reduction combines this device's part
    over: the shard axes, and the tensor axis for a split leaf."""
    return ((self.axes if self.n > 1 else ())
            + ((self.tensor,) if split and self.tensor is not None else ()))

  def split(self, i) -> bool:
    """Whether leaf ``i`` is split over the tensor axis."""
    leaf = self.leaf(i)
    return self.tensor is not None and not leaf.ignored and leaf.tensor_dim is not None

  def _tensor_dim(self, i) -> int:
    """The dimension of leaf ``i``'s logical value split over the tensor axis."""
    return len(self.prefix(i)) + self.leaf(i).tensor_dim

  def _tensor_gather(self, i, x):
    if not self.split(i):
      return x
    return lax.all_gather(x, self.tensor, axis=self._tensor_dim(i), tiled=True)

  def leaf(self, i):
    return self.plan.leaves[i]

  def prefix(self, i) -> tuple:
    leaf = self.leaf(i)
    return () if leaf.ignored else self.plan.prefix(self.plan.units[leaf.unit])

  def flat(self) -> bool:
    return not self.plan.use_orig_params

  def offset(self, i) -> int:
    """Flat layout: the leaf's offset in its unit's per-layer flat vector."""
    leaf = self.leaf(i)
    unit = self.plan.units[leaf.unit]
    off = 0
    for j in unit.leaf_ids:
      if j == i:
        return off
      off += self.plan.leaves[j].layer_numel
    raise KeyError(i)

  def local_shape(self, i) -> tuple:
    leaf = self.leaf(i)
    if leaf.ignored:
      return self.plan.gathered_shape(leaf)
    p = self.prefix(i)
    if self.flat():
      return p + (self.plan.flat_chunk(self.plan.units[leaf.unit]),)
    return p + (self.plan.chunk0(leaf),) + leaf.rest

  def has_padding(self, i) -> bool:
    leaf = self.leaf(i)
    if leaf.ignored:
      return False
    if self.flat():
      unit = self.plan.units[leaf.unit]
      return True if len(unit.leaf_ids) > 1 else self.n * self.plan.flat_chunk(unit) != leaf.layer_numel
    return self.n * self.plan.chunk0(leaf) != leaf.dim0

  def valid(self, i):
    """Bool mask, broadcastable to the local shape: where the local array
    holds leaf ``i``'s values (not padding, not another leaf)."""
    if i in self._masks:
      return self._masks[i]
    leaf = self.leaf(i)
    p = len(self.prefix(i))
    if self.flat():
      c = self.plan.flat_chunk(self.plan.units[leaf.unit])
      pos = self.index * c + lax.iota(jnp.int32, c)
      o = self.offset(i)
      m = (pos >= o) & (pos < o + leaf.layer_numel)
      m = m.reshape((1,) * p + (c,))
    else:
      chunk0 = self.plan.chunk0(leaf)
      rows = self.index * chunk0 + lax.iota(jnp.int32, chunk0)
      m = (rows < leaf.dim0).reshape((1,) * p + (chunk0,) + (1,) * len(leaf.rest))
    m = self.place(jnp.broadcast_to(m, self.local_shape(i)))
    self._masks[i] = m
    return m

  def union_valid(self, leaves):
    """Bool mask of the positions of ``leaves`` (all in one local array), or
    None when that is every position."""
    leaves = list(leaves)
    if not self.flat():
      # Leaves sharing one local array have one shape: one mask.
      return self.valid(leaves[0]) if self.has_padding(leaves[0]) else None
    unit_index = self.leaf(leaves[0]).unit
    unit = self.plan.units[unit_index]
    if len(leaves) == 1:
      return self.valid(leaves[0]) if self.has_padding(leaves[0]) else None
    pos_of = {j: p for p, j in enumerate(unit.leaf_ids)}
    positions = sorted({pos_of[i] for i in leaves})
    padded = self.n * self.plan.flat_chunk(unit) != self.plan.flat_numel(unit)
    if len(positions) == len(unit.leaf_ids) and not padded:
      return None
    m = _in_positions(self.segment_ids(unit_index), positions)
    p = len(self.prefix(leaves[0]))
    return self.place(jnp.broadcast_to(m.reshape((1,) * p + m.shape), self.local_shape(leaves[0])))

  def segment_ids(self, unit_index: int):
    """Flat layout: the position (within the unit) of the leaf each local
    element belongs to; the padding gets ``len(unit.leaf_ids)``."""
    key = ("seg", unit_index)
    if key not in self._masks:
      unit = self.plan.units[unit_index]
      c = self.plan.flat_chunk(unit)
      pos = self.index * c + lax.iota(jnp.int32, c)
      ends = np.cumsum([self.plan.leaves[j].layer_numel for j in unit.leaf_ids])
      seg = jnp.zeros((c,), jnp.int32)
      for e in ends:
        seg = seg + (pos >= int(e)).astype(jnp.int32)
      self._masks[key] = seg
    return self._masks[key]

  def gather(self, i, local):
    """Leaf ``i``'s local array -> its full logical value (every device)."""
    leaf = self.leaf(i)
    if leaf.ignored:
      return local
    p = len(self.prefix(i))
    if self.flat():
      key = id(local)
      if key not in self._gathers:
        full = local
        if self.axes:
          full = lax.all_gather(local, self._axis_name(), axis=p, tiled=True)
        self._gathers[key] = (local, full)
      full = self._gathers[key][1]
      o = self.offset(i)
      x = lax.slice_in_dim(full, o, o + leaf.layer_numel, axis=p)
      return self._tensor_gather(i, x.reshape(self.plan.gathered_shape(leaf)))
    full = local
    if self.axes:
      full = lax.all_gather(local, self._axis_name(), axis=p, tiled=True)
    if full.shape[p] != leaf.dim0:
      full = lax.slice_in_dim(full, 0, leaf.dim0, axis=p)
    return self._tensor_gather(i, full.reshape(self.plan.gathered_shape(leaf)))

  def shard_of(self, i, full):
    """Leaf ``i``'s full logical value -> this device's local array."""
    leaf = self.leaf(i)
    if leaf.ignored:
      return jnp.reshape(full, self.plan.gathered_shape(leaf))
    prefix = self.prefix(i)
    p = len(prefix)
    if self.split(i):
      if self._tensor_index is None:
        self._tensor_index = lax.axis_index(self.tensor)
      size = leaf.layer_shape[leaf.tensor_dim]
      full = lax.dynamic_slice_in_dim(jnp.reshape(full, leaf.shape),
                                      self._tensor_index * size, size, self._tensor_dim(i))
    if self.flat():
      c = self.plan.flat_chunk(self.plan.units[leaf.unit])
      x = jnp.reshape(full, prefix + (leaf.layer_numel,))
      x = jnp.pad(x, [(0, 0)] * p + [(c, c)])
      start = self.index * c - self.offset(i) + c
      return lax.dynamic_slice_in_dim(x, start, c, axis=p)
    chunk0 = self.plan.chunk0(leaf)
    x = jnp.reshape(full, prefix + (leaf.dim0,) + leaf.rest)
    pad = self.n * chunk0 - leaf.dim0
    if pad:
      x = jnp.pad(x, [(0, 0)] * p + [(0, pad)] + [(0, 0)] * len(leaf.rest))
    if self.n == 1:
      return x
    return lax.dynamic_slice_in_dim(x, self.index * chunk0, chunk0, axis=p)


# ---------------------------------------------------------------------------
# Values of the evaluator


@dataclasses.dataclass
class Rep:
  """A value with its logical shape. ``own``: it may differ between devices
  (derived from an ignored parameter's per-device copy); otherwise every
  device holds the same value."""

  value: Any
  own: bool = False


@dataclasses.dataclass
class Shard:
  """Parameter ``leaf``'s local array (its storage layout on this device)."""

  leaf: int
  value: Any


@dataclasses.dataclass
class Splat:
  """A scalar broadcast to ``shape`` (kept as the scalar)."""

  value: Any
  shape: tuple
  own: bool = False


@dataclasses.dataclass
class Partial:
  """A reduction over sharded values, not yet combined across devices: the
  full result is the ``op`` (sum, max, min, and, or) over the shard axes of
  this device's part. The part is kept lazy as ``terms``, ``{key: (local
  array, {leaf id: count})}``: the reduction of each array over the
  positions of those leaves (padding excluded), so that reductions of one
  flat buffer's leaves that are summed anyway (a global norm) read the
  buffer once."""

  op: str
  terms: dict
  dtype: Any


ELEMENTWISE = _compat.ELEMENTWISE_PRIMITIVES
_PASSTHROUGH = _compat.PASSTHROUGH_PRIMITIVES
_REDUCTIONS = _compat.REDUCTION_PRIMITIVES
def _identity(op: str, dtype):
  dtype = jnp.dtype(dtype)
  if op == "sum":
    return jnp.zeros((), dtype)
  if op == "and":
    return jnp.ones((), dtype)
  if op == "or":
    return jnp.zeros((), dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.asarray(-jnp.inf if op == "max" else jnp.inf, dtype)
  info = jnp.iinfo(dtype)
  return jnp.asarray(info.min if op == "max" else info.max, dtype)


def _source(eqn) -> str:
  """Where the equation comes from (``file:line (function)``), for reports."""
  return _compat.source_summary(eqn)


@dataclasses.dataclass
class UpdateReport:
  """What evaluating the optimizer on shards needed (filled while tracing)."""

  psums: int = 0
  gathers: list = dataclasses.field(default_factory=list)  # (leaf name, primitive, where)

  @property
  def elementwise(self) -> bool:
    return not self.psums and not self.gathers

  def summary(self) -> str:
    if self.elementwise:
      return "elementwise on the local shards, no communication"
    parts = []
    if self.psums:
      parts.append(f"{self.psums} scalar all-reduce{'s' if self.psums > 1 else ''} for "
                   "whole-parameter reductions")
    if self.gathers:
      prims = sorted({p for _, p, _ in self.gathers})
      leaves = sorted({n for n, _, _ in self.gathers})
      parts.append(f"gathers {len(leaves)} parameter-shaped value{'s' if len(leaves) > 1 else ''} "
                   f"for {', '.join(prims)} ({', '.join(leaves[:4])}"
                   f"{', ...' if len(leaves) > 4 else ''})")
    return "; ".join(parts)


class ShardedEvaluator:
  """Evaluates a jaxpr traced on logical values with each parameter-shaped
  value kept as this device's shard where that is exact (see the module
  docstring)."""

  def __init__(self, plan: Plan, report: Optional[UpdateReport] = None, index=None,
               host: bool = False):
    self.plan = plan
    # ``host``: the evaluation runs under compute_on("device_host") on
    # host-resident shards; every array it creates is put there as well (a
    # computation may not mix memory spaces).
    self.place = _to_host_space if host else (lambda x: x)
    self.geo = Geometry(plan, index, place=self.place)
    self.report = report if report is not None else UpdateReport()
    self.memo: dict = {}
    self.keep: list = []  # keeps memoised operands alive (their ids are keys)

  # -- conversions ---------------------------------------------------------
  def force(self, v):
    """A Partial -> its full value (one collective over the shard axes; for
    the leaves split over the tensor axis, over it as well: a sum of split
    and replicated leaves adds two all-reduces, a max or min takes one over
    all those axes, the replicated parts being equal along the tensor axis)."""
    if not isinstance(v, Partial):
      return v
    parts = [(x, self.geo.reduce_axes(split)) for split in (False, True)
             for x in [self._partial_local(v, split)] if x is not None]
    if v.op == "sum":
      total = None
      for x, axes in parts:
        if axes:
          self.report.psums += 1
          x = lax.psum(x, axes)
        total = x if total is None else total + x
      return Rep(total)
    combine = {"max": jnp.maximum, "min": jnp.minimum,
               "and": jnp.logical_and, "or": jnp.logical_or}[v.op]
    x = parts[0][0] if len(parts) == 1 else combine(parts[0][0], parts[1][0])
    axes = tuple(dict.fromkeys(a for _, ax in parts for a in ax))
    if not axes:
      return Rep(x)
    self.report.psums += 1
    if v.op in ("max", "min"):
      return Rep((lax.pmax if v.op == "max" else lax.pmin)(x, axes))
    as_int = x.astype(jnp.int32)
    r = lax.pmin(as_int, axes) if v.op == "and" else lax.pmax(as_int, axes)
    return Rep(r.astype(x.dtype))

  def _partial_local(self, v: Partial, split: bool):
    """This device's part of a Partial over the terms of leaves split over
    the tensor axis (``split``) or not, reducing each term's array once over
    the union of its leaves' positions; None without such terms."""
    fn = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "and": jnp.all, "or": jnp.any}[v.op]
    combine = {"sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum,
               "and": jnp.logical_and, "or": jnp.logical_or}[v.op]
    total = None
    for arr, counts in v.terms.values():
      if self.geo.split(next(iter(counts))) != split:
        continue  # the leaves of one array are all split or all not
      idempotent = v.op != "sum"
      if idempotent or all(c == 1 for c in counts.values()):
        groups = [sorted(counts)]
      else:
        groups = [[i] for i, c in counts.items() for _ in range(c)]
      for group in groups:
        mask = self.geo.union_valid(group)
        x = arr if mask is None else self.select(mask, arr, _identity(v.op, arr.dtype))
        r = fn(x).astype(v.dtype)
        total = r if total is None else combine(total, r)
    return total

  def to_rep(self, v, eqn=None):
    v = self.force(v)
    if isinstance(v, Rep):
      return v
    if isinstance(v, Splat):
      return Rep(jnp.broadcast_to(v.value, v.shape), v.own)
    leaf = self.plan.leaves[v.leaf]
    self.report.gathers.append((leaf.name, eqn.primitive.name if eqn is not None else "store",
                                _source(eqn) if eqn is not None else ""))
    return Rep(self.geo.gather(v.leaf, v.value), leaf.ignored)

  def to_local(self, v, i):
    """A value with leaf ``i``'s logical shape (or one that broadcasts to it
    along size-1 dimensions, as elementwise primitives allow) -> what leaf
    ``i``'s local array combines with."""
    v = self.force(v)
    if isinstance(v, Shard):
      if v.leaf == i or self._compatible(v.leaf, i):
        return v.value
      v = self.to_rep(v)
    if isinstance(v, Splat):
      return self._broadcast(v.value, self.geo.local_shape(i))
    leaf = self.plan.leaves[i]
    x = v.value
    if tuple(np.shape(x)) != leaf.shape:
      if leaf.ignored:
        return x
      p = len(self.geo.prefix(i))
      if not self.geo.flat() and not self.geo.split(i) and np.shape(x)[p] == 1:
        return x  # constant along the sharded dimension: the primitive broadcasts it
      x = jnp.broadcast_to(x, leaf.shape)
    return self.geo.shard_of(i, x)

  def _broadcast(self, scalar, shape):
    key = ("bcast", id(scalar), shape)
    if key not in self.memo:
      self.keep.append(scalar)
      self.memo[key] = self.place(jnp.broadcast_to(scalar, shape))
    return self.memo[key]

  def select(self, mask, x, fill):
    """``where(mask, x, fill)`` for a bool ``mask`` of ``x``'s shape and a
    scalar ``fill``."""
    return lax.select_n(mask, self._broadcast(jnp.asarray(fill, x.dtype), x.shape), x)

  def _compatible(self, a, b) -> bool:
    """Two leaves whose local arrays have the same layout (original layout,
    same logical shape, split alike over the tensor axis)."""
    la, lb = self.plan.leaves[a], self.plan.leaves[b]
    if self.geo.flat() or la.ignored != lb.ignored:
      return False
    return (la.shape == lb.shape and self.geo.prefix(a) == self.geo.prefix(b)
            and self.geo.split(a) == self.geo.split(b) and la.tensor_dim == lb.tensor_dim)

  # -- evaluation ----------------------------------------------------------
  def run(self, jaxpr, consts, args):
    env: dict = {}

    def read(v):
      if isinstance(v, Literal):
        return Rep(v.val)
      return env[v]

    for v, x in zip(jaxpr.constvars, consts):
      env[v] = x if isinstance(x, (Rep, Shard, Splat, Partial)) else Rep(x)
    for v, x in zip(jaxpr.invars, args):
      env[v] = x
    for eqn in jaxpr.eqns:
      outs = self.apply(eqn, [read(v) for v in eqn.invars])
      for v, o in zip(eqn.outvars, outs):
        env[v] = o
    return [read(v) for v in jaxpr.outvars]

  def _bind_rep(self, eqn, vals):
    own = any(getattr(v, "own", False) for v in vals)
    outs = _compat.bind_eqn(eqn, [v.value for v in vals])
    return [Rep(o, own) for o in outs]

  def apply(self, eqn, invals):
    name = eqn.primitive.name
    if all(isinstance(v, Rep) for v in invals):
      return self._bind_rep(eqn, invals)
    call = _compat.inlinable_body(eqn)
    if call is not None:
      jaxpr, consts = call
      return self.run(jaxpr, [Rep(c) for c in consts], invals[len(invals) - len(jaxpr.invars):])
    if name in ("add", "sub") and any(isinstance(v, Partial) for v in invals):
      out = self._linear_partial(eqn, invals)
      if out is not None:
        return [out]
    if (name in ("max", "min", "and", "or") and len(invals) == 2
        and all(isinstance(v, Partial) and v.op == name and v.dtype == invals[0].dtype
                for v in invals)):
      return [_merge(*invals)]
    invals = [self.force(v) for v in invals]
    if all(isinstance(v, Rep) for v in invals):
      return self._bind_rep(eqn, invals)
    if name in ELEMENTWISE:
      return [self._elementwise(eqn, invals)]
    if name == "broadcast_in_dim":
      (x,) = invals[:1]
      out_shape = tuple(eqn.outvars[0].aval.shape)
      if isinstance(x, Splat):
        return [Splat(x.value, out_shape, x.own)]
      if isinstance(x, Shard) and tuple(eqn.invars[0].aval.shape) == out_shape:
        return [x]
    if name in _PASSTHROUGH:
      return list(invals)
    if name in ("reshape", "squeeze", "expand_dims"):
      x = invals[0]
      out_shape = tuple(eqn.outvars[0].aval.shape)
      if isinstance(x, Splat):
        return [Splat(x.value, out_shape, x.own)]
      if isinstance(x, Shard) and tuple(eqn.invars[0].aval.shape) == out_shape:
        return [x]
    if name in _REDUCTIONS:
      x = invals[0]
      axes = _compat.reduction_axes(eqn)
      ndim = len(eqn.invars[0].aval.shape)
      if sorted(axes) == list(range(ndim)):
        if isinstance(x, Splat):
          return [self._reduce_splat(eqn, x)]
        if isinstance(x, Shard):
          return [self._reduce_shard(_REDUCTIONS[name], x, eqn)]
    if name == "cond":
      return self._cond(eqn, invals)
    # Anything else reads whole parameters: gather them.
    return self._bind_rep(eqn, [self.to_rep(v, eqn) for v in invals])

  def _linear_partial(self, eqn, invals):
    a, b = invals
    zero = lambda v: isinstance(v, Rep) and not v.own and np.ndim(v.value) == 0 and _is_zero(v.value)
    if (eqn.primitive.name == "add" and isinstance(a, Partial) and isinstance(b, Partial)
        and a.op == b.op == "sum" and a.dtype == b.dtype):
      return _merge(a, b)
    if isinstance(a, Partial) and a.op == "sum" and zero(b):
      return a
    if eqn.primitive.name == "add" and isinstance(b, Partial) and b.op == "sum" and zero(a):
      return b
    return None

  def _elementwise(self, eqn, invals):
    shards = [v for v in invals if isinstance(v, Shard)]
    out_aval = eqn.outvars[0].aval
    if not shards:
      # Splats and scalars only: compute on the scalars.
      vals = []
      for v in invals:
        vals.append(v.value if isinstance(v, (Splat, Rep)) else v)
      own = any(getattr(v, "own", False) for v in invals)
      if all(isinstance(v, Splat) or np.ndim(v.value) == 0 for v in invals):
        (out,) = _compat.bind_eqn(eqn, [jnp.asarray(v) for v in vals])
        return Splat(out, tuple(out_aval.shape), own)
      return self._bind_rep(eqn, [self.to_rep(v) for v in invals])[0]
    i = shards[0].leaf
    if any(s.leaf != i and not self._compatible(s.leaf, i) for s in shards):
      return self._bind_rep(eqn, [self.to_rep(v, eqn) for v in invals])[0]
    shape = self.geo.local_shape(i)
    args, key = [], [eqn.primitive, _params_key(eqn.params)]
    for v in invals:
      if isinstance(v, Shard):
        args.append(v.value)
        key.append(("s", id(v.value)))
      elif isinstance(v, Splat) or np.ndim(v.value) == 0:
        x = v.value
        # Binary primitives take scalar operands as they are; select_n's
        # cases need the full shape.
        needs_full = eqn.primitive.name == "select_n" and len(args) > 0
        args.append(self._broadcast(jnp.asarray(x), shape) if needs_full else x)
        key.append(("c", id(x)) if not isinstance(x, (int, float, bool, np.generic, np.ndarray))
                   else ("l", repr(x), str(np.asarray(x).dtype)))
      else:
        loc = self.to_local(v, i)
        args.append(loc)
        key.append(("s", id(loc)))
    key = tuple(key)
    if self.geo.flat() and key in self.memo:
      return Shard(i, self.memo[key])
    (out,) = _compat.bind_eqn(eqn, args)
    if self.geo.flat():
      self.keep.extend(args)
      self.memo[key] = out
    return Shard(i, out)

  def _reduce_splat(self, eqn, x: Splat):
    op = _REDUCTIONS[eqn.primitive.name]
    size = int(np.prod(x.shape, dtype=np.int64))
    out_dtype = eqn.outvars[0].aval.dtype
    if op == "sum":
      # What the single-device program computes: a sum of `size` copies.
      return Rep(jnp.sum(jnp.broadcast_to(x.value, (size,)).astype(out_dtype)), x.own)
    if size == 0:
      return Rep(_identity(op, out_dtype), x.own)
    return Rep(jnp.asarray(x.value).astype(out_dtype), x.own)

  def _reduce_shard(self, op, x: Shard, eqn):
    leaf = self.plan.leaves[x.leaf]
    dtype = jnp.dtype(eqn.outvars[0].aval.dtype)
    if leaf.ignored:
      fn = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "and": jnp.all, "or": jnp.any}[op]
      return Rep(fn(x.value).astype(dtype), True)
    key = (id(x.value), leaf.unit)
    self.keep.append(x.value)
    return Partial(op, {key: (x.value, {x.leaf: 1})}, dtype)

  def _cond(self, eqn, invals):
    index = self.to_rep(invals[0])
    outs = []
    for branch in _compat.cond_branches(eqn):
      body, consts = _compat.split_closed(branch)
      outs.append(self.run(body, [Rep(c) for c in consts], invals[1:]))
    result = []
    for k, var in enumerate(eqn.outvars):
      cases = [self.force(o[k]) for o in outs]
      shards = [c for c in cases if isinstance(c, Shard)]
      own = index.own or any(getattr(c, "own", False) for c in cases)
      if shards:
        i = shards[0].leaf
        vals = [self.to_local(c, i) for c in cases]
        result.append(Shard(i, lax.select_n(index.value, *vals) if len(vals) > 1 else vals[0]))
      elif all(isinstance(c, Splat) for c in cases):
        vals = [c.value for c in cases]
        result.append(Splat(lax.select_n(index.value, *vals), tuple(var.aval.shape), own))
      else:
        vals = [self.to_rep(c).value for c in cases]
        result.append(Rep(lax.select_n(index.value, *vals) if len(vals) > 1 else vals[0], own))
    return result


def _merge(a: Partial, b: Partial) -> Partial:
  terms = {k: (arr, dict(c)) for k, (arr, c) in a.terms.items()}
  for k, (arr, counts) in b.terms.items():
    if k not in terms:
      terms[k] = (arr, dict(counts))
    else:
      for i, c in counts.items():
        terms[k][1][i] = terms[k][1].get(i, 0) + c
  return Partial(a.op, terms, a.dtype)


def _to_host_space(x):
  space = getattr(jax.typeof(x), "memory_space", None)
  if space == jax.memory.Space.Host:
    return x
  return jax.device_put(x, jax.memory.Space.Host)


def _is_zero(x) -> bool:
  try:
    return bool(np.all(np.asarray(x) == 0))
  except Exception:  # pylint: disable=broad-except  # a tracer
    return False


def _params_key(params) -> tuple:
  out = []
  for k in sorted(params):
    v = params[k]
    try:
      hash(v)
      out.append((k, v))
    except TypeError:
      out.append((k, id(v)))
  return tuple(out)


# ---------------------------------------------------------------------------
# Inputs and outputs of the evaluator: the stored state <-> evaluator values


def param_values(plan: Plan, stored, geo: Geometry) -> dict:
  """Local stored params (or grads) of the trainable leaves -> values."""
  out = {}
  if plan.use_orig_params:
    leaves = jax.tree_util.tree_leaves(stored)
    it = iter(leaves)
    # ``stored`` holds the trainable leaves in order (None at frozen ones).
    for l in plan.leaves:
      if l.frozen:
        continue
      x = next(it)
      out[l.index] = Rep(x[0], True) if l.ignored else Shard(l.index, x)
    return out
  for l in plan.leaves:
    if l.frozen:
      continue
    if l.ignored:
      out[l.index] = Rep(stored[plan.ignored_key(l)][0], True)
    else:
      out[l.index] = Shard(l.index, stored[plan.units[l.unit].flat_key])
  return out


def state_values(plan: Plan, lay: OptLayout, opt_state: ShardedOptState) -> list:
  vals = []
  for e in lay.entries:
    if e.kind != "slot":
      vals.append(Rep(opt_state.leaves[e.path]))
      continue
    tree = opt_state.slots[e.slot]
    leaf = plan.leaves[e.param]
    if plan.use_orig_params:
      x = plan.treedef.flatten_up_to(tree)[e.param]
    else:
      x = tree[storage_key(plan, e.param)]
    vals.append(Rep(x[0], True) if leaf.ignored else Shard(e.param, x))
  return vals


class Assembler:
  """Evaluator values of one slot (or the params) -> stored local arrays."""

  def __init__(self, ev: ShardedEvaluator):
    self.ev = ev
    self.plan = ev.plan

  def local(self, v, i, dtype):
    leaf = self.plan.leaves[i]
    if leaf.ignored:
      x = self.ev.to_rep(v).value
      return jnp.asarray(x).astype(dtype).reshape(self.plan.gathered_shape(leaf))[None]
    return self.ev.to_local(v, i).astype(dtype)

  def store(self, values: dict, dtypes: dict) -> dict:
    """``{leaf id: value}`` -> ``{storage key: local array}`` with padding and
    absent leaves zeroed."""
    plan, geo = self.plan, self.ev.geo
    out = {}
    if plan.use_orig_params:
      for i, v in values.items():
        x = self.local(v, i, dtypes[i])
        if geo.has_padding(i):
          x = self.ev.select(geo.valid(i), x, 0)
        out[i] = x
      return out
    by_unit: dict = {}
    for i, v in values.items():
      leaf = plan.leaves[i]
      if leaf.ignored:
        out[plan.ignored_key(leaf)] = self.local(v, i, dtypes[i])
      else:
        by_unit.setdefault(leaf.unit, {})[i] = v
    for u, vals in by_unit.items():
      unit = plan.units[u]
      dtype = dtypes[next(iter(vals))]
      arrays = {i: self.local(v, i, dtype) for i, v in vals.items()}
      groups: dict = {}
      for i, x in arrays.items():
        groups.setdefault(id(x), (x, []))[1].append(i)
      # Each group of leaves sharing one array is written at their positions;
      # padding and leaves without a value stay zero.
      buf = None
      for x, ids in groups.values():
        m = geo.union_valid(ids)
        if m is None:
          buf = x
          continue
        if buf is None:
          buf = self.ev._broadcast(jnp.zeros((), dtype), x.shape)  # pylint: disable=protected-access
        buf = lax.select_n(m, buf, x)
      out[unit.flat_key] = buf
    return out


def _in_positions(seg, positions):
  """``seg`` in ``positions`` (sorted ints), as few compares as runs."""
  runs = []
  for p in positions:
    if runs and runs[-1][1] == p - 1:
      runs[-1][1] = p
    else:
      runs.append([p, p])
  m = None
  for a, b in runs:
    r = (seg >= a) & (seg <= b) if a != b else seg == a
    m = r if m is None else m | r
  return m


