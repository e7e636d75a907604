#!/usr/bin/env python
"""fsdp_jax benchmark: memory, collectives and step time, in one command.

    python benchmarks/run.py                 # everything (~10 min on 2 cores)
    python benchmarks/run.py --quick         # fewer timed rounds, N in (1, 8)
    python benchmarks/run.py --only 'fsdp/FULL_SHARD/*,jax_native/*' --rounds 3
    python benchmarks/run.py --list          # the settings and what they are

For each setting (a sharding strategy x precision of fsdp_jax, or a baseline)
on 8 simulated CPU devices it measures

* bytes per device from ``compiled.memory_analysis()`` against the analytic
  floor, and what is live at the compiled program's memory peak (from XLA's
  live-range dump);
* collectives per step read from the compiled HLO (``fsdp_jax.hlo``) against
  the theoretical volume;
* step time, as ratios to the baselines measured round-robin in the same run
  (JAX-native FSDP under ``jax.jit`` with NamedSharding, replicated data
  parallel, PyTorch FSDP with gloo in 8 processes);
* bytes per device of the stored state at N = 1, 2, 4, 8;

and writes ``benchmarks/RESULTS.md`` and ``benchmarks/results.json``. See
``benchmarks/README.md`` for the method and the definitions.

Adding a setting is one line in :data:`SETTINGS`, e.g.
``Setting("fsdp/FULL_SHARD/fp32/fwd_prefetch", "fsdp", "FULL_SHARD", "fp32",
fsdp_kwargs={"forward_prefetch": True})``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import fnmatch
import glob
import json
import os
import platform
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

# Importing jax / fsdp_jax does not start a backend; simulate_cpu_devices()
# runs first thing in main(), before anything does.
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import fsdp_jax  # noqa: E402
from fsdp_jax import hlo  # noqa: E402
from benchmarks.common import GPTConfig, make_batch  # noqa: E402

MiB = 2 ** 20


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
# Reading compiled programs


def memory_stats(compiled) -> dict:
  ma = compiled.memory_analysis()
  d = {k: int(getattr(ma, k + "_size_in_bytes")) for k in
       ("argument", "output", "alias", "temp")}
  # Peak bytes live on a device: inputs + temporaries + outputs that do not
  # reuse (alias) a donated input buffer.
  d["total"] = d["argument"] + d["temp"] + d["output"] - d["alias"]
  return d


def _group_size(c: hlo.Collective, default: int) -> int:
  groups = c.groups  # every format XLA prints (explicit, iota, mesh axes)
  return len(groups[0]) if groups else default


_COMP_HEADER = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s")
_CALLEES = re.compile(
    r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCH_LIST = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP = re.compile(r'known_trip_count[^0-9]*(\d+)')


def execution_counts(hlo_text: str) -> tuple[dict, bool]:
  """How many times each HLO computation runs per step: a ``while`` body
  runs its ``known_trip_count`` times (``fsdp_jax.hlo.summarize`` counts a
  collective in a loop body once). Returns (counts, all trip counts known)."""
  edges: dict = {}
  entry = None
  comp = None
  known = True
  for line in hlo_text.splitlines():
    if line.rstrip().endswith("{") and " = " not in line:
      m = _COMP_HEADER.match(line)
      if m:
        comp = m.group(1)
        if line.lstrip().startswith("ENTRY"):
          entry = comp
      continue
    if comp is None or " = " not in line:
      continue
    callees = _CALLEES.findall(line)
    for group in _BRANCH_LIST.findall(line):
      callees += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
    if not callees:
      continue
    mult = 1
    if re.search(r"\swhile\(", line):
      t = _TRIP.search(line)
      if t:
        mult = int(t.group(1))
      else:
        known = False
    body = re.search(r"\bbody=%?([\w.\-]+)", line)
    for c in callees:
      m_c = mult if (body and c == body.group(1)) else 1
      edges.setdefault(comp, []).append((c, m_c))
  counts: dict = {}

  def visit(c, k, depth=0):
    counts[c] = counts.get(c, 0) + k
    if depth < 50:
      for callee, m_c in edges.get(c, ()):
        visit(callee, k * m_c, depth + 1)

  if entry is not None:
    visit(entry, 1)
  return counts, known


def collective_stats(hlo_text: str, world: int) -> dict:
  """Per kind: ops, operands, and three byte counts per device per step.

  * ``buffer``: the HLO result buffer (what ``fsdp_jax.hlo.summarize``
    reports: the gathered output of an all-gather, the scattered shard of a
    reduce-scatter);
  * ``payload``: the full-size data the collective is about: all-gather
    output, reduce-scatter *input* (output x group size), all-reduce buffer;
    this is the unit the theory ("FULL_SHARD = 3 x params") is stated in;
  * ``wire``: bytes each device receives with ring algorithms:
    all-gather and reduce-scatter payload x (g-1)/g, all-reduce
    2 x payload x (g-1)/g.

  Scalar all-reduces (the loss ``pmean``) are counted apart under
  ``metrics``. A collective inside a ``while`` body (a ``scan`` over stacked
  layers) counts once per iteration: ``ops`` are HLO instructions,
  ``executions`` how many times they run per step, bytes are per step.
  """
  out: dict = {}
  counts, known = execution_counts(hlo_text)
  for c in hlo.collectives(hlo_text):
    g = _group_size(c, world)
    runs = counts.get(c.computation, 1)
    for shape, dtype in zip(c.shapes, c.dtypes):
      nbytes = runs * int(np.prod(shape, dtype=np.int64)) * hlo._DTYPE_BYTES[dtype]
      kind = c.kind
      if kind == "all-reduce" and len(shape) == 0:
        kind = "metrics"
      if kind == "reduce-scatter":
        payload = nbytes * g
      else:
        payload = nbytes
      if kind in ("all-gather", "reduce-scatter"):
        wire = payload * (g - 1) / g
      elif kind in ("all-reduce", "metrics"):
        wire = 2 * payload * (g - 1) / g
      else:  # collective-permute, all-to-all: the buffer moves once
        wire = payload * (g - 1) / g
      d = out.setdefault(kind, {"ops": set(), "operands": 0, "buffer": 0, "payload": 0,
                                "wire": 0.0, "dtypes": set(), "groups": set(),
                                "executions": 0, "in_loops": 0})
      if c.name not in d["ops"]:
        d["executions"] += runs
        d["in_loops"] += runs > 1
      d["ops"].add(c.name)
      d["operands"] += 1
      d["buffer"] += nbytes
      d["payload"] += payload
      d["wire"] += wire
      d["dtypes"].add(dtype)
      d["groups"].add(g)
  for d in out.values():
    d["ops"] = len(d["ops"])
    d["trip_counts_known"] = known
    d["dtypes"] = sorted(d["dtypes"])
    d["groups"] = sorted(d["groups"])
    d["wire"] = int(round(d["wire"]))
  return out


_PEAK_LINE = re.compile(r"^\s+([\w.\-]+)\{[\d,]*\}: (\d+) bytes")
_INSTR_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (\S+?)(?:\{[^}]*\})? ([\w\-]+)\(")


def schedule_stats(hlo_text: str) -> dict:
  """Most units whose gathered parameters are live at once (entry computation,
  execution order), in the forward and the backward pass, and the order of
  the first backward collectives."""
  order = hlo.collective_order(hlo_text)
  live = hlo.live_gathered_units(hlo_text)
  instrs = hlo.entry_instructions(hlo_text)
  seen, start = set(), len(instrs)
  for k, ins in enumerate(instrs):
    m = hlo._UNIT_GATHER.search(ins.op_name)  # pylint: disable=protected-access
    if ins.opcode == "all-gather" and m:
      if m.group(1) in seen:
        start = k
        break
      seen.add(m.group(1))
  back = [f"{'AG' if k == 'all-gather' else 'RS'} {u}" for k, u in order]
  first_back = next((i for i, (k, u) in enumerate(order)
                     if k == "all-gather" and (k, u) in order[:i]), len(order))
  return {"max_live_units_forward": max((len(x) for x in live[:start]), default=0),
          "max_live_units_backward": max((len(x) for x in live[start:]), default=0),
          "backward_order": back[first_back:first_back + 6]}


def peak_breakdown(dump_dir: str) -> Optional[dict]:
  """What is live at the memory peak, from XLA's ``*-live-range.txt``.

  Buffers are grouped as: ``arguments`` (entry parameters: the state and the
  batch), ``gathered`` (all-gather outputs, i.e. unsharded units),
  ``reduce-scatter``/``all-reduce`` results, and ``other`` (activations saved
  for backward, unsharded gradients, optimizer temporaries, ...).
  """
  files = glob.glob(os.path.join(dump_dir, "*cpu_after_optimizations-live-range.txt"))
  hlos = glob.glob(os.path.join(dump_dir, "*cpu_after_optimizations.txt"))
  if not files or not hlos:
    return None
  lr = max(files, key=os.path.getsize)
  text = open(lr).read()
  m = re.search(r"HloLiveRange \(max (\d+)\)", text)
  total_steps = int(m.group(1)) if m else None
  m = re.search(r"Live ranges at (\d+) \(peak\):\n((?:\s+\S+: \d+ bytes.*\n)+)", text)
  if not m:
    return None
  peak_at = int(m.group(1))
  opcode, opname = {}, {}
  for line in open(max(hlos, key=os.path.getsize)):
    im = _INSTR_LINE.match(line)
    if im:
      opcode[im.group(1)] = im.group(3)
      om = re.search(r'op_name="([^"]*)"', line)
      opname[im.group(1)] = om.group(1) if om else ""
  groups: dict = {}
  gathered_units = []
  for line in m.group(2).splitlines():
    pm = _PEAK_LINE.match(line)
    if not pm:
      continue
    name, nbytes = pm.group(1), int(pm.group(2))
    op = opcode.get(name, "")
    if op == "parameter" or name.startswith("param"):
      cat = "arguments"
    elif "fsdp_reduce_scatter[" in opname.get(name, ""):
      # a unit's packed gradient (the reduce-scatter input) and its result
      cat = "reduce-scatter"
    elif (op in ("all-gather", "all-gather-start", "all-gather-done")
          or name.startswith("all_gather")
          or ("fsdp_all_gather[" in opname.get(name, "") and "transpose(" not in opname.get(name, ""))):
      # an all-gather output, or a copy/convert/slice of one (bf16 gathers
      # travel as u16 and are converted; unpacked leaves)
      cat = "gathered"
      um = re.search(r"fsdp_all_gather\[([^\]]*)\]", opname.get(name, ""))
      gathered_units.append(um.group(1) if um else name)
    elif op.startswith("reduce-scatter") or name.startswith("reduce_scatter"):
      cat = "reduce-scatter"
    elif op.startswith("all-reduce") or name.startswith("all_reduce"):
      cat = "all-reduce"
    else:
      cat = "other"
    d = groups.setdefault(cat, {"bytes": 0, "buffers": 0})
    d["bytes"] += nbytes
    d["buffers"] += 1
  return {"peak_at": peak_at, "program_length": total_steps,
          "peak_bytes": sum(d["bytes"] for d in groups.values()),
          "by_kind": groups, "gathered_units": gathered_units}


def compile_with_dump(lowered, keep_dir: Optional[str], tag: str):
  """Compiles, asking XLA to dump the optimized module's buffer live ranges."""
  d = tempfile.mkdtemp(prefix="fsdp_bench_dump_")
  opts = {"xla_dump_to": d, "xla_dump_hlo_as_text": True}
  t0 = time.perf_counter()
  try:
    compiled = lowered.compile(compiler_options=opts)
  except Exception as e:  # compiler_options unsupported: compile plainly
    print(f"  (no XLA dump: {e!r})")
    compiled = lowered.compile()
  dt = time.perf_counter() - t0
  peak = peak_breakdown(d)
  if keep_dir:
    dest = os.path.join(keep_dir, tag.replace("/", "_"))
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(dest)
    for f in glob.glob(os.path.join(d, "*")):
      if f.endswith(".txt"):
        shutil.copy(f, dest)
  shutil.rmtree(d, ignore_errors=True)
  return compiled, dt, peak


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
# Report


