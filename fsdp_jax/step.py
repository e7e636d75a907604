"""``shard_train_step``: a jitted FSDP train step for any JAX loss function."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fsdp_jax import collectives, layout, schedule
from fsdp_jax.config import FSDPConfig, is_float_dtype
from fsdp_jax.mesh import cpu_flags_active
from fsdp_jax.plan import Plan
from fsdp_jax.state import ShardedTrainState, _storage_specs, opt_state_specs


def _data_spec(plan: Plan):
  axes = plan.axes.data_axes
  return P(axes[0] if len(axes) == 1 else axes)


def check_batch(plan: Plan, batch) -> None:
  """Every batch leaf is split along dim 0 over the data-parallel world."""
  world = plan.axes.world_size
  axes = plan.axes.data_axes
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    shape = np.shape(x)
    name = jax.tree_util.keystr(path) or "batch"
    if len(shape) == 0:
      raise ValueError(
          f"Batch leaf {name} is a scalar; every batch leaf needs a leading "
          f"batch dimension to split over the data-parallel mesh axes {axes} "
          f"(size {world}). Put per-step constants in the loss function instead.")
    if shape[0] % world:
      raise ValueError(
          f"Batch leaf {name} has shape {tuple(shape)}: its leading dimension "
          f"{shape[0]} is not divisible by the data-parallel size {world} "
          f"(mesh axes {axes} of sizes {dict(plan.mesh.shape)}). Fix: use a "
          f"global batch size that is a multiple of {world}, e.g. "
          f"{-(-shape[0] // world) * world}.")


def _cast_floats(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype) if is_float_dtype(x.dtype) else x, tree)


def make_local_loss(loss_fn: Callable, plan: Plan):
  """Returns ``local(params_local, batch_local) -> (loss, aux)``: ``loss_fn``
  evaluated on this device's batch with each unit gathered before first use.
  Also returns whether ``loss_fn`` returned ``(loss, aux)``."""
  mp = plan.config.mixed_precision

  def param_struct(leaf):
    dtype = leaf.dtype
    if mp is not None and mp.param_dtype is not None and is_float_dtype(dtype):
      dtype = mp.param_dtype
    return jax.ShapeDtypeStruct(leaf.shape, dtype)

  full_structs = jax.tree_util.tree_unflatten(plan.treedef, [param_struct(l) for l in plan.leaves])
  cast_inputs = mp is not None and mp.param_dtype is not None and mp.cast_root_forward_inputs
  specs_per_unit = {u.index: layout.gather_specs(plan, u) for u in plan.units}

  def local(params_local, batch_local):
    if cast_inputs:
      batch_local = _cast_floats(batch_local, mp.param_dtype)
    batch_structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch_local)
    closed, out_shape = jax.make_jaxpr(loss_fn, return_shape=True)(full_structs, batch_structs)
    has_aux = _check_loss_output(out_shape)
    storage_leaves = (jax.tree_util.tree_leaves(params_local) if plan.use_orig_params
                      else params_local)

    def unit_locals(u):
      unit = plan.units[u]
      if plan.use_orig_params:
        return [storage_leaves[i] for i in unit.leaf_ids]
      return [storage_leaves[unit.flat_key]]

    def as_dict(unit, arrays):
      if plan.use_orig_params:
        return dict(zip(unit.leaf_ids, arrays))
      return {"flat": arrays[0]}

    def gather_arrays(u, arrays):
      unit = plan.units[u]
      local_arrays = as_dict(unit, arrays)
      out = {}
      for group, spec in specs_per_unit[u]:
        buf = layout.local_buffer(plan, unit, group, local_arrays)
        for i, v in zip(group, collectives.gather(buf, spec)):
          out[i] = v
      return out

    g = schedule.Gatherer(
        gather_unit=lambda u: gather_arrays(u, unit_locals(u)),
        gather_layer=gather_arrays,
        leaf_unit={l.index: l.unit for l in plan.leaves},
        stacked_units={u.index for u in plan.units if u.stacked},
        unit_layers={u.index: u.num_layers for u in plan.units},
        unit_storage=unit_locals)
    jaxpr = closed.jaxpr
    n_params = len(plan.leaves)
    param_vars = jaxpr.invars[:n_params]
    lazy = {v: i for i, v in enumerate(param_vars)}
    args = [None] * n_params + jax.tree_util.tree_leaves(batch_local)
    outs = schedule.eval_with_gathers(jaxpr, closed.consts, args, lazy, g)
    out = jax.tree_util.tree_unflatten(jax.tree.structure(out_shape), outs)
    if has_aux:
      return out[0], out[1]
    return out, None

  return local


def _check_loss_output(out_shape) -> bool:
  def is_scalar(s):
    return hasattr(s, "shape") and s.shape == () and is_float_dtype(s.dtype)

  if is_scalar(out_shape):
    return False
  if isinstance(out_shape, (tuple, list)) and len(out_shape) == 2 and is_scalar(out_shape[0]):
    return True
  first = out_shape[0] if isinstance(out_shape, (tuple, list)) and out_shape else out_shape
  shape = getattr(first, "shape", None)
  raise ValueError(
      f"loss_fn must return a scalar floating-point loss (the mean over the "
      f"device's batch) or a (loss, aux) pair; it returned "
      f"{jax.tree.map(lambda s: f'{s.dtype}{list(s.shape)}', out_shape)}"
      + (f" (loss of shape {shape})" if shape else "")
      + ". Fix: reduce it, e.g. `return jnp.mean(per_example_loss)`.")


def _check_state(state, plan_cfg: FSDPConfig, mesh: Mesh, optimizer):
  if not isinstance(state, ShardedTrainState):
    raise TypeError("step(state, batch) needs the ShardedTrainState built by "
                    f"fsdp_jax.init_train_state; got {type(state).__name__}.")
  plan = state.plan
  if plan.config != plan_cfg:
    raise ValueError(
        "The state was built with a different FSDPConfig than this step:\n"
        f"  state: {plan.config}\n  step:  {plan_cfg}\n"
        "Pass the same config to init_train_state and shard_train_step.")
  if plan.mesh != mesh:
    raise ValueError(
        f"The state lives on mesh {dict(plan.mesh.shape)} (devices "
        f"{[d.id for d in plan.mesh.devices.flat]}) but the step was built for "
        f"mesh {dict(mesh.shape)} (devices {[d.id for d in mesh.devices.flat]}). "
        "Pass the same mesh to init_train_state and shard_train_step.")
  specs, expected = opt_state_specs(plan, optimizer)
  got = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state.opt_state)
  exp_leaves, exp_def = jax.tree_util.tree_flatten_with_path(expected)
  got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got)
  if exp_def != got_def:
    raise ValueError(
        "The optimizer state does not match this optimizer and the params: "
        f"expected the structure of optimizer.init(params)\n  {exp_def}\nbut "
        f"the state holds\n  {got_def}\nBuild the state with the same "
        "optimizer you pass to shard_train_step.")
  for (path, e), (_, a) in zip(exp_leaves, got_leaves):
    if e.shape != a.shape or e.dtype != a.dtype:
      raise ValueError(
          f"The optimizer state leaf opt_state{jax.tree_util.keystr(path)} has "
          f"shape {a.shape} {a.dtype} but this optimizer over the stored params "
          f"expects {e.shape} {e.dtype}. Build the state with the same "
          "optimizer and config you pass to shard_train_step.")
  return specs


_warned_cpu = []


def shard_train_step(loss_fn: Callable[[Any, Any], Any],
                     optimizer: optax.GradientTransformation, *, mesh: Mesh,
                     config: FSDPConfig, donate: bool = True):
  """Builds a jitted FSDP train step ``step(state, batch) -> (state, metrics)``.

  ``loss_fn(params, batch)`` is any pure JAX function of the **full, original**
  parameter tree and the device-local batch (a Flax linen ``model.apply``, an
  NNX model through ``nnx.merge``, or a plain function) returning the mean
  loss over that batch, or ``(loss, aux)``. Inside the step, which runs under
  ``jax.shard_map`` over ``mesh``:

  1. each unit is all-gathered (in ``param_dtype``) right before the first
     operation that reads it; FULL_SHARD/HYBRID_SHARD free it after forward
     and re-gather it in backward, SHARD_GRAD_OP/_HYBRID_SHARD_ZERO2 keep it;
     a stacked unit scanned over is gathered one layer per iteration;
  2. each unit's gradient is reduce-scattered (``psum_scatter``) in
     ``reduce_dtype`` and averaged over the data-parallel world with PyTorch's
     pre/post divide factors; HYBRID adds an all-reduce over ``"replicate"``,
     NO_SHARD all-reduces;
  3. ``optimizer.update`` runs on the local shards.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` or ``(loss, aux)``.
    optimizer: the optax optimizer the state was built with. Elementwise
      transforms (sgd, momentum, adam, adamw with masks, lion, ...) give the
      same result as unsharded training.
    mesh: the mesh the state lives on.
    config: the :class:`FSDPConfig` the state was built with.
    donate: donate the input state's buffers to the output (default True).

  Returns:
    A :class:`TrainStep`, called as ``step(state, batch) -> (state, metrics)``;
    ``metrics["loss"]`` is the global mean loss and ``metrics["aux"]`` the
    aux output averaged over the data-parallel world.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
    >>> cfg = fsdp_jax.FSDPConfig()
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> opt = optax.adam(1e-2)
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.zeros((3, 1))},
    ...     optimizer=opt, mesh=mesh, config=cfg)
    >>> step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=cfg)
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones((8, 1))}
    >>> state, metrics = step(state, batch)
    >>> float(metrics["loss"])
    1.0
  """
  if not callable(loss_fn):
    raise TypeError("loss_fn must be callable as loss_fn(params, batch).")
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError("optimizer must be an optax.GradientTransformation.")
  if not isinstance(config, FSDPConfig):
    raise TypeError(f"config must be a fsdp_jax.FSDPConfig, got {type(config).__name__}.")
  if (jax.devices()[0].platform == "cpu" and not cpu_flags_active()
      and config.reshard_after_forward and not _warned_cpu):
    _warned_cpu.append(True)
    warnings.warn(
        "fsdp_jax: on the CPU backend XLA merges FULL_SHARD's backward "
        "re-gather into the forward gather unless fsdp_jax.CPU_XLA_FLAGS are "
        "set (call fsdp_jax.simulate_cpu_devices() before JAX starts); "
        "results are the same, memory is not.", stacklevel=2)

  def step(state: ShardedTrainState, batch):
    opt_specs = _check_state(state, config, mesh, optimizer)
    plan = state.plan
    check_batch(plan, batch)
    param_specs = _storage_specs(plan)
    batch_specs = jax.tree.map(lambda _: _data_spec(plan), batch)
    local_loss = make_local_loss(loss_fn, plan)
    if any(plan.reshard(u) for u in plan.units):
      local_loss = jax.checkpoint(local_loss, policy=collectives.remat_policy,
                                  prevent_cse=True)
    data_axes = plan.axes.data_axes

    def body(params, opt_state, batch_local):
      (loss, aux), grads = jax.value_and_grad(local_loss, has_aux=True)(params, batch_local)
      updates, new_opt_state = optimizer.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      metrics = {"loss": jax.lax.pmean(loss.astype(jnp.float32), data_axes)}
      if aux is not None:
        metrics["aux"] = jax.tree.map(
            lambda a: jax.lax.pmean(jnp.asarray(a, jnp.float32), data_axes), aux)
      return new_params, new_opt_state, metrics

    fn = jax.shard_map(body, mesh=mesh,
                       in_specs=(param_specs, opt_specs, batch_specs),
                       out_specs=(param_specs, opt_specs, P()), check_vma=False)
    new_params, new_opt_state, metrics = fn(state.params, state.opt_state, batch)
    new_state = state.replace(step=state.step + 1, params=new_params,
                              opt_state=new_opt_state)
    return new_state, metrics

  return TrainStep(jax.jit(step, donate_argnums=(0,) if donate else ()), mesh, config)


def place_batch(plan: Plan, batch):
  """Puts a batch on the mesh, split along dim 0 over the data axes.

  With one process, host arrays are transferred (and global ``jax.Array`` s
  passed through). With several processes (``jax.distributed``), each process
  passes its own part of the global batch, in process order, and the global
  array is assembled from the parts (``jax.make_array_from_process_local_data``).
  """
  sharding = NamedSharding(plan.mesh, _data_spec(plan))
  multi = jax.process_count() > 1

  def place(x):
    if isinstance(x, jax.Array) and (not multi or not x.is_fully_addressable):
      return x
    if multi:
      return jax.make_array_from_process_local_data(sharding, np.asarray(x))
    return jax.device_put(x, sharding)

  return jax.tree.map(place, batch)


class TrainStep:
  """The step returned by :func:`shard_train_step`.

  ``step(state, batch)`` places the batch on the mesh (assembling per-process
  parts in multi-process runs) and runs the jitted step. ``step.lower(state,
  batch)`` lowers it for inspection (``.compile().as_text()``,
  ``.compile().memory_analysis()``); ``step.jitted`` is the ``jax.jit``
  function itself, taking global arrays.
  """

  def __init__(self, jitted, mesh: Mesh, config: FSDPConfig):
    self.jitted = jitted
    self.mesh = mesh
    self.config = config

  def _place(self, state, batch):
    if not isinstance(state, ShardedTrainState):
      raise TypeError("step(state, batch) needs the ShardedTrainState built by "
                      f"fsdp_jax.init_train_state; got {type(state).__name__}.")
    if jax.process_count() == 1:
      check_batch(state.plan, batch)
    return place_batch(state.plan, batch)

  def __call__(self, state, batch):
    return self.jitted(state, self._place(state, batch))

  def lower(self, state, batch):
    return self.jitted.lower(state, self._place(state, batch))
