"""``python -m benchmarks activations``: activation memory, writes
``benchmarks/ACTIVATIONS.md``. Five parts (``--only``; a part not run keeps
its section of the report as it was):

* ``exact``: ``FSDPConfig(activation_checkpointing=ActivationCheckpointing(
  policy))`` with each policy against the same training without, after 3
  AdamW steps: the eight families of ``fsdp_jax.models`` (tiny configs) and
  a Flax linen transformer, on FULL_SHARD flat, SHARD_GRAD_OP with the
  original parameters, HYBRID 2 x 2 and FSDP 4 x TP 2 (``--layouts all``;
  default: every model on FULL_SHARD, the other layouts on Llama, GPT-2
  and the linen model).
* ``memory``: the compiled peak of a 12-layer Llama-shaped model at 4,096
  tokens per device with each policy against none, and the residuals
  ``"offload"`` marks for host memory.
* ``planner``: ``fsdp_jax.estimate(config=...)`` against that peak, on 8
  and 64 simulated devices (64: the real step compiled in a fresh process).
* ``time``: each policy's step time against none, in one process.
* ``loss``: the blocked loss's own memory (below).

Each measured row is saved in ``benchmarks/activations.json`` as soon as it
is measured: parts and meshes can run in separate processes, a stopped run
resumes where it stopped (``--fresh`` starts over), and ``--render``
rewrites the report from the saved rows without measuring.

The blocked loss's part:

The head and cross-entropy of a Llama 3 sized vocabulary (128,256) at
8,192 tokens of width 4,096, with their gradients (``jax.grad`` with
respect to the hidden state and the head's kernel): the unblocked loss (the
families' ``loss_fn(loss_block_tokens=None)``: ``[tokens, vocab]`` logits,
float32 cross-entropy) against ``fsdp_jax.chunked_cross_entropy`` at
several block sizes. Every program is compiled from
``jax.ShapeDtypeStruct``s on the local backend (nothing is allocated);
the figures are XLA's ``memory_analysis()``: the temporaries (what the
program allocates besides its inputs and outputs) and the outputs (the two
gradients).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from typing import Callable, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import fsdp_jax  # noqa: E402
import fsdp_jax.models  # noqa: E402
from fsdp_jax._src import _compat, local_loss  # noqa: E402
from benchmarks import harness  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2 ** 30
MIB = 2 ** 20
RESULT = "ACTIVATIONS-RESULT "
JSON = os.path.join(HERE, "activations.json")


def stored(part: str) -> dict:
  """``activations.json``'s measured rows of one part, by key: each row is
  saved as soon as it is measured, so that parts and meshes run in separate
  processes and an interrupted run resumes (``--fresh`` measures again)."""
  if not os.path.exists(JSON):
    return {}
  with open(JSON) as f:
    return json.load(f).get(part, {})


def store(part: str, key: str, row) -> None:
  data = {}
  if os.path.exists(JSON):
    with open(JSON) as f:
      data = json.load(f)
  data.setdefault(part, {})[key] = row
  with open(JSON + ".tmp", "w") as f:
    json.dump(data, f, indent=1)
  os.replace(JSON + ".tmp", JSON)
LOSS_BLOCK_TOKENS = inspect.signature(
    fsdp_jax.models.from_pretrained).parameters["loss_block_tokens"].default


def unblocked(hidden, kernel, labels):
  """The families' unblocked loss: logits in the parameters' dtype, then
  the float32 cross-entropy."""
  logits = (hidden @ kernel).astype(jnp.float32)
  ok = labels != -100
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(ok, labels, 0))
  return jnp.sum(jnp.where(ok, ce, 0.0))


def blocked(block):
  return lambda h, w, y: fsdp_jax.chunked_cross_entropy(h, w, y, block_tokens=block).total


def measure(fn, tokens, d, vocab, dtype) -> dict:
  args = (jax.ShapeDtypeStruct((tokens, d), dtype), jax.ShapeDtypeStruct((d, vocab), dtype),
          jax.ShapeDtypeStruct((tokens,), jnp.int32))
  t = time.perf_counter()
  m = jax.jit(jax.grad(fn, (0, 1))).lower(*args).compile().memory_analysis()
  return {"temp": m.temp_size_in_bytes, "out": m.output_size_in_bytes,
          "compile_s": time.perf_counter() - t}


def run(tokens: int, d: int, vocab: int, blocks: list, dtypes: list) -> list:
  rows = []
  for dtype in dtypes:
    base = measure(unblocked, tokens, d, vocab, dtype)
    rows.append((jnp.dtype(dtype).name, "unblocked", base, 1.0))
    for b in blocks:
      m = measure(blocked(b), tokens, d, vocab, dtype)
      rows.append((jnp.dtype(dtype).name, f"blocks of {b}", m, m["temp"] / base["temp"]))
  return rows


def table(rows, tokens, vocab) -> str:
  lines = ["| dtype | loss | temporaries | vs unblocked | outputs (gradients) | one block's "
           "float32 logits |", "|---|---|---|---|---|---|"]
  for dtype, name, m, ratio in rows:
    block = tokens if name == "unblocked" else int(name.split()[-1])
    lines.append(f"| {dtype} | {name} | {m['temp'] / GIB:.3f} GiB | {ratio:.3f} "
                 f"(1/{1 / ratio:.1f}) | {m['out'] / GIB:.3f} GiB | "
                 f"{block * vocab * 4 / GIB:.3f} GiB |")
  return "\n".join(lines)


# --------------------------------------------------------------------------
# Activation checkpointing: FSDPConfig(activation_checkpointing=...)

POLICIES = ("full", "dots", "offload")
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
FAMILY_CONFIGS = {  # tests/test_families.py's tiny configs, each family's own options on
    "llama": dict(TINY, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8)),
    "mistral": dict(TINY, sliding_window=4),
    "qwen2": dict(TINY, tie_word_embeddings=True, use_sliding_window=True, sliding_window=4,
                  max_window_layers=1),
    "qwen3": dict(TINY, head_dim=16),
    "gemma2": dict(TINY, head_dim=8, query_pre_attn_scalar=16, sliding_window=4,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma3_text": dict(TINY, head_dim=8, query_pre_attn_scalar=16, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention"]),
    "phi3": dict(TINY, sliding_window=5, max_position_embeddings=32,
                 original_max_position_embeddings=8,
                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                      partial_rotary_factor=0.5, short_factor=[1.0, 1.5],
                                      long_factor=[2.0, 3.0])),
    "gpt2": dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                 initializer_range=0.2),
}
# (name, mesh kwargs, FSDPConfig kwargs, tensor parallel)
LAYOUTS = {
    "FULL_SHARD flat, 4": (dict(shard=4), {}, False),
    "SHARD_GRAD_OP orig, 3": (dict(shard=3), dict(
        sharding_strategy=fsdp_jax.ShardingStrategy.SHARD_GRAD_OP, use_orig_params=True), False),
    "HYBRID 2 x 2": (dict(replicate=2, shard=2), dict(
        sharding_strategy=fsdp_jax.ShardingStrategy.HYBRID_SHARD), False),
    "FSDP 4 x TP 2": (dict(shard=4, tensor=2), {}, True),
}
SEQ = 12  # past the sliding windows and LongRoPE's original length


class LinenBlock(nn.Module):
  """A pre-LN block: causal attention (heads of 8) and a GELU MLP."""
  d: int
  heads: int = 4

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="ln1")(x)
    q, k, v = (nn.Dense(self.d, name=n)(h).reshape(*h.shape[:-1], self.heads, -1)
               for n in ("q", "k", "v"))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((x.shape[1],) * 2, bool)), s, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v).reshape(x.shape)
    x = x + nn.Dense(self.d, name="o")(a)
    h = nn.LayerNorm(name="ln2")(x)
    return x + nn.Dense(self.d, name="down")(jax.nn.gelu(nn.Dense(2 * self.d, name="up")(h)))


class LinenLM(nn.Module):
  vocab: int = 64
  d: int = 32
  layers: int = 2

  @nn.compact
  def __call__(self, ids):
    x = nn.Embed(self.vocab, self.d, name="embed")(ids)
    for i in range(self.layers):
      x = LinenBlock(self.d, name=f"blocks_{i}")(x)
    return nn.Dense(self.vocab, name="head")(nn.LayerNorm(name="ln_f")(x))


class Model(NamedTuple):
  init_fn: Callable
  loss_fn: Callable
  config: Callable  # config(tensor_parallel: bool, **kw) -> FSDPConfig


def linen_model() -> Model:
  m = LinenLM()

  def loss_fn(params, batch):
    logits = m.apply({"params": params}, batch["input_ids"])[:, :-1]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["labels"][:, 1:]).mean()

  def config(tp, **kw):
    rules = fsdp_jax.TensorParallel(rules=[("*.q", "colwise"), ("*.k", "colwise"),
                                           ("*.v", "colwise"), ("*.o", "rowwise"),
                                           ("*.up", "colwise"), ("*.down", "rowwise")])
    return fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["blocks_*"]),
                               **(dict(tensor_parallel=rules) if tp else {}), **kw)
  return Model(lambda rng: m.init(rng, jnp.zeros((1, SEQ), jnp.int32))["params"], loss_fn,
               config)


def family_model(family: str, raw: dict, tmp: str, **kw) -> Model:
  b = fsdp_jax.models.from_pretrained(_write_config(tmp, family, raw), **kw)
  return Model(b.init_fn, b.loss_fn, lambda tp, **k: b.fsdp_config(tensor_parallel=tp, **k))


def exact_case(model: Model, layout: str, steps: int = 3) -> dict:
  """``{policy: (max |loss diff|, max |parameter diff|)}`` after ``steps``
  AdamW steps against the same training without checkpointing."""
  mesh_kw, cfg_kw, tp = LAYOUTS[layout]
  n = int(np.prod(list(mesh_kw.values())))
  mesh = fsdp_jax.make_mesh(devices=jax.devices()[:n], **mesh_kw)
  rows = 2 * n // mesh_kw.get("tensor", 1)
  rng = np.random.default_rng(0)
  params = jax.tree.map(np.asarray, jax.jit(model.init_fn)(jax.random.key(0)))
  ids = rng.integers(0, 64, (steps, rows, SEQ)).astype(np.int32)
  batches = [{"input_ids": i, "labels": i} for i in ids]
  opt = optax.adamw(1e-2)
  out = {}
  for policy in (None,) + POLICIES:
    config = model.config(tp, activation_checkpointing=policy and fsdp_jax.ActivationCheckpointing(
        policy), **cfg_kw)
    state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
    step = fsdp_jax.shard_train_step(model.loss_fn, opt, mesh=mesh, config=config)
    losses = []
    for batch in batches:
      state, metrics = step(state, batch)
      losses.append(float(metrics["loss"]))
    mu = [np.asarray(x) for path, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
          if ".mu" in jax.tree_util.keystr(path)]
    out[policy] = (np.asarray(losses), [np.asarray(x) for x in jax.tree.leaves(state.params)], mu)
  base_l, base_p, base_mu = out[None]
  mu_scale = max(float(np.max(np.abs(m))) for m in base_mu)
  return {p: (float(np.max(np.abs(out[p][0] - base_l))),
              max(float(np.max(np.abs(a - b))) for a, b in zip(out[p][1], base_p)),
              max(float(np.max(np.abs(a - b))) for a, b in zip(out[p][2], base_mu)) / mu_scale)
          for p in POLICIES}


def exact(log, layouts_for: Callable[[str], list], load: str) -> list:
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    models = {f: (lambda f=f: family_model(f, FAMILY_CONFIGS[f], tmp)) for f in FAMILY_CONFIGS}
    models["flax linen"] = linen_model
    for layout in LAYOUTS:  # every model on the first layout first
      for name, make in models.items():
        if layout not in layouts_for(name) or f"{name} | {layout}" in stored("exact"):
          continue
        model = make()
        t = time.perf_counter()
        try:
          diffs, err = exact_case(model, layout), None
        except Exception as e:  # a crash is a finding: reported in the table
          diffs, err = {}, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rows.append({"model": name, "layout": layout, "diffs": diffs, "error": err,
                     "s": time.perf_counter() - t, "load": load})
        store("exact", f"{name} | {layout}", rows[-1])
        log(f"exact {name:<12} {layout:<22} " + (err or "  ".join(
            f"{p} {l:.1e}/{w:.1e}/{m:.1e}" for p, (l, w, m) in diffs.items())) +
            f"  ({rows[-1]['s']:.1f}s)")
  return rows


def exact_table(rows) -> str:
  cols = " | ".join(f"`{p}`: loss / params / mu" for p in POLICIES)
  lines = [f"| model | layout | {cols} |",
           "|---|---|" + "---|" * len(POLICIES)]
  for r in rows:
    cells = ([" / ".join(f"{x:.1e}" for x in r["diffs"][p]) for p in POLICIES]
             if not r["error"] else [f"fails: {r['error']}"] + [""] * (len(POLICIES) - 1))
    lines.append(f"| {r['model']} | {r['layout']} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


# --------------------------------------------------------------------------
# Memory, the planner and time on a model where activations dominate

MEM_LLAMA = dict(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_hidden_layers=12,
                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=8192)
# (row name, policy or None, loss_block_tokens): the families' default
# blocked loss (LOSS_BLOCK_TOKENS) with each policy, and the unblocked loss.
MEM_ROWS = [("none", None, LOSS_BLOCK_TOKENS), ("full", "full", LOSS_BLOCK_TOKENS),
            ("dots", "dots", LOSS_BLOCK_TOKENS), ("offload", "offload", LOSS_BLOCK_TOKENS),
            ("none, unblocked loss", None, None)]


def mem_setup(tmp, policy, block, devices, seq, layers=12):
  """``(model, config, batch shapes, mesh shape)`` of the memory model."""
  b = fsdp_jax.models.from_pretrained(
      _write_config(tmp, "llama", dict(MEM_LLAMA, num_hidden_layers=layers)),
      loss_block_tokens=block)
  config = b.fsdp_config(activation_checkpointing=policy and fsdp_jax.ActivationCheckpointing(
      policy))
  batch = {k: jax.ShapeDtypeStruct((devices, seq), jnp.int32) for k in ("input_ids", "labels")}
  return b, config, batch, {"shard": devices}


def _write_config(tmp, family, raw) -> str:
  d = os.path.join(tmp, f"{family}-{len(os.listdir(tmp))}")
  os.makedirs(d)
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump({"model_type": family, **raw}, f)
  return d


def compiled_peak(policy, block, devices, seq) -> dict:
  """The real step compiled (shapes only) on ``devices`` simulated devices:
  ``memory_analysis()``'s sizes and the peak ``argument + temp + output -
  alias`` (the planner's truth, benchmarks/planner.py)."""
  with tempfile.TemporaryDirectory() as tmp:
    b, config, batch, shape = mem_setup(tmp, policy, block, devices, seq)
    mesh = fsdp_jax.make_mesh(shard=devices, devices=jax.devices()[:devices])
    opt = optax.adamw(1e-4)
    t = time.perf_counter()
    state = jax.eval_shape(lambda: fsdp_jax.init_train_state(
        init_fn=b.init_fn, rng=jax.random.key(0), optimizer=opt, mesh=mesh, config=config))
    step = fsdp_jax.shard_train_step(b.loss_fn, opt, mesh=mesh, config=config)
    ma = step.lower(state, batch).compile().memory_analysis()
    mem = {k: int(getattr(ma, k + "_size_in_bytes")) for k in ("argument", "output", "alias",
                                                               "temp")}
    one = {k: jax.ShapeDtypeStruct((1, seq), v.dtype) for k, v in batch.items()}  # a device's
    host = offloaded_residuals(b.loss_fn, state, one) if policy else (0, 0, 0)
  return {**mem, "peak": mem["argument"] + mem["temp"] + mem["output"] - mem["alias"],
          "compile_s": time.perf_counter() - t, "host": host}


def offloaded_residuals(loss_fn, state, batch) -> tuple:
  """``(checkpoints, residuals marked for host memory, their bytes)`` in the
  loss as the step traces it (tests/test_activation_checkpointing.py's
  count: each framework checkpoint's saved residuals, ``<host>`` avals)."""
  closed = local_loss.LocalLoss(loss_fn, state.plan).traced(batch)[0]
  eqns = [e for e in closed.jaxpr.eqns
          if _compat.is_remat(e) and _compat.remat_params(e).policy is not None]
  n = nbytes = 0
  for eqn in eqns:
    args = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    saved = _compat.saved_residuals(lambda *a, eqn=eqn: _compat.bind_eqn(eqn, a), *args)
    host = [aval for aval, _ in saved if "<host>" in str(aval)]
    n += len(host)
    nbytes += sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in host)
  return len(eqns), n, nbytes


