"""Each distinct segment of the loss's per-device program
(:mod:`.segments`), compiled from shapes on the local backend.

Segments whose programs are the same (the blocks of a transformer) are
compiled once: the forward, and the forward followed by the backward in one
program (as the step runs them, so that XLA frees each residual at its last
use), each with its ``memory_analysis()`` and ``cost_analysis()``; what the
forward keeps for the backward is read from the compiled program
(:func:`fsdp_jax._src.hlo.held_and_results`), after XLA's fusions.
:mod:`.schedule` puts them in the step's order.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import functools
import os
import types
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from fsdp_jax._src import _compat, attention as attention_lib, collectives, cross_entropy, hlo
from fsdp_jax._src import mesh as mesh_lib, schedule
from fsdp_jax._src._compat import Literal
from fsdp_jax._src.config import ActivationCheckpointing
from fsdp_jax._src.plan import Plan
from fsdp_jax._src.schedule import checkpoints as checkpoints_lib
from fsdp_jax._src.planner.segments import Segment, is_float, nbytes

# --------------------------------------------------------------------------
# Compiling a segment


@dataclasses.dataclass(frozen=True)
class Compiled:
  """``memory_analysis()`` and ``cost_analysis()`` of one program."""

  argument: int
  output: int
  temp: int
  alias: int
  flops: float
  bytes_accessed: float

  @property
  def transient(self) -> int:
    """Bytes it holds besides its inputs: temporaries and results."""
    return self.temp + self.output - self.alias


@dataclasses.dataclass(frozen=True)
class Programs:
  """A segment's forward and backward programs (one iteration's for a loop).

  ``backward``: the forward and backward in one program (its flops less
  the forward's are the backward's); ``backward_peak``: its peak, its
  inputs and results included, the gathered parameters it reads not;
  ``residual_bytes``: what the forward saves for the backward beyond its
  inputs and outputs; ``saved_inputs``: the inputs and outputs it saves
  (values of the flat program, counted once however many segments save
  them); ``grad_bytes``: the
  gradients of the parameters it reads, in their compute dtypes;
  ``saved_params``: the parameter leaves its backward reads.
  """

  forward: Compiled
  backward: Optional[Compiled]
  backward_peak: int
  residual_bytes: int
  saved_inputs: tuple
  grad_bytes: dict  # leaf id -> bytes
  saved_params: tuple = ()  # leaf ids the backward reads
  host_bytes: int = 0  # saved activations a policy='offload' checkpoint moves to the host


def _compiled(lowered) -> Compiled:
  """A lowered (or compiled) program's memory and cost analyses."""
  c = lowered.compile() if hasattr(lowered, "compile") else lowered
  m = c.memory_analysis()
  cost = c.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  cost = cost or {}
  return Compiled(int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                  int(m.temp_size_in_bytes), int(m.alias_size_in_bytes),
                  float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)))


def _dot_flops(eqn) -> float:
  """A ``dot_general``'s FLOPs: 2 x its result's elements x the contracted
  size."""
  (lhs_contract, _), _ = _compat.dot_dimension_numbers(eqn)
  shape = eqn.invars[0].aval.shape
  return 2.0 * float(np.prod(eqn.outvars[0].aval.shape)) * float(
      np.prod([shape[d] for d in lhs_contract]))


def _loop_work(eqns) -> np.ndarray:
  """``[forward, forward as XLA counts it, backward, backward as XLA counts
  it]`` matmul FLOPs of ``eqns``: loops whole, and as ``cost_analysis()``
  counts them (a loop's body once)."""
  total = np.zeros(4)
  for e in eqns:
    work = attention_lib.kernel_work(e)
    if work is not None:
      total += [work.pairs * work.forward_per_pair, work.forward_per_pair,
                work.pairs * work.backward_per_pair, work.backward_per_pair]
      continue
    loss = cross_entropy.blocked_work(e)
    if loss is not None:
      blocks, fwd, bwd = loss
      total += [blocks * fwd, fwd, blocks * bwd, bwd]
      continue
    if e.primitive.name == "dot_general":
      f = _dot_flops(e)
      total += [f, f, 2 * f, 2 * f]  # backward: one matmul per operand
      continue
    times = _compat.scan_params(e).length if e.primitive.name == "scan" else 1
    for sub in _compat.nested_jaxprs(e):
      inner = _loop_work(sub.eqns)
      total += [times * inner[0], inner[1], times * inner[2], inner[3]]
  return total


