"""The sharding plan built from a parameter tree and an ``FSDPConfig``: units
by the wrap policy (and the stacked layers), frozen and ignored leaves,
LoRA's adapters and frozen bases in units of their own, and the leaves
tensor parallelism splits (``state.init_train_state`` and
``state.abstract_plan`` build with it)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from fsdp_jax._src import frameworks, layout, lora as lora_lib, naming
from fsdp_jax._src import tensor as tensor_lib, tensor_eval, wrap
from fsdp_jax._src.config import FSDPConfig, is_key_dtype
from fsdp_jax._src.mesh import mesh_axes
from fsdp_jax._src.plan import LeafSpec, Plan, UnitSpec


def leaf_positions(whole, part) -> Optional[list]:
  """Where each leaf of ``part`` (a subtree split off ``whole``) is among
  ``whole``'s leaves, matched by key path; ``None`` if one is not found."""
  where = {path: k for k, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(whole)[0])}
  out = [where.get(path) for path, _ in jax.tree_util.tree_flatten_with_path(part)[0]]
  return None if any(k is None for k in out) else out


# --------------------------------------------------------------------------
# Plans


def _frozen_mask(abstract_params, requires_grad) -> list[bool]:
  """``requires_grad`` (a tree of bools, or a prefix of the params tree) ->
  per-leaf frozen flags."""
  n = len(jax.tree_util.tree_leaves(abstract_params))
  if requires_grad is None:
    return [False] * n
  try:
    full = jax.tree.map(lambda r, x: jax.tree.map(lambda _: bool(r), x),
                        requires_grad, abstract_params)
  except (ValueError, TypeError) as e:
    raise ValueError(
        "requires_grad must be a tree of bools with the structure of the "
        f"params (or a prefix of it): {e}. Params structure: "
        f"{jax.tree.structure(abstract_params)}; requires_grad structure: "
        f"{jax.tree.structure(requires_grad)}. Fix: build it with "
        "jax.tree.map(lambda _: True, params) and set the frozen leaves to False.") from e
  return [not r for r in jax.tree_util.tree_leaves(full)]


def _check_trainable_dtypes(paths, flat, frozen, requires_grad) -> None:
  """Refuses trainable leaves JAX cannot differentiate (integers, bools,
  PRNG keys): ``jax.grad`` would fail inside the step with a raw error."""
  bad = [f"{'.'.join(p)!r} ({jnp.dtype(x.dtype).name}, shape {tuple(x.shape)})"
         for p, x, f in zip(paths, flat, frozen)
         if not f and not jnp.issubdtype(x.dtype, jnp.inexact)]
  if not bad:
    return
  how = ("set those leaves to False in requires_grad" if requires_grad is not None else
         "pass requires_grad=jax.tree.map(lambda x: jnp.issubdtype(x.dtype, "
         "jnp.inexact), params)")
  raise TypeError(
      f"Fix: {how} (PyTorch's requires_grad=False), or move them out of the "
      "parameters into model_state= (non-trainable state the step threads "
      f"through): parameter(s) {', '.join(bad[:8])}{' ...' if len(bad) > 8 else ''} "
      "are trainable but not floating-point, and JAX cannot differentiate with "
      "respect to them (the step would fail in jax.grad: 'grad requires "
      "real-valued inputs').")


def _matches_class(cls, specs) -> bool:
  for spec in specs:
    if isinstance(spec, str):
      if any(c.__name__ == spec for c in getattr(cls, "__mro__", (cls,))):
        return True
    elif isinstance(spec, type) and issubclass(cls, spec):
      return True
  return False


def _align_module_paths(module_types: dict, paths) -> dict:
  """Module classes are captured under the ``"params"`` collection; when the
  tree is the params collection itself, drop that prefix."""
  if not module_types or any(p and p[0] == "params" for p in paths):
    return module_types
  if all(k and k[0] == "params" for k in module_types):
    return {k[1:]: v for k, v in module_types.items()}
  return module_types


def _ignored_leaves(paths, patterns) -> set:
  """Leaves named by ``ignored_states`` (a leaf, or any subtree above it)."""
  out = wrap.named_leaves(paths, patterns, "ignored_states entry")
  if len(out) == len(paths):
    raise ValueError("ignored_states covers every parameter: there is nothing for FSDP to shard.")
  return out


