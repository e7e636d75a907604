"""Saving parameters in Hugging Face's layout, from the shards: one
``model.safetensors``, or ``model-0000k-of-0000N.safetensors`` files and
``model.safetensors.index.json``. Files are filled in parameter order up to
``max_shard_size``; each is written by one process, from the full values of
its tensors only, so no host holds more than one file's worth (and one FSDP
unit) of the model. The directory appears whole or not at all.

A LoRA state (``FSDPConfig(lora=...)``) is saved merged: each target kernel
as ``decode(base) + (alpha / r) * A @ B``, under the user's parameter
names."""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import re
import shutil
import uuid
from typing import Optional


import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax._src import mesh as mesh_lib
from fsdp_jax._src import layout
from fsdp_jax._src import lora as lora_lib
from fsdp_jax._src.pretrained import files
from fsdp_jax._src.pretrained.loading import adapted_leaves, host_device
from fsdp_jax._src.pretrained.weight_map import Chain, WeightMap
from fsdp_jax._src.state import ShardedTrainState
from fsdp_jax._src.state_dicts import convert

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)?\s*$", re.I)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size) -> int:
  """``"5GB"`` -> 5_000_000_000 (``"5GiB"`` -> 5 * 2**30; an int as it is)."""
  if isinstance(size, (int, np.integer)):
    return int(size)
  m = _SIZE.match(str(size))
  if not m:
    raise ValueError(f"max_shard_size={size!r}: use bytes or a size such as '5GB' or '500MiB'.")
  return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def find_match(weight_map: WeightMap, name: str, short: bool):
  """``(rule, placeholder values, k)`` mapping parameter ``name`` (its
  ``k``-th parameter pattern; Flax linen's ``params.`` prefix may be left
  out of the patterns), or None."""
  found = weight_map.param_match(name)
  if found is None and short and name.startswith("params."):
    found = weight_map.param_match(name[len("params."):])
  return found


def find_rule(weight_map: WeightMap, name: str, short: bool):
  """``(rule, placeholder values)`` mapping parameter ``name``, or None."""
  found = find_match(weight_map, name, short)
  return None if found is None else found[:2]


@dataclasses.dataclass
class Piece:
  """What one parameter (one layer of it) gives a checkpoint tensor: the
  parameter through the inverse of ``chain`` (``shape``: the result's),
  whole, or ``select`` = ``(axis, start, stop)`` of it (a :func:`concat`
  rule's parameter cut back into its tensors)."""

  leaf: int
  layer: Optional[int]
  chain: Chain
  shape: tuple
  select: Optional[tuple] = None


@dataclasses.dataclass
class Entry:
  """One checkpoint tensor to write: its ``pieces`` (one, or a
  :func:`split` rule's parts joined along ``axis``)."""

  name: str
  shape: tuple
  dtype: np.dtype
  pieces: list
  axis: Optional[int] = None

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

  def value(self, leaves: dict, adapted: dict, scaling) -> np.ndarray:
    """The tensor, from the host values of its parameters."""
    out = []
    for p in self.pieces:
      if p.leaf in adapted:
        v = merged(adapted[p.leaf], leaves, scaling, p.layer)
      else:
        v = leaves[p.leaf] if p.layer is None else leaves[p.leaf][p.layer]
      v = p.chain.to_checkpoint(v, p.shape)
      if p.select is not None:
        axis, a, b = p.select
        v = v[(slice(None),) * axis + (slice(a, b),)]
      out.append(v)
    return out[0] if len(out) == 1 else np.concatenate(out, self.axis)


