"""What every measurement shares: the settings (one line each), the machine
description, building a setting's compiled step (fsdp_jax, the jit baselines,
PyTorch FSDP in the background) and timing variants round-robin.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fnmatch
import json
import os
import platform
import resource
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import fsdp_jax
from fsdp_jax._src import hlo
from benchmarks.common import GPTConfig, make_batch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 2 ** 20

from benchmarks.hlo_stats import (collective_stats, compile_with_dump, memory_stats,
                                  schedule_stats)


# --------------------------------------------------------------------------
# Settings: one line each


@dataclasses.dataclass(frozen=True)
class Setting:
  """One measured configuration.

  ``family``: ``fsdp`` (fsdp_jax.shard_train_step), ``jax_native`` (jit with
  NamedSharding-sharded params, compiler-inserted collectives), ``dp``
  (replicated params, batch sharded, jit) or ``torch`` (PyTorch FSDP, gloo).
  ``fsdp_kwargs`` go straight to ``fsdp_jax.FSDPConfig`` (future options:
  prefetch, offload, ...). ``default``: part of a plain run (others only
  with ``--only`` / ``--all``). ``model``: ``gpt`` (8 unrolled blocks, one
  FSDP unit each via ``ModuleWrapPolicy({Block})``) or ``gpt_scan`` (the
  same model with stacked blocks under ``nn.scan``; one stacked unit,
  ``stacked_layers=("params.blocks",)``).
  """

  name: str
  family: str
  strategy: Optional[str]
  precision: str  # "fp32" or "bf16" (MixedPrecision(param_dtype=bf16, reduce_dtype=fp32))
  replicate: Optional[int] = None
  fsdp_kwargs: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)
  default: bool = True
  note: str = ""
  model: str = "gpt"  # "gpt" (unrolled blocks) or "gpt_scan" (nn.scan over stacked blocks)
  patch: Optional[str] = None  # a key of PATCHES: a proposed library change, applied while lowering


SETTINGS: list[Setting] = [
    Setting("fsdp/FULL_SHARD/fp32", "fsdp", "FULL_SHARD", "fp32"),
    Setting("fsdp/FULL_SHARD/bf16", "fsdp", "FULL_SHARD", "bf16"),
    Setting("fsdp/FULL_SHARD/fp32/bwd_post", "fsdp", "FULL_SHARD", "fp32",
            fsdp_kwargs={"backward_prefetch": fsdp_jax.BackwardPrefetch.BACKWARD_POST},
            note="backward_prefetch=BACKWARD_POST"),
    Setting("fsdp/FULL_SHARD/fp32/bwd_none", "fsdp", "FULL_SHARD", "fp32",
            fsdp_kwargs={"backward_prefetch": None}, note="backward_prefetch=None"),
    Setting("fsdp/FULL_SHARD/fp32/fwd_prefetch", "fsdp", "FULL_SHARD", "fp32",
            fsdp_kwargs={"forward_prefetch": True}, note="forward_prefetch=True"),
    Setting("fsdp/FULL_SHARD/fp32/no_limit", "fsdp", "FULL_SHARD", "fp32",
            fsdp_kwargs={"forward_prefetch": True, "limit_all_gathers": False},
            note="forward_prefetch=True, limit_all_gathers=False"),
    Setting("fsdp/SHARD_GRAD_OP/fp32", "fsdp", "SHARD_GRAD_OP", "fp32"),
    Setting("fsdp/SHARD_GRAD_OP/bf16", "fsdp", "SHARD_GRAD_OP", "bf16"),
    Setting("fsdp/NO_SHARD/fp32", "fsdp", "NO_SHARD", "fp32"),
    Setting("fsdp/NO_SHARD/bf16", "fsdp", "NO_SHARD", "bf16"),
    Setting("fsdp/HYBRID_SHARD_2x4/fp32", "fsdp", "HYBRID_SHARD", "fp32", replicate=2),
    Setting("fsdp/HYBRID_SHARD_2x4/bf16", "fsdp", "HYBRID_SHARD", "bf16", replicate=2),
    Setting("jax_native/fp32", "jax_native", None, "fp32",
            note="jit, params+opt state sharded on their largest dim divisible by 8"),
    Setting("jax_native/bf16", "jax_native", None, "bf16",
            note="as jax_native/fp32, params cast to bf16 inside the loss"),
    Setting("jax_native_bs/fp32", "jax_native", None, "fp32", model="gpt_bs",
            note="jax_native/fp32 + with_sharding_constraint(batch-sharded) on the residual "
                 "stream after every block: forces GSPMD into FSDP (weights move, not "
                 "activations)"),
    Setting("dp/fp32", "dp", None, "fp32", note="jit, params replicated, batch sharded"),
    Setting("dp/bf16", "dp", None, "bf16", default=False,
            note="as dp/fp32, params cast to bf16 inside the loss"),
    Setting("fsdp/FULL_SHARD/fp32/scan", "fsdp", "FULL_SHARD", "fp32", model="gpt_scan",
            note="same GPT, blocks stacked under nn.scan: one layer gathered per iteration"),
    Setting("jax_native/fp32/scan", "jax_native", None, "fp32", model="gpt_scan",
            default=False, note="jax_native/fp32 on the nn.scan model"),
    Setting("fsdp/FULL_SHARD/bf16/scan", "fsdp", "FULL_SHARD", "bf16", model="gpt_scan",
            default=False),
    Setting("fsdp/SHARD_GRAD_OP/fp32/scan", "fsdp", "SHARD_GRAD_OP", "fp32", model="gpt_scan",
            default=False),
    Setting("torch/FULL_SHARD/fp32", "torch", "FULL_SHARD", "fp32",
            note="PyTorch FSDP, gloo, 8 processes x --torch-threads threads"),
    Setting("torch/FULL_SHARD/bf16", "torch", "FULL_SHARD", "bf16", default=False,
            note="PyTorch FSDP MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)"),
    Setting("torch/SHARD_GRAD_OP/fp32", "torch", "SHARD_GRAD_OP", "fp32", default=False),
    Setting("torch/NO_SHARD/fp32", "torch", "NO_SHARD", "fp32", default=False),
    Setting("torch/HYBRID_SHARD_2x4/fp32", "torch", "HYBRID_SHARD", "fp32", replicate=2,
            default=False),
]


# Context managers a Setting can apply while compiling (to measure proposed
# library changes before they land).
PATCHES: dict[str, Callable] = {}


def select_settings(only: Optional[str], include_all: bool) -> list[Setting]:
  if not only:
    return [s for s in SETTINGS if s.default or include_all]
  pats = [p.strip() for p in only.split(",") if p.strip()]
  out = [s for s in SETTINGS if any(fnmatch.fnmatchcase(s.name, p) for p in pats)]
  if not out:
    sys.exit(f"--only {only!r} matches no setting; see --list")
  return out


# --------------------------------------------------------------------------
# Machine description


def machine_info(torch_python: str = sys.executable) -> dict:
  cpu = "unknown"
  isa = []
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name") and cpu == "unknown":
          cpu = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not isa:
          have = set(line.split(":", 1)[1].split())
          isa = [x for x in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16",
                             "amx_bf16") if x in have]
  except OSError:
    pass
  mem = None
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal"):
          mem = int(line.split()[1]) * 1024
  except OSError:
    pass
  try:
    import jaxlib
    jaxlib_v = jaxlib.__version__
  except Exception:  # pragma: no cover
    jaxlib_v = "?"
  torch_v = torch_version(torch_python)
  return {
      "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      "cpu": cpu,
      "cpu_isa": isa,
      "cores": os.cpu_count(),
      "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
      "ram_bytes": mem,
      "python": platform.python_version(),
      "jax": jax.__version__,
      "jaxlib": jaxlib_v,
      "flax": _version("flax"),
      "optax": _version("optax"),
      "torch": torch_v,
      "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
      "loadavg_start": os.getloadavg(),
      "hostname": platform.node(),
  }


def _version(name):
  try:
    import importlib.metadata as md
    return md.version(name)
  except Exception:
    return None


# --------------------------------------------------------------------------
# Variants: something that runs a step


@dataclasses.dataclass
class Variant:
  setting: Setting
  run: Callable[[], float]          # runs one step, returns seconds
  info: dict
  first_loss: Optional[float] = None
  last_loss: Optional[float] = None
  times: list = dataclasses.field(default_factory=list)
  samples: list = dataclasses.field(default_factory=list)
  close: Callable[[], Any] = lambda: None


def _cast_tree(tree, dtype):
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      tree)


def _timed_runner(compiled, state_box, batch, unpack):
  """Runs the compiled step on the current state (donated), keeps the new
  state and the loss; returns the step's wall time and the CPU time and
  minor page faults of this process during it (the process is otherwise
  idle: PyTorch runs in other processes)."""

  def run():
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    out = compiled(*state_box["state"], batch)
    jax.block_until_ready(out)
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    state_box["state"], state_box["loss"] = unpack(out)
    return {"time_s": dt, "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
            "sys_s": r1.ru_stime - r0.ru_stime, "minflt": r1.ru_minflt - r0.ru_minflt}

  return run


@dataclasses.dataclass
class ModelBundle:
  """One model variant: its functions, host weights and activation bytes."""

  name: str
  init_fn: Callable
  loss_fn: Callable
  params: Any            # host (numpy) tree
  module_classes: dict
  stacked: tuple = ()
  act: dict = dataclasses.field(default_factory=dict)


class Bench:
  """Holds the models, their weights, the batch and the measured variants."""

  def __init__(self, args):
    from benchmarks import models
    self.args = args
    self.models = models
    self.cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
                         num_layers=args.layers, num_heads=args.heads)
    self.world = args.devices
    self.devices = jax.devices()[: self.world]
    self.global_batch = args.batch_per_device * self.world
    self.batch = make_batch(self.cfg, self.global_batch, seed=args.seed)
    self.optimizer = optax.adam(args.lr)
    self._bundles: dict = {}
    self.num_params = self.bundle("gpt").num_params

  def bundle(self, name: str) -> ModelBundle:
    if name in self._bundles:
      return self._bundles[name]
    if name == "gpt_bs":
      # The same model and weights, activations constrained batch-sharded.
      base = self.bundle("gpt")
      sh = NamedSharding(self.jit_mesh(), P("d"))
      _, _, loss_fn = self.models.make_model(
          self.cfg, constrain=lambda x: jax.lax.with_sharding_constraint(x, sh))
      mb = dataclasses.replace(base, name=name, loss_fn=loss_fn)
      mb.num_params = base.num_params
      self._bundles[name] = mb
      return mb
    scan = name == "gpt_scan"
    _, init_fn, loss_fn = self.models.make_model(self.cfg, scan=scan)
    rng = jax.random.key(self.args.seed)
    # Flax module classes for ModuleWrapPolicy({Block}), collected once and
    # passed explicitly (a second fsdp_jax.module_classes() call on the same
    # function returns {}: jax.eval_shape's trace cache skips the Python
    # function, so the interceptor never runs; see README.md).
    classes = fsdp_jax.module_classes(lambda r: init_fn(r), rng)
    # Host (numpy) copy: every variant gets fresh device buffers from it, so
    # donating one variant's state can never delete another's arrays.
    params = jax.device_get(jax.jit(init_fn)(rng))
    mb = ModelBundle(name, init_fn, loss_fn, params, classes,
                     stacked=("params.blocks",) if scan else ())
    mb.num_params = self.models.count_params(params)
    mb.act = self.activations(mb)
    self._bundles[name] = mb
    return mb

  # ---- fsdp_jax ------------------------------------------------------------
  def fsdp_config(self, s: Setting):
    mb = self.bundle(s.model)
    mp = None
    if s.precision == "bf16":
      mp = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
    kw = dict(s.fsdp_kwargs)
    if mb.stacked:
      kw.setdefault("stacked_layers", mb.stacked)
    else:
      kw.setdefault("auto_wrap_policy", fsdp_jax.ModuleWrapPolicy({self.models.Block}))
    return fsdp_jax.FSDPConfig(
        sharding_strategy=fsdp_jax.ShardingStrategy[s.strategy],
        mixed_precision=mp, **kw)

  def fsdp_mesh(self, s: Setting, n: Optional[int] = None):
    devices = self.devices if n is None else jax.devices()[:n]
    if s.replicate:
      return fsdp_jax.make_mesh(replicate=s.replicate, shard=len(devices) // s.replicate,
                                devices=devices)
    return fsdp_jax.make_mesh(shard=len(devices), devices=devices)

  def fsdp_state(self, s: Setting, n: Optional[int] = None):
    mesh = self.fsdp_mesh(s, n)
    cfg = self.fsdp_config(s)
    mb = self.bundle(s.model)
    state = fsdp_jax.init_train_state(params=mb.params, optimizer=self.optimizer, mesh=mesh,
                                      config=cfg, module_classes=mb.module_classes)
    return state, mesh, cfg

  def build_fsdp(self, s: Setting) -> Variant:
    state, mesh, cfg = self.fsdp_state(s)
    step = fsdp_jax.shard_train_step(self.bundle(s.model).loss_fn, self.optimizer, mesh=mesh,
                                     config=cfg)
    batch = jax.device_put(self.batch, NamedSharding(mesh, P(tuple(mesh.axis_names))))
    t0 = time.perf_counter()
    with (PATCHES[s.patch]() if s.patch else contextlib.nullcontext()):
      lowered = step.lower(state, batch)
    t_lower = time.perf_counter() - t0
    compiled, t_compile, peak = compile_with_dump(lowered, self.args.dump_dir, s.name)
    info = self._describe(s, compiled, peak, t_lower, t_compile)
    info["plan"] = str(state.plan)
    info["plan_collectives"] = state.plan.collectives_per_step()
    info["theory"] = self.theory(s, state.plan)
    info["state_bytes_per_device"] = state_bytes_per_device((state.params, state.opt_state))
    info["floor"] = self.floor(s, state.plan)
    box = {"state": (state,), "loss": None}
    run = _timed_runner(compiled, box, batch,
                        lambda out: ((out[0],), out[1]["loss"]))
    v = Variant(s, run, info)
    v.box = box
    return v

  # ---- baselines -----------------------------------------------------------
  def jit_mesh(self) -> Mesh:
    return Mesh(np.array(self.devices), ("d",), axis_types=(AxisType.Auto,))

  def build_jit(self, s: Setting) -> Variant:
    mesh = self.jit_mesh()
    n = len(self.devices)

    def spec(x):
      if s.family == "dp":
        return P()
      dims = sorted(range(x.ndim), key=lambda d: -x.shape[d])
      for d in dims:
        if x.shape[d] % n == 0:
          parts = [None] * x.ndim
          parts[d] = "d"
          return P(*parts)
      return P()

    mb = self.bundle(s.model)
    param_sh = jax.tree.map(lambda x: NamedSharding(mesh, spec(x)), mb.params)
    params = jax.device_put(mb.params, param_sh)
    # optax's mu/nu mirror the params: they get the params' shardings; the
    # rest (Adam's step count) is replicated.
    opt_struct = jax.eval_shape(self.optimizer.init, mb.params)
    opt_sh = jax.tree.map(lambda _: NamedSharding(mesh, P()), opt_struct)
    opt_sh = _mirror_param_shardings(opt_struct, opt_sh, mb.params, param_sh, mesh)
    opt_state = jax.jit(self.optimizer.init, out_shardings=opt_sh)(params)
    batch_sh = NamedSharding(mesh, P("d"))
    batch = jax.device_put(self.batch, batch_sh)
    loss_fn = mb.loss_fn
    optimizer = self.optimizer
    bf16 = s.precision == "bf16"

    def train_step(params, opt_state, batch):
      def lf(p, b):
        return loss_fn(_cast_tree(p, jnp.bfloat16) if bf16 else p, b)
      loss, grads = jax.value_and_grad(lf)(params, batch)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    jitted = jax.jit(train_step,
                     in_shardings=(param_sh, opt_sh, jax.tree.map(lambda _: batch_sh, batch)),
                     out_shardings=(param_sh, opt_sh, NamedSharding(mesh, P())),
                     donate_argnums=(0, 1))
    t0 = time.perf_counter()
    lowered = jitted.lower(params, opt_state, batch)
    t_lower = time.perf_counter() - t0
    compiled, t_compile, peak = compile_with_dump(lowered, self.args.dump_dir, s.name)
    info = self._describe(s, compiled, peak, t_lower, t_compile)
    info["state_bytes_per_device"] = state_bytes_per_device((params, opt_state))
    info["param_specs"] = sorted({str(sp.spec) for sp in jax.tree.leaves(
        param_sh, is_leaf=lambda x: isinstance(x, NamedSharding))})
    box = {"state": (params, opt_state), "loss": None}
    run = _timed_runner(compiled, box, batch, lambda out: ((out[0], out[1]), out[2]))
    v = Variant(s, run, info)
    v.box = box
    return v

  def _describe(self, s, compiled, peak, t_lower, t_compile) -> dict:
    text = compiled.as_text()
    return {
        "memory": memory_stats(compiled),
        "peak": peak,
        "collectives": collective_stats(text, self.world),
        "hlo_summarize": hlo.summarize(text),
        "schedule": schedule_stats(text),
        "lower_s": t_lower,
        "compile_s": t_compile,
    }

  # ---- theory --------------------------------------------------------------
  def theory(self, s: Setting, plan) -> dict:
    """Collective payload bytes per device per step the strategy implies."""
    pb = 2 if s.precision == "bf16" else 4     # gather dtype (param_dtype)
    rb = 4                                      # reduce dtype (fp32 in both settings)
    p_all = sum(l.numel for l in plan.leaves)
    p_regather = sum(plan.unit_numel(u) for u in plan.units if plan.reshard(u))
    strat = s.strategy
    t = {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}
    if strat == "NO_SHARD":
      t["all-reduce"] = rb * p_all
    else:
      t["all-gather"] = pb * (p_all + p_regather)
      t["reduce-scatter"] = rb * p_all
      if strat in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        t["all-reduce"] = rb * p_all // plan.n
    g_shard = plan.n
    g_rep = plan.axes.world_size // plan.n
    wire = {
        "all-gather": t["all-gather"] * (g_shard - 1) / g_shard,
        "reduce-scatter": t["reduce-scatter"] * (g_shard - 1) / g_shard,
        "all-reduce": (2 * t["all-reduce"] * (self.world - 1) / self.world if strat == "NO_SHARD"
                       else 2 * t["all-reduce"] * (g_rep - 1) / max(g_rep, 1)),
    }
    return {"payload": t, "wire": {k: int(round(v)) for k, v in wire.items()},
            "params": p_all, "params_regathered": p_regather,
            "param_bytes": pb, "reduce_bytes": rb}

  def activations(self, mb: ModelBundle) -> dict:
    """Activation bytes for one device's batch, by compiling the unsharded
    model's forward+backward (``jax.grad``; gradients are outputs, not
    temporaries) on one device in fp32 and reading its temporary bytes; plus
    the jaxpr-level count of saved residuals (an upper bound: XLA fuses and
    recomputes some).

    Only fp32 is compiled: on the CPU backend a bf16 forward+backward
    computes its dots in f32, and its temporaries are dominated by f32
    copies of the bf16 weights (measured: 100.7 MiB for this GPT, of which
    97 MiB are weight copies), which are not activations. The bf16 floors
    use the fp32 activation bytes (an over-estimate of bf16 activations,
    so a lenient floor).
    """
    from fsdp_jax._src._compat import saved_residuals
    b = self.args.batch_per_device
    local = {k: v[:b] for k, v in self.batch.items()}
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    p = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), mb.params)
    c = jax.jit(jax.grad(mb.loss_fn)).lower(p, local).compile()
    res = saved_residuals(mb.loss_fn, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mb.params), local)
    res_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, src in res
                    if "argument" not in src)
    return {"measured_temp": int(c.memory_analysis().temp_size_in_bytes),
            "jaxpr_residuals": int(res_bytes)}

  def floor(self, s: Setting, plan) -> dict:
    """(params + grads + optimizer state) / N + gathered units + activations."""
    p_all = sum(l.numel for l in plan.leaves)
    n = plan.n
    state_bytes = 4 * p_all + 4 * p_all + 8 * p_all    # fp32 params, grads, Adam mu+nu
    pb = 2 if s.precision == "bf16" else 4
    # A stacked unit is gathered one layer at a time.
    largest = max(plan.unit_numel(u) // (u.num_layers if u.stacked else 1) for u in plan.units)
    if s.strategy == "NO_SHARD":
      gathered, how = 0, "none (replicated)"
      if s.precision == "bf16":
        gathered, how = pb * p_all, "bf16 copy of all params"
    elif plan.config.reshard_after_forward:
      gathered, how = 2 * pb * largest, "2 x largest unit"
    else:  # SHARD_GRAD_OP keeps every gathered unit from forward to backward
      gathered, how = pb * p_all + pb * largest, "all units + 1 unit"
    act = self.bundle(s.model).act["measured_temp"]
    return {"state_over_n": state_bytes // n, "gathered": gathered, "gathered_rule": how,
            "activations": act, "total": state_bytes // n + gathered + act, "n": n}


def _mirror_param_shardings(opt_state, opt_sh, params, param_sh, mesh):
  """Optimizer-state leaves that mirror a param tree get its shardings."""
  p_def = jax.tree.structure(params)

  def fix(sub_state, sub_sh):
    try:
      if jax.tree.structure(sub_state) == p_def:
        return param_sh
    except Exception:
      pass
    return sub_sh

  if isinstance(opt_state, tuple) and not hasattr(opt_state, "_fields"):
    return tuple(_mirror_param_shardings(a, b, params, param_sh, mesh)
                 for a, b in zip(opt_state, opt_sh))
  if hasattr(opt_state, "_fields"):  # optax NamedTuple states
    vals = {f: fix(getattr(opt_state, f), getattr(opt_sh, f)) for f in opt_state._fields}
    return type(opt_sh)(**vals)
  return opt_sh


def state_bytes_per_device(tree) -> int:
  """Bytes of the stored arrays held by the first device (params + opt state)."""
  dev = jax.devices()[0]
  total = 0
  for x in jax.tree.leaves(tree):
    for sh in x.addressable_shards:
      if sh.device == dev:
        total += sh.data.nbytes
  return total


# --------------------------------------------------------------------------
# PyTorch FSDP, interleaved


class TorchVariant:
  """PyTorch FSDP ranks kept alive by ``torch_fsdp.py --serve``; each call to
  :meth:`run` runs one step (the slowest rank's time is returned)."""

  def __init__(self, s: Setting, bench: Bench, weights: str):
    a = bench.args
    cmd = [a.torch_python, os.path.join(HERE, "torch_fsdp.py"), "--serve",
           "--world", str(bench.world), "--strategy", s.strategy, "--precision", s.precision,
           "--threads", str(a.torch_threads), "--global-batch", str(bench.global_batch),
           "--seq-len", str(a.seq_len), "--d-model", str(a.d_model), "--layers", str(a.layers),
           "--heads", str(a.heads), "--vocab", str(a.vocab), "--seed", str(a.seed),
           "--weights", weights]
    if s.replicate:
      cmd += ["--replicate", str(s.replicate)]
    self.setting = s
    self.t_start = time.perf_counter()
    self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True, bufsize=1, cwd=ROOT)
    self.info: dict = {}

  def _read(self, prefix):
    while True:
      line = self.proc.stdout.readline()
      if not line:
        raise RuntimeError(f"{self.setting.name}: torch_fsdp.py exited "
                           f"(rc={self.proc.poll()}) before {prefix}")
      if line.startswith(prefix + " "):
        return json.loads(line[len(prefix) + 1:])

  def wait_ready(self):
    self.info = self._read("READY")
    self.info["ready_after_s"] = time.perf_counter() - self.t_start
    return self.info

  def step(self):
    self.proc.stdin.write("step\n")
    self.proc.stdin.flush()
    return self._read("STEP")

  def close(self):
    if self.proc.poll() is None:
      try:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.info.update(self._read("DONE"))
        self.proc.wait(timeout=120)
      except Exception as e:
        print(f"  torch shutdown: {e!r}; terminating")
        self.proc.terminate()


