"""The one place fsdp_jax touches JAX internals.

fsdp_jax supports jax 0.10 to 0.12 (``pyproject.toml`` pins
``jax>=0.10,<0.13``). Everything below is either not public in JAX or changed
shape between those releases: the rest of the package calls these helpers and
never imports ``jax._src``, reads a jaxpr equation's params by name, or looks
for ``remat_p`` itself. A new jax release is a change to this file only.

Each touchpoint says what it needs, from which jax version, and the public
alternative where one exists. What is public and stable (``jax.extend.core``'s
``Jaxpr``/``Var``/``Literal``/``DropVar``/``subjaxprs``, ``jax.core.eval_jaxpr``,
``jax.core.ShapedArray``, ``jax.extend.source_info_util``) is re-exported
from here too, so the modules that rewrite jaxprs have one import.

Implementation switches (see :func:`classic_tracing`): jax 0.10 to 0.12 carry
opt-in flags that trace ``jax.checkpoint`` and ``lax.scan`` to new
primitives: ``jax_remat3`` (named in the 0.11 CHANGELOG with
``jax.custom_remat``; present from 0.10), ``jax_scan3`` (present from 0.10),
and ``jax_remat_barrier_no_cotangents`` (from 0.11; changes the barriers of
``jax_remat3`` only). fsdp_jax traces its own step with the classic
implementations, whose jaxprs it rewrites; ``tests/test_jax_versions.py``
runs the rewrite's tests with each flag on.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, NamedTuple, Optional

import jax
from jax.extend import core as _ext_core
from jax.extend.core import primitives as _ext_primitives
from jax.extend import source_info_util  # public: jax.extend.source_info_util (0.10+)
from jax._src import source_info_util as _source_info_internal  # user_frames (0.10 to 0.12)

# -- primitive names, by what fsdp_jax does with them -------------------------
# Primitive names are not a stable API: each table lists the names jax 0.10
# to 0.12 use.

# Elementwise arithmetic shared by the step's remat (recomputed in backward)
# and the optimizer's shard evaluator (evaluated shard by shard). jax 0.12
# computes tanh's derivative with one_minus_square and erfc's with
# polynomial; log2 is 0.12's too.
_ELEMENTWISE_MATH = frozenset({
    "abs", "acos", "acosh", "add", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt",
    "ceil", "clamp", "convert_element_type", "copy", "copy_p", "cos", "cosh", "div", "eq",
    "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow",
    "is_finite", "le", "log", "log1p", "log2", "logistic", "lt", "max", "min", "mul", "ne",
    "neg", "nextafter", "not", "one_minus_square", "or", "polynomial", "pow",
    "reduce_precision", "rem", "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt",
    "square", "stop_gradient", "sub", "tan", "tanh", "xor",
})
# The optimizer's shard evaluator: elementwise on every operand, any dtype.
ELEMENTWISE_PRIMITIVES = _ELEMENTWISE_MATH | frozenset({
    "complex", "conj", "digamma", "igamma", "igammac", "imag", "lgamma", "population_count",
    "real", "shift_left", "shift_right_arithmetic", "shift_right_logical",
})
# The step's remat recomputes these in backward instead of saving their
# outputs: elementwise math, layout (broadcasts, reshapes, slices, ...), and
# device_put (CPU offload: a unit's device copy of its host shards is made
# again for the backward re-gather, not held from the forward pass).
RECOMPUTED_PRIMITIVES = _ELEMENTWISE_MATH | frozenset({
    "add_any", "bitcast_convert_type", "broadcast_in_dim", "concatenate", "device_put",
    "dynamic_slice", "expand_dims", "pad", "reshape", "rev", "slice", "split", "squeeze",
    "transpose",
})
# Primitives that only annotate their operands (sharding, scheduling).
PASSTHROUGH_PRIMITIVES = ("optimization_barrier", "reshard", "sharding_constraint", "mesh_cast")
# Reductions the shard evaluator runs over the shards, with their combining op.
REDUCTION_PRIMITIVES = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min",
                        "reduce_and": "and", "reduce_or": "or"}
# Matmuls: where a layer's compute starts (the loops' prefetch anchor).
MATMUL_PRIMITIVES = ("dot_general", "conv_general_dilated")
# init_fn analysis: PRNG key data a unit's init reads, and integer scalar
# arithmetic folded to a constant.
KEY_DATA_PRIMITIVES = frozenset({"random_fold_in"})
FOLDABLE_PRIMITIVES = frozenset({"add", "sub", "mul", "convert_element_type"})


# -- public, re-exported -----------------------------------------------------
# jax.extend.core (0.10+): the jaxpr data structures.
Jaxpr = _ext_core.Jaxpr
ClosedJaxpr = _ext_core.ClosedJaxpr
Literal = _ext_core.Literal
DropVar = _ext_core.DropVar
Primitive = _ext_core.Primitive
subjaxprs = _ext_core.subjaxprs
# jax.core (0.10+): still public.
ShapedArray = jax.core.ShapedArray
eval_jaxpr = jax.core.eval_jaxpr


def new_var(aval) -> Any:
  """A fresh jaxpr variable of type ``aval``.

  ``jax.extend.core.Var(aval)``: 0.10 also takes ``initial_qdd`` /
  ``final_qdd`` (dropped in 0.11); the one-argument form works on both."""
  return _ext_core.Var(aval)


# -- defining primitives -------------------------------------------------------
# jax.interpreters.ad / jax.interpreters.mlir (public modules, 0.10 to 0.12).

def register_lowering(prim, impl: Callable, *, multiple_results: bool) -> None:
  """Lowers ``prim`` as the JAX function ``impl`` (``mlir.lower_fun``)."""
  from jax.interpreters import mlir  # pylint: disable=import-outside-toplevel
  mlir.register_lowering(prim, mlir.lower_fun(impl, multiple_results=multiple_results))


def deflinear(prim, transpose: Callable) -> None:
  """Declares ``prim`` linear with ``transpose(cts, *args, **params)``
  (``ad.deflinear2``: its JVP applies ``prim`` to the tangents)."""
  from jax.interpreters import ad  # pylint: disable=import-outside-toplevel
  ad.deflinear2(prim, transpose)


def is_symbolic_zero(ct) -> bool:
  """Whether a cotangent passed to a transpose rule is ``ad.Zero``."""
  from jax.interpreters import ad  # pylint: disable=import-outside-toplevel
  return type(ct) is ad.Zero  # pylint: disable=unidiomatic-typecheck


# -- binding an equation again -----------------------------------------------

def bind_eqn(eqn, invals) -> list:
  """Binds ``eqn``'s primitive to ``invals`` with its params, inside the
  equation's context (``eqn.ctx.manager``: compute type, thread-local
  settings) and source location, as ``jax.core.eval_jaxpr`` does. Always
  returns a list of outputs.

  Needs ``Primitive.get_bind_params`` (turns stored params, e.g. a call's
  ``jaxpr``, back into bind arguments) and ``JaxprEqn.ctx.manager``: internal
  API, unchanged 0.10 to 0.12. No public alternative binds one equation
  (``jax.core.eval_jaxpr`` evaluates a whole jaxpr)."""
  params = eqn.primitive.get_bind_params(eqn.params)
  with user_context(eqn), eqn.ctx.manager:
    ans = eqn.primitive.bind(*invals, **params)
  return ans if eqn.primitive.multiple_results else [ans]


def user_context(eqn):
  """The source location and name scope of ``eqn`` (profiler labels and
  error messages keep them when the equation is re-traced).

  ``jax.extend.source_info_util`` (public, 0.10+) with the equation's
  ``source_info`` (``traceback``, ``name_stack``)."""
  name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
  return source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack)


def source_summary(eqn) -> str:
  """``file:line (function)`` of the user code an equation came from, for
  error messages and reports.

  ``source_info_util.summarize`` (internal, 0.10 to 0.12; the same module as
  :func:`user_context`)."""
  try:
    return source_info_util.summarize(eqn.source_info)
  except Exception:  # pylint: disable=broad-except  # a change of form: no location
    return "?"


def user_site(eqn, skip=("/flax/", "/optax/", "/equinox/", "/fsdp_jax/")) -> str:
  """``file:line (function)`` of the innermost frame an equation came from
  that is the user's own code: outside jax (``user_frames`` of the internal
  ``jax._src.source_info_util``, 0.10 to 0.12) and outside the libraries in
  ``skip``; else :func:`source_summary`."""
  try:
    for frame in _source_info_internal.user_frames(eqn.source_info.traceback):
      if not any(part in frame.file_name for part in skip):
        return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"
  except Exception:  # pylint: disable=broad-except  # a change of form: the summary
    pass
  return source_summary(eqn)


# Call-like equations whose body an interpreter can inline: nested jit, and
# custom derivative rules (their primal body; the rule only matters when
# differentiating, which fsdp_jax's optimizer evaluation never does).
INLINABLE = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                                "custom_vjp_call", "custom_vjp_call_jaxpr", "remat", "checkpoint",
                                "custom_lin")


def inlinable_body(eqn):
  """The primal body of a call-like equation (``params["jaxpr"]``,
  ``["call_jaxpr"]`` or ``["fun_jaxpr"]``: the name depends on the primitive
  and the jax version), as ``(open jaxpr, consts)``, or None."""
  if eqn.primitive.name not in INLINABLE:
    return None
  for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    j = eqn.params.get(name)
    if isinstance(j, (ClosedJaxpr, Jaxpr)):
      return split_closed(j)
  return None


def reduction_axes(eqn) -> tuple:
  """The reduced axes of a ``reduce_*`` equation (``params["axes"]``)."""
  return tuple(eqn.params.get("axes", ()))


def operated_axes(eqn) -> tuple:
  """The axes a reduction (``axes``), ``argmax``/``argmin`` (``axes``), a
  cumulative op (``axis``) or ``sort`` (``dimension``) works along."""
  p = eqn.params
  if "axes" in p:
    return tuple(p["axes"])
  return (p.get("axis", p.get("dimension")),)


def cumulative_params(eqn) -> tuple[int, bool]:
  """``(axis, reverse)`` of a ``cumsum`` / ``cummax`` / ... equation."""
  return eqn.params["axis"], bool(eqn.params.get("reverse", False))


def while_parts(eqn) -> tuple[int, int, Any, Any]:
  """``(cond_nconsts, body_nconsts, cond jaxpr, body jaxpr)`` of a ``while``
  equation (operands: the cond's consts, the body's consts, the carry), the
  jaxprs open (see :func:`split_closed`)."""
  p = eqn.params
  return (p["cond_nconsts"], p["body_nconsts"], split_closed(p["cond_jaxpr"])[0],
          split_closed(p["body_jaxpr"])[0])


def call_name(eqn) -> Optional[str]:
  """The name of the function a call equation (``jit``) calls
  (``params["name"]``), or None."""
  return eqn.params.get("name") if is_call(eqn) else None


def cond_branches(eqn) -> tuple:
  """The branches of a ``cond`` equation (``params["branches"]``: closed
  jaxprs on 0.10, jaxprs carrying ``.consts`` from 0.11; see
  :func:`split_closed`)."""
  return tuple(eqn.params["branches"])


# -- jax.checkpoint (remat) equations ------------------------------------------

def _remat_primitive():
  # ``remat_p`` (named "remat2" since jax 0.3.17, still in 0.12) lives in
  # jax._src.ad_checkpoint; no public name (jax.ad_checkpoint exports the
  # policies and checkpoint_name only).
  try:
    from jax._src.ad_checkpoint import remat_p  # pylint: disable=import-outside-toplevel
    return remat_p
  except ImportError:  # pragma: no cover - moved in a later jax
    return None


_REMAT_P = _remat_primitive()


def is_remat(eqn) -> bool:
  """Whether ``eqn`` is a ``jax.checkpoint`` (classic implementation)."""
  if _REMAT_P is not None:
    return eqn.primitive is _REMAT_P
  return eqn.primitive.name in ("remat2", "checkpoint")  # pragma: no cover


class RematParams(NamedTuple):
  """A ``jax.checkpoint`` equation's params (0.10 to 0.12: ``jaxpr`` (an open
  ``Jaxpr``), ``policy``, ``prevent_cse`` (bool or one per input),
  ``differentiated``)."""

  jaxpr: Any
  policy: Optional[Callable]
  prevent_cse: Any
  differentiated: bool


def param_items(eqn) -> tuple:
  """Every parameter of an equation as ``(name, value)`` pairs, read as
  opaque values (to key a cache on an equation, not to interpret it)."""
  return tuple(eqn.params.items())


def collective_layout(eqn) -> tuple[int, bool]:
  """An ``all_gather`` or ``reduce_scatter`` equation's ``(dimension,
  tiled)``: the dimension it gathers along or scatters (0 by default)."""
  key = "all_gather_dimension" if eqn.primitive.name == "all_gather" else "scatter_dimension"
  return int(eqn.params.get(key, 0)), bool(eqn.params.get("tiled", False))


def remat_params(eqn) -> RematParams:
  p = eqn.params
  return RematParams(p["jaxpr"], p.get("policy"), p.get("prevent_cse", True),
                     bool(p.get("differentiated", False)))


def replace_remat_body(eqn, body):
  """``eqn`` with its body jaxpr replaced."""
  return eqn.replace(params={**eqn.params, "jaxpr": body})


# -- lax.scan equations --------------------------------------------------------

class ScanParams(NamedTuple):
  """What fsdp_jax reads of a ``scan`` equation.

  ``body``/``body_consts``: the body as an open jaxpr and the constants it
  closes over. Inputs are ``consts, carry, xs`` (``num_consts``,
  ``num_carry``, rest); outputs ``carry, ys``.
  """

  num_consts: int
  num_carry: int
  length: int
  reverse: bool
  unroll: Any
  body: Any
  body_consts: tuple


def is_scan(eqn) -> bool:
  return eqn.primitive.name == "scan"


def scan_params(eqn) -> ScanParams:
  """Reads a ``scan`` equation on every supported jax.

  * jax 0.10: ``num_consts`` / ``num_carry`` ints, ``jaxpr`` a ``ClosedJaxpr``.
  * jax 0.11+: ``ft_in`` / ``ft_out`` flat trees (``ft_in.unpack()`` ->
    ``(consts, carry, xs)``, each ``len()``-able) replace the two counts, and
    ``jaxpr`` is an open ``Jaxpr`` whose constants travel with it (``.consts``).
    ``ft_out`` drops the ``ys`` forwarded straight from ``xs``: the equation's
    outputs are ``carry`` and the ``ys`` that remain, as the body's.
  """
  p = eqn.params
  if "num_consts" in p:
    num_consts, num_carry = p["num_consts"], p["num_carry"]
  else:
    consts, carry, _ = p["ft_in"].unpack()
    num_consts, num_carry = len(consts), len(carry)
  body, body_consts = split_closed(p["jaxpr"])
  return ScanParams(num_consts, num_carry, p["length"], p["reverse"], p.get("unroll", 1),
                    body, tuple(body_consts))


# -- calls (jit inside the traced function, closed_call) -----------------------

# Primitives that call a jaxpr once, as it is (jit, custom_jvp / custom_vjp
# functions, closed calls), across jax 0.10 to 0.12: a nested jax.jit is
# "pjit" up to 0.10 and "jit" from 0.11. A call that reads parameters is
# inlined (its gathers placed inside).
CALL_PRIMITIVES = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                             "custom_vjp_call", "custom_vjp_call_jaxpr"})


def is_call(eqn) -> bool:
  return eqn.primitive.name in CALL_PRIMITIVES


# Calls with their own differentiation rule (``jax.custom_jvp`` /
# ``jax.custom_vjp`` functions): inlining their body would differentiate the
# primal computation instead of the rule.
CUSTOM_RULE_PRIMITIVES = frozenset({"custom_jvp_call", "custom_vjp_call",
                                    "custom_vjp_call_jaxpr"})


def has_custom_rule(eqn) -> bool:
  return eqn.primitive.name in CUSTOM_RULE_PRIMITIVES


def custom_vjp_backward(eqn):
  """The Python function a ``jax.custom_vjp`` equation's backward rule is
  (``params["bwd"]``, a ``WrappedFun`` whose ``.f`` it is: jax 0.10-0.12),
  or None for any other equation."""
  if eqn.primitive.name not in ("custom_vjp_call", "custom_vjp_call_jaxpr"):
    return None
  return getattr(eqn.params.get("bwd"), "f", None)


def custom_vjp_static_args(eqn) -> Optional[tuple]:
  """The static (``nondiff_argnums``) arguments a ``jax.custom_vjp``
  equation's backward rule is called with (its ``params["bwd"]``
  ``WrappedFun``'s ``_prepend_static_args`` transformation, each wrapped
  in an ``Unhashable`` with ``.val``: jax 0.10-0.12), or None."""
  if custom_vjp_backward(eqn) is None:
    return None
  try:
    for gen, args in eqn.params["bwd"].transforms:
      if getattr(gen, "__name__", "") == "_prepend_static_args":
        return tuple(getattr(a, "val", a) for a in args[0])
  except Exception:  # pylint: disable=broad-except  # a change of form: unknown
    pass
  return None


def call_body(eqn):
  """The body of a call equation (``params["jaxpr"]``, or ``call_jaxpr`` for
  ``core_call``), as (open jaxpr, consts), or None."""
  inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
  if inner is None:
    return None
  return split_closed(inner)


def split_closed(jaxpr) -> tuple[Any, list]:
  """(open ``Jaxpr``, its constants) from a ``ClosedJaxpr`` (0.10) or a
  ``Jaxpr`` carrying its constants as ``.consts`` (0.11+ in ``jit`` and
  ``scan`` params)."""
  if isinstance(jaxpr, ClosedJaxpr):
    return jaxpr.jaxpr, list(jaxpr.consts)
  return jaxpr, list(getattr(jaxpr, "consts", ()) or ())


def nested_jaxprs(eqn):
  """The jaxprs held in ``eqn``'s params (scan and call bodies, cond
  branches...), as open jaxprs."""
  return params_jaxprs(eqn.params)


def params_jaxprs(params: dict) -> list:
  """The jaxprs among a primitive's params (as a remat policy receives them:
  a call's body, a custom_jvp's function...), as open jaxprs."""
  out = []
  for v in params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(x, (Jaxpr, ClosedJaxpr)):
        out.append(split_closed(x)[0])
  return out


# Primitives that call a jaxpr once, as it is (jit, custom_jvp / custom_vjp
# functions, closed calls), across jax 0.10 to 0.12.
CALL_PRIMITIVES = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                             "custom_vjp_call", "custom_vjp_call_jaxpr"})


# -- remat partial evaluation of fsdp_jax's own gather --------------------------
# jax._src.interpreters.partial_eval (0.10 to 0.12, same signatures): no public
# API lets a primitive decide how jax.checkpoint splits it (hpZ saves a
# secondary slice and recomputes from it). Classic remat only: fsdp_jax traces
# its step with the classic implementation (see classic_tracing).


def register_partial_eval_custom(prim, rule: Callable) -> None:
  """``rule(saveable, unks_in, inst_in, eqn) -> (known eqn, staged eqn,
  unks_out, inst_out, residual vars)`` for ``prim`` under ``jax.checkpoint``
  (``pe.partial_eval_jaxpr_custom_rules``)."""
  from jax._src.interpreters import partial_eval as pe  # pylint: disable=import-outside-toplevel
  pe.partial_eval_jaxpr_custom_rules[prim] = rule


def remat_decision(saveable: Callable, eqn) -> Any:
  """What a remat policy says of ``eqn``: ``"save"``, ``"recompute"``, or
  the policy's other answer (an offload) as it is (``pe.ensure_enum``,
  ``pe.SaveableType`` / ``pe.RecomputeType``)."""
  from jax._src.interpreters import partial_eval as pe  # pylint: disable=import-outside-toplevel
  policy = pe.ensure_enum(saveable(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params))
  if isinstance(policy, pe.SaveableType):
    return "save"
  if isinstance(policy, pe.RecomputeType):
    return "recompute"
  return policy


def dce(jaxpr, used_outputs: list) -> tuple[Any, list]:
  """``jaxpr`` without the equations ``used_outputs`` do not need:
  ``(jaxpr with only the used outputs, [whether each input is read])``
  (``pe.dce_jaxpr``, 0.10 to 0.12; effectful equations are kept)."""
  from jax._src.interpreters import partial_eval as pe  # pylint: disable=import-outside-toplevel
  return pe.dce_jaxpr(jaxpr, list(used_outputs))


def replace_eqn(eqn, *, params: Optional[dict] = None, merge_params: bool = True, **fields):
  """``eqn`` with ``fields`` (``outvars``, ``invars``, ``primitive``)
  replaced and ``params`` merged into (or, with ``merge_params=False``,
  replacing) its params (``JaxprEqn.replace``, 0.10 to 0.12)."""
  if params is not None:
    fields["params"] = {**eqn.params, **params} if merge_params else dict(params)
  return eqn.replace(**fields)


# -- axis names ----------------------------------------------------------------


# The params of a collective that name mesh axes: ``axes`` (psum, pmax,
# pmin), ``axis_name`` (ppermute, all_gather, axis_index, ...).
AXIS_PARAMS = ("axes", "axis_name")


# Collectives over named axes that act element by element across every
# other axis (tensor parallelism runs another axis's on its slices).
AXIS_COLLECTIVES = frozenset({"psum", "pmax", "pmin", "ppermute", "all_gather"})


def axis_params(eqn) -> dict:
  """``{param name: axis names}`` of ``eqn``'s params in :data:`AXIS_PARAMS`."""
  return {k: v for k, v in eqn.params.items() if k in AXIS_PARAMS}


