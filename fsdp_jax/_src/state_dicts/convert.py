"""What the state dicts share: dotted parameter names, canonical shardings,
and unit-by-unit conversion between the stored (sharded) layout and named
leaves, plus the optimizer state's slot layout. Also the interface
``fsdp_jax/_src/checkpoint.py`` builds on."""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from fsdp_jax._src import layout, offload, optim
from fsdp_jax._src.config import StateDictType
from fsdp_jax._src.plan import LeafSpec, Plan, UnitSpec
from fsdp_jax._src.state import ShardedTrainState



PARAMS = "params"
OPT_STATE = "opt_state"
# Data fields of the train state that hold model buffers (PyTorch registers
# buffers in the module state dict): their leaves join the model state dict.
BUFFER_FIELDS = ("model_state",)
LOCAL_METADATA_KEY = "_metadata"
MAX_LINES = 25


class OptimStateKeyType(enum.Enum):
  """How an optimizer state dict's ``"state"`` is keyed (PyTorch's enum).

  ``PARAM_NAME``: dotted parameter names (what fsdp_jax returns).
  ``PARAM_ID``: integer ids, the parameter's position in
  ``jax.tree_util.tree_leaves(params)`` of the unsharded tree (the order an
  unsharded optax state holds them in).

  Example:
    >>> import fsdp_jax
    >>> [t.name for t in fsdp_jax.OptimStateKeyType]
    ['PARAM_NAME', 'PARAM_ID']
  """

  PARAM_NAME = enum.auto()
  PARAM_ID = enum.auto()


# ---------------------------------------------------------------------------
# Small helpers


def require_state(state, fn: str) -> Plan:
  if not isinstance(state, ShardedTrainState):
    raise TypeError(
        f"{fn}: state must be the fsdp_jax.ShardedTrainState returned by "
        f"fsdp_jax.init_train_state (or a restored one); got {type(state).__name__}.")
  return state.plan


def require_type(state_dict_type, fn: str):
  if not isinstance(state_dict_type, StateDictType):
    raise TypeError(
        f"{fn}: state_dict_type={state_dict_type!r} is not a fsdp_jax.StateDictType; "
        "pass StateDictType.FULL_STATE_DICT, SHARDED_STATE_DICT or LOCAL_STATE_DICT.")
  return state_dict_type


def data_fields(state) -> list[str]:
  """Names of the train state's data (non-static) dataclass fields."""
  return [f.name for f in dataclasses.fields(state) if not f.metadata.get("static", False)]


def param_names(plan: Plan) -> list[str]:
  """Dotted names of the original parameters, in ``tree_leaves`` order."""
  names = [leaf.name for leaf in plan.leaves]
  if len(set(names)) != len(names):
    seen, dups = set(), []
    for n in names:
      if n in seen:
        dups.append(n)
      seen.add(n)
    raise ValueError(
        f"Parameters {sorted(set(dups))} share a dotted name (a key containing '.' "
        "collides with a nested path). State dicts are keyed by dotted names; "
        "rename the keys so every parameter path is unique.")
  return names


def shape_of(x) -> tuple:
  return tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)


def dtype_name(dtype) -> str:
  return str(jnp.dtype(dtype)) if not is_key_dtype(dtype) else str(dtype)


def is_key_dtype(dtype) -> bool:
  try:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  except TypeError:
    return False


def is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def _mesh_desc(plan: Plan) -> str:
  return ", ".join(f"{a!r} of size {s}" for a, s in plan.mesh.shape.items())


def shard_desc(plan: Plan) -> str:
  axes = plan.axes.shard_axes
  if not axes:
    return f"replicated over mesh axes ({_mesh_desc(plan)}) ({plan.config.sharding_strategy.name})"
  return (f"sharded over mesh axis {axes[0]!r}" if len(axes) == 1 else
          f"sharded over mesh axes {axes}") + f" (N={plan.n})"


def problems(lines: list[str]) -> str:
  shown = lines[:MAX_LINES]
  more = len(lines) - len(shown)
  return "\n".join("  " + l for l in shown) + (f"\n  ... and {more} more" if more else "")


def replicated_sharding(plan: Plan) -> NamedSharding:
  return NamedSharding(plan.mesh, P())


def layer_axis(plan: Plan, leaf: LeafSpec) -> int:
  return 1 if not leaf.ignored and plan.units[leaf.unit].stacked else 0