def uncounted_loop_flops(eqns) -> tuple:
  """``(forward, backward)`` FLOPs of the loops among ``eqns`` that XLA's
  ``cost_analysis()`` leaves out: it counts a loop's body once, so of
  ``fsdp_jax.attention``'s blockwise kernel about one (query block, key
  block) pair (:func:`fsdp_jax._src.attention.kernel_work`; at 4,096 tokens
  it counted 0.56 of the kernel's 17 GFLOP forward), of the blocked loss
  one block (:func:`fsdp_jax._src.cross_entropy.blocked_work`), of a
  ``lax.scan`` one iteration's matmuls (nested jaxprs included; a
  ``while_loop`` of unknown length stays counted once). The step time's
  roofline adds them."""
  fwd, fwd_counted, bwd, bwd_counted = _loop_work(eqns)
  return fwd - fwd_counted, bwd - bwd_counted


def _canonical(eqns, invars, outvars, texts: dict) -> tuple:
  """A key equal for two runs of equations that compute the same thing
  from inputs of the same shapes: primitives, params, shapes, and each
  operand as the position of the value it reads."""
  names: dict = {}

  def ref(v):
    if isinstance(v, Literal):
      return ("lit", repr(v.val), str(v.aval))
    if v not in names:
      names[v] = (len(names), str(v.aval))
    return names[v]

  for v in invars:
    ref(v)
  out = []
  for e in eqns:
    params = tuple(sorted((k, _param_text(p, texts)) for k, p in _compat.param_items(e)))
    out.append((e.primitive.name, params, tuple(ref(v) for v in e.invars),
                tuple(ref(v) for v in e.outvars)))
  return tuple(out), tuple(ref(v) for v in outvars)


def _param_text(p, texts: dict) -> str:
  """A param as text (a nested jaxpr printed once per object: ``texts``
  maps its id to the object, kept alive there, and its text)."""
  if isinstance(p, (_compat.ClosedJaxpr, _compat.Jaxpr)):
    hit = texts.get(id(p))
    if hit is None or hit[0] is not p:
      hit = texts[id(p)] = (p, str(p))
    return hit[1]
  if isinstance(p, (tuple, list)):
    return "(" + ",".join(_param_text(x, texts) for x in p) + ")"
  if isinstance(p, types.FunctionType):
    # by name, not by its address: a custom_vjp's out_trees is a closure
    # made per call (tensor parallelism's operators in every layer), which
    # made each layer's program distinct (a 70B-shaped model on
    # shard=8 x tensor=8: 84 programs compiled instead of a handful)
    return f"<function {p.__module__}.{p.__qualname__}>"
  return repr(p)


def _struct(aval):
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype)


def _depends_on(jaxpr, sources: set) -> set:
  """The values of ``jaxpr`` computed from ``sources`` (transitively)."""
  out = set(sources)
  for e in jaxpr.eqns:
    if any(not isinstance(v, Literal) and v in out for v in e.invars):
      out.update(e.outvars)
  return out


