"""Context parallelism inside the step: ``loss_fn`` (single-device code, for
whole sequences) re-evaluated on each device's chunk of the sequence, every
operation that mixes positions computed exactly over the ``"context"`` axis.

``loss_fn`` is traced with the whole sequence (the global shapes of the
split batch leaves) and its jaxpr evaluated again with each split leaf bound
to this device's chunk. Each value is either

* replicated: the whole array, the same on every device of the context
  group (parameters, positions made by ``iota`` / ``jnp.arange``, masks,
  anything the split leaves do not reach), or
* :class:`Split`: this device's chunk along one dimension ``dim``, device
  ``i`` holding positions ``[i * n, (i + 1) * n)`` of a padded length
  ``C * n`` (with ``load_balance``, the head-tail pieces ``i`` and
  ``2C-1-i`` of ``n / 2`` positions each: :mod:`context_layout` says which
  positions a chunk holds, and every rule below asks it). The traced equation's shape says the logical length ``L <= C *
  n``: a slice that drops the first or last positions (``labels[:, 1:]``,
  ``logits[:, :-1]``) keeps the chunking and leaves positions ``>= L``
  padding, holding real values of the array (never NaN) that reductions
  leave out.

Rules: elementwise operations, and those along other dimensions (matmuls
over hidden dimensions, norms, reshapes that keep the sequence whole),
run on the chunk; a replicated operand of the sequence's length meeting a
split one is cut to this device's positions, which is how positions made by
``iota`` (rotary tables, causal and sliding-window masks) take their global
values. A reduction over the sequence is the local one summed (``psum``) or
maximised over ``"context"``; a matmul between two split operands along
different roles (``q @ k^T``, ``probs @ v``) all-gathers the one whose
sequence is contracted or, when both are free, the smaller (keys and
values: the all-gather strategy); a matmul contracting both chunks adds up
over ``"context"``. A slice dropping ``a`` leading positions takes ``a``
values from the next device (``ppermute``); ``cumsum`` adds the preceding
chunks' totals. ``fsdp_jax.chunked_cross_entropy`` (the blocked loss, a
sum over tokens) is recognised as a whole and called on this device's
chunk, its total and weight summed over ``"context"``. Anything else that
touches the split dimension is refused with an error naming the primitive,
its source line and the fix.

Gradients: the collectives are JAX's own (``all_gather`` <-> ``psum_scatter``,
``psum`` <-> ``psum``, ``ppermute`` <-> the reverse ``ppermute``), so each
device's gradient is its share of ``C`` times the global one under the
step's ``check_vma=False`` shard_map, and the step's average over shard x
context gives the global gradient exactly (the context axis is one of the
data axes).
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
from fsdp_jax._src import attention as attention_lib
from fsdp_jax._src import context_layout
from fsdp_jax._src import cross_entropy
from fsdp_jax._src import loss as loss_lib


class Split:
  """This device's chunk of a value split along ``dim`` over the context axis."""

  __slots__ = ("x", "dim")

  def __init__(self, x, dim: int):
    self.x, self.dim = x, dim


@dataclasses.dataclass(eq=False)
class Report:
  """Context-axis collectives of the traced loss (forward pass), by kind:
  ``{kind: [count, bytes per device]}``."""

  counts: dict = dataclasses.field(default_factory=dict)

  def add(self, kind: str, x) -> None:
    c = self.counts.setdefault(kind, [0, 0])
    c[0] += 1
    c[1] += int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize


class Refused(ValueError):
  """An operation along the split sequence that context parallelism cannot
  compute exactly."""


class _Ctx:
  def __init__(self, axis: str, size: int, report: Report, balanced: bool = False):
    self.axis, self.c, self.report = axis, size, report
    # which chunks of the sequence each device holds (context_layout)
    self.layout = context_layout.Layout(size, balanced)
    self._memo: dict = {}

  def index(self):
    return lax.axis_index(self.axis)

  def gather(self, v: Split):
    """The whole (padded) value of a split one: all-gathered over the axis
    (once per value); its gradient is reduce-scattered back."""
    hit = self._memo.get(id(v))
    if hit is not None and hit[0] is v:
      return hit[1]
    out = lax.all_gather(v.x, self.axis, axis=v.dim, tiled=True)
    self.report.add("all-gather", out)
    out = self.layout.natural(out, v.dim)  # in the sequence's order
    self._memo[id(v)] = (v, out)
    return out

  def cut(self, x, dim: int, n: int):
    """This device's chunk (``n`` positions along ``dim``) of a replicated
    value; one shorter than the padded length (a slice of a split value's
    length) is padded with its last positions first."""
    if np.ndim(x) == 0 or np.shape(x)[dim] == 1:
      return x
    total = n * self.c
    size = np.shape(x)[dim]
    if size < total:
      edge = lax.slice_in_dim(x, size - 1, size, axis=dim)
      reps = [1] * np.ndim(x)
      reps[dim] = total - size
      x = lax.concatenate([x, jnp.tile(edge, reps)], dim)
    elif size != total:
      raise Refused(f"a replicated value of length {size} along dimension {dim} meets a "
                    f"sequence split into chunks of {n} ({total} in all)")
    return self.layout.cut(x, dim, n, self.index())

  def positions(self, n: int):
    """``[n]`` int32: the global positions of this device's chunk."""
    return self.layout.positions(self.index(), n)

  def valid(self, n: int, length: int):
    """``[n]`` bool: which of this device's positions are below ``length``."""
    return self.positions(n) < length


