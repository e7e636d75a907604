"""The benchmarks run: each measurement at a tiny size (1-2 layers, d_model 32 or 64)
on the simulated CPU devices. Nothing about speed or memory is asserted here
(benchmarks/ reports those); only that every measurement runs and prints or
writes its table.

The measurements run in this process, through ``python -m benchmarks``'s own
dispatch (``benchmarks.__main__.main``), on the test session's 8 devices and
compilation cache; one test runs the command in a fresh process. The
measurements that start a fresh process per setting (``flags`` and
``causes``: each setting is a set of process-wide XLA flags or an allocator;
``init_time``: a cold process per model) run their children here too: a
child's code is the same whatever its process's flags, and a child whose
arguments repeat one already run returns that run's result, as the parent
would read it (through JSON).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import __main__ as bench_main
from benchmarks import fresh, measure
from tests.helpers import REPO, subprocess_env

pytestmark = pytest.mark.slow

TINY = ["--only", "fsdp/FULL_SHARD/fp32,jax_native/fp32", "--layers", "1",
        "--d-model", "32", "--heads", "2", "--seq-len", "8", "--vocab", "64", "--rounds", "1",
        "--no-torch"]


@pytest.fixture
def children_here(monkeypatch):
  """``fresh.run_child`` runs the child's ``main(args + ["--child"])`` in this
  process and returns what it reports, once per distinct argument list."""
  done = {}

  def run_child(script, args, *, label, xla_flags="", extra_env=None):  # pylint: disable=unused-argument
    key = (Path(script).stem, tuple(args))
    if key not in done:
      module = __import__(f"benchmarks.{key[0]}", fromlist=["main"])
      reported = []
      with monkeypatch.context() as m:
        m.setattr(fresh, "report", reported.append)
        module.main([*args, "--child"])
      assert len(reported) == 1, (label, reported)
      done[key] = json.dumps(reported[0])
    return json.loads(done[key])

  monkeypatch.setattr(fresh, "run_child", run_child)
  return done


@pytest.fixture(scope="module")
def one_build():
  """``measure``'s measurements share one build of their settings: the four
  read memory, collectives, compile times and step times off the same
  compiled steps (what ``python -m benchmarks all`` does in one process),
  so the settings are built and compiled once per argument list."""
  built, setup = {}, measure._setup  # pylint: disable=protected-access

  def shared(argv, what):
    key = tuple(argv)
    if key not in built:
      built[key] = setup(argv, what)
    return built[key]

  with pytest.MonkeyPatch.context() as m:
    m.setattr(measure, "_setup", shared)
    yield built


def _run(capsys, *args):
  assert bench_main.main(list(args)) == 0
  return capsys.readouterr().out


@pytest.mark.parametrize("name,header", [
    ("memory", "| setting | total MiB |"),
    ("collectives", "| setting | collective | ops per step |"),
    ("compile_time", "| setting | lower s | compile s |"),
    ("step_time", "| setting | best step ms |"),
])
def test_single_measurement_prints_its_table(capsys, one_build, name, header):
  out = _run(capsys, name, *TINY)
  assert len(one_build) == 1
  assert header in out, out[-3000:]
  assert "| fsdp/FULL_SHARD/fp32 |" in out and "| jax_native/fp32 |" in out, out[-3000:]


def test_full_run_writes_the_report(tmp_path):
  md, js = tmp_path / "RESULTS.md", tmp_path / "results.json"
  out = subprocess.run(
      [sys.executable, "-m", "benchmarks", "all", *TINY, "--quick", "--no-state-scaling",
       "--out", str(md), "--json", str(js)], cwd=REPO, capture_output=True, text=True,
      timeout=300, env=subprocess_env(JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  text = md.read_text()
  assert text.startswith("# fsdp_jax benchmark results"), text[:300]
  assert "fsdp/FULL_SHARD/fp32" in text and js.stat().st_size > 0


@pytest.mark.parametrize("name,args,header,children", [
    ("flags", ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "8",
               "--global-batch", "8", "--steps", "1", "--warmup", "1", "--repeats", "1"],
     "| XLA_FLAGS | step compiled with |", 1),
    ("init_time", ["--depths", "2", "--d-model", "64", "--repeats", "1"],
     "| blocks | parameters | units |", 2),
    ("causes", ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "8",
                "--global-batch", "8", "--steps", "1", "--warmup", "1", "--repeats", "1"],
     "| allocator | setting | step ms |", 1),
    ("handwritten", ["--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "8",
                     "--batch-per-device", "1", "--rounds", "1", "--warmup", "0"],
     "| sequences per device | operations |", 0),
    ("scan", ["--depths", "1", "2", "--d-model", "32", "--heads", "2", "--seq-len", "8",
              "--rounds", "1", "--time-depth", "1"], "| layers | one layer MiB |", 0),
])
def test_measurement_writes_its_table(tmp_path, capsys, children_here, name, args, header,
                                      children):
  out = tmp_path / "table.md"
  _run(capsys, name, *args, "--out", str(out))
  text = out.read_text()
  assert header in text, text[-3000:]
  assert len(children_here) == children, sorted(children_here)


def test_unknown_measurement_lists_the_names():
  out = subprocess.run([sys.executable, "-m", "benchmarks", "nope"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=subprocess_env())
  assert out.returncode == 2 and "memory" in out.stdout and "nope" in out.stderr


def test_every_mutant_still_matches_the_code(capsys):
  """Each mutation check (benchmarks/MUTANTS.md) names a line that the code
  still holds exactly once, so ``python -m benchmarks mutants`` mutates what
  it says it does."""
  from benchmarks import mutants  # pylint: disable=import-outside-toplevel
  out = _run(capsys, "mutants", "--list")
  assert out.count(": fsdp_jax/") == len(mutants.MUTANTS) >= 12, out


def test_op_breakdown_counts_what_moves():
  """In-place updates move their update, slices what they keep, a loop body
  counts its trip count times, and barriers are counted, not sized."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel
  from benchmarks import hlo_stats  # pylint: disable=import-outside-toplevel

  def f(buf, x):
    def body(i, b):
      return lax.dynamic_update_slice_in_dim(b, x * i.astype(x.dtype), i * 4, axis=0)
    buf = lax.fori_loop(0, 3, body, buf)
    y = lax.optimization_barrier(buf[:8])
    return y

  text = jax.jit(f, donate_argnums=0).lower(jnp.zeros(1024), jnp.ones(4)).compile().as_text()
  out = hlo_stats.op_breakdown(text)
  assert out["optimization barriers"] == {"ops": 1, "bytes": 0.0}, out
  # Three in-place updates (the loop's trip count) of 16 B and a 4 B index,
  # each read and written, not the 4 KiB buffer they land in.
  assert out["packing (concatenate, pad, update-slice)"] == {"ops": 3, "bytes": 3 * 2 * 20}, out
  # The slice keeps 8 floats: read and written.
  assert out["slices (unpacking)"] == {"ops": 1, "bytes": 2 * 8 * 4}, out
  assert hlo_stats.dot_types(jax.jit(lambda a, b: a @ b).lower(
      jnp.ones((4, 4), jnp.bfloat16), jnp.ones((4, 4), jnp.bfloat16)).compile().as_text())


def test_tensor_parallel_routes_are_measured(tmp_path, capsys):
  """Both ways of running the tensor axis compile, agree with one device,
  and are counted per axis."""
  out = tmp_path / "routes.json"
  _run(capsys, "tp_routes", "--d", "16", "--f", "32", "--tokens", "16", "--out", str(out))
  routes = json.loads(out.read_text())["routes"]
  assert len(routes) == 2
  for r in routes.values():
    assert r["grad_rel_err"] < 1e-3 and "shard all-gather" in r["collectives"]