class Compiler:
  """Compiles segments on the local backend, once per distinct program."""

  def __init__(self, plan: Plan, flat, n_params: int, *,
               checkpoint: Optional[ActivationCheckpointing] = None,
               checkpointed: bool = True, cache: Optional[dict] = None):
    self.plan = plan
    self.flat = flat
    self.n_params = n_params
    # FSDPConfig(activation_checkpointing=...): the selected units' segments
    # (those that first gather them, as schedule.checkpoints picks them)
    # under a checkpoint of the policy. "offload" keeps on the device what
    # "full" keeps of the parameters; its saved activations go to the host.
    remat = checkpoint is not None
    self.remat = remat
    self.units = checkpoints_lib.selected_units(plan, checkpoint) if remat else frozenset()
    self.offload = remat and checkpoint.policy == "offload"
    self.ck_policy = None
    self.ck_key = None
    if remat:
      self.ck_policy = (jax.checkpoint_policies.nothing_saveable if self.offload
                        else checkpoints_lib.checkpoint_policy(checkpoint))
      self.ck_key = checkpoint.policy  # a name, or the policy callable itself
    jaxpr = flat.jaxpr
    trainable = {v for v, l in zip(jaxpr.invars[:n_params], plan.leaves) if not l.frozen}
    self.tangent = _depends_on(jaxpr, trainable)
    self.consts = dict(zip(jaxpr.constvars, flat.consts))
    self._cache: dict = {} if cache is None else cache
    self._pending: dict = {}
    self._texts: dict = {}
    regather = any(plan.regather(u) for u in plan.units)
    self.policy = None
    if regather:
      self.policy = (collectives.remat_policy if plan.recomputes_cheap_ops
                     else collectives.save_all_but_gathers)
    self.axis_names = tuple(plan.mesh.axis_names)
    self.axis_env = [(a, 1) for a in self.axis_names]
    self.mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(
        self.axis_names)), self.axis_names)
    # The step's own compiler options: whether the loss checkpoints decides
    # them (fsdp_jax.custom.compiler_options).
    self.checkpointed = bool(checkpointed or remat)
    self.options = {**local_options(checkpointed=self.checkpointed), **analysis_options()}

  def _local(self, fn, nargs: int):
    """``fn`` where the loss's mesh axes are bound, each of size 1: the
    collectives the trace replaced are stand-ins already, and those a
    custom differentiation rule runs (tensor parallelism's backward psum)
    run over one device."""
    if not self.axis_names:
      return fn
    return jax.shard_map(fn, mesh=self.mesh, in_specs=(P(),) * nargs, out_specs=P(),
                         check_vma=False)

  # ---- the segment as a function -------------------------------------------
  def _function(self, seg: Segment):
    """``(fn(theta, acts) -> outs, theta vars, act vars, out vars)`` for a
    plain segment; for a loop, one iteration of its body."""
    plan = self.plan
    if seg.scan is not None:
      return self._body_function(seg)
    consts = [v for e in seg.eqns for v in e.invars
              if not isinstance(v, Literal) and v in self.consts]
    consts = list(dict.fromkeys(consts))
    theta_vars = [v for v, _ in seg.params]
    lazy = {v: i for v, i in seg.params}
    duck = types.SimpleNamespace(constvars=consts, invars=theta_vars + list(seg.inputs),
                                 eqns=seg.eqns, outvars=list(seg.outputs))
    const_vals = [self.consts[v] for v in consts]
    save_mixed = plan.recomputes_cheap_ops

    def fn(theta, acts):
      g = _identity_gatherer(plan, dict(zip([i for _, i in seg.params], theta)), save_mixed)
      return schedule.eval_with_gathers(duck, const_vals, [None] * len(theta_vars) + list(acts),
                                        lazy, g)

    return fn, theta_vars, list(seg.inputs), list(seg.outputs), False

  def _body_function(self, seg: Segment):
    plan = self.plan
    eqn = seg.scan
    p = _compat.scan_params(eqn)
    nk, nc = p.num_consts, p.num_carry
    body = p.body
    leaf_of = {v: i for i, v in enumerate(self.flat.jaxpr.invars[:self.n_params])}
    theta_vars, theta_ids, act_vars = [], [], []
    outer_of = {}
    for k, (bv, ov) in enumerate(zip(body.invars, eqn.invars)):
      outer_of[bv] = ov
      if not isinstance(ov, Literal) and ov in leaf_of:
        theta_vars.append(bv)
        theta_ids.append(leaf_of[ov])
      else:
        act_vars.append(bv)
    lazy = dict(zip(theta_vars, theta_ids))
    duck = types.SimpleNamespace(constvars=list(body.constvars), invars=theta_vars + act_vars,
                                 eqns=body.eqns, outvars=list(body.outvars))
    consts = list(p.body_consts)

    def fn(theta, acts):
      g = _identity_gatherer(plan, dict(zip(theta_ids, theta)), False)
      return schedule.eval_with_gathers(duck, consts, [None] * len(theta_vars) + list(acts),
                                        lazy, g)

    self._outer_of = outer_of
    return fn, theta_vars, act_vars, list(body.outvars), True

  # ---- compiling -----------------------------------------------------------
  def prepare(self, seg: Segment):
    """Lowers the segment's programs unless a program of the same text was
    compiled; returns what :meth:`finish` needs."""
    fn, theta_vars, act_vars, out_vars, is_loop = self._function(seg)
    plan = self.plan
    ck = self.ck_key if set(seg.units) & self.units else None
    if is_loop:
      outer = self._outer_of
      theta_ids = [self._leaf_id(outer[v]) for v in theta_vars]
      tangent_in = [is_float(v.aval) and (self._leaf_id(outer[v]) is not None and
                                           not plan.leaves[self._leaf_id(outer[v])].frozen
                                           or (not isinstance(outer[v], Literal)
                                               and outer[v] in self.tangent))
                    for v in act_vars]
      # a carry is differentiated when its initial value or the body makes it so
      p = _compat.scan_params(seg.scan)
      body_tangent = _depends_on(p.body, {v for v, t in zip(act_vars, tangent_in) if t}
                                 | set(theta_vars))
      tangent_out = [(not isinstance(v, Literal)) and v in body_tangent and is_float(v.aval)
                     for v in out_vars]
      saved_names = [outer[v] for v in act_vars]
    else:
      theta_ids = [i for _, i in seg.params]
      tangent_in = [is_float(v.aval) and v in self.tangent for v in act_vars]
      tangent_out = [(not isinstance(v, Literal)) and is_float(v.aval) and v in self.tangent
                     for v in out_vars]
      saved_names = list(act_vars)
    diff_theta = [not plan.leaves[i].frozen and is_float(v.aval)
                  for v, i in zip(theta_vars, theta_ids)]
    eqns = _compat.scan_params(seg.scan).body.eqns if is_loop else seg.eqns
    key = (_canonical(eqns, theta_vars + act_vars, out_vars, self._texts), tuple(diff_theta),
           tuple(tangent_in), tuple(tangent_out), is_loop, ck, self.checkpointed)
    if key not in self._cache and key not in self._pending:
      lowered = self._lower(fn, theta_vars, act_vars, out_vars, diff_theta,
                            tangent_in, tangent_out, is_loop, ck is not None)
      # a checkpointed unit's backward program runs its forward again
      fwd_extra, bwd_extra = uncounted_loop_flops(eqns)
      self._pending[key] = dataclasses.replace(
          lowered, extra_flops=(fwd_extra, bwd_extra + (fwd_extra if ck is not None else 0.0)))
    host = (seg.layers if is_loop else 1) if ck is not None and self.offload else 0
    return key, saved_names, theta_ids, ([] if is_loop else list(out_vars)), host

  def finish(self, keys: list) -> list:
    """Compiles what :meth:`prepare` lowered (several programs at once:
    XLA compiles outside Python's lock) and returns each key's
    :class:`Programs`."""
    pending, self._pending = self._pending, {}
    if pending:
      if len(self.flat.jaxpr.eqns) > SERIAL_COMPILE_EQUATIONS:
        # one at a time, the memory XLA freed handed back after each: a
        # large model's programs each take XLA 100+ MiB of host memory to
        # compile (a 70B-shaped Llama on shard=8 x tensor=8: 594 MiB at
        # the peak with two at once, 340 one at a time, 280 with the memory
        # handed back)
        # (each lowered program dropped once compiled)
        done = []
        release_freed_memory()
        for key in list(pending):
          done.append((key, pending.pop(key).compile()))
          release_freed_memory()
      else:
        items = list(pending.items())
        workers = max(1, min(len(items), os.cpu_count() or 1))
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
          done = list(pool.map(lambda kv: (kv[0], kv[1].compile()), items))
      self._cache.update(done)
    return [self._rebind(self._cache[k], names, ids, outs, host)
            for k, names, ids, outs, host in keys]

  def _leaf_id(self, v):
    if isinstance(v, Literal):
      return None
    try:
      return self.flat.jaxpr.invars[:self.n_params].index(v)
    except ValueError:
      return None

  @staticmethod
  def _rebind(progs: "_Raw", saved_names, theta_ids, out_names=(), host: int = 0) -> Programs:
    saved = (tuple(saved_names[k] for k in progs.saved_pos)
             + tuple(out_names[k] for k in progs.saved_out if k < len(out_names)))
    host_bytes = 0
    if host:
      # policy="offload": the floating inputs the checkpoint saves go to the
      # host in the forward pass (checkpoints.UNIT_INPUT), per layer of a loop
      on_host = tuple(v for v in saved if not isinstance(v, Literal) and is_float(v.aval))
      host_bytes = sum(nbytes(v.aval) for v in on_host) * host
      saved = tuple(v for v in saved if v not in on_host)
    return Programs(progs.forward, progs.backward, progs.backward_peak, progs.residual_bytes,
                    saved, {i: b for i, b in zip(theta_ids, progs.grads) if b},
                    tuple(theta_ids[j] for j in progs.theta_saved), host_bytes)

  def _lower(self, fn, theta_vars, act_vars, out_vars, diff_theta, tangent_in, tangent_out,
             is_loop, remat: bool) -> "_Lowered":
    plan = self.plan
    t_structs = [_struct(v.aval) for v in theta_vars]
    a_structs = [_struct(v.aval) for v in act_vars]
    policy = self.policy
    ck_policy = self.ck_policy

    def split(xs, mask):
      return [x for x, m in zip(xs, mask) if m], [x for x, m in zip(xs, mask) if not m]

    def merge(yes, no, mask):
      yes, no = iter(yes), iter(no)
      return [next(yes) if m else next(no) for m in mask]

    def fwd(theta_d, theta_n, acts_d, acts_n):
      def f(td, ad):
        outs = fn(merge(td, theta_n, diff_theta), merge(ad, acts_n, tangent_in))
        d, n = split(outs, tangent_out)
        return d, n

      g = f
      if remat:
        # What jax.checkpoint / nn.remat around the unit's computation keeps:
        # its inputs. Bound as the step binds a model's own checkpoint
        # (schedule.checkpoints.user_checkpoint), so that the step's remat
        # policy below does not save what the checkpoint recomputes.
        g = _as_user_checkpoint(g, ck_policy)
      if is_loop:
        g = jax.checkpoint(g, policy=_loop_policy, prevent_cse=False)
      elif policy is not None:
        g = jax.checkpoint(g, policy=policy, prevent_cse=True)
      d, pullback, n = jax.vjp(g, theta_d, acts_d, has_aux=True)
      return d, n, pullback

    td, tn = split(t_structs, diff_theta)
    ad, an = split(a_structs, tangent_in)
    with _compat.classic_tracing():
      closed = jax.make_jaxpr(fwd, axis_env=self.axis_env)(td, tn, ad, an)
      out_shape = jax.eval_shape(self._local(fwd, 4), td, tn, ad, an)
    n_d = len(jax.tree.leaves(out_shape[0]))
    n_n = len(jax.tree.leaves(out_shape[1]))
    res_vars = closed.jaxpr.outvars[n_d + n_n:]
    invars = closed.jaxpr.invars
    n_td, n_tn, n_ad = len(td), len(tn), len(ad)
    theta_in = set(invars[:n_td + n_tn])
    act_pos = {v: k for k, v in enumerate(invars[n_td + n_tn:])}
    act_order = [k for k, m in enumerate(tangent_in) if m] + [
        k for k, m in enumerate(tangent_in) if not m]
    # Values computed from the parameters alone are recomputed by the loops.
    from_params = _depends_on(closed.jaxpr, theta_in) if is_loop else set()
    from_params -= _depends_on(closed.jaxpr, set(invars[n_td + n_tn:]))
    residual, saved_pos, seen = 0, [], set()
    for v in res_vars:
      if isinstance(v, Literal) or v in seen:
        continue
      seen.add(v)
      if v in theta_in or v in from_params:
        continue
      if v in act_pos:
        saved_pos.append(act_order[act_pos[v]])
        continue
      residual += nbytes(v.aval)
    with _compat.classic_tracing():
      forward = jax.jit(self._local(fwd, 4), compiler_options=self.options).lower(
          td, tn, ad, an)
      backward = None
      grads = [0] * len(theta_vars)
      if n_d and (td or ad):
        # The backward as the step runs it: from residuals made by the
        # forward in the same program, so that XLA frees each residual at
        # its last use and reuses its memory (a program reading them as
        # arguments could not). Its peak counts its inputs and results but
        # not the gathered parameters (the schedule holds those).
        cts = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(out_shape[0])]

        def both(theta_d, theta_n, acts_d, acts_n, ct):
          d, n, pullback = fwd(theta_d, theta_n, acts_d, acts_n)
          # In the step the cotangents arrive once the forward is done (the
          # later units need its outputs first): the barrier keeps XLA from
          # deferring the forward into the backward's recomputation. It takes
          # a sum of the outputs, so that they are not read by the backward.
          done = sum(jnp.sum(x.astype(jnp.float32)) for x in d)
          _, ct = jax.lax.optimization_barrier((done, ct))
          return pullback(ct), d, n

        backward = jax.jit(self._local(both, 5), keep_unused=True,
                           compiler_options=self.options).lower(
            td, tn, ad, an, cts)
        n_in = len(td) + len(tn) + len(ad) + len(an)
        ct_params = tuple(range(n_in, n_in + len(cts)))
        k = 0
        for j, m in enumerate(diff_theta):
          if m:
            grads[j] = nbytes(td[k])
            k += 1
      theta_saved = tuple(j for j, v in enumerate(invars[:n_td + n_tn]) if v in set(res_vars))
      # positions among theta_vars: the differentiated ones first, then the rest
      theta_order = [j for j, m in enumerate(diff_theta) if m] + [
          j for j, m in enumerate(diff_theta) if not m]
      theta_saved = tuple(sorted(theta_order[j] for j in theta_saved))
    return _Lowered(forward, backward, sum(nbytes(x) for x in td + tn), residual,
                    tuple(saved_pos), tuple(grads), theta_saved,
                    () if backward is None or is_loop else ct_params,
                    sum(nbytes(x) for x in jax.tree.leaves(out_shape[:2])),
                    len(td) + len(ad),
                    tuple([k for k, m in enumerate(tangent_out) if m]
                          + [k for k, m in enumerate(tangent_out) if not m]))


