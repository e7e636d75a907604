"""The optimizer on sharded parameters: the user's tree, exact numbers.

PyTorch users expect what FSDP with ``use_orig_params=True`` gives them: the
optimizer sees the original parameters. Here the optimizer's ``init`` and
``update`` are traced once on the **logical** tree that was passed to
``init_train_state`` (same paths, unpadded shapes and dtypes; frozen leaves
are ``None``), and the traced program is then evaluated on each device's
shards by :class:`ShardedEvaluator`:

* elementwise equations (all of adam, adamw, lion, sgd, masks, schedules)
  run on the local shards with no communication;
* a reduction over a whole parameter (a norm in ``clip_by_global_norm``,
  LAMB's trust ratio, ``apply_if_finite``'s check) becomes a local reduction
  with the padding excluded, and sums of such partial results stay local
  until a non-linear use forces one ``psum`` (``pmax``/``pmin``) over the
  shard axes: a global norm costs one scalar all-reduce;
* any other equation that reads a parameter-shaped value (a matrix product
  in Muon, a row/column reduction in Adafactor, a reshape) gathers that value
  to its logical shape first and runs on every device; results that must be
  stored sharded are sliced back to the device's shard.

Every rule computes exactly what the single-device program computes (up to
the order of floating-point sums), so the result is exact for any
transformation, and the cost follows what the transformation needs.

The optimizer state is stored as a :class:`ShardedOptState`: each leaf of
``optimizer.init(params)`` that belongs to one parameter and has its shape (a
*slot* entry, e.g. Adam's ``mu``) is stored sharded exactly like that
parameter (flat layout: one buffer per unit and slot); every other leaf
(counts, hyperparameters, Adafactor's factored rows and columns) is stored
replicated with its logical shape.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend.core import Literal
from jax.sharding import PartitionSpec as P

from fsdp_jax._src import _compat, offload
from fsdp_jax._src.plan import Plan

__all__ = ["ShardedOptState", "OptLayout", "OptEntry", "UpdateReport"]

MODES = ("auto", "global", "local")


# ---------------------------------------------------------------------------
# Names


def _key_name(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _path_name(path) -> str:
  return ".".join(_key_name(k) for k in path) or "_"


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


def _cast(x, dtype, shape):
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
    name = _path_name(path)
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
    slot = _path_name(prefix)
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


# ---------------------------------------------------------------------------
# Per-leaf geometry on one device


class _Geometry:
  """Where parameter leaves live in this device's local storage arrays."""

  def __init__(self, plan: Plan, index=None, place=None):
    self.plan = plan
    self.place = place or (lambda x: x)
    self.axes = plan.axes.shard_axes
    self.n = plan.n if self.axes else 1
    self._index = index
    self._masks: dict = {}
    self._gathers: dict = {}

  @property
  def index(self):
    """This device's position along the shard axes (traced)."""
    if self._index is None:
      if not self.axes:
        self._index = jnp.zeros((), jnp.int32)
      else:
        self._index = lax.axis_index(self.axes[0] if len(self.axes) == 1 else self.axes)
    return self._index

  def _axis_name(self):
    return self.axes[0] if len(self.axes) == 1 else self.axes

  def leaf(self, i):
    return self.plan.leaves[i]

  def prefix(self, i) -> tuple:
    leaf = self.leaf(i)
    return () if leaf.ignored else self.plan.prefix(self.plan.units[leaf.unit])

  def flat(self) -> bool:
    return not self.plan.use_orig_params

  def offset(self, i) -> int:
    """Flat layout: the leaf's offset in its unit's per-layer flat vector."""
    leaf = self.leaf(i)
    unit = self.plan.units[leaf.unit]
    off = 0
    for j in unit.leaf_ids:
      if j == i:
        return off
      off += self.plan.leaves[j].layer_numel
    raise KeyError(i)

  def local_shape(self, i) -> tuple:
    leaf = self.leaf(i)
    if leaf.ignored:
      return leaf.shape
    p = self.prefix(i)
    if self.flat():
      return p + (self.plan.flat_chunk(self.plan.units[leaf.unit]),)
    return p + (self.plan.chunk0(leaf),) + leaf.rest

  def has_padding(self, i) -> bool:
    leaf = self.leaf(i)
    if leaf.ignored:
      return False
    if self.flat():
      unit = self.plan.units[leaf.unit]
      return True if len(unit.leaf_ids) > 1 else self.n * self.plan.flat_chunk(unit) != leaf.layer_numel
    return self.n * self.plan.chunk0(leaf) != leaf.dim0

  def valid(self, i):
    """Bool mask, broadcastable to the local shape: where the local array
    holds leaf ``i``'s values (not padding, not another leaf)."""
    if i in self._masks:
      return self._masks[i]
    leaf = self.leaf(i)
    p = len(self.prefix(i))
    if self.flat():
      c = self.plan.flat_chunk(self.plan.units[leaf.unit])
      pos = self.index * c + lax.iota(jnp.int32, c)
      o = self.offset(i)
      m = (pos >= o) & (pos < o + leaf.layer_numel)
      m = m.reshape((1,) * p + (c,))
    else:
      chunk0 = self.plan.chunk0(leaf)
      rows = self.index * chunk0 + lax.iota(jnp.int32, chunk0)
      m = (rows < leaf.dim0).reshape((1,) * p + (chunk0,) + (1,) * len(leaf.rest))
    m = self.place(jnp.broadcast_to(m, self.local_shape(i)))
    self._masks[i] = m
    return m

  def union_valid(self, leaves):
    """Bool mask of the positions of ``leaves`` (all in one local array), or
    None when that is every position."""
    leaves = list(leaves)
    if not self.flat():
      # Leaves sharing one local array have one shape: one mask.
      return self.valid(leaves[0]) if self.has_padding(leaves[0]) else None
    unit_index = self.leaf(leaves[0]).unit
    unit = self.plan.units[unit_index]
    if len(leaves) == 1:
      return self.valid(leaves[0]) if self.has_padding(leaves[0]) else None
    pos_of = {j: p for p, j in enumerate(unit.leaf_ids)}
    positions = sorted({pos_of[i] for i in leaves})
    padded = self.n * self.plan.flat_chunk(unit) != self.plan.flat_numel(unit)
    if len(positions) == len(unit.leaf_ids) and not padded:
      return None
    m = _in_positions(self.segment_ids(unit_index), positions)
    p = len(self.prefix(leaves[0]))
    return self.place(jnp.broadcast_to(m.reshape((1,) * p + m.shape), self.local_shape(leaves[0])))

  def segment_ids(self, unit_index: int):
    """Flat layout: the position (within the unit) of the leaf each local
    element belongs to; the padding gets ``len(unit.leaf_ids)``."""
    key = ("seg", unit_index)
    if key not in self._masks:
      unit = self.plan.units[unit_index]
      c = self.plan.flat_chunk(unit)
      pos = self.index * c + lax.iota(jnp.int32, c)
      ends = np.cumsum([self.plan.leaves[j].layer_numel for j in unit.leaf_ids])
      seg = jnp.zeros((c,), jnp.int32)
      for e in ends:
        seg = seg + (pos >= int(e)).astype(jnp.int32)
      self._masks[key] = seg
    return self._masks[key]

  def gather(self, i, local):
    """Leaf ``i``'s local array -> its full logical value (every device)."""
    leaf = self.leaf(i)
    if leaf.ignored:
      return local
    p = len(self.prefix(i))
    if self.flat():
      key = id(local)
      if key not in self._gathers:
        full = local
        if self.axes:
          full = lax.all_gather(local, self._axis_name(), axis=p, tiled=True)
        self._gathers[key] = (local, full)
      full = self._gathers[key][1]
      o = self.offset(i)
      x = lax.slice_in_dim(full, o, o + leaf.layer_numel, axis=p)
      return x.reshape(leaf.shape)
    full = local
    if self.axes:
      full = lax.all_gather(local, self._axis_name(), axis=p, tiled=True)
    if full.shape[p] != leaf.dim0:
      full = lax.slice_in_dim(full, 0, leaf.dim0, axis=p)
    return full.reshape(leaf.shape)

  def shard_of(self, i, full):
    """Leaf ``i``'s full logical value -> this device's local array."""
    leaf = self.leaf(i)
    if leaf.ignored:
      return jnp.reshape(full, leaf.shape)
    prefix = self.prefix(i)
    p = len(prefix)
    if self.flat():
      c = self.plan.flat_chunk(self.plan.units[leaf.unit])
      x = jnp.reshape(full, prefix + (leaf.layer_numel,))
      x = jnp.pad(x, [(0, 0)] * p + [(c, c)])
      start = self.index * c - self.offset(i) + c
      return lax.dynamic_slice_in_dim(x, start, c, axis=p)
    chunk0 = self.plan.chunk0(leaf)
    x = jnp.reshape(full, prefix + (leaf.dim0,) + leaf.rest)
    pad = self.n * chunk0 - leaf.dim0
    if pad:
      x = jnp.pad(x, [(0, 0)] * p + [(0, pad)] + [(0, 0)] * len(leaf.rest))
    if self.n == 1:
      return x
    return lax.dynamic_slice_in_dim(x, self.index * chunk0, chunk0, axis=p)


