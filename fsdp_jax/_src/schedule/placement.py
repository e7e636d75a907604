"""Placing each unit's gather: ``loss_fn``'s jaxpr re-evaluated with a
unit's all-gather bound right before the first equation that reads one of
its parameters (:func:`eval_with_gathers`), nested calls inlined, scans over
stacked units rebuilt to gather one layer per iteration (:mod:`.loops`), the
model's own checkpoints re-bound (:mod:`.checkpoints`)."""

from __future__ import annotations

from typing import Callable, Optional

import jax
from jax import lax

from fsdp_jax._src import _compat, collectives
from fsdp_jax._src._compat import Jaxpr, Literal
from fsdp_jax._src.plan import LoopPrefetch
from fsdp_jax._src.schedule import checkpoints, loops

# Binds an equation again, keeping its name scope and source location
# (profiler labels survive the re-evaluation), as ``jax.core.eval_jaxpr``.
_bind = _compat.bind_eqn


class Gatherer:
  """Gathers units on demand and caches the full leaves for the trace.

  ``gather_unit(unit_index)`` -> ``{leaf_id: full value}`` for a whole unit;
  ``gather_layer(unit_index, layer_locals)`` -> per-layer full leaves inside a
  scan body, given that layer's local storage slices.
  """

  def __init__(self, gather_unit: Callable, gather_layer: Callable,
               leaf_unit: dict, stacked_units: set, unit_layers: dict,
               unit_storage: Callable, direct: Optional[dict] = None,
               save_mixed: bool = False, on_unstacked_scan: Optional[Callable] = None,
               loop: Optional[LoopPrefetch] = None):
    self._gather_unit = gather_unit
    self._gather_layer = gather_layer
    self.leaf_unit = leaf_unit
    self.stacked_units = stacked_units
    self.unit_layers = unit_layers
    self.unit_storage = unit_storage
    self.cache: dict[int, dict] = {}
    self.direct = direct or {}  # leaves not managed by any unit
    # Under collectives.remat_policy: save what mixes parameters with
    # activations (see _saved_if_mixed).
    self.save_mixed = save_mixed
    # Called as on_unstacked_scan(leaf_ids, length) when a scan runs over
    # parameters of a unit that is not stacked (the whole stack is gathered).
    self.on_unstacked_scan = on_unstacked_scan
    # How scans over stacked units carry the next layer's gather (None: each
    # iteration gathers its own layer).
    self.loop = loop

  def gather_layer(self, unit: int, layer_locals):
    """One layer of a stacked unit, gathered from its local storage slices:
    ``{leaf_id: full value}``."""
    return self._gather_layer(unit, layer_locals)

  def leaf(self, leaf_id: int):
    if leaf_id in self.direct:
      return self.direct[leaf_id]
    u = self.leaf_unit[leaf_id]
    if u not in self.cache:
      self.cache[u] = self._gather_unit(u)
    return self.cache[u][leaf_id]


# What a value is made of, for the step's remat (see :func:`_saved_if_mixed`):
_CONST, _PARAM, _ACT = 0, 1, 2


def _class_of(classes) -> int:
  kinds = set(classes)
  if _ACT in kinds:
    return _ACT
  return _PARAM if _PARAM in kinds else _CONST


def _saved_if_mixed(eqn, in_classes, outs, enabled: bool = True):
  """Saves the outputs of a cheap (recomputed) equation that combines
  parameters with activations: they go through an ``optimization_barrier``,
  whose outputs the policy saves and which XLA cannot fuse into a late
  consumer (with ``checkpoint_name`` XLA recomputed the value right before
  the backward pass, keeping the parameter alive until then).

  The step's remat recomputes elementwise and layout primitives
  (:data:`fsdp_jax._src.collectives.RECOMPUTED`). Recomputing ``h + bias`` or
  ``x * scale`` would need the parameter in the backward pass wherever the
  value is read, e.g. a block's output read by the next block's backward,
  and so keep other units gathered. Saving these values (one activation
  each) keeps every recomputation local to a unit: what is recomputed reads
  only saved activations, or only parameters.
  """
  if (enabled and eqn.primitive.name in collectives.RECOMPUTED and _PARAM in in_classes
      and _ACT in in_classes):
    return list(lax.optimization_barrier(list(outs))), _ACT
  return outs, _class_of(in_classes)


