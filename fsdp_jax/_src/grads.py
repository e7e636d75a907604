"""Building blocks of a sharded train step, for use inside ``jax.shard_map``.

:func:`shard_train_step` composes them; research code that needs two losses,
EMA weights or its own optimizer loop composes them itself (see
``docs/custom_step.md``):

* :func:`param_specs`, :func:`batch_spec`, :func:`opt_state_specs` — the
  ``PartitionSpec`` s for ``jax.shard_map``;
* :func:`value_and_grad` — gathers each unit before its first use, runs the
  loss and its backward, and reduce-scatters each unit's gradient (with
  optional gradient accumulation over microbatches);
* :func:`~fsdp_jax._src.clipping.clip_grad_norm` (in ``clipping.py``) — PyTorch's ``clip_grad_norm_`` over the shards;
* :func:`optimizer_step` — PyTorch's ``optimizer.step()``: the optax
  optimizer on the user's tree, run exactly on the shards;
* :func:`split_trainable` / :func:`merge_trainable` — the parameters the
  optimizer updates (frozen parameters have no gradient and no optimizer
  state).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from fsdp_jax._src import _compat
from fsdp_jax._src import collectives, frameworks, hooks, layout, offload, optim, schedule
from fsdp_jax._src import loss as loss_lib
from fsdp_jax._src.config import is_float_dtype, is_key_dtype
from fsdp_jax._src.plan import Plan


# --------------------------------------------------------------------------
# Specs


def param_specs(plan: Plan):
  """``PartitionSpec`` of every stored parameter array (``state.params``).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> from jax.sharding import PartitionSpec as P
    >>> fsdp_jax.custom.param_specs(state.plan) == {"_flat_param": P("shard")}  # one flat param
    True
  """
  return jax.tree.map(lambda s: s.spec, plan.storage_shardings(),
                      is_leaf=lambda x: isinstance(x, NamedSharding))


def batch_spec(plan: Plan) -> P:
  """Batch leaves are split along dim 0 over all data-parallel mesh axes.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> from jax.sharding import PartitionSpec as P
    >>> fsdp_jax.custom.batch_spec(state.plan) == P("shard")  # dim 0 over the data axes
    True
  """
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

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> trainable, frozen = fsdp_jax.custom.split_trainable(state.plan, state.params)
    >>> sorted(trainable), frozen
    (['_flat_param'], {})
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
  """Inverse of :func:`split_trainable`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> parts = fsdp_jax.custom.split_trainable(state.plan, state.params)
    >>> fsdp_jax.custom.merge_trainable(state.plan, *parts) == state.params
    True
  """
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
  the optimizer computes unsharded (see docs/optimizers.md): elementwise
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

  Example: a whole step (see docs/custom_step.md):

    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> opt = optax.sgd(0.1)
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=opt, mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> plan = state.plan
    >>> vg = fsdp_jax.custom.value_and_grad(
    ...     lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2), plan=plan)
    >>> p_specs = fsdp_jax.custom.param_specs(plan)
    >>> o_specs, _ = fsdp_jax.custom.opt_state_specs(plan, opt)
    >>> def body(params, opt_state, batch):
    ...   out, grads, _ = vg(params, batch)
    ...   grads, norm = fsdp_jax.custom.clip_grad_norm(grads, plan=plan, max_norm=1.0)
    ...   params, opt_state = fsdp_jax.custom.optimizer_step(
    ...       opt, grads, opt_state, params, plan=plan)
    ...   return params, opt_state, out.loss, norm
    >>> step = jax.jit(jax.shard_map(body, mesh=mesh,
    ...     in_specs=(p_specs, o_specs, fsdp_jax.custom.batch_spec(plan)),
    ...     out_specs=(p_specs, o_specs, P(), P()), check_vma=False))
    >>> params, opt_state, loss, norm = step(state.params, state.opt_state,
    ...                                      {"x": jnp.ones((2, 4))})
    >>> print(f"loss {float(loss):.1f}, gradient norm before clipping {float(norm):.1f}")
    loss 16.0, gradient norm before clipping 11.3
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


def check_forward_inputs(forward_inputs):
  """``forward_inputs`` as a frozenset of top-level batch keys; a string (whose
  ``in`` would match substrings) or a non-iterable is refused."""
  if forward_inputs is None:
    return None
  if isinstance(forward_inputs, (str, bytes)):
    raise TypeError(
        f"forward_inputs={forward_inputs!r} is a string; it must be a collection of "
        f"top-level batch keys. Fix: forward_inputs=({forward_inputs!r},).")
  try:
    return frozenset(forward_inputs)
  except TypeError:
    raise TypeError(
        f"forward_inputs must be a collection of top-level batch keys (e.g. "
        f"(\"input_ids\",)), got {forward_inputs!r}.") from None


def _check_batch_has(batch, forward_inputs) -> None:
  """Every key of ``forward_inputs`` is a top-level key of ``batch``."""
  if isinstance(batch, dict):
    keys = set(batch)
  elif hasattr(batch, "_fields"):  # NamedTuple
    keys = set(batch._fields)
  elif dataclasses.is_dataclass(batch):
    keys = {f.name for f in dataclasses.fields(batch)}
  elif isinstance(batch, (tuple, list)):
    keys = set(range(len(batch)))
  else:
    keys = set()
  missing = sorted((k for k in forward_inputs if k not in keys), key=repr)
  if missing:
    have = ", ".join(repr(k) for k in sorted(keys, key=repr)) or "none"
    raise KeyError(
        f"forward_inputs names {', '.join(repr(k) for k in missing)}, which the batch "
        f"({type(batch).__name__}) does not have at its top level. Its keys: {have}. "
        "Fix: list only the batch's top-level keys that are the model's forward inputs.")


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
  the new ``model_state`` (or None).

  For a :class:`~fsdp_jax.WeightedLoss`, ``weight`` is its weight: from
  :func:`make_local_loss`, ``loss`` and ``weight`` are this device's
  ``total`` and ``weight``; from :func:`value_and_grad`, ``loss`` is the
  global ratio ``psum(total) / psum(weight)`` and ``weight`` the global
  ``psum(weight)`` (float32), the same on every device. ``weight`` is None
  for a mean loss."""

  loss: Any
  aux: Any
  model_state: Any
  weight: Any = None


