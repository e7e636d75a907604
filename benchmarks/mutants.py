#!/usr/bin/env python
"""Mutation checks: deliberate one-line bugs in the engine, each of which the
test suite must catch.

For every mutant below, a copy of the repository (its tracked files, as they
are in the working tree) gets one line of one module replaced, and the test
suite runs on the copy with ``-x`` until the first failure. The tests named
in a mutant's ``focus`` run first (a part of the suite, with the suite's own
options: so a failure there is a failure of the suite); where they all pass,
the whole suite runs. A mutant no test catches is reported as such and makes
the run exit with status 1.

Writes ``benchmarks/MUTANTS.md``: the mutant, the line it changes
(file:line), the first failing test and where it was found.

    python -m benchmarks mutants                 # every mutant (about 15 min on 2 cores)
    python -m benchmarks mutants --only nf4-nibble-order,lora-scale
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclasses.dataclass(frozen=True)
class Mutant:
  name: str
  what: str     # the bug, in words
  path: str     # relative to the repository root
  old: str      # one line of the file (stripped), found exactly once
  new: str      # its replacement (the line's indentation is kept)
  focus: tuple  # test ids or files run first


MUTANTS = (
    Mutant("divide-factor", "the reduce-scatter's post-divide factor dropped "
           "(gradients summed, not averaged, over the data-parallel world)",
           "fsdp_jax/_src/collectives.py",
           "r = r / jnp.asarray(spec.post_divide, spec.reduce_dtype)", "r = r",
           ("tests/test_engine.py", "tests/test_pytorch_goldens.py")),
    Mutant("replicate-psum", "HYBRID_SHARD's all-reduce over \"replicate\" dropped "
           "(the flat layout's packed reduction)",
           "fsdp_jax/_src/collectives.py",
           "r = lax.psum(r, spec.reduce_axes)", "r = r",
           ("tests/test_engine.py", "tests/test_pytorch_goldens.py")),
    Mutant("not-resharded", "FULL_SHARD keeps each gathered unit for the backward "
           "pass instead of re-gathering it (no reshard after forward)",
           "fsdp_jax/_src/collectives.py",
           "return not params[\"spec\"].reshard", "return True",
           ("tests/test_engine.py", "tests/test_prefetch.py")),
    Mutant("flat-padding", "the flat layout's chunk one element too long when the "
           "mesh divides the unit (padding off by one)",
           "fsdp_jax/_src/plan.py",
           "return -(-self.flat_numel(unit) // self.n)",
           "return self.flat_numel(unit) // self.n + 1",
           ("tests/test_engine.py", "tests/test_wrap.py")),
    Mutant("tensor-all-reduce", "the all-reduce over \"tensor\" after a row-parallel "
           "matmul dropped in the training step (Megatron's g: forward identity)",
           "fsdp_jax/_src/tensor_collectives.py",
           "return lax.psum(x, axis), None", "return x, None",
           ("tests/test_tensor_parallel.py",)),
    Mutant("tensor-all-reduce-eval", "the same all-reduce dropped where nothing is "
           "differentiated (the evaluation step, forward only)",
           "fsdp_jax/_src/tensor_collectives.py",
           "return lax.psum(x, axis)", "return x",
           ("tests/test_eval.py",)),
    Mutant("lora-scale", "LoRA's adapter scale alpha / rank doubled",
           "fsdp_jax/_src/lora.py",
           "return self.alpha / self.rank", "return 2 * self.alpha / self.rank",
           ("tests/test_lora.py", "tests/test_lora_pretrained.py")),
    Mutant("nf4-nibble-order", "NF4 codes packed low nibble first (bitsandbytes packs "
           "the first value in the high nibble)",
           "fsdp_jax/_src/quantization.py",
           "body = (pairs[..., 0] << 4) | pairs[..., 1]",
           "body = pairs[..., 0] | (pairs[..., 1] << 4)",
           ("tests/test_nf4.py",)),
    Mutant("global-norm-all-reduce", "the optimizer's all-reduce of a whole-parameter "
           "sum (clip_by_global_norm's norm) dropped: each device uses its shard's",
           "fsdp_jax/_src/optim/evaluator.py",
           "x = lax.psum(x, axes)", "x = x",
           ("tests/test_optimizers.py",)),
    Mutant("checkpoint-shard-offset", "a host value placed onto devices one row off "
           "(each device reads the slice after its own)",
           "fsdp_jax/_src/state_dicts/convert.py",
           "return jax.make_array_from_callback(tuple(shape), sharding, lambda idx: arr[idx])",
           "return jax.make_array_from_callback(tuple(shape), sharding, "
           "lambda idx: np.roll(arr, 1, axis=0)[idx])",
           ("tests/test_state_dict.py", "tests/test_checkpoint.py")),
    Mutant("weightmap-transpose", "WeightMap's transpose() leaves the checkpoint "
           "tensor as it is",
           "fsdp_jax/_src/pretrained/weight_map.py",
           "return np.transpose(x)", "return x",
           ("tests/test_pretrained.py",)),
    Mutant("rng-fold-devices", "the per-step key not folded with the device index "
           "(every device draws the same dropout mask)",
           "fsdp_jax/_src/loss.py",
           "return jax.random.fold_in(jax.random.fold_in(key, step), device_index(data_axes))",
           "return jax.random.fold_in(key, step)",
           ("tests/test_rng_checks.py", "tests/test_user_models.py")),
    Mutant("accumulation-divisor", "gradient accumulation sums the microbatches' "
           "gradients without dividing by their number",
           "fsdp_jax/_src/grads.py",
           "else a + x.astype(a.dtype) / k, acc, g)", "else a + x.astype(a.dtype), acc, g)",
           ("tests/test_training_semantics.py",)),
    Mutant("hybrid-orig-psum", "HYBRID_SHARD's all-reduce over \"replicate\" dropped "
           "(the original layout's per-leaf reduction)",
           "fsdp_jax/_src/collectives.py",
           "r = lax.psum(concat_rows(parts, spec), spec.reduce_axes)",
           "r = concat_rows(parts, spec)",
           ("tests/test_engine.py",)),
    Mutant("orig-padding-rows", "the original layout drops the padding rows of the "
           "wrong end (keeps rows 1..dim0 of a gathered leaf)",
           "fsdp_jax/_src/layout.py",
           "out[i] = _slice_in_dim(x, 0, leaf.dim0, p).reshape(shape)",
           "out[i] = _slice_in_dim(x, 1, leaf.dim0 + 1, p).reshape(shape)",
           ("tests/test_state_dict.py", "tests/test_engine.py")),
)


def _line_of(text: str, old: str, path: str) -> int:
  hits = [i for i, line in enumerate(text.splitlines()) if line.strip() == old]
  if len(hits) != 1:
    raise SystemExit(f"{path}: the line {old!r} occurs {len(hits)} times (needs exactly 1); "
                     "update the mutant to the code")
  return hits[0]


def _copy_repo(dst: str) -> None:
  """The tracked files of the working tree (with their uncommitted changes)."""
  files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout.decode().split("\0")
  for f in filter(None, files):
    src = os.path.join(ROOT, f)
    if os.path.isfile(src):
      os.makedirs(os.path.dirname(os.path.join(dst, f)), exist_ok=True)
      shutil.copy2(src, os.path.join(dst, f))


def _apply(repo: str, m: Mutant) -> int:
  path = os.path.join(repo, m.path)
  text = open(path).read()
  k = _line_of(text, m.old, m.path)
  lines = text.splitlines(keepends=True)
  indent = lines[k][: len(lines[k]) - len(lines[k].lstrip())]
  lines[k] = indent + m.new + "\n"
  open(path, "w").write("".join(lines))
  return k + 1


_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)


def _pytest(repo: str, args: list, timeout: float) -> tuple[str | None, float, str, str | None]:
  """Runs the suite's pytest (its own options) with -x on ``args``: the first
  failing test id (None if none failed), the seconds, the output's tail and
  what kept the run from finishing (a timeout, pytest's own error; a run that
  did not finish catches nothing)."""
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("XLA_", "JAX_", "FSDP_JAX_"))}
  env["PYTHONPATH"] = repo
  t0 = time.perf_counter()
  try:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:warnings",
                           *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
  except subprocess.TimeoutExpired as e:
    out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
    return None, time.perf_counter() - t0, out[-3000:], f"timed out after {timeout:.0f} s"
  seconds = time.perf_counter() - t0
  failed = _FAILED.findall(out)
  if failed:
    return failed[0], seconds, out[-3000:], None
  if proc.returncode not in (0, 5):  # 5: nothing collected
    return None, seconds, out[-3000:], f"pytest exited {proc.returncode}"
  return None, seconds, out[-3000:], None


def run(mutants, *, timeout: float, log) -> list[dict]:
  rows = []
  for m in mutants:
    with tempfile.TemporaryDirectory(prefix="fsdp_jax_mutant_") as repo:
      _copy_repo(repo)
      line = _apply(repo, m)
      where = "focus"
      first, seconds, tail, problem = _pytest(repo, list(m.focus), timeout)
      if first is None and problem is None:
        where = "whole suite"
        first, more, tail, problem = _pytest(repo, [], timeout)
        seconds += more
    row = {"name": m.name, "what": m.what, "where": f"{m.path}:{line}",
           "first_failure": first, "found_in": where, "seconds": seconds,
           "problem": problem}
    log(f"{m.name}: {m.path}:{line}: "
        + (f"caught by {first} ({where}, {seconds:.0f} s)" if first else
           f"NOT CAUGHT ({where}: {problem or 'every test passed'}, {seconds:.0f} s)\n{tail}"))
    rows.append(row)
  return rows


def table(rows: list[dict]) -> str:
  caught = sum(r["first_failure"] is not None for r in rows)
  lines = [
      "# Mutation checks",
      "",
      f"Generated by `python -m benchmarks mutants` (`benchmarks/mutants.py`): {len(rows)} "
      "deliberate one-line bugs in the engine, each applied alone to a copy of the "
      "repository; the test suite then runs with `-x` (its own options: 8 simulated "
      "devices, xdist) until the first failure, the tests named in the mutant's focus "
      "first and the whole suite where they all pass. "
      f"**{caught} of {len(rows)} caught.**",
      "",
      "| mutant | the bug | line changed | first failing test | found by | seconds |",
      "|---|---|---|---|---|---|",
  ]
  for r in rows:
    first = (f"`{r['first_failure']}`" if r["first_failure"] else
             f"**not caught** ({r.get('problem') or 'every test passed'})")
    lines.append(f"| {r['name']} | {r['what']} | `{r['where']}` | {first} | "
                 f"{r['found_in']} | {r['seconds']:.0f} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--only", default=None, help="comma-separated mutant names")
  p.add_argument("--timeout", type=float, default=3600.0, help="seconds per pytest run")
  p.add_argument("--out", default=os.path.join(HERE, "MUTANTS.md"))
  p.add_argument("--list", action="store_true", help="list the mutants and exit")
  args = p.parse_args(argv)
  mutants = MUTANTS
  if args.only:
    names = args.only.split(",")
    unknown = sorted(set(names) - {m.name for m in MUTANTS})
    if unknown:
      raise SystemExit(f"unknown mutants {unknown}; choose from {[m.name for m in MUTANTS]}")
    mutants = [m for m in MUTANTS if m.name in names]
  for m in mutants:  # every mutant still matches the code, before anything runs
    _line_of(open(os.path.join(ROOT, m.path)).read(), m.old, m.path)
  if args.list:
    for m in mutants:
      print(f"{m.name}: {m.path}: {m.what}")
    return None
  t0 = time.perf_counter()
  log = lambda msg: print(f"[{time.perf_counter() - t0:6.0f}s] {msg}", flush=True)
  rows = run(mutants, timeout=args.timeout, log=log)
  text = table(rows)
  with open(args.out, "w") as f:
    f.write(text)
  print(text)
  if any(r["first_failure"] is None for r in rows):
    sys.exit(1)
  return None


if __name__ == "__main__":
  main()