# ---------------------------------------------------------------------------
# Values of the evaluator


@dataclasses.dataclass
class Rep:
  """A value with its logical shape. ``own``: it may differ between devices
  (derived from an ignored parameter's per-device copy); otherwise every
  device holds the same value."""

  value: Any
  own: bool = False


@dataclasses.dataclass
class Shard:
  """Parameter ``leaf``'s local array (its storage layout on this device)."""

  leaf: int
  value: Any


@dataclasses.dataclass
class Splat:
  """A scalar broadcast to ``shape`` (kept as the scalar)."""

  value: Any
  shape: tuple
  own: bool = False


@dataclasses.dataclass
class Partial:
  """A reduction over sharded values, not yet combined across devices: the
  full result is the ``op`` (sum, max, min, and, or) over the shard axes of
  this device's part. The part is kept lazy as ``terms``, ``{key: (local
  array, {leaf id: count})}``: the reduction of each array over the
  positions of those leaves (padding excluded), so that reductions of one
  flat buffer's leaves that are summed anyway (a global norm) read the
  buffer once."""

  op: str
  terms: dict
  dtype: Any


ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "cbrt", "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh",
    "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor",
    "ge", "gt", "igamma", "igammac", "imag", "integer_pow", "is_finite", "le", "lgamma",
    "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter",
    "not", "or", "pow", "real", "reduce_precision", "rem", "round", "rsqrt", "select_n",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "sin", "sinh",
    "sqrt", "square", "sub", "tan", "tanh", "xor", "population_count", "conj", "complex",
    "stop_gradient",
})
# Primitives that only annotate their operands (sharding, scheduling).
_PASSTHROUGH = ("optimization_barrier", "reshard", "sharding_constraint", "mesh_cast")
_REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min",
               "reduce_and": "and", "reduce_or": "or"}