def _site(eqn) -> str:
  site = _compat.user_site(eqn)
  return f" at {site}" if site and site != "?" else ""


def _refuse(eqn, what: str):
  name = eqn.primitive.name
  site = _site(eqn)
  fix = ("Fix: use fsdp_jax.attention (or attention in jnp: q @ k^T, softmax, @ v, or "
         "jax.nn.dot_product_attention), compute this per token, or remove the context axis "
         "(make_mesh without context=).")
  if "cross_entropy" in site:
    fix = ("Fix: compute the loss unblocked under a context axis (fsdp_jax.models: "
           "from_pretrained(..., loss_block_tokens=None); each device's logits are then "
           "1/C of the sequence's), or remove the context axis.")
  raise Refused(
      f"Context parallelism cannot compute {name}{site} exactly: {what}. It mixes positions "
      f"of the sequence split over the 'context' axis. {fix}")


def _out_shape(eqn, k=0) -> tuple:
  return tuple(eqn.outvars[k].aval.shape)


def _in_shape(eqn, k=0) -> tuple:
  v = eqn.invars[k]
  return tuple(np.shape(v.aval)) if hasattr(v, "aval") else tuple(np.shape(v.val))


def evaluate(jaxpr, consts, args, ctx: _Ctx) -> list:
  env: dict = {}
  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  losses = {g.first: g for g in _blocked_losses(jaxpr)}
  skip: dict = {}  # eqn index -> the blocked loss that replaces it
  for i, eqn in enumerate(jaxpr.eqns):
    g = losses.get(i)
    if g is not None and isinstance(env.get(g.hidden), Split):
      skip.update(dict.fromkeys(g.eqns, g))
    if i in skip:
      if i == skip[i].call:
        env[skip[i].total], env[skip[i].weight] = _blocked_loss(skip[i], env, ctx)
      continue
    invals = [v.val if isinstance(v, _compat.Literal) else env[v] for v in eqn.invars]
    if not any(isinstance(x, Split) for x in invals):
      outs = _compat.bind_eqn(eqn, invals)
    else:
      outs = _rule(eqn, invals, ctx)
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, _compat.DropVar):
        env[v] = x
  return [v.val if isinstance(v, _compat.Literal) else env[v] for v in jaxpr.outvars]


@dataclasses.dataclass(frozen=True, eq=False)
class _BlockedLoss:
  """The equations of one ``fsdp_jax.chunked_cross_entropy`` call: the
  tokens flattened (``reshape``), padded to whole blocks and cast, the
  weight (``sum(labels != -100)``) and the ``jax.custom_vjp`` of the blocked
  sum (:data:`cross_entropy.BACKWARD`), from ``hidden`` ``[..., T, d]``,
  ``labels`` ``[..., T]`` and the head ``kernel`` to ``total`` and
  ``weight``."""

  eqns: frozenset
  first: int
  call: int
  hidden: object
  labels: object
  kernel: object
  total: object
  weight: object
  block: int
  soft_cap: object


def _blocked_losses(jaxpr) -> list:
  """The blocked-loss calls in ``jaxpr`` (see :class:`_BlockedLoss`); one
  whose intermediate values are used elsewhere is left out (its
  equations then meet the ordinary rules)."""
  eqns = jaxpr.eqns
  if not any(_compat.custom_vjp_backward(e) is cross_entropy.BACKWARD for e in eqns):
    return []
  made, users = {}, {}
  for i, e in enumerate(eqns):
    for v in e.outvars:
      made[v] = i
    for v in e.invars:
      if not isinstance(v, _compat.Literal):
        users.setdefault(v, []).append(i)
  outs = {v for v in jaxpr.outvars if not isinstance(v, _compat.Literal)}

  def back(v, group, kinds):
    """Walks from ``v`` back through the flatten / pad / cast of its
    tokens (``kinds``, in that order from the call, each optional)."""
    for kind in kinds:
      i = made.get(v)
      if i is None:
        return v
      e = eqns[i]
      name = e.primitive.name
      ok = {"pad": name == "pad" or _compat.call_name(e) == "_pad",
            "cast": name == "convert_element_type",
            "flatten": name == "reshape"}[kind]
      if ok:
        group.add(i)
        v = e.invars[0]
    return v

  found = []
  for c, e in enumerate(eqns):
    static = _compat.custom_vjp_static_args(e)
    if _compat.custom_vjp_backward(e) is not cross_entropy.BACKWARD or static is None:
      continue
    if len(e.invars) != 3 or len(e.outvars) != 1:
      continue
    group = {c}
    hidden = back(e.invars[0], group, ("pad", "flatten"))
    labels = back(e.invars[2], group, ("pad", "cast", "flatten"))
    # the weight: sum(labels != -100) cast to float32
    chain = [i for i in users.get(e.invars[2], []) if i != c]
    if len(chain) != 1 or eqns[chain[0]].primitive.name != "ne":
      continue
    v, summed = eqns[chain[0]].outvars[0], False
    group.add(chain[0])
    while len(users.get(v, [])) == 1 and eqns[users[v][0]].primitive.name in (
        "convert_element_type", "reduce_sum"):
      i = users[v][0]
      summed |= eqns[i].primitive.name == "reduce_sum"
      group.add(i)
      v = eqns[i].outvars[0]
    weight, total = v, e.outvars[0]
    h_shape, y_shape = np.shape(hidden.aval), np.shape(labels.aval)
    inner = {w for i in group for w in eqns[i].outvars} - {weight, total}
    if (not summed or np.shape(weight.aval) != () or len(h_shape) < 2
        or tuple(y_shape) != tuple(h_shape[:-1])
        or any(u not in group for w in inner for u in users.get(w, ())) or inner & outs
        or any(u < c for u in users.get(weight, ()))):
      continue
    found.append(_BlockedLoss(frozenset(group), min(group), c, hidden, labels, e.invars[1],
                              total, weight, int(static[0]), static[1]))
  return found


