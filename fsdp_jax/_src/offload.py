"""CPU offload of the sharded parameters and optimizer state
(``FSDPConfig(cpu_offload=CPUOffload(offload_params=True))``).

With offload the state's ``params`` and ``opt_state`` live in each device's
``pinned_host`` memory (a ``NamedSharding`` with ``memory_kind="pinned_host"``:
the same shards, in host RAM). The train step copies the parameter shards to
the device for the all-gathers, moves the reduced gradient shards back to the
host, and runs the optimizer update on the host (``compute_on("device_host")``).
``model_state``, a communication hook's state and ``step`` stay on the device.

:func:`entry_memory_bytes` measures what a compiled program keeps where: it
reads the memory space of each argument and output from the entry layout of
the compiled HLO (host-resident buffers carry ``S(5)``), which is exact on
every backend, including CPU, whose ``memory_analysis()`` does not split host
from device bytes.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

HOST_MEMORY_KIND = "pinned_host"
# XLA's memory-space number of host memory in layouts (``{0:S(5)}``).
HOST_MEMORY_SPACE = 5


def offloads(config) -> bool:
  """Whether ``config`` (an ``FSDPConfig``) keeps params and optimizer state
  on the host."""
  off = getattr(config, "cpu_offload", None)
  return off is not None and bool(off.offload_params)


def state_memory_kind(config) -> Optional[str]:
  """The memory kind of the stored params and optimizer state: ``"pinned_host"``
  with offload, else None (the device's default memory)."""
  return HOST_MEMORY_KIND if offloads(config) else None


def memory_kinds(device) -> list[str]:
  """The memory kinds ``device`` can address (e.g. ``["device",
  "pinned_host", "unpinned_host"]``)."""
  try:
    return sorted({m.kind for m in device.addressable_memories()})
  except Exception:  # pylint: disable=broad-except  # backends without the API
    return []


def check_backend(mesh: Mesh) -> None:
  """Raises ``ValueError`` unless every device of ``mesh`` has ``pinned_host``
  memory (offload needs it). An abstract mesh (``jax.sharding.AbstractMesh``:
  a plan for devices this process does not have) has no devices to check."""
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return
  for d in mesh.devices.flat:
    kinds = memory_kinds(d)
    if HOST_MEMORY_KIND not in kinds:
      raise ValueError(
          f"FSDPConfig(cpu_offload=CPUOffload(offload_params=True)) keeps the params "
          f"and optimizer state in {HOST_MEMORY_KIND!r} memory, but device {d} "
          f"({d.platform}) has the memory kinds {kinds or 'none reported'}. Fix: drop "
          "cpu_offload (or pass CPUOffload(offload_params=False)) on this backend.")


def _space(x):
  try:
    return getattr(jax.typeof(x), "memory_space", None)
  except TypeError:
    return None


def to_device(tree):
  """Inside a traced function: moves host-resident leaves of ``tree`` to
  device memory (other leaves are returned as they are)."""
  def move(x):
    if _space(x) == jax.memory.Space.Host:
      return jax.device_put(x, jax.memory.Space.Device)
    return x
  return jax.tree.map(move, tree)


def to_host(tree):
  """Inside a traced function: moves every array leaf of ``tree`` to host
  memory."""
  def move(x):
    if _space(x) == jax.memory.Space.Host:
      return x
    return jax.device_put(x, jax.memory.Space.Host)
  return jax.tree.map(move, tree)


def default_memory_kind(sharding) -> str:
  """The default memory kind of the devices of ``sharding`` (read from one
  this process can address)."""
  devices = getattr(sharding, "addressable_devices", None) or sharding.device_set
  try:
    return next(iter(devices)).default_memory().kind
  except Exception:  # pylint: disable=broad-except  # backends without the API
    return "device"


def place_state_tree(memory_kind: Optional[str], tree):
  """Puts the ``jax.Array`` leaves of ``tree`` (stored params or optimizer
  state) into ``memory_kind`` (a plan's :attr:`~fsdp_jax.Plan.memory_kind`:
  ``pinned_host`` with offload), or the device's default memory when None.
  Leaves already there are returned as they are."""
  def place(x):
    if not isinstance(x, jax.Array) or not isinstance(x.sharding, NamedSharding):
      return x
    want = memory_kind or default_memory_kind(x.sharding)
    if x.sharding.memory_kind == want:
      return x
    return jax.device_put(x, x.sharding.with_memory_kind(want))
  return jax.tree.map(place, tree)


# ---------------------------------------------------------------------------
# Measuring: host vs device bytes from the compiled entry layout


_DTYPE_BITS = {"pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
               "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
               "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^{}]*\})?")


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One argument or output buffer of a compiled program (per device)."""

  dtype: str
  shape: tuple[int, ...]
  host: bool

  @property
  def bytes(self) -> int:
    bits = _DTYPE_BITS.get(self.dtype)
    if bits is None:
      bits = 8 if self.dtype.startswith("f8") else 0
    return int(np.prod(self.shape, dtype=np.int64)) * bits // 8


@dataclasses.dataclass(frozen=True)
class EntryMemory:
  """Where a compiled program's arguments and outputs live, per device.

  ``arguments`` / ``outputs`` list every array buffer of the entry layout in
  order (flattened jit arguments, then flattened results); ``host`` marks the
  ones in host memory (``S(5)``).
  """

  arguments: tuple[Buffer, ...]
  outputs: tuple[Buffer, ...]

  @property
  def argument_host_bytes(self) -> int:
    return sum(b.bytes for b in self.arguments if b.host)

  @property
  def argument_device_bytes(self) -> int:
    return sum(b.bytes for b in self.arguments if not b.host)

  @property
  def output_host_bytes(self) -> int:
    return sum(b.bytes for b in self.outputs if b.host)

  @property
  def output_device_bytes(self) -> int:
    return sum(b.bytes for b in self.outputs if not b.host)


def _entry_layout(hlo_text: str) -> str:
  key = "entry_computation_layout={"
  start = hlo_text.find(key)
  if start < 0:
    raise ValueError("entry_memory_bytes: no entry_computation_layout in the HLO text; "
                     "pass compiled.as_text() of a compiled (not just lowered) program.")
  i = start + len(key)
  depth = 1
  j = i
  while depth:
    c = hlo_text[j]
    depth += c == "{"
    depth -= c == "}"
    j += 1
  return hlo_text[i:j - 1]


def _buffers(text: str) -> tuple[Buffer, ...]:
  out = []
  for dtype, dims, layout in _ARRAY.findall(text):
    if dtype not in _DTYPE_BITS and not dtype.startswith("f8"):
      continue
    shape = tuple(int(d) for d in dims.split(",") if d)
    host = f"S({HOST_MEMORY_SPACE})" in (layout or "")
    out.append(Buffer(dtype, shape, host))
  return tuple(out)


def entry_memory_bytes(hlo_text: str) -> EntryMemory:
  """The per-device argument and output buffers of a compiled program and
  their memory space, read from ``compiled.as_text()``'s
  ``entry_computation_layout`` (host buffers are marked ``S(5)``).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import SingleDeviceSharding
    >>> from fsdp_jax.hlo import entry_memory_bytes
    >>> host = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    >>> x = jax.device_put(jnp.ones(256), host)
    >>> f = jax.jit(lambda x, y: (x, y + 1))
    >>> mem = entry_memory_bytes(f.lower(x, jnp.ones(8)).compile().as_text())
    >>> mem.argument_host_bytes, mem.argument_device_bytes
    (1024, 32)
  """
  layout = _entry_layout(hlo_text)
  depth = 0
  split = None
  for k, c in enumerate(layout):
    if c in "({[":
      depth += 1
    elif c in ")}]":
      depth -= 1
    elif c == "-" and depth == 0 and layout[k:k + 2] == "->":
      split = k
      break
  if split is None:
    raise ValueError("entry_memory_bytes: cannot split the entry layout into arguments "
                     f"and results: {layout[:200]!r}")
  return EntryMemory(_buffers(layout[:split]), _buffers(layout[split + 2:]))
