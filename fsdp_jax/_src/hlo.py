"""Reading collectives out of compiled HLO text.

Used by the tests and benchmarks to check what a step really communicates:
``collectives(step.lower(state, batch).compile().as_text())``.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "s64": 8, "s32": 4, "u32": 4,
                "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1, "u64": 8}
_SHAPE = re.compile(r"\b(f64|f32|f16|bf16|s64|s32|u32|s16|u16|s8|u8|pred|u64)\[([0-9,]*)\]")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+(" + "|".join(_KINDS) + r")(-start)?\(")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s")


@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective instruction of a compiled program.

  ``shapes`` are the result shapes (one per operand; XLA may combine several
  collectives into one instruction), ``dtypes`` their element types,
  ``computation`` the HLO computation holding it (a loop body for gathers
  inside ``scan``), ``replica_groups`` the groups as XLA printed them (its
  format changed between releases: :attr:`groups` reads every one).

  Example:
    >>> import jax, jax.numpy as jnp, fsdp_jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "shard"), mesh=mesh,
    ...                           in_specs=P("shard"), out_specs=P()))
    >>> text = f.lower(jnp.ones(4)).compile().as_text()
    >>> (c,) = fsdp_jax.hlo.collectives(text)
    >>> c.kind, c.shapes, c.dtypes, c.bytes, c.groups
    ('all-reduce', ((2,),), ('f32',), 8, ((0, 1),))
  """

  kind: str
  name: str
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[str, ...]
  computation: str
  replica_groups: str

  @property
  def bytes(self) -> int:
    return int(sum(np.prod(s, dtype=np.int64) * _DTYPE_BYTES[d]
                   for s, d in zip(self.shapes, self.dtypes)))

  @property
  def numel(self) -> int:
    return int(sum(np.prod(s, dtype=np.int64) for s in self.shapes))

  @property
  def groups(self) -> tuple[tuple[int, ...], ...]:
    """The device groups of the collective (see :func:`replica_groups`)."""
    return replica_groups(self.replica_groups)


_IOTA = re.compile(r"^\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?$")
_MESH = re.compile(r"^mesh\[([^\]]*)\]\s*\{([^}]*)\}$")


def replica_groups(text: str) -> tuple[tuple[int, ...], ...]:
  """Device groups from an HLO ``replica_groups=`` value, in any of the
  formats XLA prints: explicit ``{{0,1},{2,3}}``; iota ``[2,2]<=[4]`` or
  ``[4,2]<=[2,4]T(1,0)``;
  mesh axes ``mesh['replicate'=2,'shard'=4] {'shard'}`` (jax 0.12's XLA: the
  groups run along the named axes of a row-major mesh of device ids). ``()``
  for an empty value (one group of every device).

  Example:
    >>> from fsdp_jax.hlo import replica_groups
    >>> replica_groups("{{0,2},{1,3}}")
    ((0, 2), (1, 3))
    >>> replica_groups("[2,2]<=[2,2]T(1,0)")
    ((0, 2), (1, 3))
    >>> replica_groups("mesh['replicate'=2,'shard'=2] {'replicate'}")
    ((0, 2), (1, 3))
  """
  s = text.strip()
  if not s or s == "{}":
    return ()
  if s.startswith("{"):
    return tuple(tuple(int(x) for x in g.split(",") if x.strip())
                 for g in re.findall(r"\{([\d,\s]*)\}", s[1:-1]))
  m = _IOTA.match(s)
  if m:
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return tuple(tuple(int(x) for x in row) for row in ids.reshape(shape[0], -1))
  m = _MESH.match(s)
  if m:
    axes = [(name, int(size)) for name, size in re.findall(r"'([^']*)'=(\d+)", m.group(1))]
    names = [a for a, _ in axes]
    grouped = [names.index(a) for a in re.findall(r"'([^']*)'", m.group(2))]
    ids = np.arange(int(np.prod([n for _, n in axes]))).reshape([n for _, n in axes])
    rest = [i for i in range(len(axes)) if i not in grouped]
    ids = ids.transpose(rest + grouped)
    size = int(np.prod([axes[i][1] for i in grouped]))
    return tuple(tuple(int(x) for x in row) for row in ids.reshape(-1, size))
  raise ValueError(f"Cannot read replica groups {text!r}: not an explicit, iota or mesh "
                   "format that fsdp_jax.hlo knows.")


