"""The model's own ``jax.checkpoint`` / ``nn.remat``: re-bound so that its
policy holds inside the step's remat and the rebuilt scan bodies.

JAX partially evaluates a ``jax.checkpoint`` nested in another one with the
*outer* policy (jax-ml/jax#18817): under the step's remat, which saves every
costly result but the gathered parameters, and inside the rebuilt scan body,
a user's checkpoint would save those intermediates. Each one is re-bound as
a ``custom_vjp`` whose forward is ``jax.vjp`` of the user's checkpoint: its
residuals are its inputs and what the user's policy saves, and its backward
recomputes the rest.
"""

from __future__ import annotations

import jax
from jax import lax

from fsdp_jax._src import _compat
from fsdp_jax._src._compat import Jaxpr

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
