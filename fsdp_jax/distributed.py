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

from fsdp_jax._src import deprecations as _deprecations
from fsdp_jax._src.runtime.cluster import (
    DEFAULT_BARRIER_TIMEOUT as DEFAULT_BARRIER_TIMEOUT,
    DEFAULT_INIT_TIMEOUT as DEFAULT_INIT_TIMEOUT,
    DEFAULT_PEER_TIMEOUT as DEFAULT_PEER_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT as DEFAULT_SHUTDOWN_TIMEOUT,
    DistributedInfo as DistributedInfo,
    EXIT_PEER_LOST as EXIT_PEER_LOST,
    EXIT_RESTART as EXIT_RESTART,
    detect_platform as detect_platform,
)
from fsdp_jax._src.runtime.distributed import (
    MonitoredBarrierError as MonitoredBarrierError,
    get_local_rank as get_local_rank,
    get_rank as get_rank,
    get_world_size as get_world_size,
    info as info,
    initialize as initialize,
    install_failure_hooks as install_failure_hooks,
    is_initialized as is_initialized,
    monitored_barrier as monitored_barrier,
    shutdown as shutdown,
)
from fsdp_jax._src.runtime.preemption import (
    handle_preemption as handle_preemption,
    should_stop as should_stop,
)

__all__ = [
    "DEFAULT_BARRIER_TIMEOUT",
    "DEFAULT_INIT_TIMEOUT",
    "DEFAULT_PEER_TIMEOUT",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "DistributedInfo",
    "EXIT_PEER_LOST",
    "EXIT_RESTART",
    "MonitoredBarrierError",
    "detect_platform",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "handle_preemption",
    "info",
    "initialize",
    "install_failure_hooks",
    "is_initialized",
    "monitored_barrier",
    "should_stop",
    "shutdown",
]

# Helpers of the launcher and the watchdog, public until 0.1: they keep
# working with a DeprecationWarning.
_INTERNAL = "an internal helper of the launcher and the watchdog; it may change without notice."
__getattr__ = _deprecations.module_getattr(__name__, {
    name: ("fsdp_jax._src.runtime.cluster", _INTERNAL)
    for name in ("HEARTBEAT_INTERVAL", "default_coordinator_bind_address",
                 "describe_process", "gpu_count", "port_problem")})
