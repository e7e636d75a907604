"""Running ``optimizer.init`` / ``optimizer.update`` for a step: on the shards
(the evaluator), in the global view (the compiler partitions it), and the
choice between them.
"""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fsdp_jax._src import layout
from fsdp_jax._src._compat import Literal
from fsdp_jax._src.plan import Plan, param_specs, split_trainable
from fsdp_jax._src.optim.stored import (OptLayout, ShardedOptState, build_layout, cast,
    logical_grads, logical_params, slot_items, slot_tree, stored_shapes, stored_specs,
    user_tree)
from fsdp_jax._src.optim.evaluator import (Assembler, Geometry, Rep, ShardedEvaluator,
    UpdateReport, param_values, state_values)


# ---------------------------------------------------------------------------
# init and update on shards (inside shard_map)


def as_transformation(optimizer):
  """An optax ``GradientTransformation`` from what users pass: a
  transformation, or an object with ``init`` and ``update`` (``optax.MultiSteps``)."""
  if isinstance(optimizer, optax.GradientTransformation):
    return optimizer
  make = getattr(optimizer, "gradient_transformation", None)
  if callable(make):
    return make()
  if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
    return optax.GradientTransformationExtraArgs(optimizer.init, optimizer.update)
  raise TypeError("optimizer must be an optax.GradientTransformation (e.g. optax.adam(1e-3)) "
                  f"or an object with init and update; got {type(optimizer).__name__}.")


def takes_value(optimizer) -> bool:
  """Whether ``optimizer.update`` accepts ``value=`` (the loss): optax's
  transformations with extra-argument support do."""
  if not isinstance(optimizer, optax.GradientTransformationExtraArgs):
    return False
  try:
    params = inspect.signature(optimizer.update).parameters.values()
  except (TypeError, ValueError):
    return False
  return any(p.name == "value" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


_COMBINATORS = ("chain", "named_chain", "partition", "multi_transform", "masked",
                "inject_hyperparams", "with_extra_args_support")


def _failing_transformation(exc, optimizer) -> str:
  """The innermost optax transformation in ``exc`` (its ``update``'s
  qualified name, e.g. ``scale_by_zoom_linesearch``), else the optimizer's."""
  import re  # pylint: disable=import-outside-toplevel
  names = []
  tb = exc.__traceback__
  while tb is not None:
    q = getattr(tb.tb_frame.f_code, "co_qualname", tb.tb_frame.f_code.co_name)
    if "<locals>" in q:
      names.append(q.split(".<locals>")[0])
    tb = tb.tb_next
  names += re.findall(r"(\w+)\.<locals>\.\w+\(\)", str(exc))
  inner = [n for n in names if n not in _COMBINATORS]
  if inner:
    return inner[-1]
  return _name(optimizer).split(".<locals>")[0]


def _trace(fn, *args):
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
  return closed, out_shape


def _name(optimizer) -> str:
  fn = getattr(optimizer, "update", None)
  return getattr(fn, "__qualname__", repr(optimizer))


def abstract_init(plan: Plan, optimizer):
  """``jax.eval_shape(optimizer.init, logical params)``, with a clear error
  when the optimizer cannot be initialised on the user's tree."""
  return trace_init(plan, optimizer)[1]


def trace_init(plan: Plan, optimizer):
  """``(closed jaxpr, shapes)`` of ``optimizer.init`` on the logical params
  (one trace serves :func:`layout_for` and :func:`init_local`)."""
  try:
    return _trace(optimizer.init, logical_params(plan))
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
        f"optimizer.init failed on the parameter tree ({type(e).__name__}: {e}). The "
        "optimizer sees the tree passed to init_train_state (frozen leaves are None). "
        "Fix: build the optimizer (masks, labels) for that tree.") from e


def layout_for(plan: Plan, optimizer, init_shapes=None) -> OptLayout:
  """``init_shapes``: :func:`trace_init`'s shapes, when already traced."""
  return build_layout(plan, abstract_init(plan, optimizer) if init_shapes is None
                      else init_shapes)


