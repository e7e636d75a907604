"""``fsdp_jax.estimate``: a step's memory per device and time, for any mesh,
without its devices.

The plan is built for an abstract mesh of the requested shape (exact:
stored, gradient, optimizer and gathered bytes); the loss's per-device
program is compiled unit by unit on the local backend at the per-device
micro-batch (:mod:`.programs`) and put in the step's order
(:mod:`.schedule`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from fsdp_jax._src import attention as attention_lib
from fsdp_jax._src import grads as grads_lib, loss as loss_lib, optim
from fsdp_jax._src import state as state_lib, step as step_lib
from fsdp_jax._src.config import ActivationCheckpointing, FSDPConfig
from fsdp_jax._src.context import CONTEXT
from fsdp_jax._src.mesh import REPLICATE, SHARD, TENSOR
from fsdp_jax._src.planner import programs, schedule, segments as segments_lib
from fsdp_jax._src.planner import step_program
from fsdp_jax._src.planner.devices import DeviceSpec, device_spec

MiB = 1 << 20
GiB = 1 << 30


@dataclasses.dataclass(frozen=True, eq=False)
class Estimate:
  """A step's predicted memory and time on one mesh (:func:`fsdp_jax.estimate`).

  Attributes:
    config: the :class:`~fsdp_jax.FSDPConfig` estimated.
    mesh_shape: ``{"replicate": R, "shard": S, "context": C, "tensor": T}``
      (the axes present), as :func:`fsdp_jax.make_mesh` would build it.
    bytes_per_device: ``{"params", "grads", "optimizer", "activations",
      "total"}``: the stored parameter shards, the reduced gradient shards,
      the optimizer state, the activations at the peak (saved for the
      backward pass, handed between units, cotangents and the running
      program's temporaries, as modelled), and the peak itself
      (``memory_analysis()``'s argument + temp + output - alias of the
      compiled step). With CPU offload the params and optimizer state live
      in host memory and the total counts device memory.
    fits: whether the total fits the device's memory (or ``memory_limit``).
    step_seconds: the predicted step time.
    device: the :class:`~fsdp_jax.DeviceSpec`.
    gradient_accumulation_steps, accumulation: the step's accumulation
      (``shard_train_step``'s options of the same names).
    remat: whether each unit's forward was taken under ``jax.checkpoint``
      (what ``nn.remat`` / ``jax.checkpoint`` per block gives; the planner
      rewrites the loss for the estimate, your model must do it to run so).
    compiled: whether the total is the step's own per-device program
      compiled on the local backend (exact there), or the modelled schedule's
      peak (``estimate(compile_step=...)``).
    peak_at: where in the step the modelled peak is.
    parts: the modelled peak's parts (bytes): arguments, gathered units,
      saved activations, activations, cotangents, gradients, temporaries,
      results.
    compute_seconds, optimizer_seconds: the programs at the roofline.
    comm_seconds: ``{mesh axis: (total, exposed)}`` seconds per step.
    tokens: elements of the first batch leaf (global batch x sequence).
    notes: where the estimate is approximate.
    host_bytes: the activations ``ActivationCheckpointing("offload")``
      keeps in host memory per device (modelled; not in the total).

  Example:
    >>> import fsdp_jax
    >>> est = fsdp_jax.Estimate(
    ...     config=fsdp_jax.FSDPConfig(), mesh_shape={"replicate": 2, "shard": 4},
    ...     bytes_per_device={"params": 1, "grads": 1, "optimizer": 2,
    ...                       "activations": 4, "total": 8},
    ...     fits=True, step_seconds=0.5, device=fsdp_jax.DeviceSpec.preset("H100-80GB"),
    ...     memory_limit=80 * 2**30, tokens=4096)
    >>> est.describe_config(), est.devices, est.tokens_per_second_per_device
    ('FULL_SHARD flat replicate=2xshard=4', 8, 1024.0)
  """

  config: FSDPConfig
  mesh_shape: dict
  bytes_per_device: dict
  fits: bool
  step_seconds: float
  device: DeviceSpec
  memory_limit: int
  gradient_accumulation_steps: int = 1
  accumulation: str = "no_sync"
  remat: bool = False
  compiled: bool = False
  peak_at: str = ""
  parts: dict = dataclasses.field(default_factory=dict)
  compute_seconds: float = 0.0
  optimizer_seconds: float = 0.0
  comm_seconds: dict = dataclasses.field(default_factory=dict)
  tokens: int = 0
  notes: tuple = ()
  host_bytes: int = 0

  @property
  def devices(self) -> int:
    return math.prod(self.mesh_shape.values())

  @property
  def tokens_per_second_per_device(self) -> float:
    """``tokens`` per step time per device."""
    return self.tokens / self.step_seconds / self.devices if self.step_seconds else 0.0

  def describe_config(self) -> str:
    """One line: strategy, layout, mesh and the memory savers used."""
    cfg = self.config
    bits = [cfg.sharding_strategy.name,
            "orig" if cfg.use_orig_params else "flat",
            "x".join(f"{k}={v}" for k, v in self.mesh_shape.items())]
    if cfg.mixed_precision is not None and cfg.mixed_precision.param_dtype is not None:
      bits.append(f"{jnp.dtype(cfg.mixed_precision.param_dtype).name}")
    if cfg.lora is not None:
      bits.append("QLoRA" if cfg.lora.base_quantization is not None else "LoRA")
    if self.remat:
      ac = cfg.activation_checkpointing
      policy = "full" if ac is None else ac.policy
      bits.append("remat" if policy == "full" else
                  f"remat({policy if isinstance(policy, str) else 'custom'})")
    if cfg.cpu_offload is not None and cfg.cpu_offload.offload_params:
      bits.append("offload")
    if self.gradient_accumulation_steps > 1:
      bits.append(f"accum={self.gradient_accumulation_steps}({self.accumulation})")
    return " ".join(bits)

  def __str__(self) -> str:
    b = self.bytes_per_device
    gib = lambda x: f"{x / GiB:.2f} GiB"
    lines = [
        f"Estimate: {self.describe_config()} on {self.devices} x {self.device.name}",
        f"  memory per device: total {gib(b['total'])} of {gib(self.memory_limit)} "
        f"({'fits' if self.fits else 'does NOT fit'}; "
        f"{'compiled' if self.compiled else 'modelled'}); modelled peak at {self.peak_at}",
        f"    params {gib(b['params'])}, grads {gib(b['grads'])}, optimizer "
        f"{gib(b['optimizer'])}, activations {gib(b['activations'])}",
        "    peak: " + ", ".join(f"{k} {v / MiB:,.1f} MiB" for k, v in self.parts.items() if v),
        f"  step time {self.step_seconds * 1e3:,.2f} ms ({self.tokens_per_second_per_device:,.0f} "
        "tokens/s per device)",
        f"    compute {self.compute_seconds * 1e3:,.2f} ms (optimizer "
        f"{self.optimizer_seconds * 1e3:,.2f} ms)",
    ]
    for axis, (total, exposed) in sorted(self.comm_seconds.items()):
      lines.append(f"    communication over {axis!r}: {total * 1e3:,.2f} ms, exposed "
                   f"{exposed * 1e3:,.2f} ms, hidden {max(0.0, total - exposed) * 1e3:,.2f} ms")
    for note in self.notes:
      lines.append(f"  note: {note}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Checking what was asked


_AXIS_ORDER = (REPLICATE, SHARD, CONTEXT, TENSOR)


def check_mesh_shape(mesh_shape, config: FSDPConfig, devices: Optional[int] = None) -> dict:
  """``mesh_shape`` as an ordered dict, or a ``ValueError`` naming the fix."""
  if not isinstance(mesh_shape, dict) or not mesh_shape:
    raise ValueError(
        f"mesh_shape={mesh_shape!r} must be a dict of mesh axis sizes, e.g. {{'shard': 64}}, "
        "{'replicate': 4, 'shard': 16}, {'shard': 2, 'context': 4} or "
        "{'shard': 8, 'tensor': 8}.")
  tensor_axis = config.tensor_parallel.axis if config.tensor_parallel is not None else TENSOR
  order = (REPLICATE, SHARD, CONTEXT, tensor_axis)
  unknown = [a for a in mesh_shape if a not in order]
  if unknown:
    raise ValueError(f"mesh_shape={mesh_shape!r} has axes {unknown} fsdp_jax does not use. "
                     f"Fix: use the axes {list(order)} (make_mesh's names).")
  for a, s in mesh_shape.items():
    if not isinstance(s, (int, np.integer)) or s < 1:
      raise ValueError(f"mesh_shape[{a!r}]={s!r} must be a positive int.")
  if SHARD not in mesh_shape:
    raise ValueError(f"mesh_shape={mesh_shape!r} has no 'shard' axis. Fix: add one, e.g. "
                     f"{{**mesh_shape, 'shard': 1}}.")
  shape = {a: int(mesh_shape[a]) for a in order if a in mesh_shape}
  n = math.prod(shape.values())
  if devices is not None and n != devices:
    sizes = " x ".join(f"{a}={s}" for a, s in shape.items())
    raise ValueError(
        f"mesh_shape {shape} multiplies to {n} devices ({sizes}), not devices={devices}. "
        f"Fix: choose sizes whose product is {devices}, e.g. {{'shard': {devices}}}"
        + (f" or {{'replicate': {_factor(devices)}, 'shard': {devices // _factor(devices)}}}"
           if _factor(devices) > 1 else "") + ".")
  return shape


def _factor(n: int) -> int:
  for f in range(2, int(math.isqrt(n)) + 1):
    if n % f == 0:
      return f
  return 1


def abstract_mesh(shape: dict) -> AbstractMesh:
  """An abstract mesh with make_mesh's axis names and types."""
  names = tuple(shape)
  sizes = tuple(shape.values())
  try:
    return AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(names))
  except TypeError:  # an older signature: ((name, size), ...)
    return AbstractMesh(tuple(zip(names, sizes)))


def _structs(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def local_batch(plan, batch, steps: int):
  """The per-device micro-batch's shapes: dim 0 over the data-parallel
  devices and the microbatches; under a ``"context"`` axis the split
  leaves' sequence over it too (:func:`fsdp_jax._src.step.local_shapes`)."""
  return step_lib.local_shapes(plan, batch, steps)


def _tree_bytes(tree) -> int:
  return sum(segments_lib.nbytes(x) for x in jax.tree.leaves(tree))


# --------------------------------------------------------------------------
# The estimate


class Planner:
  """What estimates of one model share: the user's tree traced once, and
  compiled programs by their text (so a search compiles each distinct
  per-device program once)."""

  def __init__(self, loss_fn: Callable, *, optimizer, batch, init_fn=None, params=None,
               rng=None):
    if (params is None) == (init_fn is None):
      raise ValueError("Pass exactly one of params= or init_fn= (either may be abstract: "
                       "jax.ShapeDtypeStruct leaves, or a function that is traced, never run).")
    if not callable(loss_fn):
      raise TypeError("loss_fn must be callable as loss_fn(params, batch).")
    self.loss_fn = loss_fn
    self.optimizer = optim.as_transformation(optimizer)
    self.batch = _structs(batch)
    for path, x in jax.tree_util.tree_flatten_with_path(self.batch)[0]:
      if not x.shape:
        raise ValueError(f"Batch leaf {jax.tree_util.keystr(path) or 'batch'} is a scalar; "
                         "every batch leaf needs a leading (global) batch dimension.")
    self.rng = rng if rng is not None else jax.random.key(0)
    self._init_fn = init_fn
    self._params = params
    self._user = None
    self._types: dict = {}
    self.programs_cache: dict = {}
    self.optimizer_cache: dict = {}
    self.trace_cache: dict = {}
    self.step_cache: dict = {}

  def with_batch(self, batch) -> "Planner":
    """A planner of the same model for another global batch, sharing this
    one's traces and compiled programs (a per-device program depends on the
    per-device micro-batch only)."""
    other = Planner(self.loss_fn, optimizer=self.optimizer, batch=batch,
                    init_fn=self._init_fn, params=self._params, rng=self.rng)
    other._user, other._types = self._user, self._types  # pylint: disable=protected-access
    other.programs_cache, other.optimizer_cache = self.programs_cache, self.optimizer_cache
    other.trace_cache, other.step_cache = self.trace_cache, self.step_cache
    return other

  @property
  def batch_rows(self) -> int:
    """The global batch's leading dimension (of its first leaf)."""
    return int(jax.tree.leaves(self.batch)[0].shape[0])

  def plan(self, config: FSDPConfig, mesh_shape: dict):
    mesh = abstract_mesh(mesh_shape)
    if self._user is None:
      plan, ms, self._user, self._types = state_lib.abstract_plan(
          optimizer=self.optimizer, mesh=mesh, config=config, params=self._params,
          init_fn=self._init_fn, rng=self.rng, update_mode=False)
      return plan, ms
    plan, ms, _, _ = state_lib.abstract_plan(
        optimizer=self.optimizer, mesh=mesh, config=config, params=self._user,
        module_classes=self._types, rng=self.rng, update_mode=False)
    return plan, ms

  def estimate(self, config: FSDPConfig, mesh_shape: dict, device: DeviceSpec, **kw
               ) -> Estimate:
    """:func:`fsdp_jax.estimate` for this model (keywords as there)."""
    seen: list = []
    with cudnn_as_blockwise(seen):
      est = self._estimate(config, mesh_shape, device, **kw)
    if seen:
      est = dataclasses.replace(est, notes=est.notes + (CUDNN_NOTE,))
    return est

  def _estimate(self, config: FSDPConfig, mesh_shape: dict, device: DeviceSpec, *,
                memory_limit: Optional[int] = None, gradient_accumulation_steps: int = 1,
                accumulation: str = "no_sync", remat: bool = False,
                compile_step: Optional[bool] = None) -> Estimate:
    steps = int(gradient_accumulation_steps)
    if steps < 1:
      raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be >= 1.")
    if accumulation not in ("no_sync", "sharded"):
      raise ValueError(f"accumulation={accumulation!r}: use 'no_sync' or 'sharded'.")
    # remat=True is FSDPConfig(activation_checkpointing=ActivationCheckpointing("full")):
    # the step compiled with the engine's checkpoints, the units' programs
    # modelled under a checkpoint each (traced without them).
    if remat and config.activation_checkpointing is None:
      config = dataclasses.replace(config, activation_checkpointing=ActivationCheckpointing())
    remat = config.activation_checkpointing is not None
    plan, ms = self.plan(dataclasses.replace(config, activation_checkpointing=None), mesh_shape)
    step_lib.check_batch(plan, self.batch)
    if steps > 1:
      grads_lib.check_microbatches(local_batch(plan, self.batch, 1), steps)
    micro = local_batch(plan, self.batch, steps)
    takes_rng = loss_lib.takes_rng(self.loss_fn)
    rng = None
    if takes_rng:
      rng = jax.eval_shape(lambda: jax.random.key(0))
    segments, equations, checkpointed = self._segments(plan, micro, ms, rng,
                                                       config.activation_checkpointing)
    opt_prog = self._optimizer_program(plan)
    offloaded = plan.offloaded
    param_bytes = _stored_param_bytes(plan)
    sharded, replicated = optim.stored.state_bytes(plan, plan.opt_layout)
    opt_bytes = sharded + replicated
    grads = sum(b.shard * b.layers for b in schedule.unit_bytes(plan).values() if b.trainable)
    batch_bytes = _tree_bytes(local_batch(plan, self.batch, 1))
    other = _tree_bytes(ms) + 4 + (segments_lib.nbytes(rng) if rng is not None else 0)
    arguments = batch_bytes + other + (0 if offloaded else param_bytes + opt_bytes)
    mem = schedule.memory(plan, segments, opt_prog, arguments=arguments,
                          extra_outputs=16, accumulation_steps=steps,
                          accumulation=accumulation, checkpointed=checkpointed or remat)
    t = schedule.step_time(plan, segments, opt_prog, device, mesh_shape=mesh_shape,
                           accumulation_steps=steps, accumulation=accumulation,
                           offloaded=offloaded)
    parts = {"arguments": arguments, **mem.parts}
    activations = sum(mem.parts.get(k, 0) for k in ("saved", "activations", "cotangents",
                                                     "temporaries", "results", "deferred"))
    limit = int(memory_limit) if memory_limit is not None else int(device.memory_bytes)
    notes = list(_notes(plan, segments, steps, accumulation))
    host = sum(s.programs.host_bytes for s in segments)
    if host:
      notes.append(f"ActivationCheckpointing('offload'): {_size(host)} of saved activations "
                   "in host memory (modelled; not in the total)")
    total, compiled = mem.peak, False
    why_not = None
    if compile_step is not False:
      full_plan = self.step_plan(config, mesh_shape)
      why_not = step_program.why_not_compiled(full_plan)
    if compile_step and why_not:
      raise ValueError(f"compile_step=True: the step's program cannot be compiled for this "
                       f"estimate: {why_not}. Fix: pass compile_step=None (modelled) or "
                       "compile_step=False.")
    if compile_step is None:
      compile_step = why_not is None and equations <= step_program.AUTO_EQUATIONS
    if compile_step:
      total = self._compiled_peak(full_plan, ms, steps, accumulation, checkpointed, remat)
      compiled = True
      notes[0] = (f"the peak: the step's own per-device program compiled on the "
                  f"{jax.default_backend()} backend, its collectives replaced by local "
                  "stand-ins of the same shapes; the breakdown and its location are the "
                  f"modelled schedule's (which peaks at {_size(mem.peak)})")
    elif equations > step_program.AUTO_EQUATIONS and why_not is None:
      notes.append(f"the loss's per-device program has {equations:,} equations: the peak is "
                   "modelled, not compiled (estimate(compile_step=True) compiles the step, "
                   "which costs about one compile of it)")
    elif why_not is not None:
      notes.append(f"the peak is modelled, not compiled: {why_not}")
    if programs.concurrency_scheduler():
      notes.append(programs.SCHEDULER_NOTE)
      warnings.warn(programs.SCHEDULER_NOTE, stacklevel=2)
    first = jax.tree.leaves(self.batch)[0]
    tokens = int(np.prod(first.shape[:2])) if len(first.shape) >= 2 else int(first.shape[0])
    return Estimate(
        config=config, mesh_shape=dict(mesh_shape),
        bytes_per_device={"params": param_bytes, "grads": grads, "optimizer": opt_bytes,
                          "activations": activations, "total": total},
        fits=total <= limit, step_seconds=t.step, device=device, memory_limit=limit,
        gradient_accumulation_steps=steps, accumulation=accumulation, remat=remat,
        compiled=compiled, peak_at=mem.where, parts=parts, compute_seconds=t.compute,
        optimizer_seconds=t.optimizer, comm_seconds=t.comm, tokens=tokens, notes=tuple(notes),
        host_bytes=host)

  def _segments(self, plan, micro, ms, rng, checkpoint) -> list:
    # The loss's per-device program depends on what the loss sees (each
    # leaf's shape and dtype as gathered, which leaves train, the casts and
    # rewrites the config asks for), not on how the leaves are sharded.
    cfg = plan.config
    key = (tuple((l.name, plan.gathered_shape(l), str(plan.compute_dtype(l)), l.frozen,
                  l.unit < 0) for l in plan.leaves),
           tuple(sorted(plan.unit_input_dtypes.items())), str(plan.root_input_dtype),
           plan.lora_targets, cfg.lora, cfg.tensor_parallel, plan.axis_env,
           tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(micro)))
    if key not in self.trace_cache:
      self.trace_cache[key] = segments_lib.trace_loss(self.loss_fn, plan, micro, ms, rng)
    flat, n, checkpointed = self.trace_cache[key]
    equations = step_program.count_equations(flat.jaxpr)
    segments = segments_lib.segment(flat, n, plan)
    regather = any(plan.regather(u) for u in plan.units)
    key = (regather, plan.recomputes_cheap_ops, checkpoint is not None)
    cache = self.programs_cache.setdefault(key, {})
    compiler = programs.Compiler(plan, flat, n, checkpoint=checkpoint,
                                 checkpointed=checkpointed, cache=cache)
    programs.compile_segments(segments, compiler)
    return segments, equations, checkpointed

  def step_plan(self, config: FSDPConfig, mesh_shape: dict):
    """The plan :func:`fsdp_jax.init_train_state` builds (with how the
    optimizer's update runs), for an abstract mesh."""
    plan, _, _, _ = state_lib.abstract_plan(
        optimizer=self.optimizer, mesh=abstract_mesh(mesh_shape), config=config,
        params=self._user, module_classes=self._types, rng=self.rng)
    return plan

  def _compiled_peak(self, plan, model_state, steps: int, accumulation: str,
                     checkpointed: bool, remat: bool) -> int:
    """The device bytes of the step's per-device program compiled locally
    (:mod:`.step_program`), once per distinct step; with ``remat``, the
    plan's config checkpoints the units (``activation_checkpointing``)."""
    key = (plan.config, tuple(plan.mesh.shape.items()), steps, accumulation, remat,
           tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(self.batch)))
    if key not in self.step_cache:
      self.step_cache[key] = step_program.compile_step(
          self.loss_fn, plan, self.batch, model_state=model_state,
          rng=jax.ShapeDtypeStruct(np.shape(self.rng), jnp.asarray(self.rng).dtype),
          gradient_accumulation_steps=steps, accumulation=accumulation,
          checkpointed=checkpointed or remat).device_total
    return self.step_cache[key]

  def _optimizer_program(self, plan):
    shapes = programs.optimizer_inputs(plan)
    key = tuple((s.shape, str(s.dtype)) for s in shapes)
    if key not in self.optimizer_cache:
      self.optimizer_cache[key] = programs.optimizer_program(plan, shapes)
    return self.optimizer_cache[key]


