"""Where gathers go: ``loss_fn`` is traced once to a jaxpr and re-evaluated
with each unit's all-gather inserted right before the first equation that
reads one of its parameters.

* Calls into nested ``jit``/``closed_call`` jaxprs are inlined when they read
  parameters, so a model wrapped in an inner ``jax.jit`` still gathers unit by
  unit.
* A ``lax.scan`` whose scanned-over operands are leaves of a stacked unit is
  rebuilt so that each iteration gathers one layer from the layer's shard,
  instead of gathering the whole stack before the loop: a ``custom_vjp``
  pair of loops, each iteration gathering the next layer while it computes
  its own (:func:`_pipelined_scan`).
* Liveness does the rest: a gathered value dies after its last use. For
  FULL_SHARD the step wraps the evaluation in ``jax.checkpoint`` with
  :func:`fsdp_jax._src.collectives.remat_policy`, so the backward re-gathers.
* The model's own ``jax.checkpoint`` / ``nn.remat`` calls keep their policy.
  JAX partially evaluates a ``jax.checkpoint`` nested in another one with the
  *outer* policy (jax-ml/jax#18817): under the step's remat, which saves
  every costly result but the gathered parameters, and inside the rebuilt
  scan body, a user's checkpoint would save those intermediates. Each one is re-bound
  as a ``custom_vjp`` whose forward is ``jax.vjp`` of the user's checkpoint:
  its residuals are its inputs and what the user's policy saves, and its
  backward recomputes the rest.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Optional

import jax
import numpy as np
from jax import lax

from fsdp_jax._src import _compat
from fsdp_jax._src import collectives
from fsdp_jax._src._compat import DropVar, Jaxpr, Literal

# Binds an equation again, keeping its name scope and source location
# (profiler labels survive the re-evaluation), as ``jax.core.eval_jaxpr``.
_bind = _compat.bind_eqn


class Gatherer:
  """Gathers units on demand and caches the full leaves for the trace.

  ``gather_unit(unit_index)`` -> ``{leaf_id: full value}`` for a whole unit;
  ``gather_layer(unit_index, layer_locals)`` -> per-layer full leaves inside a
  scan body, given that layer's local storage slices.
  """

  def __init__(self, gather_unit: Callable, gather_layer: Callable,
               leaf_unit: dict, stacked_units: set, unit_layers: dict,
               unit_storage: Callable, direct: Optional[dict] = None,
               save_mixed: bool = False, on_unstacked_scan: Optional[Callable] = None,
               loop: Optional["LoopPrefetch"] = None):
    self._gather_unit = gather_unit
    self._gather_layer = gather_layer
    self.leaf_unit = leaf_unit
    self.stacked_units = stacked_units
    self.unit_layers = unit_layers
    self.unit_storage = unit_storage
    self.cache: dict[int, dict] = {}
    self.direct = direct or {}  # leaves not managed by any unit
    # Under collectives.remat_policy: save what mixes parameters with
    # activations (see _saved_if_mixed).
    self.save_mixed = save_mixed
    # Called as on_unstacked_scan(leaf_ids, length) when a scan runs over
    # parameters of a unit that is not stacked (the whole stack is gathered).
    self.on_unstacked_scan = on_unstacked_scan
    # How scans over stacked units carry the next layer's gather (None: each
    # iteration gathers its own layer).
    self.loop = loop

  def leaf(self, leaf_id: int):
    if leaf_id in self.direct:
      return self.direct[leaf_id]
    u = self.leaf_unit[leaf_id]
    if u not in self.cache:
      self.cache[u] = self._gather_unit(u)
    return self.cache[u][leaf_id]


# What a value is made of, for the step's remat (see :func:`_saved_if_mixed`):
_CONST, _PARAM, _ACT = 0, 1, 2


def _class_of(classes) -> int:
  kinds = set(classes)
  if _ACT in kinds:
    return _ACT
  return _PARAM if _PARAM in kinds else _CONST


def _saved_if_mixed(eqn, in_classes, outs, enabled: bool = True):
  """Saves the outputs of a cheap (recomputed) equation that combines
  parameters with activations: they go through an ``optimization_barrier``,
  whose outputs the policy saves and which XLA cannot fuse into a late
  consumer (with ``checkpoint_name`` XLA recomputed the value right before
  the backward pass, keeping the parameter alive until then).

  The step's remat recomputes elementwise and layout primitives
  (:data:`fsdp_jax._src.collectives.RECOMPUTED`). Recomputing ``h + bias`` or
  ``x * scale`` would need the parameter in the backward pass wherever the
  value is read, e.g. a block's output read by the next block's backward,
  and so keep other units gathered. Saving these values (one activation
  each) keeps every recomputation local to a unit: what is recomputed reads
  only saved activations, or only parameters.
  """
  if (enabled and eqn.primitive.name in collectives.RECOMPUTED and _PARAM in in_classes
      and _ACT in in_classes):
    return list(lax.optimization_barrier(list(outs))), _ACT
  return outs, _class_of(in_classes)


def eval_with_gathers(jaxpr: Jaxpr, consts, args, lazy: dict,
                      g: Gatherer, param_invars=()) -> list:
  """Evaluates ``jaxpr`` where ``lazy`` maps invars to parameter leaf ids.

  ``args`` holds values for the non-lazy invars (``None`` for lazy ones).
  ``param_invars``: invars (besides ``lazy``) that hold parameters or values
  made only from parameters.
  """
  env: dict = {}
  lazy = dict(lazy)
  cls: dict = {}

  def read(v):
    if isinstance(v, Literal):
      return v.val
    if v in lazy:
      return g.leaf(lazy[v])
    return env[v]

  def klass(v):
    if isinstance(v, Literal):
      return _CONST
    if v in lazy:
      return _PARAM
    return cls.get(v, _ACT)

  def write(v, val, c=_ACT):
    env[v] = val
    cls[v] = c

  for v, c in zip(jaxpr.constvars, consts):
    write(v, c, _CONST)
  param_invars = set(param_invars)
  for v, a in zip(jaxpr.invars, args):
    if v not in lazy:
      write(v, a, _PARAM if v in param_invars else _ACT)

  for eqn in jaxpr.eqns:
    reads_params = any((not isinstance(v, Literal)) and v in lazy for v in eqn.invars)
    in_classes = [klass(v) for v in eqn.invars]
    if reads_params and _compat.is_scan(eqn) and _scan_pushdown(eqn, lazy, g, read, write, klass):
      continue
    if _compat.is_remat(eqn):
      for v, o in zip(eqn.outvars, _user_checkpoint(eqn, [read(v) for v in eqn.invars])):
        write(v, o)
      continue
    if _compat.is_scan(eqn) and has_user_checkpoint(_compat.scan_params(eqn).body):
      _scan_rebuild(eqn, read, write, g, klass)
      continue
    inner = _compat.call_body(eqn) if _compat.is_call(eqn) else None
    reads_param_values = _PARAM in in_classes
    if inner is not None and (reads_params or reads_param_values
                              or has_user_checkpoint(inner[0])):
      inner_jaxpr, inner_consts = inner
      inner_lazy = {iv: lazy[ov] for iv, ov in zip(inner_jaxpr.invars, eqn.invars)
                    if not isinstance(ov, Literal) and ov in lazy}
      inner_args = [None if (not isinstance(ov, Literal) and ov in lazy) else read(ov)
                    for ov in eqn.invars]
      inner_params = [iv for iv, c in zip(inner_jaxpr.invars, in_classes) if c == _PARAM]
      outs = eval_with_gathers(inner_jaxpr, inner_consts, inner_args, inner_lazy, g,
                               inner_params)
      for v, o in zip(eqn.outvars, outs):
        write(v, o)
      continue
    outs, c = _saved_if_mixed(eqn, in_classes, _bind(eqn, [read(v) for v in eqn.invars]),
                              g.save_mixed)
    for v, a in zip(eqn.outvars, outs):
      write(v, a, c)
  return [read(v) for v in jaxpr.outvars]


def _scan_pushdown(eqn, lazy, g: Gatherer, read, write, klass) -> bool:
  """Rebuilds a scan over a stacked unit so each iteration gathers one layer."""
  p = _compat.scan_params(eqn)
  num_consts, num_carry = p.num_consts, p.num_carry
  length = p.length
  invars = list(eqn.invars)
  xs_vars = invars[num_consts + num_carry:]
  pushed: dict[int, tuple[int, int]] = {}  # xs position -> (unit, leaf_id)
  for k, v in enumerate(xs_vars):
    if isinstance(v, Literal) or v not in lazy:
      continue
    leaf_id = lazy[v]
    u = g.leaf_unit.get(leaf_id)
    if u is not None and u in g.stacked_units and u not in g.cache and g.unit_layers[u] == length:
      pushed[k] = (u, leaf_id)
  unstacked = [lazy[v] for v in xs_vars if not isinstance(v, Literal) and v in lazy
               and g.leaf_unit.get(lazy[v]) is not None
               and g.leaf_unit[lazy[v]] not in g.stacked_units]
  if unstacked and g.on_unstacked_scan is not None:
    g.on_unstacked_scan(unstacked, length)
  if not pushed:
    return False
  units = sorted({u for u, _ in pushed.values()})
  body_jaxpr, body_consts = p.body, p.body_consts
  # Parameters in the body: the gathered layer, and consts made of parameters.
  body_params = [bv for k, bv in enumerate(body_jaxpr.invars[num_consts + num_carry:])
                 if k in pushed]
  body_params += [bv for bv, ov in zip(body_jaxpr.invars[:num_consts], invars[:num_consts])
                  if klass(ov) == _PARAM]
  if g.loop is not None and all(u in g.loop.units for u in units):
    _pipelined_scan(eqn, pushed, units, g, read, write, body_params)
    return True
  consts = [read(v) for v in invars[:num_consts]]
  init = [read(v) for v in invars[num_consts:num_consts + num_carry]]
  xs_plain = [None if k in pushed else read(v) for k, v in enumerate(xs_vars)]
  unit_locals = {u: g.unit_storage(u) for u in units}

  def body(carry, xs):
    plain, per_unit = xs
    gathered = {u: g._gather_layer(u, per_unit[u]) for u in units}
    xs_full = [gathered[pushed[k][0]][pushed[k][1]] if k in pushed else plain[k]
               for k in range(len(xs_vars))]
    outs = eval_with_gathers(body_jaxpr, body_consts, [*consts, *carry, *xs_full], {}, g,
                             body_params)
    return outs[:num_carry], outs[num_carry:]

  # The rebuilt body is rematerialised with the resharding policy: without it
  # the backward loop would read every layer's gathered parameters saved by
  # the forward loop (the whole stack, gathered). With it, the backward loop
  # re-gathers one layer per iteration. SHARD_GRAD_OP is unchanged (the
  # policy saves its gathers).
  body = jax.checkpoint(body, policy=collectives.save_all_but_gathers, prevent_cse=False)
  carry_out, ys = lax.scan(body, init, (xs_plain, unit_locals), length=length,
                           reverse=p.reverse, unroll=p.unroll)
  for v, o in zip(eqn.outvars, [*carry_out, *ys]):
    write(v, o)
  return True


# --------------------------------------------------------------------------
# Scans over stacked layers: the next layer's gather rides in the carry


@dataclasses.dataclass(frozen=True)
class LoopPrefetch:
  """How a ``scan`` over stacked units overlaps gathers with compute.

  Iteration ``i`` of the forward loop gathers layer ``i+1`` (in loop order)
  while it computes layer ``i`` and hands it on in the carry; the backward
  loop does the same for layer ``i-1`` while it differentiates layer ``i``,
  so each loop holds at most two gathered layers. When the next gather is
  issued follows PyTorch's settings, as for units outside a loop:
  ``forward_prefetch`` (at the start of the iteration, else after the
  layer's first matmul) and ``backward_prefetch`` (``"BACKWARD_PRE"``: before
  the layer's gradient computation; ``"BACKWARD_POST"``: after it, before its
  reduce-scatter; ``None``: after its reduce-scatter).

  ``units``: the stacked units whose loops do this; ``reshard``: those freed
  after forward (the backward loop re-gathers them; the others keep each
  layer's gathered parameters for backward, as SHARD_GRAD_OP does).
  """

  forward_prefetch: bool
  backward_prefetch: Optional[str]
  units: frozenset
  reshard: frozenset
  axis_env: tuple = ()


_MATMULS = ("dot_general", "conv_general_dilated")
# The name scope of a loop's conditional gather of the next layer: it runs in
# every iteration but the last (benchmarks/hlo_stats.py counts it so).
NEXT_LAYER_SCOPE = "fsdp_next_layer"


def _has_matmul(eqn) -> bool:
  return eqn.primitive.name in _MATMULS or any(
      _has_matmul(e) for j in _compat.nested_jaxprs(eqn) for e in j.eqns)


def _is_int(dtype) -> bool:
  return not jax.numpy.issubdtype(dtype, jax.numpy.inexact)


def _zero_ct(aval):
  """A zero cotangent for ``aval`` (``float0`` for integer values)."""
  if _is_int(aval.dtype):
    return np.zeros(aval.shape, jax.dtypes.float0)
  return jax.numpy.zeros(aval.shape, aval.dtype)


def _struct(aval):
  return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def _loop_policy(prim, *_, **__) -> bool:
  """Inside a loop over stacked layers: saves what is costly to recompute."""
  return prim.name not in collectives.RECOMPUTED


class _Layer:
  """One iteration of a scan over stacked units, linearized: the body as a
  function of ``(consts, carry, plain xs, gathered leaves)`` returning its
  outputs and the residual leaves of its ``jax.vjp``, traced once.

  ``kinds`` says where the backward loop gets each residual: ``params``
  (recomputed by ``recompute`` from the constants and the gathered leaves
  ``g_needed``), ``plain`` (the iteration's slice of a scanned-over input),
  ``saved`` (saved per layer by the forward loop) or ``literal``."""

  def __init__(self, p, pushed, plain_pos, gkeys, gavals, units, g, body_params, loop):
    nk, nc = p.num_consts, p.num_carry
    n_xs = len(p.body.invars) - nk - nc
    key_of = {(units[j], i): k for k, (j, i) in enumerate(gkeys)}

    def layer(cs, carry, pl, gflat):
      by_pos = dict(zip(plain_pos, pl))
      xs = [gflat[key_of[pushed[k]]] if k in pushed else by_pos[k] for k in range(n_xs)]
      outs = eval_with_gathers(p.body, p.body_consts, [*cs, *carry, *xs], {}, inner,
                               body_params)
      return list(outs[:nc]), list(outs[nc:])

    # Inside the loop every leaf the layer reads is at hand in the backward
    # loop (re-gathered, or a constant of the loop): nothing needs saving
    # for the sake of another unit (see _saved_if_mixed).
    inner = copy.copy(g)
    inner.save_mixed = False
    trees = []

    def linearized(cs, carry, pl, gflat):
      # Elementwise and layout operations are recomputed in the backward
      # loop, from the saved results of the costly ones (as the step's remat
      # does outside loops): saving them held 2.8x the activations per layer.
      fn = jax.checkpoint(layer, policy=_loop_policy, prevent_cse=False)
      (c, y), pullback = jax.vjp(fn, cs, carry, pl, gflat)
      leaves, tree = jax.tree_util.tree_flatten(pullback)
      trees.append(tree)
      return [*c, *y, *leaves]

    avals = [v.aval for v in p.body.invars]
    self.closed = jax.make_jaxpr(linearized, axis_env=list(loop.axis_env))(
        [_struct(a) for a in avals[:nk]], [_struct(a) for a in avals[nk:nk + nc]],
        [_struct(avals[nk + nc + k]) for k in plain_pos], gavals)
    self.res_tree = trees[-1]
    jx = self.jaxpr = self.closed.jaxpr
    out_avals = [v.aval for v in jx.outvars]
    self.n_out = len(out_avals) - self.res_tree.num_leaves
    self.c_avals, self.y_avals = out_avals[:nc], out_avals[nc:self.n_out]
    self.cs_in = jx.invars[:nk]
    pl_in = jx.invars[nk + nc:nk + nc + len(plain_pos)]
    self.g_in = jx.invars[nk + nc + len(plain_pos):]

    # Values computed from the constants and resharded parameters alone.
    from_params = set(self.cs_in) | set(jx.constvars) | {
        v for v, (j, _) in zip(self.g_in, gkeys) if units[j] in loop.reshard}
    for e in jx.eqns:
      if not e.effects and all(isinstance(v, Literal) or v in from_params for v in e.invars):
        from_params.update(e.outvars)
    self.kinds, self.saved_vars = [], []
    for v in jx.outvars[self.n_out:]:
      if isinstance(v, Literal):
        self.kinds.append(("literal", v.val))
      elif v in from_params:
        self.kinds.append(("params", v))
      elif v in pl_in:
        self.kinds.append(("plain", pl_in.index(v)))
      else:
        if v not in self.saved_vars:
          self.saved_vars.append(v)
        self.kinds.append(("saved", self.saved_vars.index(v)))
    needed = {v for kind, v in self.kinds if kind == "params"}
    self.recompute = []
    for e in reversed(jx.eqns):
      if any(v in needed for v in e.outvars):
        self.recompute.append(e)
        needed.update(v for v in e.invars if not isinstance(v, Literal))
    self.recompute.reverse()
    self.g_needed = [k for k, v in enumerate(self.g_in) if v in needed]
    self.hook_at = None if loop.forward_prefetch else next(
        (k for k, e in enumerate(jx.eqns) if _has_matmul(e)), None)

  def _env(self, pairs):
    env = dict(zip(self.jaxpr.constvars, self.closed.consts))
    env.update(pairs)
    return env, (lambda v: v.val if isinstance(v, Literal) else env[v])

  def forward(self, args, prefetch):
    """Evaluates the layer: ``(outputs, saved residuals, next gather)``.
    ``prefetch(wait_for) -> (next layer, wait_for)`` is called at the start
    (forward_prefetch) or right after the first matmul."""
    jx = self.jaxpr
    env, rd = self._env(zip(jx.invars, args))
    nxt = prefetch([])[0] if self.hook_at is None else None
    for k, e in enumerate(jx.eqns):
      outs = _bind(e, [rd(v) for v in e.invars])
      if k == self.hook_at:
        nxt, outs = prefetch(list(outs))
      env.update(zip(e.outvars, outs))
    outs = [rd(v) for v in jx.outvars[:self.n_out]]
    return outs, [rd(v) for v in self.saved_vars], nxt

  def pullback(self, cs, gathered, pl, saved):
    """The layer's ``jax.vjp`` pullback in the backward loop, from the
    re-gathered leaves ``gathered`` (``g_needed``), ``pl`` and ``saved``."""
    env, rd = self._env([*zip(self.cs_in, cs),
                         *((self.g_in[k], v) for k, v in zip(self.g_needed, gathered))])
    for e in self.recompute:
      env.update(zip(e.outvars, _bind(e, [rd(v) for v in e.invars])))
    leaves = [pos if kind == "literal" else rd(pos) if kind == "params"
              else pl[pos] if kind == "plain" else saved[pos] for kind, pos in self.kinds]
    return jax.tree_util.tree_unflatten(self.res_tree, leaves)


def _pipelined_scan(eqn, pushed: dict, units: list, g: Gatherer, read, write,
                    body_params: list) -> None:
  """Rebuilds a scan over stacked units as a double-buffered loop pair.

  The scan body is linearized once (:class:`_Layer`). The forward loop
  carries the next layer's gathered leaves and saves each layer's residuals
  but those computed from parameters; the backward loop (the ``custom_vjp``
  backward) carries the previous layer's re-gathered leaves, recomputes the
  parameter residuals from them, applies the layer's pullback and
  reduce-scatters the layer's gradient through the gather's transpose.
  """
  p = _compat.scan_params(eqn)
  nk, nc, length, rev = p.num_consts, p.num_carry, p.length, p.reverse
  invars = list(eqn.invars)
  n_xs = len(invars) - nk - nc
  plain_pos = [k for k in range(n_xs) if k not in pushed]
  loop = g.loop
  step = -1 if rev else 1
  nu = len(units)

  def gather_layer(j, arrays):
    return g._gather_layer(units[j], arrays)

  def layer_of(stack, j, i):
    return [lax.dynamic_index_in_dim(a, i, keepdims=False) for a in stack[j]]

  locs = [list(g.unit_storage(u)) for u in units]
  structs = [[jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in ls] for ls in locs]
  gshape = [jax.eval_shape(lambda a, j=j: gather_layer(j, a), structs[j]) for j in range(nu)]
  gkeys = [(j, i) for j in range(nu) for i in sorted(gshape[j])]
  gavals = [gshape[j][i] for j, i in gkeys]
  lay = _Layer(p, pushed, plain_pos, gkeys, gavals, units, g, body_params, loop)

  def pick(full, keys):
    return [full[gkeys[k][0]][gkeys[k][1]] for k in keys]

  def gather_if(stack, i, valid, wait_for, keys):
    """Layer ``i``'s leaves ``keys`` gathered (zeros unless ``valid``: the
    loop's last iteration has no next layer), issued after ``wait_for``."""
    arrays = [layer_of(stack, j, i) for j in range(nu)]
    leaves, tree = jax.tree_util.tree_flatten(wait_for)
    held = [k for k, x in enumerate(leaves) if not _is_int(x.dtype)]  # not float0
    if held:
      arrays, out = lax.optimization_barrier((arrays, [leaves[k] for k in held]))
      for k, x in zip(held, out):
        leaves[k] = x
      wait_for = jax.tree_util.tree_unflatten(tree, leaves)
    yes = lambda a: pick([gather_layer(j, a[j]) for j in range(nu)], keys)
    no = lambda a: [jax.numpy.zeros(gavals[k].shape, gavals[k].dtype) for k in keys]
    with jax.named_scope(NEXT_LAYER_SCOPE):
      return lax.cond(valid, yes, no, arrays), wait_for

  def neighbour(i, d):
    j = i + d
    return jax.numpy.clip(j, 0, length - 1), (j >= 0) & (j < length)

  first, last = (length - 1, 0) if rev else (0, length - 1)
  idx = lambda: jax.numpy.arange(length, dtype=np.int32)  # made in each trace
  all_keys = list(range(len(gkeys)))

  def forward(cs, init, pl_stack, stack):
    g0 = pick([gather_layer(j, layer_of(stack, j, first)) for j in range(nu)], all_keys)

    def body(carry, xs):
      c, gcur = carry
      i, pl = xs
      nxt, valid = neighbour(i, step)
      outs, saved, gnext = lay.forward(
          [*cs, *c, *pl, *gcur], lambda w: gather_if(stack, nxt, valid, w, all_keys))
      if gnext is None:  # no matmul in the layer: issue it at the end
        gnext = gather_if(stack, nxt, valid, outs, all_keys)[0]
      return (outs[:nc], gnext), (outs[nc:], saved)

    (c_out, _), (ys, saved) = lax.scan(body, (init, g0), (idx(), pl_stack), length=length,
                                       reverse=rev, unroll=p.unroll)
    return (c_out, ys), saved

  @jax.custom_vjp
  def loop_fn(cs, init, pl_stack, stack):
    return forward(cs, init, pl_stack, stack)[0]

  def loop_fwd(cs, init, pl_stack, stack):
    out, saved = forward(cs, init, pl_stack, stack)
    return out, (cs, pl_stack, stack, saved)

  def loop_bwd(res, cts):
    cs, pl_stack, stack, saved = res
    ct_c, ct_ys = cts
    fcs = [k for k, x in enumerate(cs) if not _is_int(x.dtype)]
    fc = [k for k, a in enumerate(lay.c_avals) if not _is_int(a.dtype)]
    fy = [k for k, a in enumerate(lay.y_avals) if not _is_int(a.dtype)]
    g_last = pick([gather_layer(j, layer_of(stack, j, last)) for j in range(nu)], lay.g_needed)
    acc0 = [jax.numpy.zeros(cs[k].shape, cs[k].dtype) for k in fcs]

    def body(carry, xs):
      ct_cf, gcur, acc = carry
      i, pl, sv, ct_yf = xs
      prv, valid = neighbour(i, -step)
      gprev = None
      if loop.backward_prefetch == "BACKWARD_PRE":
        gprev, _ = gather_if(stack, prv, valid, [], lay.g_needed)
      ct_c_i = [_zero_ct(a) for a in lay.c_avals]
      for k, x in zip(fc, ct_cf):
        ct_c_i[k] = x
      ct_y_i = [_zero_ct(a) for a in lay.y_avals]
      for k, x in zip(fy, ct_yf):
        ct_y_i[k] = x
      ct_cs, ct_carry, ct_pl, ct_g = lay.pullback(cs, gcur, pl, sv)((ct_c_i, ct_y_i))
      ct_g = list(ct_g)
      if loop.backward_prefetch == "BACKWARD_POST":
        # Once the layer's gradient computation is done, its leaves are free.
        gprev, (ct_cs, ct_carry, ct_pl, ct_g) = gather_if(
            stack, prv, valid, (list(ct_cs), list(ct_carry), list(ct_pl), ct_g), lay.g_needed)
      if gprev is not None:  # the reduce-scatter is issued after the gather
        ct_g, gprev = lax.optimization_barrier((ct_g, gprev))
      ct_loc = []
      for j in range(nu):
        _, pull = jax.vjp(lambda a, j=j: gather_layer(j, a), layer_of(stack, j, i))
        ct_loc.append(list(pull({leaf: ct_g[k] for k, (jj, leaf) in enumerate(gkeys)
                                 if jj == j})[0]))
      if gprev is None:
        gprev, ct_loc = gather_if(stack, prv, valid, ct_loc, lay.g_needed)
      acc = [a + ct_cs[k] for a, k in zip(acc, fcs)]
      ct_pl = [None if _is_int(x.dtype) else x for x in ct_pl]
      return ([ct_carry[k] for k in fc], gprev, acc), (ct_pl, ct_loc)

    (ct_cf, _, acc), (ct_pl, ct_loc) = lax.scan(
        body, ([ct_c[k] for k in fc], g_last, acc0),
        (idx(), pl_stack, saved, [ct_ys[k] for k in fy]), length=length,
        reverse=not rev, unroll=p.unroll)
    ct_cs, ct_init = [None] * len(cs), [None] * nc
    for k, a in zip(fcs, acc):
      ct_cs[k] = a
    for k, x in zip(fc, ct_cf):
      ct_init[k] = x
    return ct_cs, ct_init, ct_pl, ct_loc

  # optimize_remat: under the step's jax.checkpoint the forward loop is one
  # equation whose residuals are saved as they are (without it, the
  # checkpoint's partial evaluation copied them in a loop of its own).
  loop_fn.defvjp(loop_fwd, loop_bwd, optimize_remat=True)
  c_out, ys = loop_fn([read(v) for v in invars[:nk]], [read(v) for v in invars[nk:nk + nc]],
                      [read(invars[nk + nc + k]) for k in plain_pos], locs)
  for v, o in zip(eqn.outvars, [*c_out, *ys]):
    write(v, o)


# --------------------------------------------------------------------------
# The model's own jax.checkpoint / nn.remat


def has_user_checkpoint(jaxpr) -> bool:
  """Whether ``jaxpr`` (or one nested in it) calls ``jax.checkpoint``."""
  jaxpr = _compat.split_closed(jaxpr)[0] if jaxpr is not None else None
  if not isinstance(jaxpr, Jaxpr):
    return False
  return any(_compat.is_remat(e) for e in jaxpr.eqns) or any(
      has_user_checkpoint(sub) for sub in _compat.subjaxprs(jaxpr))


def _user_checkpoint(eqn, invals) -> list:
  """Binds the user's ``jax.checkpoint`` equation so that its policy holds
  inside the step's own remat (see the module docstring)."""
  p = _compat.remat_params(eqn)
  body = p.jaxpr
  fn = jax.checkpoint(lambda *args: _compat.eval_jaxpr(body, (), *args),
                      policy=p.policy, prevent_cse=p.prevent_cse)

  @jax.custom_vjp
  def call(*args):
    return fn(*args)

  def fwd(*args):
    return jax.vjp(fn, *args)  # residuals: the inputs and what the policy saves

  def bwd(pullback, cts):
    return pullback(cts)

  call.defvjp(fwd, bwd)
  with _compat.user_context(eqn):
    return call(*invals)


def _scan_rebuild(eqn, read, write, g: Gatherer, klass) -> None:
  """Re-evaluates a scan whose body calls ``jax.checkpoint`` (a scan that is
  not over a stacked unit), so those checkpoints keep their policy too."""
  p = _compat.scan_params(eqn)
  num_consts, num_carry = p.num_consts, p.num_carry
  invals = [read(v) for v in eqn.invars]
  consts = invals[:num_consts]
  init = invals[num_consts:num_consts + num_carry]
  xs = invals[num_consts + num_carry:]
  body_params = [bv for bv, ov in zip(p.body.invars, eqn.invars) if klass(ov) == _PARAM]

  def body(carry, x):
    outs = eval_with_gathers(p.body, p.body_consts, [*consts, *carry, *x], {}, g, body_params)
    return outs[:num_carry], outs[num_carry:]

  carry_out, ys = lax.scan(body, init, xs, length=p.length, reverse=p.reverse,
                           unroll=p.unroll)
  for v, o in zip(eqn.outvars, [*carry_out, *ys]):
    write(v, o)


# --------------------------------------------------------------------------
# Ordering collectives against compute: prefetch and the rate limiter

# A unit's all-gathers: over the shard axes, and hpZ's backward one within
# groups (collectives.fsdp_group_gather_p).
_GATHERS = (collectives.fsdp_all_gather_p, collectives.fsdp_group_gather_p)


def _in_host_memory(x) -> bool:
  try:
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host
  except TypeError:
    return False


def _explicit(pairs, run_order, field: str, phase: str) -> dict:
  """Explicit prefetch ``((u, (x1, x2, ...)), ...)`` -> ``{x: the unit whose
  gather it follows}`` (``x1`` follows ``u``, ``x2`` follows ``x1``); the
  first listing of a unit wins. ``run_order``: the units gathered in this
  pass, in the order they run."""
  out: dict = {}
  pos = {u: k for k, u in enumerate(run_order)}
  for unit, targets in pairs:
    for name in (unit,) + tuple(targets):
      if name not in pos:
        raise ValueError(
            f"{field}: unit {name!r} has no all-gather in the {phase} pass of this step "
            f"(the {phase} pass gathers {list(run_order)}, in this order): "
            + ("its parameters are not read." if phase == "forward" else
               "its gradient does not need its parameters, or it is not resharded.")
            + f" Fix: leave it out of {field}.")
    prev = unit
    for t in targets:
      if pos[t] <= pos[unit]:
        raise ValueError(
            f"{field}: unit {unit!r} lists {t!r}, which the {phase} pass gathers "
            f"before it (order: {list(run_order)}); prefetch only gathers a unit "
            f"earlier than it would run. Fix: list units after {unit!r}.")
      out.setdefault(t, prev)
      prev = t
  return out


@dataclasses.dataclass(frozen=True)
class Ordering:
  """PyTorch's prefetch settings, as explicit ordering of a step's collectives.

  ``backward_prefetch``: ``"BACKWARD_PRE"``, ``"BACKWARD_POST"`` or ``None``.
  ``reshard``: labels of the units freed after their forward use.
  """

  backward_prefetch: Optional[str]
  forward_prefetch: bool
  limit_all_gathers: bool
  reshard: frozenset = frozenset()
  # Explicit prefetch (FSDP2's set_modules_to_{forward,backward}_prefetch):
  # ((unit label, (labels gathered early, in order)), ...).
  forward_prefetch_units: tuple = ()
  backward_prefetch_units: tuple = ()


def ordered(fn: Callable, ordering: Ordering) -> Callable:
  """Wraps ``fn`` (a differentiated step, run on local shards) so its unit
  gathers and reductions follow ``ordering``.

  ``fn`` is traced to a jaxpr. The ``jax.checkpoint`` holding the backward
  pass is inlined (with the same optimization barrier on its inputs that its
  lowering adds), giving one sequence of equations with the forward gathers,
  the backward re-gathers and the reductions (``fsdp_reduce``) of every unit.
  The sequence is re-evaluated with two changes:

  * a backward re-gather is bound just before its first use (not at the start
    of the backward pass, where tracing puts it);
  * each gather or reduction reads its input through an
    ``optimization_barrier`` together with the values it must wait for, so
    the compiled program cannot start it earlier.

  What each collective waits for (units numbered in the order they run, ``k``
  the current one) mirrors what PyTorch's CPU thread does before issuing it,
  and that one NCCL stream runs collectives in issue order:

  * forward gather ``k+1``: gather ``k`` (issue order); without
    ``forward_prefetch`` also the first matmul of unit ``k`` (PyTorch
    issues it at unit ``k+1``'s pre-forward); with ``limit_all_gathers`` the
    last forward use of unit ``k-1`` (at most two units gathered at once).
  * backward re-gather of the next unit ``n`` after the current unit ``c``:
    ``BACKWARD_PRE``: gather ``c`` (issued before ``c``'s gradient
    computation, overlapping it); ``BACKWARD_POST``: ``c``'s gradient and the
    last use of ``c``'s parameters (issued after ``c``'s gradient
    computation; ``c`` is freed first); ``None``: ``c``'s reduce-scatter (no
    overlap). With ``limit_all_gathers``, also the last backward use of the
    unit before ``c``.
  * reduce-scatter of ``c``: its gradient, and for ``BACKWARD_PRE`` /
    ``BACKWARD_POST`` the prefetched gather of ``n`` (issued before it).
  * explicit prefetch (``forward_prefetch_units`` /
    ``backward_prefetch_units``, ``{u: [x1, x2, ...]}``): the gather of
    ``x1`` waits only for ``u``'s gather in that pass, ``x2`` for ``x1``'s,
    and so on (issued together, before ``u``'s computation); in the backward
    pass ``u``'s reduce-scatter also waits for them.

  Gathers inside a ``scan`` over stacked layers are left to that loop.
  """

  def wrapped(*args):
    flat, in_tree = jax.tree_util.tree_flatten(args)
    closed, out_shape = jax.make_jaxpr(
        lambda *xs: fn(*jax.tree_util.tree_unflatten(in_tree, xs)), return_shape=True)(*flat)
    outs = _Sequence(closed.jaxpr, ordering).run(closed.consts, flat)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), outs)

  return wrapped


