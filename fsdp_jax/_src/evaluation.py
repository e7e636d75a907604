"""``shard_eval_step``: sharded evaluation, the train step's forward alone.

PyTorch's ``model.eval()`` and a forward under ``torch.no_grad()`` on an
FSDP model (LoRA's adapters run without their dropout, as PEFT's in eval
mode). The step runs ``fn`` inside ``jax.shard_map`` on each device's shards, as
the train step runs the loss (:class:`~fsdp_jax._src.local_loss.LocalForward`):
each unit is gathered right before its first use, with the train step's
prefetch and rate limits (:func:`fsdp_jax._src.schedule.ordered`), and freed
after its last; there is no backward pass, no remat and no optimizer, and
the compiled program's arguments are the parameter shards, the model state,
the key and the batch only.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from fsdp_jax._src import _compat, schedule
from fsdp_jax._src import loss as loss_lib
from fsdp_jax._src import mesh as mesh_lib
from fsdp_jax._src import plan as plan_lib
from fsdp_jax._src.local_loss import LocalForward
from fsdp_jax._src.loss import WeightedLoss
from fsdp_jax._src.plan import Plan
from fsdp_jax._src.state import ShardedTrainState
from fsdp_jax._src.step import check_setup, local_shapes, place_checked
from fsdp_jax._src.tensor_eval import SplitOutputs

OUTPUTS = ("mean", "batch")
TENSOR_OUTPUTS = ("whole", "split")


def shard_eval_step(fn: Callable[..., Any], *, outputs: str = "mean",
                    tensor_outputs: str = "whole", forward_inputs=None) -> "EvalStep":
  """Builds a jitted FSDP evaluation step ``eval_step(state, batch) -> outputs``.

  PyTorch's ``model.eval()`` and ``with torch.no_grad(): fsdp_model(batch)``:
  ``fn(params, batch)`` runs forward only on the sharded state, each unit
  gathered right before its first use and freed after its last (with the
  train step's ``forward_prefetch`` and ``limit_all_gathers``), so a model
  that needs FSDP to fit is evaluated without ever being whole on a device.
  Nothing is kept for a backward pass, and the program reads no optimizer
  state: each device holds its parameter shards, about two gathered units
  and one unit's activations.

  ``fn`` is what ``loss_fn`` is to :func:`fsdp_jax.shard_train_step`: a pure
  function of the full, original parameter tree and this device's batch,
  computed in ``param_dtype`` under mixed precision, on the adapter path
  with LoRA (in PEFT's eval mode: ``LoRA(dropout=...)`` is never applied
  here, only in the train step), on each device's slices with tensor
  parallelism. It returns any pytree of arrays:

  * **model state**: when the state holds some and ``fn`` takes a third
    argument, it is called ``fn(params, batch, model_state)``; a returned
    ``(outputs, new_model_state)`` (a training loss's result) gives
    ``outputs``: evaluation never changes the state (Flax's
    ``train=False`` / ``use_running_average=True`` reads the running
    statistics);
  * **rng**: a ``fn`` with a keyword argument ``rng`` gets
    ``fold_in(fold_in(key, state.step), device_index)``, ``key`` being
    ``eval_step(..., rng=key)`` or the state's. This is the only randomness
    that reaches ``fn`` in evaluation: fsdp_jax draws none of its own (the
    adapters' dropout is off), so ``fn`` decides with its own flags
    (``deterministic=True``, ``train=False``) whether its model's dropout
    uses the key;
  * a :class:`~fsdp_jax.WeightedLoss` anywhere in the outputs becomes the
    weighted mean over the global batch, ``psum(total) / psum(weight)``.

  Args:
    fn: ``fn(params, batch[, model_state][, rng=key])`` as above.
    outputs: ``"mean"``: each output leaf averaged over the data-parallel
      devices (as the train step averages its loss; float32), the same on
      every device. ``"batch"``: each leaf's rows from every device
      concatenated along axis 0, one global ``jax.Array`` split over the
      data-parallel axes like the batch (per-example losses, logits,
      predictions; every leaf needs the device's rows as its leading axis).
    tensor_outputs: with tensor parallelism, ``"whole"`` (default) gathers
      every output whole on each device; ``"split"`` leaves an output that
      the last operation computed split over ``"tensor"`` (a column-parallel
      head's logits) as one global array sharded over ``"tensor"`` along
      that dimension, without the all-gather (a split along axis 0 is
      gathered under ``outputs="batch"``).
    forward_inputs: top-level batch keys cast to ``param_dtype`` under
      ``MixedPrecision(cast_root_forward_inputs=True)``, as for
      :func:`~fsdp_jax.shard_train_step` (default: every floating leaf).

  Returns:
    An :class:`EvalStep`: ``eval_step(state, batch, *, rng=None)`` returns
    ``fn``'s output tree; ``eval_step.lower(state, batch)`` lowers it for
    ``memory_analysis()`` and the HLO.

  Raises:
    ValueError: ``outputs`` or ``tensor_outputs`` is not one of the above;
      at the first call, an ``outputs="batch"`` leaf without the device's
      rows as its leading axis (named by its path).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((3, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> def evaluate(params, batch):
    ...   pred = batch["x"] @ params["w"]
    ...   return {"loss": jnp.mean((pred - batch["y"]) ** 2, axis=1), "pred": pred}
    >>> batch = {"x": jnp.arange(24.0).reshape(8, 3), "y": jnp.zeros((8, 2))}
    >>> out = fsdp_jax.shard_eval_step(evaluate, outputs="batch")(state, batch)
    >>> out["pred"].shape, out["loss"].shape   # every example, split like the batch
    ((8, 2), (8,))
    >>> mean_loss = fsdp_jax.shard_eval_step(lambda p, b: jnp.mean(evaluate(p, b)["loss"]))
    >>> float(mean_loss(state, batch)), float(jnp.mean(out["loss"]))
    (1615.5, 1615.5)
  """
  if not callable(fn):
    raise TypeError("shard_eval_step(fn): fn must be callable as fn(params, batch).")
  if outputs not in OUTPUTS:
    raise ValueError(
        f"shard_eval_step(outputs={outputs!r}): use 'mean' (each output averaged over the "
        "data-parallel devices, as the train step averages its loss) or 'batch' (each "
        "output's rows from every device, concatenated along axis 0: per-example values).")
  if tensor_outputs not in TENSOR_OUTPUTS:
    raise ValueError(
        f"shard_eval_step(tensor_outputs={tensor_outputs!r}): use 'whole' (outputs "
        "gathered whole on every device) or 'split' (outputs computed split over the "
        "'tensor' axis stay sharded over it).")
  return EvalStep(fn, outputs=outputs, tensor_outputs=tensor_outputs,
                  forward_inputs=loss_lib.check_forward_inputs(forward_inputs))


def _is_weighted(x) -> bool:
  return isinstance(x, WeightedLoss)


class EvalStep:
  """The step returned by :func:`shard_eval_step`.

  ``eval_step(state, batch, *, rng=None)`` places the batch on the mesh (each
  process passes its own rows in multi-process runs, as for the train step)
  and runs the jitted forward; ``eval_step.lower(state, batch)`` lowers it
  (``.compile().memory_analysis()``, ``.compile().as_text()``). The
  program's arguments are ``state.params``, ``state.model_state``, the key
  and the batch: a state's optimizer state is never read (it may be None).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> eval_step = fsdp_jax.shard_eval_step(lambda p, b: jnp.mean(b["x"] @ p["w"]))
    >>> float(eval_step(state.replace(opt_state=None), {"x": jnp.ones((2, 4))}))
    4.0
  """

  def __init__(self, fn: Callable, *, outputs: str, tensor_outputs: str, forward_inputs):
    self.fn = fn
    self.outputs = outputs
    self.tensor_outputs = tensor_outputs
    self.forward_inputs = forward_inputs
    self._forwards: dict = {}  # plan -> (LocalForward, SplitOutputs or None)
    self._by_mesh: dict = {}  # mesh -> TopLevelJit
    self._checked_setup: set = set()  # plans whose mesh and config were checked
    self._checked_shapes = None

  # ---- the per-device forward ------------------------------------------------
  def _forward(self, plan: Plan):
    if plan not in self._forwards:
      split = None
      if plan.config.tensor_parallel is not None and self.tensor_outputs == "split":
        split = SplitOutputs(first_dim=1 if self.outputs == "batch" else 0)
      self._forwards[plan] = (LocalForward(self.fn, plan, forward_inputs=self.forward_inputs,
                                           split_outputs=split), split)
    return self._forwards[plan]

  @staticmethod
  def _local_structs(plan: Plan, batch):
    # (under a context axis, a split leaf's sequence divided too)
    return local_shapes(plan, batch)

  def _out_specs(self, plan: Plan, out_shape, split: Optional[SplitOutputs], local_batch):
    """The ``shard_map`` out_specs of the outputs (WeightedLoss: one scalar),
    after checking ``"batch"`` outputs' leading axes."""
    rows = {x.shape[0] for x in jax.tree.leaves(local_batch)}
    data = plan_lib.data_spec(plan)[0]
    tensor = plan.axes.tensor_axes[0] if plan.axes.tensor_axes else None
    dims = {} if split is None else split.dims
    # Positions of the leaves among fn's flat outputs (a WeightedLoss: two).
    pos = 0
    specs = []
    flat, tree = jax.tree_util.tree_flatten_with_path(out_shape, is_leaf=_is_weighted)
    for path, x in flat:
      if _is_weighted(x):
        specs.append(P())
        pos += 2
        continue
      d = dims.get(pos)
      pos += 1
      entries = [None] * len(x.shape)
      if self.outputs == "batch":
        if not x.shape or x.shape[0] not in rows:
          self._no_batch_axis(plan, jax.tree_util.keystr(path), x, rows)
        entries[0] = data
      if d is not None:
        entries[d] = tensor
      specs.append(P(*entries))
    return jax.tree_util.tree_unflatten(tree, specs)

  @staticmethod
  def _no_batch_axis(plan: Plan, name: str, x, rows):
    sizes = {a: int(plan.mesh.shape[a]) for a in plan.axes.data_axes}
    raise ValueError(
        f"shard_eval_step(outputs='batch'): output {name or '(root)'} has shape "
        f"{tuple(x.shape)} on each device ({x.dtype}), but 'batch' concatenates every output "
        f"along axis 0 over the data-parallel mesh axes {plan.axes.data_axes} "
        f"(sizes {sizes}), so each needs a leading axis of the device's "
        f"{' or '.join(map(str, sorted(rows)))} batch rows. Fix: return per-example values "
        "(the loss before jnp.mean, the logits), wrap a reduction in "
        "fsdp_jax.WeightedLoss(total=, weight=), or use outputs='mean'.")

  def _reduce(self, plan: Plan, out):
    """Each device's outputs -> the step's: averaged ("mean") or this
    device's rows ("batch"); a WeightedLoss -> the global weighted mean."""
    data_axes = plan.axes.data_axes

    def one(x):
      if _is_weighted(x):
        total = jax.lax.psum(jnp.asarray(x.total, jnp.float32), data_axes)
        return total / loss_lib.weight_total(x.weight, data_axes)
      if self.outputs == "mean":
        return jax.lax.pmean(jnp.asarray(x, jnp.float32), data_axes)
      return x

    return jax.tree.map(one, out, is_leaf=_is_weighted)

  # ---- the jitted program --------------------------------------------------
  def _program(self, state: ShardedTrainState, batch, rng):
    """The step on global arrays; ``state`` holds no optimizer state."""
    plan = state.plan
    forward, split = self._forward(plan)
    data_axes = plan.axes.data_axes
    key = state.rng if rng is None else rng
    with _compat.classic_tracing():
      forward.reset()  # traces are shared within one trace of the step only
      local_batch = self._local_structs(plan, batch)
      out_shape = forward.output_shape(local_batch, state.model_state, key)
      out_specs = self._out_specs(plan, out_shape, split, local_batch)
      run = schedule.ordered(forward, plan.ordering)

      def body(params, model_state, batch_local, base_key, step):
        k = None if base_key is None else jax.tree.map(
            lambda r: loss_lib.device_key(r, step, plan.axes.batch_axes), base_key)
        return self._reduce(plan, run(params, batch_local, model_state, k))

      fn = jax.shard_map(
          body, mesh=plan.mesh,
          in_specs=(plan_lib.param_specs(plan), jax.tree.map(lambda _: P(), state.model_state),
                    plan_lib.batch_specs(plan, batch),
                    jax.tree.map(lambda _: P(), key), P()),
          out_specs=out_specs, check_vma=False)
      return fn(state.params, state.model_state, batch, key, state.step)

  def _jit(self, mesh):
    if mesh not in self._by_mesh:
      def options(state, batch, rng):
        forward = self._forward(state.plan)[0]
        try:
          checkpointed = forward.checkpoints(self._local_structs(state.plan, batch),
                                             state.model_state,
                                             state.rng if rng is None else rng)
        except Exception:  # pylint: disable=broad-except  (the step's own trace reports it)
          checkpointed = True
        return mesh_lib.compiler_options(mesh, checkpointed=checkpointed)

      self._by_mesh[mesh] = mesh_lib.TopLevelJit(self._program, options)
    return self._by_mesh[mesh]

  def _args(self, state, batch, rng):
    if not isinstance(state, ShardedTrainState):
      raise TypeError("eval_step(state, batch) needs the ShardedTrainState built by "
                      f"fsdp_jax.init_train_state; got {type(state).__name__}.")
    plan = state.plan
    if plan not in self._checked_setup:
      check_setup(plan.mesh, plan.config)
      self._checked_setup.add(plan)
    placed, self._checked_shapes = place_checked(plan, batch, self._checked_shapes,
                                                 getattr(self.fn, "check_batch", None))
    if rng is not None:
      loss_lib.check_rng(rng)
    # Only what the forward reads: no optimizer state, no hook state.
    bare = state.replace(opt_state=None, comm_hook_state=None, nonfinite_steps=None)
    return bare, placed, rng

  def __call__(self, state, batch, *, rng=None):
    args = self._args(state, batch, rng)
    return self._jit(state.plan.mesh)(*args)

  def lower(self, state, batch, *, rng=None):
    """Lowers the step for these inputs (``.compile().memory_analysis()``,
    ``.as_text()``), as :meth:`fsdp_jax.TrainStep.lower` does."""
    args = self._args(state, batch, rng)
    return self._jit(state.plan.mesh).lower(*args)