def build_plan(abstract_params, *, mesh: Mesh, config: FSDPConfig,
               module_types: Optional[dict] = None, requires_grad=None,
               model_state=None) -> Plan:
  """Chooses units with the wrap policy and lays them out for ``mesh``."""
  if not isinstance(config, FSDPConfig):
    raise TypeError(f"config must be a fsdp_jax.FSDPConfig, got {type(config).__name__}.")
  axes = mesh_axes(mesh, config)
  flat, treedef = jax.tree_util.tree_flatten(abstract_params)
  if not flat:
    raise ValueError("The parameter tree has no leaves: there is nothing to shard.")
  paths = naming.leaf_paths(abstract_params)
  for p, x in zip(paths, flat):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"Parameter {'.'.join(p)!r} is a {type(x).__name__}, not an "
                      "array; the parameter tree must hold arrays only.")
  numels = [int(np.prod(x.shape, dtype=np.int64)) for x in flat]
  module_types = _align_module_paths(module_types or {}, paths)
  ignored = _ignored_leaves(paths, config.ignored_states or ())
  mp = config.mixed_precision
  full_precision_nodes = ()
  if mp is not None and config.auto_wrap_policy is not None:
    # PyTorch's _module_classes_to_ignore: with auto-wrapping, these modules
    # (BatchNorm by default) become their own units without mixed precision.
    full_precision_nodes = tuple(sorted(
        path for path, cls in module_types.items()
        if _matches_class(cls, mp._module_classes_to_ignore)))
  choices = wrap.choose_units(
      paths, numels, policy=config.auto_wrap_policy, module_types=module_types,
      sequence_prefixes=naming.sequence_prefixes(abstract_params),
      stacked_patterns=config.stacked_layers,
      full_precision_nodes=full_precision_nodes,
      ignored=sorted(ignored))
  lora_targets = ()
  if config.lora is not None:
    requires_grad, lora_targets = _lora_requires_grad(abstract_params, config, requires_grad)
  frozen = _frozen_mask(abstract_params, requires_grad)
  _check_trainable_dtypes(paths, flat, frozen, requires_grad)
  if config.lora is not None and not config.use_orig_params:
    choices = _split_lora_units(choices, flat, frozen, [".".join(p) for p in paths])
  tensor_dims = {}
  root_parts = {len(choices) - 1} if choices and choices[-1].name == "" else set()
  if config.tensor_parallel is not None:
    tensor_dims = _tensor_dims(config, axes, choices, paths, flat, ignored, abstract_params)
    choices, root_parts = _split_tensor_units(choices, tensor_dims)
  leaf_unit = {}
  units = []
  for idx, c in enumerate(choices):
    num_layers = 0
    if c.stacked:
      leads = {flat[i].shape[0] if flat[i].shape else None for i in c.leaf_ids}
      if len(leads) != 1 or None in leads:
        detail = ", ".join(f"{'.'.join(paths[i])}: {tuple(flat[i].shape)}" for i in c.leaf_ids[:6])
        raise ValueError(
            f"Stacked unit {c.name!r} needs every leaf to have the same leading "
            f"layer axis; got {detail}. Fix stacked_layers or stack the layers.")
      num_layers = leads.pop()
    for i in c.leaf_ids:
      leaf_unit[i] = idx
    units.append(UnitSpec(idx, c.name, c.leaf_ids, c.stacked, num_layers,
                          is_root=idx in root_parts,
                          overrides=c.overrides,
                          tensor=c.leaf_ids[0] in tensor_dims))
  leaves = []
  for i, (p, x) in enumerate(zip(paths, flat)):
    if i in ignored:
      leaves.append(LeafSpec(i, ".".join(p), tuple(x.shape), jnp.dtype(x.dtype), -1,
                             tuple(x.shape), frozen[i], ignored=True))
      continue
    u = units[leaf_unit[i]]
    layer_shape = tuple(x.shape[1:]) if u.stacked else tuple(x.shape)
    d = tensor_dims.get(i)
    if d is not None:  # this device's slice
      layer_shape = layer_shape[:d] + (layer_shape[d] // axes.tensor_size,) + layer_shape[d + 1:]
    leaves.append(LeafSpec(i, ".".join(p), tuple(x.shape), jnp.dtype(x.dtype),
                           leaf_unit[i], layer_shape, frozen[i], tensor_dim=d))
  layout.check_flat_dtypes(leaves, units, config.use_orig_params)
  for u in units:
    unknown = set(u.override_dict) - {"mixed_precision"}
    if unknown:
      raise NotImplementedError(
          f"CustomPolicy returned per-unit overrides {sorted(unknown)} for unit "
          f"{u.display_name!r}; only 'mixed_precision' can be overridden per unit.")
  if all(frozen):
    raise ValueError("requires_grad marks every parameter frozen: there is nothing to train.")
  ms_dtypes = None
  if model_state is not None:
    # PRNG key dtypes (NNX's RngKey) are kept as they are: NumPy cannot read them.
    ms_dtypes = tuple(x.dtype if is_key_dtype(x.dtype) else jnp.dtype(x.dtype)
                      for x in jax.tree_util.tree_leaves(model_state))
  stacked_ids = {i for u in units if u.stacked for i in u.leaf_ids}
  hints = frameworks.stacked_hints(paths, [tuple(x.shape) for x in flat],
                                   stacked_ids | ignored)
  return Plan(treedef, tuple(leaves), tuple(units), config, mesh, axes, ms_dtypes,
              stacked_hints=hints, lora_targets=lora_targets,
              lora_report=None if config.lora is None else lora_lib.Report(),
              tensor_report=None if config.tensor_parallel is None else tensor_eval.Report())


def _lora_requires_grad(abstract_params, config: FSDPConfig, requires_grad):
  """LoRA's trainable mask over the stored tree (adapters and
  ``LoRA(trainable=...)``), and the targets' names in stored order."""
  if requires_grad is not None:
    raise ValueError(
        "init_train_state(requires_grad=...) with FSDPConfig(lora=...): LoRA decides what "
        "trains (the adapters, and what LoRA(trainable=...) names). Fix: drop "
        "requires_grad= and list the fully trained leaves in LoRA(trainable=(...)).")
  is_node = lora_lib.is_lora_weight
  nodes = [(".".join(naming.path_parts(p)), x) for p, x in
           jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=is_node)[0]
           if is_node(x)]
  if not nodes:
    raise ValueError("FSDPConfig(lora=...) but the parameter tree holds no adapters.")
  user_view = jax.tree.map(lambda x: x.lora_A if is_node(x) else x, abstract_params,
                           is_leaf=is_node)
  trainable = lora_lib.trainable_leaves(user_view, config.lora)
  target_slots = [i for i, x in enumerate(jax.tree.leaves(abstract_params, is_leaf=is_node))
                  if is_node(x)]
  for (name, node), i in zip(nodes, target_slots):
    if i in trainable:
      what = ("its base is quantized (LoRA(base_quantization=...)) and frozen"
              if node.quantization is not None else "it is adapted (frozen base + A @ B)")
      raise ValueError(
          f"LoRA target {name!r} (shape {node.kernel_shape}) is "
          f"also named by LoRA(trainable=...) {config.lora.trainable!r}, but {what}. Fix: "
          "narrow LoRA(trainable=...) to the other leaves, or drop the kernel from targets "
          "to train it fully.")
  mask = lora_lib.requires_grad_tree(abstract_params, trainable,
                                     lora_lib.user_treedef(abstract_params))
  return mask, tuple(name for name, _ in nodes)


