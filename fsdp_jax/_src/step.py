"""``shard_train_step``: a jitted FSDP train step for any JAX loss function."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fsdp_jax._src import _compat
from fsdp_jax._src import grads as grads_lib
from fsdp_jax._src import loss as loss_lib
from fsdp_jax._src import clipping, offload, optim
from fsdp_jax._src import context as context_lib
from fsdp_jax._src.config import FSDPConfig, is_float_dtype, value_key
from fsdp_jax._src import mesh as mesh_lib
from fsdp_jax._src import plan as plan_lib
from fsdp_jax._src.local_loss import LocalLoss
from fsdp_jax._src.plan import Plan
from fsdp_jax._src.state import ShardedTrainState


def check_batch(plan: Plan, batch) -> None:
  """Every batch leaf is split along dim 0 over the data-parallel world.

  A leaf whose leading dimension the data-parallel size does not divide is an
  error naming every such leaf (path, shape), the mesh axes and their sizes,
  and the fix, like ``jax.shard_map``'s own check.
  """
  world = plan.axes.batch_size
  axes = plan.axes.batch_axes
  if plan.context is not None:
    context_lib.check_batch(plan.context, plan.axes.context_size, batch)
  bad = []
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    shape = np.shape(x)
    name = jax.tree_util.keystr(path) or "batch"
    if len(shape) == 0:
      raise ValueError(
          f"Batch leaf {name} is a scalar; every batch leaf needs a leading "
          f"batch dimension to split over the data-parallel mesh axes {axes} "
          f"(size {world}). Put per-step constants in the loss function instead.")
    if shape[0] % world:
      bad.append((name, tuple(shape)))
  if not bad:
    return
  where = f"the data-parallel size {world} (mesh axes {axes} of sizes {dict(plan.mesh.shape)})"
  fix = (f"Fix: use a global batch size that is a multiple of {world}, e.g. "
         f"{-(-bad[0][1][0] // world) * world}.")
  if len(bad) == 1:
    name, shape = bad[0]
    raise ValueError(
        f"Batch leaf {name} has shape {shape}: its leading dimension "
        f"{shape[0]} is not divisible by {where}. {fix}")
  lines = "\n".join(
      f"  * {name} of shape {shape}: leading dimension {shape[0]} "
      f"(nearest multiple {-(-shape[0] // world) * world})" for name, shape in bad)
  raise ValueError(
      f"{len(bad)} batch leaves have a leading dimension that is not divisible by "
      f"{where}:\n{lines}\n{fix}")


def check_setup(mesh: Mesh, config: FSDPConfig) -> None:
  """What a step can check once its mesh and config are known: the backend
  supports offload."""
  if offload.offloads(config):
    offload.check_backend(mesh)


def _config_diff(state_cfg: FSDPConfig, step_cfg: FSDPConfig) -> str:
  """The fields in which two configs differ, one line each."""
  lines = [f"  {f.name}: state {getattr(state_cfg, f.name)!r}, step {getattr(step_cfg, f.name)!r}"
           for f in dataclasses.fields(FSDPConfig)
           if value_key(getattr(state_cfg, f.name)) != value_key(getattr(step_cfg, f.name))]
  return "\n".join(lines)


def _layout_diff(want, got) -> str:
  """How the optimizer state ``want`` (what the step's optimizer makes) and
  ``got`` (what the state holds) differ, one line each: the slots (subtrees
  mirroring the parameters, like Adam's ``0.mu``) only one has, and the
  other leaves only one has or that differ in shape (at most 8 of each)."""
  if want is None or got is None:
    return f"  the state holds {'no sharded optimizer state' if got is None else 'another kind'}"
  lines = []
  mine, theirs = want.slot_names, got.slot_names
  for label, slots in (("slots only in optimizer.init(params)", [x for x in mine
                                                                  if x not in theirs]),
                       ("slots only in the state", [x for x in theirs if x not in mine])):
    if slots:
      lines.append(f"  {label}: {', '.join(slots)} (one leaf per parameter)")
  mine = {e.path: e.shape for e in want.entries if e.kind != "slot"}
  theirs = {e.path: e.shape for e in got.entries if e.kind != "slot"}
  for label, paths in (
      ("shape differs", [p for p in mine if p in theirs and mine[p] != theirs[p]]),
      ("only in optimizer.init(params)", [p for p in mine if p not in theirs]),
      ("only in the state", [p for p in theirs if p not in mine])):
    for p in paths[:8]:
      shapes = (f"{mine.get(p)} in optimizer.init(params), {theirs.get(p)} in the state"
                if label == "shape differs" else str(mine.get(p, theirs.get(p))))
      lines.append(f"  {label}: {p or '(root)'} {shapes}")
    if len(paths) > 8:
      lines.append(f"  ... and {len(paths) - 8} more {label}")
  if not lines:  # the same leaves in another arrangement
    lines.append(f"  tree structure: {want.treedef} in optimizer.init(params), {got.treedef} "
                 "in the state")
  return "\n".join(lines)


def _check_state(state, plan_cfg: Optional[FSDPConfig], mesh: Optional[Mesh], optimizer):
  if not isinstance(state, ShardedTrainState):
    raise TypeError("step(state, batch) needs the ShardedTrainState built by "
                    f"fsdp_jax.init_train_state; got {type(state).__name__}.")
  plan = state.plan
  plan_cfg = plan.config if plan_cfg is None else plan_cfg
  mesh = plan.mesh if mesh is None else mesh
  if plan.config != plan_cfg:
    raise ValueError(
        "The state was built with a different FSDPConfig than this step; the fields that "
        f"differ:\n{_config_diff(plan.config, plan_cfg)}\nFix: pass the same config to "
        "init_train_state and shard_train_step, or leave config out of shard_train_step "
        "(it then takes the state's).")
  if plan.mesh != mesh:
    raise ValueError(
        f"The state lives on mesh {dict(plan.mesh.shape)} (devices "
        f"{[d.id for d in plan.mesh.devices.flat]}) but the step was built for "
        f"mesh {dict(mesh.shape)} (devices {[d.id for d in mesh.devices.flat]}). "
        "Pass the same mesh to init_train_state and shard_train_step.")
  if optimizer is None:
    if plan.optimizer is None:
      raise ValueError(
          "shard_train_step(loss_fn) takes the optimizer from the state, but this state "
          "records none. Fix: pass it, shard_train_step(loss_fn, optimizer), or build the "
          "state with fsdp_jax.init_train_state(optimizer=...).")
    optimizer = plan.optimizer
  lay = optim.layout_for(plan, optimizer)
  got = getattr(state.opt_state, "layout", None)
  if got != lay:
    raise ValueError(
        "The optimizer state does not match this optimizer and the params; the leaves "
        f"that differ:\n{_layout_diff(lay, got)}\nFix: build the state with the optimizer "
        "you pass to shard_train_step, or leave it out of shard_train_step (it then takes "
        "the state's).")
  return optim.stored_specs(plan, lay)


def shard_train_step(loss_fn: Callable[..., Any],
                     optimizer: Optional[optax.GradientTransformation] = None, *,
                     mesh: Optional[Mesh] = None, config: Optional[FSDPConfig] = None,
                     max_norm: Optional[float] = None,
                     norm_type: float = 2.0, gradient_accumulation_steps: int = 1,
                     accumulation: str = "no_sync", forward_inputs=None,
                     donate: bool = True):
  """Builds a jitted FSDP train step ``step(state, batch) -> (state, metrics)``.

  ``loss_fn(params, batch)`` is any pure JAX function of the **full, original**
  parameter tree and the device-local batch (a Flax linen ``model.apply``, an
  NNX model through ``nnx.merge``, an equinox model through ``eqx.combine``,
  or a plain function). The contract (docs/models.md shows each case):

  * **returns** the mean loss over the device's batch, or
    :class:`~fsdp_jax.WeightedLoss` ``(total=sum(loss * w), weight=sum(w))``
    for a weighted mean over the *global* batch (the step reports and
    differentiates ``psum(total) / psum(weight)``), either one alone or as
    ``(loss, aux)``;
  * **model state**: when the state holds model state
    (``init_train_state(model_state=...)``, or a Flax/NNX model's own
    collections), it is called as ``loss_fn(params, batch, model_state)`` and
    returns ``(loss, new_model_state)`` or ``((loss, aux), new_model_state)``;
    floating new model state is averaged over the data-parallel world;
  * **rng**: if ``loss_fn`` accepts a keyword argument ``rng``, it gets
    ``fold_in(fold_in(state.rng, state.step), device_index)`` (needs
    ``init_train_state(rng=...)``), different on every step and device and
    the same in every run and after a restore; with gradient accumulation
    microbatch ``m`` gets ``fold_in(that key, m)``;
  * **axis names**: collectives over the mesh axes (``"shard"``,
    ``"replicate"``) or over ``config.data_axis_name`` (e.g. ``"batch"`` for
    ``nn.BatchNorm(axis_name="batch")``, meaning the whole data-parallel
    world) work inside it;
  * **batch check**: a ``loss_fn`` with a ``check_batch`` attribute (a
    family bundle's, ``fsdp_jax.models``) has ``loss_fn.check_batch(batch)``
    called on each global batch before it is placed on the mesh, where its
    values are still readable (e.g. token ids inside the vocabulary); it
    raises on bad input (``shard_eval_step`` does the same with its ``fn``).

  Inside the step, which runs under ``jax.shard_map`` over ``mesh``:

  1. each unit is all-gathered (in ``param_dtype``) right before the first
     operation that reads it; FULL_SHARD/HYBRID_SHARD free it after forward
     and re-gather it in backward, SHARD_GRAD_OP/_HYBRID_SHARD_ZERO2 keep it;
     a stacked unit scanned over is gathered one layer per iteration;
  2. each unit's gradient is reduce-scattered (``psum_scatter``) in
     ``reduce_dtype`` and averaged over the data-parallel world with PyTorch's
     pre/post divide factors (or reduced by ``config.comm_hook``); HYBRID adds
     an all-reduce over ``"replicate"``, NO_SHARD all-reduces;
  3. optionally the gradients are clipped (``max_norm``, PyTorch's
     ``clip_grad_norm_``);
  4. ``optimizer.update`` runs on the local shards of the trainable params.

  With ``config.cpu_offload=CPUOffload(offload_params=True)`` the state's
  params and optimizer state are in host memory (``pinned_host``): each
  unit's parameter shards are copied to the device at its gather in step 1
  (again at a backward re-gather), the reduced (and
  clipped, which needs collectives and stays on the device) gradient shards
  are moved to the host, and step 4 (``optimizer.update`` and
  ``optax.apply_updates``) runs on the host (``compute_on("device_host")``),
  so the new params and optimizer state are written in host memory.

  Args:
    loss_fn: ``loss_fn(params, batch[, model_state][, rng=key])`` as above.
    optimizer: the optax optimizer; default: the one the state was built
      with (``init_train_state(optimizer=...)``), read when the step is
      called. When given, the state's optimizer state must have its layout
      (``optimizer.init(params)``'s leaves), else the step raises a
      ``ValueError`` naming the leaves that differ. Any optax optimizer gives
      the result of unsharded training (see docs/optimizers.md); for
      clipping by the global norm, ``max_norm`` is the cheaper way.
    mesh: the mesh the state lives on; default: the state's
      (``state.plan.mesh``), read when the step is called.
    config: the :class:`FSDPConfig` the state was built with; default: the
      state's (``state.plan.config``). When given, ``mesh`` and ``config`` must
      equal the state's (by value: a config built separately from the same
      options is the same config), else the step raises a ``ValueError``
      naming both.
    max_norm: clip gradients to this total norm (``None``: no clipping).
    norm_type: the p of the norm (``2.0``, any ``p > 0``, or ``inf``).
    gradient_accumulation_steps: split each device's batch into this many
      microbatches and accumulate their gradients before one update.
    accumulation: ``"no_sync"`` (accumulate full local gradients, reduce once:
      PyTorch's ``no_sync()``) or ``"sharded"`` (reduce-scatter every
      microbatch into a sharded accumulator; less memory).
    forward_inputs: top-level batch keys that are the model's forward inputs.
      Under ``MixedPrecision(cast_root_forward_inputs=True)`` only their
      floating leaves are cast to ``param_dtype`` (PyTorch casts the model's
      arguments, not the loss targets); default: every floating batch leaf.
    donate: donate the input state's buffers to the output (default True).

  Returns:
    A :class:`TrainStep`, called as ``step(state, batch) -> (state, metrics)``;
    ``metrics["loss"]`` is the global mean loss, ``metrics["aux"]`` the aux
    output averaged over the data-parallel world, ``metrics["grad_norm"]`` the
    global (pre-clip) gradient norm, ``metrics["nonfinite"]`` whether it or
    the loss is NaN/Inf (see ``FSDPConfig.nonfinite``).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
    >>> cfg = fsdp_jax.FSDPConfig()
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
    >>> opt = optax.adam(1e-2)
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.zeros((3, 1))},
    ...     optimizer=opt, mesh=mesh, config=cfg)
    >>> step = fsdp_jax.shard_train_step(loss_fn)  # the state's optimizer, mesh and config
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.ones((8, 1))}
    >>> state, metrics = step(state, batch)
    >>> float(metrics["loss"])
    1.0
  """
  if not callable(loss_fn):
    raise TypeError("loss_fn must be callable as loss_fn(params, batch).")
  if optimizer is not None:
    optimizer = optim.as_transformation(optimizer)
  if config is not None and not isinstance(config, FSDPConfig):
    raise TypeError(f"config must be a fsdp_jax.FSDPConfig, got {type(config).__name__}.")
  if mesh is not None and not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh (e.g. fsdp_jax.make_mesh(...)), "
                    f"got {type(mesh).__name__}.")
  if max_norm is not None and not float(max_norm) > 0:
    raise ValueError(f"max_norm={max_norm} must be positive (or None for no clipping).")
  if mesh is not None and config is not None:
    check_setup(mesh, config)

  forward_inputs = loss_lib.check_forward_inputs(forward_inputs)

  def step(state: ShardedTrainState, batch):
    opt_specs = _check_state(state, config, mesh, optimizer)
    plan = state.plan
    opt = plan.optimizer if optimizer is None else optimizer
    mesh_ = plan.mesh if mesh is None else mesh
    check_batch(plan, batch)
    if gradient_accumulation_steps > 1:
      grads_lib.check_microbatches(
          local_shapes(plan, batch), gradient_accumulation_steps)
    p_specs = plan_lib.param_specs(plan)
    b_specs = plan_lib.batch_specs(plan, batch)
    ms_specs = jax.tree.map(lambda _: P(), state.model_state)
    rng_specs = jax.tree.map(lambda _: P(), state.rng)
    h_specs = jax.tree.map(lambda _: plan_lib.hook_state_spec(plan), state.comm_hook_state)
    vg = grads_lib.value_and_grad(loss_fn, plan=plan,
                                  gradient_accumulation_steps=gradient_accumulation_steps,
                                  accumulation=accumulation,
                                  forward_inputs=forward_inputs)
    data_axes = plan.axes.data_axes
    offloaded = plan.offloaded

    mode = plan.opt_update.mode if plan.opt_update is not None else "sharded"
    policy = plan.nonfinite
    own_grads = any(l.ignored and not l.frozen for l in plan.leaves)

    def body(params, opt_state, model_state, hook_state, batch_local, rng, step_count):
      # With CPU offload the stored shards are in host memory: each unit's
      # gather reads a device copy of its own shards (local_loss.LocalLoss).
      key = None if rng is None else jax.tree.map(
          lambda r: loss_lib.device_key(r, step_count, plan.axes.batch_axes), rng)
      out, grads, new_hook_state = vg(params, batch_local, model_state, hook_state, key)
      if out.weight is None:
        loss = jax.lax.pmean(out.loss.astype(jnp.float32), data_axes)
      else:  # a WeightedLoss: already the global ratio, the same on every device
        loss = out.loss
      metrics = {"loss": loss}
      if max_norm is not None:
        # Clipping sums over the shards (a collective): it runs on the device.
        grads, norm = clipping.clip_grad_norm(grads, plan=plan, max_norm=max_norm,
                                               norm_type=norm_type)
      else:
        norm = clipping.grad_norm(grads, plan=plan)
      metrics["grad_norm"] = norm
      bad = ~(jnp.isfinite(norm.astype(jnp.float32)) & jnp.isfinite(loss))
      if own_grads:
        # Ignored parameters' gradients are per device: agree on the flag.
        bad = jax.lax.pmax(bad.astype(jnp.int32), data_axes).astype(bool)
      metrics["nonfinite"] = bad
      if policy == "raise":
        metrics["nonfinite_leaves"] = clipping.nonfinite_leaves(grads, plan=plan)
      trainable, frozen = plan_lib.split_trainable(plan, params)
      if mode == "global":
        # The optimizer runs after shard_map, on the global view.
        new_trainable, new_opt_state = grads, opt_state
      elif offloaded:
        # The gradient shards go to the host and the optimizer runs there,
        # writing the new params and optimizer state in host memory.
        # The gradient shards travel as 1-D arrays: XLA may give a matmul's
        # gradient a column-major layout on the device, and the GPU compiler
        # refuses a host computation whose operand layout differs from its
        # parameter's (jax 0.11.2 on an H100: "expects the async shape ... to
        # match"). A 1-D array has one layout; the host reshapes it back.
        flat_grads, grads_def = jax.tree.flatten(grads)
        grad_shapes = [g.shape for g in flat_grads]
        grads = offload.to_host([g.reshape(-1) for g in flat_grads])
        index, value, keep = offload.to_host((optim.shard_index(plan), loss, bad))

        def host_update(g, s, t, i, v, k):
          g = grads_def.unflatten([x.reshape(shape) for x, shape in zip(g, grad_shapes)])
          new_t, new_s = optim.update_local(plan, opt, g, s, t, value=v, index=i,
                                            host=True)
          if policy != "propagate":
            new_t, new_s = _keep_if(k, (t, s), (new_t, new_s))
          return new_t, new_s

        new_trainable, new_opt_state = _compat.on_host(host_update)(
            grads, opt_state, trainable, index, value, keep)
        # Leaves the host computation may leave in device memory (a step
        # count made from a constant) are stored on the host too.
        new_trainable, new_opt_state = offload.to_host((new_trainable, new_opt_state))
      else:
        new_trainable, new_opt_state = optim.update_local(plan, opt, grads, opt_state,
                                                          trainable, value=loss)
        if policy != "propagate":
          new_trainable, new_opt_state = _keep_if(bad, (trainable, opt_state),
                                                  (new_trainable, new_opt_state))
      new_params = plan_lib.merge_trainable(plan, new_trainable, frozen)
      if out.aux is not None:
        metrics["aux"] = jax.tree.map(
            lambda a: jax.lax.pmean(jnp.asarray(a, jnp.float32), data_axes), out.aux)
      new_ms = model_state
      if out.model_state is not None:
        # Model state stays replicated: floating values (e.g. batch-norm
        # statistics of each device's batch) are averaged over the world.
        new_ms = jax.tree.map(
            lambda new, old: (jax.lax.pmean(new, data_axes).astype(old.dtype)
                              if is_float_dtype(old.dtype) else loss_lib.as_stored_dtype(new, old)),
            out.model_state, model_state)
      if policy != "propagate":
        new_ms, new_hook_state = _keep_if(bad, (model_state, hook_state),
                                          (new_ms, new_hook_state))
      return new_params, new_opt_state, new_ms, new_hook_state, metrics

    fn = jax.shard_map(body, mesh=mesh_,
                       in_specs=(p_specs, opt_specs, ms_specs, h_specs, b_specs, rng_specs, P()),
                       out_specs=(p_specs, opt_specs, ms_specs, h_specs, P()),
                       check_vma=False)
    new_params, new_opt_state, new_ms, new_hook, metrics = fn(
        state.params, state.opt_state, state.model_state, state.comm_hook_state, batch,
        state.rng, state.step)
    bad = metrics["nonfinite"]
    if mode == "global":
      grads = plan_lib.split_trainable(plan, new_params)[0]
      trainable, frozen = plan_lib.split_trainable(plan, state.params)
      new_trainable, new_opt_state = optim.update_global(
          plan, opt, grads, state.opt_state, trainable, value=metrics["loss"])
      if policy != "propagate":
        new_trainable, new_opt_state = _keep_if(bad, (trainable, state.opt_state),
                                                (new_trainable, new_opt_state))
      new_params = plan_lib.merge_trainable(plan, new_trainable, frozen)
    changes = dict(step=state.step + 1, params=new_params, opt_state=new_opt_state,
                   model_state=new_ms, comm_hook_state=new_hook)
    if policy != "propagate":
      changes["step"] = state.step + jnp.where(bad, 0, 1).astype(state.step.dtype)
    if state.nonfinite_steps is not None:
      changes["nonfinite_steps"] = state.nonfinite_steps + bad.astype(state.nonfinite_steps.dtype)
    return state.replace(**changes), metrics

  def checkpoints(state: ShardedTrainState, batch) -> bool:
    plan = state.plan
    local = local_shapes(plan, batch, gradient_accumulation_steps)
    raw = LocalLoss(loss_fn, plan, forward_inputs=forward_inputs)
    return raw.checkpoints(local, state.model_state, state.rng)

  return TrainStep(step, donate=donate, mesh=mesh, config=config, checkpoints=checkpoints,
                   batch_check=getattr(loss_fn, "check_batch", None))


def local_shapes(plan: Plan, batch, microbatches: int = 1):
  """Each device's batch leaves as shapes: dim 0 over the data-parallel
  devices (and microbatches), a context-split leaf's sequence over the
  context axis."""
  flat, treedef = jax.tree.flatten(batch)
  cp = plan.context
  split = context_lib.split_mask(cp, batch) if cp is not None else [False] * len(flat)
  out = []
  for x, s in zip(flat, split):
    shape = list(np.shape(x))
    shape[0] //= plan.axes.batch_size * microbatches
    if s:
      shape[cp.dim] //= plan.axes.context_size
    out.append(jax.ShapeDtypeStruct(tuple(shape), x.dtype))
  return jax.tree.unflatten(treedef, out)


def _keep_if(flag, old, new):
  """``old`` where the scalar ``flag`` is set, else ``new`` (bitwise, leaf by
  leaf; a scalar predicate, so nothing is broadcast)."""
  return jax.tree.map(lambda o, n: jax.lax.select(flag, o, n), old, new)


class NonFiniteError(FloatingPointError):
  """A step's gradient norm or loss was not finite under
  ``FSDPConfig(nonfinite="raise")``. ``error.state`` is the train state as
  it was before the step (the update was not applied); ``error.step`` the
  step's index; ``error.parameters`` the names of the parameters whose
  gradients were not finite.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> config = fsdp_jax.FSDPConfig(nonfinite="raise")
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=config)
    >>> step = fsdp_jax.shard_train_step(lambda p, b: jnp.mean(jnp.sqrt(b["x"] @ p["w"])),
    ...     optax.sgd(0.1), mesh=mesh, config=config)
    >>> try:
    ...   step(state, {"x": -jnp.ones((2, 4))})  # sqrt of a negative number
    ... except fsdp_jax.NonFiniteError as e:
    ...   print(e.step, e.parameters, int(e.state.step))
    0 ['w'] 0
  """

  def __init__(self, message, *, state, step, parameters):
    super().__init__(message)
    self.state = state
    self.step = step
    self.parameters = parameters


def _raise_nonfinite(state, metrics):
  plan = state.plan
  names = [l.name for l in plan.leaves if not l.frozen]
  flags = np.asarray(jax.device_get(metrics.pop("nonfinite_leaves")))
  bad = [n for n, f in zip(names, flags) if f]
  step = int(jax.device_get(state.step))
  where = (f"the first parameter whose gradient is not finite is {bad[0]!r}"
           + (f" (of {len(bad)}: {', '.join(bad[:6])}{', ...' if len(bad) > 6 else ''})"
              if len(bad) > 1 else "")) if bad else (
               "every parameter's gradient is finite, so the loss "
               f"({float(jax.device_get(metrics['loss']))}) or the norm overflowed")
  raise NonFiniteError(
      f"Step {step}: non-finite gradients (grad_norm "
      f"{float(jax.device_get(metrics['grad_norm']))}); {where}. The update was not applied: "
      "error.state is the train state as it was before this step. Fix: check the batch "
      "and the loss for NaN/Inf, lower the learning rate, or pass "
      "FSDPConfig(nonfinite='skip') to skip such steps and count them "
      "(state.nonfinite_steps).", state=state, step=step, parameters=bad)


def _row_blocks(plan: Plan) -> tuple:
  """Multi-process: ``(blocks, world)``: which of the global batch's
  ``world`` equal row blocks (one per data-parallel rank along dim 0; the
  context axis splits the sequence, not the rows) this process's devices
  hold, in order."""
  world = plan.axes.batch_size
  sharding = NamedSharding(plan.mesh, plan_lib.data_spec(plan))
  idx = sharding.addressable_devices_indices_map((world,))
  return sorted({s[0].indices(world)[0] for s in idx.values()}), world


def check_local_batch(plan: Plan, batch) -> None:
  """Multi-process: this process's part of the batch splits evenly over its
  data-parallel devices, and every process passes a part of the same size.
  Under context parallelism each process passes whole sequences (the step
  keeps its devices' chunks), so the sequence checks are those of one
  process's global batch, and processes holding the same rows (a context
  group over several processes) must pass the same values."""
  blocks, world = _row_blocks(plan)
  mine = len(blocks)
  flat = jax.tree_util.tree_flatten_with_path(batch)[0]
  names = [jax.tree_util.keystr(path) or "batch" for path, _ in flat]
  fingerprints, split = [], []
  if plan.context is not None:
    context_lib.check_batch(plan.context, plan.axes.context_size, batch)
    split = [n for n, s in zip(names, context_lib.split_mask(plan.context, batch)) if s]
    fingerprints = [-1 if isinstance(x, jax.Array) and not x.is_fully_addressable
                    else zlib.crc32(np.ascontiguousarray(np.asarray(x)).tobytes())
                    for (_, x), s in zip(flat, context_lib.split_mask(plan.context, batch)) if s]
  rows = []
  for (_, x), name in zip(flat, names):
    shape = np.shape(x)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      rows.append(-1)
      continue
    if len(shape) == 0 or shape[0] % mine:
      raise ValueError(
          f"Process {jax.process_index()}: local batch leaf {name} has shape {tuple(shape)}; "
          f"with {jax.process_count()} processes each process passes its own part of the "
          f"global batch, split over its {mine} data-parallel devices (of {world}), so its "
          f"leading dimension must be a multiple of {mine}, e.g. "
          f"{max(1, -(-(shape[0] if shape else 1) // mine)) * mine}.")
    rows.append(shape[0])
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  g = multihost_utils.process_allgather(np.asarray(rows + [blocks[0]] + fingerprints,
                                                   np.int64))
  sizes, first, prints = g[:, :len(rows)], g[:, len(rows)], g[:, len(rows) + 1:]
  if (sizes != sizes[0]).any():
    raise ValueError(
        "step(state, batch): the processes passed local batches of different sizes "
        f"(rows per leaf, per process: { {p: sizes[p].tolist() for p in range(g.shape[0])} }). "
        "Each process must pass an equal part of the global batch.")
  for p in range(g.shape[0]):
    for q in range(p):
      differ = [n for n, a, b in zip(split, prints[p], prints[q]) if a != b]
      if first[p] == first[q] and differ:
        raise ValueError(
            f"step(state, batch): processes {q} and {p} hold the same rows of the batch "
            f"(their devices share context groups of the 'context' axis, size "
            f"{plan.axes.context_size}) but passed different values for {', '.join(differ)}. "
            "Under context parallelism each process passes the rows its devices hold with "
            "their whole sequences (the step keeps each device's chunk), so the processes "
            "of one context group pass the same arrays. Fix: pass the same rows on these "
            "processes (all of the global batch's when no other axis splits it, e.g. "
            "make_mesh(context=C) alone), whole sequences, not each process's part of them.")


def place_batch(plan: Plan, batch):
  """Puts a batch on the mesh, split along dim 0 over the data axes.

  With one process, host arrays are transferred (and global ``jax.Array`` s
  passed through). With several processes (``jax.distributed``), each process
  passes its own part of the global batch, in process order, and the global
  array is assembled from the parts (``jax.make_array_from_process_local_data``).
  Under context parallelism a process passes the rows its devices hold with
  their **whole** sequences, as torchtitan's ranks of one context group load
  the same batch: the processes of a context group that spans processes
  pass the same rows, and each device takes its chunk of them.
  """
  multi = jax.process_count() > 1
  devices = set(plan.mesh.devices.flat)
  seq_dim = plan.context.dim if plan.context is not None else None
  rows = _row_blocks(plan) if multi and seq_dim is not None else None

  def place(x, spec):
    sharding = NamedSharding(plan.mesh, spec)
    if isinstance(x, jax.ShapeDtypeStruct):  # lowering on shapes alone
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding or sharding)
    if isinstance(x, jax.Array) and (not multi or not x.is_fully_addressable):
      # A one-process array on other devices (made under a user's
      # jax.set_mesh(other_mesh)) moves to the mesh.
      elsewhere = not multi and x.committed and x.sharding.device_set != devices
      return jax.device_put(x, sharding) if elsewhere else x
    if multi:
      x = np.asarray(x)
      if rows is not None and len(spec) > seq_dim and spec[seq_dim] is not None:
        # The sequence dimension given whole: each device looks its chunk up.
        shape = (x.shape[0] * rows[1] // len(rows[0]),) + x.shape[1:]
        return jax.make_array_from_process_local_data(sharding, x, shape)
      return jax.make_array_from_process_local_data(sharding, x)
    return jax.device_put(x, sharding)

  return jax.tree.map(place, batch, plan_lib.batch_specs(plan, batch))


def place_checked(plan: Plan, batch, checked_shapes=None, batch_check=None):
  """Checks the batch and puts it on the mesh (:func:`place_batch`):
  ``(placed batch, batch shapes checked)``. With several processes the
  check is a collective, run once per batch shapes (``checked_shapes``: the
  shapes checked before). ``batch_check``: the loss's own check of the
  batch's values (``loss_fn.check_batch``), or None."""
  if jax.process_count() == 1:
    check_batch(plan, batch)
  else:
    shapes = jax.tree.map(np.shape, batch)
    if checked_shapes != shapes:
      check_local_batch(plan, batch)
      checked_shapes = shapes
  if batch_check is not None:
    batch_check(batch)
  return place_batch(plan, batch), checked_shapes


