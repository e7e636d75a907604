"""Tensor parallelism inside the step: ``loss_fn`` re-evaluated on each
device's slices of the split leaves, with Megatron's collectives over the
tensor axis.

``loss_fn`` is traced on the user's tree (full shapes) and its jaxpr
evaluated again with every split leaf bound to this device's slice. Each
value is one of:

* replicated: the same full array on every device of the tensor group (every
  value the split leaves do not reach);
* :class:`Split`: this device's ``1/T`` slice along one dimension;
* :class:`Partial`: this device's addend of a sum over the tensor axis (a
  matmul that contracted a split dimension).

A ``dot_general`` with a split operand computes on the slices: a kernel split
along its output axis gives a split output (column parallel), a split
contracted dimension gives partial sums (row parallel), a split batch
dimension (attention heads) a split output. Elementwise operations, casts,
broadcasts, reshapes that keep the split dimension whole, transposes and
reductions follow the split; a replicated operand meeting a split one is cut
to this device's slice. A partial value is summed over the tensor axis
(``psum``, Megatron's ``g``) where something other than a linear operation
reads it (reduce-scattered along the sequence under sequence parallelism:
:mod:`fsdp_jax._src.tensor_sequence`), and a split value is all-gathered where an operation cannot run on
slices (a softmax over a split vocabulary, a ``while`` loop). The loss's
outputs are replicated.

Gradients follow from the same functions: each collective
(:mod:`fsdp_jax._src.tensor_collectives`) is a ``jax.custom_vjp`` with
Megatron's backward (``psum`` <-> identity,
all-gather <-> slice, and a replicated value read by split computations gets
its cotangent summed over the tensor axis, Megatron's ``f``), so every
replicated value's cotangent is the same on all devices of a group and each
split leaf's gradient is its slice's.

What the evaluation did (collectives by kind, bytes, where it gathered) is
recorded in a :class:`Report` that ``print(state.plan)`` shows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fsdp_jax._src import _compat
from fsdp_jax._src import attention
from fsdp_jax._src import cross_entropy
from fsdp_jax._src import loss as loss_lib
from fsdp_jax._src import other_axes
from fsdp_jax._src import tensor_collectives as collectives


@dataclasses.dataclass(eq=False)
class Report:
  """Tensor-axis collectives of the traced loss (forward pass), by kind:
  ``{kind: [count, bytes per device]}``, and why values were gathered."""

  counts: dict = dataclasses.field(default_factory=dict)
  gathered: dict = dataclasses.field(default_factory=dict)
  traced: bool = False

  def add(self, kind: str, x) -> None:
    c = self.counts.setdefault(kind, [0, 0])
    c[0] += 1
    c[1] += int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize

  def gather(self, why: str) -> None:
    self.gathered[why] = self.gathered.get(why, 0) + 1

  def reset(self) -> None:
    self.counts.clear()
    self.gathered.clear()


class Split:
  """This device's slice of a value split along ``dim`` over the tensor axis."""

  __slots__ = ("x", "dim")

  def __init__(self, x, dim: int):
    self.x, self.dim = x, dim


class Partial:
  """This device's addend of a value summed over the tensor axis. ``x`` may
  be wider than the value's ``dtype``: a 16-bit matmul's partial sums are
  kept in float32 and rounded once, after the all-reduce."""

  __slots__ = ("x", "dtype")

  def __init__(self, x, dtype=None):
    self.x = x
    self.dtype = jnp.dtype(x.dtype if dtype is None else dtype)

  @property
  def wide(self) -> bool:
    return self.dtype != self.x.dtype


def _kind(v):
  return "split" if isinstance(v, Split) else "partial" if isinstance(v, Partial) else "full"


# --------------------------------------------------------------------------
# The evaluator