def rebuild_params(eqn, axes: dict, jaxpr_fn: Callable):
  """``eqn`` with the axis params in ``axes`` replaced and every nested
  jaxpr (a param that is a ``Jaxpr`` / ``ClosedJaxpr``, or a tuple or list
  holding some) mapped by ``jaxpr_fn`` (``JaxprEqn.replace``, 0.10 to 0.12)."""

  def sub(value):
    if isinstance(value, (ClosedJaxpr, Jaxpr)):
      return jaxpr_fn(value)
    if isinstance(value, (tuple, list)) and any(isinstance(v, (ClosedJaxpr, Jaxpr))
                                                for v in value):
      return type(value)(sub(v) for v in value)
    return value

  return eqn.replace(params={k: axes[k] if k in axes else sub(v)
                             for k, v in eqn.params.items()})


def replace_jaxpr_eqns(jaxpr, eqns):
  """``jaxpr`` with other equations (``Jaxpr.replace``, 0.10 to 0.12)."""
  return jaxpr.replace(eqns=eqns)


def replace_closed_jaxpr(closed, jaxpr):
  """``closed`` around another open jaxpr (``ClosedJaxpr.replace``)."""
  return closed.replace(jaxpr=jaxpr)


def call_eqn(eqn, call):
  """A ``closed_call`` of the closed jaxpr ``call`` with ``eqn``'s outputs,
  source and context, taking no inputs (``jax.extend.core.new_jaxpr_eqn``
  and ``closed_call_p``; the equation's fields are not public)."""
  return _ext_core.new_jaxpr_eqn(
      [], eqn.outvars, _ext_primitives.closed_call_p, {"call_jaxpr": call},
      call.effects, eqn.source_info, eqn.ctx)


