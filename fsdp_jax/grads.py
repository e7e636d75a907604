"""Building blocks of a sharded train step, for use inside ``jax.shard_map``.

:func:`shard_train_step` composes them; research code that needs two losses,
EMA weights or its own optimizer loop composes them itself (see
``docs/custom_step.md``):

* :func:`param_specs`, :func:`batch_spec`, :func:`opt_state_specs` — the
  ``PartitionSpec`` s for ``jax.shard_map``;
* :func:`value_and_grad` — gathers each unit before its first use, runs the
  loss and its backward, and reduce-scatters each unit's gradient (with
  optional gradient accumulation over microbatches);
* :func:`clip_grad_norm` — PyTorch's ``clip_grad_norm_`` over the shards;
* :func:`optimizer_step` — PyTorch's ``optimizer.step()``: the optax
  optimizer on the user's tree, run exactly on the shards;
* :func:`split_trainable` / :func:`merge_trainable` — the parameters the
  optimizer updates (frozen parameters have no gradient and no optimizer
  state).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from fsdp_jax import collectives, hooks, layout, optim, schedule
from fsdp_jax.config import is_float_dtype
from fsdp_jax.plan import Plan


# --------------------------------------------------------------------------
# Specs


def param_specs(plan: Plan):
  """``PartitionSpec`` of every stored parameter array (``state.params``)."""
  return jax.tree.map(lambda s: s.spec, plan.storage_shardings(),
                      is_leaf=lambda x: isinstance(x, NamedSharding))


def batch_spec(plan: Plan) -> P:
  """Batch leaves are split along dim 0 over all data-parallel mesh axes."""
  axes = plan.axes.data_axes
  return P(axes[0] if len(axes) == 1 else axes)


def hook_state_spec(plan: Plan) -> P:
  """Per-device hook state: a leading device axis split over the data axes."""
  return batch_spec(plan)


# --------------------------------------------------------------------------
# Trainable / frozen


def split_trainable(plan: Plan, params):
  """Stored params -> ``(trainable, frozen)``.

  Flat layout: two dicts of flat parameters (a unit is all frozen or all
  trainable). Original layout: two trees shaped like the params, with
  ``None`` in place of the other kind's leaves.
  """
  if not plan.use_orig_params:
    frozen_keys = {u.flat_key for u in plan.units if u not in plan.trainable_units}
    frozen_keys |= {plan.ignored_key(l) for l in plan.ignored_leaves if l.frozen}
    return ({k: v for k, v in params.items() if k not in frozen_keys},
            {k: v for k, v in params.items() if k in frozen_keys})
  leaves = jax.tree_util.tree_leaves(params)
  train = [None if l.frozen else x for l, x in zip(plan.leaves, leaves)]
  frozen = [x if l.frozen else None for l, x in zip(plan.leaves, leaves)]
  return (jax.tree_util.tree_unflatten(plan.treedef, train),
          jax.tree_util.tree_unflatten(plan.treedef, frozen))


def merge_trainable(plan: Plan, trainable, frozen):
  """Inverse of :func:`split_trainable`."""
  if not plan.use_orig_params:
    out = {**frozen, **trainable}
    return {k: out[k] for k in sorted(out)}
  t = iter(jax.tree_util.tree_leaves(trainable))
  f = iter(jax.tree_util.tree_leaves(frozen))
  leaves = [next(f) if l.frozen else next(t) for l in plan.leaves]
  return jax.tree_util.tree_unflatten(plan.treedef, leaves)


def optimizer_step(optimizer, grads, opt_state, params, *, plan: Plan, value=None):
  """PyTorch's ``optimizer.step()`` inside ``jax.shard_map``.

  Runs ``optimizer.update`` and ``optax.apply_updates`` on the tree passed to
  ``init_train_state`` (its paths, unpadded shapes and dtypes; frozen leaves
  are ``None``), evaluated on this device's shards so that the result is what
  the optimizer computes unsharded (see :mod:`fsdp_jax.optim`): elementwise
  work stays local, a whole-parameter reduction costs one scalar all-reduce,
  an operation that needs a whole parameter gathers it.

  Args:
    optimizer: the optax transformation the state was built with.
    grads: the reduced gradient shards (``value_and_grad``'s output).
    opt_state: the stored optimizer state (``state.opt_state``'s shards).
    params: the stored parameter shards (``state.params``'s shards).
    plan: ``state.plan``.
    value: the loss, passed as ``value=`` to transformations that take it
      (``optax.contrib.reduce_on_plateau``).

  Returns:
    ``(new params, new opt_state)`` in the stored layout.

  Example (inside the body of a ``jax.shard_map``; see docs/custom_step.md)::

    out, grads, _ = vg(params, batch)
    params, opt_state = fsdp_jax.optimizer_step(opt, grads, opt_state, params,
                                                plan=plan)
  """
  trainable, frozen = split_trainable(plan, params)
  optimizer = optim.as_transformation(optimizer)
  new_trainable, new_state = optim.update_local(plan, optimizer, grads, opt_state, trainable,
                                                value=value)
  return merge_trainable(plan, new_trainable, frozen), new_state


def trainable_shapes(plan: Plan):
  """``ShapeDtypeStruct`` s of what the optimizer sees (global view)."""
  trainable, _ = split_trainable(plan, plan.storage_shapes())
  return trainable


# --------------------------------------------------------------------------
# The loss with gathers


def _cast_floats(tree, dtype, only=None):
  """Casts floating leaves to ``dtype``; with ``only`` (top-level keys), just
  the leaves under those keys."""
  def cast(path, x):
    if not hasattr(x, "dtype"):
      return x
    if only is not None:
      top = path[0] if path else None
      key = getattr(top, "key", getattr(top, "idx", getattr(top, "name", None)))
      if key not in only:
        return x
    return x.astype(dtype) if is_float_dtype(x.dtype) else x
  return jax.tree_util.tree_map_with_path(cast, tree)


def _compute_dtype(plan: Plan, leaf):
  if leaf.ignored:  # not managed by FSDP: no mixed precision either
    return jnp.dtype(leaf.dtype)
  mp = plan.mixed_precision(plan.units[leaf.unit])
  if mp is not None and mp.param_dtype is not None and is_float_dtype(leaf.dtype):
    return jnp.dtype(mp.param_dtype)
  return jnp.dtype(leaf.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossOutput:
  """What the loss returned on this device: ``loss``, ``aux`` (or None) and
  the new ``model_state`` (or None)."""

  loss: Any
  aux: Any
  model_state: Any


def check_loss_output(out_shape, with_model_state: bool):
  """Splits ``loss_fn``'s output structure: returns ``(has_aux, ok)``."""

  def is_scalar(s):
    return hasattr(s, "shape") and s.shape == () and is_float_dtype(s.dtype)

  head = out_shape
  if with_model_state:
    if not (isinstance(out_shape, (tuple, list)) and len(out_shape) == 2):
      raise ValueError(
          "With model state, loss_fn(params, batch, model_state) must return "
          "(loss, new_model_state) or ((loss, aux), new_model_state); it returned "
          f"{jax.tree.map(lambda s: f'{s.dtype}{list(s.shape)}', out_shape)}.")
    head = out_shape[0]
  if is_scalar(head):
    return False
  if isinstance(head, (tuple, list)) and len(head) == 2 and is_scalar(head[0]):
    return True
  first = head[0] if isinstance(head, (tuple, list)) and head else head
  shape = getattr(first, "shape", None)
  raise ValueError(
      f"loss_fn must return a scalar floating-point loss (the mean over the "
      f"device's batch) or a (loss, aux) pair; it returned "
      f"{jax.tree.map(lambda s: f'{s.dtype}{list(s.shape)}', head)}"
      + (f" (loss of shape {shape})" if shape else "")
      + ". Fix: reduce it, e.g. `return jnp.mean(per_example_loss)`.")


def _cast_unit_inputs(plan: Plan):
  """PyTorch's ``cast_forward_inputs`` for non-root units: while ``loss_fn``
  is traced, a Flax linen module that is a unit whose MixedPrecision has
  ``cast_forward_inputs=True`` gets its floating arguments cast to that unit's
  ``param_dtype``. (Other frameworks need no cast: JAX promotes mixed dtypes
  where PyTorch would raise.)"""
  import contextlib  # pylint: disable=import-outside-toplevel
  casting = {}
  for unit in plan.units:
    mp = plan.mixed_precision(unit)
    if not unit.is_root and mp is not None and mp.cast_forward_inputs and mp.param_dtype is not None:
      casting[unit.name] = mp.param_dtype
  if not casting:
    return contextlib.nullcontext()
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  def interceptor(next_fun, args, kwargs, context):
    if context.method_name == "__call__":
      path = ".".join(str(p) for p in context.module.path)
      dtype = casting.get(path, casting.get(f"params.{path}"))
      if dtype is not None:
        args, kwargs = _cast_floats((args, kwargs), dtype)
    return next_fun(*args, **kwargs)

  return nn.intercept_methods(interceptor)


def make_local_loss(loss_fn: Callable, plan: Plan, *, forward_inputs=None):
  """``local(params, batch, model_state, probes) -> LossOutput``.

  With mixed precision and ``cast_root_forward_inputs``, floating batch
  leaves are cast to ``param_dtype`` before the loss runs: all of them, or
  only those under the top-level keys in ``forward_inputs`` (PyTorch casts the
  model's forward arguments, not the loss targets).

  Evaluates ``loss_fn`` on this device's batch with every unit gathered right
  before its first use. ``probes`` (``{leaf_id: zeros}`` or None) are added to
  the gathered leaves: their gradient is the leaf's full, unreduced local
  gradient (used by ``no_sync`` accumulation and stateful hooks).
  """
  mp_root = plan.config.mixed_precision
  full_structs = jax.tree_util.tree_unflatten(
      plan.treedef, [jax.ShapeDtypeStruct(l.shape, _compute_dtype(plan, l)) for l in plan.leaves])
  cast_inputs = (mp_root is not None and mp_root.param_dtype is not None
                 and mp_root.cast_root_forward_inputs)
  specs_per_unit = {u.index: layout.gather_specs(plan, u) for u in plan.units}
  with_model_state = plan.model_state_dtypes is not None

  def local(params, batch, model_state=None, probes=None):
    if cast_inputs:
      batch = _cast_floats(batch, mp_root.param_dtype, forward_inputs)
    structs = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    args = (full_structs, structs(batch)) + ((structs(model_state),) if with_model_state else ())
    with _cast_unit_inputs(plan):
      closed, out_shape = jax.make_jaxpr(loss_fn, return_shape=True)(*args)
    has_aux = check_loss_output(out_shape, with_model_state)
    storage = jax.tree_util.tree_leaves(params) if plan.use_orig_params else params

    def unit_locals(u):
      unit = plan.units[u]
      arrays = ([storage[i] for i in unit.leaf_ids] if plan.use_orig_params
                else [storage[unit.flat_key]])
      if probes is not None:
        arrays = arrays + [probes[i] for i in unit.leaf_ids if i in probes]
      return arrays

    def gather_arrays(u, arrays):
      unit = plan.units[u]
      n_store = len(unit.leaf_ids) if plan.use_orig_params else 1
      store, extra = arrays[:n_store], arrays[n_store:]
      local_arrays = dict(zip(unit.leaf_ids, store)) if plan.use_orig_params else {"flat": store[0]}
      probe_ids = [i for i in unit.leaf_ids if probes is not None and i in probes]
      probe_of = dict(zip(probe_ids, extra))
      out = {}
      for group, spec in specs_per_unit[u]:
        buf = layout.local_buffer(plan, unit, group, local_arrays)
        for i, v in zip(group, collectives.gather(buf, spec)):
          out[i] = v + probe_of[i] if i in probe_of else v
      return out

    # Ignored leaves are read straight from this device's own copy.
    direct = {}
    for l in plan.ignored_leaves:
      x = (storage[l.index] if plan.use_orig_params else storage[plan.ignored_key(l)])[0]
      direct[l.index] = x + probes[l.index] if probes is not None and l.index in probes else x
    g = schedule.Gatherer(
        gather_unit=lambda u: gather_arrays(u, unit_locals(u)),
        gather_layer=gather_arrays,
        leaf_unit={l.index: l.unit for l in plan.leaves if not l.ignored},
        direct=direct,
        stacked_units={u.index for u in plan.units if u.stacked},
        unit_layers={u.index: u.num_layers for u in plan.units},
        unit_storage=unit_locals,
        save_mixed=_recomputes_cheap_ops(plan))
    jaxpr = closed.jaxpr
    n_params = len(plan.leaves)
    lazy = {v: i for i, v in enumerate(jaxpr.invars[:n_params])}
    flat_args = [None] * n_params + jax.tree_util.tree_leaves(
        (batch,) + ((model_state,) if with_model_state else ()))
    outs = schedule.eval_with_gathers(jaxpr, closed.consts, flat_args, lazy, g)
    out = jax.tree_util.tree_unflatten(jax.tree.structure(out_shape), outs)
    new_ms = None
    if with_model_state:
      out, new_ms = out
    if has_aux:
      return LossOutput(out[0], out[1], new_ms)
    return LossOutput(out, None, new_ms)

  return local


def _recomputes_cheap_ops(plan: Plan) -> bool:
  """Whether the step's remat uses :func:`collectives.remat_policy`.

  Stacked units keep every residual but the gathers: recomputing the cheap
  operations of a scanned layer made the compiled program gather each layer
  a third time, in a loop of its own.
  """
  return (any(plan.reshard(u) for u in plan.units)
          and not any(u.stacked for u in plan.units))


def _maybe_remat(local, plan: Plan):
  if any(plan.reshard(u) for u in plan.units):
    policy = collectives.remat_policy if _recomputes_cheap_ops(plan) else (
        collectives.save_all_but_gathers)
    return jax.checkpoint(local, policy=policy, prevent_cse=True, static_argnums=())
  return local


# --------------------------------------------------------------------------
# Gradients


def _probe_shapes(plan: Plan) -> dict:
  return {l.index: jax.ShapeDtypeStruct(l.shape, _compute_dtype(plan, l))
          for l in plan.leaves if not l.frozen}


def _acc_dtype(plan: Plan, leaf):
  """Unreduced gradients accumulate in the unit's ``reduce_dtype``, at least
  float32 (a 16-bit accumulator would lose the small microbatch terms)."""
  if leaf.ignored:
    return jnp.promote_types(leaf.dtype, jnp.float32)
  spec = layout.gather_specs(plan, plan.units[leaf.unit])[0][1]
  return jnp.promote_types(spec.reduce_dtype, jnp.float32)


def reduce_full_grads(plan: Plan, full_grads: dict, hook_state=None):
  """Reduces full, unreduced local leaf gradients unit by unit.

  Returns ``(trainable grads in the stored layout, new hook state)``: one
  reduce-scatter (or hook call) per unit and dtype group.
  """
  hook = plan.config.comm_hook
  stateful = hooks.is_stateful(hook)
  new_hook_state = {} if stateful else None
  local = {}
  for unit in plan.trainable_units:
    prefix = plan.prefix(unit)
    for gi, (group, spec) in enumerate(layout.gather_specs(plan, unit)):
      if all(plan.leaves[i].frozen for i in group):
        continue
      scope = jax.named_scope(f"fsdp_reduce_scatter[{unit.display_name}]")
      scope.__enter__()
      full = collectives.pack_full([full_grads[i] for i in group], spec, prefix)
      if stateful:
        key = hook_key(unit, gi)
        reduced, st = hooks.call_hook(hook, jax.tree.map(lambda x: x[0], hook_state[key]),
                                      full, spec)
        new_hook_state[key] = jax.tree.map(lambda x: x[None], st)
      else:
        reduced = collectives.reduce_gradient(full, spec)
      reduced = collectives.finish_gradient(reduced, spec, spec.stored_dtype)
      scope.__exit__(None, None, None)
      for k, v in layout.split_local_buffer(plan, group, reduced).items():
        local[(unit.index, k)] = v
  # Ignored leaves: this device's own gradient, not reduced.
  for l in plan.ignored_leaves:
    if not l.frozen:
      local[("ignored", l.index)] = full_grads[l.index][None].astype(l.dtype)
  if plan.use_orig_params:
    leaves = [None if l.frozen else local[("ignored", l.index) if l.ignored else (l.unit, l.index)]
              for l in plan.leaves]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves), new_hook_state
  out = {u.flat_key: local[(u.index, "flat")] for u in plan.trainable_units}
  out.update({plan.ignored_key(l): local[("ignored", l.index)]
              for l in plan.ignored_leaves if not l.frozen})
  return {k: out[k] for k in sorted(out)}, new_hook_state


def hook_key(unit, group_index: int) -> str:
  return f"{unit.flat_key}#{group_index}"


def hook_state_shapes(plan: Plan):
  """Global shapes of a stateful hook's state: one state per device."""
  hook = plan.config.comm_hook
  if not hooks.is_stateful(hook):
    return None
  world = plan.axes.world_size
  out = {}
  for unit in plan.trainable_units:
    for gi, (group, spec) in enumerate(layout.gather_specs(plan, unit)):
      shape = plan.prefix(unit) + (spec.n, spec.chunk)
      st = jax.eval_shape(lambda: hook.init(shape, spec.reduce_dtype))
      out[hook_key(unit, gi)] = jax.tree.map(
          lambda s: jax.ShapeDtypeStruct((world,) + s.shape, s.dtype), st)
  return out


def check_microbatches(local_batch_shapes, k: int) -> None:
  """Every leaf's per-device batch dimension is divisible by ``k``."""
  for x in jax.tree.leaves(local_batch_shapes):
    if x.shape[0] % k:
      raise ValueError(
          f"The local batch has {x.shape[0]} rows on each device, which "
          f"gradient_accumulation_steps={k} does not divide. Fix: use a "
          f"per-device batch that is a multiple of {k} (global batch a multiple "
          f"of {k} x the data-parallel size), or change the number of microbatches.")


def _microbatches(batch, k: int):
  check_microbatches(batch, k)

  return jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)


def value_and_grad(loss_fn: Callable, *, plan: Plan, gradient_accumulation_steps: int = 1,
                   accumulation: str = "no_sync", forward_inputs=None):
  """Returns ``f(params, batch, model_state=None, hook_state=None)``, for use
  inside ``jax.shard_map`` on the local shards, computing
  ``(LossOutput, trainable_grads, new_hook_state)``.

  ``trainable_grads`` are the reduced, averaged gradient shards in the layout
  of :func:`split_trainable`'s first output.

  Gradient accumulation over ``gradient_accumulation_steps`` microbatches of
  the local batch:

  * ``"no_sync"`` (PyTorch's ``no_sync()``): each microbatch's full unreduced
    gradient is accumulated locally (in ``reduce_dtype``, at least float32)
    and every unit is reduced once at the end: fewer collectives, a full
    gradient of every unit held per device.
  * ``"sharded"``: every microbatch reduce-scatters its gradient into a
    sharded accumulator (in the stored dtype): one reduction per unit per
    microbatch, only the shard held.

  Either way the result equals one step over the whole local batch: the
  gradient is the mean over microbatches of each microbatch's mean gradient.

  ``forward_inputs``: see :func:`make_local_loss`.
  """
  if accumulation not in ("no_sync", "sharded"):
    raise ValueError(f"accumulation={accumulation!r}: use 'no_sync' or 'sharded'.")
  k = int(gradient_accumulation_steps)
  if k < 1:
    raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be >= 1.")
  local = _maybe_remat(make_local_loss(loss_fn, plan, forward_inputs=forward_inputs), plan)
  stateful_hook = hooks.is_stateful(plan.config.comm_hook)
  use_probes = stateful_hook or (k > 1 and accumulation == "no_sync")

  cfg = plan.config
  ordering = schedule.Ordering(
      backward_prefetch=None if cfg.backward_prefetch is None else cfg.backward_prefetch.name,
      forward_prefetch=bool(cfg.forward_prefetch),
      limit_all_gathers=bool(cfg.limit_all_gathers),
      reshard=frozenset(u.display_name for u in plan.units if plan.reshard(u)),
      forward_prefetch_units=cfg.forward_prefetch_units,
      backward_prefetch_units=cfg.backward_prefetch_units)

  def direct(params, batch, model_state):
    trainable, frozen = split_trainable(plan, params)

    def objective(t):
      out = local(merge_trainable(plan, t, frozen), batch, model_state, None)
      return out.loss, out

    (_, out), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
    return out, grads

  direct = schedule.ordered(direct, ordering)

  def probed(params, batch, model_state):
    params = jax.lax.stop_gradient(params)
    shapes = _probe_shapes(plan)
    probes = {i: jnp.zeros(s.shape, s.dtype) for i, s in shapes.items()}

    def objective(pr):
      out = local(params, batch, model_state, pr)
      return out.loss, out

    (_, out), full = jax.value_and_grad(objective, has_aux=True)(probes)
    return out, full

  probed = schedule.ordered(probed, ordering)

  def f(params, batch, model_state=None, hook_state=None):
    if k == 1:
      if use_probes:
        out, full = probed(params, batch, model_state)
        grads, new_hook = reduce_full_grads(plan, full, hook_state)
        return out, grads, new_hook
      out, grads = direct(params, batch, model_state)
      return out, grads, hook_state
    micro = _microbatches(batch, k)
    if use_probes:
      acc0 = {i: jnp.zeros(s.shape, _acc_dtype(plan, plan.leaves[i]))
              for i, s in _probe_shapes(plan).items()}
    else:
      acc0 = jax.tree.map(jnp.zeros_like, split_trainable(plan, params)[0])

    def body(carry, mb):
      acc, ms, loss_sum, aux_sum = carry
      if use_probes:
        out, g = probed(params, mb, ms)
      else:
        out, g = direct(params, mb, ms)
      acc = jax.tree.map(lambda a, x: a + x.astype(a.dtype) / k, acc, g)
      aux_sum = jax.tree.map(lambda t, a: t + jnp.asarray(a, jnp.float32) / k, aux_sum, out.aux)
      if out.model_state is not None:
        ms = jax.tree.map(lambda n, o: n.astype(o.dtype), out.model_state, ms)
      return (acc, ms, loss_sum + out.loss.astype(jnp.float32) / k, aux_sum), None

    # The aux structure (for the running mean) comes from an abstract trace.
    first = jax.tree.map(lambda x: x[0], micro)
    aux_shape = jax.eval_shape(lambda: local(params, first, model_state, None).aux)
    aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), aux_shape)
    carry = (acc0, model_state, jnp.zeros((), jnp.float32), aux0)
    carry, _ = lax.scan(body, carry, micro)
    acc, ms, loss, aux = carry
    out = LossOutput(loss, aux, ms)
    if use_probes:
      grads, new_hook = reduce_full_grads(plan, acc, hook_state)
      return out, grads, new_hook
    return out, acc, hook_state

  return f