def entries(plan, weight_map: WeightMap, dtype) -> list:
  """The checkpoint tensors (:class:`Entry`) in parameter order, every
  parameter mapped. A LoRA target is mapped by its kernel's name and
  shape, from its base's leaf id."""
  short = all(l.name.startswith("params.") for l in plan.leaves)
  adapted = {t.base: t for t in adapted_leaves(plan)}
  factors = {j for t in adapted.values() for j in (t.lora_A, t.lora_B)}
  out, unmapped = [], []
  fused: dict = {}  # split rules: checkpoint name -> (Entry, rule, values)
  for leaf in plan.leaves:
    if leaf.index in factors:
      continue
    target = adapted.get(leaf.index)
    name = leaf.name if target is None else target.name
    full_shape = tuple(leaf.shape) if target is None else target.shape
    found = find_match(weight_map, name, short)
    if found is None:
      unmapped.append(name)
      continue
    rule, values, k = found
    stack = rule.stack_axis_name
    own = np.dtype(leaf.dtype) if target is None else target.dtype
    out_dtype = np.dtype(dtype) if dtype is not None else own
    layers = [None] if stack is None else list(range(full_shape[0]))
    per_layer = full_shape if stack is None else full_shape[1:]
    shape = rule.chain.checkpoint_shape(per_layer)
    for layer in layers:
      vals = values if layer is None else {**values, stack: layer}
      if rule.fuse is None:
        out.append(Entry(rule.checkpoint_name(vals), shape, out_dtype,
                         [Piece(leaf.index, layer, rule.chain, shape)]))
      elif rule.fuse.kind == "concat":
        bounds = rule.fuse.bounds(shape[rule.fuse.axis], len(rule.checkpoints),
                                  f"parameter {name!r} {list(full_shape)}")
        for j, (a, b) in enumerate(bounds):
          out.append(Entry(rule.checkpoint_name(vals, j), rule.fuse.part_shape(shape, b - a),
                           out_dtype, [Piece(leaf.index, layer, rule.chain, shape,
                                             (rule.fuse.axis, a, b))]))
      else:
        ckpt = rule.checkpoint_name(vals)
        if ckpt not in fused:
          entry = Entry(ckpt, (), out_dtype, [None] * len(rule.params), rule.fuse.axis)
          fused[ckpt] = (entry, rule, vals)
          out.append(entry)
        fused[ckpt][0].pieces[k] = Piece(leaf.index, layer, rule.chain, shape)
  if unmapped:
    raise ValueError(
        f"save: {len(unmapped)} parameter(s) no rule maps to a checkpoint name: "
        f"{unmapped[:20]}{' ...' if len(unmapped) > 20 else ''}. Fix: add rules for them "
        "to the WeightMap (print(state.plan) lists the parameter names).")
  for ckpt, (entry, rule, vals) in fused.items():
    missing = [rule.param_name(vals, k) for k, p in enumerate(entry.pieces) if p is None]
    if missing:
      raise ValueError(
          f"save: checkpoint tensor {ckpt!r} joins {len(entry.pieces)} parameters of rule "
          f"{rule.describe()}, but the model lacks {missing}. Fix: give the model every "
          "part, or map the parts to tensors of their own.")
    shapes = [p.shape for p in entry.pieces]
    entry.shape = rule.fuse.joined_shape(shapes)
    if rule.fuse.sizes is not None and tuple(s[rule.fuse.axis] for s in shapes) != (
        rule.fuse.sizes):
      raise ValueError(
          f"save: the parts of {ckpt!r} have sizes {[s[rule.fuse.axis] for s in shapes]} "
          f"along axis {rule.fuse.axis}, but rule {rule.describe()} says {list(rule.fuse.sizes)}.")
  seen: dict = {}
  for e in out:
    if e.name in seen:
      raise ValueError(f"save: parameters {plan.leaves[seen[e.name]].name!r} and "
                       f"{plan.leaves[e.pieces[0].leaf].name!r} both map to checkpoint "
                       f"tensor {e.name!r}.")
    seen[e.name] = e.pieces[0].leaf
  return out


def _files(entries: list, max_bytes: int) -> list:
  """Consecutive groups of entries, each at most ``max_bytes`` (a tensor
  larger than that gets a file of its own)."""
  groups, size = [[]], 0
  for e in entries:
    if groups[-1] and size + e.nbytes > max_bytes:
      groups.append([])
      size = 0
    groups[-1].append(e)
    size += e.nbytes
  return groups