def truth_in_child(policy, block, devices, seq) -> dict:
  """:func:`compiled_peak` in a fresh process with ``devices`` simulated
  devices (more than this process has), as benchmarks/planner.py does."""
  env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-m", "benchmarks.activations", "--child",
                         json.dumps([policy, block, devices, seq])],
                        env=env, capture_output=True, text=True, check=False,
                        cwd=os.path.dirname(HERE))
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT)]
  if proc.returncode or not lines:
    raise RuntimeError(f"child {policy}, {devices} devices: {proc.stderr[-3000:]}")
  return json.loads(lines[0][len(RESULT):])


def planner_estimate(policy, block, devices, seq):
  with tempfile.TemporaryDirectory() as tmp:
    b, config, batch, shape = mem_setup(tmp, policy, block, devices, seq)
    t = time.perf_counter()
    est = fsdp_jax.estimate(b.loss_fn, optimizer=optax.adamw(1e-4), batch=batch,
                            mesh_shape=shape, config=config, init_fn=b.init_fn, device="cpu")
    return est, time.perf_counter() - t


def memory_and_planner(log, meshes, seq, load) -> list:
  rows = []
  for devices in meshes:
    for name, policy, block in MEM_ROWS:
      if f"{devices} | {name}" in stored("memory"):
        continue
      real = (compiled_peak(policy, block, devices, seq) if devices <= len(jax.devices())
              else truth_in_child(policy, block, devices, seq))
      est, est_s = planner_estimate(policy, block, devices, seq)
      got = est.bytes_per_device["total"]
      rows.append({"devices": devices, "name": name, **real, "estimate": got,
                   "compiled": est.compiled, "error": got / real["peak"] - 1, "estimate_s": est_s,
                   "seq": seq, "load": load})
      store("memory", f"{devices} | {name}", rows[-1])
      log(f"memory {devices:>3} dev {name:<22} peak {real['peak'] / MIB:9.1f} MiB (temp "
          f"{real['temp'] / MIB:9.1f})  estimate {got / MIB:9.1f} MiB "
          f"{100 * rows[-1]['error']:+.1f}%  host residuals {real['host'][1]}  "
          f"({real['compile_s']:.0f}s / {est_s:.0f}s)")
  return rows


