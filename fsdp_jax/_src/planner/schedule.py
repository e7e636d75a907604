"""The step's peak memory and time, from its segments put in the order the
step runs them.

Memory: the arguments (stored parameter and optimizer shards, the batch)
are live throughout; on top of them the timeline walks the forward pass
segment by segment, the backward pass in reverse, each unit's gradient
reduction and the optimizer, counting at each point the gathered units the
step holds (the root for the whole step; a FULL_SHARD unit from its gather
to its last forward use and again in its backward; a SHARD_GRAD_OP unit
from its gather to its backward; the next unit with prefetch), the
residuals saved so far, the activations and cotangents passed between
segments, gradients waiting for their unit's reduction, the reduced shards,
and the running program's own temporaries and results
(:mod:`.programs`). The peak is the largest of these sums.

Time: each program at the device's roofline (``cost_analysis()`` flops at
peak FLOP/s, bytes accessed at HBM speed); each FSDP collective's bytes over
its mesh axis's link (within or across nodes by the axis's position in the
mesh); a compute stream and a communication stream run side by side as the
schedule allows (a unit's gather overlaps the segment before it, a
reduce-scatter the segment after it), and what the compute stream waits for
is the exposed communication, per axis.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from fsdp_jax._src import collectives
from fsdp_jax._src.config import ShardingStrategy
from fsdp_jax._src.planner import segments as segments_lib
from fsdp_jax._src.plan import Plan


# --------------------------------------------------------------------------
# What the plan says of each unit


@dataclasses.dataclass(frozen=True)
class UnitBytes:
  """Per device, for one layer of a stacked unit (``layers`` of them)."""

  gathered: int  # the leaves the loss reads, in the compute dtype
  payload: int  # what one all-gather returns (the payload rows of all devices)
  reduced_full: int  # the packed gradient a reduce-scatter reads (reduce dtype)
  shard: int  # the reduced gradient shard kept for the optimizer
  layers: int
  trainable: bool
  resharded: bool
  secondary: int


def unit_bytes(plan: Plan) -> dict:
  out = {}
  for u in plan.units:
    layers = u.num_layers if u.stacked else 1
    gathered = payload = full = shard = 0
    trainable = False
    for group, spec in plan.gather_specs(u):
      dtype, length = collectives.payload_row(spec)
      payload += spec.n * length * np.dtype(dtype).itemsize
      gathered += sum(plan.leaves[i].layer_numel for i in group) * np.dtype(
          spec.compute_dtype).itemsize
      if any(not plan.leaves[i].frozen for i in group):
        trainable = True
        full += spec.n * spec.chunk * np.dtype(spec.reduce_dtype).itemsize
        grad_dtype = spec.reduce_dtype if spec.keep_low_precision_grads else spec.stored_dtype
        shard += spec.chunk * np.dtype(grad_dtype).itemsize
    out[u.index] = UnitBytes(gathered, payload, full, shard, layers, trainable,
                             plan.reshard(u), plan.secondary_size(u))
  return out


def gathered_is_copy(plan: Plan, unit) -> bool:
  """Whether the "gather" makes a buffer of its own: always when sharded;
  under NO_SHARD only when it casts or unpacks (:meth:`Plan.regather`)."""
  return bool(plan.axes.shard_axes) or plan.regather(unit)


# --------------------------------------------------------------------------
# Memory


@dataclasses.dataclass
class Memory:
  """Bytes per device: ``arguments`` (state and batch), ``peak`` (the
  largest point of the timeline, arguments included), ``where`` (which
  point), and the parts of the peak: gathered units, saved activations,
  gradients, temporaries."""

  arguments: int
  peak: int
  where: str
  parts: dict


def _var_bytes(v) -> int:
  return segments_lib.nbytes(v.aval)


# Buffers of the matmul's output size kept alive (deferred_root_gradient).
DEFERRED_BUFFERS = 2
_PASS_THROUGH = frozenset({"convert_element_type", "transpose", "reshape", "copy"})


def deferred_root_gradient(plan: Plan, segments: list) -> tuple:
  """``(segment index, bytes)`` of the cotangent XLA keeps alive when it
  defers a root parameter's gradient (the head's kernel, ``hidden^T @
  dlogits``) to the root's reduction at the end of the backward: the
  largest output of a matmul, at the top level of a segment (not in a loop:
  a blocked loss's per-block logits are recomputed), one of whose operands
  is a root unit's parameter (as read, or cast or transposed). ``(-1, 0)``
  when there is none."""
  roots = {u.index for u in plan.units if u.is_root}
  best = (-1, 0)
  for s in segments:
    if s.scan is not None:
      continue
    from_root = {v for v, i in s.params if plan.leaves[i].unit in roots}
    for e in s.eqns:
      ins = [v for v in e.invars if not isinstance(v, segments_lib.Literal)]
      if e.primitive.name in _PASS_THROUGH and ins and ins[0] in from_root:
        from_root.update(e.outvars)
      elif e.primitive.name == "dot_general" and any(v in from_root for v in ins):
        size = DEFERRED_BUFFERS * segments_lib.nbytes(e.outvars[0].aval)
        if size > best[1]:
          best = (s.index, size)
  return best


def memory(plan: Plan, segments: list, opt_program, *, arguments: int, extra_outputs: int,
           accumulation_steps: int = 1, accumulation: str = "no_sync",
           forward_prefetch: Optional[bool] = None, checkpointed: bool = False) -> Memory:
  """The timeline's peak (see the module docstring). ``checkpointed``: units
  run under a checkpoint (the config's or the model's); then XLA defers the
  head's kernel gradient to the end of the backward and the logits'
  cotangent stays alive through the units' backwards
  (:func:`deferred_root_gradient`), counted there."""
  ub = unit_bytes(plan)
  cfg = plan.config
  strategy = cfg.sharding_strategy
  keeps = strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)
  forward_prefetch = bool(cfg.forward_prefetch) if forward_prefetch is None else forward_prefetch
  backward_prefetch = None if cfg.backward_prefetch is None else cfg.backward_prefetch.name
  k_count = len(segments)
  first = {}  # unit -> first segment reading it
  last = {}
  for s in segments:
    for u in s.reads | set(s.units):
      first.setdefault(u, s.index)
      last[u] = s.index
  roots = {u.index for u in plan.units if u.is_root}

  def held(u) -> int:
    b = ub[u]
    if not gathered_is_copy(plan, plan.units[u]):
      return 0
    per = b.gathered if not plan.units[u].stacked else b.gathered * b.layers
    return per

  def leaf_bytes(i) -> int:
    leaf = plan.leaves[i]
    return leaf.layer_numel * np.dtype(plan.compute_dtype(leaf)).itemsize

  def new_units(k):
    return [u for u in segments[k].units] if 0 <= k < k_count else []

  # ---- activations crossing segments -----------------------------------
  defined, last_use = {}, {}
  for s in segments:
    for v in s.outputs:
      defined[v] = s.index
    for v in s.inputs:
      last_use[v] = max(last_use.get(v, -1), s.index)
  outputs_final = {v for s in segments for v in s.outputs if v not in last_use}
  saved_by = {}
  for s in segments:
    for v in s.programs.saved_inputs:
      saved_by.setdefault(v, []).append(s.index)
  tangent = {}
  for s in segments:
    for v in s.outputs:
      tangent[v] = segments_lib.is_float(v.aval)

  def fwd_live_acts(k) -> int:
    """Activations live while segment k runs forward (besides its own
    results): handed on and not yet consumed, or saved for backward."""
    total = 0
    for v, d in defined.items():
      if d >= k:
        continue
      alive = last_use.get(v, d) >= k or any(j <= k for j in saved_by.get(v, ())) or (
          v in outputs_final)
      if alive:
        total += _var_bytes(v)
    return total

  inputs_of = [set(s.inputs) for s in segments]

  def bwd_live_acts(k) -> int:
    """Saved activations needed at or after segment k's backward, besides
    the inputs its program reads (counted in its peak)."""
    total = 0
    for v, d in defined.items():
      if d <= k and any(j <= k for j in saved_by.get(v, ())) and v not in inputs_of[k]:
        total += _var_bytes(v)
    return total

  def cotangents(k) -> int:
    """Cotangents of activations live at segment k's backward, besides its
    program's own (those of its outputs, read; of its inputs, written)."""
    ins = set(segments[k].inputs)
    total = 0
    for v, d in defined.items():
      if tangent.get(v) and d < k <= last_use.get(v, d) and v not in ins:
        total += _var_bytes(v)
    return total

  def residuals(upto) -> int:
    return sum(s.programs.residual_bytes * s.layers for s in segments if s.index <= upto)

  def grad_leaf_bytes(u) -> int:
    """The leaf gradients of unit u, as the segments' backwards return them."""
    total = 0
    for s in segments:
      for i, b in s.programs.grad_bytes.items():
        if plan.leaves[i].unit == u:
          total += b * (s.layers if s.scan is not None else 1)
    return total

  def pending_grads(k) -> int:
    """Leaf gradients later segments' backwards produced (run before k's)
    whose unit is not reduced yet: it is first read at or before k. A leaf
    read by several segments accumulates into one buffer."""
    held_leaves: dict = {}
    for s in segments:
      if s.index <= k:
        continue
      for i, b in s.programs.grad_bytes.items():
        u = plan.leaves[i].unit
        if first.get(u, -1) <= k:
          held_leaves[i] = max(held_leaves.get(i, 0), b * (s.layers if s.scan is not None else 1))
    return sum(held_leaves.values())

  shards = {u: ub[u].shard * ub[u].layers for u in ub if ub[u].trainable}
  total_shards = sum(shards.values())
  acc_bytes = 0
  if accumulation_steps > 1:
    if accumulation == "sharded":
      acc_bytes = total_shards
    else:
      acc_bytes = sum(
          l.layer_numel * (l.numel // max(l.layer_numel, 1)) * max(4, np.dtype(
              plan.gather_specs(plan.units[l.unit])[0][1].reduce_dtype).itemsize)
          for l in plan.leaves if not l.frozen and not l.ignored)

  points = []

  def point(name, **parts):
    points.append((arguments + extra_outputs + acc_bytes + sum(parts.values()), name, parts))

  # ---- forward ----------------------------------------------------------
  for s in segments:
    k = s.index
    gathered = 0
    for u in ub:
      b = ub[u]
      if u not in first:
        continue
      if u in roots:
        if first[u] <= k:
          gathered += held(u)
        continue
      if plan.units[u].stacked and s.scan is not None and u in s.reads:
        gathered += 2 * b.gathered  # this layer and the next
        continue
      if plan.units[u].stacked:
        if keeps and first[u] < k:
          gathered += b.gathered * b.layers
        continue
      alive = first[u] <= k <= last[u] or (not b.resharded and first[u] <= k)
      if b.secondary and first[u] < k and k > last[u]:
        gathered += held(u) // b.secondary
      elif alive:
        gathered += held(u)
      elif forward_prefetch and u in new_units(k + 1):
        gathered += held(u)
    p = s.programs
    own = sum(_var_bytes(v) for v in s.outputs)
    point(f"forward {_label(plan, s)}", gathered=gathered, saved=residuals(k - 1),
          activations=fwd_live_acts(k), temporaries=p.forward.temp,
          results=own + p.residual_bytes * s.layers)

  # ---- backward ---------------------------------------------------------
  done: set = set()
  head, deferred = deferred_root_gradient(plan, segments) if checkpointed else (-1, 0)
  for s in reversed(segments):
    k = s.index
    p = s.programs
    if p.backward is None:
      continue
    gathered = 0
    still_read = set()  # parameter leaves the remaining backwards read
    for j in range(k + 1):
      still_read.update(segments[j].programs.saved_params)
    for u in ub:
      b = ub[u]
      if u not in first or u in done:
        continue
      if not b.resharded and not plan.units[u].stacked:
        # kept from the forward pass (the root; SHARD_GRAD_OP): only the
        # leaves a remaining backward reads stay
        if gathered_is_copy(plan, plan.units[u]):
          gathered += sum(leaf_bytes(i) for i in plan.units[u].leaf_ids if i in still_read)
        continue
      if plan.units[u].stacked:
        if s.scan is not None and u in s.reads:
          gathered += 2 * b.gathered
        elif keeps and first[u] < k:
          gathered += b.gathered * b.layers
        continue
      if first[u] <= k <= last[u]:
        gathered += held(u)
      elif b.secondary and first[u] < k:
        gathered += held(u) // b.secondary
      elif backward_prefetch == "BACKWARD_PRE" and u in new_units(k - 1):
        gathered += held(u)
    pending = pending_grads(k)
    reduced = sum(shards.get(u, 0) for u in done)
    loop_grads = 0
    if s.scan is not None:
      # the loop writes each layer's reduced shard into the stacked result
      loop_grads = sum(shards.get(u, 0) for u in s.reads if plan.units[u].stacked)
    point(f"backward {_label(plan, s)}", gathered=gathered,
          saved=residuals(k - 1) + bwd_live_acts(k), cotangents=cotangents(k),
          gradients=pending + reduced + loop_grads, backward=p.backward_peak * (
              1 if s.scan is None else 1) + (p.residual_bytes * (s.layers - 1)),
          deferred=deferred if k < head else 0)
    # the units first read here are reduced now: leaf gradients, packed buffer
    for u in ub:
      if first.get(u) == k and u not in done:
        done.add(u)
        if not ub[u].trainable or plan.units[u].stacked:
          continue
        point(f"reduce-scatter {plan.units[u].display_name}", gathered=gathered,
              saved=residuals(k - 1) + bwd_live_acts(k - 1),
              gradients=reduced + grad_leaf_bytes(u) + ub[u].reduced_full,
              deferred=deferred if k < head else 0)

  # ---- optimizer ----------------------------------------------------------
  opt_transient = 0 if opt_program is None else opt_program.temp + max(
      0, opt_program.output - opt_program.alias)
  point("optimizer update", gradients=total_shards, temporaries=opt_transient)
  peak, where, parts = max(points, key=lambda x: x[0])
  parts = dict(parts)
  if acc_bytes:
    parts["accumulator"] = acc_bytes
  return Memory(arguments, peak, where, parts)


