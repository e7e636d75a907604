"""What a :class:`~fsdp_jax.models.CausalLM` is given, checked with errors
that name the fix: token ids inside the vocabulary, ``labels`` of
``input_ids``' shape, and a parameter tree with this model's paths and
shapes.

Token ids are values, so they are read where they are concrete: the
bundle's ``apply`` / ``loss_fn`` called on host arrays (NumPy, lists) or
computed ``jax.Array`` s read them before dispatch, and
``shard_train_step`` / ``shard_eval_step`` call ``loss_fn.check_batch``
(:class:`Checked`) on the batch they are given, before placing it. Integer
ids only, a ``B x T`` array each: a NumPy ``min``/``max`` (microseconds); a
batch already on the devices is copied back first (``B x T x 4`` bytes,
waiting for that batch only). A traced value (the bundle called inside the
user's own ``jax.jit``) cannot be read and is not checked. Shapes and the
parameter tree are checked when the function is traced: once per tree
structure and shapes (``jax.jit``'s cache), nothing per call."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import numpy as np

from fsdp_jax._src.models import decoder
from fsdp_jax._src.models.config import ModelConfig
from fsdp_jax._src.naming import path_name

IGNORE = -100  # transformers' ignored label


def _host_parts(x) -> Optional[list]:
  """``x``'s values on the host (a list of NumPy arrays: this process's
  shards of a global array), or None where they cannot be read (a traced
  value, shapes alone)."""
  if isinstance(x, jax.ShapeDtypeStruct):
    return None
  try:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return [np.asarray(s.data) for s in x.addressable_shards]
    return [np.asarray(x)]
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def check_ids(cfg: ModelConfig, ids, *, name: str, where: str, labels: bool = False) -> None:
  """A ValueError where concrete integer ``ids`` fall outside ``[0,
  vocab_size)`` (``-100`` allowed in ``labels``), naming the largest (or
  smallest) id and the vocabulary size."""
  parts = _host_parts(ids)
  if not parts or not all(np.issubdtype(p.dtype, np.integer) for p in parts):
    return
  parts = [p for p in parts if p.size]
  if not parts:
    return
  vocab = cfg.vocab_size
  hi = max(int(p.max()) for p in parts)
  lo = min(int(np.where(p == IGNORE, 0, p).min() if labels else p.min()) for p in parts)
  if hi < vocab and lo >= 0:
    return
  bad = hi if hi >= vocab else lo
  what = "largest" if hi >= vocab else "smallest"
  extra = " (or -100: ignored)" if labels else ""
  raise ValueError(
      f"{where}: {name} holds token id {bad} (its {what}), outside the vocabulary of this "
      f"{cfg.model_type} model: vocab_size {vocab} (config.json), ids 0..{vocab - 1}{extra}. "
      "An out-of-range id would give a NaN loss or another token's embedding. Fix: "
      "tokenize with this model's tokenizer, or map padding to a valid id (and its "
      "labels to -100).")


def check_label_shape(tokens_shape, labels_shape, where: str = "loss_fn") -> None:
  """A ValueError naming both shapes where ``labels`` and ``input_ids``
  differ."""
  if tuple(labels_shape) != tuple(tokens_shape):
    raise ValueError(
        f"{where}: batch['labels'] has shape {list(labels_shape)} where batch['input_ids'] "
        f"has {list(tokens_shape)}: pass labels of input_ids' shape [batch, length] (the "
        "tokens themselves, or -100 where no loss is taken); the shift by one position "
        "happens inside the loss.")


def check_batch(cfg: ModelConfig, batch, where: str = "loss_fn") -> None:
  """``loss_fn``'s batch: a dict with ``input_ids``, ``labels`` (if any) of
  its shape, every id concrete here inside the vocabulary."""
  if not isinstance(batch, dict) or "input_ids" not in batch:
    got = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
    raise ValueError(f"{where}: the batch must be a dict with 'input_ids' (and optionally "
                     f"'labels'), [batch, length] integer arrays; got {got}.")
  tokens, labels = batch["input_ids"], batch.get("labels")
  if labels is not None:
    check_label_shape(np.shape(tokens), np.shape(labels), where)
  check_ids(cfg, tokens, name="batch['input_ids']", where=where)
  if labels is not None:
    check_ids(cfg, labels, name="batch['labels']", where=where, labels=True)


def check_input_ids(cfg: ModelConfig, input_ids, where: str = "apply") -> None:
  """``apply``'s (``generate``'s) ``input_ids``: every concrete id inside
  the vocabulary."""
  check_ids(cfg, input_ids, name="input_ids", where=where)


class Checked:
  """A bundle's jitted ``fn(params, inputs, ...)`` that first checks the
  inputs it can read (``check(inputs)``): the function ``CausalLM.apply``
  / ``loss_fn`` is. ``check_batch`` is that check: ``shard_train_step``
  and ``shard_eval_step`` call it on the batch they are given (before it
  is placed on the mesh), where inside their trace the values are not
  readable. ``lower``, ``trace``, ... are the jitted function's."""

  def __init__(self, fn: Callable, check: Callable):
    self.jitted = fn
    self.check_batch = check
    self.__doc__ = getattr(fn, "__doc__", None)

  def __call__(self, params, inputs, **kwargs):
    self.check_batch(inputs)
    return self.jitted(params, inputs, **kwargs)

  def __getattr__(self, name):
    if name == "jitted":  # not set yet (copy, pickle)
      raise AttributeError(name)
    return getattr(self.jitted, name)


