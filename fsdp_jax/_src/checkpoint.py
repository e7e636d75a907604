"""Checkpointing of the whole train state with orbax-checkpoint.

A checkpoint holds the train state in a **canonical, layout-independent
form**: one array per original parameter (and per optimizer slot of each
parameter) with its global shape, written from and read into sharded arrays
(tensorstore/OCDBT); the step, the optimizer's other leaves and every other
data field of the state (model state, RNG keys, ...) as they are; and a JSON
description of all of it. Any plan can restore it: a different device count,
strategy (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, ...) or layout
(flat or original parameters), with or without CPU offload (the params and
optimizer state come back in ``pinned_host`` memory when the target's config
offloads them). Each device reads only its slice of each
parameter, and the conversion into the target's stored layout runs unit by
unit, so the full model is never assembled on one device (a parameter none of
whose dimensions divides the shard count is read whole by every device).

Safety: orbax writes a step into a temporary directory and renames it when
every file is written, so a save interrupted by a crash never damages the
previous checkpoints (the half-written directory is ignored and cleaned up by
the next :class:`CheckpointManager`). Restoring validates the saved tree
against the target first and names every differing path and shape. Nothing is
unpickled: arrays are read by tensorstore, descriptions are JSON.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from fsdp_jax._src import iterator_state
from fsdp_jax._src import mesh as mesh_lib
from fsdp_jax._src import offload
from fsdp_jax._src.plan import Plan
from fsdp_jax._src.state import ShardedTrainState
# The state dicts' interface for checkpoints: names, layouts, conversions.
from fsdp_jax._src.naming import ROOT, path_name
from fsdp_jax._src.state_dicts.convert import (
    OPT_STATE,
    PARAMS,
    canonical_sharding,
    data_fields,
    dtype_name,
    is_key_dtype,
    leaves_to_storage,
    opt_layout,
    param_names,
    problems,
    require_state,
    storage_to_leaves)
from fsdp_jax._src.state_dicts.optim import load_named_opt, named_needs, optim_named


__all__ = ["CheckpointError", "CheckpointManager", "export_params", "import_params"]

FORMAT = "fsdp_jax.train_state"
PARAMS_FORMAT = "fsdp_jax.params"
VERSION = 1
STATE_ITEM = "state"
META_ITEM = "meta"
DATA_ITEM = "data_iterator"
_MAX_LINES = 25


class CheckpointError(Exception):
  """A checkpoint on disk cannot be read: incomplete, damaged, or not written
  by fsdp_jax. The message names the directory, the step and the fix.

  Example:
    >>> import pathlib, shutil, tempfile, jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> directory = pathlib.Path(tempfile.mkdtemp())
    >>> manager = fsdp_jax.CheckpointManager(directory)
    >>> manager.save(state)
    True
    >>> manager.wait_until_finished()
    >>> shutil.rmtree(directory / "0" / "meta")  # damage step 0
    >>> try:
    ...   manager.restore(state)
    ... except fsdp_jax.CheckpointError as e:
    ...   print(str(e)[:60])  # doctest: +ELLIPSIS
    Fix: delete ... and save again. Cannot read t...
    >>> manager.close(); shutil.rmtree(directory)
  """


# ---------------------------------------------------------------------------
# Describing a train state (JSON) and building the canonical tree


def _leaf_desc(x) -> dict:
  dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
  out = {"shape": [int(d) for d in np.shape(x)], "dtype": dtype_name(dtype)}
  if is_key_dtype(dtype):
    out["prng"] = True
  return out


def _other_fields(state) -> list[str]:
  """Data fields other than params/opt_state that hold at least one leaf (an
  empty field, e.g. ``model_state=None``, is neither saved nor compared, so
  states that differ only in unused fields restore into each other)."""
  return [f for f in data_fields(state) if f not in (PARAMS, OPT_STATE)
          and jax.tree_util.tree_leaves(getattr(state, f))]


def _field_leaves(value):
  """``(kind, [(name, leaf)], treedef)`` of a data field."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(value)
  if jax.tree_util.treedef_is_leaf(treedef) and len(flat) == 1:
    return "leaf", [(ROOT, flat[0][1])], treedef
  return "tree", [(path_name(p), x) for p, x in flat], treedef