def init_local(plan: Plan, optimizer, lay: OptLayout, trainable_local, report=None,
               closed=None):
  """Inside ``shard_map``: the stored optimizer state from the local
  trainable param shards. ``closed``: :func:`trace_init`'s jaxpr, when
  already traced."""
  ev = ShardedEvaluator(plan, report)
  if closed is None:
    closed, _ = _trace(optimizer.init, logical_params(plan))
  pvals = param_values(plan, trainable_local, ev.geo)
  args = [pvals[l.index] for l in plan.leaves if not l.frozen]
  outs = ev.run(closed.jaxpr, closed.consts, args)
  return _store_state(ev, lay, outs)


def constant_init(plan: Plan, lay: OptLayout, closed) -> ShardedOptState | None:
  """The stored state of an ``optimizer.init`` whose every leaf is a
  constant (Adam, SGD with momentum, Lion, Adafactor, LAMB, Muon, constant
  hyperparameters: zeros and numbers), built on the host shard by shard
  with no program to trace or compile; None where ``init`` reads the params
  (a copy of them: schedule-free weights), computes (a schedule's value at
  step 0), holds a slot value other than zero (its padding must stay zero:
  the evaluated init writes it) or a typed PRNG key."""
  if any(jax.dtypes.issubdtype(e.dtype, jax.dtypes.prng_key) for e in lay.entries):
    return None
  values = _constants(closed)
  if values is None:
    return None
  for e, v in zip(lay.entries, values):
    if e.kind == "slot" and not (np.ndim(v) == 0 and v.tobytes() == bytes(v.nbytes)):
      return None  # zero bits only (not -0.0)
  shapes = stored_shapes(plan, lay)

  def filled(s, value):
    shard = lambda index: np.full(s.sharding.shard_shape(s.shape), value, s.dtype)
    if np.ndim(value) > 0:  # an array constant: replicated, its own value
      shard = lambda index: np.array(np.broadcast_to(value, s.shape), s.dtype)
    return jax.make_array_from_callback(s.shape, s.sharding, shard)

  slots = {name: jax.tree.map(lambda s: filled(s, 0), tree) for name, tree in shapes.slots.items()}
  leaves = {e.path: filled(shapes.leaves[e.path], v)
            for e, v in zip(lay.entries, values) if e.kind != "slot"}
  return ShardedOptState(slots, leaves, lay)


def _constants(closed) -> list | None:
  """Host values of a closed jaxpr's outputs when none depends on its
  inputs and each is a literal, a constant, a scalar's broadcast (kept a
  scalar) or a conversion of one; None otherwise."""
  jaxpr = closed.jaxpr
  env = {v: c for v, c in zip(jaxpr.constvars, closed.consts)}
  made_by = {o: eqn for eqn in jaxpr.eqns for o in eqn.outvars}

  def value(v):
    if isinstance(v, Literal):
      return np.asarray(v.val, v.aval.dtype)
    if v in env:
      return env[v]
    eqn = made_by.get(v)
    name = eqn.primitive.name if eqn is not None else None
    if name == "broadcast_in_dim":
      x = value(eqn.invars[0])
      if x is None or np.ndim(x) == 0 or np.shape(x) == tuple(eqn.outvars[0].aval.shape):
        return x
      return None  # an array broadcast along new dimensions: evaluated instead
    if name in ("convert_element_type", "copy"):
      x = value(eqn.invars[0])
      return None if x is None else np.asarray(x).astype(eqn.outvars[0].aval.dtype)
    return None  # an input, or computed from one

  out = []
  for v in jaxpr.outvars:
    x = value(v)
    if x is None or isinstance(x, jax.core.Tracer):
      return None
    out.append(np.asarray(x))
  return out