@mesh_lib.own_mesh
def save(state: ShardedTrainState, directory, weight_map: WeightMap, *,
         max_shard_size="5GB", dtype=None, overwrite: bool = False,
         metadata: Optional[dict] = None, config=None,
         generation_config=None, tokenizer=None) -> list[str]:
  """Writes the parameters of ``state`` as a Hugging Face checkpoint.

  Args:
    state: a :class:`~fsdp_jax.ShardedTrainState`. A LoRA state
      (``FSDPConfig(lora=...)``) is saved merged: each target kernel under
      its own name as ``decode(base) + (alpha / r) * A @ B`` (in float32,
      then the file's dtype), a model transformers loads without PEFT
      (:func:`save_adapter` writes the adapters alone).
    directory: where to write; it must not exist unless ``overwrite``.
    weight_map: the :class:`WeightMap` the model was loaded with: each
      parameter goes back to its checkpoint name, through the inverses of
      its transforms in reverse order (stacked layers unstacked).
    max_shard_size: the largest file, in bytes or as ``"5GB"`` /
      ``"500MiB"`` (Hugging Face's default, 5 GB).
    dtype: the tensors' dtype in the files (e.g. ``jnp.bfloat16``); default:
      each parameter's stored dtype.
    overwrite: replace an existing directory (only once the new one is
      complete).
    metadata: extra ``__metadata__`` strings (``format: pt`` is always
      written, as transformers expects).
    config: the ``config.json`` to write beside the weights: a dict, a
      path (the file, or a directory holding it), or an object with
      ``to_dict()`` (a transformers config). Default: the weight map's
      (``WeightMap(config=...)``; the maps of :mod:`fsdp_jax.models` carry
      the one their model was read from); ``False`` writes none. Its
      ``dtype`` / ``torch_dtype`` is set to the files' dtype.
    generation_config: ``generation_config.json``, likewise: a dict, a
      path, or an object with ``to_dict()``; default: the weight map's
      (the source directory's, where it had one); ``False`` writes none.
    tokenizer: the tokenizer to write beside the weights, with its chat
      template (so the directory reloads with ``AutoTokenizer``, template
      included): a transformers tokenizer (its ``save_pretrained``), or a
      directory whose tokenizer files are copied (:data:`TOKENIZER_FILES`:
      ``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``,
      ...). Default None: none.

  Returns:
    The files written, in order (the weights; ``config.json``,
    ``generation_config.json`` and the tokenizer's files are written beside
    them).

  With a ``config.json`` the directory is what transformers'
  ``save_pretrained`` writes: ``AutoModelForCausalLM.from_pretrained(directory)``
  reads it as it is. Every process must call ``save``; the files are
  written by the processes in turn.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax, tempfile, os
    >>> from fsdp_jax import pretrained
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"dense": {"kernel": jnp.ones((3, 2))}},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> wm = pretrained.WeightMap([("fc.weight", "dense.kernel", pretrained.transpose())])
    >>> out = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> [os.path.basename(f) for f in pretrained.save(state, out, wm)]
    ['model.safetensors']
  """
  plan = state.plan
  directory = os.path.abspath(os.fspath(directory))
  if os.path.exists(directory) and not overwrite:
    raise FileExistsError(
        f"save: {directory} exists. Fix: pick a new directory, or pass overwrite=True "
        "(the old one is replaced once the new one is complete).")
  tokenizer_files = _tokenizer_files(tokenizer)
  todo = entries(plan, weight_map, dtype)
  groups = _files(todo, parse_size(max_shard_size))
  n = len(groups)
  names = ([files.SINGLE_FILE] if n == 1 else
           [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)])
  rank, world = jax.process_index(), jax.process_count()
  tmp = _shared_tmp(directory)
  meta = {"format": "pt", **(metadata or {})}
  written = []
  split = convert.split_storage(plan, state.params)
  ignored = convert.ignored_entries(plan, state.params)
  adapted = {t.base: t for t in adapted_leaves(plan)}
  scaling = None if plan.config.lora is None else plan.config.lora.scaling
  cache: dict = {}  # the last unit copied to the host, which the next file may continue
  for k, (group, name) in enumerate(zip(groups, names)):
    owner = k % world == rank
    ids = {p.leaf for e in group for p in e.pieces}
    ids |= {j for i in ids if i in adapted for j in (adapted[i].lora_A, adapted[i].lora_B)}
    leaves = full_leaves(plan, split, ignored, ids, cache)
    if owner:
      path = os.path.join(tmp, name)
      writer = files.SafetensorsWriter(path, [(e.name, e.dtype, e.shape) for e in group], meta)
      for e in group:
        writer.write(e.name, e.value(leaves, adapted, scaling))  # converted to the file's dtype
      writer.close()
      files.check_readable(path)
    del leaves
    written.append(os.path.join(directory, name))
  if rank == 0:
    _write_configs(tmp, todo, weight_map, config, generation_config)
    _write_tokenizer(tmp, tokenizer, tokenizer_files)
  if n > 1 and rank == 0:
    index = {"metadata": {"total_size": sum(e.nbytes for e in todo)},
             "weight_map": {e.name: name for group, name in zip(groups, names) for e in group}}
    with open(os.path.join(tmp, files.INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2, sort_keys=True)
  _barrier("fsdp_jax.pretrained.save")
  if rank == 0:
    _publish(tmp, directory)
  _barrier("fsdp_jax.pretrained.save.done")
  return written


def _as_dict(value, name: str, what: str) -> Optional[dict]:
  """A config given as a dict, a path (the file, or a directory with
  ``name``), or an object with ``to_dict()``; None for None/False."""
  if value is None or value is False:
    return None
  if isinstance(value, dict):
    return copy.deepcopy(value)
  if isinstance(value, (str, os.PathLike)):
    path = os.fspath(value)
    path = os.path.join(path, name) if os.path.isdir(path) else path
    try:
      with open(path) as f:
        return json.load(f)
    except (OSError, ValueError) as e:
      raise ValueError(f"save: cannot read {what} from {path}: {e}. Fix: pass a dict, a "
                       f"{name} file or a directory holding one.") from None
  if hasattr(value, "to_dict"):
    return dict(value.to_dict())
  raise TypeError(f"save({what}=...) takes a dict, a path or an object with to_dict(), got "
                  f"{type(value).__name__}.")


# What transformers' tokenizers save (fast and slow, sentencepiece, BPE,
# WordPiece) and read back with AutoTokenizer, chat templates included.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "vocab.json", "merges.txt", "vocab.txt")


def _tokenizer_files(tokenizer) -> Optional[list]:
  """What ``save(tokenizer=...)`` writes, checked before anything is
  written: None (nothing), the :data:`TOKENIZER_FILES` paths a directory
  holds, or ``[]`` for a tokenizer object (its ``save_pretrained``)."""
  if tokenizer is None or tokenizer is False:
    return None
  if isinstance(tokenizer, (str, os.PathLike)):
    src = os.fspath(tokenizer)
    found = [os.path.join(src, n) for n in TOKENIZER_FILES
             if os.path.isfile(os.path.join(src, n))]
    if not found:
      raise ValueError(
          f"save(tokenizer={src!r}): no tokenizer files there (looked for "
          f"{', '.join(TOKENIZER_FILES)}). Fix: pass the directory the tokenizer was loaded "
          "from, or the tokenizer object (AutoTokenizer.from_pretrained(...)).")
    return found
  if callable(getattr(tokenizer, "save_pretrained", None)):
    return []
  raise TypeError(f"save(tokenizer=...) takes a transformers tokenizer (with save_pretrained) "
                  f"or a directory of tokenizer files, got {type(tokenizer).__name__}.")


def _write_tokenizer(tmp: str, tokenizer, found: Optional[list]) -> None:
  """The tokenizer's files into ``tmp``: the directory's ``found`` files
  copied, or the object's ``save_pretrained``."""
  if found is None:
    return
  for path in found:
    shutil.copyfile(path, os.path.join(tmp, os.path.basename(path)))
  if not found:
    tokenizer.save_pretrained(tmp)


_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
                "float64": "float64"}