def step_times(log, rounds, seq, layers) -> dict:
  """Each policy's step against none: one process, the variants run in
  turn (the order rotated every round), medians."""
  steps = {}
  with tempfile.TemporaryDirectory() as tmp:
    for name, policy in [("none", None)] + [(p, p) for p in POLICIES]:
      b, config, batch, _ = mem_setup(tmp, policy, LOSS_BLOCK_TOKENS, 8, seq, layers=layers)
      mesh = fsdp_jax.make_mesh(shard=8)
      opt = optax.adamw(1e-4)
      state = fsdp_jax.init_train_state(init_fn=b.init_fn, rng=jax.random.key(0),
                                        optimizer=opt, mesh=mesh, config=config)
      step = fsdp_jax.shard_train_step(b.loss_fn, opt, mesh=mesh, config=config)
      ids = np.random.default_rng(0).integers(0, MEM_LLAMA["vocab_size"], (8, seq), np.int32)
      data = {"input_ids": ids, "labels": ids}
      state, m = step(state, data)  # compile and warm up
      jax.block_until_ready(m["loss"])
      steps[name] = [step, state, data, []]
  names = list(steps)
  med = harness.rotated_step_medians(steps, rounds)
  log("time " + "  ".join(f"{n} {med[n]:.3f}s ({med[n] / med['none']:.2f}x)" for n in names))
  return {"median_s": med, "ratio": {n: med[n] / med["none"] for n in names}}


