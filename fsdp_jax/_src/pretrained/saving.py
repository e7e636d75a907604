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
from fsdp_jax._src.pretrained.weight_map import WeightMap
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


def find_rule(weight_map: WeightMap, name: str, short: bool):
  """``(rule, placeholder values)`` mapping parameter ``name`` (Flax linen's
  ``params.`` prefix may be left out of the patterns), or None."""
  found = weight_map.param_rule(name)
  if found is None and short and name.startswith("params."):
    found = weight_map.param_rule(name[len("params."):])
  return found


def _entries(plan, weight_map: WeightMap, dtype) -> list:
  """``[(checkpoint name, leaf id, layer or None, chain, checkpoint shape,
  dtype)]`` in parameter order, every parameter mapped. A LoRA target is
  one entry, of its base's leaf id, with the kernel's name and shape."""
  short = all(l.name.startswith("params.") for l in plan.leaves)
  adapted = {t.base: t for t in adapted_leaves(plan)}
  factors = {j for t in adapted.values() for j in (t.lora_A, t.lora_B)}
  out, unmapped = [], []
  for leaf in plan.leaves:
    if leaf.index in factors:
      continue
    target = adapted.get(leaf.index)
    name = leaf.name if target is None else target.name
    full_shape = tuple(leaf.shape) if target is None else target.shape
    found = find_rule(weight_map, name, short)
    if found is None:
      unmapped.append(name)
      continue
    rule, values = found
    stack = rule.stack_axis_name
    own = np.dtype(leaf.dtype) if target is None else target.dtype
    out_dtype = np.dtype(dtype) if dtype is not None else own
    if stack is None:
      shape = rule.chain.checkpoint_shape(full_shape)
      out.append((rule.checkpoint_name(values), leaf.index, None, rule.chain, shape, out_dtype))
    else:
      shape = rule.chain.checkpoint_shape(full_shape[1:])
      for layer in range(full_shape[0]):
        out.append((rule.checkpoint_name({**values, stack: layer}), leaf.index, layer,
                    rule.chain, shape, out_dtype))
  if unmapped:
    raise ValueError(
        f"save: {len(unmapped)} parameter(s) no rule maps to a checkpoint name: "
        f"{unmapped[:20]}{' ...' if len(unmapped) > 20 else ''}. Fix: add rules for them "
        "to the WeightMap (print(state.plan) lists the parameter names).")
  seen: dict = {}
  for name, i, layer, *_ in out:
    if name in seen:
      raise ValueError(f"save: parameters {plan.leaves[seen[name]].name!r} and "
                       f"{plan.leaves[i].name!r} both map to checkpoint tensor {name!r}.")
    seen[name] = i
  return out


def _files(entries: list, max_bytes: int) -> list:
  """Consecutive groups of entries, each at most ``max_bytes`` (a tensor
  larger than that gets a file of its own)."""
  groups, size = [[]], 0
  for e in entries:
    n = int(np.prod(e[4], dtype=np.int64)) * e[5].itemsize
    if groups[-1] and size + n > max_bytes:
      groups.append([])
      size = 0
    groups[-1].append(e)
    size += n
  return groups


@mesh_lib.own_mesh
def save(state: ShardedTrainState, directory, weight_map: WeightMap, *,
         max_shard_size="5GB", dtype=None, overwrite: bool = False,
         metadata: Optional[dict] = None) -> list[str]:
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

  Returns:
    The files written, in order.

  ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` (or the
  model's class) reads the directory once it also holds the model's
  ``config.json``: copy it from the checkpoint the model was loaded from, or
  write it with ``config.save_pretrained(directory)``. Every process must
  call ``save``; the files are written by the processes in turn.

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
  entries = _entries(plan, weight_map, dtype)
  groups = _files(entries, parse_size(max_shard_size))
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
    ids = {e[1] for e in group}
    ids |= {j for i in ids if i in adapted for j in (adapted[i].lora_A, adapted[i].lora_B)}
    leaves = full_leaves(plan, split, ignored, ids, cache)
    if owner:
      path = os.path.join(tmp, name)
      writer = files.SafetensorsWriter(path, [(e[0], e[5], e[4]) for e in group], meta)
      for ckpt, i, layer, chain, shape, _ in group:
        if i in adapted:
          value = merged(adapted[i], leaves, scaling, layer)
        else:
          value = leaves[i] if layer is None else leaves[i][layer]
        writer.write(ckpt, chain.to_checkpoint(value, shape))  # converted to the file's dtype
      writer.close()
      files.check_readable(path)
    del leaves
    written.append(os.path.join(directory, name))
  if n > 1 and rank == 0:
    index = {"metadata": {"total_size": sum(
        int(np.prod(e[4], dtype=np.int64)) * e[5].itemsize for e in entries)},
             "weight_map": {e[0]: name for group, name in zip(groups, names) for e in group}}
    with open(os.path.join(tmp, files.INDEX_FILE), "w") as f:
      json.dump(index, f, indent=2, sort_keys=True)
  _barrier("fsdp_jax.pretrained.save")
  if rank == 0:
    _publish(tmp, directory)
  _barrier("fsdp_jax.pretrained.save.done")
  return written


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
