"""The loss's per-device program, cut where the step gathers units.

``loss_fn`` is traced as the step traces it (:class:`~fsdp_jax._src.local_loss.LocalLoss`:
LoRA's adapter path, tensor-parallel slices, the axis names bound), at the
per-device micro-batch. Calls that read parameters are inlined (as the step
inlines them to place its gathers) and the collectives the loss itself runs
(tensor parallelism's over ``"tensor"``, a model's over the data axes) are
replaced by local stand-ins of the same shapes, each recorded with its bytes.
The flat program is cut into **segments** (:func:`segment`): a new segment
starts at the first equation that reads a unit not read before (where the
step places that unit's all-gather), what follows a segment's last read of
its units is a segment of its own (the step has freed them by then), and a
``scan`` over a stacked unit is a segment of its own (one layer per
iteration; the engine's :mod:`fsdp_jax._src.schedule.regions`, which
activation checkpointing wraps). :mod:`.programs` compiles them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax._src import _compat, schedule
from fsdp_jax._src._compat import Literal
from fsdp_jax._src.context import CONTEXT
from fsdp_jax._src.local_loss import LocalLoss
from fsdp_jax._src.plan import Plan
from fsdp_jax._src.schedule import regions
from fsdp_jax._src.schedule.regions import Segment as Segment, unit_group as unit_group

_STAND_IN = "fsdp_planner_"


def nbytes(aval) -> int:
  """Bytes of an array of this shape and dtype (a PRNG key: its key data)."""
  dtype = aval.dtype
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(aval.shape, dtype))
    return int(np.prod(data.shape, dtype=np.int64)) * np.dtype(data.dtype).itemsize
  if dtype == jax.dtypes.float0:
    return 0
  return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def is_float(aval) -> bool:
  return jnp.issubdtype(aval.dtype, jnp.inexact)


# --------------------------------------------------------------------------
# Tracing, inlining, and the loss's own collectives


@dataclasses.dataclass(frozen=True)
class Collective:
  """A collective the loss runs (not FSDP's): its kind, mesh axes, and the
  bytes of its result on each device."""

  kind: str
  axes: tuple
  nbytes: int


def _axes_of(eqn) -> tuple:
  out = []
  for v in _compat.axis_params(eqn).values():
    for a in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(a, str):
        out.append(a)
  return tuple(out)


def _is_collective(eqn) -> bool:
  """Whether ``eqn`` runs over mesh axes: axis names among its axis params
  (a reduction's ``axes`` are array dimensions, not mesh axes: a
  ``reduce_max`` in the attention is no collective)."""
  return bool(_axes_of(eqn)) and eqn.primitive.name not in ("pjit", "jit")


_IDENTITY = frozenset({"psum", "pmax", "pmin", "ppermute", "pbroadcast", "pvary",
                       "psum_invariant", "psum2", "pmean", "ppermute_p"})


def stand_in(eqn, invals, sizes: dict) -> list:
  """A local computation with ``eqn``'s output shapes in place of a
  collective, wrapped in a named call the segments can find."""
  name = eqn.primitive.name
  axes = _axes_of(eqn)
  outs = [v.aval for v in eqn.outvars]

  def local(*xs):
    if name in _IDENTITY and len(xs) == len(outs) and all(
        x.shape == o.shape for x, o in zip(xs, outs)):
      return [x.astype(o.dtype) for x, o in zip(xs, outs)]
    if name == "all_gather":
      x, o = xs[0], outs[0]
      d, tiled = _compat.collective_layout(eqn)
      n = int(np.prod([sizes.get(a, 1) for a in axes]))
      y = (jnp.concatenate([x] * n, axis=d) if tiled else jnp.stack([x] * n, axis=d))
      if CONTEXT in axes:
        # Context parallelism's keys and values, gathered whole per layer: a
        # buffer of its own, as the all-gather's result is (not fused into
        # the attention that reads it).
        y = jax.lax.optimization_barrier(y)
      return [y.astype(o.dtype)]
    if name in ("reduce_scatter", "psum_scatter"):
      x, o = xs[0], outs[0]
      d, tiled = _compat.collective_layout(eqn)
      idx = [slice(None)] * x.ndim
      if tiled:
        idx[d] = slice(0, o.shape[d])
        return [x[tuple(idx)].astype(o.dtype)]
      idx[d] = 0
      return [x[tuple(idx)].astype(o.dtype)]
    if len(xs) == len(outs) and all(int(np.prod(x.shape)) == int(np.prod(o.shape))
                                    for x, o in zip(xs, outs)):
      return [x.reshape(o.shape).astype(o.dtype) for x, o in zip(xs, outs)]
    # axis_index and anything else: zeros that depend on the inputs
    dep = sum((jnp.sum(x).astype(jnp.float32) * 0 for x in xs
               if jnp.issubdtype(x.dtype, jnp.number)), jnp.float32(0))
    return [jnp.zeros(o.shape, o.dtype) + dep.astype(o.dtype) for o in outs]

  local.__name__ = f"{_STAND_IN}{name}__{'+'.join(axes)}"
  return list(jax.jit(local)(*invals))


def _contains_collective(jaxpr) -> bool:
  for e in jaxpr.eqns:
    if _is_collective(e):
      return True
    for j in _compat.nested_jaxprs(e):
      if _contains_collective(j):
        return True
  return False


def localize_nested(value, contains, evaluate):
  """A nested jaxpr (``Jaxpr`` or ``ClosedJaxpr``) traced again through
  ``evaluate(jaxpr, consts, args)`` (which replaces its collectives) when
  ``contains(jaxpr)`` says it has some; else ``value`` itself."""
  jaxpr, consts = _compat.split_closed(value)
  if not contains(jaxpr):
    return value
  avals = [v.aval for v in jaxpr.invars]
  closed = jax.make_jaxpr(lambda *a: evaluate(jaxpr, consts, list(a)))(*avals)
  if isinstance(value, _compat.ClosedJaxpr):
    return closed
  if closed.consts:
    raise NotImplementedError("a collective inside a nested computation that closes over "
                              "constants")
  return closed.jaxpr


def _localize(value, sizes: dict):
  """A nested jaxpr with its collectives replaced by stand-ins."""
  return localize_nested(value, _contains_collective,
                         lambda j, c, a: _evaluate(j, c, a, sizes, set()))


def _evaluate(jaxpr, consts, args, sizes: dict, params: set) -> list:
  """``jaxpr`` re-evaluated with calls reading parameters inlined and
  collectives replaced by stand-ins. ``params``: the invars holding
  parameters (or values computed from parameters alone)."""
  env: dict = {}
  from_params: set = set()

  def read(v):
    return v.val if isinstance(v, Literal) else env[v]

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
    if v in params:
      from_params.add(v)
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    reads = [v for v in eqn.invars if not isinstance(v, Literal) and v in from_params]
    inner = _compat.call_body(eqn) if _compat.is_call(eqn) else None
    custom = inner is not None and _compat.has_custom_rule(eqn)
    # A custom rule is kept (its function runs as written) unless its body
    # runs collectives (tensor parallelism's gathers): their stand-ins need
    # the body, and a rule would run the collectives themselves.
    if inner is not None and ((reads and not custom) or (
        custom and _contains_collective(inner[0]))):
      body, body_consts = inner
      inner_params = {bv for bv, ov in zip(body.invars, eqn.invars)
                      if not isinstance(ov, Literal) and ov in from_params}
      outs = _evaluate(body, body_consts, invals, sizes, inner_params)
    elif _is_collective(eqn):
      outs = stand_in(eqn, invals, sizes)
    else:
      if any(_contains_collective(j) for j in _compat.nested_jaxprs(eqn)):
        eqn = _compat.rebuild_params(eqn, {}, lambda j: _localize(j, sizes))
      outs = _compat.bind_eqn(eqn, invals)
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
    non_literal = [v for v in eqn.invars if not isinstance(v, Literal)]
    if non_literal and all(v in from_params for v in non_literal) and not eqn.effects:
      from_params.update(eqn.outvars)
  return [read(v) for v in jaxpr.outvars]


def trace_loss(loss_fn, plan: Plan, batch, model_state=None, rng=None):
  """``(flat closed jaxpr, number of parameter inputs, whether the loss
  calls jax.checkpoint)``: ``loss_fn`` as
  the step evaluates it on one device, at these (per-device) batch shapes,
  with calls that read parameters inlined and the loss's collectives
  replaced by stand-ins. Its inputs are the parameter leaves (as the
  gathers return them), then the batch, model state and key leaves."""
  local = LocalLoss(loss_fn, plan)
  closed, _, _ = local.traced(batch, model_state, rng)
  checkpointed = schedule.has_user_checkpoint(closed)
  n = len(plan.leaves)
  sizes = {**dict(plan.axis_env), **{a: int(s) for a, s in plan.mesh.shape.items()}}
  avals = [v.aval for v in closed.jaxpr.invars]
  jaxpr = closed.jaxpr
  with _compat.classic_tracing():
    flat = jax.make_jaxpr(lambda *a: _evaluate(jaxpr, closed.consts, list(a), sizes,
                                               set(jaxpr.invars[:n])))(*avals)
  return flat, n, checkpointed


# --------------------------------------------------------------------------
# Segments


def _collectives_in(eqns, mult: int = 1) -> list:
  out = []
  for e in eqns:
    name = _compat.call_name(e) if _compat.is_call(e) else None
    if name and name.startswith(_STAND_IN):
      kind, _, axes = name[len(_STAND_IN):].partition("__")
      size = sum(nbytes(v.aval) for v in e.outvars)
      out.extend([Collective(kind, tuple(axes.split("+")) if axes else (), size)] * mult)
      continue
    inner_mult = mult * (_compat.scan_params(e).length if _compat.is_scan(e) else 1)
    for j in _compat.nested_jaxprs(e):
      out.extend(_collectives_in(j.eqns, inner_mult))
  return out


def segment(flat, n_params: int, plan: Plan) -> list:
  """Cuts the flat program into :class:`Segment` s (the engine's
  :func:`~fsdp_jax._src.schedule.regions.segment`, which activation
  checkpointing wraps), each with the loss's own collectives it runs."""
  segments = regions.segment(flat, n_params, plan)
  for s in segments:
    s.collectives = _collectives_in(s.eqns)
  return segments
