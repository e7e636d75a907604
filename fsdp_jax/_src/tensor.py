"""Tensor parallelism's configuration: :class:`TensorParallel`, its rules, and
which dimension of which leaf each rule splits over the ``"tensor"`` axis.

This module is pure tree work. How a split leaf is stored lives in
:mod:`fsdp_jax._src.plan` / :mod:`fsdp_jax._src.layout`; how the loss runs
on the split leaves (Megatron's collectives over ``"tensor"``) in
:mod:`fsdp_jax._src.tensor_eval`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

from fsdp_jax._src.lora import matches
from fsdp_jax._src.wrap import named_weights

LAYOUTS = ("colwise", "rowwise")
# A module's bias (Flax's, PyTorch's, Haiku's): split with a colwise kernel,
# replicated with a rowwise one (PyTorch's ColwiseParallel / RowwiseParallel).
BIAS_NAMES = ("bias", "b")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorParallel:
  """Tensor parallelism over the mesh's ``"tensor"`` axis, composed with FSDP
  over ``"shard"`` (and ``"replicate"``): ``FSDPConfig(tensor_parallel=...)``.

  Each rule ``(pattern, layout)`` splits the leaves ``pattern`` names:

  * ``"colwise"``: a kernel's output axis (its last axis in JAX's ``[in,
    out]`` layout), PyTorch's ``ColwiseParallel``; a pattern naming a module
    splits its ``kernel``/``weight`` and its ``bias``;
  * ``"rowwise"``: a kernel's input axis (its first axis), PyTorch's
    ``RowwiseParallel``; a module's ``bias`` stays replicated;
  * a tuple with one entry per dimension (per layer for ``stacked_layers``),
    the tensor axis name at the split dimension and ``None`` elsewhere, for
    other layouts: an embedding by vocabulary (``("tensor", None)``) or by
    feature (``(None, "tensor")``), a 3-D kernel, a bias.

  Leaves no rule names are replicated over ``"tensor"`` and sharded by FSDP
  as before. Each split leaf is stored as its ``1/T`` slice, FSDP-sharded
  within the slice; the model and the loss stay single-device code: the step
  runs the loss on each device's slices with Megatron's collectives over
  ``"tensor"`` (an all-reduce after a row-parallel matmul, ...). See
  ``docs/tensor_parallel.md``.

  Args:
    rules: ``[(pattern, layout), ...]``; patterns are dotted-name globs as in
      ``LoRA(targets=...)`` (``*`` within one segment, ``**`` across; a
      pattern may match a trailing part of a name).
    axis: the mesh axis name (``fsdp_jax.make_mesh(tensor=T)`` names it
      ``"tensor"``).
    sequence_parallel: Megatron's sequence parallelism (torchtitan's
      ``SequenceParallel``), on by default: a row-parallel output is
      reduce-scattered along the sequence instead of all-reduced, the
      norms, residual adds and dropout after it run on each device's
      ``1/T`` of the positions, and the next column-parallel matmul
      all-gathers its input along the sequence (backward: the dual
      collectives; the bytes moved are the all-reduce's). The sequence is
      dimension 1 of every batch leaf with one (under a ``"context"`` axis:
      ``ContextParallel``'s ``dim`` and ``leaves``), followed through the
      model; a value whose sequence length ``T`` does not divide, or that
      cannot be followed, is all-reduced as with ``False``. Exact either way.

  Example:
    >>> import fsdp_jax
    >>> tp = fsdp_jax.TensorParallel(rules=[("*.wq", "colwise"), ("*.wo", "rowwise"),
    ...                                     ("embed.embedding", ("tensor", None))])
    >>> tp.rules[1]
    ('*.wo', 'rowwise')
  """

  rules: Sequence[tuple[str, Union[str, tuple]]]
  axis: str = "tensor"
  sequence_parallel: bool = True

  def __post_init__(self):
    if not isinstance(self.axis, str) or not self.axis:
      raise TypeError(f"TensorParallel(axis={self.axis!r}) must be a mesh axis name.")
    if not isinstance(self.sequence_parallel, bool):
      raise TypeError(f"TensorParallel(sequence_parallel={self.sequence_parallel!r}) takes "
                      "True or False.")
    if isinstance(self.rules, dict):
      rules = tuple(self.rules.items())
    else:
      try:
        rules = tuple(tuple(r) for r in self.rules)
      except TypeError:
        rules = None
    if not rules or any(len(r) != 2 for r in rules):
      raise TypeError(
          f"TensorParallel(rules={self.rules!r}): pass a non-empty list of (pattern, "
          "layout) pairs, e.g. rules=[('*.wq', 'colwise'), ('*.wo', 'rowwise')].")
    out = []
    for pattern, layout in rules:
      if not isinstance(pattern, str) or not pattern:
        raise TypeError(f"TensorParallel rule pattern {pattern!r} must be a dotted-name "
                        "glob string such as '*.wq'.")
      if isinstance(layout, list):
        layout = tuple(layout)
      if isinstance(layout, tuple):
        named = [d for d, a in enumerate(layout) if a is not None]
        if len(named) != 1 or layout[named[0]] != self.axis:
          raise ValueError(
              f"TensorParallel rule {pattern!r}: the layout tuple {layout!r} must name the "
              f"tensor axis {self.axis!r} at exactly one dimension and None elsewhere, "
              f"e.g. ({self.axis!r}, None) for an embedding split by vocabulary.")
      elif layout not in LAYOUTS:
        raise ValueError(
            f"TensorParallel rule {pattern!r}: layout {layout!r} is not 'colwise', "
            "'rowwise' or a tuple naming the tensor axis per dimension.")
      out.append((pattern, layout))
    object.__setattr__(self, "rules", tuple(out))


def _dim(layout, ndim: int, name: str, pattern: str, shape: tuple,
         lead: int) -> int:
  """The per-layer dimension ``layout`` splits in a leaf of per-layer rank
  ``ndim``."""
  if isinstance(layout, tuple):
    if len(layout) == ndim + lead and lead and layout[0] is None:
      layout = layout[lead:]
    if len(layout) != ndim:
      per = " per layer (stacked_layers)" if lead else ""
      raise ValueError(
          f"TensorParallel rule {pattern!r} gives {len(layout)} dimensions {layout!r} but "
          f"{name!r} has shape {shape}, {ndim}-D{per}. Fix: give one entry per "
          "dimension.")
    return next(d for d, a in enumerate(layout) if a is not None)
  if ndim == 0:
    raise ValueError(
        f"TensorParallel rule {pattern!r} ({layout}) matches the scalar {name!r}; a scalar "
        "cannot be split. Fix: narrow the pattern.")
  if ndim == 1 and layout == "rowwise":
    raise ValueError(
        f"TensorParallel rule {pattern!r} is rowwise but matches the 1-D {name!r} (shape "
        f"{shape}): a row-parallel layer's bias is replicated. Fix: narrow the pattern to "
        "the kernel, or give a tuple layout to split a vector.")
  return ndim - 1 if layout == "colwise" else 0


def leaf_dims(paths: Sequence[tuple], shapes: Sequence[tuple], leads: Sequence[int],
              tp: TensorParallel, size: int) -> dict:
  """``{leaf index: per-layer dimension split over the tensor axis}``, or a
  ``ValueError`` naming the rule, leaf, shape, axis size and fix.

  ``leads[i]`` is 1 for a leaf of a stacked unit (a leading layer axis that
  is never split). A rule naming a module splits its weight (its leaf
  called ``kernel``, ``weight``, ``w``, ``embedding`` or ``embeddings``, else
  its one leaf of two or more dimensions), and for ``"colwise"`` its
  ``bias`` (or ``b``).

  Example:
    >>> tp = TensorParallel(rules=[("up", "colwise"), ("down", "rowwise")])
    >>> leaf_dims([("up", "kernel"), ("up", "bias"), ("down", "kernel"), ("down", "bias")],
    ...           [(4, 8), (8,), (8, 4), (4,)], [0, 0, 0, 0], tp, 2)
    {0: 1, 1: 0, 2: 0}
  """
  names = [".".join(p) for p in paths]
  owner: dict = {}
  out: dict = {}
  for pattern, layout in tp.rules:
    found = named_weights(paths, shapes, leads, pattern, "TensorParallel rule", match=matches)
    hits = list(found)
    if layout == "colwise":
      modules = {m for m in found.values() if m is not None}
      hits = sorted(hits + [i for i, p in enumerate(paths) if len(p) > 1 and p[-1] in BIAS_NAMES
                            and ".".join(p[:-1]) in modules and i not in found])
    if not hits:
      examples = ", ".join(repr(n) for n in names[:6])
      raise ValueError(
          f"TensorParallel rule {pattern!r} ({layout!r}) matches no parameter. Parameters "
          f"are named by dotted paths such as {examples}; a pattern names a parameter or "
          "its module (the module's weight: 'kernel', 'weight', 'w', 'embedding', or its one "
          "leaf of 2 or more dimensions; and 'bias' for colwise), '*' within one segment, "
          "'**' across. Fix the pattern.")
    for i in hits:
      if i in owner:
        raise ValueError(
            f"Parameter {names[i]!r} (shape {tuple(shapes[i])}) is matched by two "
            f"TensorParallel rules: {owner[i]!r} and {(pattern, layout)!r}. Fix: narrow "
            "one pattern so each leaf has one layout.")
      owner[i] = (pattern, layout)
      shape = tuple(shapes[i])
      lead = leads[i]
      d = _dim(layout, len(shape) - lead, names[i], pattern, shape, lead)
      n = shape[lead + d]
      if n % size:
        raise ValueError(
            f"TensorParallel rule {pattern!r} splits dimension {d} of {names[i]!r} (shape "
            f"{shape}, size {n}) over the tensor axis {tp.axis!r} of size {size}, which "
            f"does not divide it. Fix: use a tensor axis size dividing {n} (e.g. "
            f"{_divisors(n, size)}), pad the dimension in the model, or leave this leaf "
            "replicated.")
      out[i] = d
  return out


def _divisors(n: int, near: int) -> str:
  ds = [d for d in range(2, min(n, 4 * near) + 1) if n % d == 0]
  return ", ".join(map(str, ds[:5])) or "1"


def describe(layout_dim: Optional[int], ndim: int, axis: str) -> str:
  """``"(None, 'tensor')"``-style text of a leaf's split (for the plan)."""
  if layout_dim is None:
    return ""
  return "(" + ", ".join(repr(axis) if d == layout_dim else "None" for d in range(ndim)) + ")"
