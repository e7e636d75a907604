"""Gradient norms, ``clip_grad_norm`` (PyTorch ``clip_grad_norm_`` over the
shards) and the non-finite check of a step's gradients."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from fsdp_jax._src.optim import Geometry
from fsdp_jax._src.plan import Plan, split_trainable


def _ignored_flags(plan: Plan):
  """A tree shaped like the stored params: True at ignored leaves."""
  if plan.use_orig_params:
    return jax.tree_util.tree_unflatten(plan.treedef, [l.ignored for l in plan.leaves])
  out = {u.flat_key: False for u in plan.units}
  out.update({plan.ignored_key(l): True for l in plan.ignored_leaves})
  return out


def _tensor_flags(plan: Plan):
  """A tree shaped like the stored params: True at arrays split over the
  tensor axis (their norms add up over it; the others are replicated)."""
  if plan.use_orig_params:
    return jax.tree_util.tree_unflatten(
        plan.treedef, [not l.ignored and plan.units[l.unit].tensor for l in plan.leaves])
  out = {u.flat_key: u.tensor for u in plan.units}
  out.update({plan.ignored_key(l): False for l in plan.ignored_leaves})
  return out


def _grad_dtypes(plan: Plan):
  """The dtype PyTorch's gradients would have per trainable leaf: the reduce
  dtype with ``keep_low_precision_grads``, else the stored dtype."""
  out = []
  for unit in plan.trainable_units:
    for group, spec in plan.gather_specs(unit):
      d = spec.reduce_dtype if spec.keep_low_precision_grads else spec.stored_dtype
      out.extend(jnp.dtype(d) for i in group if not plan.leaves[i].frozen)
  out.extend(jnp.dtype(l.dtype) for l in plan.ignored_leaves if not l.frozen)
  return out


def grad_norm(grads, *, plan: Plan, norm_type: float = 2.0):
  """The total norm of the reduced gradient shards (inside ``jax.shard_map``):
  the norm of all gradients viewed as one vector, as
  :func:`clip_grad_norm` computes it, in the promoted dtype of the
  gradients. One scalar all-reduce over the shard axes."""
  total = _total_norm(grads, plan, float(norm_type))
  return total.astype(_norm_dtype(plan))


def _total_norm(grads, plan: Plan, norm_type: float):
  if not (norm_type > 0):
    raise ValueError(f"clip_grad_norm: norm_type={norm_type} must be > 0 or inf.")
  leaves = jax.tree.leaves(grads)
  is_ignored = jax.tree.leaves(split_trainable(plan, _ignored_flags(plan))[0])
  is_split = jax.tree.leaves(split_trainable(plan, _tensor_flags(plan))[0])
  sharded = [x for x, ign, t in zip(leaves, is_ignored, is_split) if not ign and not t]
  split = [x for x, t in zip(leaves, is_split) if t]
  own = [x for x, ign in zip(leaves, is_ignored) if ign]
  axes = plan.axes.shard_axes
  split_axes = plan.axes.tensor_axes + axes
  zero = jnp.zeros((), jnp.float32)
  # Sharded gradients are summed over the shard axes (and a tensor-parallel
  # unit's over the tensor axis too: each device holds a slice); ignored
  # parameters' gradients are this device's own and count once (PyTorch adds
  # the local non-sharded norm after the all-reduce).
  if math.isinf(norm_type):
    amax = lambda xs: jnp.max(jnp.stack([zero] + [jnp.max(jnp.abs(x.astype(jnp.float32))) for x in xs]))
    local = amax(sharded)
    total = jnp.maximum(lax.pmax(local, axes) if axes else local, amax(own))
    if split:
      total = jnp.maximum(total, lax.pmax(amax(split), split_axes))
    return total
  psum_ = lambda xs: sum((jnp.sum(jnp.abs(x.astype(jnp.float32)) ** norm_type) for x in xs), zero)
  local = psum_(sharded)
  total = (lax.psum(local, axes) if axes else local) + psum_(own)
  if split:
    total = total + lax.psum(psum_(split), split_axes)
  return total ** (1.0 / norm_type)


def _norm_dtype(plan: Plan):
  dtypes = _grad_dtypes(plan) or [jnp.dtype(jnp.float32)]
  out_dtype = dtypes[0]
  for d in dtypes[1:]:
    out_dtype = jnp.promote_types(out_dtype, d)
  return out_dtype


def clip_grad_norm(grads, *, plan: Plan, max_norm: float, norm_type: float = 2.0):
  """PyTorch's ``FullyShardedDataParallel.clip_grad_norm_`` on local shards.

  Call inside ``jax.shard_map`` on the reduced gradient shards. The total norm
  is the norm of all gradients viewed as one vector: local sums of
  ``|g| ** norm_type`` (in float32) are summed over the shard axes (``max``
  for ``inf``); gradients replicated across devices (NO_SHARD, the replicate
  axis of HYBRID) count once. Gradients are scaled by
  ``clip(max_norm / (total_norm + 1e-6), max=1)``.

  Returns ``(clipped_grads, total_norm)``; the norm is the pre-clip norm in
  the promoted dtype of the gradients, as in PyTorch.

  Example: a whole step (see docs/custom_step.md):

    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> opt = optax.sgd(0.1)
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=opt, mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> plan = state.plan
    >>> vg = fsdp_jax.custom.value_and_grad(
    ...     lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2), plan=plan)
    >>> p_specs = fsdp_jax.custom.param_specs(plan)
    >>> o_specs, _ = fsdp_jax.custom.opt_state_specs(plan, opt)
    >>> def body(params, opt_state, batch):
    ...   out, grads, _ = vg(params, batch)
    ...   grads, norm = fsdp_jax.custom.clip_grad_norm(grads, plan=plan, max_norm=1.0)
    ...   params, opt_state = fsdp_jax.custom.optimizer_step(
    ...       opt, grads, opt_state, params, plan=plan)
    ...   return params, opt_state, out.loss, norm
    >>> step = jax.jit(jax.shard_map(body, mesh=mesh,
    ...     in_specs=(p_specs, o_specs, fsdp_jax.custom.batch_spec(plan)),
    ...     out_specs=(p_specs, o_specs, P(), P()), check_vma=False))
    >>> params, opt_state, loss, norm = step(state.params, state.opt_state,
    ...                                      {"x": jnp.ones((2, 4))})
    >>> print(f"loss {float(loss):.1f}, gradient norm before clipping {float(norm):.1f}")
    loss 16.0, gradient norm before clipping 11.3
  """
  max_norm = float(max_norm)
  norm_type = float(norm_type)
  if not max_norm > 0:
    raise ValueError(f"clip_grad_norm: max_norm={max_norm} must be positive "
                     "(PyTorch clips to a norm > 0).")
  total = _total_norm(grads, plan, norm_type)
  coef = jnp.minimum(max_norm / (total + 1e-6), 1.0)
  clipped = jax.tree.map(lambda x: (x * coef.astype(x.dtype)).astype(x.dtype), grads)
  return clipped, total.astype(_norm_dtype(plan))


def nonfinite_leaves(grads, *, plan: Plan):
  """Per trainable parameter (in ``tree_leaves`` order), whether any element
  of its reduced gradient is non-finite, agreed over the data axes (inside
  ``jax.shard_map``; one small all-reduce)."""
  geo = Geometry(plan)
  flags = []
  stored = (jax.tree_util.tree_leaves(grads) if plan.use_orig_params else grads)
  it = iter(stored) if plan.use_orig_params else None
  for l in plan.leaves:
    if l.frozen:
      continue
    if plan.use_orig_params:
      x = next(it)
    else:
      x = grads[plan.ignored_key(l)] if l.ignored else grads[plan.units[l.unit].flat_key]
    bad = ~jnp.isfinite(x)
    if not l.ignored and not plan.use_orig_params and geo.has_padding(l.index):
      bad = bad & geo.valid(l.index)
    flags.append(jnp.any(bad))
  vec = jnp.stack(flags).astype(jnp.int32)
  return lax.pmax(vec, plan.axes.data_axes + plan.axes.tensor_axes).astype(bool)