@dataclasses.dataclass(frozen=True)
class _OutputKind:
  has_aux: bool
  weighted: bool


def check_loss_output(out_shape, with_model_state: bool) -> _OutputKind:
  """Reads ``loss_fn``'s output structure: whether it has aux and whether
  the loss is a :class:`~fsdp_jax.WeightedLoss`; raises for anything else."""

  def is_scalar(s):
    return hasattr(s, "shape") and s.shape == () and is_float_dtype(s.dtype)

  def is_loss(s):
    if isinstance(s, loss_lib.WeightedLoss):
      for field in ("total", "weight"):
        v = getattr(s, field)
        if not (hasattr(v, "shape") and v.shape == ()):
          raise ValueError(
              f"WeightedLoss.{field} must be a scalar (the sum over the device's "
              f"batch); got shape {getattr(v, 'shape', type(v).__name__)}. Fix: "
              "WeightedLoss(total=jnp.sum(loss * w), weight=jnp.sum(w)).")
      if not is_float_dtype(s.total.dtype):
        raise ValueError(f"WeightedLoss.total must be floating point; got {s.total.dtype}.")
      return True
    return is_scalar(s)

  show = lambda t: jax.tree.map(lambda s: f"{s.dtype}{list(s.shape)}", t)
  head = out_shape
  if with_model_state:
    if not (isinstance(out_shape, (tuple, list)) and len(out_shape) == 2):
      raise ValueError(
          "With model state, loss_fn(params, batch, model_state) must return "
          "(loss, new_model_state) or ((loss, aux), new_model_state); it returned "
          f"{show(out_shape)}.")
    head = out_shape[0]
  if is_loss(head):
    return _OutputKind(False, isinstance(head, loss_lib.WeightedLoss))
  if isinstance(head, (tuple, list)) and len(head) == 2 and is_loss(head[0]):
    return _OutputKind(True, isinstance(head[0], loss_lib.WeightedLoss))
  first = head[0] if isinstance(head, (tuple, list)) and head else head
  shape = getattr(first, "shape", None)
  raise ValueError(
      f"loss_fn must return a scalar floating-point loss (the mean over the "
      f"device's batch), a fsdp_jax.WeightedLoss(total=, weight=), or a (loss, aux) "
      f"pair; it returned {show(head)}"
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
  """``local(params, batch, model_state, probes, rng, deltas) -> LossOutput``.

  With mixed precision and ``cast_root_forward_inputs``, floating batch
  leaves are cast to ``param_dtype`` before the loss runs: all of them, or
  only those under the top-level keys in ``forward_inputs`` (PyTorch casts the
  model's forward arguments, not the loss targets).

  Evaluates ``loss_fn`` on this device's batch with every unit gathered right
  before its first use. ``probes`` (``{leaf_id: zeros}`` or None) are added to
  the gathered leaves: their gradient is the leaf's full, unreduced local
  gradient (used by ``no_sync`` accumulation, and by stateful hooks that
  cannot run in the backward pass). ``rng`` is
  passed as ``loss_fn(..., rng=rng)`` when ``loss_fn`` accepts it.

  With CPU offload the stored arrays are in host memory: each unit's are
  copied to the device at its gather (one unit at a time; the backward
  re-gather copies them again). ``deltas`` (stored-layout device zeros for
  the trainable arrays, see :func:`_offload_deltas`, or None) are added to
  those copies: the gradient with respect to them is the gradient of the
  shards, in device memory.

  ``gates`` (``{(unit index, group index): (zeros shaped like the group's
  stored local arrays, hook state)}`` or None): a stateful communication
  hook runs in the backward pass, as soon as the group's gradient is
  complete; the gradient with respect to the zeros is the hook's reduced
  shard, the one with respect to the state its new state (see
  :func:`_hook_gate`).

  The trace binds ``config.data_axis_name`` with the data-parallel world's
  size and rewrites the model's collectives over it to the mesh's data axes.
  Typed PRNG keys in the model state reach ``loss_fn`` as ``fold_in(key,
  device_index)`` and are stored unchanged (``loss_fn`` must return them as
  it got them).

  ``local.weight(batch, model_state, rng, model_state_changes=False)``
  evaluates only the weight of a :class:`~fsdp_jax.WeightedLoss` (no
  gathers; the weight must not depend on the parameters, nor, with
  ``model_state_changes=True``, on the model state), or returns None for a
  mean loss.
  """
  forward_inputs = check_forward_inputs(forward_inputs)
  mp_root = plan.config.mixed_precision
  full_structs = jax.tree_util.tree_unflatten(
      plan.treedef, [jax.ShapeDtypeStruct(l.shape, _compute_dtype(plan, l)) for l in plan.leaves])
  cast_inputs = (mp_root is not None and mp_root.param_dtype is not None
                 and mp_root.cast_root_forward_inputs)
  specs_per_unit = {u.index: layout.gather_specs(plan, u) for u in plan.units}
  with_model_state = plan.model_state_dtypes is not None
  takes_rng = loss_lib.takes_rng(loss_fn)
  data_axes = plan.axes.data_axes
  axis_map = loss_lib.axis_mapping(plan)
  axis_env = [(name, plan.axes.world_size) for name in axis_map]
  n_params = len(plan.leaves)
  traces: dict = {}  # loss_fn traced per input structure; see local.reset
  cfg = plan.config
  # Scans over stacked units carry the next layer's gather (hpZ's backward
  # gathers from its secondary slice instead, one layer per iteration).
  loop = schedule.LoopPrefetch(
      forward_prefetch=bool(cfg.forward_prefetch),
      backward_prefetch=None if cfg.backward_prefetch is None else cfg.backward_prefetch.name,
      units=frozenset(u.index for u in plan.units
                      if u.stacked and not plan.secondary_size(u)),
      reshard=frozenset(u.index for u in plan.units if plan.reshard(u)),
      axis_env=tuple(axis_env))

  def call(params, batch, model_state, rng):
    args = (params, batch) + ((model_state,) if with_model_state else ())
    return loss_fn(*args, **({"rng": rng} if takes_rng else {}))

  def prepare(batch, model_state, rng):
    """Traces ``loss_fn`` for this batch; returns ``(closed, out_shape,
    kind, the flat non-parameter arguments, key positions)``."""
    batch, ms, key = inputs(batch, model_state, rng)
    closed, out_shape, kind = trace(batch, ms, key)
    # Typed keys in the model state: each device draws with its own.
    ms_leaves = jax.tree_util.tree_leaves(ms)
    key_pos = [j for j, x in enumerate(ms_leaves) if is_key_dtype(x.dtype)]
    if key_pos:
      index = loss_lib.device_index(data_axes)
      ms_leaves = [jax.random.fold_in(x, index) if j in key_pos else x
                   for j, x in enumerate(ms_leaves)]
    rest = jax.tree_util.tree_leaves(batch) + ms_leaves + jax.tree_util.tree_leaves(key)
    return closed, out_shape, kind, rest, key_pos

  def inputs(batch, model_state, rng):
    """``(batch, model state, key)`` as ``loss_fn`` receives them."""
    if forward_inputs is not None:
      _check_batch_has(batch, forward_inputs)
    if cast_inputs:
      batch = _cast_floats(batch, mp_root.param_dtype, forward_inputs)
    if takes_rng:
      _check_rng(rng)
    key = rng if takes_rng else None
    ms = model_state if with_model_state else None
    return batch, ms, key

  def trace(batch, ms, key):
    """``loss_fn`` traced for these shapes (cached): ``(closed, out_shape,
    kind)``."""
    structs = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    args = (structs(batch), structs(ms), structs(key))
    cache_key = (jax.tree.structure(args),
                 tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(args)))
    if cache_key not in traces:
      per_device_bn: list = []
      try:
        with _cast_unit_inputs(plan), frameworks.watch_batch_norm(per_device_bn):
          closed, out_shape = jax.make_jaxpr(call, return_shape=True, axis_env=axis_env)(
              full_structs, *args)
      except NameError as e:
        _explain_axis_error(e, plan)
        raise
      if per_device_bn and plan.axes.world_size > 1:
        warnings.warn(frameworks.per_device_batch_norm_message(per_device_bn, plan),
                      stacklevel=2)
      closed = loss_lib.bind_axis_names(closed, axis_map)
      traces[cache_key] = (closed, out_shape, check_loss_output(out_shape, with_model_state))
    return traces[cache_key]

  def local(params, batch, model_state=None, probes=None, rng=None, deltas=None, gates=None):
    closed, out_shape, kind, rest, key_pos = prepare(batch, model_state, rng)
    storage = jax.tree_util.tree_leaves(params) if plan.use_orig_params else params

    def on_device(key, x):
      # CPU offload: a unit's stored arrays are copied to the device at its
      # gather, not at the start of the step.
      x = offload.to_device(x)
      return x if deltas is None or deltas.get(key) is None else x + deltas[key]

    def unit_locals(u):
      unit = plan.units[u]
      arrays = ([on_device(i, storage[i]) for i in unit.leaf_ids] if plan.use_orig_params
                else [on_device(unit.flat_key, storage[unit.flat_key])])
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
      for gi, (group, spec) in enumerate(specs_per_unit[u]):
        locs = layout.group_locals(plan, group, local_arrays)
        vals = collectives.gather(locs, spec)
        if gates is not None and (u, gi) in gates:
          vals = _hook_gate(plan.config.comm_hook, spec, plan.prefix(unit))(
              list(vals), *gates[(u, gi)])
        for i, v in zip(group, vals):
          out[i] = v + probe_of[i] if i in probe_of else v
      return out

    # Ignored leaves are read straight from this device's own copy.
    direct = {}
    for l in plan.ignored_leaves:
      x = (on_device(l.index, storage[l.index]) if plan.use_orig_params
           else on_device(plan.ignored_key(l), storage[plan.ignored_key(l)]))[0]
      direct[l.index] = x + probes[l.index] if probes is not None and l.index in probes else x
    g = schedule.Gatherer(
        gather_unit=lambda u: gather_arrays(u, unit_locals(u)),
        gather_layer=gather_arrays,
        leaf_unit={l.index: l.unit for l in plan.leaves if not l.ignored},
        direct=direct,
        stacked_units={u.index for u in plan.units if u.stacked},
        unit_layers={u.index: u.num_layers for u in plan.units},
        unit_storage=unit_locals,
        save_mixed=_recomputes_cheap_ops(plan),
        on_unstacked_scan=lambda ids, length: _warn_unstacked_scan(plan, ids, length),
        loop=loop)
    jaxpr = closed.jaxpr
    lazy = {v: i for i, v in enumerate(jaxpr.invars[:n_params])}
    try:
      outs = schedule.eval_with_gathers(jaxpr, closed.consts, [None] * n_params + rest, lazy, g)
    except NameError as e:
      _explain_axis_error(e, plan)
      raise
    out = jax.tree_util.tree_unflatten(jax.tree.structure(out_shape), outs)
    new_ms = None
    if with_model_state:
      out, new_ms = out
      ms_start = n_params + len(jax.tree_util.tree_leaves(batch))
      new_ms = _stored_model_state(model_state, new_ms, key_pos, jaxpr, out_shape, ms_start)
    loss, aux = out if kind.has_aux else (out, None)
    if kind.weighted:
      return LossOutput(loss.total, aux, new_ms, loss.weight)
    return LossOutput(loss, aux, new_ms)

  def weight(batch, model_state=None, rng=None, model_state_changes=False):
    closed, out_shape, kind, rest, _ = prepare(batch, model_state, rng)
    if not kind.weighted:
      return None
    # The weight's position among the flat outputs: the second leaf of the
    # WeightedLoss, which comes first in the output.
    flat_shape = jax.tree_util.tree_leaves(out_shape)
    pos = 1
    assert flat_shape[pos].shape == ()
    jaxpr = closed.jaxpr
    uses = loss_lib.needed_inputs(jaxpr, [pos])
    n_batch = len(jax.tree_util.tree_leaves(batch))
    n_ms = len(jax.tree_util.tree_leaves(model_state)) if with_model_state else 0
    on_params = sorted(plan.leaves[i].name for i in uses if i < n_params)
    on_state = [i for i in uses if n_params + n_batch <= i < n_params + n_batch + n_ms]
    if on_params:
      raise ValueError(
          f"WeightedLoss.weight depends on the parameters ({', '.join(on_params[:4])}"
          f"{' ...' if len(on_params) > 4 else ''}). The step divides every device's "
          "gradient by the global weight, so the weight must be known before the "
          "gradient and must not depend on the parameters. Fix: compute the weight "
          "from the batch (e.g. a padding mask: weight=jnp.sum(batch['mask'])).")
    if on_state and model_state_changes:
      raise ValueError(
          "WeightedLoss.weight depends on the model state. With "
          "gradient_accumulation_steps > 1 the step needs the weights of all "
          "microbatches before the first gradient, while the model state changes "
          "from one microbatch to the next. Fix: compute the weight from the batch, "
          "or use gradient_accumulation_steps=1.")
    return loss_lib.eval_outputs(jaxpr, closed.consts, [None] * n_params + rest, [pos])[0]

  local.weight = weight
  # Forgets the traces. A trace's constants may be values of the trace it
  # was made in: the caller resets at the start of each trace of its own.
  local.reset = traces.clear

  def checkpoints(batch, model_state=None, rng=None) -> bool:
    """Whether ``loss_fn``, traced on this device's inputs (shapes), calls
    ``jax.checkpoint`` (``nn.remat``), in any nested computation too."""
    batch, ms, key = jax.eval_shape(inputs, batch, model_state, rng)
    with _compat.classic_tracing():
      closed = trace(batch, ms, key)[0]
    return schedule.has_user_checkpoint(closed)

  local.checkpoints = checkpoints
  return local


