"""LoRA adapters in PEFT's format: :func:`save_adapter` writes a LoRA
state's factors as ``adapter_model.safetensors`` and ``adapter_config.json``
(what ``peft.PeftModel.from_pretrained`` reads), :func:`load_adapter` reads
such a directory back into a LoRA state.

PEFT adapts a PyTorch weight ``W`` ``[out, in]`` by ``(alpha / r) *
lora_B.weight @ lora_A.weight`` (``[out, r] @ [r, in]``); the state adapts
the model's kernel (``[m, n]``, the checkpoint tensor through the WeightMap's
transforms) by ``(alpha / r) * A @ B``; an N-D kernel ``[*in, *out]`` is
seen as ``[prod(in), prod(out)]`` (its factors ``[*in, r]`` and ``[r, *out]``
flattened). The map's inverse transforms must take a kernel to the 2-D
checkpoint tensor by permuting (and possibly swapping) those two axes, each
on its own: transposes, rotary permutations and reshapes that keep the axes
(e.g. ``[d, heads, head_dim]`` from a ``[heads * head_dim, d]`` weight) do. Which ones it does is found by running the inverse
on a matrix of element indices, so the factors are exact permutations of
each other's rows (a round trip is bitwise).

Fused tensors (``split`` / ``concat`` rules): the targets that are parts of
one checkpoint module are one PEFT module, their factors stacked along the
rank in blocks (rank ``m * r`` and alpha ``m * alpha`` in
``rank_pattern`` / ``alpha_pattern``: the scale stays ``alpha / r``); an
adapter PEFT trained on the fused module (rank ``r``) is read with its
``lora_A`` shared by the parts. A target joined from several checkpoint
modules gives each of them the shared factor and its slice of the other.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Optional

import jax
import numpy as np

from fsdp_jax._src import mesh as mesh_lib
from fsdp_jax._src import layout, offload
from fsdp_jax._src.pretrained import files
from fsdp_jax._src.pretrained.loading import Adapted, adapted_leaves
from fsdp_jax._src.pretrained.saving import (_barrier, _publish, _shared_tmp, find_match,
                                             find_rule, full_leaves)
from fsdp_jax._src.pretrained.weight_map import Chain, WeightMap
from fsdp_jax._src.state import ShardedTrainState
from fsdp_jax._src.state_dicts import convert

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
CONFIG_FILE = "adapter_config.json"
PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class FactorLayout:
  """How a kernel ``[m, n]`` sits in its checkpoint tensor ``[out, in]``:
  ``ckpt[p, q] = kernel[rows[p], cols[q]]``, or with ``transposed``
  ``ckpt[p, q] = kernel[rows[q], cols[p]]``."""

  transposed: bool
  rows: np.ndarray  # positions along the kernel's axis 0
  cols: np.ndarray  # positions along the kernel's axis 1

  def to_peft(self, a: np.ndarray, b: np.ndarray) -> tuple:
    """Our ``A`` ``[m, r]``, ``B`` ``[r, n]`` -> PEFT's ``(lora_A.weight
    [r, in], lora_B.weight [out, r])``."""
    if self.transposed:  # ckpt = (A[rows] @ B[:, cols]).T
      return a[self.rows].T, b[:, self.cols].T
    return b[:, self.cols], a[self.rows]

  def from_peft(self, lora_a: np.ndarray, lora_b: np.ndarray, m: int, n: int, dtype) -> tuple:
    """The inverse of :meth:`to_peft`."""
    r = lora_a.shape[0]
    a, b = np.empty((m, r), dtype), np.empty((r, n), dtype)
    if self.transposed:
      a[self.rows], b[:, self.cols] = lora_a.T, lora_b.T
    else:
      a[self.rows], b[:, self.cols] = lora_b, lora_a
    return a, b


def factor_layout(chain: Chain, kernel_shape: tuple, checkpoint_shape: tuple,
                  what: str, out_dims: int = 1) -> FactorLayout:
  """Runs the inverse of ``chain`` on a kernel of element indices (its last
  ``out_dims`` dimensions the output ones) and reads off how it permutes the
  kernel's input and output axes, or a ``ValueError`` naming the chain when
  it mixes them (or is not a permutation)."""
  kernel_shape = tuple(kernel_shape)
  k = len(kernel_shape) - out_dims
  m, n = math.prod(kernel_shape[:k]), math.prod(kernel_shape[k:])
  fix = ("PEFT adapts a 2-D [out, in] weight, so the transforms between it and the kernel "
         "may only transpose the two axes and permute each (transpose(), "
         "rope_interleave(...), or a reshape that keeps both axes, an N-D kernel's input "
         "dimensions flattened to one and its output dimensions to the other). Fix: narrow "
         "LoRA(targets=...) to such kernels (or LoRA(input_dims=...) to the kernel's input "
         "dimensions), or save the merged model with pretrained.save(state, ...).")
  if len(checkpoint_shape) != 2:
    raise ValueError(f"{what}: its checkpoint tensor has shape {list(checkpoint_shape)}, "
                     f"not 2-D. {fix}")
  index = np.arange(m * n, dtype=np.int64 if m * n >= 2**31 else np.int32)
  try:
    c = np.asarray(chain.to_checkpoint(index.reshape(kernel_shape), tuple(checkpoint_shape)))
  except (ValueError, TypeError) as e:
    raise ValueError(f"{what}: the inverse of {chain} fails on the kernel "
                     f"{list(kernel_shape)} ({e}). {fix}") from None
  ok = c.shape == tuple(checkpoint_shape)
  if ok and not np.issubdtype(c.dtype, np.integer):
    ok = bool(np.all(np.isfinite(c)) and np.all(c == np.round(c)))
    c = c.astype(np.int64) if ok else c
  if ok:
    flat = c.reshape(-1)
    ok = flat.size == m * n and flat.min() >= 0 and flat.max() < m * n
    if ok:
      seen = np.zeros(m * n, bool)
      seen[flat] = True
      ok = bool(seen.all())
  if not ok:
    raise ValueError(f"{what}: the inverse of {chain} does not move the kernel's elements "
                     f"as a permutation. {fix}")
  rows, cols = np.divmod(c, n)
  if np.all(rows == rows[:, :1]) and np.all(cols == cols[:1, :]):
    return FactorLayout(False, rows[:, 0].copy(), cols[0, :].copy())
  if np.all(rows == rows[:1, :]) and np.all(cols == cols[:, :1]):
    return FactorLayout(True, rows[0, :].copy(), cols[:, 0].copy())
  raise ValueError(f"{what}: the inverse of {chain} mixes the kernel's axes (an element's "
                   f"row in the checkpoint depends on both of its kernel indices). {fix}")


@dataclasses.dataclass(frozen=True)
class _Place:
  """Where a piece of a target sits in a PEFT module, along ``axis`` of
  PyTorch's ``[out, in]`` view (0: out, 1: in): the piece's elements
  ``start:stop`` are the module's ``at:until``."""

  module: str
  axis: int
  start: int
  stop: int
  at: int
  until: int