@dataclasses.dataclass(frozen=True)
class _Lowered:
  forward: Any
  backward: Any
  param_bytes: int
  residual_bytes: int
  saved_pos: tuple
  grads: tuple
  theta_saved: tuple
  ct_params: tuple  # the cotangents' parameter numbers in the backward program
  output_bytes: int  # the forward's outputs, which the backward program returns too
  n_grads: int  # the backward program's results before the forward's outputs
  out_order: tuple  # those outputs' positions among the segment's outputs
  # (forward, backward) FLOPs the programs run that cost_analysis() leaves
  # out (uncounted_loop_flops); the backward program runs the forward too
  extra_flops: tuple = (0.0, 0.0)

  def compile(self) -> "_Raw":
    fx, bx = self.extra_flops
    forward = _compiled(self.forward)
    forward = dataclasses.replace(forward, flops=forward.flops + fx)
    backward, peak, residual, saved_out = None, 0, self.residual_bytes, ()
    if self.backward is not None:
      executable = self.backward.compile()
      backward = _compiled(executable)
      backward = dataclasses.replace(backward, flops=backward.flops + fx + bx)
      # Less the gathered parameters (the schedule holds them) and the
      # forward's outputs, which the program returns only to keep them
      # computed before the backward (in the step the next unit reads them).
      peak = (backward.argument + backward.temp + backward.output - backward.alias
              - self.param_bytes - self.output_bytes)
      if self.ct_params:
        # What XLA keeps from the forward for the backward, after its
        # fusions: less than the residuals jax.vjp names (a fusion in the
        # backward recomputes cheap values from what is kept); the outputs
        # the backward reads are saved values of the flat program.
        residual, read = hlo.held_and_results(executable.as_text(), self.ct_params)
        saved_out = tuple(sorted(self.out_order[k - self.n_grads] for k in read
                                 if 0 <= k - self.n_grads < len(self.out_order)))
    return _Raw(forward, backward, peak, residual, self.saved_pos, self.grads,
                self.theta_saved, saved_out)