def torch_available(python: str = sys.executable) -> bool:
  if python == sys.executable:
    import importlib.util
    return importlib.util.find_spec("torch") is not None
  return subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0


def torch_version(python: str = sys.executable):
  """The torch version the PyTorch baseline runs with (None: not installed)."""
  if python == sys.executable:
    try:
      import importlib.metadata as md
      return md.version("torch")
    except Exception:  # pylint: disable=broad-except
      return None
  out = subprocess.run([python, "-c", "import torch; print(torch.__version__)"],
                       capture_output=True, text=True)
  return out.stdout.strip() if out.returncode == 0 else None


def save_weights(params, path):
  flat = {}
  for kp, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = ".".join(str(getattr(k, "key", k)) for k in kp)
    flat[name] = np.asarray(x)
  np.savez(path, **flat)


# --------------------------------------------------------------------------
# Measurement driver


def rotated_step_medians(steps: dict, rounds: int) -> dict:
  """Median seconds of one step per entry of ``steps`` (name ->
  ``[step, state, batch, times, ...]``, each compiled and warmed up): one
  step of each per round, the order rotated every round so that load from
  other processes hits every entry alike. Each entry's state advances and
  its ``times`` fill in place."""
  names = list(steps)
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      step, state, data, times = steps[name][:4]
      t0 = time.perf_counter()
      state, m = step(state, data)
      jax.block_until_ready(m["loss"])
      times.append(time.perf_counter() - t0)
      steps[name][1] = state
  return {n: float(np.median(steps[n][3])) for n in names}


