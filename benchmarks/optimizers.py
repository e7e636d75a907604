"""Optimizers on shards: what non-elementwise transformations cost.

Builds the benchmark GPT (``benchmarks/models.py``, 25.5M parameters, one
FSDP unit per ``Block``, FULL_SHARD, fp32) on 8 simulated CPU devices with
several optax optimizers, in both layouts, and for each runs the optimizer
the two ways ``FSDPConfig(optimizer_update=...)`` offers:

* ``sharded``: the update is evaluated on each device's shards (elementwise
  work local, a whole-parameter reduction is a local reduction plus a scalar
  all-reduce, an operation that needs a whole matrix gathers it);
* ``global``: the update runs on the logical tree outside ``shard_map`` and
  the compiler partitions it from the state's shardings.

For each compiled step it reports the collectives beyond plain AdamW's
(counted in the compiled HLO), the temp bytes (``memory_analysis()``), the
optimizer-state bytes per device, and the step time relative to AdamW in the
same layout and mode ``sharded``, all measured in one process: warm-up steps,
then rounds that run one step of every variant (in a rotating order); each
round's times are divided by that round's AdamW time, and the median over
rounds is reported. Writes ``benchmarks/OPTIMIZERS.md`` (``--out``).

    python benchmarks/optimizers.py [--rounds 5] [--warmup 1]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import fsdp_jax  # noqa: E402  (does not start a JAX backend)
from fsdp_jax._src import optim  # noqa: E402

MiB = 2 ** 20


def optimizers(optax):
  lr = 1e-3
  return {
      "adamw": optax.adamw(lr),
      "clip_by_global_norm + adamw": optax.chain(optax.clip_by_global_norm(1.0),
                                                 optax.adamw(lr)),
      "lamb": optax.lamb(lr),
      "adafactor": optax.adafactor(lr),
      "muon": optax.contrib.muon(lr),
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--batch-per-device", type=int, default=1)
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--layouts", default="flat,orig")
  ap.add_argument("--out", default=os.path.join(HERE, "OPTIMIZERS.md"))
  args = ap.parse_args(argv)
  t_start = time.perf_counter()
  fsdp_jax.simulate_cpu_devices(args.devices)

  import jax
  import numpy as np
  import optax
  import optax.contrib  # noqa: F401
  from jax.sharding import NamedSharding, PartitionSpec as P

  from benchmarks import models
  from benchmarks.common import GPTConfig, make_batch
  from fsdp_jax import hlo

  def log(msg):
    print(f"[{time.perf_counter() - t_start:5.0f}s] {msg}", file=sys.stderr, flush=True)

  cfg = GPTConfig()
  _, init_fn, loss_fn = models.make_model(cfg)
  rng = jax.random.key(0)
  classes = fsdp_jax.module_classes(lambda r: init_fn(r), rng)
  params = jax.device_get(jax.jit(init_fn)(rng))
  n_params = models.count_params(params)
  world = args.devices
  batch_np = make_batch(cfg, args.batch_per_device * world)
  mesh = fsdp_jax.make_mesh(shard=world, devices=jax.devices()[:world])
  batch = jax.device_put(batch_np, NamedSharding(mesh, P("shard")))
  log(f"model: {n_params:,} parameters; {world} devices")

  runs = {}
  for layout in args.layouts.split(","):
    for name, opt in optimizers(optax).items():
      for mode in ("sharded", "global"):
        config = fsdp_jax.FSDPConfig(
            auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({models.Block}),
            use_orig_params=layout == "orig", optimizer_update=mode)
        state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh,
                                          config=config, module_classes=classes)
        step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config)
        t0 = time.perf_counter()
        compiled = step.lower(state, batch).compile()
        t_compile = time.perf_counter() - t0
        stats = hlo.summarize(compiled.as_text())
        sharded_b, replicated_b = optim.state_bytes(state.plan, state.opt_state.layout)
        runs[(layout, name, mode)] = dict(
            compiled=compiled, state=state, stats=stats,
            temp=int(compiled.memory_analysis().temp_size_in_bytes),
            opt_bytes=sharded_b + replicated_b, replicated=replicated_b, times=[],
            t_compile=t_compile, losses=[],
            summary=state.plan.opt_update.summary)
        log(f"{layout} {name} {mode}: compiled in {t_compile:.1f}s, "
            f"temp {runs[(layout, name, mode)]['temp'] / MiB:.1f} MiB")

  def one_step(r):
    t0 = time.perf_counter()
    r["state"], metrics = r["compiled"](r["state"], batch)
    loss = float(metrics["loss"])
    r["losses"].append(loss)
    return time.perf_counter() - t0

  for r in runs.values():
    for _ in range(args.warmup):
      one_step(r)
  keys = list(runs)
  ratios = {k: [] for k in keys}
  load_before = os.getloadavg()
  for rd in range(args.rounds):
    order = keys[rd % len(keys):] + keys[:rd % len(keys)]
    dt = {k: one_step(runs[k]) for k in order}
    for k in keys:
      runs[k]["times"].append(dt[k])
      ratios[k].append(dt[k] / dt[(k[0], "adamw", "sharded")])
    log(f"round {rd + 1}/{args.rounds}")
  load_after = os.getloadavg()

  def coll(stats, kind):
    d = stats.get(kind, {"operands": 0, "bytes": 0})
    return d["operands"], d["bytes"]

  lines = []
  w = lines.append
  w("# Optimizers on shards: cost of non-elementwise transformations\n")
  w(f"Measured with `python benchmarks/optimizers.py` ({time.perf_counter() - t_start:.0f} s) "
    f"on a {os.cpu_count()}-core {platform.machine()} CPU, {world} simulated CPU devices, "
    f"jax {jax.__version__}, optax {optax.__version__}, Python {platform.python_version()}.\n")
  w(f"Model: the benchmark GPT (`benchmarks/models.py`), {n_params:,} fp32 parameters, one "
    f"FSDP unit per `Block`; FULL_SHARD; global batch {batch_np['inputs'].shape[0]} x "
    f"{cfg.seq_len} tokens. Collectives are counted in the compiled HLO (operands and bytes, "
    "per device) beyond those of `optax.adamw` in the same layout and mode; step time is "
    f"relative to `optax.adamw` with `optimizer_update=\"sharded\"` in the same layout "
    f"(median over {args.rounds} rounds of per-round ratios, after {args.warmup} warm-up "
    "step(s)).\n")
  for layout in args.layouts.split(","):
    w(f"## {'flat parameters' if layout == 'flat' else 'original parameters'} "
      f"(`use_orig_params={layout == 'orig'}`)\n")
    w("| optimizer | mode | what the sharded update needs | extra all-reduce (ops, bytes) | "
      "extra all-gather (ops, bytes) | optimizer state / device | temp | step time vs adamw |")
    w("|---|---|---|---:|---:|---:|---:|---:|")
    for name in optimizers(optax):
      for mode in ("sharded", "global"):
        r = runs[(layout, name, mode)]
        base = runs[(layout, "adamw", mode)]["stats"]
        ar = [a - b for a, b in zip(coll(r["stats"], "all-reduce"), coll(base, "all-reduce"))]
        ag = [a - b for a, b in zip(coll(r["stats"], "all-gather"), coll(base, "all-gather"))]
        need = runs[(layout, name, "sharded")]["summary"]
        w(f"| {name} | {mode} | {need if mode == 'sharded' else '(compiler)'} | "
          f"{ar[0]}, {ar[1] / MiB:.2f} MiB | {ag[0]}, {ag[1] / MiB:.2f} MiB | "
          f"{r['opt_bytes'] / MiB:.2f} MiB ({r['replicated'] / MiB:.2f} replicated) | "
          f"{r['temp'] / MiB:.1f} MiB | {statistics.median(ratios[(layout, name, mode)]):.3f} |")
    w("")
  same = all(np.allclose(runs[(l, n, "sharded")]["losses"], runs[(l, n, "global")]["losses"],
                         rtol=1e-4, atol=1e-5)
             for l in args.layouts.split(",") for n in optimizers(optax))
  w(f"- Losses of every step agree between the two modes (rtol 1e-4): {'yes' if same else 'no'}.")
  w(f"- Load average (1 min) {load_before[0]:.1f} before the timed rounds and "
    f"{load_after[0]:.1f} after; the per-round ratios pair steps taken back to back.")
  text = "\n".join(lines) + "\n"
  with open(args.out, "w") as fh:
    fh.write(text)
  print(text)
  log(f"wrote {args.out}")


if __name__ == "__main__":
  main()
