"""Loading a checkpoint straight into shards: :func:`load` returns a
:class:`PretrainedSource`, which ``init_train_state(pretrained=...)``
resolves against the plan (every checkpoint tensor to a parameter, shapes
and dtypes checked) and reads shard by shard: each device's stored array is
filled from the rows of each leaf it holds, read from the file as slices,
and moved to the device before the next is read. A process reads only what
its own devices hold.

With ``FSDPConfig(lora=...)`` a rule for a target kernel ``X`` loads the
stored ``X.base`` (for QLoRA each device's rows are quantized as they are
read, so the full-precision model is never held); ``X.lora_A`` and
``X.lora_B`` are not in a base checkpoint and keep ``init_fn``'s values."""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax._src import lora as lora_lib
from fsdp_jax._src import quantization as quant
from fsdp_jax._src.plan import Plan, UnitSpec
from fsdp_jax._src.pretrained import files
from fsdp_jax._src.pretrained.weight_map import Chain, Fuse, WeightMap
from fsdp_jax._src.quantization import Quantization

MAX_LISTED = 20


@dataclasses.dataclass(frozen=True)
class Adapted:
  """A LoRA target kernel of a plan: the user's parameter ``name``, the
  leaf ids of its stored ``base``, ``lora_A`` and ``lora_B``, and what
  decoding the base needs (``quantization``, the kernel's ``width`` and
  ``dtype``). ``shape`` is the kernel's (``[layers,] *in, *out``), its last
  ``out_dims`` dimensions the output ones."""

  name: str
  base: int
  lora_A: int  # pylint: disable=invalid-name
  lora_B: int  # pylint: disable=invalid-name
  quantization: Optional[Quantization]
  width: int
  dtype: np.dtype
  shape: tuple
  out_dims: int = 1
  lead: int = 0  # leading layer axes (a stacked unit's)


def adapted_leaves(plan: Plan) -> list:
  """The plan's LoRA target kernels (:class:`Adapted`), in stored order;
  empty without ``FSDPConfig(lora=...)``."""
  if plan.config.lora is None:
    return []
  tree = jax.tree_util.tree_unflatten(plan.treedef, list(range(len(plan.leaves))))
  out = []
  for node in jax.tree.leaves(tree, is_leaf=lora_lib.is_lora_weight):
    if not lora_lib.is_lora_weight(node):
      continue
    name = plan.leaves[node.base].name
    name = name[:-len(".base")] if name.endswith(".base") else name
    b_shape = tuple(plan.leaves[node.lora_B].shape)
    shape = tuple(plan.leaves[node.lora_A].shape[:-1]) + b_shape[len(b_shape) - node.out_dims:]
    out.append(Adapted(name, node.base, node.lora_A, node.lora_B, node.quantization,
                       int(node.width), np.dtype(node.dtype), shape, node.out_dims,
                       _stacked(plan, node.base)))
  return out


def _stacked(plan: Plan, leaf_id: int) -> int:
  """1 for a leaf of a stacked unit (a leading layer axis), else 0."""
  unit = plan.leaves[leaf_id].unit
  return int(unit >= 0 and plan.units[unit].stacked)


def host_device():
  """The CPU device, where host-side quantization and merges run (the
  default device where the CPU backend is not initialised)."""
  try:
    return jax.devices("cpu")[0]
  except RuntimeError:
    return None


@functools.lru_cache(maxsize=16)
def _encoder(q: Quantization):
  return jax.jit(functools.partial(quant.encode, q=q))


def encode_rows(rows: np.ndarray, q: Quantization, dtype) -> np.ndarray:
  """Rows of a kernel (in the checkpoint's dtype) -> its stored QLoRA base
  rows: converted to the kernel's ``dtype``, then
  :func:`fsdp_jax._src.quantization.encode` run on the CPU (the function
  ``init_train_state`` runs on ``init_fn``'s kernel, so the same bits)."""
  rows = np.asarray(rows).astype(dtype, copy=False)
  with jax.default_device(host_device()):
    return np.asarray(_encoder(q)(rows))


@dataclasses.dataclass(frozen=True)
class LeafSource:
  """Where one parameter's values come from: checkpoint ``tensors`` (one per
  layer when the rule stacks them, else one) through ``chain``."""

  leaf: int
  tensors: tuple
  stacked: bool  # one tensor per index of the leaf's axis 0
  chain: Chain
  checkpoint_shape: tuple  # of each tensor
  # QLoRA: the leaf is a quantized base; the kernel's rows are converted to
  # ``dtype`` and encoded as they are read.
  quantization: Optional[Quantization] = None
  dtype: Optional[np.dtype] = None
  out_dims: int = 1  # of the kernel: its rows are the others, flattened