def _write_configs(tmp: str, todo: list, weight_map: WeightMap, config,
                   generation_config) -> None:
  """``config.json`` (its dtype set to the files') and
  ``generation_config.json`` into ``tmp``."""
  cfg = _as_dict(weight_map.config if config is None else config, "config.json", "config")
  if cfg is not None:
    by_dtype: dict = {}
    for e in todo:
      if np.issubdtype(e.dtype, np.floating) or e.dtype.name == "bfloat16":
        by_dtype[e.dtype.name] = by_dtype.get(e.dtype.name, 0) + e.nbytes
    if by_dtype:
      name = _DTYPE_NAMES.get(max(by_dtype, key=by_dtype.get))
      if name is not None:
        for key in ("dtype", "torch_dtype"):
          if key in cfg or key == "dtype":
            cfg[key] = name
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(cfg, f, indent=2, sort_keys=True)
  gen = _as_dict(weight_map.generation_config if generation_config is None
                 else generation_config, "generation_config.json", "generation_config")
  if gen is not None:
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
      json.dump(gen, f, indent=2, sort_keys=True)


@functools.lru_cache(maxsize=16)
def _merger(scaling: float):
  return jax.jit(lambda node: lora_lib.merge(node, scaling, jnp.float32))


def merged(target, leaves: dict, scaling: float, layer=None) -> np.ndarray:
  """A LoRA target's effective kernel (of one layer, or all), from the
  host values of its stored leaves: ``decode(base) + scaling * A @ B`` in
  float32, computed on the CPU."""
  pick = (lambda x: x) if layer is None else (lambda x: x[layer])
  node = lora_lib.LoRAWeight(pick(leaves[target.base]), pick(leaves[target.lora_A]),
                             pick(leaves[target.lora_B]), quantization=target.quantization,
                             width=target.width, dtype=target.dtype,
                             out_dims=target.out_dims)
  with jax.default_device(host_device()):
    return np.asarray(_merger(float(scaling))(node))


