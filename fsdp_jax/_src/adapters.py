"""The LoRA adapter path inside the step: ``loss_fn`` re-evaluated with each
target kernel kept apart as ``W`` and its factors.

``loss_fn`` is traced on the user's tree (the merged kernels' shapes) and its
jaxpr evaluated again with each target kernel bound to a :class:`LoRAValue`
(the gathered frozen base, ``A``, ``B``). A ``dot_general`` that reads the
kernel becomes PEFT's computation, ``x @ W + s * (dropout(x) @ A) @ B`` in
the dot's own dimension numbers, precision and output type, so the base's
weight gradient is never formed (``W`` is a constant of the
differentiation). The value follows the kernel through dtype casts (mixed
precision's, Flax's ``promote_dtype``), nested ``jit`` calls,
``jax.checkpoint`` (kept, with its policy) and ``lax.scan`` over stacked
layers (the scan slices the value's parts). Any other use (a transpose, a
reshape, a ``while`` loop) sees the merged weight ``W + s * A @ B``; the
step records it and ``print(state.plan)`` lists it, and adapter dropout,
which needs the adapter path's input, is refused there. Dropout is the
train step's only (``wrap_loss(train=True)``); evaluation wraps with
``train=False``, PEFT's eval mode.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from fsdp_jax._src import _compat
from fsdp_jax._src import lora as lora_lib
from fsdp_jax._src import loss as loss_lib
from fsdp_jax._src import quantization as quant
from fsdp_jax._src.lora import Report

# A fixed salt folded into the step's key for the adapters' dropout, so
# the masks never repeat the ones ``loss_fn`` draws from its own ``rng``.
_DROPOUT_SALT = 0x4C6F5241  # "LoRA"


class LoRAValue:
  """A target kernel as the re-evaluated loss holds it: the base (its
  ``uint8`` payload for QLoRA, decoded where it is used), ``A`` (``[*lead,
  *in, r]``), ``B`` (``[*lead, r, *out]``), the scale, the dropout rate and
  key, the dtype the loss has cast it to, and ``perm``: the kernel's
  dimensions as the loss sees them (after its transposes; None: as stored),
  each an index into ``[*in, *out]``.
  A pytree (``lax.scan`` slices its parts, ``jax.checkpoint`` passes them)."""

  __slots__ = ("base", "a", "b", "key", "scale", "rate", "quantization", "width", "dtype",
               "name", "out_dims", "perm")

  def __init__(self, base, a, b, key, *, scale, rate, quantization, width, dtype, name,
               out_dims=1, perm=None):
    self.base, self.a, self.b, self.key = base, a, b, key
    self.scale, self.rate, self.quantization = scale, rate, quantization
    self.width, self.dtype, self.name = width, jnp.dtype(dtype), name
    self.out_dims, self.perm = out_dims, perm

  def _aux(self):
    return (self.scale, self.rate, self.quantization, self.width, self.dtype, self.name,
            self.out_dims, self.perm)

  @property
  def in_dims(self) -> int:
    return self.a.ndim - 1 - self.lead

  @property
  def lead(self) -> int:
    """Leading layer axes (a stacked kernel outside its scan)."""
    return self.b.ndim - 1 - self.out_dims

  def _stored_shape(self) -> tuple:
    return tuple(self.a.shape[:-1]) + tuple(self.b.shape[self.lead + 1:])

  def _seen(self, x):
    """``x`` in the stored layout -> as the loss sees it."""
    if self.perm is None:
      return x
    lead = self.lead
    return jnp.transpose(x, tuple(range(lead)) + tuple(lead + p for p in self.perm))

  @property
  def shape(self) -> tuple:
    stored = self._stored_shape()
    if self.perm is None:
      return stored
    lead = self.lead
    return stored[:lead] + tuple(stored[lead + p] for p in self.perm)

  def weight(self):
    """The base kernel, decoded, in the value's dtype (as the loss sees it)."""
    if self.quantization is None:
      w = self.base.astype(self.dtype)
    else:
      w = quant.decode(self.base, self.quantization, self.width, self.dtype)
      w = w.reshape(self._stored_shape())
    return self._seen(w)

  def transpose(self, permutation: tuple) -> "LoRAValue":
    """The value of ``W.transpose(permutation)`` (per layer)."""
    perm = tuple(range(len(permutation))) if self.perm is None else self.perm
    return self._replace(perm=tuple(perm[k] for k in permutation))

  def _replace(self, **kw) -> "LoRAValue":
    fields = dict(base=self.base, a=self.a, b=self.b, key=self.key, scale=self.scale,
                  rate=self.rate, quantization=self.quantization, width=self.width,
                  dtype=self.dtype, name=self.name, out_dims=self.out_dims, perm=self.perm)
    fields.update(kw)
    return LoRAValue(fields.pop("base"), fields.pop("a"), fields.pop("b"), fields.pop("key"),
                     **fields)

  def merged(self):
    """``W + scale * A @ B`` in the value's dtype (the fallback)."""
    d = self._seen(lora_lib.delta(self.a, self.b, self.out_dims))
    w = self.weight()
    return (w.astype(jnp.float32) + jnp.float32(self.scale) * d).astype(self.dtype)

  def cast(self, dtype) -> "LoRAValue":
    """The kernel cast by the loss (Flax's ``promote_dtype``): the base is
    seen in ``dtype``; the adapters keep theirs, as PEFT's do."""
    base = self.base if self.quantization is not None else self.base.astype(dtype)
    return self._replace(base=base, dtype=dtype)


