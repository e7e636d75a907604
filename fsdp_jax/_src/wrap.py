"""Wrap policies: which subtrees of the parameter tree become FSDP units.

The parameter pytree is walked like PyTorch walks ``nn.Module`` children: every
container (dict, list, Flax module scope, ...) is a *node*, every array a
parameter. A policy is called as ``policy(node, recurse, nonwrapped_numel)``
exactly like PyTorch's ``auto_wrap_policy(module, recurse, nonwrapped_numel)``:
with ``recurse=True`` it says whether to descend into the node, with
``recurse=False`` whether to make the node a unit, given the number of
parameters its children did not already claim. The root unit takes what no
policy claimed.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Iterable, Optional, Sequence, Union



@dataclasses.dataclass(frozen=True)
class Node:
  """A container in the parameter tree, as seen by a wrap policy.

  Attributes:
    path: the keys from the root, as strings.
    name: the dotted name (``"params.Block_0"``); ``""`` for the root.
    module_type: the Flax module class that owns this subtree, when known.
    numel: the number of parameters under this node.
    is_sequence: whether the node is a list/tuple (PyTorch's ``ModuleList``).

  Example: the nodes a policy sees.
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> seen = []
    >>> def policy(node):
    ...   seen.append((node.name, node.numel))
    ...   return node.name == "b"
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(
    ...     params={"a": {"w": jnp.ones(4)}, "b": {"w": jnp.ones(6)}}, optimizer=optax.sgd(0.1),
    ...     mesh=mesh, config=fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.CustomPolicy(policy)))
    >>> sorted(set(seen))
    [('a', 4), ('b', 6)]
  """

  path: tuple[str, ...]
  name: str
  module_type: Optional[type]
  numel: int
  is_sequence: bool


def _is_sequence_node(node: Node) -> bool:
  return node.is_sequence


def size_based_auto_wrap_policy(
    module: Node, recurse: bool, nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: Optional[Iterable[Any]] = None,
    exclude_wrap_modules: Optional[Iterable[Any]] = None) -> bool:
  """PyTorch's size-based policy: wrap a node whose unclaimed parameters are
  ``>= min_num_params``.

  As in PyTorch, the traversal only descends into nodes that are large
  enough, lists (``ModuleList``) are never wrapped themselves, and
  ``force_leaf_modules`` (module classes or dotted-name patterns) are not
  descended into. Use with ``functools.partial``.

  Example:
    >>> import functools, fsdp_jax
    >>> policy = functools.partial(fsdp_jax.size_based_auto_wrap_policy,
    ...                            min_num_params=1000)
  """
  is_large = nonwrapped_numel >= min_num_params
  if recurse:
    return is_large and not _matches(module, force_leaf_modules or ())
  excluded = _is_sequence_node(module) or _matches(module, exclude_wrap_modules or ())
  return is_large and not excluded


def lambda_auto_wrap_policy(module: Node, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[Node], bool]) -> bool:
  """PyTorch's lambda policy: wrap every node for which ``lambda_fn(node)``.

  Example:
    >>> import functools, jax, jax.numpy as jnp, optax, fsdp_jax
    >>> policy = functools.partial(fsdp_jax.lambda_auto_wrap_policy,
    ...                            lambda_fn=lambda node: node.name.startswith("layers."))
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(
    ...     params={"layers": [{"w": jnp.ones(4)}, {"w": jnp.ones(4)}], "head": jnp.ones(2)},
    ...     optimizer=optax.sgd(0.1), mesh=mesh,
    ...     config=fsdp_jax.FSDPConfig(auto_wrap_policy=policy))
    >>> [u.display_name for u in state.plan.units]
    ['layers.0', 'layers.1', '<root>']
  """
  del nonwrapped_numel
  if recurse:
    return True
  return bool(lambda_fn(module))


# Compiled patterns, reused across the tree walk (a policy is asked about
# every node). Bounded; ``_name_regex.cache_clear()`` empties it.
@functools.lru_cache(maxsize=1024)
def _name_regex(pattern: str) -> "re.Pattern":
  out = []
  i = 0
  while i < len(pattern):
    c = pattern[i]
    if pattern.startswith("**", i):
      out.append(".*")
      i += 2
      continue
    out.append({"*": "[^.]*", "?": "[^.]"}.get(c, re.escape(c)))
    i += 1
  return re.compile("".join(out) + r"\Z")


def name_matches(name: str, pattern: str) -> bool:
  """Glob match of a dotted name, one path segment at a time: ``*`` and
  ``?`` never cross a dot, ``**`` does. So ``"blocks.*"`` names the children
  of ``blocks`` but not their children.

  Example:
    >>> name_matches("params.Block_0", "params.Block_*")
    True
    >>> name_matches("params.Block_0.Dense_0", "params.Block_*")
    False
    >>> name_matches("params.Block_0.Dense_0", "params.**.Dense_0")
    True
  """
  return _name_regex(pattern).match(name) is not None


def named_leaves(paths, patterns, what: str, match=None) -> set:
  """Indices of the leaves (dotted-name parts ``paths``) that ``patterns``
  name, each a leaf or a subtree above it (``match(name, pattern)``,
  default :func:`name_matches`); a ``ValueError`` for a pattern that names
  nothing, ``what`` saying where it came from (``"ignored_states entry"``).

  Example:
    >>> named_leaves([("a", "w"), ("a", "b"), ("c",)], ["a"], "entry")
    {0, 1}
  """
  match = name_matches if match is None else match
  out = set()
  for pattern in patterns:
    hits = {i for i, p in enumerate(paths)
            if any(match(".".join(p[:k]), pattern) for k in range(1, len(p) + 1))}
    if not hits:
      examples = ", ".join(repr(".".join(p)) for p in paths[:6])
      raise ValueError(
          f"{what} {pattern!r} matches no parameter or subtree; parameters are named by "
          f"dotted paths such as {examples}. Fix the pattern.")
    out |= hits
  return out


# The names a module's weight goes by: Flax's ``kernel`` and ``embedding``,
# PyTorch's and equinox's ``weight``, Haiku's ``w`` and ``embeddings``.
WEIGHT_NAMES = ("kernel", "weight", "w", "embedding", "embeddings")


def named_weights(paths, shapes, leads, pattern: str, what: str, match=None) -> dict:
  """``{leaf index: module}``: the leaves ``pattern`` names directly
  (``module`` None), and for each module (the parent of leaves) it names,
  the module's weight (``module`` its dotted name): its leaf called one of
  :data:`WEIGHT_NAMES`, else its one leaf of two or more dimensions
  (``leads[i]`` leading layer axes not counted). A module with several such
  leaves is a ``ValueError`` naming them and the fix; one with none names
  nothing. ``match(name, pattern)`` defaults to :func:`name_matches`.

  Example:
    >>> paths = [("attn", "w"), ("attn", "b"), ("mlp", "up"), ("mlp", "scale")]
    >>> named_weights(paths, [(4, 2, 2), (2, 2), (4, 8), (8,)], [0] * 4, "attn", "rule")
    {0: 'attn'}
    >>> named_weights(paths, [(4, 2, 2), (2, 2), (4, 8), (8,)], [0] * 4, "mlp", "rule")
    {2: 'mlp'}
  """
  match = name_matches if match is None else match
  out: dict = {}
  modules: dict = {}
  for i, p in enumerate(paths):
    if match(".".join(p), pattern):
      out[i] = None
    if len(p) > 1:
      modules.setdefault(tuple(p[:-1]), []).append(i)
  for module, ids in modules.items():
    name = ".".join(module)
    if not match(name, pattern):
      continue
    named = [i for i in ids if paths[i][-1] in WEIGHT_NAMES]
    found = named or [i for i in ids if len(shapes[i]) - leads[i] >= 2]
    if len(found) > 1:
      listed = ", ".join(f"{paths[i][-1]!r} {tuple(shapes[i])}" for i in found)
      leaf = paths[found[0]][-1]
      raise ValueError(
          f"{what} {pattern!r} names module {name!r}, which holds several weights: {listed}. "
          f"Fix: name the leaf itself, e.g. {name + '.' + leaf!r} (or "
          f"'*.{module[-1]}.{leaf}' for every such module).")
    if found:
      out.setdefault(found[0], name)
  return out


def _matches(node: Node, specs: Iterable[Any]) -> bool:
  for spec in specs:
    if isinstance(spec, str):
      if name_matches(node.name, spec):
        return True
    elif isinstance(spec, type):
      if node.module_type is not None and issubclass(node.module_type, spec):
        return True
    else:
      raise TypeError(
          f"Wrap policy entry {spec!r} is neither a module class nor a "
          "dotted-name pattern string.")
  return False


class ModuleWrapPolicy:
  """Wraps every node that is an instance of one of ``module_classes``.

  Each entry is one of:

  * a module class (Flax linen, NNX or equinox): wraps every subtree owned
    by an instance of it or of a subclass, when the model's module classes
    are known (:func:`init_train_state` collects them from ``init_fn`` or a
    model; see :func:`fsdp_jax.module_classes`);
  * a dotted-path glob pattern of subtrees (``"layers.*"``,
    ``"params.Block_*"``): ``*`` matches within one path segment, ``**``
    across segments; this is how plain trees are wrapped;
  * a class name (``"Block"``): a string that matches no subtree's path but
    is the ``__name__`` of module classes of the model stands for those
    classes, exactly as if they were passed.

  A string that is neither a path pattern of the tree nor a class name of
  the model is an error when the policy wraps nothing, which lists the
  subtree paths and the model's class names.

  Example:
    >>> import fsdp_jax
    >>> policy = fsdp_jax.ModuleWrapPolicy({"blocks.*"})
    >>> by_name = fsdp_jax.ModuleWrapPolicy({"Block"})  # the model's Block class
  """

  def __init__(self, module_classes: Iterable[Union[type, str]]):
    if isinstance(module_classes, (str, type)):
      module_classes = [module_classes]
    self._module_classes = tuple(module_classes)
    if not self._module_classes:
      raise ValueError("ModuleWrapPolicy needs at least one module class or pattern.")
    _matches(Node((), "", None, 0, False), self._module_classes)

  def __call__(self, module: Node, recurse: bool, nonwrapped_numel: int) -> bool:
    del nonwrapped_numel
    if recurse:
      return True
    return _matches(module, self._module_classes)

  def __repr__(self):
    return f"ModuleWrapPolicy({self._module_classes!r})"

  def _for_tree(self, names: Iterable[str],
               module_types: dict) -> tuple["ModuleWrapPolicy", tuple[str, ...]]:
    """This policy for one tree: ``(policy, unmatched)``. A string entry that
    matches none of the subtree ``names`` but is the ``__name__`` of classes
    in ``module_types`` (``{path: module class}``) is replaced by those
    classes; ``unmatched`` are the strings that are neither."""
    names = tuple(names)
    by_name: dict = {}
    for cls in module_types.values():
      by_name.setdefault(cls.__name__, {})[cls] = None
    entries, unmatched = [], []
    for spec in self._module_classes:
      if not isinstance(spec, str) or any(name_matches(n, spec) for n in names):
        entries.append(spec)
      elif spec in by_name:
        entries.extend(by_name[spec])
      else:
        entries.append(spec)
        unmatched.append(spec)
    if entries == list(self._module_classes):
      return self, tuple(unmatched)
    return ModuleWrapPolicy(entries), tuple(unmatched)

  # A value: equal entries (in any order) make an equal policy, so two configs
  # built separately with ModuleWrapPolicy({"l1"}) are the same config.
  def _value_key(self):
    return frozenset(self._module_classes)

  def __eq__(self, other):
    return type(other) is type(self) and self._value_key() == other._value_key()

  def __hash__(self):
    return hash(self._value_key())


class CustomPolicy:
  """PyTorch's ``CustomPolicy``: ``lambda_fn(node)`` returns ``True`` to wrap
  the node, ``False`` not to, or a dict of per-unit option overrides (which
  also wraps it; an empty dict does not).

  Example:
    >>> import fsdp_jax
    >>> policy = fsdp_jax.CustomPolicy(lambda node: node.name.startswith("enc"))
  """

  def __init__(self, lambda_fn: Callable[[Node], Union[bool, dict]]):
    self._lambda_fn = lambda_fn

  def __call__(self, module: Node, recurse: bool, nonwrapped_numel: int) -> bool:
    del nonwrapped_numel
    if recurse:
      return True
    return bool(self._lambda_fn(module))

  def overrides(self, module: Node) -> dict:
    out = self._lambda_fn(module)
    return dict(out) if isinstance(out, dict) else {}

  def __repr__(self):
    return f"CustomPolicy({self._lambda_fn!r})"

  # Equal when built around the same function (functions compare by identity).
  def _value_key(self):
    return self._lambda_fn

  def __eq__(self, other):
    return type(other) is type(self) and self._value_key() == other._value_key()

  def __hash__(self):
    return hash(self._value_key())


@dataclasses.dataclass
class _Trie:
  path: tuple[str, ...]
  children: dict
  leaf_ids: list  # direct leaves
  is_sequence: bool = False


def build_trie(leaf_paths: Sequence[tuple[str, ...]],
               sequence_prefixes: set) -> _Trie:
  root = _Trie((), {}, [])
  for i, path in enumerate(leaf_paths):
    node = root
    for depth, key in enumerate(path[:-1]):
      if key not in node.children:
        sub = path[: depth + 1]
        node.children[key] = _Trie(sub, {}, [], sub in sequence_prefixes)
      node = node.children[key]
    node.leaf_ids.append(i)
  return root


def _all_leaves(t: _Trie) -> list[int]:
  out = list(t.leaf_ids)
  for c in t.children.values():
    out.extend(_all_leaves(c))
  return out


@dataclasses.dataclass(frozen=True)
class UnitChoice:
  name: str
  leaf_ids: tuple[int, ...]
  overrides: tuple[tuple[str, Any], ...]
  stacked: bool


def choose_units(leaf_paths: Sequence[tuple[str, ...]],
                 leaf_numels: Sequence[int],
                 *,
                 policy: Optional[Callable[..., bool]],
                 module_types: dict,
                 sequence_prefixes: set,
                 stacked_patterns: Sequence[str],
                 full_precision_nodes: Sequence[tuple] = (),
                 ignored: Sequence[int] = ()) -> list[UnitChoice]:
  """Runs ``policy`` over the tree the way PyTorch's ``_recursive_wrap`` does.

  Returns the units in post-order (children before parents), root last.
  """
  trie = build_trie(leaf_paths, sequence_prefixes)
  claimed: set[int] = set(ignored)  # ignored leaves belong to no unit
  units: list[UnitChoice] = []
  dotted = lambda p: ".".join(p)

  def node_of(t: _Trie, numel: int) -> Node:
    return Node(t.path, dotted(t.path), module_types.get(t.path), numel, t.is_sequence)

  def numel_of(ids):
    return int(sum(leaf_numels[i] for i in ids))

  def add_unit(t: _Trie, overrides: dict, stacked: bool):
    ids = tuple(i for i in sorted(_all_leaves(t)) if i not in claimed)
    if not ids:
      return 0
    claimed.update(ids)
    units.append(UnitChoice(dotted(t.path), ids,
                            tuple(sorted(overrides.items())), stacked))
    return numel_of(ids)

  # Stacked subtrees are units of their own, decided before any policy.
  stacked_hits: set[str] = set()

  def mark_stacked(t: _Trie):
    for c in t.children.values():
      mark_stacked(c)
    if t.path and any(name_matches(dotted(t.path), p) for p in stacked_patterns):
      stacked_hits.add(dotted(t.path))
      add_unit(t, {}, True)

  mark_stacked(trie)

  # Modules kept out of mixed precision (PyTorch's _module_classes_to_ignore)
  # are units of their own with mixed precision disabled.
  def mark_full_precision(t: _Trie):
    for c in t.children.values():
      mark_full_precision(c)
    if t.path and t.path in full_precision_nodes:
      add_unit(t, {"mixed_precision": None}, False)

  if full_precision_nodes:
    mark_full_precision(trie)
  for pattern in stacked_patterns:
    if not any(name_matches(h, pattern) for h in stacked_hits):
      raise ValueError(
          f"stacked_layers pattern {pattern!r} matches no subtree of the "
          f"parameter tree. Subtrees are named by dotted paths such as "
          f"{_example_names(trie)}; fix the pattern.")

  def recurse(t: _Trie, is_root: bool, policy: Callable[..., bool]) -> int:
    total = numel_of([i for i in _all_leaves(t) if i not in claimed])
    node = node_of(t, total)
    if not policy(node, recurse=True, nonwrapped_numel=total):
      return 0
    wrapped = 0
    for child in t.children.values():
      wrapped += recurse(child, False, policy)
    remainder = total - wrapped
    if not is_root and remainder > 0 and policy(
        node_of(t, remainder), recurse=False, nonwrapped_numel=remainder):
      overrides = policy.overrides(node) if isinstance(policy, CustomPolicy) else {}
      add_unit(t, overrides, False)
      return total
    return wrapped

  if policy is not None:
    unmatched: tuple[str, ...] = ()
    if isinstance(policy, ModuleWrapPolicy):  # class names become the classes
      run_policy, unmatched = policy._for_tree(_all_names(trie), module_types)
    else:
      run_policy = policy
    before = len(units)
    recurse(trie, True, run_policy)
    is_size_based = getattr(policy, "func", None) is size_based_auto_wrap_policy or \
        policy is size_based_auto_wrap_policy
    if len(units) == before and not is_size_based:
      raise ValueError(_claims_nothing_message(policy, unmatched, trie, module_types))
  rest = tuple(i for i in range(len(leaf_paths)) if i not in claimed)
  if rest:
    units.append(UnitChoice("", rest, (), False))
  return units


def _claims_nothing_message(policy, unmatched: Sequence[str], trie: _Trie,
                            module_types: dict) -> str:
  class_names = sorted({t.__name__ for t in module_types.values()})
  if not unmatched:
    return (
        f"auto_wrap_policy {policy!r} claims no parameter: it did not wrap "
        f"any subtree. Subtrees are named by dotted paths such as "
        f"{_example_names(trie)}"
        + (f" and have module classes {class_names}"
           if module_types else " (no Flax module classes are known for this tree: "
           "pass module_classes= to init_train_state, or use name patterns)")
        + ". Fix the policy or pass auto_wrap_policy=None.")
  entries = ", ".join(repr(s) for s in unmatched)
  if class_names:
    known = (f"the model's module classes are {', '.join(map(repr, class_names))}: pass "
             f"the class itself (ModuleWrapPolicy({{{class_names[0]}}})) or its name "
             f"(ModuleWrapPolicy({{{class_names[0]!r}}}))")
  else:
    known = ("no module classes are known for this tree: pass init_train_state "
             "init_fn= (Flax linen) or module_classes=fsdp_jax.module_classes(model)")
  return (
      f"auto_wrap_policy {policy!r} claims no parameter: {entries} "
      f"{'is' if len(unmatched) == 1 else 'are'} neither a subtree path pattern nor "
      f"a module class name of this model. A string entry "
      f"is either a dotted path pattern ('*' within one segment, '**' across, e.g. "
      f"'params.layers_*'; this tree's subtrees are such as {_example_names(trie)}) "
      f"or the name of a module class: {known}. Fix the entry or pass "
      f"auto_wrap_policy=None.")


def _all_names(trie: _Trie) -> list[str]:
  """The dotted names of every subtree below the root."""
  out = []

  def walk(t):
    if t.path:
      out.append(".".join(t.path))
    for c in t.children.values():
      walk(c)

  walk(trie)
  return out


def _example_names(trie: _Trie, limit: int = 6) -> str:
  names = []

  def walk(t):
    if len(names) >= limit:
      return
    if t.path:
      names.append(".".join(t.path))
    for c in t.children.values():
      walk(c)

  walk(trie)
  return ", ".join(repr(n) for n in names[:limit])
