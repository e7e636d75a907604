"""How checkpoint tensors map to parameters: :class:`WeightMap` rules and
the invertible transforms between a checkpoint's layout and the model's.

A rule is ``(checkpoint_pattern, param_pattern, *transforms)``. Patterns are
dotted names with ``{name}`` placeholders standing for non-negative integers
(``"model.layers.{i}.self_attn.q_proj.weight"``). A placeholder of the
checkpoint pattern that the parameter pattern lacks stacks: the tensors it
matches are stacked along a new axis 0 of the parameter, in index order
(scanned layers, ``FSDPConfig(stacked_layers=...)``). A rule whose
parameter pattern is None drops the checkpoint tensors it matches (buffers a
model recomputes, such as rotary tables).

Transforms turn a checkpoint tensor into the parameter's layout
(``to_model``), and back (``to_checkpoint``, applied in reverse order when
saving). Each also maps shapes, and says which axis of its input a slice of
its output's first axis comes from, so that a device's rows are read from
the file alone (:meth:`Transform.rows_from`).

Fused tensors: a rule whose parameter pattern is a tuple and whose first
transform is :func:`split` cuts one checkpoint tensor into several
parameters (Phi-3's ``qkv_proj`` into ``q_proj``, ``k_proj``, ``v_proj``); a
rule whose checkpoint pattern is a tuple and whose first transform is
:func:`concat` joins several checkpoint tensors into one parameter. The cut
runs along an axis of the checkpoint's layout, before the rule's other
transforms (which apply to each part, or to the joined tensor); saving
joins the parts back (or cuts the parameter), so the file has the
checkpoint's own tensors.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable, Optional, Sequence

import numpy as np


class Transform:
  """An invertible map between a checkpoint tensor and a parameter.

  Subclasses define ``to_model`` / ``to_checkpoint`` on numpy arrays,
  ``model_shape`` / ``checkpoint_shape`` on shapes, and :meth:`rows_from`.
  :func:`transpose`, :func:`rope_interleave` and :func:`reshape` return
  one; a rule may also hold a pair ``(to_model, to_checkpoint)``.

  >>> import numpy as np
  >>> from fsdp_jax import pretrained
  >>> t = pretrained.transpose()
  >>> t.to_model(np.zeros((3, 2))).shape, t.checkpoint_shape((2, 3))
  ((2, 3), (3, 2))
  """

  def to_model(self, x: np.ndarray) -> np.ndarray:
    raise NotImplementedError

  def to_checkpoint(self, y: np.ndarray) -> np.ndarray:
    raise NotImplementedError

  def model_shape(self, shape: tuple) -> tuple:
    raise NotImplementedError

  def checkpoint_shape(self, shape: tuple) -> tuple:
    raise NotImplementedError

  def rows_from(self, shape: tuple) -> Optional[int]:
    """The axis of the input (shape ``shape``) that the output's axis 0
    comes from, such that rows ``a:b`` of the output are this transform of
    the input sliced ``a:b`` along that axis; None when a slice of the
    output needs the whole input."""
    return None


@dataclasses.dataclass(frozen=True)
class _Transpose(Transform):
  """Reverses the axes: PyTorch's ``[out, in]`` to JAX's ``[in, out]``."""

  # Views: the loader copies them into the shards, the writer into the file.
  def to_model(self, x):
    return np.transpose(x)

  def to_checkpoint(self, y):
    return np.transpose(y)

  def model_shape(self, shape):
    return tuple(reversed(shape))

  def checkpoint_shape(self, shape):
    return tuple(reversed(shape))

  def rows_from(self, shape):
    return len(shape) - 1 if shape else None

  def __repr__(self):
    return "transpose()"


@dataclasses.dataclass(frozen=True)
class _RopeInterleave(Transform):
  """Within each head, along the last axis, Hugging Face's half-split rotary
  layout (``[x0, x2, ..., x1, x3, ...]``) -> interleaved pairs (``[x0, x1,
  x2, x3, ...]``)."""

  num_heads: int

  def _perm(self, n: int) -> np.ndarray:
    if n % self.num_heads or (n // self.num_heads) % 2:
      raise ValueError(
          f"rope_interleave(num_heads={self.num_heads}): the last axis has {n} elements, "
          f"which is not {self.num_heads} heads of an even size. Fix: pass the number of "
          "heads of this projection (key/value projections under grouped-query attention "
          "have num_key_value_heads).")
    d = n // self.num_heads
    half = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])  # where pair k sits
    inv = np.argsort(half)  # interleaved position -> half-split position
    return (np.arange(self.num_heads)[:, None] * d + inv[None, :]).reshape(-1)

  def to_model(self, x):
    # Gathers along the last axis as whole slices of the others: after a
    # transpose those are rows of the file, copied whole.
    return np.moveaxis(np.moveaxis(x, -1, 0)[self._perm(x.shape[-1])], 0, -1)

  def to_checkpoint(self, y):
    inv = np.argsort(self._perm(y.shape[-1]))
    return np.moveaxis(np.moveaxis(y, -1, 0)[inv], 0, -1)

  def model_shape(self, shape):
    if shape:
      self._perm(shape[-1])
    return tuple(shape)

  def checkpoint_shape(self, shape):
    return self.model_shape(shape)

  def rows_from(self, shape):
    return 0 if len(shape) >= 2 else None

  def __repr__(self):
    return f"rope_interleave(num_heads={self.num_heads})"


@dataclasses.dataclass(frozen=True)
class _Reshape(Transform):
  """Reshapes to ``shape`` (``-1`` allowed); back to the checkpoint's shape
  when saving (``checkpoint_shape``, or the shape it was loaded from)."""

  shape: tuple
  checkpoint: Optional[tuple] = None

  def to_model(self, x):
    return np.reshape(x, _reshaped(np.shape(x), self.shape))

  def to_checkpoint(self, y):
    if self.checkpoint is None:
      raise ValueError(
          f"reshape({self.shape}) cannot tell the checkpoint's shape from the parameter's. "
          "Fix: pass reshape(shape, checkpoint_shape=...) to save with it.")
    return np.reshape(y, self.checkpoint)

  def model_shape(self, shape):
    return _reshaped(shape, self.shape)

  def checkpoint_shape(self, shape):
    if self.checkpoint is None:
      raise ValueError(
          f"reshape({self.shape}) cannot tell the checkpoint's shape from the parameter's. "
          "Fix: pass reshape(shape, checkpoint_shape=...) to save with it.")
    return tuple(self.checkpoint)

  def rows_from(self, shape):
    # Rows of the output are rows of the input when both keep axis 0 and
    # split or merge only the axes after it.
    out = self.model_shape(shape)
    return 0 if shape and out and shape[0] == out[0] else None

  def __repr__(self):
    extra = "" if self.checkpoint is None else f", checkpoint_shape={self.checkpoint}"
    return f"reshape({self.shape}{extra})"


def _reshaped(shape, target) -> tuple:
  n = math.prod(shape)
  target = list(target)
  if target.count(-1) > 1:
    raise ValueError(f"reshape({tuple(target)}): at most one -1.")
  if -1 in target:
    known = math.prod(t for t in target if t != -1)
    if known == 0 or n % known:
      raise ValueError(f"cannot reshape {tuple(shape)} into {tuple(target)}")
    target[target.index(-1)] = n // known
  if math.prod(target) != n:
    raise ValueError(f"cannot reshape {tuple(shape)} into {tuple(target)}")
  return tuple(target)


@dataclasses.dataclass(frozen=True)
class _Pair(Transform):
  """A user's ``(to_model, to_checkpoint)`` pair of functions over numpy
  arrays."""

  forward: Callable
  backward: Callable

  def to_model(self, x):
    return np.asarray(self.forward(x))

  def to_checkpoint(self, y):
    return np.asarray(self.backward(y))

  def model_shape(self, shape):
    return tuple(np.shape(self.forward(np.zeros(shape, np.float32))))

  def checkpoint_shape(self, shape):
    return tuple(np.shape(self.backward(np.zeros(shape, np.float32))))

  def __repr__(self):
    name = lambda f: getattr(f, "__qualname__", repr(f))
    return f"({name(self.forward)}, {name(self.backward)})"


def transpose() -> Transform:
  """Reverses a tensor's axes: PyTorch's ``Linear`` weight ``[out, in]``
  becomes JAX's ``[in, out]`` kernel (and back when saving).

  Example:
    >>> import numpy as np
    >>> from fsdp_jax import pretrained
    >>> pretrained.transpose().to_model(np.zeros((3, 2))).shape
    (2, 3)
  """
  return _Transpose()


def rope_interleave(num_heads: int) -> Transform:
  """Reorders the last axis, head by head, from Hugging Face's half-split
  rotary layout to interleaved pairs: the inverse of the permutation
  ``convert_llama_weights_to_hf.py`` applies to Meta's Llama weights. Use it
  for a model whose rotary embedding rotates adjacent pairs ``(x[2k],
  x[2k+1])``; a model that rotates halves (as transformers' Llama does)
  needs no transform.

  Example: one head of size 4, ``[x0, x2, x1, x3]`` -> ``[x0, x1, x2, x3]``:

    >>> import numpy as np
    >>> from fsdp_jax import pretrained
    >>> pretrained.rope_interleave(num_heads=1).to_model(np.array([0, 2, 1, 3]))
    array([0, 1, 2, 3])
  """
  if int(num_heads) < 1:
    raise ValueError(f"rope_interleave(num_heads={num_heads}): num_heads must be >= 1.")
  return _RopeInterleave(int(num_heads))


def reshape(shape: Sequence[int], *, checkpoint_shape: Optional[Sequence[int]] = None
            ) -> Transform:
  """Reshapes a tensor to ``shape`` (one ``-1`` allowed), e.g. a fused
  ``[heads * head_dim, d]`` projection into ``[heads, head_dim, d]``.
  Saving reshapes back to ``checkpoint_shape`` (the shape in the
  checkpoint: a parameter's shape does not tell it).

  Example:
    >>> import numpy as np
    >>> from fsdp_jax import pretrained
    >>> pretrained.reshape((2, -1)).to_model(np.zeros(6)).shape
    (2, 3)
  """
  return _Reshape(tuple(int(s) for s in shape),
                  None if checkpoint_shape is None else tuple(int(s) for s in checkpoint_shape))


@dataclasses.dataclass(frozen=True)
class Fuse:
  """How a rule fuses tensors, along ``axis`` of the checkpoint's layout:
  ``"split"`` cuts one checkpoint tensor into parts (one per parameter of
  the rule), ``"concat"`` joins several checkpoint tensors (one per
  checkpoint pattern) into one parameter. ``sizes``: each part's extent
  along ``axis``, or None for equal parts. Made by :func:`split` and
  :func:`concat`."""

  kind: str
  axis: int
  sizes: Optional[tuple]

  def bounds(self, total: int, parts: int, what: str) -> list:
    """``[(start, stop)]`` of each part along the axis of extent ``total``."""
    sizes = self.sizes
    if sizes is None:
      if total % parts:
        raise ValueError(f"{what}: {self!r} cannot cut an axis of {total} into {parts} "
                         "equal parts. Fix: pass the parts' sizes.")
      sizes = (total // parts,) * parts
    if len(sizes) != parts or sum(sizes) != total:
      raise ValueError(f"{what}: {self!r} gives parts {list(sizes)} (total {sum(sizes)}) "
                       f"for {parts} parts of an axis of {total}.")
    out, start = [], 0
    for n in sizes:
      out.append((start, start + n))
      start += n
    return out

  def part_shape(self, shape: tuple, extent: int) -> tuple:
    shape = list(shape)
    shape[self.axis] = extent
    return tuple(shape)

  def joined_shape(self, shapes: Sequence[tuple]) -> tuple:
    """The shape of ``shapes`` joined along the axis, or a ``ValueError``."""
    first = list(shapes[0])
    for s in shapes[1:]:
      if len(s) != len(first) or any(a != b for d, (a, b) in enumerate(zip(s, first))
                                     if d != self.axis):
        raise ValueError(f"{self!r}: parts of shapes {[list(x) for x in shapes]} do not "
                         "join along that axis.")
    first[self.axis] = sum(s[self.axis] for s in shapes)
    return tuple(first)

  def __repr__(self):
    sizes = "" if self.sizes is None else f"{list(self.sizes)}, "
    return f"{self.kind}({sizes}axis={self.axis})"


def _fuse(kind: str, sizes, axis) -> Fuse:
  if sizes is not None:
    sizes = tuple(int(n) for n in sizes)
    if len(sizes) < 2 or min(sizes) < 1:
      raise ValueError(f"{kind}(sizes={list(sizes)}): give two or more positive sizes.")
  if int(axis) < 0:
    raise ValueError(f"{kind}(axis={axis}): the axis must be >= 0.")
  return Fuse(kind, int(axis), sizes)


def split(sizes: Optional[Sequence[int]] = None, *, axis: int = 0) -> Fuse:
  """One checkpoint tensor -> several parameters: the first "transform" of
  a rule whose parameter pattern is a tuple. The tensor is cut along
  ``axis`` (of the checkpoint's layout) into parts of ``sizes`` (equal
  parts when None), part ``k`` goes to the rule's ``k``-th parameter through
  the rule's other transforms. Saving joins the parts back into the one
  tensor. Each device still reads only its rows of its parts.

  Example: Phi-3's fused ``[q; k; v]`` projection (PyTorch ``[out, in]``)
  into three ``[in, out]`` kernels, 4 query heads and 2 key/value heads of 8:

    >>> import numpy as np
    >>> from fsdp_jax import pretrained
    >>> wm = pretrained.WeightMap([
    ...     ("layers.{i}.qkv_proj.weight",
    ...      ("layers.{i}.q_proj.kernel", "layers.{i}.k_proj.kernel", "layers.{i}.v_proj.kernel"),
    ...      pretrained.split([32, 16, 16], axis=0), pretrained.transpose())])
    >>> wm.rules[0].params
    ('layers.{i}.q_proj.kernel', 'layers.{i}.k_proj.kernel', 'layers.{i}.v_proj.kernel')
  """
  return _fuse("split", sizes, axis)


def concat(sizes: Optional[Sequence[int]] = None, *, axis: int = 0) -> Fuse:
  """Several checkpoint tensors -> one parameter: the first "transform" of a
  rule whose checkpoint pattern is a tuple. The tensors are joined along
  ``axis`` (of the checkpoint's layout) in the patterns' order, then go
  through the rule's other transforms. Saving cuts the parameter back into
  parts of ``sizes`` (equal parts when None). Each device still reads only
  its rows of each tensor.

  Example: Llama's separate projections into one fused kernel:

    >>> from fsdp_jax import pretrained
    >>> wm = pretrained.WeightMap([
    ...     (("layers.{i}.q_proj.weight", "layers.{i}.k_proj.weight", "layers.{i}.v_proj.weight"),
    ...      "layers.{i}.qkv.kernel", pretrained.concat([32, 16, 16]), pretrained.transpose())])
    >>> wm.rules[0].checkpoints[1], wm.rules[0].fuse
    ('layers.{i}.k_proj.weight', concat([32, 16, 16], axis=0))
  """
  return _fuse("concat", sizes, axis)


def as_transform(t) -> Transform:
  if isinstance(t, Transform):
    return t
  if isinstance(t, tuple) and len(t) == 2 and all(callable(f) for f in t):
    return _Pair(t[0], t[1])
  raise TypeError(
      f"{t!r} is not a transform. Fix: use fsdp_jax.pretrained.transpose(), "
      "rope_interleave(num_heads), reshape(shape), or a (to_model, to_checkpoint) pair of "
      "functions over numpy arrays.")


@dataclasses.dataclass(frozen=True)
class Chain:
  """The transforms of one rule, applied in order to a checkpoint tensor of
  shape ``checkpoint_shape`` (the inverse needs that shape for reshapes)."""

  transforms: tuple

  def model_shape(self, shape: tuple) -> tuple:
    for t in self.transforms:
      shape = t.model_shape(tuple(shape))
    return tuple(shape)

  def to_model(self, x: np.ndarray) -> np.ndarray:
    for t in self.transforms:
      x = t.to_model(x)
    return x

  def checkpoint_shape(self, shape: tuple) -> tuple:
    for t in reversed(self.transforms):
      shape = t.checkpoint_shape(tuple(shape))
    return tuple(shape)

  def to_checkpoint(self, y: np.ndarray, checkpoint_shape: tuple) -> np.ndarray:
    """The inverse of :meth:`to_model` for a tensor of ``checkpoint_shape``."""
    shapes = [tuple(checkpoint_shape)]
    for t in self.transforms:
      shapes.append(t.model_shape(shapes[-1]))
    for t, shape in zip(reversed(self.transforms), reversed(shapes[:-1])):
      y = np.reshape(y, shape) if isinstance(t, _Reshape) else t.to_checkpoint(y)
    return y

  def rows_axis(self, checkpoint_shape: tuple) -> Optional[int]:
    """The checkpoint axis that rows (axis 0) of the parameter slice along,
    or None when the parameter's rows need the whole tensor."""
    shapes = [tuple(checkpoint_shape)]
    for t in self.transforms:
      shapes.append(t.model_shape(shapes[-1]))
    axis = 0
    # Walk back from the output: the output's axis 0 comes from axis ``k``
    # of the last transform's input; that axis must be axis 0 of the
    # transform before it, and so on (a transform maps only axis 0's rows).
    for t, shape in zip(reversed(self.transforms), reversed(shapes[:-1])):
      if axis != 0:
        return None
      k = t.rows_from(shape)
      if k is None:
        return None
      axis = k
    return axis

  def __str__(self):
    return ", ".join(repr(t) for t in self.transforms) or "no transforms"


_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def _compile(pattern: str):
  """``(regex, placeholder names)`` of a dotted pattern."""
  names = _PLACEHOLDER.findall(pattern)
  if len(set(names)) != len(names):
    raise ValueError(f"pattern {pattern!r} repeats a placeholder.")
  parts = _PLACEHOLDER.split(pattern)
  regex = ""
  for k, part in enumerate(parts):
    regex += re.escape(part) if k % 2 == 0 else f"(?P<{part}>\\d+)"
  return re.compile(f"^{regex}$"), tuple(names)


def _match(compiled, name: str):
  """``(placeholder values, k)`` of the first of ``compiled`` patterns
  matching ``name``, or None."""
  for k, (regex, _) in enumerate(compiled):
    m = regex.match(name)
    if m is not None:
      return {n: int(v) for n, v in m.groupdict().items()}, k
  return None


@dataclasses.dataclass(frozen=True)
class Rule:
  """One rule: ``checkpoints`` (one pattern, or several joined by
  :func:`concat`) -> ``params`` (one pattern, several cut by :func:`split`,
  or none: dropped), through ``chain``."""

  checkpoints: tuple
  params: tuple
  chain: Chain
  fuse: Optional[Fuse] = None
  _ckpt: tuple = dataclasses.field(default=(), repr=False, compare=False)
  _param: tuple = dataclasses.field(default=(), repr=False, compare=False)

  @property
  def checkpoint(self) -> str:
    return self.checkpoints[0]

  @property
  def param(self) -> Optional[str]:
    return self.params[0] if self.params else None

  @property
  def stack_axis_name(self) -> Optional[str]:
    """The placeholder of the checkpoint pattern the parameter pattern lacks
    (its tensors stack along a new axis 0), or None."""
    if not self._param:
      return None
    missing = [n for n in self._ckpt[0][1] if n not in self._param[0][1]]
    return missing[0] if missing else None

  def match_checkpoint(self, name: str) -> Optional[dict]:
    found = _match(self._ckpt, name)
    return None if found is None else found[0]

  def match_checkpoint_part(self, name: str) -> Optional[tuple]:
    """``(placeholder values, k)``: ``name`` is the rule's ``k``-th
    checkpoint tensor (0 unless :func:`concat` joins several)."""
    return _match(self._ckpt, name)

  def match_param(self, name: str) -> Optional[dict]:
    found = _match(self._param, name)
    return None if found is None else found[0]

  def match_param_part(self, name: str) -> Optional[tuple]:
    """``(placeholder values, k)``: ``name`` is the rule's ``k``-th
    parameter (0 unless :func:`split` cuts the tensor in several)."""
    return _match(self._param, name)

  def param_name(self, values: dict, k: int = 0) -> str:
    return _fill(self.params[k], values)

  def checkpoint_name(self, values: dict, k: int = 0) -> str:
    return _fill(self.checkpoints[k], values)

  def describe(self) -> str:
    show = lambda ps: repr(ps[0]) if len(ps) == 1 else repr(tuple(ps))
    params = show(self.params) if self.params else "None"
    fuse = "" if self.fuse is None else f"{self.fuse!r}, "
    return f"({show(self.checkpoints)} -> {params}; {fuse}{self.chain})"


def _fill(pattern: str, values: dict) -> str:
  return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), pattern)


def _patterns(x, what: str, rule) -> tuple:
  if isinstance(x, str):
    return (x,)
  if isinstance(x, (tuple, list)) and len(x) >= 2 and all(isinstance(p, str) for p in x):
    return tuple(x)
  raise TypeError(
      f"WeightMap rule {rule!r}: the {what} must be a string, or a tuple of two or more "
      "strings for a fused tensor (with split() or concat() as the first transform).")


def _rule(rule) -> Rule:
  if not isinstance(rule, (tuple, list)) or len(rule) < 2:
    raise TypeError(
        f"WeightMap rule {rule!r} is not a (checkpoint_pattern, param_pattern, "
        "*transforms) tuple.")
  ckpt, param, *transforms = rule
  ckpts = _patterns(ckpt, "checkpoint pattern", rule)
  params = () if param is None else _patterns(param, "parameter pattern", rule)
  fuse = transforms.pop(0) if transforms and isinstance(transforms[0], Fuse) else None
  if any(isinstance(t, Fuse) for t in transforms):
    raise ValueError(f"WeightMap rule {rule!r}: split() / concat() must be the first "
                     "transform (it cuts or joins in the checkpoint's layout).")
  want = ("concat" if len(ckpts) > 1 else "split" if len(params) > 1 else None)
  if (fuse.kind if fuse else None) != want or (len(ckpts) > 1 and len(params) > 1):
    raise ValueError(
        f"WeightMap rule {rule!r}: a tuple of parameter patterns needs split(...) as the "
        "first transform, a tuple of checkpoint patterns concat(...), and a plain rule "
        "neither (one side of a rule may be a tuple).")
  n = len(ckpts) if len(ckpts) > 1 else len(params)
  if fuse is not None and fuse.sizes is not None and len(fuse.sizes) != n:
    raise ValueError(f"WeightMap rule {rule!r}: {fuse!r} gives {len(fuse.sizes)} sizes for "
                     f"{n} tensors.")
  ckpt_c = tuple(_compile(p) for p in ckpts)
  param_c = tuple(_compile(p) for p in params)
  for group, what in ((ckpt_c, "checkpoint"), (param_c, "parameter")):
    if len({frozenset(names) for _, names in group}) > 1:
      raise ValueError(f"WeightMap rule {rule!r}: the {what} patterns must have the same "
                       "placeholders.")
  if param_c:
    ckpt_names, param_names = ckpt_c[0][1], param_c[0][1]
    extra = [n for n in param_names if n not in ckpt_names]
    if extra:
      raise ValueError(
          f"WeightMap rule ({ckpt!r}, {param!r}): the parameter pattern's placeholders "
          f"{extra} are not in the checkpoint pattern.")
    missing = [n for n in ckpt_names if n not in param_names]
    if len(missing) > 1:
      raise ValueError(
          f"WeightMap rule ({ckpt!r}, {param!r}): {missing} are missing from the "
          "parameter pattern; one placeholder can stack tensors along axis 0.")
  chain = Chain(tuple(as_transform(t) for t in transforms))
  return Rule(ckpts, params, chain, fuse, ckpt_c, param_c)


class WeightMap:
  """How a checkpoint's tensors map to the parameters of a model.

  Args:
    rules: ``(checkpoint_pattern, param_pattern, *transforms)`` tuples.
      Patterns are dotted names; ``{i}`` (any ``{name}``) stands for a
      non-negative integer. Parameter names are the dotted names fsdp_jax's
      state dicts use (``print(state.plan)`` lists them); a Flax linen
      model's names start with ``params.``, which a pattern may leave out
      when every parameter has it. A placeholder of the checkpoint pattern
      that the parameter pattern lacks stacks its tensors along a new axis 0
      of the parameter (scanned layers). A ``param_pattern`` of None drops
      the checkpoint tensors the rule matches. The first rule that matches a
      name wins. A tuple of parameter patterns with :func:`split` first
      cuts one tensor into several parameters; a tuple of checkpoint
      patterns with :func:`concat` first joins several into one.
    fan_in_fan_out: the checkpoint's 2-D weights are ``[in, out]`` (GPT-2's
      ``Conv1D``), not PyTorch ``Linear``'s ``[out, in]``: PEFT adapters are
      written and read with ``fan_in_fan_out`` (see
      :func:`~fsdp_jax.pretrained.save_adapter`).
    config: the ``config.json`` (a dict) the model was built from. Loading a
      checkpoint whose shapes do not fit then compares it with the
      checkpoint's own ``config.json`` and names the fields that differ;
      :func:`~fsdp_jax.pretrained.save` writes it beside the weights.
    generation_config: the source's ``generation_config.json`` (a dict),
      which :func:`~fsdp_jax.pretrained.save` writes beside the weights.

  Example: a Llama attention projection, PyTorch ``[out, in]`` to a Flax
  ``[in, out]`` kernel, layers stacked for a scan:

    >>> from fsdp_jax import pretrained
    >>> wm = pretrained.WeightMap([
    ...     ("model.layers.{i}.self_attn.q_proj.weight", "layers.attn.q.kernel",
    ...      pretrained.transpose()),
    ...     ("model.rotary_emb.inv_freq", None),
    ... ])
    >>> wm.rules[0].stack_axis_name
    'i'
  """

  def __init__(self, rules: Sequence[tuple], *, fan_in_fan_out: bool = False,
               config: Optional[dict] = None, generation_config: Optional[dict] = None):
    self.rules = tuple(_rule(r) for r in rules)
    self.fan_in_fan_out = bool(fan_in_fan_out)
    for name, value in (("config", config), ("generation_config", generation_config)):
      if value is not None and not isinstance(value, dict):
        raise TypeError(f"WeightMap({name}=...) takes the JSON file's dict, got "
                        f"{type(value).__name__}.")
    self.config = config
    self.generation_config = generation_config

  def __repr__(self):
    return f"WeightMap({len(self.rules)} rules)"

  def checkpoint_match(self, name: str):
    """``(rule, placeholder values, k)`` of the first rule matching
    checkpoint tensor ``name`` (its ``k``-th checkpoint pattern), or None."""
    for rule in self.rules:
      found = rule.match_checkpoint_part(name)
      if found is not None:
        return rule, found[0], found[1]
    return None

  def param_match(self, name: str):
    """``(rule, placeholder values, k)`` of the first rule whose parameter
    patterns match parameter ``name`` (its ``k``-th), or None."""
    for rule in self.rules:
      found = rule.match_param_part(name)
      if found is not None:
        return rule, found[0], found[1]
    return None

  def checkpoint_rule(self, name: str):
    """``(rule, placeholder values)`` of the first rule matching checkpoint
    tensor ``name``, or None."""
    found = self.checkpoint_match(name)
    return None if found is None else found[:2]

  def param_rule(self, name: str):
    """``(rule, placeholder values)`` of the first rule whose parameter
    pattern matches parameter ``name``, or None."""
    found = self.param_match(name)
    return None if found is None else found[:2]