def _split_lora_units(choices, flat, frozen, names):
  """Flat parameters hold one dtype and are all frozen or all trainable
  (PyTorch's rule): with LoRA each unit's adapters become a unit of their
  own (``<unit>.lora_adapters``, as PEFT's FSDP wrap policy wraps them), and
  so do quantized bases (``<unit>.lora_base``)."""
  out = []
  for c in choices:
    groups: dict = {}
    for i in c.leaf_ids:
      groups.setdefault((jnp.dtype(flat[i].dtype).name, frozen[i]), []).append(i)
    if len(groups) == 1:
      out.append(c)
      continue
    main = max(groups, key=lambda k: (k[1], sum(int(np.prod(flat[i].shape)) for i in groups[k])))
    for key, ids in groups.items():
      if key == main:
        continue
      if key[1]:
        suffix = "lora_base"
      elif all(lora_lib.stored_leaf_kind(names[i]) in ("lora_A", "lora_B") for i in ids):
        suffix = "lora_adapters"
      else:
        suffix = "trainable"
      if len([k for k in groups if k[1] == key[1]]) > 1:
        suffix += "_" + key[0]
      name = f"{c.name}.{suffix}" if c.name else suffix
      out.append(dataclasses.replace(c, name=name, leaf_ids=tuple(ids)))
    out.append(dataclasses.replace(c, leaf_ids=tuple(groups[main])))
  return out