@dataclasses.dataclass(frozen=True)
class _Raw:
  forward: Compiled
  backward: Optional[Compiled]
  backward_peak: int
  residual_bytes: int
  saved_pos: tuple
  grads: tuple
  theta_saved: tuple
  saved_out: tuple = ()


def _as_user_checkpoint(f, policy=None):
  """``f`` under ``jax.checkpoint`` (``policy``; default: nothing saved but
  its inputs), as a ``custom_vjp`` whose forward is the checkpoint's
  ``jax.vjp``: what the step makes of a model's own ``jax.checkpoint`` per
  block, and of the config's checkpoint per unit."""
  policy = jax.checkpoint_policies.nothing_saveable if policy is None else policy
  fn = jax.checkpoint(f, policy=policy, prevent_cse=True)

  @jax.custom_vjp
  def call(td, ad):
    return fn(td, ad)

  def fwd(td, ad):
    out, pullback, aux = jax.vjp(fn, td, ad, has_aux=True)
    return (out, aux), pullback

  def bwd(pullback, cts):
    return pullback(cts[0])

  call.defvjp(fwd, bwd)
  return call


def _loop_policy(prim, *_, **__) -> bool:
  """Inside a loop over stacked layers the step saves what is costly to
  recompute (:mod:`fsdp_jax._src.schedule.loops`)."""
  return prim.name not in collectives.RECOMPUTED


