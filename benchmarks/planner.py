#!/usr/bin/env python
"""The planner against the compiled step: memory, time, cost, and what fits.

    python -m benchmarks planner                    # everything: PLANNER.md (about 40 min on 2 cores)
    python -m benchmarks planner --only accuracy    # estimate vs compiled peak, 31 configurations
    python -m benchmarks planner --only time        # CPU measured / predicted step time
    python -m benchmarks planner --only cost        # 70B-shaped Llama on 64 devices (and 8 x TP 8); a search
    python -m benchmarks planner --only fits        # Llama 3 8B / 70B on 8, 64, 512 H100s
    python -m benchmarks planner --measure-cpu      # the "cpu" DeviceSpec figures of this machine
    python -m benchmarks planner --gpu              # on a GPU host: estimate vs measured step

Memory accuracy: each configuration's truth is the real step
(``shard_train_step``) compiled on ``jax.eval_shape(init_train_state(...))``
in a fresh process with that many simulated CPU devices
(``fsdp_jax.simulate_cpu_devices(N)``), its ``memory_analysis()`` argument +
temp + output - alias per device (with CPU offload: the device-resident
arguments and results, ``fsdp_jax.hlo.entry_memory_bytes``, since the CPU
backend's ``memory_analysis()`` counts host buffers as arguments). The
estimate runs in this process, which has 8 simulated devices and never
builds the configuration's mesh. Compiles of 64 and more devices run one at
a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import platform
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

RESULT = "RESULT "
GiB, MiB = 1 << 30, 1 << 20


# --------------------------------------------------------------------------
# The model: examples/llama.py's Llama with remat and scan options


@dataclasses.dataclass(frozen=True)
class Spec:
  """One configuration: the model's shape, the batch, the mesh and the step."""

  name: str
  mesh: tuple  # ((axis, size), ...)
  strategy: str = "FULL_SHARD"
  orig: bool = False
  layers: int = 4
  hidden: int = 256
  intermediate: int = 768
  heads: int = 8
  kv_heads: int = 4
  vocab: int = 4096
  seq: int = 256
  batch_per_device: int = 2
  mp: str = ""  # "bf16": MixedPrecision(param_dtype=bf16)
  lora: str = ""  # "lora" | "qlora"
  tp: bool = False
  offload: bool = False
  remat: bool = False  # the model checkpoints each block (nn.remat)
  scan: bool = False  # nn.scan over stacked blocks
  accum: int = 1
  accumulation: str = "no_sync"
  what_if_remat: bool = False  # estimate remat=True on the model without it
  policy: str = ""  # FSDPConfig(activation_checkpointing=ActivationCheckpointing(policy))

  @property
  def devices(self) -> int:
    n = 1
    for _, s in self.mesh:
      n *= s
    return n

  @property
  def data_parallel(self) -> int:
    return self.devices // dict(self.mesh).get("tensor", 1)


LORA_TARGETS = ("*.q", "*.k", "*.v", "*.o", "*.gate", "*.up", "*.down")
TP_RULES = (("*.q", "colwise"), ("*.k", "colwise"), ("*.v", "colwise"), ("*.o", "rowwise"),
            ("*.gate", "colwise"), ("*.up", "colwise"), ("*.down", "rowwise"))