def eval_with_gathers(jaxpr: Jaxpr, consts, args, lazy: dict,
                      g: Gatherer, param_invars=()) -> list:
  """Evaluates ``jaxpr`` where ``lazy`` maps invars to parameter leaf ids.

  ``args`` holds values for the non-lazy invars (``None`` for lazy ones).
  ``param_invars``: invars (besides ``lazy``) that hold parameters or values
  made only from parameters.
  """
  env: dict = {}
  lazy = dict(lazy)
  cls: dict = {}

  def read(v):
    if isinstance(v, Literal):
      return v.val
    if v in lazy:
      return g.leaf(lazy[v])
    return env[v]

  def klass(v):
    if isinstance(v, Literal):
      return _CONST
    if v in lazy:
      return _PARAM
    return cls.get(v, _ACT)

  def write(v, val, c=_ACT):
    env[v] = val
    cls[v] = c

  for v, c in zip(jaxpr.constvars, consts):
    write(v, c, _CONST)
  param_invars = set(param_invars)
  for v, a in zip(jaxpr.invars, args):
    if v not in lazy:
      write(v, a, _PARAM if v in param_invars else _ACT)

  for eqn in jaxpr.eqns:
    reads_params = any((not isinstance(v, Literal)) and v in lazy for v in eqn.invars)
    in_classes = [klass(v) for v in eqn.invars]
    if reads_params and _compat.is_scan(eqn) and _scan_pushdown(eqn, lazy, g, read, write, klass):
      continue
    if _compat.is_remat(eqn):
      for v, o in zip(eqn.outvars,
                      checkpoints.user_checkpoint(eqn, [read(v) for v in eqn.invars])):
        write(v, o)
      continue
    if _compat.is_scan(eqn) and checkpoints.has_user_checkpoint(_compat.scan_params(eqn).body):
      body_params = [bv for bv, ov in zip(_compat.scan_params(eqn).body.invars, eqn.invars)
                     if klass(ov) == _PARAM]
      checkpoints.scan_rebuild(
          eqn, read, write, body_params,
          lambda jaxpr, consts, args, lazy_, params: eval_with_gathers(
              jaxpr, consts, args, lazy_, g, params))
      continue
    # A custom_jvp / custom_vjp function keeps its rule: its parameters are
    # gathered before it, and it runs as the user wrote it.
    inner = (_compat.call_body(eqn) if _compat.is_call(eqn) and not _compat.has_custom_rule(eqn)
             else None)
    reads_param_values = _PARAM in in_classes
    if inner is not None and (reads_params or reads_param_values
                              or checkpoints.has_user_checkpoint(inner[0])):
      inner_jaxpr, inner_consts = inner
      inner_lazy = {iv: lazy[ov] for iv, ov in zip(inner_jaxpr.invars, eqn.invars)
                    if not isinstance(ov, Literal) and ov in lazy}
      inner_args = [None if (not isinstance(ov, Literal) and ov in lazy) else read(ov)
                    for ov in eqn.invars]
      inner_params = [iv for iv, c in zip(inner_jaxpr.invars, in_classes) if c == _PARAM]
      outs = eval_with_gathers(inner_jaxpr, inner_consts, inner_args, inner_lazy, g,
                               inner_params)
      for v, o in zip(eqn.outvars, outs):
        write(v, o)
      continue
    outs, c = _saved_if_mixed(eqn, in_classes, _bind(eqn, [read(v) for v in eqn.invars]),
                              g.save_mixed)
    for v, a in zip(eqn.outvars, outs):
      write(v, a, c)
  return [read(v) for v in jaxpr.outvars]


def _scan_pushdown(eqn, lazy, g: Gatherer, read, write, klass) -> bool:
  """Rebuilds a scan over a stacked unit so each iteration gathers one layer."""
  p = _compat.scan_params(eqn)
  num_consts, num_carry = p.num_consts, p.num_carry
  length = p.length
  invars = list(eqn.invars)
  xs_vars = invars[num_consts + num_carry:]
  pushed: dict[int, tuple[int, int]] = {}  # xs position -> (unit, leaf_id)
  for k, v in enumerate(xs_vars):
    if isinstance(v, Literal) or v not in lazy:
      continue
    leaf_id = lazy[v]
    u = g.leaf_unit.get(leaf_id)
    if u is not None and u in g.stacked_units and u not in g.cache and g.unit_layers[u] == length:
      pushed[k] = (u, leaf_id)
  unstacked = [lazy[v] for v in xs_vars if not isinstance(v, Literal) and v in lazy
               and g.leaf_unit.get(lazy[v]) is not None
               and g.leaf_unit[lazy[v]] not in g.stacked_units]
  if unstacked and g.on_unstacked_scan is not None:
    g.on_unstacked_scan(unstacked, length)
  if not pushed:
    return False
  units = sorted({u for u, _ in pushed.values()})
  body_jaxpr, body_consts = p.body, p.body_consts
  # Parameters in the body: the gathered layer, and consts made of parameters.
  body_params = [bv for k, bv in enumerate(body_jaxpr.invars[num_consts + num_carry:])
                 if k in pushed]
  body_params += [bv for bv, ov in zip(body_jaxpr.invars[:num_consts], invars[:num_consts])
                  if klass(ov) == _PARAM]
  if g.loop is not None and all(u in g.loop.units for u in units):
    loops.pipelined_scan(eqn, pushed, units, g, read, write, body_params, eval_with_gathers)
    return True
  consts = [read(v) for v in invars[:num_consts]]
  init = [read(v) for v in invars[num_consts:num_consts + num_carry]]
  xs_plain = [None if k in pushed else read(v) for k, v in enumerate(xs_vars)]
  unit_locals = {u: g.unit_storage(u) for u in units}

  def body(carry, xs):
    plain, per_unit = xs
    gathered = {u: g.gather_layer(u, per_unit[u]) for u in units}
    xs_full = [gathered[pushed[k][0]][pushed[k][1]] if k in pushed else plain[k]
               for k in range(len(xs_vars))]
    outs = eval_with_gathers(body_jaxpr, body_consts, [*consts, *carry, *xs_full], {}, g,
                             body_params)
    return outs[:num_carry], outs[num_carry:]

  # The rebuilt body is rematerialised with the resharding policy: without it
  # the backward loop would read every layer's gathered parameters saved by
  # the forward loop (the whole stack, gathered). With it, the backward loop
  # re-gathers one layer per iteration. SHARD_GRAD_OP is unchanged (the
  # policy saves its gathers).
  body = jax.checkpoint(body, policy=collectives.save_all_but_gathers, prevent_cse=False)
  carry_out, ys = lax.scan(body, init, (xs_plain, unit_locals), length=length,
                           reverse=p.reverse, unroll=p.unroll)
  for v, o in zip(eqn.outvars, [*carry_out, *ys]):
    write(v, o)
  return True