# --------------------------------------------------------------------------
# Clipping


def _ignored_flags(plan: Plan):
  """A tree shaped like the stored params: True at ignored leaves."""
  if plan.use_orig_params:
    return jax.tree_util.tree_unflatten(plan.treedef, [l.ignored for l in plan.leaves])
  out = {u.flat_key: False for u in plan.units}
  out.update({plan.ignored_key(l): True for l in plan.ignored_leaves})
  return out


def _grad_dtypes(plan: Plan):
  """The dtype PyTorch's gradients would have per trainable leaf: the reduce
  dtype with ``keep_low_precision_grads``, else the stored dtype."""
  out = []
  for unit in plan.trainable_units:
    for group, spec in layout.gather_specs(plan, unit):
      d = spec.reduce_dtype if spec.keep_low_precision_grads else spec.stored_dtype
      out.extend(jnp.dtype(d) for i in group if not plan.leaves[i].frozen)
  out.extend(jnp.dtype(l.dtype) for l in plan.ignored_leaves if not l.frozen)
  return out


def grad_norm(grads, *, plan: Plan, norm_type: float = 2.0):
  """The total norm of the reduced gradient shards (inside ``jax.shard_map``):
  the norm of all gradients viewed as one vector, as
  :func:`clip_grad_norm` computes it, in the promoted dtype of the
  gradients. One scalar all-reduce over the shard axes."""
  total = _total_norm(grads, plan, float(norm_type))
  return total.astype(_norm_dtype(plan))