def build(spec: Spec, *, remat=None):
  """``(init_fn, loss_fn, config, batch shapes, mesh shape)``."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  import llama  # pylint: disable=import-outside-toplevel

  remat = spec.remat if remat is None else remat
  c = llama.LlamaConfig(vocab_size=spec.vocab, hidden_size=spec.hidden,
                        intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
                        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads)

  class ScanBlock(nn.Module):
    config: llama.LlamaConfig

    @nn.compact
    def __call__(self, x, _):
      block = nn.remat(llama.Block, prevent_cse=False) if remat else llama.Block
      return block(self.config, name="block")(x), None

  class Model(nn.Module):
    config: llama.LlamaConfig

    @nn.compact
    def __call__(self, tokens):
      cfg = self.config
      x = nn.Embed(cfg.vocab_size, cfg.hidden_size, name="embed")(tokens)
      if spec.scan:
        x, _ = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=cfg.num_hidden_layers)(cfg, name="layers")(x, None)
      else:
        block = nn.remat(llama.Block) if remat else llama.Block
        for i in range(cfg.num_hidden_layers):
          x = block(cfg, name=f"layers_{i}")(x)
      x = llama.RMSNorm(cfg.rms_norm_eps, name="norm")(x)
      return nn.Dense(cfg.vocab_size, use_bias=False, name="lm_head", dtype=x.dtype)(x)

  model = Model(c)

  def init_fn(rng):
    return model.init(rng, jnp.zeros((1, 8), jnp.int32))["params"]

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["input_ids"]).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))

  kw = {}
  if spec.scan:
    kw["stacked_layers"] = ("layers",)
  else:
    kw["auto_wrap_policy"] = fsdp_jax.ModuleWrapPolicy([llama.Block])
  if spec.mp == "bf16":
    kw["mixed_precision"] = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16,
                                                    reduce_dtype=jnp.float32)
  if spec.lora:
    quant = fsdp_jax.Quantization(dtype="nf4", block_size=64) if spec.lora == "qlora" else None
    kw["lora"] = fsdp_jax.LoRA(targets=LORA_TARGETS, rank=8, alpha=16.0,
                               base_quantization=quant)
  if spec.tp:
    kw["tensor_parallel"] = fsdp_jax.TensorParallel(rules=TP_RULES)
  if spec.offload:
    kw["cpu_offload"] = fsdp_jax.CPUOffload(offload_params=True)
  if spec.policy:
    kw["activation_checkpointing"] = fsdp_jax.ActivationCheckpointing(spec.policy)
  config = fsdp_jax.FSDPConfig(sharding_strategy=getattr(fsdp_jax.ShardingStrategy,
                                                         spec.strategy),
                               use_orig_params=spec.orig, **kw)
  rows = spec.batch_per_device * spec.data_parallel * spec.accum
  batch = {"input_ids": jax.ShapeDtypeStruct((rows, spec.seq), jnp.int32),
           "labels": jax.ShapeDtypeStruct((rows, spec.seq), jnp.int32)}
  return init_fn, loss_fn, config, batch, dict(spec.mesh)


# --------------------------------------------------------------------------
# The configurations


def accuracy_specs() -> list:
  S = Spec
  return [
      S("FULL_SHARD flat", (("shard", 8),)),
      S("FULL_SHARD orig", (("shard", 8),), orig=True),
      S("SHARD_GRAD_OP flat", (("shard", 8),), strategy="SHARD_GRAD_OP"),
      S("SHARD_GRAD_OP orig", (("shard", 16),), strategy="SHARD_GRAD_OP", orig=True),
      S("NO_SHARD", (("shard", 8),), strategy="NO_SHARD"),
      S("HYBRID_SHARD", (("replicate", 2), ("shard", 4)), strategy="HYBRID_SHARD"),
      S("_HYBRID_SHARD_ZERO2", (("replicate", 2), ("shard", 4)),
        strategy="_HYBRID_SHARD_ZERO2"),
      S("HYBRID_SHARD 4x16", (("replicate", 4), ("shard", 16)), strategy="HYBRID_SHARD"),
      S("FULL_SHARD 64", (("shard", 64),)),
      S("FULL_SHARD bf16 32", (("shard", 32),), mp="bf16"),
      S("FULL_SHARD 256", (("shard", 256),), layers=2),
      S("TP 4x2", (("shard", 4), ("tensor", 2)), tp=True),
      S("TP 16x4", (("shard", 16), ("tensor", 4)), tp=True),
      S("LoRA", (("shard", 8),), lora="lora", orig=True),
      S("QLoRA", (("shard", 8),), lora="qlora", orig=True),
      S("LoRA 64", (("shard", 64),), lora="lora", orig=True),
      S("QLoRA 128", (("shard", 128),), lora="qlora", orig=True),
      S("offload", (("shard", 8),), offload=True),
      S("remat (nn.remat)", (("shard", 8),), remat=True),
      S("remat 64", (("shard", 64),), remat=True),
      S("remat what-if", (("shard", 8),), remat=True, what_if_remat=True),
      S("policy full", (("shard", 8),), policy="full"),
      S("policy dots", (("shard", 8),), policy="dots"),
      S("policy offload", (("shard", 8),), policy="offload"),
      S("policy full 64", (("shard", 64),), policy="full"),
      S("policy dots 64", (("shard", 64),), policy="dots"),
      S("policy offload 64", (("shard", 64),), policy="offload"),
      S("scan", (("shard", 8),), scan=True),
      S("scan SHARD_GRAD_OP", (("shard", 16),), scan=True, strategy="SHARD_GRAD_OP"),
      S("scan 256", (("shard", 256),), scan=True, layers=2),
      S("accumulation sharded", (("shard", 8),), accum=2, accumulation="sharded"),
  ]


# --------------------------------------------------------------------------
# The truth: the real step compiled in a fresh process


def child(spec_json: str, measure_time: bool) -> None:
  spec = Spec(**{**json.loads(spec_json), "mesh": tuple(map(tuple, json.loads(spec_json)["mesh"]))})
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  fsdp_jax.simulate_cpu_devices(spec.devices)
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  init_fn, loss_fn, config, batch, shape = build(spec)
  mesh = fsdp_jax.make_mesh(**{k: v for k, v in shape.items()})
  opt = optax.adamw(1e-4)
  t0 = time.perf_counter()
  state = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      init_fn=init_fn, rng=jax.random.key(0), optimizer=opt, mesh=mesh, config=config))
  step = fsdp_jax.shard_train_step(loss_fn, gradient_accumulation_steps=spec.accum,
                                   accumulation=spec.accumulation)
  compiled = step.lower(state, batch).compile()
  ma = compiled.memory_analysis()
  mem = {k: int(getattr(ma, k + "_size_in_bytes")) for k in ("argument", "output", "alias",
                                                             "temp")}
  total = mem["argument"] + mem["temp"] + mem["output"] - mem["alias"]
  device_total = total
  if spec.offload:
    entry = fsdp_jax.hlo.entry_memory_bytes(compiled.as_text())
    device_total = (entry.argument_device_bytes + mem["temp"] + entry.output_device_bytes
                    - max(0, mem["alias"] - entry.output_host_bytes))
  out = {"memory": mem, "total": total, "device_total": device_total,
         "compile_s": time.perf_counter() - t0}
  if measure_time:
    real = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0), optimizer=opt,
                                     mesh=mesh, config=config)
    data = {k: np.zeros(v.shape, v.dtype) for k, v in batch.items()}
    times = []
    for _ in range(6):
      t = time.perf_counter()
      real, metrics = step(real, data)
      jax.block_until_ready(metrics["loss"])
      times.append(time.perf_counter() - t)
    out["step_s"] = sorted(times[2:])[len(times[2:]) // 2]
  print(RESULT + json.dumps(out), flush=True)


def truth(spec: Spec, measure_time: bool = False) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  args = [sys.executable, os.path.abspath(__file__), "--child",
          json.dumps(dataclasses.asdict(spec))] + (["--time"] if measure_time else [])
  proc = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT)]
  if proc.returncode or not lines:
    raise RuntimeError(f"{spec.name}: {proc.stderr[-3000:]}")
  return json.loads(lines[0][len(RESULT):])


# --------------------------------------------------------------------------
# The estimates


def estimate(spec: Spec, device="cpu"):
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  init_fn, loss_fn, config, batch, shape = build(
      spec, remat=False if spec.what_if_remat else None)
  return fsdp_jax.estimate(loss_fn, optimizer=optax.adamw(1e-4), batch=batch,
                           mesh_shape=shape, config=config, init_fn=init_fn, device=device,
                           gradient_accumulation_steps=spec.accum,
                           accumulation=spec.accumulation, remat=spec.what_if_remat)


def accuracy(log, only=None) -> list:
  """Each configuration's estimate (the step compiled per device, where
  ``estimate`` compiles it) and its modelled peak (``compile_step=False``)
  against the real step compiled on that many simulated devices."""
  import optax  # pylint: disable=import-outside-toplevel
  from fsdp_jax._src.planner.devices import device_spec  # pylint: disable=import-outside-toplevel
  from fsdp_jax._src.planner.estimator import Planner  # pylint: disable=import-outside-toplevel
  rows = []
  for spec in accuracy_specs():
    if only and spec.name not in only:
      continue
    init_fn, loss_fn, config, batch, shape = build(
        spec, remat=False if spec.what_if_remat else None)
    planner = Planner(loss_fn, optimizer=optax.adamw(1e-4), batch=batch, init_fn=init_fn)
    kw = dict(gradient_accumulation_steps=spec.accum, accumulation=spec.accumulation,
              remat=spec.what_if_remat)
    t0 = time.perf_counter()
    est = planner.estimate(config, shape, device_spec("cpu"), **kw)
    est_s = time.perf_counter() - t0
    modelled = planner.estimate(config, shape, device_spec("cpu"), compile_step=False, **kw)
    real = truth(spec)
    want = real["device_total"]
    got = est.bytes_per_device["total"]
    mod = modelled.bytes_per_device["total"]
    rows.append({"name": spec.name, "devices": spec.devices, "mesh": dict(spec.mesh),
                 "truth": want, "estimate": got, "error": got / want - 1,
                 "compiled": est.compiled, "modelled": mod, "modelled_error": mod / want - 1,
                 "estimate_s": est_s, "compile_s": real["compile_s"], "peak_at": est.peak_at})
    log(f"{spec.name:<24} {spec.devices:>4} dev  truth {want / MiB:8.2f} MiB  estimate "
        f"{got / MiB:8.2f} MiB  error {100 * (got / want - 1):+6.2f}% "
        f"({'compiled' if est.compiled else 'modelled'})  modelled {100 * (mod / want - 1):+6.2f}%"
        f"  ({est_s:.1f}s / {real['compile_s']:.1f}s)")
  return rows


# --------------------------------------------------------------------------
# Time on this CPU: measured / predicted


TIME_SPECS = ("FULL_SHARD flat", "SHARD_GRAD_OP flat", "HYBRID_SHARD", "NO_SHARD",
              "remat (nn.remat)", "scan")


def time_ratios(log, device) -> list:
  rows = []
  specs = {s.name: s for s in accuracy_specs()}
  for name in TIME_SPECS:
    spec = specs[name]
    est = estimate(spec, device=device)
    real = truth(spec, measure_time=True)
    rows.append({"name": name, "predicted_s": est.step_seconds, "measured_s": real["step_s"],
                 "ratio": real["step_s"] / est.step_seconds})
    log(f"{name:<24} measured {real['step_s'] * 1e3:8.1f} ms  predicted "
        f"{est.step_seconds * 1e3:8.1f} ms  ratio {real['step_s'] / est.step_seconds:.2f}")
  return rows


# --------------------------------------------------------------------------
# Cost: a 70B-shaped Llama on 64 devices, and a search (fresh processes)

LLAMA3 = {
    "8B": dict(vocab=128256, hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8),
    "70B": dict(vocab=128256, hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8),
}


def llama3(size: str, mesh, *, seq: int, batch_per_device: int = 1, **kw) -> Spec:
  return Spec(f"Llama 3 {size}", tuple(mesh.items()), seq=seq,
              batch_per_device=batch_per_device, orig=True, mp="bf16", **LLAMA3[size], **kw)


def cost_child(what: str) -> None:
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  fsdp_jax.simulate_cpu_devices(8)
  import jax  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  jax.devices()
  rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  t0 = time.perf_counter()
  if what in ("estimate", "estimate-tp"):
    spec = (llama3("70B", {"shard": 64}, seq=4096) if what == "estimate" else
            llama3("70B", {"shard": 8, "tensor": 8}, seq=4096, tp=True))
    est = estimate(spec, device="H100-80GB")
    out = {"total": est.bytes_per_device["total"], "step_s": est.step_seconds,
           "fits": est.fits, "peak_at": est.peak_at, "text": str(est)}
  else:
    spec = llama3("70B", {"shard": 64}, seq=4096)
    init_fn, loss_fn, config, batch, _ = build(spec)
    from fsdp_jax._src.planner.estimator import Planner  # pylint: disable=import-outside-toplevel
    counted = []
    original = Planner.estimate

    def counting(self, *a, **k):
      counted.append(1)
      return original(self, *a, **k)

    Planner.estimate = counting
    found = fsdp_jax.search(loss_fn, optimizer=optax.adamw(1e-4), batch=batch, init_fn=init_fn,
                            devices=64, device="H100-80GB",
                            space={"config": config, "use_orig_params": [True]})
    out = {"estimated": len(counted), "fit": len(found),
           "best": found[0].describe_config() if found else None,
           "rows": [(e.describe_config(), e.bytes_per_device["total"], e.step_seconds)
                    for e in found]}
  out["seconds"] = time.perf_counter() - t0
  out["rss_growth"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
  out["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  print(RESULT + json.dumps(out), flush=True)


def cost(log, what: str) -> dict:
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--cost-child", what],
                        env=env, capture_output=True, text=True, check=False)
  lines = [l for l in proc.stdout.splitlines() if l.startswith(RESULT)]
  if proc.returncode or not lines:
    raise RuntimeError(f"cost {what}: {proc.stderr[-3000:]}")
  out = json.loads(lines[0][len(RESULT):])
  log(f"cost {what}: {out['seconds']:.1f} s, peak RSS growth {out['rss_growth'] / MiB:.0f} MiB "
      f"(process peak {out['rss_peak'] / MiB:.0f} MiB)")
  return out


# --------------------------------------------------------------------------
# What fits: Llama 3 8B and 70B on 8, 64 and 512 H100s


FIT_DEVICES = (8, 64, 512)
FIT_MODES = ("full", "LoRA", "QLoRA")


def fits(log, seq: int) -> list:
  """For each model and mode, one planner (its programs compiled once) and
  a search per device count: the best configuration, its memory per GPU and
  predicted tokens per second per GPU. Meshes: one data-parallel axis, and
  for HYBRID strategies shards within a node of 8 (replicate across nodes)."""
  import optax  # pylint: disable=import-outside-toplevel
  # the module (the package re-exports its function under the same name)
  search_lib = importlib.import_module("fsdp_jax._src.planner.search")
  from fsdp_jax._src.planner.estimator import Planner  # pylint: disable=import-outside-toplevel
  rows = []
  for size in ("8B", "70B"):
    for mode in FIT_MODES:
      spec = llama3(size, {"shard": 8}, seq=seq,
                    lora={"full": "", "LoRA": "lora", "QLoRA": "qlora"}[mode])
      init_fn, loss_fn, config, batch, _ = build(spec)
      planner = Planner(loss_fn, optimizer=optax.adamw(1e-4), batch=batch, init_fn=init_fn)
      for devices in FIT_DEVICES:
        t0 = time.perf_counter()
        batch = build(dataclasses.replace(spec, mesh=(("shard", devices),)))[3]
        meshes = [{"shard": devices}] + ([{"replicate": devices // 8, "shard": 8}]
                                         if devices > 8 else [])
        space = {"config": config, "use_orig_params": [True], "mesh_shapes": meshes}
        if mode != "full":
          space["lora"] = ["lora" if mode == "LoRA" else "qlora"]
        found = search_lib.run(planner.with_batch(batch), devices=devices,
                               device="H100-80GB", space=space)
        best = found[0] if found else None
        row = {"model": size, "mode": mode, "devices": devices, "seq": seq,
               "best": best.describe_config() if best else "nothing fits",
               "memory_gib": best.bytes_per_device["total"] / GiB if best else None,
               "tokens_per_s": best.tokens_per_second_per_device if best else None,
               "compiled": best.compiled if best else None,
               "fitting": len(found), "seconds": time.perf_counter() - t0}
        rows.append(row)
        log(f"{size} {mode} on {devices}: {row['best']}  "
            + (f"{row['memory_gib']:.1f} GiB ({'compiled' if best.compiled else 'modelled'})  "
               f"{row['tokens_per_s']:,.0f} tok/s/GPU" if best else "")
            + f"  ({row['seconds']:.0f}s)")
  return rows


# --------------------------------------------------------------------------
# On a GPU host: estimate against the measured step (calibration)


def gpu(log) -> list:
  """Each accuracy configuration that fits one device's mesh, on this
  process's devices: the real step's peak (``memory_analysis()``) and median
  step time against the estimate for the local device (measured with
  :func:`~fsdp_jax._src.planner.devices.measure_local`)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  from fsdp_jax._src.planner.devices import measure_local  # pylint: disable=import-outside-toplevel
  device = measure_local()
  n = jax.device_count()
  rows = []
  for spec in accuracy_specs():
    if spec.devices != n or spec.offload:
      continue
    init_fn, loss_fn, config, batch, shape = build(spec)
    mesh = fsdp_jax.make_mesh(**shape)
    state = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0),
                                      optimizer=optax.adamw(1e-4), mesh=mesh, config=config)
    step = fsdp_jax.shard_train_step(loss_fn, gradient_accumulation_steps=spec.accum,
                                     accumulation=spec.accumulation)
    data = {k: np.zeros(v.shape, v.dtype) for k, v in batch.items()}
    ma = step.lower(state, data).compile().memory_analysis()
    peak = ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes - (
        ma.alias_size_in_bytes)
    times = []
    for _ in range(8):
      t = time.perf_counter()
      state, metrics = step(state, data)
      jax.block_until_ready(metrics["loss"])
      times.append(time.perf_counter() - t)
    measured = sorted(times[3:])[len(times[3:]) // 2]
    est = estimate(spec, device=device)
    rows.append({"name": spec.name, "peak": peak, "estimate": est.bytes_per_device["total"],
                 "measured_s": measured, "predicted_s": est.step_seconds})
    log(f"{spec.name:<24} peak {peak / MiB:.1f} MiB est {est.bytes_per_device['total'] / MiB:.1f}"
        f"  step {measured * 1e3:.1f} ms est {est.step_seconds * 1e3:.1f} ms")
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--child", default=None)
  p.add_argument("--time", action="store_true")
  p.add_argument("--cost-child", default=None)
  p.add_argument("--only", default="", help="accuracy, time, cost, fits")
  p.add_argument("--names", default="", help="accuracy configurations, comma-separated")
  p.add_argument("--measure-cpu", action="store_true")
  p.add_argument("--gpu", action="store_true")
  p.add_argument("--seq", type=int, default=4096, help="what-fits sequence length")
  p.add_argument("--json", default=os.path.join(HERE, "planner.json"))
  p.add_argument("--out", default=os.path.join(HERE, "PLANNER.md"))
  args = p.parse_args(argv)
  if args.child:
    child(args.child, args.time)
    return 0
  if args.cost_child:
    cost_child(args.cost_child)
    return 0
  import fsdp_jax  # pylint: disable=import-outside-toplevel
  if args.gpu:
    print(json.dumps(gpu(lambda m: print(m, file=sys.stderr, flush=True)), indent=1))
    return 0
  fsdp_jax.simulate_cpu_devices(8)
  log = lambda m: print(m, flush=True)
  if args.measure_cpu:
    import jax  # pylint: disable=import-outside-toplevel
    from fsdp_jax._src.planner.devices import measure_local  # pylint: disable=import-outside-toplevel
    for _ in range(3):
      spec = measure_local(devices=jax.devices())
      log(f"peak_flops {spec.peak_flops:.3g}  hbm_bytes_per_s {spec.hbm_bytes_per_s:.3g}  "
          f"link_bytes_per_s {spec.intra_node_bytes_per_s:.3g}")
    return 0
  results = {}
  if os.path.exists(args.json):
    with open(args.json) as f:
      results = json.load(f)
  names = [n for n in args.names.split(",") if n]
  parts = args.only.split(",") if args.only else ["accuracy", "time", "cost", "fits"]
  if "accuracy" in parts:
    rows = accuracy(log, names)
    if names:
      keep = [r for r in results.get("accuracy", []) if r["name"] not in names]
      rows = keep + rows
    results["accuracy"] = rows
  if "time" in parts:
    results["time"] = time_ratios(log, "cpu")
  if "cost" in parts:
    results["cost"] = {"estimate": cost(log, "estimate"), "estimate_tp": cost(log, "estimate-tp"),
                       "search": cost(log, "search")}
  if "fits" in parts:
    results["fits"] = fits(log, args.seq)
  results["machine"] = {"date": datetime.date.today().isoformat(),
                        "python": platform.python_version(),
                        "jax": __import__("jax").__version__, "cpu": platform.machine()}
  with open(args.json, "w") as f:
    json.dump(results, f, indent=1, default=str)
  from benchmarks import planner_report  # pylint: disable=import-outside-toplevel
  text = planner_report.render(results)
  with open(args.out, "w") as f:
    f.write(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