CUDNN_NOTE = ("attention with implementation='cudnn' (cuDNN's flash attention, memory linear "
              "in the sequence) is evaluated with fsdp_jax.attention's blockwise kernel, of the "
              "same memory class, on this backend without cuDNN: no [T, T] scores")


@contextlib.contextmanager
def cudnn_as_blockwise(seen: list):
  """On a backend without cuDNN (the CPU a plan is made on), an attention
  call of ``implementation="cudnn"`` (:func:`fsdp_jax.attention`, the
  families' ``attn_implementation="cudnn"``) runs as the blockwise kernel
  for the planner's traces and programs: the same memory class as cuDNN's
  flash attention (no ``[T, T]`` scores), where the traced call would
  fail. ``seen`` gets an entry per call so run."""
  original = getattr(attention_lib, "_cudnn", None)
  if original is None or jax.default_backend() == "gpu":
    yield
    return

  def blockwise(spec, q, k, v, extras):
    seen.append(spec)
    kernel = attention_lib._kernel(dataclasses.replace(spec, implementation=None))  # pylint: disable=protected-access
    return kernel(q, k, v, *extras)

  attention_lib._cudnn = blockwise  # pylint: disable=protected-access
  try:
    yield
  finally:
    attention_lib._cudnn = original  # pylint: disable=protected-access


