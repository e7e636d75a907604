"""What a multi-process job is made of, with no state: exit statuses and
defaults, :class:`DistributedInfo`, reading the launcher's and the cluster's
environment, coordinator addresses and ports. It imports no JAX: the launcher
(``python -m fsdp_jax.launch``) reads it before any worker starts.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
import socket
import subprocess
from typing import Optional


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

KV = "fsdp_jax"
HB = f"{KV}/hb/"          # fsdp_jax/hb/<rank> = counter
INFO = f"{KV}/info/"        # fsdp_jax/info/<rank> = json(host, pid, ...)
DONE = f"{KV}/done/"      # fsdp_jax/done/<rank> = "finished"
ABORT = f"{KV}/abort/"    # fsdp_jax/abort/first = the first failure, as a message
BARRIER = f"{KV}/barrier/"


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



# --------------------------------------------------------------------------
# Helpers


def env_int(name: str, default=None):
  value = os.environ.get(name)
  if value is None or value == "":
    return default
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"Environment variable {name}={value!r} is not an integer. "
                     f"Fix: set {name} to a whole number or unset it.") from None


def env_float(name: str, default=None):
  value = os.environ.get(name)
  if value is None or value == "":
    return default
  try:
    return float(value)
  except ValueError:
    raise ValueError(f"Environment variable {name}={value!r} is not a number. "
                     f"Fix: set {name} to a number of seconds or unset it.") from None


def seconds(timeout) -> float:
  if isinstance(timeout, datetime.timedelta):
    return timeout.total_seconds()
  return float(timeout)


def gpu_count() -> int:
  """Number of GPUs ``nvidia-smi -L`` lists (0 without ``nvidia-smi``).

  Never touches JAX, so it is safe to call before :func:`initialize`.

  Example:
    >>> from fsdp_jax._src.runtime import cluster
    >>> cluster.gpu_count() >= 0
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


def cluster_env() -> Optional[str]:
  """The cluster JAX can detect by itself with more than one task, if any."""
  if all(v in os.environ for v in ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS",
                                   "SLURM_PROCID", "SLURM_LOCALID")):
    if env_int("SLURM_NTASKS", 1) > 1:
      return "slurm"
  if "OMPI_MCA_orte_hnp_uri" in os.environ and env_int("OMPI_COMM_WORLD_SIZE", 1) > 1:
    return "ompi"
  return None


def cluster_local_rank():
  for rank_var, size_var in (("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
                             ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")):
    if rank_var in os.environ:
      size = os.environ.get(size_var, "1").split("(")[0].split(",")[0]
      try:
        return int(os.environ[rank_var]), int(size)
      except ValueError:
        return int(os.environ[rank_var]), 1
  return 0, 1


def split_host_port(address: str) -> tuple[str, int]:
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


def first_line(e: BaseException, limit: int = 300) -> str:
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
    >>> from fsdp_jax._src.runtime.cluster import default_coordinator_bind_address
    >>> default_coordinator_bind_address("127.0.0.1:29500")
    '127.0.0.1:29500'
    >>> default_coordinator_bind_address("localhost:29500")
    '127.0.0.1:29500'
  """
  env = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "").strip()
  if env:
    return env
  host, port = split_host_port(coordinator_address)
  ip = _resolve(host)
  return _join_host_port(ip if ip is not None else host, port)


def port_problem(bind_address: str) -> Optional[str]:
  """Why a TCP server could not listen on ``bind_address`` now
  (``"address already in use"``, ...), or None if it could.

  Binds a socket the way gRPC does (``SO_REUSEADDR``, so a port held only by
  closed connections in TIME_WAIT counts as free) and closes it at once.

  Example:
    >>> import socket
    >>> from fsdp_jax._src.runtime.cluster import port_problem
    >>> with socket.socket() as s:
    ...   s.bind(("127.0.0.1", 0)); s.listen()
    ...   busy = f"127.0.0.1:{s.getsockname()[1]}"
    ...   port_problem(busy)
    'address already in use'
  """
  host, port = split_host_port(bind_address)
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  try:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      sock.bind((host, port))
  except OSError as e:
    return (e.strerror or str(e)).lower()
  return None


def check_bind_address(bind: str, address: str, world: int, local_world: int) -> None:
  """Refuses a loopback bind address when other machines must connect."""
  host, _ = split_host_port(address)
  bind_host, _ = split_host_port(bind)
  if world > local_world and _is_loopback(bind_host) and not _is_loopback(host) \
      and "JAX_COORDINATOR_BIND_ADDRESS" not in os.environ:
    raise ValueError(
        f"Fix: give the coordinator this machine's network address (MASTER_ADDR / "
        f"--master-addr: its IP, e.g. from `hostname -I`), or set "
        f"JAX_COORDINATOR_BIND_ADDRESS=0.0.0.0:{split_host_port(address)[1]} to listen "
        f"on every interface: the coordinator host {host!r} resolves to {bind_host} on "
        f"this machine, a loopback address, but {world - local_world} of the {world} "
        "processes run on other machines and could not reach it.")
