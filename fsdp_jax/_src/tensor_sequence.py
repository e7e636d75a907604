"""Sequence parallelism under tensor parallelism (Megatron's, torchtitan's
``SequenceParallel``): which dimension of each value of the loss's jaxpr is
the sequence, and the two collectives along it over the tensor axis.

Under ``TensorParallel(sequence_parallel=True)`` the tensor evaluator
(:mod:`fsdp_jax._src.tensor_eval`) reduce-scatters a row-parallel output (a
partial sum) along the sequence where it would all-reduce it (Megatron's
``g`` becomes ``g-bar``): the norms, residual adds and dropout after it run
on this device's ``1/T`` of the positions, and the next column-parallel
matmul all-gathers its input along the sequence (``g-bar``'s dual). An
all-reduce is a reduce-scatter plus an all-gather, so the bytes moved stay
those of the all-reduce version, but for the backward pass's re-gather of
each column-parallel input (below); the activations between the blocks
shrink by ``T``.

The sequence is identified, never guessed from sizes: the batch leaves the
step would split over a ``"context"`` axis (:func:`fsdp_jax._src.context.split_mask`:
dimension ``ContextParallel.dim``, 1 by default) carry it, and
:func:`sequence_dims` follows that dimension through the jaxpr (elementwise
operations, broadcasts, reshapes and transposes that keep it whole,
reductions over other dimensions, matmuls' free dimensions, lookups indexed
by the tokens, calls, checkpoints and scans). A value nobody can follow is
untagged and keeps today's all-reduce; so does one whose sequence is not
divisible by the tensor size.

:class:`SequenceCtx` is the evaluator's context with the tags: its
``reduce`` reduce-scatters, its ``regather`` all-gathers; the evaluator
calls them where a partial sum meets a non-linear operation and where a
sequence slice meets a column-parallel kernel. Its ``dot`` runs that
kernel's matmul keeping the slice, not the gathered input, for the
backward pass, which all-gathers it again (Megatron's): the activations
kept shrink by ``T``, scanned layers included, for one more all-gather per
column-parallel input.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax import lax

from fsdp_jax._src import _compat
from fsdp_jax._src import attention
from fsdp_jax._src import context as context_lib
from fsdp_jax._src import tensor_collectives as collectives
from fsdp_jax._src import tensor_eval
from fsdp_jax._src.tensor_eval import Split


def batch_dims(cp, args) -> list:
  """Per leaf of ``args`` (``(batch, ...)``, tree order): the sequence
  dimension of the batch leaves that carry one (``split_mask`` of ``cp``, a
  :class:`~fsdp_jax.ContextParallel`, or its defaults), None for the rest
  (the model state after the batch)."""
  cp = context_lib.ContextParallel() if cp is None else cp
  batch, rest = args[0], args[1:]
  dims = [cp.dim if s else None for s in context_lib.split_mask(cp, batch)]
  return dims + [None] * len(jax.tree.leaves(rest))


class SequenceCtx(tensor_eval._Ctx):
  """The tensor evaluator's context under sequence parallelism: the loss's
  ``jaxpr`` (``n_params`` parameter leaves, then ``args``' leaves) tagged
  with each value's sequence dimension; ``cp``: the
  :class:`~fsdp_jax.ContextParallel` naming the batch leaves and their
  dimension (None: its defaults, dimension 1 of every batch leaf with one)."""

  def __init__(self, axis, size, report, jaxpr, n_params, args, *, cp=None):
    super().__init__(axis, size, report)
    self.seq = sequence_dims(jaxpr, [None] * n_params + batch_dims(cp, args))

  def is_seq(self, var, v) -> bool:
    """Whether ``v`` (of ``var``) is split along its sequence."""
    return isinstance(v, Split) and dim_of(self.seq, var) == v.dim

  def reduce(self, v, var, why: str, operands=()):
    """A partial sum ``v`` (of ``var``) for a non-linear use with
    ``operands``: reduce-scattered along its sequence (this device's
    slice), or all-reduced where it has none, the tensor size does not
    divide it, or another operand is split along another dimension (a
    log-softmax's denominator meeting the logits split by vocabulary)."""
    d = dim_of(self.seq, var)
    if d is None or var not in self.seq.matmuls or np.shape(v.x)[d] % self.t or any(
        isinstance(o, Split) and o.dim != d for o in operands):
      return self.full(v, why)

    def make():
      self.report.add("forward reduce-scatter", v.x)
      return Split(collectives.scatter(v.x, self.axis, d).astype(v.dtype), d)
    return self._once(("scatter", id(v)), v, make)

  def regather(self, v: Split):
    """A sequence slice whole, as the input of column-parallel matmuls
    only: its cotangent is reduce-scattered back, so it needs no
    ``enter`` (whose all-reduce would count the addends again)."""
    def make():
      out = collectives.regather(v.x, self.axis, v.dim)
      self.report.add("forward all-gather", out)
      self._memo[("enter", id(out))] = (out, out)
      self._memo[("regathered", id(out))] = (out, v)
      return out
    return self._once(("regather", id(v)), v, make)

  def dot(self, a, b, dn, opts: dict):
    """A column-parallel matmul; of a re-gathered sequence slice
    (:meth:`regather`), one that keeps the slice for the backward pass and
    all-gathers it again there for the kernel's gradient (Megatron's), not
    the gathered input (``T`` times the slice's bytes)."""
    for left, x in ((True, a), (False, b)):
      hit = self._memo.get(("regathered", id(x)))
      if hit is not None and hit[0] is x and tensor_eval._differentiable(b if left else a):
        v = hit[1]
        self.report.add("backward all-gather", x)
        return collectives.regathered_dot(x, v.x, b if left else a, self.axis, v.dim, left,
                                          dn, tuple(sorted(opts.items())))
    return super().dot(a, b, dn, opts)

  def scan(self, eqn, invals) -> list:
    """A scan over stacked layers (as ``tensor_eval._scan``) whose carry,
    the residual stream, stays split along the sequence where the body
    keeps it there: split once on entry (reduce-scattered, or cut from a
    replicated value), never gathered per layer. Per-step slices split
    along the scanned sequence are gathered."""
    p = _compat.scan_params(eqn)
    nc, ncar = p.num_consts, p.num_carry
    forms = []
    for k in range(ncar):
      d = dim_of(self.seq, p.body.invars[nc + k])
      out = p.body.outvars[k]
      # The residual stream: each layer ends in a row-parallel output's add.
      ok = (d is not None and dim_of(self.seq, out) == d
            and not isinstance(out, _compat.Literal) and out in self.seq.matmuls
            and np.shape(eqn.invars[nc + k].aval)[d] % self.t == 0)
      forms.append(("split", d) if ok else ("full",))
    consts = invals[:nc]
    xs = [self.whole(x) if self.is_seq(v, x) and x.dim == 0 else x
          for x, v in zip(invals[nc + ncar:], eqn.invars[nc + ncar:])]
    if any(isinstance(x, tensor_eval.Partial) or (isinstance(x, Split) and x.dim == 0)
           for x in xs):
      return tensor_eval._scan(eqn, invals, self)  # its errors
    carry = [self._as(x, f, v, "a scan carry")
             for x, f, v in zip(invals[nc:nc + ncar], forms, eqn.invars[nc:nc + ncar])]
    x_forms = [tensor_eval._form(x) for x in xs]
    c_forms = [tensor_eval._form(x) for x in consts]
    consts_payload = [tensor_eval._payload(x) for x in consts]

    def body(c, x):
      layer = [tensor_eval._apply_form(("split", f[1] - 1) if f[0] == "split" else f, v)
               for f, v in zip(x_forms, x)]
      cs = [tensor_eval._apply_form(f, v) for f, v in zip(c_forms, consts_payload)]
      c = [tensor_eval._apply_form(f, v) for f, v in zip(forms, c)]
      outs = tensor_eval.evaluate(p.body, list(p.body_consts), cs + c + layer, self)
      c = [self._as(o, f, v, "a scan output")
           for o, f, v in zip(outs[:ncar], forms, p.body.outvars[:ncar])]
      return c, [self.full(o, "a scan output") for o in outs[ncar:]]

    c, ys = lax.scan(body, carry, [tensor_eval._payload(x) for x in xs], length=p.length,
                     reverse=p.reverse, unroll=p.unroll)
    return [tensor_eval._apply_form(f, v) for f, v in zip(forms, c)] + list(ys)

  def fallback(self, eqn, invals, why: str) -> list:
    """What no rule of the evaluator runs on slices: a lookup of one
    element per position (``take_along_axis`` of the labels' log-
    probabilities) in a sequence slice runs on it, its indices cut alike;
    the rest on gathered operands."""
    if eqn.primitive.name == "gather" and len(invals) == 2:
      out = self._take_batched(eqn, *invals)
      if out is not None:
        return [out]
    invals = [self.full(x, why, v) for x, v in zip(invals, eqn.invars)]
    return super().fallback(eqn, invals, why)

  def full(self, v, why: str, var=None):
    """The replicated value of ``v``: a sequence slice by :meth:`whole`."""
    if var is not None and self.is_seq(var, v):
      return self.whole(v)
    return super().full(v, why)

  def whole(self, v: Split):
    """A sequence slice all-gathered: where the sequence-parallel region
    ends (the blocked loss's flattened tokens), as Megatron gathers before
    its head; counted, not reported as computation run unsplit."""
    def make():
      out = collectives.gather(v.x, self.axis, v.dim)
      self.report.add("forward all-gather", out)
      return out
    return self._once(("full", id(v)), v, make)

  def _take_batched(self, eqn, operand, indices):
    dn = _compat.gather_params(eqn)[0]
    batching = tuple(getattr(dn, "operand_batching_dims", ()))
    if (not isinstance(operand, Split) or operand.dim not in batching
        or isinstance(indices, tensor_eval.Partial)):
      return None
    k = dn.start_indices_batching_dims[batching.index(operand.dim)]
    if isinstance(indices, Split) and indices.dim != k:
      return None
    out_shape = tuple(eqn.outvars[0].aval.shape)
    batch = [i for i in range(len(out_shape)) if i not in dn.offset_dims]
    if k >= len(batch):  # the index vector
      return None
    out = _compat.bind_eqn(eqn, [operand.x, self.split(indices, k)])[0]
    return Split(out, batch[k])

  def _as(self, x, form, var, why):
    """``x`` (of ``var``) in ``form``'s payload: whole, or this device's
    slice along the sequence."""
    if form[0] == "full":
      return self.full(x, why)
    d = form[1]
    if isinstance(x, tensor_eval.Partial):
      x = self.reduce(x, var, why)
    if isinstance(x, Split) and x.dim == d:
      return x.x
    return self.split(self.full(x, why), d)


# --------------------------------------------------------------------------
# The sequence dimension of each value


def dim_of(tags: dict, var):
  """The tagged sequence dimension of a jaxpr variable (None: untagged, a
  literal)."""
  if isinstance(var, _compat.Literal):
    return None
  return tags.get(var)


class Tags(dict):
  """``{jaxpr variable: its sequence dimension}``; ``matmuls``: the
  variables that are matmul (or lookup) outputs or linear in one (a
  row-parallel output, its bias and residual adds; a lookup in an
  embedding split by vocabulary): the partial sums Megatron's ``g``
  reduces, the ones reduce-scattered. Others (a softmax's denominator over a
  split vocabulary, soon to meet the vocabulary-split logits) are
  all-reduced."""

  def __init__(self):
    super().__init__()
    self.matmuls: set = set()


# Operations linear in a matmul's output (which keep a partial sum partial).
_LINEAR = frozenset({"add", "sub", "add_any", "neg", "mul", "div", "convert_element_type", "copy",
                     "copy_p", "reduce_precision", "reshape", "transpose", "broadcast_in_dim",
                     "squeeze", "expand_dims", "slice", "concatenate", "pad", "select_n"})


def sequence_dims(jaxpr, in_dims, tags: "Tags | None" = None, _seen: dict = None) -> Tags:
  """The sequence dimension of each variable of ``jaxpr`` (an open jaxpr)
  whose inputs carry the sequence at ``in_dims`` (None: not at all), nested
  jaxprs included. A body shared by calls that disagree is tagged with what
  they agree on."""
  tags = Tags() if tags is None else tags
  seen = {} if _seen is None else _seen
  for v, d in zip(jaxpr.invars, in_dims):
    if d is not None:
      tags[v] = d
  for eqn in jaxpr.eqns:
    ds = [dim_of(tags, v) for v in eqn.invars]
    if all(d is None for d in ds):
      continue
    name = eqn.primitive.name
    if name in ("dot_general", "gather") or (name in _LINEAR and any(
        not isinstance(v, _compat.Literal) and v in tags.matmuls for v in eqn.invars)):
      tags.matmuls.update(v for v in eqn.outvars if not isinstance(v, _compat.DropVar))
    outs = _eqn_dims(eqn, ds, tags, seen)
    for v, d in zip(eqn.outvars, outs):
      if d is not None and not isinstance(v, _compat.DropVar):
        tags[v] = d
  return tags


def _body(jaxpr, in_dims, tags, seen) -> list:
  """The body's output tags, the body tagged (once per agreeing inputs)."""
  key = id(jaxpr)
  in_dims = list(in_dims)
  before = seen.get(key)
  if before is not None and before[0] is jaxpr:
    merged = [a if a == b else None for a, b in zip(before[1], in_dims)]
    if merged == before[1]:
      return [dim_of(tags, v) for v in jaxpr.outvars]
    _forget(jaxpr, tags)
    in_dims = merged
  seen[key] = (jaxpr, in_dims)
  sequence_dims(jaxpr, in_dims, tags, seen)
  return [dim_of(tags, v) for v in jaxpr.outvars]


def _call(eqn, body, ds, tags, seen) -> list:
  """A call's output tags; matmul outputs passed in and out of the body
  marked on both sides."""
  outer = [v for v in eqn.invars]
  tags.matmuls.update(b for o, b in zip(outer, body.invars)
                      if not isinstance(o, _compat.Literal) and o in tags.matmuls)
  outs = _body(body, ds, tags, seen)
  tags.matmuls.update(o for o, b in zip(eqn.outvars, body.outvars)
                      if not isinstance(b, _compat.Literal) and b in tags.matmuls
                      and not isinstance(o, _compat.DropVar))
  return outs


def _forget(jaxpr, tags) -> None:
  for v in jaxpr.invars:
    tags.pop(v, None)
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      if not isinstance(v, _compat.DropVar):
        tags.pop(v, None)
        tags.matmuls.discard(v)
    for sub in _compat.nested_jaxprs(eqn):
      _forget(_compat.split_closed(sub)[0], tags)


_SAME_SHAPE = frozenset({"select_n", "clamp", "rev", "cumsum", "cumprod", "cummax", "cummin",
                         "cumlogsumexp", "reduce_precision", "copy", "copy_p", "dynamic_slice",
                         "dynamic_update_slice", "slice", "pad", "concatenate", "sort"})


def _eqn_dims(eqn, ds, tags, seen) -> list:
  name = eqn.primitive.name
  outs = [tuple(v.aval.shape) for v in eqn.outvars]
  ins = [tuple(np.shape(v.aval)) for v in eqn.invars]
  if _compat.is_scan(eqn):
    return _scan_dims(eqn, ds, tags, seen)
  call = attention.match(eqn)
  if call is not None:  # its output is laid out as the queries, [batch, seq, heads, dim]
    return [ds[call.q]] + [None] * (len(outs) - 1)
  body = _compat.inlinable_body(eqn)
  if body is not None:
    if len(body[0].invars) != len(ds) or len(body[0].outvars) != len(outs):
      return [None] * len(outs)
    return _call(eqn, body[0], ds, tags, seen)
  if len(outs) != 1:
    if name == "split":
      d = ds[0]
      axis = _compat.layout_params(eqn)["axis"]
      return [d if d is not None and d != axis else None for _ in outs]
    return [None] * len(outs)
  out = outs[0]
  if name in _compat.ELEMENTWISE_PRIMITIVES or name in _SAME_SHAPE or (
      name in _compat.PASSTHROUGH_PRIMITIVES):
    # The first operand of the output's rank whose tagged dimension the
    # output keeps at full length.
    for d, shape in zip(ds, ins):
      if d is not None and len(shape) == len(out) and shape[d] == out[d]:
        return [d]
    return [None]
  d = ds[0]
  if name == "broadcast_in_dim":
    if d is None:
      return [None]
    nd = _compat.broadcast_dimensions(eqn)[d]
    return [nd if out[nd] == ins[0][d] else None]
  if name == "transpose":
    return [None if d is None else _compat.transpose_permutation(eqn).index(d)]
  if name in ("reshape", "squeeze", "expand_dims"):
    return [None if d is None else _reshaped(ins[0], out, d)]
  if name in _compat.REDUCTION_PRIMITIVES or name in ("argmax", "argmin"):
    if d is None:
      return [None]
    axes = _compat.operated_axes(eqn)
    return [None if d in axes else d - sum(a < d for a in axes)]
  if name == "dot_general":
    return [_dot_dim(eqn, ds, ins)]
  if name == "gather":
    return [_gather_dim(eqn, ds, ins, out)]
  return [None]


def _reshaped(in_shape: tuple, out_shape: tuple, d: int):
  """The output dimension holding input dimension ``d`` unchanged (the same
  elements before it, the same length), or None."""
  before = math.prod(in_shape[:d])
  for k, size in enumerate(out_shape):
    if math.prod(out_shape[:k]) == before and size == in_shape[d]:
      return k
  return None


def _dot_dim(eqn, ds, ins):
  (lc, rc), (lb, rb) = _compat.dot_dimension_numbers(eqn)
  lfree = [i for i in range(len(ins[0])) if i not in lc and i not in lb]
  rfree = [i for i in range(len(ins[1])) if i not in rc and i not in rb]
  dl, dr = ds
  if dl is not None:
    if dl in lb:
      return lb.index(dl)
    if dl in lfree:
      return len(lb) + lfree.index(dl)
  if dr is not None:
    if dr in rb:
      return rb.index(dr)
    if dr in rfree:
      return len(lb) + len(lfree) + rfree.index(dr)
  return None


def _gather_dim(eqn, ds, ins, out):
  """A lookup indexed by tagged indices (an embedding of the tokens): the
  output's batch dimension of the indices' tagged one."""
  d = ds[1] if len(ds) > 1 else None
  if d is None or d == len(ins[1]) - 1:
    return None
  dn = _compat.gather_params(eqn)[0]
  batch = [k for k in range(len(out)) if k not in dn.offset_dims]
  if len(batch) != len(ins[1]) - 1 or out[batch[d]] != ins[1][d]:
    return None
  return batch[d]


def _scan_dims(eqn, ds, tags, seen) -> list:
  """A scan: consts as they come, the carry tagged where the body keeps its
  tag, the per-step slices one dimension down (untagged if the scan runs
  along the sequence); outputs alike."""
  p = _compat.scan_params(eqn)
  nc, ncar = p.num_consts, p.num_carry
  xs = [None if d is None or d == 0 else d - 1 for d in ds[nc + ncar:]]
  carry = list(ds[nc:nc + ncar])
  for _ in range(2):
    outs = _body(p.body, list(ds[:nc]) + carry + xs, tags, seen)
    kept = [c if c == o else None for c, o in zip(carry, outs[:ncar])]
    if kept == carry:
      break
    carry = kept
  else:
    outs = _body(p.body, list(ds[:nc]) + carry + xs, tags, seen)
  ys = [None if d is None else d + 1 for d in outs[ncar:]]
  return carry + ys
