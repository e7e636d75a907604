#!/usr/bin/env python
"""ZeRO++-class communication in fsdp_jax: bytes per link, memory, error, loss.

    python benchmarks/zeropp.py                # everything (about 25 min on 2 busy cores)
    python benchmarks/zeropp.py --only bytes   # bytes and memory (about 7 min)
    python benchmarks/zeropp.py --only errors  # gradient error (about 7 min)
    python benchmarks/zeropp.py --only curves --steps 300   # loss curves, seeds (about 10 min)
    python benchmarks/zeropp.py --render       # ZEROPP.md from the saved zeropp.json

On 8 simulated CPU devices it measures, and writes to ``benchmarks/ZEROPP.md``
(tables) and ``benchmarks/zeropp.json`` (every number, and the loss curves the
strategies notebook plots):

1. **bytes per collective per step, per link type**, read from the compiled
   HLO of a GPT train step (collective result shapes, element types and
   replica groups), against the ZeRO++ paper's model. Two layouts of 8
   devices in 2 nodes of 4: a 2 x 4 mesh (``("replicate", "shard")``; a
   node is a row), and a 1-D mesh of 8 where a "node" is a group of 4
   adjacent devices (``reshard_after_forward=4``'s groups). A collective
   whose every replica group lies inside one node runs on intra-node links;
   any other crosses nodes.
2. **memory** of ``reshard_after_forward`` = True, 4, 2, False:
   ``compiled.memory_analysis()`` temporaries and ``plan.bytes_kept_for_backward()``.
3. **gradient error per step** of the quantized reduction: the reduced
   gradient against the exact one on the same state and batch.
4. **loss curves**: the example GPT (``examples/train_gpt.py``'s model, data
   and optimizer at its default size) for ``--steps`` steps, with and
   without each quantization; and the final loss of a few of them on other
   data seeds (``--seeds``).

Volumes follow the paper's convention (the size of the tensor a collective
is about, per device): an all-gather's result, a reduce-scatter's input
(result x group size), an all-to-all's result, an all-reduce's buffer.
``Psi`` is the parameter count x 2 bytes (fp16, the paper's unit).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import fsdp_jax  # noqa: E402
from fsdp_jax._src import hlo  # noqa: E402

S = fsdp_jax.ShardingStrategy
Q = fsdp_jax.Quantization
INT8, INT4 = Q(dtype=jnp.int8), Q(dtype="int4")
INT4_NEAREST = Q(dtype="int4", rounding="nearest")

# ---------------------------------------------------------------------------
# Reading the compiled program


def _groups(text: str):
  """Replica groups as printed by XLA, in any of its forms (explicit
  ``{{0,1},{2,3}}``, iota ``[2,4]<=[8]``, or jax 0.12's mesh form)."""
  return list(hlo.replica_groups(text))


def collectives(text: str):
  """``(kind, op_name, bytes, dtypes, groups)`` of every non-scalar
  collective of the module, in program order."""
  out = []
  names = [re.search(r'op_name="([^"]*)"', line) for line in text.splitlines()
           if hlo._INSTR.match(line) and not ("all-gather" in line and "-done" in line)]
  for c, name in zip(hlo.collectives(text), names):
    if all(s == () for s in c.shapes):
      continue  # the step's scalar metrics
    out.append((c.kind, name.group(1) if name else "", c, _groups(c.replica_groups)))
  return out


def per_link(text: str, node_of) -> dict:
  """Bytes per device per step: ``{(phase, link): bytes}`` with phase in
  forward all-gather / backward all-gather / gradient, link intra / inter."""
  out = collections.Counter()
  seen = set()
  for kind, name, c, groups in collectives(text):
    unit = re.search(r"fsdp_all_gather\[([^\]]*)\]", name)
    if kind == "all-gather" and unit and "fsdp_reduce_scatter" not in name:
      phase = "backward gather" if unit.group(1) in seen else "forward gather"
      seen.add(unit.group(1))
    else:
      phase = "gradient"
    size = len(groups[0]) if groups else 1
    volume = c.bytes * size if kind == "reduce-scatter" else c.bytes
    link = "intra" if all(len({node_of(d) for d in g}) == 1 for g in groups) else "inter"
    out[(phase, link)] += volume
  return dict(out)


# ---------------------------------------------------------------------------
# 1. Bytes per link


BYTES_ROWS = [
    # (label, mesh, config kwargs)
    ("FULL_SHARD fp32", "2x4", dict()),
    ("FULL_SHARD bf16 (param+reduce)", "2x4", dict(mp="bf16")),
    ("+ qwZ int8 gathers", "2x4", dict(all_gather_quantization=INT8)),
    ("+ hpZ reshard_after_forward=4", "2x4", dict(reshard_after_forward=4)),
    ("+ qgZ int4 gradients", "2x4", dict(reduce_scatter_quantization=INT4)),
    ("ZeRO++ (qwZ int8 + hpZ 4 + qgZ int4)", "2x4",
     dict(all_gather_quantization=INT8, reshard_after_forward=4, reduce_scatter_quantization=INT4)),
    ("HYBRID_SHARD fp32", "2x4", dict(sharding_strategy=S.HYBRID_SHARD)),
    ("HYBRID_SHARD + qgZ int4", "2x4",
     dict(sharding_strategy=S.HYBRID_SHARD, reduce_scatter_quantization=INT4)),
    ("FULL_SHARD fp32", "8", dict()),
    ("+ qwZ int8 gathers", "8", dict(all_gather_quantization=INT8)),
    ("+ qwZ float8_e4m3fn gathers", "8", dict(all_gather_quantization=Q(dtype=jnp.float8_e4m3fn))),
    ("+ qwZ int4 gathers", "8", dict(all_gather_quantization=INT4)),
    ("+ hpZ reshard_after_forward=4", "8", dict(reshard_after_forward=4)),
    ("+ qgZ int4 gradients", "8", dict(reduce_scatter_quantization=INT4)),
    ("ZeRO++ (qwZ int8 + hpZ 4 + qgZ int4)", "8",
     dict(all_gather_quantization=INT8, reshard_after_forward=4, reduce_scatter_quantization=INT4)),
]

# The paper's model (ZeRO++, Wang et al. 2023, section 3): cross-node volume
# per step in Psi for ZeRO-3 with fp16 weights and gradients, and with each
# technique: (forward gather, backward gather, gradient).
PAPER = {"ZeRO-3 (fp16)": (1.0, 1.0, 1.0), "qwZ": (0.5, 1.0, 1.0), "hpZ": (1.0, 0.0, 1.0),
         "qgZ": (1.0, 1.0, 0.25), "ZeRO++": (0.5, 0.0, 0.25)}


def _gpt_setup(d_model, layers, seed=0):
  from benchmarks.models import GPTConfig, make_batch, make_model
  cfg = GPTConfig(d_model=d_model, num_layers=layers, num_heads=4)
  model, init_fn, loss_fn = make_model(cfg)
  from benchmarks.models import Block
  return cfg, init_fn, loss_fn, make_batch(cfg, 8, seed=seed), Block


def _config(kw, block_cls):
  kw = dict(kw)
  mp = kw.pop("mp", None)
  if mp == "bf16":
    kw["mixed_precision"] = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16,
                                                    reduce_dtype=jnp.bfloat16)
  return fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({block_cls}), **kw)


