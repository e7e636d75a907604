"""``init_train_state(init_fn=...)``: materialise each unit straight into its
shards, compiling one program per distinct unit rather than per unit.

``init_fn`` is traced once. Each unit keeps only the equations its own leaves
need (the trace with the rest removed). Units that repeat a structure (the
blocks of a transformer) differ only in the integers folded into the random
key (Flax folds each module's path into it); those integers become arguments,
so one compiled program serves every unit of that structure, called with its
own integers. Everything else (shapes, float constants, the sub-programs the
initialisers call, the packing into shards) is part of the program's identity,
so two units share a program only when it computes exactly what each one's own
equations would: the values equal an unsharded ``jax.jit(init_fn)``'s bit for
bit.

The programs run one after the other (each takes a token the one before it
returns), so a device holds at most one unit in full, plus the shards made so
far. Each program's outputs are sharded: the compiler partitions the unit's
initialisers, so a device computes about its own shards (JAX's threefry is
partitionable).
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fsdp_jax._src import _compat
from fsdp_jax._src import layout
from fsdp_jax._src import mesh as mesh_lib
from fsdp_jax._src.plan import Plan, UnitSpec

# The primitives whose integer operands are folded into a random key: the
# only operands that become arguments (hoisting a float literal could change
# what the compiler folds, and so the bits).
_KEY_DATA_PRIMITIVES = _compat.KEY_DATA_PRIMITIVES
# Integer scalar arithmetic evaluated here when its operands are known: NNX
# counts its key's uses (``fold_in(key, count)``, ``count = count + 1``).
_FOLDABLE = _compat.FOLDABLE_PRIMITIVES


def _int_scalar(aval) -> bool:
  return not aval.shape and np.issubdtype(np.dtype(aval.dtype), np.integer)


def _fold(eqn, vals: list):
  """The value of a foldable equation's output (exact two's-complement
  arithmetic, as XLA's), or None."""
  out = eqn.outvars[0].aval
  if (eqn.primitive.name not in _FOLDABLE or len(eqn.outvars) != 1 or not _int_scalar(out)
      or any(v is None for v in vals)):
    return None
  ints = [int(v) for v in vals]
  if eqn.primitive.name == "convert_element_type":
    value = ints[0]
  elif eqn.primitive.name == "add":
    value = ints[0] + ints[1]
  elif eqn.primitive.name == "sub":
    value = ints[0] - ints[1]
  else:
    value = ints[0] * ints[1]
  dtype = np.dtype(out.dtype)
  unsigned = np.dtype(f"uint{8 * dtype.itemsize}")
  return np.array(value % (1 << (8 * dtype.itemsize)), unsigned).view(dtype)


def _array_key(x) -> tuple:
  a = np.asarray(x)
  if a.dtype == object:  # pragma: no cover (typed keys and the like: by identity)
    return ("id", id(x))
  return ("array", a.shape, str(a.dtype), hashlib.sha1(a.tobytes()).hexdigest())


class _Keys:
  """Hashable descriptions of equation params, memoised per object."""

  def __init__(self):
    self._memo: dict = {}
    self._alive: list = []  # the described objects outlive the memo (ids stay unique)

  def param(self, v) -> Any:
    if isinstance(v, (_compat.ClosedJaxpr, _compat.Jaxpr)):
      key = self._memo.get(id(v))
      if key is None:
        consts = tuple(_array_key(c) for c in getattr(v, "consts", ()))
        key = self._memo[id(v)] = ("jaxpr", str(v), consts)
        self._alive.append(v)
      return key
    if isinstance(v, (tuple, list)):
      return (type(v).__name__, tuple(self.param(x) for x in v))
    if isinstance(v, dict):
      return ("dict", tuple((k, self.param(x)) for k, x in v.items()))
    if isinstance(v, (np.ndarray, jax.Array)):
      return _array_key(v)
    if callable(v) and not isinstance(v, type):
      self._alive.append(v)
      return ("callable", id(v))
    try:
      hash(v)
    except TypeError:
      return ("repr", repr(v))
    return ("value", type(v).__name__, v)


