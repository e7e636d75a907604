"""One measurement at a time: ``python -m benchmarks <name> [options]``.

Each builds the selected settings with the shared harness and prints one
table; ``python -m benchmarks all`` (= ``python benchmarks/run.py``) runs
everything and writes RESULTS.md. The options are run.py's (``--only``,
``--devices``, the model size, ``--rounds``...), e.g.

    python -m benchmarks memory --only 'fsdp/*/fp32,jax_native/fp32'
    python -m benchmarks step_time --only 'fsdp/FULL_SHARD/fp32,jax_native/fp32' --rounds 3
"""

from __future__ import annotations

from benchmarks.harness import (MiB, Bench, build_variants, measure_times, parse_args,
                                select_settings, start)


def _setup(argv, what: str):
  args = parse_args(argv, description=f"fsdp_jax benchmark: {what}")
  settings = [s for s in select_settings(args.only, args.all) if s.family != "torch"]
  log = start(args)
  bench = Bench(args)
  log(f"model: {bench.num_params:,} parameters; global batch {bench.global_batch} x "
      f"{bench.cfg.seq_len}; {args.devices} devices")
  return args, bench, build_variants(bench, settings, log), log


def _table(header: list[str], rows: list[list]) -> str:
  out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
  return "\n".join(out)


def memory(argv=None) -> str:
  """Bytes per device of each compiled step (``memory_analysis()``)."""
  _, _, variants, _ = _setup(argv, "memory per device")
  rows = []
  for v in variants:
    m = v.info.get("memory")
    if m is None:
      rows.append([v.setting.name, "failed: " + v.info.get("error", "?")] + [""] * 4)
      continue
    rows.append([v.setting.name] + [f"{m[k] / MiB:.1f}" for k in
                                    ("total", "argument", "output", "temp", "alias")])
  return _table(["setting", "total MiB", "arguments", "outputs", "temporaries", "aliased"],
                rows)


def collectives(argv=None) -> str:
  """Collectives per step read from the compiled HLO: count and payload."""
  _, _, variants, _ = _setup(argv, "collectives per step")
  rows = []
  for v in variants:
    for kind, c in sorted(v.info.get("collectives", {}).items()):
      rows.append([v.setting.name, kind, c["ops"], f"{c['payload'] / MiB:.2f}"])
  return _table(["setting", "collective", "ops per step", "payload MiB per device"], rows)


def compile_time(argv=None) -> str:
  """Seconds to lower and to compile each setting's step."""
  _, _, variants, _ = _setup(argv, "compile time")
  rows = [[v.setting.name, f"{v.info['lower_s']:.1f}", f"{v.info['compile_s']:.1f}"]
          for v in variants if "compile_s" in v.info]
  return _table(["setting", "lower s", "compile s"], rows)


def step_time(argv=None) -> str:
  """Step time, round-robin in one process, as ratios to the first setting."""
  args, _, variants, log = _setup(argv, "step time")
  runnable = [v for v in variants if v.run is not None]
  measure_times(runnable, args.warmup, args.rounds, log)
  base = min(runnable[0].times) if runnable and runnable[0].times else None
  rows = []
  for v in runnable:
    best = min(v.times) if v.times else float("nan")
    rows.append([v.setting.name, f"{best * 1e3:.0f}",
                 f"{best / base:.2f}" if base else "n/a"])
  return _table(["setting", "best step ms",
                 f"vs {runnable[0].setting.name}" if runnable else "ratio"], rows)
