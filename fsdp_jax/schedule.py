"""Where gathers go: ``loss_fn`` is traced once to a jaxpr and re-evaluated
with each unit's all-gather inserted right before the first equation that
reads one of its parameters.

* Calls into nested ``jit``/``closed_call`` jaxprs are inlined when they read
  parameters, so a model wrapped in an inner ``jax.jit`` still gathers unit by
  unit.
* A ``lax.scan`` whose scanned-over operands are leaves of a stacked unit is
  rebuilt so the scan body gathers one layer per iteration from the layer's
  shard, instead of gathering the whole stack before the loop.
* Liveness does the rest: a gathered value dies after its last use. For
  FULL_SHARD the step wraps the evaluation in ``jax.checkpoint`` with
  :func:`fsdp_jax.collectives.remat_policy`, so the backward re-gathers.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
from jax import lax
from jax._src import core as jax_core
from jax.extend.core import Literal

from fsdp_jax import collectives

_INLINE = ("pjit", "jit", "closed_call", "core_call")


class Gatherer:
  """Gathers units on demand and caches the full leaves for the trace.

  ``gather_unit(unit_index)`` -> ``{leaf_id: full value}`` for a whole unit;
  ``gather_layer(unit_index, layer_locals)`` -> per-layer full leaves inside a
  scan body, given that layer's local storage slices.
  """

  def __init__(self, gather_unit: Callable, gather_layer: Callable,
               leaf_unit: dict, stacked_units: set, unit_layers: dict,
               unit_storage: Callable, direct: Optional[dict] = None):
    self._gather_unit = gather_unit
    self._gather_layer = gather_layer
    self.leaf_unit = leaf_unit
    self.stacked_units = stacked_units
    self.unit_layers = unit_layers
    self.unit_storage = unit_storage
    self.cache: dict[int, dict] = {}
    self.direct = direct or {}  # leaves not managed by any unit

  def leaf(self, leaf_id: int):
    if leaf_id in self.direct:
      return self.direct[leaf_id]
    u = self.leaf_unit[leaf_id]
    if u not in self.cache:
      self.cache[u] = self._gather_unit(u)
    return self.cache[u][leaf_id]


def eval_with_gathers(jaxpr: jax_core.Jaxpr, consts, args, lazy: dict,
                      g: Gatherer) -> list:
  """Evaluates ``jaxpr`` where ``lazy`` maps invars to parameter leaf ids.

  ``args`` holds values for the non-lazy invars (``None`` for lazy ones).
  """
  env: dict = {}
  lazy = dict(lazy)

  def read(v):
    if isinstance(v, Literal):
      return v.val
    if v in lazy:
      return g.leaf(lazy[v])
    return env[v]

  def write(v, val):
    env[v] = val

  for v, c in zip(jaxpr.constvars, consts):
    write(v, c)
  for v, a in zip(jaxpr.invars, args):
    if v not in lazy:
      write(v, a)

  for eqn in jaxpr.eqns:
    reads_params = any((not isinstance(v, Literal)) and v in lazy for v in eqn.invars)
    name = eqn.primitive.name
    if reads_params and name == "scan" and _scan_pushdown(eqn, lazy, g, read, write):
      continue
    if reads_params and name in _INLINE:
      inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
      if inner is not None:
        inner_jaxpr = getattr(inner, "jaxpr", inner)
        inner_consts = getattr(inner, "consts", ())
        inner_lazy = {iv: lazy[ov] for iv, ov in zip(inner_jaxpr.invars, eqn.invars)
                      if not isinstance(ov, Literal) and ov in lazy}
        inner_args = [None if (not isinstance(ov, Literal) and ov in lazy) else read(ov)
                      for ov in eqn.invars]
        outs = eval_with_gathers(inner_jaxpr, inner_consts, inner_args, inner_lazy, g)
        for v, o in zip(eqn.outvars, outs):
          write(v, o)
        continue
    invals = [read(v) for v in eqn.invars]
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
      ans = eqn.primitive.bind(*invals, **bind_params)
    if eqn.primitive.multiple_results:
      for v, a in zip(eqn.outvars, ans):
        write(v, a)
    else:
      write(eqn.outvars[0], ans)
  return [read(v) for v in jaxpr.outvars]


def _scan_pushdown(eqn, lazy, g: Gatherer, read, write) -> bool:
  """Rebuilds a scan over a stacked unit so each iteration gathers one layer."""
  p = eqn.params
  num_consts, num_carry = p["num_consts"], p["num_carry"]
  length = p["length"]
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
  if not pushed:
    return False
  units = sorted({u for u, _ in pushed.values()})
  consts = [read(v) for v in invars[:num_consts]]
  init = [read(v) for v in invars[num_consts:num_consts + num_carry]]
  xs_plain = [None if k in pushed else read(v) for k, v in enumerate(xs_vars)]
  unit_locals = {u: g.unit_storage(u) for u in units}
  body_closed = p["jaxpr"]
  body_jaxpr, body_consts = body_closed.jaxpr, body_closed.consts

  def body(carry, xs):
    plain, per_unit = xs
    gathered = {u: g._gather_layer(u, per_unit[u]) for u in units}
    xs_full = [gathered[pushed[k][0]][pushed[k][1]] if k in pushed else plain[k]
               for k in range(len(xs_vars))]
    outs = eval_with_gathers(body_jaxpr, body_consts, [*consts, *carry, *xs_full], {}, g)
    return outs[:num_carry], outs[num_carry:]

  # The rebuilt body is rematerialised with the resharding policy: without it
  # the backward loop would read every layer's gathered parameters saved by
  # the forward loop (the whole stack, gathered). With it, the backward loop
  # re-gathers one layer per iteration. SHARD_GRAD_OP is unchanged (the
  # policy saves its gathers).
  body = jax.checkpoint(body, policy=collectives.remat_policy, prevent_cse=False)
  carry_out, ys = lax.scan(body, init, (xs_plain, unit_locals), length=length,
                           reverse=p["reverse"], unroll=p["unroll"])
  for v, o in zip(eqn.outvars, [*carry_out, *ys]):
    write(v, o)
  return True