class _Analysis(NamedTuple):
  structure: tuple  # equal structures: the same function of (inputs, hoisted)
  hoisted: list  # this part's values of the hoisted operands, in order
  folded: dict  # equation index -> its output's value (not evaluated)
  operands: frozenset  # (equation index, operand index) read from ``hoisted``


def _analyse(part, keys: _Keys) -> _Analysis:
  where: dict = {}
  for i, v in enumerate(part.constvars):
    where[v] = ("const", i)
  for i, v in enumerate(part.invars):
    where[v] = ("in", i)
  known: dict = {}  # var -> its value, for folded integer scalars
  value = lambda x: (np.asarray(x.val) if isinstance(x, _compat.Literal) and _int_scalar(x.aval)
                     else known.get(x) if not isinstance(x, _compat.Literal) else None)
  hoisted, eqns, folded, operands = [], [], {}, set()
  for n, eqn in enumerate(part.eqns):
    folded_value = _fold(eqn, [value(x) for x in eqn.invars])
    if folded_value is not None:
      folded[n] = known[eqn.outvars[0]] = folded_value
      continue
    ins = []
    for j, x in enumerate(eqn.invars):
      v = value(x)
      if v is not None and eqn.primitive.name in _KEY_DATA_PRIMITIVES:
        hoisted.append(np.asarray(v, x.aval.dtype))
        operands.add((n, j))
        ins.append(("hoisted", str(x.aval)))
      elif v is not None:
        ins.append(("literal", str(x.aval), _array_key(v)))
      elif isinstance(x, _compat.Literal):
        ins.append(("literal", str(x.aval), _array_key(x.val)))
      else:
        ins.append(where[x])
    for j, o in enumerate(eqn.outvars):
      where[o] = ("eqn", len(eqns), j)
    params = tuple(sorted((k, keys.param(v)) for k, v in _compat.param_items(eqn)))
    eqns.append((eqn.primitive.name, params, tuple(ins), repr(eqn.ctx),
                 tuple(str(o.aval) for o in eqn.outvars)))
  outs = []
  for x in part.outvars:
    v = value(x)
    if v is not None or isinstance(x, _compat.Literal):
      outs.append(("literal", str(x.aval), _array_key(x.val if v is None else v)))
    else:
      outs.append(where[x])
  avals = (tuple(str(v.aval) for v in part.constvars), tuple(str(v.aval) for v in part.invars))
  return _Analysis((avals, tuple(eqns), tuple(outs)), hoisted, folded, frozenset(operands))


def _evaluate(part, analysis: _Analysis, consts, hoisted, args) -> list:
  """``part``'s outputs: the folded equations' values from ``analysis``, the
  hoisted operands read from ``hoisted`` (in the order ``analysis`` found
  them)."""
  env: dict = {}
  read = lambda x: x.val if isinstance(x, _compat.Literal) else env[x]
  for v, x in zip(part.constvars, consts):
    env[v] = x
  for v, x in zip(part.invars, args):
    env[v] = x
  supply = iter(hoisted)
  for n, eqn in enumerate(part.eqns):
    if n in analysis.folded:
      env[eqn.outvars[0]] = analysis.folded[n]
      continue
    invals = [next(supply) if (n, j) in analysis.operands else read(x)
              for j, x in enumerate(eqn.invars)]
    for o, val in zip(eqn.outvars, _compat.bind_eqn(eqn, invals)):
      if not isinstance(o, _compat.DropVar):
        env[o] = val
  return [read(x) for x in part.outvars]


def _packing_key(plan: Plan, unit: UnitSpec) -> tuple:
  """What :func:`layout.pack_unit` and the output sharding read of a unit."""
  leaves = tuple((plan.leaves[i].shape, str(plan.leaves[i].dtype),
                  plan.chunk0(plan.leaves[i]) if plan.use_orig_params else None)
                 for i in unit.leaf_ids)
  return (plan.prefix(unit), leaves, None if plan.use_orig_params else plan.flat_chunk(unit),
          plan.spec_for(unit))


