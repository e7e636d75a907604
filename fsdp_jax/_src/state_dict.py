"""State dicts of a sharded train state, as PyTorch FSDP names them.

A :class:`~fsdp_jax.ShardedTrainState` stores each unit's parameters in a
sharded layout (flat ``<unit>._flat_param`` buffers, or dim-0 shards of the
original leaves). The functions here convert to and from the three kinds of
PyTorch state dict, keyed by **dotted parameter names** (the unsharded tree's
paths, e.g. ``"params.Dense_0.kernel"`` or ``"blocks.0.w"``):

* ``StateDictType.FULL_STATE_DICT``: ``{name: full array}``. Arrays are
  replicated ``jax.Array`` s, or host ``numpy`` arrays with
  ``offload_to_cpu=True``; with ``rank0_only=True`` only process 0 gets them
  (every other process gets ``{}``).
* ``StateDictType.SHARDED_STATE_DICT``: ``{name: jax.Array}`` of the
  parameter's global shape, sharded over the state's shard axes (PyTorch's
  ShardedTensor). Loads onto any mesh, strategy and layout.
* ``StateDictType.LOCAL_STATE_DICT``: the stored arrays as they are (their
  addressable shards are this process's raw local shards), keyed by storage
  name, plus ``"_metadata"``: a JSON-able description of how to read them.
  Loads only onto the same layout and shard count.

Optimizer state dicts follow ``torch.optim.Optimizer.state_dict()``'s shape
where it fits optax: ``{"state": {name: {slot: array}}, "param_groups":
[{"params": [names], <path>: value, ...}]}``. A *slot* is a subtree of the
optax state that mirrors the parameters (Adam's ``"0.mu"`` and ``"0.nu"``);
optax keeps hyperparameters in closures, so the single parameter group holds
the remaining (non per-parameter) state leaves, e.g. Adam's ``"0.count"`` or
``inject_hyperparams``' ``"hyperparams.learning_rate"``.

Every conversion runs unit by unit with jitted programs whose outputs are
sharded, so at most one unit is ever gathered (FULL_STATE_DICT) and the
sharded kinds never hold a full parameter on one device when a dimension of
it divides the shard count.
"""

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

from fsdp_jax._src import layout, offload
from fsdp_jax._src.config import StateDictType
from fsdp_jax._src.plan import LeafSpec, Plan, UnitSpec
from fsdp_jax._src.state import ShardedTrainState, key_name

__all__ = [
    "OptimStateKeyType", "full_optim_state_dict", "load_state_dict",
    "optim_state_dict", "optim_state_dict_to_load", "rekey_optim_state_dict",
    "scatter_full_optim_state_dict", "shard_full_optim_state_dict", "state_dict",
]

PARAMS = "params"
OPT_STATE = "opt_state"
# Data fields of the train state that hold model buffers (PyTorch registers
# buffers in the module state dict): their leaves join the model state dict.
BUFFER_FIELDS = ("model_state",)
LOCAL_METADATA_KEY = "_metadata"
_ROOT = "_"  # name of a slot/leaf whose path is empty
_MAX_LINES = 25


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


def _require_state(state, fn: str) -> Plan:
  if not isinstance(state, ShardedTrainState):
    raise TypeError(
        f"{fn}: state must be the fsdp_jax.ShardedTrainState returned by "
        f"fsdp_jax.init_train_state (or a restored one); got {type(state).__name__}.")
  return state.plan


def _require_type(state_dict_type, fn: str):
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


def path_name(path) -> str:
  """A key path as a dotted name (``_`` for the empty path)."""
  return ".".join(key_name(k) for k in path) or _ROOT


def _shape(x) -> tuple:
  return tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)


def _dtype_name(dtype) -> str:
  return str(jnp.dtype(dtype)) if not _is_key_dtype(dtype) else str(dtype)


def _is_key_dtype(dtype) -> bool:
  try:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  except TypeError:
    return False


def _is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def _mesh_desc(plan: Plan) -> str:
  return ", ".join(f"{a!r} of size {s}" for a, s in plan.mesh.shape.items())


def _shard_desc(plan: Plan) -> str:
  axes = plan.axes.shard_axes
  if not axes:
    return f"replicated over mesh axes ({_mesh_desc(plan)}) ({plan.config.sharding_strategy.name})"
  return (f"sharded over mesh axis {axes[0]!r}" if len(axes) == 1 else
          f"sharded over mesh axes {axes}") + f" (N={plan.n})"


def _problems(lines: list[str]) -> str:
  shown = lines[:_MAX_LINES]
  more = len(lines) - len(shown)
  return "\n".join("  " + l for l in shown) + (f"\n  ... and {more} more" if more else "")


def _replicated(plan: Plan) -> NamedSharding:
  return NamedSharding(plan.mesh, P())


def _layer_axis(plan: Plan, leaf: LeafSpec) -> int:
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
    return _replicated(plan)
  first = _layer_axis(plan, leaf)
  order = [first] + [d for d in range(len(shape)) if d != first]
  for d in order:
    if shape[d] and shape[d] % n == 0:
      spec = [None] * len(shape)
      spec[d] = axes[0] if len(axes) == 1 else axes
      return NamedSharding(plan.mesh, P(*spec))
  return _replicated(plan)


def _to_host(x):
  return np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else np.asarray(x)


def _to_pinned(x):
  if not isinstance(x, jax.Array):
    return x
  return jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))


def _on_devices(x, mesh) -> bool:
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
    y = x if _on_devices(x, sharding.mesh) else jax.device_put(x, sharding)
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


def _sub_unit(plan: Plan, unit: UnitSpec, ids: tuple) -> UnitSpec:
  if plan.use_orig_params and ids != unit.leaf_ids:
    return dataclasses.replace(unit, leaf_ids=ids)
  return unit


