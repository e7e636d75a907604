"""What models bring besides their parameters, framework by framework.

* Flax linen: ``model.init`` returns ``{"params": ..., "batch_stats": ...,
  ...}``; the collections other than ``"params"`` are model state.
* Flax NNX: ``nnx.state(model)`` holds ``nnx.Param`` s and other variables
  (``nnx.BatchStat``, ``nnx.RngKey`` / ``nnx.RngCount``, ...); those others
  are model state.
* equinox: a model is a pytree of ``eqx.Module`` s; :func:`equinox_classes`
  maps subtree paths to their module classes for ``ModuleWrapPolicy``.
* Flax linen BatchNorm over each device's own rows (``axis_name=None``):
  :func:`watch_batch_norm` finds them while the loss is traced.
* Stacked layers: :func:`stacked_hints` finds subtrees that look like a
  stack of layers (every leaf with the same leading axis) but are not
  declared with ``FSDPConfig(stacked_layers=...)``.

Every framework is imported only when the object at hand comes from it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping
from typing import Any, Optional

import jax

from fsdp_jax._src import naming
from fsdp_jax._src.loss import cast_floats

PARAMS = "params"


def _nnx():
  # An NNX object exists only once flax.nnx is imported; importing it for a
  # linen model would cost the user's process the import (about 0.4 s).
  if "flax.nnx" not in sys.modules:
    return None
  try:
    from flax import nnx  # pylint: disable=import-outside-toplevel
  except ImportError:  # pragma: no cover
    return None
  return nnx


def split_model_state(tree) -> tuple[Any, Any, Optional[str]]:
  """Splits what a model's init returns into ``(params, model_state, what)``.

  * an NNX ``State`` holding variables other than ``nnx.Param``: the
    ``nnx.Param`` s, and the rest (``nnx.split_state(state, nnx.Param, ...)``);
  * a mapping with a ``"params"`` key and other keys (Flax linen variables):
    ``{"params": tree["params"]}`` and the other collections;
  * anything else: ``(tree, None, None)``.

  ``what`` describes the model state for messages and the plan.
  """
  nnx = _nnx()
  if nnx is not None and isinstance(tree, nnx.State):
    variables = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    other = sorted({type(v).__name__ for v in variables
                    if isinstance(v, nnx.Variable) and not isinstance(v, nnx.Param)})
    if not other:
      return tree, None, None
    params, rest = nnx.split_state(tree, nnx.Param, ...)
    return params, rest, f"NNX variables other than nnx.Param ({', '.join(other)})"
  if isinstance(tree, Mapping) and PARAMS in tree and len(tree) > 1:
    rest = {k: v for k, v in tree.items() if k != PARAMS}
    return ({PARAMS: tree[PARAMS]}, rest,
            f"Flax collections other than 'params' ({', '.join(map(repr, rest))})")
  return tree, None, None


# --------------------------------------------------------------------------
# equinox


def equinox_classes(module) -> dict:
  """``{subtree path: equinox module class}`` for every ``eqx.Module`` in
  ``module``'s tree (the root at ``()``), paths spelled as the parameter
  tree's dotted names (``("layers", "0")``). The model is walked, never
  called."""
  eqx = naming.equinox()
  out = {(): type(module)}

  def walk(m, prefix):
    is_sub = lambda x: x is not m and isinstance(x, eqx.Module)
    for path, x in jax.tree_util.tree_flatten_with_path(m, is_leaf=is_sub)[0]:
      if isinstance(x, eqx.Module):
        p = prefix + tuple(naming.key_name(k) for k in path)
        out.setdefault(p, type(x))
        walk(x, p)

  walk(module, ())
  return out


# --------------------------------------------------------------------------
# Flax linen BatchNorm over each device's rows


@contextlib.contextmanager
def watch_batch_norm(found: list):
  """While active, appends the path of every Flax linen ``nn.BatchNorm``
  that normalises with batch statistics and ``axis_name=None`` (each
  device's own rows) to ``found``. A no-op unless flax.linen is imported."""
  if "flax.linen" not in sys.modules:
    yield
    return
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  def interceptor(next_fun, args, kwargs, context):
    mod = context.module
    if context.method_name == "__call__" and isinstance(mod, nn.BatchNorm):
      call = kwargs.get("use_running_average", args[1] if len(args) > 1 else None)
      running = mod.use_running_average if mod.use_running_average is not None else call
      if running is not None and not running and mod.axis_name is None:
        found.append(".".join(str(p) for p in mod.path) or type(mod).__name__)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    yield


def is_missing_rng_error(e: BaseException) -> bool:
  """Whether ``e`` is Flax's error for a module that needs a PRNG key it was
  not given (``flax.errors.InvalidRngError``: dropout without ``rngs=``)."""
  errors = sys.modules.get("flax.errors")
  return errors is not None and isinstance(e, getattr(errors, "InvalidRngError", ()))


def per_device_batch_norm_message(paths, plan) -> str:
  axes = plan.axes.data_axes
  return (
      f"fsdp_jax: nn.BatchNorm at {', '.join(sorted(set(paths)))} normalises with "
      "axis_name=None: each device uses the statistics of its own rows (1/"
      f"{plan.axes.world_size} of the batch; PyTorch's BatchNorm without "
      "SyncBatchNorm), which differs from one jax.jit over the global batch. For "
      "global-batch statistics give the BatchNorm an axis name and bind it: "
      "nn.BatchNorm(axis_name='batch') with FSDPConfig(data_axis_name='batch') "
      f"(it then reduces over the mesh axes {axes}). See docs/models.md.")


# --------------------------------------------------------------------------
# Stacked layers


def stacked_hints(paths, shapes, skip) -> tuple[tuple[str, int], ...]:
  """Subtrees that look like a stack of layers: the topmost subtrees (not
  the root) of at least two leaves, none in ``skip`` (leaf indices of
  declared stacked units), in which every leaf has at least two dimensions
  and the same leading dimension ``L >= 2``, and the leaves do not all have
  the same rank (a stacked layer's kernels and biases differ by one, while
  e.g. the kernels of two convolutions share their leading kernel height).
  Returns ``((dotted name, L), ...)``."""
  under: dict = {}
  for i, p in enumerate(paths):
    for k in range(1, len(p)):
      under.setdefault(tuple(p[:k]), []).append(i)
  out = []
  chosen: list = []
  for prefix in sorted(under, key=len):
    if any(prefix[:len(c)] == c for c in chosen):
      continue
    ids = under[prefix]
    if len(ids) < 2 or any(i in skip for i in ids):
      continue
    leads = {shapes[i][0] if len(shapes[i]) >= 2 else None for i in ids}
    ranks = {len(shapes[i]) for i in ids}
    if len(leads) == 1 and None not in leads and min(leads) >= 2 and len(ranks) > 1:
      chosen.append(prefix)
      out.append((".".join(prefix), int(leads.pop())))
  return tuple(out)


def stacked_hint_message(name: str, layers: int) -> str:
  return (
      f"fsdp_jax: the parameters under {name!r} look like {layers} stacked layers "
      f"(every leaf has a leading axis of {layers}), but {name!r} is not declared "
      "stacked, so its unit is gathered whole, all layers at once. If a scan runs "
      f"over them (nn.scan, lax.scan, nnx.scan), declare the stack: "
      f"FSDPConfig(stacked_layers=({name!r},)) makes it a unit gathered one layer "
      "per iteration. print(state.plan) marks it.")


def scan_over_unit_message(names, layers: int, unit: str) -> str:
  prefix = _common_prefix(names)
  return (
      f"fsdp_jax: loss_fn scans over the parameters {', '.join(sorted(names)[:4])}"
      f"{' ...' if len(names) > 4 else ''} ({layers} layers), which are not declared "
      f"stacked: unit {unit!r} holding them is gathered whole before the loop (all "
      f"{layers} layers at once). Fix: FSDPConfig(stacked_layers=({prefix!r},)) "
      "gathers one layer per iteration.")


def _common_prefix(names) -> str:
  parts = [n.split(".") for n in names]
  out = []
  for seg in zip(*parts):
    if len(set(seg)) != 1:
      break
    out.append(seg[0])
  if len(parts) == 1 and out:
    out = out[:-1]  # one leaf: its parent subtree
  return ".".join(out) or "<the scanned subtree>"


def cast_unit_inputs(dtypes: dict):
  """PyTorch's ``cast_forward_inputs`` for non-root units, while ``loss_fn``
  is traced: a Flax linen module that is a unit named in ``dtypes`` (``{unit
  name: param_dtype}``) gets its floating arguments cast to that dtype.
  (Other frameworks need no cast: JAX promotes mixed dtypes where PyTorch
  would raise.)"""
  if not dtypes:
    return contextlib.nullcontext()
  import flax.linen as nn  # pylint: disable=import-outside-toplevel  (optional dependency)

  def interceptor(next_fun, args, kwargs, context):
    if context.method_name == "__call__":
      path = ".".join(str(p) for p in context.module.path)
      dtype = dtypes.get(path, dtypes.get(f"params.{path}"))
      if dtype is not None:
        args, kwargs = cast_floats((args, kwargs), dtype)
    return next_fun(*args, **kwargs)

  return nn.intercept_methods(interceptor)


# --------------------------------------------------------------------------
# Module classes, for ModuleWrapPolicy


def module_classes(model_or_fn, *args, **kwargs) -> dict:
  """Maps subtree paths to the module classes that own them.

  * a ``flax.nnx.Module``: read from the object graph;
  * an ``equinox.Module``: read from the module tree (walked, not called),
    paths as in ``eqx.partition(model, eqx.is_inexact_array)`` (``("layers",
    "0")`` for ``model.layers[0]``);
  * a function (e.g. ``model.init`` of a Flax linen model) and its
    arguments: the function runs abstractly (``jax.eval_shape``) while Flax
    module calls are intercepted; paths are prefixed with ``"params"``.

  The result is what :class:`~fsdp_jax.ModuleWrapPolicy` matches classes
  against; :func:`init_train_state` collects it itself from ``init_fn``.

  Example:
    >>> import flax.linen as nn, jax, jax.numpy as jnp, fsdp_jax
    >>> model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
    >>> classes = fsdp_jax.module_classes(model.init, jax.random.key(0),
    ...                                   jnp.ones((1, 3)))
    >>> classes[("params", "layers_0")].__name__
    'Dense'
    >>> import equinox as eqx
    >>> mlp = eqx.nn.MLP(3, 2, width_size=8, depth=2, key=jax.random.key(0))
    >>> fsdp_jax.module_classes(mlp)[("layers", "1")].__name__
    'Linear'
  """
  try:
    from flax import nnx  # pylint: disable=import-outside-toplevel  (optional)
  except ImportError:  # pragma: no cover
    nnx = None
  if nnx is not None and isinstance(model_or_fn, nnx.Module):
    out = {}
    for path, value in nnx.iter_graph(model_or_fn):
      if isinstance(value, nnx.Module):
        out[tuple(str(p) for p in path)] = type(value)
    return out
  if naming.is_equinox_module(model_or_fn):
    if args or kwargs:
      raise TypeError("module_classes(eqx_model) reads the module tree; it takes no "
                      "further arguments.")
    return equinox_classes(model_or_fn)
  out: dict = {}
  _, captured, _ = trace_capturing(model_or_fn, *args, **kwargs)
  out.update(captured)
  return out


def trace_capturing(fn, *args, **kwargs):
  """``(shapes, linen modules called inside, closed jaxpr)`` of ``fn``: one
  trace, whose jaxpr ``init_program`` reuses."""
  captured: dict = {}
  # A fresh function object each time: JAX caches traces per function, and a
  # cached trace would skip the interceptor.
  trace = lambda: jax.make_jaxpr(lambda *a, **k: fn(*a, **k), return_shape=True)(
      *args, **kwargs)
  try:
    import flax.linen as nn  # pylint: disable=import-outside-toplevel  (optional)
  except ImportError:  # pragma: no cover
    closed, shapes = trace()
    return shapes, captured, closed

  def interceptor(next_fun, a, kw, context):
    mod = context.module
    path = tuple(str(p) for p in mod.path)
    for collection in ("params",):
      captured.setdefault((collection,) + path, type(mod))
    return next_fun(*a, **kw)

  with nn.intercept_methods(interceptor):
    closed, shapes = trace()
  return shapes, captured, closed