# -- implementation switches ---------------------------------------------------

# Config flags that trace jax.checkpoint / lax.scan to another implementation,
# with the version each appeared in (all default False up to 0.12):
#   jax_remat3   (0.10; 0.11 adds jax.custom_remat for it): jax.checkpoint
#                traces to a "call_hi_primitive" (RematTraced) and consults
#                its policy only for dots, convolutions, loops and names;
#   jax_scan3    (0.10): lax.scan traces to a "call_hi_primitive" (Scan3)
#                whose carry is a mutable Ref;
#   jax_remat_barrier_no_cotangents (0.11): changes jax_remat3's CSE barriers.
IMPLEMENTATION_FLAGS = ("jax_remat3", "jax_scan3", "jax_remat_barrier_no_cotangents")


def _config_state(name: str):
  # The context-manager form of a config flag is jax._src.config.<name
  # without "jax_">; jax.config.update only sets it globally.
  try:
    from jax._src import config as jax_config  # pylint: disable=import-outside-toplevel
  except ImportError:  # pragma: no cover
    return None
  state = getattr(jax_config, name[len("jax_"):], None)
  return state if callable(state) and hasattr(state, "value") else None


def has_flag(name: str) -> bool:
  """Whether this jax has the config flag ``name`` (``jax.config.values``)."""
  return name in jax.config.values


