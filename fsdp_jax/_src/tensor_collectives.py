"""The collectives of tensor parallelism over the tensor axis, each a
``jax.custom_vjp`` with Megatron's backward pass: :mod:`fsdp_jax._src.tensor_eval`'s
(``psum`` <-> identity, all-gather <-> slice, a replicated value entering
split computations, a maximum over a split dimension) and sequence
parallelism's (:mod:`fsdp_jax._src.tensor_sequence`: reduce-scatter <->
all-gather along the sequence, and a column-parallel matmul whose backward
pass all-gathers its input's saved slice again).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def enter(x, axis):
  """Identity; the cotangent is summed over ``axis`` (Megatron's ``f``): a
  replicated value read by split or partial computations."""
  return x


def _enter_fwd(x, axis):
  return x, None


def _enter_bwd(axis, _, ct):
  return (lax.psum(ct, axis),)


enter.defvjp(_enter_fwd, _enter_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def psum(x, axis):
  """``psum`` over ``axis``; identity backward (Megatron's ``g``)."""
  return lax.psum(x, axis)


def _psum_fwd(x, axis):
  return lax.psum(x, axis), None


def _psum_bwd(axis, _, ct):
  return (ct,)


psum.defvjp(_psum_fwd, _psum_bwd)


def _all_gather(x, axis, dim):
  return lax.all_gather(x, axis, axis=dim, tiled=True)


def _reduce_scatter(x, axis, dim):
  return lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)


def _transposed(forward, backward, name: str, doc: str):
  """``forward(x, axis, dim)`` as a ``jax.custom_vjp`` whose backward is
  ``backward`` of the cotangent (each the other's transpose)."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
  def f(x, axis, dim):
    return forward(x, axis, dim)

  f.defvjp(lambda x, axis, dim: (f(x, axis, dim), None),
           lambda axis, dim, _, ct: (backward(ct, axis, dim),))
  f.__name__ = f.__qualname__ = name
  f.__doc__ = doc
  return f


def _own_part(ct, axis, dim):
  return own_slice(ct, axis, dim, ct.shape[dim] // axis_size(axis))


gather = _transposed(_all_gather, _own_part, "gather", """\
All-gather of a split value along ``dim``; backward: this device's
slice of the (replicated) cotangent.""")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def cut(x, axis, dim, size):
  """This device's slice of a replicated value; backward: the slices'
  cotangents all-gathered (the replicated value's whole cotangent)."""
  return own_slice(x, axis, dim, size)


def _cut_fwd(x, axis, dim, size):
  return own_slice(x, axis, dim, size), None


def _cut_bwd(axis, dim, size, _, ct):
  return (_all_gather(ct, axis, dim),)


cut.defvjp(_cut_fwd, _cut_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def extreme(x, axis, axes, is_max):
  """``reduce_max`` (``reduce_min``) of a split value over ``axes``, one of
  them split: this device's, then ``pmax`` (``pmin``) over ``axis``.
  Backward as one device's reduction: the cotangent shared equally among
  the positions that attain the extreme, on every device."""
  local = (jnp.max if is_max else jnp.min)(x, axis=axes)
  return (lax.pmax if is_max else lax.pmin)(local, axis)


def _extreme_fwd(x, axis, axes, is_max):
  out = extreme(x, axis, axes, is_max)
  return out, (x, out)


def _extreme_bwd(axis, axes, is_max, res, ct):
  x, out = res
  kept = tuple(d for d in range(x.ndim) if d not in axes)
  hit = (x == lax.broadcast_in_dim(out, x.shape, kept)).astype(ct.dtype)
  count = lax.psum(jnp.sum(hit, axis=axes), axis)
  return (hit * lax.broadcast_in_dim(ct / count, x.shape, kept),)


extreme.defvjp(_extreme_fwd, _extreme_bwd)


def axis_size(axis) -> int:
  return lax.axis_size(axis)


def own_slice(x, axis, dim: int, size: int):
  start = lax.axis_index(axis) * size
  return lax.dynamic_slice_in_dim(x, start, size, axis=dim)


scatter = _transposed(_reduce_scatter, _all_gather, "scatter", """\
A partial sum reduce-scattered along ``dim`` (``psum_scatter``): this
device's slice of the sum. Backward: the slices' cotangents all-gathered
(the whole cotangent, the same on every device, as each addend's).""")

regather = _transposed(_all_gather, _reduce_scatter, "regather", """\
A sequence slice all-gathered along ``dim`` as the input of split
computations only (column-parallel matmuls). Backward: their cotangents,
this device's addends of the whole one, reduce-scattered to the slice's.""")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def regathered_dot(gathered, piece, other, axis, dim, left, dn, opts):
  """``dot_general`` of ``gathered`` (``regather(piece, axis, dim)``, the
  ``left`` operand, else the right) and ``other``, saving ``piece`` for the
  backward pass instead of ``gathered`` (Megatron's sequence parallelism):
  the backward all-gathers it again for ``other``'s gradient. ``opts``: the
  matmul's options as ``(name, value)`` pairs. ``piece``'s cotangent is zero
  (``gathered``'s reaches it through ``regather``)."""
  return _dot_of(gathered, other, left, dn, opts)


def _dot_of(gathered, other, left, dn, opts):
  a, b = (gathered, other) if left else (other, gathered)
  return lax.dot_general(a, b, dn, **dict(opts))


def _regathered_dot_fwd(gathered, piece, other, axis, dim, left, dn, opts):
  return _dot_of(gathered, other, left, dn, opts), (piece, other)


def _regathered_dot_bwd(axis, dim, left, dn, opts, res, ct):
  piece, other = res
  gathered = _all_gather(piece, axis, dim)
  _, vjp = jax.vjp(lambda g, o: _dot_of(g, o, left, dn, opts), gathered, other)
  d_gathered, d_other = vjp(ct)
  return d_gathered, jnp.zeros_like(piece), d_other


regathered_dot.defvjp(_regathered_dot_fwd, _regathered_dot_bwd)
