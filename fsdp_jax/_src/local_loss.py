"""The loss on one device's shards: ``loss_fn`` traced once to a jaxpr and
evaluated with every unit gathered right before its first use
(:class:`LocalLoss`). :mod:`fsdp_jax._src.grads` differentiates it."""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import jax
import jax.numpy as jnp

from fsdp_jax._src import _compat, adapters, collectives, frameworks, layout, offload, schedule
from fsdp_jax._src import tensor_eval, tensor_sequence
from fsdp_jax._src import context as context_lib, context_eval
from fsdp_jax._src import loss as loss_lib
from fsdp_jax._src.config import is_key_dtype
from fsdp_jax._src.loss import LossOutput
from fsdp_jax._src.plan import Plan


class LocalLoss:
  """``loss_fn`` on this device's shards, inside ``jax.shard_map``.

  Called as ``local(params, batch, model_state=None, probes=None, rng=None,
  deltas=None, gates=None) -> LossOutput``, it evaluates ``loss_fn`` on this
  device's batch with every unit gathered right before its first use:

  * ``params``: the stored shards (``state.params``'s local view);
  * ``probes`` (``{leaf_id: zeros}`` or None) are added to the gathered
    leaves: their gradient is the leaf's full, unreduced local gradient
    (used by ``no_sync`` accumulation, and by stateful hooks that cannot
    run in the backward pass);
  * ``rng`` is passed as ``loss_fn(..., rng=rng)`` when ``loss_fn`` accepts
    it;
  * ``deltas`` (stored-layout device zeros for the trainable arrays, or
    None) are added to the device copies CPU offload makes of each unit's
    host arrays at its gather (one unit at a time; the backward re-gather
    copies them again): the gradient with respect to them is the gradient of
    the shards, in device memory;
  * ``gates`` (``{(unit index, group index): (zeros shaped like the group's
    stored local arrays, hook state)}`` or None): a stateful communication
    hook runs in the backward pass, as soon as the group's gradient is
    complete; the gradient with respect to the zeros is the hook's reduced
    shard, the one with respect to the state its new state.

  With mixed precision and ``cast_root_forward_inputs``, floating batch
  leaves are cast to ``param_dtype`` before the loss runs: all of them, or
  only those under the top-level keys in ``forward_inputs`` (PyTorch casts
  the model's forward arguments, not the loss targets). The trace binds
  ``config.data_axis_name`` with the data-parallel world's size and rewrites
  the model's collectives over it to the mesh's data axes. Typed PRNG keys
  in the model state reach ``loss_fn`` as ``fold_in(key, device_index)`` and
  are stored unchanged (``loss_fn`` must return them as it got them).

  Attributes:
    loss_fn: the user's loss, ``loss_fn(params, batch[, model_state][,
      rng=])``.
    plan: the sharding plan.
    forward_inputs: top-level batch keys cast to ``param_dtype`` (None: all).

  ``train`` (default True) is the train step's forward: LoRA's adapters
  apply their dropout; :class:`LocalForward` passes ``train=False``.

  ``loss_fn`` is traced once per input structure; the traces are kept until
  :meth:`reset` (a trace's constants may be values of the enclosing trace,
  so the caller resets at the start of each trace of its own).
  """

  def __init__(self, loss_fn: Callable, plan: Plan, *, forward_inputs=None,
               split_outputs=None, train: bool = True):
    if plan.config.lora is not None:
      # The adapter path: loss_fn sees each target as W + s * A @ B, computed
      # beside the frozen matmul (fsdp_jax._src.adapters); the adapters'
      # dropout only in training (train=False: PEFT's eval mode).
      loss_fn = adapters.wrap_loss(loss_fn, lora=plan.config.lora,
                                   target_names=plan.lora_targets,
                                   base_dtypes=plan.lora_base_dtypes(),
                                   axis_env=plan.axis_env, report=plan.lora_report,
                                   train=train)
    cp = plan.context
    if cp is not None:
      # Each device runs the loss on its chunk of the sequence, positions
      # mixed over the context axis exactly (fsdp_jax._src.context_eval).
      # Under tensor parallelism too: the chunked loss's jaxpr, context
      # collectives included, is what tensor_eval runs on the slices.
      loss_fn = context_eval.wrap_loss(
          loss_fn, dim=cp.dim, split_mask=lambda b: context_lib.split_mask(cp, b),
          axis=plan.axes.context_axes[0], size=plan.axes.context_size,
          axis_env=plan.axis_env, report=context_eval.Report(),
          load_balance=cp.load_balance)
    if plan.config.tensor_parallel is not None:
      # Each device runs the loss on its slices of the split leaves, with
      # Megatron's collectives over the tensor axis (fsdp_jax._src.tensor_eval).
      loss_fn = tensor_eval.wrap_loss(
          loss_fn, full_shapes=tuple(l.shape for l in plan.leaves),
          split_dims=tuple(None if l.tensor_dim is None
                           else len(plan.prefix(plan.units[l.unit])) + l.tensor_dim
                           for l in plan.leaves),
          axis=plan.axes.tensor_axes[0], size=plan.t, axis_env=plan.axis_env,
          report=plan.tensor_report, split_outputs=split_outputs,
          # Sequence parallelism: the norms and residuals split along the
          # sequence over the tensor axis (fsdp_jax._src.tensor_sequence).
          make_ctx=functools.partial(tensor_sequence.SequenceCtx, cp=cp)
          if plan.config.tensor_parallel.sequence_parallel else None)
    self.loss_fn = loss_fn
    self.plan = plan
    self.forward_inputs = loss_lib.check_forward_inputs(forward_inputs)
    self._takes_rng = loss_lib.takes_rng(loss_fn)
    self._with_model_state = plan.model_state_dtypes is not None
    # Under the step's remat: save what mixes parameters with activations
    # (see schedule.placement._saved_if_mixed).
    self._save_mixed = plan.recomputes_cheap_ops
    self._specs = {u.index: plan.gather_specs(u) for u in plan.units}
    # FSDPConfig(activation_checkpointing=...): a jax.checkpoint around each
    # selected unit's computation (schedule.checkpoint_units); checked here.
    self._checkpointing = plan.config.activation_checkpointing
    if self._checkpointing is not None:
      schedule.selected_units(plan, self._checkpointing)
      schedule.check_offload_backend(plan, self._checkpointing)
    self._axis_map = loss_lib.axis_mapping(plan)
    self._traces: dict = {}

  # ---- tracing ------------------------------------------------------------
  def _call(self, params, batch, model_state, rng):
    args = (params, batch) + ((model_state,) if self._with_model_state else ())
    return self.loss_fn(*args, **({"rng": rng} if self._takes_rng else {}))

  def _inputs(self, batch, model_state, rng):
    """``(batch, model state, key)`` as ``loss_fn`` receives them."""
    if self.forward_inputs is not None:
      loss_lib.check_batch_has(batch, self.forward_inputs)
    dtype = self.plan.root_input_dtype
    if dtype is not None:
      batch = loss_lib.cast_floats(batch, dtype, self.forward_inputs)
    if self._takes_rng:
      loss_lib.check_rng(rng)
    key = rng if self._takes_rng else None
    ms = model_state if self._with_model_state else None
    return batch, ms, key

  def _trace(self, batch, ms, key):
    """``loss_fn`` traced for these shapes (cached): ``(closed, out_shape,
    kind)``."""
    plan = self.plan
    structs = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
    args = (structs(batch), structs(ms), structs(key))
    cache_key = (jax.tree.structure(args),
                 tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(args)))
    if cache_key not in self._traces:
      full_structs = jax.tree_util.tree_unflatten(
          plan.treedef, [jax.ShapeDtypeStruct(plan.gathered_shape(l), plan.compute_dtype(l))
                         for l in plan.leaves])
      per_device_bn: list = []
      try:
        with (frameworks.cast_unit_inputs(plan.unit_input_dtypes),
              frameworks.watch_batch_norm(per_device_bn)):
          closed, out_shape = jax.make_jaxpr(self._call, return_shape=True,
                                             axis_env=list(plan.axis_env))(full_structs, *args)
      except NameError as e:
        _explain_axis_error(e, plan)
        raise
      except Exception as e:  # pylint: disable=broad-except  (re-raised, with a hint)
        if frameworks.is_missing_rng_error(e):
          e.add_note(loss_lib.MISSING_RNG_HINT)
        raise
      if plan.lora_report is not None:
        adapters.warn_fallbacks(plan.lora_report)
      draws = loss_lib.constant_key_draws(closed)
      if draws:
        raise ValueError(loss_lib.constant_key_message(draws, self._takes_rng))
      if per_device_bn and plan.axes.world_size > 1:
        warnings.warn(frameworks.per_device_batch_norm_message(per_device_bn, plan),
                      stacklevel=2)
      if self._checkpointing is not None:
        closed = schedule.checkpoint_units(closed, len(plan.leaves), plan,
                                           self._checkpointing, plan.axis_env)
      closed = loss_lib.bind_axis_names(closed, self._axis_map)
      self._traces[cache_key] = (closed, out_shape, self._check_output(out_shape))
    return self._traces[cache_key]

  def _check_output(self, out_shape):
    """What the traced output is (:class:`~fsdp_jax._src.loss.OutputKind`),
    or an error."""
    return loss_lib.check_loss_output(out_shape, self._with_model_state)

  def _prepare(self, batch, model_state, rng):
    """Traces ``loss_fn`` for this batch; returns ``(closed, out_shape,
    kind, the flat non-parameter arguments, key positions)``."""
    batch, ms, key = self._inputs(batch, model_state, rng)
    closed, out_shape, kind = self._trace(batch, ms, key)
    # Typed keys in the model state: each device draws with its own.
    ms_leaves = jax.tree_util.tree_leaves(ms)
    key_pos = [j for j, x in enumerate(ms_leaves) if is_key_dtype(x.dtype)]
    if key_pos:
      index = loss_lib.device_index(self.plan.axes.batch_axes)
      ms_leaves = [jax.random.fold_in(x, index) if j in key_pos else x
                   for j, x in enumerate(ms_leaves)]
    rest = jax.tree_util.tree_leaves(batch) + ms_leaves + jax.tree_util.tree_leaves(key)
    return closed, out_shape, kind, rest, key_pos

  def reset(self) -> None:
    """Forgets the traces of ``loss_fn``."""
    self._traces.clear()

  # ---- evaluation with gathers ---------------------------------------------
  def __call__(self, params, batch, model_state=None, probes=None, rng=None, deltas=None,
               gates=None) -> LossOutput:
    out, closed, out_shape, kind, key_pos = self._evaluate(
        params, batch, model_state, probes, rng, deltas, gates)
    new_ms = None
    if self._with_model_state:
      out, new_ms = out
      ms_start = len(self.plan.leaves) + len(jax.tree_util.tree_leaves(batch))
      new_ms = loss_lib.stored_model_state(model_state, new_ms, key_pos, closed.jaxpr,
                                           out_shape, ms_start)
    loss, aux = out if kind.has_aux else (out, None)
    if kind.weighted:
      return LossOutput(loss.total, aux, new_ms, loss.weight)
    return LossOutput(loss, aux, new_ms)

  def _evaluate(self, params, batch, model_state, probes, rng, deltas, gates):
    """``loss_fn``'s output tree on this device, every unit gathered right
    before its first use; with the trace: ``(output, closed jaxpr, output
    shapes, kind, key positions in the model state)``."""
    plan = self.plan
    n_params = len(plan.leaves)
    closed, out_shape, kind, rest, key_pos = self._prepare(batch, model_state, rng)
    storage = jax.tree_util.tree_leaves(params) if plan.use_orig_params else params
    g = self._gatherer(storage, probes, deltas, gates)
    jaxpr = closed.jaxpr
    lazy = {v: i for i, v in enumerate(jaxpr.invars[:n_params])}
    try:
      outs = schedule.eval_with_gathers(jaxpr, closed.consts, [None] * n_params + rest, lazy, g)
    except NameError as e:
      _explain_axis_error(e, plan)
      raise
    out = jax.tree_util.tree_unflatten(jax.tree.structure(out_shape), outs)
    return out, closed, out_shape, kind, key_pos

  def _gatherer(self, storage, probes, deltas, gates) -> schedule.Gatherer:
    """What :func:`schedule.eval_with_gathers` calls to gather a unit (or one
    layer of a stacked unit) from this device's stored arrays."""
    plan = self.plan

    def on_device(key, x):
      # CPU offload: a unit's stored arrays are copied to the device at its
      # gather, not at the start of the step.
      x = offload.to_device(x)
      return x if deltas is None or deltas.get(key) is None else x + deltas[key]

    def unit_locals(u):
      unit = plan.units[u]
      arrays = ([on_device(i, storage[i]) for i in unit.leaf_ids] if plan.use_orig_params
                else [on_device(unit.flat_key, storage[unit.flat_key])])
      if probes is not None:
        arrays = arrays + [probes[i] for i in unit.leaf_ids if i in probes]
      return arrays

    def gather_arrays(u, arrays):
      unit = plan.units[u]
      n_store = len(unit.leaf_ids) if plan.use_orig_params else 1
      store, extra = arrays[:n_store], arrays[n_store:]
      local_arrays = dict(zip(unit.leaf_ids, store)) if plan.use_orig_params else {"flat": store[0]}
      probe_ids = [i for i in unit.leaf_ids if probes is not None and i in probes]
      probe_of = dict(zip(probe_ids, extra))
      out = {}
      for gi, (group, spec) in enumerate(self._specs[u]):
        vals = collectives.gather(layout.group_locals(plan, group, local_arrays), spec)
        if gates is not None and (u, gi) in gates:
          vals = hook_gate(plan.comm_hook, spec, plan.prefix(unit))(list(vals), *gates[(u, gi)])
        for i, v in zip(group, vals):
          out[i] = v + probe_of[i] if i in probe_of else v
      return out

    # Ignored leaves are read straight from this device's own copy.
    direct = {}
    for l in plan.ignored_leaves:
      key = l.index if plan.use_orig_params else plan.ignored_key(l)
      x = on_device(key, storage[key])[0]
      direct[l.index] = x + probes[l.index] if probes is not None and l.index in probes else x
    return schedule.Gatherer(
        gather_unit=lambda u: gather_arrays(u, unit_locals(u)),
        gather_layer=gather_arrays,
        leaf_unit={l.index: l.unit for l in plan.leaves if not l.ignored},
        direct=direct,
        stacked_units={u.index for u in plan.units if u.stacked},
        unit_layers={u.index: u.num_layers for u in plan.units},
        unit_storage=unit_locals,
        save_mixed=self._save_mixed,
        on_unstacked_scan=lambda ids, length: _warn_unstacked_scan(plan, ids, length),
        loop=plan.loop_prefetch)

  # ---- questions about the loss --------------------------------------------
  def weight(self, batch, model_state=None, rng=None, model_state_changes: bool = False):
    """The weight of a :class:`~fsdp_jax.WeightedLoss`, evaluated alone (no
    gathers: it must not depend on the parameters, nor, with
    ``model_state_changes=True``, on the model state), or None for a mean
    loss."""
    plan = self.plan
    n_params = len(plan.leaves)
    closed, out_shape, kind, rest, _ = self._prepare(batch, model_state, rng)
    if not kind.weighted:
      return None
    # The weight's position among the flat outputs: the second leaf of the
    # WeightedLoss, which comes first in the output.
    flat_shape = jax.tree_util.tree_leaves(out_shape)
    pos = 1
    assert flat_shape[pos].shape == ()
    jaxpr = closed.jaxpr
    uses = loss_lib.needed_inputs(jaxpr, [pos])
    n_batch = len(jax.tree_util.tree_leaves(batch))
    n_ms = len(jax.tree_util.tree_leaves(model_state)) if self._with_model_state else 0
    on_params = sorted(plan.leaves[i].name for i in uses if i < n_params)
    on_state = [i for i in uses if n_params + n_batch <= i < n_params + n_batch + n_ms]
    if on_params:
      raise ValueError(
          f"WeightedLoss.weight depends on the parameters ({', '.join(on_params[:4])}"
          f"{' ...' if len(on_params) > 4 else ''}). The step divides every device's "
          "gradient by the global weight, so the weight must be known before the "
          "gradient and must not depend on the parameters. Fix: compute the weight "
          "from the batch (e.g. a padding mask: weight=jnp.sum(batch['mask'])).")
    if on_state and model_state_changes:
      raise ValueError(
          "WeightedLoss.weight depends on the model state. With "
          "gradient_accumulation_steps > 1 the step needs the weights of all "
          "microbatches before the first gradient, while the model state changes "
          "from one microbatch to the next. Fix: compute the weight from the batch, "
          "or use gradient_accumulation_steps=1.")
    return loss_lib.eval_outputs(jaxpr, closed.consts, [None] * n_params + rest, [pos])[0]

  def traced(self, batch, model_state=None, rng=None):
    """``(closed jaxpr, output shapes, kind)`` of ``loss_fn`` traced on this
    device's inputs (shapes), as the step evaluates it: its inputs are the
    parameter leaves as the gathers return them, then the batch, model
    state and key leaves ``loss_fn`` receives."""
    batch, ms, key = jax.eval_shape(self._inputs, batch, model_state, rng)
    with _compat.classic_tracing():
      return self._trace(batch, ms, key)

  def checkpoints(self, batch, model_state=None, rng=None) -> bool:
    """Whether ``loss_fn``, traced on this device's inputs (shapes), calls
    ``jax.checkpoint`` (``nn.remat``), in any nested computation too."""
    return schedule.has_user_checkpoint(self.traced(batch, model_state, rng)[0])


