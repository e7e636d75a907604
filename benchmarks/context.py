"""``python -m benchmarks context``: context parallelism (``make_mesh(...,
context=C)``, ``FSDPConfig(context_parallel=fsdp_jax.ContextParallel())``)
on 8 simulated CPU devices; writes ``benchmarks/CONTEXT.md`` and
``benchmarks/context.json``. Parts (``--only``; a part not run keeps its
section of the report as it was):

* ``memory``: one sequence of T tokens per context group under
  ``shard=8/C x context=C`` against one sequence per device on ``shard=8``:
  activation bytes per device (the compiled step's ``temp`` less its value
  at a tiny T), and, from the same compiled steps, the collectives over the
  ``"context"`` axis against the all-gather strategy's theory.
* ``longest``: the longest sequence whose step compiles within a fixed
  per-device budget (arguments + temporaries + outputs - aliased), for
  C = 1, 2, 4, 8: a search over T on a grid of ``64 C`` tokens.
* ``tensor``: ``shard=4 x tensor=2`` with one sequence per tensor group
  against ``shard=8`` with one per device, the same T (rerun it as
  sequence parallelism under ``"tensor"`` lands: ``--only tensor``).
* ``scan``: the same model with its layers scanned (``scan=True``):
  activation bytes at two lengths, and under ``context=8``.
* ``time``: step time under ``context=C`` against FSDP alone on
  ``shard=8`` at the same global tokens, in one process, round-robin.

Every program but ``time``'s is compiled from ``jax.ShapeDtypeStruct``s
(``jax.eval_shape`` of the state): nothing is allocated. Each measured row
is saved in ``context.json`` as soon as it is measured (a stopped run
resumes; ``--fresh`` starts over; ``--render`` rewrites the report only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import fsdp_jax  # noqa: E402
import fsdp_jax.models  # noqa: E402
from fsdp_jax._src import hlo  # noqa: E402
from benchmarks import harness, hlo_stats  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 2 ** 20
PARTS = ("memory", "longest", "tensor", "scan", "time")
# Llama 3 8B's proportions (kv heads a quarter of the heads, MLP 3.5x the
# hidden size), small in width: what one token costs per layer relative to
# the keys and values context parallelism gathers is the real model's.
LLAMA = dict(model_type="llama", vocab_size=1024, hidden_size=256, intermediate_size=896,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1 << 20)
MARK = "<!-- context section {} -->"


class Store:
  """``context.json``'s rows, by part and key, written as each is measured."""

  def __init__(self, path: str):
    self.path = path
    self.data = json.load(open(path)) if os.path.exists(path) else {}

  def get(self, part, key):
    return self.data.get(part, {}).get(key)

  def rows(self, part) -> dict:
    return self.data.get(part, {})

  def put(self, part, key, row):
    self.data.setdefault(part, {})[key] = row
    with open(self.path + ".tmp", "w") as f:
      json.dump(self.data, f, indent=1)
    os.replace(self.path + ".tmp", self.path)


class Bench:
  """The model and one compiled step per (layout, rows, T)."""

  def __init__(self, a, log):
    self.a, self.log = a, log
    self.tmp = tempfile.mkdtemp(prefix="fsdp_context_")
    self.models = {}
    self.cache = {}  # (layout, seq, layers, scan) -> memory row: parts share compiles

  def model(self, layers: int, scan: bool = False):
    key = (layers, scan)
    if key not in self.models:
      d = os.path.join(self.tmp, f"llama-{layers}-{int(scan)}")
      os.makedirs(d, exist_ok=True)
      with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(dict(LLAMA, hidden_size=self.a.hidden, intermediate_size=self.a.hidden * 7 // 2,
                       num_hidden_layers=layers), f)
      self.models[key] = fsdp_jax.models.from_pretrained(d, scan=scan)
    return self.models[key]

  def setup(self, layout: str, layers: int, scan: bool = False):
    """``(builder, mesh, config, rows per step)`` of a layout: ``"fsdp8"``,
    ``"cpC"`` (shard=8/C x context=C) or ``"tp2"`` (shard=4 x tensor=2)."""
    b = self.model(layers, scan)
    if layout == "fsdp8":
      return b, fsdp_jax.make_mesh(shard=8), b.fsdp_config(), 8
    if layout == "tp2":
      return b, fsdp_jax.make_mesh(shard=4, tensor=2), b.fsdp_config(tensor_parallel=True), 4
    c = int(layout[2:])
    return (b, fsdp_jax.make_mesh(shard=8 // c, context=c),
            b.fsdp_config(context_parallel=fsdp_jax.ContextParallel()), 8 // c)

  def compile(self, layout: str, seq: int, layers: int, scan: bool = False):
    b, mesh, config, rows = self.setup(layout, layers, scan)
    opt = optax.adamw(1e-4)
    t = time.perf_counter()
    state = jax.eval_shape(lambda: fsdp_jax.init_train_state(
        init_fn=b.init_fn, rng=jax.random.key(0), optimizer=opt, mesh=mesh, config=config))
    step = fsdp_jax.shard_train_step(b.loss_fn, opt, mesh=mesh, config=config)
    batch = {k: jax.ShapeDtypeStruct((rows, seq), jnp.int32) for k in ("input_ids", "labels")}
    compiled = step.lower(state, batch).compile()
    return compiled, mesh, rows, time.perf_counter() - t

  def memory(self, layout: str, seq: int, layers: int, scan: bool = False,
             compiled=None) -> dict:
    key = (layout, seq, layers, scan)
    if key in self.cache:
      return self.cache[key]
    s = 0.0
    if compiled is None:
      compiled, _, _, s = self.compile(layout, seq, layers, scan)
    m = hlo_stats.memory_stats(compiled)
    rows = self.setup(layout, layers, scan)[3]
    self.log(f"  {layout:<6} {'scan ' if scan else ''}T={seq:>6}: temp {m['temp'] / MIB:9.1f} "
             f"MiB, peak {m['total'] / MIB:9.1f} MiB ({s:.0f} s)")
    self.cache[key] = {"layout": layout, "seq": seq, "rows": rows, "layers": layers,
                       "scan": scan, **m, "compile_s": s}
    return self.cache[key]


# --------------------------------------------------------------------------
# Collectives over the context axis


_OP_NAME = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?op_name="([^"]*)"', re.M)
_PAIRS = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+) = .*?source_target_pairs=\{([\d,{}]*)\}',
                    re.M)