def _label(plan: Plan, seg) -> str:
  names = [plan.units[u].display_name for u in seg.units]
  if seg.scan is not None:
    return f"loop over {', '.join(names) or 'stacked layers'} (x{seg.layers})"
  return f"after gathering {', '.join(names)}" if names else f"segment {seg.index}"


# --------------------------------------------------------------------------
# Time


@dataclasses.dataclass
class Time:
  """Seconds per step: ``compute`` (the programs at the roofline),
  ``comm`` (``{axis: (total, exposed)}``), ``step`` (the critical path)."""

  compute: float
  comm: dict
  step: float
  optimizer: float


def axis_bandwidth(mesh_shape: dict, axes: tuple, device) -> tuple:
  """``(bytes/s, "intra" | "inter")`` of a collective over ``axes``: within
  a node when the group's devices are all in one node (the mesh's last axis
  is fastest-varying, so an axis's group spans its size times the sizes of
  the axes after it), else the inter-node link per device."""
  names = list(mesh_shape)
  if not axes:
    return math.inf, "intra"
  inner = min(names.index(a) for a in axes)
  span = int(np.prod([mesh_shape[a] for a in names[inner:]]))
  if span <= device.devices_per_node:
    return device.intra_node_bytes_per_s, "intra"
  return device.inter_node_bytes_per_s, "inter"


