"""Multi-process set-up: ``initialize()``, a monitored barrier, and a watchdog
that turns a lost process into a prompt, clear error instead of a hang.

PyTorch → fsdp_jax:

==========================================  =====================================
``torch.distributed.init_process_group``     :func:`initialize`
``torchrun`` / ``torch.distributed.launch``  ``python -m fsdp_jax.launch``
``dist.get_rank()`` / ``get_world_size()``   :func:`get_rank` / :func:`get_world_size`
``LOCAL_RANK``                               :func:`get_local_rank`
``dist.monitored_barrier(timeout=...)``      :func:`monitored_barrier`
NCCL watchdog / TCPStore failure detection   the peer watchdog started by :func:`initialize`
``dist.destroy_process_group()``             :func:`shutdown`
==========================================  =====================================

A training script calls :func:`initialize` first thing, before any JAX
computation, and is otherwise the same for one process and for many::

    import fsdp_jax
    from fsdp_jax import distributed

    info = distributed.initialize()        # reads RANK, WORLD_SIZE, ... if set
    mesh = fsdp_jax.make_mesh(replicate=info.world_size,
                              shard=jax.local_device_count())
    ...
    state, metrics = step(state, local_batch)   # each process: its own part

Run it with ``python -m fsdp_jax.launch --nproc 2 --devices-per-proc 4
train.py`` on one machine, with ``srun python train.py`` under SLURM (JAX
detects SLURM and Open MPI by itself), or as a plain ``python train.py`` (one
process).

Environment variables read by :func:`initialize` (the launcher sets them):

========================  ====================================================
``RANK``                  this process's index, ``0 .. WORLD_SIZE-1`` (torchrun)
``WORLD_SIZE``            number of processes (torchrun)
``LOCAL_RANK``            index of this process on its machine (torchrun)
``LOCAL_WORLD_SIZE``      processes on this machine (torchrun)
``GROUP_RANK``            index of this machine (torchrun's node rank)
``MASTER_ADDR/PORT``      where process 0 runs the coordinator (torchrun)
``JAX_COORDINATOR_ADDRESS``  ``host:port`` of the coordinator; read by JAX
                          itself and preferred over ``MASTER_ADDR/PORT``
``FSDP_JAX_DEVICES_PER_PROC``  devices per process: simulated CPU devices on
                          CPU, GPUs ``LOCAL_RANK*M .. LOCAL_RANK*M+M-1`` on GPU
``FSDP_JAX_PLATFORM``     ``cpu`` or ``gpu`` (else ``JAX_PLATFORMS``, else
                          ``nvidia-smi`` decides)
``FSDP_JAX_PEER_TIMEOUT`` seconds without a heartbeat before a process is
                          declared lost (default 30)
``FSDP_JAX_INIT_TIMEOUT`` seconds to wait for all processes to connect
                          (default 300)
``FSDP_JAX_SHUTDOWN_TIMEOUT``  seconds a finished process waits at exit for
                          the others before JAX ends the job (default 300)
``FSDP_JAX_LAUNCHED``     ``1`` when started by ``python -m fsdp_jax.launch``
========================  ====================================================

How a lost process is reported
------------------------------

After ``jax.distributed.initialize`` every process starts a watchdog thread
that writes a heartbeat to JAX's coordination-service key-value store once a
second. Process 0 watches everybody's heartbeats:

* a process that raises an uncaught exception publishes it before exiting;
  every other process prints ``fsdp_jax.distributed: process 1 of 2 (...)
  failed: ValueError: ...`` and exits with :data:`EXIT_PEER_LOST` within about
  a second;
* a process that stops heartbeating for ``peer_timeout`` seconds (killed,
  out of memory, segfault, machine lost) is named the same way
  (``... stopped sending heartbeats 30.0 s ago: it died or was killed``);
* if process 0 itself dies, the coordination service dies with it and JAX
  terminates the other processes at once (``Terminating process because the
  JAX distributed service detected fatal errors ... the leader task was
  preempted/died``); the watchdog adds its own line when it gets there first.

The exit is a hard ``os._exit`` after the message and the main thread's
Python stack: a survivor is usually blocked inside a collective that will
never complete, where no Python exception can reach it (PyTorch's NCCL
watchdog tears the process down for the same reason). JAX's own heartbeat
timeout is set ``peer_timeout + 20`` seconds as a backstop.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Optional, Sequence

import jax

from fsdp_jax import _compat

# Exit status of a process that stops because another process was lost
# (sysexits' EX_TEMPFAIL: "try again later", i.e. restart from a checkpoint).
EXIT_PEER_LOST = 75

DEFAULT_PEER_TIMEOUT = 30.0
DEFAULT_INIT_TIMEOUT = 300
DEFAULT_SHUTDOWN_TIMEOUT = 300  # JAX's default
DEFAULT_BARRIER_TIMEOUT = 1800.0  # PyTorch's default process-group timeout
HEARTBEAT_INTERVAL = 1.0

_KV = "fsdp_jax"
_HB = f"{_KV}/hb/"          # fsdp_jax/hb/<rank> = counter
_INFO = f"{_KV}/info/"      # fsdp_jax/info/<rank> = json(host, pid, ...)
_DONE = f"{_KV}/done/"      # fsdp_jax/done/<rank> = "finished"
_ABORT = f"{_KV}/abort/"    # fsdp_jax/abort/first = the first failure, as a message
_BARRIER = f"{_KV}/barrier/"


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
  """Where this process stands, as returned by :func:`initialize`.

  Attributes:
    rank: this process's index (``jax.process_index()``).
    world_size: number of processes (``jax.process_count()``).
    local_rank: index of this process on its machine.
    local_world_size: number of processes on this machine.
    node_rank: index of this machine.
    coordinator_address: ``host:port`` of the coordination service, or None
      for a single process.
    platform: ``"cpu"`` or ``"gpu"``.
    devices_per_process: devices given to this process, or None when JAX
      chose (all visible GPUs, or its default CPU device count).
    source: where the set-up came from: ``"explicit"`` (arguments),
      ``"env"`` (``RANK``/``WORLD_SIZE``: the launcher or torchrun),
      ``"cluster"`` (JAX's SLURM / Open MPI detection), ``"jax"``
      (``jax.distributed.initialize`` had been called directly) or
      ``"single"``.
  """

  rank: int
  world_size: int
  local_rank: int
  local_world_size: int
  node_rank: int
  coordinator_address: Optional[str]
  platform: str
  devices_per_process: Optional[int]
  source: str

  @property
  def is_main_process(self) -> bool:
    """True on process 0 (the one that should write logs and files)."""
    return self.rank == 0


_info: Optional[DistributedInfo] = None
_watchdog: Optional["_Watchdog"] = None
_barrier_seq = [0]


# --------------------------------------------------------------------------
# Helpers


def _env_int(name: str, default=None):
  value = os.environ.get(name)
  if value is None or value == "":
    return default
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"Environment variable {name}={value!r} is not an integer. "
                     f"Fix: set {name} to a whole number or unset it.") from None


def _env_float(name: str, default=None):
  value = os.environ.get(name)
  if value is None or value == "":
    return default
  try:
    return float(value)
  except ValueError:
    raise ValueError(f"Environment variable {name}={value!r} is not a number. "
                     f"Fix: set {name} to a number of seconds or unset it.") from None


def _seconds(timeout) -> float:
  if isinstance(timeout, datetime.timedelta):
    return timeout.total_seconds()
  return float(timeout)


def gpu_count() -> int:
  """Number of GPUs ``nvidia-smi -L`` lists (0 without ``nvidia-smi``).

  Never touches JAX, so it is safe to call before :func:`initialize`.
  """
  exe = shutil.which("nvidia-smi")
  if exe is None:
    return 0
  try:
    out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return 0
  if out.returncode != 0:
    return 0
  return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def detect_platform() -> str:
  """``"cpu"`` or ``"gpu"``: ``FSDP_JAX_PLATFORM``, else ``JAX_PLATFORMS``,
  else whether ``nvidia-smi`` lists a GPU."""
  value = os.environ.get("FSDP_JAX_PLATFORM", "").strip().lower()
  if value:
    if value not in ("cpu", "gpu", "cuda"):
      raise ValueError(f"FSDP_JAX_PLATFORM={value!r}: expected 'cpu' or 'gpu'.")
    return "cpu" if value == "cpu" else "gpu"
  env = os.environ.get("JAX_PLATFORMS", "").strip().lower()
  if env:
    return "gpu" if any(p in env for p in ("cuda", "gpu", "rocm")) else "cpu"
  return "gpu" if gpu_count() else "cpu"


def _backends_started() -> bool:
  return _compat.backends_initialized()


def _jax_client():
  """JAX's coordination-service client, or None without jax.distributed."""
  return _compat.distributed_state().client


def _cluster_env() -> Optional[str]:
  """The cluster JAX can detect by itself with more than one task, if any."""
  if all(v in os.environ for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                                   "SLURM_PROCID", "SLURM_LOCALID")):
    if _env_int("SLURM_NTASKS", 1) > 1:
      return "slurm"
  if "OMPI_MCA_orte_hnp_uri" in os.environ and _env_int("OMPI_COMM_WORLD_SIZE", 1) > 1:
    return "ompi"
  return None