@dataclasses.dataclass(frozen=True)
class _Piece:
  """One LoRA target (one layer of a stacked one) as PEFT sees it: its
  kernel's factors in PyTorch's ``[out, in]`` view of the tensor it maps to
  (``layout``), and where that view sits in PEFT's modules (one module; a
  part of a fused one for a :func:`split` rule; several for a
  :func:`concat` rule)."""

  target: Adapted
  layer: Optional[int]
  layout: FactorLayout
  places: tuple


@dataclasses.dataclass
class _PeftModule:
  """One PEFT-adapted module: the pieces in it, its ``[out, in]`` shape,
  and its rank (the LoRA rank times the number of pieces it stacks)."""

  name: str
  shape: tuple
  members: list  # [(piece, place)], in the order their factors stack

  @property
  def keys(self) -> tuple:
    return (f"{PREFIX}{self.name}.lora_A.weight", f"{PREFIX}{self.name}.lora_B.weight")

  def to_peft(self, factors: dict, rank: int) -> tuple:
    """PEFT's ``(lora_A.weight, lora_B.weight)`` of the module from each
    member's ``[out, in]``-view factors ``{id(piece): (a [r, in], b [out, r])}``:
    stacked along the rank, each in its own block."""
    m = len(self.members)
    out_dim, in_dim = self.shape
    first = factors[id(self.members[0][0])][0]
    lora_a = np.zeros((m * rank, in_dim), first.dtype)
    lora_b = np.zeros((out_dim, m * rank), first.dtype)
    for j, (piece, pl) in enumerate(self.members):
      a, b = factors[id(piece)]
      r = slice(j * rank, (j + 1) * rank)
      if pl.axis == 0:
        lora_a[r] = a
        lora_b[pl.at:pl.until, r] = b[pl.start:pl.stop]
      else:
        lora_a[r, pl.at:pl.until] = a[:, pl.start:pl.stop]
        lora_b[:, r] = b
    return lora_a, lora_b

  def blocks(self, lora_a: np.ndarray, lora_b: np.ndarray, rank: int) -> tuple:
    """The inverse of :meth:`to_peft`: ``[(piece, place, a, b)]``, each
    member's block. Factors of the LoRA rank itself (an adapter PEFT
    trained on the fused module) are shared: each member takes the shared
    factor and its own rows (or columns) of the other. A ``ValueError``
    where the factors reach parts that are not LoRA targets."""
    shared = lora_a.shape[0] == rank
    out, mask_a, mask_b = [], np.zeros(lora_a.shape, bool), np.zeros(lora_b.shape, bool)
    for j, (piece, pl) in enumerate(self.members):
      r = slice(0, rank) if shared else slice(j * rank, (j + 1) * rank)
      if pl.axis == 0:
        out.append((piece, pl, lora_a[r], lora_b[pl.at:pl.until, r]))
        mask_a[r] = True
        mask_b[pl.at:pl.until, r] = True
      else:
        out.append((piece, pl, lora_a[r, pl.at:pl.until], lora_b[:, r]))
        mask_a[r, pl.at:pl.until] = True
        mask_b[:, r] = True
    if np.any(lora_a[~mask_a]) or np.any(lora_b[~mask_b]):
      raise ValueError(
          f"the factors of module {self.name!r} reach parts of it that are not LoRA targets "
          f"(the state adapts {sorted({p.target.name for p, _ in self.members})}), or mix "
          "its parts: separate LoRA targets cannot hold them exactly")
    return out