def memory_table(rows) -> str:
  lines = ["| devices | policy | peak (arguments + temporaries + outputs - aliased) | vs none "
           "| temporaries | arguments | residuals to host (of checkpoints) | planner "
           "estimate | error |", "|---|---|---|---|---|---|---|---|---|"]
  base = {r["devices"]: r["peak"] for r in rows if r["name"] == "none"}
  for r in rows:
    ck, n, nb = r["host"]
    lines.append(f"| {r['devices']} | {r['name']} | {r['peak'] / MIB:,.1f} MiB | "
                 f"{r['peak'] / base[r['devices']]:.2f}x | {r['temp'] / MIB:,.1f} MiB | "
                 f"{r['argument'] / MIB:,.1f} MiB | "
                 f"{f'{n} ({nb / MIB:,.1f} MiB) of {ck}' if ck else '-'} | "
                 f"{r['estimate'] / MIB:,.1f} MiB{'' if r['compiled'] else ' (modelled)'} | "
                 f"{100 * r['error']:+.1f}% |")
  return "\n".join(lines)


def planner_table(rows) -> str:
  lines = ["| devices | policy | compiled peak | `fsdp_jax.estimate` | error | estimate's "
           "seconds |", "|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['devices']} | {r['name']} | {r['peak'] / MIB:,.1f} MiB | "
                 f"{r['estimate'] / MIB:,.1f} MiB{'' if r['compiled'] else ' (modelled)'} | "
                 f"{100 * r['error']:+.1f}% | {r['estimate_s']:.0f} |")
  return "\n".join(lines)


