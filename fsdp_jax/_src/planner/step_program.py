"""The step's own per-device program, compiled on the local backend.

:func:`fsdp_jax.shard_train_step` is traced for a plan on an abstract mesh
(``jax.sharding.AbstractMesh``: the mesh's devices need not exist), from a
state made of shapes (:func:`abstract_state`). The body of its
``shard_map`` is the program every device runs; it is evaluated again with
each collective replaced by a local computation of the same shapes (an
all-gather's result is a buffer of the gathered size, made from the
device's shard; a reduce-scatter's, the device's block of its operand at
an offset XLA cannot see; an all-reduce's, a copy of its operand) and
compiled for one local device, with the step's compiler options and its
donation of the state. Its ``memory_analysis()`` is the step's on that
mesh: the same per-device shapes, fusions, schedule and buffer assignment,
up to what the collectives themselves hold while they run, and one choice
of XLA's: it combines the loss's all-reduce with the gradient norm's, and
where it then computes the loss decides whether the logits stay alive to
the end of the step. Under tensor parallelism and with checkpointed units
(where XLA was measured to compute it late) the stand-ins tie the small
all-reduces to the last one as the combiner does (:func:`_combined_order`),
which keeps the logits too; elsewhere they do not (XLA computed it early
in every other configuration measured).

This costs one trace and one compile of the step (seconds for a small
model; minutes and gigabytes of host memory for a 70B-shaped one), so
:func:`fsdp_jax.estimate` compiles it for programs up to
:data:`AUTO_EQUATIONS` equations and models the peak from the segments
(:mod:`.schedule`) beyond.

The remat what-if compiles the step of a config with
``activation_checkpointing`` (the engine's ``jax.checkpoint`` around each
unit's computation, :mod:`fsdp_jax._src.schedule.checkpoints`) the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax._src import _compat, collectives, offload, optim
from fsdp_jax._src import state as state_lib, step as step_lib
from fsdp_jax._src.plan import Plan
from fsdp_jax._src.planner import programs, segments as segments_lib

# estimate(compile_step=None) compiles the step when the loss's per-device
# program has at most this many equations (nested ones counted). Measured on
# a 2-core machine with examples/llama.py's Llama: 4 blocks, 616 equations,
# about 6 s; Llama 3 8B's shape (32 blocks), 4,859 equations, 38 s and about
# 330 MB of host memory; 70B's (80 blocks), 12,059 equations, 146 s and
# 1.9 GB, so it is modelled.
AUTO_EQUATIONS = 5000


def count_equations(jaxpr) -> int:
  """Equations of ``jaxpr``, those of nested jaxprs included."""
  return sum(1 + sum(count_equations(j) for j in _compat.nested_jaxprs(e))
             for e in jaxpr.eqns)


def why_not_compiled(plan: Plan) -> Optional[str]:
  """Why the step's program cannot be compiled locally for this plan, or
  None when it can."""
  if plan.opt_update is not None and plan.opt_update.mode == "global":
    return ("the optimizer runs on the global view, outside the per-device program "
            f"({type(plan.optimizer).__name__})")
  if plan.stateful_hook:
    return "a stateful communication hook"
  return None


def abstract_state(plan: Plan, model_state: Any, rng: Any) -> state_lib.ShardedTrainState:
  """The :class:`~fsdp_jax.ShardedTrainState` :func:`fsdp_jax.init_train_state`
  would return for ``plan``, as shapes (the plan's mesh may be abstract)."""
  # Their shardings are on the plan's mesh, with the memory kind the step
  # reads them from (host memory under CPU offload).
  params = plan.storage_shapes()
  opt_state = optim.stored_shapes(plan, plan.opt_layout)
  int32 = jax.ShapeDtypeStruct((), jnp.int32)
  return state_lib.ShardedTrainState(
      step=int32, params=params, opt_state=opt_state, model_state=model_state,
      comm_hook_state=None, nonfinite_steps=int32 if plan.nonfinite == "skip" else None,
      rng=rng, plan=plan)


@dataclasses.dataclass(frozen=True)
class StepMemory:
  """The compiled per-device step's ``memory_analysis()``: ``total`` is
  argument + temp + output - alias, as the planner defines the peak;
  ``device_total`` counts device memory only (with CPU offload the state is
  in host memory)."""

  argument: int
  temp: int
  output: int
  alias: int
  total: int
  device_total: int
  flops: float


def compile_step(loss_fn, plan: Plan, batch, *, model_state: Any = None, rng: Any = None,
                 gradient_accumulation_steps: int = 1, accumulation: str = "no_sync",
                 checkpointed: bool = True) -> StepMemory:
  """Traces the step for ``plan`` (any mesh) and compiles its per-device
  program on one local device (see the module docstring). ``batch``: the
  global batch's shapes; ``checkpointed``: whether the loss calls
  ``jax.checkpoint`` (the step's compiler options depend on it)."""
  state = abstract_state(plan, model_state, rng)
  step = step_lib.shard_train_step(loss_fn, gradient_accumulation_steps=gradient_accumulation_steps,
                                   accumulation=accumulation)
  # Traced and lowered as the step is (jax's own remat and scan, not the
  # classic ones the segments use).
  closed = step_lib.step_jaxpr(step, state, batch)
  body = _shard_map_body(closed)
  jaxpr, consts = _compat.split_closed(body)
  sizes = {a: int(s) for a, s in plan.mesh.shape.items()}
  # The step donates the state: the parameter, optimizer, model and hook
  # state leaves (the step's first inputs), wherever the body reads them (a
  # context axis's constants come before them).
  state_in = _state_inputs(closed, len(jax.tree.leaves(
      (state.params, state.opt_state, state.model_state, state.comm_hook_state))))
  donated = tuple(k for k, p in enumerate(state_in) if p is not None)
  on_host = plan.offloaded
  structs = [_input_struct(v.aval, on_host and state_in[k] is not None
                           and state_in[k] < _n_offloaded(state))
             for k, v in enumerate(jaxpr.invars)]

  # Where XLA computes the loss once it combined the loss's all-reduce with
  # the gradient norm's: measured late (the logits alive to the end of the
  # step) under tensor parallelism and with checkpointed units, early in
  # the other configurations of benchmarks/PLANNER.md; there the stand-ins
  # read the loss with the gradient norm (an upper bound where XLA chose
  # early after all: one logits-sized buffer over).
  combine = checkpointed or plan.config.tensor_parallel is not None

  def local(*args):
    return _evaluate(jaxpr, consts, list(args), sizes, combine=combine)

  with warnings.catch_warnings():
    # A state leaf no result can reuse (as in the step itself): not the
    # user's concern here.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    lowered = jax.jit(local, donate_argnums=donated,
                      compiler_options=programs.local_options(checkpointed=checkpointed)
                      ).lower(*structs)
    compiled = lowered.compile()
  m = compiled.memory_analysis()
  arg, temp, out, alias = (int(m.argument_size_in_bytes), int(m.temp_size_in_bytes),
                           int(m.output_size_in_bytes), int(m.alias_size_in_bytes))
  total = arg + temp + out - alias
  device_total = total
  if plan.offloaded:
    entry = offload.entry_memory_bytes(compiled.as_text())
    device_total = (entry.argument_device_bytes + temp + entry.output_device_bytes
                    - max(0, alias - entry.output_host_bytes))
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return StepMemory(arg, temp, out, alias, total, device_total,
                    float((cost or {}).get("flops", 0.0)))