def _require_lora(state, fn: str):
  plan = getattr(state, "plan", None)
  if plan is None or plan.config.lora is None:
    raise ValueError(
        f"{fn}: the state has no LoRA adapters (its FSDPConfig has lora=None). Fix: build "
        "the state with FSDPConfig(lora=fsdp_jax.LoRA(targets=..., rank=...)); to save "
        "every parameter, use pretrained.save(state, directory, weight_map).")
  return plan


def _module_name(name: str, target: str, fn: str) -> str:
  if not name.endswith(".weight"):
    raise ValueError(
        f"{fn}: LoRA target {target!r} maps to checkpoint tensor {name!r}, which is not a "
        "module's '.weight'; PEFT adapts modules (e.g. 'model.layers.0.self_attn."
        "q_proj.weight'). Fix: narrow LoRA(targets=...) to linear layers' kernels.")
  return name[:-len(".weight")]


def _modules(plan, weight_map: WeightMap, fn: str) -> list:
  """Every target's PEFT modules (:class:`_PeftModule`), in stored order."""
  if not isinstance(weight_map, WeightMap):
    raise TypeError(f"{fn}: weight_map must be a fsdp_jax.pretrained.WeightMap, got "
                    f"{type(weight_map).__name__}.")
  short = all(l.name.startswith("params.") for l in plan.leaves)
  targets = adapted_leaves(plan)
  shapes = {l.name: tuple(l.shape) for l in plan.leaves}
  shapes.update({t.name: tuple(t.shape) for t in targets})
  fif = weight_map.fan_in_fan_out
  modules: dict = {}
  layouts: dict = {}
  for t in targets:
    found = find_match(weight_map, t.name, short)
    if found is None:
      raise ValueError(
          f"{fn}: no rule of the WeightMap maps LoRA target {t.name!r} (shape "
          f"{list(t.shape)}) to a checkpoint tensor. Fix: pass the WeightMap the base model "
          "was loaded with (a rule whose parameter pattern matches it).")
    rule, values, k = found
    stack = rule.stack_axis_name
    layers = [None] if stack is None else list(range(t.shape[0]))
    kernel = tuple(t.shape[t.lead:])
    if stack is None and t.lead:
      raise ValueError(
          f"{fn}: LoRA target {t.name!r} has shape {list(t.shape)} (stacked layers) but rule "
          f"{rule.describe()} maps it to one checkpoint tensor; PEFT adapts one 2-D weight "
          "per module. Fix: map one checkpoint tensor per layer (a '{i}' placeholder in the "
          "checkpoint pattern only).")
    ckpt = rule.chain.checkpoint_shape(kernel)
    key = (id(rule), kernel)
    if key not in layouts:
      first = values if stack is None else {**values, stack: 0}
      lay = factor_layout(rule.chain, kernel, ckpt,
                          f"LoRA target {t.name!r} -> {rule.checkpoint_name(first)!r}",
                          t.out_dims)
      layouts[key] = FactorLayout(not lay.transposed, lay.rows, lay.cols) if fif else lay
    view = tuple(reversed(ckpt)) if fif else tuple(ckpt)  # PyTorch's [out, in]
    axis = None
    if rule.fuse is not None:
      axis = 1 - rule.fuse.axis if fif else rule.fuse.axis
      if rule.fuse.axis > 1:
        raise ValueError(f"{fn}: LoRA target {t.name!r}: rule {rule.describe()} cuts along "
                         f"axis {rule.fuse.axis} of a 2-D weight.")
    for layer in layers:
      vals = values if layer is None else {**values, stack: layer}
      if rule.fuse is None:
        name = _module_name(rule.checkpoint_name(vals), t.name, fn)
        places = (_Place(name, 0, 0, view[0], 0, view[0]),)
        sizes = {name: view}
      elif rule.fuse.kind == "split":
        name = _module_name(rule.checkpoint_name(vals), t.name, fn)
        extents = []
        for j, pattern in enumerate(rule.params):
          part = rule.param_name(values, j)
          if part not in shapes:
            raise ValueError(f"{fn}: rule {rule.describe()} cuts {name!r} into parameters the "
                             f"model lacks ({part!r}).")
          shape = shapes[part][1:] if stack is not None else shapes[part]
          extents.append(rule.chain.checkpoint_shape(tuple(shape))[rule.fuse.axis])
        at = sum(extents[:k])
        places = (_Place(name, axis, 0, view[axis], at, at + view[axis]),)
        full = list(view)
        full[axis] = sum(extents)
        sizes = {name: tuple(full)}
      else:
        bounds = rule.fuse.bounds(ckpt[rule.fuse.axis], len(rule.checkpoints), t.name)
        places, sizes = [], {}
        for j, (a, b) in enumerate(bounds):
          name = _module_name(rule.checkpoint_name(vals, j), t.name, fn)
          places.append(_Place(name, axis, a, b, 0, b - a))
          part = list(view)
          part[axis] = b - a
          sizes[name] = tuple(part)
        places = tuple(places)
      piece = _Piece(t, layer, layouts[key], places)
      for pl in places:
        mod = modules.setdefault(pl.module, _PeftModule(pl.module, sizes[pl.module], []))
        mod.members.append((piece, pl))
  for mod in modules.values():  # the fused tensor's parts in their order
    mod.members.sort(key=lambda e: e[1].at)
  return list(modules.values())