def _size(nbytes: int) -> str:
  for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (1 << 10, "KiB")):
    if nbytes >= unit:
      return f"{nbytes / unit:,.1f} {name}"
  return f"{nbytes} bytes"


def _stored_param_bytes(plan) -> int:
  """The parameter shards one device stores."""
  total = 0
  for u in plan.units:
    layers = u.num_layers if u.stacked else 1
    if plan.use_orig_params:
      per_layer = sum(plan.chunk0(plan.leaves[i]) * plan.leaves[i].row_numel
                      * np.dtype(plan.leaves[i].dtype).itemsize for i in u.leaf_ids)
    else:
      per_layer = plan.flat_chunk(u) * np.dtype(plan.unit_dtype(u)).itemsize
    total += per_layer * layers
  for l in plan.ignored_leaves:
    total += segments_lib.nbytes(jax.ShapeDtypeStruct(l.shape, l.dtype))
  return total


def _notes(plan, segments, steps: int, accumulation: str):
  yield ("activations from each distinct unit's per-device program compiled on the "
         f"{jax.default_backend()} backend; their order in the step is modelled, not compiled")
  if any(s.scan is not None for s in segments):
    yield "a scan over stacked layers: one layer's program, times its length"
  if plan.config.tensor_parallel is not None:
    yield ("collectives over the tensor axis are on the critical path (Megatron's "
           "forward and backward pair), timed at the axis's link")
  if plan.offloaded:
    yield ("CPU offload: params and optimizer state in host memory (not in the total); "
           "each gather and gradient crosses the host link; the update runs at host speed")
  if steps > 1:
    yield f"{steps} microbatches, {accumulation} accumulation"