def describe(state) -> dict:
  """A JSON description of ``state``'s canonical form (names, shapes, dtypes).

  Works on concrete states and on abstract ones (``jax.eval_shape`` of
  ``init_train_state``)."""
  plan = state.plan
  names = param_names(plan)
  params = {}
  for i in _saved_leaves(plan):
    leaf = plan.leaves[i]
    params[names[i]] = {"shape": list(leaf.shape), "dtype": dtype_name(leaf.dtype)}
  lay = opt_layout(plan, state.opt_state)
  opt_state: dict = {}
  groups: dict = {}
  for nd in named_needs(plan, lay):
    desc = {"shape": list(nd.shape), "dtype": dtype_name(nd.dtype)}
    if nd.slot is None:
      groups[nd.key] = desc
    else:
      opt_state.setdefault(nd.key, {})[nd.slot] = desc
  fields = {}
  for f in _other_fields(state):
    kind, leaves, _ = _field_leaves(getattr(state, f))
    fields[f] = {"kind": kind, "leaves": {n: _leaf_desc(x) for n, x in leaves}}
  out = {"params": params, "opt_state": {"state": opt_state, "param_groups": groups},
         "fields": fields}
  lora = plan.config.lora
  if lora is not None:
    out["lora"] = {"targets": list(plan.lora_targets), "rank": lora.rank, "alpha": lora.alpha,
                   "trainable": list(lora.trainable)}
  return out


def _saved_leaves(plan: Plan) -> list[int]:
  """The parameters a checkpoint holds: all of them, or with LoRA the
  trainable ones (the adapters and ``LoRA(trainable=...)``); the frozen base
  is the pretrained model's, and stays where the target state has it."""
  if plan.config.lora is None:
    return list(range(len(plan.leaves)))
  return [l.index for l in plan.leaves if not l.frozen]


def _plan_summary(plan: Plan) -> dict:
  return {"sharding_strategy": plan.config.sharding_strategy.name,
          "layout": "original" if plan.use_orig_params else "flat",
          "mesh": {str(a): int(s) for a, s in plan.mesh.shape.items()},
          "process_count": jax.process_count()}


def _copy(x):
  """A private copy of a leaf, so a donated train state cannot be overwritten
  while an async save still reads it."""
  if isinstance(x, jax.Array):
    if is_key_dtype(x.dtype):
      return jax.random.key_data(x)
    default = offload.default_memory_kind(x.sharding)
    if getattr(x.sharding, "memory_kind", None) not in (None, default):
      # Offloaded (pinned_host) leaves: the move to device memory is the copy.
      return jax.device_put(x, x.sharding.with_memory_kind(default))
    return jnp.copy(x)
  return np.array(x)


def checkpoint_tree(state: ShardedTrainState):
  """``(tree, meta)``: the canonical arrays orbax writes, and their JSON
  description."""
  plan = state.plan
  names = param_names(plan)
  leaves = storage_to_leaves(plan, state.params)
  osd = optim_named(state, replicated=False)
  group = {k: _copy(v) for k, v in osd["param_groups"][0].items() if k != "params"}
  tree: dict = {
      PARAMS: {names[i]: leaves[i] for i in _saved_leaves(plan)},
      OPT_STATE: {"state": osd["state"], "param_groups": [group]},
  }
  meta = describe(state)
  for f in _other_fields(state):
    kind, items, _ = _field_leaves(getattr(state, f))
    for n, x in items:
      if isinstance(x, jax.Array) and is_key_dtype(x.dtype):
        meta["fields"][f]["leaves"][n]["prng_impl"] = str(jax.random.key_impl(x))
    values = {n: _copy(x) for n, x in items}
    tree[f] = values[ROOT] if kind == "leaf" else values
  meta = {"format": FORMAT, "version": VERSION, "step": int(jax.device_get(state.step)),
          "saved_with": _plan_summary(plan), **meta}
  return tree, meta


