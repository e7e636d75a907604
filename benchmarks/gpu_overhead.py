#!/usr/bin/env python
"""Where fsdp_jax's step spends time that plain ``jax.jit`` does not, on one
GPU: the GPU benchmark's model (``benchmarks/gpu.py``) under several
variants of the step, each timed alternating with the same plain ``jax.jit``
program in one process, and a profile of each split into matmul kernels,
other kernels and the gaps between them.

    python benchmarks/gpu_overhead.py --size 1b --out gpu_overhead.json
    python benchmarks/gpu_overhead.py --size tiny --steps 2   # smoke run (CPU works)

Variants:
* ``flat``: the default step (FULL_SHARD, flat parameters);
* ``orig``: ``use_orig_params=True`` (no flat packing and unpacking);
* ``flat-save``: the step's remat saves every residual but the gathers
  (instead of recomputing elementwise operations in backward);
* ``flat-noremat``: no remat at all (each unit's gather kept for backward);
* ``orig-save``: ``use_orig_params=True`` and the saving remat.
The ``-save`` and ``-noremat`` variants replace engine functions for the
duration of the variant: they measure what a change would buy.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks import gpu  # noqa: E402  pylint: disable=wrong-import-position

VARIANTS = ("flat", "flat-save", "flat-noremat", "orig", "orig-save")
GEMM = re.compile(r"nvjet|gemm|cutlass|cublas|xmma|sm90_|dot", re.I)


def kernel_split(kernels, steps):
  """Per step: matmul kernel ms, other kernel ms, busy ms (union of kernel
  intervals), first-to-last span ms, kernel count."""
  gemm = sum(d for n, _, d in kernels if GEMM.search(n))
  total = sum(d for _, _, d in kernels)
  busy = sum(b - a for a, b in gpu._intervals([{"ts": t, "dur": d} for _, t, d in kernels]))  # pylint: disable=protected-access
  span = max(t + d for _, t, d in kernels) - min(t for _, t, _ in kernels)
  return {"gemm_ms": gemm / 1e3 / steps, "other_ms": (total - gemm) / 1e3 / steps,
          "busy_ms": busy / 1e3 / steps, "span_ms": span / 1e3 / steps,
          "kernels": len(kernels) / steps}


def profile(fn, steps):
  trace_dir = tempfile.mkdtemp(prefix="fsdp_jax_overhead_")
  try:
    import jax  # pylint: disable=import-outside-toplevel
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
      for _ in range(steps):
        fn()
    kernels, _ = gpu.trace_kernels(trace_dir)
  except Exception as e:  # pylint: disable=broad-except
    return {"error": repr(e)[:300]}
  if not kernels:
    return {"error": "no device kernels in the trace"}
  out = kernel_split(kernels, steps)
  out["top"] = gpu.top_kernels(kernels, 8)
  return out


@contextlib.contextmanager
def patched(variant):
  from fsdp_jax._src import collectives, grads  # pylint: disable=import-outside-toplevel
  saved = (collectives.remat_policy, grads._maybe_remat)  # pylint: disable=protected-access
  if variant.endswith("-save"):
    collectives.remat_policy = collectives.save_all_but_gathers
  if variant.endswith("-noremat"):
    grads._maybe_remat = lambda local, plan: local  # pylint: disable=protected-access
  try:
    yield
  finally:
    collectives.remat_policy, grads._maybe_remat = saved  # pylint: disable=protected-access


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--size", choices=sorted(gpu.SIZES), default="1b")
  p.add_argument("--steps", type=int, default=8)
  p.add_argument("--variants", default=",".join(VARIANTS))
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)

  import jax  # pylint: disable=import-outside-toplevel
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  if fsdp_jax.distributed.detect_platform() == "cpu":
    fsdp_jax.simulate_cpu_devices(1)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from benchmarks.common import GPTConfig, make_batch  # pylint: disable=import-outside-toplevel
  from benchmarks.models import Block, make_model  # pylint: disable=import-outside-toplevel

  d, layers, heads, vocab, seq, bpd = gpu.SIZES[args.size]
  cfg = GPTConfig(vocab_size=vocab, seq_len=seq, d_model=d, num_layers=layers, num_heads=heads)
  dev = jax.devices()[0]
  _, init_fn, loss_fn = make_model(cfg)
  opt = optax.adamw(3e-4, weight_decay=0.1)
  bf16 = jnp.bfloat16
  batch = make_batch(cfg, bpd)
  mesh = fsdp_jax.make_mesh(shard=1, devices=[dev])

  # The plain program, alive for the whole run.
  params = jax.device_put(init_fn(jax.random.key(0)), dev)
  local = jax.device_put(batch, dev)

  def plain_step(params, opt_state, b):
    loss, g = jax.value_and_grad(lambda p, b: loss_fn(jax.tree.map(lambda x: x.astype(bf16), p),
                                                      b))(params, b)
    updates, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  plain = jax.jit(plain_step, donate_argnums=(0, 1)).lower(
      params, opt.init(params), local).compile()
  pm = plain.memory_analysis()
  pbox = {"p": (params, opt.init(params))}

  def run_plain():
    a, b, loss = plain(*pbox["p"], local)
    jax.block_until_ready((a, b, loss))
    pbox["p"] = (a, b)

  for _ in range(2):
    run_plain()
  result = {"device_kind": dev.device_kind, "jax": jax.__version__, "size": args.size,
            "plain": {"compiled_bytes": pm.argument_size_in_bytes + pm.temp_size_in_bytes
                      + pm.output_size_in_bytes - pm.alias_size_in_bytes,
                      "profile": profile(run_plain, 2)},
            "variants": {}}

  def run_variant(variant, t_start):
    with patched(variant):
      config = fsdp_jax.FSDPConfig(
          auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({Block}),
          use_orig_params=variant.startswith("orig"),
          mixed_precision=fsdp_jax.MixedPrecision(param_dtype=bf16, reduce_dtype=jnp.float32))
      state = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0), optimizer=opt,
                                        mesh=mesh, config=config)
      step = fsdp_jax.shard_train_step(loss_fn, opt)
      ma = step.lower(state, batch).compile().memory_analysis()
      box = {"s": state}

      def run_fsdp():
        s, m = step(box["s"], batch)
        jax.block_until_ready((s, m))
        box["s"] = s

      for _ in range(2):
        run_fsdp()
      times = {"fsdp": [], "plain": []}
      for _ in range(args.steps):
        for name, fn in (("fsdp", run_fsdp), ("plain", run_plain)):
          t0 = time.perf_counter()
          fn()
          times[name].append(time.perf_counter() - t0)
      med = {k: statistics.median(v) for k, v in times.items()}
      result["variants"][variant] = {
          "fsdp_ms": med["fsdp"] * 1e3, "plain_ms": med["plain"] * 1e3,
          "ratio": med["fsdp"] / med["plain"],
          "compiled_bytes": ma.argument_size_in_bytes + ma.temp_size_in_bytes
          + ma.output_size_in_bytes - ma.alias_size_in_bytes,
          "profile": profile(run_fsdp, 2), "seconds": time.perf_counter() - t_start}
      print(variant, json.dumps({k: v for k, v in result["variants"][variant].items()
                                 if k != "profile"}), flush=True)

  for variant in args.variants.split(","):
    t_start = time.perf_counter()
    try:
      run_variant(variant, t_start)
    except Exception as e:  # pylint: disable=broad-except  (an OOM costs one row)
      result["variants"][variant] = {"error": repr(e)[:500]}
      print(variant, "failed:", repr(e)[:500], flush=True)
    jax.clear_caches()
    gc.collect()
    if args.out:  # after each variant: a run cut short keeps what it measured
      with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)

  plain_prof = result["plain"]["profile"]
  print("variant | fsdp ms | plain ms | ratio | MiB | gemm ms | other ms | busy ms | span ms")
  print(f"plain | | | | {result['plain']['compiled_bytes'] / 2**20:.0f} | "
        + " | ".join(f"{plain_prof.get(k, float('nan')):.1f}"
                     for k in ("gemm_ms", "other_ms", "busy_ms", "span_ms")))
  for v, r in result["variants"].items():
    if "error" in r:
      print(f"{v} | failed: {r['error'][:200]}")
      continue
    prof = r["profile"]
    print(f"{v} | {r['fsdp_ms']:.1f} | {r['plain_ms']:.1f} | {r['ratio']:.3f} | "
          f"{r['compiled_bytes'] / 2**20:.0f} | "
          + " | ".join(f"{prof.get(k, float('nan')):.1f}"
                       for k in ("gemm_ms", "other_ms", "busy_ms", "span_ms")))
  return result


if __name__ == "__main__":
  main()
