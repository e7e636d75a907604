"""The sharding plan: units, their leaves, and how each is laid out in shards.

A :class:`Plan` is static (hashable) metadata carried by the train state. It is
what ``print(state.plan)`` shows, like printing an FSDP-wrapped PyTorch model.
It reads the config once for the rest of the engine: how each unit is
gathered and reduced (:meth:`Plan.gather_specs`), the prefetch ordering
(:attr:`Plan.ordering`, :attr:`Plan.loop_prefetch`), hooks and offload. This
module also holds what a custom step needs from the plan: the
``PartitionSpec`` s of ``shard_map`` and the trainable/frozen split.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fsdp_jax._src import collectives, offload, report
from fsdp_jax._src.lora import is_lora_weight
from fsdp_jax._src.collectives import GatherSpec, LeafLayout
from fsdp_jax._src.config import (FSDPConfig, MixedPrecision, data_axis_names,
                                  gradient_divide_factors, is_float_dtype)
from fsdp_jax._src import context as context_lib
from fsdp_jax._src.mesh import MeshAxes, context_parallel


@dataclasses.dataclass(frozen=True)
class Ordering:
  """PyTorch's prefetch settings, as explicit ordering of a step's
  collectives (:func:`fsdp_jax._src.schedule.ordering.ordered`).

  ``backward_prefetch``: ``"BACKWARD_PRE"``, ``"BACKWARD_POST"`` or ``None``.
  ``reshard``: labels of the units freed after their forward use.
  ``forward_prefetch_units`` / ``backward_prefetch_units``: explicit
  prefetch (FSDP2's ``set_modules_to_{forward,backward}_prefetch``),
  ``((unit label, (labels gathered early, in order)), ...)``.
  """

  backward_prefetch: Optional[str]
  forward_prefetch: bool
  limit_all_gathers: bool
  reshard: frozenset = frozenset()
  forward_prefetch_units: tuple = ()
  backward_prefetch_units: tuple = ()


@dataclasses.dataclass(frozen=True)
class LoopPrefetch:
  """How a ``scan`` over stacked units overlaps gathers with compute
  (:mod:`fsdp_jax._src.schedule.loops`).

  Iteration ``i`` of the forward loop gathers layer ``i+1`` (in loop order)
  while it computes layer ``i`` and hands it on in the carry; the backward
  loop does the same for layer ``i-1`` while it differentiates layer ``i``,
  so each loop holds at most two gathered layers. When the next gather is
  issued follows PyTorch's settings, as for units outside a loop:
  ``forward_prefetch`` (at the start of the iteration, else after the
  layer's first matmul) and ``backward_prefetch`` (``"BACKWARD_PRE"``: before
  the layer's gradient computation; ``"BACKWARD_POST"``: after it, before its
  reduce-scatter; ``None``: after its reduce-scatter).

  ``units``: the stacked units whose loops do this; ``reshard``: those freed
  after forward (the backward loop re-gathers them; the others keep each
  layer's gathered parameters for backward, as SHARD_GRAD_OP does);
  ``axis_env``: the model's axis names and sizes the loop bodies are traced
  with.
  """

  forward_prefetch: bool
  backward_prefetch: Optional[str]
  units: frozenset
  reshard: frozenset
  axis_env: tuple = ()


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """One original parameter.

  ``shape`` is the full shape; ``layer_shape`` drops the leading layer axis of
  a stacked unit. In the original-parameter layout the leaf is padded along
  its first per-layer dimension ``dim0`` to ``shard_size * chunk0`` rows.

  Under tensor parallelism ``tensor_dim`` is the per-layer dimension split
  over the tensor axis (None: replicated over it), and ``layer_shape`` is
  the per-layer shape of one device's slice (that dimension divided by the
  axis size): what the unit's gather returns and the loss runs on.
  """

  index: int
  name: str
  shape: tuple[int, ...]
  dtype: Any
  unit: int
  layer_shape: tuple[int, ...]
  frozen: bool = False
  ignored: bool = False
  tensor_dim: Optional[int] = None

  @property
  def numel(self) -> int:
    return math.prod(self.shape)  # Python ints: no overflow, and fast

  @property
  def layer_numel(self) -> int:
    return math.prod(self.layer_shape)

  @property
  def dim0(self) -> int:
    return self.layer_shape[0] if self.layer_shape else 1

  @property
  def rest(self) -> tuple[int, ...]:
    return self.layer_shape[1:] if self.layer_shape else ()

  @property
  def row_numel(self) -> int:
    return math.prod(self.rest)


@dataclasses.dataclass(frozen=True)
class UnitSpec:
  """One FSDP unit."""

  index: int
  name: str
  leaf_ids: tuple[int, ...]
  stacked: bool
  num_layers: int
  is_root: bool
  overrides: tuple = ()
  # Tensor parallelism: every leaf is split over the tensor axis, and the
  # stored arrays stack the T slices' FSDP layouts along the sharded axis.
  tensor: bool = False

  @property
  def override_dict(self) -> dict:
    return dict(self.overrides)

  @property
  def display_name(self) -> str:
    return self.name or "<root>"

  @property
  def flat_key(self) -> str:
    """The FlatParameter's name, as PyTorch names it."""
    return f"{self.name}._flat_param" if self.name else "_flat_param"


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
  """Static description of how a parameter tree is sharded.

  ``print(plan)`` shows it (units, layout, collectives, memory).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> plan = state.plan
    >>> [u.display_name for u in plan.units], dict(plan.mesh.shape)
    (['<root>'], {'shard': 2})
  """

  treedef: Any
  leaves: tuple[LeafSpec, ...]
  units: tuple[UnitSpec, ...]
  config: FSDPConfig
  mesh: Mesh
  axes: MeshAxes
  # dtypes of the model state (buffers) before the cast to buffer_dtype.
  model_state_dtypes: Optional[tuple] = None
  # How the optimizer's state is stored (fsdp_jax._src.optim.OptLayout) and how
  # its update runs; set by init_train_state.
  opt_layout: Any = None
  opt_update: Any = None
  # The optax optimizer init_train_state was given: shard_train_step's
  # default (compared by object, like any function: a step traced for one
  # optimizer is never reused for another).
  optimizer: Any = None
  # Subtrees that look like stacked layers but are not declared stacked:
  # ((dotted name, number of layers), ...); see frameworks.stacked_hints.
  stacked_hints: tuple = ()
  # LoRA: the targets' dotted names (the user's), in the stored tree's
  # order, and what tracing the step found (lora.Report; not compared).
  lora_targets: tuple = ()
  lora_report: Any = None
  # Tensor parallelism: what tracing the step found (tensor_eval.Report; not
  # compared).
  tensor_report: Any = None

  def __post_init__(self):
    _check_resharding(self)
    _check_prefetch_units(self)

  # Plans compare by the content that matters for tracing.
  def _key(self):
    return (self.treedef, self.leaves, self.units, self.config, self.mesh, self.axes,
            self.model_state_dtypes, self.opt_layout, self.opt_update, self.optimizer,
            self.lora_targets)

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return isinstance(other, Plan) and self._key() == other._key()

  # ---- layout arithmetic -------------------------------------------------
  @property
  def use_orig_params(self) -> bool:
    return self.config.use_orig_params

  @property
  def n(self) -> int:
    return self.axes.shard_size

  @property
  def t(self) -> int:
    """The tensor-parallel axis size (1 without tensor parallelism)."""
    return self.axes.tensor_size

  @property
  def context(self):
    """The :class:`~fsdp_jax.ContextParallel` options under a context axis,
    else None."""
    return context_parallel(self.mesh, self.config) if self.axes.context_axes else None

  def tensor_size(self, unit: UnitSpec) -> int:
    """How many tensor slices the unit's stored arrays stack (1: replicated)."""
    return self.t if unit.tensor else 1

  def gathered_shape(self, leaf: LeafSpec) -> tuple[int, ...]:
    """The shape the loss runs on inside the step: this device's tensor
    slice of the leaf (the full shape without tensor parallelism)."""
    if leaf.ignored or leaf.tensor_dim is None:
      return leaf.shape
    return self.prefix(self.units[leaf.unit]) + leaf.layer_shape

  def lora_base_dtypes(self) -> tuple:
    """The dtype the loss sees each LoRA target's base in (stored order):
    its unit's ``param_dtype`` under mixed precision, else the kernel's own
    (a quantized base decodes to it)."""
    out = []
    tree = jax.tree_util.tree_unflatten(self.treedef, list(range(len(self.leaves))))
    for node in jax.tree_util.tree_leaves(tree, is_leaf=is_lora_weight):
      if not is_lora_weight(node):
        continue
      base = self.leaves[node.base]
      mp = (self.config.mixed_precision if base.ignored
            else self.mixed_precision(self.units[base.unit]))
      if mp is not None and mp.param_dtype is not None:
        out.append(jnp.dtype(mp.param_dtype))
      else:
        out.append(jnp.dtype(node.dtype))
    return tuple(out)

  def mixed_precision(self, unit: UnitSpec) -> Optional[MixedPrecision]:
    """The unit's MixedPrecision: a per-unit override, else the config's."""
    over = unit.override_dict
    if "mixed_precision" in over:
      return over["mixed_precision"]
    return self.config.mixed_precision

  @property
  def has_frozen(self) -> bool:
    return any(l.frozen for l in self.leaves)

  @property
  def trainable_units(self) -> tuple[UnitSpec, ...]:
    return tuple(u for u in self.units if not all(self.leaves[i].frozen for i in u.leaf_ids))

  def reshard(self, unit: UnitSpec) -> bool:
    """FULL_SHARD/HYBRID_SHARD free a unit after forward; the root is kept.

    A shard group of one device keeps every unit, as PyTorch FSDP does on a
    world of one (it runs FULL_SHARD as NO_SHARD): the "gather" returns the
    device's own copy, so resharding would free only its cast to
    ``param_dtype`` and cost a rematerialised forward (1.10x plain
    ``jax.jit``'s step time against 1.05x without it, 1B GPT on one H100,
    benchmarks/GPU.md)."""
    return bool(self.config.reshard_after_forward) and not unit.is_root and self.n > 1

  def regather(self, unit: UnitSpec) -> bool:
    """Whether the backward pass gathers ``unit`` again rather than keeping
    its forward gather: when it is resharded, and under NO_SHARD when the
    "gather" (this device's unpacking of its replicated copy, no
    communication) copies: slices of a flat parameter, or casts to
    ``param_dtype``. Redone in backward, that costs one copy; kept, it held
    a second copy of the unit from forward to backward."""
    if self.reshard(unit):
      return True
    if self.axes.shard_axes:
      return False
    if not self.use_orig_params:
      return True
    mp = self.mixed_precision(unit)
    cast = None if mp is None else mp.param_dtype
    return cast is not None and any(
        is_float_dtype(self.leaves[i].dtype)
        and np.dtype(self.leaves[i].dtype) != np.dtype(cast) for i in unit.leaf_ids)

  def secondary_size(self, unit: UnitSpec) -> int:
    """``k`` when ``reshard_after_forward=k`` keeps a ``1/k`` slice of the
    unit for a backward all-gather within groups of ``k`` devices; else 0."""
    k = self.config.reshard_after_forward
    return k if not isinstance(k, bool) and self.reshard(unit) else 0

  def chunk0(self, leaf: LeafSpec) -> int:
    return -(-leaf.dim0 // self.n)

  def flat_numel(self, unit: UnitSpec) -> int:
    return sum(self.leaves[i].layer_numel for i in unit.leaf_ids)

  def flat_chunk(self, unit: UnitSpec) -> int:
    return -(-self.flat_numel(unit) // self.n)

  def unit_dtype(self, unit: UnitSpec):
    return self.leaves[unit.leaf_ids[0]].dtype

  def prefix(self, unit: UnitSpec) -> tuple[int, ...]:
    return (unit.num_layers,) if unit.stacked else ()

  @property
  def ignored_leaves(self) -> tuple[LeafSpec, ...]:
    return tuple(l for l in self.leaves if l.ignored)

  def ignored_key(self, leaf: LeafSpec) -> str:
    """Key of an ignored leaf in the flat layout's params dict."""
    return leaf.name

  def ignored_spec(self) -> P:
    axes = self.axes.data_axes
    return P(axes[0] if len(axes) == 1 else axes)

  def storage_shape_of_leaf(self, leaf: LeafSpec) -> tuple[int, ...]:
    if leaf.ignored:
      return (self.axes.world_size,) + leaf.shape
    unit = self.units[leaf.unit]
    return (self.prefix(unit) + (self.tensor_size(unit) * self.n * self.chunk0(leaf),)
            + leaf.rest)

  def storage_shape_of_unit(self, unit: UnitSpec) -> tuple[int, ...]:
    return self.prefix(unit) + (self.tensor_size(unit) * self.n * self.flat_chunk(unit),)

  def spec_for(self, unit: UnitSpec) -> P:
    """The stored arrays' ``PartitionSpec``: the sharded axis over the shard
    axes; a tensor-parallel unit's over ``(tensor, *shard axes)`` (each
    tensor slice's FSDP layout, stacked)."""
    axes = (self.axes.tensor_axes if unit.tensor else ()) + self.axes.shard_axes
    if not axes:
      return P()
    axis = axes[0] if len(axes) == 1 else axes
    return P(None, axis) if unit.stacked else P(axis)

  def padded_numel(self, unit: UnitSpec) -> int:
    """Elements stored for the unit across all devices (with padding)."""
    layers = (unit.num_layers if unit.stacked else 1) * self.tensor_size(unit)
    if self.use_orig_params:
      per_layer = sum(self.n * self.chunk0(self.leaves[i]) * self.leaves[i].row_numel
                      for i in unit.leaf_ids)
    else:
      per_layer = self.n * self.flat_chunk(unit)
    return layers * per_layer

  def unit_numel(self, unit: UnitSpec) -> int:
    return sum(self.leaves[i].numel for i in unit.leaf_ids)

  def unit_by_name(self, name: str) -> UnitSpec:
    for u in self.units:
      if u.name == name:
        return u
    raise KeyError(f"no unit named {name!r}; units are "
                   f"{[u.display_name for u in self.units]}")

  # ---- storage tree ------------------------------------------------------
  @property
  def memory_kind(self) -> Optional[str]:
    """The memory kind of the stored params and optimizer state:
    ``"pinned_host"`` with ``CPUOffload(offload_params=True)``, else None
    (the device's default memory)."""
    return offload.state_memory_kind(self.config)

  def sharding(self, spec: P) -> NamedSharding:
    """A ``NamedSharding`` on the plan's mesh, in the stored state's memory."""
    return NamedSharding(self.mesh, spec, memory_kind=self.memory_kind)

  def storage_shardings(self):
    """The sharding of each stored parameter array (the state's params),
    with the memory kind it is stored in (``pinned_host`` with CPU offload)."""
    ign = self.sharding(self.ignored_spec())
    if self.use_orig_params:
      specs = [ign if l.ignored else self.sharding(self.spec_for(self.units[l.unit]))
               for l in self.leaves]
      return jax.tree_util.tree_unflatten(self.treedef, specs)
    out = {u.flat_key: self.sharding(self.spec_for(u)) for u in self.units}
    out.update({self.ignored_key(l): ign for l in self.ignored_leaves})
    return out

  def storage_shapes(self):
    """``jax.ShapeDtypeStruct`` of each stored parameter array."""
    shard = self.storage_shardings()
    if self.use_orig_params:
      structs = [jax.ShapeDtypeStruct(self.storage_shape_of_leaf(l), l.dtype)
                 for l in self.leaves]
      structs = jax.tree_util.tree_unflatten(self.treedef, structs)
    else:
      structs = {u.flat_key: jax.ShapeDtypeStruct(self.storage_shape_of_unit(u),
                                                  self.unit_dtype(u))
                 for u in self.units}
      structs.update({self.ignored_key(l): jax.ShapeDtypeStruct(
          self.storage_shape_of_leaf(l), l.dtype) for l in self.ignored_leaves})
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        structs, shard)

  # ---- what the config means for the engine ------------------------------
  @property
  def comm_hook(self):
    """The communication hook (``FSDPConfig.comm_hook``), or None."""
    return self.config.comm_hook

  @property
  def stateful_hook(self) -> bool:
    """Whether the hook carries state from step to step."""
    return collectives.is_stateful(self.config.comm_hook)

  @property
  def offloaded(self) -> bool:
    """``CPUOffload(offload_params=True)``: the stored state is in host memory."""
    return offload.offloads(self.config)

  @property
  def nonfinite(self) -> str:
    """What the step does on a non-finite loss or gradient norm
    (``FSDPConfig.nonfinite``)."""
    return self.config.nonfinite

  @property
  def root_input_dtype(self):
    """The dtype floating batch leaves are cast to before the loss runs
    (``MixedPrecision(cast_root_forward_inputs=True)`` with a
    ``param_dtype``), or None."""
    mp = self.config.mixed_precision
    if mp is not None and mp.param_dtype is not None and mp.cast_root_forward_inputs:
      return mp.param_dtype
    return None

  @property
  def ordering(self) -> "Ordering":
    """PyTorch's prefetch settings for the step's top-level gathers."""
    cfg = self.config
    return Ordering(
        backward_prefetch=None if cfg.backward_prefetch is None else cfg.backward_prefetch.name,
        forward_prefetch=bool(cfg.forward_prefetch),
        limit_all_gathers=bool(cfg.limit_all_gathers),
        reshard=frozenset(u.display_name for u in self.units if self.reshard(u)),
        forward_prefetch_units=cfg.forward_prefetch_units,
        backward_prefetch_units=cfg.backward_prefetch_units)

  @property
  def loop_prefetch(self) -> "LoopPrefetch":
    """How scans over stacked units carry the next layer's gather (hpZ's
    backward gathers from its secondary slice instead, one layer per
    iteration)."""
    cfg = self.config
    return LoopPrefetch(
        forward_prefetch=bool(cfg.forward_prefetch),
        backward_prefetch=None if cfg.backward_prefetch is None else cfg.backward_prefetch.name,
        units=frozenset(u.index for u in self.units if u.stacked and not self.secondary_size(u)),
        reshard=frozenset(u.index for u in self.units if self.reshard(u)),
        axis_env=self.axis_env)

  @property
  def unit_input_dtypes(self) -> dict:
    """``{unit name: param_dtype}`` of the non-root units whose
    MixedPrecision has ``cast_forward_inputs=True`` (PyTorch casts their
    forward inputs)."""
    out = {}
    for unit in self.units:
      mp = self.mixed_precision(unit)
      if (not unit.is_root and mp is not None and mp.cast_forward_inputs
          and mp.param_dtype is not None):
        out[unit.name] = mp.param_dtype
    return out

  @property
  def recomputes_cheap_ops(self) -> bool:
    """Whether the step's remat recomputes elementwise operations
    (:func:`fsdp_jax._src.collectives.remat_policy`) rather than saving every
    residual but the re-gathered parameters.

    Only when some unit is gathered again in backward. A scan over a stacked
    unit is one equation to the step's remat, which saves its residuals (the
    loops recompute inside themselves, see :class:`LoopPrefetch`). hpZ's
    stacked units keep every residual but the gathers: recomputing the cheap
    operations of a scanned layer made the compiled program gather each
    layer a third time, in a loop of its own.
    """
    return (any(self.regather(u) for u in self.units)
            and not any(u.stacked and self.secondary_size(u) for u in self.units))

  def compute_dtype(self, leaf: LeafSpec):
    """The dtype the loss sees a leaf in: the unit's ``param_dtype`` for
    floating leaves, else the stored dtype (ignored leaves: no mixed
    precision)."""
    if leaf.ignored:
      return jnp.dtype(leaf.dtype)
    mp = self.mixed_precision(self.units[leaf.unit])
    if mp is not None and mp.param_dtype is not None and is_float_dtype(leaf.dtype):
      return jnp.dtype(mp.param_dtype)
    return jnp.dtype(leaf.dtype)

  @property
  def axis_env(self) -> tuple:
    """``((model axis name, data-parallel world size), ...)``: the axis
    names the loss is traced with (``FSDPConfig.data_axis_name``)."""
    env = tuple((name, self.axes.world_size) for name in data_axis_names(self.config))
    return (env + tuple((a, self.t) for a in self.axes.tensor_axes)
            + tuple((a, self.axes.context_size) for a in self.axes.context_axes))

  def dtype_groups(self, unit: UnitSpec) -> list[tuple[int, ...]]:
    """Leaves gathered together (one collective each): all of a flat unit, or
    the leaves of one dtype in the original-parameter layout."""
    if not self.use_orig_params:
      return [unit.leaf_ids]
    groups: dict = {}
    for i in unit.leaf_ids:
      key = (np.dtype(self.leaves[i].dtype).name, self.leaves[i].frozen)
      groups.setdefault(key, []).append(i)
    return [tuple(v) for v in groups.values()]

  def gather_specs(self, unit: UnitSpec) -> list:
    """``[(leaf ids, GatherSpec)]``: one gather per dtype group of ``unit``."""
    mp = self.mixed_precision(unit)
    axes = self.axes
    hook = self.comm_hook
    pre, post = self.divide_factors()
    cfg = self.config
    out = []
    for group in self.dtype_groups(unit):
      stored = jnp.dtype(self.leaves[group[0]].dtype)
      compute = reduce = stored
      if mp is not None and is_float_dtype(stored):
        if mp.param_dtype is not None:
          compute = jnp.dtype(mp.param_dtype)
        if mp.effective_reduce_dtype is not None:
          reduce = jnp.dtype(mp.effective_reduce_dtype)
      leaves = tuple(LeafLayout(self.leaves[i].layer_shape, self.leaves[i].dim0,
                                self.chunk0(self.leaves[i]), self.leaves[i].row_numel)
                     for i in group)
      if self.use_orig_params:
        chunk = sum(self.chunk0(self.leaves[i]) * self.leaves[i].row_numel for i in group)
      else:
        chunk = self.flat_chunk(unit)
      quantizable = is_float_dtype(stored) and bool(axes.shard_axes)
      spec = GatherSpec(
          flat=not self.use_orig_params, leaves=leaves, n=self.n, chunk=chunk,
          stored_dtype=stored, compute_dtype=compute, reduce_dtype=reduce,
          shard_axes=axes.shard_axes, reduce_axes=axes.replicate_axes,
          pre_divide=pre, post_divide=post, reshard=self.regather(unit),
          keep_low_precision_grads=bool(mp and mp.keep_low_precision_grads),
          label=unit.display_name,
          hook=None if hook is None or self.stateful_hook else hook,
          secondary=self.secondary_size(unit),
          gather_quant=cfg.all_gather_quantization if quantizable else None,
          reduce_quant=cfg.reduce_scatter_quantization if quantizable else None,
          axis_sizes=tuple((a, int(self.mesh.shape[a]))
                           for a in axes.shard_axes + axes.replicate_axes))
      out.append((group, spec))
    return out

  def group_collectives(self, unit: UnitSpec) -> list:
    """``(group, spec, gathers, reduce-scatters)`` per dtype group of
    ``unit``: how many collectives its all-gather and its gradient reduction
    take, one for the unit's buffer or one per leaf
    (:func:`fsdp_jax._src.collectives.gathers_per_leaf`; a stateful hook
    reduces the packed buffer). Frozen leaves are never reduced."""
    out = []
    for group, spec in self.gather_specs(unit):
      gathers = len(group) if collectives.gathers_per_leaf(spec) else 1
      trainable = [i for i in group if not self.leaves[i].frozen]
      if not trainable:
        reduces = 0
      elif collectives.reduces_per_leaf(spec) and not self.stateful_hook:
        reduces = len(trainable)
      else:
        reduces = 1
      out.append((group, spec, gathers, reduces))
    return out

  # ---- printing and counting (fsdp_jax._src.report) ---------------------
  def divide_factors(self) -> tuple[float, float]:
    return gradient_divide_factors(self.axes.world_size)

  def collectives_per_step(self) -> dict[str, int]:
    """Collectives the strategy implies per step; see
    :func:`fsdp_jax._src.report.collectives_per_step`."""
    return report.collectives_per_step(self)

  def bytes_kept_for_backward(self) -> int:
    """Bytes of gathered parameters each device holds from the forward pass
    to the backward pass; see :func:`fsdp_jax._src.report.bytes_kept_for_backward`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, fsdp_jax
      >>> mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
      >>> params = {"a": {"w": jnp.ones((64, 64))}, "b": {"w": jnp.ones((64, 64))}}
      >>> def kept(**kw):
      ...   cfg = fsdp_jax.FSDPConfig(
      ...       auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["a", "b"]), **kw)
      ...   return fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1),
      ...       mesh=mesh, config=cfg).plan.bytes_kept_for_backward()
      >>> kept(reshard_after_forward=True), kept(reshard_after_forward=2), kept(reshard_after_forward=False)
      (0, 16384, 32768)
    """
    return report.bytes_kept_for_backward(self)

  def __str__(self) -> str:
    return report.describe(self)

  def __repr__(self) -> str:
    """One line, whatever the model's size (``print(plan)`` shows it whole)."""
    return report.summary(self)


def _check_resharding(plan: "Plan") -> None:
  """``reshard_after_forward=k`` needs ``k`` to divide the shard-group size."""
  k = plan.config.reshard_after_forward
  if isinstance(k, bool):
    return
  sizes = dict(plan.mesh.shape)
  axes = plan.axes.shard_axes
  n = plan.axes.shard_size
  where = (f"the shard axis {axes[0]!r} of size {n}" if len(axes) == 1 else
           f"the shard axes {axes} of sizes {[sizes[a] for a in axes]} ({n} devices)")
  if n % k or k >= n:
    divisors = [d for d in range(2, n) if n % d == 0]
    hint = (f"pass one of {divisors}" if divisors else
            f"a group of {n} devices has no smaller groups: pass True")
    why = (f"groups of all {n} devices are reshard_after_forward=True" if k == n else
           f"{k} must divide {n} and be smaller than it")
    raise ValueError(
        f"reshard_after_forward={k}: units are resharded onto groups of {k} adjacent "
        f"devices along {where}; {why}. Fix: {hint}.")


def _check_prefetch_units(plan: "Plan") -> None:
  """Explicit prefetch names real units that can be prefetched."""
  cfg = plan.config
  names = {u.display_name: u for u in plan.units}
  for field in ("forward_prefetch_units", "backward_prefetch_units"):
    for unit, targets in getattr(cfg, field):
      for name in (unit,) + tuple(targets):
        u = names.get(name)
        if u is None:
          raise ValueError(
              f"{field}: {name!r} is not a unit; the units are "
              f"{sorted(names)} (print(state.plan) lists them).")
        if u.stacked:
          raise ValueError(
              f"{field}: {name!r} is a stacked unit, gathered one layer per "
              "iteration inside its scan; explicit prefetch orders the step's "
              "top-level gathers only. Fix: leave it out.")
        if field == "backward_prefetch_units" and not plan.reshard(u):
          why = ("the root unit is never resharded after forward" if u.is_root else
                 f"{cfg.sharding_strategy.name} keeps units gathered from forward to backward")
          raise ValueError(
              f"{field}: {name!r} has no backward all-gather to issue or prefetch: "
              f"{why}. Fix: list only resharded units "
              f"{sorted(n for n, x in names.items() if plan.reshard(x) and not x.stacked)}.")


# --------------------------------------------------------------------------
# What a custom step needs from the plan: shard_map specs, the trainable split


def param_specs(plan: Plan):
  """``PartitionSpec`` of every stored parameter array (``state.params``).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> from jax.sharding import PartitionSpec as P
    >>> fsdp_jax.custom.param_specs(state.plan) == {"_flat_param": P("shard")}  # one flat param
    True
  """
  return jax.tree.map(lambda s: s.spec, plan.storage_shardings(),
                      is_leaf=lambda x: isinstance(x, NamedSharding))


def batch_spec(plan: Plan) -> P:
  """Batch leaves are split along dim 0 over all data-parallel mesh axes.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> from jax.sharding import PartitionSpec as P
    >>> fsdp_jax.custom.batch_spec(state.plan) == P("shard")  # dim 0 over the data axes
    True
  """
  if plan.context is not None:
    raise ValueError(
        f"batch_spec(plan): the mesh has a 'context' axis (shape {dict(plan.mesh.shape)}), so "
        "batch leaves are split along their sequence too and one spec does not fit every "
        "leaf. Fix: pass fsdp_jax.custom.batch_specs(plan, batch) as shard_map's in_specs "
        "for the batch.")
  return data_spec(plan)


def data_spec(plan: Plan) -> P:
  """Dim 0 over the data-parallel axes the batch's rows are split over."""
  axes = plan.axes.batch_axes
  return P(axes[0] if len(axes) == 1 else axes)


def batch_specs(plan: Plan, batch):
  """Each batch leaf's ``PartitionSpec`` (a hand-written step's ``shard_map``
  ``in_specs`` for the batch): dim 0 over the data-parallel axes; under
  context parallelism (a ``"context"`` mesh axis) the leaves
  :class:`~fsdp_jax.ContextParallel` selects also along their sequence
  dimension over ``"context"`` (in the sequence's order, also with
  ``ContextParallel(load_balance=True)``: the loss fetches each device's
  head-tail chunks itself).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, context=2, devices=jax.devices()[:4])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> specs = fsdp_jax.custom.batch_specs(state.plan, {"ids": jnp.ones((2, 8)), "n": jnp.ones(2)})
    >>> from jax.sharding import PartitionSpec as P
    >>> specs["ids"] == P("shard", "context"), specs["n"] == P("shard")
    (True, True)
  """
  spec = data_spec(plan)
  cp = plan.context
  if cp is None:
    return jax.tree.map(lambda _: spec, batch)
  flat, treedef = jax.tree.flatten(batch)
  ctx = plan.axes.context_axes
  ctx = ctx[0] if len(ctx) == 1 else ctx
  along = P(*(tuple(spec) + (None,) * (cp.dim - 1) + (ctx,)))
  return jax.tree.unflatten(treedef, [along if s else spec for s in
                                      context_lib.split_mask(cp, batch)])


def hook_state_spec(plan: Plan) -> P:
  """Per-device hook state: a leading device axis split over the data axes."""
  axes = plan.axes.data_axes
  return P(axes[0] if len(axes) == 1 else axes)


def hook_key(unit: UnitSpec, group_index: int) -> str:
  """The key of a unit's dtype group in a stateful hook's state."""
  return f"{unit.flat_key}#{group_index}"


def split_trainable(plan: Plan, params):
  """Stored params -> ``(trainable, frozen)``.

  Flat layout: two dicts of flat parameters (a unit is all frozen or all
  trainable). Original layout: two trees shaped like the params, with
  ``None`` in place of the other kind's leaves.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> trainable, frozen = fsdp_jax.custom.split_trainable(state.plan, state.params)
    >>> sorted(trainable), frozen
    (['_flat_param'], {})
  """
  if not plan.use_orig_params:
    frozen_keys = {u.flat_key for u in plan.units if u not in plan.trainable_units}
    frozen_keys |= {plan.ignored_key(l) for l in plan.ignored_leaves if l.frozen}
    return ({k: v for k, v in params.items() if k not in frozen_keys},
            {k: v for k, v in params.items() if k in frozen_keys})
  leaves = jax.tree_util.tree_leaves(params)
  train = [None if l.frozen else x for l, x in zip(plan.leaves, leaves)]
  frozen = [x if l.frozen else None for l, x in zip(plan.leaves, leaves)]
  return (jax.tree_util.tree_unflatten(plan.treedef, train),
          jax.tree_util.tree_unflatten(plan.treedef, frozen))


def merge_trainable(plan: Plan, trainable, frozen):
  """Inverse of :func:`split_trainable`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> parts = fsdp_jax.custom.split_trainable(state.plan, state.params)
    >>> fsdp_jax.custom.merge_trainable(state.plan, *parts) == state.params
    True
  """
  if not plan.use_orig_params:
    out = {**frozen, **trainable}
    return {k: out[k] for k in sorted(out)}
  t = iter(jax.tree_util.tree_leaves(trainable))
  f = iter(jax.tree_util.tree_leaves(frozen))
  leaves = [next(f) if l.frozen else next(t) for l in plan.leaves]
  return jax.tree_util.tree_unflatten(plan.treedef, leaves)
