"""Device meshes for FSDP: a ``("shard",)`` axis, or ``("replicate", "shard")``
for the hybrid strategies (shard within a group, replicate across groups),
each optionally followed by a ``"context"`` axis for context parallelism
(the sequence split; the weights sharded over it too) and a ``"tensor"``
axis for tensor parallelism (adjacent devices: one NVLink node). The order is
``("replicate", "shard", "context", "tensor")``: the context group's devices
are adjacent after the tensor group's, as torchtitan orders ``dp_shard, cp,
tp``."""

from __future__ import annotations

import dataclasses
import functools
import os
import warnings
from typing import Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from fsdp_jax._src import _compat
from fsdp_jax._src.config import FSDPConfig, ShardingStrategy
from fsdp_jax._src.context import CONTEXT, ContextParallel

SHARD = "shard"
REPLICATE = "replicate"
TENSOR = "tensor"

# Process-wide XLA flags that simulate_cpu_devices() adds for the CPU
# backend. Each is measured in benchmarks/FLAGS.md, on fsdp_jax's step and on
# a plain jax.jit step of the same model (the user's own code):
# * disabling cse_barrier_expander keeps optimization barriers until XLA's
#   common-subexpression pass has run, so a custom step's FULL_SHARD backward
#   re-gather is not merged into the forward gather (jax 0.10's CPU pipeline
#   drops the barriers before that pass; GPU pipelines drop them last). No
#   effect on a program without barriers.
# * the memory-minimising scheduler issues gathers next to their use instead
#   of breadth-first; XLA reads it from the process flags only, not from a
#   program's compiler options.
CPU_XLA_FLAGS = (
    "--xla_disable_hlo_passes=cse_barrier_expander",
    "--xla_cpu_enable_concurrency_optimized_scheduler=false",
)

# Compiler options of fsdp_jax's own CPU programs (``jax.jit``'s
# ``compiler_options``), so they hold whatever XLA_FLAGS the process has and
# cost the user's other programs nothing:
# * the barrier pass as above (merged with passes the user disabled);
# * no YNNPACK fusions, for a model that checkpoints (``jax.checkpoint``,
#   ``nn.remat``): with them it keeps a quarter more temporaries under
#   FULL_SHARD (they fuse across the recomputation). Other steps keep them,
#   which saves them a tenth of their time; a process-wide flag made every
#   jax.jit program slower.
CPU_COMPILER_OPTIONS = {
    "xla_disable_hlo_passes": "cse_barrier_expander",
    "xla_cpu_experimental_ynn_fusion_type": "",
}


def simulate_cpu_devices(num_devices: int = 8) -> None:
  """Sets up ``num_devices`` simulated CPU devices and fsdp_jax's CPU flags.

  Must run before JAX initialises its backends (before the first computation
  or ``jax.devices()`` call). Appends :data:`CPU_XLA_FLAGS` to ``XLA_FLAGS``
  and sets ``jax_num_cpu_devices``. Has no effect on GPU devices.

  The flags do not slow an ordinary ``jax.jit`` program (measured in
  benchmarks/FLAGS.md). What only fsdp_jax's programs need is in their own
  compiler options (:func:`fsdp_jax.custom.compiler_options`), not in the
  process's flags.

  Example:
    >>> import fsdp_jax
    >>> fsdp_jax.simulate_cpu_devices(8)   # doctest: +SKIP
  """
  flags = os.environ.get("XLA_FLAGS", "")
  missing = [f for f in CPU_XLA_FLAGS if f not in flags]
  if missing:
    os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()
  try:
    jax.config.update("jax_num_cpu_devices", num_devices)
  except RuntimeError as e:  # backends already initialised
    raise RuntimeError(
        "simulate_cpu_devices() must be called before JAX initialises its "
        "backends: call it at the top of your script, before any jax "
        "computation or jax.devices().") from e


def _user_disabled_passes() -> list[str]:
  """The passes ``XLA_FLAGS`` disables (a program's ``xla_disable_hlo_passes``
  option replaces that list, so it must repeat them)."""
  passes: list[str] = []
  for tok in os.environ.get("XLA_FLAGS", "").split():
    if tok.startswith("--xla_disable_hlo_passes="):
      passes += [p for p in tok.split("=", 1)[1].split(",") if p]
  return passes