def _mesh(name):
  devices = jax.devices()[:8]
  if name == "2x4":
    return fsdp_jax.make_mesh(replicate=2, shard=4, devices=devices)
  return fsdp_jax.make_mesh(shard=8, devices=devices)


def measure_bytes(args):
  cfg, init_fn, loss_fn, batch, block_cls = _gpt_setup(args.d_model, args.layers)
  opt = optax.adam(1e-3)
  rows = []
  psi = None
  for label, mesh_name, kw in BYTES_ROWS:
    t0 = time.perf_counter()
    config = _config(kw, block_cls)
    mesh = _mesh(mesh_name)
    state = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0), optimizer=opt,
                                      mesh=mesh, config=config)
    step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config)
    lowered = step.lower(state, batch)
    compiled = lowered.compile()
    params = sum(l.numel for l in state.plan.leaves)
    psi = 2 * params
    links = per_link(compiled.as_text(), lambda d: d // 4)
    mem = compiled.memory_analysis()
    # Element types per collective kind, as the program asks (the lowered,
    # unoptimized HLO) and as the backend compiled it.
    dtypes = {name: sorted({f"{c.kind} {d}" for c in hlo.collectives(text) if c.shapes[0] != ()
                            for d in c.dtypes})
              for name, text in (("program", lowered.as_text(dialect="hlo")),
                                 ("compiled", compiled.as_text()))}
    rows.append({"label": label, "mesh": mesh_name, "params": params, "psi_bytes": psi,
                 "bytes": {f"{p}/{l}": b for (p, l), b in sorted(links.items())},
                 "dtypes": dtypes,
                 "temp_bytes": int(mem.temp_size_in_bytes),
                 "kept_for_backward": state.plan.bytes_kept_for_backward(),
                 "seconds": round(time.perf_counter() - t0, 1)})
    inter = sum(b for (p, l), b in links.items() if l == "inter")
    print(f"  bytes: {mesh_name:>3} {label:<40} inter-node {inter / psi:.3f} Psi "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
  return {"model": {"d_model": args.d_model, "layers": args.layers, "params": rows[0]["params"]},
          "rows": rows}


# ---------------------------------------------------------------------------
# 2. Memory of reshard_after_forward


def measure_memory(args):
  cfg, init_fn, loss_fn, batch, block_cls = _gpt_setup(args.d_model, args.layers)
  opt = optax.adam(1e-3)
  out = []
  for k in (True, 4, 2, False):
    config = _config(dict(reshard_after_forward=k), block_cls)
    mesh = _mesh("8")
    state = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0), optimizer=opt,
                                      mesh=mesh, config=config)
    compiled = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config).lower(
        state, batch).compile()
    m = compiled.memory_analysis()
    out.append({"reshard_after_forward": k, "temp_bytes": int(m.temp_size_in_bytes),
                "argument_bytes": int(m.argument_size_in_bytes),
                "kept_for_backward": state.plan.bytes_kept_for_backward()})
    print(f"  memory: reshard_after_forward={k!s:<5} temp {m.temp_size_in_bytes:,} B", flush=True)
  return out