class LocalForward(LocalLoss):
  """``fn`` on this device's shards for evaluation, inside ``jax.shard_map``:
  its whole output tree, every unit gathered right before its first use
  and freed after its last (nothing is kept for a backward pass, and no
  value is put aside for one).

  Called as ``forward(params, batch, model_state=None, rng=None) ->
  outputs``. ``fn(params, batch[, model_state][, rng=])`` gets the model
  state when the train state holds one and ``fn`` takes a third argument;
  a ``(outputs, new_model_state)`` result (a training loss's) gives
  ``outputs``: evaluation leaves the model state as it is. With LoRA the
  adapter path runs without the adapters' dropout (PEFT's eval mode);
  ``fn``'s own ``rng`` is still passed. Under tensor
  parallelism the outputs ``split_outputs``
  (:class:`~fsdp_jax._src.tensor_eval.SplitOutputs`) keeps split are this
  device's slices.
  """

  def __init__(self, fn: Callable, plan: Plan, *, forward_inputs=None, split_outputs=None):
    super().__init__(fn, plan, forward_inputs=forward_inputs, split_outputs=split_outputs,
                     train=False)
    self._with_model_state = (plan.model_state_dtypes is not None
                              and loss_lib.takes_model_state(fn))
    self._save_mixed = False
    self._checkpointing = None  # no backward pass: nothing to recompute
    self._ms_def = None

  def _trace(self, batch, ms, key):
    self._ms_def = jax.tree.structure(ms)
    return super()._trace(batch, ms, key)

  def _check_output(self, out_shape) -> bool:
    """Whether the output is ``(outputs, new_model_state)``."""
    return (self._with_model_state and isinstance(out_shape, (tuple, list))
            and len(out_shape) == 2 and jax.tree.structure(out_shape[1]) == self._ms_def)

  def __call__(self, params, batch, model_state=None, rng=None):
    out, _, _, drop_state, _ = self._evaluate(params, batch, model_state, None, rng, None,
                                              None)
    return out[0] if drop_state else out

  def output_shape(self, batch, model_state=None, rng=None):
    """The outputs' shapes on this device's inputs (shapes), as
    :meth:`__call__` returns them."""
    batch, ms, key = jax.eval_shape(self._inputs, batch, model_state, rng)
    _, out_shape, drop_state = self._trace(batch, ms, key)
    return out_shape[0] if drop_state else out_shape


