"""The sharding plan: units, their leaves, and how each is laid out in shards.

A :class:`Plan` is static (hashable) metadata carried by the train state. It is
what ``print(state.plan)`` shows, like printing an FSDP-wrapped PyTorch model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fsdp_jax._src import offload
from fsdp_jax._src.config import (FSDPConfig, MixedPrecision, ShardingStrategy,
                                  gradient_divide_factors, is_float_dtype)
from fsdp_jax._src.mesh import MeshAxes


@dataclasses.dataclass(frozen=True)
class LeafSpec:
  """One original parameter.

  ``shape`` is the full shape; ``layer_shape`` drops the leading layer axis of
  a stacked unit. In the original-parameter layout the leaf is padded along
  its first per-layer dimension ``dim0`` to ``shard_size * chunk0`` rows.
  """

  index: int
  name: str
  shape: tuple[int, ...]
  dtype: Any
  unit: int
  layer_shape: tuple[int, ...]
  frozen: bool = False
  ignored: bool = False

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
  # Subtrees that look like stacked layers but are not declared stacked:
  # ((dotted name, number of layers), ...); see frameworks.stacked_hints.
  stacked_hints: tuple = ()

  def __post_init__(self):
    _check_resharding(self)
    _check_prefetch_units(self)

  # Plans compare by the content that matters for tracing.
  def _key(self):
    return (self.treedef, self.leaves, self.units, self.config, self.mesh, self.axes,
            self.model_state_dtypes, self.opt_layout, self.opt_update)

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
    return self.prefix(unit) + (self.n * self.chunk0(leaf),) + leaf.rest

  def storage_shape_of_unit(self, unit: UnitSpec) -> tuple[int, ...]:
    return self.prefix(unit) + (self.n * self.flat_chunk(unit),)

  def spec_for(self, unit: UnitSpec) -> P:
    axes = self.axes.shard_axes
    if not axes:
      return P()
    axis = axes[0] if len(axes) == 1 else axes
    return P(None, axis) if unit.stacked else P(axis)

  def padded_numel(self, unit: UnitSpec) -> int:
    """Elements stored for the unit across all devices (with padding)."""
    layers = unit.num_layers if unit.stacked else 1
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

  # ---- printing ----------------------------------------------------------
  def divide_factors(self) -> tuple[float, float]:
    return gradient_divide_factors(self.axes.world_size)

  def collectives_per_step(self) -> dict[str, int]:
    """Collectives the strategy implies per step (upper bound for FULL_SHARD:
    a unit whose parameters the backward does not need is not re-gathered).

    A unit (per dtype) is gathered and reduced with one collective each;
    with ``use_orig_params=True`` with one per leaf (see
    :func:`fsdp_jax._src.collectives.gathers_per_leaf`), and all-reduced
    once per unit over the replicate axes. A stacked unit's scan gathers
    its first layer before each of its loops and the others inside it: two
    gather instructions per pass (hpZ's stacked units: one; a scan unrolled
    ``u`` times repeats the loop's instruction ``u`` times)."""
    # pylint: disable=import-outside-toplevel  (layout imports this module)
    from fsdp_jax._src import layout
    strategy = self.config.sharding_strategy
    out = {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}
    for u in self.units:
      for _, spec, gathers, reduces in layout.group_collectives(self, u):
        if strategy is ShardingStrategy.NO_SHARD:
          out["all-reduce"] += 1
          continue
        per_pass = 2 if u.stacked and not spec.secondary else 1
        out["all-gather"] += per_pass * (
            gathers + (1 if spec.secondary else gathers) * self.reshard(u))
        out["reduce-scatter"] += reduces
        if self.config.is_hybrid:
          out["all-reduce"] += 1
    return out

  def bytes_kept_for_backward(self) -> int:
    """Bytes of gathered parameters each device holds from the forward pass
    to the backward pass (outside a scan over stacked layers, which keeps
    one layer's worth per iteration).

    Units that are not resharded (the root, every unit under
    ``SHARD_GRAD_OP``) count whole, in the bytes their all-gather moves
    (quantized when ``all_gather_quantization`` is set); with
    ``reshard_after_forward=k`` a resharded unit counts ``1/k`` of that (its
    secondary shard); with ``reshard_after_forward=True`` it counts 0.
    ``NO_SHARD`` gathers nothing: 0.

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
    from fsdp_jax._src import collectives, layout  # pylint: disable=import-outside-toplevel
    if not self.axes.shard_axes:
      return 0
    total = 0
    for unit in self.units:
      layers = unit.num_layers if unit.stacked else 1
      for _, spec in layout.gather_specs(self, unit):
        dtype, length = collectives.payload_row(spec)
        full = spec.n * length * np.dtype(dtype).itemsize * layers
        if not spec.reshard:
          total += full
        elif spec.secondary:
          total += full // spec.secondary
    return total

  def _zeropp_lines(self) -> list[str]:
    cfg = self.config
    lines = []
    k = cfg.reshard_after_forward
    if not isinstance(k, bool):
      lines.append(
          f"  reshard after forward onto groups of {k}: each device keeps 1/{k} of every "
          f"resharded unit for the backward all-gather, which runs within its group of {k}; "
          f"gathered bytes kept forward->backward: {self.bytes_kept_for_backward():,}/device")
    if cfg.all_gather_quantization is not None:
      lines.append(f"  all-gather quantization: {cfg.all_gather_quantization.describe()} "
                   "(floating-point units; master shards exact)")
    if cfg.reduce_scatter_quantization is not None:
      hier = " (within 'shard', then across 'replicate')" if (
          len(self.axes.shard_axes) > 1 or self.axes.replicate_axes) else ""
      q = cfg.reduce_scatter_quantization
      implied = ", stochastic rounding" if q.rounding is None and q.stochastic(gradient=True) else ""
      lines.append(f"  gradient reduction: quantized all-to-all, "
                   f"{q.describe()}{implied}, summed in float32{hier}")
    for name in ("forward_prefetch_units", "backward_prefetch_units"):
      for unit, targets in getattr(cfg, name):
        lines.append(f"  {name}: {unit} -> {', '.join(targets)}")
    return lines

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

  def __str__(self) -> str:
    cfg = self.config
    mp = cfg.mixed_precision
    lines = [
        f"FSDP plan: {cfg.sharding_strategy.name}, "
        f"{'original parameters' if self.use_orig_params else 'flat parameters'}, "
        f"mesh {dict(self.mesh.shape)}, shard over {self.axes.shard_axes or '()'} "
        f"(N={self.n}), data-parallel world {self.axes.world_size}",
    ]
    if mp is not None:
      lines.append(f"  mixed precision: param {mp.param_dtype}, reduce "
                   f"{mp.effective_reduce_dtype}, buffers {mp.buffer_dtype}")
    ignored = [l.name for l in self.ignored_leaves]
    if ignored:
      lines.append(f"  ignored (a full copy per device, never gathered, gradients not "
                   f"reduced): {', '.join(ignored)}")
    frozen = sum(l.frozen for l in self.leaves)
    if frozen:
      lines.append(f"  frozen parameters: {frozen} of {len(self.leaves)} (no gradient, no optimizer state)")
    header = f"  {'unit':<32} {'leaves':>6} {'numel':>12} {'padding':>8} {'bytes/device':>13}"
    lines.append(header)
    total_numel = total_bytes = 0
    for u in self.units:
      numel = self.unit_numel(u)
      padded = self.padded_numel(u)
      itemsize = max(np.dtype(self.leaves[i].dtype).itemsize for i in u.leaf_ids)
      per_dev = padded // self.n * itemsize
      total_numel += numel
      total_bytes += per_dev
      tag = " [stacked x%d]" % u.num_layers if u.stacked else ""
      if "mixed_precision" in u.override_dict:
        mpu = u.override_dict["mixed_precision"]
        tag += " [fp32]" if mpu is None else f" [{mpu.param_dtype}]"
      lines.append(f"  {u.display_name + tag:<32} {len(u.leaf_ids):>6} {numel:>12,} "
                   f"{padded - numel:>8,} {per_dev:>13,}")
      for i in u.leaf_ids:
        leaf = self.leaves[i]
        lines.append(f"      {leaf.name:<40} {str(leaf.shape):<18} {np.dtype(leaf.dtype).name}"
                     + (" frozen" if leaf.frozen else ""))
    lines.append(f"  {'total':<32} {len(self.leaves):>6} {total_numel:>12,} "
                 f"{'':>8} {total_bytes:>13,}")
    for name, layers in self.stacked_hints:
      lines.append(f"  looks stacked, gathered whole: {name} (every leaf has a leading axis "
                   f"of {layers}); if a scan runs over it: "
                   f"FSDPConfig(stacked_layers=({name!r},))")
    coll = self.collectives_per_step()
    lines.append("  collectives per step: " + ", ".join(f"{v} {k}" for k, v in coll.items() if v))
    lines.extend(self._zeropp_lines())
    if self.opt_layout is not None:
      from fsdp_jax._src import optim  # pylint: disable=import-outside-toplevel
      sharded, replicated = optim.state_bytes(self, self.opt_layout)
      slots = ", ".join(self.opt_layout.slot_names) or "none"
      lines.append(f"  optimizer state: {sharded + replicated:,} bytes/device "
                   f"({sharded:,} sharded in slots {slots}; {replicated:,} replicated)")
      if self.opt_update is not None:
        lines.append(f"  optimizer update: {self.opt_update.describe()}")
    pre, post = self.divide_factors()
    lines.append(f"  gradient divide factors: pre {pre:g}, post {post:g}")
    return "\n".join(lines)


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