@functools.lru_cache(maxsize=None)
def _unpack_fn(plan: Plan, unit_index: int, ids: tuple, replicated: bool):
  unit = _sub_unit(plan, plan.units[unit_index], ids)
  out = {i: (_replicated(plan) if replicated else canonical_sharding(plan, plan.leaves[i]))
         for i in ids}
  return jax.jit(lambda arrays: layout.unpack_storage_full(plan, unit, offload.to_device(arrays)),
                 out_shardings=out)


@functools.lru_cache(maxsize=None)
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


def _ignored_entries(plan: Plan, tree) -> dict[int, Any]:
  """Stored per-device copies of the ignored leaves (None where masked)."""
  out = {}
  if plan.use_orig_params:
    parts = plan.treedef.flatten_up_to(tree)
    for l in plan.ignored_leaves:
      out[l.index] = None if _is_masked(parts[l.index]) else parts[l.index]
  else:
    for l in plan.ignored_leaves:
      x = tree[plan.ignored_key(l)]
      out[l.index] = None if _is_masked(x) else x
  return out


@functools.lru_cache(maxsize=None)
def _ignored_unpack_fn(plan: Plan, index: int, replicated: bool):
  leaf = plan.leaves[index]
  out = _replicated(plan) if replicated else canonical_sharding(plan, leaf)
  return jax.jit(lambda x: offload.to_device(x)[0], out_shardings=out)  # the first device's copy


@functools.lru_cache(maxsize=None)
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
      out[u.index] = [None if _is_masked(leaves[i]) else leaves[i] for i in u.leaf_ids]
  else:
    for u in plan.units:
      x = tree[u.flat_key]
      out[u.index] = [None if _is_masked(x) else x]
  return out


def _present(plan: Plan, unit: UnitSpec, arrays: list) -> tuple:
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
    ids = _present(plan, unit, arrays)
    if not ids:
      continue
    res = _unpack_fn(plan, unit.index, ids, replicated)([a for a in arrays if a is not None])
    if post is not None:
      res = {i: post(x) for i, x in res.items()}
    out.update(res)
  for i, x in _ignored_entries(plan, tree).items():
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
    ids = _present(plan, unit, tmpl)
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
  for i, tmpl in _ignored_entries(plan, template).items():
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
    from fsdp_jax._src import optim  # pylint: disable=import-outside-toplevel
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
  from fsdp_jax._src import optim  # pylint: disable=import-outside-toplevel
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


def _storage_keys(plan: Plan) -> list[str]:
  """Names of the stored arrays, in ``tree_leaves`` order of the params."""
  if plan.use_orig_params:
    return param_names(plan)
  return _flat_keys(plan)


def _storage_items(plan: Plan, tree) -> dict:
  """A stored-layout tree -> ``{storage key: array or MaskedNode}``."""
  if plan.use_orig_params:
    return dict(zip(param_names(plan), plan.treedef.flatten_up_to(tree)))
  return {k: tree[k] for k in _flat_keys(plan)}


def _storage_from_items(plan: Plan, items: dict):
  if plan.use_orig_params:
    return plan.treedef.unflatten([items[n] for n in param_names(plan)])
  return {k: items[k] for k in _flat_keys(plan)}


def _storage_sharding_by_key(plan: Plan) -> dict:
  sh = plan.storage_shardings()
  return _storage_items(plan, sh) if plan.use_orig_params else sh


def _storage_shape_by_key(plan: Plan) -> dict:
  return {k: tuple(v.shape) for k, v in _storage_items(plan, plan.storage_shapes()).items()}


# ---------------------------------------------------------------------------
# Model state dicts


def _buffer_items(state) -> list[tuple[str, Any]]:
  out = []
  for f in BUFFER_FIELDS:
    if f in data_fields(state):
      for path, x in jax.tree_util.tree_flatten_with_path(getattr(state, f))[0]:
        out.append((path_name(path), x))
  return out


def _local_metadata(plan: Plan) -> dict:
  entries = {}
  shapes = _storage_shape_by_key(plan)
  for u in plan.units:
    if plan.use_orig_params:
      for i in u.leaf_ids:
        leaf = plan.leaves[i]
        entries[leaf.name] = {
            "global_shape": list(shapes[leaf.name]), "dtype": _dtype_name(leaf.dtype),
            "unit": u.display_name, "shape": list(leaf.shape),
            "padded_dim": _layer_axis(plan, leaf),
            "padding": plan.n * plan.chunk0(leaf) - leaf.dim0}
    else:
      params, off = [], 0
      for i in u.leaf_ids:
        leaf = plan.leaves[i]
        params.append({"name": leaf.name, "shape": list(leaf.shape), "offset": off,
                       "numel": leaf.layer_numel})
        off += leaf.layer_numel
      entries[u.flat_key] = {
          "global_shape": list(shapes[u.flat_key]), "dtype": _dtype_name(plan.unit_dtype(u)),
          "unit": u.display_name, "stacked_layers": u.num_layers if u.stacked else 0,
          "params": params, "padding": plan.n * plan.flat_chunk(u) - off}
  return {
      "layout": "original" if plan.use_orig_params else "flat",
      "sharding_strategy": plan.config.sharding_strategy.name,
      "mesh": {str(a): int(s) for a, s in plan.mesh.shape.items()},
      "shard_axes": list(plan.axes.shard_axes), "shard_size": plan.n,
      "entries": entries,
  }


