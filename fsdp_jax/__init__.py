"""fsdp_jax: PyTorch's Fully Sharded Data Parallel (ZeRO-3) for JAX, as pure
functions over a device mesh.

Example:
  >>> import jax, jax.numpy as jnp, optax, fsdp_jax
  >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  >>> config = fsdp_jax.FSDPConfig(
  ...     sharding_strategy=fsdp_jax.ShardingStrategy.FULL_SHARD)
  >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
  ...     optimizer=optax.sgd(0.1), mesh=mesh, config=config)
  >>> print(state.plan)  # doctest: +ELLIPSIS
  FSDP plan: FULL_SHARD, flat parameters, mesh {'shard': 2}, ...
"""

from fsdp_jax.config import (
    BackwardPrefetch as BackwardPrefetch,
    CPUOffload as CPUOffload,
    FSDPConfig as FSDPConfig,
    MixedPrecision as MixedPrecision,
    ShardingStrategy as ShardingStrategy,
    StateDictType as StateDictType,
    gradient_divide_factors as gradient_divide_factors,
)
from fsdp_jax.mesh import (
    CPU_XLA_FLAGS as CPU_XLA_FLAGS,
    make_mesh as make_mesh,
    simulate_cpu_devices as simulate_cpu_devices,
)
from fsdp_jax.plan import Plan as Plan
from fsdp_jax.state import (
    ShardedTrainState as ShardedTrainState,
    full_params as full_params,
    init_train_state as init_train_state,
    module_classes as module_classes,
)
from fsdp_jax.step import shard_train_step as shard_train_step
from fsdp_jax.wrap import (
    CustomPolicy as CustomPolicy,
    ModuleWrapPolicy as ModuleWrapPolicy,
    Node as Node,
    lambda_auto_wrap_policy as lambda_auto_wrap_policy,
    size_based_auto_wrap_policy as size_based_auto_wrap_policy,
)

__version__ = "0.1.0"

__all__ = [
    "BackwardPrefetch", "CPUOffload", "CPU_XLA_FLAGS", "CustomPolicy",
    "FSDPConfig", "MixedPrecision", "ModuleWrapPolicy", "Node", "Plan",
    "ShardedTrainState", "ShardingStrategy", "StateDictType", "full_params",
    "gradient_divide_factors", "init_train_state", "lambda_auto_wrap_policy",
    "make_mesh", "module_classes", "shard_train_step", "simulate_cpu_devices",
    "size_based_auto_wrap_policy",
]