@contextlib.contextmanager
def classic_tracing():
  """Traces ``jax.checkpoint`` and ``lax.scan`` to the classic ``remat2`` /
  ``scan`` equations while it is active, whatever the user set globally.

  fsdp_jax's rewrite (:mod:`fsdp_jax._src.schedule`) reads those equations: it
  pushes a stacked unit's gather into the scan body, keeps a model's own
  checkpoint policies, and orders collectives across the step's remat. Its
  remat policy (:func:`fsdp_jax._src.collectives.remat_policy`) decides for every
  primitive, which ``jax_remat3`` does not ask it for (it always recomputes
  primitives without a remat rule, so SHARD_GRAD_OP would re-gather).
  Numbers are the same under either implementation; only the representation
  differs. When a jax release makes a new implementation the only one, this
  helper and :func:`scan_params` / :func:`remat_params` are what changes.

  On jax 0.10 ``jax.checkpoint`` picks its implementation when it wraps a
  function (0.12: when the wrapped function is called), so a model
  checkpoint wrapped before the step traces, under a global ``jax_remat3``,
  stays a ``call_hi_primitive``: the rewrite binds it as one equation (the
  numbers and the gathers per unit hold, tests/test_jax_versions.py).
  """
  with contextlib.ExitStack() as stack:
    for name in ("jax_remat3", "jax_scan3"):
      state = _config_state(name)
      if state is not None and state.value:
        stack.enter_context(state(False))
    yield