def _mb(x):
  return "-" if x is None else f"{x / MiB:.2f}"


def _ratio(a, b):
  if a is None or b is None or b == 0:
    return None
  return a / b


def _fmt_ratio(r, digits=2):
  return "-" if r is None else f"{r:.{digits}f}"


def summarize_times(v) -> dict:
  t = sorted(v.times)
  if not t:
    return {}
  q = lambda f: t[min(len(t) - 1, max(0, int(round(f * (len(t) - 1)))))]
  out = {"median_s": statistics.median(t), "min_s": t[0], "max_s": t[-1],
         "p25_s": q(0.25), "p75_s": q(0.75), "n": len(t), "all_s": v.times}
  samples = getattr(v, "samples", [])
  for key in ("cpu_s", "sys_s", "minflt"):
    vals = [x[key] for x in samples if x.get(key) is not None]
    if len(vals) == len(v.times) and vals:
      out["all_" + key] = vals
      out["median_" + key] = statistics.median(vals)
  return out


def write_report(results: dict, path_md: str, path_json: str):
  with open(path_json, "w") as f:
    json.dump(results, f, indent=1, default=_json_default)
  md = render_markdown(results)
  analysis = os.path.join(HERE, "ANALYSIS.md")
  if os.path.exists(analysis) and results["args"].get("analysis", True):
    md += "\n" + open(analysis).read()
  with open(path_md, "w") as f:
    f.write(md)


