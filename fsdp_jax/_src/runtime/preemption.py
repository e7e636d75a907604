"""Preemption: a SIGTERM stops training at a step every process agrees on
(:func:`handle_preemption`, :func:`should_stop`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Optional

from fsdp_jax._src.runtime.cluster import EXIT_RESTART, KV, env_int, first_line
from fsdp_jax._src.runtime.coordination import jax_client
from fsdp_jax._src.runtime import distributed as dist


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

_PREEMPT = f"{KV}/preempt/"
_PREEMPT_NOTICE = f"{_PREEMPT}notice"   # who got SIGTERM first
_PREEMPT_AT = f"{_PREEMPT}at/"          # at/<rank> = last step given to should_stop
_PREEMPT_STOP = f"{_PREEMPT}stop/"      # stop/<rank> = the step it stops after
_NO_STEP = "none"


# This process's preemption handling, set by handle_preemption() and cleared
# by uninstall(): process-wide, as the SIGTERM handler it owns is.
_preemption: Optional["Preemption"] = None


class Preemption:
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

  def __init__(self, p: Preemption, rank: int, world: int, timeout: float):
    super().__init__(name="fsdp_jax-preemption", daemon=True)
    self.p, self.rank, self.world, self.timeout = p, rank, world, timeout
    self.client = jax_client()
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
              f"step to stop after ({first_line(e)}); this process keeps training.")
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
  multi = jax_client() is not None and dist.get_world_size() > 1
  if not multi and dist._info is None and (env_int("WORLD_SIZE", 1) or 1) > 1:
    raise RuntimeError(
        "Fix: call fsdp_jax.distributed.initialize() before handle_preemption(): "
        f"this process is one of WORLD_SIZE={os.environ.get('WORLD_SIZE')} but has "
        "not joined the others yet.")
  p = Preemption(multi=multi)
  p.install()
  dist.register_teardown("preemption", on_shutdown=uninstall, on_exit=stop_preemption_agent)
  if multi:
    p.agent = _PreemptionAgent(p, dist.get_rank(), dist.get_world_size(), float(timeout))
    p.agent.start()  # stopped by shutdown(), or at exit by install_failure_hooks()'s handler
  _preemption = p


def stop_preemption_agent() -> None:
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
  world = dist.get_world_size()
  if p.multi:
    _agree_on_stop_step(step, timeout)
  who = f" ({p.notice} got it first)" if p.notice else ""
  _warn(f"SIGTERM (preemption){who}: process {dist.get_rank()} of {world} stops after step "
        f"{step}" + (", like every other process" if world > 1 else "")
        + f"; save a checkpoint and exit with status {EXIT_RESTART} (restart me).")
  return True


def _agree_on_stop_step(step: int, timeout: float) -> None:
  """Checks that every process stops after the same step."""
  client = jax_client()
  rank, world = dist.get_rank(), dist.get_world_size()
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
          f"({first_line(e)}).") from None
  if len(set(steps.values())) > 1:
    detail = ", ".join(f"process {r} after step {v}" for r, v in sorted(steps.items()))
    raise RuntimeError(
        "Fix: pass should_stop() the same steps on every process (e.g. "
        f"int(state.step)): on SIGTERM they stopped at different steps: {detail}.")


def uninstall() -> None:
  """Stops the agent and puts back the SIGTERM handler :func:`handle_preemption`
  replaced (called by :func:`fsdp_jax.distributed.shutdown`)."""
  global _preemption
  if _preemption is not None:
    _preemption.uninstall()
    _preemption = None