def hook_gate(hook, spec, prefix):
  """``gate(vals, zeros, state) -> vals``, whose backward runs the stateful
  ``hook`` on the group's full gradient (the cotangent of ``vals``) and
  returns its reduced shard as the cotangent of ``zeros`` and its new state
  as the cotangent of ``state``: the hook runs where the default reduction
  would, so no unit's full gradient outlives its backward computation."""

  @jax.custom_vjp
  def gate(vals, zeros, state):
    del zeros, state
    return vals

  def fwd(vals, zeros, state):
    del zeros
    return vals, state

  def bwd(state, cts):
    full = collectives.pack_full(list(cts), spec, prefix)
    reduced, new_state = collectives.call_hook(hook, state, full, spec)
    reduced = collectives.split_rows(
        collectives.finish_gradient(reduced, spec, spec.stored_dtype), spec)
    new_state = jax.tree.map(lambda n, o: jnp.asarray(n).astype(o.dtype), new_state, state)
    return None, reduced, new_state

  gate.defvjp(fwd, bwd)
  return gate


def _explain_axis_error(e: NameError, plan: Plan) -> None:
  name = loss_lib.unbound_axis_name(e)
  if name is not None:
    raise NameError(loss_lib.explain_unbound_axis(name, plan)) from e


def _warn_unstacked_scan(plan: Plan, leaf_ids, length: int) -> None:
  by_unit: dict = {}
  for i in leaf_ids:
    by_unit.setdefault(plan.units[plan.leaves[i].unit].display_name, []).append(
        plan.leaves[i].name)
  for unit, names in by_unit.items():
    warnings.warn(frameworks.scan_over_unit_message(names, length, unit), stacklevel=2)