def estimate(loss_fn: Callable, *, optimizer, batch, mesh_shape: dict,
             config: Optional[FSDPConfig] = None, init_fn: Optional[Callable] = None,
             params: Any = None, device="cpu", rng: Any = None,
             memory_limit: Optional[int] = None, gradient_accumulation_steps: int = 1,
             accumulation: str = "no_sync", remat: bool = False,
             compile_step: Optional[bool] = None) -> Estimate:
  """Predicts a step's memory per device and time on a mesh, without it.

  Nothing is allocated and the mesh's devices need not exist: the plan is
  built for an abstract mesh of ``mesh_shape`` (parameter, gradient,
  optimizer and gathered bytes are exact), the step's own per-device
  program is compiled on the local backend with its collectives replaced by
  local stand-ins (the peak: exact for that backend), and the loss's
  per-device program is compiled unit by unit at the per-device micro-batch
  (each distinct unit once) and put in the step's order for the breakdown
  of the peak and the time at ``device``'s roofline and links.
  docs/planner.md says what is exact and what is modelled.

  Args:
    loss_fn: the step's ``loss_fn(params, batch)`` (as for
      :func:`fsdp_jax.shard_train_step`).
    optimizer: the optax optimizer.
    batch: the *global* batch: arrays or ``jax.ShapeDtypeStruct`` s.
    mesh_shape: ``{"shard": 64}``, ``{"replicate": 4, "shard": 16}``,
      ``{"shard": 8, "tensor": 8}``, ``{"shard": 2, "context": 4}``
      (context parallelism: each sequence split into 4 chunks, the
      weights sharded over shard x context; each layer's keys and values
      gathered whole over ``"context"`` count in the peak)...: any number
      of devices.
    config: the :class:`~fsdp_jax.FSDPConfig` (default ``FSDPConfig()``).
    init_fn: ``init_fn(rng)`` returning the parameters (traced only), or
    params: the parameters (arrays or ``jax.ShapeDtypeStruct`` s).
    device: a preset name (``"H100-80GB"``, ``"H200"``, ``"A100-80GB"``,
      ``"B200"``, ``"cpu"``) or a :class:`~fsdp_jax.DeviceSpec`.
    rng: ``init_fn``'s argument (default ``jax.random.key(0)``'s shape).
    memory_limit: bytes per device to fit in (default: the device's).
    gradient_accumulation_steps, accumulation: as for
      :func:`fsdp_jax.shard_train_step`.
    remat: estimate each unit's forward under ``jax.checkpoint`` (what
      ``nn.remat`` / ``jax.checkpoint`` per block in the model gives): the
      same as ``config=FSDPConfig(activation_checkpointing=
      ActivationCheckpointing("full"))``, whose step is compiled (a config
      with ``activation_checkpointing`` set is estimated with its policy).
    compile_step: compile the step's per-device program for the peak:
      ``None`` (default) when the loss's per-device program has at most
      5,000 equations (a 32-block transformer; about 40 s on 2 cores),
      else model it from the units' programs; ``True`` always (a 70B-shaped
      model: minutes and gigabytes of host memory); ``False`` never.
      ``Estimate.compiled`` says which.

  Returns:
    An :class:`Estimate`; ``print(estimate)`` shows memory and time.

  Raises:
    ValueError: a mesh shape with unknown axes, a batch the data-parallel
      size does not divide, a context size that does not divide the
      sequence length, a tensor size that does not divide a ruled
      dimension, an unknown device name; each names the fix.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> params = {"w1": jax.ShapeDtypeStruct((256, 512), jnp.float32),
    ...           "w2": jax.ShapeDtypeStruct((512, 256), jnp.float32)}
    >>> def loss_fn(p, b):
    ...   return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)
    >>> batch = {"x": jax.ShapeDtypeStruct((1024, 256), jnp.float32),
    ...          "y": jax.ShapeDtypeStruct((1024, 256), jnp.float32)}
    >>> est = fsdp_jax.estimate(loss_fn, optimizer=optax.adam(1e-3), batch=batch,
    ...     params=params, mesh_shape={"shard": 64}, device="H100-80GB")
    >>> est.bytes_per_device["params"]  # (256*512 + 512*256) * 4 bytes / 64 devices
    16384
    >>> est.fits, est.step_seconds > 0
    (True, True)
  """
  config = FSDPConfig() if config is None else config
  if not isinstance(config, FSDPConfig):
    raise TypeError(f"config must be a fsdp_jax.FSDPConfig, got {type(config).__name__}.")
  device = device_spec(device)
  shape = check_mesh_shape(mesh_shape, config)
  planner = Planner(loss_fn, optimizer=optimizer, batch=batch, init_fn=init_fn, params=params,
                    rng=rng)
  return planner.estimate(config, shape, device, memory_limit=memory_limit,
                          gradient_accumulation_steps=gradient_accumulation_steps,
                          accumulation=accumulation, remat=remat, compile_step=compile_step)