# ---------------------------------------------------------------------------
# 3. Gradient error of the quantized reduction, per step


def measure_grad_error(args):
  """Relative L2 error and max error (over max |g|) of the reduced gradient
  against the exact one, on the trained states of the exact run at a few
  steps (same batch for both)."""
  cfg, init_fn, loss_fn, _, block_cls = _gpt_setup(args.d_model, args.layers)
  from benchmarks.models import make_batch
  opt = optax.adam(3e-4)
  settings = [("qgZ int8, 1-D 8", "8", dict(reduce_scatter_quantization=INT8)),
              ("qgZ int4, 1-D 8", "8", dict(reduce_scatter_quantization=INT4)),
              ("qgZ int4, 1-D 8, round to nearest", "8",
               dict(reduce_scatter_quantization=INT4_NEAREST)),
              ("qgZ int8, 2x4 two hops", "2x4", dict(reduce_scatter_quantization=INT8)),
              ("qgZ int4, 2x4 two hops", "2x4", dict(reduce_scatter_quantization=INT4)),
              ("qgZ int8, HYBRID 2x4", "2x4",
               dict(sharding_strategy=S.HYBRID_SHARD, reduce_scatter_quantization=INT8)),
              ("qwZ int8 (forward on int8 weights)", "8", dict(all_gather_quantization=INT8))]
  out = []
  for label, mesh_name, kw in settings:
    exact_kw = {k: v for k, v in kw.items() if k == "sharding_strategy"}
    mesh = _mesh(mesh_name)
    exact_cfg, q_cfg = _config(exact_kw, block_cls), _config(kw, block_cls)
    state = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0), optimizer=opt,
                                      mesh=mesh, config=exact_cfg)
    step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=exact_cfg)
    exact_grads = _grads_fn(loss_fn, state.plan)
    quant_grads = _grads_fn(loss_fn, _replan(state.plan, q_cfg))
    errs = []
    for s in range(args.error_steps):
      batch = make_batch(cfg, 16, seed=100 + s)
      if s % max(args.error_steps // 4, 1) == 0:
        exact = exact_grads(state.params, batch)
        quant = quant_grads(state.params, batch)
        e = jax.tree.leaves(jax.tree.map(lambda a, b: a - b, quant, exact))
        g = jax.tree.leaves(exact)
        rel = float(np.sqrt(sum(float(jnp.sum(x ** 2)) for x in e)
                            / sum(float(jnp.sum(x ** 2)) for x in g)))
        mx = max(float(jnp.max(jnp.abs(x))) for x in e) / max(float(jnp.max(jnp.abs(x)))
                                                               for x in g)
        # The error's component along the exact gradient, <e, g> / <g, g>:
        # negative when the quantized gradient is shrunk toward 0 (a bias).
        along = (sum(float(jnp.sum(a * b)) for a, b in zip(e, g))
                 / sum(float(jnp.sum(x ** 2)) for x in g))
        errs.append({"step": s, "relative_l2": rel, "max_over_max": mx, "along_g": along})
      state, _ = step(state, batch)
    out.append({"label": label, "mesh": mesh_name, "per_step": errs})
    print(f"  gradient error: {label:<36} rel L2 "
          + ", ".join(f"{e['relative_l2']:.2e}" for e in errs) + "; along g "
          + ", ".join(f"{e['along_g']:+.2e}" for e in errs), flush=True)
  return out


def _grads_fn(loss_fn, plan):
  """The reduced gradient shards of a batch (``fsdp_jax.custom.sharded_grads``,
  compiled once)."""
  vg = fsdp_jax.custom.value_and_grad(loss_fn, plan=plan)
  p_specs = fsdp_jax.custom.param_specs(plan)
  t_specs = fsdp_jax.custom.split_trainable(plan, p_specs)[0]
  b_spec = fsdp_jax.custom.batch_spec(plan)

  def body(params, batch):
    return vg(params, batch)[1]

  fn = jax.jit(jax.shard_map(body, mesh=plan.mesh,
                             in_specs=(p_specs, {"inputs": b_spec, "targets": b_spec}),
                             out_specs=t_specs, check_vma=False))
  return lambda params, batch: fn(params, batch)


def _replan(plan, config):
  """The same plan with another config (same units, layout and mesh)."""
  import dataclasses
  return dataclasses.replace(plan, config=config)


# ---------------------------------------------------------------------------
# 4. Loss curves of the example GPT

# (label, config, whether the 2% target applies: int4 weights, and int4
# gradients rounded to nearest, are shown as measured; they are not settings
# the docs recommend). Gradients round stochastically by default.
CURVES = [
    ("exact (FULL_SHARD fp32)", dict(), True),
    ("hpZ reshard_after_forward=4", dict(reshard_after_forward=4), True),
    ("qwZ int8", dict(all_gather_quantization=INT8), True),
    ("qwZ float8_e4m3fn", dict(all_gather_quantization=Q(dtype=jnp.float8_e4m3fn)), True),
    ("qwZ int4", dict(all_gather_quantization=INT4), False),
    ("qwZ int4, blocks of 32", dict(all_gather_quantization=Q(dtype="int4", block_size=32)),
     False),
    ("qgZ int8", dict(reduce_scatter_quantization=INT8), True),
    ("qgZ int4", dict(reduce_scatter_quantization=INT4), True),
    ("qgZ int4, round to nearest", dict(reduce_scatter_quantization=INT4_NEAREST), False),
    ("ZeRO++ (qwZ int8, hpZ 4, qgZ int4)",
     dict(all_gather_quantization=INT8, reshard_after_forward=4, reduce_scatter_quantization=INT4),
     True),
]


def example_setup(steps: int, seed: int = 0):
  """The example's defaults (examples/train_gpt.py): d_model 64, 2 blocks,
  4 heads, context 64, global batch 16, AdamW with warmup + cosine decay
  to a peak of 1e-2, the stdlib-source text."""
  import train_gpt as ex
  text, _ = ex.load_text(None)
  data = ex.CharData(text, seed)
  model = ex.GPT(vocab_size=data.vocab_size, max_len=64, d_model=64, num_layers=2,
                 num_heads=4)

  def init_fn(rng):
    return model.init(rng, jnp.zeros((1, 64), jnp.int32))

  def loss_fn(params, batch):
    logits = model.apply(params, batch["inputs"])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]))

  warmup = max(1, steps // 10)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=1e-2, warmup_steps=warmup,
      decay_steps=max(steps, warmup + 1), end_value=1e-3)
  optimizer = optax.adamw(schedule, b2=0.99, weight_decay=0.01)
  batches = [data.batch(16, 64, step=s) for s in range(steps)]
  # Held out: windows the training batches (steps 0..steps-1) never drew.
  evaluation = [data.batch(64, 64, step=10**6 + s) for s in range(EVAL_BATCHES)]
  return init_fn, loss_fn, optimizer, batches, ex.Block, evaluation