def measure_times(variants: list, warmup: int, rounds: int, log):
  """Warm-up calls, then ``rounds`` round-robin rounds over all variants
  (rotating the order each round) so that load from other processes hits
  every variant alike; each variant's median is over its rounds."""
  failed = []

  def fail(v, e):
    log(f"  {v.setting.name} FAILED while running: {e!r}; dropped from timing")
    v.run_error = repr(e)
    failed.append(v)

  for v in variants:
    t0 = time.perf_counter()
    try:
      for i in range(warmup):
        v.run()
        if i == 0 and v.first_loss is None:
          v.first_loss = _loss(v)
    except Exception as e:  # e.g. out of memory: keep measuring the others
      fail(v, e)
      continue
    log(f"  warm-up {v.setting.name}: {warmup} step(s) in {time.perf_counter() - t0:.1f}s, "
        f"first loss {v.first_loss}")
  variants = [v for v in variants if v not in failed]
  k = len(variants)
  for r in range(rounds):
    order = variants[r % k:] + variants[:r % k]
    line = []
    for v in order:
      if v in failed:
        continue
      try:
        sample = v.run()
      except Exception as e:
        fail(v, e)
        continue
      dt = sample["time_s"]
      v.times.append(dt)
      v.samples.append(sample)
      line.append(f"{v.setting.name.split('/', 1)[-1] if v.setting.family == 'fsdp' else v.setting.name}"
                  f" {dt * 1e3:.0f}")
    log(f"  round {r + 1}/{rounds} (load {os.getloadavg()[0]:.1f}): " + ", ".join(line))
  for v in variants:
    if v not in failed:
      v.last_loss = _loss(v)