def _json_default(o):
  if isinstance(o, (np.integer,)):
    return int(o)
  if isinstance(o, (np.floating,)):
    return float(o)
  if isinstance(o, set):
    return sorted(o)
  return str(o)


def render_markdown(R: dict) -> str:
  m = R["machine"]
  a = R["args"]
  L = []
  w = L.append
  w("# fsdp_jax benchmark results\n")
  w(f"Generated by `{R['command']}` on {m['date']} in {R['runtime_s'] / 60:.1f} min "
    "(wall clock, everything included). Numbers below are from this one run; "
    "`results.json` has every raw number.\n")
  w("## Machine and setup\n")
  w("| | |\n|---|---|")
  w(f"| CPU | {m['cpu']} (ISA: {', '.join(m.get('cpu_isa') or []) or '?'}) |")
  w(f"| cores | {m['cores']} ({m['cores_usable']} usable) |")
  w(f"| RAM | {m['ram_bytes'] / 2**30:.1f} GiB |" if m["ram_bytes"] else "| RAM | ? |")
  w(f"| load average (1 min) at start / end | {m['loadavg_start'][0]:.1f} / "
    f"{R['loadavg_end'][0]:.1f} (the machine is shared: timings are noisy, hence ratios "
    "measured round-robin) |")
  w(f"| python / jax / jaxlib / flax / optax / torch | {m['python']} / {m['jax']} / "
    f"{m['jaxlib']} / {m['flax']} / {m['optax']} / {m['torch'] or 'not installed'} |")
  w(f"| XLA_FLAGS (all JAX variants, process-wide) | `{m['XLA_FLAGS']}` |")
  w(f"| devices | {R['devices']} simulated CPU devices (`fsdp_jax.simulate_cpu_devices({R['devices']})`) |")
  mc = R["model"]
  w(f"| model | GPT (benchmarks/models.py): d_model {mc['d_model']}, {mc['layers']} layers, "
    f"{mc['heads']} heads, vocab {mc['vocab']}, context {mc['seq_len']}: "
    f"**{mc['num_params']:,} parameters** ({mc['num_params'] * 4 / MiB:.1f} MiB fp32) |")
  w(f"| FSDP units | `ModuleWrapPolicy({{Block}})`: {mc['layers']} block units of "
    f"{mc['block_params']:,} params + root unit (embeddings, ln_f, lm_head) of "
    f"{mc['root_params']:,}; flat parameters (`use_orig_params=False`) |")
  w(f"| batch | global {R['global_batch']} sequences x {mc['seq_len']} tokens "
    f"({a['batch_per_device']} sequence per device) |")
  w(f"| optimizer | optax.adam({a['lr']}) (torch.optim.Adam for PyTorch) |")
  w(f"| timing | {a['warmup']} warm-up step(s) per variant, then {a['rounds']} round-robin "
    "rounds over all variants (order rotated each round); median per variant |")
  torch_py = a.get("torch_python")
  if not R["machine"].get("torch"):
    torch_py = "; not run: torch is not installed"
  elif not torch_py or torch_py == a.get("_python_executable"):
    torch_py = ""
  else:
    torch_py = f"; run by `{torch_py}`"
  w(f"| PyTorch | {a['torch_threads']} intra-op thread(s) per process, "
    f"{R['devices']} processes, gloo{torch_py} |")
  w("")

  F = R["settings"]
  fs = [n for n in F if F[n]["family"] == "fsdp" and "memory" in F[n]]
  bases = [n for n in F if F[n]["family"] in ("jax_native", "dp") and "memory" in F[n]]
  failed = [n for n in F if F[n].get("error")]

  if failed:
    w("## Failed settings\n")
    for n in failed:
      w(f"- {n}: `{F[n]['error']}`")
    w("")

  # ---- targets summary ----
  w("## Targets\n")
  w("| target | measured | met? |\n|---|---|---|")
  for t in R["targets"]:
    w(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else '**no**'} |")
  w("")

  # ---- memory ----
  w("## Bytes per device (compiled step, `memory_analysis()`)\n")
  w("total = argument + temp + output - alias (outputs that reuse donated inputs are not "
    "counted twice). Floor = (params + grads + Adam state) / N + gathered units + "
    "activations; see the definitions below. MiB = 2^20 bytes.\n")
  w("| setting | argument | temp | output - alias | **total** | floor | total / floor | "
    "state/N | gathered (rule) | activations |")
  w("|---|---|---|---|---|---|---|---|---|---|")
  for n in fs + bases:
    d = F[n]
    if "memory" not in d:
      w(f"| {n} | failed: {d.get('error', '?')} |")
      continue
    mem = d["memory"]
    fl = d.get("floor")
    w(f"| {n} | {_mb(mem['argument'])} | {_mb(mem['temp'])} | "
      f"{_mb(mem['output'] - mem['alias'])} | **{_mb(mem['total'])}** | "
      f"{_mb(fl['total']) if fl else '-'} | "
      f"{_fmt_ratio(_ratio(mem['total'], fl['total'])) if fl else '-'} | "
      f"{_mb(fl['state_over_n']) if fl else '-'} | "
      f"{(_mb(fl['gathered']) + ' (' + fl['gathered_rule'] + ')') if fl else '-'} | "
      f"{_mb(fl['activations']) if fl else '-'} |")
  w("")
  acts = R["activations"]
  w("Activations (one device's batch: the unsharded model's forward+backward compiled on one "
    "device in fp32, temp bytes): " + ", ".join(
        f"{k} {_mb(v['measured_temp'])} MiB (jaxpr-level saved residuals, an upper bound "
        f"before XLA fusion: {_mb(v['jaxpr_residuals'])} MiB)" for k, v in acts.items())
    + ". bf16 floors use the fp32 number (see Definitions).\n")
  w("### What is live at the memory peak (XLA live-range dump of the compiled step)\n")
  w("Buffers live at the peak, grouped: *gathered* = all-gather outputs and the unpacked "
    "parameter buffers made from them (copies, converts, slices inside the gather's scope); "
    "*arguments* = the state and batch; *other* = activations, gradients, optimizer "
    "temporaries. Peak position = instruction index in the compiled schedule.\n")
  w("| setting | peak at instr. | gathered buffers live | gathered MiB | arguments MiB | "
    "other temps MiB (activations, grads, ...) |")
  w("|---|---|---|---|---|---|")
  for n in fs + bases:
    pk = F[n].get("peak")
    if not pk:
      w(f"| {n} | - | - | - | - | - |")
      continue
    bk = pk["by_kind"]
    g = bk.get("gathered", {"bytes": 0, "buffers": 0})
    other = sum(v["bytes"] for k, v in bk.items() if k not in ("gathered", "arguments"))
    w(f"| {n} | {pk['peak_at']} / {pk['program_length']} | {g['buffers']} | "
      f"{_mb(g['bytes'])} | {_mb(bk.get('arguments', {'bytes': 0})['bytes'])} | {_mb(other)} |")
  w("")

  # ---- prefetch ----
  pf = [n for n in fs if n.startswith("fsdp/FULL_SHARD/fp32") and "/scan" not in n]
  if len(pf) > 1:
    w("## Prefetch and rate limiting (FULL_SHARD fp32)\n")
    w("Units live = the most units whose gathered parameters are live at one instruction "
      "of the compiled schedule (`fsdp_jax.hlo.live_gathered_units`; the root unit, kept "
      "gathered from forward to backward as in PyTorch, counts as one). First backward "
      "collectives = the order of the first all-gathers (AG) and reduce-scatters (RS) of "
      "the backward pass. Time ratio = step time / default setting's, same run.\n")
    w("| setting | temp MiB | total / floor | units live fwd / bwd | "
      "first backward collectives | time vs default |")
    w("|---|---|---|---|---|---|")
    base_t = F["fsdp/FULL_SHARD/fp32"].get("time", {}).get("median_s") \
        if "fsdp/FULL_SHARD/fp32" in F else None
    for n in pf:
      d = F[n]
      sc = d.get("schedule") or {}
      fl = d.get("floor")
      t = d.get("time", {}).get("median_s")
      w(f"| {n}{' (' + d['note'] + ')' if d.get('note') else ' (defaults)'} | "
        f"{_mb(d['memory']['temp'])} | "
        f"{_fmt_ratio(_ratio(d['memory']['total'], fl['total'])) if fl else '-'} | "
        f"{sc.get('max_live_units_forward', '-')} / {sc.get('max_live_units_backward', '-')} | "
        f"{', '.join(sc.get('backward_order', [])) or '-'} | "
        f"{_fmt_ratio(_ratio(t, base_t)) if t and base_t else '-'} |")
    w("")

  # ---- collectives ----
  w("## Collectives per step (compiled HLO, `fsdp_jax.hlo.collectives`)\n")
  w("Bytes per device per step. **payload** = the full-size data of each collective: "
    "all-gather output, reduce-scatter input (= HLO output x group size), all-reduce "
    "buffer; the theory (FULL_SHARD: 2 x params gathered minus the root unit that is "
    "not re-gathered, 1 x params reduce-scattered) is stated in it. **wire** = bytes a "
    "device receives with ring algorithms (payload x (g-1)/g; all-reduce 2x). The "
    "scalar loss `pmean` is listed apart (`metrics`). MiB = 2^20 bytes.\n")
  w("| setting | all-gather ops / MiB | reduce-scatter ops / MiB | all-reduce ops / MiB | "
    "other | payload MiB | theory MiB | payload / theory | wire MiB | wire theory MiB | "
    "ops (expected) |")
  w("|---|---|---|---|---|---|---|---|---|---|---|")
  for n in fs + bases:
    d = F[n]
    c = d["collectives"]
    th = d.get("theory")

    def cell(k):
      x = c.get(k)
      if not x:
        return "-"
      runs = x.get("executions", x["ops"])
      runs_s = "" if runs == x["ops"] else f" (x{runs} runs)"
      return f"{x['ops']}{runs_s} / {x['payload'] / MiB:.2f}"

    other = ", ".join(f"{k} {v['ops']} ({v['payload']} B)" for k, v in c.items()
                      if k not in ("all-gather", "reduce-scatter", "all-reduce"))
    payload = sum(v["payload"] for k, v in c.items() if k != "metrics")
    wire = sum(v["wire"] for k, v in c.items() if k != "metrics")
    if th:
      tp = sum(th["payload"].values())
      tw = sum(th["wire"].values())
      exp = d["plan_collectives"]
      exp_s = " ".join(f"{k.split('-')[0][:1].upper()}{k.split('-')[1][:1].upper()}"
                       f"{c.get(k, {}).get('ops', 0)}({v})" for k, v in exp.items() if v)
    else:
      tp = tw = None
      exp_s = "-"
    w(f"| {n} | {cell('all-gather')} | {cell('reduce-scatter')} | {cell('all-reduce')} | "
      f"{other or '-'} | {payload / MiB:.2f} | {_mb(tp) if tp else '-'} | "
      f"{_fmt_ratio(_ratio(payload, tp), 4) if tp else '-'} | {wire / MiB:.2f} | "
      f"{_mb(tw) if tw else '-'} | {exp_s} |")
  w("")
  w("ops (expected): measured op count per kind with the count `state.plan."
    "collectives_per_step()` implies in parentheses (AG all-gather, RS reduce-scatter, "
    "AR all-reduce). Per-kind theory (payload MiB):\n")
  w("| setting | all-gather theory / measured | reduce-scatter theory / measured | "
    "all-reduce theory / measured | gather dtype in HLO |")
  w("|---|---|---|---|---|")
  for n in fs:
    d = F[n]
    c = d["collectives"]
    th = d["theory"]["payload"]
    cells = []
    for k in ("all-gather", "reduce-scatter", "all-reduce"):
      cells.append(f"{_mb(th[k])} / {_mb(c.get(k, {}).get('payload', 0))}")
    w(f"| {n} | {' | '.join(cells)} | {', '.join(c.get('all-gather', {}).get('dtypes', [])) or '-'} |")
  w("")

  # ---- step time ----
  w("## Step time (median of the round-robin rounds, same run)\n")
  w("Each ratio is the median over rounds of (this step / the baseline's step in the same "
    "round), so the load of each round cancels; results.json also has the ratios of the "
    "medians. "
    "Ratios < 1 mean fsdp_jax is faster. `vs jax_native`, `vs jax_native_bs` (JAX-native "
    "with activations constrained batch-sharded, i.e. forced into FSDP) and `vs dp` compare "
    "with the baseline of the same precision (dp: fp32 when dp/bf16 was not run); `vs torch` "
    f"with PyTorch FSDP FULL_SHARD fp32 at world {R['devices']} (or the same "
    "strategy/precision when that torch setting was run).\n")
  w("| setting | median ms | p25-p75 ms | first-step loss | vs jax_native | "
    "vs jax_native_bs | vs dp | vs torch | CPU s/step | CPU vs jax_native | CPU vs torch | "
    "page faults/step (MiB) |")
  w("|---|---|---|---|---|---|---|---|---|---|---|---|")
  for n in F:
    d = F[n]
    t = d.get("time", {})
    if not t:
      continue
    r = d.get("ratios", {})
    loss = d.get("first_loss")
    mf = t.get("median_minflt")
    faults = "-" if mf is None else f"{mf * 4096 / MiB:.0f}"
    w(f"| {n} | {t['median_s'] * 1e3:.0f} | {t['p25_s'] * 1e3:.0f}-{t['p75_s'] * 1e3:.0f} | "
      f"{'-' if loss is None else f'{loss:.5f}'} | {_fmt_ratio(r.get('jax_native'))} | "
      f"{_fmt_ratio(r.get('jax_native_bs'))} | "
      f"{_fmt_ratio(r.get('dp'))} | {_fmt_ratio(r.get('torch'))} | "
      f"{_fmt_ratio(t.get('median_cpu_s'))} | {_fmt_ratio(r.get('cpu', {}).get('jax_native'))} | "
      f"{_fmt_ratio(r.get('cpu', {}).get('torch'))} | "
      f"{faults} |")
  w("")
  tinfo = [n for n in F if F[n]["family"] == "torch"]
  for n in tinfo:
    ti = F[n].get("torch_info", {})
    w(f"{n}: setup (spawn, import, FSDP wrap) {ti.get('setup_s', 0):.0f}s; "
      f"max RSS per process {max(ti.get('max_rss_bytes_per_process') or [0]) / MiB:.0f} MiB; "
      f"{ti.get('num_params', '?'):,} parameters, loaded from the same weights as the JAX runs.\n")

  # ---- state scaling ----
  if R.get("state_scaling"):
    w("## Stored state per device vs N (FULL_SHARD fp32, params + Adam state)\n")
    w("From the initialised state's arrays (`addressable_shards` on device 0).\n")
    w("| N | params MiB | optimizer MiB | total MiB | N=1 / this | ideal (N) |")
    w("|---|---|---|---|---|---|")
    base = R["state_scaling"][0]["bytes_per_device"]
    for row in R["state_scaling"]:
      w(f"| {row['n']} | {_mb(row['params_bytes_per_device'])} | "
        f"{_mb(row['opt_bytes_per_device'])} | {_mb(row['bytes_per_device'])} | "
        f"{base / row['bytes_per_device']:.3f} | {row['n']} |")
    w("")

  # ---- compile times ----
  w("## Compile times\n")
  w("| setting | lower s | compile s |\n|---|---|---|")
  for n in fs + bases:
    d = F[n]
    w(f"| {n} | {d['lower_s']:.1f} | {d['compile_s']:.1f} |")
  w("")

  w("## Definitions\n")
  w("- **Floor** = (params + grads + Adam mu/nu, all fp32: 16 bytes/param) / N + gathered "
    "units + activations. Gathered units: FULL_SHARD / HYBRID_SHARD: 2 x the largest unit "
    "in param_dtype (the unit in use plus one more: its unsharded gradient or the next "
    "prefetched unit); SHARD_GRAD_OP: every unit stays gathered from forward to backward "
    "(all params in param_dtype) + 1 unit; NO_SHARD: nothing (N = 1; bf16 adds the bf16 "
    "copy of the params). N = shard-group size (8; 4 for HYBRID 2x4; 1 for NO_SHARD). "
    "Activations = temp bytes of the unsharded model's `jax.grad` for one device's batch "
    "compiled on one device (its gradients are outputs, so not counted).")
  w("- **Stored state** counts params + optimizer state only; the floor's grads are "
    "transient inside the step.")
  w("- Baselines (`jax_native`, `dp`) have no floor; their bytes are shown for comparison.")
  w("")
  return "\n".join(L)


