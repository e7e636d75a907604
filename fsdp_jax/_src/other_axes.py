"""A collective over one mesh axis, run on values laid out over another.

Context parallelism's collectives over ``"context"`` (keys and values
all-gathered along the sequence, sums over it, a maximum's all-gather,
halos) act element by element across every other mesh axis. Tensor
parallelism (:mod:`fsdp_jax._src.tensor_eval`) evaluates the loss's jaxpr,
context collectives included, on each device's slices: such a collective
runs on a split value's slice (it leaves the split dimension whole) and,
being linear, on a partial sum's addend; its gradient is JAX's transpose
on the same slices. A value's form is tensor_eval's: ``("split", dim)``,
``("partial", dtype)`` or ``("full",)``.
"""

from __future__ import annotations

from fsdp_jax._src import _compat


def named_axes(eqn) -> tuple:
  """The mesh axes ``eqn``'s params name."""
  return tuple(a for v in _compat.axis_params(eqn).values()
               for a in (v if isinstance(v, (tuple, list)) else (v,)))


def collective(eqn, axis: str, forms: list, payloads: list):
  """``eqn`` (one of :data:`_compat.AXIS_COLLECTIVES` over axes other than
  ``axis``) on each operand's payload: ``[(form, output)]``, or None where
  it cannot run on the slices: it names ``axis``, all-gathers along a
  split dimension (tiled), or takes the maximum of a partial sum."""
  name = eqn.primitive.name
  if axis in named_axes(eqn) or (name in ("pmax", "pmin")
                                 and any(f[0] == "partial" for f in forms)):
    return None
  at, tiled = _compat.collective_layout(eqn) if name == "all_gather" else (None, True)
  if any(f[0] == "split" and f[1] == at and tiled for f in forms):
    return None
  outs = []
  for form, x in zip(forms, payloads):
    if form[0] == "split" and at is not None and not tiled and at <= form[1]:
      form = ("split", form[1] + 1)  # an untiled all-gather's new leading dimension
    outs.append((form, _compat.bind_eqn(eqn, [x])[0]))
  return outs