def _identity(op: str, dtype):
  dtype = jnp.dtype(dtype)
  if op == "sum":
    return jnp.zeros((), dtype)
  if op == "and":
    return jnp.ones((), dtype)
  if op == "or":
    return jnp.zeros((), dtype)
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.asarray(-jnp.inf if op == "max" else jnp.inf, dtype)
  info = jnp.iinfo(dtype)
  return jnp.asarray(info.min if op == "max" else info.max, dtype)


def _source(eqn) -> str:
  """Where the equation comes from (``file:line (function)``), for reports."""
  return _compat.source_summary(eqn)


@dataclasses.dataclass
class UpdateReport:
  """What evaluating the optimizer on shards needed (filled while tracing)."""

  psums: int = 0
  gathers: list = dataclasses.field(default_factory=list)  # (leaf name, primitive, where)
  reductions: int = 0

  @property
  def elementwise(self) -> bool:
    return not self.psums and not self.gathers

  def summary(self) -> str:
    if self.elementwise:
      return "elementwise on the local shards, no communication"
    parts = []
    if self.psums:
      parts.append(f"{self.psums} scalar all-reduce{'s' if self.psums > 1 else ''} for "
                   "whole-parameter reductions")
    if self.gathers:
      prims = sorted({p for _, p, _ in self.gathers})
      leaves = sorted({n for n, _, _ in self.gathers})
      parts.append(f"gathers {len(leaves)} parameter-shaped value{'s' if len(leaves) > 1 else ''} "
                   f"for {', '.join(prims)} ({', '.join(leaves[:4])}"
                   f"{', ...' if len(leaves) > 4 else ''})")
    return "; ".join(parts)