jax.tree_util.register_pytree_node(
    LoRAValue,
    lambda v: ((v.base, v.a, v.b, v.key), v._aux()),  # pylint: disable=protected-access
    lambda aux, ch: LoRAValue(*ch, scale=aux[0], rate=aux[1], quantization=aux[2],
                              width=aux[3], dtype=aux[4], name=aux[5], out_dims=aux[6],
                              perm=aux[7]))


def _is_lora(x) -> bool:
  return isinstance(x, LoRAValue)


# --------------------------------------------------------------------------
# The interpreter


def _read(env, v):
  return v.val if isinstance(v, _compat.Literal) else env[v]


def _materialize(x, report: Report, why: str):
  if not _is_lora(x):
    return x
  if x.rate:
    raise ValueError(
        f"LoRA(dropout={x.rate}) on target {x.name!r}, which the loss uses through "
        f"{why}, not as a matmul operand: dropout applies to the adapter path's input, "
        "and here the adapter is merged into the weight. Fix: pass dropout=0.0, or "
        "narrow LoRA(targets=...) to the kernels used in matmuls.")
  report.fallback(x, why)
  return x.merged()


def _dropout(x, value: LoRAValue, counter: list):
  if not value.rate:
    return x
  counter[0] += 1
  key = jax.random.fold_in(value.key, counter[0])
  keep = jax.random.bernoulli(key, 1.0 - value.rate, x.shape)
  return jnp.where(keep, x / jnp.asarray(1.0 - value.rate, x.dtype), jnp.zeros((), x.dtype))