def _diff(saved: dict, target: dict) -> list[str]:
  """The differences between two :func:`describe` s, one line each. An entry
  is named by the train state field and its key in the checkpoint, which is
  its state-dict name: ``params['params.Dense_0.bias']`` (a Flax parameter,
  whose dotted name starts with its collection),
  ``opt_state.state['w']['0.mu']``, ``opt_state.param_groups[0]['0.count']``,
  ``model_state['batch_stats.BatchNorm_0.mean']``; a field that is one leaf
  by its name alone (``rng``)."""
  lines = []

  def shape_of(d):
    return tuple(d["shape"])

  def cmp(name_of, a: dict, b: dict, leaf_fn, hint=lambda k, where: ""):
    for k in list(a) + [k for k in b if k not in a]:
      name = name_of(k)
      if k not in b:
        lines.append(f"{name}: in the checkpoint {leaf_fn(a[k])}, not in the target"
                     + hint(k, "the target"))
      elif k not in a:
        lines.append(f"{name}: in the target {leaf_fn(b[k])}, not in the checkpoint"
                     + hint(k, "the saved run"))
      else:
        yield name, a[k], b[k]

  def desc(d):
    if "shape" in d:
      return f"{shape_of(d)} {d['dtype']}"
    return "{" + ", ".join(f"{k}: {shape_of(v)}" for k, v in list(d.items())[:4]) + "}"

  def leaf_cmp(name, a, b):
    if shape_of(a) != shape_of(b) or bool(a.get("prng")) != bool(b.get("prng")):
      lines.append(f"{name}: checkpoint {desc(a)}, target {desc(b)}")

  if saved.get("lora") != target.get("lora"):
    lines.append(f"lora: checkpoint {saved.get('lora')}, target {target.get('lora')} (a LoRA "
                 "checkpoint holds the adapters and trainable leaves only; restore it into a "
                 "state with the same FSDPConfig(lora=...), built from the same base model)")
  for name, a, b in cmp(lambda k: f"{PARAMS}[{k!r}]", saved["params"], target["params"], desc):
    leaf_cmp(name, a, b)
  so, to = saved["opt_state"], target["opt_state"]
  for name, a, b in cmp(lambda k: f"{OPT_STATE}.state[{k!r}]", so["state"], to["state"], desc):
    for n2, a2, b2 in cmp(lambda k, p=name: f"{p}[{k!r}]", a, b, desc):
      leaf_cmp(n2, a2, b2)
  for name, a, b in cmp(lambda k: f"{OPT_STATE}.param_groups[0][{k!r}]", so["param_groups"],
                        to["param_groups"], desc):
    leaf_cmp(name, a, b)
  fdesc = lambda d: f"({len(d['leaves'])} leaves)"
  hints = {"rng": "init_train_state(..., rng=key)",
           "model_state": "init_train_state(..., model_state=...) or an init_fn whose model "
                          "returns non-parameter collections"}
  field_hint = lambda f, where: f" (build {where} with {hints[f]} too)" if f in hints else ""
  for field, a, b in cmp(lambda k: k, saved["fields"], target["fields"], fdesc, field_hint):
    leaf_name = lambda k, f=field: f if k == ROOT else f"{f}[{k!r}]"
    for n2, a2, b2 in cmp(leaf_name, a["leaves"], b["leaves"], desc):
      leaf_cmp(n2, a2, b2)
  return lines


def _target_sharding(plan: Plan, x):
  sh = getattr(x, "sharding", None)
  if isinstance(sh, NamedSharding) and sh.mesh == plan.mesh:
    return sh.with_memory_kind(plan.mesh.devices.flat[0].default_memory().kind)
  return NamedSharding(plan.mesh, P())


def _abstract_tree(target, meta: dict):
  """ShapeDtypeStructs (with shardings on the target's mesh) of the canonical
  tree, for orbax to read each device's slice into."""
  plan = target.plan
  names = param_names(plan)
  params = {names[i]: jax.ShapeDtypeStruct(plan.leaves[i].shape, plan.leaves[i].dtype,
                                           sharding=canonical_sharding(plan, plan.leaves[i]))
            for i in _saved_leaves(plan)}
  lay = opt_layout(plan, target.opt_state)
  state: dict = {}
  group: dict = {}
  scalars = dict(lay.scalars)
  for nd in named_needs(plan, lay):
    if nd.slot is None:
      group[nd.key] = jax.ShapeDtypeStruct(nd.shape, nd.dtype,
                                           sharding=_target_sharding(plan, scalars[nd.key]))
    elif nd.sharded:
      leaf = plan.leaves[nd.index]
      state.setdefault(nd.key, {})[nd.slot] = jax.ShapeDtypeStruct(
          leaf.shape, nd.dtype, sharding=canonical_sharding(plan, leaf))
    else:  # per-parameter state of another shape: replicated
      state.setdefault(nd.key, {})[nd.slot] = jax.ShapeDtypeStruct(
          nd.shape, nd.dtype, sharding=NamedSharding(plan.mesh, P()))
  tree = {PARAMS: params, OPT_STATE: {"state": state, "param_groups": [group]}}
  for f in _other_fields(target):
    kind, items, _ = _field_leaves(getattr(target, f))
    values = {}
    for n, x in items:
      dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
      if is_key_dtype(dtype):
        s = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(np.shape(x), dtype))
        values[n] = jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(plan.mesh, P()))
      else:
        values[n] = jax.ShapeDtypeStruct(np.shape(x), dtype, sharding=_target_sharding(plan, x))
    tree[f] = values[ROOT] if kind == "leaf" else values
  return tree