def state_dict(state: ShardedTrainState, *,
               state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT,
               rank0_only: bool = False, offload_to_cpu: bool = False) -> dict:
  """The model state dict (PyTorch ``model.state_dict()`` under
  ``FSDP.state_dict_type``).

  Args:
    state: a :class:`~fsdp_jax.ShardedTrainState`.
    state_dict_type: ``FULL_STATE_DICT`` (default): ``{name: full array}``;
      ``SHARDED_STATE_DICT``: ``{name: global jax.Array}`` sharded over the
      shard axes; ``LOCAL_STATE_DICT``: the stored arrays by storage name
      (``"<unit>._flat_param"``, or the parameter name when
      ``use_orig_params=True``) and ``"_metadata"``.
    rank0_only: FULL only (PyTorch ``FullStateDictConfig.rank0_only``):
      processes other than 0 get ``{}``. Every process must still call it.
    offload_to_cpu: FULL: host ``numpy`` arrays, converted unit by unit;
      SHARDED/LOCAL: the same sharded arrays in ``pinned_host`` memory.

  Buffers (the leaves of a ``model_state`` field, e.g. Flax ``batch_stats``)
  are included under their dotted paths, as they are (typed PRNG keys stay
  ``jax.Array`` s with ``offload_to_cpu`` too).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from fsdp_jax import state_dict
    >>> mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
    >>> state = fsdp_jax.init_train_state(
    ...     params={"dense": {"w": jnp.ones((8, 3)), "b": jnp.zeros(3)}},
    ...     optimizer=optax.adam(1e-3), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> sd = state_dict(state, offload_to_cpu=True)
    >>> {k: v.shape for k, v in sd.items()}
    {'dense.b': (3,), 'dense.w': (8, 3)}
    >>> sharded = state_dict(
    ...     state, state_dict_type=fsdp_jax.StateDictType.SHARDED_STATE_DICT)
    >>> sharded["dense.w"].sharding.spec  # split along dim 0 over "shard"
    P('shard', None)
    >>> local = state_dict(
    ...     state, state_dict_type=fsdp_jax.StateDictType.LOCAL_STATE_DICT)
    >>> local["_flat_param"].shape, local["_metadata"]["entries"]["_flat_param"]["padding"]
    ((28,), 1)
  """
  fn = "state_dict"
  plan = _require_state(state, fn)
  kind = _require_type(state_dict_type, fn)
  if rank0_only and kind is not StateDictType.FULL_STATE_DICT:
    raise ValueError(f"{fn}: rank0_only applies to FULL_STATE_DICT only (PyTorch's "
                     "FullStateDictConfig); sharded and local state dicts are per process.")
  names = param_names(plan)
  out: dict = {}
  if kind is StateDictType.LOCAL_STATE_DICT:
    post = _to_pinned if offload_to_cpu else (lambda x: x)
    for key, x in _storage_items(plan, state.params).items():
      out[key] = post(x)
    for name, x in _buffer_items(state):
      out[name] = post(x)
    out[LOCAL_METADATA_KEY] = _local_metadata(plan)
    return out
  full = kind is StateDictType.FULL_STATE_DICT
  dropped = full and rank0_only and jax.process_index() != 0
  post = (_to_host if full else _to_pinned) if offload_to_cpu and not dropped else None
  # Every process runs the gathers (they are collectives); only the kept
  # values are copied to host.
  leaves = storage_to_leaves(plan, state.params, replicated=full, post=post)
  for i, name in enumerate(names):
    out[name] = leaves[i]
  for name, x in _buffer_items(state):
    if name in out:
      raise ValueError(f"Buffer {name!r} has the same dotted name as a parameter; "
                       "rename one of them.")
    # Typed PRNG keys (NNX's RngKey) stay jax arrays: NumPy cannot hold them.
    out[name] = post(x) if post is not None and not _is_key_dtype(x.dtype) else x
  return {} if dropped else out


def _mismatch_error(title: str, missing, unexpected, sizes, fix: str) -> ValueError:
  lines = []
  if missing:
    lines.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing[:_MAX_LINES])
                 + (f" ... and {len(missing) - _MAX_LINES} more" if len(missing) > _MAX_LINES else "") + ".")
  if unexpected:
    lines.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected[:_MAX_LINES])
                 + (f" ... and {len(unexpected) - _MAX_LINES} more" if len(unexpected) > _MAX_LINES else "") + ".")
  lines.extend(sizes)
  return ValueError(f"Error(s) in {title}:\n" + _problems(lines) + f"\nFix: {fix}")


def load_state_dict(state: ShardedTrainState, state_dict: dict, *,
                    state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT,
                    strict: bool = True) -> ShardedTrainState:
  """Loads a model state dict into ``state`` (PyTorch
  ``model.load_state_dict``) and returns the new state.

  FULL and SHARDED state dicts load onto any mesh, strategy and layout: values
  may be numpy arrays (each device takes only its slice), or ``jax.Array`` s
  with any sharding on any devices. LOCAL state dicts load only onto a state
  with the same layout and shard count. Values are cast to the parameters'
  dtypes; the optimizer state is left as it is.

  Args:
    state: the :class:`~fsdp_jax.ShardedTrainState` to load into (any strategy,
      layout, mesh; only its plan and structure are used for FULL/SHARDED).
    state_dict: from :func:`state_dict` (or a ``{name: array}`` dict).
    state_dict_type: the kind of ``state_dict``.
    strict: missing or unexpected keys are errors (PyTorch's default); with
      ``strict=False`` missing parameters keep their values and unexpected keys
      are ignored.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, fsdp_jax
    >>> from fsdp_jax import load_state_dict, state_dict
    >>> params = {"w": jnp.arange(12.0).reshape(4, 3)}
    >>> def build(n, **cfg):
    ...   mesh = fsdp_jax.make_mesh(shard=n, devices=jax.devices()[:n])
    ...   return fsdp_jax.init_train_state(params=jax.tree.map(jnp.zeros_like, params),
    ...       optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig(**cfg))
    >>> state = load_state_dict(build(4), {"w": np.arange(12.0).reshape(4, 3)})
    >>> sharded = state_dict(
    ...     state, state_dict_type=fsdp_jax.StateDictType.SHARDED_STATE_DICT)
    >>> other = load_state_dict(build(3, use_orig_params=True), sharded,
    ...     state_dict_type=fsdp_jax.StateDictType.SHARDED_STATE_DICT)
    >>> fsdp_jax.summon_full_params(other)["w"].tolist() == params["w"].tolist()
    True
  """
  fn = "load_state_dict"
  plan = _require_state(state, fn)
  kind = _require_type(state_dict_type, fn)
  if not isinstance(state_dict, dict):
    raise TypeError(f"{fn}: state_dict must be a dict of name -> array; got "
                    f"{type(state_dict).__name__}.")
  buffers = dict(_buffer_items(state))
  if kind is StateDictType.LOCAL_STATE_DICT:
    params = _load_local_params(plan, state, state_dict, buffers, strict)
  else:
    params = _load_named_params(plan, state, state_dict, buffers, strict, kind)
  changes = {PARAMS: params}
  for f in BUFFER_FIELDS:
    if f in data_fields(state) and buffers:
      changes[f] = _load_buffers(getattr(state, f), state_dict, plan)
  return state.replace(**changes)


