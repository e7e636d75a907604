"""Building blocks for a hand-written train step.

:func:`fsdp_jax.shard_train_step` builds the whole step. When a training loop
needs its own (several losses, a GAN's two optimizers, gradient inspection),
these pieces are the same ones it is made of, to be called inside your own
``jax.shard_map`` over ``state.plan.mesh``:

* :func:`value_and_grad` - the loss and the reduced gradient shards, with
  FSDP's gathers, reduce-scatters, mixed precision and accumulation;
* :func:`clip_grad_norm` - PyTorch ``clip_grad_norm_`` over the shards;
* :func:`optimizer_step` - the optimizer's update on the shards;
* :func:`param_specs`, :func:`batch_spec`, :func:`opt_state_specs` - the
  ``in_specs`` / ``out_specs`` for ``shard_map``;
* :func:`split_trainable` / :func:`merge_trainable` - trainable and frozen
  storage;
* :func:`sharded_grads` - the reduced gradient shards of one batch, outside a
  step (for ``summon_full_params(with_grads=True, grads=...)``);
* :class:`GatherSpec` (with a :class:`LeafLayout` per leaf) and
  :func:`reduce_gradient` - what a communication hook receives and the
  default reduction it may call;
* :func:`compiler_options` - what to pass to your ``jax.jit`` so the step
  compiles the way :func:`fsdp_jax.shard_train_step`'s does (on CPU,
  FULL_SHARD's backward re-gather survives XLA's optimisations), and
  :data:`CPU_XLA_FLAGS`, the process flags
  :func:`fsdp_jax.simulate_cpu_devices` adds.

See docs/custom_step.md for a complete step.

Example:
  >>> import jax, jax.numpy as jnp, optax, fsdp_jax
  >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones(4)},
  ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
  >>> spec = fsdp_jax.custom.batch_spec(state.plan)  # shard_map's in_specs
  >>> spec == jax.sharding.PartitionSpec(("shard",))
  True
"""

from fsdp_jax._src.clipping import clip_grad_norm as clip_grad_norm
from fsdp_jax._src.collectives import (
    GatherSpec as GatherSpec,
    LeafLayout as LeafLayout,
    reduce_gradient as reduce_gradient,
)
from fsdp_jax._src.full import sharded_grads as sharded_grads
from fsdp_jax._src.grads import (
    optimizer_step as optimizer_step,
    value_and_grad as value_and_grad,
)
from fsdp_jax._src.mesh import (
    CPU_XLA_FLAGS as CPU_XLA_FLAGS,
    compiler_options as compiler_options,
)
from fsdp_jax._src.plan import (
    batch_spec as batch_spec,
    batch_specs as batch_specs,
    merge_trainable as merge_trainable,
    param_specs as param_specs,
    split_trainable as split_trainable,
)
from fsdp_jax._src.state import opt_state_specs as opt_state_specs

__all__ = [
    "CPU_XLA_FLAGS", "GatherSpec", "LeafLayout", "batch_spec", "batch_specs",
    "clip_grad_norm",
    "compiler_options", "merge_trainable", "opt_state_specs", "optimizer_step", "param_specs",
    "reduce_gradient", "sharded_grads", "split_trainable", "value_and_grad",
]