class ShardedEvaluator:
  """Evaluates a jaxpr traced on logical values with each parameter-shaped
  value kept as this device's shard where that is exact (see the module
  docstring)."""

  def __init__(self, plan: Plan, report: Optional[UpdateReport] = None, index=None,
               host: bool = False):
    self.plan = plan
    # ``host``: the evaluation runs under compute_on("device_host") on
    # host-resident shards; every array it creates is put there as well (a
    # computation may not mix memory spaces).
    self.place = _to_host_space if host else (lambda x: x)
    self.geo = _Geometry(plan, index, place=self.place)
    self.report = report if report is not None else UpdateReport()
    self.memo: dict = {}
    self.keep: list = []  # keeps memoised operands alive (their ids are keys)

  # -- conversions ---------------------------------------------------------
  def force(self, v):
    """A Partial -> its full value (one collective over the shard axes)."""
    if not isinstance(v, Partial):
      return v
    x = self._partial_local(v)
    axes = self.geo.axes
    if not axes or self.geo.n == 1:
      return Rep(x)
    name = self.geo._axis_name()  # pylint: disable=protected-access
    self.report.psums += 1
    if v.op == "sum":
      return Rep(lax.psum(x, name))
    if v.op in ("max", "min"):
      return Rep((lax.pmax if v.op == "max" else lax.pmin)(x, name))
    as_int = x.astype(jnp.int32)
    r = lax.pmin(as_int, name) if v.op == "and" else lax.pmax(as_int, name)
    return Rep(r.astype(x.dtype))

  def _partial_local(self, v: Partial):
    """This device's part of a Partial, reducing each term's array once over
    the union of its leaves' positions."""
    fn = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "and": jnp.all, "or": jnp.any}[v.op]
    combine = {"sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum,
               "and": jnp.logical_and, "or": jnp.logical_or}[v.op]
    total = None
    for arr, counts in v.terms.values():
      idempotent = v.op != "sum"
      if idempotent or all(c == 1 for c in counts.values()):
        groups = [sorted(counts)]
      else:
        groups = [[i] for i, c in counts.items() for _ in range(c)]
      for group in groups:
        mask = self.geo.union_valid(group)
        x = arr if mask is None else self.select(mask, arr, _identity(v.op, arr.dtype))
        r = fn(x).astype(v.dtype)
        total = r if total is None else combine(total, r)
    return total

  def to_rep(self, v, eqn=None):
    v = self.force(v)
    if isinstance(v, Rep):
      return v
    if isinstance(v, Splat):
      return Rep(jnp.broadcast_to(v.value, v.shape), v.own)
    leaf = self.plan.leaves[v.leaf]
    self.report.gathers.append((leaf.name, eqn.primitive.name if eqn is not None else "store",
                                _source(eqn) if eqn is not None else ""))
    return Rep(self.geo.gather(v.leaf, v.value), leaf.ignored)

  def to_local(self, v, i):
    """A value with leaf ``i``'s logical shape (or one that broadcasts to it
    along size-1 dimensions, as elementwise primitives allow) -> what leaf
    ``i``'s local array combines with."""
    v = self.force(v)
    if isinstance(v, Shard):
      if v.leaf == i or self._compatible(v.leaf, i):
        return v.value
      v = self.to_rep(v)
    if isinstance(v, Splat):
      return self._broadcast(v.value, self.geo.local_shape(i))
    leaf = self.plan.leaves[i]
    x = v.value
    if tuple(np.shape(x)) != leaf.shape:
      if leaf.ignored:
        return x
      p = len(self.geo.prefix(i))
      if not self.geo.flat() and np.shape(x)[p] == 1:
        return x  # constant along the sharded dimension: the primitive broadcasts it
      x = jnp.broadcast_to(x, leaf.shape)
    return self.geo.shard_of(i, x)

  def _broadcast(self, scalar, shape):
    key = ("bcast", id(scalar), shape)
    if key not in self.memo:
      self.keep.append(scalar)
      self.memo[key] = self.place(jnp.broadcast_to(scalar, shape))
    return self.memo[key]

  def select(self, mask, x, fill):
    """``where(mask, x, fill)`` for a bool ``mask`` of ``x``'s shape and a
    scalar ``fill``."""
    return lax.select_n(mask, self._broadcast(jnp.asarray(fill, x.dtype), x.shape), x)

  def _compatible(self, a, b) -> bool:
    """Two leaves whose local arrays have the same layout (original layout,
    same logical shape)."""
    la, lb = self.plan.leaves[a], self.plan.leaves[b]
    if self.geo.flat() or la.ignored != lb.ignored:
      return False
    return la.shape == lb.shape and self.geo.prefix(a) == self.geo.prefix(b)

  # -- evaluation ----------------------------------------------------------
  def run(self, jaxpr, consts, args):
    env: dict = {}

    def read(v):
      if isinstance(v, Literal):
        return Rep(v.val)
      return env[v]

    for v, x in zip(jaxpr.constvars, consts):
      env[v] = x if isinstance(x, (Rep, Shard, Splat, Partial)) else Rep(x)
    for v, x in zip(jaxpr.invars, args):
      env[v] = x
    for eqn in jaxpr.eqns:
      outs = self.apply(eqn, [read(v) for v in eqn.invars])
      for v, o in zip(eqn.outvars, outs):
        env[v] = o
    return [read(v) for v in jaxpr.outvars]

  def _bind_rep(self, eqn, vals):
    own = any(getattr(v, "own", False) for v in vals)
    outs = _compat.bind_eqn(eqn, [v.value for v in vals])
    return [Rep(o, own) for o in outs]

  def apply(self, eqn, invals):
    name = eqn.primitive.name
    if all(isinstance(v, Rep) for v in invals):
      return self._bind_rep(eqn, invals)
    call = _compat.inlinable_body(eqn)
    if call is not None:
      jaxpr, consts = call
      return self.run(jaxpr, [Rep(c) for c in consts], invals[len(invals) - len(jaxpr.invars):])
    if name in ("add", "sub") and any(isinstance(v, Partial) for v in invals):
      out = self._linear_partial(eqn, invals)
      if out is not None:
        return [out]
    if (name in ("max", "min", "and", "or") and len(invals) == 2
        and all(isinstance(v, Partial) and v.op == name and v.dtype == invals[0].dtype
                for v in invals)):
      return [_merge(*invals)]
    invals = [self.force(v) for v in invals]
    if all(isinstance(v, Rep) for v in invals):
      return self._bind_rep(eqn, invals)
    if name in ELEMENTWISE:
      return [self._elementwise(eqn, invals)]
    if name == "broadcast_in_dim":
      (x,) = invals[:1]
      out_shape = tuple(eqn.outvars[0].aval.shape)
      if isinstance(x, Splat):
        return [Splat(x.value, out_shape, x.own)]
      if isinstance(x, Shard) and tuple(eqn.invars[0].aval.shape) == out_shape:
        return [x]
    if name in _PASSTHROUGH:
      return list(invals)
    if name in ("reshape", "squeeze", "expand_dims"):
      x = invals[0]
      out_shape = tuple(eqn.outvars[0].aval.shape)
      if isinstance(x, Splat):
        return [Splat(x.value, out_shape, x.own)]
      if isinstance(x, Shard) and tuple(eqn.invars[0].aval.shape) == out_shape:
        return [x]
    if name in _REDUCTIONS:
      x = invals[0]
      axes = _compat.reduction_axes(eqn)
      ndim = len(eqn.invars[0].aval.shape)
      if sorted(axes) == list(range(ndim)):
        if isinstance(x, Splat):
          return [self._reduce_splat(eqn, x)]
        if isinstance(x, Shard):
          return [self._reduce_shard(_REDUCTIONS[name], x, eqn)]
    if name == "cond":
      return self._cond(eqn, invals)
    # Anything else reads whole parameters: gather them.
    return self._bind_rep(eqn, [self.to_rep(v, eqn) for v in invals])

  def _linear_partial(self, eqn, invals):
    a, b = invals
    zero = lambda v: isinstance(v, Rep) and not v.own and np.ndim(v.value) == 0 and _is_zero(v.value)
    if (eqn.primitive.name == "add" and isinstance(a, Partial) and isinstance(b, Partial)
        and a.op == b.op == "sum" and a.dtype == b.dtype):
      return _merge(a, b)
    if isinstance(a, Partial) and a.op == "sum" and zero(b):
      return a
    if eqn.primitive.name == "add" and isinstance(b, Partial) and b.op == "sum" and zero(a):
      return b
    return None

  def _elementwise(self, eqn, invals):
    shards = [v for v in invals if isinstance(v, Shard)]
    out_aval = eqn.outvars[0].aval
    if not shards:
      # Splats and scalars only: compute on the scalars.
      vals = []
      for v in invals:
        vals.append(v.value if isinstance(v, (Splat, Rep)) else v)
      own = any(getattr(v, "own", False) for v in invals)
      if all(isinstance(v, Splat) or np.ndim(v.value) == 0 for v in invals):
        (out,) = _compat.bind_eqn(eqn, [jnp.asarray(v) for v in vals])
        return Splat(out, tuple(out_aval.shape), own)
      return self._bind_rep(eqn, [self.to_rep(v) for v in invals])[0]
    i = shards[0].leaf
    if any(s.leaf != i and not self._compatible(s.leaf, i) for s in shards):
      return self._bind_rep(eqn, [self.to_rep(v, eqn) for v in invals])[0]
    shape = self.geo.local_shape(i)
    args, key = [], [eqn.primitive, _params_key(eqn.params)]
    for v in invals:
      if isinstance(v, Shard):
        args.append(v.value)
        key.append(("s", id(v.value)))
      elif isinstance(v, Splat) or np.ndim(v.value) == 0:
        x = v.value
        # Binary primitives take scalar operands as they are; select_n's
        # cases need the full shape.
        needs_full = eqn.primitive.name == "select_n" and len(args) > 0
        args.append(self._broadcast(jnp.asarray(x), shape) if needs_full else x)
        key.append(("c", id(x)) if not isinstance(x, (int, float, bool, np.generic, np.ndarray))
                   else ("l", repr(x), str(np.asarray(x).dtype)))
      else:
        loc = self.to_local(v, i)
        args.append(loc)
        key.append(("s", id(loc)))
    key = tuple(key)
    if self.geo.flat() and key in self.memo:
      return Shard(i, self.memo[key])
    (out,) = _compat.bind_eqn(eqn, args)
    if self.geo.flat():
      self.keep.extend(args)
      self.memo[key] = out
    return Shard(i, out)

  def _reduce_splat(self, eqn, x: Splat):
    op = _REDUCTIONS[eqn.primitive.name]
    size = int(np.prod(x.shape, dtype=np.int64))
    out_dtype = eqn.outvars[0].aval.dtype
    if op == "sum":
      # What the single-device program computes: a sum of `size` copies.
      return Rep(jnp.sum(jnp.broadcast_to(x.value, (size,)).astype(out_dtype)), x.own)
    if size == 0:
      return Rep(_identity(op, out_dtype), x.own)
    return Rep(jnp.asarray(x.value).astype(out_dtype), x.own)

  def _reduce_shard(self, op, x: Shard, eqn):
    leaf = self.plan.leaves[x.leaf]
    self.report.reductions += 1
    dtype = jnp.dtype(eqn.outvars[0].aval.dtype)
    if leaf.ignored:
      fn = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "and": jnp.all, "or": jnp.any}[op]
      return Rep(fn(x.value).astype(dtype), True)
    key = (id(x.value), leaf.unit)
    self.keep.append(x.value)
    return Partial(op, {key: (x.value, {x.leaf: 1})}, dtype)

  def _cond(self, eqn, invals):
    index = self.to_rep(invals[0])
    outs = []
    for branch in _compat.cond_branches(eqn):
      body, consts = _compat.split_closed(branch)
      outs.append(self.run(body, [Rep(c) for c in consts], invals[1:]))
    result = []
    for k, var in enumerate(eqn.outvars):
      cases = [self.force(o[k]) for o in outs]
      shards = [c for c in cases if isinstance(c, Shard)]
      own = index.own or any(getattr(c, "own", False) for c in cases)
      if shards:
        i = shards[0].leaf
        vals = [self.to_local(c, i) for c in cases]
        result.append(Shard(i, lax.select_n(index.value, *vals) if len(vals) > 1 else vals[0]))
      elif all(isinstance(c, Splat) for c in cases):
        vals = [c.value for c in cases]
        result.append(Splat(lax.select_n(index.value, *vals), tuple(var.aval.shape), own))
      else:
        vals = [self.to_rep(c).value for c in cases]
        result.append(Rep(lax.select_n(index.value, *vals) if len(vals) > 1 else vals[0], own))
    return result