def _load_buffers(tree, sd, plan):
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  out = []
  for path, x in flat:
    name = path_name(path)
    if name not in sd:
      out.append(x)
      continue
    v = sd[name]
    if _shape(v) != _shape(x):
      raise ValueError(f"Buffer {name!r}: the state dict holds shape {_shape(v)}, the "
                       f"state {_shape(x)}. Fix: load a state dict of the same model.")
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
      sh = (x.sharding if isinstance(x, jax.Array) and _on_devices(x, plan.mesh)
            else _replicated(plan))
      out.append(place(v, sh, shape=_shape(x), dtype=x.dtype))
    else:
      out.append(np.asarray(jax.device_get(v)).astype(np.asarray(x).dtype))
  return treedef.unflatten(out)


def _load_named_params(plan, state, sd, buffers, strict, kind):
  names = param_names(plan)
  if LOCAL_METADATA_KEY in sd:
    raise ValueError(
        f"load_state_dict: this state dict has a {LOCAL_METADATA_KEY!r} entry, so it is a "
        f"LOCAL_STATE_DICT, but state_dict_type={kind.name}. Fix: pass "
        "state_dict_type=StateDictType.LOCAL_STATE_DICT.")
  missing = [n for n in names if n not in sd]
  unexpected = [k for k in sd if k not in names and k not in buffers]
  sizes = []
  for i, n in enumerate(names):
    if n in sd and _shape(sd[n]) != plan.leaves[i].shape:
      sizes.append(f"size mismatch for {n}: copying a param with shape {_shape(sd[n])} from "
                   f"the state dict, the shape in the current model is {plan.leaves[i].shape}.")
  for n, x in buffers.items():
    if n in sd and _shape(sd[n]) != _shape(x):
      sizes.append(f"size mismatch for buffer {n}: {_shape(sd[n])} in the state dict, "
                   f"{_shape(x)} in the current model.")
  if sizes or (strict and (missing or unexpected)):
    raise _mismatch_error(
        f"loading {kind.name} into the model ({_shard_desc(plan)})",
        missing if strict else [], unexpected if strict else [], sizes,
        "load a state dict of the same model (same parameter tree and shapes); "
        "pass strict=False to load a subset. Mesh, strategy and layout may differ.")
  leaves = {}
  need_current = [u for u in plan.units if any(names[i] not in sd for i in u.leaf_ids)]
  if need_current:
    current = storage_to_leaves(plan, state.params)
    for u in need_current:
      for i in u.leaf_ids:
        leaves[i] = current[i]
  for i, n in enumerate(names):
    if n in sd:
      leaf = plan.leaves[i]
      leaves[i] = place(sd[n], canonical_sharding(plan, leaf), shape=leaf.shape, dtype=leaf.dtype)
  return offload.place_state_tree(plan.config, leaves_to_storage(plan, leaves, state.params))


def _check_local_metadata(plan: Plan, meta, what: str):
  if meta is None:
    return
  mine = _local_metadata(plan)
  if not isinstance(meta, dict) or "entries" not in meta:
    raise ValueError(f"{what}: {LOCAL_METADATA_KEY!r} is not fsdp_jax local-state-dict "
                     "metadata; pass the dict returned with LOCAL_STATE_DICT unchanged.")
  fix = ("A local state dict holds raw shards and loads only onto the same layout "
         "(use_orig_params), wrap policy and shard count. Fix: take a SHARDED_STATE_DICT "
         "or FULL_STATE_DICT (or use fsdp_jax.CheckpointManager) to change "
         "mesh, strategy or layout.")
  if meta.get("layout") != mine["layout"]:
    raise ValueError(f"{what}: it was taken from the {meta.get('layout')} layout but this "
                     f"state uses the {mine['layout']} layout. {fix}")
  if meta.get("shard_size") != mine["shard_size"]:
    raise ValueError(
        f"{what}: it was taken with parameters sharded over mesh axes "
        f"{tuple(meta.get('shard_axes', ()))} of total size {meta.get('shard_size')} "
        f"(mesh {meta.get('mesh')}); this state is {_shard_desc(plan)} on mesh "
        f"{mine['mesh']}. {fix}")
  lines = []
  for k in sorted(set(meta["entries"]) | set(mine["entries"])):
    a, b = meta["entries"].get(k), mine["entries"].get(k)
    if a is None:
      lines.append(f"{k}: not in the local state dict")
    elif b is None:
      lines.append(f"{k}: not in this state")
    elif a != b:
      lines.append(f"{k}: local state dict {tuple(a['global_shape'])} holding "
                   f"{[(p['name'], tuple(p['shape'])) for p in a.get('params', [])] or tuple(a.get('shape', ()))}, "
                   f"this state {tuple(b['global_shape'])} holding "
                   f"{[(p['name'], tuple(p['shape'])) for p in b.get('params', [])] or tuple(b.get('shape', ()))}")
  if lines:
    raise ValueError(f"{what}: the stored arrays differ from this state's:\n"
                     + _problems(lines) + "\n" + fix)


