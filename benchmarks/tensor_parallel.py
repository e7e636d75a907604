#!/usr/bin/env python
"""Tensor parallelism composed with FSDP: stored bytes, bytes per mesh axis, step time.

    python -m benchmarks tensor_parallel     # TENSOR_PARALLEL.md, tensor_parallel.json (~11 min)
    python -m benchmarks tensor_parallel --d-model 64 --layers 2 --heads 4 --rounds 1 \\
        --warmup 1 --loss-vocab 1024 --loss-seq-len 32 --out /tmp/TP.md --json /tmp/tp.json  # smoke
    python -m benchmarks tensor_parallel --render     # TENSOR_PARALLEL.md from --json

The benchmark GPT on 8 simulated CPU devices: FSDP alone on make_mesh(shard=8)
against FSDP x tensor parallelism on make_mesh(shard=S, tensor=T): stored
bytes, bytes per mesh axis, step time, peak and first-step losses (each
defined in TENSOR_PARALLEL.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import jax  # noqa: E402  (importing starts no backend)
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import fsdp_jax  # noqa: E402
from fsdp_jax._src import hlo  # noqa: E402
from benchmarks import harness, hlo_stats, models  # noqa: E402

MiB = 2 ** 20
_UNIT = re.compile(r"%?([\w.\-]+) = .*?fsdp_all_gather\[([^\]]*)\]")
_TP_LINE = re.compile(r"^\s*('tensor' per step: .*|gathered over 'tensor'.*)$", re.M)


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name, default in (("d-model", 512), ("layers", 8), ("heads", 8), ("vocab", 256),
                        ("seq-len", 64), ("rounds", 15), ("warmup", 2),
                        ("loss-vocab", 16384), ("loss-seq-len", 256)):
    p.add_argument(f"--{name}", type=int, default=default)
  p.add_argument("--tensor", type=int, nargs="+", default=[2, 4], help="tensor axis sizes")
  p.add_argument("--render", action="store_true", help="only rewrite --out from --json")
  p.add_argument("--out", default=os.path.join(HERE, "TENSOR_PARALLEL.md"))
  p.add_argument("--json", default=os.path.join(HERE, "tensor_parallel.json"))
  return p.parse_args(argv)


def rules(cfg, t: int, head: bool = True) -> list:
  """Megatron's layout of the benchmark GPT: the (fused) q/k/v projection and
  the MLP's fc column-parallel, the attention output and the MLP's proj
  row-parallel; the head column-parallel when T divides the vocabulary
  (and ``head``)."""
  out = [("*.attn.qkv", "colwise"), ("*.attn.proj", "rowwise"),
         ("*.mlp.fc", "colwise"), ("*.mlp.proj", "rowwise")]
  return out + ([("lm_head", "colwise")] if head and cfg.vocab_size % t == 0 else [])


def axis_collectives(text: str, mesh) -> dict:
  """``{axis: {kind: {"count", "bytes"}}}`` per device per step (``shard``,
  ``tensor`` or ``all``); bytes as ``hlo_stats.collective_stats``' payload."""
  ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(mesh.devices.shape[0], -1)
  axes = {"shard": {tuple(sorted(c)) for c in ids.T.tolist()},
          "tensor": {tuple(sorted(r)) for r in ids.tolist()} if ids.shape[1] > 1 else set()}
  counts, _ = hlo_stats.execution_counts(text)
  out: dict = {}
  for c in hlo.collectives(text):
    g = tuple(sorted(c.groups[0])) if c.groups else tuple(sorted(ids.ravel().tolist()))
    axis = next((a for a, gs in axes.items() if g in gs), "all")
    runs = counts.get(c.computation, 1)
    for shape, dtype in zip(c.shapes, c.dtypes):
      kind = "scalar all-reduce" if c.kind == "all-reduce" and not shape else c.kind
      n = int(np.prod(shape)) * hlo._DTYPE_BYTES[dtype]  # pylint: disable=protected-access
      d = out.setdefault(axis, {}).setdefault(kind, {"count": 0, "bytes": 0})
      d["count"] += runs
      d["bytes"] += int(runs * n * (len(g) if kind == "reduce-scatter" else 1))
  return out