def _loss(v):
  if not hasattr(v, "box"):  # TorchRunner keeps its own losses
    return v.last_loss
  loss = v.box["loss"]
  return None if loss is None else float(loss)


class TorchRunner:
  """Adapts a TorchVariant to the Variant interface used by measure_times."""

  def __init__(self, tv: TorchVariant):
    self.tv = tv
    self.setting = tv.setting
    self.times: list = []
    self.samples: list = []
    self.first_loss = None
    self.last_loss = None
    self.info = tv.info

  def run(self):
    d = self.tv.step()
    if self.first_loss is None:
      self.first_loss = d["loss"]
    self.last_loss = d["loss"]
    return d


def state_scaling(bench: Bench, ns, log) -> list:
  s = Setting("fsdp/FULL_SHARD/fp32", "fsdp", "FULL_SHARD", "fp32")
  out = []
  for n in ns:
    if n > len(jax.devices()):
      continue
    t0 = time.perf_counter()
    state, mesh, _ = bench.fsdp_state(s, n)
    jax.block_until_ready(state)
    b = state_bytes_per_device((state.params, state.opt_state))
    out.append({"n": n, "bytes_per_device": b,
                "params_bytes_per_device": state_bytes_per_device(state.params),
                "opt_bytes_per_device": state_bytes_per_device(state.opt_state)})
    log(f"  state N={n}: {b / MiB:.2f} MiB per device ({time.perf_counter() - t0:.1f}s)")
    del state
  return out


