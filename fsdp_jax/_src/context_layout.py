"""Where each position of a sequence split over the ``"context"`` axis
lives: the layout of :class:`~fsdp_jax.ContextParallel`'s chunks.

The sequence (``T`` positions along the split dimension) is cut into
``C * pieces`` equal chunks of ``m`` positions; device ``i`` of the context
axis (size ``C``) holds ``pieces`` of them, one after the other, as its local
chunk of ``n = pieces * m`` positions:

* contiguous (``load_balance=False``): one piece, chunk ``i``;
* head-tail (``load_balance=True``): two pieces, chunks ``i`` and
  ``2C-1-i``, so each device holds as many early (cheap under a causal
  mask) as late positions.

:class:`Layout` answers, for the traced device index, which global
positions its local chunk holds (:meth:`Layout.positions`), cuts a
replicated value to them (:meth:`Layout.cut`), puts an all-gathered value
back in the sequence's order (:meth:`Layout.natural`), moves a halo between
neighbouring chunks (:meth:`Layout.halo`, one ``ppermute`` per pair of
pieces; a chunk whose neighbour is on the same device reads it locally) and
gives the totals of the chunks before each piece (:meth:`Layout.before`,
for cumulative sums). The batch is split over the axis in the sequence's
order, as without balancing (the user passes it so; a hand-written step's
``shard_map`` splits it so): :meth:`Layout.from_contiguous` fetches each
of a device's pieces from the device that contiguous split left it on.
With one piece every permutation is the identity and nothing is added to
the program.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax


class Layout:
  """The chunks of a sequence split over a context axis of ``size``
  devices (``balanced``: head-tail, two pieces per device)."""

  def __init__(self, size: int, balanced: bool = False):
    self.c = int(size)
    self.balanced = bool(balanced)
    self.pieces = 2 if self.balanced else 1
    # chunks[i, t]: the chunk of device i's piece t
    if self.balanced:
      self.chunks = np.array([[i, 2 * self.c - 1 - i] for i in range(self.c)], np.int32)
    else:
      self.chunks = np.arange(self.c, dtype=np.int32)[:, None]
    self.order = [int(k) for k in self.chunks.reshape(-1)]  # the layout's chunk order
    self.owner = {k: divmod(j, self.pieces) for j, k in enumerate(self.order)}

  @property
  def count(self) -> int:
    """Chunks of the sequence: ``C * pieces``."""
    return self.c * self.pieces

  def piece(self, n: int) -> int:
    """Positions per piece of a local chunk of ``n``."""
    return n // self.pieces

  def _chunk(self, index, t: int):
    """The chunk of device ``index``'s piece ``t`` (traced)."""
    if not self.balanced:
      return index
    return jnp.asarray(self.chunks[:, t])[index]

  def positions(self, index, n: int, dtype=jnp.int32):
    """``[n]``: the global positions of device ``index``'s local chunk."""
    m = self.piece(n)
    return jnp.concatenate([(self._chunk(index, t) * m).astype(dtype) + jnp.arange(m, dtype=dtype)
                            for t in range(self.pieces)])

  def cut(self, x, dim: int, n: int, index):
    """Device ``index``'s positions (``n`` along ``dim``) of ``x``, whose
    ``dim`` is the whole (padded) sequence, ``C * n`` long."""
    m = self.piece(n)
    parts = [lax.dynamic_slice_in_dim(x, self._chunk(index, t) * m, m, axis=dim)
             for t in range(self.pieces)]
    return parts[0] if len(parts) == 1 else lax.concatenate(parts, dim)

  def split(self, x, dim: int) -> list:
    """A local chunk cut into its pieces along ``dim``."""
    m = self.piece(x.shape[dim])
    return [lax.slice_in_dim(x, t * m, (t + 1) * m, axis=dim) for t in range(self.pieces)]

  def join(self, parts: list, dim: int):
    return parts[0] if len(parts) == 1 else lax.concatenate(parts, dim)

  def _reorder(self, x, dim: int, order: list):
    m = x.shape[dim] // self.count
    return lax.concatenate([lax.slice_in_dim(x, k * m, (k + 1) * m, axis=dim) for k in order],
                           dim)

  def natural(self, x, dim: int):
    """A value in the layout's order (an all-gather of the devices'
    chunks) -> the sequence's order."""
    if not self.balanced:
      return x
    return self._reorder(x, dim, [self.order.index(k) for k in range(self.count)])

  def _exchange(self, sends: list, source, axis: str, index, on_send=None):
    """Per piece ``t`` of this device ``i``, ``sends[s]`` of device ``d``
    where ``source(i, t) == (d, s)`` (None: nothing there): one
    ``ppermute`` per pair of pieces (``on_send(x)`` called for each), read
    locally where ``d`` is this device. Returns ``(received, has)``: per
    piece, the value (zeros where nothing is there) and a traced bool,
    whether something is."""
    c, p = self.c, self.pieces
    received, has = [], []
    for t in range(p):
      got, any_src = None, np.zeros(c, bool)
      for s in range(p):
        pairs, local, dst = [], np.zeros(c, bool), np.zeros(c, bool)
        for i in range(c):
          src = source(i, t)
          if src is None or src[1] != s:
            continue
          any_src[i] = True
          if src[0] == i:
            local[i] = True
          else:
            pairs.append((src[0], i))
            dst[i] = True
        if pairs:
          r = lax.ppermute(sends[s], axis, pairs)
          if on_send is not None:
            on_send(sends[s])
          got = r if got is None else jnp.where(jnp.asarray(dst)[index], r, got)
        if local.any():
          got = sends[s] if got is None else jnp.where(jnp.asarray(local)[index], sends[s], got)
      received.append(jnp.zeros_like(sends[0]) if got is None else got)
      has.append(jnp.asarray(any_src)[index])
    return received, has

  def halo(self, sends: list, step: int, axis: str, index, on_send=None):
    """Each piece's halo from its neighbouring chunk: piece ``t`` of this
    device receives ``sends[s]`` of the device holding chunk ``chunk(t) -
    step`` as its piece ``s`` (``step`` 1: from the previous chunk, -1: from
    the next). Returns ``(received, has)`` (see :meth:`_exchange`)."""
    return self._exchange(sends, lambda i, t: self.owner.get(int(self.chunks[i, t]) - step),
                          axis, index, on_send)

  def from_contiguous(self, x, dim: int, axis: str, index, on_send=None):
    """This device's pieces from its contiguous share of the sequence along
    ``dim`` (what a plain split of a batch in the sequence's order gives
    device ``i``: chunks ``2i`` and ``2i+1`` of ``2C``), each fetched from
    the device holding it (the identity without balancing)."""
    if not self.balanced:
      return x
    out, _ = self._exchange(self.split(x, dim),
                            lambda i, t: divmod(int(self.chunks[i, t]), self.pieces),
                            axis, index, on_send)
    return self.join(out, dim)

  def before(self, totals, axis: str, index):
    """Per piece of this device, the sum of ``totals`` (each device's
    ``[pieces, ...]`` totals of its pieces) over the chunks that come
    before it in the sequence: a list of ``[...]`` values."""
    every = lax.all_gather(totals, axis, axis=0)  # [C, pieces, ...]
    flat = every.reshape((self.count,) + every.shape[2:])  # layout order
    out = []
    for t in range(self.pieces):
      mine = self._chunk(index, t)
      earlier = (jnp.asarray(np.array(self.order)) < mine).astype(every.dtype)
      out.append(jnp.tensordot(earlier, flat, axes=(0, 0)))
    return out