def time_table(t: dict) -> str:
  names = list(t["ratio"])
  return "\n".join(["| | " + " | ".join(f"`{n}`" if n != "none" else n for n in names) + " |",
                    "|---|" + "---|" * len(names),
                    "| step time vs none | " + " | ".join(f"{t['ratio'][n]:.2f}x" for n in names)
                    + " |"])


def _met(ok: bool) -> str:
  return "met" if ok else "**missed**"


def exact_text(rows, layouts, seconds, load, missing=()) -> str:
  ok = [r for r in rows if not r["error"]]
  worst = lambda k: max((r["diffs"][p][k] for r in ok for p in POLICIES), default=float("nan"))
  over = [(r["model"], r["layout"], p) for r in ok for p in POLICIES if r["diffs"][p][1] > 1e-6]
  crashed = [(r["model"], r["layout"]) for r in rows if r["error"]]
  scope = ("every model on every layout" if layouts == "all" else
           "every model on FULL_SHARD; the other layouts on Llama, GPT-2 and the linen model "
           "(`--layouts all`: the full product, about twice as long)")
  return f"""## 1. Exact: each policy trains as without checkpointing

Each model trained 3 AdamW steps (`optax.adamw(1e-2)`, float32, {SEQ} tokens
per row, 2 rows per data-parallel device, the same batches) with
`activation_checkpointing=None` and with each policy; the table gives the
largest |difference| of the 3 losses, of the parameters after the 3 steps,
and of Adam's first moment `mu` (relative to its largest entry). Models:
the eight families of `fsdp_jax.models` (tests/test_families.py's tiny
configs: hidden 32, 2 layers, each family's own options; one unit per
layer) and a Flax linen model (2 pre-LN blocks of `nn.Dense` /
`nn.LayerNorm` with causal attention, `ModuleWrapPolicy(["blocks_*"])`).
Layouts: FULL_SHARD flat on 4 devices, SHARD_GRAD_OP with
`use_orig_params=True` on 3 (which divides no size), HYBRID_SHARD 2 x 2,
FSDP 4 x TP 2 (`make_mesh(shard=4, tensor=2)`, the family's
`fsdp_config(tensor_parallel=True)`; the linen model: Megatron rules on its
projections). Scope: {scope}. {len(rows)} cases, {seconds:.0f} s (load
average {load}).{
" Not measured (the run was stopped for time): " + "; ".join(missing) + "." if missing else ""}

{exact_table(rows)}

Largest differences: losses {worst(0):.1e}, parameters {worst(1):.1e},
`mu` {worst(2):.1e} (relative). Target (1e-6 in float32): losses
{_met(worst(0) <= 1e-6)}; parameters {_met(not over)}{
f" ({len(over)} of {len(ok) * len(POLICIES)} (model, layout, policy) over 1e-6, "
f"the largest {worst(1) / 1e-6:.0f}x it)" if over else ""}{
"; crashed: " + ", ".join(f"{m} on {l}" for m, l in crashed) if crashed else ""}.

Why parameters can differ by more than the losses: the recomputation runs
the same operations, but XLA fuses and orders the recomputed forward
differently from the kept one, so gradients agree to float32 rounding
(`mu`'s column, relative to its largest entry), not bitwise. Adam divides each
gradient entry by its own magnitude: an entry whose gradient is near zero
(|g| ~ Adam's eps, 1e-8) turns a rounding difference of ~1e-9 into an
update difference of up to lr x 1e-9 / (|g| + eps)^2 x eps, ~1e-4 at lr 1e-2.
Checked by hand once (jax 0.10.2): in Llama on SHARD_GRAD_OP (3 devices),
`"full"`, after one step the largest difference, 6.9e-5, is one `up_proj`
entry whose gradient is -4e-8 (the median entry's is 6e-3); with SGD
(lr 0.1) the same run's parameters agree to 1e-7; Qwen2 with `"dots"` on
FULL_SHARD, after one SGD step (lr 0.1): 6e-8. A key-projection bias (Qwen2's,
GPT-2's in its fused `c_attn`, the linen model's `nn.Dense` `k`: the rows
with the largest differences) has a gradient of zero in exact arithmetic (a softmax does not see a
constant added to every score of a row), so its computed gradient is
rounding noise, which Adam scales up to steps of up to lr (one AdamW step:
1.4e-4 against SGD's 6e-8; after 3 steps up to 1e-2, lr itself); the later
steps' losses (up to 9e-6) and `mu` follow. The models without such a bias
stay within a few 1e-6 but for Phi-3 (1.2e-5) and Llama on SHARD_GRAD_OP
(5e-5, the entry above). This is float32's answer to a
different summation order, as two data-parallel layouts also give: it is
not a difference in what is computed.
"""


