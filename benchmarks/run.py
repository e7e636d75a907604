#!/usr/bin/env python
"""fsdp_jax benchmark: memory, collectives and step time, in one command.

    python benchmarks/run.py                 # everything (~10 min on 2 cores)
    python benchmarks/run.py --quick         # fewer timed rounds, N in (1, 8)
    python benchmarks/run.py --only 'fsdp/FULL_SHARD/*,jax_native/*' --rounds 3
    python benchmarks/run.py --list          # the settings and what they are

For each setting (a sharding strategy x precision of fsdp_jax, or a baseline)
on 8 simulated CPU devices it measures

* bytes per device from ``compiled.memory_analysis()`` against the analytic
  floor, and what is live at the compiled program's memory peak (from XLA's
  live-range dump);
* collectives per step read from the compiled HLO (``fsdp_jax.hlo``) against
  the theoretical volume;
* step time, as ratios to the baselines measured round-robin in the same run
  (JAX-native FSDP under ``jax.jit`` with NamedSharding, replicated data
  parallel, PyTorch FSDP with gloo in 8 processes);
* bytes per device of the stored state at N = 1, 2, 4, 8;

and writes ``benchmarks/RESULTS.md`` and ``benchmarks/results.json``. See
``benchmarks/README.md`` for the method and the definitions.

Adding a setting is one line in :data:`SETTINGS`, e.g.
``Setting("fsdp/FULL_SHARD/fp32/fwd_prefetch", "fsdp", "FULL_SHARD", "fp32",
fsdp_kwargs={"forward_prefetch": True})``.
"""


from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

# Importing jax / fsdp_jax does not start a backend; simulate_cpu_devices()
# runs first thing in main(), before anything does.
import jax  # noqa: E402

import fsdp_jax  # noqa: E402
from benchmarks.common import GPTConfig  # noqa: E402

MiB = 2 ** 20

from benchmarks.harness import (  # noqa: E402
    Bench, SETTINGS, TorchRunner, build_variants, parse_args, start, TorchVariant, Variant, machine_info, measure_times,
    save_weights, select_settings, state_scaling, torch_available)
from benchmarks.report import (  # noqa: E402
    compute_ratios, evaluate_targets, render_only, summarize_times, write_report)


def main(argv=None):
  t_start = time.perf_counter()
  args = parse_args(argv, description=__doc__.split("\n\n")[0])
  if args.render:
    render_only(args.render, args.out, args.analysis)
    print(f"wrote {args.out} from {args.render}")
    return
  if args.list:
    for s in SETTINGS:
      print(f"{s.name:<34} {'default' if s.default else '(--all/--only)':<15} {s.note}")
    return
  settings = select_settings(args.only, args.all)
  log = start(args)
  machine = machine_info(args.torch_python)
  log(f"{machine['cpu']}, {machine['cores']} cores, load {machine['loadavg_start'][0]:.1f}; "
      f"jax {machine['jax']}; XLA_FLAGS={machine['XLA_FLAGS']}")
  bench = Bench(args)
  cfg = bench.cfg
  log(f"model: {bench.num_params:,} parameters ({cfg.num_layers} layers, d_model "
      f"{cfg.d_model}); global batch {bench.global_batch} x {cfg.seq_len}")
  if bench.num_params != cfg.num_params:
    log(f"warning: GPTConfig.num_params {cfg.num_params:,} != {bench.num_params:,}")

  torch_settings = [s for s in settings if s.family == "torch"]
  torch_variants: list = []
  tmpdir = tempfile.mkdtemp(prefix="fsdp_bench_")
  if torch_settings and not args.no_torch:
    if not torch_available(args.torch_python):
      log("torch is not installed: skipping the PyTorch FSDP baseline")
    else:
      weights = os.path.join(tmpdir, "weights.npz")
      save_weights(bench.bundle("gpt").params, weights)
      for s in torch_settings:
        log(f"starting {s.name} (in the background while JAX compiles)")
        torch_variants.append(TorchVariant(s, bench, weights))

  for name in sorted({s.model for s in settings if s.family != "torch"} - {"gpt_bs"}):
    mb = bench.bundle(name)
    log(f"activations of {name} (unsharded fwd+bwd on one device): "
        f"{mb.act['measured_temp'] / MiB:.2f} MiB")

  variants = build_variants(bench, settings, log)

  runnable = [v for v in variants if v.run is not None]
  for tv in torch_variants:
    log(f"waiting for {tv.setting.name} to be ready")
    try:
      info = tv.wait_ready()
      log(f"  ready after {info['ready_after_s']:.0f}s ({info['num_params']:,} params)")
      runnable.append(TorchRunner(tv))
    except Exception as e:
      log(f"  FAILED: {e!r}")

  log(f"timing {len(runnable)} variants: {args.warmup} warm-up + {args.rounds} rounds")
  try:
    measure_times(runnable, args.warmup, args.rounds, log)
  finally:
    for tv in torch_variants:
      tv.close()

  scaling = []
  if not args.no_state_scaling:
    log("stored state vs N")
    scaling = state_scaling(bench, (1, 8) if args.quick else (1, 2, 4, 8), log)

  # ---- assemble results ----
  R: dict = {
      "command": "python benchmarks/run.py" + ("" if argv is None and len(sys.argv) == 1
                                                else " " + " ".join(sys.argv[1:] if argv is None else argv)),
      "machine": machine, "args": {**vars(args), "_python_executable": sys.executable},
      "devices": args.devices,
      "global_batch": bench.global_batch,
      "model": {"d_model": cfg.d_model, "layers": cfg.num_layers, "heads": cfg.num_heads,
                "vocab": cfg.vocab_size, "seq_len": cfg.seq_len, "num_params": bench.num_params,
                "block_params": cfg.block_params, "root_params": cfg.root_params},
      "activations": {k: v.act for k, v in bench._bundles.items() if k != "gpt_bs"},
      "settings": {}, "state_scaling": scaling,
  }
  for v in variants + [r for r in runnable if isinstance(r, TorchRunner)]:
    s = v.setting
    d = {"family": s.family, "strategy": s.strategy, "precision": s.precision, "model": s.model,
         "replicate": s.replicate, "fsdp_kwargs": {k: repr(x) for k, x in s.fsdp_kwargs.items()},
         "note": s.note}
    if isinstance(v, TorchRunner):
      d["torch_info"] = v.tv.info
    else:
      d.update(v.info)
    if getattr(v, "run_error", None):
      d["error"] = "while running: " + v.run_error
    d["time"] = summarize_times(v) if v.times and not getattr(v, "run_error", None) else {}
    d["first_loss"] = v.first_loss
    d["last_loss"] = v.last_loss
    R["settings"][s.name] = d
  compute_ratios(R)
  R["loadavg_end"] = os.getloadavg()
  R["runtime_s"] = time.perf_counter() - t_start
  R["targets"] = evaluate_targets(R)
  write_report(R, args.out, args.json)
  shutil.rmtree(tmpdir, ignore_errors=True)
  log(f"wrote {args.out} and {args.json} ({R['runtime_s'] / 60:.1f} min)")
  for t in R["targets"]:
    log(f"  {'MET ' if t['met'] else 'MISS'} {t['target']}: {t['measured']}")


if __name__ == "__main__":
  main()