def canonical_sharding(plan: Plan, leaf: LeafSpec) -> NamedSharding:
  """The sharding of a parameter of global shape ``leaf.shape`` on
  ``plan``'s mesh in sharded state dicts and checkpoints: its per-layer first
  dimension (or else the first dimension that divides) split over the shard
  axes; replicated when no dimension divides ``N`` (or NO_SHARD)."""
  axes = plan.axes.shard_axes
  shape = leaf.shape
  n = plan.n
  if not axes or n == 1 or not shape:
    return replicated_sharding(plan)
  first = layer_axis(plan, leaf)
  order = [first] + [d for d in range(len(shape)) if d != first]
  for d in order:
    if shape[d] and shape[d] % n == 0:
      spec = [None] * len(shape)
      spec[d] = axes[0] if len(axes) == 1 else axes
      return NamedSharding(plan.mesh, P(*spec))
  return replicated_sharding(plan)


def to_host(x):
  return np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else np.asarray(x)


def to_pinned(x):
  if not isinstance(x, jax.Array):
    return x
  return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))


def on_devices(x, mesh) -> bool:
  """Whether a jax.Array can go straight into a jit over ``mesh``."""
  sh = x.sharding
  kind = getattr(sh, "memory_kind", None)
  default = mesh.devices.flat[0].default_memory().kind
  return sh.device_set == set(mesh.devices.flat) and kind in (None, default)


def place(x, sharding: NamedSharding, *, shape, dtype):
  """Puts ``x`` (numpy, a jax.Array on any devices, or a Python scalar) onto
  ``sharding`` with ``dtype``. Host values are sliced per device
  (``make_array_from_callback``: no device ever holds more than its shard)."""
  if isinstance(x, jax.Array):
    default = sharding.mesh.devices.flat[0].default_memory().kind
    if getattr(x.sharding, "memory_kind", None) not in (None, default):
      x = jax.device_put(x, x.sharding.with_memory_kind(default))  # off pinned host first
    y = x if on_devices(x, sharding.mesh) else jax.device_put(x, sharding)
    if y.dtype != dtype:
      y = y.astype(dtype)
    if y.sharding != sharding and not y.sharding.is_equivalent_to(sharding, len(shape)):
      y = jax.device_put(y, sharding)
    return y
  arr = np.asarray(x)
  if arr.dtype != dtype:
    arr = arr.astype(dtype)
  return jax.make_array_from_callback(tuple(shape), sharding, lambda idx: arr[idx])


# ---------------------------------------------------------------------------
# Stored layout <-> named full-shape leaves, one unit at a time


# The jitted per-unit pack/unpack programs are cached by (plan, unit, ...):
# a state dict call runs one per unit, and saving every few steps would
# otherwise trace and compile them again each time. Bounded (a plan holds its
# mesh, and a cached program its executable); clear_caches() empties them.
_CACHE_SIZE = 256


def clear_caches() -> None:
  """Drops the cached pack/unpack programs (and with them their plans)."""
  for fn in (_unpack_fn, _pack_fn, _ignored_unpack_fn, _ignored_pack_fn):
    fn.cache_clear()


def _sub_unit(plan: Plan, unit: UnitSpec, ids: tuple) -> UnitSpec:
  if plan.use_orig_params and ids != unit.leaf_ids:
    return dataclasses.replace(unit, leaf_ids=ids)
  return unit


# One unit's stored arrays -> its full-shape leaves (state_dict, optim_state_dict,
# checkpoint save): one program per unit and output kind.
@functools.lru_cache(maxsize=_CACHE_SIZE)
def _unpack_fn(plan: Plan, unit_index: int, ids: tuple, replicated: bool):
  unit = _sub_unit(plan, plan.units[unit_index], ids)
  out = {i: (replicated_sharding(plan) if replicated else canonical_sharding(plan, plan.leaves[i]))
         for i in ids}
  return jax.jit(lambda arrays: layout.unpack_storage_full(plan, unit, offload.to_device(arrays),
                                                        replicate=replicated),
                 out_shardings=out)


# Full-shape leaves -> one unit's stored arrays (load_state_dict,
# optim_state_dict_to_load, checkpoint restore): one program per unit and dtypes.
@functools.lru_cache(maxsize=_CACHE_SIZE)
def _pack_fn(plan: Plan, unit_index: int, ids: tuple, dtypes: tuple):
  unit = _sub_unit(plan, plan.units[unit_index], ids)
  shardings = plan.storage_shardings()  # the state's own shardings (and memory kinds)
  if plan.use_orig_params:
    by_leaf = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    out = {i: by_leaf[i] for i in ids}
  else:
    out = {"flat": shardings[unit.flat_key]}

  def pack(leaves):
    leaves = {i: leaves[i].astype(d) for i, d in zip(ids, dtypes)}
    return layout.pack_unit(plan, unit, leaves)

  return jax.jit(pack, out_shardings=out)