def _blocked_loss(g: _BlockedLoss, env, ctx: _Ctx):
  """``chunked_cross_entropy`` of this device's chunk (its tokens; labels
  past the sequence's logical length ignored, -100), the same blocked
  ``jax.custom_vjp`` with its blockwise backward, its total and weight
  summed over ``"context"`` as any sum over the sequence."""
  read = lambda v: v.val if isinstance(v, _compat.Literal) else env[v]
  h, y, kernel = read(g.hidden), read(g.labels), read(g.kernel)
  d = h.x.ndim - 2
  if h.dim != d or isinstance(kernel, Split):
    raise Refused(
        f"Context parallelism cannot compute fsdp_jax.chunked_cross_entropy: its hidden "
        f"state {tuple(np.shape(g.hidden.aval))} is split along dimension {h.dim}, not its "
        f"tokens ({d}), or its head kernel is split. Fix: pass the hidden state "
        f"[..., tokens, d] of the split sequence and a head kernel [d, vocab].")
  n = h.x.shape[d]
  if isinstance(y, Split):
    if y.dim != d:
      raise Refused(
          f"Context parallelism cannot compute fsdp_jax.chunked_cross_entropy: its labels "
          f"{tuple(np.shape(g.labels.aval))} are split along dimension {y.dim}, not {d}. "
          "Fix: pass labels of the hidden state's shape less its last dimension.")
    y = y.x
  else:
    y = ctx.cut(y, d, n)
  length = np.shape(g.hidden.aval)[d]
  if length < n * ctx.c:  # positions past the logical length are padding
    keep = lax.broadcast_in_dim(ctx.valid(n, length), y.shape, (d,))
    y = jnp.where(keep, y, jnp.asarray(cross_entropy.IGNORE_INDEX, y.dtype))
  out = cross_entropy.chunked_cross_entropy(h.x, kernel, y, block_tokens=g.block,
                                            soft_cap=g.soft_cap)
  total = out.total.astype(g.total.aval.dtype)
  weight = out.weight.astype(g.weight.aval.dtype)
  ctx.report.add("all-reduce", total)
  ctx.report.add("all-reduce", weight)
  return lax.psum(total, ctx.axis), lax.psum(weight, ctx.axis)


def _rule(eqn, invals, ctx: _Ctx) -> list:
  name = eqn.primitive.name
  if name == "dot_general":
    return [_dot(eqn, invals, ctx)]
  if name in _compat.ELEMENTWISE_PRIMITIVES:
    return [_elementwise(eqn, invals, ctx)]
  if name in _compat.PASSTHROUGH_PRIMITIVES and len(invals) == 1:
    return [invals[0]]
  if name in _compat.REDUCTION_PRIMITIVES and len(invals) == 1:
    return [_reduce(eqn, invals[0], ctx)]
  if name == "slice":
    return [_slice(eqn, invals[0], ctx)]
  if name == "cumsum":
    return [_cumsum(eqn, invals[0], ctx)]
  if name in _ALONG_OTHER and len(invals) == 1:
    # argmax over the vocabulary, a cumulative op or a sort along another
    # dimension: on the chunk
    v = invals[0]
    axes = _compat.operated_axes(eqn)
    if v.dim not in axes:
      out = _compat.bind_eqn(eqn, [v.x])[0]
      drop = name in ("argmax", "argmin")
      return [Split(out, v.dim - (sum(a < v.dim for a in axes) if drop else 0))]
  if name in ("transpose", "broadcast_in_dim", "reshape", "squeeze", "expand_dims",
              "convert_element_type") and isinstance(invals[0], Split):
    out = _layout(eqn, invals, ctx)
    if out is not None:
      return [out]
  if name in ("concatenate", "pad"):
    out = _join(eqn, invals, ctx)
    if out is not None:
      return [out]
  if name == "gather":
    out = _take(eqn, invals, ctx)
    if out is not None:
      return [out]
  call = attention_lib.match(eqn)
  if call is not None:
    return [_attention(eqn, call, invals, ctx)]
  if _compat.is_remat(eqn):
    return _remat(eqn, invals, ctx)
  if _compat.is_scan(eqn):
    return _scan(eqn, invals, ctx)
  body = _compat.inlinable_body(eqn)
  if body is not None:
    return evaluate(body[0], body[1], invals, ctx)
  _refuse(eqn, "no rule for it on a split sequence")


