"""The blocked loss: a linear head and its cross-entropy computed a block of
tokens at a time, so no ``[tokens, vocab]`` logits array is ever live, in
the forward pass or the backward.

:func:`chunked_cross_entropy` is a ``jax.custom_vjp``. Its forward pass is
a ``lax.scan`` over blocks of ``block_tokens`` tokens (each block's logits
in float32, their logsumexp, the labels' logits) that keeps each token's
logsumexp only. Its backward pass recomputes the logits a block at a time,
twice: over blocks of tokens for the hidden state's gradient, then over
blocks of the vocabulary for the kernel's, each column block contracted
over every token in one float32-accumulated matmul and written into the
gradient in place (no kernel-sized addend or accumulator).

Tensor parallelism (``tensor_eval``) recognises the rule (:data:`BACKWARD`)
and runs the function's own body instead, on the slices of a head split by
vocabulary: a scan whose body is a ``jax.checkpoint`` of each block's
cross-entropy, which JAX differentiates (the vocabulary-parallel
cross-entropy of each block, nothing gathered).
"""

from __future__ import annotations

import functools
import operator
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fsdp_jax._src import _compat
from fsdp_jax._src.loss import WeightedLoss

IGNORE_INDEX = -100


def _positive_int(value, what: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{what}={value!r}): pass a positive int (a number of tokens, e.g. 512 "
                     "or 1024).")
  return operator.index(value)


def _check(hidden, head_kernel, labels, block_tokens, soft_cap) -> int:
  block = _positive_int(block_tokens, "chunked_cross_entropy(block_tokens")
  h_shape, k_shape, y_shape = np.shape(hidden), np.shape(head_kernel), np.shape(labels)
  if len(h_shape) < 2:
    raise ValueError(f"chunked_cross_entropy: hidden has shape {h_shape}; pass [..., tokens, d] "
                     "(or [tokens, d]).")
  if len(k_shape) != 2:
    raise ValueError(f"chunked_cross_entropy: head_kernel has shape {k_shape}; pass the "
                     "head's [d, vocab] kernel (a tied embedding table [vocab, d] as table.T).")
  if h_shape[-1] != k_shape[0]:
    raise ValueError(f"chunked_cross_entropy: hidden's last dimension is {h_shape[-1]} "
                     f"(shape {h_shape}) but head_kernel {k_shape} takes {k_shape[0]} features: "
                     "pass the kernel as [d, vocab] (a [vocab, d] table transposed).")
  if tuple(y_shape) != tuple(h_shape[:-1]):
    raise ValueError(f"chunked_cross_entropy: labels have shape {tuple(y_shape)}, hidden "
                     f"{tuple(h_shape)}: labels must have hidden's shape without its last "
                     f"dimension, {tuple(h_shape[:-1])} (one label per token, aligned with it: "
                     "shift them before the call for next-token prediction).")
  if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
    raise ValueError(f"chunked_cross_entropy: labels have dtype {jnp.result_type(labels)}; "
                     f"pass integer class ids ({IGNORE_INDEX} for tokens to ignore).")
  if soft_cap is not None and not (isinstance(soft_cap, (int, float, np.floating))
                                   and not isinstance(soft_cap, bool) and soft_cap > 0):
    raise ValueError(f"chunked_cross_entropy(soft_cap={soft_cap!r}): pass None or a positive "
                     "number (Gemma 2's final_logit_softcapping, e.g. 30.0).")
  return block