def _merge(a: Partial, b: Partial) -> Partial:
  terms = {k: (arr, dict(c)) for k, (arr, c) in a.terms.items()}
  for k, (arr, counts) in b.terms.items():
    if k not in terms:
      terms[k] = (arr, dict(counts))
    else:
      for i, c in counts.items():
        terms[k][1][i] = terms[k][1].get(i, 0) + c
  return Partial(a.op, terms, a.dtype)


def _to_host_space(x):
  space = getattr(jax.typeof(x), "memory_space", None)
  if space == jax.memory.Space.Host:
    return x
  return jax.device_put(x, jax.memory.Space.Host)


def _is_zero(x) -> bool:
  try:
    return bool(np.all(np.asarray(x) == 0))
  except Exception:  # pylint: disable=broad-except  # a tracer
    return False


def _params_key(params) -> tuple:
  out = []
  for k in sorted(params):
    v = params[k]
    try:
      hash(v)
      out.append((k, v))
    except TypeError:
      out.append((k, id(v)))
  return tuple(out)


# ---------------------------------------------------------------------------
# Inputs and outputs of the evaluator: the stored state <-> evaluator values


def _param_values(plan: Plan, stored, geo: _Geometry) -> dict:
  """Local stored params (or grads) of the trainable leaves -> values."""
  out = {}
  if plan.use_orig_params:
    leaves = jax.tree_util.tree_leaves(stored)
    it = iter(leaves)
    # ``stored`` holds the trainable leaves in order (None at frozen ones).
    for l in plan.leaves:
      if l.frozen:
        continue
      x = next(it)
      out[l.index] = Rep(x[0], True) if l.ignored else Shard(l.index, x)
    return out
  for l in plan.leaves:
    if l.frozen:
      continue
    if l.ignored:
      out[l.index] = Rep(stored[plan.ignored_key(l)][0], True)
    else:
      out[l.index] = Shard(l.index, stored[plan.units[l.unit].flat_key])
  return out


