"""Configuration objects mirroring ``torch.distributed.fsdp``.

Every option keeps PyTorch's name and default. Options that change numbers
follow PyTorch's documented semantics; options that only change scheduling in
PyTorch (``backward_prefetch``, ``forward_prefetch``, ``limit_all_gathers``)
become explicit ordering of the step's collectives against its computation
(see :func:`fsdp_jax._src.schedule.ordered`).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax._src.collectives import check_hook
from fsdp_jax._src.context import ContextParallel
from fsdp_jax._src.lora import LoRA
from fsdp_jax._src.quantization import Quantization
from fsdp_jax._src.tensor import TensorParallel


class ShardingStrategy(enum.Enum):
  """How parameters, gradients and optimizer state are sharded.

  * ``FULL_SHARD``: parameters, gradients and optimizer state are sharded over
    the whole data-parallel world; a unit is all-gathered before its forward,
    freed after it, and all-gathered again for its backward (ZeRO-3).
  * ``SHARD_GRAD_OP``: like ``FULL_SHARD`` but the gathered unit is kept from
    forward to backward (one all-gather per unit per step, ZeRO-2).
  * ``NO_SHARD``: replicated parameters and all-reduced gradients (DDP).
  * ``HYBRID_SHARD``: ``FULL_SHARD`` inside each ``"shard"`` group and
    replication across the ``"replicate"`` mesh axis.
  * ``_HYBRID_SHARD_ZERO2``: ``SHARD_GRAD_OP`` inside each ``"shard"`` group,
    replicated across ``"replicate"``.

  Example:
    >>> import fsdp_jax
    >>> fsdp_jax.FSDPConfig(sharding_strategy=fsdp_jax.ShardingStrategy.SHARD_GRAD_OP
    ...                     ).reshard_after_forward
    False
  """

  FULL_SHARD = enum.auto()
  SHARD_GRAD_OP = enum.auto()
  NO_SHARD = enum.auto()
  HYBRID_SHARD = enum.auto()
  _HYBRID_SHARD_ZERO2 = enum.auto()


HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD,
                     ShardingStrategy._HYBRID_SHARD_ZERO2)
RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD,
                         ShardingStrategy.HYBRID_SHARD)


class BackwardPrefetch(enum.Enum):
  """PyTorch's backward prefetch modes (``BACKWARD_PRE`` is the default).

  Example:
    >>> import fsdp_jax
    >>> fsdp_jax.FSDPConfig().backward_prefetch is fsdp_jax.BackwardPrefetch.BACKWARD_PRE
    True
  """

  BACKWARD_PRE = enum.auto()
  BACKWARD_POST = enum.auto()


class StateDictType(enum.Enum):
  """PyTorch's state-dict kinds.

  Example:
    >>> import fsdp_jax
    >>> [t.name for t in fsdp_jax.StateDictType]  # doctest: +ELLIPSIS
    ['FULL_STATE_DICT', ...]
  """

  FULL_STATE_DICT = enum.auto()
  LOCAL_STATE_DICT = enum.auto()
  SHARDED_STATE_DICT = enum.auto()


def _canon_dtype(dtype):
  return None if dtype is None else jnp.dtype(dtype)


def value_key(value):
  """What configuration values compare and hash by: their contents.

  Two configs built separately from equal parts are equal (and hash equal,
  so a jitted step compiled for one is reused for the other). Dataclasses
  compare field by field, ``functools.partial`` objects by function and
  arguments (``functools.partial(size_based_auto_wrap_policy,
  min_num_params=...)`` is PyTorch's idiom; partials themselves compare by
  identity), containers by their items, dtypes by ``jnp.dtype``. A plain
  function compares by identity: the same function object is the same
  policy, and nothing else can honestly be said of two functions.

  Example:
    >>> import functools, fsdp_jax
    >>> from fsdp_jax._src.config import value_key
    >>> p = lambda: functools.partial(fsdp_jax.size_based_auto_wrap_policy,
    ...                               min_num_params=100)
    >>> value_key(p()) == value_key(p())
    True
  """
  if isinstance(value, functools.partial):
    return ("partial", value_key(value.func), value_key(value.args),
            value_key(value.keywords))
  if hasattr(value, "_value_key") and not isinstance(value, type):
    return (type(value), value._value_key())  # pylint: disable=protected-access
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return (type(value), tuple((f.name, value_key(getattr(value, f.name)))
                               for f in dataclasses.fields(value) if f.compare))
  if isinstance(value, (list, tuple)):
    return ("seq", tuple(value_key(v) for v in value))
  if isinstance(value, (set, frozenset)):
    return ("set", frozenset(value_key(v) for v in value))
  if isinstance(value, Mapping):
    return ("map", frozenset((value_key(k), value_key(v)) for k, v in value.items()))
  if isinstance(value, type) and issubclass(value, np.generic):
    return np.dtype(value)  # np.float32
  if isinstance(getattr(value, "dtype", None), np.dtype) and callable(value):
    return value.dtype  # jnp.bfloat16 and the other jnp scalar types
  try:
    hash(value)
  except TypeError:
    return ("id", id(value))
  return value


class _ValueEquality:
  """``==`` and ``hash`` by :func:`value_key` (for frozen dataclasses declared
  with ``eq=False``)."""

  def __eq__(self, other):
    return type(other) is type(self) and value_key(self) == value_key(other)

  def __hash__(self):
    return hash(value_key(self))


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class MixedPrecision(_ValueEquality):
  """PyTorch's ``MixedPrecision``: the dtypes used in forward, backward and
  gradient reduction.

  Sharded master parameters stay in their stored (full) precision. A unit is
  cast to ``param_dtype`` *before* its all-gather, so a bf16 gather moves half
  the bytes of an fp32 one. Gradients are reduced in ``reduce_dtype``, which
  falls back to ``param_dtype`` when unset, and are returned to the optimizer
  in the stored precision unless ``keep_low_precision_grads``. Only floating
  point values are cast. Keyword-only, frozen, compared by value.

  Args:
    param_dtype: the dtype units are gathered and computed in (PyTorch
      ``param_dtype``); ``None``: the stored dtype.
    reduce_dtype: the dtype gradients are reduced in; ``None``: falls back to
      ``param_dtype`` (PyTorch's rule), then the stored dtype.
    buffer_dtype: the dtype of floating model state (Flax collections such as
      BatchNorm statistics) in the forward; ``None``: as stored.
    keep_low_precision_grads: return gradients to the optimizer in the
      reduced dtype instead of the stored one (default ``False``).
    cast_forward_inputs: cast floating inputs of every unit to its
      ``param_dtype`` (default ``False``, as in PyTorch).
    cast_root_forward_inputs: cast the floating batch leaves (or only
      ``shard_train_step(forward_inputs=...)``) to ``param_dtype`` (default
      ``True``, as in PyTorch).

  Example:
    >>> import jax.numpy as jnp
    >>> import fsdp_jax
    >>> mp = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16,
    ...                              reduce_dtype=jnp.float32)
    >>> mp.effective_reduce_dtype
    dtype('float32')
  """

  param_dtype: Optional[Any] = None
  reduce_dtype: Optional[Any] = None
  buffer_dtype: Optional[Any] = None
  keep_low_precision_grads: bool = False
  cast_forward_inputs: bool = False
  cast_root_forward_inputs: bool = True
  _module_classes_to_ignore: tuple = ("BatchNorm",)

  def __post_init__(self):
    object.__setattr__(self, "_module_classes_to_ignore",
                       tuple(self._module_classes_to_ignore))
    for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
      value = _canon_dtype(getattr(self, name))
      if value is not None and not jnp.issubdtype(value, jnp.floating):
        raise ValueError(
            f"MixedPrecision.{name}={value} is not a floating-point dtype. "
            "Mixed precision only casts floating-point values; pass e.g. "
            "jnp.bfloat16, jnp.float16 or jnp.float32.")
      object.__setattr__(self, name, value)

  @property
  def effective_reduce_dtype(self):
    """``reduce_dtype``, falling back to ``param_dtype`` (PyTorch's rule)."""
    return self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class CPUOffload(_ValueEquality):
  """PyTorch's ``CPUOffload(offload_params=False)``.

  With ``offload_params=True`` the sharded parameters and the optimizer state
  live in host memory (each device's ``pinned_host`` memory kind, the same
  shards in host RAM). Every step copies each unit's parameter shards to the
  device at its all-gather (one unit at a time), moves the reduced (and, with
  ``max_norm``, clipped)
  gradient shards to the host, and runs ``optimizer.update`` and
  ``optax.apply_updates`` on the host, so the new parameters and optimizer
  state are written in host memory. The step counter, ``model_state`` and a
  communication hook's state stay on the device. The devices must have a
  ``pinned_host`` memory kind; ``init_train_state`` raises a ``ValueError``
  otherwise. Keyword-only, frozen, compared by value.

  Args:
    offload_params: keep parameter shards, gradients and optimizer state in
      host memory (default ``False``, as in PyTorch).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> cfg = fsdp_jax.FSDPConfig(
    ...     cpu_offload=fsdp_jax.CPUOffload(offload_params=True))
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.adam(1e-3), mesh=mesh, config=cfg)
    >>> state.params["_flat_param"].sharding.memory_kind
    'pinned_host'
  """

  offload_params: bool = False


# ActivationCheckpointing's named policies (see ActivationCheckpointing.policy).
CHECKPOINT_POLICIES = ("full", "dots", "offload")


@dataclasses.dataclass(frozen=True, eq=False)
class ActivationCheckpointing(_ValueEquality):
  """Activation checkpointing applied by the framework, as PyTorch's
  ``apply_activation_checkpointing(model, check_fn=...)``: each selected
  unit's computation in the loss (from the first equation that reads the
  unit's parameters to the last; for a scan over stacked layers, the scan's
  body, one layer at a time) runs under ``jax.checkpoint``, so its
  intermediates are recomputed in the backward pass instead of kept. The
  model is unchanged. The step's collectives stay those of the strategy:
  FULL_SHARD's backward all-gather serves the recomputation, SHARD_GRAD_OP
  keeps its forward gather. Frozen, compared by value.

  Args:
    policy: what each checkpoint saves. ``"full"`` (default): only the
      unit's inputs; ``"dots"``: also the outputs of matmuls without batch
      dimensions (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``,
      torchtitan's selective checkpointing); ``"offload"``: what ``"full"``
      saves of the activations goes to host memory (``pinned_host``) in the
      forward pass and comes back in the backward
      (``save_and_offload_only_these_names``; the gathered parameters are
      not offloaded: the strategy keeps or re-gathers them); or any
      ``jax.checkpoint_policies`` policy callable.
    units: which units: ``None`` (default) every unit but the root; a glob
      pattern or a sequence of them over unit names (as ``print(state.plan)``
      lists them; ``*`` within one dotted segment, ``**`` across), each of
      which must name a unit; or a predicate ``units(name) -> bool``, asked
      about every unit's name (``"<root>"`` too). LoRA's adapters and
      tensor-parallel parts go with the unit they belong to.

  Example:
    >>> import fsdp_jax
    >>> cfg = fsdp_jax.FSDPConfig(
    ...     activation_checkpointing=fsdp_jax.ActivationCheckpointing("dots", units="blocks.*"))
    >>> cfg.activation_checkpointing.units
    ('blocks.*',)
    >>> fsdp_jax.ActivationCheckpointing() == fsdp_jax.ActivationCheckpointing(policy="full")
    True
  """

  policy: Union[str, Callable[..., Any]] = "full"
  units: Optional[Union[str, Sequence[str], Callable[[str], bool]]] = None

  def __post_init__(self):
    if isinstance(self.policy, str):
      if self.policy not in CHECKPOINT_POLICIES:
        raise ValueError(
            f"ActivationCheckpointing(policy={self.policy!r}) is not a known policy. Pass one "
            f"of {', '.join(repr(p) for p in CHECKPOINT_POLICIES)}, or a "
            "jax.checkpoint_policies policy (e.g. "
            "jax.checkpoint_policies.dots_with_no_batch_dims_saveable).")
    elif not callable(self.policy):
      raise TypeError(
          f"ActivationCheckpointing(policy={self.policy!r}) must be one of "
          f"{', '.join(repr(p) for p in CHECKPOINT_POLICIES)} or a jax.checkpoint_policies "
          "policy callable.")
    units = self.units
    if isinstance(units, str):
      units = (units,)
    elif units is not None and not callable(units):
      try:
        units = tuple(units)
      except TypeError:
        units = None
      if units is None or not units or not all(isinstance(u, str) and u for u in units):
        raise TypeError(
            f"ActivationCheckpointing(units={self.units!r}) must be None (every unit but "
            "the root), unit-name patterns (e.g. 'blocks.*' or ['layers.*']) or a "
            "predicate over unit names.")
    object.__setattr__(self, "units", units)

  def describe(self) -> str:
    """``policy=..., units=...`` as ``print(state.plan)`` shows it."""
    policy = self.policy if isinstance(self.policy, str) else getattr(
        self.policy, "__name__", repr(self.policy))
    units = ("every unit but the root" if self.units is None else
             ", ".join(self.units) if isinstance(self.units, tuple) else
             getattr(self.units, "__name__", repr(self.units)))
    return f"{policy} ({units})"


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class FSDPConfig(_ValueEquality):
  """The ``FullyShardedDataParallel`` constructor's options, keyword-only.

  Args:
    sharding_strategy: a :class:`ShardingStrategy`; ``None`` (default) means
      ``FULL_SHARD``, or ``SHARD_GRAD_OP`` when ``reshard_after_forward=False``
      (PyTorch's default, ``None``, is ``FULL_SHARD``). After construction the
      field holds the strategy in effect.
    cpu_offload: a :class:`CPUOffload` or ``None``; ``CPUOffload(offload_params=True)``
      keeps the sharded params and optimizer state in host memory.
    auto_wrap_policy: a wrap policy choosing the FSDP units:
      :class:`ModuleWrapPolicy`, :class:`CustomPolicy`, or
      ``functools.partial`` of :func:`size_based_auto_wrap_policy` /
      :func:`lambda_auto_wrap_policy` (name patterns: ``*`` within one dotted
      segment, ``**`` across); ``None`` makes the whole tree one root unit.
    backward_prefetch: when the backward pass re-gathers the next unit
      (FULL_SHARD/HYBRID_SHARD): ``BackwardPrefetch.BACKWARD_PRE`` (default:
      before the current unit's gradient computation; most overlap, most
      memory), ``BACKWARD_POST`` (after it, once the current unit is freed)
      or ``None`` (after the current unit's reduce-scatter; no overlap).
    mixed_precision: a :class:`MixedPrecision` or ``None`` (full precision).
    ignored_states: dotted names (glob patterns, ``*`` within a path
      segment, ``**`` across) of parameters or
      subtrees FSDP does not manage (PyTorch ``ignored_states``): they are not
      sharded and never gathered; every device keeps its own full copy and
      updates it with its own, unreduced gradient, as each PyTorch rank does.
    sync_module_states: with several processes, every process starts from
      process 0's parameters, model state and init rng (broadcast at
      ``init_train_state``).
    forward_prefetch: ``True`` lets unit ``k+1``'s gather start before unit
      ``k``'s computation; ``False`` (default) starts it once unit ``k``'s
      computation has started, as PyTorch issues it at unit ``k+1``'s forward.
    limit_all_gathers: ``True`` (default) makes each gather wait until the
      unit two back is freed: at most two units gathered at once.
    use_orig_params: ``False`` (default) flattens each unit into one padded
      FlatParameter; ``True`` keeps the original tree for the optimizer with
      each leaf sharded along dimension 0 (padded), and gathers and reduces
      each leaf with its own collective.
    comm_hook: a communication hook replacing each unit's gradient reduction
      (PyTorch ``register_comm_hook``), e.g. ``fsdp_jax.hooks.bf16_compress_hook``;
      see :mod:`fsdp_jax.hooks`.
    optimizer_update: how the step runs the optimizer, which always sees the
      tree passed to ``init_train_state`` and computes what it computes
      unsharded (see ``docs/optimizers.md``): ``"sharded"`` evaluates its
      update on each device's shards (elementwise work stays local, a
      whole-parameter reduction costs one scalar all-reduce, an operation
      that needs a whole parameter gathers it); ``"global"`` runs it on the
      logical tree outside ``shard_map`` and lets the compiler partition it
      from the state's shardings; ``"auto"`` (default) runs it sharded unless
      it would gather whole parameters (Muon, factored Adafactor), which the
      compiler partitions faster (``benchmarks/OPTIMIZERS.md``).
    nonfinite: what a step does when its gradient norm or loss is not finite
      (NaN or Inf; ``metrics["nonfinite"]`` reports it every step, decided
      the same way on every device and process): ``"propagate"`` (default:
      the update is applied, as unsharded training and PyTorch's
      ``clip_grad_norm_(error_if_nonfinite=False)`` do), ``"skip"`` (params,
      optimizer state, model state, hook state and ``state.step`` stay
      bitwise unchanged, and ``state.nonfinite_steps`` counts the skip) or
      ``"raise"`` (the same, then the step raises
      :class:`~fsdp_jax.NonFiniteError` naming the step and the first
      parameter whose gradient is not finite; the unchanged state is on the
      error).
    stacked_layers: dotted-name glob patterns (as in ``ModuleWrapPolicy``) of
      subtrees whose leaves carry a
      leading layer axis (models that ``lax.scan`` over stacked layers). Each
      such subtree is its own unit, sharded layer by layer, and is gathered one
      layer per scan iteration: each iteration gathers the next layer while
      it computes its own, in forward and backward, as ``forward_prefetch``
      and ``backward_prefetch`` say (at most two gathered layers).
    data_axis_name: the axis name (a string, or a tuple of alias names) the
      model's own collectives use for the data-parallel world, e.g.
      ``"batch"`` for ``nn.BatchNorm(axis_name="batch")`` or
      ``lax.pmean(x, "batch")``. Inside the step each such name means all
      data-parallel mesh axes together (``("shard",)``, or
      ``("replicate", "shard")`` on a 2-D mesh): a synchronised BatchNorm
      computes the statistics of the global batch, as one ``jax.jit`` over
      that batch would. ``None`` (default): only the mesh axis names are
      bound. The names must differ from the mesh's (``"shard"``,
      ``"replicate"``).
    reshard_after_forward: FSDP2's name for what the strategy does with a
      unit after its forward: ``True`` frees it (``FULL_SHARD`` /
      ``HYBRID_SHARD``: the backward all-gathers it again over the whole
      shard axis), ``False`` keeps it gathered (``SHARD_GRAD_OP`` /
      ``_HYBRID_SHARD_ZERO2``), and an int ``k`` (a divisor of the shard-axis
      size, ``1 < k < size``) reshards onto groups of ``k`` adjacent devices
      (ZeRO++'s hpZ secondary shard): each device keeps a ``1/k`` slice of
      each unit's gathered parameters until backward, and the backward
      all-gather runs within its group of ``k`` (one node, or fast links, on
      a cluster). Forward all-gathers still span the shard axis; numbers are
      identical to ``True``. ``None`` (default) takes it from
      ``sharding_strategy``; after construction the field holds the value in
      effect. A pair that disagrees (``SHARD_GRAD_OP`` with ``True`` or an
      int, ``FULL_SHARD`` / ``HYBRID_SHARD`` with ``False``, ``NO_SHARD``
      with ``True`` or an int) raises ``ValueError``.
    all_gather_quantization: a :class:`~fsdp_jax.Quantization`: each device
      block-quantizes its shard of a unit before the all-gather and every
      device dequantizes the gathered unit to the compute dtype (ZeRO++'s
      qwZ; FSDP2 users know it from float8 all-gathers). The stored master
      shards stay exact; the gradient flows straight through the gather to
      them (the reduction is unchanged unless ``reduce_scatter_quantization``
      is set). Floating-point units only. ``None``: gather in the compute
      dtype. See ``docs/zeropp.md``.
    reduce_scatter_quantization: a :class:`~fsdp_jax.Quantization` for the
      gradient reduction (ZeRO++'s qgZ): each device quantizes its unit
      gradient block-wise (integer formats round stochastically unless the
      ``Quantization`` says ``rounding="nearest"``: the reduced gradient is
      unbiased), an all-to-all sends every device the pieces of its shard,
      which it dequantizes and sums in float32. On a 2-D mesh the
      exchange is hierarchical: within ``"shard"`` (in-node) first, then
      across ``"replicate"`` (the hybrid strategies' all-reduce across
      replicas becomes a quantized all-to-all and all-gather). Not with
      ``NO_SHARD`` or a ``comm_hook``.
    forward_prefetch_units: explicit forward prefetch, as FSDP2's
      ``set_modules_to_forward_prefetch``: ``{unit: [units...]}`` maps a unit's
      name to units (later in the forward pass) whose all-gathers are issued
      right after that unit's own, before its computation, whatever
      ``forward_prefetch`` and ``limit_all_gathers`` say for them. Unit names
      are those ``print(state.plan)`` lists (``"<root>"`` for the root).
      Stored as a sorted tuple of ``(unit, (units...))`` pairs.
    backward_prefetch_units: explicit backward prefetch, as FSDP2's
      ``set_modules_to_backward_prefetch``: ``{unit: [units...]}``; the listed
      units' backward all-gathers are issued right after that unit's backward
      all-gather and before its reduce-scatter. Both the unit and the listed
      ones must be re-gathered in the backward pass (resharded, non-root).
    lora: a :class:`~fsdp_jax.LoRA`: LoRA / QLoRA fine-tuning (PEFT's
      semantics). The state stores each target kernel as its frozen base
      (quantized with ``LoRA(base_quantization=...)``) and trainable adapter
      factors; everything else is frozen unless ``LoRA(trainable=...)``
      names it. The model and loss are unchanged. See ``docs/lora.md``.
    tensor_parallel: a :class:`~fsdp_jax.TensorParallel`: tensor parallelism
      over the mesh's ``"tensor"`` axis (``make_mesh(shard=S, tensor=T)``)
      composed with FSDP over the other axes; its rules split the leaves
      they name (``"colwise"``, ``"rowwise"`` or a per-dimension tuple). The
      model and loss are unchanged. See ``docs/tensor_parallel.md``.
    activation_checkpointing: an :class:`~fsdp_jax.ActivationCheckpointing`:
      each selected unit's computation runs under ``jax.checkpoint``
      (PyTorch's ``apply_activation_checkpointing``); ``None`` (default):
      only the model's own checkpoints. See ``docs/activation_checkpointing.md``.
    context_parallel: a :class:`~fsdp_jax.ContextParallel`: context
      parallelism over the mesh's ``"context"`` axis (``make_mesh(...,
      context=C)``): each sequence split into ``C`` chunks, the weights
      sharded over shard x context; the model and loss are unchanged
      (default ``None``: ``ContextParallel()`` when the mesh has a context
      axis). See ``docs/context_parallel.md``.

  Example:
    >>> import fsdp_jax
    >>> cfg = fsdp_jax.FSDPConfig(
    ...     sharding_strategy=fsdp_jax.ShardingStrategy.SHARD_GRAD_OP,
    ...     use_orig_params=True)
    >>> cfg.limit_all_gathers
    True
    >>> # flax's nn.BatchNorm(axis_name="batch") then reduces over all devices:
    >>> fsdp_jax.FSDPConfig(data_axis_name="batch").data_axis_name
    'batch'
    >>> fsdp_jax.FSDPConfig(reshard_after_forward=False).sharding_strategy.name
    'SHARD_GRAD_OP'
    >>> fsdp_jax.FSDPConfig(reshard_after_forward=4).sharding_strategy.name
    'FULL_SHARD'
  """

  sharding_strategy: Optional[ShardingStrategy] = None
  cpu_offload: Optional[CPUOffload] = None
  auto_wrap_policy: Optional[Callable[..., Any]] = None
  backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
  mixed_precision: Optional[MixedPrecision] = None
  ignored_states: Optional[Sequence[str]] = None
  sync_module_states: bool = False
  forward_prefetch: bool = False
  limit_all_gathers: bool = True
  use_orig_params: bool = False
  stacked_layers: Sequence[str] = ()
  comm_hook: Optional[Any] = None
  optimizer_update: str = "auto"
  nonfinite: str = "propagate"
  data_axis_name: Optional[Any] = None
  reshard_after_forward: Optional[Union[bool, int]] = None
  all_gather_quantization: Optional[Quantization] = None
  reduce_scatter_quantization: Optional[Quantization] = None
  forward_prefetch_units: Optional[Mapping[str, Sequence[str]]] = None
  backward_prefetch_units: Optional[Mapping[str, Sequence[str]]] = None
  lora: Optional[LoRA] = None
  tensor_parallel: Optional[TensorParallel] = None
  activation_checkpointing: Optional[ActivationCheckpointing] = None
  context_parallel: Optional[ContextParallel] = None

  def __post_init__(self):
    if self.context_parallel is not None and not isinstance(self.context_parallel,
                                                            ContextParallel):
      raise TypeError(
          f"context_parallel={self.context_parallel!r} must be a fsdp_jax.ContextParallel "
          "or None, e.g. context_parallel=fsdp_jax.ContextParallel(dim=1).")
    if self.activation_checkpointing is not None and not isinstance(
        self.activation_checkpointing, ActivationCheckpointing):
      raise TypeError(
          f"activation_checkpointing={self.activation_checkpointing!r} must be a "
          "fsdp_jax.ActivationCheckpointing or None, e.g. activation_checkpointing="
          "fsdp_jax.ActivationCheckpointing(policy='full').")
    if self.tensor_parallel is not None and not isinstance(self.tensor_parallel,
                                                           TensorParallel):
      raise TypeError(
          f"tensor_parallel={self.tensor_parallel!r} must be a fsdp_jax.TensorParallel or "
          "None, e.g. tensor_parallel=fsdp_jax.TensorParallel(rules=[('*.wq', 'colwise'), "
          "('*.wo', 'rowwise')]).")
    if self.lora is not None and not isinstance(self.lora, LoRA):
      raise TypeError(
          f"lora={self.lora!r} must be a fsdp_jax.LoRA or None, e.g. "
          "lora=fsdp_jax.LoRA(targets=('*.wq', '*.wv'), rank=8).")
    if self.sharding_strategy is not None and not isinstance(
        self.sharding_strategy, ShardingStrategy):
      raise TypeError(
          f"sharding_strategy={self.sharding_strategy!r} is not a "
          "fsdp_jax.ShardingStrategy; pass e.g. "
          "fsdp_jax.ShardingStrategy.FULL_SHARD.")
    strategy, reshard = _resolve_resharding(self.sharding_strategy,
                                            self.reshard_after_forward)
    object.__setattr__(self, "sharding_strategy", strategy)
    object.__setattr__(self, "reshard_after_forward", reshard)
    for name in ("all_gather_quantization", "reduce_scatter_quantization"):
      value = getattr(self, name)
      if value is not None and not isinstance(value, Quantization):
        raise TypeError(
            f"{name}={value!r} must be a fsdp_jax.Quantization or None, e.g. "
            f"{name}=fsdp_jax.Quantization(dtype=jnp.int8, block_size=256).")
    if strategy is ShardingStrategy.NO_SHARD:
      for name in ("all_gather_quantization", "reduce_scatter_quantization"):
        if getattr(self, name) is not None:
          raise ValueError(
              f"{name} needs a sharded strategy: NO_SHARD has no all-gather and "
              "reduces gradients with an all-reduce. Fix: use FULL_SHARD, "
              f"SHARD_GRAD_OP or a hybrid strategy, or drop {name}.")
    if self.reduce_scatter_quantization is not None and self.comm_hook is not None:
      raise ValueError(
          "reduce_scatter_quantization and comm_hook both replace the gradient "
          f"reduction (comm_hook={self.comm_hook!r}). Fix: pass one of them.")
    for name in ("forward_prefetch_units", "backward_prefetch_units"):
      object.__setattr__(self, name, _prefetch_map(name, getattr(self, name)))
    if self.mixed_precision is not None and not isinstance(
        self.mixed_precision, MixedPrecision):
      raise TypeError("mixed_precision must be a fsdp_jax.MixedPrecision or None.")
    if self.comm_hook is not None:
      check_hook(self.comm_hook)
    if isinstance(self.stacked_layers, str):
      object.__setattr__(self, "stacked_layers", (self.stacked_layers,))
    object.__setattr__(self, "stacked_layers", tuple(self.stacked_layers))
    if self.ignored_states is not None:
      object.__setattr__(self, "ignored_states", tuple(self.ignored_states))
    if self.backward_prefetch is not None and not isinstance(
        self.backward_prefetch, BackwardPrefetch):
      raise TypeError(
          f"backward_prefetch={self.backward_prefetch!r}: pass "
          "fsdp_jax.BackwardPrefetch.BACKWARD_PRE, .BACKWARD_POST or None.")
    if self.nonfinite not in ("propagate", "skip", "raise"):
      raise ValueError(
          f"nonfinite={self.nonfinite!r}: pass 'propagate' (default), 'skip' or 'raise'.")
    if self.optimizer_update not in ("auto", "sharded", "global"):
      raise ValueError(
          f"optimizer_update={self.optimizer_update!r}: pass 'auto' (default), 'sharded' "
          "or 'global'.")
    for name in ("forward_prefetch", "limit_all_gathers"):
      if not isinstance(getattr(self, name), bool):
        raise TypeError(f"{name}={getattr(self, name)!r} must be True or False.")
    if self.data_axis_name is not None:
      names = ((self.data_axis_name,) if isinstance(self.data_axis_name, str)
               else tuple(self.data_axis_name)
               if isinstance(self.data_axis_name, (tuple, list)) else ())
      if not names or not all(isinstance(n, str) and n for n in names):
        raise TypeError(
            f"data_axis_name={self.data_axis_name!r}: pass the axis name the model's "
            "collectives use, e.g. 'batch', or a tuple of such names.")
      taken = [n for n in names if n in ("shard", "replicate", "tensor")]
      if taken:
        raise ValueError(
            f"data_axis_name={self.data_axis_name!r}: {taken[0]!r} is a mesh axis name, "
            "already bound inside the step to that mesh axis alone. Pass the name the "
            "model uses for the whole data-parallel world (e.g. 'batch'), or leave "
            "data_axis_name=None if the model reduces over the mesh axes themselves.")
      object.__setattr__(self, "data_axis_name", names[0] if len(names) == 1 else names)

  @property
  def is_hybrid(self) -> bool:
    return self.sharding_strategy in HYBRID_STRATEGIES



def _resolve_resharding(strategy, reshard):
  """``(sharding_strategy, reshard_after_forward)`` in effect, from what was
  passed (either may be None); refuses a pair that disagrees."""
  if reshard is not None:
    if isinstance(reshard, (bool, np.bool_)):
      reshard = bool(reshard)
    elif isinstance(reshard, (int, np.integer)):
      reshard = int(reshard)
      if reshard < 2:
        raise ValueError(
            f"reshard_after_forward={reshard}: an int is the size of the groups a "
            "unit is resharded onto after forward, a divisor of the shard-axis size "
            "greater than 1. Fix: pass e.g. the number of devices per node, or False "
            "to keep whole units (SHARD_GRAD_OP), or True to free them (FULL_SHARD).")
    else:
      raise TypeError(f"reshard_after_forward={reshard!r} must be True, False, an int "
                      "(the size of the groups to reshard onto) or None.")
  if strategy is None:
    strategy = (ShardingStrategy.SHARD_GRAD_OP if reshard is False
                else ShardingStrategy.FULL_SHARD)
  frees = strategy in RESHARD_AFTER_FORWARD
  if reshard is None:
    return strategy, frees
  if strategy is ShardingStrategy.NO_SHARD:
    if reshard is not False:
      raise ValueError(
          f"reshard_after_forward={reshard!r} conflicts with sharding_strategy=NO_SHARD, "
          "which never gathers (parameters are replicated). Fix: drop "
          "reshard_after_forward, or pick a sharded strategy.")
    return strategy, reshard
  if frees != (reshard is not False):
    same = {ShardingStrategy.FULL_SHARD: "SHARD_GRAD_OP",
            ShardingStrategy.SHARD_GRAD_OP: "FULL_SHARD",
            ShardingStrategy.HYBRID_SHARD: "_HYBRID_SHARD_ZERO2",
            ShardingStrategy._HYBRID_SHARD_ZERO2: "HYBRID_SHARD"}[strategy]
    raise ValueError(
        f"reshard_after_forward={reshard!r} conflicts with sharding_strategy="
        f"{strategy.name}, which {'frees' if frees else 'keeps'} each unit after its "
        f"forward (reshard_after_forward={frees}). reshard_after_forward="
        f"{reshard!r} is {same}{' with a secondary shard' if reshard not in (True, False) else ''}. "
        f"Fix: pass only one of the two, or sharding_strategy={same}.")
  return strategy, reshard


def _prefetch_map(name, value):
  """``{unit: [units]}`` -> a sorted tuple of ``(unit, (units...))`` pairs."""
  if value is None or value == ():
    return ()
  items = value.items() if isinstance(value, Mapping) else value
  try:
    pairs = [(k, v) for k, v in items]
  except (TypeError, ValueError):
    raise TypeError(
        f"{name}={value!r} must map a unit's name to a list of unit names, e.g. "
        f"{name}={{'blocks.0': ['blocks.1', 'blocks.2']}}.") from None
  out = {}
  for unit, targets in pairs:
    if isinstance(targets, str):
      targets = (targets,)
    targets = tuple(targets)
    if not isinstance(unit, str) or not all(isinstance(t, str) for t in targets):
      raise TypeError(
          f"{name}: {unit!r} -> {targets!r}: unit names are strings, e.g. "
          f"{name}={{'blocks.0': ['blocks.1', 'blocks.2']}}.")
    if unit in targets:
      raise ValueError(f"{name}: unit {unit!r} lists itself; list the units to gather "
                       "early, after it in execution order.")
    if len(set(targets)) != len(targets):
      raise ValueError(f"{name}: unit {unit!r} lists {list(targets)} with repeats.")
    if unit in out:
      raise ValueError(f"{name}: unit {unit!r} appears twice.")
    out[unit] = targets
  return tuple(sorted(out.items()))


def gradient_divide_factors(world_size: int) -> tuple[float, float]:
  """PyTorch's gradient pre/post divide factors for a data-parallel world.

  The pre-factor is the largest power of two ``f`` with ``world % f == 0`` and
  ``world / f > f`` (PyTorch ``_get_gradient_predivide_factor``); gradients
  are divided by it before the reduction and by ``world / f`` after, so fp16
  sums do not overflow.

  Example:
    >>> [gradient_divide_factors(n) for n in (2, 3, 4, 8, 16)]
    [(2.0, 1.0), (2.0, 1.5), (2.0, 2.0), (4.0, 2.0), (4.0, 4.0)]
  """
  factor = 1
  while world_size % factor == 0 and world_size / factor > factor:
    factor *= 2
  return float(factor), world_size / float(factor)


def is_float_dtype(dtype) -> bool:
  """Whether ``dtype`` is a floating-point dtype (``False`` for PRNG key
  dtypes such as ``key<fry>``, which NumPy cannot interpret)."""
  if is_key_dtype(dtype):
    return False
  return jnp.issubdtype(np.dtype(dtype), jnp.floating)


def is_key_dtype(dtype) -> bool:
  """Whether ``dtype`` is a typed PRNG key dtype (``jax.random.key``)."""
  try:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
  except TypeError:
    return False


def data_axis_names(config: "FSDPConfig") -> tuple[str, ...]:
  """``config.data_axis_name`` as a tuple of names (empty when unset)."""
  names = config.data_axis_name
  if names is None:
    return ()
  return (names,) if isinstance(names, str) else tuple(names)
