"""benchmarks/gpu.py runs (on CPU, at a tiny size) and reads a profile's
collective/compute overlap correctly. The GPU numbers themselves come from
running it on a GPU (benchmarks/README.md)."""

import gzip
import json
import math
import re
import subprocess
import sys

import pytest

from benchmarks import gpu, gpu_overhead
from tests.helpers import REPO, subprocess_env


def _trace(tmp_path, events):
  d = tmp_path / "plugins" / "profile" / "run"
  d.mkdir(parents=True)
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
  with gzip.open(d / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": meta + events}, f)
  return str(tmp_path)


def test_hidden_collective_share_reads_overlap(tmp_path):
  ev = lambda name, ts, dur, pid=1: {"ph": "X", "name": name, "pid": pid, "tid": 7,
                                     "ts": ts, "dur": dur}
  trace = _trace(tmp_path, [
      ev("ncclDevKernel_AllGather_RING_LL", 0, 100),   # 0-100: compute covers 50-100
      ev("fusion.12", 50, 100),                         # 50-150
      ev("reduce-scatter.3", 200, 50),                  # 200-250: not covered
      ev("gemm_bf16", 0, 1000, pid=2),                  # a host event: ignored
  ])
  share, total, _ = gpu.hidden_collective_share(trace)
  assert total == 150 and math.isclose(share, 50 / 150)


def test_hidden_collective_share_says_when_it_cannot(tmp_path):
  trace = _trace(tmp_path, [{"ph": "X", "name": "x", "pid": 2, "tid": 1, "ts": 0, "dur": 5}])
  share, _, why = gpu.hidden_collective_share(trace)
  assert share is None and "no device" in why


def test_xplane_events_are_read_from_a_real_profile(tmp_path):
  """The fallback when the perfetto JSON holds no device kernels: the
  xplane's planes. A CPU profile has no GPU plane (None); its host plane
  shows that events are read, with times in microseconds."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  f = jax.jit(lambda x: jnp.sin(x) @ x)
  x = jnp.ones((128, 128))
  f(x).block_until_ready()
  with jax.profiler.trace(str(tmp_path)):
    f(x).block_until_ready()
  assert gpu.xplane_events(str(tmp_path)) is None
  host = gpu.xplane_events(str(tmp_path), plane_prefix="/host:CPU")
  assert host and all(isinstance(n, str) and start >= 0 and dur > 0 for n, start, dur in host)
  assert gpu.hidden_collective_share(str(tmp_path))[0] is None


def test_hidden_share_from_events():
  share, total, _ = gpu.hidden_share([("all-gather-start", 0.0, 10.0), ("fusion", 5.0, 10.0)])
  assert total == 10.0 and math.isclose(share, 0.5)


def test_mfu_inputs():
  assert gpu.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert gpu.peak_flops("NVIDIA H100 PCIe") == 756e12
  assert gpu.peak_flops("cpu") is None
  assert gpu.model_flops(10, 2, 4, 8, 100) == 6 * 10 * 100 + 12 * 2 * 4 * 8 * 100


@pytest.mark.slow
def test_runs_at_a_tiny_size_on_cpu(tmp_path):
  out_md = tmp_path / "gpu.md"
  out = subprocess.run([sys.executable, "benchmarks/gpu.py", "--size", "tiny", "--steps", "1",
                        "--warmup", "0", "--profile-steps", "1", "--seq-len", "8",
                        "--batch-per-device", "1", "--out", str(out_md)],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=subprocess_env(JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]
  text = out_md.read_text()
  for program in ("fsdp_jax FULL_SHARD", "plain jax.jit, 1 device"):
    row = re.search(rf"\| {re.escape(program)} \| ([\d.]+) \| ([\d,]+) \| [^|]+ \| ([\d,.]+) \|",
                    text)
    assert row, text
    step_ms, tok_s, mem = (float(g.replace(",", "")) for g in row.groups())
    assert step_ms > 0 and tok_s > 0 and mem > 0 and math.isfinite(step_ms)
  assert re.search(r"fsdp_jax / plain jit step time: [\d.]+", text), text
  assert "Collective time hidden behind compute (fsdp_jax): could not be measured" in text or \
      re.search(r"Collective time hidden behind compute \(fsdp_jax\): [\d.]+%", text), text
  result = json.loads((tmp_path / "gpu.json").read_text())
  assert result["params"] > 0 and result["fsdp_over_plain"] > 0


def test_top_kernels_and_the_kernel_split():
  kernels = [("nvjet_sm90_gemm", 0.0, 10.0), ("fusion_1", 10.0, 4.0), ("nvjet_sm90_gemm", 20.0, 6.0),
             ("fusion_1", 30.0, 2.0)]
  assert gpu.top_kernels(kernels, 1) == [("nvjet_sm90_gemm", 16.0, 2)]
  split = gpu_overhead.kernel_split(kernels, steps=2)
  assert split == {"gemm_ms": 16.0 / 1e3 / 2, "other_ms": 6.0 / 1e3 / 2,
                   "busy_ms": 22.0 / 1e3 / 2, "span_ms": 32.0 / 1e3 / 2, "kernels": 2.0}


def test_hidden_share_says_how_many_kernels_it_found_without_collectives():
  share, total, how = gpu.hidden_share([("fusion", 0.0, 3.0), ("gemm", 3.0, 1.0)])
  assert share is None and total == 0.0 and "among 2 device kernels" in how


def test_options_this_xla_refuses_are_dropped_and_named():
  ok, dropped = gpu.accepted_options({"xla_backend_optimization_level": 1,
                                      "xla_no_such_option_anywhere": True}, "cpu")
  assert ok == {"xla_backend_optimization_level": 1}
  assert dropped == ["xla_no_such_option_anywhere"]


@pytest.mark.slow
def test_overhead_and_collectives_scripts_run_on_cpu(tmp_path):
  out = subprocess.run([sys.executable, "benchmarks/gpu_overhead.py", "--size", "tiny",
                        "--steps", "1", "--variants", "flat,flat-noremat",
                        "--out", str(tmp_path / "o.json")],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=subprocess_env(JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads((tmp_path / "o.json").read_text())
  flat, noremat = result["variants"]["flat"], result["variants"]["flat-noremat"]
  assert flat["ratio"] > 0 and noremat["ratio"] > 0
  out = subprocess.run([sys.executable, "benchmarks/gpu_collectives.py", "--devices", "2",
                        "--cpu", "--out", str(tmp_path / "c.json")],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env=subprocess_env(JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads((tmp_path / "c.json").read_text())
  assert result["devices"] == 2 and result["psum_scatter_bf16"] == {"reduce-scatter": {"f32": 1}}
  for key in ("fsdp_step_reduce_bfloat16", "fsdp_step_reduce_float32"):
    assert set(result[key]) >= {"all-gather", "reduce-scatter"}, result[key]


@pytest.mark.slow
def test_native_device_mode_skips_meshes_larger_than_the_machine():
  """FSDP_JAX_TEST_DEVICES=native (how the GPU run tests on one GPU): on this
  machine that is one CPU device; a test that needs 2 is skipped, naming
  both counts, and one that fits runs."""
  out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-rs",
                        "-p", "no:cacheprovider", "tests/test_engine.py", "-k",
                        "test_matches_unsharded_training and (SHARD_GRAD_OP-2-flat or FULL_SHARD-1-flat)"],
                       cwd=REPO, capture_output=True, text=True, timeout=600,
                       env=subprocess_env(FSDP_JAX_TEST_DEVICES="native", JAX_PLATFORMS="cpu"))
  assert "1 passed, 1 skipped" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
  assert "1 device(s) here" in out.stdout and "needs 2 devices" in out.stdout, out.stdout[-3000:]