# --------------------------------------------------------------------------
# Command line and set-up, shared by every measurement


def parse_args(argv=None, description: str = "fsdp_jax benchmark"):
  """The options every measurement takes (settings, model size, rounds)."""
  p = argparse.ArgumentParser(description=description,
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--quick", action="store_true",
                 help="2 timed rounds, 1 warm-up, state scaling at N in (1, 8)")
  p.add_argument("--only", default=None,
                 help="comma-separated glob patterns over setting names (see --list)")
  p.add_argument("--all", action="store_true", help="also the non-default settings")
  p.add_argument("--list", action="store_true", help="print the settings and exit")
  p.add_argument("--rounds", "--steps", dest="rounds", type=int, default=None,
                 help="timed round-robin rounds (steps per variant); default 5, --quick 2")
  p.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (default 1)")
  p.add_argument("--no-torch", action="store_true", help="skip the PyTorch FSDP baseline")
  p.add_argument("--torch-python", default=sys.executable, metavar="PYTHON",
                 help="the Python that runs the PyTorch FSDP ranks (default: this one); "
                      "e.g. a Python 3.11 with torch when JAX runs in a 3.13 venv")
  p.add_argument("--torch-threads", type=int, default=1,
                 help="intra-op threads per PyTorch process")
  p.add_argument("--no-state-scaling", action="store_true")
  p.add_argument("--xla-flags", default=None, metavar="FLAGS",
                 help="ablation: run every variant with exactly these XLA_FLAGS instead of "
                      "fsdp_jax.custom.CPU_XLA_FLAGS ('' = XLA's defaults)")
  p.add_argument("--no-cpu-flags", dest="xla_flags", action="store_const", const="",
                 help="same as --xla-flags ''")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--batch-per-device", type=int, default=1)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--d-model", type=int, default=512)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--vocab", type=int, default=256)
  p.add_argument("--lr", type=float, default=1e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dump-dir", default=None,
                 help="keep each setting's XLA text dumps (optimized HLO, buffer "
                      "assignment, live ranges) here")
  p.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
  p.add_argument("--json", default=os.path.join(HERE, "results.json"))
  p.add_argument("--render", default=None, metavar="RESULTS_JSON",
                 help="only re-render --out from an existing results.json")
  p.add_argument("--no-analysis", dest="analysis", action="store_false",
                 help="do not append benchmarks/ANALYSIS.md to the report")
  a = p.parse_args(argv)
  if a.rounds is None:
    a.rounds = 2 if a.quick else 5
  if a.warmup is None:
    a.warmup = 1
  return a