# -- compute_on ----------------------------------------------------------------

def _compute_on_api():
  from jax.experimental import compute_on as mod  # pylint: disable=import-outside-toplevel
  return mod


def on_host(fn: Callable) -> Callable:
  """``fn`` (a pure function of arrays) run on the host (``compute_type=
  "device_host"``), its outputs in host memory.

  ``jax.experimental.compute_on`` (public, experimental):
  * jax 0.10: ``compute_on("device_host")`` is a context manager/decorator;
    the function is wrapped in ``jax.jit`` so it becomes one host
    computation, and its outputs are placed by the caller.
  * jax 0.11+: ``compute_on(f, compute_type=..., out_memory_spaces=...)``
    (0.10's ``compute_on2``) needs the outputs' memory spaces: all host.
  """
  mod = _compute_on_api()
  params = inspect.signature(mod.compute_on).parameters
  if "out_memory_spaces" in params:
    return mod.compute_on(fn, compute_type="device_host",
                          out_memory_spaces=jax.memory.Space.Host)
  return mod.compute_on("device_host")(jax.jit(fn))


# -- backends and jax.distributed ---------------------------------------------

def under_trace() -> bool:
  """Whether a JAX trace (``jax.jit``, ``jax.eval_shape``, ...) is running
  (``jax._src.core.trace_state_clean``, 0.10 to 0.12: no public API)."""
  from jax._src import core  # pylint: disable=import-outside-toplevel
  return not core.trace_state_clean()