def _store_state(ev: ShardedEvaluator, lay: OptLayout, outs) -> ShardedOptState:
  plan = ev.plan
  asm = Assembler(ev)
  per_slot: dict = {}
  leaves = {}
  for e, v in zip(lay.entries, outs):
    if e.kind == "slot":
      per_slot.setdefault(e.slot, ({}, {}))
      per_slot[e.slot][0][e.param] = v
      per_slot[e.slot][1][e.param] = e.dtype
    else:
      r = ev.to_rep(v)
      if r.own:
        raise NotImplementedError(
            f"Optimizer state leaf opt_state.{e.path} depends on the per-device gradients of "
            "ignored_states parameters, so it would differ between devices, but it is not "
            "per-parameter state fsdp_jax can keep per device. Fix: leave those parameters "
            "out of ignored_states, or out of this transformation (optax.masked).")
      leaves[e.path] = cast(r.value, e.dtype, e.shape)
  slots = {}
  for slot in lay.slot_names:
    vals, dtypes = per_slot[slot]
    slots[slot] = slot_tree(plan, asm.store(vals, dtypes))
  return ShardedOptState(slots, leaves, lay)


def update_local(plan: Plan, optimizer, grads, opt_state: ShardedOptState, params, *,
                 value=None, report=None, index=None, host: bool = False):
  """Inside ``shard_map``: one optimizer step on the local shards.

  ``grads`` and ``params`` are the local trainable gradient and parameter
  shards (the layout of :func:`fsdp_jax.custom.split_trainable`'s first output).
  Returns ``(new trainable params, new ShardedOptState)``.
  """
  lay = opt_state.layout
  ev = ShardedEvaluator(plan, report, index, host=host)
  lg, lp = logical_grads(plan), logical_params(plan)
  state_tree = jax.tree_util.tree_unflatten(
      lay.treedef, [jax.ShapeDtypeStruct(e.shape, e.dtype) for e in lay.entries])
  extra = value is not None and takes_value(optimizer)

  def step(g, s, p, *v):
    kw = {"value": v[0]} if extra else {}
    updates, new_s = optimizer.update(g, s, p, **kw)
    return optax.apply_updates(p, updates), new_s

  args = (lg, state_tree, lp) + ((jax.ShapeDtypeStruct((), jnp.float32),) if extra else ())
  try:
    closed, out_shape = _trace(step, *args)
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
        f"The optimizer's update ({_failing_transformation(e, optimizer)}) failed when traced "
        "on the parameter "
        f"tree ({type(e).__name__}: {e}). fsdp_jax calls optimizer.update(grads, opt_state, "
        "params) with the tree passed to init_train_state"
        + (" and value=<global mean loss>" if extra else "")
        + "; transformations that need other arguments (optax.lbfgs's value_fn, a "
        "reduce_on_plateau without value) cannot run inside shard_train_step. Fix: use "
        "another transformation, or write a custom step (docs/custom_step.md).") from e
  gvals = param_values(plan, grads, ev.geo)
  pvals = param_values(plan, params, ev.geo)
  args = ([gvals[l.index] for l in plan.leaves if not l.frozen]
          + state_values(plan, lay, opt_state)
          + [pvals[l.index] for l in plan.leaves if not l.frozen]
          + ([Rep(jnp.asarray(value, jnp.float32))] if extra else []))
  outs = ev.run(closed.jaxpr, closed.consts, args)
  n_params = sum(not l.frozen for l in plan.leaves)
  new_p, new_s = outs[:n_params], outs[n_params:]
  trainable = [l for l in plan.leaves if not l.frozen]
  asm = Assembler(ev)
  stored = asm.store({l.index: v for l, v in zip(trainable, new_p)},
                     {l.index: jnp.dtype(l.dtype) for l in trainable})
  new_params = _trainable_tree(plan, stored)
  return new_params, _store_state(ev, lay, new_s)


def _trainable_tree(plan: Plan, stored: dict):
  """Stored local arrays by key -> the layout of ``split_trainable``'s first
  output."""
  if plan.use_orig_params:
    return jax.tree_util.tree_unflatten(
        plan.treedef, [None if l.frozen else stored[l.index] for l in plan.leaves])
  return {k: stored[k] for k in sorted(stored)}