def start(args):
  """Sets up the devices (before anything starts a JAX backend) and returns a
  ``log(msg)`` that prefixes the seconds since the start."""
  t_start = time.perf_counter()
  if args.xla_flags is not None:
    # Ablation: exactly these XLA flags (e.g. "" for XLA's default CPU
    # pipeline; fsdp_jax then warns that memory is not what it should be).
    os.environ["XLA_FLAGS"] = args.xla_flags
    jax.config.update("jax_num_cpu_devices", args.devices)
  else:
    fsdp_jax.simulate_cpu_devices(args.devices)
  jax.config.update("jax_platforms", "cpu")

  def log(msg):
    print(f"[{time.perf_counter() - t_start:6.0f}s] {msg}", flush=True)

  return log


def build_variants(bench: "Bench", settings: list, log) -> list:
  """Compiles every fsdp_jax and jit setting (PyTorch runs elsewhere); memory,
  collectives and compile time are read here, a failure is recorded."""
  variants = []
  for s in settings:
    if s.family == "torch":
      continue
    log(f"building {s.name}")
    try:
      v = bench.build_fsdp(s) if s.family == "fsdp" else bench.build_jit(s)
    except Exception as e:  # keep going: report the failure
      log(f"  FAILED: {e!r}")
      variants.append(Variant(s, None, {"error": repr(e)}))
      continue
    mem = v.info["memory"]
    summ = {k: (x["ops"], round(x["payload"] / MiB, 2)) for k, x in v.info["collectives"].items()}
    log(f"  compile {v.info['compile_s']:.1f}s; total {mem['total'] / MiB:.1f} MiB/device "
        f"(temp {mem['temp'] / MiB:.1f}); collectives (ops, payload MiB) {summ}")
    variants.append(v)
  return variants
