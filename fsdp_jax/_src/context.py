"""Context parallelism's configuration: :class:`ContextParallel`, and which
batch leaves the step splits along the sequence over the ``"context"`` axis.

This module is pure tree work. Which positions each device's chunk holds
(contiguous, or head-tail balanced) is :mod:`fsdp_jax._src.context_layout`;
how the loss runs on each device's chunk of the sequence (positions offset,
reductions summed, keys and values gathered) lives in
:mod:`fsdp_jax._src.context_eval`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import numpy as np

from fsdp_jax._src import context_layout

CONTEXT = "context"
STRATEGIES = ("all_gather",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextParallel:
  """Context parallelism over the mesh's ``"context"`` axis
  (``fsdp_jax.make_mesh(..., context=C)``): ``FSDPConfig(context_parallel=...)``.

  The step splits each selected batch leaf along ``dim`` into ``C`` equal
  chunks, device ``i`` of the context axis holding chunk ``i`` (with
  ``load_balance``: into ``2C`` chunks, device ``i`` holding chunks ``i``
  and ``2C-1-i``); the devices
  of the axis also shard the weights (FSDP over shard x context). The model
  and the loss stay single-device code: the step evaluates the loss on each
  chunk with every operation that mixes positions computed exactly (keys
  and values all-gathered for attention, positions offset, sums over the
  sequence summed over ``"context"``) or refused with an error naming the
  operation. See ``docs/context_parallel.md``.

  Args:
    dim: the sequence dimension of the batch leaves (default 1: ``[batch,
      seq, ...]``).
    leaves: the top-level batch keys (or dotted paths) to split; default
      ``None``: every leaf with a dimension ``dim``. The others are
      replicated over ``"context"``.
    strategy: ``"all_gather"`` (queries stay split, keys and values are
      all-gathered over ``"context"``, their gradients reduce-scattered).
      A ring is not implemented.
    load_balance: head-tail balancing of causal attention: the sequence
      cut into ``2C`` chunks, device ``i`` holding chunks ``i`` and
      ``2C-1-i`` (as many early positions as late ones), so that
      :func:`fsdp_jax.attention`, which skips the key blocks a causal mask
      hides, does the same work on every device (with contiguous chunks
      the last device does about ``2C - 1`` times the first's). The
      sequence length must then be divisible by ``2C``. Batches are
      passed in their natural order and split contiguously, as without it
      (also by :func:`fsdp_jax.custom.batch_specs`); each device fetches
      its two chunks from the devices holding them (per split leaf, at
      most four ``ppermute`` s of a chunk, each device receiving two), and
      the loss and gradients are the same.
      Attention written in jnp (``q @ k^T``, a mask, softmax) computes
      every block whatever the layout, so it gains nothing.

  Example:
    >>> import fsdp_jax
    >>> cp = fsdp_jax.ContextParallel(leaves=("input_ids", "labels"))
    >>> cp == fsdp_jax.ContextParallel(leaves=["input_ids", "labels"])
    True
    >>> cp.dim, cp.strategy
    (1, 'all_gather')
  """

  dim: int = 1
  leaves: Optional[Sequence[str]] = None
  strategy: str = "all_gather"
  load_balance: bool = False

  def __post_init__(self):
    if not isinstance(self.dim, (int, np.integer)) or isinstance(self.dim, bool) or self.dim < 1:
      raise ValueError(
          f"ContextParallel(dim={self.dim!r}): the sequence dimension must be an int >= 1 "
          "(dim 0 is the batch, split over the data-parallel axes); the default 1 is "
          "[batch, seq, ...].")
    if self.leaves is not None:
      if isinstance(self.leaves, str):
        object.__setattr__(self, "leaves", (self.leaves,))
      else:
        object.__setattr__(self, "leaves", tuple(self.leaves))
      if not all(isinstance(x, str) for x in self.leaves):
        raise TypeError(f"ContextParallel(leaves={self.leaves!r}) takes batch key names "
                        "(strings), e.g. leaves=('input_ids', 'labels').")
    if self.strategy not in STRATEGIES:
      raise ValueError(
          f"ContextParallel(strategy={self.strategy!r}) is not supported; the one strategy "
          "is 'all_gather' (queries split, keys and values all-gathered over 'context'). "
          "A ring is not implemented.")
    if not isinstance(self.load_balance, (bool, np.bool_)):
      raise TypeError(f"ContextParallel(load_balance={self.load_balance!r}) takes True or "
                      "False.")


def _dotted(path) -> str:
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
  return ".".join(parts)


def split_mask(cp: ContextParallel, batch) -> list:
  """Per batch leaf (tree order): whether the step splits it along
  ``cp.dim`` over the context axis."""
  out = []
  for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
    if cp.leaves is None:
      out.append(np.ndim(x) > cp.dim)
    else:
      name = _dotted(path)
      out.append(any(name == s or name.startswith(s + ".") for s in cp.leaves))
  return out


def check_batch(cp: ContextParallel, size: int, batch) -> None:
  """The selected leaves have one sequence length, divisible by ``size``."""
  flat = jax.tree_util.tree_flatten_with_path(batch)[0]
  lengths = {}
  for (path, x), split in zip(flat, split_mask(cp, batch)):
    if not split:
      continue
    name = jax.tree_util.keystr(path) or "batch"
    shape = tuple(np.shape(x))
    if len(shape) <= cp.dim:
      raise ValueError(
          f"Batch leaf {name} of shape {shape} has no dimension {cp.dim} to split over the "
          f"'context' axis. Fix: leave it out of ContextParallel(leaves=...), or give it a "
          "sequence dimension.")
    lengths[name] = (shape, shape[cp.dim])
  if not lengths:
    raise ValueError(
        f"No batch leaf is split over the 'context' axis (none has a dimension {cp.dim}"
        + (f" or is named by leaves={cp.leaves}" if cp.leaves is not None else "")
        + "). Fix: pass ContextParallel(dim=...) naming the sequence dimension.")
  seqs = {t for _, t in lengths.values()}
  if len(seqs) > 1:
    lines = "\n".join(f"  * {n}: shape {s}, length {t}" for n, (s, t) in lengths.items())
    raise ValueError(
        f"The batch leaves split over the 'context' axis have different sequence lengths "
        f"along dim {cp.dim}:\n{lines}\nFix: pad them to one length, or leave the other "
        "leaves out with ContextParallel(leaves=(...)) (they are then replicated).")
  (t,) = seqs
  chunks = context_layout.Layout(size, cp.load_balance).count
  if t % chunks:
    name, (shape, _) = next(iter(lengths.items()))
    what = (f"2 x the context axis size {size} (ContextParallel(load_balance=True) cuts it "
            f"into {chunks} chunks, device i holding chunks i and {chunks - 1}-i)"
            if cp.load_balance else f"the context axis size {size}")
    raise ValueError(
        f"Batch leaf {name} has shape {shape}: its sequence length {t} (dim {cp.dim}) is not "
        f"divisible by {what}. Fix: pad the sequences to a multiple of {chunks}, e.g. "
        f"{-(-t // chunks) * chunks} (with labels masked / weight 0 there)"
        + (", or use load_balance=False." if cp.load_balance else "."))