_ALONG_OTHER = frozenset({"argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
                          "cumlogsumexp", "sort"})


def _elementwise(eqn, invals, ctx: _Ctx):
  dims = {x.dim for x in invals if isinstance(x, Split)}
  if len(dims) > 1:
    # e.g. a packed-document mask, seg[:, :, None] == seg[:, None, :]: the
    # operand split along the first (query) dimension stays split, the
    # others (keys) are all-gathered.
    dim = min(dims)
    invals = [ctx.gather(x) if isinstance(x, Split) and x.dim != dim else x for x in invals]
  (dim,) = {x.dim for x in invals if isinstance(x, Split)}
  n = next(x for x in invals if isinstance(x, Split)).x.shape[dim]
  vals = [x.x if isinstance(x, Split) else ctx.cut(x, dim, n) for x in invals]
  return Split(_compat.bind_eqn(eqn, vals)[0], dim)


def _padded(eqn, v: Split, ctx: _Ctx, k: int = 0) -> bool:
  """Whether the split operand ``k``'s logical length is below its padded one."""
  return _in_shape(eqn, k)[v.dim] < v.x.shape[v.dim] * ctx.c


def _reduce(eqn, v, ctx: _Ctx):
  axes = _compat.reduction_axes(eqn)
  kind = _compat.REDUCTION_PRIMITIVES[eqn.primitive.name]
  if v.dim not in axes:
    out = _compat.bind_eqn(eqn, [v.x])[0]
    return Split(out, v.dim - sum(a < v.dim for a in axes))
  x = v.x
  n = x.shape[v.dim]
  if _padded(eqn, v, ctx):  # leave out the padding past the logical length
    keep = ctx.valid(n, _in_shape(eqn)[v.dim])
    keep = lax.broadcast_in_dim(keep, x.shape, (v.dim,))
    fill = {"sum": 0, "max": -jnp.inf, "min": jnp.inf, "and": True, "or": False}[kind]
    if kind in ("max", "min") and not jnp.issubdtype(x.dtype, jnp.floating):
      info = jnp.iinfo(x.dtype)
      fill = info.min if kind == "max" else info.max
    x = jnp.where(keep, x, jnp.asarray(fill, x.dtype))
  local = _compat.bind_eqn(eqn, [x])[0]
  if kind == "sum":
    ctx.report.add("all-reduce", local)
    return lax.psum(local, ctx.axis)
  if kind in ("max", "min"):
    every = lax.all_gather(local, ctx.axis, axis=0)
    return (jnp.max if kind == "max" else jnp.min)(every, axis=0)
  _refuse(eqn, f"a {kind} over the split sequence")


def _slice(eqn, v, ctx: _Ctx):
  start, limit, strides = _compat.slice_params(eqn)
  d = v.dim
  if strides is not None and any(s != 1 for k, s in enumerate(strides) if k == d):
    _refuse(eqn, "a strided slice of the split sequence")
  x = v.x
  n = x.shape[d]
  others_start = [0 if k == d else s for k, s in enumerate(start)]
  others_limit = [x.shape[d] if k == d else l for k, l in enumerate(limit)]
  x = lax.slice(x, others_start, others_limit,
                None if strides is None else [1 if k == d else s for k, s in enumerate(strides)])
  a = start[d]
  if a == 0:  # keeps the chunking; the tail past `limit` becomes padding
    return Split(x, d)
  lay = ctx.layout
  m = lay.piece(n)
  if a > m:
    _refuse(eqn, f"a slice dropping {a} leading positions, more than a chunk ({m})")
  # y[i] = x[i + a]: each chunk's tail, then the first a positions of the
  # chunk after it, from the device holding it (context_layout; the
  # sequence's last chunk takes its own last positions: padding).
  pieces = lay.split(x, d)
  heads = [lax.slice_in_dim(p, 0, a, axis=d) for p in pieces]
  nxt, has = lay.halo(heads, -1, ctx.axis, ctx.index(), lambda h: ctx.report.add("halo", h))
  out = [lax.concatenate([lax.slice_in_dim(p, a, m, axis=d),
                          jnp.where(h, r, lax.slice_in_dim(p, m - a, m, axis=d))], d)
         for p, r, h in zip(pieces, nxt, has)]
  return Split(lay.join(out, d), d)


def _join(eqn, invals, ctx: _Ctx):
  """``concatenate`` / ``pad`` along a dimension other than the split one."""
  params = _compat.layout_params(eqn)
  if eqn.primitive.name == "pad":
    operand, value = invals
    if not isinstance(operand, Split) or isinstance(value, Split):
      return None
    d = operand.dim
    lo, hi, interior = params["padding_config"][d]
    if interior or lo < 0 or hi < 0:
      return None
    config = list(params["padding_config"])
    config[d] = (0, 0, 0)
    x = Split(lax.pad(operand.x, value, config), d)
    shape = list(_out_shape(eqn))
    shape[d] = lo
    head = jnp.broadcast_to(jnp.asarray(value, x.x.dtype), tuple(shape))
    return _concat_along(eqn, [head, x] if lo else [x], d,
                         [lo, _in_shape(eqn)[d]] if lo else [_in_shape(eqn)[d]], ctx, hi,
                         fill=value)
  dims = {x.dim for x in invals if isinstance(x, Split)}
  if len(dims) == 1 and params["dimension"] in dims:
    (d,) = dims
    return _concat_along(eqn, list(invals), d,
                         [_in_shape(eqn, i)[d] for i in range(len(invals))], ctx, 0)
  if len(dims) != 1:
    return None
  (d,) = dims
  n = next(x for x in invals if isinstance(x, Split)).x.shape[d]
  return Split(lax.concatenate([x.x if isinstance(x, Split) else ctx.cut(x, d, n)
                                for x in invals], params["dimension"]), d)