def _pieces(modules: list) -> list:
  """The distinct pieces of ``modules``, in order."""
  seen, out = set(), []
  for mod in modules:
    for piece, _ in mod.members:
      if id(piece) not in seen:
        seen.add(id(piece))
        out.append(piece)
  return out


def _trainable(plan, weight_map: WeightMap, fn: str) -> list:
  """``[(leaf id, layer or None, checkpoint name, chain, checkpoint
  shape)]`` of the leaves ``LoRA(trainable=...)`` trains (PEFT's
  ``modules_to_save``)."""
  adapted = adapted_leaves(plan)
  factors = {j for t in adapted for j in (t.lora_A, t.lora_B)}
  short = all(l.name.startswith("params.") for l in plan.leaves)
  out = []
  for leaf in plan.leaves:
    if leaf.frozen or leaf.index in factors:
      continue
    found = find_rule(weight_map, leaf.name, short)
    if found is None:
      raise ValueError(
          f"{fn}: no rule of the WeightMap maps the trainable parameter {leaf.name!r} "
          "(LoRA(trainable=...); PEFT's modules_to_save) to a checkpoint tensor. Fix: add a "
          "rule for it, or drop it from LoRA(trainable=...).")
    rule, values = found
    stack = rule.stack_axis_name
    if stack is None:
      out.append((leaf.index, None, rule.checkpoint_name(values), rule.chain,
                  rule.chain.checkpoint_shape(tuple(leaf.shape))))
    else:
      shape = rule.chain.checkpoint_shape(tuple(leaf.shape[1:]))
      out.extend((leaf.index, k, rule.checkpoint_name({**values, stack: k}), rule.chain, shape)
                 for k in range(leaf.shape[0]))
  return out


def _module_of(tensor: str) -> str:
  return tensor.rsplit(".", 1)[0]


def _patterns(modules: list, rank: int, alpha: float) -> tuple:
  """PEFT's ``rank_pattern`` and ``alpha_pattern`` for the modules that
  stack several pieces (rank ``m * r``, alpha ``m * alpha``: the same scale
  ``alpha / r``), keyed by the module's last name where every module of
  that name stacks as many, else by its whole name."""
  by_last: dict = {}
  for mod in modules:
    by_last.setdefault(mod.name.rsplit(".", 1)[-1], set()).add(len(mod.members))
  ranks, alphas = {}, {}
  for mod in modules:
    m = len(mod.members)
    if m == 1:
      continue
    last = mod.name.rsplit(".", 1)[-1]
    key = last if by_last[last] == {m} else re.escape(mod.name)
    ranks[key] = m * rank
    alphas[key] = m * alpha
  return ranks, alphas


def _adapter_config(lora, modules: list, saved: list, task_type, base_model,
                    fan_in_fan_out: bool) -> dict:
  leaf_names = sorted({m.name.rsplit(".", 1)[-1] for m in modules})
  to_save = sorted({_module_of(e[2]) for e in saved}) or None
  ranks, alphas = _patterns(modules, lora.rank, lora.alpha)
  return {
      "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model,
      "revision": None, "inference_mode": True, "r": lora.rank,
      "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": leaf_names,
      "bias": "none", "fan_in_fan_out": fan_in_fan_out, "modules_to_save": to_save,
      "init_lora_weights": True, "use_rslora": False, "use_dora": False,
      "layers_to_transform": None, "layers_pattern": None, "rank_pattern": ranks,
      "alpha_pattern": alphas,
  }