@dataclasses.dataclass(frozen=True)
class Part:
  """Elements ``start:stop`` along ``fuse.axis`` of checkpoint tensor
  ``name``: one parameter's part of a tensor a :func:`split` rule cuts."""

  name: str
  fuse: Fuse
  start: int
  stop: int


@dataclasses.dataclass(frozen=True)
class Joined:
  """Checkpoint tensors ``names`` joined along ``fuse.axis``: the tensor a
  :func:`concat` rule makes one parameter of."""

  names: tuple
  fuse: Fuse


def describe_ref(ref) -> str:
  """A checkpoint tensor, a part of one or joined ones, for messages."""
  if isinstance(ref, str):
    return repr(ref)
  if isinstance(ref, Part):
    return f"{ref.name!r} [{ref.start}:{ref.stop} along axis {ref.fuse.axis}]"
  return " + ".join(repr(n) for n in ref.names)


# config.json fields that set parameter shapes, compared when a checkpoint
# does not fit the model built from another config.json.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "n_embd", "n_layer",
                "n_head", "n_inner", "n_positions", "tie_word_embeddings")


def config_differences(config: Optional[dict], path: str) -> list:
  """``["hidden_size 96 in config.json, model built for 64", ...]``: the
  fields of the checkpoint's ``config.json`` (beside ``path``) that set
  shapes and differ from ``config``, the one the model was built from."""
  if not config:
    return []
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  try:
    with open(os.path.join(directory, "config.json")) as f:
      theirs = json.load(f)
  except (OSError, ValueError):
    return []
  if not isinstance(theirs, dict):
    return []
  theirs = theirs.get("text_config", theirs) if "text_config" in theirs and (
      "hidden_size" not in theirs) else theirs
  return [f"{k} {theirs[k]} in config.json, model built for {config[k]}" for k in SHAPE_FIELDS
          if k in theirs and k in config and theirs[k] != config[k]]