def _cluster_local_rank():
  for rank_var, size_var in (("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
                             ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")):
    if rank_var in os.environ:
      size = os.environ.get(size_var, "1").split("(")[0].split(",")[0]
      try:
        return int(os.environ[rank_var]), int(size)
      except ValueError:
        return int(os.environ[rank_var]), 1
  return 0, 1


# --------------------------------------------------------------------------
# initialize


def initialize(*, coordinator_address: Optional[str] = None,
               num_processes: Optional[int] = None,
               process_id: Optional[int] = None,
               local_rank: Optional[int] = None,
               devices_per_process: Optional[int] = None,
               platform: Optional[str] = None,
               peer_timeout: Optional[float] = None,
               initialization_timeout: Optional[int] = None,
               cluster_detection_method: Optional[str] = None,
               watchdog: bool = True) -> DistributedInfo:
  """Sets up this process for single- or multi-process training.

  Call it at the top of the training script, before any JAX computation
  (PyTorch: ``init_process_group("gloo"/"nccl", init_method="env://")``).
  Where the set-up comes from, first match wins:

  1. the arguments ``coordinator_address``, ``num_processes``,
     ``process_id``;
  2. the environment: ``RANK``, ``WORLD_SIZE`` and ``JAX_COORDINATOR_ADDRESS``
     (or ``MASTER_ADDR``/``MASTER_PORT``), as set by
     ``python -m fsdp_jax.launch`` (or torchrun);
  3. a SLURM or Open MPI job with more than one task: JAX's own detection
     (``jax.distributed.initialize()`` with no arguments);
  4. otherwise a single process: ``jax.distributed`` is not started.

  Devices are chosen before JAX starts: on CPU, ``devices_per_process`` (or
  ``FSDP_JAX_DEVICES_PER_PROC``) simulated devices with fsdp_jax's CPU XLA
  flags (:func:`fsdp_jax.simulate_cpu_devices`) and gloo CPU collectives; on
  GPU, process ``LOCAL_RANK`` gets GPUs ``LOCAL_RANK*M .. LOCAL_RANK*M+M-1``;
  with M unset, GPU ``LOCAL_RANK`` when several processes share the machine
  (torchrun's convention), all visible GPUs when the process is alone (under
  SLURM / Open MPI, JAX's own choice: GPU ``SLURM_LOCALID``).

  With more than one process a watchdog thread is started (``watchdog=True``):
  when a process raises an uncaught exception or stops heartbeating for
  ``peer_timeout`` seconds, every other process prints an error naming it and
  exits with status :data:`EXIT_PEER_LOST` instead of hanging in a collective.

  Calling it again returns the first call's result. If
  ``jax.distributed.initialize`` was already called directly, its set-up is
  taken as is and only the watchdog is added.

  Args:
    coordinator_address: ``host:port`` where process 0 runs the coordinator.
    num_processes: number of processes.
    process_id: this process's rank.
    local_rank: this process's index on its machine (default ``LOCAL_RANK``,
      else 0).
    devices_per_process: simulated CPU devices / GPUs per process (default
      ``FSDP_JAX_DEVICES_PER_PROC``).
    platform: ``"cpu"`` or ``"gpu"`` (default: :func:`detect_platform`).
    peer_timeout: seconds without a heartbeat before a peer is declared lost
      (default ``FSDP_JAX_PEER_TIMEOUT``, else 30).
    initialization_timeout: seconds to wait for all processes to connect
      (default ``FSDP_JAX_INIT_TIMEOUT``, else 300).
    cluster_detection_method: passed to ``jax.distributed.initialize`` for
      case 3 (e.g. ``"mpi4py"``).
    watchdog: start the heartbeat watchdog (multi-process only).

  Returns:
    A :class:`DistributedInfo`.

  Raises:
    RuntimeError: JAX has already started its backends, or the coordinator
      could not be reached.
    ValueError: inconsistent arguments or environment variables.

  Example::

      from fsdp_jax import distributed
      info = distributed.initialize()    # first thing in the script
      print(f"process {info.rank} of {info.world_size}")

  Before (or without) it, a process is alone::

      >>> from fsdp_jax import distributed
      >>> distributed.get_rank(), distributed.get_world_size()
      (0, 1)
  """
  global _info
  if _info is not None:
    return _info
  if _jax_client() is not None:
    return _adopt_jax_distributed(peer_timeout, watchdog)

  # -- who am I
  source = "single"
  rank, world = 0, 1
  address = coordinator_address
  if num_processes is not None or process_id is not None or coordinator_address is not None:
    if None in (coordinator_address, num_processes, process_id):
      raise ValueError(
          "initialize(): pass all of coordinator_address, num_processes and "
          f"process_id, or none of them; got coordinator_address="
          f"{coordinator_address!r}, num_processes={num_processes!r}, "
          f"process_id={process_id!r}.")
    source, rank, world = "explicit", int(process_id), int(num_processes)
  elif "RANK" in os.environ or "WORLD_SIZE" in os.environ:
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is None or world is None:
      raise ValueError(
          f"RANK={os.environ.get('RANK')!r} and WORLD_SIZE="
          f"{os.environ.get('WORLD_SIZE')!r}: set both (python -m "
          "fsdp_jax.launch does) or neither.")
    source = "env"
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
      if world > 1 and "TORCHELASTIC_RUN_ID" in os.environ:
        raise ValueError(
            "Started by torchrun, whose own store already listens on MASTER_PORT="
            f"{os.environ['MASTER_PORT']}, so JAX's coordinator cannot use it. Fix: "
            "set JAX_COORDINATOR_ADDRESS=<MASTER_ADDR>:<another free port> for "
            "every process, or start the script with python -m fsdp_jax.launch.")
      address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if world > 1 and not address:
      raise ValueError(
          f"RANK={rank}, WORLD_SIZE={world} but no coordinator address: set "
          "JAX_COORDINATOR_ADDRESS=host:port (or MASTER_ADDR and MASTER_PORT) "
          "to where process 0 should listen, or start the script with "
          "python -m fsdp_jax.launch.")
  elif _cluster_env() is not None or cluster_detection_method is not None:
    source = "cluster"
  if source in ("explicit", "env"):
    if world < 1 or not 0 <= rank < world:
      raise ValueError(
          f"Invalid process ranks: rank={rank}, world_size={world}; need "
          "world_size >= 1 and 0 <= rank < world_size.")

  if local_rank is None:
    local_rank = _env_int("LOCAL_RANK")
  local_world = _env_int("LOCAL_WORLD_SIZE")
  if source == "cluster" and local_rank is None:
    local_rank, local_world = _cluster_local_rank()
  local_rank = 0 if local_rank is None else int(local_rank)
  local_world = local_world or 1  # unknown: as if alone on the machine
  node_rank = _env_int("GROUP_RANK", _env_int("SLURM_NODEID", 0))

  # -- devices, before JAX starts
  if devices_per_process is None:
    devices_per_process = _env_int("FSDP_JAX_DEVICES_PER_PROC")
  if devices_per_process is not None and devices_per_process < 1:
    raise ValueError(f"devices_per_process={devices_per_process}: need at least 1.")
  if _backends_started():
    if world > 1 or source == "cluster" or devices_per_process is not None:
      raise RuntimeError(
          "fsdp_jax.distributed.initialize() must run before JAX starts its "
          "backends, but something already ran a JAX computation or called "
          "jax.devices() in this process. Fix: call initialize() first thing "
          "in the script, right after the imports.")
    # One process and nothing to configure (e.g. a notebook): keep what runs.
    _info = DistributedInfo(rank=0, world_size=1, local_rank=local_rank,
                            local_world_size=1, node_rank=node_rank,
                            coordinator_address=None,
                            platform="cpu" if jax.default_backend() == "cpu" else "gpu",
                            devices_per_process=None, source=source)
    return _info
  forced = platform or os.environ.get("FSDP_JAX_PLATFORM", "").strip().lower() or None
  platform = (platform or detect_platform()).lower()
  if platform == "cuda":
    platform = "gpu"
  if platform not in ("cpu", "gpu"):
    raise ValueError(f"platform={platform!r}: expected 'cpu' or 'gpu'.")
  local_device_ids = None
  if world > 1 or source == "cluster":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if platform == "cpu":
    if forced:  # asked for CPU: do not probe for accelerators
      jax.config.update("jax_platforms", "cpu")
    if devices_per_process is not None:
      from fsdp_jax.mesh import simulate_cpu_devices
      simulate_cpu_devices(devices_per_process)
  elif devices_per_process is not None:
    local_device_ids = list(range(local_rank * devices_per_process,
                                  (local_rank + 1) * devices_per_process))
  elif local_world > 1 and source in ("explicit", "env"):
    local_device_ids = [local_rank]  # torchrun's convention: GPU LOCAL_RANK

  if peer_timeout is None:
    peer_timeout = _env_float("FSDP_JAX_PEER_TIMEOUT", DEFAULT_PEER_TIMEOUT)
  if peer_timeout <= 0:
    raise ValueError(f"peer_timeout={peer_timeout}: need a positive number of seconds.")
  if initialization_timeout is None:
    initialization_timeout = _env_int("FSDP_JAX_INIT_TIMEOUT", DEFAULT_INIT_TIMEOUT)

  # -- start jax.distributed
  if source == "cluster" or world > 1:
    kwargs = dict(initialization_timeout=int(initialization_timeout),
                  heartbeat_timeout_seconds=int(peer_timeout) + 20,
                  shutdown_timeout_seconds=_env_int("FSDP_JAX_SHUTDOWN_TIMEOUT",
                                                    DEFAULT_SHUTDOWN_TIMEOUT))
    if source == "cluster":
      what = f"JAX's cluster detection ({cluster_detection_method or _cluster_env()})"
      args = dict(cluster_detection_method=cluster_detection_method,
                  local_device_ids=local_device_ids)
    else:
      what = f"the coordinator at {address}"
      # "deactivate": the launcher's ranks win over a surrounding SLURM/MPI
      # job (whose variables would otherwise also pick the visible GPUs).
      args = dict(coordinator_address=address, num_processes=world, process_id=rank,
                  local_device_ids=local_device_ids,
                  cluster_detection_method="deactivate")
    try:
      jax.distributed.initialize(**args, **kwargs)
    except Exception as e:
      raise RuntimeError(
          f"fsdp_jax.distributed.initialize(): process {rank} of {world} could "
          f"not join {what} within {initialization_timeout} s: {e}\nFix: start "
          "all processes (python -m fsdp_jax.launch does), check that process 0 "
          "can listen on that port and the others can reach it, or raise "
          "FSDP_JAX_INIT_TIMEOUT.") from e
    state = _compat.distributed_state()
    rank, world, address = state.process_id, state.num_processes, state.coordinator_address

  _info = DistributedInfo(rank=rank, world_size=world, local_rank=local_rank,
                          local_world_size=local_world, node_rank=node_rank,
                          coordinator_address=address if world > 1 else None,
                          platform=platform, devices_per_process=devices_per_process,
                          source=source)
  if world > 1:
    _publish_info(_info)
    if watchdog:
      _start_watchdog(_info, float(peer_timeout))
  return _info


def _adopt_jax_distributed(peer_timeout, watchdog) -> DistributedInfo:
  """``jax.distributed.initialize`` was called directly: take its set-up."""
  global _info
  state = _compat.distributed_state()
  local_rank = _env_int("LOCAL_RANK", 0)
  _info = DistributedInfo(
      rank=state.process_id, world_size=state.num_processes, local_rank=local_rank,
      local_world_size=_env_int("LOCAL_WORLD_SIZE", 1), node_rank=_env_int("GROUP_RANK", 0),
      coordinator_address=state.coordinator_address,
      platform="cpu" if jax.default_backend() == "cpu" else "gpu",
      devices_per_process=None, source="jax")
  if _info.world_size > 1:
    _publish_info(_info)
    if watchdog:
      if peer_timeout is None:
        peer_timeout = _env_float("FSDP_JAX_PEER_TIMEOUT", DEFAULT_PEER_TIMEOUT)
      _start_watchdog(_info, float(peer_timeout))
  return _info


def is_initialized() -> bool:
  """Whether :func:`initialize` has run in this process."""
  return _info is not None


def info() -> DistributedInfo:
  """The :class:`DistributedInfo` of :func:`initialize` (which must have run)."""
  if _info is None:
    raise RuntimeError("fsdp_jax.distributed.initialize() has not been called; "
                       "call it first thing in the script.")
  return _info


def get_rank() -> int:
  """This process's index (PyTorch ``dist.get_rank()``); 0 without set-up."""
  if _info is not None:
    return _info.rank
  return jax.process_index() if _jax_client() is not None else 0


def get_world_size() -> int:
  """Number of processes (PyTorch ``dist.get_world_size()``); 1 without set-up."""
  if _info is not None:
    return _info.world_size
  return jax.process_count() if _jax_client() is not None else 1


def get_local_rank() -> int:
  """Index of this process on its machine (torchrun's ``LOCAL_RANK``)."""
  if _info is not None:
    return _info.local_rank
  return _env_int("LOCAL_RANK", 0)


def shutdown() -> None:
  """Stops the watchdog and ``jax.distributed`` (PyTorch
  ``destroy_process_group``). Optional: it also happens at exit."""
  global _info, _watchdog
  if _watchdog is not None:
    _watchdog.finish()
    _watchdog.stop()
    _watchdog = None
  if _jax_client() is not None:
    jax.distributed.shutdown()
  _info = None


# --------------------------------------------------------------------------
# Process descriptions


def _publish_info(info: DistributedInfo) -> None:
  client = _jax_client()
  record = {"host": socket.gethostname(), "pid": os.getpid(),
            "local_rank": info.local_rank, "node_rank": info.node_rank}
  try:
    client.key_value_set(f"{_INFO}{info.rank}", json.dumps(record), allow_overwrite=True)
  except Exception:  # pragma: no cover - informational only
    pass


def describe_process(rank: int, world: Optional[int] = None, client=None) -> str:
  """``"process 1 of 2 (host h, pid 123, LOCAL_RANK 1)"`` from the KV store."""
  world = world or get_world_size()
  text = f"process {rank} of {world}"
  client = client or _jax_client()
  if client is None:
    return text
  try:
    record = json.loads(client.key_value_try_get(f"{_INFO}{rank}"))
    text += (f" (host {record['host']}, pid {record['pid']}, "
             f"LOCAL_RANK {record['local_rank']})")
  except Exception:
    pass
  return text


# --------------------------------------------------------------------------
# The watchdog


def _main_thread_stack() -> str:
  frame = sys._current_frames().get(threading.main_thread().ident)
  if frame is None:
    return ""
  return "".join(traceback.format_stack(frame))


class _Watchdog(threading.Thread):
  """Heartbeats, and on process 0 watches the others' heartbeats.

  Every process: once per ``interval`` set ``fsdp_jax/hb/<rank>`` to an
  increasing counter and look for ``fsdp_jax/abort`` (a failure someone
  published). Process 0: read all heartbeats; a process whose counter has not
  moved for ``peer_timeout`` seconds (and that has not said it finished) is
  lost: publish that, wait for the others to read it, exit.
  """

  def __init__(self, info: DistributedInfo, peer_timeout: float,
               interval: float = HEARTBEAT_INTERVAL):
    super().__init__(name="fsdp_jax-watchdog", daemon=True)
    self.info = info
    self.client = _jax_client()
    self.peer_timeout = peer_timeout
    self.interval = min(interval, peer_timeout / 4)
    self._stop_event = threading.Event()
    self._finished = False
    self.failed = False
    self.shutdown_timeout = _env_int("FSDP_JAX_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT)
    self._done_since: dict[int, float] = {}
    self._warned_done: set[int] = set()

  def stop(self):
    self._stop_event.set()

  def finish(self):
    """This process is exiting normally: tell process 0 not to wait for it."""
    if self._finished:
      return
    self._finished = True
    try:
      self.client.key_value_set(f"{_DONE}{self.info.rank}", "finished", allow_overwrite=True)
    except Exception:
      pass

  def publish_failure(self, message: str) -> None:
    """Publishes this process's own failure so the others stop at once."""
    self.failed = True
    try:
      self.client.key_value_set(f"{_ABORT}first", message)
    except Exception:  # someone else failed first, or the service is gone
      pass

  def wait_for_cause(self, seconds: float, finished_peers: bool = False) -> Optional[str]:
    """The failure another process published, waiting up to ``seconds``.

    With ``finished_peers``, processes that already exited normally also
    count as the cause (a collective with a process that is gone cannot
    complete: it stopped early, e.g. ``sys.exit`` or fewer steps).
    """
    deadline = time.monotonic() + seconds
    while True:
      try:
        abort = self.client.key_value_dir_get(_ABORT)
        done = (sorted(int(k.rsplit("/", 1)[-1]) for k, _ in self.client.key_value_dir_get(_DONE))
                if finished_peers else [])
      except Exception:
        abort, done = None, []
      if abort:
        return abort[0][1]
      done = [r for r in done if r != self.info.rank]
      if done:
        who = "; ".join(describe_process(r, self.info.world_size, self.client) for r in done)
        return (f"{who} exited (end of its script, or sys.exit) while process "
                f"{self.info.rank} still needed it in a collective: the processes "
                "ran different numbers of steps or collectives, or that process "
                "stopped early on an error it handled itself.")
      if time.monotonic() >= deadline:
        return None
      time.sleep(min(0.2, self.interval))

  def die(self, message: str, consequence: Optional[str] = None,
          stack: bool = True) -> None:
    rank = self.info.rank
    text = [
        "", "=" * 78,
        f"fsdp_jax.distributed: {message}",
        f"This process ({describe_process(rank, self.info.world_size, self.client)}) "
        f"exits with status {EXIT_PEER_LOST} instead of waiting on a collective "
        "that cannot complete. Look at the named process's log for the cause, "
        "then restart the job (from the last checkpoint).",
    ]
    if consequence:
      text.append(f"(This process's own error, a consequence of that: {consequence})")
    where = _main_thread_stack() if stack else ""
    if where:
      text += [f"Main thread of process {rank} was at:", where.rstrip()]
    text += ["=" * 78, ""]
    try:
      sys.stdout.flush()
    except Exception:
      pass
    try:
      sys.stderr.write("\n".join(text) + "\n")
      sys.stderr.flush()
    except Exception:
      pass
    os._exit(EXIT_PEER_LOST)

  def _check_finished_peers(self, done: set, now: float) -> None:
    """Warns once when peers finished ``peer_timeout`` ago and this process
    still runs: if it waits in a collective for them, it hangs until JAX's
    shutdown timeout (the classic uneven-number-of-batches bug)."""
    if self._finished:
      return
    for r in done:
      self._done_since.setdefault(int(r), now)
    late = sorted(r for r, t in self._done_since.items()
                  if r != self.info.rank and now - t > self.peer_timeout
                  and r not in self._warned_done)
    if not late:
      return
    self._warned_done.update(late)
    who = "; ".join(describe_process(r, self.info.world_size, self.client) for r in late)
    try:
      sys.stderr.write(
          f"fsdp_jax.distributed: warning: {who} finished more than "
          f"{self.peer_timeout:g} s ago while process {self.info.rank} still runs. "
          "If this process is waiting in a collective (a train step), it waits "
          "for a process that is gone: the processes ran different numbers of "
          "steps (uneven data per process?) or that process stopped early. JAX "
          f"ends the job after its shutdown timeout ({self.shutdown_timeout} s, "
          "FSDP_JAX_SHUTDOWN_TIMEOUT).\n")
      sys.stderr.flush()
    except Exception:
      pass

  def run(self):
    rank, world = self.info.rank, self.info.world_size
    counter = 0
    last_seen: dict[int, tuple[str, float]] = {}
    start = time.monotonic()
    rpc_error_since = None
    while not self._stop_event.is_set():
      now = time.monotonic()
      try:
        counter += 1
        self.client.key_value_set(f"{_HB}{rank}", str(counter), allow_overwrite=True)
        abort = self.client.key_value_dir_get(_ABORT)
        if abort and not self.failed:
          if rank == 0 and world > 2:
            # This process hosts the coordination service: give the others a
            # few heartbeats to read the message before it goes away.
            time.sleep(3 * self.interval)
          self.die(abort[0][1])
        if rank == 0 or counter % 5 == 0:
          done = {k.rsplit("/", 1)[-1] for k, _ in self.client.key_value_dir_get(_DONE)}
          self._check_finished_peers(done, now)
        if rank == 0:
          beats = dict(self.client.key_value_dir_get(_HB))
          lost = []
          for peer in range(1, world):
            value = beats.get(f"{_HB}{peer}")
            seen = last_seen.get(peer)
            if seen is None or seen[0] != value:
              last_seen[peer] = (value, now if seen is not None or value is not None else start)
              continue
            if str(peer) in done:
              continue
            if now - seen[1] > self.peer_timeout:
              lost.append((peer, value, now - seen[1]))
          if lost and not self.failed:
            parts = []
            for peer, value, age in lost:
              how = ("never sent a heartbeat" if value is None else
                     f"stopped sending heartbeats {age:.1f} s ago")
              parts.append(f"{describe_process(peer, world, self.client)} {how}")
            message = ("lost " + "; ".join(parts) + f" (peer_timeout {self.peer_timeout:g} s): "
                       "it died or was killed (crash, out of memory, SIGKILL, node "
                       "failure).")
            self.publish_failure(message)
            # Give the others a few heartbeats to read the message before the
            # coordination service (hosted by this process) goes away.
            time.sleep(3 * self.interval)
            self.die(message)
        rpc_error_since = None
      except Exception as e:  # the coordination service is unreachable
        if rpc_error_since is None:
          rpc_error_since = now
        elif now - rpc_error_since > max(2 * self.interval, 2.0) and not self._finished:
          self.die(
              f"lost the coordinator: {describe_process(0, world)} at "
              f"{self.info.coordinator_address}, which hosts JAX's coordination "
              f"service, has not answered for {now - rpc_error_since:.1f} s ({e}). "
              "Process 0 probably died or was killed.")
      self._stop_event.wait(self.interval)


def _start_watchdog(info: DistributedInfo, peer_timeout: float) -> None:
  global _watchdog
  _watchdog = _Watchdog(info, peer_timeout)
  _watchdog.start()

  previous_hook = sys.excepthook

  def excepthook(exc_type, exc, tb):
    wd = _watchdog
    if wd is None or issubclass(exc_type, KeyboardInterrupt):
      previous_hook(exc_type, exc, tb)
      return
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    own = f"{exc_type.__name__}: {first}"
    # A collective that fails because a peer died ("Gloo AllGather failed:
    # ... Connection reset by peer") is a consequence, not the cause: give the
    # watchdog time to name the lost process before blaming this one.
    comm = _is_communication_error(exc)
    wait = wd.peer_timeout + 4 * wd.interval if comm else 0.0
    cause = wd.wait_for_cause(wait, finished_peers=comm)
    if cause is not None:
      wd.die(cause, consequence=own, stack=False)
    wd.publish_failure(
        f"{describe_process(info.rank, info.world_size, wd.client)} failed: {own}")
    previous_hook(exc_type, exc, tb)

  sys.excepthook = excepthook
  atexit.register(_at_exit)


_COMM_ERROR_WORDS = ("gloo", "nccl", "connection", "socket", "unavailable",
                     "coordination", "deadline", "barrier", "peer")


def _is_communication_error(exc: BaseException) -> bool:
  """Whether ``exc`` looks like a collective or RPC failure (XLA runtime
  errors that mention gloo/NCCL, connections, the coordination service)."""
  name = type(exc).__name__
  if name not in ("JaxRuntimeError", "XlaRuntimeError") and not isinstance(
      exc, (ConnectionError, TimeoutError)):
    return False
  text = str(exc).lower()
  return isinstance(exc, (ConnectionError, TimeoutError)) or any(
      w in text for w in _COMM_ERROR_WORDS)


def _at_exit() -> None:
  """Runs before JAX's own exit handler (atexit is last-in, first-out)."""
  wd = _watchdog
  if wd is None:
    return
  if wd.failed:
    # This process published its failure; the others are exiting. JAX's
    # shutdown would now wait up to its shutdown timeout for them at a
    # barrier they will never reach, so leave at once -- after giving the
    # others a few heartbeats to read the failure if this process hosts the
    # coordination service (process 0), which dies with it.
    if wd.info.rank == 0:
      time.sleep(3 * wd.interval)
    try:
      sys.stdout.flush()
      sys.stderr.flush()
    except Exception:
      pass
    os._exit(1)
  wd.finish()


# --------------------------------------------------------------------------
# monitored_barrier


class MonitoredBarrierError(RuntimeError):
  """Raised by :func:`monitored_barrier`; ``missing`` lists the absent ranks."""

  def __init__(self, message: str, missing: Sequence[int] = ()):
    super().__init__(message)
    self.missing = tuple(missing)


def monitored_barrier(name: Optional[str] = None, *, timeout=None,
                      wait_all_ranks: bool = False) -> None:
  """A host-side barrier that names the processes that did not arrive.

  Mirrors ``torch.distributed.monitored_barrier``: every process blocks until
  all processes have called it, or until ``timeout``; then it raises
  :class:`MonitoredBarrierError` naming the processes that did not arrive,
  whether they still send heartbeats (alive but hung, slow, or skipped the
  barrier) or not (dead). Unlike PyTorch's, every process reports, not only
  rank 0. All processes must call it the same number of times in the same
  order; ``name`` (optional) is checked to match across processes, which
  catches barriers called in a different order.

  Built on JAX's coordination-service key-value store, so it needs no
  devices and works across hosts. With one process it returns at once.

  Args:
    name: a label for messages (and the match check).
    timeout: seconds or a ``datetime.timedelta`` (default 1800 s, PyTorch's
      default process-group timeout).
    wait_all_ranks: with ``False`` (PyTorch's default: fail fast) it raises
      as soon as a missing process is known to be dead (no heartbeat for
      the watchdog's peer timeout); with ``True`` it waits the full timeout
      and reports every missing process. Both report all absent processes.

  Raises:
    MonitoredBarrierError: some processes did not arrive in time, or
      arrived at a barrier with a different ``name``.

  Example::

      from datetime import timedelta
      from fsdp_jax import distributed
      distributed.initialize()
      ...
      distributed.monitored_barrier("after-load", timeout=timedelta(seconds=60))
      # process 0, if process 1 hangs:
      # MonitoredBarrierError: monitored_barrier 'after-load' (#1): 1 of 2
      # processes did not arrive within 60.0 s: process 1 of 2 (host ..., pid
      # ..., LOCAL_RANK 1) [alive: still sending heartbeats, so hung, slow,
      # or not calling this barrier] ...
  """
  world = get_world_size()
  if world == 1:
    return
  client = _jax_client()
  if client is None:
    raise RuntimeError("monitored_barrier() needs jax.distributed: call "
                       "fsdp_jax.distributed.initialize() first.")
  timeout_s = DEFAULT_BARRIER_TIMEOUT if timeout is None else _seconds(timeout)
  if timeout_s <= 0:
    raise ValueError(f"monitored_barrier timeout={timeout!r}: need a positive duration.")
  rank = get_rank()
  _barrier_seq[0] += 1
  seq = _barrier_seq[0]
  label = name if name is not None else ""
  title = f"monitored_barrier {label!r} (#{seq})" if label else f"monitored_barrier #{seq}"
  prefix = f"{_BARRIER}{seq}/"
  client.key_value_set(f"{prefix}{rank}", label, allow_overwrite=True)
  beats_at_start = dict(client.key_value_dir_get(_HB))
  deadline = time.monotonic() + timeout_s
  wd = _watchdog
  peer_timeout = wd.peer_timeout if wd is not None else None
  last_beat: dict[str, tuple[Optional[str], float]] = {}
  poll = 0.02
  dead_now: list[int] = []
  while True:
    arrived = dict(client.key_value_dir_get(prefix))
    ranks = {int(k.rsplit("/", 1)[-1]): v for k, v in arrived.items()}
    wrong = {r: v for r, v in ranks.items() if v != label}
    if wrong:
      detail = ", ".join(f"process {r} at {v!r}" for r, v in sorted(wrong.items()))
      raise MonitoredBarrierError(
          f"{title}: process {rank} is at barrier {label!r} but {detail}. "
          "Processes call monitored_barrier in a different order; make every "
          "process call the same barriers in the same order.")
    missing = sorted(set(range(world)) - set(ranks))
    if not missing:
      break
    now = time.monotonic()
    if not wait_all_ranks and peer_timeout is not None:
      # Fail fast: a missing process whose heartbeat has stood still for the
      # watchdog's peer timeout is dead and will never arrive.
      beats = dict(client.key_value_dir_get(_HB))
      dead_now = []
      for r in missing:
        key = f"{_HB}{r}"
        value = beats.get(key)
        if key not in last_beat or last_beat[key][0] != value:
          last_beat[key] = (value, now)
        elif now - last_beat[key][1] > peer_timeout:
          dead_now.append(r)
    if now >= deadline or dead_now:
      break
    time.sleep(poll)
    poll = min(poll * 1.5, 0.2)
  if not missing:
    # Everyone passed #seq, so everyone has left #seq-1: drop our old key.
    if seq > 1:
      try:
        client.key_value_delete(f"{_BARRIER}{seq - 1}/{rank}")
      except Exception:
        pass
    return
  beats_at_end = dict(client.key_value_dir_get(_HB))
  parts = []
  for r in missing:
    key = f"{_HB}{r}"
    if wd is None:
      state = ""
    elif r not in dead_now and beats_at_end.get(key) != beats_at_start.get(key):
      state = (" [alive: still sending heartbeats, so hung, slow, or not calling "
               "this barrier]")
    else:
      state = " [no heartbeat during the wait: probably dead]"
    parts.append(describe_process(r, world, client) + state)
  waited = timeout_s - max(0.0, deadline - time.monotonic())
  raise MonitoredBarrierError(
      f"{title}: {len(missing)} of {world} processes did not arrive within "
      f"{waited:.1f} s: " + "; ".join(parts) + ". Fix: look at those processes' "
      "logs and stacks (py-spy dump --pid PID); if they are only slow, pass a "
      "longer timeout.", missing)