def memory_text(rows, seq, seconds, load) -> str:
  r = {x["name"]: x for x in rows}
  missing = [n for n, *_ in MEM_ROWS if n not in r]
  verdict = ("Not measured (the run was stopped for time): " + "; ".join(missing) + ".\n\n"
             if missing else "")
  if "full" in r and "none" in r:
    full = r["full"]["peak"] / r["none"]["peak"]
    verdict += (f'`"full"` against none: {full:.2f}x the peak (target at most 0.5x: '
                f'{_met(full <= 0.5)}). Without checkpointing the FULL_SHARD step keeps '
                "each layer's attention output and logsumexp, which the kernel names for "
                "the step's rematerialisation policy to save; before it did (2026-11-29) "
                "the backward pass ran the kernel's forward loops again and kept their "
                "inputs, the blocked queries, keys and values: none was 1,215.8 MiB, "
                '`"full"` 0.20x of it.')
  if "offload" in r:
    ck, n, nb = r["offload"]["host"]
    verdict += f""" `"offload"`: {n} residuals of its {ck} checkpoints
(one per layer) are `float32<host>` in the step's jaxpr ({nb / MIB:,.1f} MiB
per device), counted as tests/test_activation_checkpointing.py counts them
(`saved_residuals` of each framework checkpoint): per layer its two input
activations (`[1, {seq}, 256]`, the layer's input and the residual stream
after attention, which the block's add reads outside the unit) and the
rotary `cos` and `sin` tables (`[{seq}, 64]`), which every layer reads and
each layer's checkpoint offloads again. The gathered parameters stay on
the device. On the CPU backend host memory is the same memory, so
`"offload"` copies rather than moves, and its peak here counts those
residuals as device memory; on a GPU the {nb / MIB:,.1f} MiB leave device memory."""
  return f"""## 2. Memory: the compiled peak with each policy

A Llama-shaped family model (`from_pretrained` of a config.json: hidden
256, 12 layers, 4 heads, MLP 1,024, vocabulary 1,024), {seq:,} tokens per
device (1 sequence per device), 8 simulated devices, FULL_SHARD flat,
AdamW, the families' default blocked loss (`loss_block_tokens={LOSS_BLOCK_TOKENS}`)
unless the row says otherwise. The step is compiled only (its state from
`jax.eval_shape`). Peak = `memory_analysis()`'s arguments + temporaries
+ outputs - aliased outputs (the donated state counts once): the figure
benchmarks/planner.py calls the truth; the arguments are the sharded state
and the batch, the same in every row, so the differences are temporaries.
{seconds:.0f} s (load average {load}).

{memory_table(rows)}

{verdict}
"""


def planner_text(rows, seq, seconds, load, missing=()) -> str:
  worst = max(abs(r["error"]) for r in rows)
  return f"""## 3. Planner: `fsdp_jax.estimate(config=...)` against the compiled peak

The model of section 2; for each policy and for the unblocked loss,
`fsdp_jax.estimate(b.loss_fn, optimizer=optax.adamw(1e-4), batch=...,
mesh_shape={{"shard": N}}, config=b.fsdp_config(activation_checkpointing=...),
init_fn=b.init_fn, device="cpu")` (it compiles a per-device stand-in of the
step: docs/planner.md) against the real step's peak (section 2's
definition) compiled on N simulated devices: for 64, in a fresh process
with 64 simulated devices, as benchmarks/planner.py's accuracy rows do.
Error = estimate / compiled - 1. {seconds:.0f} s (load average {load}).
These rows are kept here, not in PLANNER.md's accuracy table (its
configurations are benchmarks/planner.py's own `Spec`s of the example
Llama, compiled by its own child process).

{planner_table(rows)}

Largest |error| {100 * worst:.1f}% (target within 5%: {_met(worst <= 0.05)}).{
" Not measured (the run was stopped for time): " + "; ".join(missing) + "." if missing else ""}
"""


def time_text(t, a, seconds, load) -> str:
  return f"""## 4. Time: each policy's step against none

The model of section 2 at {a.time_layers} layers and {a.time_seq:,} tokens per device (smaller,
so that the timed rounds fit the run), 8 simulated devices, FULL_SHARD,
the blocked loss; every variant compiled and run once, then {a.rounds} rounds,
each running one step of every variant (the order rotated every round) in
this one process; medians, as ratios to none (absolute times on a loaded
2-core machine mean little). {seconds:.0f} s (load average {load}).

{time_table(t)}

A checkpointed unit runs its forward twice, so `"full"` adds up to one
forward of the units (about a third of the step's FLOPs for a
transformer); `"dots"` recomputes only what lies between its saved
matmuls; `"offload"` also copies residuals to host memory and back (on
this CPU, a memory copy). Ratios within several percent of 1.00x are
within the noise of this shared machine, whose load changed during the
run (a step took {t['median_s']['none']:.0f} s here).
"""


