"""Reading compiled programs: memory, collectives per step (with loop trip
counts), the schedule, and what is live at the memory peak.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
import time
from typing import Optional

import numpy as np

import fsdp_jax
from fsdp_jax._src import hlo
from fsdp_jax._src.schedule import NEXT_LAYER_SCOPE


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
  collective in a loop body once). A scan over stacked layers gathers the
  next layer in a ``conditional`` (name scope ``fsdp_next_layer``) that
  takes its gathering branch in every iteration but the last: of the ``n``
  such conditionals of a loop body (``n`` > 1 when the scan is unrolled)
  run ``trip`` times, one skips once, so each counts ``trip - 1/n`` runs
  (fractional per branch computation; the other branch holds no
  collective). An unrolled scan whose length the unroll does not divide
  runs its last iteration after the loop, where XLA drops the skipped
  gather: it is counted one gather short per loop. Returns (counts, all
  trip counts known)."""
  edges: dict = {}
  skipping: dict = {}  # computation -> its conditionals that skip the last trip
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
    skips_last = bool(re.search(r"\sconditional\(", line)) and (
        f"{NEXT_LAYER_SCOPE}/" in line)
    if skips_last:
      skipping[comp] = skipping.get(comp, 0) + 1
    for c in callees:
      is_body = bool(body and c == body.group(1))
      edges.setdefault(comp, []).append((c, mult if is_body else 1, is_body, skips_last))
  counts: dict = {}

  def visit(c, k, trip=None, depth=0):
    counts[c] = counts.get(c, 0) + k
    if depth < 50:
      for callee, m_c, is_body, skips_last in edges.get(c, ()):
        if is_body:
          visit(callee, k * m_c, m_c, depth + 1)
        elif skips_last and trip:
          visit(callee, k * (trip - 1 / skipping[c]) / trip, trip, depth + 1)
        else:
          visit(callee, k * m_c, trip, depth + 1)

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
    d["executions"] = round(d["executions"], 6)
    if d["executions"] == int(d["executions"]):
      d["executions"] = int(d["executions"])
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
# What a step's operations move: a per-op breakdown of the compiled program

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|f16|bf16|s32|u32|f32|s64|u64|f64|c64|c128)"
                    r"\[([\d,]*)\]")
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
          "c128": 16}
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
         "partition-id", "replica-id", "iota", "while", "conditional", "call",
         "opt-barrier", "add-dependency"}
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute",
                "all-to-all")


def _array_bytes(text: str) -> float:
  total = 0.0
  for dtype, dims in _ARRAY.findall(text):
    n = 1
    for d in dims.split(","):
      if d:
        n *= int(d)
    total += n * _BYTES[dtype]
  return total


def _category(opcode: str, fused_ops: set) -> str:
  if opcode.startswith(_COLLECTIVES):
    return "collectives"
  if opcode in ("dot", "convolution") or (opcode == "fusion" and fused_ops & {"dot", "convolution"}):
    return "matmuls (dots and their fusions)"
  if opcode == "copy" or opcode.startswith("copy-"):
    return "copies"
  if opcode in ("slice", "dynamic-slice") or (
      opcode == "fusion" and fused_ops and fused_ops <= {"slice", "dynamic-slice", "bitcast",
                                                          "parameter", "reshape", "copy"}):
    return "slices (unpacking)"
  if opcode in ("dynamic-update-slice", "concatenate", "pad") or (
      opcode == "fusion" and fused_ops & {"dynamic-update-slice", "concatenate", "pad"}):
    return "packing (concatenate, pad, update-slice)"
  if opcode in ("reduce", "reduce-window") or (opcode == "fusion" and "reduce" in fused_ops):
    return "reductions"
  if opcode == "fusion":
    return "elementwise fusions"
  return "other"