def _load_local_params(plan, state, sd, buffers, strict):
  what = "load_state_dict(LOCAL_STATE_DICT)"
  _check_local_metadata(plan, sd.get(LOCAL_METADATA_KEY), what)
  shapes = _storage_shape_by_key(plan)
  shardings = _storage_sharding_by_key(plan)
  current = _storage_items(plan, state.params)
  missing = [k for k in shapes if k not in sd]
  unexpected = [k for k in sd if k not in shapes and k not in buffers and k != LOCAL_METADATA_KEY]
  sizes = [f"size mismatch for {k}: stored array of global shape {_shape(sd[k])} in the "
           f"state dict, {shapes[k]} in the current model ({_shard_desc(plan)})."
           for k in shapes if k in sd and _shape(sd[k]) != shapes[k]]
  if sizes or (strict and (missing or unexpected)):
    raise _mismatch_error(
        f"loading LOCAL_STATE_DICT into the model ({_shard_desc(plan)})",
        missing if strict else [], unexpected if strict else [], sizes,
        "load the local state dict of a state with the same plan, or use "
        "SHARDED_STATE_DICT / FULL_STATE_DICT to change mesh, strategy or layout.")
  items = {}
  for k, shape in shapes.items():
    if k in sd:
      items[k] = place(sd[k], shardings[k], shape=shape, dtype=current[k].dtype)
    else:
      items[k] = current[k]
  return offload.place_state_tree(plan.config, _storage_from_items(plan, items))


# ---------------------------------------------------------------------------
# Optimizer state dicts


def _optim_named(state, *, replicated: bool, post=None) -> dict:
  """``{"state": {name: {slot: array}}, "param_groups": [{...}]}`` from the
  state's optax state (arrays of the parameters' global shapes)."""
  plan = state.plan
  names = param_names(plan)
  lay = opt_layout(plan, state.opt_state)
  per_name: dict = {n: {} for n in names}
  for slot, tree in lay.slots:
    for i, x in storage_to_leaves(plan, tree, replicated=replicated, post=post).items():
      per_name[names[i]][slot] = x
  for (i, slot), x in lay.pleaves:
    per_name[names[i]][slot] = post(x) if post is not None else x
  group: dict = {"params": list(names)}
  for name, x in lay.scalars:
    group[name] = post(x) if post is not None else x
  return {"state": {n: d for n, d in per_name.items() if d}, "param_groups": [group]}


def _optim_local(state, *, offload: bool) -> dict:
  plan = state.plan
  keys = _storage_keys(plan)
  lay = opt_layout(plan, state.opt_state)
  post = _to_pinned if offload else (lambda x: x)
  per_key: dict = {k: {} for k in keys}
  for slot, tree in lay.slots:
    for k, x in _storage_items(plan, tree).items():
      if not _is_masked(x):
        per_key[k][slot] = post(x)
  group: dict = {"params": list(keys)}
  for name, x in _group_items(lay):
    group[name] = post(x)
  return {"state": {k: d for k, d in per_key.items() if d}, "param_groups": [group],
          LOCAL_METADATA_KEY: _local_metadata(plan)}


def _group_items(lay: OptLayout) -> list:
  """LOCAL state dicts keep every replicated leaf under its full path."""
  paths = {(e.param, e.slot): e.path for e in lay.state.layout.entries if e.kind == "param"}
  items = [(paths[k], x) for k, x in lay.pleaves] + list(lay.scalars)
  order = {e.path: n for n, e in enumerate(lay.state.layout.entries)}
  return sorted(items, key=lambda kv: order[kv[0]])


def optim_state_dict(state: ShardedTrainState, *,
                     state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT,
                     rank0_only: bool = False,
                     offload_to_cpu: Optional[bool] = None) -> dict:
  """The optimizer state dict (PyTorch ``FSDP.optim_state_dict``).

  Returns ``{"state": {name: {slot: array}}, "param_groups": [{"params":
  [names], <leaf path>: value}]}`` where slots are the optax subtrees that
  mirror the parameters (Adam: ``"0.mu"``, ``"0.nu"``) and the group holds the
  other optax leaves (Adam: ``"0.count"``).

  Args:
    state: a :class:`~fsdp_jax.ShardedTrainState`.
    state_dict_type: FULL (full arrays per parameter), SHARDED (global arrays
      per parameter, sharded over the shard axes) or LOCAL (the stored slot
      arrays by storage name, untransformed, and ``"_metadata"``).
    rank0_only: FULL only: processes other than 0 get ``{}``.
    offload_to_cpu: PyTorch's defaults: True for FULL and SHARDED, False for
      LOCAL. FULL: host numpy arrays; SHARDED/LOCAL: ``pinned_host`` arrays.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from fsdp_jax import optim_state_dict
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 3))},
    ...     optimizer=optax.adam(1e-3), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> osd = optim_state_dict(state)
    >>> sorted(osd["state"]["w"]), osd["state"]["w"]["0.mu"].shape
    (['0.mu', '0.nu'], (4, 3))
    >>> osd["param_groups"][0]["params"], int(osd["param_groups"][0]["0.count"])
    (['w'], 0)
  """
  fn = "optim_state_dict"
  _require_state(state, fn)
  kind = _require_type(state_dict_type, fn)
  if rank0_only and kind is not StateDictType.FULL_STATE_DICT:
    raise ValueError(f"{fn}: rank0_only applies to FULL_STATE_DICT only.")
  if offload_to_cpu is None:
    offload_to_cpu = kind is not StateDictType.LOCAL_STATE_DICT
  if kind is StateDictType.LOCAL_STATE_DICT:
    return _optim_local(state, offload=offload_to_cpu)
  full = kind is StateDictType.FULL_STATE_DICT
  dropped = full and rank0_only and jax.process_index() != 0
  post = (_to_host if full else _to_pinned) if offload_to_cpu and not dropped else None
  out = _optim_named(state, replicated=full, post=post)
  return {} if dropped else out