def child(spec: str) -> None:
  policy, block, devices, seq = json.loads(spec)
  fsdp_jax.simulate_cpu_devices(devices)
  print(RESULT + json.dumps(compiled_peak(policy, block, devices, seq)), flush=True)


def loss_section(a) -> tuple:
  """The blocked loss's section of the report, and its table."""
  blocks = [int(b) for b in a.blocks.split(",")]
  rows = run(a.tokens, a.d, a.vocab, blocks, [jnp.float32, jnp.bfloat16])
  body = table(rows, a.tokens, a.vocab)
  f32 = {name: m for dt, name, m, _ in rows if dt == "float32"}
  ratio_512 = f32["blocks of 512"]["temp"] / f32["unblocked"]["temp"] if "blocks of 512" in f32 \
      else None
  bf16 = {name: m for dt, name, m, _ in rows if dt == "bfloat16"}
  copy = a.d * a.vocab * 4
  bf16_base = (bf16["unblocked"]["temp"] - copy) / GIB
  bf16_512 = (bf16.get("blocks of 512", bf16["unblocked"])["temp"] - copy) / GIB
  text = f"""## The blocked loss: its memory

`python -m benchmarks activations` ({datetime.date.today().isoformat()}, jax
{jax.__version__}, {jax.default_backend()} backend, Python {platform.python_version()}):
the head and the cross-entropy of {a.tokens:,} tokens of width {a.d:,} over a
vocabulary of {a.vocab:,} (Llama 3's), with their gradients (`jax.grad` with
respect to the hidden state and the head's kernel), each program compiled
from `jax.ShapeDtypeStruct`s (nothing allocated). Temporaries: XLA's
`memory_analysis().temp_size_in_bytes`, what the program allocates besides
its inputs and its outputs (the two gradients, listed apart).

- **unblocked**: the families' `loss_fn(loss_block_tokens=None)`: logits
  `[tokens, vocab]` in the parameters' dtype, then the float32
  cross-entropy (`optax.softmax_cross_entropy_with_integer_labels`).
- **blocks of b**: `fsdp_jax.chunked_cross_entropy(..., block_tokens=b)`.

{body}

{"At blocks of 512 in float32 the loss's temporaries are "
 f"{f32['blocks of 512']['temp'] / GIB:.3f} GiB against {f32['unblocked']['temp'] / GIB:.3f} GiB "
 f"unblocked: 1/{1 / ratio_512:.1f}." if ratio_512 else ""}
The blocked loss's temporaries are a few blocks of logits (the block's
float32 logits and their cotangent, in the forward scan, the backward's
pass over blocks of tokens, and its pass over blocks of the vocabulary,
each `[tokens, vocab / blocks]`), and the per-token logsumexp the forward
keeps (`tokens x 4` bytes). The unblocked loss holds the whole logits
several times over (in float32: the logits, the softmax, their cotangent).

In bfloat16 on the CPU backend both programs also hold a float32 copy of
the `[d, vocab]` kernel ({a.d * a.vocab * 4 / GIB:.2f} GiB): XLA's CPU backend
computes a bf16 matmul in float32 (`float-normalization`), converting its
operands, and hoists the conversion of the kernel out of the loops (one
`f32[{a.d},{a.vocab}]` convert in each compiled program's entry). That copy
is the CPU's, not the loss's: a GPU multiplies bf16 directly. Less that
copy, blocks of 512 in bfloat16 hold {bf16_512:.3f} GiB against
{bf16_base:.3f} GiB unblocked (1/{bf16_base / bf16_512:.1f}). The float32
rows are free of it.

How it works, and what it is in Liger Kernel and Cut Cross-Entropy:
[docs/activation_checkpointing.md](../docs/activation_checkpointing.md#the-blocked-loss).
"""
  return text, body


SECTIONS = ("exact", "memory", "planner", "time", "loss")
MARK = "<!-- section {} -->"


def sections_of(path: str) -> dict:
  """The report's sections by name; a report without markers is the
  blocked loss's section."""
  if not os.path.exists(path):
    return {}
  text = open(path).read()
  if MARK.format("loss") not in text and "# The blocked loss" in text:
    return {"loss": "#" + text[text.index("# The blocked loss"):].strip() + "\n"}
  parts = re.split(r"<!-- section (\w+) -->\n", text)
  return {parts[i]: parts[i + 1].strip() + "\n" for i in range(1, len(parts) - 1, 2)}