def _check_rng(rng) -> None:
  if rng is None:
    raise ValueError(
        "loss_fn takes rng=, but the train state holds no key. Fix: pass "
        "rng=jax.random.key(seed) to fsdp_jax.init_train_state (it also seeds init_fn); "
        "each step then passes fold_in(fold_in(rng, step), device_index).")
  for x in jax.tree_util.tree_leaves(rng):
    dtype = getattr(x, "dtype", None)
    if not (is_key_dtype(dtype) or (dtype == jnp.uint32 and x.ndim >= 1)):  # typed or raw
      raise TypeError(
          f"loss_fn takes rng=, but the state's rng is not a PRNG key (a leaf of dtype "
          f"{dtype} and shape {getattr(x, 'shape', None)}). Fix: pass "
          "rng=jax.random.key(seed) to fsdp_jax.init_train_state.")


def _explain_axis_error(e: NameError, plan: Plan) -> None:
  name = loss_lib.unbound_axis_name(e)
  if name is not None:
    raise NameError(loss_lib.explain_unbound_axis(name, plan)) from e


def _stored_model_state(model_state, new_ms, key_pos, jaxpr, out_shape, ms_start: int):
  """The new model state as stored: the structure checked, and the typed
  keys (folded with the device index for ``loss_fn``) put back as stored.
  ``ms_start``: the position of the model state's first leaf among the
  traced loss's inputs."""
  old_leaves, old_def = jax.tree_util.tree_flatten(model_state)
  new_leaves, new_def = jax.tree_util.tree_flatten(new_ms)
  if old_def != new_def:
    raise ValueError(
        "loss_fn must return the new model state with the structure of the model state "
        f"it got:\n  got:      {old_def}\n  returned: {new_def}\nFix: return every "
        "collection, e.g. {**model_state, **updates} for Flax linen's "
        "model.apply(..., mutable=[...]) updates, or nnx.state(model, nnx.Not(nnx.Param)).")
  if not key_pos:
    return new_ms
  # A key leaf must come back as the very input it was: a step cannot keep
  # per-device keys in replicated state.
  first_ms_out = len(jax.tree_util.tree_leaves(out_shape)) - len(new_leaves)
  for j in key_pos:
    if jaxpr.outvars[first_ms_out + j] is not jaxpr.invars[ms_start + j]:
      raise ValueError(
          "loss_fn returns a new value for a PRNG key in the model state (leaf "
          f"{j} of {old_def}). Keys in model_state are constants of the train state "
          "(each device's loss_fn sees fold_in(key, device_index)); per-step "
          "randomness comes from the step. Fix: return the key unchanged, and take "
          "a key that changes every step as loss_fn(..., rng=...) (pass "
          "rng= to init_train_state).")
  return jax.tree_util.tree_unflatten(
      new_def, [old_leaves[j] if j in key_pos else x for j, x in enumerate(new_leaves)])