@mesh_lib.own_mesh
def save_adapter(state: ShardedTrainState, directory, weight_map: WeightMap, *,
                 task_type: Optional[str] = "CAUSAL_LM",
                 base_model_name_or_path: Optional[str] = None, dtype=None,
                 overwrite: bool = False) -> list[str]:
  """Writes the LoRA adapters of ``state`` in PEFT's format, for
  ``peft.PeftModel.from_pretrained(base_model, directory)``.

  ``adapter_model.safetensors`` holds, for each target (each layer of a
  stacked one), ``base_model.model.<module>.lora_A.weight`` ``[rank, in]``
  and ``.lora_B.weight`` ``[out, rank]`` in PyTorch's layout, ``<module>``
  being the target's checkpoint tensor name without ``.weight``: the
  factors go through the inverse of the WeightMap's transforms, so that
  ``lora_B.weight @ lora_A.weight`` is the checkpoint-layout image of ``A @
  B``. The leaves ``LoRA(trainable=...)`` trains are written whole, under
  their checkpoint names (PEFT's ``modules_to_save``). ``adapter_config.json``
  holds ``peft_type: "LORA"``, ``r``, ``lora_alpha``, ``lora_dropout``,
  ``target_modules`` (the modules' last names, e.g. ``["q_proj",
  "v_proj"]``), ``modules_to_save``, ``task_type`` and
  ``base_model_name_or_path``.

  Args:
    state: a state built with ``FSDPConfig(lora=...)``.
    directory: where to write; it must not exist unless ``overwrite``. It
      appears whole or not at all.
    weight_map: the :class:`WeightMap` the base model was loaded with.
    task_type: PEFT's task type (``"CAUSAL_LM"``, ``"SEQ_CLS"``, ...; None
      for a bare ``PeftModel``).
    base_model_name_or_path: recorded in ``adapter_config.json``.
    dtype: the factors' dtype in the file (default: as stored).
    overwrite: replace an existing directory once the new one is complete.

  Returns:
    The files written. Every process must call it (process 0 writes).

  Raises:
    ValueError: for a state without LoRA, a target no rule maps, or a
      target whose transforms mix its axes (PEFT's factors cannot express
      it; ``pretrained.save`` writes the merged model instead).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax, json, os, tempfile
    >>> from fsdp_jax import pretrained
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(
    ...     params={"fc": {"kernel": jnp.ones((6, 4))}}, optimizer=optax.sgd(0.1), mesh=mesh,
    ...     config=fsdp_jax.FSDPConfig(lora=fsdp_jax.LoRA(targets=("fc",), rank=2)))
    >>> wm = pretrained.WeightMap([("fc.weight", "fc.kernel", pretrained.transpose())])
    >>> out = os.path.join(tempfile.mkdtemp(), "adapter")
    >>> [os.path.basename(f) for f in pretrained.save_adapter(state, out, wm)]
    ['adapter_model.safetensors', 'adapter_config.json']
    >>> from safetensors.numpy import load_file
    >>> {k: v.shape for k, v in load_file(os.path.join(out, "adapter_model.safetensors")).items()}
    {'base_model.model.fc.lora_A.weight': (2, 6), 'base_model.model.fc.lora_B.weight': (4, 2)}
    >>> json.load(open(os.path.join(out, "adapter_config.json")))["target_modules"]
    ['fc']
  """
  plan = _require_lora(state, "save_adapter")
  lora = plan.config.lora
  directory = os.path.abspath(os.fspath(directory))
  if os.path.exists(directory) and not overwrite:
    raise FileExistsError(
        f"save_adapter: {directory} exists. Fix: pick a new directory, or pass "
        "overwrite=True (the old one is replaced once the new one is complete).")
  modules = _modules(plan, weight_map, "save_adapter")
  saved = _trainable(plan, weight_map, "save_adapter")
  clash = {_module_of(e[2]) for e in saved} & {m.name for m in modules}
  if clash:
    raise ValueError(
        f"save_adapter: module(s) {sorted(clash)} are both LoRA targets and trained whole "
        "(LoRA(trainable=...)); PEFT's modules_to_save cannot hold an adapted module. Fix: "
        "drop them from LoRA(trainable=...) or from targets.")
  pieces = _pieces(modules)
  ids = {j for p in pieces for j in (p.target.lora_A, p.target.lora_B)} | {e[0] for e in saved}
  leaves = full_leaves(plan, convert.split_storage(plan, state.params),
                       convert.ignored_entries(plan, state.params), ids, {})
  factors = {}
  for p in pieces:
    pick = (lambda x: x) if p.layer is None else (lambda x, k=p.layer: x[k])
    a, b = pick(leaves[p.target.lora_A]), pick(leaves[p.target.lora_B])
    factors[id(p)] = p.layout.to_peft(a.reshape(-1, a.shape[-1]), b.reshape(b.shape[0], -1))
  tensors = []  # (name, array)
  for mod in modules:
    tensors += list(zip(mod.keys, mod.to_peft(factors, lora.rank)))
  for i, layer, name, chain, shape in saved:
    value = leaves[i] if layer is None else leaves[i][layer]
    tensors.append((PREFIX + name, chain.to_checkpoint(value, shape)))
  written = [os.path.join(directory, ADAPTER_FILE), os.path.join(directory, CONFIG_FILE)]
  tmp = _shared_tmp(directory)
  if jax.process_index() == 0:
    path = os.path.join(tmp, ADAPTER_FILE)
    entries = [(k, np.dtype(dtype) if dtype is not None else v.dtype, v.shape)
               for k, v in tensors]
    writer = files.SafetensorsWriter(path, entries, {"format": "pt"})
    for k, v in tensors:
      writer.write(k, v)
    writer.close()
    files.check_readable(path)
    config = _adapter_config(lora, modules, saved, task_type, base_model_name_or_path,
                             weight_map.fan_in_fan_out)
    with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
      json.dump(config, f, indent=2, sort_keys=True)
  _barrier("fsdp_jax.pretrained.save_adapter")
  if jax.process_index() == 0:
    _publish(tmp, directory)
  _barrier("fsdp_jax.pretrained.save_adapter.done")
  return written