def _fresh_vars(jaxpr: Jaxpr) -> Jaxpr:
  """A copy of ``jaxpr`` with new variables (nested jaxprs are kept)."""
  new: dict = {}

  def sub(v):
    if isinstance(v, (Literal, DropVar)):
      return v
    if v not in new:
      new[v] = _compat.new_var(v.aval)
    return new[v]

  return jaxpr.replace(
      constvars=[sub(v) for v in jaxpr.constvars], invars=[sub(v) for v in jaxpr.invars],
      outvars=[sub(v) for v in jaxpr.outvars],
      eqns=[e.replace(invars=[sub(v) for v in e.invars], outvars=[sub(v) for v in e.outvars])
            for e in jaxpr.eqns])


class _Sequence:
  """A step's equations as one sequence, with ``remat`` bodies inlined."""

  def __init__(self, jaxpr: Jaxpr, ordering: Ordering):
    self.jaxpr = jaxpr
    self.ordering = ordering
    self.items: list = []  # ("eqn", eqn) | ("enter", eqn) | ("exit", eqn)
    self._flatten(jaxpr)
    # Inlined remat bodies: their invars are the outer values passed in, and
    # their results are the inner values.
    self.alias: dict = {}
    for kind, eqn in self.items:
      if kind == "enter":
        for iv, ov in zip(_compat.remat_params(eqn).jaxpr.invars, eqn.invars):
          if not isinstance(ov, Literal):
            self.alias[iv] = self.resolve(ov)
      elif kind == "exit":
        for ov, iv in zip(eqn.outvars, _compat.remat_params(eqn).jaxpr.outvars):
          if not isinstance(ov, DropVar):
            self.alias[ov] = iv if isinstance(iv, Literal) else self.resolve(iv)
    self.uses: dict = {}
    self.producer: dict = {}
    for i, (kind, eqn) in enumerate(self.items):
      if kind == "exit":
        continue
      for v in eqn.invars:
        if not isinstance(v, Literal):
          self.uses.setdefault(self.resolve(v), []).append(i)
      if kind == "eqn":
        for v in eqn.outvars:
          self.producer[v] = i
    self.gathers = {i for i, (kind, eqn) in enumerate(self.items)
                    if kind == "eqn" and eqn.primitive in _GATHERS}
    # Equations computing from gathered parameters alone (a LayerNorm scale
    # reshaped, a bias broadcast, a cast) run at their first use, like the
    # gathers: the backward pass's recomputation lists them at its start,
    # and binding them there would start every re-gather at once.
    self.deferred: set = set()
    for i, (kind, eqn) in enumerate(self.items):
      if kind != "eqn" or i in self.gathers or eqn.effects:
        continue
      ins = [self.resolve(v) for v in eqn.invars if not isinstance(v, Literal)]
      if ins and all(self.producer.get(v) in self.gathers or self.producer.get(v) in self.deferred
                     for v in ins):
        self.deferred.add(i)
    # CPU offload's copies of a unit's host shards to the device (and the
    # gradient's zeros added to them) run at the gather that reads them, not
    # where the backward pass's recomputation lists them (at its start, which
    # would copy every unit's shards at once).
    self.feeders: set = set()
    for i, (kind, eqn) in enumerate(self.items):
      if kind != "eqn" or eqn.effects:
        continue
      if eqn.primitive.name == "device_put" or (
          eqn.primitive.name in ("add", "convert_element_type") and any(
              self.producer.get(self.resolve(v)) in self.feeders for v in eqn.invars
              if not isinstance(v, Literal))):
        self.feeders.add(i)
    while True:  # keep those whose every reader is a gather or a kept one
      keep = {i for i in self.feeders if all(
          u in self.gathers or u in self.feeders
          for v in self.items[i][1].outvars if not isinstance(v, DropVar)
          for u in self.uses.get(v, ())) and any(
              self.uses.get(v) for v in self.items[i][1].outvars)}
      if keep == self.feeders:
        break
      self.feeders = keep
    self.deps: dict[int, list] = {}
    self._plan()

  def _flatten(self, jaxpr, seen=None):
    seen = set() if seen is None else seen
    for eqn in jaxpr.eqns:
      if _compat.is_remat(eqn):
        body = _compat.remat_params(eqn).jaxpr
        if id(body) in seen:
          # jax.checkpoint caches its trace: calls of one function on the same
          # shapes share one body jaxpr. Inlined bodies are told apart by
          # their variables, so each further copy gets new ones.
          body = _fresh_vars(body)
          eqn = _compat.replace_remat_body(eqn, body)
        seen.add(id(body))
        self.items.append(("enter", eqn))
        self._flatten(body, seen)
        self.items.append(("exit", eqn))
      else:
        self.items.append(("eqn", eqn))

  def resolve(self, v):
    while v in self.alias:
      v = self.alias[v]
    return v

  # -- analysis ------------------------------------------------------------

  def _outs(self, i) -> list:
    kind, eqn = self.items[i]
    vs = _compat.remat_params(eqn).jaxpr.invars if kind == "enter" else eqn.outvars
    if kind == "eqn" and eqn.primitive is collectives.fsdp_all_gather_p and \
        collectives.is_secondary(eqn):
      vs = vs[:-1]  # hpZ's saved slice is read by the backward gather, not compute
    return [v for v in vs if not isinstance(v, DropVar)]

  def _readers(self, idxs) -> list:
    """Positions of the equations reading these gathers' results (directly or
    through equations on parameters alone), in order."""
    found, stack, seen = set(), list(idxs), set(idxs)
    while stack:
      for v in self._outs(stack.pop()):
        for u in self.uses.get(v, ()):
          if u in self.deferred:
            if u not in seen:
              seen.add(u)
              stack.append(u)
          else:
            found.add(u)
    return sorted(found)

  def _first_compute_index(self, idxs):
    """Position of the first matmul (else the first equation) reading these
    gathers' results, or None."""
    readers = self._readers(idxs)
    for r in readers:
      kind, eqn = self.items[r]
      if kind == "eqn" and eqn.primitive.name in ("dot_general", "conv_general_dilated"):
        return r
    return readers[0] if readers else None

  def _first_compute(self, idxs) -> list:
    """The output of the first matmul (else the first equation) reading
    these gathers' results: the unit's computation has started."""
    r = self._first_compute_index(idxs)
    return [] if r is None else self._outs(r)[:1]

  def _freed(self, idxs) -> list:
    """Values computed once every reader of these gathers' results has run:
    the outputs of all of them (the last one in program order may be a cheap
    broadcast the compiler runs early)."""
    return [v for r in self._readers(idxs) for v in self._outs(r)[:1]]

  def _plan(self):
    o = self.ordering
    seen: dict = {}
    fwd: dict = {}
    bwd: dict = {}
    red: dict = {}
    for i, (kind, eqn) in enumerate(self.items):
      if kind != "eqn":
        continue
      if eqn.primitive in _GATHERS:
        spec = collectives.spec_of(eqn)
        n = seen[spec] = seen.get(spec, 0) + 1
        (fwd if n == 1 else bwd).setdefault(spec.label, []).append(i)
      elif eqn.primitive is collectives.fsdp_reduce_p:
        red.setdefault(collectives.spec_of(eqn).label, []).append(i)

    def order(d):
      """Units in the order their gathered parameters are first read."""
      first = {u: self._readers(idxs)[:1] for u, idxs in d.items()}
      return sorted((u for u in d if first[u]), key=lambda u: first[u][0])

    def tie(idxs, anchors):
      for i in idxs:
        self.deps.setdefault(i, []).extend(anchors)

    outs = lambda idxs: [v for i in idxs for v in self._outs(i)]

    def before_compute(gathers, pairs):
      """Explicit prefetch: unit u's computation waits for the gathers it
      prefetches, so they are issued before it."""
      for u, targets in pairs:
        r = self._first_compute_index(gathers[u])
        if r is not None:
          tie([r], outs([i for t in targets for i in gathers[t]]))

    fo = order(fwd)
    early = _explicit(o.forward_prefetch_units, fo, "forward_prefetch_units", "forward")
    before_compute(fwd, o.forward_prefetch_units)
    for k in range(1, len(fo)):
      if fo[k] in early:
        tie(fwd[fo[k]], outs(fwd[early[fo[k]]]))
        continue
      tie(fwd[fo[k]], outs(fwd[fo[k - 1]]))
      if not o.forward_prefetch:
        tie(fwd[fo[k]], self._first_compute(fwd[fo[k - 1]]))
      if o.limit_all_gathers and k >= 2 and fo[k - 2] in o.reshard:
        tie(fwd[fo[k]], self._freed(fwd[fo[k - 2]]))

    bo = [u for u in order(bwd) if u in red]
    early = _explicit(o.backward_prefetch_units, bo, "backward_prefetch_units", "backward")
    before_compute(bwd, o.backward_prefetch_units)
    for n, prev in early.items():
      tie(bwd[n], outs(bwd[prev]))
    for u, targets in o.backward_prefetch_units:
      tie(red[u], outs([i for t in targets for i in bwd[t]]))
    for k in range(1, len(bo)):
      c, n = bo[k - 1], bo[k]
      if n in early:
        if o.backward_prefetch is not None:
          tie(red[c], outs(bwd[n]))
        continue
      tie(bwd[n], outs(bwd[c]))
      if o.backward_prefetch is None:
        tie(bwd[n], outs(red[c]))
      else:
        if k >= 2:
          tie(bwd[n], outs(red[bo[k - 2]]))
        tie(red[c], outs(bwd[n]))
      if o.backward_prefetch != "BACKWARD_PRE":
        tie(bwd[n], [v for i in red[c] for v in self.items[i][1].invars
                     if not isinstance(v, Literal)])
        tie(bwd[n], self._freed(bwd[c]))
      if o.limit_all_gathers and k >= 2:
        tie(bwd[n], self._freed(bwd[bo[k - 2]]))
    # Reductions run in the order their gradients complete.
    ro = sorted(red, key=lambda u: min(red[u]))
    for a, b in zip(ro, ro[1:]):
      tie(red[b], outs(red[a]))

  # -- evaluation ----------------------------------------------------------

  def run(self, consts, args):
    """Evaluates the sequence. A gather with something to wait for is bound
    as soon as all of it is computed (the earliest point its setting allows;
    the compiler may still delay it); one with nothing to wait for, at its
    first use. Every value waited for is re-bound to its copy out of the
    barrier, so later readers keep the barrier (XLA drops barrier operands
    whose results nobody reads)."""
    env: dict = {}
    pending: set = set(self.gathers) | self.deferred | self.feeders
    waiting = sorted(i for i in pending if self.deps.get(i))
    self.skipped = 0

    def read(v):
      if isinstance(v, Literal):
        return v.val
      if v not in env:
        v = self.resolve(v)
        if isinstance(v, Literal):
          return v.val
      if v not in env and self.producer.get(v) in pending:
        force(self.producer[v])
      return env[v]

    def bind(i):
      _, eqn = self.items[i]
      invals = [read(v) for v in eqn.invars]
      anchors = list(dict.fromkeys(self.deps.get(i, ())))
      for a in anchors:
        j = self.producer.get(a)
        if a not in env and j in pending and j != i:
          force(j)
      avail = [a for a in anchors if a in env]
      self.skipped += len(anchors) - len(avail)

      if avail:
        invals, held = lax.optimization_barrier((invals, [env[a] for a in avail]))
        for a, h in zip(avail, held):
          env[a] = h
      for v, a in zip(eqn.outvars, _bind(eqn, invals)):
        env[v] = a
      release()

    def force(i):
      pending.discard(i)
      bind(i)

    def known(v):
      return isinstance(v, Literal) or v in env or self.resolve(v) in env

    def release():
      for j in waiting:
        if (j in pending and all(a in env for a in self.deps[j])
            and all(known(v) for v in self.items[j][1].invars)):
          force(j)

    for v, c in zip(self.jaxpr.constvars, consts):
      env[v] = c
    for v, a in zip(self.jaxpr.invars, args):
      env[v] = a
    for i, (kind, eqn) in enumerate(self.items):
      if kind == "enter":
        rp = _compat.remat_params(eqn)
        inner = rp.jaxpr
        vals = [read(v) for v in eqn.invars]
        pc = rp.prevent_cse
        pc = (pc,) * len(vals) if isinstance(pc, bool) else pc
        if rp.differentiated and any(pc):
          # Not CPU offload's host arrays: only copies to the device read
          # them, which the compiler does not merge (they have effects).
          idx = [j for j, p in enumerate(pc) if p and not _in_host_memory(vals[j])]
          barred = lax.optimization_barrier([vals[j] for j in idx])
          for j, b in zip(idx, barred):
            vals[j] = b
        for iv, val in zip(inner.invars, vals):
          env[iv] = val
        release()
      elif kind == "exit":
        pass  # its results are read through ``alias``
      elif i not in pending and i not in self.gathers and i not in self.deferred:
        bind(i)
    return [read(v) for v in self.jaxpr.outvars]
