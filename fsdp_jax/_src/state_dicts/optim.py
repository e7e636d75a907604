"""Optimizer state dicts: ``optim_state_dict`` / ``optim_state_dict_to_load``,
``full_optim_state_dict``, ``shard_``/``scatter_full_optim_state_dict`` and
``rekey_optim_state_dict``, keyed like ``torch.optim.Optimizer.state_dict()``."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from fsdp_jax._src import mesh as mesh_lib
from fsdp_jax._src import offload
from fsdp_jax._src.config import StateDictType
from fsdp_jax._src.plan import Plan
from fsdp_jax._src.state import ShardedTrainState
from fsdp_jax._src.state_dicts.convert import (LOCAL_METADATA_KEY, OptLayout,
    OptimStateKeyType, canonical_sharding, ignored_entries, is_masked, leaves_to_storage,
    opt_layout, param_names, place, present, problems, replicated_sharding, require_state,
    require_type, shape_of, split_storage, storage_from_items, storage_items, storage_keys,
    storage_shape_by_key, storage_sharding_by_key, storage_to_leaves, to_host, to_pinned)
from fsdp_jax._src.state_dicts.model import check_local_metadata, local_metadata


def optim_named(state, *, replicated: bool, post=None) -> dict:
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
  keys = storage_keys(plan)
  lay = opt_layout(plan, state.opt_state)
  post = to_pinned if offload else (lambda x: x)
  per_key: dict = {k: {} for k in keys}
  for slot, tree in lay.slots:
    for k, x in storage_items(plan, tree).items():
      if not is_masked(x):
        per_key[k][slot] = post(x)
  group: dict = {"params": list(keys)}
  for name, x in _group_items(lay):
    group[name] = post(x)
  return {"state": {k: d for k, d in per_key.items() if d}, "param_groups": [group],
          LOCAL_METADATA_KEY: local_metadata(plan)}


def _group_items(lay: OptLayout) -> list:
  """LOCAL state dicts keep every replicated leaf under its full path."""
  paths = {(e.param, e.slot): e.path for e in lay.state.layout.entries if e.kind == "param"}
  items = [(paths[k], x) for k, x in lay.pleaves] + list(lay.scalars)
  order = {e.path: n for n, e in enumerate(lay.state.layout.entries)}
  return sorted(items, key=lambda kv: order[kv[0]])


@mesh_lib.own_mesh
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
  require_state(state, fn)
  kind = require_type(state_dict_type, fn)
  if rank0_only and kind is not StateDictType.FULL_STATE_DICT:
    raise ValueError(f"{fn}: rank0_only applies to FULL_STATE_DICT only.")
  if offload_to_cpu is None:
    offload_to_cpu = kind is not StateDictType.LOCAL_STATE_DICT
  if kind is StateDictType.LOCAL_STATE_DICT:
    return _optim_local(state, offload=offload_to_cpu)
  full = kind is StateDictType.FULL_STATE_DICT
  dropped = full and rank0_only and jax.process_index() != 0
  post = (to_host if full else to_pinned) if offload_to_cpu and not dropped else None
  out = optim_named(state, replicated=full, post=post)
  return {} if dropped else out


@mesh_lib.own_mesh
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


def named_needs(plan: Plan, lay: OptLayout) -> list[_Need]:
  names = param_names(plan)
  needs = []
  for slot, tree in lay.slots:
    split = split_storage(plan, tree)
    for u in plan.units:
      tmpl = split[u.index]
      for i in present(plan, u, tmpl):
        if plan.use_orig_params:
          dtype = tmpl[u.leaf_ids.index(i)].dtype
        else:
          dtype = tmpl[0].dtype
        needs.append(_Need(slot, names[i], plan.leaves[i].shape, jnp.dtype(dtype), i))
    for i, x in ignored_entries(plan, tree).items():
      if x is not None:
        needs.append(_Need(slot, names[i], plan.leaves[i].shape, jnp.dtype(x.dtype), i))
  for (i, slot), x in lay.pleaves:
    needs.append(_Need(slot, names[i], shape_of(x), jnp.dtype(x.dtype), i, sharded=False))
  for name, x in lay.scalars:
    needs.append(_Need(None, name, shape_of(x), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype))
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
      elif shape_of(group[nd.key]) != nd.shape:
        lines.append(f"param_groups[0][{nd.key!r}]: shape {shape_of(group[nd.key])} in the dict, "
                     f"{nd.shape} in the optimizer state")
      continue
    wanted.setdefault(nd.key, set()).add(nd.slot)
    entry = state.get(nd.key)
    if entry is None or nd.slot not in entry:
      lines.append(f"state[{nd.key!r}][{nd.slot!r}]: missing (expected shape {nd.shape})")
    elif shape_of(entry[nd.slot]) != nd.shape:
      lines.append(f"state[{nd.key!r}][{nd.slot!r}]: shape {shape_of(entry[nd.slot])} in the "
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
    raise ValueError(f"Error(s) in {what}:\n" + problems(lines) + f"\nFix: {fix}")


_OSD_FIX = ("load the optimizer state dict of the same model and optimizer (same "
            "parameter names, same optax transformation). Mesh, strategy and layout "
            "may differ.")


def load_named_opt(state, osd, *, what: str, fetch: Optional[Callable] = None,
                    check: bool = True):
  """Builds the state's optax state from a named (FULL/SHARDED) optimizer
  state dict. ``fetch(need)`` supplies values instead of ``osd`` (scatter)."""
  plan = state.plan
  lay = opt_layout(plan, state.opt_state)
  needs = named_needs(plan, lay)
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
  return offload.place_state_tree(plan.memory_kind, lay.unflatten(entries))


def _place_scalar(plan: Plan, v, tmpl):
  shape = shape_of(tmpl)
  dtype = tmpl.dtype if hasattr(tmpl, "dtype") else np.asarray(tmpl).dtype
  if isinstance(tmpl, (jax.Array, jax.ShapeDtypeStruct)):
    sh = getattr(tmpl, "sharding", None)
    if not isinstance(sh, NamedSharding) or sh.mesh != plan.mesh:
      sh = replicated_sharding(plan)
    return place(v, sh, shape=shape, dtype=dtype)
  if isinstance(tmpl, np.ndarray):
    return np.asarray(jax.device_get(v)).astype(dtype)
  return type(tmpl)(np.asarray(jax.device_get(v)).item())


def _load_local_opt(state, osd):
  plan = state.plan
  what = "optim_state_dict_to_load(LOCAL_STATE_DICT)"
  check_local_metadata(plan, osd.get(LOCAL_METADATA_KEY) if isinstance(osd, dict) else None, what)
  lay = opt_layout(plan, state.opt_state)
  shapes = storage_shape_by_key(plan)
  shardings = storage_sharding_by_key(plan)
  needs = []
  for slot, tree in lay.slots:
    for k, x in storage_items(plan, tree).items():
      if not is_masked(x):
        needs.append(_Need(slot, k, shapes[k], x.dtype))
  for name, x in _group_items(lay):
    needs.append(_Need(None, name, shape_of(x), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype))
  _check_osd(osd, needs, what=what, keys_kind="stored array",
             fix="load the local optimizer state dict of a state with the same plan, or "
                 "use FULL_STATE_DICT / SHARDED_STATE_DICT to change mesh, strategy or layout.")
  paths = {(e.param, e.slot): e.path for e in lay.state.layout.entries if e.kind == "param"}
  entries = []
  for kind, name, tmpl in lay.entries:
    if kind == "slot":
      items = {}
      for k, x in storage_items(plan, tmpl).items():
        items[k] = x if is_masked(x) else place(osd["state"][k][name], shardings[k],
                                                  shape=shapes[k], dtype=x.dtype)
      entries.append(storage_from_items(plan, items))
    else:
      key = paths[name] if kind == "pleaf" else name
      entries.append(_place_scalar(plan, osd["param_groups"][0][key], tmpl))
  return offload.place_state_tree(plan.memory_kind, lay.unflatten(entries))


@mesh_lib.own_mesh
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
  require_state(state, fn)
  kind = require_type(state_dict_type, fn)
  if kind is StateDictType.LOCAL_STATE_DICT:
    return _load_local_opt(state, optim_state_dict)
  if isinstance(optim_state_dict, dict) and LOCAL_METADATA_KEY in optim_state_dict:
    raise ValueError(f"{fn}: this optimizer state dict has a {LOCAL_METADATA_KEY!r} entry, so "
                     f"it is a LOCAL_STATE_DICT, but state_dict_type={kind.name}. Fix: pass "
                     "state_dict_type=StateDictType.LOCAL_STATE_DICT.")
  return load_named_opt(state, optim_state_dict, what=f"{fn}({kind.name})")


@mesh_lib.own_mesh
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
  require_state(state, fn)
  return load_named_opt(state, full_optim_state_dict, what=fn)


@mesh_lib.own_mesh
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
  require_state(state, fn)
  if jax.process_count() == 1:
    return load_named_opt(state, full_optim_state_dict, what=fn)
  from jax.experimental import multihost_utils

  plan = state.plan
  lay = opt_layout(plan, state.opt_state)
  needs = named_needs(plan, lay)
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

  return load_named_opt(state, None, what=fn, fetch=fetch, check=False)


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
  plan = require_state(state, fn)
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