def _field_value(x, restored, leaf_meta: dict, plan: Plan):
  if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
    if is_key_dtype(x.dtype):
      impl = leaf_meta.get("prng_impl")
      return jax.random.wrap_key_data(restored, impl=impl) if impl else \
          jax.random.wrap_key_data(restored)
    return restored
  host = np.asarray(jax.device_get(restored))
  if isinstance(x, np.ndarray):
    return host
  if isinstance(x, np.generic):
    return host.astype(x.dtype)[()]
  return type(x)(host.item())


def from_checkpoint_tree(target: ShardedTrainState, restored: dict, meta: dict):
  """Builds the target's train state from the restored canonical tree."""
  plan = target.plan
  names = param_names(plan)
  leaves = {i: restored[PARAMS][names[i]] for i in _saved_leaves(plan)}
  if len(leaves) < len(plan.leaves):  # LoRA: the frozen base is the target's own
    current = storage_to_leaves(plan, target.params)
    leaves.update({i: x for i, x in current.items() if i not in leaves})
  params = offload.place_state_tree(plan.memory_kind,
                                    leaves_to_storage(plan, leaves, target.params))
  ro = restored[OPT_STATE]
  osd = {"state": ro["state"], "param_groups": [dict(ro["param_groups"][0])]}
  opt_state = load_named_opt(target, osd, what="restore", check=False)
  changes = {PARAMS: params, OPT_STATE: opt_state}
  for f in _other_fields(target):
    kind, items, treedef = _field_leaves(getattr(target, f))
    saved = restored[f] if kind == "tree" else {ROOT: restored[f]}
    fmeta = meta["fields"][f]["leaves"]
    values = [_field_value(x, saved[n], fmeta.get(n, {}), plan) for n, x in items]
    changes[f] = treedef.unflatten(values)
  return dataclasses.replace(target, **changes)


# ---------------------------------------------------------------------------
# The manager


