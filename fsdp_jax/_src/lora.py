"""LoRA and QLoRA: the adapter configuration, and the parameter tree with
adapters.

With ``FSDPConfig(lora=LoRA(...))`` the state stores each target kernel
``W`` (``[*in, *out]``: ``[m, n]``, or an N-D kernel such as Flax
``DenseGeneral``'s ``[d, heads, head_dim]``; ``[layers, ...]`` in a stacked
unit) as a :class:`LoRAWeight`: the frozen ``base`` (``W`` itself, or for
QLoRA its block-quantized rows: ``W`` as ``[*in, prod(out)]``, each row a
``uint8`` payload row of :func:`fsdp_jax._src.quantization.encode`, codes
then float32 scales) and the trainable factors ``lora_A`` (``[*in, r]``) and
``lora_B`` (``[r, *out]``). The loss sees ``W + (alpha / r) * lora_A @
lora_B`` (contracting ``r``; PEFT's LoRA on a linear layer: for a JAX ``[in,
out]`` kernel ``lora_A`` is PEFT's ``lora_A.weight`` transposed and
``lora_B`` its ``lora_B.weight`` transposed).

This module is pure tree work: which leaves are targets, the stored tree
and its trainable mask, and the merged weights. How the step computes the
adapter path beside the frozen matmul lives in
:mod:`fsdp_jax._src.adapters`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax._src import naming
from fsdp_jax._src import quantization as quant
from fsdp_jax._src.quantization import Quantization
from fsdp_jax._src.wrap import name_matches, named_leaves, named_weights


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRA:
  """LoRA (and QLoRA) fine-tuning, PEFT's semantics: ``FSDPConfig(lora=...)``.

  Each target kernel ``W`` is seen by the loss as ``W + (alpha / rank) * A @
  B``, with ``A`` (``[m, rank]``, PEFT's Kaiming-uniform init: uniform in
  ``+-1/sqrt(m)``) and ``B`` (``[rank, n]``, zeros) trainable and in the
  kernel's own layout (for a JAX ``[in, out]`` kernel, ``A`` is PEFT's
  ``lora_A.weight.T`` and ``B`` its ``lora_B.weight.T``) and dtype (float32
  for a 16-bit kernel, as PEFT's ``autocast_adapter_dtype``). An N-D kernel
  (Flax ``DenseGeneral`` / einsum kernels) is its input dimensions then its
  output dimensions: ``[d, heads, head_dim]`` gets ``A`` ``[d, rank]`` and
  ``B`` ``[rank, heads, head_dim]``, an output projection ``[heads,
  head_dim, d]`` with ``input_dims=2`` gets ``A`` ``[heads, head_dim, rank]``
  and ``B`` ``[rank, d]`` (``m``, ``n``: the products). The step computes
  ``x @ W + (alpha / rank) * (dropout(x) @ A) @ B`` where the loss uses the
  kernel as a matmul operand (a ``dot_general`` contracting its input
  dimensions, or its output dimensions for a transposed use), so the frozen
  base's weight gradient is never computed; every other use sees the merged
  weight (``print(state.plan)`` says which). Everything else is frozen (no
  gradient, no reduce-scatter, no optimizer state) except the leaves
  ``trainable`` names.

  Args:
    targets: glob patterns over dotted parameter names (``*`` within one
      segment, ``**`` across; a pattern may match any trailing part of a
      name, as PEFT's ``target_modules`` do). A pattern naming a module
      (``"*.wq"`` for Flax's ``...wq.kernel``) names its weight: its leaf
      called ``kernel``, ``weight``, ``w``, ``embedding`` or ``embeddings``,
      else its one leaf of two or more dimensions (several are an error
      naming them). Kernels have at least 2 dimensions per layer.
    rank: ``r``, at most the smaller of ``m`` and ``n``.
    alpha: ``lora_alpha``; the adapter is scaled by ``alpha / rank``.
    dropout: ``lora_dropout``: dropout on the adapter path's input (needs
      ``init_train_state(rng=...)``; each step and device draws its own
      mask).
    trainable: dotted-name patterns of other leaves (or subtrees) to train
      fully: norms, a new head (PEFT's ``modules_to_save``).
    base_quantization: QLoRA: a :class:`fsdp_jax.Quantization` for the frozen
      target kernels, e.g. ``Quantization(dtype="nf4", block_size=64)``
      (QLoRA's NormalFloat4) or ``dtype=jnp.int8``. Each kernel row (an N-D
      kernel's output dimensions flattened) is stored as codes plus one
      float32 absmax scale per block (a partial last block is allowed, so
      any width works), gathered quantized (4 bits per value on the wire
      for nf4) and dequantized to the compute dtype after the gather.
    input_dims: how many leading dimensions (per layer) of a target kernel
      are its input: an int for every target (default 1: ``[in, out]``,
      ``[d, heads, head_dim]``), or ``{pattern: int}`` for the targets a
      pattern names (the others take 1), e.g. ``{"*.o_proj": 2}`` for
      ``[heads, head_dim, d]`` output projections.

  Example:
    >>> import fsdp_jax
    >>> lora = fsdp_jax.LoRA(targets=("*.wq", "*.wv"), rank=4, alpha=8.0)
    >>> lora.scaling
    2.0
    >>> fsdp_jax.FSDPConfig(lora=lora, use_orig_params=True).lora.rank
    4
    >>> fsdp_jax.LoRA(targets=("q", "o"), input_dims={"o": 2}).input_dims
    (('o', 2),)
  """

  targets: Sequence[str]
  rank: int = 8
  alpha: float = 16.0
  dropout: float = 0.0
  trainable: Sequence[str] = ()
  base_quantization: Optional[Quantization] = None
  input_dims: Union[int, Mapping[str, int], Sequence[tuple]] = 1

  def __post_init__(self):
    targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
    if not targets or not all(isinstance(t, str) and t for t in targets):
      raise ValueError(
          f"LoRA(targets={self.targets!r}) must be non-empty dotted-name patterns, e.g. "
          "targets=('*.wq', '*.wv') or ('*.q_proj', '*.v_proj').")
    object.__setattr__(self, "targets", targets)
    trainable = (self.trainable,) if isinstance(self.trainable, str) else tuple(self.trainable)
    if not all(isinstance(t, str) and t for t in trainable):
      raise ValueError(f"LoRA(trainable={self.trainable!r}) must be dotted-name patterns.")
    object.__setattr__(self, "trainable", trainable)
    r = self.rank
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r <= 0:
      raise ValueError(f"LoRA(rank={r!r}) must be a positive int, e.g. rank=8.")
    object.__setattr__(self, "rank", int(r))
    if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float, np.number)):
      raise TypeError(f"LoRA(alpha={self.alpha!r}) must be a number, e.g. alpha=16.0.")
    object.__setattr__(self, "alpha", float(self.alpha))
    d = self.dropout
    if isinstance(d, bool) or not isinstance(d, (int, float, np.number)) or not 0 <= d < 1:
      raise ValueError(f"LoRA(dropout={d!r}) must be a number in [0, 1), e.g. 0.05.")
    object.__setattr__(self, "dropout", float(d))
    q = self.base_quantization
    if q is not None:
      if not isinstance(q, Quantization):
        raise TypeError(
            f"LoRA(base_quantization={q!r}) must be a fsdp_jax.Quantization, e.g. "
            "fsdp_jax.Quantization(dtype='nf4', block_size=64).")
      if q.rounding == "stochastic":
        raise ValueError(
            "LoRA(base_quantization=Quantization(rounding='stochastic')): the frozen base "
            "is quantized once, to nearest. Fix: drop rounding= (or pass 'nearest').")
    object.__setattr__(self, "input_dims", _input_dims(self.input_dims))

  def input_dims_of(self, name: str) -> int:
    """The input dimensions of target ``name``: the first ``input_dims``
    pattern naming it (or its module), else 1 (or the int given)."""
    if isinstance(self.input_dims, int):
      return self.input_dims
    module = name.rsplit(".", 1)[0] if "." in name else None
    for pattern, k in self.input_dims:
      if matches(name, pattern) or (module is not None and matches(module, pattern)):
        return k
    return 1

  @property
  def scaling(self) -> float:
    """``alpha / rank``: the adapter's scale."""
    return self.alpha / self.rank

  def describe(self) -> str:
    """One line, as ``print(state.plan)`` shows it."""
    q = self.base_quantization
    base = "frozen base" if q is None else f"frozen base quantized ({q.describe()})"
    drop = f", dropout {self.dropout}" if self.dropout else ""
    return (f"LoRA rank {self.rank}, alpha {self.alpha:g} (scale {self.scaling:g}){drop}; "
            f"{base}")


def _count(k, what: str) -> int:
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise ValueError(f"LoRA(input_dims=...) {what}{k!r} must be a positive int (how many "
                     "leading kernel dimensions are the input), e.g. input_dims={'*.o_proj': 2}.")
  return int(k)


def _input_dims(value):
  """``input_dims`` as an int, or a tuple of ``(pattern, int)`` pairs."""
  if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    return _count(value, "")
  items = value.items() if isinstance(value, Mapping) else value
  try:
    pairs = tuple((p, k) for p, k in items)
  except (TypeError, ValueError):
    raise ValueError(f"LoRA(input_dims={value!r}) must be an int or {{pattern: int}}, e.g. "
                     "input_dims={'*.o_proj': 2}.") from None
  for p, k in pairs:
    if not isinstance(p, str) or not p:
      raise ValueError(f"LoRA(input_dims=...) key {p!r} must be a dotted-name pattern.")
    _count(k, f"for {p!r}: ")
  return tuple((p, int(k)) for p, k in pairs)


# --------------------------------------------------------------------------
# The stored node


class LoRAWeight:
  """A target kernel as the state stores it: ``base`` (frozen; for QLoRA the
  ``uint8`` payload rows of its quantized rows), ``lora_A`` (``[*in, r]``)
  and ``lora_B`` (``[r, *out]``) (trainable). A pytree node: its leaves are
  named ``<kernel>.base``, ``<kernel>.lora_A``, ``<kernel>.lora_B``.

  ``quantization``, ``width`` (the size of a kernel row: the product of its
  output dimensions ``n``), ``dtype`` (the kernel's own dtype) and
  ``out_dims`` (how many trailing kernel dimensions are its output) are
  static: what decoding a quantized base and shaping the kernel need.
  """

  __slots__ = ("base", "lora_A", "lora_B", "quantization", "width", "dtype", "out_dims")

  def __init__(self, base, lora_A, lora_B, *, quantization=None, width=None, dtype=None,  # pylint: disable=invalid-name
               out_dims=1):
    self.base, self.lora_A, self.lora_B = base, lora_A, lora_B
    self.quantization, self.width = quantization, width
    self.dtype = None if dtype is None else jnp.dtype(dtype)
    self.out_dims = int(out_dims)

  def __repr__(self):
    shape = lambda x: tuple(getattr(x, "shape", ()))
    q = "" if self.quantization is None else f", {self.quantization.describe()}"
    return (f"LoRAWeight(base={shape(self.base)}, lora_A={shape(self.lora_A)}, "
            f"lora_B={shape(self.lora_B)}{q})")

  @property
  def kernel_shape(self) -> tuple:
    """The kernel's shape (``[layers,] *in, *out``), from the factors'."""
    out = tuple(self.lora_B.shape[len(self.lora_B.shape) - self.out_dims:])
    return tuple(self.lora_A.shape[:-1]) + out

  def replace(self, **kw) -> "LoRAWeight":
    fields = dict(base=self.base, lora_A=self.lora_A, lora_B=self.lora_B,
                  quantization=self.quantization, width=self.width, dtype=self.dtype,
                  out_dims=self.out_dims)
    fields.update(kw)
    return LoRAWeight(**fields)


def _aux(w):
  return (w.quantization, w.width, w.dtype, w.out_dims)


def _flatten_with_keys(w):
  keys = [jax.tree_util.GetAttrKey(n) for n in ("base", "lora_A", "lora_B")]
  return list(zip(keys, (w.base, w.lora_A, w.lora_B))), _aux(w)


def _flatten(w):
  return (w.base, w.lora_A, w.lora_B), _aux(w)


def _unflatten(aux, children):
  out = object.__new__(LoRAWeight)
  out.base, out.lora_A, out.lora_B = children
  out.quantization, out.width, out.dtype, out.out_dims = aux
  return out


jax.tree_util.register_pytree_with_keys(LoRAWeight, _flatten_with_keys, _unflatten, _flatten)


def is_lora_weight(x) -> bool:
  return isinstance(x, LoRAWeight)


class Report:
  """What the step's re-evaluation of ``loss_fn`` found (filled when the
  step is traced, shown by ``print(state.plan)``): the targets computed
  through the adapter path, and for the others the operation that saw the
  merged weight."""

  def __init__(self):
    self.adapter_path: set = set()
    self.merged: dict = {}
    self.warned: set = set()

  def fallback(self, value, why: str) -> None:
    self.merged.setdefault(value.name, why)


# --------------------------------------------------------------------------
# Targets


@dataclasses.dataclass(frozen=True)
class Target:
  """One target kernel of the user's tree: its leaf index, dotted name,
  per-layer input and output dimensions and leading layer dims."""

  index: int
  name: str
  ins: tuple
  outs: tuple
  lead: tuple

  @property
  def m(self) -> int:
    return math.prod(self.ins)

  @property
  def n(self) -> int:
    return math.prod(self.outs)


def matches(name: str, pattern: str) -> bool:
  """A pattern names ``name`` or a trailing part of it (PEFT's suffix match).

  Example:
    >>> matches("layers.0.attn.wq", "*.wq"), matches("layers.0.attn.wq", "attn.wq")
    (True, True)
    >>> matches("layers.0.attn.wqkv", "*.wq")
    False
  """
  return name_matches(name, pattern) or name_matches(name, "**." + pattern)


def _stacked_lead(path: tuple, stacked_patterns) -> int:
  """1 when the leaf sits in a stacked subtree (a leading layer axis)."""
  return int(any(name_matches(".".join(path[:k]), p)
                 for p in stacked_patterns for k in range(1, len(path) + 1)))


def find_targets(tree, lora: LoRA, stacked_patterns=()) -> dict:
  """``{leaf index: Target}`` of the user's tree, or a ``ValueError`` naming
  the pattern, leaf, shape and fix."""
  paths = naming.leaf_paths(tree)
  leaves = jax.tree_util.tree_leaves(tree)
  names = [".".join(p) for p in paths]
  shapes = [tuple(x.shape) for x in leaves]
  leads = [_stacked_lead(p, stacked_patterns) for p in paths]
  out = {}
  for pattern in lora.targets:
    hits = named_weights(paths, shapes, leads, pattern, "LoRA target", match=matches)
    if not hits:
      examples = ", ".join(repr(n) for n in names[:6])
      raise ValueError(
          f"LoRA target {pattern!r} matches no parameter. Parameters are named by dotted "
          f"paths such as {examples}; a pattern names a parameter or its module (the "
          f"module's weight: 'kernel', 'weight', 'w', 'embedding', or its one leaf of 2 or "
          "more dimensions), '*' within one segment, '**' across. Fix the pattern.")
    for i in hits:
      x, shape, lead = leaves[i], shapes[i], leads[i]
      if len(shape) - lead < 2:
        what = "per layer (stacked_layers) " if lead else ""
        raise ValueError(
            f"LoRA target {pattern!r} matches {names[i]!r} of shape {shape}, which is not "
            f"2-D or more {what}(LoRA adapts a matmul kernel [*in, *out]). Fix: narrow the "
            "pattern to the kernels (e.g. '*.wq.kernel').")
      if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"LoRA target {names[i]!r} has dtype {jnp.dtype(x.dtype).name}; LoRA adapts "
            "floating-point kernels. Fix the pattern.")
      k = lora.input_dims_of(names[i])
      per_layer = shape[lead:]
      if k >= len(per_layer):
        raise ValueError(
            f"LoRA(input_dims=...) gives target {names[i]!r} (shape {shape}) {k} input "
            f"dimension(s), but its kernel has {len(per_layer)} dimensions per layer and "
            f"needs at least one output dimension. Fix: input_dims <= {len(per_layer) - 1} "
            "for it.")
      out[i] = Target(i, names[i], per_layer[:k], per_layer[k:], shape[:lead])
  _check_rank(lora, out, shapes)
  return out


def _check_rank(lora: LoRA, targets: dict, shapes: list) -> None:
  """A ``ValueError`` when the rank exceeds ``min(m, n)`` of a target, naming
  the smallest such limit over all targets (the rank that fits them all)."""
  limit = {i: min(t.m, t.n) for i, t in targets.items()}
  over = sorted((i for i in targets if lora.rank > limit[i]), key=lambda i: (limit[i], i))
  if not over:
    return
  t = targets[over[0]]
  others = [targets[i].name for i in over[1:]]
  also = ""
  if others:
    shown = ", ".join(repr(n) for n in others[:3]) + (" ..." if len(others) > 3 else "")
    also = f"; {len(others)} other target(s) are below the rank too ({shown})"
  raise ValueError(
      f"LoRA(rank={lora.rank}) is larger than a dimension of target {t.name!r} (shape "
      f"{shapes[over[0]]}: {t.m} inputs, {t.n} outputs), whose min(m, n) = {limit[over[0]]} "
      f"is the smallest over all {len(targets)} targets (the rank is at most min(m, n) of "
      f"every target){also}. Fix: pass rank<={limit[over[0]]}, or narrow "
      f"targets={lora.targets!r} to leave out {t.name!r}"
      f"{' and the others below the rank' if others else ''}.")


def trainable_leaves(tree, lora: LoRA) -> set:
  """Indices of the user's leaves ``lora.trainable`` names (a leaf, or a
  subtree above it)."""
  return named_leaves(naming.leaf_paths(tree), lora.trainable, "LoRA(trainable=...) entry",
                      match=matches)


# --------------------------------------------------------------------------
# The stored tree


def init_factors(key, t: Target, rank: int, dtype):
  """``(A, B)``: ``A`` (``[*lead, *in, r]``) uniform in ``+-1/sqrt(m)``
  (PEFT's ``kaiming_uniform_(a=sqrt(5))`` on ``lora_A.weight`` ``[r, m]``),
  ``B`` (``[*lead, r, *out]``) zeros."""
  bound = 1.0 / math.sqrt(t.m)
  a = jax.random.uniform(key, t.lead + (t.m, rank), jnp.float32, -bound, bound)
  a = a.reshape(t.lead + t.ins + (rank,)).astype(dtype)
  return a, jnp.zeros(t.lead + (rank,) + t.outs, dtype)


def adapter_dtype(kernel_dtype):
  """The factors' dtype: float32 for a 16-bit kernel (PEFT's default,
  ``autocast_adapter_dtype=True``), else the kernel's."""
  kernel_dtype = jnp.dtype(kernel_dtype)
  return jnp.dtype(jnp.float32) if kernel_dtype.itemsize < 4 else kernel_dtype


def encode_base(w, q: Quantization, out_dims: int):
  """A kernel ``[..., *out]`` -> its QLoRA base: the rows of ``[...,
  prod(out)]`` encoded (to nearest)."""
  rows = w.reshape(w.shape[:w.ndim - out_dims] + (-1,))
  return quant.encode(rows, q)


def decode_base(node: LoRAWeight, dtype=None):
  """The base kernel of ``node`` (dequantized for QLoRA) in ``dtype``
  (default: the kernel's own dtype)."""
  dtype = node.dtype if dtype is None else dtype
  if node.quantization is None:
    return node.base if dtype is None else node.base.astype(dtype)
  rows = quant.decode(node.base, node.quantization, node.width, dtype)
  return rows.reshape(node.kernel_shape)


def delta(a, b, out_dims: int):
  """``A @ B`` contracting ``r``: ``[*lead, *in, r] x [*lead, r, *out] ->
  [*lead, *in, *out]`` in float32 (the layer axes batched)."""
  lead = b.ndim - 1 - out_dims
  shape = tuple(a.shape[:-1]) + tuple(b.shape[lead + 1:])
  a2 = a.astype(jnp.float32).reshape(a.shape[:lead] + (-1, a.shape[-1]))
  b2 = b.astype(jnp.float32).reshape(b.shape[:lead + 1] + (-1,))
  return jnp.matmul(a2, b2).reshape(shape)


def adapter_tree(tree, lora: LoRA, targets: dict, key):
  """The user's tree -> the stored tree: each target leaf becomes a
  :class:`LoRAWeight` (the base quantized for QLoRA, ``A`` drawn from
  ``fold_in(key, leaf index)``). Traceable (``jax.eval_shape`` gives the
  stored shapes)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  q = lora.base_quantization
  out = []
  for i, w in enumerate(leaves):
    t = targets.get(i)
    if t is None:
      out.append(w)
      continue
    dtype = jnp.dtype(w.dtype)
    a, b = init_factors(jax.random.fold_in(key, i), t, lora.rank, adapter_dtype(dtype))
    # QLoRA: each row -> uint8 payload (codes, then float32 scales), to nearest.
    base = jnp.asarray(w) if q is None else encode_base(jnp.asarray(w), q, len(t.outs))
    out.append(LoRAWeight(base, a, b, quantization=q, width=t.n, dtype=dtype,
                          out_dims=len(t.outs)))
  return jax.tree_util.tree_unflatten(treedef, out)


def requires_grad_tree(stored_tree, trainable: set, user_treedef):
  """The stored tree's ``requires_grad``: ``lora_A``/``lora_B`` and the
  ``trainable`` leaves (user leaf indices) True, the rest False."""
  user_slots = jax.tree_util.tree_unflatten(
      user_treedef, [i in trainable for i in range(user_treedef.num_leaves)])
  return jax.tree.map(
      lambda flag, node: (node.replace(base=False, lora_A=True, lora_B=True)
                          if is_lora_weight(node) else flag),
      user_slots, stored_tree, is_leaf=is_lora_weight)


def user_treedef(stored_tree):
  """The user's treedef: the stored tree with each :class:`LoRAWeight` as
  one leaf."""
  return jax.tree.structure(jax.tree.map(lambda _: 0, stored_tree, is_leaf=is_lora_weight))


def merge(node: LoRAWeight, scaling: float, dtype=None):
  """The effective kernel: ``base + scaling * A @ B`` (computed in float32,
  returned in ``dtype``, default the kernel's)."""
  dtype = node.dtype if dtype is None else dtype
  base = decode_base(node, jnp.float32)
  d = delta(node.lora_A, node.lora_B, node.out_dims)
  return (base + jnp.float32(scaling) * d).astype(dtype)


def merged_tree(stored_tree, scaling: float):
  """The stored tree with each :class:`LoRAWeight` replaced by its effective
  kernel: the user's tree."""
  return jax.tree.map(lambda x: merge(x, scaling) if is_lora_weight(x) else x,
                      stored_tree, is_leaf=is_lora_weight)


def stored_leaf_kind(name: str) -> Optional[str]:
  """``"base"``, ``"lora_A"``, ``"lora_B"`` for a stored leaf name of a
  :class:`LoRAWeight`, else None (a name can only tell; the plan knows)."""
  tail = name.rsplit(".", 1)[-1]
  return tail if tail in ("base", "lora_A", "lora_B") else None


def check_user_tree(stored_tree, what: str) -> None:
  """Refuses a tree that already holds adapters where the user's is wanted."""
  if any(is_lora_weight(x) for x in jax.tree.leaves(stored_tree, is_leaf=is_lora_weight)):
    raise ValueError(f"{what}: the tree already holds LoRA adapters (LoRAWeight nodes); "
                     "pass the model's own parameters.")