def _total_norm(grads, plan: Plan, norm_type: float):
  if not (norm_type > 0):
    raise ValueError(f"clip_grad_norm: norm_type={norm_type} must be > 0 or inf.")
  leaves = jax.tree.leaves(grads)
  is_ignored = jax.tree.leaves(split_trainable(plan, _ignored_flags(plan))[0])
  sharded = [x for x, ign in zip(leaves, is_ignored) if not ign]
  own = [x for x, ign in zip(leaves, is_ignored) if ign]
  axes = plan.axes.shard_axes
  zero = jnp.zeros((), jnp.float32)
  # Sharded gradients are summed over the shard axes; ignored parameters'
  # gradients are this device's own and count once (PyTorch adds the local
  # non-sharded norm after the all-reduce).
  if math.isinf(norm_type):
    amax = lambda xs: jnp.max(jnp.stack([zero] + [jnp.max(jnp.abs(x.astype(jnp.float32))) for x in xs]))
    local = amax(sharded)
    return jnp.maximum(lax.pmax(local, axes) if axes else local, amax(own))
  psum_ = lambda xs: sum((jnp.sum(jnp.abs(x.astype(jnp.float32)) ** norm_type) for x in xs), zero)
  local = psum_(sharded)
  return ((lax.psum(local, axes) if axes else local) + psum_(own)) ** (1.0 / norm_type)