def split_leaf_gathers(text: str, plan, split: set) -> dict:
  """Shard-axis all-gathers of the leaves in ``split`` per device per step:
  a gather's unit from its op name (``fsdp_all_gather[unit]``), its leaf from
  the result shape among the unit's leaves (checked unambiguous)."""
  unit_of = dict(_UNIT.findall(text))
  shapes: dict = {}
  for unit in plan.units:
    for leaf in (plan.leaves[i] for i in unit.leaf_ids):
      shape = (plan.n * plan.chunk0(leaf),) + tuple(leaf.rest)  # one tensor slice, padded
      shapes.setdefault((unit.display_name, shape), set()).add(leaf.name in split)
  out = {"bytes": 0, "count": 0, "other_bytes": 0}
  for c in hlo.collectives(text):
    for shape in c.shapes if c.kind == "all-gather" and c.name in unit_of else ():
      hit = shapes.get((unit_of[c.name], tuple(shape)))
      if hit is None or len(hit) != 1:
        raise ValueError(f"gather {c.name} {shape} of {unit_of[c.name]}: leaf {hit}")
      key = "bytes" if True in hit else "other_bytes"
      out[key] += c.bytes // len(c.shapes)
      out["count"] += key == "bytes"
  return out


class Runs:
  """The model, its weights, and one compiled step per (S, T, batch, strategy)."""

  def __init__(self, args, log):
    self.log = log
    self.cfg = models.GPTConfig(args.vocab, args.seq_len, args.d_model, args.layers, args.heads)
    _, self.init_fn, self.loss_fn = models.make_model(self.cfg)
    rng = jax.random.key(0)
    self.classes = fsdp_jax.module_classes(self.init_fn, rng)
    self.params = jax.device_get(jax.jit(self.init_fn)(rng))  # host copy: fresh per run
    self.num_params = models.count_params(self.params)
    self.opt = optax.adam(1e-3)

  def build(self, s: int, t: int, batch: int, strategy: str, orig: bool,
            head: bool = True) -> dict:
    config = fsdp_jax.FSDPConfig(
        tensor_parallel=(fsdp_jax.TensorParallel(rules=rules(self.cfg, t, head)) if t > 1
                         else None),
        use_orig_params=orig, sharding_strategy=fsdp_jax.ShardingStrategy[strategy],
        auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({models.Block}))
    mesh = fsdp_jax.make_mesh(shard=s, tensor=t if t > 1 else None,
                              devices=jax.devices()[:s * t])
    t0 = time.perf_counter()
    state = fsdp_jax.init_train_state(params=self.params, optimizer=self.opt, mesh=mesh,
                                      config=config, module_classes=self.classes)
    step = fsdp_jax.shard_train_step(self.loss_fn, self.opt, mesh=mesh, config=config)
    data = jax.device_put(models.make_batch(self.cfg, batch), NamedSharding(mesh, P("shard")))
    compiled = step.lower(state, data).compile()
    text, plan = compiled.as_text(), str(state.plan)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    dev0 = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
    out = {"name": f"FSDP{s}" + (f"xTP{t}" if t > 1 else ""), "S": s, "T": t,
           "global_batch": batch, "strategy": strategy, "use_orig_params": orig,
           "params_bytes_per_device": dev0(state.params),
           "opt_bytes_per_device": dev0(state.opt_state),
           "memory": hlo_stats.memory_stats(compiled), "flops": float(cost.get("flops", 0.0)),
           "axes": axis_collectives(text, mesh),
           "plan_tensor_lines": [l.strip().replace(ROOT + os.sep, "")
                                 for l in _TP_LINE.findall(plan)],
           "split_leaves": sorted(l.name for l in state.plan.leaves if l.tensor_dim is not None),
           "split_numel": sum(l.numel for l in state.plan.leaves if l.tensor_dim is not None),
           "build_s": time.perf_counter() - t0}
    self.log(f"{out['name']} batch {batch} {strategy}{' orig' if orig else ''}: "
             f"{out['build_s']:.1f}s; peak {out['memory']['total'] / MiB:.1f} MiB")
    return out, (compiled, state, data, text, state.plan)


