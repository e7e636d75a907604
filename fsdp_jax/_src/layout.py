"""Parameter layouts: full tree <-> stored shards <-> per-device gather buffers.

Flat layout (``use_orig_params=False``, PyTorch's FlatParameter): a unit's
leaves are flattened, concatenated and zero-padded to ``N * chunk``; device r
holds ``[r * chunk, (r + 1) * chunk)``. Stored as ``{"<unit>._flat_param": x}``.

Original layout (``use_orig_params=True``, FSDP2 style): every leaf keeps its
place in the original tree and is zero-padded along its first dimension to a
multiple of N and sharded along it. Each leaf's local rows are gathered and
reduced on their own (:func:`fsdp_jax._src.collectives.gathers_per_leaf`);
hooks, quantization and hpZ work on the unit's concatenated local buffer.

Stacked units (``FSDPConfig.stacked_layers``) carry a leading layer axis that
is not sharded: each layer is laid out as above, independently.

A tensor-parallel unit (``UnitSpec.tensor``) is laid out as above once per
slice of the tensor axis: slice ``t`` of every leaf (its ``tensor_dim`` cut
in ``T`` equal parts) gets its own flat parameter or padded rows, and the
``T`` layouts are concatenated along the sharded axis, so the stored array
is sharded over ``(tensor, shard)`` and device ``(t, r)`` holds chunk ``r``
of slice ``t``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from fsdp_jax._src.plan import Plan, UnitSpec


def pack_unit(plan: Plan, unit: UnitSpec, full_leaves: dict, *, replicate: bool = False):
  """Full leaves of ``unit`` -> its stored arrays (global view, zero padded).

  Returns ``{leaf_id: array}`` (original layout) or ``{"flat": array}``.

  ``replicate``: the full leaves are replicated (a user's tree, or a unit
  unpacked with ``unpack_storage_full(..., replicate=True)``). A
  tensor-parallel unit is then packed on every device and each keeps its
  slice, rather than left to the compiler to partition (see
  :func:`unpack_storage_full`).
  """
  if unit.tensor:
    parts = [_pack_slices(plan, unit, {i: _tensor_slice(plan, i, x, t)
                                       for i, x in full_leaves.items()})
             for t in range(plan.t)]
    p = len(plan.prefix(unit))
    packed = {k: _concat([part[k] for part in parts], p) for k in parts[0]}
    if replicate and not all(isinstance(x, np.ndarray) for x in packed.values()):
      everywhere = NamedSharding(plan.mesh, P())
      packed = {k: lax.with_sharding_constraint(x, everywhere) for k, x in packed.items()}
    return packed
  return _pack_slices(plan, unit, full_leaves)


def _pack_slices(plan: Plan, unit: UnitSpec, full_leaves: dict):
  prefix = plan.prefix(unit)
  p = len(prefix)
  n = plan.n
  if plan.use_orig_params:
    out = {}
    for i in unit.leaf_ids:
      leaf = plan.leaves[i]
      x = jnp.reshape(full_leaves[i], prefix + (leaf.dim0,) + leaf.rest)
      pad = n * plan.chunk0(leaf) - leaf.dim0
      if pad:
        x = jnp.pad(x, [(0, 0)] * p + [(0, pad)] + [(0, 0)] * len(leaf.rest))
      out[i] = x
    return out
  flat = jnp.concatenate(
      [jnp.reshape(full_leaves[i], prefix + (-1,)) for i in unit.leaf_ids], axis=p)
  pad = n * plan.flat_chunk(unit) - flat.shape[-1]
  if pad:
    flat = jnp.pad(flat, [(0, 0)] * p + [(0, pad)])
  return {"flat": flat}


def unit_storage(plan: Plan, unit: UnitSpec, storage) -> list:
  """The stored arrays of ``unit`` from the state's params tree, in order."""
  if plan.use_orig_params:
    leaves = jax.tree_util.tree_leaves(storage)
    return [leaves[i] for i in unit.leaf_ids]
  return [storage[unit.flat_key]]


