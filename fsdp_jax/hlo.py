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
  inside ``scan``).
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


def collectives(hlo_text: str) -> list[Collective]:
  """All collectives of an HLO module (``compiled.as_text()``), in order."""
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
    groups = re.search(r"replica_groups=(\{[^ ]*\}|\[[^ ]*\][^ ,]*)", line)
    out.append(Collective(kind, name, tuple(s for _, s in shapes),
                          tuple(d for d, _ in shapes), comp,
                          groups.group(1) if groups else ""))
  return out


def summarize(hlo_text: str) -> dict[str, dict[str, int]]:
  """``{kind: {"ops": n, "operands": m, "bytes": b}}`` over the module."""
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
  bodies and everything they call."""
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