def _pattern_value(pattern: dict, name: str, default):
  """PEFT's lookup of a module's entry in ``rank_pattern`` /
  ``alpha_pattern`` (``peft.utils.other.get_pattern_key``)."""
  for key, value in (pattern or {}).items():
    if re.match(rf"(.*\.)?({key})$", name):
      return value
  return default


def _read_config(directory: str, lora, sample: str, modules: list,
                 fan_in_fan_out: bool) -> dict:
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.exists(path):
    raise ValueError(f"load_adapter: {directory} holds no {CONFIG_FILE}: not a PEFT adapter "
                     "directory. Fix: pass the directory save_adapter (or PEFT's "
                     "save_pretrained) wrote.")
  with open(path) as f:
    config = json.load(f)
  fix = "Fix: build the state with FSDPConfig(lora=fsdp_jax.LoRA(..., {}))."
  if config.get("peft_type", "LORA") != "LORA":
    raise ValueError(f"load_adapter: {path} is a {config.get('peft_type')} adapter, not LoRA.")
  r = config.get("r", 8)  # PEFT's defaults
  if r != lora.rank:
    raise ValueError(
        f"load_adapter: the adapter has rank r={r} ({path}{sample}) but the "
        f"state's LoRA has rank={lora.rank}. " + fix.format(f"rank={r}"))
  alpha = config.get("lora_alpha", 8)
  if not isinstance(alpha, (int, float)) or float(alpha) != lora.alpha:
    raise ValueError(
        f"load_adapter: the adapter has lora_alpha={alpha} ({path}) but the state's LoRA has "
        f"alpha={lora.alpha:g}: the scale alpha / r would differ. "
        + fix.format(f"alpha={alpha}"))
  unsupported = [("use_rslora", "rank-stabilised scaling"), ("use_dora", "DoRA")]
  if not fan_in_fan_out:  # [in, out] weights need a WeightMap(fan_in_fan_out=True)
    unsupported.append(("fan_in_fan_out", "[in, out] (Conv1D) weights"))
  for key, what in unsupported:
    if config.get(key):
      raise ValueError(f"load_adapter: {path} sets {key}={config[key]!r} ({what}), which "
                       "fsdp_jax's LoRA does not have. Fix: train the adapter without it.")
  # Per-module ranks and alphas: only those of modules fused from several
  # targets (m pieces: rank m * r, alpha m * alpha, the same scale).
  # A PEFT-trained adapter of a fused module has the rank itself (shared).
  for mod in modules:
    m = len(mod.members)
    got = (_pattern_value(config.get("rank_pattern"), mod.name, r),
           _pattern_value(config.get("alpha_pattern"), mod.name, alpha))
    if (got[0], float(got[1])) not in ((m * lora.rank, m * lora.alpha),
                                       (lora.rank, lora.alpha)):
      raise ValueError(
          f"load_adapter: {path} gives module {mod.name!r} rank {got[0]} and alpha {got[1]} "
          f"(rank_pattern / alpha_pattern), but the state holds it as {m} LoRA target(s) of "
          f"rank {lora.rank}, alpha {lora.alpha:g} (rank {m * lora.rank}, alpha "
          f"{m * lora.alpha:g}). Fix: load an adapter save_adapter wrote for these targets, or "
          "train the adapter without per-module ranks.")
  return config


def _open(directory: str):
  for name in (ADAPTER_FILE, ADAPTER_BIN):
    path = os.path.join(directory, name)
    if os.path.exists(path):
      return files.open_checkpoint(path)
  raise ValueError(f"load_adapter: {directory} holds neither {ADAPTER_FILE} nor "
                   f"{ADAPTER_BIN}. Fix: pass the directory save_adapter (or PEFT's "
                   "save_pretrained) wrote.")


