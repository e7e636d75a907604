#!/usr/bin/env bash
# The GPU run, in one go, on a machine with one or more NVIDIA GPUs:
#   1. what the machine has: nvidia-smi, python, jax/jaxlib and whether a CUDA
#      jaxlib plugin is installed (if JAX finds no GPU, it tries
#      `pip install "jax[cuda13]"` and says what that did);
#   2. benchmarks/gpu.py (~1B GPT, bf16, FULL_SHARD next to plain jax.jit)
#      under XLA's defaults;
#   3. the GPU-relevant tests on the GPU (FSDP_JAX_TEST_DEVICES=native: a
#      test whose mesh needs more devices than the machine has is skipped);
#   4. benchmarks/gpu_collectives.py: the dtype a bf16 reduce-scatter over 8
#      GPUs compiles to, on JAX's mock GPU topology;
#   5. benchmarks/gpu.py again with MaxText's H100 XLA options;
#   6. benchmarks/gpu_overhead.py: fsdp_jax's step variants against plain jit,
#      with a kernel-time split of each;
#   7. pretrained weights on the GPU: tests/test_pretrained.py, and
#      benchmarks/pretrained.py --platform gpu (load and save of a Llama in
#      Hugging Face's layout, against load_file + device_put);
#   8. the planner's calibration: `python -m benchmarks planner --gpu`, the
#      estimate (with the GPU measured by DeviceSpec's measure_local) against
#      the compiled peak and the measured step of each configuration whose
#      mesh the machine has (planner-gpu.json).
# STAGES picks stages by name (default: all of them, in this order):
#   machine default tests collectives maxtext overhead pretrained planner
# Wheels under $WHEELS (default ./gpu_wheels), if any, are installed first
# with --no-index (the machine may reach no package index).
# Each stage has its own time limit so that a slow one cannot starve the
# others; the whole run took about 5 minutes on one H100 (benchmarks/GPU.md).
# Everything is written to $OUT (default ./gpu_out): session.log,
# GPU-default.{md,json}, GPU-maxtext.{md,json}, tests.log, collectives.json,
# overhead.json.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_session.sh
#   OUT=/tmp/gpu STAGES="machine tests pretrained" bash benchmarks/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="$OUT/session.log"
SIZE=${SIZE:-1b}
STAGES=" ${STAGES:-machine default tests collectives maxtext overhead pretrained planner} "
WHEELS=${WHEELS:-$PWD/gpu_wheels}
stage() { echo "== $1 ($(date +%T))" >>"$LOG"; }
want() { [[ "$STAGES" == *" $1 "* ]]; }

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  stage "wheels"
  "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl >>"$LOG" 2>&1
  echo "installed $(ls "$WHEELS") (exit $?)" >>"$LOG"
fi

if want machine; then
stage "machine"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
  "$PY" - <<'PYEOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
             "jax-cuda12-pjrt", "flax", "optax", "orbax-checkpoint", "chex", "pytest-xdist"):
  try:
    print(f"{name} {md.version(name)}")
  except md.PackageNotFoundError:
    print(f"{name}: not installed")
PYEOF
  if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")'; then
    echo "JAX finds no GPU: trying pip install 'jax[cuda13]'"
    "$PY" -m pip install -q "jax[cuda13]" && echo "installed jax[cuda13]" \
      || echo "pip install 'jax[cuda13]' failed (no package index here?)"
  fi
  "$PY" -c 'import jax; print("backend", jax.default_backend(), jax.devices())'
} >>"$LOG" 2>&1
fi

if want default; then
stage "benchmark, XLA defaults"
timeout "${T_DEFAULT:-200}" "$PY" benchmarks/gpu.py --size "$SIZE" --steps 10 --warmup 2 \
  --profile-steps 2 --out "$OUT/GPU-default.md" >>"$LOG" 2>&1
echo "exit $?" >>"$LOG"
fi

if want tests; then
stage "tests on the GPU"
FSDP_JAX_TEST_DEVICES=native XLA_PYTHON_CLIENT_PREALLOCATE=false \
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${T_TESTS:-100}" "$PY" -m pytest -q \
  -p no:cacheprovider -n 4 -rfE tests/test_one_device.py tests/test_engine.py \
  tests/test_precision_state.py tests/test_offload.py tests/test_checkpoint.py \
  >"$OUT/tests.log" 2>&1
echo "exit $?" >>"$LOG"
fi

if want collectives; then
stage "collectives of an 8-GPU mesh (mock topology)"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${T_COLL:-30}" "$PY" \
  benchmarks/gpu_collectives.py --devices 8 --out "$OUT/collectives.json" >>"$LOG" 2>&1
echo "exit $?" >>"$LOG"
fi

if want maxtext; then
stage "benchmark, MaxText options"
timeout "${T_MAXTEXT:-170}" "$PY" benchmarks/gpu.py --size "$SIZE" --steps 10 --warmup 2 \
  --profile-steps 2 --xla-options maxtext --out "$OUT/GPU-maxtext.md" >>"$LOG" 2>&1
echo "exit $?" >>"$LOG"
fi

if want overhead; then
stage "step variants against plain jit"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout "${T_OVERHEAD:-150}" "$PY" benchmarks/gpu_overhead.py \
  --size "$SIZE" --steps 8 --variants flat,orig --out "$OUT/overhead.json" >>"$LOG" 2>&1
echo "exit $?" >>"$LOG"
fi

if want pretrained; then
stage "pretrained weights: tests on the GPU"
FSDP_JAX_TEST_DEVICES=native XLA_PYTHON_CLIENT_PREALLOCATE=false \
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout "${T_PRE_TESTS:-120}" "$PY" -m pytest -q \
  -p no:cacheprovider -n 4 -rfEs tests/test_pretrained.py >"$OUT/pretrained-tests.log" 2>&1
echo "exit $?" >>"$LOG"
stage "pretrained weights: load and save into the GPU"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${T_PRE_BENCH:-150}" "$PY" \
  benchmarks/pretrained.py --platform gpu ${PRE_ARGS:-} --out "$OUT/PRETRAINED-gpu.md" \
  >>"$LOG" 2>&1
echo "exit $?" >>"$LOG"
fi
if want planner; then
stage "planner: estimate against the measured step"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout "${T_PLANNER:-240}" "$PY" -m benchmarks planner --gpu \
  >"$OUT/planner-gpu.json" 2>>"$LOG"
echo "exit $?" >>"$LOG"
fi
stage "done"
