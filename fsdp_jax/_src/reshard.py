"""``reshard_params``: the hand-off from training to inference.

The user's parameter tree (LoRA merged, QLoRA dequantized) as ``jax.Array`` s in the
layout a plain ``jax.jit`` sampler or serving engine wants: replicated, or
split over a ``"tensor"`` axis by :class:`~fsdp_jax.TensorParallel` rules.

The tree is made one group of units at a time (a unit, or the units a LoRA
target's base and adapters live in): one program gathers the group's shards,
merges and casts, and places each leaf in its target sharding, so a device
holds its share of the target layout plus one group in flight.
"""

from __future__ import annotations

import collections
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fsdp_jax._src import layout, naming, offload
from fsdp_jax._src import lora as lora_lib
from fsdp_jax._src import tensor as tensor_lib
from fsdp_jax._src.config import is_float_dtype
from fsdp_jax._src.plan import Plan
from fsdp_jax._src.state import ShardedTrainState, ignored_storage
from fsdp_jax._src.tensor import TensorParallel


def reshard_params(state: ShardedTrainState, *, mesh: Optional[Mesh] = None,
                   tensor_parallel: Optional[TensorParallel] = None, dtype=None):
  """The user's parameter tree in an inference layout, for plain ``jax.jit``
  code (a sampler with a KV cache, a serving engine).

  The tree is the one passed to :func:`~fsdp_jax.init_train_state` (its
  names and shapes), with each LoRA target's effective kernel (``base +
  (alpha / rank) * A @ B``, a QLoRA base dequantized) as
  :func:`~fsdp_jax.summon_full_params` gives it (bit for bit: it is this
  function with the defaults). It is made one unit at a time: each unit's
  shards are gathered, merged, cast and placed in the target layout, then
  freed, so no device holds more than its share of the result plus one
  unit in flight.

  Args:
    state: the sharded train state.
    mesh: the target mesh, on the state's devices in any arrangement (e.g.
      ``fsdp_jax.make_mesh(tensor=8, devices=...)`` for the 8 GPUs of one
      host); default: the state's mesh.
    tensor_parallel: :class:`~fsdp_jax.TensorParallel` rules: the leaves
      they name are split over their axis of ``mesh`` (``"colwise"``: a
      kernel's output axis, ``"rowwise"``: its input axis, or a tuple per
      dimension), every other leaf is replicated; default None: every leaf
      replicated over ``mesh``. A stacked unit's leaves
      (``FSDPConfig(stacked_layers=...)``) keep their leading layer axis,
      which is never split.
    dtype: cast floating leaves to this dtype (e.g. ``jnp.bfloat16``);
      default: the stored dtype.

  Returns:
    The parameter tree of global ``jax.Array`` s on ``mesh``.

  Raises:
    ValueError: ``mesh`` is not on the state's devices; ``tensor_parallel``
      names an axis ``mesh`` lacks, a rule matches no parameter, or a split
      dimension is not divisible by the axis size (each naming the rule,
      parameter, shape and fix).
    TypeError: a wrong type for ``mesh``, ``tensor_parallel`` or ``dtype``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
    >>> params = {"up": {"kernel": jnp.ones((8, 16))}, "down": {"kernel": jnp.ones((16, 8))}}
    >>> state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1),
    ...     mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> tp = fsdp_jax.TensorParallel(rules=[("up", "colwise"), ("down", "rowwise")])
    >>> out = fsdp_jax.reshard_params(state, mesh=fsdp_jax.make_mesh(
    ...     tensor=4, devices=jax.devices()[:4]), tensor_parallel=tp, dtype=jnp.bfloat16)
    >>> tuple(out["up"]["kernel"].sharding.spec), out["up"]["kernel"].dtype.name
    ((None, 'tensor'), 'bfloat16')
    >>> out["down"]["kernel"].addressable_shards[0].data.shape   # 1/4 of the rows
    (4, 8)
  """
  if not isinstance(state, ShardedTrainState):
    raise TypeError("reshard_params(state): pass the ShardedTrainState built by "
                    f"fsdp_jax.init_train_state; got {type(state).__name__}.")
  plan = state.plan
  target = _check_mesh(plan, mesh)
  if dtype is not None:
    try:
      dtype = jnp.dtype(dtype)
    except TypeError as e:
      raise TypeError(f"reshard_params(dtype={dtype!r}) is not a dtype.") from e
    if not is_float_dtype(dtype):
      raise ValueError(f"reshard_params(dtype={dtype}): floating leaves are cast to dtype, so "
                       "it must be a floating dtype such as jnp.bfloat16 or jnp.float32.")
  recipe, treedef = _recipe(plan)
  # A program's inputs and outputs must list the devices in one order: it
  # writes each leaf on a mesh of the target's shape in the state's device
  # order, from where a target in another order is one copy per leaf away.
  same_order = list(target.devices.flat) == list(plan.mesh.devices.flat)
  compute = target if same_order else Mesh(
      np.asarray(list(plan.mesh.devices.flat)).reshape(target.devices.shape),
      target.axis_names, axis_types=target.axis_types)
  specs = _specs(plan, recipe, target, tensor_parallel)
  shardings = [NamedSharding(compute, s) for s in specs]
  leaves: list = [None] * len(recipe)
  for units, positions in _groups(plan, recipe):
    storage = tuple(tuple(layout.unit_storage(plan, plan.units[u], state.params)) for u in units)
    outs = _group_program(plan, units, tuple(positions), tuple(shardings[k] for k in positions),
                          dtype)(storage)
    for k, x in zip(positions, outs):
      leaves[k] = x
  todo = [k for k, x in enumerate(leaves) if x is None]  # ignored leaves: per-device copies
  if todo:
    copies = ignored_storage(plan, state.params)
    outs = _ignored_program(plan, tuple(todo), tuple(shardings[k] for k in todo), dtype)(
        {k: copies[recipe[k]] for k in todo})
    for k in todo:
      leaves[k] = outs[k]
  if not same_order:
    leaves = [jax.device_put(x, NamedSharding(target, s)) for x, s in zip(leaves, specs)]
  return jax.tree_util.tree_unflatten(treedef, leaves)


