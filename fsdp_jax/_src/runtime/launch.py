"""``python -m fsdp_jax.launch``: start N processes of a training script, like
``torchrun``.

Usage::

    python -m fsdp_jax.launch --nproc 2 --devices-per-proc 4 train.py --lr 1e-3

starts ``train.py --lr 1e-3`` twice with ``RANK``/``WORLD_SIZE``/
``LOCAL_RANK``/... and ``JAX_COORDINATOR_ADDRESS`` (a free loopback port) in
the environment; the script calls :func:`fsdp_jax.distributed.initialize`
first thing, which reads them, starts ``jax.distributed`` and, without a GPU,
gives each process 4 simulated CPU devices with gloo CPU collectives.

Like torchrun, the launcher waits for all workers; when one fails it stops
the others (SIGTERM, then SIGKILL after ``--kill-grace`` seconds), prints
which worker failed first and how, and exits with that worker's status
(``128 + signal`` for a signal). It exits 0 only when every worker did.
Workers die with the launcher (Linux ``PR_SET_PDEATHSIG``), so none is ever
orphaned.

Fault tolerance:

* ``--max-restarts K`` (torchrun's name and meaning): after a worker fails,
  all workers are stopped and started again, up to K times. Each start gets
  ``FSDP_JAX_RESTART_COUNT`` (0, 1, ...) and a fresh coordinator port (unless
  ``--master-port`` fixes it); the script resumes from its latest finished
  checkpoint.
* Preemption: a SIGTERM to the launcher is forwarded to every worker, which
  then get ``--term-timeout`` seconds to finish the step, save and exit (see
  :func:`fsdp_jax.distributed.should_stop`) before SIGKILL. The launcher does
  not restart them (its machine is going away) and exits with
  :data:`fsdp_jax.distributed.EXIT_RESTART` (75, "restart me") when they all
  saved and exited so, for the scheduler to restart the job. A SIGTERM to one
  worker stops all of them the same way; their exit status 75 is a failure
  the launcher restarts (``--max-restarts``) or passes on.
* SIGINT (Ctrl-C) and SIGHUP are forwarded with ``--kill-grace``; a second
  signal kills the workers at once.

Output: what the workers print comes through the launcher's stdout and
stderr as it happens (the workers run with ``PYTHONUNBUFFERED=1``), less
gloo's connection messages (``[Gloo] Rank N is connected to M peer ranks
...``, a line per process and collective group of a CPU run). ``--verbose``
shows those too; when a worker fails, its whole output, those lines
included, is shown again after it. ``--log-dir`` writes each worker's
complete output to its own file instead.

Several machines (static rendezvous, like ``torch.distributed.launch``): on
each machine ``--nnodes K --node-rank i --master-addr HOST0 --master-port
PORT``; ranks are ``node_rank * nproc + local_rank``. Under SLURM you may
skip the launcher: ``srun python train.py`` works because JAX reads SLURM's
variables itself (see ``examples/slurm_job.sh``).

The launcher never imports JAX, so it starts at once and does not take GPU
memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

from fsdp_jax._src.runtime import cluster, output

__all__ = ["WorkerGroup", "WorkerResult", "free_port", "main", "worker_env"]


def free_port(host: str = "127.0.0.1") -> int:
  """A TCP port that is free on ``host`` right now (the OS picks it).

  Example:
    >>> 0 < free_port() < 65536
    True
  """
  family = socket.AF_INET6 if ":" in host else socket.AF_INET
  with socket.socket(family, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s.getsockname()[1]


def worker_env(*, rank: int, world_size: int, local_rank: int, local_world_size: int,
               master_addr: str, master_port: int, node_rank: int = 0,
               devices_per_proc: Optional[int] = None, platform: Optional[str] = None,
               peer_timeout: Optional[float] = None,
               restart_count: int = 0, max_restarts: Optional[int] = None,
               base: Optional[dict] = None) -> dict:
  """The environment of one worker (what ``fsdp_jax.distributed.initialize``
  reads).

  torchrun's names (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), JAX's
  ``JAX_COORDINATOR_ADDRESS``, and fsdp_jax's ``FSDP_JAX_DEVICES_PER_PROC``,
  ``FSDP_JAX_PLATFORM``, ``FSDP_JAX_PEER_TIMEOUT``, ``FSDP_JAX_LAUNCHED=1``,
  ``FSDP_JAX_RESTART_COUNT`` (torchrun's ``TORCHELASTIC_RESTART_COUNT``) and
  ``FSDP_JAX_MAX_RESTARTS``, on top of ``base`` (default ``os.environ``).
  ``PYTHONUNBUFFERED=1`` unless set, so output is not lost when a worker is
  stopped.

  Example:
    >>> env = worker_env(rank=1, world_size=2, local_rank=1, local_world_size=2,
    ...                  master_addr="127.0.0.1", master_port=29500, base={})
    >>> env["RANK"], env["JAX_COORDINATOR_ADDRESS"]
    ('1', '127.0.0.1:29500')
  """
  env = dict(os.environ if base is None else base)
  host = f"[{master_addr}]" if ":" in master_addr and not master_addr.startswith("[") else master_addr
  env.update({
      "RANK": str(rank), "WORLD_SIZE": str(world_size),
      "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world_size),
      "GROUP_RANK": str(node_rank), "NODE_RANK": str(node_rank),
      "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
      "JAX_COORDINATOR_ADDRESS": f"{host}:{master_port}",
      "FSDP_JAX_LAUNCHED": "1",
      "FSDP_JAX_RESTART_COUNT": str(restart_count),
  })
  if max_restarts is not None:
    env["FSDP_JAX_MAX_RESTARTS"] = str(max_restarts)
  env.setdefault("PYTHONUNBUFFERED", "1")
  if devices_per_proc is not None:
    env["FSDP_JAX_DEVICES_PER_PROC"] = str(devices_per_proc)
  if platform is not None:
    env["FSDP_JAX_PLATFORM"] = platform
  if peer_timeout is not None:
    env["FSDP_JAX_PEER_TIMEOUT"] = f"{peer_timeout:g}"
  return env


def _load_prctl():
  try:
    import ctypes
    return ctypes.CDLL(None, use_errno=True).prctl
  except Exception:  # pragma: no cover - not Linux / no libc
    return None


_PRCTL = _load_prctl() if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
  """Child side of Popen (between fork and exec): ask the kernel to SIGKILL
  this worker when the launcher dies (Linux ``PR_SET_PDEATHSIG``)."""
  if _PRCTL is not None:
    _PRCTL(1, signal.SIGKILL, 0, 0, 0)


def describe_status(code: Optional[int]) -> str:
  """``"exit code 3"`` / ``"killed by signal SIGKILL (9)"`` for a Popen
  returncode."""
  if code is None:
    return "still running"
  if code < 0:
    try:
      name = signal.Signals(-code).name
    except ValueError:
      name = f"signal {-code}"
    return f"killed by signal {name} ({-code})"
  return f"exit code {code}"


def exit_status(code: int) -> int:
  """A Popen returncode as a shell exit status (``128 + signal``)."""
  return 128 - code if code < 0 else code


@dataclasses.dataclass
class WorkerResult:
  """How one worker ended.

  Example:
    >>> from fsdp_jax.launch import WorkerResult
    >>> WorkerResult(rank=1, local_rank=1, pid=1234, returncode=-9).describe()
    'worker RANK=1 (LOCAL_RANK=1, pid 1234): killed by signal SIGKILL (9)'
  """

  rank: int
  local_rank: int
  pid: int
  returncode: Optional[int]
  stopped: bool = False  # stopped by the group after another worker failed
  ended_at: Optional[float] = None  # time.time() when its exit was seen

  def describe(self) -> str:
    return (f"worker RANK={self.rank} (LOCAL_RANK={self.local_rank}, pid {self.pid}): "
            f"{describe_status(self.returncode)}")


class WorkerGroup:
  """Local worker processes, started together and stopped together.

  The launcher's engine, also usable from Python (tests use it to start
  workers without the launcher's stop-the-others policy).

  Args:
    cmd: the command of every worker, e.g. ``[sys.executable, "train.py"]``.
    envs: one environment per worker (see :func:`worker_env`).
    ranks: the global rank of each worker (for messages).
    log_dir: write each worker's stdout and stderr to
      ``log_dir/rank<R>.log`` instead of inheriting the launcher's.
    stdout, stderr: passed to ``subprocess.Popen`` when ``log_dir`` is None.
    cwd: the workers' working directory.
    die_with_parent: have the kernel SIGKILL each worker when this process
      dies (Linux ``PR_SET_PDEATHSIG``; set in the forked child before
      ``exec``). Leave it off when calling from a multi-threaded process
      such as one running JAX, where running Python code between fork and
      exec is unsafe; then rely on :meth:`wait`'s timeout and :meth:`stop`.
    log_header: with ``log_dir``, append to the log files (after this line)
      instead of starting them afresh (the launcher's restarts).
    hide_output: without ``log_dir``, ``stdout`` and ``stderr``, read the
      workers' output through pipes and forward it to this process's
      ``sys.stdout`` / ``sys.stderr`` as it comes, less the lines that start
      with one of these byte strings (the launcher hides gloo's ``[Gloo]``
      connection messages), and the rest of a message such a line cut
      when two threads wrote at once; :meth:`hidden_lines` counts them and
      :meth:`output` gives a worker's whole output. The workers then run
      with ``PYTHONUNBUFFERED=1`` (unless set), so that their prints still
      come as they happen.

  Example:
    >>> import sys
    >>> from fsdp_jax.launch import WorkerGroup, worker_env
    >>> envs = [worker_env(rank=r, world_size=2, local_rank=r, local_world_size=2,
    ...                    master_addr="127.0.0.1", master_port=1) for r in (0, 1)]
    >>> group = WorkerGroup([sys.executable, "-c", "pass"], envs,
    ...                     die_with_parent=False).start()
    >>> [r.returncode for r in group.wait(timeout=60)]
    [0, 0]
  """

  def __init__(self, cmd: Sequence[str], envs: Sequence[dict],
               ranks: Optional[Sequence[int]] = None, *, log_dir: Optional[str] = None,
               stdout=None, stderr=None, cwd: Optional[str] = None,
               die_with_parent: bool = True, log_header: Optional[str] = None,
               hide_output: Sequence[bytes] = ()):
    self.cmd = list(cmd)
    self.log_header = log_header
    self.envs = list(envs)
    self.ranks = list(ranks) if ranks is not None else [int(e.get("RANK", i)) for i, e in enumerate(envs)]
    self.log_dir = log_dir
    self.stdout, self.stderr, self.cwd = stdout, stderr, cwd
    self.die_with_parent = die_with_parent and sys.platform.startswith("linux")
    self.procs: list[subprocess.Popen] = []
    self._files = []
    self.first_failure: Optional[WorkerResult] = None
    self._stopped: set[int] = set()
    self.interrupt_signal = signal.SIGTERM  # what wait() sends if interrupted
    self._ended: dict[int, float] = {}
    self.hide_output = tuple(hide_output)
    self._forwarder: Optional[output.OutputForwarder] = None

  def start(self) -> "WorkerGroup":
    if self.hide_output and self.log_dir is None and self.stdout is None \
        and self.stderr is None:
      self._forwarder = output.OutputForwarder(self.hide_output, sys.stdout, sys.stderr)
    for local, env in enumerate(self.envs):
      stdout, stderr = self.stdout, self.stderr
      if self._forwarder is not None:
        stdout = stderr = subprocess.PIPE
        env = dict(os.environ if env is None else env)
        env.setdefault("PYTHONUNBUFFERED", "1")
      if self.log_dir is not None:
        os.makedirs(self.log_dir, exist_ok=True)
        f = open(os.path.join(self.log_dir, f"rank{self.ranks[local]}.log"),
                 "wb" if self.log_header is None else "ab")
        if self.log_header is not None:
          f.write(f"\n{self.log_header}\n".encode())
          f.flush()
        self._files.append(f)
        stdout, stderr = f, subprocess.STDOUT
      self.procs.append(subprocess.Popen(
          self.cmd, env=env, cwd=self.cwd, stdout=stdout, stderr=stderr,
          start_new_session=True,
          preexec_fn=_die_with_parent if self.die_with_parent else None))
      if self._forwarder is not None:
        self._forwarder.add(self.procs[-1])
    if self._forwarder is not None:
      self._forwarder.start()
    return self

  def hidden_lines(self, local_rank: int) -> int:
    """How many lines of worker ``local_rank``'s output ``hide_output`` held
    back (so far)."""
    return self._forwarder.hidden(local_rank) if self._forwarder is not None else 0

  def output(self, local_rank: int) -> tuple[bytes, int]:
    """With ``hide_output``: ``(worker local_rank's whole output, hidden lines
    included, or its last MiB from a line start; its size in bytes)``."""
    if self._forwarder is None:
      raise ValueError("WorkerGroup.output() needs hide_output= (and no log_dir, stdout "
                       "or stderr): only then does the group read the workers' output.")
    self._forwarder.join()
    return self._forwarder.output(local_rank)

  def results(self) -> list[WorkerResult]:
    out = []
    for i, p in enumerate(self.procs):
      code = p.poll()
      if code is not None and i not in self._ended:
        self._ended[i] = time.time()
      out.append(WorkerResult(self.ranks[i], i, p.pid, code, i in self._stopped,
                              self._ended.get(i)))
    return out

  def poll(self) -> Optional[WorkerResult]:
    """Returns the first worker seen failing (non-zero status), if any."""
    if self.first_failure is None:
      for r in self.results():
        if r.returncode not in (None, 0) and not r.stopped:
          self.first_failure = r
          break
    return self.first_failure

  def running(self) -> bool:
    return any(r.returncode is None for r in self.results())

  def signal_all(self, sig: int) -> None:
    for i, p in enumerate(self.procs):
      if p.poll() is None:
        self._stopped.add(i)
        try:
          os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
          try:
            p.send_signal(sig)
          except ProcessLookupError:
            pass

  def stop(self, grace: float = 5.0, sig: int = signal.SIGTERM) -> None:
    """Sends ``sig`` to the running workers (and their children), then
    SIGKILL to whatever still runs after ``grace`` seconds."""
    self.signal_all(sig)
    deadline = time.monotonic() + grace
    while self.running() and time.monotonic() < deadline:
      time.sleep(0.05)
    if self.running():
      self.signal_all(signal.SIGKILL)
    for p in self.procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:  # pragma: no cover
        pass
    for i, p in enumerate(self.procs):  # reap leftover children of the workers
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    self.close()

  def close(self) -> None:
    """Closes the log files; with ``hide_output``, waits (up to 10 s) until
    everything the workers printed is forwarded."""
    for f in self._files:
      f.close()
    self._files = []
    if self._forwarder is not None and not self.running():
      self._forwarder.join()

  def wait(self, timeout: Optional[float] = None, *, stop_on_failure: bool = True,
           grace: float = 5.0) -> list[WorkerResult]:
    """Waits for all workers. With ``stop_on_failure`` the others are stopped
    as soon as one fails. After ``timeout`` seconds all are stopped (the
    results then show who was still running). Always leaves no worker
    running."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
      while self.running():
        if stop_on_failure and self.poll() is not None:
          self.stop(grace)
          break
        if deadline is not None and time.monotonic() > deadline:
          results = self.results()
          self.stop(grace)
          return [dataclasses.replace(r, stopped=r.returncode is None) if r.returncode is None
                  else r for r in results]
        time.sleep(0.05)
    finally:
      if self.running():  # an exception (e.g. KeyboardInterrupt) got here
        self.stop(grace, sig=self.interrupt_signal)
      self.close()
    self.poll()
    return self.results()


# --------------------------------------------------------------------------
# The command line


class _Parser(argparse.ArgumentParser):

  def error(self, message):  # clearer than argparse's default one-liner
    self.print_usage(sys.stderr)
    self.exit(2, f"{self.prog}: error: {message}\n(run with --help for all options)\n")


def _positive_int(name):
  def parse(text):
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be a whole number, got {text!r}") from None
    if value < 1:
      raise argparse.ArgumentTypeError(f"{name} must be at least 1, got {value}")
    return value
  return parse


def _non_negative_int(name):
  def parse(text):
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be a whole number, got {text!r}") from None
    if value < 0:
      raise argparse.ArgumentTypeError(f"{name} must be 0 or more, got {value}")
    return value
  return parse


def _positive_float(name):
  def parse(text):
    try:
      value = float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{name} must be a number of seconds, got {text!r}") from None
    if value <= 0:
      raise argparse.ArgumentTypeError(f"{name} must be positive, got {value:g}")
    return value
  return parse


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(
      prog="python -m fsdp_jax.launch",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description=(
          "Start N local processes of a JAX training script, like torchrun.\n\n"
          "Each worker gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,\n"
          "GROUP_RANK, MASTER_ADDR, MASTER_PORT (torchrun's names),\n"
          "JAX_COORDINATOR_ADDRESS, FSDP_JAX_DEVICES_PER_PROC, FSDP_JAX_PLATFORM,\n"
          "FSDP_JAX_PEER_TIMEOUT and FSDP_JAX_LAUNCHED=1; the script calls\n"
          "fsdp_jax.distributed.initialize() first thing to use them."),
      epilog=(
          "examples:\n"
          "  python -m fsdp_jax.launch --nproc 2 --devices-per-proc 4 train.py --steps 10\n"
          "  python -m fsdp_jax.launch --nproc 4 -m mypackage.train\n"
          "  # two machines:\n"
          "  python -m fsdp_jax.launch --nnodes 2 --node-rank 0 --master-addr node0 \\\n"
          "      --master-port 29500 --nproc 8 train.py      # on node0\n"
          "  python -m fsdp_jax.launch --nnodes 2 --node-rank 1 --master-addr node0 \\\n"
          "      --master-port 29500 --nproc 8 train.py      # on node1\n\n"
          "  # restart all workers after a failure, up to 3 times:\n"
          "  python -m fsdp_jax.launch --nproc 8 --max-restarts 3 train.py --resume\n\n"
          "exit status: 0 if every worker exited 0; 75 (restart me) when the\n"
          "workers saved and stopped after a SIGTERM (preemption), or a worker exited\n"
          "75 with no restarts left; else the status of the last failed attempt's\n"
          "first failed worker (128 + N for signal N); 2 for bad arguments."))
  p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc",
                 type=_positive_int("--nproc"), metavar="N",
                 help="processes to start on this machine (required)")
  p.add_argument("--devices-per-proc", "--devices_per_proc", dest="devices_per_proc",
                 type=_positive_int("--devices-per-proc"), metavar="M",
                 help="devices per process: M simulated CPU devices without a GPU "
                      "(default: JAX's 1), or GPUs LOCAL_RANK*M..LOCAL_RANK*M+M-1 "
                      "(default: the machine's GPUs / N)")
  p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                 help="cpu or gpu; auto (default) follows JAX_PLATFORMS, else "
                      "nvidia-smi")
  p.add_argument("--nnodes", type=_positive_int("--nnodes"), default=1,
                 help="number of machines (default 1)")
  p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=int, default=0,
                 help="index of this machine, 0..nnodes-1 (default 0)")
  p.add_argument("--master-addr", "--master_addr", dest="master_addr", default="127.0.0.1",
                 help="host of the process with RANK 0 (default 127.0.0.1)")
  p.add_argument("--master-port", "--master_port", dest="master_port", type=int,
                 help="port for JAX's coordinator (default: a free port; "
                      "required with --nnodes > 1)")
  p.add_argument("--peer-timeout", dest="peer_timeout", type=_positive_float("--peer-timeout"),
                 metavar="S", help="seconds without a heartbeat before a worker is "
                                   "declared lost by the others (default 30)")
  p.add_argument("--kill-grace", dest="kill_grace", type=_positive_float("--kill-grace"),
                 default=5.0, metavar="S",
                 help="when a worker fails, seconds between SIGTERM and SIGKILL for "
                      "the others (default 5)")
  p.add_argument("--max-restarts", "--max_restarts", dest="max_restarts",
                 type=_non_negative_int("--max-restarts"), default=0, metavar="K",
                 help="after a worker fails, restart all workers, up to K times "
                      "(torchrun's flag; default 0); the script resumes from its "
                      "latest checkpoint")
  p.add_argument("--term-timeout", dest="term_timeout",
                 type=_positive_float("--term-timeout"), default=30.0, metavar="S",
                 help="when the launcher gets SIGTERM (preemption), seconds the workers "
                      "get to finish the step, save and exit before SIGKILL (default "
                      "30; keep it below the scheduler's grace period)")
  p.add_argument("--log-dir", dest="log_dir", metavar="DIR",
                 help="write each worker's output to DIR/rank<R>.log (restarts append)")
  p.add_argument("-v", "--verbose", action="store_true",
                 help="show all the workers' output, including gloo's connection messages "
                      "('[Gloo] Rank N is connected to M peer ranks...'), which are hidden "
                      "by default except in the output of a worker that fails")
  p.add_argument("-m", "--module", action="store_true",
                 help="run SCRIPT as a module (python -m SCRIPT)")
  p.add_argument("script", metavar="SCRIPT", nargs="?",
                 help="the training script (or module with -m)")
  p.add_argument("script_args", metavar="...", nargs=argparse.REMAINDER,
                 help="arguments passed to the script")
  return p


