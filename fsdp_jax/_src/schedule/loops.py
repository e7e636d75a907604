"""Scans over stacked layers: the next layer's gather rides in the carry.

A ``lax.scan`` whose scanned-over operands are leaves of a stacked unit runs
as a ``custom_vjp`` pair of double-buffered loops (:func:`pipelined_scan`):
each iteration gathers the next layer while it computes its own, so each
loop holds at most two gathered layers; the prefetch settings
(:class:`~fsdp_jax._src.plan.LoopPrefetch`) place the next gather.
"""

from __future__ import annotations

import copy
from typing import Callable

import jax
import numpy as np
from jax import lax

from fsdp_jax._src import _compat, collectives
from fsdp_jax._src._compat import Literal

# Binds an equation again, keeping its name scope and source location.
_bind = _compat.bind_eqn

_MATMULS = _compat.MATMUL_PRIMITIVES
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

  def __init__(self, p, pushed, plain_pos, gkeys, gavals, units, g, body_params, loop,
               evaluate):
    nk, nc = p.num_consts, p.num_carry
    n_xs = len(p.body.invars) - nk - nc
    key_of = {(units[j], i): k for k, (j, i) in enumerate(gkeys)}

    def layer(cs, carry, pl, gflat):
      by_pos = dict(zip(plain_pos, pl))
      xs = [gflat[key_of[pushed[k]]] if k in pushed else by_pos[k] for k in range(n_xs)]
      outs = evaluate(p.body, p.body_consts, [*cs, *carry, *xs], {}, inner, body_params)
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


def pipelined_scan(eqn, pushed: dict, units: list, g, read, write, body_params: list,
                   evaluate: Callable) -> None:
  """Rebuilds a scan over stacked units as a double-buffered loop pair.

  ``g``: the placement's :class:`~fsdp_jax._src.schedule.placement.Gatherer`;
  ``evaluate``: its evaluator
  (:func:`~fsdp_jax._src.schedule.placement.eval_with_gathers`), which the
  layer's body is run with.

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
    return g.gather_layer(units[j], arrays)

  def layer_of(stack, j, i):
    return [lax.dynamic_index_in_dim(a, i, keepdims=False) for a in stack[j]]

  locs = [list(g.unit_storage(u)) for u in units]
  structs = [[jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in ls] for ls in locs]
  gshape = [jax.eval_shape(lambda a, j=j: gather_layer(j, a), structs[j]) for j in range(nu)]
  gkeys = [(j, i) for j in range(nu) for i in sorted(gshape[j])]
  gavals = [gshape[j][i] for j, i in gkeys]
  lay = _Layer(p, pushed, plain_pos, gkeys, gavals, units, g, body_params, loop, evaluate)

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
