"""Attention that never holds the ``[T, T]`` scores: flash attention's
blocks and online softmax in pure JAX, with a backward pass that recomputes
each block's scores from the rows' saved logsumexp.

:func:`attention` is the public entry (``fsdp_jax.attention``), a drop-in
for ``jax.nn.dot_product_attention`` with packed documents (segment ids),
sliding windows, Gemma 2's soft-capping and explicit positions; the model
families call it (``models.layers.attend``).

The blockwise kernel
--------------------

The queries are cut into blocks of :data:`BLOCK_Q` rows (a quarter of the
queries where that is less, down to :data:`MIN_BLOCK_Q`) and the keys into
blocks of :data:`BLOCK_K` (a length they do not divide is padded; padded
keys are masked, padded queries dropped). A loop over query blocks runs a
loop over key blocks (both ``lax.while_loop`` s, whose bodies no caller's
rematerialisation policy can save from), keeping each row's running maximum,
sum and float32 accumulator (the online softmax); a key block that no query
of the block can see (every pair hidden by the causal mask, the window or
the segments, judged from each block's smallest and largest positions and
segment ids over the whole batch) is skipped by a ``lax.cond``. The forward
pass saves the output and each row's logsumexp only. The backward pass (a
``jax.custom_vjp``) is a scan over key blocks with a loop over query blocks
(skipping the same pairs), recomputing each block's probabilities from the
logsumexp; ``dk`` / ``dv`` of a key block accumulate in the loop, ``dq`` in
a float32 buffer of the queries' size. The largest temporaries are a few
``[batch, heads, BLOCK_Q, BLOCK_K]`` float32 arrays. A sequence of one block
(queries and keys both at most a block) takes the plain path: the scores
whole, masked, a float32 softmax (the same numbers as the kernel, to
float32 rounding). ``implementation="cudnn"`` calls
``jax.nn.dot_product_attention(implementation="cudnn")`` (a boolean mask
where positions, segments or a traced window need one).

Masks are defined by positions: query ``i`` sees key ``j`` when
``kv_pos[j] <= q_pos[i]`` (causal), ``q_pos[i] - kv_pos[j] < window`` (and,
without ``causal``, ``kv_pos[j] - q_pos[i] < window``), and
``q_seg[i] == kv_seg[j]`` (segments). A row that sees no key gives zeros.

The contract for other interpreters (context parallelism)
---------------------------------------------------------

Every call of :func:`attention` / :func:`attend_local` traces to one
``custom_vjp_call`` equation whose backward rule carries the call's static
options. In a traced (not yet differentiated) jaxpr:

* :func:`match` ``(eqn)`` returns None, or a :class:`Call`: ``q``, ``k``,
  ``v`` (positions of the operands in ``eqn.invars``), ``q_positions``,
  ``kv_positions``, ``q_segment_ids``, ``kv_segment_ids``,
  ``window_operand`` (each an index into ``eqn.invars``, or None where the
  call had none: positions then default to ``arange`` of the sequence, no
  segments, a static or no window), and the static options ``causal``,
  ``window`` (an int, or None: none or the traced ``window_operand``),
  ``soft_cap``, ``scale`` (a float, always set), ``implementation``.
  ``Call.operands(invals)`` names the operand values,
  ``Call.options()`` the keyword arguments for :func:`attend_local`.
  Positions and segment ids are ``[batch or 1, seq]`` int32 arrays in the
  equation (``[seq]`` is widened to ``[1, seq]``).
* :func:`attend_local` ``(q, k, v, *, q_positions, kv_positions,
  q_segment_ids, kv_segment_ids, causal, window, soft_cap, scale,
  implementation=None)`` is the same kernel on explicit positions (any
  order: chunks of a sequence, load-balanced, all-gathered keys), and
  differentiable. Positions fully define the causal and window masks; slots
  play no part.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from fsdp_jax._src import _compat

# Rows per query block and per key block of the blockwise kernel (a block's
# scores are BLOCK_Q * BLOCK_K * heads * batch float32s). A call's query
# blocks hold at most a quarter of its queries, down to MIN_BLOCK_Q rows
# (:func:`_default_block_q`).
BLOCK_Q = 512
BLOCK_K = 512
MIN_BLOCK_Q = 128
MASKED = float(np.finfo(np.float32).min)
IMPLEMENTATIONS = (None, "xla", "cudnn")
# The forward's output and logsumexp (``jax.ad_checkpoint.checkpoint_name``):
# what its backward reads besides the operands. A checkpoint policy that
# saves them (fsdp_jax's unit policies save every name; context
# parallelism's attention saves these alone) spares the backward pass the
# forward's loops, which a ``lax.while_loop`` would otherwise rerun whole
# from its inputs: the blocked queries, keys and values.
OUT_NAME, LSE_NAME = "fsdp_jax.attention.out", "fsdp_jax.attention.lse"
_OPERANDS = ("q_positions", "kv_positions", "q_segment_ids", "kv_segment_ids", "window")


@dataclasses.dataclass(frozen=True)
class _Spec:
  """A call's static options; ``operands``: the optional operands present,
  in their order after ``q, k, v``."""

  causal: bool
  window: Optional[int]
  soft_cap: Optional[float]
  scale: float
  implementation: Optional[str]
  block_q: int
  block_k: int
  operands: tuple


@dataclasses.dataclass(frozen=True)
class Call:
  """A recognised attention equation (:func:`match`): operand indices into
  ``eqn.invars`` (None: absent) and the static options."""

  q: int
  k: int
  v: int
  q_positions: Optional[int]
  kv_positions: Optional[int]
  q_segment_ids: Optional[int]
  kv_segment_ids: Optional[int]
  window_operand: Optional[int]
  causal: bool
  window: Optional[int]
  soft_cap: Optional[float]
  scale: float
  implementation: Optional[str]

  def operands(self, invals) -> dict:
    """``{"q", "k", "v", "q_positions", ..., "window"}`` -> the values among
    ``invals`` (the equation's inputs), None where absent."""
    names = ("q", "k", "v", "q_positions", "kv_positions", "q_segment_ids", "kv_segment_ids")
    out = {n: None if getattr(self, n) is None else invals[getattr(self, n)] for n in names}
    out["window"] = self.window if self.window_operand is None else invals[self.window_operand]
    return out

  def options(self) -> dict:
    """Keyword arguments of :func:`attend_local` besides the operands."""
    return dict(causal=self.causal, soft_cap=self.soft_cap, scale=self.scale,
                implementation=self.implementation)


def match(eqn) -> Optional[Call]:
  """A :class:`Call` if ``eqn`` is a call of :func:`attention` /
  :func:`attend_local` in a traced jaxpr (before differentiation), else
  None."""
  spec = getattr(_compat.custom_vjp_backward(eqn), "fsdp_jax_attention", None)
  if not isinstance(spec, _Spec):
    return None
  first = len(eqn.invars) - 3 - len(spec.operands)  # constants, if any, come first
  at = {name: first + 3 + i for i, name in enumerate(spec.operands)}
  return Call(q=first, k=first + 1, v=first + 2, q_positions=at.get("q_positions"),
              kv_positions=at.get("kv_positions"), q_segment_ids=at.get("q_segment_ids"),
              kv_segment_ids=at.get("kv_segment_ids"), window_operand=at.get("window"),
              causal=spec.causal, window=spec.window, soft_cap=spec.soft_cap, scale=spec.scale,
              implementation=spec.implementation)


# --------------------------------------------------------------------------
# Checks


@dataclasses.dataclass(frozen=True)
class KernelWork:
  """The matmul FLOPs a call's blockwise kernel runs (:func:`kernel_work`):
  ``pairs`` visible (query block, key block) pairs, each costing
  ``forward_per_pair`` FLOPs in the forward pass (``q @ k^T`` and ``p @
  v``) and ``backward_per_pair`` in the backward (the scores again, ``dv``,
  ``dp``, ``dk``, ``dq``)."""

  pairs: int
  forward_per_pair: float
  backward_per_pair: float


def kernel_work(eqn) -> Optional[KernelWork]:
  """What the blockwise kernel computes for ``eqn`` (a call :func:`match`
  recognises), or None where the call takes the plain or cuDNN path (one
  program without loops). The visible pairs are counted from the shapes
  and the static mask alone: the queries as the last ``Tq`` of the ``Tk``
  positions (the whole sequence; under a context axis the device holding
  the sequence's end, which every step waits for), segments ignored. The
  planner reads it: XLA's ``cost_analysis()`` counts a loop's body once,
  so of this kernel it counts about one pair."""
  spec = getattr(_compat.custom_vjp_backward(eqn), "fsdp_jax_attention", None)
  if not isinstance(spec, _Spec):
    return None
  call = match(eqn)
  b, tq, n, h = eqn.invars[call.q].aval.shape
  tk = eqn.invars[call.k].aval.shape[1]
  if _direct(spec, tq, tk) is not None:
    return None
  bq, bk = min(spec.block_q, tq), min(spec.block_k, tk)
  nq, nk = -(-tq // bq), -(-tk // bk)
  offset, pairs = tk - tq, 0
  for i in range(nq):
    lo, hi = offset + i * bq, offset + min((i + 1) * bq, tq) - 1
    last = min(nk - 1, hi // bk) if spec.causal else nk - 1
    first = 0
    if spec.window is not None:
      first = max(0, (lo - spec.window + 1) // bk)
      if not spec.causal:
        last = min(nk - 1, (hi + spec.window - 1) // bk)
    pairs += max(0, last - first + 1)
  block = b * bq * bk * n * h
  return KernelWork(pairs, 4.0 * block, 10.0 * block)


def _check(q, k, v, q_positions, kv_positions, q_seg, kv_seg, window, soft_cap, scale,
           implementation) -> None:
  qs, ks, vs = np.shape(q), np.shape(k), np.shape(v)
  if len(qs) != 4 or len(ks) != 4 or tuple(ks) != tuple(vs):
    raise ValueError(f"attention: q has shape {qs}, k {ks}, v {vs}; pass q [batch, seq_q, "
                     "heads, head_dim] and k, v [batch, seq_k, kv_heads, head_dim] (k and v "
                     "of one shape).")
  if qs[0] != ks[0] or qs[3] != ks[3] or ks[2] == 0 or qs[2] % ks[2]:
    raise ValueError(f"attention: q {qs} and k/v {ks} do not fit: batch and head_dim must "
                     "match and heads must be a multiple of kv_heads (grouped-query).")
  for name, value, seq in (("q_positions", q_positions, qs[1]),
                           ("kv_positions", kv_positions, ks[1]),
                           ("q_segment_ids", q_seg, qs[1]), ("kv_segment_ids", kv_seg, ks[1])):
    if value is None:
      continue
    shape = np.shape(value)
    if (shape not in ((seq,), (1, seq), (qs[0], seq))
        or not jnp.issubdtype(jnp.result_type(value), jnp.integer)):
      raise ValueError(f"attention: {name} has shape {shape} ({jnp.result_type(value)}); "
                       f"pass integers of shape [batch, seq] = [{qs[0]}, {seq}] (or [{seq}]).")
  if isinstance(window, bool) or (
      window is not None and not isinstance(window, (int, np.integer, jax.Array))):
    raise ValueError(f"attention(window={window!r}): pass None or a positive int (transformers' "
                     "sliding_window: a query sees itself and the window - 1 keys before it).")
  if isinstance(window, (int, np.integer)) and window < 1:
    raise ValueError(f"attention(window={window!r}): pass None or a positive int.")
  if isinstance(window, jax.Array) and (window.ndim or not jnp.issubdtype(window.dtype,
                                                                         jnp.integer)):
    raise ValueError(f"attention: a traced window must be an integer scalar, not "
                     f"{window.dtype}{list(window.shape)}.")
  for name, value in (("soft_cap", soft_cap), ("scale", scale)):
    if value is not None and (isinstance(value, bool) or not isinstance(
        value, (int, float, np.floating, np.integer)) or (name == "soft_cap" and value <= 0)):
      raise ValueError(f"attention({name}={value!r}): pass None or a "
                       f"{'positive ' if name == 'soft_cap' else ''}Python number.")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"attention(implementation={implementation!r}): pass None or 'xla' (the "
                     "blockwise kernel) or 'cudnn'.")


def _as_rows(x):
  x = jnp.asarray(x, jnp.int32)
  return x[None] if x.ndim == 1 else x


# --------------------------------------------------------------------------
# The public functions


def attention(q, k, v, *, causal: bool = True, segment_ids=None, window=None,
              soft_cap: Optional[float] = None, scale: Optional[float] = None,
              implementation: Optional[str] = None, q_positions=None, kv_positions=None):
  """Dot-product attention without the ``[T, T]`` scores: blocks of queries
  and keys, an online float32 softmax, and a backward pass that recomputes
  each block from the rows' logsumexp (flash attention, in pure JAX; memory
  linear in the sequence on any backend).

  A drop-in for ``jax.nn.dot_product_attention``: grouped-query (``heads``
  a multiple of ``kv_heads``), scores ``q . k * scale`` in float32.

  Args:
    q: ``[batch, seq_q, heads, head_dim]``.
    k, v: ``[batch, seq_k, kv_heads, head_dim]``.
    causal: a query sees keys at its own position and before.
    segment_ids: None, ``[batch, seq]`` ints (packed documents: a query sees
      only keys of its own segment; 0 is padding, which sees padding, so no
      row is empty), or a pair ``(q_segment_ids, kv_segment_ids)`` where
      ``seq_q != seq_k``.
    window: None, or transformers' ``sliding_window``: a query sees itself
      and the ``window - 1`` keys before it (without ``causal``, also the
      ``window - 1`` after it). An int, or a traced int scalar.
    soft_cap: None, or Gemma 2's ``c``: scores become ``c * tanh(s / c)``.
    scale: the scores' factor; default ``head_dim ** -0.5``.
    implementation: None or ``"xla"`` (the blockwise kernel; a sequence of
      one block of queries and keys: the plain computation), or
      ``"cudnn"`` (``jax.nn.dot_product_attention(implementation="cudnn")``;
      soft-capping computed plainly).
    q_positions, kv_positions: ``[batch, seq]`` (or ``[seq]``) ints, the
      positions the causal mask and the window compare; default
      ``arange(seq_q)`` / ``arange(seq_k)``.

  Returns:
    ``[batch, seq_q, heads, head_dim]`` in ``q``'s dtype. A query that sees
    no key gives zeros.

  Example:
    >>> import jax, jax.numpy as jnp, fsdp_jax
    >>> q = jax.random.normal(jax.random.key(0), (2, 6, 4, 8))
    >>> k, v = jax.random.normal(jax.random.key(1), (2, 2, 6, 2, 8))
    >>> out = fsdp_jax.attention(q, k, v)
    >>> ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-6))
    ((2, 6, 4, 8), True)
    >>> docs = jnp.array([[1, 1, 1, 2, 2, 0]] * 2)  # two documents and padding
    >>> fsdp_jax.attention(q, k, v, segment_ids=docs, window=2).shape
    (2, 6, 4, 8)
  """
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError("attention: segment_ids as a sequence must be a pair (q_segment_ids, "
                       f"kv_segment_ids); got {len(segment_ids)} items.")
    q_seg, kv_seg = segment_ids
  else:
    q_seg = kv_seg = segment_ids
    if segment_ids is not None and np.shape(q)[1] != np.shape(k)[1]:
      raise ValueError(f"attention: seq_q {np.shape(q)[1]} != seq_k {np.shape(k)[1]}: pass "
                       "segment_ids=(q_segment_ids, kv_segment_ids).")
  return attend_local(q, k, v, q_positions=q_positions, kv_positions=kv_positions,
                      q_segment_ids=q_seg, kv_segment_ids=kv_seg, causal=causal, window=window,
                      soft_cap=soft_cap, scale=scale, implementation=implementation)


def _default_block_q(tq: int, tk: int) -> int:
  """The query block of a call of ``tq`` queries and ``tk`` keys: one block
  where both fit one (the plain path), else :data:`BLOCK_Q` rows, or a
  quarter of the queries where that is less, down to :data:`MIN_BLOCK_Q`.
  The kernel's block temporaries (the backward's scores, probabilities and
  their cotangents, ``[batch, heads, block_q, block_k]`` float32 each) are
  a constant per call; a device's short query chunk under a context axis
  (512 of 4,096 tokens at ``context=8``) would otherwise be one block whose
  temporaries weigh like a quarter of its activations (benchmarks/CONTEXT.md)."""
  if tq <= BLOCK_Q and tk <= BLOCK_K:
    return BLOCK_Q
  return min(BLOCK_Q, max(MIN_BLOCK_Q, tq // 4))


def attend_local(q, k, v, *, q_positions=None, kv_positions=None, q_segment_ids=None,
                 kv_segment_ids=None, causal: bool = True, window=None,
                 soft_cap: Optional[float] = None, scale: Optional[float] = None,
                 implementation: Optional[str] = None, block_q: Optional[int] = None,
                 block_k: Optional[int] = None):
  """:func:`attention` on explicit positions and segment ids (each None or
  ``[batch or 1, seq]`` / ``[seq]`` ints; positions default to ``arange``):
  what :func:`attention` calls, and what a context-parallel step calls with
  a device's query chunk and the gathered keys and values. ``block_q`` /
  ``block_k``: the kernel's block sizes (default :func:`_default_block_q`,
  :data:`BLOCK_K`). Differentiable in ``q``, ``k``, ``v``."""
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("attention: pass both q_segment_ids and kv_segment_ids, or neither.")
  _check(q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, window, soft_cap,
         scale, implementation)
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  if implementation == "xla":
    implementation = None
  values = {"q_positions": q_positions, "kv_positions": kv_positions,
            "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids}
  extras = {n: _as_rows(x) for n, x in values.items() if x is not None}
  static_window = window
  if window is not None and not isinstance(window, (int, np.integer)):
    extras["window"] = jnp.asarray(window, jnp.int32)
    static_window = None
  names = tuple(n for n in _OPERANDS if n in extras)
  spec = _Spec(causal=bool(causal), window=None if static_window is None else int(static_window),
               soft_cap=None if soft_cap is None else float(soft_cap),
               scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
               implementation=implementation,
               block_q=int(block_q or _default_block_q(q.shape[1], k.shape[1])),
               block_k=int(block_k or BLOCK_K), operands=names)
  return _kernel(spec)(q, k, v, *(extras[n] for n in names))


# --------------------------------------------------------------------------
# The computation


class _Masks:
  """The operands that define the mask, as ``[P, seq]`` rows (``P``: 1 or
  the batch) and the window (an int, a traced scalar, or None)."""

  def __init__(self, spec: _Spec, tq: int, tk: int, extras: tuple):
    ops = dict(zip(spec.operands, extras))
    self.causal = spec.causal
    self.q_pos = ops.get("q_positions", jnp.arange(tq, dtype=jnp.int32)[None])
    self.k_pos = ops.get("kv_positions", jnp.arange(tk, dtype=jnp.int32)[None])
    self.q_seg, self.k_seg = ops.get("q_segment_ids"), ops.get("kv_segment_ids")
    self.window = ops.get("window", spec.window)

  def mask(self, q_pos, k_pos, q_seg, k_seg, k_valid=None):
    """``[P, 1, 1, tq, tk]`` booleans (None: everything visible)."""
    m = None if k_valid is None else k_valid[None, None, :]

    def both(a, b):
      return b if a is None else a & b
    d = q_pos[:, :, None] - k_pos[:, None, :]
    if self.causal:
      m = both(m, d >= 0)
    if self.window is not None:
      m = both(m, d < self.window)
      if not self.causal:
        m = both(m, -d < self.window)
    if q_seg is not None:
      m = both(m, q_seg[:, :, None] == k_seg[:, None, :])
    return None if m is None else m[:, None, None]


def _scores(spec: _Spec, q, k):
  """``q`` ``[B, t, K, G, H]``, ``k`` ``[B, s, K, H]`` -> float32 scores
  ``[B, K, G, t, s]`` (soft-capped), and ``tanh`` of the cap (or None)."""
  s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * spec.scale
  if spec.soft_cap is None:
    return s, None
  c = jnp.tanh(s / spec.soft_cap)
  return c * spec.soft_cap, c


def _grouped(q, kv_heads: int):
  b, t, n, h = q.shape
  return q.reshape(b, t, kv_heads, n // kv_heads, h)


def _plain(spec: _Spec, q, k, v, extras):
  """The whole scores at once, masked, softmax in float32 (rows that see
  nothing give zeros)."""
  b, t, n, h = q.shape
  masks = _Masks(spec, t, k.shape[1], extras)
  s, _ = _scores(spec, _grouped(q, k.shape[2]), k)
  m = masks.mask(masks.q_pos, masks.k_pos, masks.q_seg, masks.k_seg)
  if m is not None:
    s = jnp.where(m, s, MASKED)
  e = jnp.exp(s - jnp.max(s, -1, keepdims=True))
  if m is not None:
    e = jnp.where(m, e, 0.0)
  total = jnp.sum(e, -1, keepdims=True)
  p = (e / jnp.where(total == 0, 1.0, total)).astype(v.dtype)
  return jnp.einsum("bkgts,bskh->btkgh", p, v).reshape(b, t, n, h).astype(q.dtype)


def _cudnn(spec: _Spec, q, k, v, extras):
  """``jax.nn.dot_product_attention(implementation="cudnn")``: ``is_causal``
  and ``local_window_size`` where the positions are the slots, else a
  boolean mask; soft-capping (which it cannot express) plainly."""
  if spec.soft_cap is not None:
    return _plain(spec, q, k, v, extras)
  masks = _Masks(spec, q.shape[1], k.shape[1], extras)
  slots = not set(spec.operands) & {"q_positions", "kv_positions", "q_segment_ids", "window"}
  if slots and spec.causal:
    local = None if spec.window is None else (spec.window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, scale=spec.scale, is_causal=True,
                                        local_window_size=local, implementation="cudnn")
  m = masks.mask(masks.q_pos, masks.k_pos, masks.q_seg, masks.k_seg)
  if m is not None:
    m = jnp.broadcast_to(m[:, 0], (m.shape[0], 1) + m.shape[3:])
  return jax.nn.dot_product_attention(q, k, v, mask=m, scale=spec.scale,
                                      implementation="cudnn")


def _blocks(x, size: int, n: int, pad_mode: str = "constant"):
  """``x`` ``[P, T, ...]`` padded to ``n * size`` along axis 1 and cut into
  ``[n, P, size, ...]``."""
  pad = n * size - x.shape[1]
  if pad:
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    x = jnp.pad(x, widths, mode=pad_mode)
  x = x.reshape(x.shape[:1] + (n, size) + x.shape[2:])
  return jnp.moveaxis(x, 1, 0)


class _Layout:
  """The blocked operands of a call: queries, keys, values and the mask's
  rows cut into blocks, and which (query block, key block) pairs can see
  anything (``visible`` ``[nq, nk]``)."""

  def __init__(self, spec: _Spec, q, k, v, extras):
    self.spec = spec
    b, tq, n, h = q.shape
    tk, kv = k.shape[1], k.shape[2]
    self.shape = (b, tq, n, h, tk, kv)
    self.bq, self.bk = min(spec.block_q, tq), min(spec.block_k, tk)
    self.nq, self.nk = -(-tq // self.bq), -(-tk // self.bk)
    self.masks = masks = _Masks(spec, tq, tk, extras)
    self.q = _blocks(_grouped(q, kv), self.bq, self.nq)  # [nq, B, bq, K, G, H]
    self.k = _blocks(k, self.bk, self.nk)  # [nk, B, bk, K, H]
    self.v = _blocks(v, self.bk, self.nk)
    self.q_pos = _blocks(masks.q_pos, self.bq, self.nq, "edge")  # [nq, P, bq]
    self.k_pos = _blocks(masks.k_pos, self.bk, self.nk, "edge")
    seg = masks.q_seg is not None
    self.q_seg = _blocks(masks.q_seg, self.bq, self.nq, "edge") if seg else None
    self.k_seg = _blocks(masks.k_seg, self.bk, self.nk, "edge") if seg else None
    # Positions (``arange`` by default) and segment ids tied to the queries,
    # keys and values: under a ``lax.scan`` (layers scanned) they are
    # loop-invariant, and JAX's partial evaluation of the scan would hoist
    # everything of the kernel's loops that depends on them alone (each
    # block pair's mask and ``jnp.where`` fill values) out of the scan,
    # stacked for every (query block, key block) pair: ``[T, T]`` arrays.
    tied = lax.optimization_barrier(
        (self.q, self.k, self.v, self.q_pos, self.k_pos, self.q_seg, self.k_seg))
    self.q, self.k, self.v, self.q_pos, self.k_pos, self.q_seg, self.k_seg = tied
    self.visible = self._visible()

  def _visible(self):
    m = self.masks
    qp, kp = self.q_pos, self.k_pos  # [n, P, size]
    q_lo, q_hi = jnp.min(qp, -1).T[:, :, None], jnp.max(qp, -1).T[:, :, None]  # [P, nq, 1]
    k_lo, k_hi = jnp.min(kp, -1).T[:, None], jnp.max(kp, -1).T[:, None]  # [P, 1, nk]
    vis = jnp.ones((1, self.nq, self.nk), bool)
    if m.causal:
      vis = vis & (q_hi >= k_lo)
    if m.window is not None:
      vis = vis & (q_lo - k_hi < m.window)
      if not m.causal:
        vis = vis & (k_lo - q_hi < m.window)
    if self.q_seg is not None:
      qs_lo, qs_hi = jnp.min(self.q_seg, -1).T[:, :, None], jnp.max(self.q_seg, -1).T[:, :, None]
      ks_lo, ks_hi = jnp.min(self.k_seg, -1).T[:, None], jnp.max(self.k_seg, -1).T[:, None]
      vis = vis & (qs_lo <= ks_hi) & (ks_lo <= qs_hi)
    return jnp.any(vis, 0)

  def block_mask(self, i, j):
    """The ``[P, 1, 1, bq, bk]`` mask of query block ``i``, key block ``j``."""
    valid = None
    if self.nk * self.bk != self.shape[4]:
      valid = j * self.bk + jnp.arange(self.bk) < self.shape[4]
    seg = self.q_seg is not None
    return self.masks.mask(self.q_pos[i], self.k_pos[j], self.q_seg[i] if seg else None,
                           self.k_seg[j] if seg else None, valid)


def _blocked_forward(spec: _Spec, q, k, v, extras):
  """The output ``[B, Tq, N, H]`` and each row's logsumexp ``[nq, B, K, G,
  bq]`` (float32; rows that see nothing: 0).

  Both loops are ``lax.while_loop`` s, not scans: a caller's
  ``jax.checkpoint`` policy (fsdp_jax's units', ``dots_saveable``) applies to
  the equations of every scan it rematerialises, the custom_vjp's forward
  included (nested checkpoints too, jax-ml/jax#18817), and would save what
  it names in each iteration: the scores and ``p @ v`` of every (query
  block, key block) pair, ``[T/block, T/block, ...]`` arrays, quadratic in
  T. Of a while loop JAX saves nothing, whatever the policy: where the
  backward pass needs its outputs it runs the loop again, whole, from its
  inputs, which it then keeps (the blocked queries, keys and values: under
  a context axis, the keys and values of the whole sequence). The output
  and logsumexp are therefore named (:data:`OUT_NAME`, :data:`LSE_NAME`)
  after the loops: a policy that saves them (fsdp_jax's unit policies save
  every name) spares the backward pass the forward's loops and their
  inputs."""
  lay = _Layout(spec, q, k, v, extras)
  b, tq, n, h, _, kv = lay.shape
  g = n // kv

  def query_block(i, bufs):
    out_buf, lse_buf = bufs
    qb = lay.q[i]

    def key_block(carry):
      j, inner = carry

      def update(carry):
        m_old, l_old, acc = carry
        s, _ = _scores(spec, qb, lay.k[j])
        mask = lay.block_mask(i, j)
        if mask is not None:
          s = jnp.where(mask, s, MASKED)
        m_new = jnp.maximum(m_old, jnp.max(s, -1))
        e = jnp.exp(s - m_new[..., None])
        if mask is not None:
          e = jnp.where(mask, e, 0.0)
        alpha = jnp.exp(m_old - m_new)
        pv = jnp.einsum("bkgts,bskh->bkgth", e.astype(v.dtype), lay.v[j],
                        preferred_element_type=jnp.float32)
        return m_new, l_old * alpha + jnp.sum(e, -1), acc * alpha[..., None] + pv
      return j + 1, lax.cond(lay.visible[i, j], update, lambda c: c, inner)

    init = (jnp.full((b, kv, g, lay.bq), MASKED, jnp.float32),
            jnp.zeros((b, kv, g, lay.bq), jnp.float32),
            jnp.zeros((b, kv, g, lay.bq, h), jnp.float32))
    _, (m, l, acc) = lax.while_loop(lambda c: c[0] < lay.nk, key_block, (jnp.int32(0), init))
    seen = l > 0
    safe = jnp.where(seen, l, 1.0)
    out = jnp.where(seen[..., None], acc / safe[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(safe), 0.0)
    out = jnp.einsum("bkgth->btkgh", out).astype(q.dtype)
    return (lax.dynamic_update_index_in_dim(out_buf, out, i, 0),
            lax.dynamic_update_index_in_dim(lse_buf, lse, i, 0))

  bufs = (jnp.zeros((lay.nq, b, lay.bq, kv, g, h), q.dtype),
          jnp.zeros((lay.nq, b, kv, g, lay.bq), jnp.float32))

  def step(carry):
    i, bufs = carry
    return i + 1, query_block(i, bufs)
  _, (out, lse) = lax.while_loop(lambda c: c[0] < lay.nq, step, (jnp.int32(0), bufs))
  out = jnp.moveaxis(out, 0, 1).reshape(b, lay.nq * lay.bq, n, h)[:, :tq]
  return checkpoint_name(out, OUT_NAME), checkpoint_name(lse, LSE_NAME)


def _blocked_backward(spec: _Spec, q, k, v, extras, out, lse, g_out):
  lay = _Layout(spec, q, k, v, extras)
  b, tq, n, h, tk, kv = lay.shape
  grp = n // kv
  do = _blocks(_grouped(g_out.astype(q.dtype), kv), lay.bq, lay.nq)  # [nq, B, bq, K, G, H]
  delta = jnp.sum(g_out.astype(jnp.float32) * out.astype(jnp.float32), -1)  # [B, Tq, N]
  delta = _blocks(delta.reshape(b, tq, kv, grp), lay.bq, lay.nq)  # [nq, B, bq, K, G]
  delta = jnp.einsum("nbtkg->nbkgt", delta)

  def key_block(dq, j):
    kb, vb = lay.k[j], lay.v[j]

    def query_block(i, carry):
      def update(carry):
        dq, dk, dv = carry
        qb, dob = lay.q[i], do[i]
        s, cap = _scores(spec, qb, kb)
        p = jnp.exp(s - lse[i][..., None])
        mask = lay.block_mask(i, j)
        if mask is not None:
          p = jnp.where(mask, p, 0.0)
        dv = dv + jnp.einsum("bkgts,btkgh->bskh", p.astype(v.dtype), dob,
                             preferred_element_type=jnp.float32)
        dp = jnp.einsum("btkgh,bskh->bkgts", dob, vb, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[i][..., None])
        if cap is not None:
          ds = ds * (1.0 - cap * cap)
        ds = (ds * spec.scale).astype(q.dtype)
        dk = dk + jnp.einsum("bkgts,btkgh->bskh", ds, qb, preferred_element_type=jnp.float32)
        dq_i = jnp.einsum("bkgts,bskh->btkgh", ds, kb, preferred_element_type=jnp.float32)
        dq = lax.dynamic_update_index_in_dim(dq, dq[i] + dq_i, i, 0)
        return dq, dk, dv
      return lax.cond(lay.visible[i, j], update, lambda c: c, carry)

    zeros = jnp.zeros((b, lay.bk, kv, h), jnp.float32)
    dq, dk, dv = lax.fori_loop(0, lay.nq, query_block, (dq, zeros, zeros))
    return dq, (dk, dv)

  dq = jnp.zeros(lay.q.shape, jnp.float32)
  dq, (dk, dv) = lax.scan(key_block, dq, jnp.arange(lay.nk))
  dq = jnp.moveaxis(dq, 0, 1).reshape(b, lay.nq * lay.bq, n, h)[:, :tq]
  dk = jnp.moveaxis(dk, 0, 1).reshape(b, lay.nk * lay.bk, kv, h)[:, :tk]
  dv = jnp.moveaxis(dv, 0, 1).reshape(b, lay.nk * lay.bk, kv, h)[:, :tk]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _direct(spec: _Spec, tq: int, tk: int):
  """The function computing a call without blocks (cuDNN, or a sequence of
  one block), or None: the blockwise kernel."""
  if spec.implementation == "cudnn":
    return _cudnn
  if tq <= spec.block_q and tk <= spec.block_k:
    return _plain
  return None


@functools.lru_cache(maxsize=256)
def _kernel(spec: _Spec):
  """The ``jax.custom_vjp`` of one set of static options. Its backward
  rule carries them (``fsdp_jax_attention``), which :func:`match` reads."""

  def primal(q, k, v, *extras):
    direct = _direct(spec, q.shape[1], k.shape[1])
    if direct is not None:
      return direct(spec, q, k, v, extras)
    return _blocked_forward(spec, q, k, v, extras)[0]

  def fwd(q, k, v, *extras):
    direct = _direct(spec, q.shape[1], k.shape[1])
    if direct is not None:
      out, pull = jax.vjp(lambda q, k, v: direct(spec, q, k, v, extras), q, k, v)
      return out, (pull, None)
    out, lse = _blocked_forward(spec, q, k, v, extras)
    return out, (None, (q, k, v, extras, out, lse))

  def bwd(res, g):
    pull, saved = res
    if pull is not None:
      grads = pull(g)
      n = len(spec.operands)
    else:
      q, k, v, extras, out, lse = saved
      grads = _blocked_backward(spec, q, k, v, extras, out, lse, g)
      n = len(extras)
    return tuple(grads) + (None,) * n

  bwd.fsdp_jax_attention = spec
  f = jax.custom_vjp(primal)
  f.defvjp(fwd, bwd)
  return f