def _validate(p: argparse.ArgumentParser, args) -> None:
  if args.nproc is None:
    p.error("--nproc N is required (the number of processes to start on this machine).")
  if args.script is None:
    p.error("give the training script to run, e.g. "
            "`python -m fsdp_jax.launch --nproc 2 train.py`.")
  if not args.module and not os.path.isfile(args.script):
    hint = (f" (to run a module, pass -m: `-m {args.script}`)"
            if not args.script.endswith(".py") else "")
    p.error(f"script {args.script!r} does not exist or is not a file{hint}.")
  if not 0 <= args.node_rank < args.nnodes:
    p.error(f"--node-rank {args.node_rank} is out of range for --nnodes {args.nnodes}; "
            f"use 0..{args.nnodes - 1}.")
  if args.master_port is not None and not 0 < args.master_port < 65536:
    p.error(f"--master-port {args.master_port} is not a TCP port (1..65535).")
  if args.nnodes > 1 and args.master_port is None:
    p.error("--nnodes > 1 needs --master-port (and --master-addr): every machine "
            "must be told the same coordinator address.")
  if args.nnodes > 1 and args.master_addr in ("127.0.0.1", "localhost", "::1") \
      and args.node_rank > 0:
    print("fsdp_jax.launch: warning: --master-addr is a loopback address with "
          "--nnodes > 1; that only works when all 'nodes' are this machine.",
          file=sys.stderr)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """The launcher's entry point; returns the exit status.

  Example (what ``python -m fsdp_jax.launch --nproc 2 train.py`` runs):
    >>> import pathlib, tempfile, fsdp_jax.launch
    >>> script = pathlib.Path(tempfile.mkdtemp()) / "train.py"
    >>> _ = script.write_text("import os\\n")
    >>> fsdp_jax.launch.main(["--nproc", "2", "--platform", "cpu", str(script)])
    0
  """
  parser = build_parser()
  args = parser.parse_args(argv)
  _validate(parser, args)

  platform = args.platform
  if platform == "auto":
    platform = cluster.detect_platform()
  devices = args.devices_per_proc
  if platform == "gpu":
    n_gpu = cluster.gpu_count()
    if devices is None and n_gpu:
      if n_gpu % args.nproc:
        parser.error(f"{n_gpu} GPUs cannot be split evenly over --nproc {args.nproc}; "
                     "pass --devices-per-proc M with nproc * M <= GPUs.")
      devices = n_gpu // args.nproc
    if not n_gpu and devices is None and args.nproc > 1:
      parser.error(f"--platform gpu but nvidia-smi lists no GPU, so the {args.nproc} "
                   "workers cannot be given separate GPUs; pass --devices-per-proc M "
                   "(worker i gets GPUs i*M..i*M+M-1) or use --platform cpu.")
    if n_gpu and devices is not None and args.nproc * devices > n_gpu:
      parser.error(f"--nproc {args.nproc} x --devices-per-proc {devices} needs "
                   f"{args.nproc * devices} GPUs but nvidia-smi lists {n_gpu}.")

  world = args.nnodes * args.nproc
  ranks = [args.node_rank * args.nproc + i for i in range(args.nproc)]
  # Every worker starts through the worker entry point, which installs the
  # failure hooks (fsdp_jax/_src/worker.py) and runs the script as __main__.
  cmd = [sys.executable, "-m", "fsdp_jax._src.runtime.worker"]
  cmd += ["-m", args.script] if args.module else [args.script]
  cmd += list(args.script_args)

  received: list[int] = []

  def on_signal(signum, frame):  # the supervision loop acts on it
    received.append(signum)

  previous = {s: signal.signal(s, on_signal)
              for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
  try:
    restart = 0
    while True:
      port = args.master_port
      if port is None:  # a fresh free port for every start
        host = args.master_addr if args.master_addr not in ("localhost",) else "127.0.0.1"
        try:
          port = free_port(host)
        except OSError as e:
          parser.error(f"Fix: pass --master-port. Cannot find a free port on "
                       f"--master-addr {args.master_addr!r} ({e}).")
      envs = [worker_env(rank=r, world_size=world, local_rank=i, local_world_size=args.nproc,
                         node_rank=args.node_rank, master_addr=args.master_addr,
                         master_port=port, devices_per_proc=devices, platform=platform,
                         peer_timeout=args.peer_timeout, restart_count=restart,
                         max_restarts=args.max_restarts)
              for i, r in enumerate(ranks)]
      if args.node_rank == 0:
        _check_coordinator_port(parser, args, envs[0]["JAX_COORDINATOR_ADDRESS"], port,
                                world)
      attempt = f" (restart {restart} of {args.max_restarts})" if restart else ""
      print(f"fsdp_jax.launch: starting {args.nproc} worker(s) (RANK {ranks[0]}..{ranks[-1]} "
            f"of {world}), platform {platform}, "
            f"{devices if devices is not None else 'default'} device(s) each, coordinator "
            f"{envs[0]['JAX_COORDINATOR_ADDRESS']}"
            + (f", logs in {args.log_dir}" if args.log_dir else "") + attempt,
            file=sys.stderr, flush=True)
      header = (f"==== fsdp_jax.launch: restart {restart} of {args.max_restarts} ===="
                if restart else None)
      group = WorkerGroup(cmd, envs, ranks, log_dir=args.log_dir, log_header=header,
                          hide_output=() if args.verbose else output.GLOO_CHATTER)
      group.start()
      outcome = _supervise(group, args, received)
      if outcome == "signal":
        return _after_signal(group, received[0])
      failure = group.first_failure
      if failure is None:
        return 0
      _replay_output(group, failure)
      _report_failure(group, args, failure)
      if restart >= args.max_restarts:
        if args.max_restarts:
          print(f"fsdp_jax.launch: no restarts left (--max-restarts {args.max_restarts} "
                f"used up). Exiting with status {exit_status(failure.returncode)}.",
                file=sys.stderr, flush=True)
        return exit_status(failure.returncode)
      if received:  # a signal came while the workers were being stopped
        print(f"fsdp_jax.launch: got {signal.Signals(received[0]).name} before the "
              f"restart; not restarting. Exiting with status {cluster.EXIT_RESTART} "
              "(restart the job to resume from its latest checkpoint).",
              file=sys.stderr, flush=True)
        return cluster.EXIT_RESTART
      restart += 1
      print(f"fsdp_jax.launch: restarting all {args.nproc} worker(s) (restart {restart} of "
            f"{args.max_restarts}); the script resumes from its latest checkpoint.",
            file=sys.stderr, flush=True)
  finally:
    for sig, handler in previous.items():
      signal.signal(sig, handler)


def _check_coordinator_port(parser, args, address: str, port: int, world: int) -> None:
  """Process 0 runs on this machine: check now that its coordinator can
  listen, rather than have the worker fail with gRPC's "Failed to start RPC
  server"."""
  bind = cluster.default_coordinator_bind_address(address)
  try:
    cluster.check_bind_address(bind, address, world, args.nproc)
  except ValueError as e:
    parser.error(str(e))
  problem = cluster.port_problem(bind)
  if problem:
    how = ("pass another --master-port (the same on every machine)" if args.nnodes > 1
           else "pass another --master-port, or leave it out to get a free port")
    parser.error(
        f"Fix: {how}, or stop the process that holds it (`ss -ltnp 'sport = :{port}'` "
        f"names it). --master-port {port}: the coordinator cannot listen on {bind}: "
        f"{problem}.")


def _supervise(group: WorkerGroup, args, received: list) -> str:
  """Waits for the workers: ``"done"`` when all exited (``group.first_failure``
  tells whether one failed), ``"signal"`` when the launcher got a signal
  (forwarded; the workers have exited or been killed)."""
  try:
    while group.running():
      if received:
        _forward(group, args, received)
        return "signal"
      failure = group.poll()
      if failure is not None:
        if failure.returncode == cluster.EXIT_RESTART:
          # The worker saved after a SIGTERM (or lost a peer): the others are
          # saving and exiting too. Let them finish before stopping them.
          deadline = time.monotonic() + args.term_timeout
          while group.running() and time.monotonic() < deadline and not received:
            time.sleep(0.05)
          if received and group.running():
            _forward(group, args, received)
            return "signal"
        group.stop(args.kill_grace)
        break
      time.sleep(0.05)
    group.poll()
    return "done"
  finally:
    if group.running():  # an unexpected exception got here
      group.stop(args.kill_grace)
    group.close()


def _forward(group: WorkerGroup, args, received: list) -> None:
  """Forwards the first signal to the workers and waits for them to exit:
  ``--term-timeout`` for SIGTERM (they save), ``--kill-grace`` otherwise; a
  second signal, or the end of the wait, kills the rest."""
  sig = received[0]
  grace = args.term_timeout if sig == signal.SIGTERM else args.kill_grace
  print(f"fsdp_jax.launch: got {signal.Signals(sig).name}; forwarded it to the workers "
        f"(up to {grace:g} s to exit"
        + (", e.g. after saving a checkpoint" if sig == signal.SIGTERM else "") + ").",
        file=sys.stderr, flush=True)
  group.signal_all(sig)
  deadline = time.monotonic() + grace
  while group.running() and time.monotonic() < deadline and len(received) == 1:
    time.sleep(0.05)
  if group.running():
    why = "a second signal" if len(received) > 1 else f"{grace:g} s"
    print(f"fsdp_jax.launch: killing the workers still running after {why}.",
          file=sys.stderr, flush=True)
    group.stop(0.0, sig=signal.SIGKILL)


def _after_signal(group: WorkerGroup, sig: int) -> int:
  """The launcher's status after forwarding ``sig``: 0 if every worker
  finished, 75 if they all saved and asked to be restarted, else 128+sig."""
  results = group.results()
  codes = [r.returncode for r in results]
  if all(c == 0 for c in codes):
    status = 0
  elif all(c in (0, cluster.EXIT_RESTART) for c in codes):
    status = cluster.EXIT_RESTART
  else:
    status = 128 + sig
  meaning = {0: "every worker finished",
             cluster.EXIT_RESTART: "the workers saved and stopped: restart the job to resume"}
  print("fsdp_jax.launch: after " + signal.Signals(sig).name + ": "
        + "; ".join(f"RANK={r.rank} {describe_status(r.returncode)}" for r in results)
        + f". Exiting with status {status}"
        + (f" ({meaning[status]})." if status in meaning else "."),
        file=sys.stderr, flush=True)
  return status


def _replay_output(group: WorkerGroup, failure: WorkerResult) -> None:
  """Shows the failed worker's whole output again, with the lines that were
  hidden from it (if any were)."""
  hidden = group.hidden_lines(failure.local_rank)  # all: the group is closed
  if not hidden:
    return
  data, size = group.output(failure.local_rank)
  what = ("its whole output" if len(data) == size else
          f"the last {len(data)} bytes of its {size} bytes of output")
  print(f"fsdp_jax.launch: worker RANK={failure.rank} ended with "
        f"{describe_status(failure.returncode)}; {what} follows, with the {hidden} "
        "line(s) of gloo connection messages hidden above (--verbose shows them as they "
        "come):", file=sys.stderr, flush=True)
  output.write_bytes(sys.stderr, data if data.endswith(b"\n") else data + b"\n")
  print(f"fsdp_jax.launch: end of worker RANK={failure.rank}'s output.",
        file=sys.stderr, flush=True)


def _report_failure(group: WorkerGroup, args, failure: WorkerResult) -> None:

  def ended(r: WorkerResult) -> str:
    return r.describe() + (" (restart me)" if r.returncode == cluster.EXIT_RESTART else "")

  results = group.results()
  lines = [f"fsdp_jax.launch: {ended(failure)} "
           + ("stopped first." if failure.returncode == cluster.EXIT_RESTART else "failed first.")]
  stopped = [r for r in results if r.stopped]
  if stopped:
    lines.append("fsdp_jax.launch: stopped the other workers: "
                 + ", ".join(f"RANK={r.rank} ({describe_status(r.returncode)})" for r in stopped))
  others = [r for r in results if not r.stopped and r.rank != failure.rank and r.returncode]
  for r in others:
    lines.append(f"fsdp_jax.launch: also ended: {ended(r)}")
  where = (f"{args.log_dir}/rank{failure.rank}.log" if args.log_dir
           else "the output above")
  lines.append(f"fsdp_jax.launch: see {where} for worker RANK={failure.rank}'s error."
               + ("" if args.max_restarts else
                  f" Exiting with status {exit_status(failure.returncode)}."))
  print("\n".join(lines), file=sys.stderr, flush=True)