def analyse(plan: Plan, optimizer, lay: OptLayout) -> UpdateReport:
  """Traces one sharded update abstractly and reports what it needs."""
  report = UpdateReport()
  p_specs = split_trainable(plan, param_specs(plan))[0]
  o_specs = stored_specs(plan, lay)
  shapes = split_trainable(plan, plan.storage_shapes())[0]
  o_shapes = stored_shapes(plan, lay)

  def body(g, s, p):
    return update_local(plan, optimizer, g, s, p, value=jnp.zeros((), jnp.float32),
                        report=report)

  fn = jax.shard_map(body, mesh=plan.mesh, in_specs=(p_specs, o_specs, p_specs),
                     out_specs=(p_specs, o_specs), check_vma=False)
  strip = lambda t: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), t)
  jax.eval_shape(fn, strip(shapes), strip(o_shapes), strip(shapes))
  return report


# ---------------------------------------------------------------------------
# The update in the global view (the compiler partitions it)


def _unpack_units(plan: Plan, tree, ids=None) -> dict:
  """A global tree laid out like the stored params (or a slot of it) ->
  ``{leaf id: logical array}`` for the leaves in ``ids`` (default: all
  trainable ones present)."""
  out = {}
  present = slot_items(plan, tree)
  for unit in plan.units:
    want = [i for i in unit.leaf_ids if (ids is None or i in ids) and not plan.leaves[i].frozen]
    if not want:
      continue
    if plan.use_orig_params:
      if not all(i in present for i in want):
        want = [i for i in want if i in present]
      if not want:
        continue
      sub = dataclasses.replace(unit, leaf_ids=tuple(want))
      arrays = [present[i] for i in want]
    else:
      if unit.flat_key not in present:
        continue
      sub = unit
      arrays = [present[unit.flat_key]]
    full = layout.unpack_storage_full(plan, sub, arrays)
    out.update({i: full[i] for i in want})
  return out


def _pack_units(plan: Plan, values: dict, dtypes: dict) -> dict:
  """``{leaf id: logical array}`` -> ``{storage key: stored global array}``
  (absent leaves of a flat unit are zeros)."""
  out = {}
  for unit in plan.units:
    ids = [i for i in unit.leaf_ids if i in values]
    if not ids:
      continue
    if plan.use_orig_params:
      sub = dataclasses.replace(unit, leaf_ids=tuple(ids))
      packed = layout.pack_unit(plan, sub, {i: values[i].astype(dtypes[i]) for i in ids})
      out.update(packed)
    else:
      dtype = dtypes[ids[0]]
      full = {i: (values[i].astype(dtype) if i in values else
                  jnp.zeros(plan.leaves[i].shape, dtype)) for i in unit.leaf_ids}
      out[unit.flat_key] = layout.pack_unit(plan, unit, full)["flat"]
  return out


def _check_global(plan: Plan) -> None:
  own = [l.name for l in plan.leaves if l.ignored and not l.frozen]
  if own:
    raise ValueError(
        f"FSDPConfig(optimizer_update='global') runs the optimizer on the global view "
        f"of the parameters, but {own[:4]} are ignored_states parameters whose copies "
        "differ per device. Fix: use optimizer_update='auto' (or 'sharded').")
  if plan.offloaded:
    raise ValueError(
        "FSDPConfig(optimizer_update='global') cannot run with CPUOffload(offload_params=True) "
        "(the offloaded update runs on each device's host shards). Fix: use "
        "optimizer_update='auto'.")