def collectives(hlo_text: str) -> list[Collective]:
  """All collectives of an HLO module (``compiled.as_text()``), in order.

  Example:
    >>> import jax, jax.numpy as jnp, fsdp_jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "shard"), mesh=mesh,
    ...                           in_specs=P("shard"), out_specs=P()))
    >>> text = f.lower(jnp.ones(4)).compile().as_text()
    >>> [(c.kind, c.shapes) for c in fsdp_jax.hlo.collectives(text)]
    [('all-reduce', ((2,),))]
  """
  out = []
  comp = ""
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if m is None:
      c = _COMP.match(line)
      if c and line.rstrip().endswith("{") and " = " not in line:
        comp = c.group(1)
      continue
    name, result, kind, _ = m.groups()
    if kind == "all-gather" and "-done" in line:
      continue
    # For async starts the result tuple holds operands and results; keep the
    # second half (results).
    shapes = [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _SHAPE.findall(result)]
    if m.group(4) and len(shapes) >= 2:
      shapes = shapes[len(shapes) // 2:]
    groups = re.search(
        r"replica_groups=(\{[^ ]*\}|\[[^ ]*\][^ ,]*|mesh\[[^\]]*\]\s*\{[^}]*\})", line)
    out.append(Collective(kind, name, tuple(s for _, s in shapes),
                          tuple(d for d, _ in shapes), comp,
                          groups.group(1) if groups else ""))
  return out


def summarize(hlo_text: str) -> dict[str, dict[str, int]]:
  """``{kind: {"ops": n, "operands": m, "bytes": b}}`` over the module.

  Example:
    >>> import jax, jax.numpy as jnp, fsdp_jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "shard"), mesh=mesh,
    ...                           in_specs=P("shard"), out_specs=P()))
    >>> text = f.lower(jnp.ones(4)).compile().as_text()
    >>> fsdp_jax.hlo.summarize(text)
    {'all-reduce': {'ops': 1, 'operands': 1, 'bytes': 8}}
  """
  out: dict = {}
  for c in collectives(hlo_text):
    d = out.setdefault(c.kind, {"ops": 0, "operands": 0, "bytes": 0})
    d["ops"] += 1
    d["operands"] += len(c.shapes)
    d["bytes"] += c.bytes
  return out


_WHILE = re.compile(r"\bwhile\(.*?\bbody=%?([\w.\-]+)")
_CALLS = re.compile(r"\b(?:to_apply|calls|body|condition|branch_computations)=\{?%?([\w.\-, %]+)\}?")


def loop_bodies(hlo_text: str) -> set[str]:
  """Names of the computations that run inside a ``while`` loop: the loop
  bodies and everything they call.

  Example:
    >>> import jax, jax.numpy as jnp, fsdp_jax
    >>> loop = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, y: y * 2, x))
    >>> text = loop.lower(jnp.ones(3)).compile().as_text()
    >>> len(fsdp_jax.hlo.loop_bodies(text)) > 0
    True
    >>> fsdp_jax.hlo.loop_bodies(jax.jit(jnp.sin).lower(1.0).compile().as_text())
    set()
  """
  calls: dict[str, set[str]] = {}
  comp = ""
  bodies: set[str] = set()
  for line in hlo_text.splitlines():
    c = _COMP.match(line)
    if c and line.rstrip().endswith("{") and " = " not in line:
      comp = c.group(1)
      continue
    for m in _WHILE.finditer(line):
      bodies.add(m.group(1))
    for m in _CALLS.finditer(line):
      for name in m.group(1).replace("%", "").split(","):
        if name.strip():
          calls.setdefault(comp, set()).add(name.strip())
  out, todo = set(), list(bodies)
  while todo:
    name = todo.pop()
    if name in out:
      continue
    out.add(name)
    todo.extend(calls.get(name, ()))
  return out


# --------------------------------------------------------------------------
# The scheduled entry computation: collective order and gathered liveness

_UNIT_GATHER = re.compile(r"fsdp_all_gather\[([^\]]*)\]")
_UNIT_REDUCE = re.compile(r"fsdp_reduce_scatter\[([^\]]*)\]")
_ALIASING = ("bitcast", "copy", "reshape")


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction of a computation, as printed by ``as_text()``.

  Example:
    >>> import jax, jax.numpy as jnp, fsdp_jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "shard"), mesh=mesh,
    ...                           in_specs=P("shard"), out_specs=P()))
    >>> text = f.lower(jnp.ones(4)).compile().as_text()
    >>> ins = [i for i in fsdp_jax.hlo.entry_instructions(text) if i.opcode == "all-reduce"]
    >>> len(ins), ins[0].tuple_size
    (1, 0)
  """

  name: str
  opcode: str
  operands: tuple[str, ...]
  op_name: str
  tuple_size: int  # 0 for an array
  index: int = -1  # get-tuple-element's index


def _closing(s: str, start: int) -> int:
  depth = 0
  for k in range(start, len(s)):
    if s[k] in "({":
      depth += 1
    elif s[k] in ")}":
      depth -= 1
      if depth == 0:
        return k
  return len(s) - 1


def entry_instructions(hlo_text: str) -> list[Instruction]:
  """The ENTRY computation's instructions in order. For a scheduled module
  (``compiled.as_text()`` on CPU and GPU) the order is the execution order.

  Example:
    >>> import jax, jax.numpy as jnp, fsdp_jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "shard"), mesh=mesh,
    ...                           in_specs=P("shard"), out_specs=P()))
    >>> text = f.lower(jnp.ones(4)).compile().as_text()
    >>> ops = [i.opcode for i in fsdp_jax.hlo.entry_instructions(text)]
    >>> ops[0], "all-reduce" in ops
    ('parameter', True)
  """
  out = []
  for name, shape, opcode, args, rest, _ in _entry_lines(hlo_text):
    size = len(re.findall(r"\[[0-9,]*\]", shape)) if shape.startswith("(") else 0
    index = re.search(r"\bindex=(\d+)", rest)
    op_name = re.search(r'op_name="([^"]*)"', rest)
    out.append(Instruction(name, opcode, tuple(re.findall(r"%([\w.\-]+)", args)),
                           op_name.group(1) if op_name else "", size,
                           int(index.group(1)) if index else -1))
  return out


def _entry_lines(hlo_text: str):
  """``(name, result shape text, opcode, operands text, rest, is ROOT)`` of
  each instruction of the ENTRY computation, in order."""
  inside = False
  for line in hlo_text.splitlines():
    if line.startswith("ENTRY"):
      inside = True
      continue
    if not inside:
      continue
    if line.startswith("}"):
      break
    m = re.match(r"\s*(ROOT\s+)?%([\w.\-]+) = ", line)
    if m is None:
      continue
    rest = line[m.end():]
    if rest.startswith("("):
      end = _closing(rest, 0)
      shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
      shape, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-]+)\(", rest)
    if op is None:
      continue
    args = rest[op.end() - 1:_closing(rest, op.end() - 1) + 1]
    yield m.group(2), shape, op.group(1), args, rest, bool(m.group(1))


def collective_order(hlo_text: str) -> list[tuple[str, str]]:
  """``[(kind, unit), ...]``: the entry computation's all-gathers and
  reduce-scatters in execution order, with the unit each belongs to (from the
  ``fsdp_all_gather[unit]`` / ``fsdp_reduce_scatter[unit]`` scopes).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> config = fsdp_jax.FSDPConfig()
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=config)
    >>> step = fsdp_jax.shard_train_step(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
    ...     optax.sgd(0.1), mesh=mesh, config=config)
    >>> text = step.lower(state, {"x": jnp.ones((2, 4))}).compile().as_text()
    >>> fsdp_jax.hlo.collective_order(text)  # one unit: the root
    [('all-gather', '<root>'), ('reduce-scatter', '<root>')]
  """
  out = []
  for ins in entry_instructions(hlo_text):
    kind = ins.opcode.replace("-start", "")
    if kind not in ("all-gather", "reduce-scatter") or ins.opcode.endswith("-done"):
      continue
    m = (_UNIT_REDUCE if kind == "reduce-scatter" else _UNIT_GATHER).search(ins.op_name)
    out.append((kind, m.group(1) if m else ""))
  return out


def live_gathered_units(hlo_text: str) -> list[frozenset]:
  """For each instruction of the entry computation (in execution order), the
  units whose gathered parameters are live there.

  A unit's gathered values are the results of instructions in its
  ``fsdp_all_gather[unit]`` scope (the all-gather and its unpacking), followed
  through tuples, optimization barriers, get-tuple-element, bitcasts and
  copies. A value is live from its instruction to its last reader.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> config = fsdp_jax.FSDPConfig()
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=config)
    >>> step = fsdp_jax.shard_train_step(lambda p, b: jnp.mean((b["x"] @ p["w"]) ** 2),
    ...     optax.sgd(0.1), mesh=mesh, config=config)
    >>> text = step.lower(state, {"x": jnp.ones((2, 4))}).compile().as_text()
    >>> live = fsdp_jax.hlo.live_gathered_units(text)
    >>> max(len(units) for units in live), sorted(set().union(*live))
    (1, ['<root>'])
  """
  instrs = entry_instructions(hlo_text)
  pos = {ins.name: k for k, ins in enumerate(instrs)}
  carries: dict[str, list[frozenset]] = {}
  empty = frozenset()

  def whole(name):
    return frozenset().union(*carries.get(name, [empty]))

  for ins in instrs:
    gather = _UNIT_GATHER.search(ins.op_name)
    n = max(ins.tuple_size, 1)
    if gather and "fsdp_reduce_scatter" not in ins.op_name and ins.opcode != "parameter":
      carries[ins.name] = [frozenset([gather.group(1)])] * n
    elif ins.opcode == "tuple":
      carries[ins.name] = [whole(o) for o in ins.operands]
    elif ins.opcode == "opt-barrier" and ins.operands:
      carries[ins.name] = list(carries.get(ins.operands[0], [empty] * n))
    elif ins.opcode == "get-tuple-element" and ins.operands:
      src = carries.get(ins.operands[0], [])
      carries[ins.name] = [src[ins.index] if 0 <= ins.index < len(src) else empty]
    elif ins.opcode in _ALIASING and ins.operands:
      carries[ins.name] = [whole(ins.operands[0])]
  # A tuple's elements are separate buffers: element i lives until the last
  # get-tuple-element reading it (or the last reader of the whole tuple).
  last: dict = {}
  for k, ins in enumerate(instrs):
    for o in ins.operands:
      key = (o, ins.index) if ins.opcode == "get-tuple-element" else (o, None)
      last[key] = k
  live = [set() for _ in instrs]
  for name, car in carries.items():
    whole_end = last.get((name, None), pos[name])
    for i, units in enumerate(car):
      if not units:
        continue
      end = max(whole_end, last.get((name, i), pos[name])) if len(car) > 1 else whole_end
      if len(car) == 1:
        end = max(end, last.get((name, 0), pos[name]))
      for k in range(pos[name], end + 1):
        live[k] |= units
  return [frozenset(s) for s in live]


# --------------------------------------------------------------------------
# What a program's forward part holds for its backward part

# Instructions whose result is (a view of) their operands' buffers.
_VIEWS = ("bitcast", "get-tuple-element", "tuple", "opt-barrier")


def _entry_buffers(hlo_text: str) -> list:
  """``[(name, opcode, operands, bytes, parameter number or -1, is ROOT)]``
  of the ENTRY computation, in (scheduled) order."""
  out = []
  for name, shape, opcode, args, _, root in _entry_lines(hlo_text):
    nbytes = sum(int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
                 * _DTYPE_BYTES[dt] for dt, dims in _SHAPE.findall(shape))
    number = int(args[1:-1]) if opcode == "parameter" and args[1:-1].isdigit() else -1
    out.append((name, opcode, tuple(re.findall(r"%([\w.\-]+)", args)), nbytes, number, root))
  return out


def held_across(hlo_text: str, parameters) -> int:
  """Bytes a compiled program computes without the entry parameters
  numbered ``parameters`` and reads again in computation that uses them:
  for a program running a forward pass and then its backward from
  cotangent parameters, what the forward keeps for the backward, after
  XLA's fusions (a fusion of the backward recomputes cheap values from what
  is kept, so this is often less than what ``jax.vjp`` names). Parameters,
  the program's results, values made from constants alone (which can be
  made when needed) and what ``jax.checkpoint`` recomputes (its barrier
  takes the cotangents, so the recomputation uses them) are not counted.

  Example:
    >>> import jax, jax.numpy as jnp, fsdp_jax
    >>> def fwd_bwd(x, ct):  # sin's backward needs cos(x): recomputed from x
    ...   return jax.vjp(jnp.sin, x)[1](ct)
    >>> text = jax.jit(fwd_bwd).lower(jnp.ones(1024), jnp.ones(1024)).compile().as_text()
    >>> fsdp_jax.hlo.held_across(text, parameters={1})
    0
  """
  return held_and_results(hlo_text, parameters)[0]


def held_and_results(hlo_text: str, parameters) -> tuple:
  """``(bytes, results read)``: :func:`held_across`'s bytes, and the
  positions among the program's results (its ROOT tuple) of those that
  do not use the parameters and that computation using them reads."""
  instrs = _entry_buffers(hlo_text)
  wanted = set(parameters)
  by_name = {i[0]: i for i in instrs}
  dependent, sources, computed = set(), {}, set()
  for name, opcode, operands, _, number, _ in instrs:
    if opcode == "parameter":
      if number in wanted:
        dependent.add(name)
      computed.add(name)
      sources[name] = set()  # parameters are not held here
      continue
    if any(o in dependent for o in operands):
      dependent.add(name)
    if any(o in computed for o in operands):
      computed.add(name)  # made from the inputs (not a constant or iota alone)
    if opcode in _VIEWS:
      sources[name] = set().union(*(sources.get(o, set()) for o in operands)) if operands else set()
    elif opcode == "constant":
      sources[name] = set()
    else:
      sources[name] = {name}
  root = next((i for i in instrs if i[5]), None)
  results = list(root[2]) if root is not None and root[1] == "tuple" else (
      [root[0]] if root is not None else [])
  result_of = {}
  for k, r in enumerate(results):
    if r not in dependent:
      for src in sources.get(r, ()):
        result_of.setdefault(src, []).append(k)
  held, read = set(), set()
  for name, _, operands, _, _, _ in instrs:
    if name not in dependent:
      continue
    for o in operands:
      for src in sources.get(o, ()):
        if src in dependent or src not in computed:
          continue
        if src in result_of:
          read.update(result_of[src])
        else:
          held.add(src)
  return sum(by_name[h][3] for h in held), read