class CheckpointManager:
  """Saves and restores :class:`~fsdp_jax.ShardedTrainState` s with orbax's
  ``CheckpointManager``: async saves, a retention policy, and restore onto any
  mesh, strategy and layout.

  Args:
    directory: the root directory; each step is a sub-directory.
    max_to_keep: keep the newest ``max_to_keep`` checkpoints (None: all).
    keep_period: also keep every step divisible by ``keep_period``.
    save_interval_steps: :meth:`save` only writes steps divisible by this
      (unless ``force=True``); as in orbax, the first save into an empty
      directory is always written.
    enable_async_checkpointing: :meth:`save` returns once the arrays are
      copied off the devices and writes in a background thread (default).
    read_only: only restore: never save, delete or clean up (for jobs that
      read a directory another job writes, e.g. evaluation).
    create_parents: a writable manager creates ``directory`` itself but, by
      default, not its missing parents, so that a mistyped path fails here
      instead of silently growing a new directory tree; pass True to create
      them too (``mkdir -p``).
    options: a full ``orbax.checkpoint.CheckpointManagerOptions``; overrides
      the options above.

  Raises:
    FileNotFoundError: ``directory``'s parent does not exist (and
      ``create_parents`` is False).
    NotADirectoryError: ``directory`` or one of its parents is a file.

  Example:
    >>> import tempfile, jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from fsdp_jax import CheckpointManager
    >>> def build(n, **cfg):
    ...   mesh = fsdp_jax.make_mesh(shard=n, devices=jax.devices()[:n])
    ...   return fsdp_jax.init_train_state(params={"w": jnp.arange(6.0)},
    ...       optimizer=optax.adam(1e-3), mesh=mesh, config=fsdp_jax.FSDPConfig(**cfg))
    >>> with CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as mngr:
    ...   mngr.save(build(4))
    ...   mngr.wait_until_finished()
    ...   target = jax.eval_shape(lambda: build(3, use_orig_params=True))
    ...   restored = mngr.restore(target)   # another mesh and layout
    True
    >>> fsdp_jax.summon_full_params(restored)["w"].tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
  """

  def __init__(self, directory, *, max_to_keep: Optional[int] = None,
               keep_period: Optional[int] = None, save_interval_steps: int = 1,
               enable_async_checkpointing: bool = True, read_only: bool = False,
               create_parents: bool = False,
               options: Optional[ocp.CheckpointManagerOptions] = None):
    self.directory = os.path.abspath(os.fspath(directory))
    if not read_only and (options is None or (options.create and not options.read_only)):
      _check_creatable(self.directory, create_parents)
    if options is None:
      if read_only:
        options = ocp.CheckpointManagerOptions(read_only=True, create=False,
                                               save_root_metadata=False)
      else:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, keep_period=keep_period,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=enable_async_checkpointing,
            cleanup_tmp_directories=True, create=True)
    self.read_only = bool(options.read_only)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  # -- bookkeeping ----------------------------------------------------------
  def all_steps(self) -> list[int]:
    """The finished checkpoints' steps, oldest first."""
    return sorted(self.manager.all_steps())

  def latest_step(self) -> Optional[int]:
    """The newest finished step, or None."""
    return self.manager.latest_step()

  def delete(self, step: int) -> None:
    """Deletes the saved checkpoint of ``step`` (orbax's
    ``CheckpointManager.delete``), e.g. to save that step again.

    Raises:
      ValueError: no finished checkpoint of ``step`` is in the directory, or
        the manager is read-only (orbax would skip the deletion silently).

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, optax, fsdp_jax
      >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
      >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones(4)},
      ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
      >>> with fsdp_jax.CheckpointManager(tempfile.mkdtemp()) as manager:
      ...   _ = manager.save(state, force=True)
      ...   manager.wait_until_finished()
      ...   manager.delete(0)
      ...   manager.all_steps()
      []
    """
    if self.read_only:
      raise ValueError(
          f"CheckpointManager.delete: {self.directory} was opened read_only=True, so step "
          f"{step} is not deleted. Fix: open it with a CheckpointManager that is not read-only.")
    self.manager.wait_until_finished()
    if int(step) not in self.manager.all_steps():
      raise ValueError(
          f"CheckpointManager.delete: no checkpoint of step {step} in {self.directory} "
          f"(saved steps: {self.all_steps()}).")
    self.manager.delete(int(step))

  def wait_until_finished(self) -> None:
    """Blocks until a pending async save is written and committed."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager's resources."""
    self.manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  # -- save -------------------------------------------------------------------
  @mesh_lib.own_mesh
  def save(self, state: ShardedTrainState, *, force: bool = False,
           metrics: Optional[dict] = None, data_state: Optional[dict] = None,
           data_iterator=None) -> bool:
    """Saves ``state`` as step ``int(state.step)``; returns whether it did.

    Honors ``save_interval_steps`` unless ``force``. With async
    checkpointing it returns once the canonical arrays (fresh copies, so the
    train step may donate ``state`` right away) are off the devices; call
    :meth:`wait_until_finished` to block. ``metrics`` go to orbax's
    ``best_fn`` retention, if configured.

    ``data_state`` is the input pipeline's position (a JSON-serialisable
    dict, e.g. ``{"epoch": 3, "batch": 1200}``), saved in the same commit as
    the arrays and read back with :meth:`data_state`, so a resumed run feeds
    the batches the uninterrupted run would have. Process 0 writes it: pass
    the same value on every process (a global position, from which each
    process derives its own part).

    ``data_iterator`` is an iterator with ``get_state()`` / ``set_state()``
    (``fsdp_jax.data.batches(...)``, or grain's): each process writes its
    own state (``data_iterator/process_<i>-of-<n>.json``, grain's layout) in
    the same commit, taken when ``save`` is called; :meth:`restore` with
    ``data_iterator=`` sets it back.
    """
    require_state(state, "CheckpointManager.save")
    if data_state is not None:
      data_state = _check_data_state(data_state)
    step = int(jax.device_get(state.step))
    if not force and not self.manager.should_save(step):
      return False
    tree, meta = checkpoint_tree(state)
    if data_state is not None:
      meta["data_state"] = data_state
    items = {}
    if data_iterator is not None:
      kind, text = iterator_state.capture(data_iterator)
      meta[DATA_ITEM] = {"kind": kind, "process_count": jax.process_count()}
      items[DATA_ITEM] = iterator_state.IteratorStateSave(text)
    if step in self.manager.all_steps():
      raise ValueError(
          f"CheckpointManager.save: step {step} is already saved in {self.directory}. "
          "Fix: train further before saving again, or delete it first with "
          f"manager.delete({step}).")
    args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(tree),
                                 META_ITEM: ocp.args.JsonSave(meta), **items})
    return bool(self.manager.save(step, args=args, force=force, metrics=metrics))

  # -- restore ------------------------------------------------------------------
  def _step_dir(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def _choose_step(self, step: Optional[int]) -> int:
    self.manager.reload()
    steps = self.all_steps()
    if step is None:
      if not steps:
        pending = [n for n in (os.listdir(self.directory) if os.path.isdir(self.directory) else [])
                   if "tmp" in n]
        raise FileNotFoundError(
            f"No finished checkpoint in {self.directory}"
            + (f" (incomplete saves, ignored: {sorted(pending)})" if pending else "")
            + ". Fix: pass the directory a CheckpointManager saved into, and call "
            "wait_until_finished() after an async save.")
      return steps[-1]
    if int(step) not in steps:
      raise FileNotFoundError(
          f"Step {step} is not a finished checkpoint in {self.directory}; finished steps: "
          f"{steps}. Fix: pass one of them (or step=None for the latest).")
    return int(step)

  def metadata(self, step: Optional[int] = None) -> dict:
    """The JSON description saved with ``step`` (default: the latest): format,
    the saving plan (``saved_with``), and every saved path's shape and dtype."""
    self.wait_until_finished()
    step = self._choose_step(step)
    return self._read_meta(step)

  def data_state(self, step: Optional[int] = None) -> Optional[dict]:
    """The ``data_state`` saved with ``step`` (default: the latest), or None
    if that save had none.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, optax, fsdp_jax
      >>> from fsdp_jax import CheckpointManager
      >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
      >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones(4)},
      ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
      >>> with CheckpointManager(tempfile.mkdtemp()) as mngr:
      ...   mngr.save(state, data_state={"epoch": 0, "batch": 17})
      ...   mngr.data_state()
      True
      {'epoch': 0, 'batch': 17}
    """
    return self.metadata(step).get("data_state")

  def _read_meta(self, step: int) -> dict:
    where = f"step {step} of the checkpoint at {self.directory}"
    fix = self._fix(step)
    try:
      meta = self.manager.restore(
          step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
    except Exception as e:  # orbax raises many types for damaged directories
      raise CheckpointError(
          f"{fix} Cannot read the description ({META_ITEM!r} item) of {where}: the "
          "checkpoint is damaged or was not written by "
          f"fsdp_jax.CheckpointManager.{_details(e)}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
      raise CheckpointError(
          f"{fix} Not an fsdp_jax train-state checkpoint: {where} has a {META_ITEM!r} "
          "item of format "
          f"{meta.get('format') if isinstance(meta, dict) else type(meta).__name__!r}, "
          f"expected {FORMAT!r}.")
    if meta.get("version", 0) > VERSION:
      raise CheckpointError(
          f"Fix: upgrade fsdp_jax. Written by a newer fsdp_jax: {where} has format "
          f"version {meta['version']}, this fsdp_jax reads up to {VERSION}.")
    for key in ("params", "opt_state", "fields"):
      if key not in meta:
        raise CheckpointError(f"{fix} The description of {where} has no {key!r} entry.")
    return meta

  def _fix(self, step: int) -> str:
    others = [s for s in self.all_steps() if s != step]
    if others:
      return (f"Fix: restore another step with restore(target, step=S) (finished steps: "
              f"{others}), or delete {self._step_dir(step)}.")
    return f"Fix: delete {self._step_dir(step)} and save again."

  @mesh_lib.own_mesh
  def restore(self, target, *, step: Optional[int] = None,
              data_iterator=None) -> ShardedTrainState:
    """Restores step ``step`` (default: the latest) into ``target``'s plan.

    ``target`` is a :class:`~fsdp_jax.ShardedTrainState` built for the mesh,
    strategy, layout and optimizer to restore onto, or an abstract one
    (``jax.eval_shape(lambda: fsdp_jax.init_train_state(...))``, which
    allocates nothing). With ``data_iterator`` (saved with ``save(...,
    data_iterator=)``), this process's iterator state is set back into it
    once the arrays are read, so the next batch is the one the
    uninterrupted run would have had. Only its plan and tree structure are used (with
    ``FSDPConfig(lora=...)`` its frozen base too: the checkpoint holds the
    adapters, the trainable leaves and their optimizer state only). The
    parameter tree and optimizer must match the saved ones (dtypes may differ
    and are cast); otherwise a ``ValueError`` lists every differing path.

    Raises:
      FileNotFoundError: no such finished step.
      CheckpointError: the step's files are damaged or not fsdp_jax's.
      ValueError: the saved tree does not match ``target``.
    """
    require_state(target, "CheckpointManager.restore")
    if target.plan.config.lora is not None and any(
        isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(target.params)):
      raise ValueError(
          "CheckpointManager.restore: a LoRA checkpoint holds the adapters and trainable "
          "leaves, not the frozen base, so the target must be a real train state holding "
          "the base (e.g. init_train_state(init_fn=..., pretrained=...)), not an abstract "
          "one.")
    self.wait_until_finished()
    step = self._choose_step(step)
    meta = self._read_meta(step)
    plan = target.plan
    lines = _diff(meta, describe(target))
    if lines:
      saved = meta.get("saved_with", {})
      raise ValueError(
          f"The checkpoint at {self.directory} (step {step}) does not match the target "
          f"train state ({len(lines)} difference(s), each named by the train state field "
          f"and the entry's keys as in state_dict() / optim_state_dict()):\n"
          + problems(lines) +
          f"\nIt was saved with {saved.get('sharding_strategy')}, {saved.get('layout')} "
          f"parameters, mesh {saved.get('mesh')}; the target is "
          f"{plan.config.sharding_strategy.name}, "
          f"{'original' if plan.use_orig_params else 'flat'} parameters, mesh "
          f"{dict(plan.mesh.shape)}. Mesh, strategy and layout may differ; the parameter "
          "tree, the optimizer and the other state fields may not. Fix: build the target "
          "with the same model and optimizer as the saved run, or load only the parameters "
          "with import_params / load_state_dict.")
    abstract = _abstract_tree(target, meta)
    items = {STATE_ITEM: ocp.args.StandardRestore(abstract)}
    if data_iterator is not None:
      saved = meta.get(DATA_ITEM)
      if saved is None:
        raise ValueError(
            f"CheckpointManager.restore: step {step} of {self.directory} was saved without "
            "data_iterator=, so there is no iterator state to restore. Fix: restore without "
            "data_iterator= (and position the data yourself, e.g. with data_state()), or "
            "save with save(state, data_iterator=it).")
      if saved["process_count"] != jax.process_count():
        raise ValueError(
            f"CheckpointManager.restore: step {step} of {self.directory} holds the iterator "
            f"states of {saved['process_count']} process(es); this job has "
            f"{jax.process_count()}, and each process's state is its own share of the data. "
            f"Fix: resume with {saved['process_count']} process(es), or restore without "
            "data_iterator= and start the data afresh.")
      items[DATA_ITEM] = iterator_state.IteratorStateRestore()
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(**items))
      if data_iterator is not None:
        text = restored[DATA_ITEM]
      restored = restored[STATE_ITEM]
    except Exception as e:
      raise CheckpointError(
          f"{self._fix(step)} Cannot read the arrays of step {step} of the checkpoint at "
          f"{self.directory}: the step's files are damaged or incomplete."
          f"{_details(e)}") from e
    out = from_checkpoint_tree(target, restored, meta)
    if data_iterator is not None:
      iterator_state.restore_into(data_iterator, meta[DATA_ITEM]["kind"], text)
    return out


def _check_data_state(data_state) -> dict:
  """A JSON round trip of ``data_state`` (what :meth:`data_state` returns)."""
  import json
  if not isinstance(data_state, dict):
    raise TypeError(
        f"Fix: pass data_state as a dict, e.g. {{'position': 1200}}: got a "
        f"{type(data_state).__name__}.")
  try:
    return json.loads(json.dumps(data_state, allow_nan=False))
  except (TypeError, ValueError) as e:
    raise TypeError(
        "Fix: give data_state plain JSON values (int, float, str, bool, None, lists, "
        "dicts with str keys; e.g. int(x) for a NumPy or JAX integer): "
        f"{e}.") from None


def _check_creatable(directory: str, create_parents: bool) -> None:
  """A writable manager makes ``directory`` but, unless asked, not its
  parents: a mistyped path must not grow a new tree."""
  if os.path.isdir(directory):
    return
  # Another process of the job may make the directory between these checks:
  # only a path that exists and is still no directory is a file.
  if os.path.exists(directory) and not os.path.isdir(directory):
    raise NotADirectoryError(
        f"Fix: pass a directory path (or a new one) to CheckpointManager: "
        f"{directory} exists and is a file.")
  parent = os.path.dirname(directory)
  ancestor = parent
  while not os.path.exists(ancestor):
    ancestor = os.path.dirname(ancestor)
  if not os.path.isdir(ancestor):
    raise NotADirectoryError(
        f"Fix: correct the checkpoint path {directory}: its ancestor {ancestor} is a "
        "file, not a directory.")
  if ancestor != parent and not create_parents:
    missing = os.path.relpath(parent, ancestor)
    raise FileNotFoundError(
        f"Fix: check the path for a typo, create its parent first "
        f"(os.makedirs({parent!r})), or pass create_parents=True. CheckpointManager "
        f"creates {directory} itself but not its missing parents: {parent} does not "
        f"exist (the nearest existing directory is {ancestor}, so {missing!r} would "
        "be created too).")


def _short(e: BaseException, limit: int = 400) -> str:
  text = " ".join(str(e).split())
  return text if len(text) <= limit else text[:limit] + " ..."


def _details(e: BaseException) -> str:
  """The low-level error (e.g. a TensorStore spec), after what to do."""
  return f"\nDetails: {type(e).__name__}: {_short(e)}"


# ---------------------------------------------------------------------------
# Plain parameter trees for inference


def _plain(tree) -> bool:
  if isinstance(tree, dict):
    return type(tree) is dict and all(isinstance(k, str) for k in tree) and \
        all(_plain(v) for v in tree.values())
  if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
    return all(_plain(v) for v in tree)
  return hasattr(tree, "shape")


def _nested(names, values) -> dict:
  out: dict = {}
  for name, v in zip(names, values):
    node = out
    parts = name.split(".")
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = v
  return out


@mesh_lib.own_mesh
def export_params(state: ShardedTrainState, directory, *, force: bool = False) -> str:
  """Writes the full, unsharded parameter tree for inference; returns the
  directory.

  The arrays are written from their sharded canonical form (no device
  gathers the model). The tree keeps its structure when it is made of dicts,
  lists and tuples (tuples come back as lists), and otherwise becomes nested
  dicts of the dotted names. The result is a plain orbax checkpoint: read it
  with :func:`import_params`, or without fsdp_jax with
  ``orbax.checkpoint.StandardCheckpointer().restore(directory + "/params")``.

  Example:
    >>> import os, tempfile, jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from fsdp_jax import export_params, import_params
    >>> mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
    >>> params = {"layers": [{"w": jnp.ones((4, 2))}, {"w": jnp.zeros((2, 1))}]}
    >>> state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1),
    ...     mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> path = export_params(state, os.path.join(tempfile.mkdtemp(), "export"))
    >>> tree = import_params(path)          # host numpy arrays
    >>> jax.tree.map(lambda x: x.shape, tree)
    {'layers': [{'w': (4, 2)}, {'w': (2, 1)}]}
  """
  plan = require_state(state, "export_params")
  names = param_names(plan)
  leaves = storage_to_leaves(plan, state.params)
  values = [leaves[i] for i in range(len(names))]
  tree = jax.tree_util.tree_unflatten(plan.treedef, values)
  if not _plain(tree):
    tree = _nested(names, values)
  meta = {"format": PARAMS_FORMAT, "version": VERSION,
          "params": {n: {"shape": list(l.shape), "dtype": dtype_name(l.dtype)}
                     for n, l in zip(names, plan.leaves)}}
  path = os.path.abspath(os.fspath(directory))
  if os.path.exists(path) and not force:
    raise FileExistsError(f"export_params: {path} already exists. Fix: pass a new directory "
                          "or force=True to overwrite it.")
  with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
    ckptr.save(path, args=ocp.args.Composite(params=ocp.args.StandardSave(tree),
                                             meta=ocp.args.JsonSave(meta)), force=force)
  return path


@mesh_lib.own_mesh
def import_params(directory, *, sharding: Optional[jax.sharding.Sharding] = None):
  """Reads a parameter tree written by :func:`export_params`.

  Args:
    directory: the exported directory.
    sharding: None (default) returns host numpy arrays; a
      ``jax.sharding.Sharding`` (e.g. ``SingleDeviceSharding(jax.devices()[0])``
      or a replicated ``NamedSharding``) places every leaf with it.

  Returns the tree; pass it to ``fsdp_jax.init_train_state(params=...)`` or
  to a model's ``apply``.

  Example:
    >>> import os, tempfile, jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from fsdp_jax import export_params, import_params
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.arange(4.0)},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> path = export_params(state, os.path.join(tempfile.mkdtemp(), "export"))
    >>> one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> import_params(path, sharding=one_device)["w"].tolist()
    [0.0, 1.0, 2.0, 3.0]
  """
  path = os.path.abspath(os.fspath(directory))
  item = os.path.join(path, "params")
  if not os.path.isdir(item):
    raise FileNotFoundError(
        f"import_params: {path} is not a parameter export (no 'params' directory). Fix: "
        "pass the directory export_params wrote.")
  try:
    with ocp.PyTreeCheckpointer() as ckptr:
      md = ckptr.metadata(item)
      tree_md = md.item_metadata.tree if hasattr(md, "item_metadata") else md.tree
      if sharding is None:
        args = jax.tree.map(lambda m: ocp.RestoreArgs(restore_type=np.ndarray, dtype=m.dtype),
                            tree_md)
        return ckptr.restore(item, args=ocp.args.PyTreeRestore(restore_args=args))
      abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype,
                                                             sharding=sharding), tree_md)
      restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
      return ckptr.restore(item, args=ocp.args.PyTreeRestore(item=abstract,
                                                             restore_args=restore_args))
  except (FileNotFoundError, TypeError):
    raise
  except Exception as e:
    raise CheckpointError(f"Fix: export the parameters again (export_params). "
                          f"import_params cannot read {item}: the export is damaged or "
                          f"incomplete.{_details(e)}") from e
