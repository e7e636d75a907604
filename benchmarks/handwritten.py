#!/usr/bin/env python
"""fsdp_jax against a minimal hand-written shard_map FSDP, by per-device batch.

The hand-written step is what a JAX user writes by hand for FULL_SHARD:
every parameter sharded along its first dimension, a ``jax.shard_map`` in
which each block all-gathers its parameters (``lax.all_gather``, tiled)
inside a ``jax.checkpoint`` that saves everything but the gathers (so the
backward pass gathers again), the gradient's reduce-scatter coming from
JAX's transpose of the all-gather, and AdamW on the shards. The embeddings,
final norm and head are gathered once, like fsdp_jax's root unit.

For each per-device batch, both steps of the same GPT are compiled in one
process (``fsdp_jax.custom.CPU_XLA_FLAGS``): step time (round-robin), peak bytes
per device (``memory_analysis()``) and a per-op breakdown of what the
compiled step moves (operands and results of every operation XLA runs, per
device, from the compiled module: ``hlo_stats.op_breakdown``). Writes
``benchmarks/HANDWRITTEN.md``.

    python benchmarks/handwritten.py                 # ~6 min on 2 cores
    python benchmarks/handwritten.py --d-model 64 --layers 2 --batch-per-device 1 --rounds 2 --out /tmp/H.md
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

import fsdp_jax  # noqa: E402  (importing starts no backend)
from benchmarks import fresh  # noqa: E402


def handwritten_step(cfg, mesh, optimizer, params):
  """``(shards, opt_state, step)``: the minimal hand-written FULL_SHARD step
  of the benchmark GPT; ``step(shards, opt_state, batch) -> (shards,
  opt_state, loss)`` on global arrays."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from jax import lax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from benchmarks.models import Block  # pylint: disable=import-outside-toplevel

  axis = mesh.axis_names[0]
  n = mesh.shape[axis]
  p = params["params"]
  for path, x in jax.tree_util.tree_flatten_with_path(p)[0]:
    assert x.shape[0] % n == 0, f"{jax.tree_util.keystr(path)} {x.shape}: dim 0 % {n}"
  spec = jax.tree.map(lambda _: P(axis), p)
  shards = jax.device_put(p, jax.tree.map(lambda s: NamedSharding(mesh, s), spec))
  opt_state = jax.jit(optimizer.init)(shards)
  o_spec = jax.tree.map(lambda x: P(axis) if getattr(x, "ndim", 0) else P(), opt_state)
  gather = lambda tree: jax.tree.map(lambda x: lax.all_gather(x, axis, axis=0, tiled=True),
                                     tree)
  # Save everything but the gathers: the backward pass gathers again.
  keep = lambda prim, *_, **__: prim.name != "all_gather"
  blocks = [k for k in p if k.startswith("block_")]

  @jax.checkpoint
  def root_gather(r):
    return gather(r)

  def block_fn(b, x):
    return Block(cfg.num_heads).apply({"params": gather(b)}, x)

  block_fn = jax.checkpoint(block_fn, policy=keep)

  def local_loss(s, batch):
    root = gather({k: v for k, v in s.items() if k not in blocks})
    tokens = batch["inputs"]
    x = nn.Embed(cfg.vocab_size, cfg.d_model).apply({"params": root["tok_embed"]}, tokens)
    x = x + nn.Embed(cfg.seq_len, cfg.d_model).apply({"params": root["pos_embed"]},
                                                     jnp.arange(tokens.shape[1]))
    for k in blocks:
      x = block_fn(s[k], x)
    x = nn.LayerNorm(dtype=x.dtype).apply({"params": root["ln_f"]}, x)
    logits = nn.Dense(cfg.vocab_size, dtype=x.dtype).apply({"params": root["lm_head"]}, x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]))

  def body(s, o, batch):
    loss, g = jax.value_and_grad(local_loss)(s, batch)
    g = jax.tree.map(lambda x: x / n, g)  # the transpose sums the devices' gradients
    updates, o = optimizer.update(g, o, s)
    return optax.apply_updates(s, updates), o, lax.pmean(loss, axis)

  b_spec = {"inputs": P(axis), "targets": P(axis)}
  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, o_spec, b_spec),
                               out_specs=(spec, o_spec, P()), check_vma=False),
                 donate_argnums=(0, 1))
  return shards, opt_state, step


ORIG, HAND = "fsdp_jax use_orig_params", "hand-written"


