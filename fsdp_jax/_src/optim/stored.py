"""The optimizer state as stored (:class:`ShardedOptState`, its layout of
slots), the names of its entries, and the logical tree the optimizer sees.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from fsdp_jax._src import naming
from fsdp_jax._src.plan import Plan


MODES = ("auto", "global", "local")


# ---------------------------------------------------------------------------
# Names


def _dtype(dtype):
  """``jnp.dtype`` of an array dtype; typed PRNG key dtypes as they are."""
  try:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
      return dtype
  except TypeError:
    pass
  return jnp.dtype(dtype)


def _itemsize(dtype) -> int:
  """Bytes per element (a typed PRNG key counts its key data)."""
  if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
    return int(np.prod(data.shape, dtype=np.int64)) * np.dtype(data.dtype).itemsize
  return np.dtype(dtype).itemsize


def cast(x, dtype, shape):
  x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
  if x.dtype != dtype:
    x = x.astype(dtype)
  return x.reshape(shape) if tuple(x.shape) != tuple(shape) else x


def _is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


# ---------------------------------------------------------------------------
# The stored optimizer state


@dataclasses.dataclass(frozen=True)
class OptEntry:
  """One leaf of ``optimizer.init(params)``, in ``tree_leaves`` order.

  ``kind`` is ``"slot"`` (belongs to parameter ``param`` and has its shape:
  stored sharded like it in ``ShardedOptState.slots[slot]``), ``"param"``
  (belongs to parameter ``param`` with another shape: stored replicated in
  ``ShardedOptState.leaves[path]``) or ``"group"`` (no parameter: stored
  replicated in ``leaves[path]``). ``slot`` is the dotted path of the
  subtree mirroring the parameters (Adam: ``"0.mu"``), ``path`` the leaf's
  full dotted path.
  """

  kind: str
  path: str
  slot: Optional[str]
  param: int
  shape: tuple
  dtype: Any


@dataclasses.dataclass(frozen=True)
class OptLayout:
  """How ``optimizer.init(params)`` is stored: its tree structure and one
  :class:`OptEntry` per leaf. Static (hashable) metadata of
  :class:`ShardedOptState`."""

  treedef: Any
  entries: tuple

  @property
  def slot_names(self) -> tuple:
    names = []
    for e in self.entries:
      if e.kind == "slot" and e.slot not in names:
        names.append(e.slot)
    return tuple(names)

  def slot_params(self, slot: str) -> tuple:
    return tuple(e.param for e in self.entries if e.kind == "slot" and e.slot == slot)

  def describe(self, plan: Plan) -> str:
    """What ``print(state.plan)`` says of the stored optimizer state."""
    sharded, replicated = state_bytes(plan, self)
    slots = ", ".join(self.slot_names) or "none"
    return (f"{sharded + replicated:,} bytes/device "
            f"({sharded:,} sharded in slots {slots}; {replicated:,} replicated)")


@dataclasses.dataclass(frozen=True)
class ShardedOptState:
  """The optimizer state of a :class:`~fsdp_jax.ShardedTrainState`.

  Attributes:
    slots: ``{slot: tree}``: per-parameter state shaped like the parameters
      (Adam's ``"0.mu"``, ``"0.nu"``), each tree laid out like the stored
      params (``{"<unit>._flat_param": shard}`` or the original tree of
      padded dim-0 shards) with ``optax.MaskedNode`` where the slot has no
      entry (frozen or masked-out parameters).
    leaves: ``{dotted path: array}``: every other leaf of the optax state
      (counts, hyperparameters, factored statistics), replicated, with its
      logical shape.
    layout: the :class:`OptLayout` (static).

  ``fsdp_jax.full_opt_state(state)`` returns the optax state as the
  optimizer built it, with full arrays; ``optim_state_dict`` names it per
  parameter as PyTorch does.
  """

  slots: dict
  leaves: dict
  layout: OptLayout = dataclasses.field(metadata=dict(static=True))


jax.tree_util.register_dataclass(ShardedOptState, data_fields=["slots", "leaves"],
                                 meta_fields=["layout"])


# ---------------------------------------------------------------------------
# The logical tree the optimizer sees


def grad_dtype(plan: Plan, leaf) -> Any:
  """The dtype of a parameter's gradient as the optimizer sees it: the
  parameter's dtype (with ``keep_low_precision_grads`` the values are rounded
  to ``reduce_dtype`` first; PyTorch's optimizers compute with such gradients
  in the parameter's precision)."""
  del plan
  return jnp.dtype(leaf.dtype)


def user_tree(plan: Plan, values: dict):
  """``{leaf id: value}`` of the trainable leaves -> the user's tree with
  ``None`` at frozen leaves."""
  return jax.tree_util.tree_unflatten(
      plan.treedef, [None if l.frozen else values[l.index] for l in plan.leaves])


def logical_params(plan: Plan):
  return user_tree(plan, {l.index: jax.ShapeDtypeStruct(l.shape, l.dtype)
                          for l in plan.leaves if not l.frozen})


def logical_grads(plan: Plan):
  return user_tree(plan, {l.index: jax.ShapeDtypeStruct(l.shape, grad_dtype(plan, l))
                          for l in plan.leaves if not l.frozen})


def _param_paths(plan: Plan) -> dict:
  """``{key path tuple: leaf id}`` of the trainable leaves."""
  tree = jax.tree_util.tree_unflatten(plan.treedef, list(range(len(plan.leaves))))
  out = {}
  for path, i in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not plan.leaves[i].frozen:
      out[tuple(path)] = i
  return out


def _child(node, key):
  if isinstance(key, jax.tree_util.SequenceKey):
    return node[key.idx]
  if isinstance(key, jax.tree_util.DictKey):
    return node[key.key]
  if isinstance(key, jax.tree_util.GetAttrKey):
    return getattr(node, key.name)
  raise KeyError(key)


def _subtree(tree, path):
  node = tree
  for k in path:
    node = _child(node, k)
  return node


def build_layout(plan: Plan, abstract_state) -> OptLayout:
  """Classifies the leaves of ``optimizer.init(params)`` (abstract)."""
  params_paths = _param_paths(plan)
  by_len = sorted({len(p) for p in params_paths}, reverse=True)
  user_def = jax.tree.structure(logical_params(plan))
  flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
  mirrors: dict = {}

  def mirrors_params(prefix) -> bool:
    if prefix not in mirrors:
      try:
        user_def.flatten_up_to(_subtree(abstract_state, prefix))
        mirrors[prefix] = True
      except Exception:  # pylint: disable=broad-except  # not a parameter-shaped subtree
        mirrors[prefix] = False
    return mirrors[prefix]

  entries = []
  names = set()
  for path, x in flat:
    path = tuple(path)
    name = naming.path_name(path)
    if name in names:
      raise ValueError(f"Optimizer state path {name!r} is ambiguous as a dotted name; "
                       "rename the optimizer state's keys.")
    names.add(name)
    shape, dtype = tuple(np.shape(x)), _dtype(x.dtype)
    match = None
    for n in by_len:
      if n <= len(path) and path[len(path) - n:] in params_paths:
        prefix = path[:len(path) - n]
        if mirrors_params(prefix):
          match = (prefix, params_paths[path[len(path) - n:]])
          break
    if match is None:
      entries.append(OptEntry("group", name, None, -1, shape, dtype))
      continue
    prefix, i = match
    slot = naming.path_name(prefix)
    kind = "slot" if shape == plan.leaves[i].shape else "param"
    entries.append(OptEntry(kind, name, slot, i, shape, dtype))
  lay = OptLayout(treedef, tuple(entries))
  _check_flat_slots(plan, lay)
  return lay


def _check_flat_slots(plan: Plan, lay: OptLayout) -> None:
  if plan.use_orig_params:
    return
  for slot in lay.slot_names:
    dtypes: dict = {}
    for e in lay.entries:
      if e.kind == "slot" and e.slot == slot and not plan.leaves[e.param].ignored:
        dtypes.setdefault(plan.leaves[e.param].unit, set()).add(str(e.dtype))
    for u, ds in dtypes.items():
      if len(ds) > 1:
        raise NotImplementedError(
            f"Optimizer state slot {slot!r} holds {sorted(ds)} leaves for the parameters of "
            f"unit {plan.units[u].display_name!r}; a flat unit stores each slot in one "
            "buffer of one dtype. Fix: pass FSDPConfig(use_orig_params=True).")


def storage_key(plan: Plan, i: int) -> str:
  """Where parameter ``i``'s slot entry lives in a slot tree (flat layout:
  its unit's flat key or the ignored leaf's key)."""
  leaf = plan.leaves[i]
  if leaf.ignored:
    return plan.ignored_key(leaf)
  return plan.units[leaf.unit].flat_key


def _flat_keys(plan: Plan) -> list:
  return sorted([u.flat_key for u in plan.units] + [plan.ignored_key(l) for l in plan.ignored_leaves])


def slot_tree(plan: Plan, present: dict, masked=None):
  """A tree laid out like the stored params, with ``present[key]`` at the
  storage positions that hold the slot (leaf ids in the original layout,
  storage keys in the flat layout) and ``masked`` (default
  ``optax.MaskedNode()``) elsewhere."""
  masked = optax.MaskedNode() if masked is None else masked
  if plan.use_orig_params:
    return jax.tree_util.tree_unflatten(
        plan.treedef, [present.get(l.index, masked) for l in plan.leaves])
  return {k: present.get(k, masked) for k in _flat_keys(plan)}


def slot_items(plan: Plan, tree) -> dict:
  """Inverse of :func:`slot_tree`: the present ``{key: value}``."""
  if plan.use_orig_params:
    parts = plan.treedef.flatten_up_to(tree)
    return {i: x for i, x in enumerate(parts) if not _is_masked(x)}
  return {k: x for k, x in tree.items() if not _is_masked(x)}


def slot_keys(plan: Plan, lay: OptLayout, slot: str) -> list:
  """The storage keys (flat) or leaf ids (original) a slot occupies."""
  out = []
  for i in lay.slot_params(slot):
    k = i if plan.use_orig_params else storage_key(plan, i)
    if k not in out:
      out.append(k)
  return out


def _storage_struct_by_key(plan: Plan) -> dict:
  shapes = plan.storage_shapes()
  if plan.use_orig_params:
    return dict(enumerate(jax.tree_util.tree_leaves(shapes)))
  return dict(shapes)


def stored_shapes(plan: Plan, lay: OptLayout) -> ShardedOptState:
  """``jax.ShapeDtypeStruct`` s (with shardings) of the stored state."""
  by_key = _storage_struct_by_key(plan)
  slots = {}
  for slot in lay.slot_names:
    dtypes = {}
    for e in lay.entries:
      if e.kind == "slot" and e.slot == slot:
        dtypes[e.param if plan.use_orig_params else storage_key(plan, e.param)] = e.dtype
    present = {k: jax.ShapeDtypeStruct(by_key[k].shape, dtypes[k], sharding=by_key[k].sharding)
               for k in slot_keys(plan, lay, slot)}
    slots[slot] = slot_tree(plan, present)
  rep = plan.sharding(P())
  leaves = {e.path: jax.ShapeDtypeStruct(e.shape, e.dtype, sharding=rep)
            for e in lay.entries if e.kind != "slot"}
  return ShardedOptState(slots, leaves, lay)


def stored_specs(plan: Plan, lay: OptLayout) -> ShardedOptState:
  """``PartitionSpec`` s of the stored state (for ``jax.shard_map``)."""
  shapes = stored_shapes(plan, lay)
  return jax.tree.map(lambda s: s.sharding.spec, shapes)


def state_bytes(plan: Plan, lay: OptLayout) -> tuple[int, int]:
  """Bytes per device of the stored optimizer state: ``(sharded, replicated)``."""
  shapes = stored_shapes(plan, lay)
  sharded = replicated = 0
  for tree in shapes.slots.values():
    for s in jax.tree.leaves(tree):
      local = s.sharding.shard_shape(s.shape)
      sharded += int(np.prod(local, dtype=np.int64)) * _itemsize(s.dtype)
  for s in shapes.leaves.values():
    replicated += int(np.prod(s.shape, dtype=np.int64)) * _itemsize(s.dtype)
  return sharded, replicated