def ignored_entries(plan: Plan, tree) -> dict[int, Any]:
  """Stored per-device copies of the ignored leaves (None where masked)."""
  out = {}
  if plan.use_orig_params:
    parts = plan.treedef.flatten_up_to(tree)
    for l in plan.ignored_leaves:
      out[l.index] = None if is_masked(parts[l.index]) else parts[l.index]
  else:
    for l in plan.ignored_leaves:
      x = tree[plan.ignored_key(l)]
      out[l.index] = None if is_masked(x) else x
  return out


# An ignored leaf's per-device copies -> one copy: one program per ignored leaf.
@functools.lru_cache(maxsize=_CACHE_SIZE)
def _ignored_unpack_fn(plan: Plan, index: int, replicated: bool):
  leaf = plan.leaves[index]
  out = replicated_sharding(plan) if replicated else canonical_sharding(plan, leaf)
  return jax.jit(lambda x: offload.to_device(x)[0], out_shardings=out)  # the first device's copy


# One value -> an ignored leaf's per-device copies: one program per ignored leaf
# and dtype.
@functools.lru_cache(maxsize=_CACHE_SIZE)
def _ignored_pack_fn(plan: Plan, index: int, dtype):
  leaf = plan.leaves[index]
  world = plan.axes.world_size
  return jax.jit(lambda x: jnp.broadcast_to(x.astype(dtype)[None], (world,) + leaf.shape),
                 out_shardings=plan.sharding(plan.ignored_spec()))


def split_storage(plan: Plan, tree) -> dict[int, list]:
  """A tree with the stored-params structure -> ``{unit: [array or None]}``
  aligned with the unit's stored arrays (None where optax masked it out)."""
  out = {}
  if plan.use_orig_params:
    leaves = plan.treedef.flatten_up_to(tree)
    for u in plan.units:
      out[u.index] = [None if is_masked(leaves[i]) else leaves[i] for i in u.leaf_ids]
  else:
    for u in plan.units:
      x = tree[u.flat_key]
      out[u.index] = [None if is_masked(x) else x]
  return out


def present(plan: Plan, unit: UnitSpec, arrays: list) -> tuple:
  if plan.use_orig_params:
    return tuple(i for i, a in zip(unit.leaf_ids, arrays) if a is not None)
  return unit.leaf_ids if arrays[0] is not None else ()


def storage_to_leaves(plan: Plan, tree, *, replicated: bool = False,
                      post: Optional[Callable] = None) -> dict[int, Any]:
  """Stored arrays -> ``{leaf index: full-shape array}`` (canonically sharded,
  or replicated). ``post`` runs on each unit's results as they are made."""
  out = {}
  split = split_storage(plan, tree)
  for unit in plan.units:
    arrays = split[unit.index]
    ids = present(plan, unit, arrays)
    if not ids:
      continue
    res = _unpack_fn(plan, unit.index, ids, replicated)([a for a in arrays if a is not None])
    if post is not None:
      res = {i: post(x) for i, x in res.items()}
    out.update(res)
  for i, x in ignored_entries(plan, tree).items():
    if x is not None:
      y = _ignored_unpack_fn(plan, i, replicated)(x)
      out[i] = post(y) if post is not None else y
  return out


def leaves_to_storage(plan: Plan, leaves: dict, template):
  """``{leaf index: full-shape array on plan's mesh}`` -> a tree laid out
  like ``template`` (the stored params, or an optimizer slot mirroring them:
  masked leaves stay masked, dtypes follow the template)."""
  split = split_storage(plan, template)
  per_leaf: list = [None] * len(plan.leaves)
  flat: dict = {}
  for unit in plan.units:
    tmpl = split[unit.index]
    ids = present(plan, unit, tmpl)
    if not ids:
      continue
    if plan.use_orig_params:
      dtypes = tuple(jnp.dtype(t.dtype) for t in tmpl if t is not None)
    else:
      dtypes = tuple(jnp.dtype(tmpl[0].dtype) for _ in ids)
    packed = _pack_fn(plan, unit.index, ids, dtypes)({i: leaves[i] for i in ids})
    if plan.use_orig_params:
      for i in ids:
        per_leaf[i] = packed[i]
    else:
      flat[unit.flat_key] = packed["flat"]
  for i, tmpl in ignored_entries(plan, template).items():
    if tmpl is not None and i in leaves:
      packed = _ignored_pack_fn(plan, i, jnp.dtype(tmpl.dtype))(leaves[i])
      if plan.use_orig_params:
        per_leaf[i] = packed
      else:
        flat[plan.ignored_key(plan.leaves[i])] = packed
  if plan.use_orig_params:
    orig = plan.treedef.flatten_up_to(template)
    return plan.treedef.unflatten([x if x is not None else orig[i]
                                   for i, x in enumerate(per_leaf)])
  return {k: flat.get(k, template[k]) for k in _flat_keys(plan)}


