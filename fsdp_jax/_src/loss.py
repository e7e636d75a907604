"""The ``loss_fn`` contract beyond ``loss_fn(params, batch) -> loss``.

* :class:`WeightedLoss`: a loss given as a sum and its weight (``sum(loss *
  w)`` and ``sum(w)``); the step reports and differentiates the *global*
  ratio ``psum(total) / psum(weight)``, as one ``jax.jit`` over the global
  batch computes it.
* ``rng``: a ``loss_fn`` with a keyword argument named ``rng`` gets a key
  that differs on every step and every device (:func:`device_key`).
* Axis names: the model's own collectives over the data-parallel world
  (``nn.BatchNorm(axis_name="batch")``) are bound to the mesh's data axes
  (:func:`bind_axis_names`, ``FSDPConfig(data_axis_name=...)``).

Then the checks and casts of what ``loss_fn`` gets and returns
(:class:`LossOutput`, :func:`check_loss_output`, :func:`check_rng`,
:func:`check_forward_inputs`, :func:`cast_floats`). The helpers at the end
read the traced loss: which inputs an output depends
on, and the evaluation of selected outputs only (the weight of a
:class:`WeightedLoss`, computed before the gradient).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fsdp_jax._src import _compat
from fsdp_jax._src._compat import Literal
from fsdp_jax._src.config import data_axis_names, is_float_dtype, is_key_dtype

__all__ = ["WeightedLoss", "constant_key"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightedLoss:
  """A loss given as a weighted sum and its total weight.

  ``loss_fn`` may return ``WeightedLoss(total=jnp.sum(loss * w),
  weight=jnp.sum(w))`` over the device's batch instead of a mean loss (also
  as ``(WeightedLoss(...), aux)`` and with model state). The step then
  reports ``metrics["loss"] = psum(total) / psum(weight)`` over the
  data-parallel world and takes the gradient of that global ratio, exactly
  what ``sum(loss * w) / sum(w)`` over the global batch under one
  ``jax.jit`` computes (a mean of per-device ratios would not be, when
  devices hold different weights). With gradient accumulation the sums run
  over every microbatch of every device.

  ``weight`` must not depend on the parameters (it is computed from the
  batch, e.g. a padding mask, before the gradient); with
  ``gradient_accumulation_steps > 1`` it must not depend on the model state
  either. Both are checked when the step is traced, following the weight
  into nested ``jit`` calls, ``jax.checkpoint`` / ``remat``, ``custom_jvp``
  / ``custom_vjp`` functions, ``scan``, ``while`` and ``cond`` (a loss
  wrapped in ``jax.checkpoint`` is fine); any other primitive counts as
  reading all its inputs.

  Attributes:
    total: scalar float, the weighted sum of the per-example losses of this
      device's batch.
    weight: scalar, the sum of the weights (a count of tokens, ...).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> cfg = fsdp_jax.FSDPConfig()
    >>> def loss_fn(params, batch):
    ...   per_example = (batch["x"] @ params["w"])[:, 0] ** 2
    ...   return fsdp_jax.WeightedLoss(total=jnp.sum(per_example * batch["w"]),
    ...                                weight=jnp.sum(batch["w"]))
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((3, 1))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=cfg)
    >>> step = fsdp_jax.shard_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, config=cfg)
    >>> # Device 0 holds rows of weight 1 (loss 9), device 1 one row of weight 3
    >>> # (loss 36): the global ratio is (2 * 9 + 3 * 36) / 5, not (9 + 36) / 2.
    >>> x = np.array([[1., 1., 1.], [1., 1., 1.], [2., 2., 2.], [0., 0., 0.]], np.float32)
    >>> batch = {"x": x, "w": np.array([1., 1., 3., 0.], np.float32)}
    >>> state, metrics = step(state, batch)
    >>> round(float(metrics["loss"]), 4)
    25.2
  """

  total: Any
  weight: Any

  def __float__(self) -> float:
    """The loss it stands for, ``total / weight`` (outside a trace).

    >>> import fsdp_jax
    >>> float(fsdp_jax.WeightedLoss(total=6.0, weight=4.0))
    1.5
    """
    return float(self.total) / float(self.weight)

  def __array__(self, dtype=None, copy=None):
    """``total / weight`` as a NumPy scalar array (``np.asarray(loss)``)."""
    del copy
    return np.asarray(float(self), dtype=dtype)


# --------------------------------------------------------------------------
# rng


def takes_rng(loss_fn: Callable) -> bool:
  """Whether ``loss_fn`` accepts a keyword argument named ``rng``."""
  try:
    sig = inspect.signature(loss_fn)
  except (TypeError, ValueError):  # builtins, some C callables
    return False
  p = sig.parameters.get("rng")
  return p is not None and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                      inspect.Parameter.KEYWORD_ONLY)


def takes_model_state(fn: Callable) -> bool:
  """Whether ``fn`` accepts a third positional argument (the model state),
  or a parameter named ``model_state``; True when its signature cannot be
  read."""
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return True
  kinds = [p.kind for p in sig.parameters.values()]
  positional = sum(k in (inspect.Parameter.POSITIONAL_ONLY,
                         inspect.Parameter.POSITIONAL_OR_KEYWORD) for k in kinds)
  return (positional >= 3 or inspect.Parameter.VAR_POSITIONAL in kinds
          or "model_state" in sig.parameters)


def rewrapped(loss_fn: Callable, run: Callable, *, with_rng: bool) -> Callable:
  """A loss with ``loss_fn``'s name and docstring that calls ``run(params,
  args, rng)``: it takes ``rng=`` (a keyword) when ``with_rng``, else
  ``rng`` is None. Its signature is its own (what :func:`takes_rng` reads)."""
  if with_rng:
    @functools.wraps(loss_fn)
    def with_key(params, *args, rng):
      return run(params, args, rng)
    del with_key.__wrapped__
    return with_key

  @functools.wraps(loss_fn)
  def without_key(params, *args):
    return run(params, args, None)
  del without_key.__wrapped__
  return without_key


def device_index(data_axes) -> jax.Array:
  """This device's index over the data-parallel mesh axes (inside
  ``jax.shard_map``): the row block of the global batch it holds."""
  return lax.axis_index(tuple(data_axes))


def device_key(key, step, data_axes):
  """The key ``loss_fn(..., rng=...)`` gets: ``fold_in(fold_in(key, step),
  device_index)`` (inside ``jax.shard_map``)."""
  return jax.random.fold_in(jax.random.fold_in(key, step), device_index(data_axes))


# --------------------------------------------------------------------------
# Keys that are constants of the trace

# Primitives that turn a key into random bits, and how many leading operands
# are the key (``threefry2x32`` takes two key words, then the counts).
_DRAWS = {"random_bits": 1, "threefry2x32": 2, "rng_bit_generator": 1}
_MARK = "fsdp_jax_constant_key"


def _marked(key):
  return lax.optimization_barrier(key)


_marked.__name__ = _MARK
_mark = jax.jit(_marked)


def constant_key(key):
  """Marks ``key`` as meant to be the same on every device and every step.

  ``shard_train_step`` refuses a ``loss_fn`` that draws random bits from a
  key that is a constant of its trace (a key closed over from outside
  ``loss_fn`` or made inside it from a Python number): every device and
  every step would get the same random numbers, e.g. the same dropout mask.
  When that is what you want (a fixed random projection, noise kept equal
  on purpose), pass the key through ``constant_key`` inside ``loss_fn``.
  Keys that come from ``loss_fn(..., rng=...)`` need no mark.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> PROJECTION_KEY = jax.random.key(0)
    >>> def loss_fn(params, batch):
    ...   proj = jax.random.normal(fsdp_jax.constant_key(PROJECTION_KEY), (2, 3))
    ...   return jnp.mean((batch["x"] @ params["w"] @ proj) ** 2)
    >>> state, metrics = fsdp_jax.shard_train_step(loss_fn)(state, {"x": jnp.ones((2, 4))})
    >>> int(state.step)
    1
  """
  return _mark(key)


def _body_deps(eqn, ins: list) -> list:
  """``[(open jaxpr, which of its inputs depend on loss_fn's inputs)]`` for
  the jaxprs nested in ``eqn``, given which of ``eqn``'s operands do, and
  the number of loop-carried values (for a fixed point) per body."""
  name = eqn.primitive.name
  if _compat.is_scan(eqn):
    p = _compat.scan_params(eqn)
    return [(p.body, ins, (p.num_consts, p.num_carry))]
  if name == "while":
    nc, nb, cond, body = _compat.while_parts(eqn)
    carry = ins[nc + nb:]
    return [(cond, ins[:nc] + carry, None), (body, ins[nc:nc + nb] + carry, (nb, len(carry)))]
  if name == "cond":
    return [(_compat.split_closed(b)[0], ins[1:], None) for b in _compat.cond_branches(eqn)]
  out = []
  for sub in _compat.nested_jaxprs(eqn):
    same = len(sub.invars) == len(ins)
    out.append((sub, ins if same else [any(ins)] * len(sub.invars), None))
  return out


def _constant_draws(jaxpr, dep_in: list, found: list, site=None) -> list:
  """Appends to ``found`` the draws of ``jaxpr`` whose key depends on none
  of the inputs marked in ``dep_in``, as the equation of the traced loss
  they are in (``site``: the user's line); returns which outputs depend on
  those inputs."""
  dep = {v for v, d in zip(jaxpr.invars, dep_in) if d}
  is_dep = lambda v: not isinstance(v, Literal) and v in dep
  for eqn in jaxpr.eqns:
    ins = [is_dep(v) for v in eqn.invars]
    name = eqn.primitive.name
    if _compat.call_name(eqn) == _MARK:
      dep.update(eqn.outvars)  # constant_key: meant to be constant
      continue
    if name in _DRAWS and not any(ins[:_DRAWS[name]]):
      found.append(site or eqn)
    outs = [any(ins)] * len(eqn.outvars)
    for body, body_in, loop in _body_deps(eqn, ins):
      mark = len(found)
      body_out = _constant_draws(body, body_in, found, site or eqn)
      if loop is not None:  # carried values: iterate to a fixed point
        k, n = loop
        while True:
          carry = [a or b for a, b in zip(body_in[k:k + n], body_out[:n])]
          if carry == list(body_in[k:k + n]):
            break
          body_in = body_in[:k] + carry + body_in[k + n:]
          del found[mark:]
          body_out = _constant_draws(body, body_in, found, site or eqn)
      if len(body_out) == len(outs) and name not in ("cond", "while"):
        outs = [a or b for a, b in zip(outs, body_out)] if name == "scan" else body_out
      elif name == "cond" and len(body_out) == len(outs):
        outs = [a or b or ins[0] for a, b in zip(outs, body_out)]
    dep.update(v for v, d in zip(eqn.outvars, outs) if d)
  return [is_dep(v) for v in jaxpr.outvars]


def constant_key_draws(closed) -> list:
  """The equations of the traced ``loss_fn`` (a ``ClosedJaxpr`` whose inputs
  are everything ``loss_fn`` gets) that draw random bits from a key no input
  feeds: a key closed over or made from a Python number inside the loss."""
  jaxpr = _compat.split_closed(closed)[0]
  found: list = []
  _constant_draws(jaxpr, [True] * len(jaxpr.invars), found)
  return found


def constant_key_message(draws: list, takes_rng: bool) -> str:
  where = sorted({_compat.user_site(e) for e in draws})
  shown = "; ".join(where[:4]) + ("; ..." if len(where) > 4 else "")
  fix = ("use the rng it already gets (e.g. model.apply(params, x, rngs={'dropout': rng}))"
         if takes_rng else "take it as a keyword argument, def loss_fn(params, batch, *, rng), "
         "use it (e.g. model.apply(params, x, rngs={'dropout': rng})) and pass "
         "rng=jax.random.key(seed) to fsdp_jax.init_train_state")
  return (
      f"loss_fn draws random numbers from a key that is a constant of its trace (at {shown}): "
      "a key closed over from outside loss_fn or made inside it from a Python number. Every "
      "device and every step would get the same random numbers (e.g. the same dropout "
      f"mask). Fix: {fix}; each step then gets fold_in(fold_in(rng, step), device_index), "
      "different on every device and step and the same when the run is repeated or "
      "restored. If one key everywhere is intended, wrap it inside loss_fn as "
      "fsdp_jax.constant_key(key).")


MISSING_RNG_HINT = (
    "fsdp_jax: the model needs a PRNG key (e.g. for dropout) and loss_fn passed none. Fix: "
    "take it as a keyword argument, def loss_fn(params, batch, *, rng), pass it on "
    "(model.apply(params, x, rngs={'dropout': rng})), and pass rng=jax.random.key(seed) to "
    "fsdp_jax.init_train_state; each step then gets fold_in(fold_in(rng, step), "
    "device_index), different on every device and step. For evaluation without dropout, "
    "call the model with deterministic=True (or train=False) instead.")


# --------------------------------------------------------------------------
# Axis names


def bind_axis_names(closed, mapping: dict):
  """``closed`` (a ``ClosedJaxpr``) with every collective over a name in
  ``mapping`` (a model's ``"batch"``) rewritten to run over the mesh axes it
  maps to (``("replicate", "shard")``), nested jaxprs included.

  The trace must have bound those names with the data-parallel world's size
  (``jax.make_jaxpr(..., axis_env=...)``), so sizes read at trace time (the
  divisor of ``pmean``, ``ppermute``'s permutation) are already right.
  """
  if not mapping:
    return closed
  return _rename_axis_names(closed, mapping)


def _rename_axis_names(closed, mapping: dict):
  """``closed`` with every collective over a name in ``mapping`` rewritten
  to run over the mesh axes it maps to, nested jaxprs included.

  Collectives carry their names in the params ``axes`` (psum, pmax, pmin)
  or ``axis_name`` (ppermute, all_gather, axis_index, ...); ``axis_index``
  lowers for one axis only, so one over several axes becomes a
  ``closed_call`` of ``lax.axis_index(axes)``. No public API renames an axis
  in a traced program (the equation accessors are ``_compat``'s).
  """
  memo: dict = {}

  def names(value):
    if isinstance(value, str):
      return mapping.get(value, (value,)), value in mapping
    if isinstance(value, tuple) and any(isinstance(v, str) and v in mapping for v in value):
      out = []
      for v in value:
        for n in (mapping.get(v, (v,)) if isinstance(v, str) else (v,)):
          if n not in out:
            out.append(n)
      return tuple(out), True
    return value, False

  def any_jaxpr(value):
    if isinstance(value, _compat.ClosedJaxpr):
      return _compat.replace_closed_jaxpr(value, jaxpr_(value.jaxpr))
    return jaxpr_(value)

  def eqn_(e):
    renamed = {}
    for key, value in _compat.axis_params(e).items():
      new, changed = names(value)
      if changed:
        renamed[key] = new
    if e.primitive.name == "axis_index" and "axis_name" in renamed:
      new = renamed["axis_name"]
      axes = new if isinstance(new, tuple) else (new,)
      if len(axes) > 1:
        # The primitive lowers for one axis only: lax.axis_index(axes)
        # combines one per axis, called in place of the equation.
        return _compat.call_eqn(e, jax.make_jaxpr(lambda: lax.axis_index(axes))())
      renamed["axis_name"] = axes[0]
    return _compat.rebuild_params(e, renamed, any_jaxpr)

  def jaxpr_(jaxpr):
    if id(jaxpr) not in memo:
      eqns = [eqn_(e) for e in jaxpr.eqns]
      memo[id(jaxpr)] = (jaxpr, _compat.replace_jaxpr_eqns(jaxpr, eqns))
    return memo[id(jaxpr)][1]

  return _compat.replace_closed_jaxpr(closed, jaxpr_(closed.jaxpr))


_UNBOUND = re.compile(r"unbound axis name: ([^\s.]+)")


def unbound_axis_name(error: BaseException) -> Optional[str]:
  """The axis name of JAX's ``NameError: Found an unbound axis name: ...``."""
  if not isinstance(error, NameError):
    return None
  m = _UNBOUND.search(str(error))
  return m.group(1) if m else None


def explain_unbound_axis(name: str, plan) -> str:
  """The message for a collective in ``loss_fn`` over an axis name the step
  does not bind: which names exist and the fix."""
  axes = plan.axes.data_axes
  sizes = dict(plan.mesh.shape)
  bound = ", ".join(f"{a!r} (mesh axis, size {sizes[a]})" for a in plan.mesh.axis_names)
  aliases = data_axis_names(plan.config)
  if aliases:
    bound += ", " + ", ".join(f"{a!r} (data_axis_name: all of {axes})" for a in aliases)
  world = plan.axes.world_size
  target = repr(axes[0]) if len(axes) == 1 else repr(axes)
  if name in aliases:
    return (
        f"loss_fn uses the axis name {name!r} where the step cannot bind it: "
        f"FSDPConfig(data_axis_name=...) maps {name!r} onto the mesh axes {axes} in "
        "loss_fn's own program, but not inside a custom_jvp / custom_vjp rule, whose "
        "derivative is traced later. Fix: use the mesh axis name(s) "
        f"{target} in that rule.")
  return (
      f"loss_fn runs a collective over the axis name {name!r} (e.g. "
      f"nn.BatchNorm(axis_name={name!r}) or lax.pmean(x, {name!r})), which is not bound "
      f"inside the step. Names bound there: {bound}. Fix: "
      f"FSDPConfig(data_axis_name={name!r}) makes {name!r} mean the whole data-parallel "
      f"world (mesh axes {axes}, {world} devices), so a BatchNorm computes the statistics "
      f"of the global batch; or use {target} as the axis name in the model.")


def axis_mapping(plan) -> dict:
  """``{model axis name: data-parallel mesh axes}`` for the plan's config."""
  return {n: tuple(plan.axes.data_axes) for n in data_axis_names(plan.config)}


# --------------------------------------------------------------------------
# What loss_fn gets and returns: checks and casts


def cast_floats(tree, dtype, only=None):
  """Casts floating leaves to ``dtype``; with ``only`` (top-level keys), just
  the leaves under those keys."""
  def cast(path, x):
    if not hasattr(x, "dtype"):
      return x
    if only is not None:
      top = path[0] if path else None
      key = getattr(top, "key", getattr(top, "idx", getattr(top, "name", None)))
      if key not in only:
        return x
    return x.astype(dtype) if is_float_dtype(x.dtype) else x
  return jax.tree_util.tree_map_with_path(cast, tree)


def check_forward_inputs(forward_inputs):
  """``forward_inputs`` as a frozenset of top-level batch keys; a string (whose
  ``in`` would match substrings) or a non-iterable is refused."""
  if forward_inputs is None:
    return None
  if isinstance(forward_inputs, (str, bytes)):
    raise TypeError(
        f"forward_inputs={forward_inputs!r} is a string; it must be a collection of "
        f"top-level batch keys. Fix: forward_inputs=({forward_inputs!r},).")
  try:
    return frozenset(forward_inputs)
  except TypeError:
    raise TypeError(
        f"forward_inputs must be a collection of top-level batch keys (e.g. "
        f"(\"input_ids\",)), got {forward_inputs!r}.") from None


def check_batch_has(batch, forward_inputs) -> None:
  """Every key of ``forward_inputs`` is a top-level key of ``batch``."""
  if isinstance(batch, dict):
    keys = set(batch)
  elif hasattr(batch, "_fields"):  # NamedTuple
    keys = set(batch._fields)
  elif dataclasses.is_dataclass(batch):
    keys = {f.name for f in dataclasses.fields(batch)}
  elif isinstance(batch, (tuple, list)):
    keys = set(range(len(batch)))
  else:
    keys = set()
  missing = sorted((k for k in forward_inputs if k not in keys), key=repr)
  if missing:
    have = ", ".join(repr(k) for k in sorted(keys, key=repr)) or "none"
    raise KeyError(
        f"forward_inputs names {', '.join(repr(k) for k in missing)}, which the batch "
        f"({type(batch).__name__}) does not have at its top level. Its keys: {have}. "
        "Fix: list only the batch's top-level keys that are the model's forward inputs.")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossOutput:
  """What the loss returned on this device: ``loss``, ``aux`` (or None) and
  the new ``model_state`` (or None).

  For a :class:`~fsdp_jax.WeightedLoss`, ``weight`` is its weight: from
  :class:`~fsdp_jax._src.local_loss.LocalLoss`, ``loss`` and ``weight`` are this device's
  ``total`` and ``weight``; from :func:`~fsdp_jax._src.grads.value_and_grad`, ``loss`` is the
  global ratio ``psum(total) / psum(weight)`` and ``weight`` the global
  ``psum(weight)`` (float32), the same on every device. ``weight`` is None
  for a mean loss."""

  loss: Any
  aux: Any
  model_state: Any
  weight: Any = None


@dataclasses.dataclass(frozen=True)
class OutputKind:
  has_aux: bool
  weighted: bool


def check_loss_output(out_shape, with_model_state: bool) -> OutputKind:
  """Reads ``loss_fn``'s output structure: whether it has aux and whether
  the loss is a :class:`~fsdp_jax.WeightedLoss`; raises for anything else."""

  def is_scalar(s):
    return hasattr(s, "shape") and s.shape == () and is_float_dtype(s.dtype)

  def is_loss(s):
    if isinstance(s, WeightedLoss):
      for field in ("total", "weight"):
        v = getattr(s, field)
        if not (hasattr(v, "shape") and v.shape == ()):
          raise ValueError(
              f"WeightedLoss.{field} must be a scalar (the sum over the device's "
              f"batch); got shape {getattr(v, 'shape', type(v).__name__)}. Fix: "
              "WeightedLoss(total=jnp.sum(loss * w), weight=jnp.sum(w)).")
      if not is_float_dtype(s.total.dtype):
        raise ValueError(f"WeightedLoss.total must be floating point; got {s.total.dtype}.")
      return True
    return is_scalar(s)

  show = lambda t: jax.tree.map(lambda s: f"{s.dtype}{list(s.shape)}", t)
  head = out_shape
  if with_model_state:
    if not (isinstance(out_shape, (tuple, list)) and len(out_shape) == 2):
      raise ValueError(
          "With model state, loss_fn(params, batch, model_state) must return "
          "(loss, new_model_state) or ((loss, aux), new_model_state); it returned "
          f"{show(out_shape)}.")
    head = out_shape[0]
  if is_loss(head):
    return OutputKind(False, isinstance(head, WeightedLoss))
  if isinstance(head, (tuple, list)) and len(head) == 2 and is_loss(head[0]):
    return OutputKind(True, isinstance(head[0], WeightedLoss))
  first = head[0] if isinstance(head, (tuple, list)) and head else head
  shape = getattr(first, "shape", None)
  raise ValueError(
      f"loss_fn must return a scalar floating-point loss (the mean over the "
      f"device's batch), a fsdp_jax.WeightedLoss(total=, weight=), or a (loss, aux) "
      f"pair; it returned {show(head)}"
      + (f" (loss of shape {shape})" if shape else "")
      + ". Fix: reduce it, e.g. `return jnp.mean(per_example_loss)`.")


def check_rng(rng) -> None:
  if rng is None:
    raise ValueError(
        "loss_fn takes rng=, but the train state holds no key. Fix: pass "
        "rng=jax.random.key(seed) to fsdp_jax.init_train_state (it also seeds init_fn); "
        "each step then passes fold_in(fold_in(rng, step), device_index).")
  for x in jax.tree_util.tree_leaves(rng):
    dtype = getattr(x, "dtype", None)
    if not (is_key_dtype(dtype) or (dtype == jnp.uint32 and x.ndim >= 1)):  # typed or raw
      raise TypeError(
          f"loss_fn takes rng=, but the state's rng is not a PRNG key (a leaf of dtype "
          f"{dtype} and shape {getattr(x, 'shape', None)}). Fix: pass "
          "rng=jax.random.key(seed) to fsdp_jax.init_train_state.")


def stored_model_state(model_state, new_ms, key_pos, jaxpr, out_shape, ms_start: int):
  """The new model state as stored: the structure checked, and the typed
  keys (folded with the device index for ``loss_fn``) put back as stored.
  ``ms_start``: the position of the model state's first leaf among the
  traced loss's inputs."""
  old_leaves, old_def = jax.tree_util.tree_flatten(model_state)
  new_leaves, new_def = jax.tree_util.tree_flatten(new_ms)
  if old_def != new_def:
    raise ValueError(
        "loss_fn must return the new model state with the structure of the model state "
        f"it got:\n  got:      {old_def}\n  returned: {new_def}\nFix: return every "
        "collection, e.g. {**model_state, **updates} for Flax linen's "
        "model.apply(..., mutable=[...]) updates, or nnx.state(model, nnx.Not(nnx.Param)).")
  if not key_pos:
    return new_ms
  # A key leaf must come back as the very input it was: a step cannot keep
  # per-device keys in replicated state.
  first_ms_out = len(jax.tree_util.tree_leaves(out_shape)) - len(new_leaves)
  for j in key_pos:
    if jaxpr.outvars[first_ms_out + j] is not jaxpr.invars[ms_start + j]:
      raise ValueError(
          "loss_fn returns a new value for a PRNG key in the model state (leaf "
          f"{j} of {old_def}). Keys in model_state are constants of the train state "
          "(each device's loss_fn sees fold_in(key, device_index)); per-step "
          "randomness comes from the step. Fix: return the key unchanged, and take "
          "a key that changes every step as loss_fn(..., rng=...) (pass "
          "rng= to init_train_state).")
  return jax.tree_util.tree_unflatten(
      new_def, [old_leaves[j] if j in key_pos else x for j, x in enumerate(new_leaves)])


def as_stored_dtype(new, old):
  """A model-state leaf back in its stored dtype (PRNG keys as they are)."""
  return new if is_key_dtype(old.dtype) else new.astype(old.dtype)


# --------------------------------------------------------------------------
# Reading the traced loss

def _call_body(eqn):
  """The (open jaxpr, consts) of an equation that calls a jaxpr once, input
  for input and output for output: a ``jit``, a closed call, a
  ``jax.checkpoint`` / ``remat`` (its body), a ``custom_jvp`` /
  ``custom_vjp`` function (its primal body: the value, which is all the
  weight needs). None for any other equation."""
  if _compat.is_remat(eqn):
    body = _compat.split_closed(_compat.remat_params(eqn).jaxpr)
  elif _compat.is_call(eqn):
    body = _compat.call_body(eqn)
  else:
    return None
  if (body is None or len(body[0].invars) != len(eqn.invars)
      or len(body[0].outvars) != len(eqn.outvars)):
    return None
  return body


def _scan_needs(eqn, hits) -> Optional[set]:
  """A ``scan``'s inputs (consts, carry, xs) its outputs at ``hits`` (carry,
  ys) depend on: a carried value the body reads is needed from every
  iteration, so the needed carry grows to a fixed point."""
  p = _compat.scan_params(eqn)
  body, nc, ncar = p.body, p.num_consts, p.num_carry
  if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(eqn.outvars):
    return None
  outs = set(hits)
  while True:
    ins = needed_inputs(body, sorted(outs))
    more = {j - nc for j in ins if nc <= j < nc + ncar} - outs
    if not more:
      return ins | {nc + j for j in outs if j < ncar}
    outs |= more


def _while_needs(eqn, hits) -> Optional[set]:
  """A ``while``'s inputs (cond consts, body consts, carry) its outputs at
  ``hits`` depend on: the carried values the condition reads (the trip
  count) and those the needed ones are computed from, to a fixed point."""
  nc, nb, cond, body = _compat.while_parts(eqn)
  n = len(eqn.invars) - nc - nb
  if len(cond.invars) != nc + n or len(body.invars) != nb + n or len(body.outvars) != n:
    return None
  c_need = needed_inputs(cond, [0])
  carry = set(hits) | {j - nc for j in c_need if j >= nc}
  while True:
    b_need = needed_inputs(body, sorted(carry))
    more = {j - nb for j in b_need if j >= nb} - carry
    if not more:
      return ({j for j in c_need if j < nc} | {nc + j for j in b_need if j < nb}
              | {nc + nb + j for j in carry})
    carry |= more


def _cond_needs(eqn, hits) -> Optional[set]:
  """A ``cond``'s inputs (the index, the operands) its outputs at ``hits``
  depend on: the index, and what any branch reads for them."""
  needs = {0}
  for branch in _compat.cond_branches(eqn):
    b = _compat.split_closed(branch)[0]
    if len(b.invars) != len(eqn.invars) - 1 or len(b.outvars) != len(eqn.outvars):
      return None
    needs |= {i + 1 for i in needed_inputs(b, hits)}
  return needs


def _eqn_needs(eqn, hits) -> Optional[set]:
  """Positions of ``eqn``'s inputs that its outputs at ``hits`` depend on,
  seen through the jaxprs it holds (calls, ``jax.checkpoint``, custom
  derivative rules' primal bodies, ``scan``, ``while``, ``cond``); None
  where it cannot see inside (every input counts)."""
  body = _call_body(eqn)
  if body is not None:
    return needed_inputs(body[0], hits)
  if _compat.is_scan(eqn):
    return _scan_needs(eqn, hits)
  name = eqn.primitive.name
  if name == "while":
    return _while_needs(eqn, hits)
  if name == "cond":
    return _cond_needs(eqn, hits)
  return None


def _needed(jaxpr, outs) -> tuple[list, set]:
  """``(needed equations as (eqn, needed output positions, needed input
  positions or None for all), live vars)`` for the outputs at positions
  ``outs``."""
  live = {jaxpr.outvars[i] for i in outs if not isinstance(jaxpr.outvars[i], Literal)}
  needed = []
  for eqn in reversed(jaxpr.eqns):
    hits = [i for i, o in enumerate(eqn.outvars) if o in live]
    if not hits:
      continue
    needs = _eqn_needs(eqn, hits)
    needed.append((eqn, hits, needs))
    live.update(v for i, v in enumerate(eqn.invars)
                if not isinstance(v, Literal) and (needs is None or i in needs))
  needed.reverse()
  return needed, live


def needed_inputs(jaxpr, outs) -> set:
  """Positions of ``jaxpr``'s inputs that its outputs at ``outs`` depend on,
  seen through nested calls, ``jax.checkpoint``, ``custom_jvp`` /
  ``custom_vjp`` functions, ``scan``, ``while`` and ``cond``; any other
  equation's outputs depend on all its inputs."""
  _, live = _needed(jaxpr, outs)
  return {i for i, v in enumerate(jaxpr.invars) if v in live}


def eval_outputs(jaxpr, consts, args, outs) -> list:
  """Evaluates only what ``jaxpr``'s outputs at ``outs`` need. ``args`` holds
  values for the inputs they depend on (``None`` for the others). Calls are
  evaluated body first, for the needed outputs only; a loop or ``cond``
  gets zeros for the operands its needed outputs do not read."""
  needed, _ = _needed(jaxpr, outs)
  env = dict(zip(jaxpr.constvars, consts))
  env.update({v: a for v, a in zip(jaxpr.invars, args) if a is not None})
  read = lambda v: v.val if isinstance(v, Literal) else env[v]

  def operand(v, i, needs):
    if isinstance(v, Literal) or v in env or (needs is not None and i in needs):
      return read(v)
    return lax.full(v.aval.shape, 0, v.aval.dtype)  # not read by the needed outputs

  for eqn, hits, needs in needed:
    inner = _call_body(eqn)
    if inner is not None:
      ij, consts = inner
      vals = eval_outputs(ij, consts, [read(v) if i in needs else None
                                       for i, v in enumerate(eqn.invars)], hits)
      for i, x in zip(hits, vals):
        env[eqn.outvars[i]] = x
    else:
      vals = [operand(v, i, needs) for i, v in enumerate(eqn.invars)]
      for v, x in zip(eqn.outvars, _compat.bind_eqn(eqn, vals)):
        env[v] = x
  return [read(jaxpr.outvars[i]) for i in outs]


def weight_total(weights, data_axes):
  """``psum`` of the devices' weights, as float32 (integer weights are
  summed exactly first)."""
  w = jnp.asarray(weights)
  if not jnp.issubdtype(w.dtype, jnp.inexact):
    w = w.astype(jnp.int32)
  else:
    w = w.astype(jnp.float32)
  return lax.psum(w, tuple(data_axes)).astype(jnp.float32)
