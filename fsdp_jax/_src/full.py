"""Full-parameter access (PyTorch ``summon_full_params`` and ``apply``).

* :func:`summon_full_params` returns the full, original tree (optionally only
  on process 0, optionally as host numpy arrays, optionally with gradients);
* :func:`write_full_params` applies a pure function to the full parameters
  and stores the result back into the shards (``summon_full_params(writeback=True)``);
* :func:`apply` maps ``fn(name, leaf)`` over every parameter one unit at a
  time, for re-initialising parts of a model (``FullyShardedDataParallel.apply``);
* :func:`sharded_grads` computes the reduced gradient shards of a batch, for
  inspection with ``summon_full_params(with_grads=True, grads=...)``.

Parameters are returned in their stored (full) precision, as PyTorch forces
full precision in ``summon_full_params``. With CPU offload the stored shards
are read from host memory (one unit at a time in :func:`apply`), the full
parameters are returned in device memory, and write-backs store the new
shards in host memory again.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from fsdp_jax._src import mesh as mesh_lib
from fsdp_jax._src import grads as grads_lib
from fsdp_jax._src import layout, offload
from fsdp_jax._src import loss as loss_lib
from fsdp_jax._src import plan as plan_lib
from fsdp_jax._src.state import (ShardedTrainState, assemble_storage, ignored_storage,
                            pack_ignored, unpack_all)
from fsdp_jax._src.reshard import reshard_params
from fsdp_jax._src.step import place_batch


def _to_host(tree):
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    return multihost_utils.process_allgather(tree, tiled=True)
  return jax.tree.map(np.asarray, tree)


@mesh_lib.own_mesh
def summon_full_params(state: ShardedTrainState, *, rank0_only: bool = False,
                       offload_to_cpu: bool = False, with_grads: bool = False,
                       grads: Any = None):
  """The full, original parameter tree (PyTorch ``summon_full_params``).

  Args:
    state: the sharded train state.
    rank0_only: only process 0 receives the tree; other processes get
      ``None``. (With one process this process is process 0.)
    offload_to_cpu: return host ``numpy`` arrays instead of device arrays
      replicated over the mesh.
    with_grads: also return the full gradients, from ``grads`` (the reduced
      gradient shards in the optimizer's layout, e.g. from
      :func:`sharded_grads`). Frozen parameters get ``None``.
    grads: see ``with_grads``.

  The tree is gathered one unit at a time, by the programs of
  :func:`~fsdp_jax.reshard_params` (whose default layout this is).

  Returns:
    The full tree, or ``(params, grads)`` with ``with_grads``. With
    ``FSDPConfig(lora=...)`` the tree is the model's own, each target the
    effective kernel ``dequantized base + (alpha / rank) * A @ B`` in its
    dtype; ``grads`` keep the stored tree (each target a ``LoRAWeight``
    whose ``base`` gradient is ``None``).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.arange(6.0)},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> fsdp_jax.summon_full_params(state, offload_to_cpu=True)["w"]
    array([0., 1., 2., 3., 4., 5.], dtype=float32)
  """
  if with_grads and grads is None:
    raise ValueError(
        "summon_full_params(with_grads=True) needs grads=: the reduced gradient "
        "shards, e.g. fsdp_jax.custom.sharded_grads(loss_fn, state, batch). The train "
        "state holds no gradients between steps.")
  plan = state.plan
  replicated = NamedSharding(plan.mesh, P())
  unpack = lambda s: unpack_all(plan, offload.to_device(s), replicate=True)
  # One unit at a time, with reshard_params' programs: the same values.
  params = reshard_params(state)
  full_grads = None
  if with_grads:
    frozen = plan_lib.split_trainable(plan, state.params)[1]
    zeros = jax.tree.map(lambda x: x, frozen)
    merged = plan_lib.merge_trainable(plan, grads, zeros)
    full_grads = jax.jit(unpack, out_shardings=replicated)(merged)
    if plan.has_frozen:
      leaves = jax.tree_util.tree_leaves(full_grads)
      full_grads = jax.tree_util.tree_unflatten(
          plan.treedef, [None if l.frozen else x for l, x in zip(plan.leaves, leaves)])
  if offload_to_cpu:
    params = _to_host(params)
    full_grads = _to_host(full_grads) if full_grads is not None else None
  if rank0_only and jax.process_index() != 0:
    params, full_grads = None, None
  return (params, full_grads) if with_grads else params


@mesh_lib.own_mesh
def write_full_params(state: ShardedTrainState, fn: Callable[[Any], Any], *,
                      rank0_only: bool = False) -> ShardedTrainState:
  """Applies ``fn(full_params) -> full_params`` and writes the result back
  into the shards (PyTorch ``summon_full_params(writeback=True)``).

  ``fn`` must be a pure JAX function returning a tree of the same structure,
  shapes and dtypes. The optimizer state is left unchanged, as in PyTorch.
  With ``FSDPConfig(lora=...)`` ``fn`` gets and returns the stored tree:
  each target a ``LoRAWeight`` (``base``, as stored, ``lora_A``,
  ``lora_B``), since a merged kernel cannot be split back.

  Raises:
    ValueError: with ``rank0_only=True`` (PyTorch refuses writeback with
      rank0_only: other processes would not see the change).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=3, devices=jax.devices()[:3])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones(5)},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> state = fsdp_jax.write_full_params(state, lambda p: {"w": p["w"] * 2})
    >>> fsdp_jax.summon_full_params(state)["w"].tolist()
    [2.0, 2.0, 2.0, 2.0, 2.0]
  """
  if rank0_only:
    raise ValueError(
        "write_full_params(rank0_only=True) is not supported: only process 0 "
        "would hold the full parameters, so the write-back could not reach the "
        "other processes' shards (PyTorch refuses writeback=True with "
        "rank0_only=True). Call it with rank0_only=False.")
  plan = state.plan
  shardings = plan.storage_shardings()

  def run(storage):
    full = unpack_all(plan, offload.to_device(storage))
    new = fn(full)
    _check_same_tree(full, new)
    new_leaves = jax.tree_util.tree_leaves(new)
    packed = {u.index: layout.pack_unit(plan, u, {i: new_leaves[i] for i in u.leaf_ids})
              for u in plan.units}
    return assemble_storage(plan, packed, pack_ignored(plan, new_leaves))

  new_params = jax.jit(run, out_shardings=shardings)(state.params)
  return state.replace(params=new_params)


def _check_same_tree(old, new):
  old_l, old_def = jax.tree_util.tree_flatten_with_path(old)
  new_l, new_def = jax.tree_util.tree_flatten_with_path(new)
  if old_def != new_def:
    raise ValueError(f"write_full_params: fn changed the tree structure from {old_def} "
                     f"to {new_def}; return a tree like its input.")
  for (path, a), (_, b) in zip(old_l, new_l):
    if a.shape != b.shape or a.dtype != b.dtype:
      raise ValueError(
          f"write_full_params: fn returned {jax.tree_util.keystr(path)} with shape "
          f"{b.shape} {b.dtype}; the parameter is {a.shape} {a.dtype}. Return "
          "values of the same shape and dtype (cast with .astype).")


@mesh_lib.own_mesh
def apply(state: ShardedTrainState, fn: Callable[[str, Any], Any]) -> ShardedTrainState:
  """Maps ``fn(name, full_leaf) -> new_leaf`` over every parameter, one unit
  at a time (PyTorch ``FullyShardedDataParallel.apply``): only one unit is
  ever gathered. ``name`` is the dotted parameter name; return the leaf
  unchanged to keep it.

  Example (re-initialise every bias to zero):
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(
    ...     params={"w": jnp.ones((2, 3)), "bias": jnp.ones(3)},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> state = fsdp_jax.apply(state, lambda name, x: x * 0 if name.endswith("bias") else x)
    >>> fsdp_jax.summon_full_params(state)["bias"].tolist()
    [0.0, 0.0, 0.0]
  """
  plan = state.plan
  storage = state.params
  per_unit = {}
  for unit in plan.units:
    arrays = layout.unit_storage(plan, unit, storage)
    sh = plan.sharding(plan.spec_for(unit))  # the stored memory kind, too
    out_sh = ({i: sh for i in unit.leaf_ids} if plan.use_orig_params else {"flat": sh})

    def run(arrays, unit=unit):
      full = layout.unpack_storage_full(plan, unit, offload.to_device(arrays),
                                        replicate=True)
      new = {}
      for i, x in full.items():
        y = fn(plan.leaves[i].name, x)
        if y.shape != x.shape or y.dtype != x.dtype:
          raise ValueError(
              f"apply: fn returned shape {y.shape} {y.dtype} for parameter "
              f"{plan.leaves[i].name!r} of shape {x.shape} {x.dtype}; return "
              "the same shape and dtype.")
        new[i] = y
      return layout.pack_unit(plan, unit, new, replicate=True)

    per_unit[unit.index] = jax.jit(run, out_shardings=out_sh)(arrays)
  ignored = {}
  if plan.ignored_leaves:
    # Ignored leaves: fn sees the first device's copy; every device gets the result.
    ign_sh = plan.sharding(plan.ignored_spec())

    def run_ignored(copies):
      copies = offload.to_device(copies)
      return {i: jax.numpy.broadcast_to(fn(plan.leaves[i].name, x[0])[None], x.shape)
              for i, x in copies.items()}

    ignored = jax.jit(run_ignored, out_shardings=ign_sh)(ignored_storage(plan, storage))
  return state.replace(params=assemble_storage(plan, per_unit, ignored))


@mesh_lib.own_mesh
def sharded_grads(loss_fn: Callable, state: ShardedTrainState, batch):
  """The reduced, averaged gradient shards of ``batch`` (in the optimizer's
  layout, as global arrays, in device memory also with CPU offload), without
  updating the state. Pass them to ``summon_full_params(with_grads=True,
  grads=...)`` to see full gradients.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> loss_fn = lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2)
    >>> grads = fsdp_jax.custom.sharded_grads(loss_fn, state, {"x": jnp.ones((2, 4))})
    >>> grads["_flat_param"].shape  # the flat parameter's gradient, sharded
    (8,)
    >>> params, full_grads = fsdp_jax.summon_full_params(state, with_grads=True, grads=grads)
    >>> full_grads["w"].tolist()
    [[4.0, 4.0], [4.0, 4.0], [4.0, 4.0], [4.0, 4.0]]
  """
  plan = state.plan
  vg = grads_lib.value_and_grad(loss_fn, plan=plan)
  p_specs = plan_lib.param_specs(plan)
  t_specs = plan_lib.split_trainable(plan, p_specs)[0]
  b_specs = plan_lib.batch_specs(plan, batch)
  ms_specs = jax.tree.map(lambda _: P(), state.model_state)
  rng_specs = jax.tree.map(lambda _: P(), state.rng)

  def body(params, model_state, batch_local, rng, step):
    # The key the step would pass at this step (see shard_train_step).
    key = None if rng is None else jax.tree.map(
        lambda r: loss_lib.device_key(r, step, plan.axes.batch_axes), rng)
    _, g, _ = vg(offload.to_device(params), batch_local, model_state, None, key)
    return g

  fn = jax.jit(jax.shard_map(body, mesh=plan.mesh,
                             in_specs=(p_specs, ms_specs, b_specs, rng_specs, P()),
                             out_specs=t_specs, check_vma=False))
  return fn(state.params, state.model_state, place_batch(plan, batch), state.rng, state.step)