def _warn_unstacked_scan(plan: Plan, leaf_ids, length: int) -> None:
  by_unit: dict = {}
  for i in leaf_ids:
    by_unit.setdefault(plan.units[plan.leaves[i].unit].display_name, []).append(
        plan.leaves[i].name)
  for unit, names in by_unit.items():
    warnings.warn(frameworks.scan_over_unit_message(names, length, unit), stacklevel=2)


def _recomputes_cheap_ops(plan: Plan) -> bool:
  """Whether the step's remat uses :func:`collectives.remat_policy`.

  A scan over a stacked unit is one equation to the step's remat, which
  saves its residuals (the loops recompute inside themselves, see
  ``schedule.LoopPrefetch``). hpZ's stacked units keep every residual but
  the gathers: recomputing the cheap operations of a scanned layer made the
  compiled program gather each layer a third time, in a loop of its own.
  """
  return (any(plan.regather(u) for u in plan.units)
          and not any(u.stacked and plan.secondary_size(u) for u in plan.units))


def _hook_gate(hook, spec, prefix):
  """``gate(vals, zeros, state) -> vals``, whose backward runs the stateful
  ``hook`` on the group's full gradient (the cotangent of ``vals``) and
  returns its reduced shard as the cotangent of ``zeros`` and its new state
  as the cotangent of ``state``: the hook runs where the default reduction
  would, so no unit's full gradient outlives its backward computation."""

  @jax.custom_vjp
  def gate(vals, zeros, state):
    del zeros, state
    return vals

  def fwd(vals, zeros, state):
    del zeros
    return vals, state

  def bwd(state, cts):
    full = collectives.pack_full(list(cts), spec, prefix)
    reduced, new_state = hooks.call_hook(hook, state, full, spec)
    reduced = collectives.split_rows(
        collectives.finish_gradient(reduced, spec, spec.stored_dtype), spec)
    new_state = jax.tree.map(lambda n, o: jnp.asarray(n).astype(o.dtype), new_state, state)
    return None, reduced, new_state

  gate.defvjp(fwd, bwd)
  return gate