# --------------------------------------------------------------------------
# The parameter tree


def expected_shapes(cfg: ModelConfig, scan: bool) -> dict:
  """``{dotted name: shape}`` of the parameters :func:`decoder.init_params`
  makes, in its order."""
  n = decoder.names_of(cfg)
  top, layer = decoder.param_shapes(cfg, n)
  out = {}
  for path, (shape, _) in top.items():
    out[".".join(path)] = tuple(shape)
  base = f"{n.root}.{n.layers}"
  if scan:
    for path, (shape, _) in layer.items():
      out[f"{base}.{'.'.join(path)}"] = (cfg.num_hidden_layers,) + tuple(shape)
  else:
    for i in range(cfg.num_hidden_layers):
      for path, (shape, _) in layer.items():
        out[f"{base}.{i}.{'.'.join(path)}"] = tuple(shape)
  return out


def check_params(cfg: ModelConfig, scan: bool, params, where: str = "apply") -> None:
  """A ValueError where ``params`` is not this model's tree (parameters of
  another family or configuration, a leaf missing or extra, another
  shape, the other layer layout), naming the first differing path, its
  shape and the expected one. Called while the function is traced (shapes
  only)."""
  expected = expected_shapes(cfg, scan)
  flat, _ = jax.tree_util.tree_flatten_with_path(params)
  given = {path_name(p): tuple(np.shape(x)) for p, x in flat}
  if given == expected:
    return
  problems = []
  for name, shape in given.items():
    if name not in expected:
      problems.append(f"{name} (shape {shape}) is not one of its parameters")
    elif expected[name] != shape:
      problems.append(f"{name} has shape {shape} where this model's is {expected[name]}")
  problems += [f"{name} (shape {shape}) is missing" for name, shape in expected.items()
               if name not in given]
  if not problems:  # same names and shapes, in another order: fine
    return
  c = cfg
  n = decoder.names_of(cfg)
  layers = f"{n.root}.{n.layers}"
  hint = ""
  if scan and f"{layers}.0.{'.'.join(next(iter(decoder.param_shapes(cfg, n)[1])))}" in given:
    hint = (" The layers are a list (from_pretrained(scan=False)); this bundle stacks them "
            "(scan=True).")
  elif not scan and any(k.startswith(layers + ".") and not k[len(layers) + 1:].split(".")[0]
                        .isdigit() for k in given):
    hint = (" The layers are stacked (from_pretrained(scan=True)); this bundle keeps them "
            "as a list (scan=False).")
  more = f" (and {len(problems) - 1} more differences)" if len(problems) > 1 else ""
  raise ValueError(
      f"{where}: the parameters are not this {c.model_type} model's ({c.num_hidden_layers} "
      f"layers, hidden {c.hidden_size}, {c.num_attention_heads} heads, "
      f"{c.num_key_value_heads} key/value, vocabulary {c.vocab_size}{', scan' if scan else ''}"
      f"): {problems[0]}{more}.{hint} Parameters of another family or config.json? Fix: make "
      "them with this bundle's init_fn, or load its checkpoint with "
      "fsdp_jax.pretrained.load(directory, b.weight_map).")
