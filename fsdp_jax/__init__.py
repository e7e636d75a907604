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

import sys
from typing import TYPE_CHECKING

from fsdp_jax._src import deprecations as _deprecations

__version__ = "0.1.0"

# The public names, by the module that defines each. They are imported on
# first use (PEP 562): ``import fsdp_jax`` itself imports neither JAX nor the
# engine, so ``python -m fsdp_jax.launch`` and the workers it starts begin at
# once, and a script pays for what it uses (reading ``fsdp_jax.FSDPConfig``
# imports the configuration, ``fsdp_jax.shard_train_step`` the engine).
_PUBLIC = {
    # Configuration: the FSDP constructor's options, as values.
    "fsdp_jax._src.config": ("ActivationCheckpointing", "BackwardPrefetch", "CPUOffload",
        "FSDPConfig", "MixedPrecision", "ShardingStrategy", "StateDictType", "gradient_divide_factors"),
    "fsdp_jax._src.quantization": ("Quantization",),
    "fsdp_jax._src.lora": ("LoRA",),
    "fsdp_jax._src.tensor": ("TensorParallel",),
    "fsdp_jax._src.context": ("ContextParallel",),
    "fsdp_jax._src.wrap": ("CustomPolicy", "ModuleWrapPolicy", "Node", "lambda_auto_wrap_policy",
        "size_based_auto_wrap_policy"),
    # Devices.
    "fsdp_jax._src.mesh": ("make_mesh", "simulate_cpu_devices"),
    # State and the train step.
    "fsdp_jax._src.loss": ("WeightedLoss", "constant_key"),
    "fsdp_jax._src.cross_entropy": ("chunked_cross_entropy",),
    "fsdp_jax._src.attention": ("attention",),
    "fsdp_jax._src.plan": ("Plan",),
    "fsdp_jax._src.frameworks": ("module_classes",),
    "fsdp_jax._src.state": ("ShardedTrainState", "init_train_state"),
    "fsdp_jax._src.step": ("NonFiniteError", "TrainStep", "shard_train_step"),
    # Evaluation, and the hand-off to inference.
    "fsdp_jax._src.evaluation": ("EvalStep", "shard_eval_step"),
    "fsdp_jax._src.reshard": ("reshard_params",),
    # The planner: what fits and how fast.
    "fsdp_jax._src.planner": ("DeviceSpec", "Estimate", "estimate", "search"),
    # Full parameters.
    "fsdp_jax._src.full": ("apply", "summon_full_params", "write_full_params"),
    # State dicts and checkpoints.
    "fsdp_jax._src.state_dicts": ("OptimStateKeyType", "full_optim_state_dict", "load_state_dict",
        "optim_state_dict", "optim_state_dict_to_load", "rekey_optim_state_dict",
        "scatter_full_optim_state_dict", "shard_full_optim_state_dict", "state_dict"),
    "fsdp_jax._src.checkpoint": ("CheckpointError", "CheckpointManager", "export_params",
        "import_params"),
    # Multi-process.
    "fsdp_jax._src.runtime.cluster": ("DistributedInfo",),
    "fsdp_jax._src.runtime.distributed": ("MonitoredBarrierError", "monitored_barrier"),
}
# Public submodules, also imported on first use (``fsdp_jax.models``,
# ``fsdp_jax.pretrained``: without safetensors and the model code).
_SUBMODULES = ("custom", "distributed", "hlo", "hooks", "models", "pretrained")

if TYPE_CHECKING:  # the same names, for type checkers and editors
  # Configuration: the FSDP constructor's options, as values.
  from fsdp_jax._src.config import (
      ActivationCheckpointing as ActivationCheckpointing,
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
  from fsdp_jax._src.context import ContextParallel as ContextParallel
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
  from fsdp_jax._src.cross_entropy import chunked_cross_entropy as chunked_cross_entropy
  from fsdp_jax._src.attention import attention as attention
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
  from fsdp_jax import custom, distributed, hlo, hooks, models, pretrained

__all__ = sorted([n for names in _PUBLIC.values() for n in names]
                 + ["custom", "distributed", "hlo", "hooks"])

# Names that moved (to fsdp_jax.custom, or merged into one) and the old module
# paths (fsdp_jax.config, fsdp_jax.state_dict, ...) keep working with a
# DeprecationWarning; see fsdp_jax/_src/deprecations.py.
_deprecations.register_moved_modules(__name__)
__getattr__, __dir__ = _deprecations.package_getattr(
    __name__, public=_PUBLIC, lazy=_SUBMODULES, namespace=sys.modules[__name__].__dict__)