def _gates_apply(plan: Plan, hook_state) -> bool:
  """Whether a stateful hook can run in the backward pass: no stacked
  trainable unit (scan loops reduce layer by layer) and a floating state
  (it travels as a cotangent)."""
  if any(u.stacked for u in plan.trainable_units):
    return False
  return all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(hook_state))


def _offload_deltas(plan: Plan, trainable) -> dict:
  """Trainable arrays in the stored layout (as :func:`split_trainable`
  returns them) -> ``{leaf id or flat key: array}``, as ``local`` reads
  ``deltas``."""
  if not plan.use_orig_params:
    return dict(trainable)
  leaves = jax.tree_util.tree_leaves(trainable)
  ids = [l.index for l in plan.leaves if not l.frozen]
  return dict(zip(ids, leaves))


def _maybe_remat(local, plan: Plan):
  if any(plan.regather(u) for u in plan.units):
    policy = collectives.remat_policy if _recomputes_cheap_ops(plan) else (
        collectives.save_all_but_gathers)
    # jax.checkpoint picks its implementation when it wraps (jax 0.10).
    with _compat.classic_tracing():
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
      cts = [full_grads[i] for i in group]
      if stateful:
        key = hook_key(unit, gi)
        full = collectives.pack_full(cts, spec, prefix)
        reduced, st = hooks.call_hook(hook, jax.tree.map(lambda x: x[0], hook_state[key]),
                                      full, spec)
        new_hook_state[key] = jax.tree.map(lambda x: x[None], st)
        reduced = collectives.split_rows(
            collectives.finish_gradient(reduced, spec, spec.stored_dtype), spec)
      else:
        # The reduction of the gather's transpose: a stateless hook included.
        reduced = collectives.reduce_leaves(cts, spec, spec.stored_dtype)
      scope.__exit__(None, None, None)
      keys = group if plan.use_orig_params else ["flat"]
      for k, v in zip(keys, reduced):
        local[(unit.index, k)] = v
  # Ignored leaves: this device's own gradient, not reduced.
  for l in plan.ignored_leaves:
    if not l.frozen:
      local[("ignored", l.index)] = full_grads[l.index][None].astype(l.dtype)
  return _assemble_grads(plan, local), new_hook_state


