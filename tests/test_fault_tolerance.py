"""Preemption and restarts lose nothing.

* A 2-process run (``python -m fsdp_jax.launch --max-restarts``) of 16 steps,
  checkpointing every 4, whose workers are SIGKILLed at random steps twice
  and SIGTERMed once (random worker, random steps: the seed is printed
  and can be replayed with ``FSDP_JAX_FAULT_SEED``), then whose launcher is
  SIGTERMed (exit 75, "restart me") and which is started again, as a
  scheduler would: it ends with parameters and optimizer state bitwise
  equal to an uninterrupted run's (one process with 2 devices: the same
  program). On each SIGTERM every process stops
  after the same step, saves it, and exits with 75; the launcher restarts
  after each failure.
* One process (2 devices), no launcher: SIGTERM, save, exit 75, resume:
  bitwise equal to the same uninterrupted run.
* ``handle_preemption`` / ``should_stop`` misuse gets clear errors;
  ``CheckpointManager.save(data_state=...)`` round-trips.

The worker is tests/restart_worker.py (a script written the way
examples/train_gpt.py shows). Every subprocess runs under a hard timeout and
is killed with its process group on the way out. The one-process runs get
the test run's persistent compilation cache: the resumed run loads the
programs its predecessor compiled. (A 2-process job's programs get other
cache keys at each start: the launcher's workers go without.)
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fsdp_jax import distributed
from fsdp_jax._src.runtime import preemption

from helpers import Background, compile_cache_env, subprocess_env

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="uses Linux process groups and signals")]

REPO = Path(__file__).resolve().parents[1]
WORKER = str(REPO / "tests" / "restart_worker.py")
STEPS, SAVE_EVERY = 16, 4
LAUNCH = ["--nproc", "2", "--devices-per-proc", "1", "--platform", "cpu",
          "--peer-timeout", "5", "--kill-grace", "2"]


def _env(**extra) -> dict:
  return subprocess_env(FSDP_JAX_SHUTDOWN_TIMEOUT="30", **extra)


def Run(cmd, log: Path, timeout: float, env=None) -> Background:
  return Background(cmd, log, timeout, env=env or _env())


def _launcher(*args) -> list[str]:
  return [sys.executable, "-m", "fsdp_jax.launch", *args]


def _worker_args(directory: Path, out: Path, progress: Path = None, sleep: float = 0.0):
  args = [WORKER, "--dir", str(directory), "--out", str(out), "--steps", str(STEPS),
          "--save-every", str(SAVE_EVERY)]
  if progress is not None:
    args += ["--progress", str(progress), "--step-sleep", str(sleep)]
  return args


def _wait_for_step(progress: Path, rank: int, attempt: int, step: int, run: Background,
                   timeout: float = 120) -> int:
  """Waits until worker ``rank`` of start ``attempt`` has finished ``step``
  (or more); returns its pid."""
  base = progress / f"rank{rank}.attempt{attempt}"
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert run.proc.poll() is None, (
        f"the job ended before rank {rank} of start {attempt} reached step {step}:\n"
        + run.output()[-5000:])
    try:
      done = int(base.read_text())
      pid = int(Path(f"{base}.pid").read_text())
    except (OSError, ValueError):
      done = None
    if done is not None and done >= step:
      return pid
    time.sleep(0.01)
  pytest.fail(f"rank {rank} of start {attempt} did not reach step {step}:\n"
              + run.output()[-5000:])


def _load(path: Path) -> dict:
  with np.load(path) as f:
    return {k: f[k] for k in f.files}


def _assert_bitwise(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  assert any(k.startswith("opt") for k in want) and any(k.startswith("params/") for k in want)
  for k in want:
    assert got[k].dtype == want[k].dtype, k
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def _stops(text: str) -> list[tuple[int, int, int]]:
  """``(rank, attempt, step)`` of every STOPPED line."""
  return [tuple(int(x) for x in m.groups())
          for m in re.finditer(r"^STOPPED rank (\d+) attempt (\d+) step (\d+)", text, re.M)]


def _one_process_env() -> dict:
  return _env(FSDP_JAX_DEVICES_PER_PROC="2", FSDP_JAX_PLATFORM="cpu", **compile_cache_env())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """One uninterrupted run, one process with 2 devices: the same program as
  the 2-process job's (a 2-device shard axis; a collective of 2 values sums
  them in the same order whoever does it), so both tests compare with it,
  bit for bit."""
  tmp = tmp_path_factory.mktemp("reference")
  run = Run([sys.executable] + _worker_args(tmp / "ckpt", tmp / "ref.npz"), tmp / "ref.log",
            timeout=300, env=_one_process_env())

  def result() -> dict:
    assert run.wait() == 0, run.output()[-5000:]
    return _load(tmp / "ref.npz")

  yield result
  run.kill()


def test_kills_and_preemptions_lose_nothing(tmp_path, reference):
  seed = int(os.environ.get("FSDP_JAX_FAULT_SEED") or random.SystemRandom().randrange(2**31))
  print(f"\nfault seed {seed} (replay: FSDP_JAX_FAULT_SEED={seed})")
  rng = random.Random(seed)
  # One fault per start of the workers: SIGKILL twice and SIGTERM once,
  # each to a random worker once it has finished a random step; then
  # SIGTERM to the launcher.
  faults = [("SIGKILL", rng.randrange(2), rng.randint(1, STEPS - 8)) for _ in range(2)]
  faults.insert(rng.randint(0, 2), ("SIGTERM", rng.randrange(2), rng.randint(1, STEPS - 8)))
  launcher_term_at = rng.randint(1, STEPS - 8)
  print(f"faults: {faults}; then SIGTERM to the launcher after step {launcher_term_at}")

  progress = tmp_path / "progress"
  progress.mkdir()
  logs = tmp_path / "logs"
  ckpt, out = tmp_path / "ckpt", tmp_path / "out.npz"
  cmd = _launcher(*LAUNCH, "--max-restarts", "6", "--log-dir", str(logs), "--term-timeout", "60",
                  *_worker_args(ckpt, out, progress, sleep=0.05))
  start = time.monotonic()
  run = Run(cmd, tmp_path / "launcher.log", timeout=600)
  try:
    for attempt, (how, victim, at) in enumerate(faults):
      pid = _wait_for_step(progress, victim, attempt, at, run)
      os.kill(pid, getattr(signal, how))
    attempt = len(faults)
    _wait_for_step(progress, 0, attempt, launcher_term_at, run)
    os.kill(run.proc.pid, signal.SIGTERM)
    code = run.wait()
  finally:
    run.kill()
  text = run.output()
  worker_logs = {r: (logs / f"rank{r}.log").read_text(errors="replace") for r in (0, 1)}
  assert code == distributed.EXIT_RESTART, text[-5000:]
  # Every fault made the launcher restart all workers, once; the SIGTERM to
  # the launcher did not (its machine is going away) but asked for a restart.
  restarts = re.findall(r"restarting all 2 worker\(s\) \(restart (\d+) of 6\)", text)
  assert restarts == ["1", "2", "3"], text[-5000:]
  assert "after SIGTERM: RANK=0 exit code 75; RANK=1 exit code 75. Exiting with status 75" \
      in text, text[-3000:]
  # On each SIGTERM both processes stopped after the same step and saved it.
  stops = _stops(worker_logs[0]) + _stops(worker_logs[1])
  term_attempts = [faults.index(f) for f in faults if f[0] == "SIGTERM"] + [attempt]
  for a in term_attempts:
    steps = {s for r, at, s in stops if at == a}
    ranks = {r for r, at, s in stops if at == a}
    assert len(steps) == 1 and ranks == {0, 1}, (a, stops)
    assert (ckpt / str(steps.pop())).is_dir()
  assert {at for _, at, _ in stops} == set(term_attempts), stops
  # Each start resumed where the last finished checkpoint left off, data
  # position included (the position does not follow the step).
  resumed = re.findall(r"^RESUMED rank 0 attempt (\d+) step (\d+) position (\d+)",
                       worker_logs[0], re.M)
  assert [int(a) for a, _, _ in resumed] == list(range(attempt + 1)), resumed

  # The scheduler starts the job again: it finishes.
  again = Run(_launcher(*LAUNCH, *_worker_args(ckpt, out)), tmp_path / "again.log", timeout=300)
  assert again.wait() == 0, again.output()[-5000:]
  took = time.monotonic() - start
  _assert_bitwise(_load(out), reference())
  final = _load(out)
  assert int(final["step"]) == STEPS and int(final["position"]) > STEPS
  print(f"4 faults, 3 restarts, 1 relaunch: {took:.0f} s; resumed at "
        f"{[(int(s), int(p)) for _, s, p in resumed]} (step, position)")


def test_one_process_preemption_saves_and_resumes(tmp_path, reference):
  """No launcher, one process with 2 devices: SIGTERM mid-training saves
  the step it stops after and exits 75; the next run resumes there and ends
  bitwise equal to an uninterrupted run."""
  env = _one_process_env()
  py = [sys.executable]
  progress = tmp_path / "progress"
  progress.mkdir()
  ckpt, out = tmp_path / "ckpt", tmp_path / "out.npz"
  run = Run(py + _worker_args(ckpt, out, progress, sleep=0.03), tmp_path / "run.log",
            timeout=300, env=env)
  try:
    pid = _wait_for_step(progress, 0, 0, 9, run)
    assert pid == run.proc.pid
    os.kill(pid, signal.SIGTERM)
    code = run.wait()
  finally:
    run.kill()
  text = run.output()
  assert code == distributed.EXIT_RESTART, text[-4000:]
  (stop,) = _stops(text)
  assert stop[1] == 0 and stop[2] >= 9 and (ckpt / str(stop[2])).is_dir(), stop
  assert re.search(rf"process 0 of 1 stops after step {stop[2]}; save a checkpoint and "
                   r"exit with status 75", text), text[-3000:]
  again = Run(py + _worker_args(ckpt, out), tmp_path / "again.log", timeout=300, env=env)
  assert again.wait() == 0, again.output()[-4000:]
  assert f"RESUMED rank 0 attempt 0 step {stop[2]}" in again.output()
  _assert_bitwise(_load(out), reference())


# --------------------------------------------------------------------------
# In this process


@pytest.fixture
def no_preemption(monkeypatch):
  """handle_preemption() in this (pytest) process, undone afterwards."""
  monkeypatch.setattr(preemption, "_preemption", None)
  yield
  p = preemption._preemption
  if p is not None:
    p.uninstall()


def test_should_stop_needs_handle_preemption(no_preemption):
  with pytest.raises(RuntimeError, match=r"^Fix: call fsdp_jax.distributed.handle_preemption"):
    distributed.should_stop(1)


def test_should_stop_on_sigterm_in_one_process(no_preemption):
  before = signal.getsignal(signal.SIGTERM)
  distributed.handle_preemption()
  distributed.handle_preemption()  # once is enough; again is a no-op
  assert not distributed.should_stop(1) and not distributed.should_stop(2)
  with pytest.raises(ValueError, match=r"^Fix: pass should_stop the step just finished.*"
                                       r"got step 2 after step 2"):
    distributed.should_stop(2)
  os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal
  time.sleep(0.1)
  assert distributed.should_stop(3)
  assert distributed.should_stop(4)  # stays True: save and exit
  preemption._preemption.uninstall()
  assert signal.getsignal(signal.SIGTERM) == before


def test_handle_preemption_from_a_thread_is_refused(no_preemption):
  import threading
  seen = []
  t = threading.Thread(target=lambda: seen.append(_raises(distributed.handle_preemption)))
  t.start()
  t.join()
  assert "from the main thread" in seen[0], seen


def _raises(fn) -> str:
  try:
    fn()
  except RuntimeError as e:
    return str(e)
  return "no error"


def test_checkpoint_data_state_round_trip(tmp_path):
  import jax
  import jax.numpy as jnp
  import optax
  import fsdp_jax
  from fsdp_jax import CheckpointManager

  mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  state = fsdp_jax.init_train_state(params={"w": jnp.ones(4)}, optimizer=optax.sgd(0.1),
                                    mesh=mesh, config=fsdp_jax.FSDPConfig())
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  at = lambda s: state.replace(step=jax.device_put(jnp.int32(s), rep))
  with CheckpointManager(tmp_path / "c", enable_async_checkpointing=False) as mngr:
    assert mngr.save(at(1), data_state={"epoch": 0, "batch": 7, "files": ["a", "b"]})
    assert mngr.save(at(2))
    assert mngr.save(at(3), data_state={"position": 11})
    with pytest.raises(TypeError, match=r"^Fix: give data_state plain JSON values"):
      mngr.save(at(4), data_state={"position": np.int64(12)})
    with pytest.raises(TypeError, match=r"^Fix: pass data_state as a dict"):
      mngr.save(at(4), data_state=12)
    assert mngr.all_steps() == [1, 2, 3]
  with CheckpointManager(tmp_path / "c", read_only=True) as mngr:
    assert mngr.data_state() == {"position": 11}
    assert mngr.data_state(1) == {"epoch": 0, "batch": 7, "files": ["a", "b"]}
    assert mngr.data_state(2) is None