def evaluate_targets(R: dict) -> list:
  F = R["settings"]
  out = []

  def add(target, measured, met):
    out.append({"target": target, "measured": measured, "met": bool(met)})

  for prec in ("fp32", "bf16"):
    n = f"fsdp/FULL_SHARD/{prec}"
    if n in F and "memory" in F[n]:
      d = F[n]
      r = d["memory"]["total"] / d["floor"]["total"]
      add(f"{n} bytes/device <= 1.05 x floor",
          f"{r:.2f} x ({_mb(d['memory']['total'])} vs {_mb(d['floor']['total'])} MiB)", r <= 1.05)
  worst = None
  extra = []
  for n, d in F.items():
    if d["family"] != "fsdp" or "collectives" not in d:
      continue
    c = d["collectives"]
    tp = sum(d["theory"]["payload"].values())
    mp = sum(v["payload"] for k, v in c.items() if k != "metrics")
    dev = abs(mp / tp - 1) if tp else (0 if mp == 0 else 1)
    if worst is None or dev > worst[1]:
      worst = (n, dev)
    exp = d["plan_collectives"]
    for k, v in c.items():
      if k == "metrics":
        continue
      if k not in exp or v["ops"] > exp[k]:
        extra.append(f"{n}: {k} {v['ops']} > {exp.get(k, 0)}")
  if worst:
    add("collective bytes = theory within 1% (all fsdp settings)",
        f"worst {worst[0]}: {worst[1] * 100:.3f}% off", worst[1] <= 0.01)
    add("no extra collectives (ops <= plan, besides the scalar loss pmean)",
        "none" if not extra else "; ".join(extra), not extra)
  sc = R.get("state_scaling") or []
  by_n = {r["n"]: r["bytes_per_device"] for r in sc}
  if 1 in by_n and 8 in by_n:
    ratio = by_n[1] / by_n[8]
    add("stored state at N=8 <= 1/7.5 of N=1", f"N=1 / N=8 = {ratio:.3f}", ratio >= 7.5)
  for prec in ("fp32", "bf16"):
    n = f"fsdp/FULL_SHARD/{prec}"
    if n in F and "ratios" in F[n]:
      r = F[n]["ratios"]
      cpu = r.get("cpu", {})

      def cpu_note(k):
        return "" if cpu.get(k) is None else f" (CPU time: {cpu[k]:.2f} x)"

      if r.get("jax_native") is not None:
        add(f"{n} step time <= 0.85 x jax_native/{prec}",
            f"{r['jax_native']:.2f} x{cpu_note('jax_native')}", r["jax_native"] <= 0.85)
      if r.get("torch") is not None:
        add(f"{n} step time <= 0.4 x PyTorch FSDP ({F[n]['ratios'].get('torch_ref')})",
            f"{r['torch']:.2f} x{cpu_note('torch')}", r["torch"] <= 0.4)
  return out


