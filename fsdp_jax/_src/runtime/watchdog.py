"""The peer watchdog: a thread per process that heartbeats through JAX's
coordination service, notices a lost or failed process, and stops this one
with a message naming it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Optional

from fsdp_jax._src.runtime.cluster import (ABORT, DEFAULT_SHUTDOWN_TIMEOUT, DONE, DistributedInfo,
    EXIT_PEER_LOST, HB, HEARTBEAT_INTERVAL, env_int)
from fsdp_jax._src.runtime.coordination import describe_process, jax_client


# --------------------------------------------------------------------------
# The watchdog


def _main_thread_stack() -> str:
  frame = sys._current_frames().get(threading.main_thread().ident)
  if frame is None:
    return ""
  return "".join(traceback.format_stack(frame))


class Watchdog(threading.Thread):
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
    self.client = jax_client()
    self.peer_timeout = peer_timeout
    self.interval = min(interval, peer_timeout / 4)
    self._stop_event = threading.Event()
    self._finished = False
    self.failed = False
    self.shutdown_timeout = env_int("FSDP_JAX_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT)
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
      self.client.key_value_set(f"{DONE}{self.info.rank}", "finished", allow_overwrite=True)
    except Exception:
      pass

  def publish_failure(self, message: str) -> None:
    """Publishes this process's own failure so the others stop at once."""
    self.failed = True
    try:
      self.client.key_value_set(f"{ABORT}first", message)
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
        abort = self.client.key_value_dir_get(ABORT)
        done = (sorted(int(k.rsplit("/", 1)[-1]) for k, _ in self.client.key_value_dir_get(DONE))
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
        self.client.key_value_set(f"{HB}{rank}", str(counter), allow_overwrite=True)
        abort = self.client.key_value_dir_get(ABORT)
        if abort and not self.failed:
          if rank == 0 and world > 2:
            # This process hosts the coordination service: give the others a
            # few heartbeats to read the message before it goes away.
            time.sleep(3 * self.interval)
          self.die(abort[0][1])
        if rank == 0 or counter % 5 == 0:
          done = {k.rsplit("/", 1)[-1] for k, _ in self.client.key_value_dir_get(DONE)}
          self._check_finished_peers(done, now)
        if rank == 0:
          beats = dict(self.client.key_value_dir_get(HB))
          lost = []
          for peer in range(1, world):
            value = beats.get(f"{HB}{peer}")
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


_COMM_ERROR_WORDS = ("gloo", "nccl", "connection", "socket", "unavailable",
                     "coordination", "deadline", "barrier", "peer")


def is_communication_error(exc: BaseException) -> bool:
  """Whether ``exc`` looks like a collective or RPC failure (XLA runtime
  errors that mention gloo/NCCL, connections, the coordination service)."""
  name = type(exc).__name__
  if name not in ("JaxRuntimeError", "XlaRuntimeError") and not isinstance(
      exc, (ConnectionError, TimeoutError)):
    return False
  text = str(exc).lower()
  return isinstance(exc, (ConnectionError, TimeoutError)) or any(
      w in text for w in _COMM_ERROR_WORDS)