def gathered_part(args, runs: Runs) -> list:
  """Part 2: SHARD_GRAD_OP, original parameters; one step each for the loss."""
  rows = []
  for t in args.tensor:
    pair = [runs.build(8 // t, tt, 8 // t, "SHARD_GRAD_OP", True) for tt in (1, t)]
    split = set(pair[1][0]["split_leaves"])
    for r, (compiled, state, data, text, plan) in pair:
      r["split_gathers"] = split_leaf_gathers(text, plan, split)
      r["first_loss"] = float(compiled(state, data)[1]["loss"])
    rows.append({"S": 8 // t, "T": t, "alone": pair[0][0], "tp": pair[1][0]})
  return rows


def vocab_part(args, log) -> dict:
  """Part 4: a large vocabulary, FULL_SHARD at 1 sequence per data-parallel
  group; the head column-parallel (the loss over the split vocabulary) or
  replicated over 'tensor' (every device computes the whole logits)."""
  big = argparse.Namespace(**dict(vars(args), vocab=args.loss_vocab, seq_len=args.loss_seq_len,
                                  d_model=128, layers=2, heads=4))
  runs = Runs(big, log)
  rows = []
  for t in args.tensor:
    for head in (True, False):
      r, (compiled, state, data, _, _) = runs.build(8 // t, t, 8 // t, "FULL_SHARD", False, head)
      r.update(head_split=head, first_loss=float(compiled(state, data)[1]["loss"]))
      rows.append(r)
  return {"model": dataclasses.asdict(runs.cfg), "num_params": runs.num_params, "rows": rows}


def step_part(args, runs: Runs, log) -> list:
  """Part 3: FULL_SHARD, flat parameters; every point timed round-robin."""
  points = ([(8, 1, 8)] + [(8 // t, t, 8 // t) for t in args.tensor]
            + [(8 // t, t, 8) for t in args.tensor])
  variants = []
  for s, t, b in points:
    r, (compiled, state, data, _, _) = runs.build(s, t, b, "FULL_SHARD", False)
    box = {"state": (state,), "loss": None}
    run = harness._timed_runner(compiled, box, data,  # pylint: disable=protected-access
                                lambda out: ((out[0],), out[1]["loss"]))
    v = harness.Variant(harness.Setting(f"tp/{r['name']} b{b}", "fsdp", "FULL_SHARD", "fp32"),
                        run, r)
    v.box = box
    variants.append(v)
  harness.measure_times(variants, args.warmup, args.rounds, log)
  base = variants[0]
  for v in variants:
    ratios = [a / b for a, b in zip(v.times, base.times)]
    cpu = [a["cpu_s"] / b["cpu_s"] for a, b in zip(v.samples, base.samples)]
    v.info.update(first_loss=v.first_loss, times_s=v.times, ratios=ratios,
                  median_s=statistics.median(v.times), ratio=statistics.median(ratios),
                  cpu_ratio=statistics.median(cpu))
  return [v.info for v in variants]


# --------------------------------------------------------------------------
# The report (prose soft-wrapped here, joined into paragraphs at the end)


def _mib(b) -> str:
  return f"{b / MiB:,.2f}"


def _ax(r, axis, kind, key="bytes"):
  return r["axes"].get(axis, {}).get(kind, {}).get(key, 0)


def _row(label: str, runs: list, cell) -> str:
  return f"| {label} | " + " | ".join(cell(r) for r in runs) + " |"


def _axes_rows(runs: list) -> list:
  keys = sorted({(a, k) for r in runs for a, ks in r["axes"].items() for k in ks})
  cell = lambda r, a, k: (f"{_ax(r, a, k, 'count')} / {_mib(_ax(r, a, k))}"
                          if _ax(r, a, k, "count") else "-")
  return [_row(f"'{a}' {k}: count / MiB", runs, lambda r, a=a, k=k: cell(r, a, k))
          for a, k in keys]


def render(res: dict) -> str:
  cfg, gathered, steps, total = res["model"], res["gathered"], res["step"], res["num_params"] * 4
  stored = [steps[0]] + [r for r in steps[1:] if r["global_batch"] == r["S"]]
  equal = [r for r in steps[1:] if r["global_batch"] == 8]
  f, base, met = res["split_fraction"], steps[0], lambda ok: "**met**" if ok else "**missed**"
  _tensor_mib = lambda r: _mib(_ax(r, "tensor", "all-reduce") + _ax(r, "tensor", "all-gather"))
  dloss = ([abs(r["first_loss"] - r["ref_loss"]) for r in steps[1:]]
           + [abs(g["tp"]["first_loss"] - g["alone"]["first_loss"]) for g in gathered])
  qkv = [l for l in stored[-1]["plan_tensor_lines"] if "split at" in l]
  busy = (" Other processes shared the cores (load averages above): hence the wide per-round "
          "ranges." if res["machine_info"]["loadavg_start"][0] > res["machine_info"]["cores"] else "")
  L = [f"""# Tensor parallelism composed with FSDP

Generated by `{res['command']}` (`benchmarks/tensor_parallel.py`, {res['seconds']:.0f} s) on
{res['machine']}; 8 simulated CPU devices (`fsdp_jax.simulate_cpu_devices(8)`: every device is
the same RAM and cores), one process. Rerun: `python -m benchmarks tensor_parallel` (`--help` for
the sizes); every number is also in `benchmarks/tensor_parallel.json`.

Model: the benchmark GPT (`benchmarks/models.py`; {cfg['num_layers']} blocks, d_model
{cfg['d_model']}, {cfg['num_heads']} heads, vocabulary {cfg['vocab_size']}, context
{cfg['seq_len']}): {res['num_params']:,} fp32 parameters ({_mib(total)} MiB), `optax.adam(1e-3)`,
one FSDP unit per `Block`. Tensor parallelism: `FSDPConfig(tensor_parallel=TensorParallel(...))`
on `make_mesh(shard=S, tensor=T)` with
`rules=[{', '.join(f'({p!r}, {l!r})' for p, l in res['rules'])}]`
(`attn.qkv` is the fused q, k, v projection). The rules split {f * 100:.2f}% of the elements; the
embeddings, LayerNorms and row-parallel biases stay replicated over `'tensor'`.

## Targets

| target | measured | |
|---|---|---|"""]
  for r in stored[1:]:
    x = r["params_bytes_per_device"] / (total / 8)
    L.append(f"| {r['name']}: stored parameters per device <= 1.05 x 1/(S*T) of the total | "
             f"{x:.4f}x ({_mib(r['params_bytes_per_device'])} / {_mib(total / 8)} MiB) | "
             f"{met(x <= 1.05)} |")
  for g in gathered:
    x = g["tp"]["split_gathers"]["bytes"] / g["alone"]["split_gathers"]["bytes"]
    L.append(f"| FSDP{g['S']}xTP{g['T']}: bytes all-gathered over 'shard' for the split leaves "
             f"= 1/{g['T']} of FSDP{g['S']} alone's | {x:.4f}x | {met(x <= 1.001 / g['T'])} |")
  L += [f"""| first-step loss = FSDP alone's on the same global batch, within 1e-5 | largest
difference {max(dloss):.1e} ({len(dloss)} comparisons) | {met(max(dloss) <= 1e-5)} |

## 1. Stored state per device

`addressable_shards[0]` bytes summed over `state.params` (FULL_SHARD, flat parameters) and over
`state.opt_state` (Adam's two moments and step count). *Predicted*: f + (1 - f) x T, the split
fraction f stored at 1/(S*T) and the rest at 1/S.

| configuration | params MiB/device | total / 8 | ratio | predicted | Adam MiB/device | ratio to 2 x total / 8 |
|---|---:|---:|---:|---:|---:|---:|"""]
  L += [f"| {r['name']} | {_mib(r['params_bytes_per_device'])} | {_mib(total / 8)} | "
        f"{r['params_bytes_per_device'] / (total / 8):.4f} | {f + (1 - f) * r['T']:.4f} | "
        f"{_mib(r['opt_bytes_per_device'])} | {r['opt_bytes_per_device'] / (total / 4):.4f} |"
        for r in stored]
  L.append("""
## 2. Bytes per axis per step against FSDP alone on the same S

SHARD_GRAD_OP (each unit gathered once per step, in the forward pass, kept for the backward) and
`use_orig_params=True` (one gather per leaf) in both runs; FSDP alone on `make_mesh(shard=S)` with
the same S sequences. Per device per step from the compiled HLO (`fsdp_jax.hlo.collectives`;
all-gather: its result, reduce-scatter: its input, all-reduce: its buffer; a split leaf's gather
told by its op name's unit and its shape). 'shard' groups: equal tensor index ((0, 2, 4, 6) for
4 x 2); 'tensor' groups: T adjacent ids ((0, 1)).
""")
  for g in gathered:
    pair, sg = [g["alone"], g["tp"]], lambda r, k="bytes": r["split_gathers"][k]
    L += [f"| S = {g['S']}, T = {g['T']} | FSDP{g['S']} alone ({g['S']} devices) | "
          f"FSDP{g['S']}xTP{g['T']} (8 devices) |", "|---|---:|---:|",
          _row("**split leaves all-gathered over 'shard', MiB**", pair,
               lambda r: f"**{_mib(sg(r))}**"),
          f"| ratio | 1 | **{sg(g['tp']) / sg(g['alone']):.4f}** |",
          _row("split leaves' all-gathers", pair, lambda r: str(sg(r, "count"))),
          _row("other leaves all-gathered over 'shard', MiB", pair,
               lambda r: _mib(sg(r, "other_bytes")))]
    L += _axes_rows(pair) + [_row("first-step loss", pair, lambda r: f"{r['first_loss']:.6f}"), ""]
  L += [f"""## 3. The step

FULL_SHARD, flat parameters (as RESULTS.md), at 1 sequence per data-parallel group (global batch
= S: the T devices of a tensor group share one sequence) and at an equal global batch of 8. Step
time: {res['warmup']} warm-up steps each, then {res['rounds']} rounds each running one step of every
column back to back, the order rotated every round; *ratio*: the median of the per-round ratios to
FSDP8 (range in brackets). Peak: `memory_analysis()` argument + temp + output - alias. Flops:
`cost_analysis()`. Per device; collectives as in part 2.
""", _row("", steps, lambda r: f"{r['name']}, batch {r['global_batch']}"),
        "|---|" + "---:|" * len(steps),
        _row("sequences each device computes on", steps, lambda r: f"{r['global_batch'] / r['S']:g}"),
        _row("step time, median (ms)", steps, lambda r: f"{r['median_s'] * 1e3:.0f}"),
        _row("**step time / FSDP8**", steps, lambda r: f"**{r['ratio']:.3f}** "
             f"({min(r['ratios']):.2f}-{max(r['ratios']):.2f})"),
        _row("CPU time / FSDP8", steps, lambda r: f"{r['cpu_ratio']:.3f}"),
        _row("GFLOP per device per step", steps, lambda r: f"{r['flops'] / 1e9:.2f}"),
        _row("**peak MiB/device**", steps, lambda r: f"**{_mib(r['memory']['total'])}**")]
  L += [_row(f"&nbsp;&nbsp;{k}", steps, lambda r, k=k: _mib(r["memory"][k]))
        for k in ("argument", "temp", "output", "alias")]
  L += _axes_rows(steps) + [
      _row("first-step loss", steps, lambda r: f"{r['first_loss']:.6f}"),
      _row("FSDP alone on the same batch", steps, lambda r: f"{r['ref_loss']:.6f}"),
      _row("difference", steps, lambda r: f"{abs(r['first_loss'] - r['ref_loss']):.1e}"),
      "\nFSDP alone: FSDP8 at batch 8, FSDP on S devices (part 2) at batch S. What "
      "`print(state.plan)` reports for the tensor axis once the step is traced:\n"]
  for r in stored[1:]:
    L += [f"* {r['name']}:"] + [f"  * `{line}`" for line in r["plan_tensor_lines"]]
  j = lambda fmt, rows: "; ".join(fmt(r) for r in rows)
  shard = lambda r: _mib(_ax(r, "shard", "all-gather") + _ax(r, "shard", "reduce-scatter"))
  L.append(f"""
## Reading

* **Stored state: 1/(S*T) for every split leaf.** The split leaves are stored as 1/T slices
sharded S ways, the other {(1 - f) * 100:.2f}% of the elements at 1/S: {j(lambda r: (
    f"{r['name']} stores {r['params_bytes_per_device'] / (total / 8):.4f}x 1/8 of the total "
    f"(predicted {f + (1 - f) * r['T']:.4f}x)"), stored[1:])}. Adam's state follows.
* **Gathered over 'shard': 1/T for the split leaves,** in as many gathers. Counting every leaf,
{j(lambda g: (f"FSDP{g['S']}xTP{g['T']} gathers "
              f"{_ax(g['tp'], 'shard', 'all-gather') / _ax(g['alone'], 'shard', 'all-gather'):.4f}x"
              f" FSDP{g['S']}'s bytes"), gathered)}; the reduce-scatters shrink alike.
* **The tensor axis carries activations instead:** at 1 sequence per group
{j(lambda r: f"{r['name']} {_tensor_mib(r)} MiB", stored[1:])} per device per step, growing with
the sequences a group computes on (batch 8: {j(lambda r: f"{r['name']} {_tensor_mib(r)} MiB",
equal)}). The forward all-reduces are Megatron's two per block (after `attn.proj` and `mlp.proj`)
and three of the loss over the split vocabulary (part 4).
* **The attention core is not split in this model.** The fused `attn.qkv` output is separated
into q, k and v by `jnp.split` along the dimension colwise splits, and a device's contiguous slice
of those 3 x d_model columns holds no whole q, k and v heads: the step all-gathers each block's
qkv activation over 'tensor', runs scores, softmax and weighted sum whole on each of the T devices
of a group (T times the same work), then cuts the result to the slice for the row-parallel
`attn.proj`. The plan: `{qkv[0] if qkv else '(no such line)'}`. That is one forward all-gather
per block. Separate q, k and v projections, or a fused kernel ordered head by head, would keep
attention split by heads as in Megatron; the benchmark model is measured as it is.
* **Step time.** On simulated devices 8 threads of one process share 2 cores and a collective is a
copy in the same RAM; nothing models NVLink: the ratios reflect dispatch and compute on shared
cores, not a GPU node. At 1 sequence per group the tensor-parallel meshes process S sequences per
step against FSDP8's 8: {j(lambda r: (f"{r['name']} {r['ratio']:.3f}x the step, "
                                      f"{r['ratio'] * 8 / r['S']:.2f}x per sequence"), stored[1:])}.
At the same global batch of 8: {j(lambda r: (f"{r['name']} {r['ratio']:.3f}x (CPU time "
                                             f"{r['cpu_ratio']:.3f}x)"), equal)}. Per device
FSDP8 computes {base['flops'] / 1e9:.2f} GFLOP and moves {shard(base)} MiB over 'shard';
{j(lambda r: (f"{r['name']} {r['flops'] / 1e9:.2f} GFLOP, {shard(r)} MiB over 'shard' and "
              f"{_tensor_mib(r)} MiB over 'tensor'"), equal)}.{busy}
* **Peak memory per device:** {j(lambda r: (
    f"{r['name']} at batch {r['global_batch']} {r['memory']['total'] / base['memory']['total']:.2f}x"
    f" FSDP8's (temporaries {_mib(r['memory']['temp'])} MiB against "
    f"{_mib(base['memory']['temp'])})"), steps[1:])}. The temporaries hold a gathered block at 1/T of
its size and the activations of the sequences a device computes on (1 at batch S, 8/S at batch 8).
* **Losses:** every first-step loss equals FSDP alone's on the same batch within {max(dloss):.1e}.
""")
  L += _vocab_section(res["vocab"])
  return re.sub(r"(?<=[^\n|])\n(?=[^\n|*# ])", " ", "\n".join(L)).rstrip() + "\n"


def _vocab_section(v: dict) -> list:
  cfg, rows = v["model"], v["rows"]
  logits = cfg["seq_len"] * cfg["vocab_size"] * 4
  pairs = [(a, b) for a, b in zip(rows[::2], rows[1::2])]
  L = [f"""## 4. The loss over a split vocabulary

The benchmark GPT with a large vocabulary ({cfg['vocab_size']:,} tokens, context {cfg['seq_len']},
d_model {cfg['d_model']}, {cfg['num_layers']} blocks, {v['num_params']:,} parameters; the loss
`optax.softmax_cross_entropy_with_integer_labels`), FULL_SHARD, flat parameters, 1 sequence per
data-parallel group; one sequence's fp32 logits are {_mib(logits)} MiB. With the head
column-parallel (`("lm_head", "colwise")`) the loss runs on each device's slice of the vocabulary,
as Megatron's vocabulary-parallel cross-entropy: the maximum, the sum of `exp` and the labels'
logits are each a per-slice result all-reduced over 'tensor' ([batch, seq] values). Without that
rule the head is replicated over 'tensor' and every device computes the whole logits. Memory from
`memory_analysis()` per device, collectives as in part 2.
""", "| | " + " | ".join(f"{r['name']}, head {'split' if r['head_split'] else 'replicated'}"
                         for r in rows) + " |", "|---|" + "---:|" * len(rows),
       _row("**peak MiB/device**", rows, lambda r: f"**{_mib(r['memory']['total'])}**"),
       _row("temporaries MiB/device", rows, lambda r: _mib(r["memory"]["temp"]))]
  L += _axes_rows(rows) + [_row("first-step loss", rows, lambda r: f"{r['first_loss']:.6f}")]
  L.append("\n" + " ".join(
      f"FSDP{a['S']}xTP{a['T']}: the split vocabulary takes the peak from "
      f"{_mib(b['memory']['total'])} to {_mib(a['memory']['total'])} MiB per device "
      f"({a['memory']['total'] / b['memory']['total']:.2f}x; temporaries "
      f"{a['memory']['temp'] / b['memory']['temp']:.2f}x), the same first-step loss within "
      f"{abs(a['first_loss'] - b['first_loss']):.1e}." for a, b in pairs) + "\n")
  return L


def main(argv=None):
  args = _parse(argv)
  if args.render:
    with open(args.json) as f:
      res = json.load(f)
  else:
    t_start = time.perf_counter()
    fsdp_jax.simulate_cpu_devices(8)
    log = lambda msg: print(f"[{time.perf_counter() - t_start:5.0f}s] {msg}", file=sys.stderr,
                            flush=True)
    info = harness.machine_info()
    runs = Runs(args, log)
    res = {"command": " ".join(["python -m benchmarks tensor_parallel"]
                               + list(sys.argv[1:] if argv is None else argv)),
           "model": dataclasses.asdict(runs.cfg), "num_params": runs.num_params,
           "rules": rules(runs.cfg, max(args.tensor)), "machine_info": info,
           "warmup": args.warmup, "rounds": args.rounds}
    res["gathered"] = gathered_part(args, runs)
    res["step"] = step_part(args, runs, log)
    res["vocab"] = vocab_part(args, log)
    ref = {g["S"]: g["alone"]["first_loss"] for g in res["gathered"]}
    for r in res["step"]:
      r["ref_loss"] = res["step"][0]["first_loss"] if r["global_batch"] == 8 else ref[r["S"]]
    res["split_fraction"] = res["step"][-1]["split_numel"] / runs.num_params
    res["seconds"] = time.perf_counter() - t_start
    res["machine"] = (f"{info['date'][:10]}, {info['cores']}-core CPU ({info['cpu']}), "
                      f"{info['ram_bytes'] / 2 ** 30:.0f} GiB RAM, jax {info['jax']} (jaxlib "
                      f"{info['jaxlib']}), Python {info['python']}; load average (1 min) "
                      f"{info['loadavg_start'][0]:.1f} at the start, {os.getloadavg()[0]:.1f} at "
                      "the end")
    with open(args.json, "w") as f:
      json.dump(res, f, indent=1, default=str)
  text = render(res)
  with open(args.out, "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  main()
