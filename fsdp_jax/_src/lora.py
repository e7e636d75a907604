"""LoRA and QLoRA: the adapter configuration, and the parameter tree with
adapters.

With ``FSDPConfig(lora=LoRA(...))`` the state stores each target kernel
``W`` (``[m, n]``; ``[layers, m, n]`` in a stacked unit) as a
:class:`LoRAWeight`: the frozen ``base`` (``W`` itself, or for QLoRA its
block-quantized rows: ``uint8`` payload rows of
:func:`fsdp_jax._src.quantization.encode`, codes then float32 scales) and the
trainable factors ``lora_A`` (``[m, r]``) and ``lora_B`` (``[r, n]``). The
loss sees ``W + (alpha / r) * lora_A @ lora_B`` (PEFT's LoRA on a linear
layer; for a JAX ``[in, out]`` kernel ``lora_A`` is PEFT's ``lora_A.weight``
transposed and ``lora_B`` its ``lora_B.weight`` transposed).

This module is pure tree work: which leaves are targets, the stored tree
and its trainable mask, and the merged weights. How the step computes the
adapter path beside the frozen matmul lives in
:mod:`fsdp_jax._src.adapters`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax._src import naming
from fsdp_jax._src import quantization as quant
from fsdp_jax._src.quantization import Quantization
from fsdp_jax._src.wrap import name_matches, named_leaves

# The leaf names of a module's matmul kernel in Flax (``kernel``) and in
# equinox / PyTorch-style trees (``weight``): a pattern naming the module
# names its kernel.
KERNEL_NAMES = ("kernel", "weight")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRA:
  """LoRA (and QLoRA) fine-tuning, PEFT's semantics: ``FSDPConfig(lora=...)``.

  Each target kernel ``W`` is seen by the loss as ``W + (alpha / rank) * A @
  B``, with ``A`` (``[m, rank]``, PEFT's Kaiming-uniform init: uniform in
  ``+-1/sqrt(m)``) and ``B`` (``[rank, n]``, zeros) trainable and in the
  kernel's own layout (for a JAX ``[in, out]`` kernel, ``A`` is PEFT's
  ``lora_A.weight.T`` and ``B`` its ``lora_B.weight.T``) and dtype (float32
  for a 16-bit kernel, as PEFT's ``autocast_adapter_dtype``). The step computes
  ``x @ W + (alpha / rank) * (dropout(x) @ A) @ B`` where the loss uses the
  kernel as a matmul operand, so the frozen base's weight gradient is never
  computed; every other use sees the merged weight (``print(state.plan)``
  says which). Everything else is frozen (no gradient, no reduce-scatter,
  no optimizer state) except the leaves ``trainable`` names.

  Args:
    targets: glob patterns over dotted parameter names (``*`` within one
      segment, ``**`` across; a pattern may match any trailing part of a
      name, as PEFT's ``target_modules`` do). A pattern naming a module
      (``"*.wq"`` for Flax's ``...wq.kernel``) names its 2-D ``kernel`` or
      ``weight``. Kernels must be 2-D per layer; reshape others (e.g. a
      ``DenseGeneral`` ``[d, heads, head_dim]`` kernel) to ``[d, heads *
      head_dim]`` in the model.
    rank: ``r``, at most the smaller kernel dimension.
    alpha: ``lora_alpha``; the adapter is scaled by ``alpha / rank``.
    dropout: ``lora_dropout``: dropout on the adapter path's input (needs
      ``init_train_state(rng=...)``; each step and device draws its own
      mask).
    trainable: dotted-name patterns of other leaves (or subtrees) to train
      fully: norms, a new head (PEFT's ``modules_to_save``).
    base_quantization: QLoRA: a :class:`fsdp_jax.Quantization` for the frozen
      target kernels, e.g. ``Quantization(dtype="nf4", block_size=64)``
      (QLoRA's NormalFloat4) or ``dtype=jnp.int8``. Each kernel row is
      stored as codes plus one float32 absmax scale per block (a partial last
      block is allowed, so any width works), gathered quantized (4 bits per
      value on the wire for nf4) and dequantized to the compute dtype after
      the gather.

  Example:
    >>> import fsdp_jax
    >>> lora = fsdp_jax.LoRA(targets=("*.wq", "*.wv"), rank=4, alpha=8.0)
    >>> lora.scaling
    2.0
    >>> fsdp_jax.FSDPConfig(lora=lora, use_orig_params=True).lora.rank
    4
  """

  targets: Sequence[str]
  rank: int = 8
  alpha: float = 16.0
  dropout: float = 0.0
  trainable: Sequence[str] = ()
  base_quantization: Optional[Quantization] = None

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


# --------------------------------------------------------------------------
# The stored node


class LoRAWeight:
  """A target kernel as the state stores it: ``base`` (frozen; for QLoRA the
  ``uint8`` payload rows of its quantized rows), ``lora_A`` and ``lora_B``
  (trainable). A pytree node: its leaves are named ``<kernel>.base``,
  ``<kernel>.lora_A``, ``<kernel>.lora_B``.

  ``quantization``, ``width`` (the kernel's last dimension ``n``) and
  ``dtype`` (the kernel's own dtype) are static: what decoding a
  quantized base needs.
  """

  __slots__ = ("base", "lora_A", "lora_B", "quantization", "width", "dtype")

  def __init__(self, base, lora_A, lora_B, *, quantization=None, width=None, dtype=None):  # pylint: disable=invalid-name
    self.base, self.lora_A, self.lora_B = base, lora_A, lora_B
    self.quantization, self.width = quantization, width
    self.dtype = None if dtype is None else jnp.dtype(dtype)

  def __repr__(self):
    shape = lambda x: tuple(getattr(x, "shape", ()))
    q = "" if self.quantization is None else f", {self.quantization.describe()}"
    return (f"LoRAWeight(base={shape(self.base)}, lora_A={shape(self.lora_A)}, "
            f"lora_B={shape(self.lora_B)}{q})")

  def replace(self, **kw) -> "LoRAWeight":
    fields = dict(base=self.base, lora_A=self.lora_A, lora_B=self.lora_B,
                  quantization=self.quantization, width=self.width, dtype=self.dtype)
    fields.update(kw)
    return LoRAWeight(**fields)


def _flatten_with_keys(w):
  keys = [jax.tree_util.GetAttrKey(n) for n in ("base", "lora_A", "lora_B")]
  return (list(zip(keys, (w.base, w.lora_A, w.lora_B))),
          (w.quantization, w.width, w.dtype))


def _flatten(w):
  return (w.base, w.lora_A, w.lora_B), (w.quantization, w.width, w.dtype)


def _unflatten(aux, children):
  q, width, dtype = aux
  out = object.__new__(LoRAWeight)
  out.base, out.lora_A, out.lora_B = children
  out.quantization, out.width, out.dtype = q, width, dtype
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
  per-layer shape ``(m, n)`` and leading layer dims."""

  index: int
  name: str
  m: int
  n: int
  lead: tuple


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
  out = {}
  for pattern in lora.targets:
    hits = []
    for i, (p, name) in enumerate(zip(paths, names)):
      module = ".".join(p[:-1]) if len(p) > 1 and p[-1] in KERNEL_NAMES else None
      if matches(name, pattern) or (module is not None and matches(module, pattern)):
        hits.append(i)
    if not hits:
      examples = ", ".join(repr(n) for n in names[:6])
      raise ValueError(
          f"LoRA target {pattern!r} matches no parameter. Parameters are named by dotted "
          f"paths such as {examples}; a pattern names a parameter or its module (the "
          f"module's 'kernel'/'weight'), '*' within one segment, '**' across. Fix the "
          "pattern.")
    for i in hits:
      x = leaves[i]
      shape = tuple(x.shape)
      lead = _stacked_lead(paths[i], stacked_patterns)
      if len(shape) - lead != 2:
        what = "per layer (stacked_layers) " if lead else ""
        raise ValueError(
            f"LoRA target {pattern!r} matches {names[i]!r} of shape {shape}, which is not "
            f"2-D {what}(LoRA adapts a matmul kernel [m, n]). Fix: narrow the pattern to "
            "the 2-D kernels (e.g. '*.wq.kernel'), or reshape the kernel to 2-D in the "
            "model (a DenseGeneral [d, heads, head_dim] kernel as [d, heads * head_dim]).")
      if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(
            f"LoRA target {names[i]!r} has dtype {jnp.dtype(x.dtype).name}; LoRA adapts "
            "floating-point kernels. Fix the pattern.")
      m, n = shape[lead:]
      if lora.rank > min(m, n):
        raise ValueError(
            f"LoRA(rank={lora.rank}) is larger than a dimension of target {names[i]!r} "
            f"(shape {shape}): the rank is at most min(m, n) = {min(m, n)}. Fix: pass "
            f"rank<={min(m, n)} or narrow targets={lora.targets!r}.")
      out[i] = Target(i, names[i], m, n, shape[:lead])
  return out


def trainable_leaves(tree, lora: LoRA) -> set:
  """Indices of the user's leaves ``lora.trainable`` names (a leaf, or a
  subtree above it)."""
  return named_leaves(naming.leaf_paths(tree), lora.trainable, "LoRA(trainable=...) entry",
                      match=matches)


# --------------------------------------------------------------------------
# The stored tree


def init_factors(key, m: int, n: int, rank: int, lead: tuple, dtype):
  """``(A, B)``: ``A`` uniform in ``+-1/sqrt(m)`` (PEFT's
  ``kaiming_uniform_(a=sqrt(5))`` on ``lora_A.weight`` ``[r, m]``), ``B``
  zeros."""
  bound = 1.0 / math.sqrt(m)
  a = jax.random.uniform(key, lead + (m, rank), jnp.float32, -bound, bound).astype(dtype)
  return a, jnp.zeros(lead + (rank, n), dtype)


def adapter_dtype(kernel_dtype):
  """The factors' dtype: float32 for a 16-bit kernel (PEFT's default,
  ``autocast_adapter_dtype=True``), else the kernel's."""
  kernel_dtype = jnp.dtype(kernel_dtype)
  return jnp.dtype(jnp.float32) if kernel_dtype.itemsize < 4 else kernel_dtype


def decode_base(node: LoRAWeight, dtype=None):
  """The base kernel of ``node`` (dequantized for QLoRA) in ``dtype``
  (default: the kernel's own dtype)."""
  dtype = node.dtype if dtype is None else dtype
  if node.quantization is None:
    return node.base if dtype is None else node.base.astype(dtype)
  return quant.decode(node.base, node.quantization, node.width, dtype)


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
    a, b = init_factors(jax.random.fold_in(key, i), t.m, t.n, lora.rank, t.lead,
                        adapter_dtype(dtype))
    # QLoRA: each row -> uint8 payload (codes, then float32 scales), to nearest.
    base = jnp.asarray(w) if q is None else quant.encode(w, q)
    out.append(LoRAWeight(base, a, b, quantization=q, width=t.n, dtype=dtype))
  return jax.tree_util.tree_unflatten(treedef, out)


def requires_grad_tree(stored_tree, trainable: set, user_treedef):
  """The stored tree's ``requires_grad``: ``lora_A``/``lora_B`` and the
  ``trainable`` leaves (user leaf indices) True, the rest False."""
  user_slots = jax.tree_util.tree_unflatten(
      user_treedef, [i in trainable for i in range(user_treedef.num_leaves)])
  return jax.tree.map(
      lambda flag, node: (LoRAWeight(False, True, True, quantization=node.quantization,
                                     width=node.width, dtype=node.dtype)
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
  delta = jnp.matmul(node.lora_A.astype(jnp.float32), node.lora_B.astype(jnp.float32))
  return (base + jnp.float32(scaling) * delta).astype(dtype)


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