class InitProgram:
  """``program(*leaves of init_args) -> {unit index: pack_unit output}``:
  every unit materialised into its shards, one compiled program per distinct
  unit structure (see the module docstring)."""

  def __init__(self, plan: Plan, closed, positions: list):
    self.plan = plan
    jaxpr, self._consts = closed.jaxpr, closed.consts
    keys = _Keys()
    self._programs: dict = {}  # structure -> jitted program
    self._calls: list = []  # (unit, structure, hoisted values, reads)
    for unit in plan.units:
      wanted = {positions[i]: i for i in unit.leaf_ids}
      part, reads = _compat.dce(jaxpr, [k in wanted for k in range(len(jaxpr.outvars))])
      ids = [wanted[k] for k in sorted(wanted)]
      analysis = _analyse(part, keys)
      # Every part keeps the trace's constvars, so equal structures read
      # the same constants. ``order``: where each output goes in the unit.
      order = tuple(unit.leaf_ids.index(i) for i in ids)
      key = (analysis.structure, tuple(reads), order, _packing_key(plan, unit))
      if key not in self._programs:
        self._programs[key] = self._compile(unit, part, analysis, reads, ids)
      self._calls.append((unit, key, analysis.hoisted))

  @property
  def num_programs(self) -> int:
    """How many distinct programs the units compile to."""
    return len(self._programs)

  def _compile(self, unit: UnitSpec, part, analysis: _Analysis, reads, ids):
    plan, consts = self.plan, self._consts

    def run(token, hoisted, args):
      # Start once the unit before has been packed: one unit at a time.
      (hoisted, args), token = lax.optimization_barrier(((hoisted, args), token))
      full = _evaluate(part, analysis, consts, hoisted, [x for x, r in zip(args, reads) if r])
      packed = list(layout.pack_unit(plan, unit, dict(zip(ids, full))).values())
      return lax.optimization_barrier((packed, token))

    sh = plan.sharding(plan.spec_for(unit))
    replicated = plan.sharding(jax.sharding.PartitionSpec())
    return mesh_lib.TopLevelJit(run, lambda *_: mesh_lib.compiler_options(
                                    plan.mesh, checkpointed=False),
                                out_shardings=([sh] * len(unit.leaf_ids)
                                               if plan.use_orig_params else [sh], replicated))

  def _runs(self):
    token = jax.device_put(jnp.zeros((), jnp.int32), self.plan.sharding(
        jax.sharding.PartitionSpec()))
    for unit, key, hoisted in self._calls:
      yield unit, self._programs[key], token, hoisted

  def __call__(self, *args, units=None) -> dict:
    """``units``: the indices of the units to make (default: all)."""
    out = {}
    token = None
    for unit, program, first, hoisted in self._runs():
      if units is not None and unit.index not in units:
        continue
      packed, token = program(first if token is None else token, hoisted, list(args))
      out[unit.index] = (dict(zip(unit.leaf_ids, packed)) if self.plan.use_orig_params
                         else {"flat": packed[0]})
    return out

  def compiled(self, *args) -> list:
    """``[(unit, compiled program)]`` in the order they run (each distinct
    program compiled once), for ``memory_analysis()``."""
    done: dict = {}
    out = []
    for unit, program, token, hoisted in self._runs():
      if id(program) not in done:
        done[id(program)] = program.lower(token, hoisted, list(args)).compile()
      out.append((unit, done[id(program)]))
    return out

  def peak_bytes(self, *args) -> int:
    """Bytes per device while the programs run: the largest of (the shards
    made so far + one program's arguments, temporaries and outputs)."""
    held, peak = 0, 0
    for _, compiled in self.compiled(*args):
      m = compiled.memory_analysis()
      peak = max(peak, held + m.argument_size_in_bytes + m.temp_size_in_bytes
                 + m.output_size_in_bytes - m.alias_size_in_bytes)
      held += m.output_size_in_bytes
    return peak


def init_program(plan: Plan, init_fn: Callable, init_args: tuple, *,
                 traced=None) -> InitProgram:
  """The programs that materialise every unit of ``plan`` from ``init_fn``.

  ``traced``: ``(closed jaxpr, positions)`` from a trace already made of a
  function whose outputs include ``init_fn``'s: parameter leaf ``i`` is its
  output ``positions[i]`` (default: ``init_fn`` traced here).
  """
  if traced is None:
    closed = jax.make_jaxpr(init_fn)(*init_args)
    positions = list(range(len(closed.jaxpr.outvars)))
  else:
    closed, positions = traced
  return InitProgram(plan, closed, positions)