@mesh_lib.own_mesh
def load_adapter(state: ShardedTrainState, directory, weight_map: WeightMap
                 ) -> ShardedTrainState:
  """Reads a PEFT LoRA adapter (what :func:`save_adapter` or PEFT's
  ``save_pretrained`` writes) into a LoRA state: returns the state with its
  ``lora_A`` / ``lora_B`` (and the leaves ``LoRA(trainable=...)`` trains,
  from PEFT's ``modules_to_save``, where the adapter holds them) replaced,
  sharded as before. The factors go through the WeightMap's transforms, the
  inverse of :func:`save_adapter`, so a round trip is exact.

  The optimizer state is left as it is (its moments belong to the old
  factors: start a fresh state's optimizer, or keep training with them
  knowingly); the frozen base is untouched.

  Args:
    state: a state built with ``FSDPConfig(lora=...)`` whose targets,
      ``rank`` and ``alpha`` are the adapter's.
    directory: the adapter's directory (``adapter_config.json`` and
      ``adapter_model.safetensors`` or ``adapter_model.bin``).
    weight_map: the :class:`WeightMap` the base model was loaded with.

  Raises:
    ValueError: naming the tensor, its shape and the fix: a rank or alpha
      that is not the state's, a target's tensors missing from the adapter,
      adapter tensors for a module the state does not adapt.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax, os, tempfile
    >>> from fsdp_jax import pretrained
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> config = fsdp_jax.FSDPConfig(lora=fsdp_jax.LoRA(targets=("fc",), rank=2))
    >>> params = {"fc": {"kernel": jnp.ones((6, 4))}}
    >>> one = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
    ...                                 config=config, rng=jax.random.key(1))
    >>> bump = lambda w: w.replace(lora_B=w.lora_B + 1.0)  # as if trained: B != 0
    >>> one = fsdp_jax.write_full_params(one, lambda p: {"fc": {"kernel": bump(p["fc"]["kernel"])}})
    >>> wm = pretrained.WeightMap([("fc.weight", "fc.kernel", pretrained.transpose())])
    >>> out = os.path.join(tempfile.mkdtemp(), "adapter")
    >>> _ = pretrained.save_adapter(one, out, wm)
    >>> two = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
    ...                                 config=config, rng=jax.random.key(2))
    >>> merged = lambda s: fsdp_jax.summon_full_params(s)["fc"]["kernel"]
    >>> bool((merged(two) == merged(one)).all())  # another A
    False
    >>> two = pretrained.load_adapter(two, out, wm)
    >>> bool((merged(two) == merged(one)).all())
    True
  """
  plan = _require_lora(state, "load_adapter")
  lora = plan.config.lora
  directory = os.fspath(directory)
  modules = _modules(plan, weight_map, "load_adapter")
  saved = _trainable(plan, weight_map, "load_adapter")
  reader = _open(directory)
  names = set(reader.tensors)
  sample = next((n for n in sorted(names) if ".lora_A." in n), None)
  _read_config(directory, lora, "" if sample is None else
               f"; tensor {sample!r} has shape {list(reader.tensors[sample].shape)}",
               modules, weight_map.fan_in_fan_out)
  problems, missing = [], []
  wanted = set()
  for mod in modules:
    wanted.update(mod.keys)
    rank = len(mod.members) * lora.rank
    first = reader.tensors.get(mod.keys[0])
    if first is not None and len(first.shape) == 2 and first.shape[0] == lora.rank:
      rank = lora.rank  # trained by PEFT on the fused module: one factor shared
    out_dim, in_dim = mod.shape
    for key, want in zip(mod.keys, ((rank, in_dim), (out_dim, rank))):
      if key not in names:
        missing.append(key)
        continue
      got = tuple(reader.tensors[key].shape)
      if got != want:
        owners = sorted({p.target.name for p, _ in mod.members})
        who = (f"LoRA target {owners[0]!r} (rank {lora.rank})" if len(mod.members) == 1 else
               f"module {mod.name!r} (LoRA targets {owners}, rank {lora.rank} each)")
        problems.append(
            f"tensor {key!r} has shape {list(got)}, but {who} needs {list(want)}: "
            + ("the adapter's rank is not the state's; fix: FSDPConfig(lora=LoRA(rank=...)) "
               "with the adapter's rank" if rank not in got or len(got) != 2 else
               "the adapter is for a model of another size; fix: pass the base model the "
               "adapter was trained on"))
  if missing:
    problems.append(
        f"{len(missing)} tensor(s) of the state's LoRA targets are not in the adapter: "
        f"{missing[:8]}{' ...' if len(missing) > 8 else ''}; fix: the state's "
        "LoRA(targets=...) must be the adapter's (its adapter_config.json's target_modules)")
  whole = {PREFIX + e[2]: e for e in saved}
  unknown = sorted(n for n in names if n not in wanted and n not in whole)
  if unknown:
    modules_known = sorted({m.name for m in modules})
    problems.append(
        f"{len(unknown)} adapter tensor(s) are for modules the state does not adapt or "
        f"train: {unknown[:8]}{' ...' if len(unknown) > 8 else ''} (the state adapts "
        f"{modules_known[:6]}{' ...' if len(modules_known) > 6 else ''}); fix: add their "
        "parameters to LoRA(targets=...) (or, for a module trained whole, to "
        "LoRA(trainable=...)), with WeightMap rules for them")
  parts: dict = {}  # id(piece) -> (piece, [(place, a, b)])
  if not problems:
    for mod in modules:
      lora_a, lora_b = (np.asarray(reader.read(k)) for k in mod.keys)
      try:
        blocks = mod.blocks(lora_a, lora_b, lora.rank)
      except ValueError as e:
        problems.append(f"{e}; fix: load the adapter into a model whose parameters are the "
                        "fused module's (or merge it into the base with PEFT first)")
        continue
      for piece, pl, a, b in blocks:
        parts.setdefault(id(piece), (piece, []))[1].append((pl, a, b))
  pieces = {}
  for piece, got in parts.values():
    try:
      pieces[id(piece)] = (piece,) + _join_blocks(piece, got)
    except ValueError as e:
      problems.append(str(e))
  if problems:
    raise ValueError(f"load_adapter: {directory}:\n  - " + "\n  - ".join(problems))
  new: dict = {}
  for piece, lora_a, lora_b in pieces.values():
    t = piece.target
    dtype = np.dtype(plan.leaves[t.lora_A].dtype)
    kernel = tuple(t.shape[t.lead:])
    ins, outs = kernel[:len(kernel) - t.out_dims], kernel[len(kernel) - t.out_dims:]
    a, b = piece.layout.from_peft(lora_a, lora_b, math.prod(ins), math.prod(outs), dtype)
    a, b = a.reshape(ins + (a.shape[-1],)), b.reshape((b.shape[0],) + outs)
    for i, x in ((t.lora_A, a), (t.lora_B, b)):
      if piece.layer is None:
        new[i] = x
      else:
        new.setdefault(i, np.empty(plan.leaves[i].shape, dtype))[piece.layer] = x
  kept = {}
  for i, layer, name, chain, _ in saved:
    if PREFIX + name not in names:
      continue
    value = chain.to_model(np.asarray(reader.read(PREFIX + name)))
    leaf = plan.leaves[i]
    if layer is None:
      kept[i] = np.asarray(value).astype(leaf.dtype)
    else:
      kept.setdefault(i, np.empty(leaf.shape, leaf.dtype))[layer] = value
  new.update(kept)
  return state.replace(params=_replace_leaves(plan, state.params, new))


