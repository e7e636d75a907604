"""Gradient communication hooks (PyTorch ``register_comm_hook``).

Pass one as ``FSDPConfig(comm_hook=...)``. A hook is a pure function
``hook(state, grad, spec) -> (reduced, state)`` called once per FSDP unit and
group inside the step; :class:`fsdp_jax.custom.GatherSpec` describes ``spec``
and :func:`fsdp_jax.custom.reduce_gradient` is the default reduction a hook may
call. The built-ins mirror ``torch.distributed.algorithms._comm_hooks``.

Example:
  >>> import fsdp_jax
  >>> config = fsdp_jax.FSDPConfig(comm_hook=fsdp_jax.hooks.bf16_compress_hook)
"""

from fsdp_jax._src.hooks import (
    DefaultHook as DefaultHook,
    ErrorFeedbackHook as ErrorFeedbackHook,
    LowPrecisionHook as LowPrecisionHook,
    allreduce_hook as allreduce_hook,
    bf16_compress_hook as bf16_compress_hook,
    fp16_compress_hook as fp16_compress_hook,
    reduce_scatter_hook as reduce_scatter_hook,
)

__all__ = [
    "DefaultHook", "ErrorFeedbackHook", "LowPrecisionHook", "allreduce_hook",
    "bf16_compress_hook", "fp16_compress_hook", "reduce_scatter_hook",
]