class PretrainedSource:
  """A checkpoint and the :class:`~fsdp_jax.pretrained.WeightMap` that maps
  it onto a model: what :func:`fsdp_jax.pretrained.load` returns and
  ``init_train_state(pretrained=...)`` reads. Only headers have been read.

  Attributes:
    path: the checkpoint.
    weight_map: the map.
    strict: whether every checkpoint tensor and every parameter must be
      covered by a rule.
    tensors: ``{name: (dtype, shape)}`` of the checkpoint's tensors.

  >>> import os, tempfile
  >>> import numpy as np
  >>> from safetensors.numpy import save_file
  >>> from fsdp_jax import pretrained
  >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
  >>> save_file({"fc.weight": np.zeros((4, 3), np.float32)}, path)
  >>> source = pretrained.load(
  ...     path, pretrained.WeightMap([("fc.weight", "kernel", pretrained.transpose())]))
  >>> source.tensors
  {'fc.weight': (dtype('float32'), (4, 3))}
  >>> source.bytes_read  # headers only, so far
  0
  """

  def __init__(self, path: str, weight_map: WeightMap, *, strict: bool = True):
    if not isinstance(weight_map, WeightMap):
      raise TypeError(f"weight_map must be a fsdp_jax.pretrained.WeightMap, got "
                      f"{type(weight_map).__name__}.")
    self.path = path
    self.weight_map = weight_map
    self.strict = bool(strict)
    self.reader = files.open_checkpoint(path)
    self.tensors = {n: (i.dtype, i.shape) for n, i in self.reader.tensors.items()}
    self._cache: collections.OrderedDict = collections.OrderedDict()

  def __repr__(self):
    return (f"PretrainedSource({self.path!r}, {len(self.tensors)} tensors, "
            f"{self.weight_map!r}, strict={self.strict})")

  @property
  def bytes_read(self) -> int:
    """Tensor bytes this process has read from the checkpoint so far."""
    return self.reader.bytes_read

  @property
  def page_bytes_read(self) -> int:
    """Bytes of the file pages those tensor bytes lie in (what storage
    moves): larger where a process reads columns of rows shorter than a
    few pages. Counted for safetensors files (0 for a PyTorch state
    dict)."""
    return self.reader.page_bytes_read

  # ---- resolution ----------------------------------------------------------
  def _ref_info(self, ref) -> tuple:
    """``(dtype, shape)`` of a checkpoint tensor, a part of one, or joined
    ones (:class:`Part`, :class:`Joined`)."""
    if isinstance(ref, str):
      info = self.reader.tensors[ref]
      return info.dtype, tuple(info.shape)
    if isinstance(ref, Part):
      dtype, shape = self._ref_info(ref.name)
      return dtype, ref.fuse.part_shape(shape, ref.stop - ref.start)
    infos = [self._ref_info(n) for n in ref.names]
    return infos[0][0], ref.fuse.joined_shape([i[1] for i in infos])

  def resolve(self, plan: Plan) -> dict:
    """``{leaf id: LeafSource}``, checked: raises one ``ValueError`` naming
    every problem (an uncovered tensor or parameter under ``strict``, a
    parameter the model lacks, a shape or dtype that does not fit)."""
    names = {l.name: l.index for l in plan.leaves}
    adapted = {t.base: t for t in adapted_leaves(plan)}
    # LoRA: a rule for the kernel ``X`` loads its base ``X.base``; the
    # factors are never in a base checkpoint.
    names.update({t.name: i for i, t in adapted.items()})
    factors = {j for t in adapted.values() for j in (t.lora_A, t.lora_B)}
    shown = {i: (f"{t.name!r} (LoRA target, stored as {plan.leaves[i].name!r})")
             for i, t in adapted.items()}
    if names and all(n.startswith("params.") for n in names):
      # Flax linen's collection prefix may be left out of a pattern.
      names.update({n[len("params."):]: i for n, i in list(names.items())})
    problems: list[str] = []
    uncovered: list[str] = []
    groups: dict = {}  # leaf id -> {layer or None: (ref, rule)}
    joins: dict = {}  # (rule, values) -> {k: tensor}, for concat rules
    mapped = []  # (param name, layer, ref, rule)
    for tensor in sorted(self.reader.tensors):
      found = self.weight_map.checkpoint_match(tensor)
      if found is None:
        uncovered.append(tensor)
        continue
      rule, values, k = found
      if not rule.params:
        continue  # dropped on purpose
      stack = rule.stack_axis_name
      layer = values[stack] if stack is not None else None
      if rule.fuse is None:
        mapped.append((rule.param_name(values), layer, tensor, rule))
      elif rule.fuse.kind == "concat":
        joins.setdefault((id(rule), tuple(sorted(values.items()))), (rule, values, {}))[2][k] = \
            tensor
      else:
        shape = self.reader.tensors[tensor].shape
        try:
          if rule.fuse.axis >= len(shape):
            raise ValueError(f"tensor {tensor!r} {list(shape)} has no axis {rule.fuse.axis}")
          bounds = rule.fuse.bounds(shape[rule.fuse.axis], len(rule.params),
                                    f"tensor {tensor!r} {list(shape)}")
        except ValueError as e:
          problems.append(f"rule {rule.describe()}: {e}")
          continue
        for j, (a, b) in enumerate(bounds):
          mapped.append((rule.param_name(values, j), layer, Part(tensor, rule.fuse, a, b), rule))
    for rule, values, parts in joins.values():
      want = range(len(rule.checkpoints))
      if sorted(parts) != list(want):
        missing = [rule.checkpoint_name(values, k) for k in want if k not in parts]
        problems.append(f"rule {rule.describe()} joins {len(want)} tensors, but the "
                        f"checkpoint lacks {missing}")
        continue
      stack = rule.stack_axis_name
      mapped.append((rule.param_name(values), values[stack] if stack is not None else None,
                     Joined(tuple(parts[k] for k in want), rule.fuse), rule))
    for param, layer, ref, rule in mapped:
      if param not in names:
        problems.append(
            f"rule {rule.describe()} maps tensor {describe_ref(ref)} to parameter {param!r}, "
            "which the model does not have")
        continue
      slot = groups.setdefault(names[param], {})
      if layer in slot:
        problems.append(f"tensors {describe_ref(slot[layer][0])} and {describe_ref(ref)} both "
                        f"map to parameter {param!r}"
                        + (f" layer {layer}" if layer is not None else ""))
        continue
      slot[layer] = (ref, rule)
    out = {}
    shape_problems = 0
    for i, slot in sorted(groups.items()):
      leaf = plan.leaves[i]
      target = adapted.get(i)
      q = None if target is None else target.quantization
      # A quantized base is loaded from the kernel: its shape and dtype.
      full_shape = tuple(leaf.shape) if target is None else target.shape
      kernel_dtype = np.dtype(leaf.dtype) if target is None else target.dtype
      what = shown.get(i, repr(leaf.name))
      rules = {id(r) for _, r in slot.values()}
      if len(rules) > 1:
        problems.append(f"parameter {what} is mapped by several rules")
        continue
      tensor, rule = next(iter(slot.values()))
      stacked = None not in slot
      if stacked:
        layers = sorted(slot)
        if layers != list(range(full_shape[0] if full_shape else 0)):
          problems.append(
              f"parameter {what} {full_shape} stacks {len(layers)} tensors of rule "
              f"{rule.describe()} (indices {layers[:6]}{' ...' if len(layers) > 6 else ''}), "
              f"but its axis 0 has {full_shape[0] if full_shape else 0} entries")
          continue
        tensors = tuple(slot[k][0] for k in layers)
        want = tuple(full_shape[1:])
      else:
        tensors = (tensor,)
        want = tuple(full_shape)
      try:
        infos = [self._ref_info(t) for t in tensors]
      except ValueError as e:
        problems.append(f"parameter {what}: {e}")
        continue
      shapes = {info[1] for info in infos}
      if len(shapes) > 1:
        problems.append(f"parameter {leaf.name!r}: its tensors have different shapes "
                        f"{sorted(shapes)}")
        continue
      ckpt_shape = infos[0][1]
      try:
        got = rule.chain.model_shape(ckpt_shape)
      except (ValueError, TypeError) as e:
        problems.append(f"tensor {describe_ref(tensors[0])} {list(ckpt_shape)} -> parameter "
                        f"{leaf.name!r}: {rule.chain} fails: {e}")
        shape_problems += 1
        continue
      if tuple(got) != want:
        problems.append(
            f"shape mismatch: tensor {describe_ref(tensors[0])}"
            f"{' (and its layers)' if stacked else ''} has shape {list(ckpt_shape)}, which "
            f"after {rule.chain} is {list(got)}, but parameter {what} has shape "
            f"{list(full_shape)}"
            + (f" ({full_shape[0]} stacked layers of {list(want)})" if stacked else ""))
        shape_problems += 1
        continue
      src_dtype = infos[0][0]
      if not np.can_cast(src_dtype, kernel_dtype, casting="same_kind"):
        problems.append(f"tensor {describe_ref(tensors[0])} is {src_dtype}, which does not "
                        f"convert to parameter {what}'s {kernel_dtype}")
        continue
      out[i] = LeafSource(i, tensors, stacked, rule.chain, ckpt_shape, q,
                          None if q is None else kernel_dtype,
                          1 if target is None else target.out_dims)
    if self.strict:
      if uncovered:
        problems.append(
            f"{len(uncovered)} checkpoint tensor(s) no rule covers: "
            f"{_listing(uncovered)} (add rules, a (pattern, None) rule to drop them, or "
            "load(..., strict=False))")
      missing = [adapted[l.index].name if l.index in adapted else l.name for l in plan.leaves
                 if l.index not in out and l.index not in factors]
      if missing:
        problems.append(
            f"{len(missing)} parameter(s) no checkpoint tensor loads: {_listing(missing)} "
            "(add rules, or load(..., strict=False) to keep init_fn's values for them)")
    if problems:
      fix = "Fix the WeightMap rules (print(state.plan) lists the parameter names)."
      differ = config_differences(self.weight_map.config, self.path) if shape_problems else []
      if differ:
        fix = ("The checkpoint is of another model size: " + "; ".join(differ)
               + ". Fix: build the model from the checkpoint's own config.json (e.g. "
               "fsdp_jax.models.from_pretrained(checkpoint_directory)), or load a checkpoint "
               "of the model's size.")
      raise ValueError(
          f"Loading {self.path} with {self.weight_map!r}:\n  - " + "\n  - ".join(problems)
          + "\n" + fix)
    return out

  # ---- what init_train_state calls -------------------------------------------
  def unit_arrays(self, plan: Plan, unit: UnitSpec, sources: dict) -> dict:
    """See :func:`unit_arrays`."""
    return unit_arrays(plan, unit, self, sources)

  def with_init(self, plan: Plan, unit: UnitSpec, sources: dict, loaded: dict,
                init: dict) -> dict:
    """The unit's stored arrays: the checkpoint's values where it covers the
    unit's leaves, ``init`` (``init_fn``'s, laid out the same) elsewhere."""
    return merge(loaded, init, covered_mask(plan, unit, sources))

  def ignored_arrays(self, plan: Plan, sources: dict) -> dict:
    """See :func:`ignored_arrays`."""
    return ignored_arrays(plan, self, sources)

  # ---- reading ---------------------------------------------------------------
  def _read(self, ref, index=()) -> np.ndarray:
    """``ref[index]`` (``index``: slices, one per leading axis) from the
    file: a tensor, a part of one, or tensors joined (each read for the
    rows it contributes)."""
    if isinstance(ref, str):
      return self.reader.read(ref, index)
    _, shape = self._ref_info(ref)
    ranges = [s.indices(n)[:2] for s, n in zip(tuple(index) + (slice(None),) * (
        len(shape) - len(index)), shape)]
    axis = ref.fuse.axis
    if isinstance(ref, Part):
      ranges[axis] = (ranges[axis][0] + ref.start, ranges[axis][1] + ref.start)
      return self.reader.read(ref.name, tuple(slice(a, b) for a, b in ranges))
    pieces, start = [], 0
    a, b = ranges[axis]
    for name in ref.names:
      n = self.reader.tensors[name].shape[axis]
      lo, hi = max(a, start), min(b, start + n)
      if hi > lo:
        pick = list(ranges)
        pick[axis] = (lo - start, hi - start)
        pieces.append(self.reader.read(name, tuple(slice(p, q) for p, q in pick)))
      start += n
    if not pieces:
      return np.zeros(tuple(q - p for p, q in ranges), self._ref_info(ref)[0])
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis)

  def _whole(self, name, chain: Chain, shape: tuple) -> np.ndarray:
    """A tensor in the model's layout, read whole (one cached)."""
    key = (name, id(chain))
    if key not in self._cache:
      self._cache.clear()
      self._cache[key] = chain.to_model(self._read(name))
    return self._cache[key]

  def _tensor_part(self, name, chain: Chain, ckpt_shape: tuple, index: tuple):
    """``chain(tensor)[index]``, reading only the slice along the checkpoint
    axis the model's axis 0 comes from where the chain allows it."""
    index = tuple(index)
    axis = chain.rows_axis(ckpt_shape)
    if axis is None or not index:
      return self._whole(name, chain, ckpt_shape)[index]
    rows = index[0]
    pick = [slice(None)] * len(ckpt_shape)
    pick[axis] = rows
    part = chain.to_model(self._read(name, tuple(pick)))
    return part[(slice(None),) + index[1:]]

  def read_leaf(self, src: LeafSource, index: tuple, dtype=None) -> np.ndarray:
    """``leaf[index]`` (a tuple of unit-step slices over the leaf's shape),
    in ``dtype`` (by default the checkpoint's, and possibly a read-only view
    of the file or a transposed view: copy it before keeping it). A
    quantized LoRA base: the kernel's rows ``index[:-1]`` (its output
    dimensions flattened), encoded, then ``index[-1]`` of their payload
    rows."""
    index = tuple(index)
    if src.quantization is not None:
      ndim = (len(src.chain.model_shape(src.checkpoint_shape)) + int(src.stacked)
              - src.out_dims + 1)  # the base's: [*lead, *in, payload]
      index = index + (slice(None),) * (ndim - len(index))
      plain = dataclasses.replace(src, quantization=None, dtype=None)
      rows = self.read_leaf(plain, index[:-1] + (slice(None),) * src.out_dims)
      rows = rows.reshape(rows.shape[:rows.ndim - src.out_dims] + (-1,))
      out = encode_rows(rows, src.quantization, src.dtype)[..., index[-1]]
      return out if dtype is None else out.astype(dtype, copy=False)
    if src.stacked:
      a, b, _ = (index[0] if index else slice(None)).indices(len(src.tensors))
      parts = [self._tensor_part(src.tensors[k], src.chain, src.checkpoint_shape, index[1:])
               for k in range(a, b)]
      shape = (b - a,) + (parts[0].shape if parts else ())
      out = np.stack(parts) if parts else np.zeros(shape, dtype)
    else:
      out = self._tensor_part(src.tensors[0], src.chain, src.checkpoint_shape, index)
    out = np.asarray(out)
    return out if dtype is None else out.astype(dtype, copy=False)


