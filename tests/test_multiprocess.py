"""Several processes on one machine through jax.distributed (gloo, loopback).

* 2 processes x 4 simulated CPU devices train to the same numbers as
  1 process x 8 devices (this pytest process) for FULL_SHARD (one 8-device
  shard axis spanning both processes) and HYBRID_SHARD (replicate=2 across
  the processes x shard=4 within each), each process feeding its own half of
  the global batch; tensor parallelism within the processes; context
  parallelism with a context group over both processes and within each.
* A process that is killed, or raises, mid-training is named by the survivor,
  which exits with fsdp_jax.distributed.EXIT_PEER_LOST in well under 60 s.
* monitored_barrier names the process that did not arrive.
* A checkpoint crosses process counts; fsdp_jax.data's iterator states
  (one per process) resume 2 processes on the saved run's next batches.
* The launcher: --help, argument errors, environment, exit codes, stopping
  the other workers when one fails, a busy --master-port.
* Who can reach the job: the coordination service listens on loopback only
  for a one-machine launch, on the interface of --master-addr otherwise.

Every subprocess runs under a hard timeout and is killed (with its process
group) on the way out; workers also die with their parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import io
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from fsdp_jax import launch
from fsdp_jax import distributed
from fsdp_jax._src.runtime import cluster
from fsdp_jax._src.runtime import distributed as distributed_impl
from fsdp_jax._src.runtime.output import GLOO_CHATTER, HOLD, LineFilter
from fsdp_jax.launch import WorkerGroup, free_port, worker_env

import mp_worker
from helpers import Background, subprocess_env

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="multi-process tests use Linux process groups")]

REPO = Path(__file__).resolve().parents[1]
WORKER = str(REPO / "tests" / "mp_worker.py")
PEER_TIMEOUT = 5  # seconds; the workers' heartbeat timeout in failure tests
STRATEGIES = ("FULL_SHARD", "HYBRID_SHARD")


def _launcher(*args) -> list[str]:
  return [sys.executable, "-m", "fsdp_jax.launch", *args]


# --------------------------------------------------------------------------
# Same numbers as one process


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("mp_train")
  out = tmp / "result.json"
  run = Background(_launcher("--nproc", "2", "--devices-per-proc", "4", "--platform", "cpu",
                              WORKER, "train", "--out", str(out),
                              "--strategies", ",".join(STRATEGIES)),
                    tmp / "launcher.log", timeout=240)
  cache = {}

  def result():
    if "r" not in cache:
      code = run.wait()
      assert code == 0, f"2-process training failed ({code}):\n{run.output()[-6000:]}"
      cache["r"] = json.loads(out.read_text())
      cache["r"]["launcher_seconds"] = run.seconds
    return cache["r"]

  yield result
  run.kill()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_processes_train_like_one(two_process_run, strategy):
  import jax
  assert jax.device_count() == 8 and jax.process_count() == 1
  ref_losses, ref_params, ref_layout = mp_worker.train(strategy)  # 1 process x 8
  got = two_process_run()
  assert got["world_size"] == 2 and got["devices"] == 8 and got["local_devices"] == 4
  run = got[strategy]
  # make_mesh on jax.devices() (ordered by process): FULL_SHARD's shard axis
  # spans both processes; HYBRID's replicate axis runs across the processes
  # and each shard group is one process's 4 devices.
  if strategy == "HYBRID_SHARD":
    assert run["layout"] == [[0, 0, 0, 0], [1, 1, 1, 1]]
  else:
    assert run["layout"] == [0, 0, 0, 0, 1, 1, 1, 1]
  np.testing.assert_allclose(run["losses"], ref_losses, rtol=0, atol=1e-5)
  assert set(run["params"]) == set(ref_params)
  for name, ref in ref_params.items():
    np.testing.assert_allclose(np.asarray(run["params"][name], np.float32), ref,
                               rtol=2e-4, atol=1e-6, err_msg=name)
  # A NaN in the second process's rows at step 2: every process skips it.
  flags, skipped, count, params = mp_worker.train_skipping(strategy)
  skip = run["skipping"]
  assert skip["flags"] == flags == [False, False, True, False, False]
  assert skip["skipped"] == skipped == 1 and skip["step"] == count == 4
  for name, ref in params.items():
    np.testing.assert_allclose(np.asarray(skip["params"][name], np.float32), ref,
                               rtol=2e-4, atol=1e-6, err_msg=name)
  # LoRA with an int8 base: adapters and the trained layer as in one process.
  lora_losses, lora_params = mp_worker.train_lora(strategy)
  np.testing.assert_allclose(run["lora"]["losses"], lora_losses, rtol=0, atol=1e-5)
  assert lora_losses[-1] < lora_losses[0]
  for name, ref in lora_params.items():
    np.testing.assert_allclose(np.asarray(run["lora"]["params"][name], np.float32), ref,
                               rtol=2e-4, atol=1e-6, err_msg=name)
  print(f"\n{strategy}: 2x4 launcher run {got['launcher_seconds']:.1f} s, "
        f"losses {np.round(run['losses'], 6).tolist()}")


def test_tensor_parallel_within_processes_fsdp_across(two_process_run):
  """make_mesh(shard=2, tensor=4) on 2 processes x 4 devices: each tensor
  group is one process's devices, FSDP's shard axis runs across the
  processes; the numbers are one process's."""
  ref_losses, ref_params, _ = mp_worker.train_tensor()
  run = two_process_run()["tensor"]
  assert run["layout"] == [[0, 0, 0, 0], [1, 1, 1, 1]]
  np.testing.assert_allclose(run["losses"], ref_losses, rtol=0, atol=1e-5)
  assert ref_losses[-1] < ref_losses[0]
  assert set(run["params"]) == set(ref_params)
  for name, ref in ref_params.items():
    np.testing.assert_allclose(np.asarray(run["params"][name], np.float32), ref,
                               rtol=2e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("name", list(mp_worker.CONTEXT_MESHES))
def test_context_parallel_across_processes(two_process_run, name):
  """Context parallelism on 2 processes x 4 devices, each process passing
  its rows with whole sequences: context=8 (one context group over both
  processes: both pass every row, each device takes its head-tail chunks,
  load_balance=True) and shard=2 x context=4 (a context group within each
  process, the rows split, contiguous chunks). The
  losses, parameters and shard_eval_step's loss equal one device's; the
  two processes of one context group passing different rows is refused."""
  import optax
  import test_context_parallel as t
  from helpers import jit_reference_run
  _, b, _ = mp_worker.CONTEXT_MESHES[name]
  batches = t._batches(b, seed=7, steps=2)  # pylint: disable=protected-access
  ratio = t._ratio(t.weighted_loss)  # pylint: disable=protected-access
  ref_losses, ref_params = jit_reference_run(ratio, mp_worker.context_params(),
                                             optax.adam(1e-2), batches)
  run = two_process_run()[name]
  assert np.asarray(run["layout"]).ravel().tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
  np.testing.assert_allclose(run["losses"], ref_losses, rtol=1e-5, atol=1e-6)
  ref_flat = mp_worker.flat(ref_params)
  assert set(run["params"]) == set(ref_flat)
  for key, ref in ref_flat.items():
    np.testing.assert_allclose(np.asarray(run["params"][key], np.float32), ref,
                               rtol=1e-5, atol=1e-5, err_msg=key)
  np.testing.assert_allclose(run["eval"], float(ratio(ref_params, batches[-1])), rtol=1e-5)
  if name == "context8":  # each process its own row, not the group's rows: named, refused
    assert re.search(r"processes 0 and 1 hold the same rows.*different values for "
                     r"\['ids'\], \['w'\].*whole sequences", run["error"]), run["error"]
  else:
    assert run["error"] is None
  print(f"\n{name}: {run['seconds']:.1f} s of the 2x4 run, losses {run['losses']}")


# --------------------------------------------------------------------------
# Checkpoints and full state dicts across process counts


def test_checkpoint_crosses_process_counts(tmp_path):
  """A checkpoint saved by 2 processes restores in 1 process and vice versa:
  the step after the restore matches the step after the save (same loss,
  same parameters), so parameters and Adam's moments came back. Also a FULL
  state dict with rank0_only taken by 2 processes."""
  one_dir, two_dir, out = tmp_path / "saved_by_1", tmp_path / "saved_by_2", tmp_path / "r.json"
  loss_1, params_1 = mp_worker.checkpoint_round(str(one_dir))  # 1 process x 8 devices
  proc = subprocess.run(
      _launcher("--nproc", "2", "--devices-per-proc", "4", "--platform", "cpu", WORKER,
                "checkpoint", "--save-dir", str(two_dir), "--restore-dir", str(one_dir),
                "--out", str(out)),
      cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=200)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  got = json.loads(out.read_text())
  # saved by 1 process, resumed by 2
  resumed = got["resumed"]
  np.testing.assert_allclose(resumed["loss"], loss_1, rtol=0, atol=1e-5)
  for name, ref in params_1.items():
    np.testing.assert_allclose(np.asarray(resumed["params"][name], np.float32), ref,
                               rtol=2e-4, atol=1e-6, err_msg=name)
  # saved by 2 processes, resumed by 1
  loss_2, params_2 = mp_worker.resume_round(str(two_dir))
  np.testing.assert_allclose(loss_2, got["saved"]["loss"], rtol=0, atol=1e-5)
  for name, ref in params_2.items():
    np.testing.assert_allclose(np.asarray(got["saved"]["params"][name], np.float32), ref,
                               rtol=2e-4, atol=1e-6, err_msg=name)
  assert got["state_dict_matches"], got["state_dict_keys"]
  # fsdp_jax.data: each process's iterator state saved beside the arrays
  # and set back: the batches after the restore are the saved run's.
  if got["data"] is not None:
    after_save, after_restore, files = got["data"]
    assert after_restore == after_save, (after_save, after_restore)
    assert files == ["process_0-of-2.json", "process_1-of-2.json"]
    seen = [i for batch in after_save for i in batch]
    assert len(set(seen)) == len(seen) == 24  # the processes' shares are disjoint


# --------------------------------------------------------------------------
# A lost process is named, promptly


def _start_fail_run(tmp_path, victim, how, **extra_env):
  port = free_port()
  base = dict(subprocess_env(), **extra_env)
  envs = [worker_env(rank=r, world_size=2, local_rank=r, local_world_size=2,
                     master_addr="127.0.0.1", master_port=port, devices_per_proc=1,
                     platform="cpu", peer_timeout=PEER_TIMEOUT, base=base)
          for r in range(2)]
  cmd = [sys.executable, WORKER, "fail", "--victim", str(victim), "--how", how,
         "--at", "3", "--steps", "100000", "--max-seconds", "170"]
  # die_with_parent=False: no Python between fork and exec in this (JAX,
  # multi-threaded) process; the workers stop themselves after --max-seconds.
  group = WorkerGroup(cmd, envs, log_dir=str(tmp_path), cwd=str(REPO),
                      die_with_parent=False).start()
  # Workers are started directly (not by the launcher, which would stop the
  # survivor itself): the survivor must find out on its own.
  results = group.wait(timeout=150, stop_on_failure=False)
  logs = [(tmp_path / f"rank{r}.log").read_text(errors="replace") for r in range(2)]
  died = re.search(rf"VICTIM {victim} {how} at ([0-9.]+)", logs[victim])
  assert died, f"the victim never reached its failure point:\n{logs[victim][-3000:]}"
  return results, logs, float(died.group(1))


def test_killed_process_is_named_by_survivor(tmp_path):
  results, logs, died_at = _start_fail_run(tmp_path, victim=1, how="kill")
  victim, survivor = results[1], results[0]
  assert victim.returncode == -9, victim.describe()
  assert not survivor.stopped, f"survivor hung until the test's timeout:\n{logs[0][-3000:]}"
  assert survivor.returncode == distributed.EXIT_PEER_LOST, (survivor.describe(), logs[0][-3000:])
  elapsed = survivor.ended_at - died_at
  assert elapsed < 60, f"survivor took {elapsed:.1f} s to exit"
  assert "FINISHED" not in logs[0]
  message = logs[0]
  assert re.search(r"lost process 1 of 2 \(host \S+, pid \d+, LOCAL_RANK 1\) stopped "
                   r"sending heartbeats", message), message[-3000:]
  assert "died or was killed" in message
  print(f"\nsurvivor exited {elapsed:.1f} s after the peer was killed "
        f"(peer_timeout {PEER_TIMEOUT} s)")


def test_failed_process_is_named_by_survivor(tmp_path):
  results, logs, died_at = _start_fail_run(tmp_path, victim=1, how="raise")
  victim, survivor = results[1], results[0]
  assert victim.returncode == 1, victim.describe()
  assert "ValueError: injected failure" in logs[1]
  assert survivor.returncode == distributed.EXIT_PEER_LOST, (survivor.describe(), logs[0][-3000:])
  elapsed = survivor.ended_at - died_at
  assert elapsed < 60, f"survivor took {elapsed:.1f} s to exit"
  assert re.search(r"process 1 of 2 \(host \S+, pid \d+, LOCAL_RANK 1\) failed: "
                   r"ValueError: injected failure in process 1 at step 3", logs[0]), logs[0][-3000:]
  print(f"\nsurvivor exited {elapsed:.1f} s after the peer raised")


def test_early_exit_is_reported_and_bounded(tmp_path):
  """Process 1 calls sys.exit(3) mid-training (the uneven-batches bug): it
  stays alive at JAX's shutdown barrier, so process 0's collective neither
  completes nor fails. The watchdog warns, naming process 1, and JAX ends
  both after FSDP_JAX_SHUTDOWN_TIMEOUT."""
  results, logs, died_at = _start_fail_run(tmp_path, victim=1, how="exit",
                                           FSDP_JAX_SHUTDOWN_TIMEOUT="10")
  survivor = results[0]
  assert not survivor.stopped, f"survivor hung until the test's timeout:\n{logs[0][-3000:]}"
  assert survivor.returncode != 0
  elapsed = survivor.ended_at - died_at
  assert elapsed < 60, f"survivor took {elapsed:.1f} s to exit"
  assert re.search(r"warning: process 1 of 2 \(host \S+, pid \d+, LOCAL_RANK 1\) finished "
                   r"more than 5 s ago while process 0 still runs", logs[0]), logs[0][-3000:]
  assert "Shutdown barrier" in logs[0]  # JAX's own termination, after the timeout
  print(f"\nsurvivor exited {elapsed:.1f} s after the peer's sys.exit")


def test_lost_coordinator_stops_the_others(tmp_path):
  results, logs, died_at = _start_fail_run(tmp_path, victim=0, how="kill")
  survivor = results[1]
  assert results[0].returncode == -9
  assert not survivor.stopped, f"survivor hung until the test's timeout:\n{logs[1][-3000:]}"
  assert survivor.returncode != 0
  elapsed = survivor.ended_at - died_at
  assert elapsed < 60, f"survivor took {elapsed:.1f} s to exit"
  # Process 0 hosts JAX's coordination service: JAX itself terminates the
  # others at once, naming the leader; fsdp_jax's watchdog may get there first.
  assert ("leader task" in logs[1] or "lost the coordinator" in logs[1]), logs[1][-3000:]
  print(f"\nsurvivor exited {elapsed:.1f} s after process 0 was killed")


# --------------------------------------------------------------------------
# monitored_barrier


def test_monitored_barrier_names_missing_process(tmp_path):
  out = tmp_path / "barrier.json"
  proc = subprocess.run(
      _launcher("--nproc", "2", "--devices-per-proc", "1", "--platform", "cpu",
                "--peer-timeout", "10", WORKER, "barrier", "--out", str(out),
                "--timeout", "2"),
      cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  seen = json.loads(out.read_text())
  assert seen["pass"] == "ok"
  assert "process 0 is at barrier 'name-0' but process 1 at 'name-1'" in seen["mismatch"]
  assert seen["missing"] == [1]
  assert re.search(r"monitored_barrier 'late' \(#3\): 1 of 2 processes did not arrive "
                   r"within 2\.\d s: process 1 of 2 \(host \S+, pid \d+, LOCAL_RANK 1\) "
                   r"\[alive: still sending heartbeats", seen["timeout"]), seen["timeout"]
  assert 2.0 <= seen["waited"] < 10


def test_monitored_barrier_single_process_returns():
  distributed.monitored_barrier("solo", timeout=1)  # one process: nothing to wait for


# --------------------------------------------------------------------------
# initialize() argument errors (raised before JAX is touched)


@pytest.fixture
def clean_dist_env(monkeypatch):
  for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "JAX_COORDINATOR_ADDRESS", "MASTER_ADDR",
            "MASTER_PORT", "FSDP_JAX_DEVICES_PER_PROC", "FSDP_JAX_PEER_TIMEOUT"):
    monkeypatch.delenv(k, raising=False)
  monkeypatch.setattr(distributed_impl, "_info", None)
  return monkeypatch


def test_initialize_errors(clean_dist_env):
  import jax
  jax.devices()  # JAX has started in this process (as it has after conftest's set-up)
  mp = clean_dist_env
  mp.setenv("RANK", "0")
  mp.setenv("WORLD_SIZE", "2")
  with pytest.raises(ValueError, match="no coordinator address.*JAX_COORDINATOR_ADDRESS"):
    distributed.initialize()
  mp.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
  mp.setenv("RANK", "5")
  with pytest.raises(ValueError, match=r"rank=5, world_size=2"):
    distributed.initialize()
  mp.setenv("RANK", "x")
  with pytest.raises(ValueError, match="RANK='x' is not an integer"):
    distributed.initialize()
  mp.delenv("RANK")
  with pytest.raises(ValueError, match="set both"):
    distributed.initialize()
  with pytest.raises(ValueError, match="pass all of coordinator_address"):
    distributed.initialize(num_processes=2)
  # Multi-process needs JAX not started yet (this pytest process has started it).
  with pytest.raises(RuntimeError, match="before JAX starts its backends"):
    distributed.initialize(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0)


def test_initialize_single_process_after_jax_started(clean_dist_env):
  info = distributed.initialize()
  assert (info.rank, info.world_size, info.source) == (0, 1, "single")
  assert info.is_main_process and distributed.get_world_size() == 1


# --------------------------------------------------------------------------
# The launcher


def test_launcher_help(capsys):
  with pytest.raises(SystemExit) as e:
    launch.main(["--help"])
  assert e.value.code == 0
  text = capsys.readouterr().out
  for word in ("--nproc", "--devices-per-proc", "--master-port", "--peer-timeout",
               "RANK", "LOCAL_RANK", "JAX_COORDINATOR_ADDRESS", "exit status"):
    assert word in text, word


@pytest.mark.parametrize("argv, message", [
    (["x.py"], "--nproc N is required"),
    (["--nproc", "0", "x.py"], "--nproc must be at least 1"),
    (["--nproc", "two", "x.py"], "--nproc must be a whole number"),
    (["--nproc", "2"], "give the training script"),
    (["--nproc", "2", "no_such_script.py"], "'no_such_script.py' does not exist"),
    (["--nproc", "2", "--devices-per-proc", "0", WORKER], "--devices-per-proc must be at least 1"),
    (["--nproc", "2", "--nnodes", "2", "--node-rank", "2", WORKER], "--node-rank 2 is out of range"),
    (["--nproc", "2", "--nnodes", "2", WORKER], "needs --master-port"),
    (["--nproc", "2", "--master-port", "70000", WORKER], "not a TCP port"),
    (["--nproc", "2", "--peer-timeout", "-1", WORKER], "--peer-timeout must be positive"),
    (["--nproc", "2", "--platform", "tpu", WORKER], "invalid choice: 'tpu'"),
    (["--nproc", "2", "--max-restarts", "-1", WORKER], "--max-restarts must be 0 or more"),
    (["--nproc", "2", "--term-timeout", "0", WORKER], "--term-timeout must be positive"),
])
def test_launcher_rejects_bad_arguments(capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    launch.main(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def _script(tmp_path, body: str) -> str:
  path = tmp_path / "script.py"
  path.write_text(textwrap.dedent(body))
  return str(path)


def test_launcher_sets_environment_forwards_arguments_module_mode_and_log_dir(tmp_path):
  """One launch of a module (``-m``) with arguments and --log-dir: every
  worker's environment and argv, and each worker's output in its own log."""
  pkg = tmp_path / "pkg_mp_demo"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "main.py").write_text(textwrap.dedent(f"""
      import json, os, sys
      keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
              "MASTER_ADDR", "MASTER_PORT", "JAX_COORDINATOR_ADDRESS",
              "FSDP_JAX_DEVICES_PER_PROC", "FSDP_JAX_PLATFORM", "FSDP_JAX_PEER_TIMEOUT",
              "FSDP_JAX_LAUNCHED"]
      out = {{k: os.environ.get(k) for k in keys}}
      out["argv"] = sys.argv[1:]
      with open(os.path.join({str(tmp_path)!r}, f"env{{os.environ['RANK']}}.json"), "w") as f:
          json.dump(out, f)
      print('hello from', os.environ['RANK'])
  """))
  env = subprocess_env()
  env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
  logs = tmp_path / "logs"
  proc = subprocess.run(_launcher("--nproc", "3", "--devices-per-proc", "2", "--platform", "cpu",
                                  "--peer-timeout", "7", "--log-dir", str(logs), "-m",
                                  "pkg_mp_demo.main", "--lr", "0.1", "pos"),
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
  port = envs[0]["MASTER_PORT"]
  for r, e in enumerate(envs):
    assert e == {"RANK": str(r), "WORLD_SIZE": "3", "LOCAL_RANK": str(r),
                 "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": port, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                 "FSDP_JAX_DEVICES_PER_PROC": "2", "FSDP_JAX_PLATFORM": "cpu",
                 "FSDP_JAX_PEER_TIMEOUT": "7", "FSDP_JAX_LAUNCHED": "1",
                 "argv": ["--lr", "0.1", "pos"]}
    assert (logs / f"rank{r}.log").read_text().strip() == f"hello from {r}"


def test_launcher_stops_others_and_forwards_failure(tmp_path):
  """A worker's exit status is the launcher's; a worker killed by a signal
  (128 + N) is test_launcher_max_restarts' second run."""
  expected_status, described = 3, "exit code 3"
  script = _script(tmp_path, """
      import os, signal, sys, time
      if os.environ["RANK"] == "1":
          time.sleep(0.5)
          sys.exit(3)
      time.sleep(120)  # the others would run on; the launcher must stop them
  """)
  start = time.monotonic()
  proc = subprocess.run(_launcher("--nproc", "3", "--kill-grace", "2", script),
                        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=60)
  took = time.monotonic() - start
  assert proc.returncode == expected_status, proc.stderr
  assert took < 30, f"launcher took {took:.1f} s to stop the other workers"
  assert re.search(rf"worker RANK=1 \(LOCAL_RANK=1, pid \d+\): {re.escape(described)} "
                   "failed first", proc.stderr), proc.stderr
  assert re.search(r"stopped the other workers: RANK=0 \(killed by signal SIGTERM \(15\)\), "
                   r"RANK=2 \(killed by signal SIGTERM \(15\)\)", proc.stderr), proc.stderr


def test_launcher_max_restarts(tmp_path):
  """--max-restarts K: after a worker fails, all workers start again (with
  FSDP_JAX_RESTART_COUNT and a fresh coordinator port), up to K times; the
  logs of every start follow each other. The last worker fails in the
  first two starts: exit code 3, then killed by SIGKILL."""
  marks = tmp_path / "marks"
  marks.mkdir()
  script = _script(tmp_path, f"""
      import os, pathlib, signal, sys, time
      n = int(os.environ["FSDP_JAX_RESTART_COUNT"])
      print(f"start {{n}} of max {{os.environ['FSDP_JAX_MAX_RESTARTS']}} rank {{os.environ['RANK']}} "
            f"port {{os.environ['MASTER_PORT']}}", flush=True)
      mark = pathlib.Path({str(marks)!r}) / f"rank0-start{{n}}"
      if os.environ["RANK"] == "0":
          mark.touch()
      if n < 2 and int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
          # Fail once rank 0 has logged this start (on a loaded machine it
          # may still be starting when rank 1 fails, and be stopped first).
          deadline = time.monotonic() + 30
          while not mark.exists() and time.monotonic() < deadline:
              time.sleep(0.05)
          if n == 0:
              sys.exit(3)
          os.kill(os.getpid(), signal.SIGKILL)
      time.sleep(0 if n >= 2 else 60)  # rank 0 runs on until stopped
  """)
  logs = tmp_path / "logs"
  proc = subprocess.run(_launcher("--nproc", "2", "--max-restarts", "2", "--kill-grace", "2",
                                  "--log-dir", str(logs), script),
                        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=90)
  assert proc.returncode == 0, proc.stderr
  assert re.findall(r"restarting all 2 worker\(s\) \(restart (\d) of 2\)", proc.stderr) == \
      ["1", "2"], proc.stderr
  assert re.search(r"worker RANK=1 \(LOCAL_RANK=1, pid \d+\): exit code 3 failed first",
                   proc.stderr), proc.stderr
  assert re.search(r"worker RANK=1 \(LOCAL_RANK=1, pid \d+\): killed by signal SIGKILL \(9\) "
                   r"failed first", proc.stderr), proc.stderr
  assert proc.stderr.count("stopped the other workers: RANK=0 (killed by signal SIGTERM (15))") \
      == 2, proc.stderr
  log0 = (logs / "rank0.log").read_text()
  starts = re.findall(r"start (\d) of max 2 rank 0 port (\d+)", log0)
  assert [n for n, _ in starts] == ["0", "1", "2"], log0
  assert len({p for _, p in starts}) == 3, starts  # a fresh port each time
  assert "==== fsdp_jax.launch: restart 2 of 2 ====" in log0
  # One restart fewer than needed (one worker: the others' stopping is
  # above): the last failure's status, 128 + 9 for SIGKILL, and why.
  proc = subprocess.run(_launcher("--nproc", "1", "--max-restarts", "1", "--kill-grace", "2",
                                  script),
                        cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=90)
  assert proc.returncode == 128 + 9, proc.stderr
  assert re.search(r"worker RANK=0 \(LOCAL_RANK=0, pid \d+\): killed by signal SIGKILL \(9\) "
                   r"failed first", proc.stderr), proc.stderr
  assert "no restarts left (--max-restarts 1 used up). Exiting with status 137." in proc.stderr


@pytest.mark.parametrize("how, expected, words", [
    # Workers that save and exit 75 on SIGTERM: the launcher asks to be
    # restarted, and does not restart them itself (its machine goes away).
    ("sys.exit(75)", 75, "RANK=0 exit code 75; RANK=1 exit code 75. Exiting with status 75 "
                         "(the workers saved and stopped: restart the job to resume)"),
    # Workers that ignore SIGTERM: killed after --term-timeout.
    ("time.sleep(120)", 128 + 15, "killing the workers still running after 2 s"),
])
def test_launcher_forwards_sigterm(tmp_path, how, expected, words):
  script = _script(tmp_path, f"""
      import os, signal, sys, time
      def on_term(signum, frame):
          print("worker got SIGTERM", flush=True)
          {how}
      signal.signal(signal.SIGTERM, on_term)
      open(os.path.join(os.path.dirname(__file__), "up" + os.environ["RANK"]), "w").close()
      time.sleep(60)
  """)
  proc = subprocess.Popen(_launcher("--nproc", "2", "--max-restarts", "3", "--term-timeout", "2",
                                    script),
                          cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    deadline = time.monotonic() + 30
    while not all((tmp_path / f"up{r}").exists() for r in (0, 1)):
      assert time.monotonic() < deadline and proc.poll() is None
      time.sleep(0.05)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    took = time.monotonic() - start
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, 9)
  assert proc.returncode == expected, err
  assert out.count("worker got SIGTERM") == 2, out
  assert "got SIGTERM; forwarded it to the workers (up to 2 s to exit" in err, err
  assert words in err, err
  assert "restarting" not in err
  assert took < 20


def _alive(pid: int) -> bool:
  """Running (a zombie waiting to be reaped counts as dead)."""
  try:
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):
    return False
  return state not in ("Z", "X")


def test_workers_die_with_the_launcher(tmp_path):
  """SIGKILL to the launcher (no chance to stop anything): the kernel kills
  every worker (PR_SET_PDEATHSIG), so none is left running orphaned."""
  script = _script(tmp_path, """
      import os, time
      with open(os.path.join(os.path.dirname(__file__), "pid" + os.environ["RANK"]), "w") as f:
          f.write(str(os.getpid()))
      time.sleep(120)
  """)
  proc = subprocess.Popen(_launcher("--nproc", "2", script), cwd=REPO, env=subprocess_env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True)
  pids = []
  try:
    deadline = time.monotonic() + 30
    while len(pids) < 2:
      assert time.monotonic() < deadline and proc.poll() is None
      pids = [int(p.read_text()) for p in sorted(tmp_path.glob("pid[01]")) if p.read_text()]
      time.sleep(0.05)
    assert all(_alive(p) for p in pids)
    proc.kill()  # the launcher only: the workers run in their own sessions
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert not any(_alive(p) for p in pids), pids
  finally:
    for p in pids:
      if _alive(p):
        os.kill(p, 9)


# Two processes whose cross-process collective connects gloo (which prints a
# "[Gloo] Rank N is connected to M peer ranks" line per process and group);
# process 1 fails after its collective with FAIL in argv.
_GLOO_SCRIPT = """
    import sys
    import fsdp_jax
    fsdp_jax.distributed.initialize()
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    mesh = fsdp_jax.make_mesh(shard=jax.device_count())
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("shard")))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
    rank = jax.process_index()
    for step in range(3):
      print(f"rank {rank} step {step} sum {float(total)}")
    print(f"rank {rank} to stderr", file=sys.stderr)
    if "FAIL" in sys.argv and rank == 1:
      raise ValueError("rank 1 fails on purpose")
"""


def _gloo_run(tmp_path, *args):
  script = _script(tmp_path, _GLOO_SCRIPT)
  launcher_args = [a for a in args if a != "FAIL"]
  return subprocess.run(
      _launcher("--nproc", "2", "--devices-per-proc", "1", "--platform", "cpu",
                *launcher_args, script, *[a for a in args if a == "FAIL"]),
      cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def quiet_gloo_runs(tmp_path_factory):
  """Two launches of the gloo script side by side, without --verbose: what
  each printed and its exit status."""
  script = _script(tmp_path_factory.mktemp("gloo_quiet"), _GLOO_SCRIPT)
  procs = [subprocess.Popen(_launcher("--nproc", "2", "--devices-per-proc", "1",
                                      "--platform", "cpu", script),
                            cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
           for _ in range(2)]
  try:
    outs = [p.communicate(timeout=120) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, 9)
  return [subprocess.CompletedProcess(p.args, p.returncode, out, err)
          for p, (out, err) in zip(procs, outs)]


def test_exit_without_shutdown_is_clean(quiet_gloo_runs):
  """A script that never calls distributed.shutdown() exits 0: the watchdog
  and jax.distributed are shut down at exit, in order (left to interpreter
  teardown, about one exit in two aborted with SIGABRT). Two jobs side by
  side (the quiet gloo runs); the --verbose gloo run, the SLURM run and the
  two coordinator-address runs exit without shutdown() too, and must exit
  0: twelve such exits per test run."""
  for run in quiet_gloo_runs:
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    for rank in (0, 1):
      assert f"rank {rank} step 0 sum 6.0" in run.stdout, run.stdout


def test_launcher_hides_gloo_chatter_unless_verbose_or_failed(tmp_path, quiet_gloo_runs):
  for quiet in quiet_gloo_runs:
    assert quiet.returncode == 0, quiet.stdout[-3000:] + quiet.stderr[-3000:]
    # Not a piece of one either (a worker's threads write theirs at once).
    assert "[Gloo]" not in quiet.stdout + quiet.stderr, quiet.stdout
    assert "peer ranks" not in quiet.stdout + quiet.stderr, quiet.stdout
    for rank in (0, 1):  # everything else comes through, each process's lines in order
      lines = [l for l in quiet.stdout.splitlines() if l.startswith(f"rank {rank} ")]
      assert lines == [f"rank {rank} step {i} sum 6.0" for i in range(3)], quiet.stdout
      assert f"rank {rank} to stderr" in quiet.stderr, quiet.stderr[-3000:]

  verbose = _gloo_run(tmp_path, "--verbose")
  assert verbose.returncode == 0, verbose.stderr[-3000:]
  # Both workers write gloo's line to the shared stdout as they connect: the
  # two lines may interleave mid-line, so count their pieces.
  assert verbose.stdout.count("[Gloo] Rank") >= 2, verbose.stdout
  assert verbose.stdout.count("is connected to") >= 2, verbose.stdout
  assert "rank 1 step 2 sum 6.0" in verbose.stdout

  failed = _gloo_run(tmp_path, "FAIL")
  assert failed.returncode == 1, failed.stderr[-3000:]
  err = failed.stderr
  assert "[Gloo]" not in failed.stdout and "peer ranks" not in failed.stdout, failed.stdout
  # The failed worker's whole output is shown again, with its gloo lines.
  start = re.search(r"fsdp_jax\.launch: worker RANK=1 ended with exit code 1; its whole output "
                    r"follows, with the (\d+) line\(s\) of gloo connection messages hidden "
                    r"above \(--verbose shows them as they come\):\n", err)
  assert start, err[-4000:]
  end = err.index("fsdp_jax.launch: end of worker RANK=1's output.", start.end())
  replay = err[start.end():end]
  # One line per message, though threads may have cut one with another.
  begun = replay.count("[Gloo] Rank ")
  ended = replay.count("Expected number of connected peer ranks is : ")
  assert begun == ended == int(start.group(1)) > 0, replay
  assert "rank 1 step 2 sum 6.0" in replay and "ValueError: rank 1 fails on purpose" in replay
  assert "rank 0 step" not in replay  # only the failed worker's
  assert err.index("end of worker RANK=1's output") < err.index("failed first")


def test_launcher_forwards_output_as_it_comes(tmp_path):
  """A worker's prints (no flush) and an unfinished line reach the launcher's
  output while the worker still runs."""
  flag = tmp_path / "go"
  script = _script(tmp_path, f"""
      import os, sys, time
      print("started", os.environ["RANK"])
      sys.stdout.write("[progress 1/2]")  # no newline yet
      deadline = time.monotonic() + 60
      while not os.path.exists({str(flag)!r}) and time.monotonic() < deadline:
          time.sleep(0.05)
      print(" done", os.environ["RANK"])
  """)
  run = Background(_launcher("--nproc", "2", "--platform", "cpu", script),
                   tmp_path / "launcher.log", timeout=90)
  try:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
      out = run.output()
      if all(f"started {r}" in out for r in (0, 1)) and out.count("[progress 1/2]") == 2:
        break
      time.sleep(0.1)
    else:
      raise AssertionError(f"no output while the workers run:\n{run.output()[-3000:]}")
    assert run.proc.poll() is None  # the workers are still waiting
    flag.write_text("")
    assert run.wait() == 0, run.output()[-3000:]
    assert "[progress 1/2] done 0" in run.output() or "[progress 1/2] done 1" in run.output()
  finally:
    run.kill()


def test_line_filter_hides_prefixed_lines_across_chunks():
  sink = io.StringIO()
  f = LineFilter(sink, GLOO_CHATTER)
  for chunk in ["a\n[Gl", "oo] Rank 0 is con", "nected\nb", "c\n[", "step 1]", " ok\n",
                "[Gloo] last"]:
    f.feed(chunk.encode())
  assert sink.getvalue() == "a\nbc\n[step 1] ok\n"
  f.close()
  assert f.hidden == 2 and sink.getvalue() == "a\nbc\n[step 1] ok\n"


def test_line_filter_forwards_whole_lines_and_a_held_line_start_after_a_while():
  """Two workers printing at once (text and newline written apart) reach the
  shared output line by line; an unfinished line (a progress bar) is
  forwarded once it has waited HOLD seconds, the start of a gloo line never."""
  sink = io.StringIO()
  w0, w1 = LineFilter(sink, GLOO_CHATTER), LineFilter(sink, GLOO_CHATTER)
  w1.feed(b"rank 1 step 0")
  w0.feed(b"rank 0 step 0\n")
  w1.feed(b"\n")
  assert sink.getvalue() == "rank 0 step 0\nrank 1 step 0\n"
  w0.feed(b"[progress 1/2]")
  w1.feed(b"[Gl")
  start = time.monotonic()
  w0.forward_held(start)
  w1.forward_held(start + HOLD)
  assert sink.getvalue().endswith("step 0\n")
  w0.forward_held(start + HOLD)
  assert sink.getvalue().endswith("step 0\n[progress 1/2]")
  w0.feed(b" done\n")
  w1.feed(b"oo] Rank 1 is connected\n")
  assert sink.getvalue().endswith("[progress 1/2] done\n") and w1.hidden == 1


def test_line_filter_hides_gloo_messages_cut_by_another_thread():
  """Two threads' messages written at once: the second line is the rest of
  the first message, which the second one cut."""
  sink = io.StringIO()
  f = LineFilter(sink, GLOO_CHATTER)
  tail = " peer ranks. Expected number of connected peer ranks is : 3\n"
  for chunk in ["before\n[Gloo] Rank ", "[Gloo] Rank 3 is connected to 3" + tail, "2",
                " is connected to 3" + tail, "[Gloo] Rank 0 is connected to 3" + tail,
                "after\n", "[progress]"]:
    f.feed(chunk.encode())
  f.close()
  assert sink.getvalue() == "before\nafter\n[progress]" and f.hidden == 3


def test_slurm_job_is_detected(tmp_path):
  """Without the launcher, under srun: initialize() hands over to JAX's SLURM
  detection (coordinator = first node of the step, JAX_COORDINATOR_PORT)."""
  script = _script(tmp_path, """
      from fsdp_jax import distributed
      info = distributed.initialize()
      import jax
      distributed.monitored_barrier("up", timeout=60)
      print(f"slurm rank {info.rank} of {info.world_size} source {info.source} "
            f"local {info.local_rank} devices {jax.device_count()}", flush=True)
  """)
  port = free_port()
  envs = []
  for r in range(2):
    env = subprocess_env()
    env.update(SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
               SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS_PER_NODE="2",
               JAX_COORDINATOR_PORT=str(port), FSDP_JAX_DEVICES_PER_PROC="2",
               FSDP_JAX_PLATFORM="cpu", FSDP_JAX_PEER_TIMEOUT="10")
    envs.append(env)
  group = WorkerGroup([sys.executable, script], envs, ranks=[0, 1], log_dir=str(tmp_path),
                      die_with_parent=False).start()
  results = group.wait(timeout=90)
  logs = [(tmp_path / f"rank{r}.log").read_text(errors="replace") for r in range(2)]
  assert [r.returncode for r in results] == [0, 0], logs
  for r in range(2):
    assert f"slurm rank {r} of 2 source cluster local {r} devices 4" in logs[r], logs[r]


# --------------------------------------------------------------------------
# sync_module_states


def test_sync_module_states_starts_every_process_from_process_0(tmp_path):
  out = tmp_path / "sync.json"
  run = Background(_launcher("--nproc", "2", "--devices-per-proc", "2", "--platform", "cpu",
                              WORKER, "sync", "--out", str(out)),
                    tmp_path / "launcher.log", timeout=240)
  code = run.wait()
  assert code == 0, run.output()[-4000:]
  seen = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
  import numpy as np
  sys.path.insert(0, str(REPO / "tests"))
  from mp_worker import flat, np_params
  p0 = flat(np_params(seed=0))
  for r in (0, 1):
    synced = seen[r]["True"]
    for k, v in p0.items():
      np.testing.assert_array_equal(np.asarray(synced["params"][k]), v)
    assert synced["stat"] == [0.0, 0.0, 0.0]  # process 0's model state everywhere
  # Without the option, the processes' different host values are not
  # reconciled: process 1's own model state stays on its devices.
  assert seen[1]["False"]["stat"] == [1.0, 1.0, 1.0]


# --------------------------------------------------------------------------
# A busy --master-port, and who can reach the coordinator


def test_launcher_refuses_busy_master_port(capsys):
  with socket.socket() as squatter:
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    with pytest.raises(SystemExit) as e:
      launch.main(["--nproc", "2", "--master-port", str(port), WORKER])
  assert e.value.code == 2
  err = capsys.readouterr().err
  assert "error: Fix: pass another --master-port, or leave it out to get a free port" in err
  assert f"--master-port {port}: the coordinator cannot listen on 127.0.0.1:{port}: " \
         "address already in use" in err, err


def test_worker_names_busy_coordinator_port(tmp_path):
  """Started without the launcher's check: process 0 says 'address already
  in use' with the fix, at once, instead of JAX's 'Failed to start RPC
  server' under a claim of a 300 s wait."""
  script = _script(tmp_path, """
      from fsdp_jax import distributed
      distributed.initialize()
  """)
  with socket.socket() as squatter:
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    port = squatter.getsockname()[1]
    env = worker_env(rank=0, world_size=2, local_rank=0, local_world_size=2,
                     master_addr="127.0.0.1", master_port=port, devices_per_proc=1,
                     platform="cpu", base=subprocess_env())
    start = time.monotonic()
    proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                          timeout=120)
    took = time.monotonic() - start
  assert proc.returncode == 1
  err = proc.stderr
  assert re.search(r"RuntimeError: Fix: choose another port .* Process 0 could not start "
                   rf"JAX's coordination service on 127\.0\.0\.1:{port}: address already in use",
                   err), err
  assert "300 s" not in err and "raise FSDP_JAX_INIT_TIMEOUT" not in err, err
  assert "The above exception was the direct cause" not in err  # no JAX traceback
  assert took < 60


def listening_sockets(pids) -> list[tuple[int, str, int]]:
  """``(pid, ip, port)`` of every TCP socket in LISTEN state owned by
  ``pids``, from /proc/net/tcp and tcp6 (IPv4-mapped IPv6 shown as IPv4)."""
  owner = {}
  for pid in pids:
    for fd in os.listdir(f"/proc/{pid}/fd"):
      try:
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
      except OSError:
        continue
      if target.startswith("socket:["):
        owner[target[len("socket:["):-1]] = pid
  out = []
  for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
    for line in Path(table).read_text().splitlines()[1:]:
      fields = line.split()
      local, state, inode = fields[1], fields[3], fields[9]
      if state != "0A" or inode not in owner:  # 0A: LISTEN
        continue
      hex_ip, hex_port = local.split(":")
      raw = bytes.fromhex(hex_ip)
      # The kernel prints the address as 32-bit words in host (little-endian) order.
      raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
      ip = ipaddress.ip_address(raw)
      if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
      out.append((owner[inode], str(ip), int(hex_port, 16)))
  return out


@pytest.mark.parametrize("where", ["one-machine", "master-addr"])
def test_coordinator_listens_only_where_it_must(tmp_path, where):
  """A one-machine launch: JAX's coordination service (unauthenticated gRPC)
  listens on 127.0.0.1 only, not on every interface as JAX's default
  ``[::]:PORT`` would. With --master-addr set to another address of this
  machine: on that address only. The test talks only to loopback: the other
  address is 127.0.0.2, which Linux routes to ``lo`` as it routes
  127.0.0.0/8, and which is not the default 127.0.0.1, so the same rule is
  tested as with a network interface's address."""
  extra = []
  expect = "127.0.0.1"
  if where == "master-addr":
    expect = "127.0.0.2"
    extra = ["--master-addr", expect]
  go = tmp_path / "go"
  script = _script(tmp_path, f"""
      import json, os, time
      from fsdp_jax import distributed
      info = distributed.initialize()
      import jax.numpy as jnp
      from jax.experimental import multihost_utils
      multihost_utils.process_allgather(jnp.ones(()))  # gloo connects its pairs
      # One write per line: both workers share the launcher's stdout.
      os.write(1, ("READY " + json.dumps(dict(pid=os.getpid(), rank=info.rank,
                                              address=info.coordinator_address,
                                              bind=info.coordinator_bind_address))
                   + "\\n").encode())
      deadline = time.monotonic() + 60
      while not os.path.exists({str(go)!r}) and time.monotonic() < deadline:
        time.sleep(0.05)
      # No distributed.shutdown(): one more clean exit without it (see
      # test_exit_without_shutdown_is_clean).
  """)
  log = tmp_path / "launcher.log"
  run = Background(_launcher("--nproc", "2", "--devices-per-proc", "1", "--platform", "cpu",
                              *extra, script), log, timeout=120)
  try:
    ready = {}
    deadline = time.monotonic() + 90
    while len(ready) < 2 and time.monotonic() < deadline and run.proc.poll() is None:
      for m in re.finditer(r"READY (\{[^{}]*\})", run.output()):
        seen = json.loads(m.group(1))
        ready[seen["rank"]] = seen
      time.sleep(0.1)
    assert len(ready) == 2, run.output()[-3000:]
    port = int(ready[0]["address"].rsplit(":", 1)[1])
    assert ready[0]["address"] == f"{expect}:{port}"
    assert ready[0]["bind"] == f"{expect}:{port}"
    sockets = listening_sockets([ready[0]["pid"], ready[1]["pid"]])
  finally:
    go.write_text("")
  assert run.wait() == 0, run.output()[-3000:]
  on_port = [(pid, ip) for pid, ip, p in sockets if p == port]
  assert on_port == [(ready[0]["pid"], expect)], (port, sockets)
  # Nothing of the job listens on every interface (gloo, CPU collectives,
  # listens on the address of this machine's host name).
  host_ip = socket.gethostbyname(socket.gethostname())
  for pid, ip, p in sockets:
    assert ip not in ("0.0.0.0", "::"), sockets
    assert ip in (expect, host_ip, "127.0.0.1"), sockets
  print(f"\nlistening: {sockets}")


def test_bind_address_rules(monkeypatch):
  monkeypatch.delenv("JAX_COORDINATOR_BIND_ADDRESS", raising=False)
  assert cluster.default_coordinator_bind_address("localhost:29500") == "127.0.0.1:29500"
  assert cluster.default_coordinator_bind_address("[::1]:29500") == "[::1]:29500"
  # A host name that resolves to loopback (Debian maps the host name to
  # 127.0.1.1) while other machines must connect: refused with the fix.
  with pytest.raises(ValueError, match=(
      r"^Fix: give the coordinator this machine's network address .* 'node0' resolves to "
      r"127\.0\.1\.1 on this machine, a loopback address, but 2 of the 4 processes run on "
      r"other machines")):
    cluster.check_bind_address("127.0.1.1:29500", "node0:29500", 4, 2)
  cluster.check_bind_address("127.0.1.1:29500", "node0:29500", 2, 2)  # one machine
  cluster.check_bind_address("127.0.0.1:29500", "127.0.0.1:29500", 4, 2)  # meant
  monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", "0.0.0.0:29500")
  assert cluster.default_coordinator_bind_address("node0:29500") == "0.0.0.0:29500"
  cluster.check_bind_address("127.0.1.1:29500", "node0:29500", 4, 2)  # user's choice
