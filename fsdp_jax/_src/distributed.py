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
torchrun ``--max-restarts`` / elastic agent  ``python -m fsdp_jax.launch --max-restarts K``,
                                             :func:`handle_preemption`, :func:`should_stop`,
                                             :data:`EXIT_RESTART`
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

from fsdp_jax._src import _compat

# "Restart me": the job stopped in a state it can resume from the latest
# checkpoint (sysexits' EX_TEMPFAIL, "try again later"). A process exits with
# it after saving on preemption (should_stop), and when the watchdog stops it
# because another process was lost. ``python -m fsdp_jax.launch
# --max-restarts K`` restarts the workers; a cluster scheduler can requeue the
# job on it (Kubernetes podFailurePolicy onExitCodes, SLURM requeue).
EXIT_RESTART = 75
# The watchdog's exit status: another process was lost (the same "restart me").
EXIT_PEER_LOST = EXIT_RESTART

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
    coordinator_bind_address: ``ip:port`` where process 0's coordination
      service listens (see :func:`default_coordinator_bind_address`), or None when
      JAX chose (cluster detection: all interfaces) or for one process.
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
  coordinator_bind_address: Optional[str] = None

  @property
  def is_main_process(self) -> bool:
    """True on process 0 (the one that should write logs and files)."""
    return self.rank == 0