def _assemble_grads(plan: Plan, local: dict):
  """``{(unit index, leaf id or "flat") or ("ignored", leaf id): reduced}``
  -> the trainable gradients in the stored layout."""
  if plan.use_orig_params:
    leaves = [None if l.frozen else local[("ignored", l.index) if l.ignored else (l.unit, l.index)]
              for l in plan.leaves]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)
  out = {u.flat_key: local[(u.index, "flat")] for u in plan.trainable_units}
  out.update({plan.ignored_key(l): local[("ignored", l.index)]
              for l in plan.ignored_leaves if not l.frozen})
  return {k: out[k] for k in sorted(out)}


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
  """Returns ``f(params, batch, model_state=None, hook_state=None, rng=None)``,
  for use inside ``jax.shard_map`` on the local shards, computing
  ``(LossOutput, trainable_grads, new_hook_state)``.

  ``trainable_grads`` are the reduced, averaged gradient shards in the layout
  of :func:`split_trainable`'s first output. ``rng`` is this device's key
  for the step, passed on as ``loss_fn(..., rng=rng)`` when ``loss_fn``
  accepts it (:func:`shard_train_step` passes ``fold_in(fold_in(state.rng,
  step), device_index)``).

  Gradient accumulation over ``gradient_accumulation_steps`` microbatches of
  the local batch (microbatch ``m`` gets the key ``fold_in(rng, m)``):

  * ``"no_sync"`` (PyTorch's ``no_sync()``): each microbatch's full unreduced
    gradient is accumulated locally (in ``reduce_dtype``, at least float32)
    and every unit is reduced once at the end: fewer collectives, a full
    gradient of every unit held per device.
  * ``"sharded"``: every microbatch reduce-scatters its gradient into a
    sharded accumulator (in the stored dtype): one reduction per unit per
    microbatch, only the shard held.

  Either way the result equals one step over the whole local batch: the
  gradient is the mean over microbatches of each microbatch's mean gradient.

  When ``loss_fn`` returns a :class:`~fsdp_jax.WeightedLoss`, the weights of
  every microbatch are summed over the data-parallel world first (one scalar
  all-reduce), and each device differentiates ``total * world / sum(weight)``,
  so that the averaged reduction yields the gradient of the global ratio
  ``sum(total) / sum(weight)``; ``out.loss`` is that ratio and
  ``out.weight`` the global weight.

  ``forward_inputs``: see :func:`make_local_loss`.

  Example: a whole step (see docs/custom_step.md):

    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> opt = optax.sgd(0.1)
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=opt, mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> plan = state.plan
    >>> vg = fsdp_jax.custom.value_and_grad(
    ...     lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2), plan=plan)
    >>> p_specs = fsdp_jax.custom.param_specs(plan)
    >>> o_specs, _ = fsdp_jax.custom.opt_state_specs(plan, opt)
    >>> def body(params, opt_state, batch):
    ...   out, grads, _ = vg(params, batch)
    ...   grads, norm = fsdp_jax.custom.clip_grad_norm(grads, plan=plan, max_norm=1.0)
    ...   params, opt_state = fsdp_jax.custom.optimizer_step(
    ...       opt, grads, opt_state, params, plan=plan)
    ...   return params, opt_state, out.loss, norm
    >>> step = jax.jit(jax.shard_map(body, mesh=mesh,
    ...     in_specs=(p_specs, o_specs, fsdp_jax.custom.batch_spec(plan)),
    ...     out_specs=(p_specs, o_specs, P(), P()), check_vma=False))
    >>> params, opt_state, loss, norm = step(state.params, state.opt_state,
    ...                                      {"x": jnp.ones((2, 4))})
    >>> print(f"loss {float(loss):.1f}, gradient norm before clipping {float(norm):.1f}")
    loss 16.0, gradient norm before clipping 11.3
  """
  if accumulation not in ("no_sync", "sharded"):
    raise ValueError(f"accumulation={accumulation!r}: use 'no_sync' or 'sharded'.")
  k = int(gradient_accumulation_steps)
  if k < 1:
    raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be >= 1.")
  raw = make_local_loss(loss_fn, plan, forward_inputs=forward_inputs)
  local = _maybe_remat(raw, plan)
  offloaded = offload.offloads(plan.config)
  stateful_hook = hooks.is_stateful(plan.config.comm_hook)
  use_probes = stateful_hook or (k > 1 and accumulation == "no_sync")
  data_axes = plan.axes.data_axes
  world = plan.axes.world_size

  cfg = plan.config
  ordering = schedule.Ordering(
      backward_prefetch=None if cfg.backward_prefetch is None else cfg.backward_prefetch.name,
      forward_prefetch=bool(cfg.forward_prefetch),
      limit_all_gathers=bool(cfg.limit_all_gathers),
      reshard=frozenset(u.display_name for u in plan.units if plan.reshard(u)),
      forward_prefetch_units=cfg.forward_prefetch_units,
      backward_prefetch_units=cfg.backward_prefetch_units)

  def objective_of(out, scale):
    # A WeightedLoss: d(total * world / W), averaged over the world by the
    # reduction, sums to d(sum(total)) / W, the gradient of the global ratio.
    return out.loss if scale is None else out.loss.astype(jnp.float32) * scale

  def direct(params, batch, model_state, rng, scale):
    trainable, frozen = split_trainable(plan, params)
    if offloaded:
      # Differentiate with respect to device zeros added to each unit's
      # device copy: the gradient shards stay in device memory (a gradient
      # with respect to the host arrays would be computed in host memory).
      stored = merge_trainable(plan, trainable, frozen)  # constants of the objective

      def objective(dz):
        out = local(stored, batch, model_state, None, rng, _offload_deltas(plan, dz))
        return objective_of(out, scale), out

      zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), trainable)
      (_, out), grads = jax.value_and_grad(objective, has_aux=True)(zeros)
      return out, grads

    def objective(t):
      out = local(merge_trainable(plan, t, frozen), batch, model_state, None, rng)
      return objective_of(out, scale), out

    (_, out), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
    return out, grads

  direct = schedule.ordered(direct, ordering)

  def probed(params, batch, model_state, rng, scale):
    params = jax.lax.stop_gradient(params)
    shapes = _probe_shapes(plan)
    probes = {i: jnp.zeros(s.shape, s.dtype) for i, s in shapes.items()}

    def objective(pr):
      out = local(params, batch, model_state, pr, rng)
      return objective_of(out, scale), out

    (_, out), full = jax.value_and_grad(objective, has_aux=True)(probes)
    return out, full

  probed = schedule.ordered(probed, ordering)

  def hooked(params, batch, model_state, rng, scale, hook_state):
    """A stateful hook in the backward pass: differentiate with respect to
    zeros and the hook's state at each group's gate (and zeros added to the
    ignored leaves), the stored arrays being constants."""
    trainable, frozen = split_trainable(plan, params)
    stored = merge_trainable(plan, trainable, frozen)
    zeros, states = {}, {}
    for u in plan.trainable_units:
      arrays = layout.unit_storage(plan, u, stored)
      arrays = (dict(zip(u.leaf_ids, arrays)) if plan.use_orig_params else {"flat": arrays[0]})
      for gi, (group, _) in enumerate(layout.gather_specs(plan, u)):
        zeros[(u.index, gi)] = [jnp.zeros(x.shape, x.dtype)
                                for x in layout.group_locals(plan, group, arrays)]
        states[(u.index, gi)] = jax.tree.map(lambda x: x[0], hook_state[hook_key(u, gi)])
    leaves = jax.tree_util.tree_leaves(stored) if plan.use_orig_params else None
    ignored = {}
    for l in plan.ignored_leaves:
      if not l.frozen:
        key = l.index if plan.use_orig_params else plan.ignored_key(l)
        x = leaves[l.index] if plan.use_orig_params else stored[key]
        ignored[key] = jnp.zeros(x.shape, x.dtype)

    def objective(z, st, dz):
      out = local(stored, batch, model_state, None, rng, dz,
                  {k: (z[k], st[k]) for k in z})
      return objective_of(out, scale), out

    (_, out), (reduced, new_states, d_ignored) = jax.value_and_grad(
        objective, argnums=(0, 1, 2), has_aux=True)(zeros, states, ignored)
    per = {}
    for (ui, gi), arrays in reduced.items():
      group = layout.gather_specs(plan, plan.units[ui])[gi][0]
      for k, v in zip(group if plan.use_orig_params else ["flat"], arrays):
        per[(ui, k)] = v
    for l in plan.ignored_leaves:
      if not l.frozen:
        per[("ignored", l.index)] = d_ignored[l.index if plan.use_orig_params
                                              else plan.ignored_key(l)]
    new_hook = {hook_key(plan.units[ui], gi): jax.tree.map(lambda x: x[None], st)
                for (ui, gi), st in new_states.items()}
    return out, _assemble_grads(plan, per), new_hook

  hooked = schedule.ordered(hooked, ordering)

  def global_weight(local_weights):
    w = loss_lib.weight_total(local_weights, data_axes)
    return w, jnp.float32(world) / w

  def f(params, batch, model_state=None, hook_state=None, rng=None):
    raw.reset()  # traces of loss_fn are shared within one trace of f only
    if k == 1:
      w = raw.weight(batch, model_state, rng)
      total_w, scale = global_weight(w) if w is not None else (None, None)
      if stateful_hook and _gates_apply(plan, hook_state):
        out, grads, new_hook = hooked(params, batch, model_state, rng, scale, hook_state)
      elif use_probes:
        out, full = probed(params, batch, model_state, rng, scale)
        grads, new_hook = reduce_full_grads(plan, full, hook_state)
      else:
        (out, grads), new_hook = direct(params, batch, model_state, rng, scale), hook_state
      if w is not None:
        out = LossOutput(jax.lax.psum(out.loss.astype(jnp.float32), data_axes) / total_w,
                         out.aux, out.model_state, total_w)
      return out, grads, new_hook
    micro = _microbatches(batch, k)
    keys = None if rng is None else jax.vmap(lambda m: _micro_key(rng, m))(jnp.arange(k))
    first = jax.tree.map(lambda x: x[0], micro)
    first_key = None if keys is None else jax.tree.map(lambda x: x[0], keys)
    weighted = raw.weight(first, model_state, first_key) is not None
    total_w = scale = None
    if weighted:
      ws = lax.map(lambda a: raw.weight(a[0], model_state, a[1], model_state_changes=True),
                   (micro, keys))
      total_w, scale = global_weight(jnp.sum(ws))
    if use_probes:
      acc0 = {i: jnp.zeros(s.shape, _acc_dtype(plan, plan.leaves[i]))
              for i, s in _probe_shapes(plan).items()}
    else:
      acc0 = jax.tree.map(jnp.zeros_like, split_trainable(plan, params)[0])
    # A weighted objective is already normalised by the global weight: its
    # microbatch gradients add up; a mean loss's are averaged.
    def body(carry, xs):
      mb, key = xs
      acc, ms, loss_sum, aux_sum = carry
      if use_probes:
        out, g = probed(params, mb, ms, key, scale)
      else:
        out, g = direct(params, mb, ms, key, scale)
      acc = jax.tree.map(lambda a, x: a + x.astype(a.dtype) if weighted
                         else a + x.astype(a.dtype) / k, acc, g)
      aux_sum = jax.tree.map(lambda t, a: t + jnp.asarray(a, jnp.float32) / k, aux_sum, out.aux)
      if out.model_state is not None:
        ms = jax.tree.map(as_stored_dtype, out.model_state, ms)
      loss = out.loss.astype(jnp.float32)
      return (acc, ms, loss_sum + (loss if weighted else loss / k), aux_sum), None

    # The aux structure (for the running mean) comes from an abstract trace.
    aux_shape = jax.eval_shape(lambda: local(params, first, model_state, None, first_key).aux)
    aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), aux_shape)
    carry = (acc0, model_state, jnp.zeros((), jnp.float32), aux0)
    carry, _ = lax.scan(body, carry, (micro, keys))
    acc, ms, loss, aux = carry
    if weighted:
      out = LossOutput(jax.lax.psum(loss, data_axes) / total_w, aux, ms, total_w)
    else:
      out = LossOutput(loss, aux, ms)
    if use_probes:
      grads, new_hook = reduce_full_grads(plan, acc, hook_state)
      return out, grads, new_hook
    return out, acc, hook_state

  # The rewrite reads classic jax.checkpoint / lax.scan equations, whatever
  # implementation the user's config selects (see fsdp_jax._compat).
  def traced_classically(*args, **kwargs):
    with _compat.classic_tracing():
      return f(*args, **kwargs)

  return traced_classically


def _micro_key(rng, m):
  return jax.tree.map(lambda key: jax.random.fold_in(key, m), rng)


def as_stored_dtype(new, old):
  """A model-state leaf back in its stored dtype (PRNG keys as they are)."""
  return new if is_key_dtype(old.dtype) else new.astype(old.dtype)
