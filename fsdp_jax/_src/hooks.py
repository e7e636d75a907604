"""Communication hooks: pure functions that replace a unit's gradient reduction
(PyTorch ``FullyShardedDataParallel.register_comm_hook``).

A hook is called as ``hook(state, grad, spec) -> (reduced, new_state)`` inside
the sharded step, once per unit (per dtype group) and step:

* ``grad`` is the device's full, unreduced gradient of the unit laid out as
  ``(..., N, S)``: row r is the part that device r of the shard group keeps;
* ``spec`` (:class:`fsdp_jax.custom.GatherSpec`) carries the mesh axes
  (``shard_axes``, ``reduce_axes``), PyTorch's ``pre_divide`` / ``post_divide``
  factors and the ``reduce_dtype``;
* it returns this device's reduced shard ``(..., S)`` (any float dtype: it is
  cast to the stored dtype afterwards) and its new state.

Hooks run inside the backward pass, where the default reduce-scatter would,
as soon as a unit's gradient is complete. Stateful hooks declare
``init(shape, dtype) -> state`` with a state per device; their state lives in
``ShardedTrainState.comm_hook_state`` (a floating state travels through the
backward pass as a cotangent). Two cases run a stateful hook after the
backward pass instead, on every unit's full gradient kept until then: a plan
with a stacked (scanned) trainable unit, or a state with non-floating leaves;
and with ``gradient_accumulation_steps > 1`` it runs once, on the accumulated
full gradients.

Built-ins mirror ``torch.distributed.algorithms._comm_hooks.default_hooks``:
:data:`allreduce_hook` (NO_SHARD), :data:`reduce_scatter_hook` (sharded
strategies), :data:`fp16_compress_hook`, :data:`bf16_compress_hook`, and the
stateful :class:`ErrorFeedbackHook` (low-precision reduction with the
compression error carried to the next step).

Example:
  >>> import fsdp_jax
  >>> cfg = fsdp_jax.FSDPConfig(comm_hook=fsdp_jax.hooks.bf16_compress_hook)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from fsdp_jax._src.collectives import GatherSpec, reduce_gradient


@dataclasses.dataclass(frozen=True)
class DefaultHook:
  """PyTorch's default reduction: divide by ``pre_divide``, reduce-scatter
  over the shard axes (all-reduce for NO_SHARD), all-reduce over
  ``"replicate"`` for HYBRID, divide by ``post_divide``; in ``reduce_dtype``.

  :data:`reduce_scatter_hook` and :data:`allreduce_hook` are instances.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> config = fsdp_jax.FSDPConfig(comm_hook=fsdp_jax.hooks.reduce_scatter_hook)
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=config)
    >>> step = fsdp_jax.shard_train_step(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
    ...     optax.sgd(0.1), mesh=mesh, config=config)
    >>> state, metrics = step(state, {"x": jnp.ones((2, 4))})
    >>> float(metrics["loss"])
    16.0
  """

  name: str  # "reduce_scatter" or "allreduce" (PyTorch's hook names)
  stateful = False

  def __call__(self, state, grad, spec: GatherSpec):
    if spec.flat:
      # The same program as fsdp_jax's own reduction of a flat parameter:
      # one (N * S) vector, reduce-scattered tiled (XLA may sum an (N, S)
      # buffer in another order, one ulp apart).
      tiled = grad.reshape(grad.shape[:-2] + (grad.shape[-2] * grad.shape[-1],))
      return reduce_gradient(tiled, spec, tiled=True), state
    return reduce_gradient(grad, spec), state


@dataclasses.dataclass(frozen=True)
class LowPrecisionHook:
  """PyTorch's ``fp16_compress_hook`` / ``bf16_compress_hook``: cast the
  gradient to ``dtype``, run the default reduction in that dtype (with the
  divide factors), and cast back.

  :data:`bf16_compress_hook` and :data:`fp16_compress_hook` are instances.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> config = fsdp_jax.FSDPConfig(comm_hook=fsdp_jax.hooks.bf16_compress_hook)
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=config)
    >>> step = fsdp_jax.shard_train_step(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
    ...     optax.sgd(0.1), mesh=mesh, config=config)
    >>> state, metrics = step(state, {"x": jnp.ones((2, 4))})
    >>> float(metrics["loss"])
    16.0
  """

  dtype: Any  # the dtype the gradient is cast to and reduced in
  stateful = False

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

  def __call__(self, state, grad, spec: GatherSpec):
    low = dataclasses.replace(spec, reduce_dtype=jnp.dtype(self.dtype))
    return reduce_gradient(grad.astype(self.dtype), low).astype(grad.dtype), state


@dataclasses.dataclass(frozen=True)
class ErrorFeedbackHook:
  """Low-precision reduction with error feedback (a stateful hook).

  Each device keeps the rounding error of its last compressed gradient and
  adds it to the next one before compressing: ``c = round(g + e)``,
  ``e' = (g + e) - c``, and ``c`` is reduced like ``LowPrecisionHook``. The
  error state is per device, in ``ShardedTrainState.comm_hook_state``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> config = fsdp_jax.FSDPConfig(comm_hook=fsdp_jax.hooks.ErrorFeedbackHook())
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=config)
    >>> step = fsdp_jax.shard_train_step(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
    ...     optax.sgd(0.1), mesh=mesh, config=config)
    >>> state, metrics = step(state, {"x": jnp.ones((2, 4))})
    >>> float(metrics["loss"])
    16.0
    >>> list(jax.tree.map(jnp.shape, state.comm_hook_state).values())  # one error per device
    [(2, 2, 4)]
  """

  dtype: Any = jnp.bfloat16  # the dtype the compensated gradient is reduced in
  stateful = True

  def __post_init__(self):
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

  def init(self, shape, dtype):
    return jnp.zeros(shape, jnp.float32)

  def __call__(self, state, grad, spec: GatherSpec):
    corrected = grad.astype(jnp.float32) + state
    compressed = corrected.astype(self.dtype)
    new_state = corrected - compressed.astype(jnp.float32)
    low = dataclasses.replace(spec, reduce_dtype=jnp.dtype(self.dtype))
    return reduce_gradient(compressed, low).astype(jnp.float32), new_state


allreduce_hook = DefaultHook("allreduce")
reduce_scatter_hook = DefaultHook("reduce_scatter")
fp16_compress_hook = LowPrecisionHook(jnp.float16)
bf16_compress_hook = LowPrecisionHook(jnp.bfloat16)