def _state_values(plan: Plan, lay: OptLayout, opt_state: ShardedOptState) -> list:
  vals = []
  for e in lay.entries:
    if e.kind != "slot":
      vals.append(Rep(opt_state.leaves[e.path]))
      continue
    tree = opt_state.slots[e.slot]
    leaf = plan.leaves[e.param]
    if plan.use_orig_params:
      x = plan.treedef.flatten_up_to(tree)[e.param]
    else:
      x = tree[storage_key(plan, e.param)]
    vals.append(Rep(x[0], True) if leaf.ignored else Shard(e.param, x))
  return vals


class _Assembler:
  """Evaluator values of one slot (or the params) -> stored local arrays."""

  def __init__(self, ev: ShardedEvaluator):
    self.ev = ev
    self.plan = ev.plan

  def local(self, v, i, dtype):
    leaf = self.plan.leaves[i]
    if leaf.ignored:
      x = self.ev.to_rep(v).value
      return jnp.asarray(x).astype(dtype).reshape(leaf.shape)[None]
    return self.ev.to_local(v, i).astype(dtype)

  def store(self, values: dict, dtypes: dict) -> dict:
    """``{leaf id: value}`` -> ``{storage key: local array}`` with padding and
    absent leaves zeroed."""
    plan, geo = self.plan, self.ev.geo
    out = {}
    if plan.use_orig_params:
      for i, v in values.items():
        x = self.local(v, i, dtypes[i])
        if geo.has_padding(i):
          x = self.ev.select(geo.valid(i), x, 0)
        out[i] = x
      return out
    by_unit: dict = {}
    for i, v in values.items():
      leaf = plan.leaves[i]
      if leaf.ignored:
        out[plan.ignored_key(leaf)] = self.local(v, i, dtypes[i])
      else:
        by_unit.setdefault(leaf.unit, {})[i] = v
    for u, vals in by_unit.items():
      unit = plan.units[u]
      dtype = dtypes[next(iter(vals))]
      arrays = {i: self.local(v, i, dtype) for i, v in vals.items()}
      groups: dict = {}
      for i, x in arrays.items():
        groups.setdefault(id(x), (x, []))[1].append(i)
      # Each group of leaves sharing one array is written at their positions;
      # padding and leaves without a value stay zero.
      buf = None
      for x, ids in groups.values():
        m = geo.union_valid(ids)
        if m is None:
          buf = x
          continue
        if buf is None:
          buf = self.ev._broadcast(jnp.zeros((), dtype), x.shape)  # pylint: disable=protected-access
        buf = lax.select_n(m, buf, x)
      out[unit.flat_key] = buf
    return out