def _listing(names) -> str:
  shown = ", ".join(repr(n) for n in names[:MAX_LISTED])
  return shown + (f" and {len(names) - MAX_LISTED} more" if len(names) > MAX_LISTED else "")


# --------------------------------------------------------------------------
# Stored arrays, device by device


def _rows(plan: Plan, unit: UnitSpec, leaf_id: int, rows, t: int = 0) -> tuple:
  """A leaf index: every layer of a stacked unit, ``rows`` along the leaf's
  first per-layer axis, the rest whole; of a tensor-parallel unit, ``rows``
  of tensor slice ``t`` (its ``tensor_dim`` cut in equal parts)."""
  leaf = plan.leaves[leaf_id]
  layers = (slice(None),) if unit.stacked else ()
  if not leaf.layer_shape:  # a scalar: one row
    return layers
  index = [rows] + [slice(None)] * len(leaf.rest)
  if unit.tensor:
    d, size = leaf.tensor_dim, leaf.layer_shape[leaf.tensor_dim]
    if d == 0:
      index[0] = slice(rows.start + t * size, rows.stop + t * size)
    else:
      index[d] = slice(t * size, (t + 1) * size)
  return layers + tuple(index)


def _local(sharding, shape) -> list:
  """``[(device, [(start, stop) of each axis], local shape)]`` of this
  process's devices."""
  out = []
  for device, index in sharding.addressable_devices_indices_map(tuple(shape)).items():
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    ranges = [s.indices(n)[:2] for s, n in zip(index, shape)]
    out.append((device, ranges, tuple(b - a for a, b in ranges)))
  return out


