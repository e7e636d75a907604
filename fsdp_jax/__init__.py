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
from fsdp_jax.quantization import Quantization as Quantization
from fsdp_jax.mesh import (
    CPU_XLA_FLAGS as CPU_XLA_FLAGS,
    make_mesh as make_mesh,
    simulate_cpu_devices as simulate_cpu_devices,
)
from fsdp_jax import distributed as distributed
from fsdp_jax import hlo as hlo
from fsdp_jax import hooks as hooks
from fsdp_jax.distributed import (
    DistributedInfo as DistributedInfo,
    MonitoredBarrierError as MonitoredBarrierError,
    monitored_barrier as monitored_barrier,
)
from fsdp_jax.checkpoint import (
    CheckpointError as CheckpointError,
    CheckpointManager as CheckpointManager,
    export_params as export_params,
    import_params as import_params,
)
from fsdp_jax.full import (
    apply as apply,
    sharded_grads as sharded_grads,
    summon_full_params as summon_full_params,
    write_full_params as write_full_params,
)
from fsdp_jax.grads import (
    batch_spec as batch_spec,
    clip_grad_norm as clip_grad_norm,
    merge_trainable as merge_trainable,
    optimizer_step as optimizer_step,
    param_specs as param_specs,
    split_trainable as split_trainable,
    value_and_grad as value_and_grad,
)
from fsdp_jax.loss import WeightedLoss as WeightedLoss
from fsdp_jax.plan import Plan as Plan
from fsdp_jax.state import (
    ShardedTrainState as ShardedTrainState,
    full_params as full_params,
    init_train_state as init_train_state,
    module_classes as module_classes,
    opt_state_specs as opt_state_specs,
)
from fsdp_jax.state_dict import (
    OptimStateKeyType as OptimStateKeyType,
    full_optim_state_dict as full_optim_state_dict,
    load_state_dict as load_state_dict,
    optim_state_dict as optim_state_dict,
    optim_state_dict_to_load as optim_state_dict_to_load,
    rekey_optim_state_dict as rekey_optim_state_dict,
    scatter_full_optim_state_dict as scatter_full_optim_state_dict,
    shard_full_optim_state_dict as shard_full_optim_state_dict,
    state_dict as state_dict,
)
from fsdp_jax.step import (
    NonFiniteError as NonFiniteError,
    TrainStep as TrainStep,
    shard_train_step as shard_train_step,
)
from fsdp_jax.wrap import (
    CustomPolicy as CustomPolicy,
    ModuleWrapPolicy as ModuleWrapPolicy,
    Node as Node,
    lambda_auto_wrap_policy as lambda_auto_wrap_policy,
    size_based_auto_wrap_policy as size_based_auto_wrap_policy,
)

__version__ = "0.1.0"

__all__ = [
    "BackwardPrefetch", "CPUOffload", "CPU_XLA_FLAGS", "CheckpointError",
    "CheckpointManager", "CustomPolicy", "DistributedInfo",
    "MonitoredBarrierError", "NonFiniteError", "OptimStateKeyType", "Quantization",
    "distributed",
    "monitored_barrier", "hlo",
    "export_params", "full_optim_state_dict", "import_params",
    "load_state_dict", "optim_state_dict", "optim_state_dict_to_load",
    "rekey_optim_state_dict", "scatter_full_optim_state_dict",
    "shard_full_optim_state_dict", "state_dict",
    "FSDPConfig", "MixedPrecision", "ModuleWrapPolicy", "Node", "Plan",
    "ShardedTrainState", "ShardingStrategy", "StateDictType", "TrainStep", "WeightedLoss",
    "apply", "batch_spec", "clip_grad_norm", "full_params",
    "gradient_divide_factors", "hooks", "init_train_state",
    "lambda_auto_wrap_policy", "make_mesh", "merge_trainable",
    "module_classes", "opt_state_specs", "optimizer_step", "param_specs", "shard_train_step",
    "sharded_grads", "simulate_cpu_devices", "size_based_auto_wrap_policy",
    "split_trainable", "summon_full_params", "value_and_grad",
    "write_full_params",
]