def chunked_cross_entropy(hidden, head_kernel, labels, *, block_tokens: int,
                          soft_cap: Optional[float] = None) -> WeightedLoss:
  """A linear head and its cross-entropy, a block of tokens at a time:
  ``sum over tokens of -log softmax(hidden @ head_kernel)[label]``, never
  holding the ``[tokens, vocab]`` logits (Liger Kernel's fused linear
  cross-entropy, Cut Cross-Entropy's idea, in pure JAX).

  The tokens (every position of ``hidden``'s leading dimensions) are cut
  into blocks of ``block_tokens``; a ``lax.scan`` computes each block's
  logits ``[block_tokens, vocab]`` (in the operands' dtype, as the
  unblocked ``hidden @ head_kernel`` gives them: a 16-bit head's logits are
  rounded to 16 bits), optionally soft-caps them, and takes their float32
  cross-entropy, keeping each token's
  logsumexp only. The backward pass (a ``jax.custom_vjp``) recomputes the
  logits a block at a time: by blocks of tokens for ``hidden``'s gradient,
  by as many blocks of the vocabulary for the kernel's (each written into
  it in place). The largest temporaries, forward and backward, are a few
  ``[block_tokens, vocab]``-sized float32 arrays. A token count that
  ``block_tokens`` does not divide is padded with ignored tokens.

  The labels are aligned with ``hidden`` (token ``t``'s label is
  ``labels[t]``); there is no shift. For next-token prediction shift them
  first, as transformers does and the model families' ``loss_fn`` does::

    shifted = jnp.pad(labels[:, 1:], ((0, 0), (0, 1)), constant_values=-100)

  Args:
    hidden: ``[..., tokens, d]`` (or ``[tokens, d]``): the final hidden
      state, after the last norm.
    head_kernel: ``[d, vocab]``; a tied embedding table ``[vocab, d]`` as
      ``table.T`` (a transpose inside a jitted function is not copied).
    labels: integers of ``hidden``'s shape less its last dimension; ``-100``
      marks a token to ignore (padding, a prompt, a document boundary).
    block_tokens: tokens per block, a positive int (512 or 1024: a block's
      logits are ``block_tokens * vocab * 4`` bytes, 256 MiB for 512 tokens
      of a 128,256-token vocabulary). Larger than the token count: one
      block.
    soft_cap: None, or ``c`` for Gemma 2's final soft-capping: the logits
      become ``c * tanh(logits / c)`` before the softmax.

  Returns:
    A :class:`~fsdp_jax.WeightedLoss`: ``total``, the sum of the
    cross-entropy over the tokens whose label is not ``-100`` (float32);
    ``weight``, their count (float32). ``float(loss)`` is the mean; return
    it from a ``loss_fn`` as it is.

  Raises:
    ValueError: ``block_tokens`` not a positive int; ``hidden``'s last
      dimension not ``head_kernel``'s first; ``labels`` not of ``hidden``'s
      leading shape, or not integers; a ``soft_cap`` that is not positive.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> h = jax.random.normal(jax.random.key(0), (2, 7, 16))
    >>> w = jax.random.normal(jax.random.key(1), (16, 50))
    >>> y = jax.random.randint(jax.random.key(2), (2, 7), 0, 50).at[0, 0].set(-100)
    >>> loss = fsdp_jax.chunked_cross_entropy(h, w, y, block_tokens=4)
    >>> float(loss.weight)
    13.0
    >>> ce = optax.softmax_cross_entropy_with_integer_labels(h @ w, jnp.maximum(y, 0))
    >>> bool(jnp.allclose(loss.total, jnp.sum(jnp.where(y != -100, ce, 0.0)), rtol=1e-5))
    True
  """
  block = _check(hidden, head_kernel, labels, block_tokens, soft_cap)
  hidden, labels = jnp.asarray(hidden), jnp.asarray(labels)
  shape, d = hidden.shape, hidden.shape[-1]
  hidden = hidden.reshape(-1, d)
  labels = labels.reshape(-1).astype(jnp.int32)
  n = hidden.shape[0]
  block = max(1, min(block, n))
  blocks = -(-n // block)
  pad = blocks * block - n
  if pad:
    hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
    labels = jnp.pad(labels, (0, pad), constant_values=IGNORE_INDEX)
  weight = jnp.sum(labels != IGNORE_INDEX).astype(jnp.float32)
  total = _blocked(block, None if soft_cap is None else float(soft_cap), hidden,
                   jnp.asarray(head_kernel), labels)
  return WeightedLoss(total=total, weight=weight)


def _logits(h, kernel, soft_cap):
  """A block's logits in float32 (soft-capped), and the derivative of the
  cap at them (None without one). As in the unblocked head, the logits are
  the matmul's in the operands' dtype (a 16-bit head rounds them to 16
  bits, and soft-caps them there: Liger's fused linear cross-entropy does
  the same) and only then widened to float32 for the softmax."""
  dtype = jnp.result_type(h, kernel)
  z = jnp.dot(h, kernel, preferred_element_type=jnp.float32).astype(dtype)
  if soft_cap is None:
    return z.astype(jnp.float32), None
  c = jnp.tanh(z / soft_cap)
  return (c * soft_cap).astype(jnp.float32), (1.0 - c.astype(jnp.float32) ** 2)


def _forward(block, soft_cap, hidden, kernel, labels):
  """The sum of the cross-entropy, and each token's logsumexp ``[N]``."""
  d = hidden.shape[-1]

  def body(_, xs):
    h, y = xs
    z, _ = _logits(h, kernel, soft_cap)
    lse = jax.nn.logsumexp(z, axis=-1)
    ok = y != IGNORE_INDEX
    picked = jnp.take_along_axis(z, jnp.where(ok, y, 0)[:, None], axis=-1)[:, 0]
    return (), (jnp.sum(jnp.where(ok, lse - picked, 0.0)), lse)

  _, (totals, lse) = jax.lax.scan(body, (), (hidden.reshape(-1, block, d),
                                             labels.reshape(-1, block)))
  return jnp.sum(totals), lse.reshape(-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _blocked(block, soft_cap, hidden, kernel, labels):
  """The sum of the cross-entropy. Its body is what tensor parallelism
  differentiates (``tensor_eval`` evaluates it on the slices of a head
  split by vocabulary, see :data:`BACKWARD`): a scan whose body is a
  ``jax.checkpoint``, each block's vocabulary-parallel cross-entropy."""
  d = hidden.shape[-1]

  def body(h, y):
    z, _ = _logits(h, kernel, soft_cap)
    ok = y != IGNORE_INDEX
    ce = optax.softmax_cross_entropy_with_integer_labels(z, jnp.where(ok, y, 0))
    return jnp.sum(jnp.where(ok, ce, 0.0))

  step = jax.checkpoint(body, prevent_cse=False)
  _, totals = jax.lax.scan(lambda c, xs: (c, step(*xs)), (),
                           (hidden.reshape(-1, block, d), labels.reshape(-1, block)))
  return jnp.sum(totals)


def _blocked_fwd(block, soft_cap, hidden, kernel, labels):
  total, lse = _forward(block, soft_cap, hidden, kernel, labels)
  return total, (hidden, kernel, labels, lse)


def _blocked_bwd(block, soft_cap, res, g):
  """Two passes, each recomputing logits a block at a time: over blocks of
  tokens for the hidden state's gradient (each block's rows whole, the
  vocabulary contracted in one matmul), then over blocks of the vocabulary
  for the kernel's (each block's columns whole, every token contracted in
  one float32-accumulated matmul, written into the gradient in place). No
  kernel-sized addend or accumulator exists besides the gradient itself.
  As in the unblocked loss, the logits' cotangent is rounded to the
  operands' dtype before each matmul."""
  hidden, kernel, labels, lse = res
  n, d = hidden.shape
  vocab = kernel.shape[1]
  dtype = jnp.result_type(hidden, kernel)
  ok = labels != IGNORE_INDEX
  scale = jnp.where(ok, g, 0.0).astype(jnp.float32)

  def dlogits(h, kernel_cols, y, lse_rows, scale_rows, first):
    z, dcap = _logits(h, kernel_cols, soft_cap)
    hit = (y - first)[:, None] == jnp.arange(z.shape[1])[None, :]
    dz = (jnp.exp(z - lse_rows[:, None]) - hit) * scale_rows[:, None]
    if dcap is not None:
      dz = dz * dcap
    return dz.astype(dtype)

  def rows(_, xs):
    h, y, lse_b, s_b = xs
    dz = dlogits(h, kernel, y, lse_b, s_b, 0)
    return (), jnp.dot(dz, kernel.T, preferred_element_type=jnp.float32).astype(hidden.dtype)

  _, dh = jax.lax.scan(rows, (), (hidden.reshape(-1, block, d), labels.reshape(-1, block),
                                  lse.reshape(-1, block), scale.reshape(-1, block)))
  # As many vocabulary blocks as token blocks: a block is [tokens, vocab /
  # blocks], the size of a token block's logits. The last block starts at
  # vocab - width (overlapping the one before it, whose columns it writes
  # again with the same values) so no padded copy of the kernel is made.
  width = -(-vocab // (n // block))
  starts = jnp.minimum(jnp.arange(-(-vocab // width)) * width, vocab - width)

  def cols(dw, first):
    w = jax.lax.dynamic_slice_in_dim(kernel, first, width, axis=1)
    dz = dlogits(hidden, w, labels, lse, scale, first)
    part = jnp.dot(hidden.T, dz, preferred_element_type=jnp.float32).astype(kernel.dtype)
    return jax.lax.dynamic_update_slice_in_dim(dw, part, first, axis=1), None

  dw, _ = jax.lax.scan(cols, jnp.zeros_like(kernel), starts)
  return dh.reshape(n, d), dw, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)

# The backward rule that marks the blocked loss in a traced program: where
# the head is split over the tensor axis, ``tensor_eval`` runs the function's
# own body on the slices (JAX differentiates it) instead of gathering the
# head for this rule.
BACKWARD = _blocked_bwd


def blocked_work(eqn):
  """``(blocks, forward FLOPs per block, backward FLOPs per block)`` of the
  matmuls the blocked sum of a :func:`chunked_cross_entropy` call's
  equation runs, or None for another equation: per block of tokens the
  head's logits forward; backward, the logits again and ``dh`` over blocks
  of tokens, then the logits again and ``dW`` over as many blocks of the
  vocabulary. The planner reads it: XLA's ``cost_analysis()`` counts a
  loop's body once, one block of each pass."""
  static = _compat.custom_vjp_static_args(eqn)
  if _compat.custom_vjp_backward(eqn) is not BACKWARD or not static:
    return None
  block = int(static[0])
  n, d = eqn.invars[-3].aval.shape
  vocab = eqn.invars[-2].aval.shape[1]
  per = 2.0 * block * d * vocab
  return n // block, per, 4.0 * per