# --------------------------------------------------------------------------
# Main


def compute_ratios(R: dict) -> None:
  """Adds each timed setting's step-time ratios to its baselines."""
  F = R["settings"]

  def med(name):
    return F.get(name, {}).get("time", {}).get("median_s")

  def paired(name, base, key="all_s"):
    """Median over rounds of (this variant's time / the baseline's time in
    the same round): the load of a round cancels out of each ratio."""
    a = F.get(name, {}).get("time", {}).get(key) or []
    b = F.get(base, {}).get("time", {}).get(key) or []
    rs = [x / y for x, y in zip(a, b) if y]
    return statistics.median(rs) if rs else None

  def ratios(name, d):
    suffix = "/scan" if d["model"] == "gpt_scan" else ""
    prec = d["precision"]
    bases = {"jax_native": f"jax_native/{prec}{suffix}",
             "jax_native_bs": f"jax_native_bs/{prec}{suffix}",
             "dp": f"dp/{prec}{suffix}" if med(f"dp/{prec}{suffix}") else
                   ("dp/fp32" if not suffix else None)}
    if d["family"] == "fsdp":
      same = f"torch/{name.split('/')[1]}/{prec}"
      bases["torch"] = same if med(same) else "torch/FULL_SHARD/fp32"
    else:
      bases = {"torch": "torch/FULL_SHARD/fp32"}
    r, of_medians, cpu = {}, {}, {}
    for k, base in bases.items():
      if base and med(base) and base != name:
        r[k] = paired(name, base)
        of_medians[k] = _ratio(med(name), med(base))
        cpu[k] = paired(name, base, "all_cpu_s")
    r["torch_ref"] = bases.get("torch") if "torch" in r else None
    r["of_medians"] = of_medians
    r["cpu"] = cpu
    return r

  for name, d in F.items():
    if d["family"] in ("fsdp", "jax_native", "dp") and d.get("time"):
      d["ratios"] = ratios(name, d)