def backends_initialized() -> bool:
  """Whether JAX has started its backends in this process (after which
  ``jax.distributed.initialize`` and device flags are too late).

  ``jax._src.xla_bridge.backends_are_initialized`` (0.10 to 0.12). No public
  alternative: ``jax.devices()`` would start them."""
  try:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    return bool(xla_bridge.backends_are_initialized())
  except Exception:  # pylint: disable=broad-except  # pragma: no cover - moved
    return False


class DistributedState(NamedTuple):
  """What ``jax.distributed.initialize`` set up (None fields: not started)."""

  client: Any
  process_id: int
  num_processes: int
  coordinator_address: Optional[str]


def distributed_state() -> DistributedState:
  """``jax._src.distributed.global_state`` (0.10 to 0.12): the coordination
  service client (None without ``jax.distributed``), this process's id, the
  number of processes and the coordinator's address.

  Public alternatives cover part of it: ``jax.process_index()`` /
  ``jax.process_count()`` (after the backends start) and
  ``jax.distributed.is_initialized()``; the client (for the key-value store
  and barriers) and the coordinator address have none."""
  from jax._src import distributed as jax_distributed  # pylint: disable=import-outside-toplevel
  s = jax_distributed.global_state
  return DistributedState(getattr(s, "client", None), getattr(s, "process_id", 0),
                          getattr(s, "num_processes", 1),
                          getattr(s, "coordinator_address", None))