def _concat_along(eqn, parts, d, lengths, ctx: _Ctx, tail: int, fill=None):
  """Concatenation along the split dimension: ``[head, x]`` (a replicated
  head of ``a`` positions, then split ``x``: ``x`` shifted right by ``a``,
  each device taking the previous device's last ``a``), and ``[x, tail]``
  (a replicated tail, or ``tail`` positions of a pad's value ``fill``,
  written at ``x``'s end). The result keeps the chunking; anything else is
  refused."""
  splits = [i for i, x in enumerate(parts) if isinstance(x, Split)]
  if len(splits) != 1:
    _refuse(eqn, "a concatenation of several pieces of the split sequence")
  (i,) = splits
  x = parts[i]
  n = x.x.shape[d]
  if i > 1 or len(parts) - i > 2:
    _refuse(eqn, "a concatenation of more than a head, the split sequence and a tail")
  if sum(lengths) + tail > n * ctx.c:
    _refuse(eqn, f"a concatenation lengthening the split sequence past {n * ctx.c}")
  y = x.x
  a = lengths[0] if i == 1 else 0
  if a:
    lay = ctx.layout
    m = lay.piece(n)
    if a > m:
      _refuse(eqn, f"a shift by {a} positions, more than a chunk ({m})")
    head = jnp.broadcast_to(parts[0], y.shape[:d] + (a,) + y.shape[d + 1:]).astype(y.dtype)
    # each chunk takes the last a positions of the chunk before it (the
    # sequence's first chunk: the head)
    pieces = lay.split(y, d)
    tails = [lax.slice_in_dim(p, m - a, m, axis=d) for p in pieces]
    prev, has = lay.halo(tails, 1, ctx.axis, ctx.index(), lambda t: ctx.report.add("halo", t))
    y = lay.join([lax.concatenate([jnp.where(h, r, head), lax.slice_in_dim(p, 0, m - a, axis=d)],
                                  d) for p, r, h in zip(pieces, prev, has)], d)
  end = a + lengths[i]
  rest = parts[i + 1] if len(parts) > i + 1 else None
  given = lengths[i + 1] if rest is not None else 0
  if given + tail > n:
    _refuse(eqn, f"a tail of {given + tail} positions, more than a chunk ({n})")
  pos = ctx.positions(n)
  for k in range(given + tail):
    val = lax.slice_in_dim(rest, k, k + 1, axis=d) if k < given else fill
    hit = lax.broadcast_in_dim(pos == end + k, y.shape, (d,))
    y = jnp.where(hit, jnp.broadcast_to(val, y.shape).astype(y.dtype), y)
  return Split(y, d)


def _take(eqn, invals, ctx: _Ctx):
  """A ``gather`` from a replicated operand at split indices (an embedding
  lookup ``emb[ids]``), or batched along the split sequence of both
  (``take_along_axis(logp, labels)``): the lookup of this device's indices."""
  operand, indices = invals
  dn, slice_sizes, _, _ = _compat.gather_params(eqn)
  if isinstance(operand, Split) and not isinstance(indices, Split):
    # x[..., i]: the split dimension taken whole by every slice
    d = operand.dim
    sizes = list(slice_sizes)
    if (d in tuple(dn.collapsed_slice_dims) or d in tuple(dn.start_index_map)
        or d in tuple(getattr(dn, "operand_batching_dims", ()))
        or sizes[d] != _in_shape(eqn)[d]):
      return None
    sizes[d] = operand.x.shape[d]
    out = _compat.bind_with(eqn, [operand.x, indices], slice_sizes=tuple(sizes))[0]
    kept = [i for i in range(operand.x.ndim) if i not in tuple(dn.collapsed_slice_dims)
            and i not in tuple(getattr(dn, "operand_batching_dims", ()))]
    return Split(out, tuple(dn.offset_dims)[kept.index(d)])
  if not isinstance(indices, Split) or indices.dim == indices.x.ndim - 1:
    return None
  obatch = tuple(getattr(dn, "operand_batching_dims", ()))
  ibatch = tuple(getattr(dn, "start_indices_batching_dims", ()))
  if isinstance(operand, Split):
    if operand.dim not in obatch or ibatch[obatch.index(operand.dim)] != indices.dim:
      return None
    operand = operand.x
  elif obatch:
    return None
  out = _compat.bind_eqn(eqn, [operand, indices.x])[0]
  offset = tuple(dn.offset_dims)
  batch_out = [i for i in range(out.ndim) if i not in offset]
  return Split(out, batch_out[indices.dim])