def render_only(path_json: str, path_md: str, analysis: bool = True) -> None:
  """Re-renders RESULTS.md from a results.json (e.g. after editing ANALYSIS.md)."""
  with open(path_json) as f:
    R = json.load(f)
  R["args"]["analysis"] = analysis
  compute_ratios(R)
  R["targets"] = evaluate_targets(R)
  write_report(R, path_md, path_json)


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
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
                      "fsdp_jax.CPU_XLA_FLAGS ('' = XLA's defaults)")
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


def main(argv=None):
  t_start = time.perf_counter()
  args = parse_args(argv)
  if args.render:
    render_only(args.render, args.out, args.analysis)
    print(f"wrote {args.out} from {args.render}")
    return
  if args.list:
    for s in SETTINGS:
      print(f"{s.name:<34} {'default' if s.default else '(--all/--only)':<15} {s.note}")
    return
  settings = select_settings(args.only, args.all)
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

  machine = machine_info(args.torch_python)
  log(f"{machine['cpu']}, {machine['cores']} cores, load {machine['loadavg_start'][0]:.1f}; "
      f"jax {machine['jax']}; XLA_FLAGS={machine['XLA_FLAGS']}")
  bench = Bench(args)
  cfg = bench.cfg
  log(f"model: {bench.num_params:,} parameters ({cfg.num_layers} layers, d_model "
      f"{cfg.d_model}); global batch {bench.global_batch} x {cfg.seq_len}")
  if bench.num_params != cfg.num_params:
    log(f"warning: GPTConfig.num_params {cfg.num_params:,} != {bench.num_params:,}")

  torch_settings = [s for s in settings if s.family == "torch"]
  torch_variants: list = []
  tmpdir = tempfile.mkdtemp(prefix="fsdp_bench_")
  if torch_settings and not args.no_torch:
    if not torch_available(args.torch_python):
      log("torch is not installed: skipping the PyTorch FSDP baseline")
    else:
      weights = os.path.join(tmpdir, "weights.npz")
      save_weights(bench.bundle("gpt").params, weights)
      for s in torch_settings:
        log(f"starting {s.name} (in the background while JAX compiles)")
        torch_variants.append(TorchVariant(s, bench, weights))

  for name in sorted({s.model for s in settings if s.family != "torch"} - {"gpt_bs"}):
    mb = bench.bundle(name)
    log(f"activations of {name} (unsharded fwd+bwd on one device): "
        f"{mb.act['measured_temp'] / MiB:.2f} MiB")

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

  runnable = [v for v in variants if v.run is not None]
  for tv in torch_variants:
    log(f"waiting for {tv.setting.name} to be ready")
    try:
      info = tv.wait_ready()
      log(f"  ready after {info['ready_after_s']:.0f}s ({info['num_params']:,} params)")
      runnable.append(TorchRunner(tv))
    except Exception as e:
      log(f"  FAILED: {e!r}")

  log(f"timing {len(runnable)} variants: {args.warmup} warm-up + {args.rounds} rounds")
  try:
    measure_times(runnable, args.warmup, args.rounds, log)
  finally:
    for tv in torch_variants:
      tv.close()

  scaling = []
  if not args.no_state_scaling:
    log("stored state vs N")
    scaling = state_scaling(bench, (1, 8) if args.quick else (1, 2, 4, 8), log)

  # ---- assemble results ----
  R: dict = {
      "command": "python benchmarks/run.py" + ("" if argv is None and len(sys.argv) == 1
                                                else " " + " ".join(sys.argv[1:] if argv is None else argv)),
      "machine": machine, "args": {**vars(args), "_python_executable": sys.executable},
      "devices": args.devices,
      "global_batch": bench.global_batch,
      "model": {"d_model": cfg.d_model, "layers": cfg.num_layers, "heads": cfg.num_heads,
                "vocab": cfg.vocab_size, "seq_len": cfg.seq_len, "num_params": bench.num_params,
                "block_params": cfg.block_params, "root_params": cfg.root_params},
      "activations": {k: v.act for k, v in bench._bundles.items() if k != "gpt_bs"},
      "settings": {}, "state_scaling": scaling,
  }
  for v in variants + [r for r in runnable if isinstance(r, TorchRunner)]:
    s = v.setting
    d = {"family": s.family, "strategy": s.strategy, "precision": s.precision, "model": s.model,
         "replicate": s.replicate, "fsdp_kwargs": {k: repr(x) for k, x in s.fsdp_kwargs.items()},
         "note": s.note}
    if isinstance(v, TorchRunner):
      d["torch_info"] = v.tv.info
    else:
      d.update(v.info)
    if getattr(v, "run_error", None):
      d["error"] = "while running: " + v.run_error
    d["time"] = summarize_times(v) if v.times and not getattr(v, "run_error", None) else {}
    d["first_loss"] = v.first_loss
    d["last_loss"] = v.last_loss
    R["settings"][s.name] = d
  compute_ratios(R)
  R["loadavg_end"] = os.getloadavg()
  R["runtime_s"] = time.perf_counter() - t_start
  R["targets"] = evaluate_targets(R)
  write_report(R, args.out, args.json)
  shutil.rmtree(tmpdir, ignore_errors=True)
  log(f"wrote {args.out} and {args.json} ({R['runtime_s'] / 60:.1f} min)")
  for t in R["targets"]:
    log(f"  {'MET ' if t['met'] else 'MISS'} {t['target']}: {t['measured']}")


if __name__ == "__main__":
  main()
