"""Ordering a step's collectives against compute: PyTorch's prefetch
settings and the rate limiter, as explicit dependencies in the traced program
(:func:`ordered`)."""

from __future__ import annotations

from typing import Callable

import jax
from jax import lax

from fsdp_jax._src import _compat, collectives
from fsdp_jax._src._compat import DropVar, Jaxpr, Literal
from fsdp_jax._src.plan import Ordering

# Binds an equation again, keeping its name scope and source location.
_bind = _compat.bind_eqn

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