def _attention(eqn, call, invals, ctx: _Ctx):
  """``fsdp_jax.attention`` with the sequence split: this device's queries
  against the whole keys and values (all-gathered over the context axis,
  with their positions and segment ids), on the queries' global positions,
  so causal masks, windows and documents hold across chunk boundaries.
  Under head-tail balancing each of the device's two chunks is its own
  call, its query blocks within one chunk, so the kernel skips the key
  blocks the causal mask hides from each. K and V split (the usual case):
  only their chunks are saved for the backward pass
  (:func:`_regathered_attention`)."""
  ops = call.operands(invals)
  q, k, v = ops["q"], ops["k"], ops["v"]
  if not isinstance(q, Split) or q.dim != 1 or any(
      isinstance(x, Split) and x.dim != 1 for x in (k, v)):
    _refuse(eqn, "attention whose queries are not split along their sequence (dim 1)")
  for i, x in zip((call.q, call.k, call.v), (q, k, v)):
    if isinstance(x, Split) and _padded(eqn, x, ctx, i):
      _refuse(eqn, "attention over a sliced sequence")
  n = q.x.shape[1]

  def rows(x, split_at, whole):
    """A positions / segment-ids operand ([rows, seq]) for this device's
    queries (``whole=False``) or the gathered keys."""
    if x is None:
      return None
    if isinstance(x, Split):
      return ctx.gather(x) if whole else x.x
    return x if whole else ctx.cut(x, split_at, n)

  regather = isinstance(k, Split) and isinstance(v, Split)
  kf = ctx.gather(k) if isinstance(k, Split) and not regather else k
  vf = ctx.gather(v) if isinstance(v, Split) and not regather else v
  qpos = rows(ops["q_positions"], 1, False)
  if qpos is None:
    qpos = ctx.positions(n)[None]
  kpos = rows(ops["kv_positions"], 1, True)
  if kpos is None:
    kpos = jnp.arange(n * ctx.c if regather else kf.shape[1], dtype=jnp.int32)
  window = ops["window"]
  if isinstance(window, Split):
    _refuse(eqn, "a window operand split along the sequence")
  qseg, kseg = rows(ops["q_segment_ids"], 1, False), rows(ops["kv_segment_ids"], 1, True)
  lay = ctx.layout
  cut = lambda x: [None] * lay.pieces if x is None else lay.split(jnp.atleast_2d(x), 1)
  options = call.options()

  def attend(q, kf, vf, extras):
    qpos, qseg, kpos, kseg = extras
    # one call per piece (head-tail: two), its query blocks within the piece
    outs = [attention_lib.attend_local(qt, kf, vf, q_positions=pt, kv_positions=kpos,
                                       q_segment_ids=st, kv_segment_ids=kseg, window=window,
                                       **options)
            for qt, pt, st in zip(lay.split(q, 1), cut(qpos), cut(qseg))]
    return lay.join(outs, 1)

  extras = (qpos, qseg, kpos, kseg)  # a window operand stays as it came (static or not)
  if not regather:
    return Split(attend(q.x, kf, vf, extras), 1)
  return Split(_regathered_attention(attend, ctx, q.x, k.x, v.x, extras), 1)


# What the regathered attention keeps besides its inputs: the kernel's output
# and logsumexp (its backward then runs without the forward's loops).
_SAVE_ATTENTION_OUT = jax.checkpoint_policies.save_only_these_names(
    attention_lib.OUT_NAME, attention_lib.LSE_NAME)


def _regathered_attention(attend, ctx: _Ctx, q, k, v, extras):
  """``attend(q, K, V, extras)`` on the keys and values all-gathered from
  this device's chunks ``k`` / ``v``, saving the chunks for the backward
  pass, not the gathered ``[b, T, ...]`` K and V (torchtitan's and
  Megatron's context parallelism): a ``jax.checkpoint`` that saves its
  inputs and the kernel's output and logsumexp (named by the kernel), so
  the backward all-gathers K and V again (one more all-gather of each per
  layer), runs the kernel's backward and reduce-scatters dK / dV (the
  all-gather's transpose). Under a FULL_SHARD step's remat JAX applies the
  step's policy here instead of this one (jax-ml/jax#18817); that policy
  saves the names too, and with them nothing of the gathered sequence
  (tests/test_context_families.py). A checkpoint, not a ``custom_vjp``:
  tensor parallelism's evaluation (:mod:`tensor_eval`) runs through it,
  heads split."""
  def run(q, k, v, extras):
    def whole(x):
      out = lax.all_gather(x, ctx.axis, axis=1, tiled=True)
      ctx.report.add("all-gather", out)
      return ctx.layout.natural(out, 1)  # in the sequence's order
    return attend(q, whole(k), whole(v), extras)

  return jax.checkpoint(run, policy=_SAVE_ATTENTION_OUT, prevent_cse=True)(q, k, v, extras)