def _check_mesh(plan: Plan, mesh) -> Mesh:
  if mesh is None:
    return plan.mesh
  if not isinstance(mesh, Mesh):
    raise TypeError("reshard_params(mesh=...) must be a jax.sharding.Mesh (e.g. "
                    f"fsdp_jax.make_mesh(tensor=8)); got {type(mesh).__name__}.")
  have = sorted(d.id for d in plan.mesh.devices.flat)
  want = sorted(d.id for d in mesh.devices.flat)
  if have != want:
    raise ValueError(
        f"reshard_params(mesh=...): the target mesh {dict(mesh.shape)} is on devices {want}, "
        f"the state's mesh {dict(plan.mesh.shape)} on devices {have}. The parameters are "
        "moved unit by unit within one set of devices, so the target mesh must hold exactly "
        "the state's devices, in any arrangement. Fix: build it from them, e.g. "
        f"fsdp_jax.make_mesh(tensor={len(have)}, devices=state.plan.mesh.devices.flat), "
        "or reshard onto the state's devices and move the result with jax.device_put "
        "(export_params writes it for another job).")
  return mesh


def _recipe(plan: Plan):
  """Each leaf of the user's tree as the stored leaves it is made of: a
  leaf index, or a :class:`~fsdp_jax._src.lora.LoRAWeight` of three;
  ``(recipe leaves, the user's treedef)``."""
  stored = jax.tree_util.tree_unflatten(plan.treedef, list(range(len(plan.leaves))))
  flat, treedef = jax.tree_util.tree_flatten(stored, is_leaf=lora_lib.is_lora_weight)
  return flat, treedef


def _first(item) -> int:
  return item.base if lora_lib.is_lora_weight(item) else item


def _stored_ids(item) -> tuple:
  return (item.base, item.lora_A, item.lora_B) if lora_lib.is_lora_weight(item) else (item,)


def _specs(plan: Plan, recipe, mesh: Mesh, tp) -> list:
  """The target ``PartitionSpec`` of each leaf of the user's tree."""
  if tp is None:
    return [P()] * len(recipe)
  if not isinstance(tp, TensorParallel):
    raise TypeError("reshard_params(tensor_parallel=...) must be a fsdp_jax.TensorParallel; "
                    f"got {type(tp).__name__}.")
  if tp.axis not in mesh.shape:
    raise ValueError(
        f"reshard_params: the TensorParallel rules split over the mesh axis {tp.axis!r}, but "
        f"the target mesh has axes {dict(mesh.shape)}. Fix: pass a mesh with that axis, "
        "e.g. mesh=fsdp_jax.make_mesh(tensor=8) on the state's devices.")
  user = jax.tree_util.tree_unflatten(plan.treedef, [
      jax.ShapeDtypeStruct(l.shape, l.dtype) for l in plan.leaves])
  paths = naming.leaf_paths(user, is_leaf=lora_lib.is_lora_weight)
  shapes = [_user_shape(plan, item) for item in recipe]
  leads = [int(not plan.leaves[_first(item)].ignored
               and plan.units[plan.leaves[_first(item)].unit].stacked) for item in recipe]
  dims = tensor_lib.leaf_dims(paths, shapes, leads, tp, int(mesh.shape[tp.axis]))
  out = []
  for k, shape in enumerate(shapes):
    spec = [None] * len(shape)
    if k in dims:
      spec[leads[k] + dims[k]] = tp.axis
    out.append(P(*spec) if k in dims else P())
  return out