def _in_positions(seg, positions):
  """``seg`` in ``positions`` (sorted ints), as few compares as runs."""
  runs = []
  for p in positions:
    if runs and runs[-1][1] == p - 1:
      runs[-1][1] = p
    else:
      runs.append([p, p])
  m = None
  for a, b in runs:
    r = (seg >= a) & (seg <= b) if a != b else seg == a
    m = r if m is None else m | r
  return m


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
  try:
    return jax.eval_shape(optimizer.init, logical_params(plan))
  except Exception as e:  # pylint: disable=broad-except
    raise ValueError(
        f"optimizer.init failed on the parameter tree ({type(e).__name__}: {e}). The "
        "optimizer sees the tree passed to init_train_state (frozen leaves are None). "
        "Fix: build the optimizer (masks, labels) for that tree.") from e


def layout_for(plan: Plan, optimizer) -> OptLayout:
  return build_layout(plan, abstract_init(plan, optimizer))


def init_local(plan: Plan, optimizer, lay: OptLayout, trainable_local, report=None):
  """Inside ``shard_map``: the stored optimizer state from the local
  trainable param shards."""
  ev = ShardedEvaluator(plan, report)
  closed, _ = _trace(optimizer.init, logical_params(plan))
  pvals = _param_values(plan, trainable_local, ev.geo)
  args = [pvals[l.index] for l in plan.leaves if not l.frozen]
  outs = ev.run(closed.jaxpr, closed.consts, args)
  return _store_state(ev, lay, outs)