def _cumsum(eqn, v, ctx: _Ctx):
  axis, reverse = _compat.cumulative_params(eqn)
  if axis != v.dim:
    return Split(_compat.bind_eqn(eqn, [v.x])[0], v.dim)
  if reverse:
    _refuse(eqn, "a reverse cumulative sum along the split sequence")
  # each chunk's own cumulative sum, plus the totals of the chunks before
  # it in the sequence (on whichever devices they are)
  lay = ctx.layout
  local = [_compat.bind_eqn(eqn, [p])[0] for p in lay.split(v.x, axis)]
  m = local[0].shape[axis]
  totals = jnp.stack([lax.slice_in_dim(x, m - 1, m, axis=axis) for x in local])
  offsets = lay.before(totals, ctx.axis, ctx.index())
  return Split(lay.join([x + o for x, o in zip(local, offsets)], axis), v.dim)


def _layout(eqn, invals, ctx: _Ctx):
  v = invals[0]
  name = eqn.primitive.name
  x, d = v.x, v.dim
  if name == "convert_element_type":
    return Split(_compat.bind_eqn(eqn, [x])[0], d)
  if name == "transpose":
    perm = _compat.transpose_permutation(eqn)
    return Split(lax.transpose(x, perm), perm.index(d))
  if name == "broadcast_in_dim":
    bdims = _compat.broadcast_dimensions(eqn)
    out = list(_out_shape(eqn))
    nd = bdims[d]
    out[nd] = x.shape[d]
    return Split(lax.broadcast_in_dim(x, tuple(out), bdims), nd)
  # reshape / squeeze / expand_dims: the sequence dimension kept whole
  ins, outs = _in_shape(eqn), _out_shape(eqn)
  k = _reshaped_dim(ins, outs, d, ctx.c)
  if k is not None and _padded(eqn, v, ctx) and outs[k] != ins[d]:
    _refuse(eqn, "a reshape merging a sliced sequence with other dimensions")
  if k is None:
    _refuse(eqn, f"a reshape {ins} -> {outs} that merges or cuts the split sequence "
            f"(dimension {d})")
  shape = list(outs)
  shape[k] = outs[k] // ins[d] * x.shape[d]
  return Split(jnp.reshape(x, shape), k)


def _reshaped_dim(in_shape: tuple, out_shape: tuple, d: int, c: int):
  """The output dimension a reshape carries split dimension ``d`` to whole
  (the same elements before it, its size a multiple of ``d``'s: ``d`` and
  the dimensions after it merged, ``d`` major), or None."""
  before = math.prod(in_shape[:d])
  for k, size in enumerate(out_shape):
    if math.prod(out_shape[:k]) == before and size % in_shape[d] == 0 and size > 1:
      return k
  return None


def _dot(eqn, invals, ctx: _Ctx):
  (lc, rc), (lb, rb) = _compat.dot_dimension_numbers(eqn)
  lhs, rhs = invals
  opts = _compat.dot_options(eqn)
  dn = ((lc, rc), (lb, rb))
  ls, rs = isinstance(lhs, Split), isinstance(rhs, Split)
  # A sliced sequence (padding past its length) may be a per-token operand
  # (free or batch), not gathered or contracted.
  pl, pr = (isinstance(v, Split) and _padded(eqn, v, ctx, k) for k, v in enumerate(invals))
  lfree = [i for i in range(len(_in_shape(eqn, 0))) if i not in lc and i not in lb]
  rfree = [i for i in range(len(_in_shape(eqn, 1))) if i not in rc and i not in rb]

  def role(dim, contract, batch, free):
    if dim in contract:
      return ("contract", contract.index(dim))
    if dim in batch:
      return ("batch", batch.index(dim))
    return ("free", free.index(dim))

  rl = role(lhs.dim, lc, lb, lfree) if ls else None
  rr = role(rhs.dim, rc, rb, rfree) if rs else None
  if ls and rs and (rl != rr or rl[0] == "free"):
    # Attention: gather the operand whose sequence is contracted (v in
    # probs @ v), else the smaller (k in q @ k^T).
    if rr[0] == "contract" or (rl[0] != "contract" and lhs.x.size >= rhs.x.size):
      if pr:
        _refuse(eqn, "a matmul gathering a sliced sequence")
      rhs, rs, rr = ctx.gather(rhs), False, None
    else:
      if pl:
        _refuse(eqn, "a matmul gathering a sliced sequence")
      lhs, ls, rl = ctx.gather(lhs), False, None
  if (pl and rl[0] == "contract") or (pr and rr[0] == "contract"):
    _refuse(eqn, "a matmul contracting a sliced sequence")
  if ls and rs:  # the same role
    kind, j = rl
    out = lax.dot_general(lhs.x, rhs.x, dn, **opts)
    if kind == "contract":
      ctx.report.add("all-reduce", out)
      return lax.psum(out, ctx.axis)
    return Split(out, j)
  if ls:
    kind, j = rl
    n = lhs.x.shape[lhs.dim]
    if kind == "free":
      return Split(lax.dot_general(lhs.x, rhs, dn, **opts), len(lb) + j)
    other = rc[j] if kind == "contract" else rb[j]
    out = lax.dot_general(lhs.x, ctx.cut(rhs, other, n), dn, **opts)
    if kind == "contract":
      ctx.report.add("all-reduce", out)
      return lax.psum(out, ctx.axis)
    return Split(out, j)
  kind, j = rr
  n = rhs.x.shape[rhs.dim]
  if kind == "free":
    return Split(lax.dot_general(lhs, rhs.x, dn, **opts), len(lb) + len(lfree) + j)
  other = lc[j] if kind == "contract" else lb[j]
  out = lax.dot_general(ctx.cut(lhs, other, n), rhs.x, dn, **opts)
  if kind == "contract":
    ctx.report.add("all-reduce", out)
    return lax.psum(out, ctx.axis)
  return Split(out, j)