def _groups(sharding, shape) -> list:
  """``[(ranges, [local device positions])]``: this process's distinct
  shards in order (replicas of a HYBRID mesh share one)."""
  groups: dict = {}
  for k, (_, ranges, _) in enumerate(_local(sharding, shape)):
    groups.setdefault(tuple(map(tuple, ranges)), []).append(k)
  return sorted(groups.items())


def _build(shape, sharding, fill) -> jax.Array:
  """A global array whose shards on this process's devices are
  ``fill(ranges, local shape)`` (a numpy array), built one distinct shard at
  a time: each is filled, put on every device that holds it, and dropped,
  so the host holds one shard beyond what is already on the devices."""
  local = _local(sharding, shape)
  arrays = [None] * len(local)
  moving = []  # the last shard's transfers, which run while the next is filled
  for ranges, ks in _groups(sharding, shape):
    part = fill(ranges, local[ks[0]][2])
    jax.block_until_ready(moving)
    moving = [jax.device_put(part, jax.sharding.SingleDeviceSharding(
        local[k][0], memory_kind=sharding.memory_kind)) for k in ks]
    for k, x in zip(ks, moving):
      arrays[k] = x
    del part
  jax.block_until_ready(moving)
  return jax.make_array_from_single_device_arrays(tuple(shape), sharding, arrays)