def _join_blocks(piece: _Piece, got: list) -> tuple:
  """A piece's ``[out, in]``-view factors from its blocks in one or more
  modules (a :func:`concat` rule's parameter spans several: they share one
  factor, which must agree, and the other is joined)."""
  got = sorted(got, key=lambda e: e[0].start)
  axis = got[0][0].axis
  shared = [a if axis == 0 else b for _, a, b in got]
  if any(not np.array_equal(x, shared[0]) for x in shared[1:]):
    raise ValueError(
        f"LoRA target {piece.target.name!r} spans modules {[pl.module for pl, _, _ in got]} "
        "whose adapters differ in their shared factor, which one LoRA target cannot hold; "
        "fix: merge the adapter into the base with PEFT and load the merged model")
  joined = np.concatenate([b if axis == 0 else a for _, a, b in got], axis=0 if axis == 0
                          else 1) if len(got) > 1 else (got[0][2] if axis == 0 else got[0][1])
  return (shared[0], joined) if axis == 0 else (joined, shared[0])


def _replace_leaves(plan, storage, new: dict):
  """The stored params with the full values ``new`` (``{leaf id: numpy
  array}``) written in: each unit holding one of them is gathered, updated
  and sharded again (in its own memory kind); the others are kept."""
  if any(plan.leaves[i].ignored for i in new):
    names = [plan.leaves[i].name for i in new if plan.leaves[i].ignored]
    raise ValueError(f"load_adapter: {names} are ignored_states; the adapter cannot be "
                     "loaded into them. Fix: leave them out of FSDPConfig(ignored_states=...).")
  units = [u for u in plan.units if any(i in new for i in u.leaf_ids)]
  if plan.use_orig_params:
    parts = plan.treedef.flatten_up_to(storage)
  else:
    parts = dict(storage)
  for unit in units:
    arrays = layout.unit_storage(plan, unit, storage)
    sh = plan.sharding(plan.spec_for(unit))
    out_sh = {i: sh for i in unit.leaf_ids} if plan.use_orig_params else {"flat": sh}
    values = {i: new[i] for i in unit.leaf_ids if i in new}

    def run(arrays, values, unit=unit):
      full = layout.unpack_storage_full(plan, unit, offload.to_device(arrays),
                                        replicate=True)
      full.update({i: v.astype(full[i].dtype) for i, v in values.items()})
      return layout.pack_unit(plan, unit, full, replicate=True)

    packed = jax.jit(run, out_shardings=out_sh)(arrays, values)
    if plan.use_orig_params:
      for i in unit.leaf_ids:
        parts[i] = packed[i]
    else:
      parts[unit.flat_key] = packed["flat"]
  if plan.use_orig_params:
    return plan.treedef.unflatten(parts)
  return parts
