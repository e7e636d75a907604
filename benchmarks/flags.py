#!/usr/bin/env python
"""What each of fsdp_jax's CPU XLA settings costs and earns.

Two kinds of setting: process-wide ``XLA_FLAGS`` that
``fsdp_jax.simulate_cpu_devices()`` appends (``fsdp_jax.custom.CPU_XLA_FLAGS``),
which every program of the process gets, and the compiler options fsdp_jax's
own step is compiled with (``fsdp_jax.custom.compiler_options(mesh)``), which
no other program gets. A process flag that helps fsdp_jax but slows an
ordinary ``jax.jit`` program is a tax on the user's other code.

For each process flag set (the library's, each of them left out, none, and
the library's plus the YNN flag it used to set), in a fresh process each
(XLA reads its flags once per process), this measures:

* a plain single-device ``jax.jit`` train step of the benchmark GPT (the
  user's own code): its step time;
* fsdp_jax FULL_SHARD fp32 on 8 simulated CPU devices (same model, same
  global batch), compiled with the options it picks for this loss (which
  does not checkpoint: YNN fusions on), with the YNN option added (what a
  checkpointing loss gets), and with no options: step time, peak bytes per
  device (``memory_analysis()``) and all-gathers per step (from the compiled
  HLO: 2 per unit when the backward re-gathers, 1 when it does not);
* the same GPT with ``nn.remat`` on every block under FULL_SHARD, with and
  without the YNN option: temporaries per device (what per-block
  checkpointing is for);

and writes ``benchmarks/FLAGS.md``. Times are the median of timed steps
after warm-up; the programs of one flag set alternate in one process, and
every flag set runs ``--repeats`` times in turn, so slow phases of a loaded
machine spread over all of them.

    python benchmarks/flags.py                   # ~8 min on 2 cores
    python benchmarks/flags.py --d-model 128 --layers 2 --steps 3 --out /tmp/FLAGS.md
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


YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type="
LIBRARY = "library flags"
OLD = "library flags + " + YNN_FLAG + " (before this release)"


def _flag_sets(flags: tuple[str, ...]) -> dict[str, str]:
  sets = {LIBRARY: " ".join(flags)}
  for f in flags:
    sets[f"all but {f}"] = " ".join(g for g in flags if g != f)
  sets["none (XLA's defaults)"] = ""
  sets[OLD] = " ".join([*flags, YNN_FLAG])
  return sets


# fsdp_jax's step compiled three ways: name -> compiler_options(mesh,
# checkpointed=...) or explicit options. "lean" is what shard_train_step picks
# for a loss that does not checkpoint, "ynn_option" for one that does.
STEP_VARIANTS = {"lean": False, "ynn_option": True, "no_options": {}}


def _child(args) -> dict:
  """Runs in a fresh process with XLA_FLAGS already set: one measurement."""
  jax = fresh.start_jax(args.devices)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  from fsdp_jax._src import hlo  # pylint: disable=import-outside-toplevel
  from benchmarks import hlo_stats  # pylint: disable=import-outside-toplevel
  from benchmarks.common import make_batch  # pylint: disable=import-outside-toplevel
  from benchmarks.models import Block  # pylint: disable=import-outside-toplevel

  cfg, init_fn, loss_fn = fresh.gpt(args, args.layers)
  batch = {k: jnp.asarray(v) for k, v in make_batch(cfg, args.global_batch).items()}
  opt = optax.adamw(1e-3)

  # The user's own program: one jax.jit step on one device.
  dev = jax.devices()[0]
  params = jax.device_put(init_fn(jax.random.key(0)), dev)
  opt_state = opt.init(params)

  @jax.jit
  def plain_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  b1 = jax.device_put(batch, dev)
  box = {"p": (params, opt_state)}

  def run_plain():
    p, s, loss = plain_step(*box["p"], b1)
    # The whole step: the loss is ready before the update is.
    jax.block_until_ready((p, s, loss))
    box["p"] = (p, s)

  # fsdp_jax FULL_SHARD fp32, one unit per Block.
  mesh = fsdp_jax.make_mesh(shard=args.devices)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({Block}))
  own = fsdp_jax.custom.compiler_options(mesh)

  def variant_options(v):
    if isinstance(v, bool):
      return fsdp_jax.custom.compiler_options(mesh, checkpointed=v)
    return v

  def compiled_stats(step, state, batch):
    compiled = step.lower(state, batch).compile()
    mem = hlo_stats.memory_stats(compiled)
    gathers = sum(1 for c in hlo.collectives(compiled.as_text()) if c.kind == "all-gather")
    return mem["total"], mem["temp"], gathers

  state0 = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0), optimizer=opt,
                                     mesh=mesh, config=config)
  base_step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config)
  base_step.lower(state0, batch)  # the options it picks for this loss
  picked = {"plain": base_step.jitted.options}
  runs = {"plain": run_plain}
  stats = {}
  for name, v in STEP_VARIANTS.items():
    step = base_step._with_compiler_options(variant_options(v))  # pylint: disable=protected-access
    stats[name] = compiled_stats(step, state0, batch)
    box_s = {"s": fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0),
                                            optimizer=opt, mesh=mesh, config=config)}

    def run(step=step, box_s=box_s):
      s, m = step(box_s["s"], batch)
      jax.block_until_ready((s, m))
      box_s["s"] = s
    runs[name] = run

  # The same model with nn.remat on every block: what the YNN option is for.
  _, rinit, rloss = fresh.gpt(args, args.layers, remat=True)
  rstate = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      init_fn=rinit, rng=jax.random.key(0), optimizer=opt, mesh=mesh, config=config))
  rstep = fsdp_jax.shard_train_step(rloss, opt, mesh=mesh, config=config)
  rstep.lower(rstate, batch)
  picked["remat"] = rstep.jitted.options
  remat = {}
  for name in ("lean", "ynn_option"):
    remat[name] = compiled_stats(
        rstep._with_compiler_options(variant_options(STEP_VARIANTS[name])),  # pylint: disable=protected-access
        rstate, batch)[1]

  for _ in range(args.warmup):
    for fn in runs.values():
      fn()
  times = {name: [] for name in runs}
  for _ in range(args.steps):
    for name, fn in runs.items():
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  out = {f"{name}_s": statistics.median(t) for name, t in times.items()}
  for name, (peak, temp, gathers) in stats.items():
    out.update({f"{name}_peak_bytes": peak, f"{name}_temp_bytes": temp,
                f"{name}_all_gathers": gathers})
  out.update({f"remat_{name}_temp_bytes": b for name, b in remat.items()})
  out.update({"units": len(state0.plan.units),
              "remat_units": len(rstate.plan.units),
              "params": sum(l.numel for l in state0.plan.leaves), "jax": jax.__version__,
              "options": {k: v for k, v in own.items()},
              "picked": {k: sorted(v) for k, v in picked.items()}})
  return out


def _decision(sets, results, med) -> list[str]:
  """The paragraph under the tables, its numbers read from them."""
  lib = lambda k: med(LIBRARY, k)
  none = "none (XLA's defaults)"
  sched = [n for n in sets if "concurrency_optimized_scheduler" in n and n.startswith("all but")]
  cse = [n for n in sets if "cse_barrier_expander" in n and n.startswith("all but")]
  r = lambda name, k: results[name][0][k] / 2**20
  ynn = "xla_cpu_experimental_ynn_fusion_type"
  picked = results[LIBRARY][0]["picked"]
  assert ynn not in picked["plain"] and ynn in picked["remat"], picked
  lines = [
      f"* The YNN flag is no process flag any more. With it, a plain `jax.jit` step took "
      f"{med(OLD, 'plain_s') / lib('plain_s'):.2f}x the time it takes without it "
      f"(this run). fsdp_jax's step sets it as its own compiler option only when the "
      f"loss checkpoints (`jax.checkpoint`, `nn.remat`; `shard_train_step` traces the "
      f"loss to see): this GPT's step (no checkpointing) compiled with it anyway took "
      f"{lib('ynn_option_s') / lib('lean_s'):.2f}x the time; on the same GPT with "
      f"`nn.remat` per block it keeps temporaries at {r(LIBRARY, 'remat_ynn_option_temp_bytes'):.1f} "
      f"MiB against {r(LIBRARY, 'remat_lean_temp_bytes'):.1f} without (last column; FULL_SHARD "
      "on 2 devices in `tests/test_activation_checkpointing.py`, a model whose activations "
      "outweigh its blocks: 2.33 MiB of temporaries with it, 2.92 without, 5.71 without "
      "checkpointing).",
  ]
  if sched:
    lines.append(
        f"* `--xla_cpu_enable_concurrency_optimized_scheduler=false` stays a process flag "
        f"(XLA reads it from the process flags only): without it fsdp_jax's peak is "
        f"{r(sched[0], 'lean_peak_bytes'):.1f} MiB instead of {r(LIBRARY, 'lean_peak_bytes'):.1f}, "
        f"and a plain step without it took {med(sched[0], 'plain_s') / lib('plain_s'):.2f}x "
        "the time it takes with it, within this machine's run-to-run noise (about 10%).")
  if cse:
    lines.append(
        f"* `--xla_disable_hlo_passes=cse_barrier_expander` is both. As fsdp_jax's step "
        f"option it keeps FULL_SHARD's re-gathers under any process flags (with no options "
        f"and XLA's default flags: {results[none][0]['no_options_all_gathers']} all-gathers, "
        f"{r(none, 'no_options_peak_bytes'):.1f} MiB; with its options: "
        f"{results[none][0]['lean_all_gathers']}, {r(none, 'lean_peak_bytes'):.1f} MiB). As a "
        "process flag it does the same for a hand-written step that does not pass "
        "`fsdp_jax.custom.compiler_options`, and changes nothing in a program without "
        f"optimization barriers (a plain step without it took "
        f"{med(cse[0], 'plain_s') / lib('plain_s'):.2f}x the time, within the noise).")
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--d-model", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--global-batch", type=int, default=16)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--repeats", type=int, default=2,
                 help="runs of every flag set, in turn")
  p.add_argument("--out", default=os.path.join(HERE, "FLAGS.md"))
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    fresh.report(_child(args))
    return None

  import fsdp_jax  # pylint: disable=import-outside-toplevel  (no backend starts)
  sets = _flag_sets(tuple(fsdp_jax.custom.CPU_XLA_FLAGS))
  raw = list(argv if argv is not None else sys.argv[1:])
  child_args = []
  while raw:  # everything but --out and its value
    a = raw.pop(0)
    if a == "--out":
      raw.pop(0)
    elif not a.startswith("--out="):
      child_args.append(a)
  results: dict[str, list] = {name: [] for name in sets}
  t0 = time.perf_counter()
  for r in range(args.repeats):
    for name, flags in sets.items():
      results[name].append(fresh.run_child(__file__, child_args, label=name, xla_flags=flags))
      print(f"[{time.perf_counter() - t0:5.0f}s] repeat {r + 1}: {name}: "
            f"{results[name][-1]}", flush=True)

  ref = results[LIBRARY]
  med = lambda name, key: statistics.median(x[key] for x in results[name])
  first = ref[0]
  mib = lambda b: f"{b / 2**20:.1f}"
  rows = []
  for name in sets:
    r0 = results[name][0]
    rows.append(
        f"| {name} | {med(name, 'plain_s') * 1e3:.0f} | "
        f"{med(name, 'plain_s') / med(LIBRARY, 'plain_s'):.2f} | "
        f"{med(name, 'lean_s') * 1e3:.0f} | "
        f"{med(name, 'lean_s') / med(LIBRARY, 'lean_s'):.2f} | "
        f"{r0['lean_all_gathers']} | {mib(r0['lean_peak_bytes'])} |")
  opt_rows = []
  labels = {"lean": "its own (`compiler_options(mesh, checkpointed=False)`: the loss "
                    "does not checkpoint)",
            "ynn_option": "`compiler_options(mesh)` (with the YNN option: a checkpointing "
                          "loss's)",
            "no_options": "none"}
  for name in ("none (XLA's defaults)", LIBRARY):
    for v in STEP_VARIANTS:
      r0 = results[name][0]
      remat = (mib(r0[f"remat_{v}_temp_bytes"]) if f"remat_{v}_temp_bytes" in r0 else "")
      opt_rows.append(
          f"| {name} | {labels[v]} | {med(name, f'{v}_s') * 1e3:.0f} | "
          f"{r0[f'{v}_all_gathers']} | {mib(r0[f'{v}_peak_bytes'])} | "
          f"{mib(r0[f'{v}_temp_bytes'])} | {remat} |")
  opts = " ".join(f"`{k}={v!r}`" for k, v in first["options"].items())
  text = "\n".join([
      "# CPU XLA settings: what each costs the user's code and earns fsdp_jax",
      "",
      f"Generated by `python benchmarks/flags.py {' '.join(child_args)}`".rstrip() + f" with jax "
      f"{first['jax']}: the benchmark GPT ({first['params']:,} parameters, {args.layers} "
      f"blocks of d_model {args.d_model}, {first['units']} FSDP units), global batch "
      f"{args.global_batch} x {args.seq_len}, AdamW; median of {args.steps} timed steps "
      f"after {args.warmup} warm-up, median over {args.repeats} runs of every flag set in "
      f"turn, each in a fresh process. Machine: {os.cpu_count()} cores, load average "
      f"{os.getloadavg()[0]:.1f} at the end.",
      "",
      f"Process flags (`fsdp_jax.custom.CPU_XLA_FLAGS`, set by `simulate_cpu_devices`): "
      f"`{sets[LIBRARY]}`. fsdp_jax's step options "
      f"(`fsdp_jax.custom.compiler_options(mesh)`, its program only): {opts}, the "
      "last only when the loss checkpoints.",
      "",
      "## Process flags: the user's program and fsdp_jax's",
      "",
      "| XLA_FLAGS | plain jit step ms (1 device) | vs library flags | fsdp_jax FULL_SHARD "
      "step ms (8 devices) | vs library flags | fsdp all-gathers per step | fsdp peak MiB "
      "per device |",
      "|---|---|---|---|---|---|---|",
      *rows,
      "",
      f"FULL_SHARD gathers each unit twice (forward, and again in backward), but "
      f"the root, which it keeps gathered as PyTorch does: {2 * first['units'] - 1} "
      f"all-gathers for {first['units']} units. Fewer means XLA merged the backward "
      "re-gather into the forward gather, keeping every gathered unit alive until "
      "backward (SHARD_GRAD_OP's memory).",
      "",
      "## fsdp_jax's step options",
      "",
      "| XLA_FLAGS | step compiled with | fsdp step ms | all-gathers | peak MiB | "
      "temporaries MiB | temporaries MiB, `nn.remat` per block |",
      "|---|---|---|---|---|---|---|",
      *opt_rows,
      "",
      "## What stays, and why",
      "",
      *_decision(sets, results, med),
      ""])
  return fresh.write_table(args.out, text)


if __name__ == "__main__":
  main()
