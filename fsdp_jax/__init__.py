"""fsdp_jax: PyTorch's Fully Sharded Data Parallel (ZeRO-3) for JAX, as pure
functions over a device mesh.

The top level holds what a training script needs. The building blocks of a
hand-written step live in :mod:`fsdp_jax.custom`; communication hooks in
:mod:`fsdp_jax.hooks`; multi-process set-up in :mod:`fsdp_jax.distributed`
and the launcher ``python -m fsdp_jax.launch``; compiled-program inspection in
:mod:`fsdp_jax.hlo`. The implementation is private (``fsdp_jax._src``).

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

# Configuration: the FSDP constructor's options, as values.
from fsdp_jax._src.config import (
    BackwardPrefetch as BackwardPrefetch,
    CPUOffload as CPUOffload,
    FSDPConfig as FSDPConfig,
    MixedPrecision as MixedPrecision,
    ShardingStrategy as ShardingStrategy,
    StateDictType as StateDictType,
    gradient_divide_factors as gradient_divide_factors,
)
from fsdp_jax._src.quantization import Quantization as Quantization
from fsdp_jax._src.lora import LoRA as LoRA
from fsdp_jax._src.tensor import TensorParallel as TensorParallel
from fsdp_jax._src.wrap import (
    CustomPolicy as CustomPolicy,
    ModuleWrapPolicy as ModuleWrapPolicy,
    Node as Node,
    lambda_auto_wrap_policy as lambda_auto_wrap_policy,
    size_based_auto_wrap_policy as size_based_auto_wrap_policy,
)

# Devices.
from fsdp_jax._src.mesh import (
    make_mesh as make_mesh,
    simulate_cpu_devices as simulate_cpu_devices,
)

# State and the train step.
from fsdp_jax._src.loss import WeightedLoss as WeightedLoss
from fsdp_jax._src.loss import constant_key as constant_key
from fsdp_jax._src.plan import Plan as Plan
from fsdp_jax._src.frameworks import module_classes as module_classes
from fsdp_jax._src.state import (
    ShardedTrainState as ShardedTrainState,
    init_train_state as init_train_state,
)
from fsdp_jax._src.step import (
    NonFiniteError as NonFiniteError,
    TrainStep as TrainStep,
    shard_train_step as shard_train_step,
)

# Evaluation, and the hand-off to inference.
from fsdp_jax._src.evaluation import (
    EvalStep as EvalStep,
    shard_eval_step as shard_eval_step,
)
from fsdp_jax._src.reshard import reshard_params as reshard_params

# The planner: what fits and how fast.
from fsdp_jax._src.planner import (
    DeviceSpec as DeviceSpec,
    Estimate as Estimate,
    estimate as estimate,
    search as search,
)

# Full parameters.
from fsdp_jax._src.full import (
    apply as apply,
    summon_full_params as summon_full_params,
    write_full_params as write_full_params,
)

# State dicts and checkpoints.
from fsdp_jax._src.state_dicts import (
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
from fsdp_jax._src.checkpoint import (
    CheckpointError as CheckpointError,
    CheckpointManager as CheckpointManager,
    export_params as export_params,
    import_params as import_params,
)

# Multi-process.
from fsdp_jax._src.runtime.cluster import DistributedInfo as DistributedInfo
from fsdp_jax._src.runtime.distributed import (
    MonitoredBarrierError as MonitoredBarrierError,
    monitored_barrier as monitored_barrier,
)

# Public submodules.
from fsdp_jax import custom as custom
from fsdp_jax import distributed as distributed
from fsdp_jax import hlo as hlo
from fsdp_jax import hooks as hooks

from fsdp_jax._src import deprecations as _deprecations

__version__ = "0.1.0"

__all__ = [
    "BackwardPrefetch", "CPUOffload", "CheckpointError",
    "CheckpointManager", "CustomPolicy", "DeviceSpec", "DistributedInfo", "Estimate",
    "EvalStep", "FSDPConfig", "LoRA",
    "MixedPrecision", "ModuleWrapPolicy", "MonitoredBarrierError", "Node",
    "NonFiniteError", "OptimStateKeyType", "Plan", "Quantization",
    "ShardedTrainState", "ShardingStrategy", "StateDictType", "TensorParallel", "TrainStep",
    "WeightedLoss", "apply", "constant_key", "custom", "distributed", "estimate",
    "export_params",
    "full_optim_state_dict", "gradient_divide_factors", "hlo", "hooks",
    "import_params", "init_train_state", "lambda_auto_wrap_policy",
    "load_state_dict", "make_mesh", "module_classes", "monitored_barrier",
    "optim_state_dict", "optim_state_dict_to_load", "rekey_optim_state_dict",
    "reshard_params", "scatter_full_optim_state_dict", "search", "shard_eval_step",
    "shard_full_optim_state_dict", "shard_train_step", "simulate_cpu_devices",
    "size_based_auto_wrap_policy",
    "state_dict", "summon_full_params", "write_full_params",
]

# Names that moved (to fsdp_jax.custom, or merged into one) and the old module
# paths (fsdp_jax.config, fsdp_jax.state_dict, ...) keep working with a
# DeprecationWarning; see fsdp_jax/_src/deprecations.py.
_deprecations.register_moved_modules(__name__)
__getattr__ = _deprecations.package_getattr(__name__, lazy=("models", "pretrained"))