def _measure(bpd, args, log):
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from benchmarks import hlo_stats  # pylint: disable=import-outside-toplevel
  from benchmarks.common import GPTConfig, make_batch  # pylint: disable=import-outside-toplevel
  from benchmarks.models import Block, make_model  # pylint: disable=import-outside-toplevel

  cfg = GPTConfig(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
                  seq_len=args.seq_len)
  _, init_fn, loss_fn = make_model(cfg)
  mesh = fsdp_jax.make_mesh(shard=args.devices)
  batch = {k: jnp.asarray(v) for k, v in make_batch(cfg, bpd * args.devices).items()}
  opt = optax.adamw(1e-3)
  params = init_fn(jax.random.key(0))

  compiled, boxes, losses, runs = {}, {}, {}, {}

  def fsdp_run(name, config):
    state = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0), optimizer=opt,
                                      mesh=mesh, config=config)
    fstep = fsdp_jax.shard_train_step(loss_fn, opt)
    placed = fstep._place(state, batch)  # pylint: disable=protected-access
    compiled[name] = fstep.lower(state, batch).compile()
    boxes[name], losses[name] = [state], []

    def run():
      s, m = compiled[name](boxes[name][0], placed)
      jax.block_until_ready((s, m))
      boxes[name][0] = s
      losses[name].append(float(m["loss"]))
    runs[name] = run

  wrap = fsdp_jax.ModuleWrapPolicy({Block})
  fsdp_run("fsdp_jax", fsdp_jax.FSDPConfig(auto_wrap_policy=wrap))
  fsdp_run(ORIG, fsdp_jax.FSDPConfig(auto_wrap_policy=wrap, use_orig_params=True))
  shards, o_state, hstep = handwritten_step(cfg, mesh, opt, params)
  h_batch = jax.device_put(batch, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(mesh.axis_names[0])))
  compiled[HAND] = hstep.lower(shards, o_state, h_batch).compile()
  boxes[HAND], losses[HAND] = [(shards, o_state)], []

  def run_hand():
    s, o, loss = compiled[HAND](*boxes[HAND][0], h_batch)
    jax.block_until_ready((s, o, loss))
    boxes[HAND][0] = (s, o)
    losses[HAND].append(float(loss))
  runs[HAND] = run_hand
  for _ in range(args.warmup):
    for fn in runs.values():
      fn()
  times = {k: [] for k in runs}
  for r in range(args.rounds):
    order = list(runs) if r % 2 == 0 else list(runs)[::-1]
    for name in order:
      t0 = time.perf_counter()
      runs[name]()
      times[name].append(time.perf_counter() - t0)
  out = {}
  for name, c in compiled.items():
    text = c.as_text()
    out[name] = {"step_s": statistics.median(times[name]),
                 "peak": hlo_stats.memory_stats(c)["total"],
                 "ops": hlo_stats.op_breakdown(text),
                 "losses": losses[name][:3]}
  log(f"batch/device {bpd}: " + ", ".join(
      f"{k} {v['step_s'] * 1e3:.1f} ms, {v['peak'] / 2**20:.1f} MiB" for k, v in out.items()))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--d-model", type=int, default=384)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--heads", type=int, default=6)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch-per-device", type=int, nargs="+", default=[1, 2, 4])
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--rounds", type=int, default=10)
  p.add_argument("--out", default=os.path.join(HERE, "HANDWRITTEN.md"))
  args = p.parse_args(argv)
  fsdp_jax.simulate_cpu_devices(args.devices)
  import jax  # pylint: disable=import-outside-toplevel

  t0 = time.perf_counter()
  log = lambda msg: print(f"[{time.perf_counter() - t0:5.0f}s] {msg}", flush=True)
  results = {bpd: _measure(bpd, args, log) for bpd in args.batch_per_device}

  mib = lambda b: f"{b / 2**20:,.1f}"
  moved = lambda x: sum(v["bytes"] for v in x["ops"].values())
  rows = []
  for bpd, r in results.items():
    h = r[HAND]
    for name, f in r.items():
      rows.append(
          f"| {bpd} | {name} | {f['step_s'] * 1e3:.1f} | {f['step_s'] / h['step_s']:.2f} | "
          f"{mib(f['peak'])} | {f['peak'] / h['peak']:.2f} | {mib(moved(f))} | "
          f"{moved(f) / moved(h):.2f} |")
  names = list(next(iter(results.values())))
  breakdown = []
  for bpd, r in results.items():
    cats = sorted({c for x in r.values() for c in x["ops"]})
    for c in cats:
      cells = []
      for name in names:
        x = r[name]["ops"].get(c, {"ops": 0, "bytes": 0})
        cells.append(f"{x['ops']} | {mib(x['bytes'])}")
      breakdown.append(f"| {bpd} | {c} | " + " | ".join(cells) + " |")
  first = next(iter(results.values()))
  text = "\n".join([
      "# fsdp_jax against a minimal hand-written shard_map FSDP",
      "",
      f"Generated by `python benchmarks/handwritten.py` with jax {jax.__version__}: the "
      f"benchmark GPT (d_model {args.d_model}, {args.layers} blocks, {args.heads} heads, "
      f"{args.seq_len} tokens per sequence), FULL_SHARD fp32 on {args.devices} simulated CPU "
      f"devices, AdamW; median of {args.rounds} round-robin rounds after {args.warmup} "
      f"warm-up steps. Machine: {os.cpu_count()} cores, load average "
      f"{os.getloadavg()[0]:.1f} at the end. `fsdp_jax` is the default flat layout (one "
      "collective per unit); `use_orig_params` gathers and reduces each leaf on its own, "
      "like the hand-written step. First losses: "
      + "; ".join(f"{k} {v['losses']}" for k, v in first.items()) + ".",
      "",
      "| sequences per device | step | ms | time ratio | peak MiB | peak ratio | MiB moved "
      "| moved ratio |",
      "|---|---|---|---|---|---|---|---|",
      *rows,
      "",
      "Ratios are to the hand-written step at the same batch.",
      "",
      "## Per-op breakdown",
      "",
      "What the operations of each compiled step read and write, per device and step "
      "(operands and result of every operation XLA runs, loop bodies times their trip "
      "count; a fusion counts once, with what it reads and writes).",
      "",
      "| sequences per device | operations | " + " | ".join(
          f"{n} ops | {n} MiB" for n in names) + " |",
      "|---|---|" + "---|---|" * len(names),
      *breakdown,
      ""])
  return fresh.write_table(args.out, text)


if __name__ == "__main__":
  main()
