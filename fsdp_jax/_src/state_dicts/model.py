"""Model state dicts: :func:`state_dict` and :func:`load_state_dict`
(FULL, SHARDED and LOCAL, as PyTorch FSDP names them)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from fsdp_jax._src import mesh as mesh_lib
from fsdp_jax._src import offload
from fsdp_jax._src.config import StateDictType
from fsdp_jax._src.naming import path_name
from fsdp_jax._src.plan import Plan
from fsdp_jax._src.state import ShardedTrainState
from fsdp_jax._src.state_dicts.convert import (BUFFER_FIELDS, LOCAL_METADATA_KEY,
    MAX_LINES, PARAMS, canonical_sharding, data_fields, dtype_name, is_key_dtype,
    layer_axis, leaves_to_storage, on_devices, param_names, place, problems,
    replicated_sharding, require_state, require_type, shape_of, shard_desc,
    storage_from_items, storage_items, storage_shape_by_key, storage_sharding_by_key,
    storage_to_leaves, to_host, to_pinned)


def _buffer_items(state) -> list[tuple[str, Any]]:
  out = []
  for f in BUFFER_FIELDS:
    if f in data_fields(state):
      for path, x in jax.tree_util.tree_flatten_with_path(getattr(state, f))[0]:
        out.append((path_name(path), x))
  return out


def local_metadata(plan: Plan) -> dict:
  entries = {}
  shapes = storage_shape_by_key(plan)
  for u in plan.units:
    if plan.use_orig_params:
      for i in u.leaf_ids:
        leaf = plan.leaves[i]
        entries[leaf.name] = {
            "global_shape": list(shapes[leaf.name]), "dtype": dtype_name(leaf.dtype),
            "unit": u.display_name, "shape": list(leaf.shape),
            "padded_dim": layer_axis(plan, leaf),
            "padding": plan.n * plan.chunk0(leaf) - leaf.dim0}
    else:
      params, off = [], 0
      for i in u.leaf_ids:
        leaf = plan.leaves[i]
        params.append({"name": leaf.name, "shape": list(leaf.shape), "offset": off,
                       "numel": leaf.layer_numel})
        off += leaf.layer_numel
      entries[u.flat_key] = {
          "global_shape": list(shapes[u.flat_key]), "dtype": dtype_name(plan.unit_dtype(u)),
          "unit": u.display_name, "stacked_layers": u.num_layers if u.stacked else 0,
          "params": params, "padding": plan.n * plan.flat_chunk(u) - off}
  return {
      "layout": "original" if plan.use_orig_params else "flat",
      "sharding_strategy": plan.config.sharding_strategy.name,
      "mesh": {str(a): int(s) for a, s in plan.mesh.shape.items()},
      "shard_axes": list(plan.axes.shard_axes), "shard_size": plan.n,
      "entries": entries,
  }


@mesh_lib.own_mesh
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
  plan = require_state(state, fn)
  kind = require_type(state_dict_type, fn)
  if rank0_only and kind is not StateDictType.FULL_STATE_DICT:
    raise ValueError(f"{fn}: rank0_only applies to FULL_STATE_DICT only (PyTorch's "
                     "FullStateDictConfig); sharded and local state dicts are per process.")
  names = param_names(plan)
  out: dict = {}
  if kind is StateDictType.LOCAL_STATE_DICT:
    post = to_pinned if offload_to_cpu else (lambda x: x)
    for key, x in storage_items(plan, state.params).items():
      out[key] = post(x)
    for name, x in _buffer_items(state):
      out[name] = post(x)
    out[LOCAL_METADATA_KEY] = local_metadata(plan)
    return out
  full = kind is StateDictType.FULL_STATE_DICT
  dropped = full and rank0_only and jax.process_index() != 0
  post = (to_host if full else to_pinned) if offload_to_cpu and not dropped else None
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
    out[name] = post(x) if post is not None and not is_key_dtype(x.dtype) else x
  return {} if dropped else out


def _mismatch_error(title: str, missing, unexpected, sizes, fix: str) -> ValueError:
  lines = []
  if missing:
    lines.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing[:MAX_LINES])
                 + (f" ... and {len(missing) - MAX_LINES} more" if len(missing) > MAX_LINES else "") + ".")
  if unexpected:
    lines.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected[:MAX_LINES])
                 + (f" ... and {len(unexpected) - MAX_LINES} more" if len(unexpected) > MAX_LINES else "") + ".")
  lines.extend(sizes)
  return ValueError(f"Error(s) in {title}:\n" + problems(lines) + f"\nFix: {fix}")


@mesh_lib.own_mesh
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
  plan = require_state(state, fn)
  kind = require_type(state_dict_type, fn)
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
    if shape_of(v) != shape_of(x):
      raise ValueError(f"Buffer {name!r}: the state dict holds shape {shape_of(v)}, the "
                       f"state {shape_of(x)}. Fix: load a state dict of the same model.")
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
      sh = (x.sharding if isinstance(x, jax.Array) and on_devices(x, plan.mesh)
            else replicated_sharding(plan))
      out.append(place(v, sh, shape=shape_of(x), dtype=x.dtype))
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
    if n in sd and shape_of(sd[n]) != plan.leaves[i].shape:
      sizes.append(f"size mismatch for {n}: copying a param with shape {shape_of(sd[n])} from "
                   f"the state dict, the shape in the current model is {plan.leaves[i].shape}.")
  for n, x in buffers.items():
    if n in sd and shape_of(sd[n]) != shape_of(x):
      sizes.append(f"size mismatch for buffer {n}: {shape_of(sd[n])} in the state dict, "
                   f"{shape_of(x)} in the current model.")
  if sizes or (strict and (missing or unexpected)):
    raise _mismatch_error(
        f"loading {kind.name} into the model ({shard_desc(plan)})",
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
  return offload.place_state_tree(plan.memory_kind,
                                  leaves_to_storage(plan, leaves, state.params))


def check_local_metadata(plan: Plan, meta, what: str):
  if meta is None:
    return
  mine = local_metadata(plan)
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
        f"(mesh {meta.get('mesh')}); this state is {shard_desc(plan)} on mesh "
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
                     + problems(lines) + "\n" + fix)


def _load_local_params(plan, state, sd, buffers, strict):
  what = "load_state_dict(LOCAL_STATE_DICT)"
  check_local_metadata(plan, sd.get(LOCAL_METADATA_KEY), what)
  shapes = storage_shape_by_key(plan)
  shardings = storage_sharding_by_key(plan)
  current = storage_items(plan, state.params)
  missing = [k for k in shapes if k not in sd]
  unexpected = [k for k in sd if k not in shapes and k not in buffers and k != LOCAL_METADATA_KEY]
  sizes = [f"size mismatch for {k}: stored array of global shape {shape_of(sd[k])} in the "
           f"state dict, {shapes[k]} in the current model ({shard_desc(plan)})."
           for k in shapes if k in sd and shape_of(sd[k]) != shapes[k]]
  if sizes or (strict and (missing or unexpected)):
    raise _mismatch_error(
        f"loading LOCAL_STATE_DICT into the model ({shard_desc(plan)})",
        missing if strict else [], unexpected if strict else [], sizes,
        "load the local state dict of a state with the same plan, or use "
        "SHARDED_STATE_DICT / FULL_STATE_DICT to change mesh, strategy or layout.")
  items = {}
  for k, shape in shapes.items():
    if k in sd:
      items[k] = place(sd[k], shardings[k], shape=shape, dtype=current[k].dtype)
    else:
      items[k] = current[k]
  return offload.place_state_tree(plan.memory_kind, storage_from_items(plan, items))


