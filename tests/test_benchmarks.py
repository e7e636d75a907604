"""The benchmarks run: each measurement at a tiny size (2 layers, d_model 64)
on the simulated CPU devices, in a fresh process. Nothing about speed or
memory is asserted here (benchmarks/ reports those); only that every
measurement runs and prints or writes its table."""

import subprocess
import sys

import pytest

from tests.helpers import REPO, subprocess_env

pytestmark = pytest.mark.slow

TINY = ["--only", "fsdp/FULL_SHARD/fp32,jax_native/fp32", "--layers", "2",
        "--d-model", "64", "--rounds", "1", "--no-torch"]


def _run(*args, timeout=300):
  out = subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout,
                       env=subprocess_env(JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out.stdout


@pytest.mark.parametrize("name,header", [
    ("memory", "| setting | total MiB |"),
    ("collectives", "| setting | collective | ops per step |"),
    ("compile_time", "| setting | lower s | compile s |"),
    ("step_time", "| setting | best step ms |"),
])
def test_single_measurement_prints_its_table(name, header):
  out = _run(name, *TINY)
  assert header in out, out[-3000:]
  assert "| fsdp/FULL_SHARD/fp32 |" in out and "| jax_native/fp32 |" in out, out[-3000:]


def test_full_run_writes_the_report(tmp_path):
  md, js = tmp_path / "RESULTS.md", tmp_path / "results.json"
  _run("all", *TINY, "--quick", "--no-state-scaling", "--out", str(md), "--json", str(js))
  text = md.read_text()
  assert text.startswith("# fsdp_jax benchmark results"), text[:300]
  assert "fsdp/FULL_SHARD/fp32" in text and js.stat().st_size > 0


@pytest.mark.parametrize("name,args,header", [
    ("flags", ["--d-model", "64", "--layers", "2", "--steps", "1", "--warmup", "1",
               "--repeats", "1"], "| XLA_FLAGS | step compiled with |"),
    ("init_time", ["--depths", "2", "--d-model", "64", "--repeats", "1"],
     "| blocks | parameters | units |"),
    ("causes", ["--d-model", "64", "--layers", "2", "--steps", "1", "--warmup", "1",
                "--repeats", "1"], "| allocator | setting | step ms |"),
    ("handwritten", ["--d-model", "64", "--layers", "2", "--heads", "2",
                     "--batch-per-device", "1", "--rounds", "1", "--warmup", "1"],
     "| sequences per device | operations |"),
    ("scan", ["--depths", "2", "3", "--d-model", "64", "--heads", "2", "--rounds", "1",
              "--time-depth", "2"], "| layers | one layer MiB |"),
])
def test_measurement_writes_its_table(tmp_path, name, args, header):
  out = tmp_path / "table.md"
  _run(name, *args, "--out", str(out), timeout=600)
  text = out.read_text()
  assert header in text, text[-3000:]


def test_unknown_measurement_lists_the_names():
  out = subprocess.run([sys.executable, "-m", "benchmarks", "nope"], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env=subprocess_env())
  assert out.returncode == 2 and "memory" in out.stdout and "nope" in out.stderr


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


def test_tensor_parallel_routes_are_measured(tmp_path):
  """Both ways of running the tensor axis compile, agree with one device,
  and are counted per axis."""
  import json
  out = tmp_path / "routes.json"
  _run("tp_routes", "--d", "16", "--f", "32", "--tokens", "16", "--out", str(out))
  routes = json.loads(out.read_text())["routes"]
  assert len(routes) == 2
  for r in routes.values():
    assert r["grad_rel_err"] < 1e-3 and "shard all-gather" in r["collectives"]
