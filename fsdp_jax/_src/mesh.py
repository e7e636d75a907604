"""Device meshes for FSDP: a ``("shard",)`` axis, or ``("replicate", "shard")``
for the hybrid strategies (shard within a group, replicate across groups)."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from fsdp_jax._src.config import FSDPConfig, ShardingStrategy

SHARD = "shard"
REPLICATE = "replicate"

# XLA flags for the CPU backend. The first keeps the optimization barriers
# that stop XLA from merging FULL_SHARD's backward re-gather into the forward
# gather (which would keep every gathered unit alive until backward). The
# other two make the CPU scheduler issue gathers next to their use instead of
# hoisting them all to the top of the program.
CPU_XLA_FLAGS = (
    "--xla_disable_hlo_passes=cse_barrier_expander",
    "--xla_cpu_enable_concurrency_optimized_scheduler=false",
    "--xla_cpu_experimental_ynn_fusion_type=",
)


def simulate_cpu_devices(num_devices: int = 8) -> None:
  """Sets up ``num_devices`` simulated CPU devices and fsdp_jax's CPU flags.

  Must run before JAX initialises its backends (before the first computation
  or ``jax.devices()`` call). Appends :data:`CPU_XLA_FLAGS` to ``XLA_FLAGS``
  and sets ``jax_num_cpu_devices``. Has no effect on GPU devices.

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


def cpu_flags_active() -> bool:
  """Whether :data:`CPU_XLA_FLAGS` are in this process's ``XLA_FLAGS``."""
  flags = os.environ.get("XLA_FLAGS", "")
  return all(f in flags for f in CPU_XLA_FLAGS)


def make_mesh(*, shard: Optional[int] = None, replicate: Optional[int] = None,
              devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
  """Builds an FSDP mesh.

  With ``replicate=None`` the mesh is 1-D, ``("shard",)``. With ``replicate``
  set it is 2-D, ``("replicate", "shard")``: devices that are adjacent in
  ``devices`` (the same host, in multi-process runs) share a shard group and
  groups replicate across hosts, as PyTorch recommends for HYBRID_SHARD.

  Args:
    shard: size of the ``"shard"`` axis (default: all devices / replicate).
    replicate: size of the ``"replicate"`` axis, or ``None`` for a 1-D mesh.
    devices: the devices to use (default ``jax.devices()``).

  Example:
    >>> import fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, replicate=2,
    ...                           devices=jax.devices()[:4])
    >>> dict(mesh.shape)
    {'replicate': 2, 'shard': 2}
  """
  if devices is None:
    devices = jax.devices()
    if jax.process_count() > 1:  # shard within a process, replicate across
      devices = sorted(devices, key=lambda d: (d.process_index, d.id))
  devices = list(devices)
  n = len(devices)
  rep = 1 if replicate is None else int(replicate)
  if shard is None:
    if n % rep:
      raise ValueError(
          f"make_mesh: {n} devices cannot be split into replicate={rep} groups; "
          f"pass replicate dividing {n}.")
    shard = n // rep
  if rep * shard > n:
    raise ValueError(
        f"make_mesh: replicate={rep} x shard={shard} needs {rep * shard} "
        f"devices but only {n} are available; pass devices= or smaller sizes.")
  devices = devices[: rep * shard]
  if replicate is None:
    return Mesh(np.array(devices), (SHARD,), axis_types=(AxisType.Auto,))
  return Mesh(np.array(devices).reshape(rep, shard), (REPLICATE, SHARD),
              axis_types=(AxisType.Auto, AxisType.Auto))


@dataclasses.dataclass(frozen=True)
class MeshAxes:
  """How a strategy uses the mesh axes.

  ``shard_axes`` are the axes parameters are sharded over, ``replicate_axes``
  the axes gradients are all-reduced over after the reduce-scatter, and
  ``data_axes`` all axes the batch is split over.
  """

  shard_axes: tuple[str, ...]
  replicate_axes: tuple[str, ...]
  data_axes: tuple[str, ...]
  shard_size: int
  world_size: int


def mesh_axes(mesh: Mesh, config: FSDPConfig) -> MeshAxes:
  """Validates ``mesh`` for ``config`` and says which axes do what."""
  names = tuple(mesh.axis_names)
  strategy = config.sharding_strategy
  fix_1d = "fsdp_jax.make_mesh(shard=N)"
  fix_2d = "fsdp_jax.make_mesh(replicate=R, shard=S)"
  if config.is_hybrid:
    if names != (REPLICATE, SHARD):
      raise ValueError(
          f"{strategy.name} needs a 2-D mesh with axes ('replicate', 'shard') "
          f"(shard within a group, replicate across groups); got a mesh with "
          f"axes {names} and shape {dict(mesh.shape)}. Build one with {fix_2d}.")
  elif names not in ((SHARD,), (REPLICATE, SHARD)):
    raise ValueError(
        f"{strategy.name} needs a mesh with axes ('shard',) or ('replicate', "
        f"'shard'); got axes {names} with shape {dict(mesh.shape)}. Build one "
        f"with {fix_1d}.")
  world = int(np.prod([mesh.shape[a] for a in names]))
  if strategy is ShardingStrategy.NO_SHARD:
    return MeshAxes((), names, names, 1, world)
  if config.is_hybrid:
    return MeshAxes((SHARD,), (REPLICATE,), names, mesh.shape[SHARD], world)
  return MeshAxes(names, (), names, world, world)