def _user_shape(plan: Plan, item) -> tuple:
  if lora_lib.is_lora_weight(item):
    a = plan.leaves[item.lora_A].shape
    return tuple(a[:-1]) + (plan.leaves[item.lora_B].shape[-1],)
  return plan.leaves[item].shape


def _groups(plan: Plan, recipe):
  """``[(unit indices, positions in the user's tree)]``: the units a LoRA
  target's stored leaves live in form one group; ignored leaves none."""
  parent = {u.index: u.index for u in plan.units}

  def root(u):
    while parent[u] != u:
      parent[u] = parent[parent[u]]
      u = parent[u]
    return u

  for item in recipe:
    units = {plan.leaves[i].unit for i in _stored_ids(item) if not plan.leaves[i].ignored}
    first = min(units, default=None)
    for u in units:
      parent[root(u)] = root(first)
  members: dict = {}
  for u in plan.units:
    members.setdefault(root(u.index), []).append(u.index)
  at: dict = {}
  for k, item in enumerate(recipe):
    leaf = plan.leaves[_first(item)]
    if not leaf.ignored:
      at.setdefault(root(leaf.unit), []).append(k)
  return [(tuple(members[r]), at[r]) for r in sorted(members) if r in at]


def _cast(x, dtype):
  return x if dtype is None or not is_float_dtype(x.dtype) else x.astype(dtype)


# Programs are kept for the next call (a loop alternating training with
# sampling reshards the same plan again): at most this many.
_PROGRAMS = 256
_programs: collections.OrderedDict = collections.OrderedDict()


def _signature(plan: Plan, units: tuple, positions: tuple, recipe) -> tuple:
  """What a group's program depends on, without the units' names and
  places: the blocks of a model share one program."""
  where: dict = {}  # stored leaf id -> (unit position, leaf position)
  unit_keys = []
  for j, u in enumerate(units):
    unit = plan.units[u]
    leaves = [plan.leaves[i] for i in unit.leaf_ids]
    where.update({l.index: (j, k) for k, l in enumerate(leaves)})
    unit_keys.append((unit.stacked, unit.num_layers, unit.tensor,
                      tuple((l.shape, l.layer_shape, l.dtype.name, l.tensor_dim) for l in leaves)))
  items = []
  for k in positions:
    item = recipe[k]
    if lora_lib.is_lora_weight(item):
      items.append((where[item.base], where[item.lora_A], where[item.lora_B],
                    item.quantization, item.width, item.dtype))
    else:
      items.append(where[item])
  scaling = None if plan.config.lora is None else plan.config.lora.scaling
  return (plan.use_orig_params, plan.n, plan.t, plan.mesh, tuple(unit_keys), tuple(items),
          scaling)


def _group_program(plan: Plan, units: tuple, positions: tuple, shardings: tuple, dtype):
  """The jitted program making a group's leaves of the user's tree from its
  units' stored arrays (global view), each in its target sharding; groups
  of one signature (:func:`_signature`) share it."""
  recipe, _ = _recipe(plan)
  key = (_signature(plan, units, positions, recipe), shardings, dtype)
  if key in _programs:
    _programs.move_to_end(key)
    return _programs[key]
  scaling = key[0][-1]
  whole = NamedSharding(plan.mesh, P())

  def run(storage):
    full = {}
    for u, arrays in zip(units, storage):
      # Gathered whole first: the unpacking (slices of a flat parameter,
      # padding dropped) is then local, and compiles in a fraction of the
      # time the partitioner takes for slices of a sharded array.
      arrays = jax.lax.with_sharding_constraint(offload.to_device(arrays), whole)
      full.update(layout.unpack_storage_full(plan, plan.units[u], arrays))
    outs = []
    for k in positions:
      item = recipe[k]
      if lora_lib.is_lora_weight(item):
        node = item.replace(base=full[item.base], lora_A=full[item.lora_A],
                            lora_B=full[item.lora_B])
        x = lora_lib.merge(node, scaling)
      else:
        x = full[item]
      # Made whole before it is placed: the arithmetic (a LoRA merge) is
      # the same program whatever the target layout, and so are its bits.
      outs.append(jax.lax.with_sharding_constraint(_cast(x, dtype), whole))
    return outs

  _programs[key] = jax.jit(run, out_shardings=list(shardings))
  while len(_programs) > _PROGRAMS:
    _programs.popitem(last=False)
  return _programs[key]


@functools.lru_cache(maxsize=_PROGRAMS)
def _ignored_program(plan: Plan, positions: tuple, shardings: tuple, dtype):
  """Ignored leaves (a copy per device): the first device's copy, placed."""
  del plan
  return jax.jit(lambda copies: {k: _cast(offload.to_device(copies[k])[0], dtype)
                                 for k in positions},
                 out_shardings=dict(zip(positions, shardings)))


def clear_caches() -> None:
  """Forgets the compiled programs kept for the next call."""
  _programs.clear()
  _ignored_program.cache_clear()
