"""``DeviceSpec``: what the planner needs to know of a device, with presets.

Every GPU figure is NVIDIA's published datasheet number for the SXM part,
cited per preset; rates are per direction (a link's bidirectional figure
halved), and peak FLOP/s are dense 16-bit tensor-core figures (the
datasheets print them with 2:4 sparsity, twice as high). ``"cpu"`` is this
machine, measured (see :func:`measure_local`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """A device the planner predicts memory and time for.

  Args:
    name: a label.
    memory_bytes: device memory (what ``Estimate.fits`` compares the peak
      with; ``search(memory_limit=...)`` overrides it).
    peak_flops: dense 16-bit matmul FLOP/s.
    hbm_bytes_per_s: device memory bandwidth.
    intra_node_bytes_per_s: per device and direction, between devices of
      one node (NVLink).
    inter_node_bytes_per_s: per device and direction, across nodes (the
      device's network adapter).
    devices_per_node: devices sharing the intra-node link.
    host_bytes_per_s: per device and direction, to host memory (PCIe): CPU
      offload's transfers.
    host_memory_bytes_per_s: the host memory bandwidth one device's share
      of an offloaded optimizer update runs at.
    source: where the figures come from.

  Example:
    >>> import fsdp_jax
    >>> h100 = fsdp_jax.DeviceSpec.preset("H100-80GB")
    >>> h100.memory_bytes // 2**30, h100.peak_flops / 1e12, h100.devices_per_node
    (80, 989.5, 8)
    >>> mine = fsdp_jax.DeviceSpec("mine", memory_bytes=24 * 2**30, peak_flops=1e14,
    ...     hbm_bytes_per_s=1e12, intra_node_bytes_per_s=1e11,
    ...     inter_node_bytes_per_s=1e10, devices_per_node=4)
    >>> mine.intra_node_bytes_per_s > mine.inter_node_bytes_per_s
    True
  """

  name: str
  memory_bytes: int
  peak_flops: float
  hbm_bytes_per_s: float
  intra_node_bytes_per_s: float
  inter_node_bytes_per_s: float
  devices_per_node: int
  host_bytes_per_s: float = 32e9
  host_memory_bytes_per_s: float = 100e9
  source: str = ""

  def __post_init__(self):
    for field in ("memory_bytes", "peak_flops", "hbm_bytes_per_s", "intra_node_bytes_per_s",
                  "inter_node_bytes_per_s", "devices_per_node", "host_bytes_per_s",
                  "host_memory_bytes_per_s"):
      value = getattr(self, field)
      if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"DeviceSpec({self.name!r}): {field}={value!r} must be a positive "
                         "number.")

  @staticmethod
  def preset(name: str) -> "DeviceSpec":
    """The preset named ``name`` (see :data:`PRESETS`)."""
    return device_spec(name)


# NVIDIA's datasheets read "GB" of HBM as GiB: an H100 80GB reports 81,559
# MiB, an A100 80GB 81,920 MiB. The process cannot use all of it (the CUDA
# context; JAX preallocates 75% unless XLA_PYTHON_CLIENT_MEM_FRACTION says
# otherwise): pass search(memory_limit=...) for the budget you run with.
PRESETS = {
    "H100-80GB": DeviceSpec(
        "H100-80GB", memory_bytes=80 * GiB, peak_flops=989.5e12, hbm_bytes_per_s=3.35e12,
        intra_node_bytes_per_s=450e9, inter_node_bytes_per_s=50e9, devices_per_node=8,
        host_bytes_per_s=64e9, host_memory_bytes_per_s=100e9,
        source=("NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column "
                "(https://www.nvidia.com/en-us/data-center/h100/): 80GB HBM3 at 3.35TB/s, "
                "BF16 tensor core 1,979 TFLOPS with sparsity (989.5 dense), NVLink 900GB/s "
                "(450 per direction), PCIe Gen5 128GB/s (64 per direction); DGX H100 "
                "datasheet: 8 GPUs and 8 ConnectX-7 400Gb/s ports per node (50GB/s per GPU)")),
    "H200": DeviceSpec(
        "H200", memory_bytes=141 * GiB, peak_flops=989.5e12, hbm_bytes_per_s=4.8e12,
        intra_node_bytes_per_s=450e9, inter_node_bytes_per_s=50e9, devices_per_node=8,
        host_bytes_per_s=64e9, host_memory_bytes_per_s=100e9,
        source=("NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column "
                "(https://www.nvidia.com/en-us/data-center/h200/): 141GB HBM3e at 4.8TB/s, "
                "BF16 tensor core 1,979 TFLOPS with sparsity (989.5 dense), NVLink 900GB/s, "
                "PCIe Gen5 128GB/s; HGX H200: 8 GPUs per node, 400Gb/s networking per GPU")),
    "A100-80GB": DeviceSpec(
        "A100-80GB", memory_bytes=80 * GiB, peak_flops=312e12, hbm_bytes_per_s=2.039e12,
        intra_node_bytes_per_s=300e9, inter_node_bytes_per_s=25e9, devices_per_node=8,
        host_bytes_per_s=32e9, host_memory_bytes_per_s=100e9,
        source=("NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column "
                "(https://www.nvidia.com/en-us/data-center/a100/): 80GB HBM2e at 2,039GB/s, "
                "BF16 tensor core 312 TFLOPS dense (624 with sparsity), NVLink 600GB/s (300 "
                "per direction), PCIe Gen4 64GB/s; DGX A100 datasheet: 8 GPUs and 8 "
                "ConnectX-6 200Gb/s HDR ports per node (25GB/s per GPU)")),
    "B200": DeviceSpec(
        "B200", memory_bytes=180 * GiB, peak_flops=2.25e15, hbm_bytes_per_s=8e12,
        intra_node_bytes_per_s=900e9, inter_node_bytes_per_s=50e9, devices_per_node=8,
        host_bytes_per_s=64e9, host_memory_bytes_per_s=100e9,
        source=("NVIDIA DGX B200 / HGX B200 datasheets (https://www.nvidia.com/en-us/"
                "data-center/dgx-b200/, https://www.nvidia.com/en-us/data-center/hgx/): 8 "
                "B200 GPUs with 1,440GB HBM3e (180GB each) at 64TB/s (8TB/s each), FP16/BF16 "
                "tensor core 36 PFLOPS with sparsity per 8 GPUs (2.25 dense each), fifth-"
                "generation NVLink 1.8TB/s per GPU (900GB/s per direction), 8 ConnectX-7 "
                "400Gb/s ports (50GB/s per GPU), PCIe Gen5")),
    # This machine, measured by measure_local() (python -m benchmarks planner
    # --measure-cpu, Nov 2026, under the machine's usual load): 42-62 GFLOP/s
    # for an f32 1024^3 matmul, 1.6-2.0 GB/s read+write, 0.11-0.13 GB/s per
    # device all-gathered among 8 simulated devices. 2 shared x86_64 cores
    # and 24 GiB: the simulated devices share them (docs/planner.md).
    "cpu": DeviceSpec(
        "cpu", memory_bytes=24 * GiB, peak_flops=50e9, hbm_bytes_per_s=2e9,
        intra_node_bytes_per_s=0.12e9, inter_node_bytes_per_s=0.12e9,
        devices_per_node=1 << 16, host_bytes_per_s=2e9, host_memory_bytes_per_s=2e9,
        source=("measured on this machine by fsdp_jax._src.planner.devices.measure_local "
                "(benchmarks/planner.py --measure-cpu): f32 matmul FLOP/s, copy bandwidth, "
                "and an all-gather among 8 simulated CPU devices; every simulated device "
                "shares the same RAM and cores (devices_per_node covers any mesh)")),
}


def device_spec(device) -> DeviceSpec:
  """A :class:`DeviceSpec` from a preset name or a ``DeviceSpec``."""
  if isinstance(device, DeviceSpec):
    return device
  if isinstance(device, str) and device in PRESETS:
    return PRESETS[device]
  raise ValueError(
      f"Unknown device {device!r}. Fix: pass one of the presets {sorted(PRESETS)}, or a "
      "fsdp_jax.DeviceSpec(name, memory_bytes, peak_flops, hbm_bytes_per_s, "
      "intra_node_bytes_per_s, inter_node_bytes_per_s, devices_per_node).")


def _best_seconds(fn, *args, repeats: int = 5) -> float:
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - t0)
  return best


def measure_local(*, devices: Optional[list] = None, size: int = 1024,
                  copy_bytes: int = 64 << 20) -> DeviceSpec:
  """Measures the local backend: an ``f32[size, size]`` matmul (FLOP/s),
  an elementwise pass over ``copy_bytes`` (read + write: memory bandwidth),
  and an all-gather of ``copy_bytes`` over ``devices`` (bytes each device
  receives per second; the intra- and inter-node figure alike). The
  memory figure is the first device's ``bytes_limit`` when the backend
  reports one, else 24 GiB.

  Example:
    >>> import jax, fsdp_jax
    >>> from fsdp_jax._src.planner.devices import measure_local
    >>> spec = measure_local(devices=jax.devices()[:2], size=128, copy_bytes=1 << 20)
    >>> spec.peak_flops > 0 and spec.hbm_bytes_per_s > 0
    True
  """
  devices = list(devices or jax.devices())
  d0 = devices[0]
  a = jax.device_put(jnp.ones((size, size), jnp.float32), d0)
  mm = jax.jit(lambda x: x @ x)
  flops = 2 * size ** 3 / _best_seconds(mm, a)
  n = copy_bytes // 4
  x = jax.device_put(jnp.ones((n,), jnp.float32), d0)
  bw = 2 * copy_bytes / _best_seconds(jax.jit(lambda v: v * 1.0001), x)
  link = bw
  if len(devices) > 1:
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    spec = jax.sharding.PartitionSpec("d")
    xs = jax.device_put(jnp.ones((len(devices) * (n // len(devices)),), jnp.float32),
                        jax.sharding.NamedSharding(mesh, spec))
    gather = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, "d", tiled=True),
                                   mesh=mesh, in_specs=spec, out_specs=spec,
                                   check_vma=False))
    k = len(devices)
    link = (k - 1) / k * (n // k * k * 4) / _best_seconds(gather, xs)
  try:
    memory = int(d0.memory_stats()["bytes_limit"])
  except Exception:  # pylint: disable=broad-except  # CPU: no memory stats
    memory = 24 * GiB
  return DeviceSpec(f"{d0.platform} (measured)", memory_bytes=memory, peak_flops=flops,
                    hbm_bytes_per_s=bw, intra_node_bytes_per_s=link,
                    inter_node_bytes_per_s=link, devices_per_node=1 << 16,
                    host_bytes_per_s=bw, host_memory_bytes_per_s=bw,
                    source="measure_local() on this process's devices")