def _dot(eqn, invals, report: Report, counter: list):
  """``dot_general`` with a :class:`LoRAValue` operand: PEFT's adapter path,
  or the merged weight when the dims do not allow it."""
  (lc, rc), (lb, rb) = _compat.dot_dimension_numbers(eqn)
  lhs, rhs = invals
  opts = _compat.dot_options(eqn)
  side = 1 if _is_lora(rhs) and not _is_lora(lhs) else 0 if _is_lora(lhs) and not _is_lora(rhs) else None
  value = None if side is None else invals[side]
  if value is None or lb or rb or value.lead:
    vals = [_materialize(x, report, "a dot_general it cannot split") for x in invals]
    return _compat.bind_eqn(eqn, vals)
  contract = rc if side else lc        # the kernel's contracted dims, as seen
  other = lc if side else rc           # x's, pair by pair
  k_in, ndim = value.in_dims, len(value.shape)
  perm = value.perm or tuple(range(ndim))
  stored = [perm[j] for j in contract]  # the contracted dims in [*in, *out]
  a, b = value.a, value.b
  if sorted(stored) == list(range(k_in)):            # x . A, then . B
    first, first_dims, second, r_axis = a, stored, b, 0
    rest = list(range(k_in, ndim))                    # B's dims, in order
  elif sorted(stored) == list(range(k_in, ndim)):    # a transposed use: x . B.T, then . A.T
    first, first_dims, second, r_axis = b, [1 + s - k_in for s in stored], a, a.ndim - 1
    rest = list(range(k_in))
  else:
    why = (f"a dot_general contracting kernel dims {tuple(stored)}, neither its input dims "
           f"{tuple(range(k_in))} nor its output dims {tuple(range(k_in, ndim))} (set "
           "LoRA(input_dims=...) to the kernel's input dimensions)")
    return _compat.bind_eqn(eqn, [_materialize(x, report, why) for x in invals])
  x = lhs if side else rhs

  def base_dot(stored_base, x):
    w = value._replace(base=stored_base).weight()  # pylint: disable=protected-access
    return _compat.bind_eqn(eqn, [w, x] if side == 0 else [x, w])[0]

  if value.quantization is None:
    base = base_dot(value.base, x)
  else:
    # QLoRA: decoded where it is used and again in the backward pass, so no
    # decoded kernel is kept from forward to backward (only its payload,
    # which FULL_SHARD re-gathers): otherwise every layer's decoded kernel
    # would be live at the peak (2x full fine-tuning's, benchmarks/LORA.md).
    base = jax.checkpoint(base_dot)(value.base, x)
  # PEFT runs the adapter in its own dtype (x cast to lora_A's) and adds the
  # result in the base output's.
  x = _dropout(x, value, counter).astype(a.dtype)
  # x . first over the contracted dims: [x's free dims, r]; then . second
  # over r: [x's free dims, second's kernel dims in stored order].
  t = lax.dot_general(x, first, ((tuple(other), tuple(first_dims)), ((), ())), **opts)
  u = lax.dot_general(t, second, (((t.ndim - 1,), (r_axis,)), ((), ())), **opts)
  free = [perm[j] for j in range(ndim) if j not in contract]  # the dot's order
  nx = t.ndim - 1
  order = tuple(range(nx)) + tuple(nx + rest.index(s) for s in free)
  if side == 0:  # W . x: the kernel's free dims first
    order = order[nx:] + order[:nx]
  if order != tuple(range(u.ndim)):
    u = lax.transpose(u, order)
  report.adapter_path.add(value.name)
  return [base + (u * jnp.asarray(value.scale, u.dtype)).astype(base.dtype)]


def evaluate(jaxpr, consts, args, report: Report, counter: list) -> list:
  """Evaluates ``jaxpr`` with :class:`LoRAValue` s among ``args``."""
  env: dict = {}
  for v, x in zip(jaxpr.constvars, consts):
    env[v] = x
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    invals = [_read(env, v) for v in eqn.invars]
    if not any(_is_lora(x) for x in invals):
      outs = _compat.bind_eqn(eqn, invals)
    else:
      outs = _rule(eqn, invals, report, counter)
    for v, x in zip(eqn.outvars, outs):
      if not isinstance(v, _compat.DropVar):
        env[v] = x
  return [_materialize(_read(env, v), report, "an output of a traced function")
          for v in jaxpr.outvars]


def _rule(eqn, invals, report: Report, counter: list) -> list:
  name = eqn.primitive.name
  if name == "dot_general":
    return _dot(eqn, invals, report, counter)
  if name == "convert_element_type" and _is_lora(invals[0]):
    return [invals[0].cast(_compat.converted_dtype(eqn))]
  if name in _compat.PASSTHROUGH_PRIMITIVES and len(invals) == 1:
    return [invals[0]]
  if name == "transpose" and not invals[0].lead:
    # x @ W.T (tied embeddings, PyTorch-layout kernels), an einsum's operand order
    return [invals[0].transpose(_compat.transpose_permutation(eqn))]
  if _compat.is_remat(eqn):
    p = _compat.remat_params(eqn)
    body = lambda *xs: evaluate(p.jaxpr, [], list(xs), report, counter)
    prevent_cse = bool(p.prevent_cse) if isinstance(p.prevent_cse, bool) else any(p.prevent_cse)
    return list(jax.checkpoint(body, policy=p.policy, prevent_cse=prevent_cse)(*invals))
  if _compat.is_scan(eqn):
    return _scan(eqn, invals, report, counter)
  if name in ("pjit", "jit", "closed_call", "core_call"):
    body = _compat.call_body(eqn)
    if body is not None:
      return evaluate(body[0], body[1], invals, report, counter)
  site = _compat.user_site(eqn)
  why = f"{name} at {site}" if site and site != "?" else name
  return _compat.bind_eqn(eqn, [_materialize(x, report, why) for x in invals])


