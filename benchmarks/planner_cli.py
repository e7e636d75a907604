"""How long ``python -m fsdp_jax.plan`` takes, and where the time goes.

    python -m benchmarks.planner_cli                 # Llama 3 8B, 8,192 tokens, 8 x H100-80GB
    python -m benchmarks.planner_cli --seq 4096 --devices 64 --global-batch 64
    python -m benchmarks.planner_cli --seq 32768 --strategy FULL_SHARD --layout orig
    python -m benchmarks.planner_cli --model 70b --seq 4096   # Llama 3 70B's shape

Writes Llama 3 8B's (or 70B's) ``config.json`` (its published shape) to a temporary
directory and runs the command on it in a fresh process without the
shell's ``XLA_FLAGS`` (as from a plain shell), with timers around the
planner's compiles: the step compiled per device (the search's
confirmation), the units' programs (the modelled pass). Prints the
command's output and one JSON line: wall seconds, seconds per part, the
answer. Figures in docs/planner.md ("Cost").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
             "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu"}
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672,
              "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8}
MODELS = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}


def child(argv) -> None:
  """The command, its compiles timed (runs in the fresh process)."""
  # pylint: disable=import-outside-toplevel  (after the parent set the environment)
  from fsdp_jax._src.planner import estimator, programs, step_program
  import fsdp_jax.plan
  seconds, counts = collections.defaultdict(float), collections.Counter()

  def timed(module, name, label):
    f = getattr(module, name)

    def run(*a, **k):
      t = time.perf_counter()
      try:
        return f(*a, **k)
      finally:
        seconds[label] += time.perf_counter() - t
        counts[label] += 1
    setattr(module, name, run)

  timed(step_program, "compile_step", "step compiles")
  timed(programs, "compile_segments", "unit programs")
  timed(estimator.segments_lib, "trace_loss", "loss traces")
  out = [a for k, a in enumerate(argv) if k and argv[k - 1] == "--json"]
  t0 = time.perf_counter()
  fsdp_jax.plan.main(argv)
  answer = json.load(open(out[0])) if out else {}
  best = (answer.get("fits") or [{}])[0]
  summary = {"wall_seconds": time.perf_counter() - t0, "seconds": dict(seconds),
             "counts": dict(counts), "best": best.get("configuration"),
             "best_gib": best.get("bytes_per_device", {}).get("total", 0) / 2**30,
             "context": best.get("context"), "compiled": best.get("compiled"),
             "tokens_per_s": best.get("tokens_per_second_per_device"),
             "fitting": len(answer.get("fits", []))}
  print(json.dumps(summary))
  if out:
    with open(out[0] + ".summary", "w") as f:
      json.dump(summary, f)


def record(path: str, args, narrow: list, summary: dict, load: str) -> None:
  """The run as a row of ``planner.json``'s ``long_context`` (PLANNER.md's
  "Long sequences" table), replacing one of the same model, length,
  devices and command."""
  results = json.load(open(path)) if os.path.exists(path) else {}
  row = {"model": args.model, "seq": args.seq, "devices": args.devices,
         "command": " ".join(narrow), "best": summary["best"], "context": summary["context"],
         "memory_gib": summary["best_gib"] if summary["best"] else None,
         "compiled": summary["compiled"], "tokens_per_s": summary["tokens_per_s"],
         "fitting": summary["fitting"], "wall_seconds": summary["wall_seconds"], "load": load,
         "date": time.strftime("%Y-%m-%d", time.gmtime()),
         "unit_program_seconds": round(summary["seconds"].get("unit programs", 0.0), 1),
         "loss_trace_seconds": round(summary["seconds"].get("loss traces", 0.0), 1)}
  same = lambda r: ((r.get("model", "8b"), r["seq"], r.get("devices", 8), r["command"])
                    == (row["model"], row["seq"], row["devices"], row["command"]))
  results["long_context"] = [r for r in results.get("long_context", []) if not same(r)] + [row]
  with open(path, "w") as f:
    json.dump(results, f, indent=1, default=str)


def main(argv=None) -> int:
  if argv and argv[0] == "--child":
    child(argv[1:])
    return 0
  p = argparse.ArgumentParser(prog="python -m benchmarks.planner_cli", description=__doc__)
  p.add_argument("--model", choices=sorted(MODELS), default="8b", help="Llama 3's shape")
  p.add_argument("--seq", type=int, default=8192)
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--global-batch", type=int, default=8)
  p.add_argument("--device", default="H100-80GB")
  p.add_argument("--strategy", action="append", default=[],
                 help="passed on (repeatable; default: every strategy)")
  p.add_argument("--layout", default=None, help="passed on: flat, orig or both")
  p.add_argument("--context", type=int, action="append", default=[],
                 help="passed on (repeatable; default: the command's context sizes)")
  p.add_argument("--record", default=None, metavar="PLANNER_JSON",
                 help="add the answer to this planner.json's long_context rows "
                      "(benchmarks/planner.json: PLANNER.md's 'Long sequences' table)")
  args = p.parse_args(argv)
  narrow = ([a for s in args.strategy for a in ("--strategy", s)]
            + (["--layout", args.layout] if args.layout else [])
            + [a for c in args.context for a in ("--context", str(c))])
  with tempfile.TemporaryDirectory() as d:
    with open(os.path.join(d, "config.json"), "w") as f:
      json.dump(MODELS[args.model], f)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([repo, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "benchmarks.planner_cli", "--child",
                    "--hf-config", os.path.join(d, "config.json"),
                    "--devices", str(args.devices), "--device", args.device,
                    "--seq", str(args.seq), "--global-batch", str(args.global_batch),
                    "--json", os.path.join(d, "plan.json"), *narrow], env=env, check=True)
    load = os.getloadavg()
    print(f"process: {time.perf_counter() - t0:.1f} s; load average {load}")
    if args.record:
      with open(os.path.join(d, "plan.json.summary")) as f:
        record(args.record, args, narrow, json.load(f), ", ".join(f"{x:.1f}" for x in load))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