def _form(v):
  return ("split", v.dim) if isinstance(v, Split) else ("full",)


def _payload(v):
  return v.x if isinstance(v, Split) else v


def _apply(form, x):
  return Split(x, form[1]) if form[0] == "split" else x


def _remat(eqn, invals, ctx: _Ctx) -> list:
  p = _compat.remat_params(eqn)
  forms: list = []
  in_forms = [_form(x) for x in invals]

  def body(*xs):
    outs = evaluate(p.jaxpr, [], [_apply(f, x) for f, x in zip(in_forms, xs)], ctx)
    forms[:] = [_form(o) for o in outs]
    return [_payload(o) for o in outs]

  prevent_cse = bool(p.prevent_cse) if isinstance(p.prevent_cse, bool) else any(p.prevent_cse)
  outs = jax.checkpoint(body, policy=p.policy, prevent_cse=prevent_cse)(
      *[_payload(x) for x in invals])
  return [_apply(f, o) for f, o in zip(forms, outs)]


def _scan(eqn, invals, ctx: _Ctx) -> list:
  """A scan (over stacked layers): consts and carry keep their forms (a
  split carry must come out split along the same dimension); the scanned
  operands and outputs must not be split (refused otherwise)."""
  p = _compat.scan_params(eqn)
  nc, ncar = p.num_consts, p.num_carry
  xs = invals[nc + ncar:]
  if any(isinstance(x, Split) for x in xs):
    _refuse(eqn, "a scan over values split along the sequence")
  c_forms = [_form(x) for x in invals[:nc]]
  car_forms = [_form(x) for x in invals[nc:nc + ncar]]
  consts = [_payload(x) for x in invals[:nc]]

  def body(c, x):
    outs = evaluate(p.body, list(p.body_consts),
                    [_apply(f, v) for f, v in zip(c_forms, consts)]
                    + [_apply(f, v) for f, v in zip(car_forms, c)] + list(x), ctx)
    if [_form(o) for o in outs[:ncar]] != car_forms or any(
        isinstance(o, Split) for o in outs[ncar:]):
      _refuse(eqn, "a scan whose carry changes how it is split, or whose outputs are split")
    return [_payload(o) for o in outs[:ncar]], outs[ncar:]

  c, ys = lax.scan(body, [_payload(x) for x in invals[nc:nc + ncar]], list(xs),
                   length=p.length, reverse=p.reverse, unroll=p.unroll)
  return [_apply(f, x) for f, x in zip(car_forms, c)] + list(ys)


def wrap_loss(loss_fn: Callable, *, dim: int, split_mask: Callable, axis: str, size: int,
              axis_env: tuple, report: Report, load_balance: bool = False) -> Callable:
  """``loss_fn`` over whole sequences -> the same loss over this device's
  chunk of each split batch leaf (``split_mask(batch)``: per leaf, whether
  it is split along ``dim``; ``load_balance``: the chunk is the head-tail
  pair of :mod:`~fsdp_jax._src.context_layout`, the batch permuted so). The
  outputs are replicated over the context axis (a split output is
  refused)."""
  user_rng = loss_lib.takes_rng(loss_fn)

  def run(params, args, rng):
    batch = args[0]
    flat_b, bdef = jax.tree.flatten(batch)
    mask = split_mask(batch)
    structs = []
    for x, s in zip(flat_b, mask):
      shape = list(np.shape(x))
      if s:
        shape[dim] *= size
      structs.append(jax.ShapeDtypeStruct(tuple(shape), x.dtype))
    kw = {"rng": rng} if user_rng else {}
    call = lambda p, *a: loss_fn(p, *a, **kw)
    closed, out_shape = jax.make_jaxpr(call, return_shape=True, axis_env=list(axis_env))(
        params, jax.tree.unflatten(bdef, structs), *args[1:])
    jaxpr, consts = _compat.split_closed(closed)
    ctx = _Ctx(axis, size, report, load_balance)
    report.counts.clear()
    # The step splits the batch in the sequence's order; with load_balance
    # each device then fetches its head-tail pieces (context_layout).
    fetch = lambda x: ctx.layout.from_contiguous(x, dim, axis, ctx.index(),
                                                 lambda y: report.add("batch", y))
    values = [Split(fetch(x), dim) if s else x for x, s in zip(flat_b, mask)]
    rest = jax.tree.leaves(args[1:])
    outs = evaluate(jaxpr, consts, jax.tree.leaves(params) + values + rest, ctx)
    for o in outs:
      if isinstance(o, Split):
        raise Refused(
            "An output of the loss is split along the sequence (a per-token value). Under "
            "context parallelism the loss's outputs must be reduced over the sequence "
            "(a mean or a WeightedLoss); per-token outputs are not supported.")
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return loss_lib.rewrapped(loss_fn, run, with_rng=user_rng)
