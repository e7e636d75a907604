"""``python -m fsdp_jax.launch``: start N processes of a training script, like
``torchrun``. See ``python -m fsdp_jax.launch --help`` and docs/multihost.md.

Usage::

    python -m fsdp_jax.launch --nproc 2 --devices-per-proc 4 train.py --lr 1e-3

:class:`WorkerGroup` and :func:`worker_env` start workers from Python (tests,
notebooks). The launcher never imports JAX: it starts at once and takes no GPU memory.
"""

import sys

from fsdp_jax._src.runtime.launch import (
    WorkerGroup as WorkerGroup,
    WorkerResult as WorkerResult,
    free_port as free_port,
    main as main,
    worker_env as worker_env,
)

__all__ = ["WorkerGroup", "WorkerResult", "free_port", "main", "worker_env"]

if __name__ == "__main__":
  sys.exit(main())