def full_optim_state_dict(state: ShardedTrainState, *, rank0_only: bool = True) -> dict:
  """The full optimizer state dict on host (PyTorch
  ``FSDP.full_optim_state_dict``; ``rank0_only=True`` by default as there).

  Same as ``optim_state_dict(state, state_dict_type=FULL_STATE_DICT,
  rank0_only=rank0_only, offload_to_cpu=True)``: numpy arrays of the full
  parameter shapes, keyed by parameter name.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from fsdp_jax import full_optim_state_dict
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones(5)},
    ...     optimizer=optax.sgd(0.1, momentum=0.9), mesh=mesh,
    ...     config=fsdp_jax.FSDPConfig())
    >>> osd = full_optim_state_dict(state)
    >>> type(osd["state"]["w"]["0.trace"]).__name__, osd["state"]["w"]["0.trace"].shape
    ('ndarray', (5,))
  """
  return optim_state_dict(state, state_dict_type=StateDictType.FULL_STATE_DICT,
                          rank0_only=rank0_only, offload_to_cpu=True)


@dataclasses.dataclass
class _Need:
  """One value the target optimizer state needs."""

  slot: Optional[str]  # None for a param-group leaf
  key: str             # parameter name / storage key, or the leaf path
  shape: tuple
  dtype: Any
  index: int = -1      # leaf index for named slots
  sharded: bool = True  # a slot entry shaped like its parameter (not a "pleaf")


def _named_needs(plan: Plan, lay: OptLayout) -> list[_Need]:
  names = param_names(plan)
  needs = []
  for slot, tree in lay.slots:
    split = split_storage(plan, tree)
    for u in plan.units:
      tmpl = split[u.index]
      for i in _present(plan, u, tmpl):
        if plan.use_orig_params:
          dtype = tmpl[u.leaf_ids.index(i)].dtype
        else:
          dtype = tmpl[0].dtype
        needs.append(_Need(slot, names[i], plan.leaves[i].shape, jnp.dtype(dtype), i))
    for i, x in _ignored_entries(plan, tree).items():
      if x is not None:
        needs.append(_Need(slot, names[i], plan.leaves[i].shape, jnp.dtype(x.dtype), i))
  for (i, slot), x in lay.pleaves:
    needs.append(_Need(slot, names[i], _shape(x), jnp.dtype(x.dtype), i, sharded=False))
  for name, x in lay.scalars:
    needs.append(_Need(None, name, _shape(x), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype))
  return needs


def _check_osd(osd, needs: list[_Need], *, what: str, keys_kind: str, fix: str) -> None:
  if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
    raise ValueError(f"{what}: expected an optimizer state dict {{'state': ..., "
                     f"'param_groups': [...]}}; got {type(osd).__name__}"
                     + (f" with keys {sorted(map(str, osd))[:8]}" if isinstance(osd, dict) else "")
                     + ". Fix: pass the dict returned by fsdp_jax's optim_state_dict / "
                     "full_optim_state_dict.")
  state = osd["state"]
  if any(isinstance(k, (int, np.integer)) for k in state):
    raise ValueError(f"{what}: the optimizer state dict is keyed by parameter ids; fsdp_jax "
                     "loads dicts keyed by parameter names. Fix: "
                     "rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, state) first.")
  groups = osd["param_groups"]
  if not isinstance(groups, (list, tuple)) or len(groups) != 1:
    raise ValueError(f"{what}: expected one parameter group (optax keeps one), got "
                     f"{len(groups) if isinstance(groups, (list, tuple)) else groups!r}.")
  group = groups[0]
  lines = []
  wanted = {}
  for nd in needs:
    if nd.slot is None:
      if nd.key not in group:
        lines.append(f"param_groups[0][{nd.key!r}]: missing (the optimizer state holds a "
                     f"{nd.shape} {jnp.dtype(nd.dtype).name} leaf there)")
      elif _shape(group[nd.key]) != nd.shape:
        lines.append(f"param_groups[0][{nd.key!r}]: shape {_shape(group[nd.key])} in the dict, "
                     f"{nd.shape} in the optimizer state")
      continue
    wanted.setdefault(nd.key, set()).add(nd.slot)
    entry = state.get(nd.key)
    if entry is None or nd.slot not in entry:
      lines.append(f"state[{nd.key!r}][{nd.slot!r}]: missing (expected shape {nd.shape})")
    elif _shape(entry[nd.slot]) != nd.shape:
      lines.append(f"state[{nd.key!r}][{nd.slot!r}]: shape {_shape(entry[nd.slot])} in the "
                   f"dict, {nd.shape} for this {keys_kind}")
  for k, entry in state.items():
    extra = sorted(set(entry) - wanted.get(k, set())) if isinstance(entry, dict) else ["?"]
    if k not in wanted and entry:
      lines.append(f"state[{k!r}]: not a {keys_kind} of this state with optimizer state "
                   f"(slots {sorted(entry) if isinstance(entry, dict) else entry!r})")
    elif extra and k in wanted:
      lines.append(f"state[{k!r}]: unexpected slot(s) {extra}")
  scalars = {nd.key for nd in needs if nd.slot is None}
  for k in group:
    if k != "params" and k not in scalars:
      lines.append(f"param_groups[0][{k!r}]: not a leaf of this optimizer state")
  if lines:
    raise ValueError(f"Error(s) in {what}:\n" + _problems(lines) + f"\nFix: {fix}")


_OSD_FIX = ("load the optimizer state dict of the same model and optimizer (same "
            "parameter names, same optax transformation). Mesh, strategy and layout "
            "may differ.")