# -- residuals (benchmarks) ----------------------------------------------------

def saved_residuals(fn, *args):
  """``[(aval, source description)]`` of what ``jax.grad(fn)`` saves from its
  forward pass. ``jax._src.ad_checkpoint.saved_residuals`` (0.10 to 0.12);
  the public ``jax.ad_checkpoint.print_saved_residuals`` only prints them."""
  from jax._src.ad_checkpoint import saved_residuals as impl  # pylint: disable=import-outside-toplevel
  return impl(fn, *args)


# -- dot_general and convert_element_type equations ----------------------------

def dot_dimension_numbers(eqn) -> tuple:
  """``((lhs contracting, rhs contracting), (lhs batch, rhs batch))`` of a
  ``dot_general`` equation (``params["dimension_numbers"]``, 0.10 to 0.12),
  as tuples of ints."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  return (tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))


def dot_options(eqn) -> dict:
  """The ``precision`` and ``preferred_element_type`` of a ``dot_general``
  equation, as ``lax.dot_general`` keywords."""
  return {"precision": eqn.params.get("precision"),
          "preferred_element_type": eqn.params.get("preferred_element_type")}


def converted_dtype(eqn):
  """The target dtype of a ``convert_element_type`` equation
  (``params["new_dtype"]``)."""
  return eqn.params["new_dtype"]


def broadcast_dimensions(eqn) -> tuple:
  """The ``broadcast_dimensions`` of a ``broadcast_in_dim`` equation."""
  return tuple(eqn.params["broadcast_dimensions"])


def slice_params(eqn) -> tuple:
  """``(start_indices, limit_indices, strides or None)`` of a ``slice``
  equation."""
  p = eqn.params
  return tuple(p["start_indices"]), tuple(p["limit_indices"]), (
      None if p.get("strides") is None else tuple(p["strides"]))


def gather_params(eqn) -> tuple:
  """``(dimension_numbers, slice_sizes, mode name, fill_value)`` of a
  ``gather`` equation; the mode's name is ``"clip"``, ``"fill"``,
  ``"promise_in_bounds"`` or another (``"one_hot"``)."""
  p = eqn.params
  mode = str(p.get("mode", "")).rsplit(".", 1)[-1].lower()
  mode = {"fill_or_drop": "fill"}.get(mode, mode)
  return p["dimension_numbers"], tuple(p["slice_sizes"]), mode, p.get("fill_value")


def layout_params(eqn) -> dict:
  """The dimension parameters of ``concatenate`` (``dimension``), ``rev``
  (``dimensions``), ``pad`` (``padding_config``), ``split`` (``sizes``,
  ``axis``), ``stack`` (``axis``; a primitive from jax 0.10),
  ``dynamic_slice`` (``slice_sizes``) and ``bitcast_convert_type``
  (``new_dtype``) equations."""
  return {k: eqn.params[k] for k in ("dimension", "dimensions", "padding_config", "sizes",
                                     "axis", "slice_sizes", "new_dtype")
          if k in eqn.params}


def bind_with(eqn, invals, **params) -> list:
  """:func:`bind_eqn` with some of ``eqn``'s params replaced (a gather's or
  dynamic slice's ``slice_sizes`` on a device's slice)."""
  return bind_eqn(replace_eqn(eqn, params=params), invals)


def transpose_permutation(eqn) -> tuple:
  """The permutation of a ``transpose`` equation (``params["permutation"]``)."""
  return tuple(eqn.params["permutation"])
