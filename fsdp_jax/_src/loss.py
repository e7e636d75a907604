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

The helpers at the end read the traced loss: which inputs an output depends
on, and the evaluation of selected outputs only (the weight of a
:class:`WeightedLoss`, computed before the gradient).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from fsdp_jax._src import _compat
from fsdp_jax._src._compat import Literal

__all__ = ["WeightedLoss"]


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
  either. Both are checked when the step is traced.

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


def device_index(data_axes) -> jax.Array:
  """This device's index over the data-parallel mesh axes (inside
  ``jax.shard_map``): the row block of the global batch it holds."""
  return lax.axis_index(tuple(data_axes))


def device_key(key, step, data_axes):
  """The key ``loss_fn(..., rng=...)`` gets: ``fold_in(fold_in(key, step),
  device_index)`` (inside ``jax.shard_map``)."""
  return jax.random.fold_in(jax.random.fold_in(key, step), device_index(data_axes))


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
  return _compat.rename_axis_names(closed, mapping)


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
  aliases = _aliases(plan)
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


def _aliases(plan) -> tuple[str, ...]:
  from fsdp_jax._src.config import data_axis_names  # pylint: disable=import-outside-toplevel
  return data_axis_names(plan.config)


def axis_mapping(plan) -> dict:
  """``{model axis name: data-parallel mesh axes}`` for the plan's config."""
  return {n: tuple(plan.axes.data_axes) for n in _aliases(plan)}


# --------------------------------------------------------------------------
# Reading the traced loss

def _call_body(eqn):
  """The (open jaxpr, consts) of a call equation (``jit``), which is followed
  output by output; other equations count as depending on all their
  inputs."""
  return _compat.call_body(eqn) if _compat.is_call(eqn) else None


def _needed(jaxpr, outs) -> tuple[list, set]:
  """``(needed equations as (eqn, needed output positions), live vars)``
  for the outputs at positions ``outs``."""
  live = {jaxpr.outvars[i] for i in outs if not isinstance(jaxpr.outvars[i], Literal)}
  needed = []
  for eqn in reversed(jaxpr.eqns):
    hits = [i for i, o in enumerate(eqn.outvars) if o in live]
    if not hits:
      continue
    needed.append((eqn, hits))
    inner = _call_body(eqn)
    if inner is not None:
      for i in needed_inputs(inner[0], hits):
        if not isinstance(eqn.invars[i], Literal):
          live.add(eqn.invars[i])
    else:
      live.update(v for v in eqn.invars if not isinstance(v, Literal))
  needed.reverse()
  return needed, live


def needed_inputs(jaxpr, outs) -> set:
  """Positions of ``jaxpr``'s inputs that its outputs at ``outs`` depend on
  (through ``jit`` calls output by output; any other equation's outputs
  depend on all its inputs)."""
  _, live = _needed(jaxpr, outs)
  return {i for i, v in enumerate(jaxpr.invars) if v in live}


def eval_outputs(jaxpr, consts, args, outs) -> list:
  """Evaluates only what ``jaxpr``'s outputs at ``outs`` need. ``args`` holds
  values for the inputs they depend on (``None`` for the others)."""
  needed, _ = _needed(jaxpr, outs)
  env = dict(zip(jaxpr.constvars, consts))
  env.update({v: a for v, a in zip(jaxpr.invars, args) if a is not None})
  read = lambda v: v.val if isinstance(v, Literal) else env[v]
  for eqn, hits in needed:
    inner = _call_body(eqn)
    if inner is not None:
      ij, consts = inner
      use = needed_inputs(ij, hits)
      vals = eval_outputs(ij, consts,
                          [read(v) if i in use else None for i, v in enumerate(eqn.invars)],
                          hits)
      for i, x in zip(hits, vals):
        env[eqn.outvars[i]] = x
    else:
      for v, x in zip(eqn.outvars, _compat.bind_eqn(eqn, [read(v) for v in eqn.invars])):
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