def _load_named_opt(state, osd, *, what: str, fetch: Optional[Callable] = None,
                    check: bool = True):
  """Builds the state's optax state from a named (FULL/SHARDED) optimizer
  state dict. ``fetch(need)`` supplies values instead of ``osd`` (scatter)."""
  plan = state.plan
  lay = opt_layout(plan, state.opt_state)
  needs = _named_needs(plan, lay)
  if check:
    _check_osd(osd, needs, what=what, keys_kind="parameter", fix=_OSD_FIX)

  def value(nd: _Need):
    if fetch is not None:
      return fetch(nd)
    if nd.slot is None:
      return osd["param_groups"][0][nd.key]
    return osd["state"][nd.key][nd.slot]

  per_slot: dict = {}
  scalars: dict = {}
  pvalues: dict = {}
  for nd in needs:
    if nd.slot is None:
      scalars[nd.key] = value(nd)
    elif not nd.sharded:
      pvalues[(nd.index, nd.slot)] = value(nd)
    else:
      leaf = plan.leaves[nd.index]
      per_slot.setdefault(nd.slot, {})[nd.index] = place(
          value(nd), canonical_sharding(plan, leaf), shape=leaf.shape, dtype=nd.dtype)
  entries = []
  for kind, name, tmpl in lay.entries:
    if kind == "slot":
      entries.append(leaves_to_storage(plan, per_slot.get(name, {}), tmpl))
    elif kind == "pleaf":
      entries.append(_place_scalar(plan, pvalues[name], tmpl))
    else:
      entries.append(_place_scalar(plan, scalars[name], tmpl))
  return offload.place_state_tree(plan.config, lay.unflatten(entries))


def _place_scalar(plan: Plan, v, tmpl):
  shape = _shape(tmpl)
  dtype = tmpl.dtype if hasattr(tmpl, "dtype") else np.asarray(tmpl).dtype
  if isinstance(tmpl, (jax.Array, jax.ShapeDtypeStruct)):
    sh = getattr(tmpl, "sharding", None)
    if not isinstance(sh, NamedSharding) or sh.mesh != plan.mesh:
      sh = _replicated(plan)
    return place(v, sh, shape=shape, dtype=dtype)
  if isinstance(tmpl, np.ndarray):
    return np.asarray(jax.device_get(v)).astype(dtype)
  return type(tmpl)(np.asarray(jax.device_get(v)).item())


def _load_local_opt(state, osd):
  plan = state.plan
  what = "optim_state_dict_to_load(LOCAL_STATE_DICT)"
  _check_local_metadata(plan, osd.get(LOCAL_METADATA_KEY) if isinstance(osd, dict) else None, what)
  lay = opt_layout(plan, state.opt_state)
  shapes = _storage_shape_by_key(plan)
  shardings = _storage_sharding_by_key(plan)
  needs = []
  for slot, tree in lay.slots:
    for k, x in _storage_items(plan, tree).items():
      if not _is_masked(x):
        needs.append(_Need(slot, k, shapes[k], x.dtype))
  for name, x in _group_items(lay):
    needs.append(_Need(None, name, _shape(x), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype))
  _check_osd(osd, needs, what=what, keys_kind="stored array",
             fix="load the local optimizer state dict of a state with the same plan, or "
                 "use FULL_STATE_DICT / SHARDED_STATE_DICT to change mesh, strategy or layout.")
  paths = {(e.param, e.slot): e.path for e in lay.state.layout.entries if e.kind == "param"}
  entries = []
  for kind, name, tmpl in lay.entries:
    if kind == "slot":
      items = {}
      for k, x in _storage_items(plan, tmpl).items():
        items[k] = x if _is_masked(x) else place(osd["state"][k][name], shardings[k],
                                                  shape=shapes[k], dtype=x.dtype)
      entries.append(_storage_from_items(plan, items))
    else:
      key = paths[name] if kind == "pleaf" else name
      entries.append(_place_scalar(plan, osd["param_groups"][0][key], tmpl))
  return offload.place_state_tree(plan.config, lay.unflatten(entries))


def optim_state_dict_to_load(state: ShardedTrainState, optim_state_dict: dict, *,
                             state_dict_type: StateDictType = StateDictType.FULL_STATE_DICT):
  """Converts an optimizer state dict into ``state``'s optax state (PyTorch
  ``FSDP.optim_state_dict_to_load``); load it with
  ``state.replace(opt_state=...)``.

  FULL and SHARDED dicts load onto any mesh, strategy and layout (values may be
  numpy or ``jax.Array`` s on any devices); LOCAL dicts onto the same plan.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from fsdp_jax import optim_state_dict, optim_state_dict_to_load
    >>> def build(n, **cfg):
    ...   mesh = fsdp_jax.make_mesh(shard=n, devices=jax.devices()[:n])
    ...   return fsdp_jax.init_train_state(params={"w": jnp.ones((5, 2))},
    ...       optimizer=optax.adam(1e-3), mesh=mesh, config=fsdp_jax.FSDPConfig(**cfg))
    >>> osd = optim_state_dict(build(4))
    >>> osd["state"]["w"]["0.mu"] = osd["state"]["w"]["0.mu"] + 1.0
    >>> target = build(3, use_orig_params=True)
    >>> target = target.replace(opt_state=optim_state_dict_to_load(target, osd))
    >>> float(optim_state_dict(target)["state"]["w"]["0.mu"].sum())
    10.0
  """
  fn = "optim_state_dict_to_load"
  _require_state(state, fn)
  kind = _require_type(state_dict_type, fn)
  if kind is StateDictType.LOCAL_STATE_DICT:
    return _load_local_opt(state, optim_state_dict)
  if isinstance(optim_state_dict, dict) and LOCAL_METADATA_KEY in optim_state_dict:
    raise ValueError(f"{fn}: this optimizer state dict has a {LOCAL_METADATA_KEY!r} entry, so "
                     f"it is a LOCAL_STATE_DICT, but state_dict_type={kind.name}. Fix: pass "
                     "state_dict_type=StateDictType.LOCAL_STATE_DICT.")
  return _load_named_opt(state, optim_state_dict, what=f"{fn}({kind.name})")