def full_leaves(plan, split: dict, ignored: dict, ids: set, cache: dict) -> dict:
  """``{leaf id: numpy array}`` of the full values of ``ids`` on this
  process, unit by unit: each unit's stored arrays are copied to the host
  (their shards, assembled) and cut into leaves there (views), with no
  program to compile. ``cache`` keeps the last unit for the next call
  (files split units), so the host holds one file and one unit."""
  out = {}
  for unit in plan.units:
    want = tuple(i for i in unit.leaf_ids if i in ids)
    if not want:
      continue
    if unit.index not in cache:
      cache.clear()
      arrays = split[unit.index]
      present = convert.present(plan, unit, arrays)
      sub = dataclasses.replace(unit, leaf_ids=present) if plan.use_orig_params else unit
      cache[unit.index] = layout.unpack_storage_full(
          plan, sub, [_to_host(a) for a in arrays if a is not None])
    host = cache[unit.index]
    out.update({i: host[i] for i in want if i in host})
  for i in ids:
    if i not in out and ignored.get(i) is not None:
      x = ignored[i]  # (world, *shape): every device's copy; the first one
      out[i] = np.asarray(x.addressable_shards[0].data)[0]
  return out


def _to_host(x) -> np.ndarray:
  """A sharded array's whole value on this host (from every process's
  shards when the array spans processes)."""
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _shared_tmp(directory: str) -> str:
  """A temporary directory beside ``directory``, the same on every process."""
  parent = os.path.dirname(directory)
  os.makedirs(parent, exist_ok=True)
  token = uuid.uuid4().hex if jax.process_count() == 1 else _agree(uuid.uuid4().hex)
  tmp = os.path.join(parent, f".{os.path.basename(directory)}.tmp-{token[:12]}")
  if jax.process_index() == 0:
    os.makedirs(tmp)
  _barrier("fsdp_jax.pretrained.save.tmp")
  return tmp


def _agree(value: str) -> str:
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  data = np.frombuffer(value.encode(), np.uint8)
  return bytes(np.asarray(multihost_utils.broadcast_one_to_all(data)).tolist()).decode()


def _barrier(name: str) -> None:
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(name)


def _publish(tmp: str, directory: str) -> None:
  """Moves the finished ``tmp`` to ``directory`` (replacing an old one only
  now that the new one is complete)."""
  old = None
  if os.path.exists(directory):
    old = f"{tmp}.old"
    os.rename(directory, old)
  os.rename(tmp, directory)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True)