def _n_offloaded(state) -> int:
  """Inputs the step reads from host memory under CPU offload: the
  parameters and the optimizer state (the first ones)."""
  return len(jax.tree.leaves((state.params, state.opt_state)))


def _input_struct(aval, on_host: bool):
  if not on_host:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype)
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=jax.sharding.SingleDeviceSharding(
      jax.local_devices()[0], memory_kind="pinned_host"))


def _state_inputs(closed, n_state: int) -> list:
  """Per input of the step's ``shard_map`` body: the index of the step's
  input (a state leaf: one of the first ``n_state``) it is, else None."""
  (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
  outer = {v: k for k, v in enumerate(closed.jaxpr.invars[:n_state])}
  return [None if isinstance(v, _compat.Literal) else outer.get(v) for v in eqn.invars]


def _shard_map_body(closed):
  """The body of the step's one ``shard_map`` equation."""
  found = [e for e in closed.jaxpr.eqns if e.primitive.name == "shard_map"]
  if len(found) != 1:
    raise NotImplementedError(f"the step traced to {len(found)} shard_map equations, not one")
  return found[0].params["jaxpr"]


# --------------------------------------------------------------------------
# Collectives as local computations


_FSDP_PRIMITIVES = collectives.IMPLEMENTATIONS


def _named_axes(eqn) -> tuple:
  """The mesh axes ``eqn`` runs over (a reduction's ``axes`` are array
  dimensions, not mesh axes)."""
  out = []
  for v in _compat.axis_params(eqn).values():
    for a in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(a, str):
        out.append(a)
  return tuple(out)


def _is_collective(eqn) -> bool:
  return eqn.primitive in _FSDP_PRIMITIVES or (
      bool(_named_axes(eqn)) and eqn.primitive.name not in ("pjit", "jit"))


def _has_collective(jaxpr) -> bool:
  return any(_is_collective(e) or any(_has_collective(j) for j in _compat.nested_jaxprs(e))
             for e in jaxpr.eqns)


def _stand_in(eqn, invals, sizes: dict) -> list:
  """A local computation with the shapes of collective ``eqn``'s results."""
  if eqn.primitive.name == "all_gather":
    x, o = invals[0], eqn.outvars[0].aval
    d, tiled = _compat.collective_layout(eqn)
    copies = o.shape[d] // x.shape[d] if tiled else o.shape[d]
    y = jnp.broadcast_to(jnp.expand_dims(x, d), x.shape[:d] + (copies,) + x.shape[d:])
    # A buffer of its own, as the all-gather's result is (not fused into
    # what reads it).
    return [jax.lax.optimization_barrier(y.reshape(o.shape).astype(o.dtype))]
  if eqn.primitive.name in ("reduce_scatter", "psum_scatter"):
    # This device's block of the operand, at an offset XLA cannot see (as
    # the device's index is): a fixed slice would let it compute only the
    # rows kept.
    x, o = invals[0], eqn.outvars[0].aval
    d, tiled = _compat.collective_layout(eqn)
    index = jax.lax.optimization_barrier(jnp.zeros((), jnp.int32))
    if tiled:
      block = jax.lax.dynamic_slice_in_dim(x, index * o.shape[d], o.shape[d], axis=d)
    else:
      block = jnp.squeeze(jax.lax.dynamic_slice_in_dim(x, index, 1, axis=d), axis=d)
    return [jax.lax.optimization_barrier(block.astype(o.dtype))]
  outs = segments_lib.stand_in(eqn, invals, sizes)
  # Each result a buffer of its own, as a collective's is: an all-reduce's
  # result is not its operand (a product with a one XLA cannot see through),
  # a reduce-scatter's not a view of its operand.
  one = jax.lax.optimization_barrier(jnp.ones((), jnp.float32))
  return [jax.lax.optimization_barrier(
      o * one.astype(o.dtype) if jnp.issubdtype(o.dtype, jnp.inexact) else o) for o in outs]


# An all-reduce of at most this many elements is one XLA's all-reduce
# combiner merges with the step's last one (the gradient norm's).
_SMALL_ALL_REDUCE = 64


def _small_all_reduce(eqn) -> bool:
  return (_is_collective(eqn) and eqn.primitive not in _FSDP_PRIMITIVES
          and "psum" in eqn.primitive.name
          and sum(int(np.prod(v.aval.shape)) for v in eqn.invars
                  if hasattr(v.aval, "shape")) <= _SMALL_ALL_REDUCE)


def _combined_order(jaxpr) -> tuple:
  """``(order, tied)``: the equations' order with each small all-reduce the
  last one does not depend on (the loss's, the token count's) moved, with
  what depends on it, to the last one (the gradient norm's), and the
  positions in ``order`` of the all-reduces that then read their operands
  together. XLA's all-reduce combiner merges them into one all-reduce at
  the end of the step; where the loss is then computed (late: its inputs,
  the logits, stay alive through the backward) is XLA's choice, which the
  stand-ins reproduce only with this dependence (measured: Llama's logits
  under tensor parallelism, a checkpointed model's)."""
  eqns = jaxpr.eqns
  small = [k for k, e in enumerate(eqns) if _small_all_reduce(e)]
  if len(small) < 2:
    return list(range(len(eqns))), ()
  last = small[-1]
  moved = set()
  for a in small[:-1]:
    tainted = set(eqns[a].outvars)
    deps = {a}
    for k in range(a + 1, last + 1):
      if any(not isinstance(v, _compat.Literal) and v in tainted for v in eqns[k].invars):
        tainted.update(eqns[k].outvars)
        deps.add(k)
    if last not in deps:
      moved |= deps
  if not moved:
    return list(range(len(eqns))), ()
  inputs = {v for k in moved | {last} if k in small for v in eqns[k].invars
            if not isinstance(v, _compat.Literal)}
  if any(v in inputs for k in moved for v in eqns[k].outvars):
    return list(range(len(eqns))), ()  # an operand made by a moved equation
  before = [k for k in range(last) if k not in moved]
  after = sorted(moved)
  order = before + [k for k in after if k in small] + [last] + [
      k for k in after if k not in small] + list(range(last + 1, len(eqns)))
  start = len(before)
  tied = tuple(range(start, start + sum(1 for k in after if k in small) + 1))
  return order, tied


def _evaluate(jaxpr, consts, args, sizes: dict, combine: bool = False) -> list:
  """``jaxpr`` evaluated with its collectives (fsdp_jax's gathers and
  reductions through their implementations) replaced by stand-ins;
  ``combine``: the step's body, whose small all-reduces XLA combines
  (:func:`_combined_order`)."""
  env: dict = {}
  read = lambda v: v.val if isinstance(v, _compat.Literal) else env[v]
  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
  axis_env = list(sizes.items())
  order, tied = _combined_order(jaxpr) if combine else (list(range(len(jaxpr.eqns))), ())
  tied_in: dict = {}
  for p, i in enumerate(order):
    eqn = jaxpr.eqns[i]
    if tied and p == tied[0]:
      # the combined all-reduce reads every operand at once
      ins = [read(v) for q in tied for v in jaxpr.eqns[order[q]].invars]
      ins = list(jax.lax.optimization_barrier(ins))
      for q in tied:
        n = len(jaxpr.eqns[order[q]].invars)
        tied_in[q], ins = ins[:n], ins[n:]
    invals = tied_in[p] if p in tied_in else [read(v) for v in eqn.invars]
    if eqn.primitive in _FSDP_PRIMITIVES:
      impl = functools.partial(_FSDP_PRIMITIVES[eqn.primitive], **eqn.params)
      inner = jax.make_jaxpr(impl, axis_env=axis_env)(*[v.aval for v in eqn.invars])
      outs = _evaluate(inner.jaxpr, inner.consts, invals, sizes)
    elif _is_collective(eqn):
      outs = _stand_in(eqn, invals, sizes)
    else:
      if any(_has_collective(j) for j in _compat.nested_jaxprs(eqn)):
        eqn = _compat.rebuild_params(eqn, {}, lambda j: _localize(j, sizes))
      outs = _compat.bind_eqn(eqn, invals)
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
  return [read(v) for v in jaxpr.outvars]


def _localize(value, sizes: dict):
  """A nested jaxpr with its collectives replaced by stand-ins."""
  return segments_lib.localize_nested(value, _has_collective,
                                      lambda j, c, a: _evaluate(j, c, a, sizes))