def context_collectives(text: str, mesh, c: int) -> list:
  """The collectives of a compiled step whose groups are the mesh's context
  groups, FSDP's own (``fsdp_all_gather[...]`` / ``fsdp_reduce_scatter[...]``
  in their op name: under ``context=8`` FSDP's groups are the context
  group) left out. Each: kind, result shapes, bytes of the result and of
  the payload (a reduce-scatter's input), how many times it runs."""
  ids = np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1, c)
  groups = {tuple(sorted(r)) for r in ids.tolist()}
  op_names = dict(_OP_NAME.findall(text))
  pairs_of = dict(_PAIRS.findall(text))
  counts, _ = hlo_stats.execution_counts(text)
  out = []
  for col in hlo.collectives(text):
    g = tuple(tuple(sorted(x)) for x in col.groups) or (tuple(sorted(ids.ravel().tolist())),)
    if col.kind == "collective-permute":  # its pairs, each within one group
      pairs = re.findall(r"\{(\d+),(\d+)\}", pairs_of.get(col.name, ""))
      g = tuple(next((grp for grp in groups if int(x) in grp and int(y) in grp), (-1,))
                for x, y in pairs)
    op = op_names.get(col.name, "")
    if not set(g) <= groups or "fsdp_all_gather[" in op or "fsdp_reduce_scatter[" in op:
      continue
    runs = counts.get(col.computation, 1)
    nbytes = runs * col.bytes
    out.append({"kind": col.kind, "shapes": [list(s) for s in col.shapes], "runs": runs,
                "bytes": nbytes, "payload": nbytes * (c if col.kind == "reduce-scatter" else 1)})
  return out


def comm_row(text: str, mesh, c: int, rows: int, seq: int, layers: int, hidden: int) -> dict:
  kv_dim = hidden // LLAMA["num_attention_heads"] * LLAMA["num_key_value_heads"]
  del rows  # each device holds one sequence's chunk: its K and V are [1, T, kv_dim]
  kv_bytes = seq * kv_dim * 4
  moved = context_collectives(text, mesh, c)
  is_kv = lambda m: (m["kind"] in ("all-gather", "reduce-scatter") and all(
      int(np.prod(s)) * (c if m["kind"] == "reduce-scatter" else 1) == seq * kv_dim
      for s in m["shapes"]))
  kv = [m for m in moved if is_kv(m)]
  other = [m for m in moved if not is_kv(m)]
  # K and V gathered forward and again backward, their gradients scattered: payload
  theory = 6 * layers * kv_bytes
  by_kind = {}
  for m in moved:
    d = by_kind.setdefault(("K/V " if is_kv(m) else "other ") + m["kind"],
                           {"ops": 0, "runs": 0, "payload": 0, "shapes": set()})
    d["ops"] += 1
    d["runs"] += m["runs"]
    d["payload"] += m["payload"]
    d["shapes"].add(str(tuple(tuple(s) for s in m["shapes"])))
  for d in by_kind.values():
    d["shapes"] = sorted(d["shapes"])[:3]
  return {"kv_payload": sum(m["payload"] for m in kv), "kv_runs": sum(m["runs"] for m in kv),
          "other_payload": sum(m["payload"] for m in other),
          "total_payload": sum(m["payload"] for m in moved), "theory_payload": theory,
          "theory_ops": 6 * layers, "kv_bytes_one": kv_bytes, "by_kind": by_kind,
          "wire": sum(m["payload"] * (c - 1) / c for m in moved),
          "theory_wire": theory * (c - 1) / c}


# --------------------------------------------------------------------------
# The parts


