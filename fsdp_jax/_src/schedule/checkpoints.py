"""The model's own ``jax.checkpoint`` / ``nn.remat``: re-bound so that its
policy holds inside the step's remat and the rebuilt scan bodies.

JAX partially evaluates a ``jax.checkpoint`` nested in another one with the
*outer* policy (jax-ml/jax#18817): under the step's remat, which saves every
costly result but the gathered parameters, and inside the rebuilt scan body,
a user's checkpoint would save those intermediates. Each one is re-bound as
a ``custom_vjp`` whose forward is ``jax.vjp`` of the user's checkpoint: its
residuals are its inputs and what the user's policy saves, and its backward
recomputes the rest.

``FSDPConfig(activation_checkpointing=...)`` puts each selected unit's
computation under such a checkpoint (:func:`checkpoint_units`): the loss's
jaxpr, its calls that read parameters inlined, is cut into the units'
regions (:mod:`.regions`) and traced again with each selected region a
``jax.checkpoint`` whose inputs are the unit's gathered parameters and the
activations it reads, and with the body of a scan over a stacked unit
checkpointed one layer at a time. The step then treats these checkpoints
as a model's own: its gathers are placed before them, FULL_SHARD's backward
re-gather serves the recomputation.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from fsdp_jax._src import _compat, offload, wrap
from fsdp_jax._src._compat import Jaxpr, Literal
from fsdp_jax._src.config import ActivationCheckpointing
from fsdp_jax._src.plan import Plan
from fsdp_jax._src.schedule import regions

# The name "offload" gives the activations a checkpointed unit reads: its
# policy moves them to host memory.
UNIT_INPUT = "fsdp_unit_input"

def has_user_checkpoint(jaxpr) -> bool:
  """Whether ``jaxpr`` (or one nested in it) calls ``jax.checkpoint``."""
  jaxpr = _compat.split_closed(jaxpr)[0] if jaxpr is not None else None
  if not isinstance(jaxpr, Jaxpr):
    return False
  return any(_compat.is_remat(e) for e in jaxpr.eqns) or any(
      has_user_checkpoint(sub) for sub in _compat.subjaxprs(jaxpr))


def user_checkpoint(eqn, invals) -> list:
  """Binds the user's ``jax.checkpoint`` equation so that its policy holds
  inside the step's own remat (see the module docstring)."""
  p = _compat.remat_params(eqn)
  body = p.jaxpr
  fn = jax.checkpoint(lambda *args: _compat.eval_jaxpr(body, (), *args),
                      policy=p.policy, prevent_cse=p.prevent_cse)

  @jax.custom_vjp
  def call(*args):
    return fn(*args)

  def fwd(*args):
    return jax.vjp(fn, *args)  # residuals: the inputs and what the policy saves

  def bwd(pullback, cts):
    return pullback(cts)

  call.defvjp(fwd, bwd)
  with _compat.user_context(eqn):
    return call(*invals)


def scan_rebuild(eqn, read, write, body_params, evaluate) -> None:
  """Re-evaluates a scan whose body calls ``jax.checkpoint`` (a scan that is
  not over a stacked unit), so those checkpoints keep their policy too.
  ``body_params``: the body's inputs that hold parameters; ``evaluate(jaxpr,
  consts, args, lazy, param_invars)``: the placement's evaluator."""
  p = _compat.scan_params(eqn)
  num_consts, num_carry = p.num_consts, p.num_carry
  invals = [read(v) for v in eqn.invars]
  consts = invals[:num_consts]
  init = invals[num_consts:num_consts + num_carry]
  xs = invals[num_consts + num_carry:]

  def body(carry, x):
    outs = evaluate(p.body, p.body_consts, [*consts, *carry, *x], {}, body_params)
    return outs[:num_carry], outs[num_carry:]

  carry_out, ys = lax.scan(body, init, xs, length=p.length, reverse=p.reverse,
                           unroll=p.unroll)
  for v, o in zip(eqn.outvars, [*carry_out, *ys]):
    write(v, o)


# --------------------------------------------------------------------------
# FSDPConfig(activation_checkpointing=...): a checkpoint per unit


def checkpoint_policy(ac: ActivationCheckpointing) -> Callable:
  """The ``jax.checkpoint`` policy of ``ac.policy``."""
  if callable(ac.policy):
    return ac.policy
  cp = jax.checkpoint_policies
  if ac.policy == "full":
    return cp.nothing_saveable
  if ac.policy == "dots":
    return cp.dots_with_no_batch_dims_saveable
  return cp.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=[UNIT_INPUT],
      offload_src="device", offload_dst=offload.HOST_MEMORY_KIND)


def selected_units(plan: Plan, ac: ActivationCheckpointing) -> frozenset:
  """The indices of the units ``ac`` checkpoints; a pattern that names no
  unit is an error. Patterns and predicates see the wrap-policy unit's name
  (``"<root>"`` for the root): its parts (LoRA's bases and adapters,
  tensor-parallel leaves) go with it."""
  key = {u.index: regions.unit_group(plan, u) or u.display_name for u in plan.units}
  if ac.units is None:
    return frozenset(u.index for u in plan.units if not u.is_root)
  if callable(ac.units):
    return frozenset(i for i, name in key.items() if ac.units(name))
  out = set()
  for pattern in ac.units:
    hit = {i for i, name in key.items() if wrap.name_matches(name, pattern)}
    if not hit:
      listed = sorted(set(key.values()))
      shown = ", ".join(listed[:12]) + (" ..." if len(listed) > 12 else "")
      raise ValueError(
          f"ActivationCheckpointing(units={ac.units!r}): the pattern {pattern!r} names no "
          f"unit. The units are: {shown}. Fix: use their names as print(state.plan) lists "
          "them ('*' within one dotted segment, '**' across), or units=None for every unit "
          "but the root.")
    out |= hit
  return frozenset(out)