class TrainStep:
  """The step returned by :func:`shard_train_step`.

  ``step(state, batch)`` places the batch on the mesh (assembling per-process
  parts in multi-process runs) and runs the jitted step. ``step.lower(state,
  batch)`` lowers it for inspection (``.compile().as_text()``,
  ``.compile().memory_analysis()``); ``step.jitted`` is the ``jax.jit``
  function itself, taking global arrays.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> step = fsdp_jax.shard_train_step(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
    ...     optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> state, metrics = step(state, {"x": jnp.ones((2, 4))})
    >>> float(metrics["loss"]), int(state.step)
    (16.0, 1)
  """

  def __init__(self, fn: Callable, *, donate: bool, mesh: Optional[Mesh],
               config: Optional[FSDPConfig], compiler_options: Optional[dict] = None,
               checkpoints: Optional[Callable] = None, batch_check: Optional[Callable] = None):
    self._fn = fn
    self._batch_check = batch_check  # loss_fn.check_batch, or None
    # checkpoints(state, batch) -> whether the loss calls jax.checkpoint
    self._checkpoints = checkpoints
    self._donate = donate
    self.mesh = mesh  # None: the state's
    self.config = config  # None: the state's
    # None: fsdp_jax.custom.compiler_options(mesh) (benchmarks pass others)
    self._compiler_options = compiler_options
    self._by_mesh: dict = {}  # mesh -> TopLevelJit
    self._checked_shapes = None
    self._checked_setup = mesh is not None and config is not None

  def _jit(self, mesh: Optional[Mesh]):
    """The ``jax.jit`` of the step, compiled with the mesh's options."""
    if mesh not in self._by_mesh:  # else a dict lookup per step
      if self._compiler_options is not None:
        opts = self._compiler_options
      else:  # read at the first top-level call
        opts = lambda state, batch, *_, **__: mesh_lib.compiler_options(
            mesh if mesh is not None else state.plan.mesh,
            checkpointed=self._checkpointed(state, batch))
      self._by_mesh[mesh] = mesh_lib.TopLevelJit(
          self._fn, opts, donate_argnums=(0,) if self._donate else ())
    return self._by_mesh[mesh]

  def _checkpointed(self, state, batch) -> bool:
    """Whether the loss calls ``jax.checkpoint`` (True when it cannot be
    told: the options that keep a checkpointed model's memory down)."""
    if self._checkpoints is None:
      return True
    try:
      return bool(self._checkpoints(state, batch))
    except Exception:  # pylint: disable=broad-except  (the step's own trace reports it)
      return True

  def _with_compiler_options(self, compiler_options: dict) -> "TrainStep":
    """The same step compiled with other XLA options (for measurements)."""
    return TrainStep(self._fn, donate=self._donate, mesh=self.mesh, config=self.config,
                     compiler_options=dict(compiler_options), checkpoints=self._checkpoints,
                     batch_check=self._batch_check)

  @property
  def jitted(self):
    """The ``jax.jit`` function (taking global arrays), compiled with
    :func:`fsdp_jax.custom.compiler_options` for the step's mesh (called
    inside your own ``jax.jit``, that one's options apply)."""
    return self._jit(self.mesh)

  def _place(self, state, batch):
    if not isinstance(state, ShardedTrainState):
      raise TypeError("step(state, batch) needs the ShardedTrainState built by "
                      f"fsdp_jax.init_train_state; got {type(state).__name__}.")
    if not self._checked_setup:  # mesh or config taken from the state
      check_setup(self.mesh or state.plan.mesh, self.config or state.plan.config)
      self._checked_setup = True
    placed, self._checked_shapes = place_checked(state.plan, batch, self._checked_shapes,
                                                 self._batch_check)
    return placed

  @mesh_lib.own_mesh
  def __call__(self, state, batch):
    new_state, metrics = self._jit(self.mesh or state.plan.mesh)(
        state, self._place(state, batch))
    config = state.plan.config if self.config is None else self.config
    if config.nonfinite == "raise":
      # One host read of a replicated flag per step: every process decides
      # the same way.
      if bool(jax.device_get(metrics["nonfinite"])):
        _raise_nonfinite(new_state, metrics)
      metrics.pop("nonfinite_leaves")
    return new_state, metrics

  @mesh_lib.own_mesh
  def lower(self, state, batch):
    """The step lowered for ``state`` and ``batch`` (``jax.jit``'s
    ``lower``: ``.compile()``, ``.as_text()``, ``memory_analysis()``). Both
    may be abstract: ``jax.eval_shape`` of :func:`init_train_state` and
    ``jax.ShapeDtypeStruct`` batches (the global batch)."""
    return self._jit(self.mesh or state.plan.mesh).lower(_with_stored_shardings(state),
                                                        self._place(state, batch))


def step_jaxpr(step: TrainStep, state, batch):
  """The step's jaxpr for ``state`` and ``batch`` (both may be shapes, and
  the state's plan may be on a ``jax.sharding.AbstractMesh``): what the
  planner compiles per device (:mod:`fsdp_jax._src.planner.step_program`)."""
  return jax.make_jaxpr(step._fn)(state, batch)  # pylint: disable=protected-access


def _with_stored_shardings(state: ShardedTrainState) -> ShardedTrainState:
  """``state`` with each abstract parameter and optimizer-state leaf that has
  no sharding (``jax.eval_shape(init_train_state)`` drops them) given the
  plan's, memory kind included: with CPU offload the step reads those arrays
  from host memory, and lowering it on device-memory leaves fails."""
  plan = state.plan

  def fill(x, stored):
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None:
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=stored.sharding)
    return x

  if not any(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None
             for x in jax.tree.leaves((state.params, state.opt_state))):
    return state
  params = jax.tree.map(fill, state.params, plan.storage_shapes())
  opt_state = state.opt_state
  if plan.opt_layout is not None:
    opt_state = jax.tree.map(fill, opt_state, optim.stored_shapes(plan, plan.opt_layout))
  return state.replace(params=params, opt_state=opt_state)