def _accepted(platform: str, name: str, value) -> bool:
  """Whether this XLA takes the option (a later one may drop a CPU option).
  Probed with a small program at the top level only: under a trace JAX
  refuses any program's options (and nothing is compiled there with them)."""
  return True if _compat.under_trace() else _probe(platform, name, value)


@functools.lru_cache(maxsize=None)
def _probe(platform: str, name: str, value) -> bool:
  x = jax.ShapeDtypeStruct((), np.float32, sharding=jax.sharding.SingleDeviceSharding(
      jax.local_devices(backend=platform)[0]))
  try:
    jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(x).compile()
  except Exception:  # pylint: disable=broad-except  (XLA's INVALID_ARGUMENT)
    return False
  return True


def compiler_options(mesh: Mesh, *, checkpointed: bool = True) -> dict:
  """The XLA compiler options fsdp_jax compiles a step on ``mesh`` with.

  On CPU: :data:`CPU_COMPILER_OPTIONS`, keeping the passes ``XLA_FLAGS``
  disables, less any option this XLA does not know; with
  ``checkpointed=False`` (the model calls no ``jax.checkpoint`` /
  ``nn.remat``) without the one that turns XLA's YNN fusions off, which
  only keeps a checkpointed model's memory down and costs time. Elsewhere,
  none: GPU pipelines keep optimization barriers through
  common-subexpression elimination already, and MaxText's H100 options
  (latency-hiding scheduler, collective combining, double-buffered loops)
  changed nothing on one H100 (benchmarks/GPU.md), so none is imposed.
  :func:`fsdp_jax.shard_train_step` applies them itself (it traces the loss
  to see whether it checkpoints); pass them to ``jax.jit`` for a
  hand-written step, so that FULL_SHARD re-gathers in backward whatever
  ``XLA_FLAGS`` the process has.

  Example:
    >>> import jax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> opts = fsdp_jax.custom.compiler_options(mesh)
    >>> opts["xla_disable_hlo_passes"]
    'cse_barrier_expander'
    >>> f = jax.jit(lambda x: x * 2, compiler_options=opts)
  """
  platform = mesh.devices.flat[0].platform
  if platform != "cpu":
    return {}
  opts = dict(CPU_COMPILER_OPTIONS)
  if not checkpointed:
    del opts["xla_cpu_experimental_ynn_fusion_type"]
  passes = list(dict.fromkeys([*_user_disabled_passes(), opts["xla_disable_hlo_passes"]]))
  opts["xla_disable_hlo_passes"] = ",".join(passes)
  return {k: v for k, v in opts.items() if _accepted(platform, k, v)}


def own_mesh(fn: Callable) -> Callable:
  """``fn`` (a public entry point) run with no context mesh: a user's
  ``jax.set_mesh(other_mesh)`` or ``with mesh:`` around it changes nothing,
  since fsdp_jax's programs name their own mesh in their shardings and
  ``shard_map`` s (inside a trace, ``jax.set_mesh`` is not allowed and the
  trace's own mesh applies).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> f = own_mesh(lambda: jax.sharding.get_abstract_mesh().empty)
    >>> with jax.set_mesh(jax.make_mesh((1,), ("other",), devices=jax.devices()[:1])):
    ...   f()
    True
  """

  @functools.wraps(fn)
  def run(*args, **kwargs):
    if _compat.under_trace():
      return fn(*args, **kwargs)
    with jax.set_mesh(None):
      return fn(*args, **kwargs)

  return run