def _norm_dtype(plan: Plan):
  dtypes = _grad_dtypes(plan) or [jnp.dtype(jnp.float32)]
  out_dtype = dtypes[0]
  for d in dtypes[1:]:
    out_dtype = jnp.promote_types(out_dtype, d)
  return out_dtype


def clip_grad_norm(grads, *, plan: Plan, max_norm: float, norm_type: float = 2.0):
  """PyTorch's ``FullyShardedDataParallel.clip_grad_norm_`` on local shards.

  Call inside ``jax.shard_map`` on the reduced gradient shards. The total norm
  is the norm of all gradients viewed as one vector: local sums of
  ``|g| ** norm_type`` (in float32) are summed over the shard axes (``max``
  for ``inf``); gradients replicated across devices (NO_SHARD, the replicate
  axis of HYBRID) count once. Gradients are scaled by
  ``clip(max_norm / (total_norm + 1e-6), max=1)``.

  Returns ``(clipped_grads, total_norm)``; the norm is the pre-clip norm in
  the promoted dtype of the gradients, as in PyTorch.
  """
  max_norm = float(max_norm)
  norm_type = float(norm_type)
  if not max_norm > 0:
    raise ValueError(f"clip_grad_norm: max_norm={max_norm} must be positive "
                     "(PyTorch clips to a norm > 0).")
  total = _total_norm(grads, plan, norm_type)
  coef = jnp.minimum(max_norm / (total + 1e-6), 1.0)
  clipped = jax.tree.map(lambda x: (x * coef.astype(x.dtype)).astype(x.dtype), grads)
  return clipped, total.astype(_norm_dtype(plan))


def nonfinite_leaves(grads, *, plan: Plan):
  """Per trainable parameter (in ``tree_leaves`` order), whether any element
  of its reduced gradient is non-finite, agreed over the data axes (inside
  ``jax.shard_map``; one small all-reduce)."""
  from fsdp_jax.optim import _Geometry  # pylint: disable=import-outside-toplevel
  geo = _Geometry(plan)
  flags = []
  stored = (jax.tree_util.tree_leaves(grads) if plan.use_orig_params else grads)
  it = iter(stored) if plan.use_orig_params else None
  for l in plan.leaves:
    if l.frozen:
      continue
    if plan.use_orig_params:
      x = next(it)
    else:
      x = grads[plan.ignored_key(l)] if l.ignored else grads[plan.units[l.unit].flat_key]
    bad = ~jnp.isfinite(x)
    if not l.ignored and not plan.use_orig_params and geo.has_padding(l.index):
      bad = bad & geo.valid(l.index)
    flags.append(jnp.any(bad))
  vec = jnp.stack(flags).astype(jnp.int32)
  return lax.pmax(vec, plan.axes.data_axes).astype(bool)