def _store_state(ev: ShardedEvaluator, lay: OptLayout, outs) -> ShardedOptState:
  plan = ev.plan
  asm = _Assembler(ev)
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
      leaves[e.path] = _cast(r.value, e.dtype, e.shape)
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
  gvals = _param_values(plan, grads, ev.geo)
  pvals = _param_values(plan, params, ev.geo)
  args = ([gvals[l.index] for l in plan.leaves if not l.frozen]
          + _state_values(plan, lay, opt_state)
          + [pvals[l.index] for l in plan.leaves if not l.frozen]
          + ([Rep(jnp.asarray(value, jnp.float32))] if extra else []))
  outs = ev.run(closed.jaxpr, closed.consts, args)
  n_params = sum(not l.frozen for l in plan.leaves)
  new_p, new_s = outs[:n_params], outs[n_params:]
  trainable = [l for l in plan.leaves if not l.frozen]
  asm = _Assembler(ev)
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
  from fsdp_jax._src.grads import param_specs, split_trainable  # pylint: disable=import-outside-toplevel
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
  from fsdp_jax._src import layout  # pylint: disable=import-outside-toplevel
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
  from fsdp_jax._src import layout  # pylint: disable=import-outside-toplevel
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
  if offload.offloads(plan.config):
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
      leaves[e.path] = _cast(x, e.dtype, e.shape)
  new_slots = {slot: slot_tree(plan, _pack_units(plan, *per_slot[slot]))
               for slot in lay.slot_names}
  new_state = ShardedOptState(new_slots, leaves, lay)
  # The compiler would choose its own layouts for these results: keep the
  # state's (the next step is compiled for them).
  new_state = jax.lax.with_sharding_constraint(
      new_state, jax.tree.map(lambda s: s.sharding, stored_shapes(plan, lay)))
  from fsdp_jax._src.grads import split_trainable  # pylint: disable=import-outside-toplevel
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
  requested = getattr(plan.config, "optimizer_update", "auto")
  lay = plan.opt_layout if plan.opt_layout is not None else layout_for(plan, optimizer)
  report = analyse(plan, optimizer, lay)
  if offload.offloads(plan.config) and not report.elementwise:
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
    global_ok = not offload.offloads(plan.config) and not any(
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
  return _Geometry(plan).index