def check_offload_backend(plan: Plan, ac: ActivationCheckpointing) -> None:
  """``policy="offload"`` needs host memory the devices can address."""
  if ac.policy != "offload":
    return
  mesh = plan.mesh
  if isinstance(mesh, jax.sharding.AbstractMesh):
    return
  for d in mesh.devices.flat:
    kinds = offload.memory_kinds(d)
    if offload.HOST_MEMORY_KIND not in kinds:
      raise ValueError(
          f"ActivationCheckpointing(policy='offload') moves the checkpointed activations to "
          f"{offload.HOST_MEMORY_KIND!r} memory, but device {d} ({d.platform}) has the "
          f"memory kinds {kinds or 'none reported'}. Fix: use policy='full' (or 'dots') on "
          "this backend.")


def checkpoint_units(closed, n_params: int, plan: Plan, ac: ActivationCheckpointing,
                     axis_env=()):
  """``closed`` (the loss's jaxpr; its first ``n_params`` inputs the
  parameter leaves as gathered) traced again with each selected unit's
  computation under ``jax.checkpoint`` (see the module docstring)."""
  units = selected_units(plan, ac)
  policy = checkpoint_policy(ac)
  name_inputs = ac.policy == "offload"
  jaxpr = closed.jaxpr
  avals = [v.aval for v in jaxpr.invars]

  def flat_fn(*args):
    return regions.inline_param_calls(jaxpr, closed.consts, list(args),
                                      set(jaxpr.invars[:n_params]))

  flat = jax.make_jaxpr(flat_fn, axis_env=list(axis_env))(*avals)
  segs = regions.segment(flat, n_params, plan)
  if not any(set(s.units) & units for s in segs):
    return closed

  def run(*args):
    return _run_checkpointed(flat, list(args), segs, units, policy, name_inputs)

  return jax.make_jaxpr(run, axis_env=list(axis_env))(*avals)


def _named(vals, on: bool) -> list:
  if not on:
    return list(vals)
  return [checkpoint_name(x, UNIT_INPUT) if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)
          else x for x in vals]


def _run_checkpointed(flat, args, segs, units: frozenset, policy, name_inputs: bool) -> list:
  """The flat program, segment by segment, each selected unit's under
  ``jax.checkpoint``; a scan over a selected stacked unit with its body so."""
  jaxpr = flat.jaxpr
  env: dict = dict(zip(jaxpr.constvars, flat.consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, Literal) else env[v]
  for seg in segs:
    if not set(seg.units) & units:
      for eqn in seg.eqns:
        env.update(zip(eqn.outvars, _compat.bind_eqn(eqn, [read(v) for v in eqn.invars])))
      continue
    if seg.scan is not None:
      eqn = seg.scan
      env.update(zip(eqn.outvars, _checkpointed_scan(
          eqn, [read(v) for v in eqn.invars], {v for v, _ in seg.params}, policy, name_inputs)))
      continue
    theta = [v for v, _ in seg.params]

    def body(theta_vals, in_vals, seg=seg, theta=theta):
      local = dict(zip(theta, theta_vals))
      local.update(zip(seg.inputs, _named(in_vals, name_inputs)))
      get = lambda v: v.val if isinstance(v, Literal) else local[v] if v in local else env[v]
      for eqn in seg.eqns:
        local.update(zip(eqn.outvars, _compat.bind_eqn(eqn, [get(v) for v in eqn.invars])))
      return [local[v] for v in seg.outputs]

    outs = jax.checkpoint(body, policy=policy, prevent_cse=True)(
        [read(v) for v in theta], [read(v) for v in seg.inputs])
    env.update(zip(seg.outputs, outs))
  return [read(v) for v in jaxpr.outvars]


def _checkpointed_scan(eqn, invals, params: set, policy, name_inputs: bool) -> list:
  """A scan over a stacked unit with its body (one layer) under
  ``jax.checkpoint``; its scanned-over leaves stay the scan's operands, so
  the step still gathers them one layer per iteration."""
  p = _compat.scan_params(eqn)
  nk, nc = p.num_consts, p.num_carry
  consts, init, xs = invals[:nk], invals[nk:nk + nc], invals[nk + nc:]
  is_param = [not isinstance(v, Literal) and v in params for v in eqn.invars]

  def layer(*args):
    args = [a if is_param[k] else _named([a], name_inputs)[0] for k, a in enumerate(args)]
    return _compat.eval_jaxpr(p.body, p.body_consts, *args)

  fn = jax.checkpoint(layer, policy=policy, prevent_cse=False)

  def body(carry, x):
    outs = fn(*consts, *carry, *x)
    return list(outs[:nc]), list(outs[nc:])

  carry_out, ys = lax.scan(body, list(init), list(xs), length=p.length, reverse=p.reverse,
                           unroll=p.unroll)
  return [*carry_out, *ys]