def header(load: str) -> str:
  return f"""# Activation memory: checkpointing policies and the blocked loss

`python -m benchmarks activations` writes this file (`--only
exact,memory,planner,time,loss` reruns parts; the others keep their text).
Last run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, jax
{jax.__version__}, {jax.default_backend()} backend, Python {platform.python_version()},
{platform.machine()} with {os.cpu_count()} cores shared with other work (load
average at the start of the run: {load}); 8 simulated CPU devices
(`fsdp_jax.simulate_cpu_devices`). The policies are
`FSDPConfig(activation_checkpointing=fsdp_jax.ActivationCheckpointing(policy))`
([docs/activation_checkpointing.md](../docs/activation_checkpointing.md)).
"""


def main(argv: list) -> int:
  if argv[:1] == ["--child"]:
    child(argv[1])
    return 0
  p = argparse.ArgumentParser(prog="python -m benchmarks activations", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--only", default=",".join(SECTIONS), help="parts to run: " + ", ".join(SECTIONS))
  p.add_argument("--layouts", choices=("default", "all"), default="default",
                 help="exact: every layout for every model (all), or for three (default)")
  p.add_argument("--seq", type=int, default=4096, help="memory/planner: tokens per device")
  p.add_argument("--meshes", default="8,64", help="planner: simulated devices")
  p.add_argument("--time-seq", type=int, default=1024)
  p.add_argument("--time-layers", type=int, default=4)
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--render", action="store_true",
                 help="measure nothing: write the sections from activations.json's rows")
  p.add_argument("--fresh", action="store_true", help="forget activations.json's rows first")
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--d", type=int, default=4096)
  p.add_argument("--vocab", type=int, default=128256)
  p.add_argument("--blocks", default="256,512,1024,2048")
  p.add_argument("--out", default=os.path.join(HERE, "ACTIVATIONS.md"),
                 help="the report ('-': print it only)")
  a = p.parse_args(argv)
  parts = a.only.split(",")
  if set(parts) - set(SECTIONS):
    p.error(f"--only {a.only!r}: the parts are {', '.join(SECTIONS)}")
  fsdp_jax.simulate_cpu_devices(8)
  load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  log = lambda msg: print(msg, flush=True)
  new, started = {}, time.perf_counter()
  if a.fresh and os.path.exists(JSON):
    os.remove(JSON)
  wide = ("llama", "gpt2", "flax linen")
  layouts_for = lambda m: list(LAYOUTS) if a.layouts == "all" or m in wide else list(LAYOUTS)[:1]
  if "exact" in parts and not a.render:
    exact(log, layouts_for, load)
  if ("memory" in parts or "planner" in parts) and not a.render:
    meshes = [int(n) for n in a.meshes.split(",")] if "planner" in parts else [8]
    memory_and_planner(log, meshes, a.seq, load)
  if "time" in parts and not a.render:
    t = time.perf_counter()
    store("time", "steps", {**step_times(log, a.rounds, a.time_seq, a.time_layers),
                            "s": time.perf_counter() - t, "load": load,
                            "seq": a.time_seq, "layers": a.time_layers, "rounds": a.rounds})
  # Each section from every row measured so far (this run's and earlier ones').
  if "exact" in parts and stored("exact"):
    done = stored("exact")
    cases = [(m, l) for m in list(FAMILY_CONFIGS) + ["flax linen"] for l in layouts_for(m)]
    rows = [done[f"{m} | {l}"] for m, l in cases if f"{m} | {l}" in done]
    missing = [f"{m} on {l}" for m, l in cases if f"{m} | {l}" not in done]
    new["exact"] = exact_text(rows, a.layouts, sum(r["s"] for r in rows),
                              "; ".join(sorted({r["load"] for r in rows})), missing)
  mem = list(stored("memory").values())
  if ("memory" in parts or "planner" in parts) and mem:
    eight = [r for r in mem if r["devices"] == 8]
    if eight:
      new["memory"] = memory_text(sorted(eight, key=lambda r: [n for n, *_ in MEM_ROWS].index(
          r["name"])), eight[0]["seq"], sum(r["compile_s"] + r["estimate_s"] for r in eight),
          "; ".join(sorted({r["load"] for r in eight})))
    if "planner" in parts:
      order = lambda r: (r["devices"], [n for n, *_ in MEM_ROWS].index(r["name"]))
      have = {(r["devices"], r["name"]) for r in mem}
      missing = [f"{name} on {n} devices" for n in [int(x) for x in a.meshes.split(",")]
                 for name, *_ in MEM_ROWS if (n, name) not in have]
      new["planner"] = planner_text(sorted(mem, key=order), mem[0]["seq"],
                                    sum(r["compile_s"] + r["estimate_s"] for r in mem),
                                    "; ".join(sorted({r["load"] for r in mem})), missing)
  if "time" in parts and stored("time"):
    t = stored("time")["steps"]
    new["time"] = time_text(t, argparse.Namespace(time_layers=t["layers"], time_seq=t["seq"],
                                                  rounds=t["rounds"]), t["s"], t["load"])
  if "loss" in parts and not a.render:
    new["loss"], body = loss_section(a)
    print(body)
  log(f"activations: {time.perf_counter() - started:.0f} s")
  old = {} if a.out == "-" else sections_of(a.out)
  merged = {**old, **new}
  report = header(load) + "".join(f"\n{MARK.format(k)}\n{merged[k]}" for k in SECTIONS
                                  if k in merged)
  if a.out == "-":
    print(report)
  else:
    with open(a.out, "w") as f:
      f.write(report)
    print(f"wrote {a.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
