"""The workers' output as the launcher forwards it.

Each worker's stdout and stderr are read through pipes and written to the
launcher's own stdout and stderr as they arrive, line by line, except lines
that start with one of the hidden prefixes: gloo's connection messages
(``[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected
peer ranks is : 7``), one per process and collective group, which a CPU run
of a few processes prints by the dozen before its first line of output.
A worker's threads may write such messages at once, piece by piece
(``[Gloo] Rank [Gloo] Rank 3 is connected ...`` then ``2 is connected ...``
on the next line): a hidden line that holds the prefix k times began k
messages and ended one, so the next k - 1 lines of that stream, the rest of
the messages it cut, are hidden too. Each worker's whole output (hidden
lines included, both streams in the order they arrived) is kept in a
temporary file, so that the launcher can show a failed worker's output in
full.

Text that does not end a line yet is held until its line ends, so that the
lines of several workers reach the launcher's output whole (Python writes a
print's text and its newline apart); a prompt or a progress bar redrawn
with ``\\r`` that stays unfinished for ``HOLD`` seconds is forwarded then,
unless it may still become a hidden line.
"""

from __future__ import annotations

import os
import selectors
import subprocess
import tempfile
import threading
import time
from typing import Optional, Sequence, TextIO

# gloo's "[Gloo] Rank N is connected to M peer ranks. ..." (its std::cout).
GLOO_CHATTER = (b"[Gloo]",)

# How long the start of a line waits for its end before it is forwarded.
HOLD = 0.25

# The most of a failed worker's output the launcher prints again (its end).
REPLAY_LIMIT = 1 << 20


def write_bytes(stream: TextIO, data: bytes) -> None:
  """Writes ``data`` to a text stream, through its byte buffer when it has
  one (the launcher's own prints are flushed, so the order holds)."""
  buffer = getattr(stream, "buffer", None)
  if buffer is not None:
    stream.flush()
    buffer.write(data)
    buffer.flush()
  else:  # e.g. a StringIO standing in for sys.stdout
    stream.write(data.decode(errors="replace"))
    stream.flush()


class LineFilter:
  """One stream of one worker: forwards what ``feed`` gets to ``stream``,
  less the lines that start with one of ``hide`` (and the rest of the
  messages such a line cut: see the module's docstring); counts those."""

  def __init__(self, stream: TextIO, hide: Sequence[bytes]):
    self.stream = stream
    self.hide = tuple(hide)
    self.hidden = 0
    self._pending = b""  # the start of a line, held until it ends
    self._since = 0.0  # when the pending text began
    self._at_line_start = True
    self._cut = 0  # hidden messages begun whose line has not ended yet

  def _may_hide(self, start: bytes) -> bool:
    return any(start.startswith(p) or p.startswith(start) for p in self.hide)

  def _hides(self, line: bytes) -> bool:
    """Whether a whole line is hidden; counts it. Each line ends one message
    and begins as many as it holds prefixes."""
    if not self._cut and not any(line.startswith(p) for p in self.hide):
      return False
    self._cut = max(self._cut + sum(line.count(p) for p in self.hide) - 1, 0)
    self.hidden += 1
    return True

  def feed(self, data: bytes) -> None:
    held = bool(self._pending)
    buf, self._pending = self._pending + data, b""
    out = []
    while buf:
      end = buf.find(b"\n") + 1
      if not self._at_line_start:  # the rest of a line already forwarded
        if not end:
          out.append(buf)
          break
        out.append(buf[:end])
        buf, self._at_line_start = buf[end:], True
      elif not end:  # an unfinished line: held
        self._pending = buf
        if not held:
          self._since = time.monotonic()
        break
      else:
        line, buf, held = buf[:end], buf[end:], False
        if not self._hides(line):
          out.append(line)
    if out:
      write_bytes(self.stream, b"".join(out))

  def forward_held(self, now: float) -> None:
    """Forwards a line start held since before ``now - HOLD`` (a prompt, a
    progress bar), unless it may still become a hidden line."""
    if self._pending and now - self._since >= HOLD and not self._may_hide(self._pending):
      pending, self._pending = self._pending, b""
      self._at_line_start, self._cut = False, 0  # not the rest of a cut message
      write_bytes(self.stream, pending)

  def close(self) -> None:
    """At the end of the stream: what is left is a whole last line."""
    pending, self._pending = self._pending, b""
    if pending and not self._hides(pending):
      write_bytes(self.stream, pending)


class OutputForwarder:
  """Forwards the output of workers started with ``stdout=PIPE,
  stderr=PIPE`` (see :meth:`add`), in one background thread."""

  def __init__(self, hide: Sequence[bytes], stdout: TextIO, stderr: TextIO):
    self.hide = tuple(hide)
    self.stdout, self.stderr = stdout, stderr
    self._selector = selectors.DefaultSelector()
    self._filters: list[tuple[LineFilter, LineFilter]] = []
    self._spools: list = []
    self._lock = threading.Lock()  # the spools: written by the thread, read after
    self._thread: Optional[threading.Thread] = None

  def add(self, proc: subprocess.Popen) -> None:
    """Takes over ``proc.stdout`` and ``proc.stderr`` (before :meth:`start`)."""
    spool = tempfile.TemporaryFile(prefix="fsdp_jax_worker_output_")
    pair = (LineFilter(self.stdout, self.hide), LineFilter(self.stderr, self.hide))
    for pipe, line_filter in zip((proc.stdout, proc.stderr), pair):
      self._selector.register(pipe, selectors.EVENT_READ, (line_filter, spool))
    self._filters.append(pair)
    self._spools.append(spool)

  def start(self) -> "OutputForwarder":
    self._thread = threading.Thread(target=self._run, name="fsdp_jax.launch output",
                                    daemon=True)
    self._thread.start()
    return self

  def _run(self) -> None:
    while self._selector.get_map():
      for key, _ in self._selector.select(timeout=HOLD / 2):
        line_filter, spool = key.data
        try:
          data = os.read(key.fd, 1 << 16)
        except OSError:
          data = b""
        if data:
          with self._lock:
            spool.write(data)
        else:  # the worker (and whatever it started) closed the stream
          self._selector.unregister(key.fileobj)
          key.fileobj.close()
        try:
          if data:
            line_filter.feed(data)
          else:
            line_filter.close()
        except (OSError, ValueError):  # our own output is gone (a closed pipe):
          pass  # keep reading, so that no worker blocks on a full pipe
      now = time.monotonic()
      for line_filter in (f for pair in self._filters for f in pair):
        try:
          line_filter.forward_held(now)
        except (OSError, ValueError):
          pass

  def join(self, timeout: float = 10.0) -> None:
    """Waits until every stream has ended (the workers have exited), for at
    most ``timeout`` seconds (a process a worker started may keep a stream
    open)."""
    if self._thread is not None:
      self._thread.join(timeout)

  def hidden(self, i: int) -> int:
    """How many lines of worker ``i``'s output were not forwarded."""
    return sum(f.hidden for f in self._filters[i])

  def output(self, i: int, limit: int = REPLAY_LIMIT) -> tuple[bytes, int]:
    """``(the end of worker i's whole output, at most limit bytes from a line
    start, its total size)``."""
    spool = self._spools[i]
    with self._lock:
      size = spool.seek(0, os.SEEK_END)
      spool.seek(max(0, size - limit))
      data = spool.read()
      spool.seek(0, os.SEEK_END)
    if size > limit:
      data = data[data.find(b"\n") + 1:]
    return data, size