def _ring(kind: str, nbytes: float, group: int) -> float:
  """Bytes each device sends (and receives) in a ring collective of
  ``nbytes`` (the gathered / reduced buffer)."""
  if group <= 1:
    return 0.0
  frac = (group - 1) / group
  return 2 * nbytes * frac if kind == "all-reduce" else nbytes * frac


def roofline(flops: float, nbytes: float, device) -> float:
  return max(flops / device.peak_flops, nbytes / device.hbm_bytes_per_s)


def step_time(plan: Plan, segments: list, opt_program, device, *, mesh_shape: dict,
              accumulation_steps: int = 1, accumulation: str = "no_sync",
              offloaded: bool = False) -> Time:
  """The two-stream schedule (see the module docstring)."""
  cfg = plan.config
  ub = unit_bytes(plan)
  axes = plan.axes
  shard_group = axes.shard_size
  rep_group = int(np.prod([mesh_shape[a] for a in axes.replicate_axes])) if axes.replicate_axes else 1
  bw_shard, _ = axis_bandwidth(mesh_shape, axes.shard_axes, device)
  bw_rep, _ = axis_bandwidth(mesh_shape, axes.replicate_axes, device)
  shard_name = "+".join(axes.shard_axes) or None
  rep_name = "+".join(axes.replicate_axes) or None
  comm: dict = {}

  def add(axis, total, exposed=0.0):
    t, e = comm.get(axis, (0.0, 0.0))
    comm[axis] = (t + total, e + exposed)

  first: dict = {}
  for s in segments:
    for u in s.reads | set(s.units):
      first.setdefault(u, s.index)

  def gather_s(u) -> float:
    b = ub[u]
    if not axes.shard_axes:
      return 0.0
    t = _ring("all-gather", b.payload, shard_group) / bw_shard
    if offloaded:
      t += b.payload / shard_group / device.host_bytes_per_s
    return t

  def reduce_s(u) -> tuple:
    b = ub[u]
    if not b.trainable:
      return 0.0, 0.0
    rs = _ring("reduce-scatter", b.reduced_full, shard_group) / bw_shard if axes.shard_axes else 0.0
    ar = 0.0
    if axes.replicate_axes:
      size = b.shard if axes.shard_axes else b.reduced_full
      ar = _ring("all-reduce", size, rep_group) / bw_rep
    if offloaded:
      rs += b.shard / device.host_bytes_per_s
    return rs, ar

  def seg_compute(s, backward: bool) -> float:
    fwd, prog = s.programs.forward, s.programs.backward
    if backward:
      if prog is None:
        return 0.0
      # the backward program runs the forward too
      flops = max(0.0, prog.flops - fwd.flops)
      moved = max(0.0, prog.bytes_accessed - fwd.bytes_accessed)
    else:
      flops, moved = fwd.flops, fwd.bytes_accessed
    t = roofline(flops, moved, device) * s.layers
    for c in s.collectives:  # the loss's own collectives: on the critical path
      bw, _ = axis_bandwidth(mesh_shape, c.axes, device)
      group = int(np.prod([mesh_shape.get(a, 1) for a in c.axes]))
      kind = "all-reduce" if c.kind in ("psum", "pmean", "psum2") else "all-gather"
      ct = _ring(kind, c.nbytes, group) / bw
      t += ct
      add("+".join(c.axes), ct, ct)
    return t

  micro = max(1, accumulation_steps)
  regather = {u for u in ub if ub[u].resharded}
  clock = {"compute": 0.0, "comm": 0.0, "busy": 0.0}

  def issue(seconds: float, at: float, axis: Optional[str]) -> float:
    """Queues a collective on the communication stream; returns its end."""
    if seconds <= 0:
      return at
    clock["comm"] = max(clock["comm"], at) + seconds
    add(axis, seconds)
    return clock["comm"]

  def wait(ready: float, axis: Optional[str]) -> None:
    if ready > clock["compute"]:
      if axis is not None:
        add(axis, 0.0, ready - clock["compute"])
      clock["compute"] = ready

  def run(seconds: float) -> None:
    clock["compute"] += seconds
    clock["busy"] += seconds

  def loop(s, backward: bool) -> None:
    """A scan over stacked layers: each iteration gathers the next layer
    (and, backward, reduce-scatters its own) while it computes."""
    layer_c = seg_compute(s, backward) / s.layers
    stacked = [u for u in s.reads if plan.units[u].stacked]
    g = sum(gather_s(u) / ub[u].layers for u in stacked
            if not backward or u in regather)
    rs = sum(reduce_s(u)[0] / ub[u].layers for u in stacked) if backward else 0.0
    comm_per = g + rs
    exposed = g + max(0.0, comm_per - layer_c) * (s.layers - 1)
    add(shard_name, comm_per * s.layers, exposed)
    clock["compute"] = max(clock["compute"], clock["comm"]) + exposed + layer_c * s.layers
    clock["busy"] += layer_c * s.layers
    clock["comm"] = clock["compute"]

  gathered = set()
  for m in range(micro):
    # Forward: a segment's gathers are queued while the segment before it
    # runs, and the segment waits for them.
    at = clock["compute"]
    for s in segments:
      if s.scan is not None:
        loop(s, False)
        at = clock["compute"]
        continue
      ready = clock["compute"]
      for u in s.units:
        if u in gathered and (plan.units[u].is_root or not ub[u].resharded):
          continue  # kept from an earlier microbatch
        ready = max(ready, issue(gather_s(u), at, shard_name))
        gathered.add(u)
      wait(ready, shard_name)
      at = clock["compute"]
      run(seg_compute(s, False))
    # Backward: the re-gathers of resharded units, prefetched as the config
    # says; each unit's reduction queued after the backward of its first
    # segment (no_sync accumulation reduces after the last microbatch only).
    order = [s for s in reversed(segments) if s.programs.backward is not None]
    ready_at: dict = {}

    def regather_of(s, at):
      if s.scan is not None:
        ready_at[s.index] = at
        return
      t = at
      for u in s.units:
        if u in regather:
          t = issue(gather_s(u) / (ub[u].secondary or 1), at, shard_name)
      ready_at[s.index] = t

    prefetch = None if cfg.backward_prefetch is None else cfg.backward_prefetch.name
    for j, s in enumerate(order):
      nxt = order[j + 1] if j + 1 < len(order) else None
      if s.index not in ready_at:
        regather_of(s, clock["compute"])
      wait(ready_at[s.index], shard_name)
      if s.scan is not None:
        loop(s, True)
      else:
        if prefetch == "BACKWARD_PRE" and nxt is not None:
          regather_of(nxt, clock["compute"])
        run(seg_compute(s, True))
        if prefetch == "BACKWARD_POST" and nxt is not None:
          regather_of(nxt, clock["compute"])
      if accumulation == "no_sync" and m < micro - 1:
        continue
      for u in ub:
        if first.get(u) == s.index and not (plan.units[u].stacked and s.scan is not None):
          rs, ar = reduce_s(u)
          end = issue(rs, clock["compute"], shard_name)
          issue(ar, end, rep_name)
  # The optimizer waits for the last reduction.
  wait(clock["comm"], rep_name or shard_name)
  opt = 0.0
  if opt_program is not None:
    if offloaded:
      opt = opt_program.bytes_accessed / device.host_memory_bytes_per_s
    else:
      opt = roofline(opt_program.flops, opt_program.bytes_accessed, device)
  run(opt)
  return Time(clock["busy"], {a: v for a, v in comm.items() if a is not None and v[0] > 0},
              clock["compute"], opt)