def _scan(eqn, invals, report: Report, counter: list) -> list:
  p = _compat.scan_params(eqn)
  nc, ncar = p.num_consts, p.num_carry
  consts = invals[:nc]
  carry = [_materialize(x, report, "a scan carry") for x in invals[nc:nc + ncar]]
  xs = invals[nc + ncar:]

  def body(c, x):
    outs = evaluate(p.body, list(p.body_consts), list(consts) + list(c) + list(x), report,
                    counter)
    return outs[:ncar], outs[ncar:]

  c, ys = lax.scan(body, carry, xs, length=p.length, reverse=p.reverse, unroll=p.unroll)
  return list(c) + list(ys)


# --------------------------------------------------------------------------
# The loss with adapters


def values_tree(stored_tree, lora: lora_lib.LoRA, names: tuple, base_dtypes: tuple, key, *,
                train: bool = True):
  """The gathered stored tree -> the user's tree with :class:`LoRAValue` s
  at the targets (``names`` and ``base_dtypes``, the dtype the loss sees
  each base in, in stored order). ``train=False`` (evaluation, PEFT's
  ``model.eval()``): the adapters' dropout is off, ``key`` is not read."""
  it = iter(names)
  dtypes = iter(base_dtypes)
  rate = lora.dropout if train else 0.0

  def one(node):
    if not lora_lib.is_lora_weight(node):
      return node
    name = next(it)
    k = None
    if rate:
      k = jax.random.fold_in(key, zlib.crc32(name.encode()) % (2 ** 31))
      lead = tuple(node.lora_A.shape[:-2])
      if lead:  # stacked: one key per layer (the scan slices them)
        k = jax.random.split(k, lead[0])
    compute = next(dtypes)
    return LoRAValue(node.base, node.lora_A, node.lora_B, k, scale=lora.scaling,
                     rate=rate, quantization=node.quantization, width=node.width,
                     dtype=compute, name=name, out_dims=node.out_dims)

  return jax.tree.map(one, stored_tree, is_leaf=lora_lib.is_lora_weight)


def wrap_loss(loss_fn: Callable, *, lora: lora_lib.LoRA, target_names: tuple,
              base_dtypes: tuple, axis_env: tuple, report: Report,
              train: bool = True) -> Callable:
  """``loss_fn`` over the user's tree -> the same loss over the stored
  (gathered) tree, with the adapter path. ``train``: the train step's
  forward (the adapters' dropout applies); ``train=False`` is PEFT's eval
  mode (the adapter path without dropout: evaluation). The result takes
  ``rng`` when ``loss_fn`` does or the adapters' dropout applies."""
  user_rng = loss_lib.takes_rng(loss_fn)
  dropout = bool(lora.dropout) and train

  def run(params, args, rng):
    key = None
    if dropout:
      key = jax.random.fold_in(rng, _DROPOUT_SALT)
    values = values_tree(params, lora, target_names, base_dtypes, key, train=train)
    flat, treedef = jax.tree.flatten(values, is_leaf=_is_lora)
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat]
    kw = {"rng": rng} if user_rng else {}
    call = lambda p, *a: loss_fn(p, *a, **kw)
    closed, out_shape = jax.make_jaxpr(call, return_shape=True, axis_env=list(axis_env))(
        jax.tree.unflatten(treedef, structs), *args)
    rest = jax.tree.leaves(args)
    jaxpr, consts = _compat.split_closed(closed)
    outs = evaluate(jaxpr, consts, flat + rest, report, [0])
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

  return loss_lib.rewrapped(loss_fn, run, with_rng=user_rng or dropout)


def warn_fallbacks(report: Report) -> None:
  """One warning per target the loss uses through the merged weight."""
  for name, why in sorted(report.merged.items()):
    if name not in report.warned:
      report.warned.add(name)
      warnings.warn(
          f"LoRA target {name!r} is used through {why}, not as a matmul operand: that use "
          "sees the merged weight W + scale * A @ B (its gradient is formed for the "
          "whole kernel there). print(state.plan) lists it.", stacklevel=3)