def parse_module(hlo_text: str, with_roots: bool = False):
  """``{computation: [(name, result type, opcode, operand names, rest)]}``
  from a module's text (operands are printed by name: their types are their
  own instructions' result types); with ``with_roots`` also
  ``{computation: its ROOT's opcode}``."""
  comps: dict = {}
  roots: dict = {}
  comp = None
  for line in hlo_text.splitlines():
    if line.rstrip().endswith("{") and " = " not in line:
      m = _COMP_HEADER.match(line)
      comp = m.group(1) if m else None
      if comp is not None:
        comps[comp] = []
      continue
    m = _INSTR.match(line)
    if comp is not None and m:
      rest = m.group(4)
      depth, cut = 1, len(rest)
      for k, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
          cut = k
          break
      operands = re.findall(r"%([\w.\-]+)", rest[:cut])
      if line.lstrip().startswith("ROOT"):
        roots[comp] = m.group(3)
      comps[comp].append((m.group(1), m.group(2), m.group(3), operands, rest[cut:]))
  return (comps, roots) if with_roots else comps


def _dtype_of(type_text: str) -> str:
  m = _ARRAY.search(type_text)
  return m.group(1) if m else "?"


def dot_types(hlo_text: str) -> dict:
  """Dots anywhere in a compiled module (fused ones included) by operand and
  result element type: ``{"bf16 x bf16 -> f32": count}``."""
  out: dict = {}
  for instrs in parse_module(hlo_text).values():
    types = {name: t for name, t, _, _, _ in instrs}
    for _, result, opcode, operands, _ in instrs:
      if opcode not in ("dot", "convolution"):
        continue
      key = f"{' x '.join(_dtype_of(types.get(o, '')) for o in operands)} -> {_dtype_of(result)}"
      out[key] = out.get(key, 0) + 1
  return out


def op_breakdown(hlo_text: str) -> dict:
  """Bytes each kind of operation reads and writes per step (operands plus
  result, per device, times the loop trip counts), from a compiled module's
  text: ``{category: {"ops": executed ops, "bytes": bytes}}``, plus
  ``"optimization barriers"`` (their count: they move nothing). An update
  written in place (a ``dynamic-update-slice``, or a fusion ending in one)
  moves its update twice, not the buffer; a slice, what it keeps twice.

  Only operations XLA runs one by one are counted: a fusion is one
  operation (its result and operands), the computations inside it are not.
  """
  comps, roots = parse_module(hlo_text, with_roots=True)
  counts, _ = execution_counts(hlo_text)
  # Computations run as operations: the entry, loop bodies and conditions,
  # branches and calls; not fused computations or reducers.
  run = set()
  stack = [c for c in comps if re.search(rf"ENTRY\s+%?{re.escape(c)}\s", hlo_text)]
  while stack:
    c = stack.pop()
    if c in run:
      continue
    run.add(c)
    for _, _, opcode, _, rest in comps.get(c, ()):
      if opcode in ("while", "conditional", "call"):
        stack += _CALLEES.findall(rest) + [x.strip().lstrip("%") for g in
                                          _BRANCH_LIST.findall(rest) for x in g.split(",")]
  fused_ops = {c: {op for _, _, op, _, _ in comps[c]} for c in comps}
  out: dict = {}
  barriers = 0
  for c in run:
    k = counts.get(c, 1)
    types = {name: t for name, t, _, _, _ in comps[c]}
    for _, result, opcode, operands, rest in comps[c]:
      if opcode == "opt-barrier":
        barriers += k
      if opcode in _FREE:
        continue
      callee = re.search(r"\bcalls=%?([\w.\-]+)", rest)
      cat = _category(opcode, fused_ops.get(callee.group(1), set()) if callee else set())
      ins = [_array_bytes(types.get(o, "")) for o in operands]
      in_place = opcode == "dynamic-update-slice" or (
          callee is not None and roots.get(callee.group(1)) == "dynamic-update-slice")
      if in_place and ins:
        # Written in place: what moves is the update (read and written), not
        # the buffer it lands in.
        moved = 2 * (sum(ins) - max(ins))
      elif cat.startswith("slices"):
        moved = 2 * _array_bytes(result)  # a slice reads only what it keeps
      else:
        moved = _array_bytes(result) + sum(ins)
      row = out.setdefault(cat, {"ops": 0, "bytes": 0.0})
      row["ops"] += k
      row["bytes"] += k * moved
  out["optimization barriers"] = {"ops": barriers, "bytes": 0.0}
  return out