def unpack_storage_full(plan: Plan, unit: UnitSpec, arrays: list, *,
                        replicate: bool = False) -> dict:
  """Stored (global) arrays of a unit -> its full leaves, without collectives
  (used outside the step, where arrays are global). On numpy arrays (a
  host copy) the leaves are views (copies for a tensor-parallel unit).

  ``replicate``: the leaves are wanted replicated (or the unit is unpacked
  and packed again, one unit at a time). A tensor-parallel unit's stored
  arrays, sharded over ``(tensor, shard)``, are then replicated first (one
  all-gather each) and cut into leaves on every device: left to the
  compiler, cutting the slices out of the sharded arrays partitions into
  thousands of operations (seconds to compile for a two-layer model) and
  holds more temporaries than the unit itself.
  """
  if unit.tensor:
    if replicate and not isinstance(arrays[0], np.ndarray):
      everywhere = NamedSharding(plan.mesh, P())
      arrays = [lax.with_sharding_constraint(x, everywhere) for x in arrays]
    p = len(plan.prefix(unit))
    parts = []
    for t in range(plan.t):
      own = []
      for x in arrays:
        size = x.shape[p] // plan.t
        own.append(_slice_in_dim(x, t * size, (t + 1) * size, p))
      parts.append(_unpack_slices(plan, unit, own, local=True))
    return {i: _concat([part[i] for part in parts],
                       p + plan.leaves[i].tensor_dim) for i in parts[0]}
  return _unpack_slices(plan, unit, arrays)


def _tensor_slice(plan: Plan, i: int, x, t: int):
  """Slice ``t`` of leaf ``i`` (its ``tensor_dim`` cut in ``plan.t`` parts)."""
  leaf = plan.leaves[i]
  p = len(plan.prefix(plan.units[leaf.unit]))
  size = leaf.layer_shape[leaf.tensor_dim]
  return _slice_in_dim(x, t * size, (t + 1) * size, p + leaf.tensor_dim)


def _concat(xs: list, axis: int):
  if all(isinstance(x, np.ndarray) for x in xs):
    return np.concatenate(xs, axis=axis)
  return jnp.concatenate(xs, axis=axis)


def _unpack_slices(plan: Plan, unit: UnitSpec, arrays: list, local: bool = False) -> dict:
  prefix = plan.prefix(unit)
  p = len(prefix)
  out = {}
  if plan.use_orig_params:
    for i, x in zip(unit.leaf_ids, arrays):
      leaf = plan.leaves[i]
      shape = prefix + leaf.layer_shape if local else leaf.shape
      out[i] = _slice_in_dim(x, 0, leaf.dim0, p).reshape(shape)
    return out
  (flat,) = arrays
  off = 0
  for i in unit.leaf_ids:
    leaf = plan.leaves[i]
    size = leaf.layer_numel
    shape = prefix + leaf.layer_shape if local else leaf.shape
    out[i] = _slice_in_dim(flat, off, off + size, p).reshape(shape)
    off += size
  return out


def _slice_in_dim(x, start: int, stop: int, axis: int):
  if isinstance(x, np.ndarray):
    return x[(slice(None),) * axis + (slice(start, stop),)]
  return lax.slice_in_dim(x, start, stop, axis=axis)


def group_locals(plan: Plan, group, local_arrays: dict) -> list:
  """The local operands a dtype group is gathered from
  (:func:`fsdp_jax._src.collectives.local_shapes`): its leaves' local shards
  (original layout) or the unit's local flat shard.

  ``local_arrays`` maps leaf id -> local shard (original layout) or holds the
  local flat shard under ``"flat"``.
  """
  if not plan.use_orig_params:
    return [local_arrays["flat"]]
  return [local_arrays[i] for i in group]


def check_flat_dtypes(plan_leaves, units, use_orig_params: bool):
  """A FlatParameter holds one dtype (PyTorch's rule): refuse mixed units."""
  if use_orig_params:
    return
  for u in units:
    dtypes = {np.dtype(plan_leaves[i].dtype).name for i in u.leaf_ids}
    if len(dtypes) > 1:
      detail = ", ".join(f"{plan_leaves[i].name}: {np.dtype(plan_leaves[i].dtype).name}"
                         for i in u.leaf_ids[:8])
      raise ValueError(
          f"Unit {u.name or '<root>'!r} mixes dtypes {sorted(dtypes)} ({detail}). "
          "A flat parameter (use_orig_params=False) holds a single dtype, as in "
          "PyTorch. Fix: cast the parameters to one dtype, wrap the leaves of "
          "each dtype into separate units with auto_wrap_policy, or pass "
          "use_orig_params=True (one gather per dtype).")
    frozen = {plan_leaves[i].frozen for i in u.leaf_ids}
    if len(frozen) > 1:
      names = [plan_leaves[i].name for i in u.leaf_ids if plan_leaves[i].frozen][:6]
      raise ValueError(
          f"Unit {u.name or '<root>'!r} mixes frozen ({', '.join(names)}) and "
          "trainable parameters. With use_orig_params=False each unit's flat "
          "parameter is all frozen or all trainable (PyTorch's rule). Fix: wrap "
          "the frozen subtree as its own unit with auto_wrap_policy, or pass "
          "use_orig_params=True.")