def _identity_gatherer(plan: Plan, values: dict, save_mixed: bool) -> schedule.Gatherer:
  """A gatherer handing out the given full leaves (the segment's inputs)."""
  leaf_unit = {i: plan.leaves[i].unit for i in values}
  direct = {i: values[i] for i in values if plan.leaves[i].ignored}
  return schedule.Gatherer(
      gather_unit=lambda u: {i: v for i, v in values.items() if leaf_unit[i] == u},
      gather_layer=None, leaf_unit={i: u for i, u in leaf_unit.items() if i not in direct},
      stacked_units=set(), unit_layers={}, unit_storage=None, direct=direct,
      save_mixed=save_mixed)


# Loss programs of more equations compile their segments one at a time
# (Compiler.finish): the step programs of more than
# step_program.AUTO_EQUATIONS are modelled for the same reason.
SERIAL_COMPILE_EQUATIONS = 5000


def release_freed_memory() -> None:
  """Hands the memory the C allocator holds freed back to the system
  (glibc's ``malloc_trim``; elsewhere nothing): XLA frees what a compile
  took, but glibc keeps it mapped, so each compile's scratch would add to
  the process's resident memory."""
  trim = _malloc_trim()
  if trim is not None:
    trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
  try:
    return ctypes.CDLL(None).malloc_trim
  except (OSError, AttributeError):
    return None