class _LeafRows:
  """Rows of one leaf at a time: the rows any of this process's shards
  needs (``hulls[leaf id]``) are read once, and each shard slices its own."""

  def __init__(self, plan: Plan, unit: UnitSpec, source: PretrainedSource, sources: dict,
               hulls: dict):
    self.plan, self.unit, self.source, self.sources = plan, unit, source, sources
    self.hulls = hulls  # {leaf id or (leaf id, tensor slice): (first row, end)}
    self.leaf, self.block = None, None

  def __call__(self, i: int, r0: int, r1: int, t: Optional[int] = None) -> np.ndarray:
    """Rows ``r0:r1`` of leaf ``i`` (of every layer of a stacked unit; a
    scalar has one row; of tensor slice ``t`` in a tensor-parallel unit), in
    the checkpoint's dtype, possibly a view."""
    leaf = self.plan.leaves[i]
    key = i if t is None else (i, t)
    h0, h1 = self.hulls[key]
    q = 1 if self.unit.stacked else 0
    if self.leaf != key:
      self.leaf, self.block = None, None  # drop the last leaf before reading
      block = self.source.read_leaf(self.sources[i],
                                    _rows(self.plan, self.unit, i, slice(h0, h1), t or 0))
      if not leaf.layer_shape:
        block = block.reshape(block.shape[:q] + (1,))
      self.leaf, self.block = key, block
    return self.block[(slice(None),) * q + (slice(r0 - h0, r1 - h0),)]


