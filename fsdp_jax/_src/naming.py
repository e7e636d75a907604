"""Names of pytree leaves: the dotted parameter names state dicts, wrap
policies and messages use (``"layers.0.wq"``), and which containers of a
tree are sequences (PyTorch's ``ModuleList``)."""

from __future__ import annotations

import dataclasses
import sys

import jax

ROOT = "_"  # the dotted name of the empty path (a tree that is one leaf)


def key_name(key) -> str:
  """One key of a key path as it appears in a dotted name."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_name(path) -> str:
  """A key path as a dotted name (``_`` for the empty path)."""
  return ".".join(key_name(k) for k in path) or ROOT


# The leaves of a LoRA target's stored node (fsdp_jax._src.lora.LoRAWeight).
ADAPTER_PARTS = ("base", "lora_A", "lora_B")


def path_parts(path) -> tuple[str, ...]:
  """Dotted-name parts of a key path, NNX's ``.value`` dropped (trailing, or
  before a LoRA target's parts: ``wq.kernel.base``, not
  ``wq.kernel.value.base``)."""
  parts = tuple(key_name(k) for k in path)
  keep = []
  for j, (k, part) in enumerate(zip(path, parts)):
    rest = parts[j + 1:]
    if (part == "value" and isinstance(k, jax.tree_util.GetAttrKey) and j > 0
        and (not rest or (len(rest) == 1 and rest[0] in ADAPTER_PARTS))):
      continue
    keep.append(part)
  return tuple(keep)


def leaf_paths(tree, is_leaf=None) -> list[tuple[str, ...]]:
  """Dotted-name parts of every leaf (see :func:`path_parts`)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  return [path_parts(path) for path, _ in flat]


def equinox():
  """The equinox module if the process imported it, else None (an equinox
  object exists only then; importing it for other models would cost time)."""
  if "equinox" not in sys.modules:
    return None
  import equinox as eqx  # pylint: disable=import-outside-toplevel  (optional dependency)
  return eqx


def is_equinox_module(x) -> bool:
  eqx = equinox()
  return eqx is not None and isinstance(x, eqx.Module)


def sequence_prefixes(tree) -> set:
  """Paths of list/tuple containers (PyTorch's ModuleList)."""
  out = set()

  def walk(x, prefix):
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
      out.add(prefix)
      for i, c in enumerate(x):
        walk(c, prefix + (str(i),))
    elif is_equinox_module(x):  # its fields are its children
      for f in dataclasses.fields(x):
        walk(getattr(x, f.name, None), prefix + (f.name,))
    elif isinstance(x, dict) or hasattr(x, "items"):
      try:
        items = list(x.items())
      except Exception:  # not a mapping after all
        return
      for k, c in items:
        walk(c, prefix + (str(k),))

  walk(tree, ())
  return out