def compile_segments(segments: list, compiler: Compiler) -> None:
  """Fills each segment's :class:`Programs`."""
  keys = [compiler.prepare(seg) for seg in segments]
  for seg, progs in zip(segments, compiler.finish(keys)):
    seg.programs = progs


def analysis_options() -> dict:
  """Options for programs compiled only for their analyses: on CPU, no LLVM
  optimisation of the machine code, which XLA generates after it has
  assigned the buffers and counted the cost (``memory_analysis()`` and
  ``cost_analysis()`` the same: the accuracy table's configurations gave
  the same estimates; a 70B-shaped Llama's attention layer compiles in 6 s
  instead of 14)."""
  return {"xla_backend_optimization_level": 0} if jax.default_backend() == "cpu" else {}


def local_options(*, checkpointed: bool = True) -> dict:
  """fsdp_jax's compiler options for a program on one local device."""
  device_mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("planner",))
  return mesh_lib.compiler_options(device_mesh, checkpointed=checkpointed)


# --------------------------------------------------------------------------
# XLA:CPU's scheduler: a process flag, not a program's option


def use_cpu_flags() -> bool:
  """Adds fsdp_jax's CPU XLA flags (:data:`fsdp_jax._src.mesh.CPU_XLA_FLAGS`:
  the memory-minimising scheduler among them) to ``XLA_FLAGS`` when JAX has
  not started its backends yet (a process of its own: ``python -m
  fsdp_jax.plan``); the number of devices is left as it is. Returns whether
  the process compiles with them (the flags were set, or were there)."""
  flags = os.environ.get("XLA_FLAGS", "")
  missing = [f for f in mesh_lib.CPU_XLA_FLAGS if f not in flags]
  if missing and not _compat.backends_initialized():
    os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()
  return not concurrency_scheduler()


@functools.lru_cache(maxsize=None)
def concurrency_scheduler() -> bool:
  """Whether this process's XLA:CPU schedules programs breadth-first (its
  concurrency-optimised scheduler, the default) instead of minimising memory
  (``--xla_cpu_enable_concurrency_optimized_scheduler=false``, which
  :func:`fsdp_jax.simulate_cpu_devices` sets). XLA reads that choice from
  ``XLA_FLAGS`` when the process first compiles; a program's
  ``compiler_options`` do not change it (jax 0.10: a program of eight
  independent chains held 8 of its buffers at once under either option
  value without the flag, 1 with it; jax 0.12: 9 and 2). Measured once per
  process on such a program; False off CPU."""
  if jax.default_backend() != "cpu":
    return False

  def chains(x):
    total = jnp.zeros((), x.dtype)
    for i in range(8):
      held = jax.lax.optimization_barrier(jnp.sin(x * (i + 1)) @ x)
      total = total + jnp.sum(jnp.tanh(held) @ x)
    return total

  x = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  temp = jax.jit(chains).lower(x).compile().memory_analysis().temp_size_in_bytes
  return temp >= 4 * nbytes(x)