def _put(part: np.ndarray, a: int, s: int, lo: int, hi: int, row: int, rows, r0: int,
         r1: int) -> None:
  """``part[..., lo - a:hi - a]`` = elements ``lo - s:hi - s`` (of each
  layer) of a leaf whose rows ``r0:r1`` are ``rows`` (leading layer axis
  when ``part`` has one): whole rows in one copy, the partial rows at
  either end one by one."""
  prefix = part.shape[:-1]
  q = len(prefix)
  f0, f1 = -(-(lo - s) // row), (hi - s) // row  # the whole rows
  if f1 > f0:
    dst = part[..., s + f0 * row - a:s + f1 * row - a]
    files.copy_into(dst.reshape(prefix + (f1 - f0,) + rows.shape[q + 1:]),
          rows[(slice(None),) * q + (slice(f0 - r0, f1 - r0),)])
  for r in sorted({r0, r1 - 1} - set(range(f0, f1))):
    e0, e1 = max(lo - s, r * row), min(hi - s, (r + 1) * row)
    if e1 > e0:
      one = np.reshape(rows[(slice(None),) * q + (r - r0,)], prefix + (-1,))
      files.copy_into(part[..., s + e0 - a:s + e1 - a], one[..., e0 - r * row:e1 - r * row])


def _hull(hulls: dict, i: int, r0: int, r1: int) -> None:
  h = hulls.get(i)
  hulls[i] = (r0, r1) if h is None else (min(h[0], r0), max(h[1], r1))


def unit_arrays(plan: Plan, unit: UnitSpec, source: PretrainedSource, sources: dict) -> dict:
  """The unit's stored arrays (``{leaf id or "flat": jax.Array}``, as
  ``layout.pack_unit`` lays them out), this process's shards read from the
  checkpoint; leaves without a source are zeros there (the caller merges
  ``init_fn``'s values in).

  Shard by shard: each of this process's shards takes the rows of each
  leaf it holds, is moved to its devices and dropped. A leaf's rows that any
  of the process's shards needs are read once (a slice of the file) and
  kept until the next leaf, so the host holds one shard and one leaf's rows
  beyond what is on the devices, and the process reads its own devices'
  rows."""
  sharding = plan.sharding(plan.spec_for(unit))
  p = len(plan.prefix(unit))  # the sharded axis: after a stacked unit's layer axis
  tensor = plan.tensor_size(unit)

  def within(ranges, shape):
    """``(tensor slice, start, stop)`` of a shard along the sharded axis,
    within its tensor slice's layout (a tensor-parallel unit stacks T)."""
    size = shape[p] // tensor
    t = ranges[p][0] // size
    key = t if unit.tensor else None
    return key, ranges[p][0] - t * size, ranges[p][1] - t * size

  if plan.use_orig_params:
    out = {}
    for i in unit.leaf_ids:
      leaf, src = plan.leaves[i], sources.get(i)
      shape = plan.storage_shape_of_leaf(leaf)
      spans = {}
      for ranges, _ in _groups(sharding, shape):
        t, a, b = within(ranges, shape)
        b = min(b, leaf.dim0)
        if src is not None and b > a:
          _hull(spans, i if t is None else (i, t), a, b)
      rows = _LeafRows(plan, unit, source, sources, spans)

      def fill(ranges, lshape, leaf=leaf, i=i, rows=rows, shape=shape):
        part = np.zeros(lshape, np.dtype(leaf.dtype))
        t, a, b = within(ranges, shape)
        b = min(b, leaf.dim0)
        if (i if t is None else (i, t)) in rows.hulls and b > a:
          files.copy_into(part[(slice(None),) * p + (slice(0, b - a),)],
                rows(i, a, b, t).reshape(lshape[:p] + (b - a,) + lshape[p + 1:]))
        return part

      out[i] = _build(shape, sharding, fill)
    return out

  shape = plan.storage_shape_of_unit(unit)
  dtype = np.dtype(plan.unit_dtype(unit))
  spans = []  # (leaf id, first flat element, elements per layer, elements per row)
  start = 0
  for i in unit.leaf_ids:
    leaf = plan.leaves[i]
    spans.append((i, start, leaf.layer_numel, max(1, leaf.row_numel)))
    start += leaf.layer_numel

  def pieces(a, b):
    """``(leaf id, lo, hi, r0, r1)``: the shard's elements ``lo:hi`` of the
    unit's flat axis (of its tensor slice's layout) are rows ``r0:r1`` of the
    leaf (trimmed)."""
    for i, s, n, row in spans:
      lo, hi = max(a, s), min(b, s + n)
      if i in sources and hi > lo:
        yield i, s, lo, hi, (lo - s) // row, -(-(hi - s) // row), row

  hulls: dict = {}
  for ranges, _ in _groups(sharding, shape):
    t, a, b = within(ranges, shape)
    for i, _, _, _, r0, r1, _ in pieces(a, b):
      _hull(hulls, i if t is None else (i, t), r0, r1)
  rows = _LeafRows(plan, unit, source, sources, hulls)

  def fill(ranges, lshape):
    part = np.empty(lshape, dtype)
    t, a, b = within(ranges, shape)
    done = a  # elements before it are written; the gaps (no source, padding) are zeros
    for i, s, lo, hi, r0, r1, row in pieces(a, b):
      part[..., done - a:lo - a] = 0
      _put(part, a, s, lo, hi, row, rows(i, r0, r1, t), r0, r1)
      done = hi
    part[..., done - a:] = 0
    return part

  return {"flat": _build(shape, sharding, fill)}


def covered_mask(plan: Plan, unit: UnitSpec, sources: dict) -> dict:
  """Like :func:`unit_arrays`, booleans: where the checkpoint covers."""
  sharding = plan.sharding(plan.spec_for(unit))
  if plan.use_orig_params:
    out = {}
    for i in unit.leaf_ids:
      shape = plan.storage_shape_of_leaf(plan.leaves[i])
      out[i] = _build(shape, sharding, lambda _, lshape, i=i: np.full(lshape, i in sources))
    return out
  shape = plan.storage_shape_of_unit(unit)
  p = len(plan.prefix(unit))
  tensor = plan.tensor_size(unit)
  flags = np.zeros(shape[p] // tensor, bool)
  s = 0
  for i in unit.leaf_ids:
    n = plan.leaves[i].layer_numel
    flags[s:s + n] = i in sources
    s += n
  flags = np.tile(flags, tensor)  # the same leaves in every tensor slice
  return {"flat": _build(shape, sharding, lambda ranges, lshape: np.broadcast_to(
      flags[ranges[p][0]:ranges[p][1]], lshape).copy())}


def ignored_arrays(plan: Plan, source: PretrainedSource, sources: dict) -> dict:
  """Ignored leaves with a source: ``{leaf id: (world, *shape) array}``,
  every device holding the whole leaf."""
  sharding = plan.sharding(plan.ignored_spec())
  out = {}
  for l in plan.ignored_leaves:
    src = sources.get(l.index)
    if src is None:
      continue
    shape = (plan.axes.world_size,) + tuple(l.shape)
    full = source.read_leaf(src, (), l.dtype)
    out[l.index] = _build(shape, sharding,
                          lambda _, lshape, full=full: np.broadcast_to(full, lshape).copy())
  return out


def merge(loaded: dict, init: dict, mask: dict) -> dict:
  """``where(mask, loaded, init)`` array by array, shard by shard."""
  return {k: jax.jit(jnp.where)(mask[k], loaded[k], init[k]) for k in loaded}


def load(path, weight_map: WeightMap, *, strict: bool = True) -> PretrainedSource:
  """A pretrained checkpoint to start from: pass it as
  ``fsdp_jax.init_train_state(init_fn=..., pretrained=...)``.

  Reads headers only. The tree, shapes and dtypes of the parameters come
  from ``init_fn`` (traced abstractly: a loaded leaf is never computed); the
  values come from the checkpoint, converted to each leaf's dtype (a bf16
  checkpoint into fp32 masters). Each device's shard is read from the file
  as a slice, so no host holds the whole model; in a multi-process run each
  process reads only what its devices hold. The optimizer state is
  initialised from the loaded parameters.

  With ``FSDPConfig(lora=...)`` the rules name the model's own parameters:
  a target kernel's rule loads its frozen base (for QLoRA, each device's
  rows are quantized as they are read, with the function
  ``init_train_state`` applies to ``init_fn``'s kernel), and its
  ``lora_A`` / ``lora_B``, which a base checkpoint does not have, keep
  ``init_fn``'s initialisation (``strict`` does not ask for them).

  Args:
    path: a ``.safetensors`` file; a directory of them, with or without
      ``model.safetensors.index.json`` (Hugging Face's ``save_pretrained``
      layout); or a PyTorch state dict (``.bin`` / ``.pt``, read with
      ``torch.load(weights_only=True, mmap=True)``; needs torch).
    weight_map: the :class:`WeightMap` from checkpoint names to parameters.
    strict: every checkpoint tensor must be covered by a rule (or dropped
      by one) and every parameter loaded. ``strict=False`` keeps
      ``init_fn``'s values for the parameters no rule loads (a new head)
      and ignores tensors no rule covers.

  Returns:
    A :class:`PretrainedSource`. Problems (a tensor no rule covers, a shape
    or dtype that does not fit, a parameter the model lacks) are raised by
    ``init_train_state``, all of them in one error.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, fsdp_jax, tempfile, os
    >>> from fsdp_jax import pretrained
    >>> from safetensors.numpy import save_file
    >>> path = os.path.join(tempfile.mkdtemp(), "model.safetensors")
    >>> save_file({"fc.weight": np.arange(6, dtype=np.float32).reshape(2, 3)}, path)
    >>> source = pretrained.load(path, pretrained.WeightMap(
    ...     [("fc.weight", "dense.kernel", pretrained.transpose())]))
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(
    ...     init_fn=lambda: {"dense": {"kernel": jnp.zeros((3, 2))}}, optimizer=optax.sgd(0.1),
    ...     mesh=mesh, config=fsdp_jax.FSDPConfig(), pretrained=source)
    >>> fsdp_jax.summon_full_params(state)["dense"]["kernel"].tolist()
    [[0.0, 3.0], [1.0, 4.0], [2.0, 5.0]]
  """
  return PretrainedSource(path, weight_map, strict=strict)