def update_global(plan: Plan, optimizer, grads, opt_state: ShardedOptState, params, *,
                  value=None):
  """Under ``jax.jit``, outside ``shard_map``: one optimizer step on the
  logical (unpadded) tree built from the stored global arrays, partitioned by
  the compiler from the state's shardings. ``grads`` / ``params`` are the
  trainable stored arrays (``split_trainable``'s first output). Returns
  ``(new trainable params, new ShardedOptState)``."""
  lay = opt_state.layout
  g = _unpack_units(plan, grads)
  p = _unpack_units(plan, params)
  trainable = [l for l in plan.leaves if not l.frozen]
  slots = {slot: _unpack_units(plan, tree) for slot, tree in opt_state.slots.items()}
  state_leaves = [slots[e.slot][e.param] if e.kind == "slot" else opt_state.leaves[e.path]
                  for e in lay.entries]
  s = jax.tree_util.tree_unflatten(lay.treedef, state_leaves)
  kw = {}
  if value is not None and takes_value(optimizer):
    kw["value"] = value
  gt, pt = user_tree(plan, g), user_tree(plan, p)
  updates, new_s = optimizer.update(gt, s, pt, **kw)
  new_pt = optax.apply_updates(pt, updates)
  new_p = {l.index: x for l, x in zip(trainable, jax.tree_util.tree_leaves(new_pt))}
  stored = _pack_units(plan, new_p, {l.index: jnp.dtype(l.dtype) for l in trainable})
  new_leaves = lay.treedef.flatten_up_to(new_s)
  per_slot: dict = {}
  leaves = {}
  for e, x in zip(lay.entries, new_leaves):
    if e.kind == "slot":
      per_slot.setdefault(e.slot, ({}, {}))
      per_slot[e.slot][0][e.param] = jnp.asarray(x)
      per_slot[e.slot][1][e.param] = e.dtype
    else:
      leaves[e.path] = cast(x, e.dtype, e.shape)
  new_slots = {slot: slot_tree(plan, _pack_units(plan, *per_slot[slot]))
               for slot in lay.slot_names}
  new_state = ShardedOptState(new_slots, leaves, lay)
  # The compiler would choose its own layouts for these results: keep the
  # state's (the next step is compiled for them).
  new_state = jax.lax.with_sharding_constraint(
      new_state, jax.tree.map(lambda s: s.sharding, stored_shapes(plan, lay)))
  p_sh = split_trainable(plan, plan.storage_shardings())[0]
  new_params = jax.lax.with_sharding_constraint(_trainable_tree(plan, stored), p_sh)
  return new_params, new_state


# ---------------------------------------------------------------------------
# Choosing how the update runs


@dataclasses.dataclass(frozen=True)
class UpdateMode:
  """How the step runs the optimizer: ``"sharded"`` (the shard-wise evaluator
  inside ``shard_map``) or ``"global"`` (the compiler partitions the update of
  the logical tree); ``summary`` says what the update needs."""

  mode: str
  summary: str

  def describe(self) -> str:
    return f"{self.mode}: {self.summary}"


def choose_mode(plan: Plan, optimizer) -> UpdateMode:
  """Reads what ``optimizer.update`` computes (one abstract trace on the
  shards) and picks how to run it (``FSDPConfig.optimizer_update``)."""
  requested = plan.config.optimizer_update
  lay = plan.opt_layout if plan.opt_layout is not None else layout_for(plan, optimizer)
  report = analyse(plan, optimizer, lay)
  if plan.offloaded and not report.elementwise:
    raise ValueError(
        f"The optimizer's update ({_name(optimizer)}) needs collectives on the shards "
        f"({report.summary()}), but with CPUOffload(offload_params=True) it runs on the "
        "host, where collectives are not available. Fix: keep whole-tensor steps out of the "
        "optimizer (e.g. clip with shard_train_step(max_norm=...) instead of "
        "optax.clip_by_global_norm), or drop cpu_offload.")
  if requested == "auto":
    # Measured (benchmarks/OPTIMIZERS.md): an update that needs no gather is
    # fastest on the shards in both layouts; one that gathers whole matrices
    # (Muon, factored Adafactor) is as fast or faster when the compiler
    # partitions it, because every device would otherwise redo the whole
    # computation. The global form cannot hold per-device (ignored) values
    # or run on the host (offload).
    global_ok = not plan.offloaded and not any(
        l.ignored and not l.frozen for l in plan.leaves)
    requested = "global" if report.gathers and global_ok else "sharded"
  if requested == "global":
    _check_global(plan)
    return UpdateMode("global", "the compiler partitions the update of the logical tree"
                      + (f" (on the shards it would need: {report.summary()})"
                         if not report.elementwise else ""))
  return UpdateMode("sharded", report.summary())


def shard_index(plan: Plan):
  """Inside ``shard_map``: this device's position along the shard axes."""
  return Geometry(plan).index
