"""The launcher's worker entry point:
``python -m fsdp_jax._src.runtime.worker (SCRIPT | -m MODULE) [ARGS...]``.

``python -m fsdp_jax.launch`` starts every worker through this module. It
installs the process-wide failure hooks
(:func:`fsdp_jax.distributed.install_failure_hooks`) and then runs the user's
script as ``__main__``, exactly as ``python SCRIPT ARGS...`` (or ``python -m
MODULE ARGS...``) would: same ``sys.argv``, ``sys.path[0]`` and exit status.
This is the only place fsdp_jax installs a process-wide hook on its own;
importing fsdp_jax or calling its functions never does.
"""

from __future__ import annotations

import os
import runpy
import sys

from fsdp_jax._src.runtime import distributed

USAGE = "usage: python -m fsdp_jax._src.runtime.worker (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str]) -> None:
  if not argv or (argv[0] == "-m" and len(argv) < 2):
    raise SystemExit(USAGE)
  if argv[0] == "-m":
    module, args = argv[1], argv[2:]
    sys.argv = [module, *args]  # run_module puts the module's file first
    sys.path[0] = os.getcwd()  # as `python -m` does
    distributed.install_failure_hooks()
    runpy.run_module(module, run_name="__main__", alter_sys=True)
  else:
    script, args = argv[0], argv[1:]
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` does
    distributed.install_failure_hooks()
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
  main(sys.argv[1:])