EVAL_BATCHES = 8  # x 64 windows of 64 characters


def run_curve(kw, steps, setup=None):
  """Training losses, and the final parameters' loss on the held-out
  windows (exact: full parameters on one device)."""
  init_fn, loss_fn, optimizer, batches, block, evaluation = setup or example_setup(steps)
  mesh = _mesh("8")
  config = _config(kw, block)
  state = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0),
                                    optimizer=optimizer, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(loss_fn, optimizer, mesh=mesh, config=config)
  losses = []
  for batch in batches[:steps]:
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  params = jax.device_put(fsdp_jax.summon_full_params(state), jax.devices()[0])
  held_out = float(np.mean([jax.jit(loss_fn)(params, b) for b in evaluation]))
  return losses, held_out


# Settings also trained on other data seeds (batches and held-out windows),
# against the exact run on the same data: how much of a gap is the seed's.
SEED_LABELS = ("exact (FULL_SHARD fp32)", "qgZ int4", "qgZ int4, round to nearest",
               "ZeRO++ (qwZ int8, hpZ 4, qgZ int4)")


def measure_seeds(args):
  out = []
  for seed in args.seeds:
    setup = example_setup(args.steps, seed=seed)
    for label, kw, _ in CURVES:
      if label in SEED_LABELS:
        t0 = time.perf_counter()
        _, held_out = run_curve(kw, args.steps, setup)
        out.append({"seed": seed, "label": label, "held_out_loss": held_out})
        print(f"  seed {seed}: {label:<36} held-out {held_out:.4f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
  return out


def measure_curves(args):
  setup = example_setup(args.steps)
  out = []
  for label, kw, target in CURVES:
    t0 = time.perf_counter()
    losses, held_out = run_curve(kw, args.steps, setup)
    out.append({"label": label, "config": {k: repr(v) for k, v in kw.items()},
                "losses": losses, "held_out_loss": held_out, "target_2pct": target,
                "seconds": round(time.perf_counter() - t0, 1)})
    print(f"  curve: {label:<36} held-out {held_out:.4f}, last step {losses[-1]:.4f} "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
  return out


# ---------------------------------------------------------------------------
# Report


def inter_total(row) -> float:
  """Inter-node bytes per device per step of a bytes row, in Psi."""
  return sum(v for k, v in row["bytes"].items() if k.endswith("/inter")) / row["psi_bytes"]


def _mb(b):
  return f"{b / 2**20:.2f}"


def render(results) -> str:
  meta = results["meta"]
  lines = [
      "# ZeRO++-class communication: measured",
      "",
      f"Measured {meta['date']} with jax {meta['jax']}, jaxlib {meta['jaxlib']}, Python "
      f"{meta['python']}, {meta['devices']} simulated CPU devices ({meta['machine']}); "
      "`python benchmarks/zeropp.py` writes this file and `zeropp.json`. Method: "
      "the docstring of `benchmarks/zeropp.py` and docs/zeropp.md.",
      "",
  ]
  if "bytes" in results:
    b = results["bytes"]
    psi = b["rows"][0]["psi_bytes"]
    lines += [
        "## Bytes per collective per step, per link type",
        "",
        f"GPT of `benchmarks/models.py` with d_model {b['model']['d_model']}, "
        f"{b['model']['layers']} blocks ({b['model']['params']:,} parameters; "
        f"Psi = 2 bytes x parameters = {_mb(psi)} MiB), one FSDP unit per block, "
        "fp32 master weights, global batch 8. Per device, from the compiled HLO; "
        "in Psi. Two nodes of 4 devices: on the `2x4` mesh a node is a `\"replicate\"` "
        "row (FULL_SHARD shards over both axes: ZeRO-3 over 8 devices, the paper's "
        "setting); on the `8` mesh a node is a group of 4 adjacent devices.",
        "",
        "| mesh | setting | fwd gather intra | fwd gather inter | bwd gather intra | "
        "bwd gather inter | gradient intra | gradient inter | **inter-node total** | "
        "inter-node / FULL_SHARD fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    widened = []
    for r in b["rows"]:
      get = lambda p, l: r["bytes"].get(f"{p}/{l}", 0) / r["psi_bytes"]
      base = inter_total(next(x for x in b["rows"] if x["mesh"] == r["mesh"]))
      lines.append(
          f"| {r['mesh']} | {r['label']} | " + " | ".join(
              f"{get(p, l):.3f}" for p in ("forward gather", "backward gather", "gradient")
              for l in ("intra", "inter")) + f" | **{inter_total(r):.3f}** | "
          f"{inter_total(r) / base:.3f} |")
      d = r.get("dtypes", {})
      if d.get("program") != d.get("compiled"):
        widened.append(f"`{r['label']}`: the program's collectives are "
                       f"{', '.join(d['program'])}; compiled: {', '.join(d['compiled'])}")
    lines += [
        "",
        "A collective counts as inter-node when any of its replica groups spans two "
        "nodes, with all its bytes, as in the paper's model (where each of ZeRO-3's "
        "collectives over all devices counts in full). Psi is 2 bytes per parameter "
        "whatever the dtype moved, so fp32 FULL_SHARD moves about 2 x 3 Psi (the root "
        "unit is not gathered again in backward) and the absolute Psi of a row compares "
        "with the paper's model below; the last column is relative to this table's fp32 "
        "baseline, not to a 16-bit one.",
    ]
    if widened:
      lines += ["", "Element types the CPU backend changed when compiling (the table "
                "counts the compiled bytes; the program asked for the narrower type): "
                + "; ".join(widened) + "."]
    lines += [
        "",
        "The paper's model (cross-node volume per step, Psi, fp16 ZeRO-3 baseline):",
        "",
        "| technique | fwd gather | bwd gather | gradient | total | / ZeRO-3 |",
        "|---|---|---|---|---|---|",
    ]
    for name, (f, bw, g) in PAPER.items():
      lines.append(f"| {name} | {f} | {bw} | {g} | {f + bw + g:g} | {(f + bw + g) / 3:.3f} |")
    lines.append("")
  if "memory" in results:
    lines += [
        "## Memory of reshard_after_forward (same GPT, 1-D mesh of 8)",
        "",
        "| reshard_after_forward | temporaries (memory_analysis) MiB | "
        "gathered bytes kept forward->backward (plan) MiB |",
        "|---|---|---|",
    ]
    for m in results["memory"]:
      lines.append(f"| {m['reshard_after_forward']} | {_mb(m['temp_bytes'])} | "
                   f"{_mb(m['kept_for_backward'])} |")
    lines.append("")
  if "grad_error" in results:
    lines += [
        "## Error the quantized reduction adds per step",
        "",
        "The reduced gradient of one step (GPT above, global batch 16) against the "
        "exact reduction of the same state and batch, at several points of an exact "
        "Adam run: relative L2 error ||g_q - g|| / ||g||, max |g_q - g| / max |g|, and "
        "the error's component along the exact gradient, <g_q - g, g> / <g, g> "
        "(negative: the quantized gradient is shrunk toward 0, a bias). Blocks of 256; "
        "integer gradients round stochastically unless the row says otherwise. (qwZ "
        "changes the forward pass, so its row is the gradient at the int8-gathered "
        "weights against the exact one.)",
        "",
        "| setting | relative L2 per measured step | max / max | along g |",
        "|---|---|---|---|",
    ]
    for e in results["grad_error"]:
      lines.append(f"| {e['label']} | " + ", ".join(
          f"{x['relative_l2']:.2e} (step {x['step']})" for x in e["per_step"]) + " | "
          + ", ".join(f"{x['max_over_max']:.1e}" for x in e["per_step"]) + " | "
          + ", ".join(f"{x['along_g']:+.1e}" if "along_g" in x else "" for x in e["per_step"])
          + " |")
    lines.append("")
  if "curves" in results:
    c = results["curves"]
    exact = c[0]["losses"]
    tail = max(len(exact) // 15, 1)
    ref = c[0]["held_out_loss"]
    lines += [
        "## Loss curves: the example GPT",
        "",
        f"`examples/train_gpt.py`'s model, data and optimizer at its defaults, "
        f"{len(exact)} steps on 8 devices (FULL_SHARD, fp32 masters; 16 windows of 64 "
        "characters per step). **Final loss**: the trained parameters' loss on "
        f"{EVAL_BATCHES * 64} held-out windows; its gap is relative to the exact run's. "
        f"A single step's training loss varies by several percent from batch to batch, "
        f"so the mean of the last {tail} training losses is shown too. Plotted in "
        "notebooks/strategies.ipynb.",
        "",
        "| setting | final (held-out) loss | gap | mean of last training losses | gap | time s |",
        "|---|---|---|---|---|---|",
    ]
    ref_tail = float(np.mean(exact[-tail:]))
    for r in c:
      ls, h = r["losses"], r["held_out_loss"]
      t = float(np.mean(ls[-tail:]))
      lines.append(f"| {r['label']} | {h:.4f} | {100 * (h - ref) / ref:+.2f}% "
                   f"| {t:.4f} | {100 * (t - ref_tail) / ref_tail:+.2f}% | {r['seconds']} |")
    if results.get("seeds"):
      seeds = results["seeds"]
      ids = sorted({x["seed"] for x in seeds})
      held = {(x["seed"], x["label"]): x["held_out_loss"] for x in seeds}
      for r in c:
        held[(0, r["label"])] = r["held_out_loss"]
      labels = [l for l in SEED_LABELS if all((s, l) in held for s in [0] + ids)]
      lines += ["", "Final (held-out) loss gap on other data seeds (other batches and "
                "held-out windows, same initialization), against the exact run on the "
                "same data; seed 0 is the table above:", "",
                "| setting | " + " | ".join(f"seed {s}" for s in [0] + ids) + " |",
                "|---|" + "---|" * (len(ids) + 1)]
      for l in labels[1:]:
        lines.append(f"| {l} | " + " | ".join(
            f"{100 * (held[(s, l)] - held[(s, labels[0])]) / held[(s, labels[0])]:+.2f}%"
            for s in [0] + ids) + " |")
    same = [r["label"] for r in c[1:] if r["losses"] == exact]
    lines += ["", "Training losses equal to the exact run's at every step (compared with "
              "`==`): " + (", ".join(same) if same else "none") + "."]
    lines.append("")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--only", choices=("bytes", "errors", "curves", "all"), default="all",
                 help="bytes: bytes and memory; errors: gradient error; curves: loss "
                 "curves (and the other seeds)")
  p.add_argument("--seeds", type=int, nargs="*", default=[1, 2],
                 help="further data seeds for the final-loss gaps of a few settings")
  p.add_argument("--steps", type=int, default=300, help="loss-curve steps")
  p.add_argument("--error-steps", type=int, default=40,
                 help="exact steps over which the gradient error is sampled (4 points)")
  p.add_argument("--d-model", type=int, default=256, help="GPT width for the bytes table")
  p.add_argument("--layers", type=int, default=4, help="GPT blocks for the bytes table")
  p.add_argument("--out", default=HERE)
  p.add_argument("--render", action="store_true",
                 help="only rewrite ZEROPP.md from the saved zeropp.json")
  args = p.parse_args(argv)
  if args.render:
    with open(os.path.join(args.out, "zeropp.json")) as f:
      results = json.load(f)
    with open(os.path.join(args.out, "ZEROPP.md"), "w") as f:
      f.write(render(results))
    return
  fsdp_jax.simulate_cpu_devices(8)
  jax.config.update("jax_platforms", "cpu")
  path = os.path.join(args.out, "zeropp.json")
  results = {}
  if os.path.exists(path):
    with open(path) as f:
      results = json.load(f)
  import jaxlib
  results["meta"] = {"date": datetime.date.today().isoformat(), "jax": jax.__version__,
                     "jaxlib": jaxlib.__version__, "python": platform.python_version(),
                     "machine": platform.machine(), "devices": jax.device_count()}
  if args.only in ("bytes", "all"):
    results["bytes"] = measure_bytes(args)
    results["memory"] = measure_memory(args)
  if args.only in ("errors", "all"):
    results["grad_error"] = measure_grad_error(args)
  if args.only in ("curves", "all"):
    results["curves"] = measure_curves(args)
    results["seeds"] = measure_seeds(args)
  with open(path, "w") as f:
    json.dump(results, f, indent=1)
  with open(os.path.join(args.out, "ZEROPP.md"), "w") as f:
    f.write(render(results))
  print(f"wrote {path} and ZEROPP.md")


if __name__ == "__main__":
  main()
