"""Each unit's computation in the loss: the flat program cut where the step
gathers units (:func:`segment`).

A new segment starts at the first equation that reads a unit not read
before (where the step places that unit's all-gather), what follows a
segment's last read of its units is a segment of its own (the step has
freed them by then), and a ``scan`` over a stacked unit is a segment of its
own (one layer per iteration). ``FSDPConfig(activation_checkpointing=...)``
checkpoints the segments of the units it selects (:mod:`.checkpoints`); the
planner compiles and schedules them (:mod:`fsdp_jax._src.planner.segments`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from fsdp_jax._src import _compat
from fsdp_jax._src._compat import Literal
from fsdp_jax._src.plan import Plan

# Suffixes the plan gives the parts of one wrap-policy unit (LoRA's frozen
# bases and adapters, tensor-parallel leaves): the parts are gathered
# together, at the unit's first use.
_PART_SUFFIXES = (".lora_base", ".lora_adapters", ".trainable", ".tensor_parallel")


def unit_group(plan: Plan, unit) -> str:
  """The wrap-policy unit a planned unit is part of."""
  if unit.is_root:
    return ""
  name = unit.name
  for suffix in _PART_SUFFIXES:
    k = name.find(suffix)
    if k >= 0:
      return name[:k]
  return name


@dataclasses.dataclass
class Segment:
  """A run of the flat loss program between two gather points.

  ``units``: the units first gathered here (the step gathers them right
  before it); ``reads``: every unit it reads; ``scan``: the scan equation
  when the segment is a loop over stacked units (then ``layers`` is its
  length and the programs are one iteration's); ``inputs`` / ``outputs``:
  the flat program's values it reads from earlier segments and hands on.
  """

  index: int
  eqns: list
  units: list
  reads: set
  scan: Any = None
  layers: int = 1
  inputs: list = dataclasses.field(default_factory=list)
  outputs: list = dataclasses.field(default_factory=list)
  params: list = dataclasses.field(default_factory=list)  # (invar, leaf id)
  # Filled by the planner: the loss's own collectives, the compiled programs.
  collectives: list = dataclasses.field(default_factory=list)
  programs: Any = None


def _scan_leaves(eqn, leaf_of: dict, plan: Plan) -> Optional[dict]:
  """``{xs position: leaf id}`` when ``eqn`` is a scan over leaves of a
  stacked unit (one layer per iteration), else None."""
  if not _compat.is_scan(eqn):
    return None
  p = _compat.scan_params(eqn)
  xs = eqn.invars[p.num_consts + p.num_carry:]
  out = {}
  for k, v in enumerate(xs):
    if isinstance(v, Literal) or v not in leaf_of:
      continue
    leaf = plan.leaves[leaf_of[v]]
    if leaf.ignored:
      continue
    unit = plan.units[leaf.unit]
    if unit.stacked and unit.num_layers == p.length:
      out[k] = leaf.index
  return out or None


def segment(flat, n_params: int, plan: Plan) -> list:
  """Cuts the flat program into :class:`Segment` s."""
  jaxpr = flat.jaxpr
  leaf_of = {v: i for i, v in enumerate(jaxpr.invars[:n_params])}
  group_of = {u.index: unit_group(plan, u) for u in plan.units}
  segments: list = []
  seen_groups: set = set()

  def start(eqn_units=()):
    segments.append(Segment(len(segments), [], list(eqn_units), set()))

  start()
  for eqn in jaxpr.eqns:
    read_leaves = [leaf_of[v] for v in eqn.invars
                   if not isinstance(v, Literal) and v in leaf_of]
    read_units = {plan.leaves[i].unit for i in read_leaves if not plan.leaves[i].ignored}
    stacked = _scan_leaves(eqn, leaf_of, plan)
    if stacked is not None:
      new = sorted(u for u in read_units if group_of[u] not in seen_groups)
      seen_groups.update(group_of[u] for u in new)
      start(new)
      seg = segments[-1]
      seg.eqns.append(eqn)
      seg.reads |= read_units
      seg.scan = eqn
      seg.layers = _compat.scan_params(eqn).length
      start()
      continue
    new_groups = {group_of[u] for u in read_units} - seen_groups
    if new_groups and (segments[-1].eqns or segments[-1].units):
      if segments[-1].units or segments[-1].scan is not None:
        start()
    seg = segments[-1]
    for u in sorted(read_units):
      if group_of[u] in new_groups and u not in seg.units:
        seg.units.append(u)
    # every part of a new group is gathered with it
    for u in plan.units:
      if group_of[u.index] in new_groups and u.index not in seg.units:
        seg.units.append(u.index)
    seen_groups |= new_groups
    seg.eqns.append(eqn)
    seg.reads |= read_units
  segments = [s for s in segments if s.eqns]
  segments = _split_tails(segments, leaf_of, plan)
  for k, s in enumerate(segments):
    s.index = k
  _wire(segments, jaxpr, leaf_of)
  return segments


def _split_tails(segments: list, leaf_of: dict, plan: Plan) -> list:
  """Splits off what a segment computes after its last read of the units it
  gathers (a block's residual add and the next norm's statistics, the
  head and loss after the last block): the step has freed those units by
  then, and in backward gathers them only once that part is done."""
  out = []
  for s in segments:
    if s.scan is not None or not s.units:
      out.append(s)
      continue
    mine = set(s.units)
    last = max((k for k, e in enumerate(s.eqns) for v in e.invars
                if not isinstance(v, Literal) and v in leaf_of
                and plan.leaves[leaf_of[v]].unit in mine), default=len(s.eqns) - 1)
    if last + 1 >= len(s.eqns):
      out.append(s)
      continue
    head, tail = s.eqns[:last + 1], s.eqns[last + 1:]
    units_of = lambda eqns: {plan.leaves[leaf_of[v]].unit for e in eqns for v in e.invars
                             if not isinstance(v, Literal) and v in leaf_of
                             and not plan.leaves[leaf_of[v]].ignored}
    out.append(Segment(0, head, list(s.units), units_of(head)))
    out.append(Segment(0, tail, [], units_of(tail)))
  return out


def _wire(segments: list, jaxpr, leaf_of: dict) -> None:
  """Each segment's inputs (values defined before it, parameters apart) and
  outputs (values read after it, or returned by the loss)."""
  defined_in = {}
  for k, s in enumerate(segments):
    for e in s.eqns:
      for v in e.outvars:
        defined_in[v] = k
  later_reads: dict = {}
  for k, s in enumerate(segments):
    for e in s.eqns:
      for v in e.invars:
        if not isinstance(v, Literal):
          later_reads.setdefault(v, set()).add(k)
  final = {v for v in jaxpr.outvars if not isinstance(v, Literal)}
  consts = set(jaxpr.constvars)
  for k, s in enumerate(segments):
    ins, params = [], []
    seen = set()
    for e in s.eqns:
      for v in e.invars:
        if isinstance(v, Literal) or v in seen or defined_in.get(v) == k:
          continue
        seen.add(v)
        if v in leaf_of:
          params.append((v, leaf_of[v]))
        elif v not in consts:
          ins.append(v)
    s.inputs, s.params = ins, params
    outs = []
    for e in s.eqns:
      for v in e.outvars:
        if isinstance(v, _compat.DropVar):
          continue
        if v in final or any(j > k for j in later_reads.get(v, ())):
          outs.append(v)
    s.outputs = outs


def inline_param_calls(jaxpr, consts, args, params: set) -> list:
  """``jaxpr`` evaluated with the calls that read parameters (``params``:
  its invars holding them) inlined, their equations becoming the program's,
  so that units can be cut apart; calls with a custom differentiation rule
  are kept."""
  env: dict = {}
  read = lambda v: v.val if isinstance(v, Literal) else env[v]
  for v, c in zip(jaxpr.constvars, consts):
    env[v] = c
  from_params = set()
  for v, a in zip(jaxpr.invars, args):
    env[v] = a
    if v in params:
      from_params.add(v)
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    reads = [v for v in eqn.invars if not isinstance(v, Literal) and v in from_params]
    body = _compat.call_body(eqn) if _compat.is_call(eqn) else None
    if body is not None and reads and not _compat.has_custom_rule(eqn):
      inner, inner_consts = body
      inner_params = {bv for bv, ov in zip(inner.invars, eqn.invars)
                      if not isinstance(ov, Literal) and ov in from_params}
      outs = inline_param_calls(inner, inner_consts, invals, inner_params)
    else:
      outs = _compat.bind_eqn(eqn, invals)
    for v, o in zip(eqn.outvars, outs):
      env[v] = o
    if reads:
      from_params.update(eqn.outvars)
  return [read(v) for v in jaxpr.outvars]