_info: Optional[DistributedInfo] = None
_watchdog: Optional["_Watchdog"] = None
_barrier_seq = [0]
_preemption: Optional["_Preemption"] = None  # set by handle_preemption()


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

  Example:
    >>> from fsdp_jax import distributed
    >>> distributed.gpu_count() >= 0
    True
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
  else whether ``nvidia-smi`` lists a GPU.

  Example:
    >>> from fsdp_jax import distributed
    >>> distributed.detect_platform() in ("cpu", "gpu")
    True
  """
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


def _split_host_port(address: str) -> tuple[str, int]:
  """``"host:port"`` / ``"[v6]:port"`` -> ``(host, port)``."""
  host, sep, port = address.rpartition(":")
  if not sep or not port.isdigit():
    raise ValueError(f"Fix: give the coordinator address as host:port, e.g. "
                     f"127.0.0.1:29500 or [::1]:29500: got {address!r}.")
  return host.strip("[]"), int(port)


def _join_host_port(host: str, port: int) -> str:
  return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _resolve(host: str) -> Optional[str]:
  """The address ``host`` resolves to on this machine (IPv4 first), or None."""
  try:
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
  except OSError:
    return None
  v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
  v6 = [i[4][0] for i in infos if i[0] == socket.AF_INET6]
  return (v4 or v6 or [None])[0]


def _first_line(e: BaseException, limit: int = 300) -> str:
  return ((str(e).strip().splitlines() or [type(e).__name__])[0])[:limit]


def _is_loopback(ip: str) -> bool:
  import ipaddress
  try:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback
  except ValueError:
    return False


def default_coordinator_bind_address(coordinator_address: str) -> str:
  """Where process 0's coordination service listens for ``coordinator_address``.

  JAX's default is every interface (``[::]:PORT``), so any host that can
  reach the machine can talk to the coordination service, which is
  unauthenticated gRPC. fsdp_jax listens only on the interface of the
  coordinator's host instead: ``127.0.0.1:PORT`` for a one-machine launch
  (the launcher's default ``--master-addr``), the address ``--master-addr``
  resolves to on several machines. ``JAX_COORDINATOR_BIND_ADDRESS``, if set,
  wins (e.g. ``0.0.0.0:PORT`` behind NAT, where the coordinator's public
  address is not one of the machine's own).

  Example:
    >>> from fsdp_jax.distributed import default_coordinator_bind_address
    >>> default_coordinator_bind_address("127.0.0.1:29500")
    '127.0.0.1:29500'
    >>> default_coordinator_bind_address("localhost:29500")
    '127.0.0.1:29500'
  """
  env = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "").strip()
  if env:
    return env
  host, port = _split_host_port(coordinator_address)
  ip = _resolve(host)
  return _join_host_port(ip if ip is not None else host, port)


def port_problem(bind_address: str) -> Optional[str]:
  """Why a TCP server could not listen on ``bind_address`` now
  (``"address already in use"``, ...), or None if it could.

  Binds a socket the way gRPC does (``SO_REUSEADDR``, so a port held only by
  closed connections in TIME_WAIT counts as free) and closes it at once.

  Example:
    >>> import socket
    >>> from fsdp_jax.distributed import port_problem
    >>> with socket.socket() as s:
    ...   s.bind(("127.0.0.1", 0)); s.listen()
    ...   busy = f"127.0.0.1:{s.getsockname()[1]}"
    ...   port_problem(busy)
    'address already in use'
  """
  host, port = _split_host_port(bind_address)
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      sock.bind((host, port))
  except OSError as e:
    return (e.strerror or str(e)).lower()
  return None


def _check_bind_address(bind: str, address: str, world: int, local_world: int) -> None:
  """Refuses a loopback bind address when other machines must connect."""
  host, _ = _split_host_port(address)
  bind_host, _ = _split_host_port(bind)
  if world > local_world and _is_loopback(bind_host) and not _is_loopback(host) \
      and "JAX_COORDINATOR_BIND_ADDRESS" not in os.environ:
    raise ValueError(
        f"Fix: give the coordinator this machine's network address (MASTER_ADDR / "
        f"--master-addr: its IP, e.g. from `hostname -I`), or set "
        f"JAX_COORDINATOR_BIND_ADDRESS=0.0.0.0:{_split_host_port(address)[1]} to listen "
        f"on every interface: the coordinator host {host!r} resolves to {bind_host} on "
        f"this machine, a loopback address, but {world - local_world} of the {world} "
        "processes run on other machines and could not reach it.")


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
               coordinator_bind_address: Optional[str] = None,
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
    coordinator_bind_address: ``ip:port`` where process 0's coordination
      service listens (cases 1 and 2). Default: ``JAX_COORDINATOR_BIND_ADDRESS``,
      else only the interface of the coordinator's host (see
      :func:`default_coordinator_bind_address`), not JAX's every interface. In case 3
      JAX decides (every interface unless ``JAX_COORDINATOR_BIND_ADDRESS``).
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
      from fsdp_jax._src.mesh import simulate_cpu_devices
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
      bind = coordinator_bind_address or default_coordinator_bind_address(address)
      if rank == 0:
        _check_bind_address(bind, address, world, local_world)
      # "deactivate": the launcher's ranks win over a surrounding SLURM/MPI
      # job (whose variables would otherwise also pick the visible GPUs).
      args = dict(coordinator_address=address, num_processes=world, process_id=rank,
                  local_device_ids=local_device_ids,
                  cluster_detection_method="deactivate", coordinator_bind_address=bind)
    bind = args.get("coordinator_bind_address")

    def port_error(problem: str, jax_error: str = "") -> RuntimeError:
      port = _split_host_port(bind)[1]
      return RuntimeError(
          f"Fix: choose another port (python -m fsdp_jax.launch --master-port P, or "
          f"leave --master-port out to get a free one; or MASTER_PORT / "
          f"JAX_COORDINATOR_ADDRESS), or stop the process that holds it (`ss -ltnp "
          f"'sport = :{port}'` names it). Process 0 could not start JAX's coordination "
          f"service on {bind}: {problem}" + (f" (JAX: {jax_error})." if jax_error else "."))

    if rank == 0 and bind:
      # Checked first: JAX 0.10 sometimes segfaults when its service cannot bind.
      problem = port_problem(bind)
      if problem:
        raise port_error(problem)
    started = time.monotonic()
    try:
      jax.distributed.initialize(**args, **kwargs)
    except Exception as e:
      waited = time.monotonic() - started
      problem = port_problem(bind) if rank == 0 and bind else None
      if rank == 0 and bind and ("rpc server" in str(e).lower() or problem):
        raise port_error(problem or "the port cannot be listened on",
                         _first_line(e)) from None
      raise RuntimeError(
          f"Fix: start all processes (python -m fsdp_jax.launch does), check that "
          f"process 0 can listen on {address} and the others can reach it, or raise "
          f"FSDP_JAX_INIT_TIMEOUT (now {initialization_timeout} s). "
          f"fsdp_jax.distributed.initialize(): process {rank} of {world} could not "
          f"join {what} (gave up after {waited:.0f} s): {_first_line(e)}") from e
    state = _compat.distributed_state()
    rank, world, address = state.process_id, state.num_processes, state.coordinator_address

  _info = DistributedInfo(rank=rank, world_size=world, local_rank=local_rank,
                          local_world_size=local_world, node_rank=node_rank,
                          coordinator_address=address if world > 1 else None,
                          platform=platform, devices_per_process=devices_per_process,
                          source=source,
                          coordinator_bind_address=(
                              args.get("coordinator_bind_address")
                              if world > 1 and source != "cluster" else None))
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
  """Whether :func:`initialize` has run in this process.

  Example:
    >>> from fsdp_jax import distributed
    >>> distributed.is_initialized()  # nothing set up in this process
    False
  """
  return _info is not None


def info() -> DistributedInfo:
  """The :class:`DistributedInfo` of :func:`initialize` (which must have run)."""
  if _info is None:
    raise RuntimeError("fsdp_jax.distributed.initialize() has not been called; "
                       "call it first thing in the script.")
  return _info


def get_rank() -> int:
  """This process's index (PyTorch ``dist.get_rank()``); 0 without set-up.

  Example (one process, no set-up):
    >>> from fsdp_jax import distributed
    >>> distributed.get_rank(), distributed.get_world_size(), distributed.get_local_rank()
    (0, 1, 0)
  """
  if _info is not None:
    return _info.rank
  return jax.process_index() if _jax_client() is not None else 0


def get_world_size() -> int:
  """Number of processes (PyTorch ``dist.get_world_size()``); 1 without set-up.

  Example (one process, no set-up):
    >>> from fsdp_jax import distributed
    >>> distributed.get_world_size()
    1
  """
  if _info is not None:
    return _info.world_size
  return jax.process_count() if _jax_client() is not None else 1


def get_local_rank() -> int:
  """Index of this process on its machine (torchrun's ``LOCAL_RANK``).

  Example (one process, no set-up):
    >>> from fsdp_jax import distributed
    >>> distributed.get_local_rank()
    0
  """
  if _info is not None:
    return _info.local_rank
  return _env_int("LOCAL_RANK", 0)


def shutdown() -> None:
  """Stops the watchdog and ``jax.distributed`` (PyTorch
  ``destroy_process_group``). Optional where :func:`install_failure_hooks`
  ran (every worker of ``python -m fsdp_jax.launch``): a process that exits
  normally then does it at exit.

  ``jax.distributed.shutdown`` waits at a barrier for every process to shut
  down (at most ``FSDP_JAX_SHUTDOWN_TIMEOUT`` seconds). Also puts back the
  SIGTERM handler that :func:`handle_preemption` replaced, if any.
  """
  global _info, _watchdog, _preemption
  wd = _watchdog
  if wd is not None:
    wd.finish()
    wd.stop()
    if wd is not threading.current_thread():
      # Not inside an RPC of the coordination client when it is destroyed:
      # a daemon thread in native code at interpreter exit aborts the process.
      wd.join(timeout=2 * wd.interval + 5)
    _watchdog = None
  if _preemption is not None:
    _preemption.uninstall()
    _preemption = None
  if _jax_client() is not None:
    jax.distributed.shutdown()
  _info = None


# --------------------------------------------------------------------------
# Preemption: stop at an agreed step, save, exit with EXIT_RESTART
#
# A SIGTERM handler (installed by handle_preemption) only records the signal.
# With several processes a background thread per process then publishes a
# notice in the coordination service; when a process's thread sees the
# notice it takes the process's lock (so should_stop cannot move on), writes
# the last step should_stop was given, waits until every process has written
# one, and sets the stop step to the largest plus one. should_stop returns
# True from the first call whose step reaches it: the same call on every
# process, as no process can have passed it (each was frozen at or below the
# largest step while the decision was made), and no main thread has to wait
# for another (a process blocked on a collective still gets its step
# published by its thread).
#
# This is the protocol of JAX's preemption sync manager
# (multihost_utils.reached_preemption_sync_point), run here because that one
# shares its step counter with orbax: orbax's CheckpointManager reports the
# step of every save to it, also from its finalize thread after the fact,
# which can move the counter back below the step the training loop is at and
# make the sync point one that is never reached. A SIGTERM handler installed
# here also replaces JAX's (which would otherwise only log the signal).

_PREEMPT = f"{_KV}/preempt/"
_PREEMPT_NOTICE = f"{_PREEMPT}notice"   # who got SIGTERM first
_PREEMPT_AT = f"{_PREEMPT}at/"          # at/<rank> = last step given to should_stop
_PREEMPT_STOP = f"{_PREEMPT}stop/"      # stop/<rank> = the step it stops after
_NO_STEP = "none"


class _Preemption:
  """What :func:`handle_preemption` set up for this process."""

  def __init__(self, multi: bool):
    self.multi = multi
    self.signalled = threading.Event()  # this process got SIGTERM
    self.lock = threading.Lock()
    self.last_step: Optional[int] = None  # the last step given to should_stop
    self.sync_step: Optional[float] = None  # stop at the first step >= this
    self.stop_step: Optional[int] = None
    self.notice: Optional[str] = None
    self.previous = None
    self.installed = False
    self.agent: Optional[_PreemptionAgent] = None

  def install(self) -> None:
    import signal

    def on_sigterm(signum, frame):  # records it: the training loop decides
      self.signalled.set()
      if self.agent is not None:
        self.agent.publish()  # at once: the agent may be waiting in an RPC

    self.previous = signal.signal(signal.SIGTERM, on_sigterm)
    self.installed = True

  def uninstall(self) -> None:
    if self.agent is not None:
      self.agent.stop()
      self.agent = None
    if not self.installed:
      return
    import signal
    try:
      signal.signal(signal.SIGTERM, self.previous if self.previous is not None
                    else signal.SIG_DFL)
    except ValueError:  # pragma: no cover - not the main thread
      return
    self.installed = False


class _PreemptionAgent(threading.Thread):
  """Publishes this process's SIGTERM and runs the agreement on the stop
  step (see the comment above)."""

  POLL_MS = 500

  def __init__(self, p: _Preemption, rank: int, world: int, timeout: float):
    super().__init__(name="fsdp_jax-preemption", daemon=True)
    self.p, self.rank, self.world, self.timeout = p, rank, world, timeout
    self.client = _jax_client()
    self._stop_event = threading.Event()
    self._published = False

  def stop(self) -> None:
    self._stop_event.set()
    if self is not threading.current_thread():
      self.join(timeout=self.POLL_MS / 1000 + 5)

  def publish(self) -> bool:
    """Tells every process that this one got SIGTERM; whether it could."""
    if self._published:
      return True
    try:
      self.client.key_value_set(_PREEMPT_NOTICE, f"process {self.rank}",
                                allow_overwrite=True)
    except Exception:  # the service is gone; the watchdog deals with that
      return False
    self._published = True
    return True

  def run(self) -> None:
    while not self._stop_event.is_set():
      started = time.monotonic()
      if self.p.signalled.is_set():
        self.publish()  # if the signal handler could not
      try:
        # Returns as soon as any process publishes a notice (ours included).
        notice = self.client.blocking_key_value_get(_PREEMPT_NOTICE, self.POLL_MS)
      except Exception:  # no notice yet (timeout), or the service is gone
        left = self.POLL_MS / 1000 - (time.monotonic() - started)
        self._stop_event.wait(max(0.05, left))
        continue
      self._agree(notice)
      return

  def _agree(self, notice: str) -> None:
    p = self.p
    with p.lock:  # should_stop waits: the last step stays put meanwhile
      mine = _NO_STEP if p.last_step is None else str(p.last_step)
      try:
        self.client.key_value_set(f"{_PREEMPT_AT}{self.rank}", mine, allow_overwrite=True)
        steps = [self.client.blocking_key_value_get(f"{_PREEMPT_AT}{r}",
                                                    int(self.timeout * 1000))
                 for r in range(self.world)]
      except Exception as e:
        _warn(f"SIGTERM ({notice}): could not agree with the other processes on the "
              f"step to stop after ({_first_line(e)}); this process keeps training.")
        return
      known = [int(v) for v in steps if v != _NO_STEP]
      p.notice = notice
      p.sync_step = max(known) + 1 if known else float("-inf")


def _warn(text: str) -> None:
  try:
    sys.stderr.write(f"fsdp_jax.distributed: {text}\n")
    sys.stderr.flush()
  except Exception:
    pass


def handle_preemption(*, timeout: float = 120.0) -> None:
  """Makes SIGTERM (preemption) stop training at a step all processes agree
  on, instead of killing the job: see :func:`should_stop`.

  Call it once, from the main thread, after :func:`initialize` and before
  the training loop. It is an explicit call because it changes what SIGTERM
  does to the whole process: it installs a SIGTERM handler that only records
  the signal (:func:`shutdown` puts the previous one back). With several
  processes it also starts a thread that tells the others through JAX's
  coordination service and agrees with them on the step to stop after.

  A SIGTERM may reach any one process (a scheduler preempting a node, ``kill
  PID``) or all of them (``python -m fsdp_jax.launch`` forwards the SIGTERM
  it gets; SLURM signals every task).

  Args:
    timeout: seconds to wait for every process to report its step once a
      SIGTERM arrived (a process that does not is dead, and the watchdog
      stops the job).

  Raises:
    RuntimeError: called off the main thread, or before :func:`initialize`
      in a multi-process job.

  Example::

      from fsdp_jax import distributed
      distributed.initialize()
      distributed.handle_preemption()
      ...   # the loop calls distributed.should_stop(step) after every step
  """
  global _preemption
  if _preemption is not None:
    return
  if threading.current_thread() is not threading.main_thread():
    raise RuntimeError("Fix: call fsdp_jax.distributed.handle_preemption() from the "
                       "main thread: signal handlers can only be installed there.")
  multi = _jax_client() is not None and get_world_size() > 1
  if not multi and _info is None and (_env_int("WORLD_SIZE", 1) or 1) > 1:
    raise RuntimeError(
        "Fix: call fsdp_jax.distributed.initialize() before handle_preemption(): "
        f"this process is one of WORLD_SIZE={os.environ.get('WORLD_SIZE')} but has "
        "not joined the others yet.")
  p = _Preemption(multi=multi)
  p.install()
  if multi:
    p.agent = _PreemptionAgent(p, get_rank(), get_world_size(), float(timeout))
    p.agent.start()  # stopped by shutdown(), or at exit by install_failure_hooks()'s handler
  _preemption = p


def _stop_preemption_agent() -> None:
  """At exit: the agent thread must not be inside an RPC at teardown."""
  p = _preemption
  if p is not None and p.agent is not None:
    p.agent.stop()
    p.agent = None


def should_stop(step: int, *, timeout: float = 120.0) -> bool:
  """Whether to save and exit after ``step``: True on every process at the
  same step once a SIGTERM reached any of them (or the launcher).

  Call it on every process after every train step, with the step just
  finished (e.g. ``int(state.step)``), after :func:`handle_preemption`. It
  costs a lock until a SIGTERM arrives; then the processes agree on the
  first step that none of them has passed, and from that step on it returns
  True. Save with :class:`~fsdp_jax.CheckpointManager`
  (``force=True``), wait for the save, and exit with :data:`EXIT_RESTART`::

      distributed.handle_preemption()
      for step in range(start + 1, total + 1):
        state, metrics = train_step(state, next_batch())
        stop = distributed.should_stop(step)
        if step % save_every == 0 or stop:
          manager.save(state, force=stop, data_state={"position": position})
        if stop:
          manager.wait_until_finished()
          sys.exit(distributed.EXIT_RESTART)   # 75: "restart me"

  Every process must call it with the same steps, in increasing order (once
  per step, or at the same subset of steps everywhere).

  Args:
    step: the step just finished; must increase from call to call.
    timeout: seconds to wait, once stopping, for the other processes to
      report the step they stop after (a check that they passed the same
      steps).

  Returns:
    True from the agreed step on; False before, and always without a SIGTERM.

  Raises:
    RuntimeError: :func:`handle_preemption` was not called; or the processes
      stopped after different steps (they passed different ``step`` values).
    ValueError: ``step`` did not increase.
  """
  p = _preemption
  if p is None:
    raise RuntimeError(
        "Fix: call fsdp_jax.distributed.handle_preemption() once before the training "
        "loop: should_stop() needs it to learn of a SIGTERM.")
  step = int(step)
  with p.lock:
    if p.stop_step is not None:
      return True
    if p.last_step is not None and step <= p.last_step:
      raise ValueError(
          f"Fix: pass should_stop the step just finished, increasing from call to call "
          f"(e.g. int(state.step)): got step {step} after step {p.last_step}.")
    p.last_step = step
    if p.multi:
      hit = p.sync_step is not None and step >= p.sync_step
    else:
      hit = p.signalled.is_set()
    if not hit:
      return False
    p.stop_step = step
  world = get_world_size()
  if p.multi:
    _agree_on_stop_step(step, timeout)
  who = f" ({p.notice} got it first)" if p.notice else ""
  _warn(f"SIGTERM (preemption){who}: process {get_rank()} of {world} stops after step "
        f"{step}" + (", like every other process" if world > 1 else "")
        + f"; save a checkpoint and exit with status {EXIT_RESTART} (restart me).")
  return True


def _agree_on_stop_step(step: int, timeout: float) -> None:
  """Checks that every process stops after the same step."""
  client = _jax_client()
  rank, world = get_rank(), get_world_size()
  client.key_value_set(f"{_PREEMPT_STOP}{rank}", str(step), allow_overwrite=True)
  steps = {}
  for r in range(world):
    try:
      steps[r] = int(client.blocking_key_value_get(f"{_PREEMPT_STOP}{r}", int(timeout * 1000)))
    except Exception as e:
      raise RuntimeError(
          f"Fix: look at process {r}'s log; every process must call should_stop() with "
          f"the same steps. Process {rank} stops after step {step} on SIGTERM but "
          f"process {r} did not report its step within {timeout:g} s "
          f"({_first_line(e)}).") from None
  if len(set(steps.values())) > 1:
    detail = ", ".join(f"process {r} after step {v}" for r, v in sorted(steps.items()))
    raise RuntimeError(
        "Fix: pass should_stop() the same steps on every process (e.g. "
        f"int(state.step)): on SIGTERM they stopped at different steps: {detail}.")


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


# Whether install_failure_hooks() ran in this process: the hooks are
# process-wide by nature (sys.excepthook, atexit), so this flag is too.
_failure_hooks_installed = False


def install_failure_hooks() -> None:
  """Installs the two process-wide hooks that make a failing worker stop the
  whole job promptly and name the cause.

  * ``sys.excepthook``: an uncaught exception in a process that called
    :func:`initialize` is published to the other processes (which then stop
    with an error naming this process and the exception), after waiting
    briefly for the watchdog when the exception is a collective's failure
    caused by a lost peer.
  * ``atexit``: at exit, shuts :func:`initialize`'s state down in order
    (a failed process leaves at once instead of waiting at JAX's shutdown
    barrier for peers that have stopped).

  ``python -m fsdp_jax.launch`` calls this in every worker before running the
  script, so a launched script does not. A script started another way (for
  example ``srun python train.py``) calls it once, first thing, to get the
  same behaviour; without it, a lost process is still detected by the
  watchdog, only less promptly and with a less precise message. Importing
  fsdp_jax or calling :func:`initialize` installs nothing. Calling it again
  does nothing.

  Example::

      from fsdp_jax import distributed
      distributed.install_failure_hooks()
      info = distributed.initialize()
  """
  global _failure_hooks_installed
  if _failure_hooks_installed:
    return
  _failure_hooks_installed = True
  previous_hook = sys.excepthook

  def excepthook(exc_type, exc, tb):
    wd = _watchdog
    if wd is None or issubclass(exc_type, KeyboardInterrupt):
      previous_hook(exc_type, exc, tb)
      return
    info = wd.info
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
  """Runs before JAX's own exit handler (atexit is last-in, first-out; JAX
  registers its handler when jax is imported, before this module is)."""
  _stop_preemption_agent()
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
  # A normal exit: shut down in order while the interpreter is whole. Left
  # to interpreter teardown, the watchdog thread (or JAX's own threads) could
  # be inside the coordination client as it is destroyed, which aborted about
  # one exit in two ("terminate called after throwing an instance of ...").
  try:
    shutdown()
  except Exception as e:  # pragma: no cover - best effort at exit
    try:
      sys.stderr.write(f"fsdp_jax.distributed: shutdown at exit failed: {e}\n")
    except Exception:
      pass


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