SCHEDULER_NOTE = (
    "XLA:CPU in this process schedules breadth-first (XLA_FLAGS lacked "
    "--xla_cpu_enable_concurrency_optimized_scheduler=false when JAX started; a program's "
    "compiler options cannot change it): the compiled programs hold more buffers at once "
    "than under fsdp_jax's CPU flags, so the peak is higher than the step's. Fix: call "
    "fsdp_jax.simulate_cpu_devices() before JAX starts, or set that flag in XLA_FLAGS "
    "(python -m fsdp_jax.plan sets it itself)")


def optimizer_inputs(plan: Plan) -> list:
  """The trainable shards one device updates (what ``optimizer.update``
  runs on in the step): one per flat parameter, or per leaf."""
  leaves = []
  for u in plan.trainable_units:
    prefix = plan.prefix(u)
    for group, spec in plan.gather_specs(u):
      ids = [i for i in group if not plan.leaves[i].frozen]
      if not ids:
        continue
      if plan.use_orig_params:
        for i in ids:
          l = plan.leaves[i]
          leaves.append(jax.ShapeDtypeStruct(prefix + (plan.chunk0(l),) + l.rest, l.dtype))
      else:
        leaves.append(jax.ShapeDtypeStruct(prefix + (spec.chunk,), spec.stored_dtype))
  for l in plan.ignored_leaves:
    if not l.frozen:
      leaves.append(jax.ShapeDtypeStruct(l.shape, l.dtype))
  return leaves


def optimizer_program(plan: Plan, leaves: list) -> Optional[Compiled]:
  """The optimizer's update on one device's shards as a program of its own,
  parameters and state donated as the step donates them (exact for
  elementwise optimizers: the step runs the same update on the shards).

  A model's layers repeat a few shapes (a 70B-shaped Llama under tensor
  parallelism: 723 leaves of 8 shapes), and XLA's memory to compile the
  update grows with its leaves (that program alone took 265 MiB of host
  memory and 13 s). So past :data:`WHOLE_UPDATE_LEAVES` leaves the update is
  compiled on each distinct leaf once, on each twice, and on each once plus
  the smallest again: the update is a sum over the leaves, each leaf's share
  a constant plus a share per byte, which the three programs give, summed
  over all the leaves (the temporaries, the update's scratch: the largest
  of the three). Measured on that model, with AdamW and with AdamW after
  global-norm clipping: argument, output and aliased bytes as the whole
  update's, temporaries within 116 bytes, flops and bytes accessed within
  0.02% (the test suite's two-block model with the clip: 2.3%, XLA fusing
  the norm differently per program; only the time reads them); 4 s instead
  of 17 s (50 s with clipping)."""
  if not leaves:
    return None
  distinct = list({(l.shape, str(l.dtype)): l for l in leaves}.values())
  if len(leaves) <= WHOLE_UPDATE_LEAVES or len(distinct) == len(leaves):
    return _update_program(plan, leaves)
  small = min(distinct, key=nbytes)
  progs = [_update_program(plan, x) for x in (distinct, distinct + distinct, distinct + [small])]
  n, w, w_small = len(distinct), sum(nbytes(l) for l in distinct), nbytes(small)
  more_leaves, more_bytes = len(leaves) - n, sum(nbytes(l) for l in leaves) - w

  def whole(field):
    once, twice, plus = (getattr(p, field) for p in progs)
    per_leaf = plus - once  # a constant + w_small per byte
    if w == n * w_small:  # every distinct leaf of the same size: one share each
      return once + per_leaf * more_leaves
    per_byte = (twice - once - n * per_leaf) / (w - n * w_small)
    constant = per_leaf - per_byte * w_small
    return once + constant * more_leaves + per_byte * more_bytes

  return Compiled(int(round(whole("argument"))), int(round(whole("output"))),
                  max(p.temp for p in progs), int(round(whole("alias"))), whole("flops"),
                  whole("bytes_accessed"))


# Updates of at most this many leaves are compiled whole (optimizer_program).
WHOLE_UPDATE_LEAVES = 64


def _update_program(plan: Plan, leaves: list) -> Compiled:
  opt = plan.optimizer

  def update(params, grads, state):
    updates, new_state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), new_state

  state = jax.eval_shape(opt.init, leaves)
  with _compat.classic_tracing():
    lowered = jax.jit(update, donate_argnums=(0, 2),
                      compiler_options={**local_options(), **analysis_options()}).lower(
        leaves, leaves, state)
  out = _compiled(lowered)
  release_freed_memory()
  return out
