#!/usr/bin/env python
"""Why SHARD_GRAD_OP and bf16 are slower than FULL_SHARD fp32 on this CPU.

Two hypotheses, each tested by changing only its cause:

* **Fresh temporaries.** XLA's CPU runtime allocates an execution's
  temporaries anew each step; above glibc's mmap threshold that is a fresh
  mapping the kernel faults in and zeroes page by page. A strategy with more
  temporaries (SHARD_GRAD_OP keeps every gathered unit until backward) pays
  more of that. Test: the same programs with glibc told to keep freed memory
  for reuse (``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=...:
  glibc.malloc.trim_threshold=...``, read at process start): if the
  temporaries are the cause, the page faults go and SHARD_GRAD_OP's gap
  with them.
* **bf16 dots run in f32.** XLA's CPU backend converts bf16 dot operands to
  f32 (it has no bf16 dot kernel here), so bf16 mixed precision adds
  converts and saves only gather bytes. Test: count the dots by operand type
  in the compiled step, and time a plain single-device ``jax.jit`` step in
  bf16 against fp32: if the backend is the cause, plain JAX pays the same.
  bf16 runs with ``reduce_dtype`` fp32 (the benchmark suite's setting) and
  bf16 (PyTorch's common ``MixedPrecision(param_dtype=bf16,
  reduce_dtype=bf16)``).

Each (setting, allocator) pair runs in a fresh process; the settings of one
process alternate step by step. Writes ``benchmarks/CAUSES.md``.

    python benchmarks/causes.py                  # ~4 min on 2 cores
    python benchmarks/causes.py --d-model 64 --layers 2 --steps 2 --out /tmp/CAUSES.md
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks import fresh  # noqa: E402  (starts no backend)

# Large enough that every temporary buffer of the step stays on the heap
# (the threshold's maximum on 64-bit glibc is 32 MiB), and freed memory is
# never returned to the kernel.
REUSE = ("glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967295:"
         "glibc.malloc.top_pad=268435456")
ALLOCATORS = {"default": None, "reuse freed memory": REUSE}
SETTINGS = ("FULL_SHARD fp32", "SHARD_GRAD_OP fp32", "FULL_SHARD bf16",
            "FULL_SHARD bf16 bf16-reduce", "plain jit fp32", "plain jit bf16")
N_FSDP = 4  # the first four settings are fsdp_jax's


def _child(args) -> dict:
  jax = fresh.start_jax(args.devices)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  from benchmarks import hlo_stats  # pylint: disable=import-outside-toplevel
  from benchmarks.common import make_batch  # pylint: disable=import-outside-toplevel
  from benchmarks.models import Block  # pylint: disable=import-outside-toplevel

  cfg, init_fn, loss_fn = fresh.gpt(args, args.layers)
  batch = {k: jnp.asarray(v) for k, v in make_batch(cfg, args.global_batch).items()}
  opt = optax.adamw(1e-3)
  bf16 = jnp.bfloat16
  runs, info = {}, {}

  def compiled_info(name, compiled):
    ma = compiled.memory_analysis()
    info[name] = {"temp_bytes": int(ma.temp_size_in_bytes),
                  "dots": hlo_stats.dot_types(compiled.as_text())}

  mesh = fsdp_jax.make_mesh(shard=args.devices)
  for name in SETTINGS[:N_FSDP]:
    strategy, precision = name.split()[:2]
    reduce = bf16 if name.endswith("bf16-reduce") else jnp.float32
    mp = (fsdp_jax.MixedPrecision(param_dtype=bf16, reduce_dtype=reduce)
          if precision == "bf16" else None)
    config = fsdp_jax.FSDPConfig(sharding_strategy=fsdp_jax.ShardingStrategy[strategy],
                                 mixed_precision=mp,
                                 auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({Block}))
    state = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0), optimizer=opt,
                                      mesh=mesh, config=config)
    step = fsdp_jax.shard_train_step(loss_fn, opt)
    compiled_info(name, step.lower(state, batch).compile())
    box = {"s": state}

    def run(step=step, box=box):
      s, m = step(box["s"], batch)
      jax.block_until_ready((s, m))
      box["s"] = s
    runs[name] = run

  dev = jax.devices()[0]
  local = jax.device_put(batch, dev)
  for name in SETTINGS[N_FSDP:]:
    dtype = bf16 if name.endswith("bf16") else jnp.float32
    params = jax.device_put(init_fn(jax.random.key(0)), dev)

    def plain_step(params, opt_state, b, dtype=dtype):
      loss, grads = jax.value_and_grad(
          lambda p: loss_fn(jax.tree.map(lambda x: x.astype(dtype), p), b))(params)
      updates, opt_state = opt.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(plain_step, donate_argnums=(0, 1))
    opt_state = opt.init(params)
    compiled_info(name, jitted.lower(params, opt_state, local).compile())
    box = {"p": (params, opt_state)}

    def run(jitted=jitted, box=box):
      p, s, loss = jitted(*box["p"], local)
      jax.block_until_ready((p, s, loss))
      box["p"] = (p, s)
    runs[name] = run

  for _ in range(args.warmup):
    for fn in runs.values():
      fn()
  times = {name: [] for name in runs}
  faults = {name: 0 for name in runs}
  for _ in range(args.steps):
    for name, fn in runs.items():
      f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
      faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
  return {name: {"step_s": statistics.median(times[name]),
                 "faults_per_step": faults[name] / args.steps, **info[name]}
          for name in runs} | {"jax": jax.__version__}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--global-batch", type=int, default=16)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--steps", type=int, default=6)
  p.add_argument("--repeats", type=int, default=2)
  p.add_argument("--out", default=os.path.join(HERE, "CAUSES.md"))
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    fresh.report(_child(args))
    return None

  child_args = ["--devices", str(args.devices), "--d-model", str(args.d_model), "--layers",
                str(args.layers), "--heads", str(args.heads), "--seq-len", str(args.seq_len),
                "--global-batch", str(args.global_batch), "--warmup", str(args.warmup),
                "--steps", str(args.steps)]
  import fsdp_jax  # pylint: disable=import-outside-toplevel  (no backend starts)
  results: dict = {a: [] for a in ALLOCATORS}
  t0 = time.perf_counter()
  for r in range(args.repeats):
    for alloc, tunables in ALLOCATORS.items():
      results[alloc].append(fresh.run_child(
          __file__, child_args, label=alloc, xla_flags=" ".join(fsdp_jax.custom.CPU_XLA_FLAGS),
          extra_env={"GLIBC_TUNABLES": tunables}))
      print(f"[{time.perf_counter() - t0:5.0f}s] repeat {r + 1}: {alloc}", flush=True)

  med = lambda alloc, name, key: statistics.median(x[name][key] for x in results[alloc])
  rows = []
  for alloc in ALLOCATORS:
    base = med(alloc, "FULL_SHARD fp32", "step_s")
    plain = med(alloc, "plain jit fp32", "step_s")
    for name in SETTINGS:
      ref = plain if name.startswith("plain") else base
      rows.append(
          f"| {alloc} | {name} | {med(alloc, name, 'step_s') * 1e3:.0f} | "
          f"{med(alloc, name, 'step_s') / ref:.2f} | "
          f"{med(alloc, name, 'faults_per_step'):,.0f} | "
          f"{results[alloc][0][name]['temp_bytes'] / 2**20:.1f} |")
  dots = []
  for name in SETTINGS:
    d = results["default"][0][name]["dots"]
    dots.append(f"| {name} | " + ", ".join(f"{k}: {v}" for k, v in sorted(d.items())) + " |")
  first = results["default"][0]
  text = "\n".join([
      "# Why SHARD_GRAD_OP and bf16 are slower on this CPU",
      "",
      f"Generated by `python benchmarks/causes.py` with jax {first['jax']}: the benchmark GPT "
      f"(d_model {args.d_model}, {args.layers} blocks), global batch {args.global_batch} x "
      f"{args.seq_len}, AdamW; fsdp_jax on {args.devices} simulated CPU devices "
      "(`fsdp_jax.custom.CPU_XLA_FLAGS`), plain `jax.jit` on one; median of "
      f"{args.steps} steps after {args.warmup} warm-up, median over {args.repeats} runs per "
      f"allocator, each in a fresh process. Machine: {os.cpu_count()} cores, load average "
      f"{os.getloadavg()[0]:.1f} at the end.",
      "",
      f"Allocators: glibc's default, and `GLIBC_TUNABLES={REUSE}` (freed memory is kept "
      "and reused: no fresh mappings per step).",
      "",
      "| allocator | setting | step ms | vs FULL_SHARD fp32 (plain: vs plain fp32) | minor "
      "page faults per step | temporaries MiB per device |",
      "|---|---|---|---|---|---|",
      *rows,
      "",
      "Dots in the compiled step by operand type (`operand -> result`):",
      "",
      "| setting | dots |",
      "|---|---|",
      *dots,
      ""])
  return fresh.write_table(args.out, text)


if __name__ == "__main__":
  main()