def _tensor_dims(config: FSDPConfig, axes, choices, paths, flat, ignored,
                 abstract_params) -> dict:
  """``{leaf index: per-layer dimension}`` the tensor-parallel rules split.

  With LoRA the rules name the user's kernels; a target's stored leaves
  split with it: a column-parallel kernel's base and ``lora_B`` along the
  output axis (``lora_A`` replicated), a row-parallel kernel's base and
  ``lora_A`` along the input axis (``lora_B`` replicated)."""
  tp = config.tensor_parallel
  stacked = {i for c in choices if c.stacked for i in c.leaf_ids}
  if config.lora is None:
    leads = [int(i in stacked) for i in range(len(flat))]
    dims = tensor_lib.leaf_dims(paths, [tuple(x.shape) for x in flat], leads, tp,
                                axes.tensor_size)
  else:
    dims = _lora_tensor_dims(config, axes, abstract_params, stacked)
  bad = sorted(set(dims) & set(ignored))
  if bad:
    name = ".".join(paths[bad[0]])
    raise ValueError(
        f"Parameter {name!r} (shape {tuple(flat[bad[0]].shape)}) is in ignored_states and "
        "named by a TensorParallel rule; an ignored leaf keeps a full copy per device. "
        "Fix: drop it from one of them.")
  return dims


def _lora_tensor_dims(config: FSDPConfig, axes, abstract_params, stacked: set) -> dict:
  is_node = lora_lib.is_lora_weight
  items = jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=is_node)[0]
  user_paths, shapes, leads, stored = [], [], [], []
  k = 0  # the stored leaf index
  for path, x in items:
    user_paths.append(naming.path_parts(path))
    if is_node(x):
      shapes.append(x.kernel_shape)
      stored.append((k, x))
      k += 3
    else:
      shapes.append(tuple(x.shape))
      stored.append((k, None))
      k += 1
    leads.append(int(stored[-1][0] in stacked))
  user_dims = tensor_lib.leaf_dims(user_paths, shapes, leads, config.tensor_parallel,
                                   axes.tensor_size)
  dims = {}
  for j, d in user_dims.items():
    first, node = stored[j]
    if node is None:
      dims[first] = d
      continue
    name = ".".join(user_paths[j])
    k_in = len(shapes[j]) - leads[j] - node.out_dims  # the kernel's input dims
    if node.quantization is not None and d >= k_in:
      raise NotImplementedError(
          f"LoRA target {name!r} (shape {shapes[j]}) is quantized "
          "(LoRA(base_quantization=...)) and split along an output dimension over the tensor "
          "axis (column-wise); a quantized base is stored in row blocks and splits along its "
          "input dimensions only. Fix: make the rule 'rowwise', drop base_quantization, or "
          "leave this kernel replicated.")
    dims[first] = d  # the base
    if d < k_in:
      dims[first + 1] = d  # lora_A [*in, r]: along the kernel's input dim
    else:
      dims[first + 2] = 1 + d - k_in  # lora_B [r, *out]: along its output dim
  return dims


def _split_tensor_units(choices, dims: dict):
  """A unit's tensor-parallel leaves become a unit of their own
  (``<unit>.tensor_parallel``): a unit's stored arrays are either stacked
  tensor slices or replicated over the tensor axis. Returns the units and
  the indices of the root's parts (both kept gathered, as the root is)."""
  out = []
  root_parts = set()
  for k, c in enumerate(choices):
    is_root = c.name == "" and k == len(choices) - 1
    split = tuple(i for i in c.leaf_ids if i in dims)
    rest = tuple(i for i in c.leaf_ids if i not in dims)
    if split and rest:
      name = f"{c.name}.tensor_parallel" if c.name else "tensor_parallel"
      parts = [dataclasses.replace(c, name=name, leaf_ids=split),
               dataclasses.replace(c, leaf_ids=rest)]
    else:
      parts = [c]
    if is_root:
      root_parts |= set(range(len(out), len(out) + len(parts)))
    out.extend(parts)
  return out, root_parts


# --------------------------------------------------------------------------
# Optimizer state sharding
