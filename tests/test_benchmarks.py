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
