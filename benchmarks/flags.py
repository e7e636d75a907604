#!/usr/bin/env python
"""What each of fsdp_jax's CPU XLA flags costs and earns.

``fsdp_jax.simulate_cpu_devices()`` appends ``fsdp_jax.CPU_XLA_FLAGS`` to
``XLA_FLAGS`` for the whole process, so a flag that helps fsdp_jax but slows
an ordinary ``jax.jit`` program is a tax on the user's other code. For each
flag set (all of them, all but one, none) this runs, in a fresh process each
(XLA reads its flags once per process):

* a plain single-device ``jax.jit`` train step of the benchmark GPT (the
  user's own code), and
* fsdp_jax FULL_SHARD fp32 on 8 simulated CPU devices (same model, same
  global batch): its step time, its peak bytes per device
  (``memory_analysis()``) and its all-gathers per step (from the compiled
  HLO: 2 per unit when the backward re-gathers, 1 when it does not);

and writes ``benchmarks/FLAGS.md``. Times are the median of timed steps
after warm-up; the two programs of one flag set alternate in one process,
and every flag set runs ``--repeats`` times in turn, so slow phases of a
loaded machine spread over all of them.

    python benchmarks/flags.py                   # ~5 min on 2 cores
    python benchmarks/flags.py --d-model 128 --layers 2 --steps 3 --out /tmp/FLAGS.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def _flag_sets(flags: tuple[str, ...]) -> dict[str, str]:
  sets = {"all library flags": " ".join(flags)}
  for f in flags:
    sets[f"all but {f}"] = " ".join(g for g in flags if g != f)
  sets["none (XLA's defaults)"] = ""
  return sets


def _child(args) -> dict:
  """Runs in a fresh process with XLA_FLAGS already set: one measurement."""
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_num_cpu_devices", args.devices)
  jax.config.update("jax_platforms", "cpu")
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  from fsdp_jax._src import hlo  # pylint: disable=import-outside-toplevel
  from benchmarks.common import GPTConfig, make_batch  # pylint: disable=import-outside-toplevel
  from benchmarks.models import Block, make_model  # pylint: disable=import-outside-toplevel

  cfg = GPTConfig(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
                  seq_len=args.seq_len)
  _, init_fn, loss_fn = make_model(cfg)
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
    loss.block_until_ready()
    box["p"] = (p, s)

  # fsdp_jax FULL_SHARD fp32, one unit per Block.
  mesh = fsdp_jax.make_mesh(shard=args.devices)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({Block}))
  state = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0), optimizer=opt,
                                    mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(loss_fn, opt)
  compiled = step.lower(state, batch).compile()
  text = compiled.as_text()
  ma = compiled.memory_analysis()
  peak = (ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
          - ma.alias_size_in_bytes)
  gathers = sum(1 for c in hlo.collectives(text) if c.kind == "all-gather")  # noqa
  sbox = {"s": state}

  def run_fsdp():
    s, m = step(sbox["s"], batch)
    m["loss"].block_until_ready()
    sbox["s"] = s

  for _ in range(args.warmup):
    run_plain()
    run_fsdp()
  times = {"plain": [], "fsdp": []}
  for _ in range(args.steps):
    for name, fn in (("plain", run_plain), ("fsdp", run_fsdp)):
      t0 = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - t0)
  return {"plain_s": statistics.median(times["plain"]),
          "fsdp_s": statistics.median(times["fsdp"]),
          "fsdp_peak_bytes": int(peak), "fsdp_all_gathers": gathers,
          "units": len(state.plan.units), "params": sum(l.numel for l in state.plan.leaves),
          "jax": jax.__version__}


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
    print("RESULT " + json.dumps(_child(args)), flush=True)
    return None

  import fsdp_jax  # pylint: disable=import-outside-toplevel  (no backend starts)
  sets = _flag_sets(tuple(fsdp_jax.CPU_XLA_FLAGS))
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
      env = dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=ROOT)
      out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *child_args],
                           env=env, capture_output=True, text=True, check=False)
      line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
      if out.returncode or not line:
        raise RuntimeError(f"{name}: {out.stderr[-3000:]}")
      results[name].append(json.loads(line[0][len("RESULT "):]))
      print(f"[{time.perf_counter() - t0:5.0f}s] repeat {r + 1}: {name}: "
            f"{results[name][-1]}", flush=True)

  base = sets["all library flags"]
  ref = results["all library flags"]
  med = lambda name, key: statistics.median(x[key] for x in results[name])
  first = ref[0]
  rows = []
  for name in sets:
    rows.append(
        f"| {name} | {med(name, 'plain_s') * 1e3:.0f} | "
        f"{med(name, 'plain_s') / med('all library flags', 'plain_s'):.2f} | "
        f"{med(name, 'fsdp_s') * 1e3:.0f} | "
        f"{med(name, 'fsdp_s') / med('all library flags', 'fsdp_s'):.2f} | "
        f"{results[name][0]['fsdp_all_gathers']} | "
        f"{results[name][0]['fsdp_peak_bytes'] / 2**20:.1f} |")
  text = "\n".join([
      "# CPU XLA flags: what each costs the user's code and earns fsdp_jax",
      "",
      f"Generated by `python benchmarks/flags.py {' '.join(child_args)}`".rstrip() + f" with jax "
      f"{first['jax']}: the benchmark GPT ({first['params']:,} parameters, {args.layers} "
      f"blocks of d_model {args.d_model}, {first['units']} FSDP units), global batch "
      f"{args.global_batch} x {args.seq_len}, AdamW; median of {args.steps} timed steps "
      f"after {args.warmup} warm-up, median over {args.repeats} runs of every flag set in "
      f"turn, each in a fresh process. Machine: {os.cpu_count()} cores, load average "
      f"{os.getloadavg()[0]:.1f} at the end.",
      "",
      f"The library's flags (`fsdp_jax.CPU_XLA_FLAGS`): `{base}`.",
      "",
      "| XLA_FLAGS | plain jit step ms (1 device) | vs all flags | fsdp_jax FULL_SHARD step ms "
      "(8 devices) | vs all flags | fsdp all-gathers per step | fsdp peak MiB per device |",
      "|---|---|---|---|---|---|---|",
      *rows,
      "",
      f"FULL_SHARD gathers each unit twice (forward, and again in backward): "
      f"{2 * first['units']} all-gathers for {first['units']} units. Fewer means XLA "
      "merged the backward re-gather into the forward gather, keeping every gathered "
      "unit alive until backward (SHARD_GRAD_OP's memory).",
      ""])
  with open(args.out, "w") as f:
    f.write(text)
  print(text)
  return text


if __name__ == "__main__":
  main()