class TopLevelJit:
  """``jax.jit(fn, compiler_options=...)`` where JAX takes them: called (or
  lowered) at the top level it compiles with the options; inside another
  trace (the user's own ``jax.jit``, ``jax.eval_shape``) it is the same
  ``jax.jit`` without them, since JAX accepts compiler options on the
  outermost program only (that program's options then apply)."""

  def __init__(self, fn: Callable, compiler_options, **jit_kwargs):
    """``compiler_options``: a dict, or a function of the call's arguments
    returning one (called at the first top-level use)."""
    self._fn = fn
    self._jit_kwargs = jit_kwargs
    self._options = compiler_options
    self.nested = jax.jit(fn, **jit_kwargs)
    self._top = None
    self.options = None  # what the top-level program is compiled with, once chosen

  def _pick(self, args, kwargs):
    if _compat.under_trace():
      return self.nested
    if self._top is None:
      opts = self._options(*args, **kwargs) if callable(self._options) else self._options
      self.options = dict(opts)
      self._top = (jax.jit(self._fn, compiler_options=opts, **self._jit_kwargs)
                   if opts else self.nested)
    return self._top

  def __call__(self, *args, **kwargs):
    return self._pick(args, kwargs)(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self._pick(args, kwargs).lower(*args, **kwargs)

  def trace(self, *args, **kwargs):
    return self._pick(args, kwargs).trace(*args, **kwargs)


def _cpu_devices_hint(devices: Sequence[jax.Device], needed: int) -> str:
  """How to get ``needed`` devices when they are CPU devices (simulated ones)."""
  if not devices or devices[0].platform != "cpu" or jax.device_count() >= needed:
    return ""
  procs = jax.process_count()
  if procs > 1:
    per_process = -(-needed // procs)
    return (f" On CPU, simulate {per_process} devices per process: "
            f"fsdp_jax.distributed.initialize(devices_per_process={per_process}), or "
            f"python -m fsdp_jax.launch --devices-per-proc {per_process}.")
  return (f" On CPU, simulate them: call fsdp_jax.simulate_cpu_devices({needed}) at the top "
          f"of the script, before the first jax computation or jax.devices() call (or set "
          f"JAX_NUM_CPU_DEVICES={needed} in the environment).")


def _warn_idle(used: int, n: int, shard, replicate, tensor, context=None) -> None:
  """Warns that a mesh built from all devices leaves some idle (once per
  message: Python's warning registry keeps one per distinct text and caller)."""
  sizes = ", ".join(f"{k}={v}" for k, v in (("replicate", replicate), ("shard", shard),
                                           ("context", context), ("tensor", tensor))
                    if v is not None)
  warnings.warn(
      f"make_mesh({sizes}) uses {used} of the {n} devices; the other {n - used} stay idle. "
      f"Fix: pick sizes whose product is {n} (or leave shard= out: it defaults to the "
      f"devices left), or pass devices= (e.g. devices=jax.devices()[:{used}]) to use a "
      "subset on purpose.", UserWarning, stacklevel=3)


def make_mesh(*, shard: Optional[int] = None, replicate: Optional[int] = None,
              tensor: Optional[int] = None, context: Optional[int] = None,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """Builds an FSDP mesh.

  With ``replicate=None`` the mesh is 1-D, ``("shard",)``. With ``replicate``
  set it is 2-D, ``("replicate", "shard")``: devices that are adjacent in
  ``devices`` (the same host, in multi-process runs) share a shard group and
  groups replicate across hosts, as PyTorch recommends for HYBRID_SHARD.
  With ``tensor=T`` a last axis ``"tensor"`` of size ``T`` is added for
  tensor parallelism (``FSDPConfig(tensor_parallel=...)``): the ``T``
  devices of a tensor group are adjacent (one NVLink node, or one process),
  FSDP shards across groups, as torchtitan's ``("dp_shard", "tp")`` mesh.
  With ``context=C`` an axis ``"context"`` of size ``C`` is added after
  ``"shard"`` (before ``"tensor"``) for context parallelism
  (:class:`~fsdp_jax.ContextParallel`): each sequence is split into ``C``
  chunks over it, and FSDP shards the weights over shard x context.

  Args:
    shard: size of the ``"shard"`` axis (default: all devices / (replicate
      * tensor)).
    replicate: size of the ``"replicate"`` axis, or ``None`` for no such axis.
    tensor: size of the ``"tensor"`` axis, or ``None`` for no such axis.
    context: size of the ``"context"`` axis, or ``None`` for no such axis.
    devices: the devices to use (default ``jax.devices()``). Without it, a
      mesh smaller than ``jax.devices()`` warns (a ``UserWarning`` naming how
      many devices it uses); pass ``devices=`` to use a subset on purpose.

  Example:
    >>> import fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, replicate=2,
    ...                           devices=jax.devices()[:4])
    >>> dict(mesh.shape)
    {'replicate': 2, 'shard': 2}
    >>> dict(fsdp_jax.make_mesh(shard=4, tensor=2, devices=jax.devices()[:8]).shape)
    {'shard': 4, 'tensor': 2}
    >>> dict(fsdp_jax.make_mesh(shard=2, context=4, devices=jax.devices()[:8]).shape)
    {'shard': 2, 'context': 4}
  """
  chosen = devices is not None
  if devices is None:
    devices = jax.devices()
    if jax.process_count() > 1:  # shard within a process, replicate across
      devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  devices = list(devices)
  n = len(devices)
  rep = 1 if replicate is None else int(replicate)
  tp = 1 if tensor is None else int(tensor)
  cp = 1 if context is None else int(context)
  if rep < 1 or tp < 1 or cp < 1 or (shard is not None and int(shard) < 1):
    raise ValueError(f"make_mesh: sizes must be positive; got shard={shard}, "
                     f"replicate={replicate}, context={context}, tensor={tensor}.")
  if shard is None:
    if n % (rep * tp * cp):
      raise ValueError(
          f"make_mesh: {n} devices cannot be split into replicate={rep} x context={cp} x "
          f"tensor={tp} groups; pass sizes whose product divides {n}, or shard= explicitly.")
    shard = n // (rep * tp * cp)
  shard = int(shard)
  used = rep * shard * cp * tp
  if used > n:
    raise ValueError(
        f"make_mesh: replicate={rep} x shard={shard}"
        + (f" x context={cp}" if context is not None else "")
        + (f" x tensor={tp}" if tensor is not None else "")
        + f" needs {used} devices but only {n} are available; pass devices= or "
        "smaller sizes." + _cpu_devices_hint(devices, used))
  if not chosen and used < n:
    _warn_idle(used, n, shard, replicate, tensor, context)
  devices = devices[:used]
  names = ((REPLICATE,) if replicate is not None else ()) + (SHARD,) + (
      (CONTEXT,) if context is not None else ()) + ((TENSOR,) if tensor is not None else ())
  shape = ((rep,) if replicate is not None else ()) + (shard,) + (
      (cp,) if context is not None else ()) + ((tp,) if tensor is not None else ())
  return Mesh(np.array(devices).reshape(shape), names,
              axis_types=(AxisType.Auto,) * len(names))


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """How a strategy uses the mesh axes.

  ``shard_axes`` are the axes parameters are sharded over, ``replicate_axes``
  the axes gradients are all-reduced over after the reduce-scatter, and
  ``data_axes`` all axes the batch is split over. ``tensor_axes`` is
  ``("tensor",)`` under tensor parallelism (the batch is replicated over it,
  the rules' leaves are split over it), of size ``tensor_size``.
  ``context_axes`` is ``("context",)`` under context parallelism, of size
  ``context_size``: it is one of the shard axes (the weights are sharded
  over it) and of the data axes (the loss and gradients are averaged over
  it), but the batch is split over it along the sequence dimension, not
  dim 0 (:attr:`batch_axes` are the data axes without it).
  """

  shard_axes: tuple[str, ...]
  replicate_axes: tuple[str, ...]
  data_axes: tuple[str, ...]
  shard_size: int
  world_size: int
  tensor_axes: tuple[str, ...] = ()
  tensor_size: int = 1
  context_axes: tuple[str, ...] = ()
  context_size: int = 1

  @property
  def batch_axes(self) -> tuple[str, ...]:
    """The axes a batch's dim 0 is split over."""
    return tuple(a for a in self.data_axes if a not in self.context_axes)

  @property
  def batch_size(self) -> int:
    """The devices a batch's dim 0 is split over."""
    return self.world_size // self.context_size


def mesh_axes(mesh: Mesh, config: FSDPConfig) -> MeshAxes:
  """Validates ``mesh`` for ``config`` and says which axes do what."""
  all_names = tuple(mesh.axis_names)
  tp = config.tensor_parallel
  tensor_axis = TENSOR if tp is None else tp.axis
  names = tuple(a for a in all_names if a not in (tensor_axis, CONTEXT))
  context = _context_axes(mesh, config, all_names, tensor_axis)
  strategy = config.sharding_strategy
  t = "" if tensor_axis not in all_names else ", tensor=T"
  fix_1d = f"fsdp_jax.make_mesh(shard=N{t})"
  fix_2d = f"fsdp_jax.make_mesh(replicate=R, shard=S{t})"
  if tp is not None and tensor_axis not in all_names:
    raise ValueError(
        f"FSDPConfig(tensor_parallel=...) splits leaves over the mesh axis {tensor_axis!r}, "
        f"but the mesh has axes {all_names} (shape {dict(mesh.shape)}). Fix: build the mesh "
        f"with fsdp_jax.make_mesh(shard=S, tensor=T), or drop tensor_parallel.")
  if tp is None and TENSOR in all_names:
    raise ValueError(
        f"The mesh has a 'tensor' axis of size {mesh.shape[TENSOR]} (shape "
        f"{dict(mesh.shape)}) but FSDPConfig has no tensor_parallel rules, so every "
        "device of a tensor group would hold and compute the same thing. Fix: pass "
        "FSDPConfig(tensor_parallel=fsdp_jax.TensorParallel(rules=[...])), or build the "
        "mesh without tensor=.")
  if tensor_axis in all_names and all_names[-1] != tensor_axis:
    raise ValueError(
        f"The tensor axis {tensor_axis!r} must be the mesh's last axis (its devices "
        f"adjacent); got axes {all_names}. Fix: build the mesh with "
        "fsdp_jax.make_mesh(..., tensor=T).")
  if config.is_hybrid:
    if names != (REPLICATE, SHARD):
      raise ValueError(
          f"{strategy.name} needs a 2-D mesh with axes ('replicate', 'shard') "
          f"(shard within a group, replicate across groups); got a mesh with "
          f"axes {all_names} and shape {dict(mesh.shape)}. Build one with {fix_2d}.")
  elif names not in ((SHARD,), (REPLICATE, SHARD)):
    raise ValueError(
        f"{strategy.name} needs a mesh with axes ('shard',) or ('replicate', "
        f"'shard'){' and a last tensor axis' if t else ''}; got axes {all_names} with "
        f"shape {dict(mesh.shape)}. Build one with {fix_1d}.")
  cax = (CONTEXT,) if context else ()
  c = int(mesh.shape[CONTEXT]) if context else 1
  names = names + cax
  world = int(np.prod([mesh.shape[a] for a in names]))
  tensor = ((tensor_axis,), int(mesh.shape[tensor_axis])) if tp is not None else ((), 1)
  if strategy is ShardingStrategy.NO_SHARD:
    return MeshAxes((), names, names, 1, world, *tensor, cax, c)
  if config.is_hybrid:
    return MeshAxes((SHARD,) + cax, (REPLICATE,), names, mesh.shape[SHARD] * c, world,
                    *tensor, cax, c)
  return MeshAxes(names, (), names, world, world, *tensor, cax, c)


def context_parallel(mesh: Mesh, config: FSDPConfig):
  """The :class:`ContextParallel` options a step on ``mesh`` uses: the
  config's, or the defaults when the mesh has a context axis; None without
  one."""
  if CONTEXT not in tuple(mesh.axis_names):
    return None
  return config.context_parallel or ContextParallel()


def _context_axes(mesh: Mesh, config: FSDPConfig, all_names: tuple, tensor_axis) -> bool:
  """Whether the mesh has a context axis; checks where it is and what it
  composes with."""
  if CONTEXT not in all_names:
    if config.context_parallel is not None:
      raise ValueError(
          f"FSDPConfig(context_parallel=...) splits sequences over the mesh axis 'context', "
          f"but the mesh has axes {all_names} (shape {dict(mesh.shape)}). Fix: build the mesh "
          "with fsdp_jax.make_mesh(..., context=C), or drop context_parallel.")
    return False
  rest = tuple(a for a in all_names if a != tensor_axis)
  if rest[-1] != CONTEXT:
    raise ValueError(
        f"The 'context' axis must follow the FSDP axes (before a tensor axis); got axes "
        f"{all_names}. Fix: build the mesh with fsdp_jax.make_mesh(..., context=C).")
  return True
