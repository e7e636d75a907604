"""Gradients of the loss on shards: :class:`ValueAndGrad` differentiates a
:class:`~fsdp_jax._src.local_loss.LocalLoss`, reduce-scatters each unit's
gradient (in the backward pass, or after it for accumulated or probed
gradients) and accumulates microbatches; :func:`optimizer_step` is PyTorch's
``optimizer.step()`` on the shards. Both are building blocks of a custom step
(``docs/custom_step.md``); :func:`fsdp_jax.shard_train_step` composes them.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from fsdp_jax._src import _compat, collectives, layout, optim, schedule
from fsdp_jax._src import loss as loss_lib
from fsdp_jax._src.local_loss import LocalLoss
from fsdp_jax._src.loss import LossOutput, as_stored_dtype
from fsdp_jax._src.plan import Plan, hook_key, merge_trainable, split_trainable


def optimizer_step(optimizer, grads, opt_state, params, *, plan: Plan, value=None):
  """PyTorch's ``optimizer.step()`` inside ``jax.shard_map``.

  Runs ``optimizer.update`` and ``optax.apply_updates`` on the tree passed to
  ``init_train_state`` (its paths, unpadded shapes and dtypes; frozen leaves
  are ``None``), evaluated on this device's shards so that the result is what
  the optimizer computes unsharded (see docs/optimizers.md): elementwise
  work stays local, a whole-parameter reduction costs one scalar all-reduce,
  an operation that needs a whole parameter gathers it.

  Args:
    optimizer: the optax transformation the state was built with.
    grads: the reduced gradient shards (``value_and_grad``'s output).
    opt_state: the stored optimizer state (``state.opt_state``'s shards).
    params: the stored parameter shards (``state.params``'s shards).
    plan: ``state.plan``.
    value: the loss, passed as ``value=`` to transformations that take it
      (``optax.contrib.reduce_on_plateau``).

  Returns:
    ``(new params, new opt_state)`` in the stored layout.

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
  trainable, frozen = split_trainable(plan, params)
  optimizer = optim.as_transformation(optimizer)
  new_trainable, new_state = optim.update_local(plan, optimizer, grads, opt_state, trainable,
                                                value=value)
  return merge_trainable(plan, new_trainable, frozen), new_state


# --------------------------------------------------------------------------
# Reducing full gradients (accumulated, or probed for a stateful hook)


def _acc_dtype(plan: Plan, leaf):
  """Unreduced gradients accumulate in the unit's ``reduce_dtype``, at least
  float32 (a 16-bit accumulator would lose the small microbatch terms)."""
  if leaf.ignored:
    return jnp.promote_types(leaf.dtype, jnp.float32)
  spec = plan.gather_specs(plan.units[leaf.unit])[0][1]
  return jnp.promote_types(spec.reduce_dtype, jnp.float32)


def reduce_full_grads(plan: Plan, full_grads: dict, hook_state=None):
  """Reduces full, unreduced local leaf gradients unit by unit.

  Returns ``(trainable grads in the stored layout, new hook state)``: one
  reduce-scatter (or hook call) per unit and dtype group.
  """
  hook = plan.comm_hook
  stateful = plan.stateful_hook
  new_hook_state = {} if stateful else None
  local = {}
  for unit in plan.trainable_units:
    prefix = plan.prefix(unit)
    for gi, (group, spec) in enumerate(plan.gather_specs(unit)):
      if all(plan.leaves[i].frozen for i in group):
        continue
      cts = [full_grads[i] for i in group]
      with jax.named_scope(f"fsdp_reduce_scatter[{unit.display_name}]"):
        if stateful:
          key = hook_key(unit, gi)
          full = collectives.pack_full(cts, spec, prefix)
          reduced, st = collectives.call_hook(
              hook, jax.tree.map(lambda x: x[0], hook_state[key]), full, spec)
          new_hook_state[key] = jax.tree.map(lambda x: x[None], st)
          reduced = collectives.split_rows(
              collectives.finish_gradient(reduced, spec, spec.stored_dtype), spec)
        else:
          # The reduction of the gather's transpose: a stateless hook included.
          reduced = collectives.reduce_leaves(cts, spec, spec.stored_dtype)
      keys = group if plan.use_orig_params else ["flat"]
      for k, v in zip(keys, reduced):
        local[(unit.index, k)] = v
  # Ignored leaves: this device's own gradient, not reduced.
  for l in plan.ignored_leaves:
    if not l.frozen:
      local[("ignored", l.index)] = full_grads[l.index][None].astype(l.dtype)
  return _assemble_grads(plan, local), new_hook_state


def _assemble_grads(plan: Plan, local: dict):
  """``{(unit index, leaf id or "flat") or ("ignored", leaf id): reduced}``
  -> the trainable gradients in the stored layout."""
  if plan.use_orig_params:
    leaves = [None if l.frozen else local[("ignored", l.index) if l.ignored else (l.unit, l.index)]
              for l in plan.leaves]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)
  out = {u.flat_key: local[(u.index, "flat")] for u in plan.trainable_units}
  out.update({plan.ignored_key(l): local[("ignored", l.index)]
              for l in plan.ignored_leaves if not l.frozen})
  return {k: out[k] for k in sorted(out)}


def check_microbatches(local_batch_shapes, k: int) -> None:
  """Every leaf's per-device batch dimension is divisible by ``k``."""
  for x in jax.tree.leaves(local_batch_shapes):
    if x.shape[0] % k:
      raise ValueError(
          f"The local batch has {x.shape[0]} rows on each device, which "
          f"gradient_accumulation_steps={k} does not divide. Fix: use a "
          f"per-device batch that is a multiple of {k} (global batch a multiple "
          f"of {k} x the data-parallel size), or change the number of microbatches.")


# --------------------------------------------------------------------------
# value_and_grad


def value_and_grad(loss_fn: Callable, *, plan: Plan, gradient_accumulation_steps: int = 1,
                   accumulation: str = "no_sync", forward_inputs=None) -> "ValueAndGrad":
  """Returns ``f(params, batch, model_state=None, hook_state=None, rng=None)``,
  for use inside ``jax.shard_map`` on the local shards, computing
  ``(LossOutput, trainable_grads, new_hook_state)``.

  ``trainable_grads`` are the reduced, averaged gradient shards in the layout
  of :func:`split_trainable`'s first output. ``rng`` is this device's key
  for the step, passed on as ``loss_fn(..., rng=rng)`` when ``loss_fn``
  accepts it (:func:`shard_train_step` passes ``fold_in(fold_in(state.rng,
  step), device_index)``).

  Gradient accumulation over ``gradient_accumulation_steps`` microbatches of
  the local batch (microbatch ``m`` gets the key ``fold_in(rng, m)``):

  * ``"no_sync"`` (PyTorch's ``no_sync()``): each microbatch's full unreduced
    gradient is accumulated locally (in ``reduce_dtype``, at least float32)
    and every unit is reduced once at the end: fewer collectives, a full
    gradient of every unit held per device.
  * ``"sharded"``: every microbatch reduce-scatters its gradient into a
    sharded accumulator (in the stored dtype): one reduction per unit per
    microbatch, only the shard held.

  Either way the result equals one step over the whole local batch: the
  gradient is the mean over microbatches of each microbatch's mean gradient.

  When ``loss_fn`` returns a :class:`~fsdp_jax.WeightedLoss`, the weights of
  every microbatch are summed over the data-parallel world first (one scalar
  all-reduce), and each device differentiates ``total * world / sum(weight)``,
  so that the averaged reduction yields the gradient of the global ratio
  ``sum(total) / sum(weight)``; ``out.loss`` is that ratio and
  ``out.weight`` the global weight.

  ``forward_inputs``: see :func:`make_local_loss`.

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

  return ValueAndGrad(loss_fn, plan=plan, gradient_accumulation_steps=gradient_accumulation_steps,
                      accumulation=accumulation, forward_inputs=forward_inputs)


class ValueAndGrad:
  """The loss and the reduced gradient shards of ``loss_fn`` on this device
  (:func:`value_and_grad` documents the call).

  Attributes:
    plan: the sharding plan.
    loss: the :class:`~fsdp_jax._src.local_loss.LocalLoss` differentiated.
    steps: ``gradient_accumulation_steps``.
    accumulation: ``"no_sync"`` or ``"sharded"``.

  One of three differentiations runs, each through the plan's
  :attr:`~fsdp_jax._src.plan.Plan.ordering` of the collectives:

  * direct: with respect to the trainable shards (with CPU offload, to device
    zeros added to each unit's device copy): each unit's gradient is
    reduce-scattered in the backward pass, by the gather's transpose;
  * probed: with respect to zeros added to the gathered leaves, giving
    every unit's full unreduced gradient (``no_sync`` accumulation, and a
    stateful hook that cannot run in the backward pass), reduced after it;
  * hooked: with respect to zeros and the hook state at each group's gate,
    so a stateful hook runs in the backward pass.
  """

  def __init__(self, loss_fn: Callable, *, plan: Plan, gradient_accumulation_steps: int = 1,
               accumulation: str = "no_sync", forward_inputs=None):
    if accumulation not in ("no_sync", "sharded"):
      raise ValueError(f"accumulation={accumulation!r}: use 'no_sync' or 'sharded'.")
    k = int(gradient_accumulation_steps)
    if k < 1:
      raise ValueError(f"gradient_accumulation_steps={gradient_accumulation_steps} must be >= 1.")
    self.plan = plan
    self.steps = k
    self.accumulation = accumulation
    self.loss = LocalLoss(loss_fn, plan, forward_inputs=forward_inputs)
    self._local = _maybe_remat(self.loss, plan)
    self._use_probes = plan.stateful_hook or (k > 1 and accumulation == "no_sync")
    ordering = plan.ordering
    self._direct = schedule.ordered(self._direct_grads, ordering)
    self._probed = schedule.ordered(self._probed_grads, ordering)
    self._hooked = schedule.ordered(self._hooked_grads, ordering)

  def __call__(self, params, batch, model_state=None, hook_state=None, rng=None):
    # The rewrite reads classic jax.checkpoint / lax.scan equations, whatever
    # implementation the user's config selects (see fsdp_jax._src._compat).
    with _compat.classic_tracing():
      self.loss.reset()  # traces of loss_fn are shared within one trace of a call only
      if self.steps == 1:
        return self._single(params, batch, model_state, hook_state, rng)
      return self._accumulated(params, batch, model_state, hook_state, rng)

  # ---- the three differentiations -----------------------------------------
  @staticmethod
  def _objective(out, scale):
    # A WeightedLoss: d(total * world / W), averaged over the world by the
    # reduction, sums to d(sum(total)) / W, the gradient of the global ratio.
    return out.loss if scale is None else out.loss.astype(jnp.float32) * scale

  def _direct_grads(self, params, batch, model_state, rng, scale):
    plan, local = self.plan, self._local
    trainable, frozen = split_trainable(plan, params)
    if plan.offloaded:
      # Differentiate with respect to device zeros added to each unit's
      # device copy: the gradient shards stay in device memory (a gradient
      # with respect to the host arrays would be computed in host memory).
      stored = merge_trainable(plan, trainable, frozen)  # constants of the objective

      def objective(dz):
        out = local(stored, batch, model_state, None, rng, _offload_deltas(plan, dz))
        return self._objective(out, scale), out

      zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), trainable)
      (_, out), grads = jax.value_and_grad(objective, has_aux=True)(zeros)
      return out, grads

    def objective(t):
      out = local(merge_trainable(plan, t, frozen), batch, model_state, None, rng)
      return self._objective(out, scale), out

    (_, out), grads = jax.value_and_grad(objective, has_aux=True)(trainable)
    return out, grads

  def _probed_grads(self, params, batch, model_state, rng, scale):
    params = jax.lax.stop_gradient(params)
    probes = {i: jnp.zeros(s.shape, s.dtype) for i, s in _probe_shapes(self.plan).items()}

    def objective(pr):
      out = self._local(params, batch, model_state, pr, rng)
      return self._objective(out, scale), out

    (_, out), full = jax.value_and_grad(objective, has_aux=True)(probes)
    return out, full

  def _hooked_grads(self, params, batch, model_state, rng, scale, hook_state):
    """A stateful hook in the backward pass: differentiate with respect to
    zeros and the hook's state at each group's gate (and zeros added to the
    ignored leaves), the stored arrays being constants."""
    plan = self.plan
    trainable, frozen = split_trainable(plan, params)
    stored = merge_trainable(plan, trainable, frozen)
    zeros, states = {}, {}
    for u in plan.trainable_units:
      arrays = layout.unit_storage(plan, u, stored)
      arrays = (dict(zip(u.leaf_ids, arrays)) if plan.use_orig_params else {"flat": arrays[0]})
      for gi, (group, _) in enumerate(plan.gather_specs(u)):
        zeros[(u.index, gi)] = [jnp.zeros(x.shape, x.dtype)
                                for x in layout.group_locals(plan, group, arrays)]
        states[(u.index, gi)] = jax.tree.map(lambda x: x[0], hook_state[hook_key(u, gi)])
    leaves = jax.tree_util.tree_leaves(stored) if plan.use_orig_params else None
    ignored = {}
    for l in plan.ignored_leaves:
      if not l.frozen:
        key = l.index if plan.use_orig_params else plan.ignored_key(l)
        x = leaves[l.index] if plan.use_orig_params else stored[key]
        ignored[key] = jnp.zeros(x.shape, x.dtype)

    def objective(z, st, dz):
      out = self._local(stored, batch, model_state, None, rng, dz,
                        {k: (z[k], st[k]) for k in z})
      return self._objective(out, scale), out

    (_, out), (reduced, new_states, d_ignored) = jax.value_and_grad(
        objective, argnums=(0, 1, 2), has_aux=True)(zeros, states, ignored)
    per = {}
    for (ui, gi), arrays in reduced.items():
      group = plan.gather_specs(plan.units[ui])[gi][0]
      for k, v in zip(group if plan.use_orig_params else ["flat"], arrays):
        per[(ui, k)] = v
    for l in plan.ignored_leaves:
      if not l.frozen:
        per[("ignored", l.index)] = d_ignored[l.index if plan.use_orig_params
                                              else plan.ignored_key(l)]
    new_hook = {hook_key(plan.units[ui], gi): jax.tree.map(lambda x: x[None], st)
                for (ui, gi), st in new_states.items()}
    return out, _assemble_grads(plan, per), new_hook

  # ---- one batch, or microbatches ------------------------------------------
  def _global_weight(self, local_weights):
    w = loss_lib.weight_total(local_weights, self.plan.axes.data_axes)
    return w, jnp.float32(self.plan.axes.world_size) / w

  def _single(self, params, batch, model_state, hook_state, rng):
    plan = self.plan
    w = self.loss.weight(batch, model_state, rng)
    total_w, scale = self._global_weight(w) if w is not None else (None, None)
    if plan.stateful_hook and _gates_apply(plan, hook_state):
      out, grads, new_hook = self._hooked(params, batch, model_state, rng, scale, hook_state)
    elif self._use_probes:
      out, full = self._probed(params, batch, model_state, rng, scale)
      grads, new_hook = reduce_full_grads(plan, full, hook_state)
    else:
      (out, grads), new_hook = self._direct(params, batch, model_state, rng, scale), hook_state
    if w is not None:
      out = LossOutput(jax.lax.psum(out.loss.astype(jnp.float32), plan.axes.data_axes) / total_w,
                       out.aux, out.model_state, total_w)
    return out, grads, new_hook

  def _accumulated(self, params, batch, model_state, hook_state, rng):
    plan, k, local = self.plan, self.steps, self._local
    check_microbatches(batch, k)
    micro = jax.tree.map(lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)
    keys = None if rng is None else jax.vmap(lambda m: _micro_key(rng, m))(jnp.arange(k))
    first = jax.tree.map(lambda x: x[0], micro)
    first_key = None if keys is None else jax.tree.map(lambda x: x[0], keys)
    weighted = self.loss.weight(first, model_state, first_key) is not None
    total_w = scale = None
    if weighted:
      ws = lax.map(lambda a: self.loss.weight(a[0], model_state, a[1], model_state_changes=True),
                   (micro, keys))
      total_w, scale = self._global_weight(jnp.sum(ws))
    if self._use_probes:
      acc0 = {i: jnp.zeros(s.shape, _acc_dtype(plan, plan.leaves[i]))
              for i, s in _probe_shapes(plan).items()}
    else:
      acc0 = jax.tree.map(jnp.zeros_like, split_trainable(plan, params)[0])

    # A weighted objective is already normalised by the global weight: its
    # microbatch gradients add up; a mean loss's are averaged.
    def body(carry, xs):
      mb, key = xs
      acc, ms, loss_sum, aux_sum = carry
      if self._use_probes:
        out, g = self._probed(params, mb, ms, key, scale)
      else:
        out, g = self._direct(params, mb, ms, key, scale)
      acc = jax.tree.map(lambda a, x: a + x.astype(a.dtype) if weighted
                         else a + x.astype(a.dtype) / k, acc, g)
      aux_sum = jax.tree.map(lambda t, a: t + jnp.asarray(a, jnp.float32) / k, aux_sum, out.aux)
      if out.model_state is not None:
        ms = jax.tree.map(as_stored_dtype, out.model_state, ms)
      loss = out.loss.astype(jnp.float32)
      return (acc, ms, loss_sum + (loss if weighted else loss / k), aux_sum), None

    # The aux structure (for the running mean) comes from an abstract trace.
    aux_shape = jax.eval_shape(lambda: local(params, first, model_state, None, first_key).aux)
    aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), aux_shape)
    carry = (acc0, model_state, jnp.zeros((), jnp.float32), aux0)
    carry, _ = lax.scan(body, carry, (micro, keys))
    acc, ms, loss, aux = carry
    if weighted:
      out = LossOutput(jax.lax.psum(loss, plan.axes.data_axes) / total_w, aux, ms, total_w)
    else:
      out = LossOutput(loss, aux, ms)
    if self._use_probes:
      grads, new_hook = reduce_full_grads(plan, acc, hook_state)
      return out, grads, new_hook
    return out, acc, hook_state


def _gates_apply(plan: Plan, hook_state) -> bool:
  """Whether a stateful hook can run in the backward pass: no stacked
  trainable unit (scan loops reduce layer by layer) and a floating state
  (it travels as a cotangent)."""
  if any(u.stacked for u in plan.trainable_units):
    return False
  return all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(hook_state))


def _offload_deltas(plan: Plan, trainable) -> dict:
  """Trainable arrays in the stored layout (as :func:`split_trainable`
  returns them) -> ``{leaf id or flat key: array}``, as ``local`` reads
  ``deltas``."""
  if not plan.use_orig_params:
    return dict(trainable)
  leaves = jax.tree_util.tree_leaves(trainable)
  ids = [l.index for l in plan.leaves if not l.frozen]
  return dict(zip(ids, leaves))


def _maybe_remat(local, plan: Plan):
  """The local loss under the step's remat when a unit is gathered again in
  backward: the remat refuses to save the re-gathered parameters (and, with
  :attr:`~fsdp_jax._src.plan.Plan.recomputes_cheap_ops`, recomputes
  elementwise operations)."""
  if any(plan.regather(u) for u in plan.units):
    policy = (collectives.remat_policy if plan.recomputes_cheap_ops
              else collectives.save_all_but_gathers)
    # jax.checkpoint picks its implementation when it wraps (jax 0.10).
    with _compat.classic_tracing():
      return jax.checkpoint(local, policy=policy, prevent_cse=True, static_argnums=())
  return local


def _probe_shapes(plan: Plan) -> dict:
  return {l.index: jax.ShapeDtypeStruct(plan.gathered_shape(l), plan.compute_dtype(l))
          for l in plan.leaves if not l.frozen}


def _micro_key(rng, m):
  return jax.tree.map(lambda key: jax.random.fold_in(key, m), rng)