class _Ctx:
  def __init__(self, axis: str, size: int, report: Report):
    self.axis, self.t, self.report = axis, size, report
    # One collective per value (and dimension): the q, k and v projections
    # of one input share its backward all-reduce, as in Megatron. Keyed by
    # id, holding the value so the id stays its own.
    self._memo: dict = {}
    # Replicated broadcasts (a mask's fill value, a bias): cut to a slice by
    # broadcasting their operand's slice, not by slicing the broadcast.
    self._broadcasts: dict = {}

  def note_broadcast(self, out, operand, dims) -> None:
    self._broadcasts[id(out)] = (out, operand, dims)

  def _once(self, key, v, make):
    hit = self._memo.get(key)
    if hit is not None and hit[0] is v:
      return hit[1]
    out = make()
    self._memo[key] = (v, out)
    return out

  # values -> replicated / partial / split forms
  def full(self, v, why: str, var=None):
    """The replicated value of ``v`` (of jaxpr variable ``var``)."""
    if isinstance(v, Split) and not _differentiable(v.x):
      return lax.all_gather(v.x, self.axis, axis=v.dim, tiled=True)
    if isinstance(v, Partial):
      def reduce():
        self.report.add("forward all-reduce", v.x)
        return collectives.psum(v.x, self.axis).astype(v.dtype)
      return self._once(("full", id(v)), v, reduce)
    if isinstance(v, Split):
      def gather():
        self.report.gather(why)
        out = collectives.gather(v.x, self.axis, v.dim)
        self.report.add("forward all-gather", out)
        return out
      return self._once(("full", id(v)), v, gather)
    return v

  def split(self, v, dim: int):
    """``v`` (replicated or split along ``dim``) as this device's slice."""
    if isinstance(v, Split):
      assert v.dim == dim
      return v.x
    if np.ndim(v) == 0 or np.shape(v)[dim] == 1:
      # Broadcast by the primitive: its cotangent adds up over the slices.
      return self.enter(v)
    src = self._broadcasts.get(id(v))
    if src is not None and src[0] is v:
      _, operand, dims = src
      shape = list(np.shape(v))
      shape[dim] //= self.t
      if dim in dims and np.shape(operand)[dims.index(dim)] != 1:
        operand = self.split(operand, dims.index(dim))
      else:
        operand = self.enter(operand)
      return lax.broadcast_in_dim(operand, tuple(shape), dims)
    if not _differentiable(v):
      return collectives.own_slice(v, self.axis, dim, np.shape(v)[dim] // self.t)

    def make():
      self.report.add("backward all-gather", v)
      return collectives.cut(v, self.axis, dim, np.shape(v)[dim] // self.t)
    return self._once(("cut", id(v), dim), v, make)

  # Sequence parallelism (tensor_sequence.SequenceCtx) overrides these.
  def is_seq(self, var, v) -> bool:
    return False

  def reduce(self, v, var, why: str, operands=()):
    return self.full(v, why)

  def scan(self, eqn, invals) -> list:
    return _scan(eqn, invals, self)

  def dot(self, a, b, dn, opts: dict):
    """A column-parallel matmul of payloads ``a`` and ``b``."""
    return lax.dot_general(a, b, dn, **opts)

  def fallback(self, eqn, invals, why: str) -> list:
    return _compat.bind_eqn(eqn, [self.full(x, why) for x in invals])

  def enter(self, v):
    """A replicated operand of a computation whose result is split or partial."""
    if (isinstance(v, (Split, Partial, int, float, bool, np.ndarray, np.generic))
        or not _differentiable(v)):
      return v
    def make():
      # An all-gather over another axis (keys and values over "context"):
      # of the entered chunk, whose cotangent is all-reduced, not the whole.
      src = self._memo.get(("gathered", id(v)))
      if src is not None and src[0] is v and len(src[1][0].invars) == 1:
        return _compat.bind_eqn(src[1][0], [self.enter(src[1][1])])[0]
      self.report.add("backward all-reduce", v)
      return collectives.enter(v, self.axis)
    return self._once(("enter", id(v)), v, make)


def _differentiable(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def evaluate(jaxpr, consts, args, ctx: _Ctx) -> list:
  """Evaluates ``jaxpr`` with :class:`Split` / :class:`Partial` values
  among ``args``; returns the outputs in their forms."""
  env: dict = {}
  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    invals = [v.val if isinstance(v, _compat.Literal) else env[v] for v in eqn.invars]
    if not any(isinstance(x, (Split, Partial)) for x in invals):
      outs = _compat.bind_eqn(eqn, invals)
      if eqn.primitive.name == "broadcast_in_dim":
        ctx.note_broadcast(outs[0], invals[0], _compat.broadcast_dimensions(eqn))
      elif eqn.primitive.name == "all_gather" and ctx.axis not in other_axes.named_axes(eqn):
        ctx._memo[("gathered", id(outs[0]))] = (outs[0], (eqn, invals[0]))
    else:
      outs = _rule(eqn, invals, ctx)
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, _compat.DropVar):
        env[v] = x
  return [v.val if isinstance(v, _compat.Literal) else env[v] for v in jaxpr.outvars]


def _out_shape(eqn, k=0) -> tuple:
  return tuple(eqn.outvars[k].aval.shape)


def _in_shape(eqn, k=0) -> tuple:
  return tuple(np.shape(eqn.invars[k].aval)) if hasattr(eqn.invars[k], "aval") else ()


def _rule(eqn, invals, ctx: _Ctx) -> list:
  name = eqn.primitive.name
  if name == "dot_general":
    return [_dot(eqn, invals, ctx)]
  if name in _compat.ELEMENTWISE_PRIMITIVES:
    return [_elementwise(eqn, invals, ctx)]
  if name in _compat.PASSTHROUGH_PRIMITIVES and len(invals) == 1:
    return [invals[0]]
  if len(invals) == 1 and isinstance(invals[0], Split):
    out = _layout(eqn, invals[0], ctx)
    if out is not None:
      return [out]
  if (name in _LINEAR_LAYOUT and all(isinstance(x, Partial) for x in invals)
      and len({(x.x.dtype, x.dtype) for x in invals}) == 1):
    return [Partial(_compat.bind_eqn(eqn, [_payload(x) for x in invals])[0], invals[0].dtype)]
  if name == "split":
    out = _split(eqn, invals[0])
    if out is not None:
      return out
  if name == "gather":
    out = _take(eqn, invals, ctx)
    if out is None:
      out = _gather_along(eqn, invals, ctx)
    if out is not None:
      return [out]
  if name in ("concatenate", "pad", "stack"):
    out = _join(eqn, invals, ctx)
    if out is not None:
      return [out]
  if name in ("dynamic_slice", "dynamic_update_slice"):
    out = _dynamic(eqn, invals, ctx)
    if out is not None:
      return [out]
  if name in _compat.AXIS_COLLECTIVES:  # over "context": on the slices
    out = other_axes.collective(eqn, ctx.axis, [_form(x) for x in invals],
                                [_payload(x) for x in invals])
    if out is not None:
      return [_apply_form(f, y) for f, y in out]
  if _compat.is_remat(eqn):
    return _remat(eqn, invals, ctx)
  if _compat.is_scan(eqn):
    return ctx.scan(eqn, invals)
  if _compat.custom_vjp_backward(eqn) is cross_entropy.BACKWARD:
    # The blocked loss runs its own body (a checkpointed scan over blocks of
    # tokens) on the head's vocabulary slices; JAX differentiates it. Its
    # hidden state, the scan's operand, is summed first where it is partial
    # (a norm's output scaling a row-parallel sum).
    body = _compat.inlinable_body(eqn)
    invals = [ctx.full(x, "the blocked loss", v) if isinstance(x, Partial) or ctx.is_seq(v, x)
              else x for x, v in zip(invals, eqn.invars)]
    return evaluate(body[0], body[1], invals, ctx)
  call = attention.match(eqn)
  qkv = () if call is None else [invals[i] for i in (call.q, call.k, call.v)]
  if qkv and all(isinstance(x, Split) and x.dim == 2 for x in qkv) and (
      qkv[0].x.shape[2] * _in_shape(eqn, call.k)[2]
      == qkv[1].x.shape[2] * _in_shape(eqn, call.q)[2]):
    # Heads split alike (whole key/value groups on each device): the
    # attention of this device's heads, on its slices.
    ops = call.operands([None if i in (call.q, call.k, call.v) else ctx.full(x, "a mask")
                         for i, x in enumerate(invals)])
    out = attention.attend_local(
        *(x.x for x in qkv), q_positions=ops["q_positions"],
        kv_positions=ops["kv_positions"], q_segment_ids=ops["q_segment_ids"],
        kv_segment_ids=ops["kv_segment_ids"], window=ops["window"], **call.options())
    return [Split(out, 2)]
  if qkv:  # e.g. a slice of a key/value head (tensor > kv heads): every head everywhere
    why = "attention of heads not split as whole key/value groups"
    return _compat.bind_eqn(eqn, [ctx.full(x, why) for x in invals])
  if name in ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call"):
    body = _compat.inlinable_body(eqn)
    if body is not None:
      return evaluate(body[0], body[1], invals, ctx)
  site = _compat.user_site(eqn)
  why = f"{name} at {site}" if site and site != "?" else name
  return ctx.fallback(eqn, invals, why)


# Layout operations that are linear and keep a partial sum partial (a
# partial value has the full shape: the equation runs as it is).
_LINEAR_LAYOUT = frozenset({"transpose", "reshape", "broadcast_in_dim", "reduce_sum",
                            "squeeze", "expand_dims", "copy", "copy_p", "slice",
                            "concatenate", "rev", "stack"})


def _elementwise(eqn, invals, ctx: _Ctx):
  name = eqn.primitive.name
  parts = [x for x in invals if isinstance(x, Partial)]
  if parts:
    if name == "convert_element_type" and len(invals) == 1:
      # A cast of a float32 partial sum keeps it float32 until its all-reduce.
      x = invals[0]
      out = _compat.converted_dtype(eqn)
      if x.wide and jnp.issubdtype(out, jnp.floating) and jnp.finfo(out).bits >= 32:
        return Partial(x.x.astype(out), out)
      if not x.wide:
        return Partial(_compat.bind_eqn(eqn, [x.x])[0])
    linear = _linear_in_partial(name, invals) and (
        not any(p.wide for p in parts) or (
            name in ("add", "sub", "add_any", "neg")
            and len({(p.x.dtype, p.dtype) for p in parts}) == 1))
    if linear:
      vals = [x.x if isinstance(x, Partial) else ctx.enter(x) for x in invals]
      return Partial(_compat.bind_eqn(eqn, vals)[0], parts[0].dtype)
    invals = [ctx.reduce(x, var, "a non-linear use of a partial sum", invals)
              if isinstance(x, Partial) else x for x, var in zip(invals, eqn.invars)]
    if not any(isinstance(x, Split) for x in invals):
      return _compat.bind_eqn(eqn, invals)[0]
  dims = {x.dim for x in invals if isinstance(x, Split)}
  if len(dims) > 1:
    site = _compat.user_site(eqn)
    return _compat.bind_eqn(eqn, [ctx.full(x, f"{name} of values split differently at {site}")
                                  for x in invals])[0]
  (dim,) = dims
  vals = [ctx.split(x, dim) for x in invals]
  return Split(_compat.bind_eqn(eqn, vals)[0], dim)


def _linear_in_partial(name: str, invals) -> bool:
  """Whether the op is linear in its partial operands (so it can run on
  each device's addend)."""
  kinds = [_kind(x) for x in invals]
  if "split" in kinds:
    return False
  if name in ("add", "sub", "add_any"):
    return all(k == "partial" for k in kinds)
  if name in ("neg", "convert_element_type", "copy", "copy_p", "reduce_precision"):
    return True
  if name == "mul":
    return kinds.count("partial") == 1
  if name == "div":
    return kinds[0] == "partial" and kinds[1] == "full"
  return False


def _layout(eqn, v: Split, ctx: _Ctx):
  """Layout and reduction operations on a split value; None when the split
  dimension does not survive whole."""
  name = eqn.primitive.name
  x, d = v.x, v.dim
  if name == "transpose":
    perm = _compat.transpose_permutation(eqn)
    return Split(lax.transpose(x, perm), perm.index(d))
  if name == "convert_element_type":
    return Split(_compat.bind_eqn(eqn, [x])[0], d)
  if name == "broadcast_in_dim":
    bdims = _compat.broadcast_dimensions(eqn)
    out = list(_out_shape(eqn))
    nd = bdims[d]
    out[nd] //= ctx.t
    return Split(lax.broadcast_in_dim(x, tuple(out), bdims), nd)
  if name in ("reshape", "squeeze", "expand_dims"):
    k = _reshaped_dim(_in_shape(eqn), _out_shape(eqn), d, ctx.t)
    if k is None:
      return None
    out = list(_out_shape(eqn))
    out[k] //= ctx.t
    return Split(lax.reshape(x, tuple(out)), k)
  if name == "slice":
    start, limit, strides = _compat.slice_params(eqn)
    whole = start[d] == 0 and limit[d] == _in_shape(eqn)[d] and (
        strides is None or strides[d] == 1)
    if not whole:
      return None
    limit = limit[:d] + (x.shape[d],) + limit[d + 1:]
    return Split(lax.slice(x, start, limit, strides), d)
  if name == "rev":
    if d in _compat.layout_params(eqn)["dimensions"]:
      return None
    return Split(_compat.bind_eqn(eqn, [x])[0], d)
  if name == "bitcast_convert_type":
    # Same-width types keep the shape; a wider one eats the last dimension
    # (QLoRA's float32 scales from their bytes), a narrower one adds one.
    if d >= len(_out_shape(eqn)) or (len(_out_shape(eqn)) < x.ndim and d == x.ndim - 1):
      return None
    return Split(_compat.bind_eqn(eqn, [x])[0], d)
  if name in _compat.REDUCTION_PRIMITIVES:
    axes = _compat.reduction_axes(eqn)
    if d in axes:
      if name in ("reduce_max", "reduce_min") and _differentiable(x):
        # A maximum over a split vocabulary (a softmax's shift): this
        # device's, then the maximum of those over the tensor axis.
        out = collectives.extreme(x, ctx.axis, tuple(axes), name == "reduce_max")
        ctx.report.add("forward all-reduce", out)
        return out
      if name != "reduce_sum":
        return None
      if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32:
        # A 16-bit sum (a softmax's denominator over a split vocabulary):
        # added up in float32, as one device's reduction accumulates,
        # and rounded once.
        local = jnp.sum(x.astype(jnp.float32), axis=tuple(axes))
        ctx.report.add("forward all-reduce", local)
        return collectives.psum(local, ctx.axis).astype(x.dtype)
      return Partial(_compat.bind_eqn(eqn, [x])[0])
    return Split(_compat.bind_eqn(eqn, [x])[0], d - sum(a < d for a in axes))
  return None


def _take(eqn, invals, ctx: _Ctx):
  """A ``gather`` of one element along a split dimension (``take_along_axis``
  of the labels' logits from a split vocabulary): each device gathers at
  the indices that fall in its slice and gives zero elsewhere, a partial
  sum the one holder's value adds up to. Indices out of the whole range
  follow the gather's mode (clipped, or the fill value); None when the
  gather is not of that form."""
  operand, indices = invals
  if not isinstance(operand, Split) or not _differentiable(operand.x) or isinstance(
      indices, (Split, Partial)):
    return None
  dn, slice_sizes, mode, fill = _compat.gather_params(eqn)
  d = operand.dim
  if (d not in dn.start_index_map or d not in dn.collapsed_slice_dims or slice_sizes[d] != 1
      or mode not in ("clip", "fill", "promise_in_bounds")):
    return None
  size = operand.x.shape[d]
  k = dn.start_index_map.index(d)
  indices = jnp.asarray(indices)
  col = indices[..., k]
  if mode != "fill":
    col = jnp.clip(col, 0, size * ctx.t - 1)
  local = col - (lax.axis_index(ctx.axis) * size).astype(col.dtype)
  mine = (local >= 0) & (local < size)
  local = jnp.clip(local, 0, size - 1)
  out = _compat.bind_eqn(eqn, [operand.x, indices.at[..., k].set(local)])[0]
  batch = [i for i in range(out.ndim) if i not in dn.offset_dims]
  keep = lambda m: lax.broadcast_in_dim(m, out.shape, tuple(batch))
  part = jnp.where(keep(mine), out, jnp.zeros((), out.dtype))
  if mode == "fill":
    # Out of the whole range: the fill value, added by the first device.
    outside = (col < 0) | (col >= size * ctx.t)
    if fill is None:
      fill = np.nan  # the gather's default for a floating-point operand
    first = lax.axis_index(ctx.axis) == 0
    part = jnp.where(keep(outside & first), jnp.asarray(fill, out.dtype), part)
  return Partial(part)


def _split(eqn, v):
  """``split`` (``jnp.split``: a rotary's halves) along a dimension other
  than the split one: each piece on the slices; of a partial sum, partial
  pieces. None otherwise."""
  params = _compat.layout_params(eqn)
  sizes, axis = tuple(int(k) for k in params["sizes"]), params["axis"]
  if isinstance(v, Partial):
    return [Partial(x, v.dtype) for x in lax.split(v.x, sizes, axis)]
  if not isinstance(v, Split) or v.dim == axis:
    return None
  return [Split(x, v.dim) for x in lax.split(v.x, sizes, axis)]


def _gather_along(eqn, invals, ctx: _Ctx):
  """A ``gather`` that takes the split dimension whole (``jnp.take`` of a
  permutation along another dimension of a head-split value), or whose
  indices are split along a batch dimension (a table lookup, QLoRA's NF4
  levels): on the slices. None otherwise."""
  operand, indices = invals
  dn, slice_sizes, _, _ = _compat.gather_params(eqn)
  if getattr(dn, "operand_batching_dims", ()) or isinstance(operand, Partial) or isinstance(
      indices, Partial):
    return None
  if isinstance(operand, Split) and not isinstance(indices, Split):
    d = operand.dim
    # A lookup in a 2-D table split by features (an embedding with the rule
    # (None, "tensor")) runs on the gathered table: on the slices it would
    # give feature-split activations, which the next matmul (split by its
    # output columns) would gather with its kernel, layer after layer.
    if operand.x.ndim <= 2:
      return None
    if (d in dn.start_index_map or d in dn.collapsed_slice_dims
        or slice_sizes[d] != _in_shape(eqn, 0)[d]):
      return None
    kept = [k for k in range(len(slice_sizes)) if k not in dn.collapsed_slice_dims]
    sizes = list(slice_sizes)
    sizes[d] = operand.x.shape[d]
    out = _compat.bind_with(eqn, [operand.x, indices], slice_sizes=tuple(sizes))[0]
    return Split(out, dn.offset_dims[kept.index(d)])
  if isinstance(indices, Split) and not isinstance(operand, Split):
    d = indices.dim
    if d == indices.x.ndim - 1:  # the index vector itself
      return None
    batch = [k for k in range(len(_out_shape(eqn))) if k not in dn.offset_dims]
    out = _compat.bind_eqn(eqn, [ctx.enter(operand), indices.x])[0]
    return Split(out, batch[d])
  return None


def _dynamic(eqn, invals, ctx: _Ctx):
  """``dynamic_slice`` taking the split dimension whole, and
  ``dynamic_update_slice`` writing it whole (the start along it is then
  0): on the slices. None otherwise."""
  operand = invals[0]
  if not isinstance(operand, Split) or any(isinstance(x, (Split, Partial)) for x in invals[2:]):
    return None
  d = operand.dim
  full = _in_shape(eqn, 0)[d]
  if eqn.primitive.name == "dynamic_slice":
    if any(isinstance(x, (Split, Partial)) for x in invals[1:]):
      return None
    sizes = list(_compat.layout_params(eqn)["slice_sizes"])
    if sizes[d] != full:
      return None
    sizes[d] = operand.x.shape[d]
    return Split(_compat.bind_with(eqn, [operand.x] + list(invals[1:]),
                                   slice_sizes=tuple(sizes))[0], d)
  update = invals[1]
  if isinstance(update, Partial):
    return None
  if isinstance(update, Split):
    if update.dim != d or update.x.shape[d] != operand.x.shape[d]:
      return None
  elif np.shape(update)[d] != full:
    return None
  return Split(_compat.bind_eqn(eqn, [operand.x, ctx.split(update, d)] + list(invals[2:]))[0], d)


def _join(eqn, invals, ctx: _Ctx):
  """``concatenate`` along, ``stack`` beside, or ``pad`` of dimensions
  other than the split one: on the slices (replicated operands cut to
  theirs); else None."""
  if any(isinstance(x, Partial) for x in invals):
    return None
  params = _compat.layout_params(eqn)
  if eqn.primitive.name == "stack":
    dims = {x.dim for x in invals if isinstance(x, Split)}
    if len(dims) != 1:
      return None
    (d,) = dims
    axis = params["axis"]
    return Split(lax.stack([ctx.split(x, d) for x in invals], axis), d + int(d >= axis))
  if eqn.primitive.name == "pad":
    operand, value = invals
    if not isinstance(operand, Split) or isinstance(value, Split):
      return None
    if tuple(params["padding_config"][operand.dim]) != (0, 0, 0):
      return None
    return Split(lax.pad(operand.x, ctx.enter(value), params["padding_config"]), operand.dim)
  dims = {x.dim for x in invals if isinstance(x, Split)}
  if len(dims) != 1 or params["dimension"] in dims:
    return None
  (d,) = dims
  return Split(lax.concatenate([ctx.split(x, d) for x in invals], params["dimension"]), d)


def _reshaped_dim(in_shape: tuple, out_shape: tuple, d: int, t: int):
  """The output dimension a reshape carries split dimension ``d`` to, whole
  (the same elements before it, its size a multiple of ``t``), or None."""
  before = math.prod(in_shape[:d])
  for k, size in enumerate(out_shape):
    if math.prod(out_shape[:k]) == before and size % t == 0 and size > 1:
      # d's major part must be k's: k holds at least d's whole extent, or d
      # spans k and more dimensions with k major.
      return k
  return None


def _dot(eqn, invals, ctx: _Ctx):
  (lc, rc), (lb, rb) = _compat.dot_dimension_numbers(eqn)
  lhs, rhs = invals
  opts = _compat.dot_options(eqn)
  dn = ((lc, rc), (lb, rb))
  kl, kr = _kind(lhs), _kind(rhs)
  site = _compat.user_site(eqn)
  if "partial" in (kl, kr):
    if {kl, kr} == {"partial", "full"} and not any(
        isinstance(x, Partial) and x.wide for x in (lhs, rhs)):
      a = lhs.x if kl == "partial" else ctx.enter(lhs)
      b = rhs.x if kr == "partial" else ctx.enter(rhs)
      return Partial(lax.dot_general(a, b, dn, **opts))
    lhs, rhs = (ctx.full(x, f"a matmul of a partial sum at {site}") if isinstance(x, Partial)
                else x for x in (lhs, rhs))
    kl, kr = _kind(lhs), _kind(rhs)
    if kl == kr == "full":
      return lax.dot_general(lhs, rhs, dn, **opts)
  lfree = [i for i in range(len(_in_shape(eqn, 0))) if i not in lc and i not in lb]
  rfree = [i for i in range(len(_in_shape(eqn, 1))) if i not in rc and i not in rb]

  def role(dim, contract, batch, free):
    if dim in contract:
      return ("contract", contract.index(dim))
    if dim in batch:
      return ("batch", batch.index(dim))
    return ("free", free.index(dim))

  rl = role(lhs.dim, lc, lb, lfree) if kl == "split" else None
  rr = role(rhs.dim, rc, rb, rfree) if kr == "split" else None
  # Both split: the same contracted or batch dimension works on the slices.
  if rl is not None and rr is not None:
    if rl == rr and rl[0] != "free":
      if rl[0] == "contract":
        return _partial_dot(lhs.x, rhs.x, dn, opts, eqn)
      return Split(lax.dot_general(lhs.x, rhs.x, dn, **opts), rl[1])
    # Otherwise gather the smaller operand.
    small = 0 if np.size(lhs.x) <= np.size(rhs.x) else 1
    if rr[0] == "free" and ctx.is_seq(eqn.invars[0], lhs):  # a column-parallel input
      lhs, kl, rl = ctx.regather(lhs), "full", None
    elif rl[0] == "free" and ctx.is_seq(eqn.invars[1], rhs):
      rhs, kr, rr = ctx.regather(rhs), "full", None
    elif small == 0:
      lhs, kl, rl = ctx.full(lhs, f"a matmul of differently split operands at {site}"), "full", None
    else:
      rhs, kr, rr = ctx.full(rhs, f"a matmul of differently split operands at {site}"), "full", None
  if rl is not None:  # lhs split, rhs replicated
    kind, j = rl
    if kind == "free":
      out = ctx.dot(lhs.x, ctx.enter(rhs), dn, opts)
      return Split(out, len(lb) + j)
    other = rc[j] if kind == "contract" else rb[j]
    if kind == "contract":
      return _partial_dot(lhs.x, ctx.split(rhs, other), dn, opts, eqn)
    return Split(lax.dot_general(lhs.x, ctx.split(rhs, other), dn, **opts), j)
  kind, j = rr
  if kind == "free":
    out = ctx.dot(ctx.enter(lhs), rhs.x, dn, opts)
    return Split(out, len(lb) + len(lfree) + j)
  other = lc[j] if kind == "contract" else lb[j]
  if kind == "contract":
    return _partial_dot(ctx.split(lhs, other), rhs.x, dn, opts, eqn)
  return Split(lax.dot_general(ctx.split(lhs, other), rhs.x, dn, **opts), j)


def _partial_dot(a, b, dn, opts, eqn) -> Partial:
  """A matmul contracting a split dimension: this device's partial sums, in
  float32 when the matmul's result is 16-bit (each output element is then
  rounded once, after the all-reduce, as one device's matmul rounds it)."""
  out_dtype = jnp.dtype(eqn.outvars[0].aval.dtype)
  if jnp.issubdtype(out_dtype, jnp.floating) and jnp.finfo(out_dtype).bits < 32:
    wide = lax.dot_general(a, b, dn, precision=opts["precision"],
                           preferred_element_type=jnp.float32)
    return Partial(wide, out_dtype)
  return Partial(lax.dot_general(a, b, dn, **opts))


def _remat(eqn, invals, ctx: _Ctx) -> list:
  p = _compat.remat_params(eqn)
  forms: list = []

  def body(*xs):
    outs = evaluate(p.jaxpr, [], list(_rebuild(invals, xs)), ctx)
    forms[:] = [_form(o) for o in outs]
    return [_payload(o) for o in outs]

  prevent_cse = bool(p.prevent_cse) if isinstance(p.prevent_cse, bool) else any(p.prevent_cse)
  outs = jax.checkpoint(body, policy=p.policy, prevent_cse=prevent_cse)(
      *[_payload(x) for x in invals])
  return [_apply_form(f, o) for f, o in zip(forms, outs)]


def _payload(v):
  return v.x if isinstance(v, (Split, Partial)) else v


def _form(v):
  return ("split", v.dim) if isinstance(v, Split) else ("partial", v.dtype) \
      if isinstance(v, Partial) else ("full",)


def _apply_form(form, x):
  if form[0] == "split":
    return Split(x, form[1])
  if form[0] == "partial":
    return Partial(x, form[1])
  return x


def _rebuild(templates, xs):
  return [_apply_form(_form(t), x) for t, x in zip(templates, xs)]


def _scan(eqn, invals, ctx: _Ctx) -> list:
  """A scan over stacked layers: the consts and the per-layer slices keep
  their forms (a split leaf's layer is split along the same dimension less
  the layer axis); the carry is replicated, and so are the outputs."""
  p = _compat.scan_params(eqn)
  nc, ncar = p.num_consts, p.num_carry
  consts = invals[:nc]
  carry = [ctx.full(x, "a scan carry") for x in invals[nc:nc + ncar]]
  xs = invals[nc + ncar:]
  for x in xs:
    if isinstance(x, Split) and x.dim == 0:
      raise ValueError("A scan runs over a dimension split over the tensor axis. Fix: split "
                       "a per-layer dimension (the rules' layouts are per layer).")
    if isinstance(x, Partial):
      raise ValueError("A scan runs over a partial sum")
  x_forms = [_form(x) for x in xs]
  c_forms = [_form(x) for x in consts]

  def body(c, x):
    layer = [_apply_form(("split", f[1] - 1) if f[0] == "split" else f, v)
             for f, v in zip(x_forms, x)]
    cs = [_apply_form(f, v) for f, v in zip(c_forms, consts_payload)]
    outs = evaluate(p.body, list(p.body_consts), cs + list(c) + layer, ctx)
    outs = [ctx.full(o, "a scan output") for o in outs]
    return outs[:ncar], outs[ncar:]

  consts_payload = [_payload(x) for x in consts]
  c, ys = lax.scan(body, carry, [_payload(x) for x in xs], length=p.length,
                   reverse=p.reverse, unroll=p.unroll)
  return list(c) + list(ys)


# --------------------------------------------------------------------------
# The loss on the slices


@dataclasses.dataclass(eq=False)
class SplitOutputs:
  """Which outputs of the loss stay split over the tensor axis (this
  device's slice, no all-gather): those split along a dimension of at least
  ``first_dim``. Tracing the loss fills ``dims`` with ``{flat output
  position: dimension}`` of the outputs left split."""

  first_dim: int = 0
  dims: dict = dataclasses.field(default_factory=dict)


def wrap_loss(loss_fn: Callable, *, full_shapes: tuple, split_dims: tuple, axis: str,
              size: int, axis_env: tuple, report: Report,
              split_outputs: "SplitOutputs | None" = None, make_ctx=None) -> Callable:
  """``loss_fn`` over the user's tree -> the same loss over each device's
  slices (the gathered tree of a tensor-parallel step). ``full_shapes`` and
  ``split_dims`` (None: replicated) are per leaf, in tree order. The outputs
  are gathered whole, except those ``split_outputs`` keeps split.
  ``make_ctx``: tensor_sequence.SequenceCtx's factory (sequence parallelism)."""
  user_rng = loss_lib.takes_rng(loss_fn)

  def run(params, args, rng):
    flat, treedef = jax.tree.flatten(params)
    structs = [jax.ShapeDtypeStruct(s, x.dtype) for s, x in zip(full_shapes, flat)]
    kw = {"rng": rng} if user_rng else {}
    call = lambda p, *a: loss_fn(p, *a, **kw)
    closed, out_shape = jax.make_jaxpr(call, return_shape=True, axis_env=list(axis_env))(
        jax.tree.unflatten(treedef, structs), *args)
    jaxpr, consts = _compat.split_closed(closed)
    ctx = (_Ctx(axis, size, report) if make_ctx is None
           else make_ctx(axis, size, report, jaxpr, len(flat), args))
    report.reset()
    values = [x if d is None else Split(x, d) for x, d in zip(flat, split_dims)]
    outs = evaluate(jaxpr, consts, values + jax.tree.leaves(args), ctx)
    if split_outputs is not None:
      split_outputs.dims.clear()
    for k, o in enumerate(outs):
      if (split_outputs is not None and isinstance(o, Split)
          and o.dim >= split_outputs.first_dim and not ctx.is_seq(jaxpr.outvars[k], o)):
        split_outputs.dims[k] = o.dim
        outs[k] = o.x
      else:
        outs[k] = ctx.full(o, "an output of the loss")
    report.traced = True
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return loss_lib.rewrapped(loss_fn, run, with_rng=user_rng)