def part_memory(bench: Bench, store: Store, a) -> None:
  for layout in ["fsdp8"] + [f"cp{c}" for c in a.contexts if c > 1]:
    key = f"{layout} | {a.seq} | {a.layers}"
    if store.get("memory", key):
      continue
    tiny = bench.memory(layout, a.tiny_seq, a.layers)
    compiled, mesh, rows, s = bench.compile(layout, a.seq, a.layers)
    m = bench.memory(layout, a.seq, a.layers, compiled=compiled)
    row = {"layout": layout, "seq": a.seq, "tiny_seq": a.tiny_seq, "rows": rows,
           "layers": a.layers, **m, "tiny_temp": tiny["temp"], "act": m["temp"] - tiny["temp"],
           "compile_s": s + tiny["compile_s"], "load": a.load}
    if layout != "fsdp8":
      c = int(layout[2:])
      row["comm"] = comm_row(compiled.as_text(), mesh, c, rows, a.seq, a.layers, a.hidden)
    bench.log(f"memory {layout:<6} T={a.seq}: activations {row['act'] / MIB:9.1f} MiB "
              f"(temp {m['temp'] / MIB:.1f} - {tiny['temp'] / MIB:.1f})")
    store.put("memory", key, row)


def part_longest(bench: Bench, store: Store, a) -> None:
  budget = a.budget_mib * MIB
  mem = store.rows("memory")
  for c in a.contexts:
    key = f"{c} | {a.budget_mib} | {a.layers}"
    if store.get("longest", key):
      continue
    layout = "fsdp8" if c == 1 else f"cp{c}"
    grid = 64 * c
    probes = {}

    def fits(seq):
      if seq not in probes:
        probes[seq] = bench.memory(layout, seq, a.layers)["total"]
      return probes[seq] <= budget

    t = time.perf_counter()
    # A first guess from the memory part's two points (linear in T), then
    # steps of the grid doubling away from it until the answer is bracketed,
    # then bisection on the grid.
    row = mem.get(f"{layout} | {a.seq} | {a.layers}")
    if row:
      slope = row["act"] / (a.seq - a.tiny_seq)
      guess = a.tiny_seq + (budget - (row["total"] - row["act"])) / slope
    else:
      guess = 2048 * c
    seq = max(grid, int(guess) // grid * grid)
    step = grid
    if fits(seq):
      lo = seq
      while fits(lo + step):
        lo += step
        step *= 2
      hi = lo + step
    else:
      hi = seq
      while seq - step >= grid and not fits(seq - step):
        hi = seq - step
        seq -= step
        step *= 2
      lo = max(grid, hi - step)
      if not fits(lo):
        raise RuntimeError(f"context={c}: {lo} tokens do not fit {a.budget_mib} MiB")
    while hi - lo > grid:
      mid = (lo + hi) // 2 // grid * grid
      if fits(mid):
        lo = mid
      else:
        hi = mid
    store.put("longest", key, {"c": c, "longest": lo, "grid": grid, "budget": budget,
                               "probes": {str(k): v for k, v in sorted(probes.items())},
                               "s": time.perf_counter() - t, "load": a.load})
    bench.log(f"longest context={c}: {lo:,} tokens within {a.budget_mib} MiB "
              f"({len(probes)} compiles)")


def part_tensor(bench: Bench, store: Store, a) -> None:
  base_key = f"fsdp8 | {a.seq} | {a.layers}"
  if not store.get("memory", base_key):
    part_memory(bench, store, argparse.Namespace(**{**vars(a), "contexts": [1]}))
  tiny = bench.memory("tp2", a.tiny_seq, a.layers)
  full = bench.memory("tp2", a.seq, a.layers)
  base = store.get("memory", base_key)
  act = full["temp"] - tiny["temp"]
  store.put("tensor", f"tp2 | {a.seq} | {a.layers}", {
      "seq": a.seq, "layers": a.layers, "temp": full["temp"], "tiny_temp": tiny["temp"],
      "act": act, "fsdp8_act": base["act"], "ratio": act / base["act"],
      "total": full["total"], "load": a.load,
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")})
  bench.log(f"tensor shard=4 x tensor=2: activations {act / MIB:.1f} MiB, "
            f"{act / base['act']:.3f}x FSDP8's")


def part_scan(bench: Bench, store: Store, a) -> None:
  for layout, seq in (("fsdp8", a.seq // 2), ("fsdp8", a.seq), ("cp8", a.seq)):
    key = f"{layout} | {seq} | {a.layers}"
    if store.get("scan", key):
      continue
    tiny = bench.memory(layout, a.tiny_seq, a.layers, scan=True)
    full = bench.memory(layout, seq, a.layers, scan=True)
    store.put("scan", key, {"layout": layout, "seq": seq, "layers": a.layers,
                            "act": full["temp"] - tiny["temp"], "temp": full["temp"],
                            "tiny_temp": tiny["temp"], "load": a.load})


def part_time(bench: Bench, store: Store, a) -> None:
  steps = {}
  for c in [1] + [c for c in a.contexts if c > 1]:
    layout = "fsdp8" if c == 1 else f"cp{c}"
    b, mesh, config, rows = bench.setup(layout, a.time_layers)
    seq = a.time_tokens // rows
    opt = optax.adamw(1e-4)
    state = fsdp_jax.init_train_state(init_fn=b.init_fn, rng=jax.random.key(0), optimizer=opt,
                                      mesh=mesh, config=config)
    step = fsdp_jax.shard_train_step(b.loss_fn, opt, mesh=mesh, config=config)
    ids = np.random.default_rng(0).integers(0, LLAMA["vocab_size"], (rows, seq), np.int32)
    data = {"input_ids": ids, "labels": ids}
    state, m = step(state, data)  # compile and warm up
    jax.block_until_ready(m["loss"])
    steps[layout] = [step, state, data, [], rows, seq, float(m["loss"])]
    bench.log(f"time {layout}: {rows} x {seq} tokens, first loss {float(m['loss']):.4f}")
  names = list(steps)
  t = time.perf_counter()
  med = harness.rotated_step_medians(steps, a.rounds)
  store.put("time", f"{a.time_tokens} | {a.time_layers}", {
      "tokens": a.time_tokens, "layers": a.time_layers, "rounds": a.rounds,
      "median_s": med, "ratio": {n: med[n] / med["fsdp8"] for n in names},
      "shape": {n: [steps[n][4], steps[n][5]] for n in names},
      "loss": {n: steps[n][6] for n in names},
      "flops": {n: step_flops(a, a.time_layers, steps[n][4], steps[n][5],
                              1 if n == "fsdp8" else int(n[2:])) for n in names},
      "s": time.perf_counter() - t, "load": a.load})
  bench.log("time " + "  ".join(f"{n} {med[n]:.2f}s ({med[n] / med['fsdp8']:.2f}x)"
                                for n in names))


def step_flops(a, layers: int, rows: int, seq: int, c: int) -> dict:
  """The step's FLOPs summed over the 8 devices: the matmuls (6 x
  parameters x tokens: forward and backward) and the blockwise attention's
  (the query x key blocks of 512 that the causal mask leaves visible, per
  device's chunk; forward QK^T and PV, backward four more and the
  recomputed scores: 7 block matmuls in all)."""
  h, f, v = a.hidden, a.hidden * 7 // 2, LLAMA["vocab_size"]
  kv = h // LLAMA["num_attention_heads"] * LLAMA["num_key_value_heads"]
  per_layer = h * h * 2 + h * kv * 2 + 3 * h * f
  tokens = rows * seq * (8 // (rows * c))  # every device's chunk: the global tokens
  matmul = 6 * tokens * (layers * per_layer + h * v)
  block = 512
  chunk = seq // c
  pairs = 0
  for dev in range(c):  # query blocks of the device's chunk against the key blocks
    for i in range(-(-chunk // block)):
      q_hi = dev * chunk + min((i + 1) * block, chunk) - 1
      pairs += q_hi // block + 1
  bq, bk = min(block, chunk), min(block, seq)
  attn = 7 * 2 * bq * bk * h * pairs * layers * (8 // c)  # each context group's sequences
  return {"matmul": matmul, "attention": attn, "total": matmul + attn}


# --------------------------------------------------------------------------
# The report


def _met(ok: bool) -> str:
  return "met" if ok else "**missed**"


def memory_text(store: Store, a) -> str:
  rows = [r for r in store.rows("memory").values() if r["layers"] == a.layers]
  if not rows:
    return ""
  seq = rows[0]["seq"]
  rows = [r for r in rows if r["seq"] == seq]
  base = next((r for r in rows if r["layout"] == "fsdp8"), None)
  lines = ["| layout | sequences per step | tokens per device | temporaries | at "
           f"{rows[0]['tiny_seq']} tokens | activations | vs one sequence per device | "
           "target (1.3/C) | peak |", "|---|---|---|---|---|---|---|---|---|"]
  for r in sorted(rows, key=lambda r: 1 if r["layout"] == "fsdp8" else int(r["layout"][2:])):
    c = 1 if r["layout"] == "fsdp8" else int(r["layout"][2:])
    name = "shard=8" if c == 1 else f"shard={8 // c} x context={c}"
    ratio = r["act"] / base["act"] if base else float("nan")
    target = "-" if c == 1 else f"{1.3 / c:.3f}: {_met(ratio <= 1.3 / c)}"
    lines.append(f"| {name} | {r['rows']} x {seq:,} | {seq // c:,} | {r['temp'] / MIB:,.1f} MiB | "
                 f"{r['tiny_temp'] / MIB:,.1f} MiB | {r['act'] / MIB:,.1f} MiB | {ratio:.3f} "
                 f"(1/{1 / ratio:.2f}) | {target} | {r['total'] / MIB:,.1f} MiB |")
  kv_dim = a.hidden // LLAMA["num_attention_heads"] * LLAMA["num_key_value_heads"]
  kv_share = 2 * kv_dim * 4 * seq * a.layers / base["act"] if base else float("nan")
  ratios = [(int(r["layout"][2:]), r["act"] / base["act"]) for r in rows[1:]] if base else []
  met = [c for c, x in ratios if x <= 1.3 / c]
  missed = [c for c, x in ratios if x > 1.3 / c]
  verdict = (f"holds for C = {', '.join(map(str, met)) or 'none'}"
             + (f" and misses for C = {', '.join(map(str, missed))}" if missed else "")
             + f" at this length ({', '.join(f'{x:.3f}' for _, x in ratios)})")
  return f"""### 1. Memory: one sequence over C devices

A Llama-shaped family model (`fsdp_jax.models.from_pretrained` of a
config.json: hidden {a.hidden}, {a.layers} layers unrolled, 8 heads and 2
key/value heads of 32, MLP {a.hidden * 7 // 2}, vocabulary 1,024: Llama 3
8B's proportions), FULL_SHARD flat, AdamW, the families' default blocked
loss, float32, on 8 simulated devices. One sequence of {seq:,} tokens per
context group on `make_mesh(shard=8/C, context=C)` against one sequence of
{seq:,} tokens per device on `make_mesh(shard=8)`: each device holds
{seq:,}/C positions against {seq:,}. Activations = the compiled step's
`memory_analysis()` temporaries less their value at {rows[0]['tiny_seq']} tokens
(same layout); peak = arguments + temporaries + outputs - aliased.
{sum(r['compile_s'] for r in rows):.0f} s of compiling (load average
{'; '.join(sorted({r['load'] for r in rows}))}).

{chr(10).join(lines)}

The memory target {verdict}. How it got there, read from XLA's
live-range dumps at the peak (`xla_dump_to`):

* a quadratic term in every layout, fixed with this benchmark: the
  compiled step kept, for every layer, the forward kernel's loop carries
  of every (query block, key block) pair (`f32[nq, nk, 1, 2, 4, 512,
  32]`: `(T/C) x T / 512` pairs of 512 x 34 x 8 float32 per layer, 272
  MiB of `shard=8`'s 729 MiB then). fsdp_jax's units rematerialise with
  a policy (`collectives.remat_policy`) and JAX applied it inside the
  `custom_vjp`'s forward loops; a policy that saves batched matmuls
  (`jax.checkpoint_policies.dots_saveable`) reached through a checkpoint
  too (jax-ml/jax#18817) and saved every pair's scores and `p @ v` (351
  MiB for one 4,096-token call). The forward's two loops are now
  `lax.while_loop` s, whose bodies no policy saves from (29.5 MiB under
  every policy, `tests/test_attention.py`): `shard=8` 728.9 -> 507.9
  MiB, `context=8` 120.8 -> 96.1;
* the gathered keys and values each layer kept for its backward pass
  (the whole sequence's K and V, `[1, {seq:,}, 2, {a.hidden // 8}]` each,
  {2 * kv_dim * 4 * seq * a.layers / MIB:.1f} MiB over the {a.layers} layers whatever C: {kv_share:.3f} of one sequence per
  device's activations): context parallelism keeps each layer's K/V
  chunks instead (`context_eval`'s `_regathered_attention`, a
  `jax.checkpoint` saving its inputs; the backward all-gathers K and V
  again, section 2): `context=8` 110.6 -> 100.4 MiB on the tree of then
  (10.2 of the 14 MiB predicted). Only partly: under FULL_SHARD the step
  rematerialises with its own policy, which JAX applies inside that
  checkpoint too (jax-ml/jax#18817), and of the kernel's forward (two
  `lax.while_loop`s) JAX saves nothing, so the backward pass ran the
  loops again from their inputs, which the step's policy kept: every
  layer's K and V of the whole sequence in the kernel's blocks
  (`f32[T/512, 1, 512, 2, 32]`; at 8,192 tokens 19 such buffers, 38 MiB,
  at the peak of `context=8`'s step). The kernel now names its output and
  logsumexp (`jax.ad_checkpoint.checkpoint_name`), which the step's
  policy saves: the backward pass reads them and runs no forward loop
  (`tests/test_context_families.py` checks the saved residuals). At
  4,096 tokens `context=8` 81.6 -> 65.7 MiB (0.157 -> 0.129), `context=4`
  149.4 -> 133.5, `context=2` 281.5 -> 265.8, and `shard=8`, which saved
  its blocked queries, keys and values the same way, 521.1 -> 507.9;
* the attention kernel's block temporaries (the backward's `[1, 2, 4,
  block_q, 512]` float32 scores, probabilities and their cotangents, a
  constant per call that the tiny-T baseline does not hold): with one
  512-row query block per 512-token chunk they were about 25 MiB, 0.049
  of `shard=8`'s activations, and kept `context=8` at 0.193. A call's
  query blocks now hold at most a quarter of its queries (down to 128
  rows; `attention._default_block_q`): `context=8` 100.4 -> 81.6 MiB
  (0.193 -> 0.157), the other layouts unchanged (their chunks of 1,024
  tokens and more: 256- and 512-row blocks), and the `context=8` step
  1.9x faster on CPU (section 5's script: 15.05 -> 8.02 s against
  `shard=8`'s 3.22 / 3.61 s, one process each).

Nothing holds a whole `[T, T]` score matrix or `[T, vocab]` logits, and
positions are `[T]` int32.
"""


def comm_text(store: Store, a) -> str:
  rows = [r for r in store.rows("memory").values() if "comm" in r and r["layers"] == a.layers]
  if not rows:
    return ""
  lines = ["| layout | K/V collectives (theory) | K/V payload | theory: 6 x layers x "
           f"[1, T, {a.hidden // 4}] fp32 | K/V / theory | everything else over "
           "`\"context\"` | all / theory |"
           " wire bytes per device |", "|---|---|---|---|---|---|---|---|"]
  worst = 0.0
  for r in sorted(rows, key=lambda r: int(r["layout"][2:])):
    c, m = int(r["layout"][2:]), r["comm"]
    kv, total = m["kv_payload"] / m["theory_payload"], m["total_payload"] / m["theory_payload"]
    worst = max(worst, abs(kv - 1), abs(total - 1))
    lines.append(f"| shard={8 // c} x context={c} | {m['kv_runs']} ({m['theory_ops']}) | "
                 f"{m['kv_payload'] / MIB:,.2f} MiB | {m['theory_payload'] / MIB:,.2f} MiB | "
                 f"{kv:.4f} | {m['other_payload']:,} B | {total:.4f} | "
                 f"{m['wire'] / MIB:,.2f} MiB |")
  kinds = sorted({k for r in rows for k in r["comm"]["by_kind"]})
  detail = []
  for r in sorted(rows, key=lambda r: int(r["layout"][2:])):
    for k in kinds:
      d = r["comm"]["by_kind"].get(k)
      if d:
        detail.append(f"| {r['layout'][2:]} | {k} | {d['runs']} | {d['payload']:,} B | "
                      f"{', '.join(d['shapes'])} |")
  return f"""### 2. Communication: what moves over `"context"`

From the compiled steps of section 1 (`compiled.as_text()`,
`fsdp_jax.hlo.collectives`): every collective whose replica groups are the
mesh's context groups, less FSDP's own (`fsdp_all_gather[...]` /
`fsdp_reduce_scatter[...]` in the op name: under `context=8` FSDP shards
over the same 8 devices). Payload: an all-gather's result, a
reduce-scatter's input (its result x C). Theory, the all-gather strategy:
per layer K and V, `[1, T, 2 x {a.hidden // 8}]` float32 each, all-gathered forward
and again backward (each layer saves its chunks only), their gradients
reduce-scattered backward: 6 x {a.layers} collectives of
`T x {a.hidden // 4} x 4` bytes; on the wire each device receives (C-1)/C of each.

{chr(10).join(lines)}

Largest deviation from theory: {100 * worst:.3f}% (target within 1%:
{_met(worst <= 0.01)}). The collectives, by kind:

| C | kind | runs per step | payload | result shapes |
|---|---|---|---|---|
{chr(10).join(detail)}

The "other" collectives are the loss's: the labels' one-token halo from
the next device (`labels[:, 1:]`: a `collective-permute` of `[1, 1]`), the
blocked loss's `total` and `weight` (scalar all-reduces), and the like.
No hidden state, logits or query moves; the backward pass gathers K and V
again (each layer saves this device's chunks, not the gathered sequence:
section 1).
"""


def longest_text(store: Store, a) -> str:
  rows = {r["c"]: r for r in store.rows("longest").values()
          if r["budget"] == a.budget_mib * MIB}
  if 1 not in rows:
    return ""
  lines = ["| C | mesh | longest T | vs C=1 | target (0.8 C) | compiles (T: peak MiB) |",
           "|---|---|---|---|---|---|"]
  for c in sorted(rows):
    r = rows[c]
    x = r["longest"] / rows[1]["longest"]
    probes = ", ".join(f"{int(k):,}: {v / MIB:.0f}" for k, v in r["probes"].items())
    # a search stopped for time: the longest that fitted is a lower bound
    low = r.get("partial", False)
    verdict = ("met" if x >= 0.8 * c else "not known") if low else _met(x >= 0.8 * c)
    lines.append(f"| {c} | {'shard=8' if c == 1 else f'shard={8 // c} x context={c}'} | "
                 f"{'at least ' if low else ''}{r['longest']:,} | {'>= ' if low else ''}{x:.2f}x | "
                 f"{'-' if c == 1 else f'{0.8 * c:.1f}x: ' + verdict} | {probes} |")
  return f"""### 3. The longest sequence within {a.budget_mib} MiB per device

The model of section 1; for each C the longest T (on a grid of 64 x C
tokens) whose step compiles with a peak (arguments + temporaries +
outputs - aliased, per device) of at most {a.budget_mib} MiB: one sequence
per context group (C = 1: one per device on `shard=8`). The search starts
from section 1's linear fit, steps the grid away from it until the
answer is bracketed and bisects. {sum(r['s'] for r in rows.values()):.0f} s (load
average {'; '.join(sorted({r['load'] for r in rows.values()}))}).

{chr(10).join(lines)}

{"Not measured (the run was stopped for time): C = " + ", ".join(
    str(c) for c in a.contexts if c not in rows) + "." if set(a.contexts) - set(rows) else ""}
The arguments (the sharded weights and AdamW's moments) are the same for
every C; what scales is the temporaries, whose per-token part divides by
C while the whole sequence's keys and values do not. At C = 8 each more
token of a device's chunk costs about 0.128 MiB of peak against 0.116 at
C = 1 (the slopes between the compiles above): the difference is one
layer's gathered keys and values and their gradients (transient, the
whole sequence's). Before the step saved the attention kernel's output
and logsumexp (section 1) it was 0.151 MiB: every layer kept the whole
sequence's blocked K and V, and C = 8 reached 23,040 tokens, 6.21x
(missed).
"""


def tensor_text(store: Store, a) -> str:
  rows = [r for r in store.rows("tensor").values() if r["layers"] == a.layers]
  if not rows:
    return ""
  r = rows[-1]
  return f"""### 4. Tensor parallelism: `shard=4 x tensor=2`, one sequence per tensor group

The model of section 1 under `make_mesh(shard=4, tensor=2)` with the
family's Megatron rules (`b.fsdp_config(tensor_parallel=True)`), 4
sequences of {r['seq']:,} tokens (one per tensor group), against
`shard=8` with 8 sequences of {r['seq']:,} (one per device): activations as
in section 1. Measured {r['date']} UTC (load average {r['load']});
`python -m benchmarks context --only tensor` measures it again.

| layout | activations per device | vs `shard=8` | target |
|---|---|---|---|
| shard=8 | {r['fsdp8_act'] / MIB:,.1f} MiB | 1.000 | |
| shard=4 x tensor=2 | {r['act'] / MIB:,.1f} MiB | {r['ratio']:.3f} | at most 0.65: {_met(r['ratio'] <= 0.65)} |

Tensor parallelism splits the attention heads and the MLP's columns over
`"tensor"`, so the q/k/v, attention and MLP activations are halved; the
activations between the blocks (the residual stream, the norms' inputs
and outputs, the embeddings and the logits' blocks) stay whole on both
devices of a tensor group until sequence parallelism splits them along
the sequence.
"""


def scan_text(store: Store, a) -> str:
  rows = {(r["layout"], r["seq"]): r for r in store.rows("scan").values()
          if r["layers"] == a.layers}
  mem = {r["layout"]: r for r in store.rows("memory").values() if r["layers"] == a.layers}
  if ("fsdp8", a.seq) not in rows:
    return ""
  half, full = rows.get(("fsdp8", a.seq // 2)), rows[("fsdp8", a.seq)]
  cp8 = rows.get(("cp8", a.seq))
  unrolled = mem.get("fsdp8")
  lines = ["| layers | layout | T | activations |", "|---|---|---|---|"]
  for r in (half, full, cp8):
    if r:
      lines.append(f"| scanned | {r['layout']} | {r['seq']:,} | {r['act'] / MIB:,.1f} MiB |")
  if unrolled:
    lines.append(f"| unrolled (section 1) | fsdp8 | {unrolled['seq']:,} | "
                 f"{unrolled['act'] / MIB:,.1f} MiB |")
  growth = full["act"] / half["act"] if half else float("nan")
  return f"""### 5. Scanned layers (`from_pretrained(..., scan=True)`)

The same model with its layers run by `lax.scan` (one stacked unit).

{chr(10).join(lines)}

Doubling T multiplies the scanned model's activations by {growth:.2f}
(linear: 2){f"; under `context=8` they are {cp8['act'] / full['act']:.3f} of `shard=8`'s"
if cp8 else ""}. Two things made them quadratic before this benchmark's
fixes in `fsdp_jax/_src/attention.py`: inside `lax.scan` the kernel's
masks depend only on positions, which are loop-invariant, and JAX's
partial evaluation of the scan hoisted each block pair's mask and
`jnp.where` fill values out of the loop, stacked for every (query block,
key block) pair (`jax.grad` of 3 scanned calls at 2,048 tokens, 8 heads:
488 MB of temporaries against 50 MB for one call; now the positions go
through an `optimization_barrier` with q, k and v); and the units'
rematerialisation policy saved the forward's loop carries per pair
(section 1).
"""


def time_text(store: Store, a) -> str:
  rows = [r for r in store.rows("time").values()]
  if not rows:
    return ""
  r = rows[-1]
  names = list(r["ratio"])
  label = lambda n: "shard=8" if n == "fsdp8" else f"shard={8 // int(n[2:])} x context={n[2:]}"
  lines = ["| layout | sequences x tokens | median step | vs shard=8 | FLOPs vs shard=8 "
           "(attention's share) | first loss |", "|---|---|---|---|---|---|"]
  base = r["flops"]["fsdp8"]["total"]
  for n in names:
    fl = r["flops"][n]
    lines.append(f"| {label(n)} | {r['shape'][n][0]} x {r['shape'][n][1]:,} | "
                 f"{r['median_s'][n]:.2f} s | {r['ratio'][n]:.2f}x | {fl['total'] / base:.2f}x "
                 f"({100 * fl['attention'] / fl['total']:.0f}%) | {r['loss'][n]:.4f} |")
  return f"""### 6. Time: context parallelism against FSDP alone, the same global tokens

The model of section 1 at {r['layers']} layers, {r['tokens']:,} tokens per step on 8
simulated CPU devices: `shard=8` with 8 sequences of {r['tokens'] // 8:,}
tokens against `shard=8/C x context=C` with 8/C sequences of
{r['tokens'] // 8:,} x C. Every variant compiled and run once, then
{r['rounds']} rounds of one step each (the order rotated every round) in this
one process; medians. {r['s']:.0f} s (load average {r['load']}: the 2 cores
were shared with other work, so absolute times mean little).

{chr(10).join(lines)}

The same global tokens in longer sequences cost more attention: each
token attends to more keys (the FLOPs column: the matmuls plus the
blockwise attention's visible 512 x 512 blocks, counted per device's
chunk). On simulated CPU devices the 8 devices share the host's cores, so
a step takes about the sum of the devices' work, not the slowest
device's: the causal imbalance across the context group (the last chunk
sees every key, the first only its own) does not show here; on real
devices each step waits for the last chunk (head-tail load balancing
evens it). The collectives are memory copies on this CPU. `shard=8`'s
512-token sequences take the kernel's plain path (one block: the scores
whole), the longer ones the blockwise kernel. Its history on this
machine, 2026-11-29, `context=8` against `shard=8`: 4.67x with one
512-row query block per 512-token chunk (15.05 against 3.22 s, one
process); 1.99x with a call's query blocks at most a quarter of its
queries (section 1); 1.35x since the backward pass no longer runs the
kernel's forward loops again (section 1: the step saves the kernel's
output and logsumexp), which also puts `context=2` and `4` under
`shard=8`'s step. The ratios move with the machine's load (an earlier
run with other work on both cores gave 2.51x for C = 8 where a quiet one
gave 1.99x).
"""


def intro_text(store: Store, a) -> str:
  if not any(store.rows(p) for p in PARTS):
    return ""
  loads = sorted({r["load"] for p in PARTS for r in store.rows(p).values() if "load" in r})
  return f"""## Memory, the longest sequence, communication and time

`python -m benchmarks context` (`benchmarks/context.py`) writes the
sections below from `context.json` (`--only {','.join(PARTS)}` reruns
parts, `--render` only rewrites them). Last written
{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, jax {jax.__version__}, {jax.default_backend()}
backend, Python {platform.python_version()}, {platform.machine()} with {os.cpu_count()} cores shared with
other work (load averages at the parts' starts: {'; '.join(loads)}); 8
simulated CPU devices. Every program but the timed ones is compiled from
`jax.ShapeDtypeStruct`s (nothing allocated); memory is XLA's
`memory_analysis()` per device.
"""


def header(a) -> str:
  return f"""# Context parallelism: memory, communication, time

`python -m benchmarks context` writes this file (`--only
{','.join(PARTS)}` reruns parts; the others keep their text).
Last run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, jax
{jax.__version__}, {jax.default_backend()} backend, Python {platform.python_version()},
{platform.machine()} with {os.cpu_count()} cores shared with other work; 8
simulated CPU devices (`fsdp_jax.simulate_cpu_devices`). Context
parallelism: `make_mesh(..., context=C)` and
`FSDPConfig(context_parallel=fsdp_jax.ContextParallel())`
([docs/context_parallel.md](../docs/context_parallel.md)); the raw
numbers are in `context.json`.
"""


SECTIONS = (("intro", intro_text), ("memory", memory_text), ("comm", comm_text),
            ("longest", longest_text),
            ("tensor", tensor_text), ("scan", scan_text), ("time", time_text))


def write_report(path: str, store: Store, a) -> None:
  """This benchmark's sections, each between its markers; a section this
  run did not produce keeps its old text, and anything in the file outside
  the markers (another benchmark's sections) is kept as it is."""
  old = open(path).read() if os.path.exists(path) else ""
  new = {k: fn(store, a) for k, fn in SECTIONS}
  blocks = []
  for k, _ in SECTIONS:
    start, end = MARK.format(k), MARK.format(k + " end")
    text = new[k]
    if not text and start in old:
      text = old[old.index(start) + len(start):old.index(end)].strip() + "\n"
    if text:
      blocks.append(f"{start}\n{text.strip()}\n{end}\n")
  text = old or header(a)
  for block in blocks:
    start = block.split("\n", 1)[0]
    end = block.rstrip("\n").rsplit("\n", 1)[1]
    if start in text and end in text:  # in place
      text = (text[:text.index(start)] + block.rstrip("\n")
              + text[text.index(end) + len(end):])
    else:  # after what is there (another benchmark's sections kept as they are)
      text = text.rstrip("\n") + "\n\n" + block
  with open(path, "w") as f:
    f.write(text)


def main(argv: list) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks context", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--only", default=",".join(PARTS), help="parts to run: " + ", ".join(PARTS))
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--seq", type=int, default=4096, help="memory, tensor, scan: tokens")
  p.add_argument("--tiny-seq", type=int, default=64, help="the activations' baseline T")
  p.add_argument("--contexts", default="1,2,4,8")
  p.add_argument("--budget-mib", type=int, default=512, help="longest: peak per device")
  p.add_argument("--time-tokens", type=int, default=4096, help="time: global tokens per step")
  p.add_argument("--time-layers", type=int, default=4)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--render", action="store_true", help="measure nothing, rewrite the report")
  p.add_argument("--fresh", action="store_true", help="forget the JSON's rows first")
  p.add_argument("--out", default=os.path.join(HERE, "CONTEXT.md"))
  p.add_argument("--json", default=os.path.join(HERE, "context.json"))
  a = p.parse_args(argv)
  parts = a.only.split(",")
  if set(parts) - set(PARTS):
    p.error(f"--only {a.only!r}: the parts are {', '.join(PARTS)}")
  a.contexts = [int(c) for c in a.contexts.split(",")]
  fsdp_jax.simulate_cpu_devices(8)
  a.load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  if a.fresh and os.path.exists(a.json):
    os.remove(a.json)
  store = Store(a.json)
  log = lambda msg: print(msg, flush=True)
  bench = Bench(a, log)
  started = time.perf_counter()
  if not a.render:
    for part, fn in (("memory", part_memory), ("longest", part_longest),
                     ("tensor", part_tensor), ("scan", part_scan), ("time", part_time)):
      if part in parts:
        fn(bench, store, a)
  log(f"context: {time.perf_counter() - started:.0f} s")
  write_report(a.out, store, a)
  print(f"wrote {a.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