def shard_full_optim_state_dict(full_optim_state_dict: dict, state: ShardedTrainState):
  """Shards a full optimizer state dict for ``state`` (PyTorch
  ``FSDP.shard_full_optim_state_dict``) and returns ``state``'s optax state.

  Every process passes the full dict (host numpy arrays) and keeps only its
  devices' slices, without communication. ``state`` may use any mesh,
  strategy and layout.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from fsdp_jax import (full_optim_state_dict,
    ...                                  shard_full_optim_state_dict)
    >>> def build(n):
    ...   mesh = fsdp_jax.make_mesh(shard=n, devices=jax.devices()[:n])
    ...   return fsdp_jax.init_train_state(params={"w": jnp.ones((5, 2))},
    ...       optimizer=optax.adam(1e-3), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> full = full_optim_state_dict(build(8))
    >>> state = build(2)
    >>> state = state.replace(opt_state=shard_full_optim_state_dict(full, state))
    >>> state.opt_state.slots["0.mu"]["_flat_param"].sharding.spec
    P('shard',)
  """
  fn = "shard_full_optim_state_dict"
  _require_state(state, fn)
  return _load_named_opt(state, full_optim_state_dict, what=fn)


def scatter_full_optim_state_dict(full_optim_state_dict: Optional[dict],
                                  state: ShardedTrainState):
  """Like :func:`shard_full_optim_state_dict`, but only process 0 holds the
  full dict (PyTorch ``FSDP.scatter_full_optim_state_dict``): the argument is
  ignored on other processes (pass ``None``). Values are broadcast one at a
  time, so other processes hold at most one full optimizer leaf on host.
  Every process must call it.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from fsdp_jax import (full_optim_state_dict,
    ...                                  scatter_full_optim_state_dict)
    >>> mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones(6)},
    ...     optimizer=optax.adam(1e-3), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> full = full_optim_state_dict(state)  # populated on process 0 only
    >>> opt_state = scatter_full_optim_state_dict(full, state)
    >>> int(opt_state.leaves["0.count"])
    0
  """
  fn = "scatter_full_optim_state_dict"
  _require_state(state, fn)
  if jax.process_count() == 1:
    return _load_named_opt(state, full_optim_state_dict, what=fn)
  from jax.experimental import multihost_utils

  plan = state.plan
  lay = opt_layout(plan, state.opt_state)
  needs = _named_needs(plan, lay)
  error = None
  if jax.process_index() == 0:
    try:
      _check_osd(full_optim_state_dict, needs, what=fn, keys_kind="parameter", fix=_OSD_FIX)
    except ValueError as e:
      error = e
  bad = int(multihost_utils.broadcast_one_to_all(np.int32(error is not None)))
  if bad:
    if error is not None:
      raise error
    raise ValueError(f"{fn}: process 0 rejected its full optimizer state dict (see the error "
                     "raised on process 0).")

  def fetch(nd: _Need):
    if jax.process_index() == 0:
      v = (full_optim_state_dict["param_groups"][0][nd.key] if nd.slot is None
           else full_optim_state_dict["state"][nd.key][nd.slot])
      v = np.asarray(jax.device_get(v)).astype(nd.dtype)
    else:
      v = np.zeros(nd.shape, nd.dtype)
    return np.asarray(multihost_utils.broadcast_one_to_all(v))

  return _load_named_opt(state, None, what=fn, fetch=fetch, check=False)


def rekey_optim_state_dict(optim_state_dict: dict, optim_state_key_type: OptimStateKeyType,
                           state: ShardedTrainState) -> dict:
  """Re-keys an optimizer state dict by parameter name or parameter id
  (PyTorch ``FSDP.rekey_optim_state_dict``).

  Ids are positions in ``jax.tree_util.tree_leaves(params)`` of the unsharded
  parameter tree, i.e. the order in which an unsharded optax state holds the
  parameters. Keys already of the requested type are kept.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from fsdp_jax import (OptimStateKeyType, full_optim_state_dict,
    ...                                  rekey_optim_state_dict)
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(
    ...     params={"a": jnp.ones(3), "b": jnp.ones(2)},
    ...     optimizer=optax.adam(1e-3), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> by_id = rekey_optim_state_dict(full_optim_state_dict(state),
    ...                                OptimStateKeyType.PARAM_ID, state)
    >>> sorted(by_id["state"]), by_id["param_groups"][0]["params"]
    ([0, 1], [0, 1])
    >>> by_name = rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, state)
    >>> sorted(by_name["state"])
    ['a', 'b']
  """
  fn = "rekey_optim_state_dict"
  plan = _require_state(state, fn)
  if not isinstance(optim_state_key_type, OptimStateKeyType):
    raise TypeError(f"{fn}: optim_state_key_type must be an OptimStateKeyType "
                    "(PARAM_NAME or PARAM_ID).")
  if not isinstance(optim_state_dict, dict) or "state" not in optim_state_dict:
    raise ValueError(f"{fn}: expected an optimizer state dict with 'state' and "
                     "'param_groups'; pass the dict from optim_state_dict.")
  names = param_names(plan)
  ids = {n: i for i, n in enumerate(names)}
  to_id = optim_state_key_type is OptimStateKeyType.PARAM_ID

  def rekey(k):
    if isinstance(k, (int, np.integer)):
      if not 0 <= int(k) < len(names):
        raise ValueError(f"{fn}: parameter id {k} is out of range: the model has "
                         f"{len(names)} parameters (ids 0..{len(names) - 1}).")
      return int(k) if to_id else names[int(k)]
    if k not in ids:
      raise ValueError(f"{fn}: {k!r} is not a parameter of this state; parameters are "
                       f"{names[:8]}{' ...' if len(names) > 8 else ''}. Fix: pass the state "
                       "of the model the optimizer state dict was taken from.")
    return ids[k] if to_id else k

  out = dict(optim_state_dict)
  out["state"] = {rekey(k): v for k, v in optim_state_dict["state"].items()}
  groups = []
  for g in optim_state_dict.get("param_groups", []):
    g = dict(g)
    if "params" in g:
      g["params"] = [rekey(k) for k in g["params"]]
    groups.append(g)
  out["param_groups"] = groups
  return out
