#!/usr/bin/env python
"""How long ``init_train_state(init_fn=...)`` takes against a plain jit init.

For GPTs of increasing depth (the benchmark GPT, one FSDP unit per block),
each measurement in a fresh process (JAX's caches are per process; the
persistent compilation cache is off):

* plain: ``jax.jit(init_fn)(rng)`` on one device (what an unsharded user
  runs), and that plus ``jax.jit(optimizer.init)`` (an unsharded train state);
* fsdp_jax: ``init_train_state(init_fn=..., optimizer=...)`` on 8 simulated
  devices, FULL_SHARD: the parameters (packed into their shards), the
  optimizer state on the shards and the step counter;

all wall-clock seconds from the call to the arrays being ready, tracing and
compiling included. Also the init programs' peak bytes per device
(``memory_analysis()``) against the model's size: no device may hold the
whole model. Writes ``benchmarks/INIT.md``.

    python benchmarks/init_time.py                        # ~1.5 min on 2 cores
    python benchmarks/init_time.py --depths 2 4 --d-model 64 --out /tmp/INIT.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from benchmarks import fresh  # noqa: E402  (starts no backend)


def _child(args) -> dict:
  jax = fresh.start_jax(args.devices)
  import optax  # pylint: disable=import-outside-toplevel
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  from fsdp_jax._src import unit_init  # pylint: disable=import-outside-toplevel
  from benchmarks.models import Block, count_params  # pylint: disable=import-outside-toplevel

  _, init_fn, _ = fresh.gpt(args, args.depth)
  opt = optax.adamw(1e-3)
  rng = jax.random.key(0)
  out = {"jax": jax.__version__}
  if args.mode == "plain":
    t0 = time.perf_counter()
    params = jax.block_until_ready(jax.jit(init_fn)(rng))
    out["params_s"] = time.perf_counter() - t0
    jax.block_until_ready(jax.jit(opt.init)(params))
    out["with_opt_s"] = time.perf_counter() - t0
    out["params"] = count_params(params)
    out["param_bytes"] = sum(x.nbytes for x in jax.tree.leaves(params))
    return out
  mesh = fsdp_jax.make_mesh(shard=args.devices)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({Block}))
  t0 = time.perf_counter()
  state = jax.block_until_ready(fsdp_jax.init_train_state(
      init_fn=init_fn, rng=rng, optimizer=opt, mesh=mesh, config=config))
  out["fsdp_s"] = time.perf_counter() - t0
  out["units"] = len(state.plan.units)
  # The init programs' peak per device (compiled again, not timed).
  program = unit_init.init_program(state.plan, init_fn, (rng,))
  out["init_peak_bytes"] = program.peak_bytes(rng)
  out["init_programs"] = program.num_programs
  out["largest_unit_bytes"] = max(
      sum(state.plan.leaves[i].numel * 4 for i in u.leaf_ids) for u in state.plan.units)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--depths", type=int, nargs="+", default=[4, 8, 16, 32])
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--repeats", type=int, default=2, help="runs of every measurement, in turn")
  p.add_argument("--out", default=os.path.join(HERE, "INIT.md"))
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--mode", choices=("plain", "fsdp"), help=argparse.SUPPRESS)
  p.add_argument("--depth", type=int, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    fresh.report(_child(args))
    return None

  common = ["--devices", str(args.devices), "--d-model", str(args.d_model),
            "--heads", str(args.heads), "--seq-len", str(args.seq_len)]
  results: dict = {}
  t0 = time.perf_counter()
  for r in range(args.repeats):
    for depth in args.depths:
      for mode in ("plain", "fsdp"):
        res = fresh.run_child(__file__, ["--mode", mode, "--depth", str(depth), *common],
                              label=f"{mode} depth {depth}")
        results.setdefault((depth, mode), []).append(res)
        print(f"[{time.perf_counter() - t0:5.0f}s] repeat {r + 1}: depth {depth} {mode}: {res}",
              flush=True)

  med = lambda depth, mode, key: statistics.median(x[key] for x in results[(depth, mode)])
  mib = lambda b: f"{b / 2**20:.1f}"
  rows = []
  for depth in args.depths:
    plain, fsdp = results[(depth, "plain")][0], results[(depth, "fsdp")][0]
    rows.append(
        f"| {depth} | {plain['params']:,} | {fsdp['units']} | {med(depth, 'plain', 'params_s'):.2f} | "
        f"{med(depth, 'plain', 'with_opt_s'):.2f} | {med(depth, 'fsdp', 'fsdp_s'):.2f} | "
        f"{med(depth, 'fsdp', 'fsdp_s') / med(depth, 'plain', 'params_s'):.2f} | "
        f"{mib(plain['param_bytes'])} | {mib(fsdp['largest_unit_bytes'])} | "
        f"{mib(fsdp['init_peak_bytes'])} | {fsdp['init_programs']} |")
  first = results[(args.depths[0], "plain")][0]
  text = "\n".join([
      "# Initialisation time: `init_train_state(init_fn=...)` against a plain jit init",
      "",
      f"Generated by `python benchmarks/init_time.py` with jax {first['jax']}: the benchmark "
      f"GPT (d_model {args.d_model}, {args.heads} heads, one FSDP unit per block, AdamW), "
      f"FULL_SHARD on {args.devices} simulated CPU devices; each measurement in a fresh "
      f"process (XLA's default flags), median of {args.repeats} runs taken in turn. "
      f"Seconds from the call to the arrays being ready, tracing and compiling "
      f"included. Machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} "
      "at the end.",
      "",
      "| blocks | parameters | units | plain `jax.jit(init_fn)` s | plain + `jax.jit(opt.init)` s "
      "| fsdp_jax `init_train_state` s | fsdp / plain init_fn | model MiB | largest unit MiB | "
      "fsdp init peak MiB per device | init programs compiled |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
      *rows,
      "",
      "`init_train_state` traces `init_fn` once. Each unit evaluates only what its own "
      "leaves need, straight into its shards (sharded outputs: a device computes about its "
      "own part), in a program of its own that starts once the unit before it is packed, "
      "so a device holds at most one unit in full, plus its shards of the others. Units "
      "that repeat a structure share one compiled program: the integers folded into their "
      "random keys (Flax's module paths, NNX's counts) are its arguments, so the blocks of "
      "a GPT compile once, whatever the depth. It also builds the optimizer state on the "
      "shards, which the first plain column does not.",
      ""])
  return fresh.write_table(args.out, text)


if __name__ == "__main__":
  main()
