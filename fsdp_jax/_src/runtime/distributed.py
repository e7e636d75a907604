"""The job of a multi-process run: :func:`initialize` / :func:`shutdown`, the
process-wide failure hooks (:func:`install_failure_hooks`) and
:func:`monitored_barrier`, with the job's state.

The public face, with the PyTorch correspondence and a full example, is
:mod:`fsdp_jax.distributed`; ``cluster``, ``watchdog`` and ``preemption`` hold
the rest of it.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable, Optional, Sequence

import jax

from fsdp_jax._src import _compat, mesh
from fsdp_jax._src.runtime.cluster import (BARRIER, DEFAULT_BARRIER_TIMEOUT, DEFAULT_INIT_TIMEOUT,
    DEFAULT_PEER_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT, DistributedInfo, HB,
    check_bind_address, cluster_env, cluster_local_rank, default_coordinator_bind_address,
    detect_platform, env_float, env_int, first_line, port_problem, seconds, split_host_port)
from fsdp_jax._src.runtime.coordination import (backends_started, describe_process, jax_client,
                                                publish_info)
from fsdp_jax._src.runtime.watchdog import Watchdog, is_communication_error


# The job this process belongs to. Process-wide because jax.distributed is:
# one coordination service client per process. Set by initialize(), cleared by
# shutdown().
_info: Optional[DistributedInfo] = None
_watchdog: Optional["Watchdog"] = None  # the peer watchdog initialize() started
# Teardown of what other runtime modules install (preemption's SIGTERM handler
# and agent thread), registered by them with register_teardown: name ->
# (called by shutdown(), called at interpreter exit before JAX's handler).
_teardowns: dict = {}
# monitored_barrier() calls so far: each call's keys in the coordination
# service are numbered, as every process calls the barriers in the same order.
_barrier_seq = [0]

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
  if jax_client() is not None:
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
    rank, world = env_int("RANK"), env_int("WORLD_SIZE")
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
  elif cluster_env() is not None or cluster_detection_method is not None:
    source = "cluster"
  if source in ("explicit", "env"):
    if world < 1 or not 0 <= rank < world:
      raise ValueError(
          f"Invalid process ranks: rank={rank}, world_size={world}; need "
          "world_size >= 1 and 0 <= rank < world_size.")

  if local_rank is None:
    local_rank = env_int("LOCAL_RANK")
  local_world = env_int("LOCAL_WORLD_SIZE")
  if source == "cluster" and local_rank is None:
    local_rank, local_world = cluster_local_rank()
  local_rank = 0 if local_rank is None else int(local_rank)
  local_world = local_world or 1  # unknown: as if alone on the machine
  node_rank = env_int("GROUP_RANK", env_int("SLURM_NODEID", 0))

  # -- devices, before JAX starts
  if devices_per_process is None:
    devices_per_process = env_int("FSDP_JAX_DEVICES_PER_PROC")
  if devices_per_process is not None and devices_per_process < 1:
    raise ValueError(f"devices_per_process={devices_per_process}: need at least 1.")
  if backends_started():
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
      mesh.simulate_cpu_devices(devices_per_process)
  elif devices_per_process is not None:
    local_device_ids = list(range(local_rank * devices_per_process,
                                  (local_rank + 1) * devices_per_process))
  elif local_world > 1 and source in ("explicit", "env"):
    local_device_ids = [local_rank]  # torchrun's convention: GPU LOCAL_RANK

  if peer_timeout is None:
    peer_timeout = env_float("FSDP_JAX_PEER_TIMEOUT", DEFAULT_PEER_TIMEOUT)
  if peer_timeout <= 0:
    raise ValueError(f"peer_timeout={peer_timeout}: need a positive number of seconds.")
  if initialization_timeout is None:
    initialization_timeout = env_int("FSDP_JAX_INIT_TIMEOUT", DEFAULT_INIT_TIMEOUT)

  # -- start jax.distributed
  if source == "cluster" or world > 1:
    kwargs = dict(initialization_timeout=int(initialization_timeout),
                  heartbeat_timeout_seconds=int(peer_timeout) + 20,
                  shutdown_timeout_seconds=env_int("FSDP_JAX_SHUTDOWN_TIMEOUT",
                                                    DEFAULT_SHUTDOWN_TIMEOUT))
    if source == "cluster":
      what = f"JAX's cluster detection ({cluster_detection_method or cluster_env()})"
      args = dict(cluster_detection_method=cluster_detection_method,
                  local_device_ids=local_device_ids)
    else:
      what = f"the coordinator at {address}"
      bind = coordinator_bind_address or default_coordinator_bind_address(address)
      if rank == 0:
        check_bind_address(bind, address, world, local_world)
      # "deactivate": the launcher's ranks win over a surrounding SLURM/MPI
      # job (whose variables would otherwise also pick the visible GPUs).
      args = dict(coordinator_address=address, num_processes=world, process_id=rank,
                  local_device_ids=local_device_ids,
                  cluster_detection_method="deactivate", coordinator_bind_address=bind)
    bind = args.get("coordinator_bind_address")

    def port_error(problem: str, jax_error: str = "") -> RuntimeError:
      port = split_host_port(bind)[1]
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
                         first_line(e)) from None
      raise RuntimeError(
          f"Fix: start all processes (python -m fsdp_jax.launch does), check that "
          f"process 0 can listen on {address} and the others can reach it, or raise "
          f"FSDP_JAX_INIT_TIMEOUT (now {initialization_timeout} s). "
          f"fsdp_jax.distributed.initialize(): process {rank} of {world} could not "
          f"join {what} (gave up after {waited:.0f} s): {first_line(e)}") from e
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
    publish_info(_info)
    if watchdog:
      _start_watchdog(_info, float(peer_timeout))
  return _info


def _adopt_jax_distributed(peer_timeout, watchdog) -> DistributedInfo:
  """``jax.distributed.initialize`` was called directly: take its set-up."""
  global _info
  state = _compat.distributed_state()
  local_rank = env_int("LOCAL_RANK", 0)
  _info = DistributedInfo(
      rank=state.process_id, world_size=state.num_processes, local_rank=local_rank,
      local_world_size=env_int("LOCAL_WORLD_SIZE", 1), node_rank=env_int("GROUP_RANK", 0),
      coordinator_address=state.coordinator_address,
      platform="cpu" if jax.default_backend() == "cpu" else "gpu",
      devices_per_process=None, source="jax")
  if _info.world_size > 1:
    publish_info(_info)
    if watchdog:
      if peer_timeout is None:
        peer_timeout = env_float("FSDP_JAX_PEER_TIMEOUT", DEFAULT_PEER_TIMEOUT)
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
  return jax.process_index() if jax_client() is not None else 0


def get_world_size() -> int:
  """Number of processes (PyTorch ``dist.get_world_size()``); 1 without set-up.

  Example (one process, no set-up):
    >>> from fsdp_jax import distributed
    >>> distributed.get_world_size()
    1
  """
  if _info is not None:
    return _info.world_size
  return jax.process_count() if jax_client() is not None else 1


def get_local_rank() -> int:
  """Index of this process on its machine (torchrun's ``LOCAL_RANK``).

  Example (one process, no set-up):
    >>> from fsdp_jax import distributed
    >>> distributed.get_local_rank()
    0
  """
  if _info is not None:
    return _info.local_rank
  return env_int("LOCAL_RANK", 0)


def shutdown() -> None:
  """Stops the watchdog and ``jax.distributed`` (PyTorch
  ``destroy_process_group``). Optional where :func:`install_failure_hooks`
  ran (every worker of ``python -m fsdp_jax.launch``): a process that exits
  normally then does it at exit.

  ``jax.distributed.shutdown`` waits at a barrier for every process to shut
  down (at most ``FSDP_JAX_SHUTDOWN_TIMEOUT`` seconds). Also puts back the
  SIGTERM handler that :func:`handle_preemption` replaced, if any.
  """
  global _info, _watchdog
  wd = _watchdog
  if wd is not None:
    wd.finish()
    wd.stop()
    if wd is not threading.current_thread():
      # Not inside an RPC of the coordination client when it is destroyed:
      # a daemon thread in native code at interpreter exit aborts the process.
      wd.join(timeout=2 * wd.interval + 5)
    _watchdog = None
  for on_shutdown, _ in list(_teardowns.values()):
    on_shutdown()
  if jax_client() is not None:
    jax.distributed.shutdown()
  _info = None


def register_teardown(name: str, *, on_shutdown: Callable[[], None],
                      on_exit: Callable[[], None]) -> None:
  """Registers what :func:`shutdown` and the exit handler of
  :func:`install_failure_hooks` call to tear down process-wide state another
  runtime module installed (e.g. :func:`fsdp_jax.distributed.handle_preemption`'s
  signal handler); registering a name again replaces its calls."""
  _teardowns[name] = (on_shutdown, on_exit)


def _start_watchdog(info: DistributedInfo, peer_timeout: float) -> None:
  global _watchdog
  _watchdog = Watchdog(info, peer_timeout)
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
    comm = is_communication_error(exc)
    wait = wd.peer_timeout + 4 * wd.interval if comm else 0.0
    cause = wd.wait_for_cause(wait, finished_peers=comm)
    if cause is not None:
      wd.die(cause, consequence=own, stack=False)
    wd.publish_failure(
        f"{describe_process(info.rank, info.world_size, wd.client)} failed: {own}")
    previous_hook(exc_type, exc, tb)

  sys.excepthook = excepthook
  atexit.register(_at_exit)


def _at_exit() -> None:
  """Runs before JAX's own exit handler (atexit is last-in, first-out; JAX
  registers its handler when jax is imported, before this module is)."""
  for _, on_exit in list(_teardowns.values()):
    on_exit()
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
  client = jax_client()
  if client is None:
    raise RuntimeError("monitored_barrier() needs jax.distributed: call "
                       "fsdp_jax.distributed.initialize() first.")
  timeout_s = DEFAULT_BARRIER_TIMEOUT if timeout is None else seconds(timeout)
  if timeout_s <= 0:
    raise ValueError(f"monitored_barrier timeout={timeout!r}: need a positive duration.")
  rank = get_rank()
  _barrier_seq[0] += 1
  seq = _barrier_seq[0]
  label = name if name is not None else ""
  title = f"monitored_barrier {label!r} (#{seq})" if label else f"monitored_barrier #{seq}"
  prefix = f"{BARRIER}{seq}/"
  client.key_value_set(f"{prefix}{rank}", label, allow_overwrite=True)
  beats_at_start = dict(client.key_value_dir_get(HB))
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
      beats = dict(client.key_value_dir_get(HB))
      dead_now = []
      for r in missing:
        key = f"{HB}{r}"
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
        client.key_value_delete(f"{BARRIER}{seq - 1}/{rank}")
      except Exception:
        pass
    return
  beats_at_end = dict(client.key_value_dir_get(HB))
  parts = []
  for r in missing:
    key = f"{HB}{r}"
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
