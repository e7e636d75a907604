#!/usr/bin/env python
"""Sharded evaluation and the hand-off to inference: memory per device.

    python -m benchmarks eval                # writes benchmarks/EVAL.md (5-10 min on 2 cores)
    python -m benchmarks eval --hidden 64 --intermediate 128 --layers 2 --heads 4 \\
        --kv-heads 2 --vocab 512 --variants flat --out /tmp/EVAL.md   # smoke

On 8 simulated CPU devices, a Llama (``examples/llama.py``: grouped-query
attention, SwiGLU, RMSNorm, rotary embeddings; 58M parameters by default,
most of them in a 32,000-token embedding and head) whose embedding, head and
each layer are FSDP units. Compiled only (``memory_analysis()``: argument +
temporaries + output - aliased, per device), for each variant (strategy,
layout, precision, stacked layers):

* the eval step (``fsdp_jax.shard_eval_step``, the next-token loss) against
  the train step on the same batch (AdamW) and against
  ``summon_full_params`` + ``jax.jit`` of the same loss on the replicated
  tree (its peak plus the state's shards, which stay where they are);
* the target: eval peak <= the parameter shards + the 2 largest units
  (gathered, in ``param_dtype``) + 32 MiB, and well under the whole model;
* the collectives of the eval step's compiled HLO (each unit gathered once;
  no reduction) against the train step's.

Then ``reshard_params`` of the first variant onto ``make_mesh(tensor=8)``
(the state's devices) with Megatron's rules for the Llama
(``examples/llama_decode.TP_RULES``): the bytes each device holds against
its share (1/8 of every split leaf, the replicated ones whole), each split
leaf's shard shape, and each unit's program (``memory_analysis()``: its
temporaries and output) against the largest unit: the unit in flight.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

# Importing jax or fsdp_jax starts no backend: simulate_cpu_devices() in
# main() still chooses the devices.
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import fsdp_jax  # noqa: E402
import llama  # noqa: E402  (examples/llama.py)
import llama_decode  # noqa: E402  (examples/llama_decode.py)
from benchmarks.lora import _machine  # noqa: E402
from fsdp_jax._src import layout, reshard  # noqa: E402

MiB = 2 ** 20
SLACK = 32 * MiB
VARIANTS = {
    # name: (FSDPConfig options, description)
    "flat": (dict(), "FULL_SHARD, flat parameters, fp32"),
    "orig": (dict(use_orig_params=True), "FULL_SHARD, use_orig_params, fp32"),
    "sgo": (dict(sharding_strategy="SHARD_GRAD_OP", use_orig_params=True),
            "SHARD_GRAD_OP, use_orig_params, fp32"),
    "bf16": (dict(mixed_precision="bf16"), "FULL_SHARD, flat, bf16 compute (fp32 shards)"),
    "scan": (dict(scan=True, use_orig_params=True),
             "FULL_SHARD, use_orig_params, stacked layers in a scan"),
}


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--intermediate", type=int, default=1376)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--vocab", type=int, default=32000)
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--batch-per-device", type=int, default=1)
  p.add_argument("--variants", default=",".join(VARIANTS),
                 help=f"comma-separated, of {', '.join(VARIANTS)}")
  p.add_argument("--out", default=os.path.join(HERE, "EVAL.md"))
  args = p.parse_args(argv)
  args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  bad = [v for v in args.variants if v not in VARIANTS]
  if bad:
    p.error(f"unknown variants {bad}; choose from {list(VARIANTS)}")
  return args


def _peak(ma) -> int:
  return int(ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
             - ma.alias_size_in_bytes)


def _mib(b) -> str:
  return f"{b / MiB:,.1f}"


def _device0_bytes(tree) -> int:
  dev = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == dev)


def measure_variant(args, name, log) -> dict:

  opts, desc = VARIANTS[name]
  opts = dict(opts)
  scan = opts.pop("scan", False)
  bf16 = opts.pop("mixed_precision", None) == "bf16"
  if "sharding_strategy" in opts:
    opts["sharding_strategy"] = fsdp_jax.ShardingStrategy[opts["sharding_strategy"]]
  cfg = llama.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                          intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                          num_attention_heads=args.heads, num_key_value_heads=args.kv_heads)
  model = llama.Llama(cfg, scan=scan)
  units = {"params.embed", "params.lm_head"} | (set() if scan else {llama.Block})
  config = fsdp_jax.FSDPConfig(
      auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(units),
      stacked_layers=("params.layers",) if scan else (),
      mixed_precision=fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16) if bf16 else None,
      **opts)
  mesh = fsdp_jax.make_mesh(shard=8)
  t0 = time.perf_counter()
  state = fsdp_jax.init_train_state(
      init_fn=lambda rng: model.init(rng, jnp.zeros((1, 8), jnp.int32)),
      rng=jax.random.key(0), optimizer=optax.adamw(1e-4), mesh=mesh, config=config)
  jax.block_until_ready(state)
  log(f"{name}: init {time.perf_counter() - t0:.1f} s")
  plan = state.plan
  n_params = sum(l.numel for l in plan.leaves)
  batch_rows = 8 * args.batch_per_device
  toks = np.random.default_rng(0).integers(0, args.vocab, (batch_rows, args.seq_len + 1))
  batch = {"inputs": toks[:, :-1].astype(np.int32), "targets": toks[:, 1:].astype(np.int32)}

  def loss_fn(params, b):
    logits = model.apply(params, b["inputs"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"]).mean()

  t0 = time.perf_counter()
  eval_c = fsdp_jax.shard_eval_step(loss_fn, forward_inputs=("inputs",)).lower(
      state.replace(opt_state=None), batch).compile()
  t_eval = time.perf_counter() - t0
  t0 = time.perf_counter()
  train_c = fsdp_jax.shard_train_step(loss_fn, forward_inputs=("inputs",)).lower(
      state, batch).compile()
  t_train = time.perf_counter() - t0
  # summon_full_params + a plain jit of the same loss on the replicated tree.
  full = jax.eval_shape(lambda: jax.tree.map(
      lambda l: jnp.zeros(l.shape, l.dtype),
      jax.tree_util.tree_unflatten(plan.treedef, list(plan.leaves))))
  rep = NamedSharding(mesh, P())
  full = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=rep), full)
  split = NamedSharding(mesh, P("shard"))
  b_structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=split),
                           batch)
  cast = (lambda p: jax.tree.map(lambda x: x.astype(jnp.bfloat16), p)) if bf16 else (lambda p: p)
  plain_c = jax.jit(lambda p, b: loss_fn(cast(p), b)).lower(full, b_structs).compile()
  log(f"{name}: compiled eval {t_eval:.1f} s, train {t_train:.1f} s")
  compute = 2 if bf16 else 4
  # (elements gathered at once, name): a stacked unit one layer at a time
  unit_numel = sorted(
      (sum(plan.leaves[i].numel for i in u.leaf_ids) // (u.num_layers if u.stacked else 1),
       u.display_name + (" (one layer)" if u.stacked else "")) for u in plan.units)[::-1]
  unit_bytes = [(n * compute, name) for n, name in unit_numel]
  shards = _device0_bytes(state.params)
  counts = {}
  for label, c in (("eval", eval_c), ("train", train_c)):
    kinds = [x.kind for x in fsdp_jax.hlo.collectives(c.as_text())]
    counts[label] = {k: kinds.count(k) for k in ("all-gather", "reduce-scatter", "all-reduce")}
  return dict(
      name=name, desc=desc, n_params=n_params, whole=n_params * 4, shards=shards,
      units=unit_bytes, unit_numel=unit_numel, n_units=len(plan.units), stacked=scan,
      eval=eval_c.memory_analysis(), train=train_c.memory_analysis(),
      plain=plain_c.memory_analysis(), counts=counts, state=state, cfg=cfg)


def measure_reshard(result, log) -> dict:

  state = result["state"]
  plan = state.plan
  mesh = fsdp_jax.make_mesh(tensor=8, devices=list(plan.mesh.devices.flat))
  tp = fsdp_jax.TensorParallel(rules=llama_decode.TP_RULES)
  t0 = time.perf_counter()
  out = fsdp_jax.reshard_params(state, mesh=mesh, tensor_parallel=tp)
  jax.block_until_ready(out)
  seconds = time.perf_counter() - t0
  t0 = time.perf_counter()
  again = fsdp_jax.reshard_params(state, mesh=mesh, tensor_parallel=tp)
  jax.block_until_ready(again)
  seconds_again = time.perf_counter() - t0
  del again
  held = max(sum(s.data.nbytes for x in jax.tree.leaves(out) for s in x.addressable_shards
                 if s.device == d) for d in mesh.devices.flat)
  share, split_ok, n_split = 0, True, 0
  for x in jax.tree.leaves(out):
    spec = x.sharding.spec
    if "tensor" in tuple(spec):
      n_split += 1
      dim = tuple(spec).index("tensor")
      share += x.nbytes // 8
      split_ok &= all(s.data.shape[dim] * 8 == x.shape[dim] for s in x.addressable_shards)
    else:
      share += x.nbytes
  # Each unit's program: what it holds besides the unit's own shards.
  recipe, _ = reshard._recipe(plan)
  specs = reshard._specs(plan, recipe, mesh, tp)
  shardings = [NamedSharding(mesh, s) for s in specs]
  in_flight = []
  for units, positions in reshard._groups(plan, recipe):
    storage = tuple(tuple(layout.unit_storage(plan, plan.units[u], state.params)) for u in units)
    fn = reshard._group_program(plan, units, tuple(positions),
                                tuple(shardings[k] for k in positions), None)
    ma = fn.lower(storage).compile().memory_analysis()
    name = ", ".join(plan.units[u].display_name for u in units)
    in_flight.append((int(ma.temp_size_in_bytes + ma.output_size_in_bytes), name,
                      int(ma.temp_size_in_bytes), int(ma.output_size_in_bytes)))
  log(f"reshard_params: {seconds:.1f} s (again: {seconds_again:.2f} s)")
  return dict(held=held, share=share, split_ok=split_ok, n_split=n_split,
              n_leaves=len(jax.tree.leaves(out)), in_flight=sorted(in_flight)[::-1],
              seconds=seconds, seconds_again=seconds_again,
              largest_unit=result["unit_numel"][0][0] * 4)


def render(args, argv, results, rs, seconds, load) -> str:
  cmd = " ".join(["python -m benchmarks eval"] + list(argv))
  r0 = results[0]
  lines = [
      "# Sharded evaluation and the hand-off to inference\n",
      f"Generated by `{cmd}` (`benchmarks/eval.py`, {seconds:.0f} s, load average "
      f"{load[0]:.1f} -> {load[1]:.1f}: the cores were shared) on {_machine()}; 8 "
      "simulated CPU devices (`fsdp_jax.simulate_cpu_devices`). Compiled programs only: "
      "per-device bytes from `memory_analysis()` (argument + temporaries + output - "
      "aliased), which do not depend on the load. Rerun: `python -m benchmarks eval` "
      "(`--help` for the sizes).\n",
      f"The model: `examples/llama.py` with hidden {args.hidden}, {args.layers} layers, "
      f"{args.heads} heads ({args.kv_heads} key/value heads), MLP {args.intermediate}, "
      f"vocabulary {args.vocab}: {r0['n_params']:,} fp32 parameters "
      f"({_mib(r0['whole'])} MiB); FSDP units: the embedding, the head and each layer "
      "(a stacked unit for the scan). Batch: "
      f"{8 * args.batch_per_device} x {args.seq_len} tokens ({args.batch_per_device} row per "
      "device); the loss is the mean next-token cross-entropy (float32 logits). Baselines: "
      "the train step (AdamW) on the same batch, and `summon_full_params` + a plain "
      "`jax.jit` of the same loss on the replicated tree (its program's peak plus the "
      "state's parameter shards, which stay allocated).\n",
      "## Targets\n",
      "The eval step's peak against the shards + the 2 largest units (gathered, in the "
      "compute dtype) + 32 MiB, and against the whole model (fp32; *well under*: at most "
      "half of it).\n",
      "| target | measured | |",
      "|---|---|---|",
  ]
  for r in results:
    peak = _peak(r["eval"])
    bound = r["shards"] + r["units"][0][0] + r["units"][1][0] + SLACK
    lines.append(
        f"| {r['name']}: eval peak <= shards + 2 largest units + 32 MiB | {_mib(peak)} <= "
        f"{_mib(bound)} MiB | **{'met' if peak <= bound else 'missed'}** |")
    lines.append(
        f"| {r['name']}: well under the whole model ({_mib(r['whole'])} MiB) | "
        f"{peak / r['whole']:.2f}x | **{'met' if peak <= r['whole'] / 2 else 'missed'}** |")
  if rs is not None:
    ok_share = rs["held"] <= rs["share"] and rs["split_ok"]
    biggest = rs["in_flight"][0]
    unit = rs["largest_unit"]  # stored dtype (fp32): what reshard_params gathers
    ok_flight = biggest[2] <= unit + SLACK and biggest[3] <= unit
    lines.append(
        f"| reshard_params to tensor=8: 1/8 of each split leaf per device | "
        f"{rs['n_split']} of {rs['n_leaves']} leaves split, each device's shard 1/8 of the "
        f"split dimension: {rs['split_ok']}; {_mib(rs['held'])} MiB held per device, share "
        f"{_mib(rs['share'])} MiB | **{'met' if ok_share else 'missed'}** |")
    lines.append(
        f"| reshard_params: never more than the share plus one unit in flight | largest "
        f"program ({biggest[1]}): {_mib(biggest[2])} MiB temporaries + {_mib(biggest[3])} MiB "
        f"output, the unit gathered ({_mib(unit)} MiB) and its placed share | "
        f"**{'met' if ok_flight else 'missed'}** |")
  bf16 = [r for r in results if r["name"] == "bf16"]
  fp32 = [r for r in results if r["name"] == "flat"]
  if bf16 and fp32 and bf16[0]["eval"].temp_size_in_bytes > fp32[0]["eval"].temp_size_in_bytes:
    r = bf16[0]
    lines += ["", f"With bf16 compute the eval step holds {_mib(r['eval'].temp_size_in_bytes)} MiB "
              "of temporaries where fp32 holds less: the CPU backend widens bf16 matmuls to "
              "float32 (`float-normalization-bf16`), so at the head's matmul the gathered bf16 "
              "head and a float32 copy of it are both live (the plain `jax.jit` of the same "
              "loss pays the same: see its column below). A GPU multiplies in bf16."]
  lines += ["", "## Peak per device\n",
            "MiB per device. *Shards*: the state's stored parameters. *2 largest units*: "
            "gathered, in the compute dtype (a stacked unit: one layer).\n",
            "| variant | shards | 2 largest units | eval step peak (temp) | train step peak "
            "(temp) | summon + jit peak (shards + program) | eval / train | eval / summon + "
            "jit |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in results:
    e, t, p = r["eval"], r["train"], r["plain"]
    plain = r["shards"] + _peak(p)
    two = r["units"][0][0] + r["units"][1][0]
    lines.append(
        f"| {r['desc']} | {_mib(r['shards'])} | {_mib(two)} ({r['units'][0][1]}, "
        f"{r['units'][1][1]}) | **{_mib(_peak(e))}** ({_mib(e.temp_size_in_bytes)}) | "
        f"{_mib(_peak(t))} ({_mib(t.temp_size_in_bytes)}) | {_mib(plain)} "
        f"({_mib(r['shards'])} + {_mib(_peak(p))}) | {_peak(e) / _peak(t):.2f}x | "
        f"{_peak(e) / plain:.2f}x |")
  lines += ["", "## Collectives per step (compiled HLO)\n",
            "| variant | units | eval: all-gather / reduce-scatter / all-reduce | train: "
            "all-gather / reduce-scatter / all-reduce |", "|---|---:|---|---|"]
  for r in results:
    c = r["counts"]
    fmt = lambda d: f"{d['all-gather']} / {d['reduce-scatter']} / {d['all-reduce']}"
    lines.append(f"| {r['desc']} | {r['n_units']} | {fmt(c['eval'])} | {fmt(c['train'])} |")
  lines += ["", "Each gather in the eval step's HLO runs once: a unit before its first "
            "use (`use_orig_params=True`: one all-gather per leaf), and for the stacked "
            "unit the first layer before the loop and each next one inside it (the loop's "
            "gathers run once per layer). Nothing is reduced but the loss (one scalar "
            "all-reduce). The train step gathers the resharded units again in the backward "
            "pass and reduce-scatters every gradient."]
  if rs is not None:
    lines += ["", "## reshard_params onto a tensor=8 mesh\n",
              f"The `{r0['name']}` state ({r0['desc']}) resharded onto "
              "`make_mesh(tensor=8, devices=<the state's>)` with "
              "`examples/llama_decode.TP_RULES` (q, k, v, gate, up and the head by column; o "
              "and down by row; norms and the embedding replicated), fp32, one program per "
              f"unit structure (the layers share one): {rs['seconds']:.1f} s, "
              f"{rs['seconds_again']:.1f} s again with the programs kept (moving the model, "
              "on shared cores).\n",
              "| per device | MiB |", "|---|---:|",
              f"| held after the call (max over devices) | {_mib(rs['held'])} |",
              f"| the share: 1/8 of every split leaf + every replicated leaf | "
              f"{_mib(rs['share'])} |",
              f"| the whole model | {_mib(r0['whole'])} |", "",
              "Each unit's program (besides the unit's own shards, its arguments):\n",
              "| unit | temporaries | output (its share, placed) |", "|---|---:|---:|"]
    for total, name, temp, out in rs["in_flight"][:4]:
      lines.append(f"| {name} | {_mib(temp)} | {_mib(out)} |")
    if len(rs["in_flight"]) > 4:
      lines.append(f"| ... {len(rs['in_flight']) - 4} more, smaller | | |")
  return "\n".join(lines).rstrip() + "\n"


def main(argv=None):
  args = _parse(argv)
  t_start = time.perf_counter()
  fsdp_jax.simulate_cpu_devices(8)

  def log(msg):
    print(f"[{time.perf_counter() - t_start:5.0f}s] {msg}", file=sys.stderr, flush=True)

  results = []
  rs = None
  load0 = os.getloadavg()[0]
  for name in args.variants:
    results.append(measure_variant(args, name, log))
    if len(results) == 1:
      rs = measure_reshard(results[0], log)
    for r in results:
      r.pop("state", None)  # free the states as we go
  text = render(args, sys.argv[1:] if argv is None else argv, results, rs,
                time.perf_counter() - t_start, (load0, os.getloadavg()[0]))
  with open(args.out, "w") as f:
    f.write(text)
  print(text)
  log(f"wrote {args.out}")


if __name__ == "__main__":
  main()