def _flat_keys(plan: Plan) -> list[str]:
  """Keys of the flat layout's params dict (units and ignored leaves), sorted
  as ``tree_leaves`` orders them."""
  return sorted([u.flat_key for u in plan.units] +
                [plan.ignored_key(l) for l in plan.ignored_leaves])


# ---------------------------------------------------------------------------
# The optimizer state: slots mirroring the params, and other leaves


@dataclasses.dataclass
class OptLayout:
  """The stored optimizer state (a :class:`~fsdp_jax._src.optim.ShardedOptState`)
  as named entries, in the order of ``optimizer.init(params)``'s leaves:

  * ``("slot", slot, tree)``: a slot laid out like the stored params
    (``optax.MaskedNode`` where it has no entry), named per parameter;
  * ``("pleaf", (param index, slot), array)``: per-parameter state of another
    shape than the parameter (replicated), named per parameter;
  * ``("leaf", path, array)``: every other leaf (a parameter-group value).
  """

  state: Any
  entries: list

  def unflatten(self, values):
    """Entries' values (same order) -> a ``ShardedOptState``."""
    lay = self.state.layout
    slots, leaves = {}, {}
    pleaf_paths = {(e.param, e.slot): e.path for e in lay.entries if e.kind == "param"}
    for (kind, name, _), v in zip(self.entries, values):
      if kind == "slot":
        slots[name] = v
      elif kind == "pleaf":
        leaves[pleaf_paths[name]] = v
      else:
        leaves[name] = v
    return optim.ShardedOptState(slots, leaves, lay)

  @property
  def slots(self):
    return [(n, v) for k, n, v in self.entries if k == "slot"]

  @property
  def pleaves(self):
    return [(n, v) for k, n, v in self.entries if k == "pleaf"]

  @property
  def scalars(self):
    return [(n, v) for k, n, v in self.entries if k == "leaf"]


def opt_layout(plan: Plan, opt_state) -> OptLayout:
  """Names the entries of a state's optimizer state (concrete or abstract)."""
  if not isinstance(opt_state, optim.ShardedOptState):
    raise TypeError(
        f"The state's opt_state is a {type(opt_state).__name__}, not the "
        "ShardedOptState that init_train_state builds. Fix: build the state with "
        "fsdp_jax.init_train_state, and replace its optimizer state only with values "
        "from optim_state_dict_to_load / shard_full_optim_state_dict.")
  lay = opt_state.layout
  entries = []
  for slot in lay.slot_names:
    entries.append(("slot", slot, opt_state.slots[slot]))
  for e in lay.entries:
    if e.kind == "param":
      entries.append(("pleaf", (e.param, e.slot), opt_state.leaves[e.path]))
    elif e.kind == "group":
      entries.append(("leaf", e.path, opt_state.leaves[e.path]))
  return OptLayout(opt_state, entries)


def storage_keys(plan: Plan) -> list[str]:
  """Names of the stored arrays, in ``tree_leaves`` order of the params."""
  if plan.use_orig_params:
    return param_names(plan)
  return _flat_keys(plan)


def storage_items(plan: Plan, tree) -> dict:
  """A stored-layout tree -> ``{storage key: array or MaskedNode}``."""
  if plan.use_orig_params:
    return dict(zip(param_names(plan), plan.treedef.flatten_up_to(tree)))
  return {k: tree[k] for k in _flat_keys(plan)}


def storage_from_items(plan: Plan, items: dict):
  if plan.use_orig_params:
    return plan.treedef.unflatten([items[n] for n in param_names(plan)])
  return {k: items[k] for k in _flat_keys(plan)}


def storage_sharding_by_key(plan: Plan) -> dict:
  sh = plan.storage_shardings()
  return storage_items(plan, sh) if plan.use_orig_params else sh


def storage_shape_by_key(plan: Plan) -> dict:
  return {k: tuple(v.shape) for k, v in storage_items(plan, plan.storage_shapes()).items()}


