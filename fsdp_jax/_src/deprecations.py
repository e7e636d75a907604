"""Old names that keep working, with a ``DeprecationWarning`` naming the new one.

Two kinds:

* top-level names that moved or merged: the custom-step building blocks now
  live in :mod:`fsdp_jax.custom`, and ``full_params`` is
  :func:`fsdp_jax.summon_full_params` (one name for one job);
* the old module paths (``fsdp_jax.config``, ``fsdp_jax.state_dict``, ...)
  from before the implementation moved to ``fsdp_jax._src``. Each is a small
  alias module in ``sys.modules`` (so ``from fsdp_jax.config import
  FSDPConfig`` works) that is *not* set as an attribute of the package: the
  attribute ``fsdp_jax.state_dict`` stays the function, never shadowed by a
  module of the same name.

Nothing here runs until an old name is used; the aliases hold no state.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings

# Top-level name -> (new public spelling, module, attribute).
MOVED_NAMES = {
    "full_params": ("fsdp_jax.summon_full_params", "fsdp_jax._src.full", "summon_full_params"),
    "value_and_grad": ("fsdp_jax.custom.value_and_grad", "fsdp_jax._src.grads", "value_and_grad"),
    "clip_grad_norm": ("fsdp_jax.custom.clip_grad_norm", "fsdp_jax._src.clipping", "clip_grad_norm"),
    "optimizer_step": ("fsdp_jax.custom.optimizer_step", "fsdp_jax._src.grads", "optimizer_step"),
    "param_specs": ("fsdp_jax.custom.param_specs", "fsdp_jax._src.plan", "param_specs"),
    "batch_spec": ("fsdp_jax.custom.batch_spec", "fsdp_jax._src.plan", "batch_spec"),
    "split_trainable": ("fsdp_jax.custom.split_trainable", "fsdp_jax._src.plan", "split_trainable"),
    "merge_trainable": ("fsdp_jax.custom.merge_trainable", "fsdp_jax._src.plan", "merge_trainable"),
    "CPU_XLA_FLAGS": ("fsdp_jax.custom.CPU_XLA_FLAGS", "fsdp_jax._src.mesh", "CPU_XLA_FLAGS"),
    "sharded_grads": ("fsdp_jax.custom.sharded_grads", "fsdp_jax._src.full", "sharded_grads"),
    "opt_state_specs": ("fsdp_jax.custom.opt_state_specs", "fsdp_jax._src.state", "opt_state_specs"),
}

# Old public module path (under fsdp_jax.) -> its implementation module.
MOVED_MODULES = (
    "checkpoint", "collectives", "config", "frameworks", "full", "grads",
    "layout", "loss", "mesh", "offload", "optim", "quantization",
    "schedule", "state", "state_dict", "step", "wrap",
)
# Public modules imported on first use: ``fsdp_jax.plan`` (the planner, also
# run as ``python -m fsdp_jax.plan``, which must not find it imported by the
# package) still resolves as an attribute, as it did as an alias.
LAZY_MODULES = ("plan",)
# Where an old module's contents live now, when not (only) at
# fsdp_jax._src.<same name>: the modules searched, in order.
_IMPLEMENTATION = {
    "state_dict": ("state_dicts",),
    "grads": ("grads", "local_loss", "loss", "plan"),
    "layout": ("layout", "plan"),
    "hooks": ("hooks", "collectives"),
    "schedule": ("schedule", "schedule.placement", "schedule.loops", "schedule.checkpoints",
                 "schedule.ordering", "plan"),
    "state": ("state", "frameworks", "naming"),
}


def _implementations(module: str) -> list[str]:
  return [f"fsdp_jax._src.{m}" for m in _IMPLEMENTATION.get(module, (module,))]


def _implementation(module: str) -> str:
  return _implementations(module)[0]


def _public_spelling(module: str, name: str) -> str:
  """Where ``fsdp_jax.<module>.<name>`` lives now, as a user should write it
  (the package is loaded: this runs on an attribute read of an alias)."""
  if name in getattr(sys.modules["fsdp_jax"], "__all__", ()):
    return f"fsdp_jax.{name}"
  if name in importlib.import_module("fsdp_jax.custom").__all__:
    return f"fsdp_jax.custom.{name}"
  if name in MOVED_NAMES:
    return MOVED_NAMES[name][0]
  if name == "entry_memory_bytes":
    return "fsdp_jax.hlo.entry_memory_bytes"
  where = next((m for m in _implementations(module)
                if hasattr(importlib.import_module(m), name)), _implementation(module))
  return f"{where}.{name} (internal: it may change without notice)"


class _MovedModule(types.ModuleType):
  """``fsdp_jax.<module>``: forwards attribute reads to ``fsdp_jax._src.<module>``."""

  def __init__(self, package: str, module: str):
    super().__init__(f"{package}.{module}",
                     f"Deprecated alias of {_implementation(module)}; see fsdp_jax.")
    self._fsdp_module = module

  def __getattr__(self, name: str):
    if name.startswith("__"):
      raise AttributeError(name)
    for where in _implementations(self._fsdp_module):
      target = importlib.import_module(where)
      if hasattr(target, name):
        break
    value = getattr(target, name)  # AttributeError as usual for a wrong name
    warnings.warn(
        f"fsdp_jax.{self._fsdp_module}.{name} is deprecated: use "
        f"{_public_spelling(self._fsdp_module, name)}.",
        DeprecationWarning, stacklevel=2)
    return value

  def __dir__(self):
    return sorted({n for m in _implementations(self._fsdp_module)
                   for n in dir(importlib.import_module(m))})


def module_getattr(module: str, moved: dict):
  """A public module's ``__getattr__`` for names it no longer exports:
  ``moved`` maps each to ``(implementation module, why)``; reading one warns
  and returns it."""

  def __getattr__(name: str):
    if name not in moved:
      raise AttributeError(f"module {module!r} has no attribute {name!r}")
    where, why = moved[name]
    warnings.warn(f"{module}.{name} is deprecated: {why}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(where), name)

  return __getattr__


def register_moved_modules(package: str) -> None:
  """Puts the alias modules into ``sys.modules`` (not onto the package)."""
  for module in MOVED_MODULES:
    sys.modules.setdefault(f"{package}.{module}", _MovedModule(package, module))


def package_getattr(package: str, *, public: dict, lazy: tuple, namespace: dict):
  """The package's module ``__getattr__`` and ``__dir__`` (PEP 562).

  ``public`` maps each defining module to the public names it gives the
  package; ``lazy`` names the public submodules. Both are imported on first
  use and then kept in the package's ``namespace`` (later reads are plain
  attribute reads). Then the moved names and old module paths."""
  home = {name: module for module, names in public.items() for name in names}

  def __getattr__(name: str):
    if name in home:
      value = getattr(importlib.import_module(home[name]), name)
      namespace[name] = value
      return value
    if name in lazy:
      return importlib.import_module(f"{package}.{name}")
    if name in MOVED_NAMES:
      new, module, attr = MOVED_NAMES[name]
      warnings.warn(f"fsdp_jax.{name} is deprecated: use {new}.",
                    DeprecationWarning, stacklevel=2)
      return getattr(importlib.import_module(module), attr)
    if name in MOVED_MODULES:  # fsdp_jax.config etc. (fsdp_jax.state_dict is the function)
      return sys.modules[f"{package}.{name}"]
    if name in LAZY_MODULES:
      return importlib.import_module(f"{package}.{name}")
    raise AttributeError(f"module {package!r} has no attribute {name!r}")

  def __dir__():
    return sorted({*namespace, *home, *lazy})

  return __getattr__, __dir__
