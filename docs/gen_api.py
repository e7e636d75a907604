#!/usr/bin/env python
"""Generates docs/api.md from fsdp_jax's public docstrings.

    python docs/gen_api.py           # (re)write docs/api.md
    python docs/gen_api.py --check   # exit 1 if docs/api.md is out of date

One section per name in ``fsdp_jax.__all__`` (its signature and docstring;
the public methods of classes, the members of enums), grouped by what it is
for; then the custom-step building blocks of ``fsdp_jax.custom``; then the
public sub-modules (``fsdp_jax.hooks``, ``fsdp_jax.hlo``,
``fsdp_jax.pretrained``, ``fsdp_jax.models``, ``fsdp_jax.distributed``,
``fsdp_jax.launch``); then the deprecated names of
``fsdp_jax/_src/deprecations.py`` and what replaces each. Docstrings are
Google style with RST inline markup; they are turned into Markdown: ``Args:``
lists become bullet lists, ``>>>`` examples become ``pycon`` blocks, ``::``
literal blocks and RST tables become code blocks. ``tests/test_docs.py`` runs
``--check``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import enum
import importlib
import inspect
import pathlib
import pprint
import re
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"
sys.path.insert(0, str(ROOT))

import fsdp_jax  # noqa: E402  (after the path set-up, so the checkout is documented)

# Sections of the top level, in this order, by the (private) module that
# defines each name; a module not listed here comes after them.
MODULE_ORDER = [
    "fsdp_jax._src.config", "fsdp_jax._src.quantization", "fsdp_jax._src.wrap",
    "fsdp_jax._src.mesh", "fsdp_jax._src.state", "fsdp_jax._src.plan",
    "fsdp_jax._src.step", "fsdp_jax._src.loss", "fsdp_jax._src.cross_entropy",
    "fsdp_jax._src.attention", "fsdp_jax._src.full",
    "fsdp_jax._src.state_dicts", "fsdp_jax._src.checkpoint", "fsdp_jax._src.runtime.distributed",
]
# Section titles (the implementation modules are private: titles only).
TITLES = {
    "fsdp_jax._src.config": "Configuration",
    "fsdp_jax._src.quantization": "Quantized collectives",
    "fsdp_jax._src.wrap": "Wrap policies",
    "fsdp_jax._src.mesh": "Devices and meshes",
    "fsdp_jax._src.state": "The sharded train state",
    "fsdp_jax._src.plan": "The plan",
    "fsdp_jax._src.step": "The train step",
    "fsdp_jax._src.loss": "The loss function",
    "fsdp_jax._src.cross_entropy": "The blocked loss",
    "fsdp_jax._src.attention": "Attention",
    "fsdp_jax._src.full": "Full parameters",
    "fsdp_jax._src.state_dicts": "State dicts",
    "fsdp_jax._src.checkpoint": "Checkpoints",
    "fsdp_jax._src.runtime.distributed": "Several processes",
}
# The custom-step building blocks, then the public sub-modules, in this order.
CUSTOM_MODULE = "fsdp_jax.custom"
SUBMODULES = ["fsdp_jax.hooks", "fsdp_jax.hlo", "fsdp_jax.pretrained", "fsdp_jax.models",
              "fsdp_jax.distributed",
              "fsdp_jax.launch", "fsdp_jax.data"]

_SECTION = re.compile(
    r"^(Args|Arguments|Attributes|Returns|Yields|Raises|Example|Examples|Note|Notes)"
    r"\b[^:]*:$")
_LIST_SECTIONS = ("Args", "Arguments", "Attributes", "Raises")
_ROLE = re.compile(r":(?:func|class|meth|mod|data|attr|obj|exc|const|py:\w+):`~?([^`]+)`")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


# ---------------------------------------------------------------------------
# Docstring -> Markdown


def inline(text: str) -> str:
  """RST inline markup -> Markdown, escaping HTML-like text outside code."""

  def role(m):
    target = m.group(1)
    if m.group(0).startswith(":") and "`~" in m.group(0):
      target = target.split(".")[-1]
    return f"``{target}``"

  text = _ROLE.sub(role, text)
  parts = re.split(r"(``.+?``|`[^`]+`)", text, flags=re.S)
  out = []
  for p in parts:
    if p.startswith("``") and p.endswith("``") and len(p) > 4:
      code = p[2:-2].replace("\n", "\n")
      out.append(f"`` {code} ``" if "`" in code else f"`{code}`")
    elif p.startswith("`") and p.endswith("`") and len(p) > 2:
      out.append(p)
    else:
      out.append(p.replace("<", "&lt;").replace(">", "&gt;"))
  return "".join(out)


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _dedent(lines: list[str]) -> list[str]:
  ind = min((_indent(l) for l in lines if l.strip()), default=0)
  return [l[ind:] for l in lines]


def _fence(lines: list[str], lang: str) -> list[str]:
  while lines and not lines[-1].strip():
    lines = lines[:-1]
  return [f"```{lang}", *lines, "```", ""]


def _is_table_border(line: str) -> bool:
  s = line.strip()
  return bool(s) and set(s) <= {"=", " "} and "=" in s and " " in s


def _rst_table(lines: list[str]) -> list[str]:
  """An RST simple table -> a Markdown table (continuation lines joined)."""
  border = next(l for l in lines if _is_table_border(l))
  starts = [m.start() for m in re.finditer(r"=+", border)]
  borders = [i for i, l in enumerate(lines) if _is_table_border(l)]
  header_rows = borders[1] - borders[0] - 1 if len(borders) >= 3 else 0
  rows: list[list[str]] = []
  for i, line in enumerate(lines):
    if _is_table_border(line) or not line.strip():
      continue
    if line[:1].isspace() and rows:  # a continuation of the last cell
      rows[-1][-1] = f"{rows[-1][-1]} {line.strip()}".strip()
      continue
    # Cells are separated by 2+ spaces (cells may overrun the borders).
    cells = re.split(r"\s{2,}", line.strip(), maxsplit=len(starts) - 1)
    if len(cells) < len(starts) and len(starts) == 2:
      # A first cell that overruns its column by a character or two.
      m = re.compile(r"\s").search(line, max(starts[1] - 2, 0))
      if m:
        cells = [line[:m.start()].strip(), line[m.start():].strip()]
    rows.append(cells + [""] * (len(starts) - len(cells)))
  header = rows[:header_rows] and rows[0] or [""] * len(starts)
  body = rows[header_rows:] if header_rows else rows
  esc = lambda c: inline(c).replace("|", "\\|")
  out = ["| " + " | ".join(esc(c) for c in header) + " |",
         "|" + "---|" * len(starts)]
  out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in body]
  return out + [""]


def render_text(lines: list[str]) -> list[str]:
  """Free text: paragraphs, bullet lists, >>> examples, :: literal blocks,
  RST simple tables and RST section titles."""
  lines = _dedent(lines)
  out: list[str] = []
  para: list[str] = []

  def flush():
    if para:
      out.extend(inline("\n".join(para)).split("\n"))
      para.clear()

  i = 0
  while i < len(lines):
    line = lines[i]
    s = line.strip()
    if not s:
      flush()
      out.append("")
      i += 1
      continue
    if s.startswith(">>>"):
      flush()
      block = []
      while i < len(lines) and lines[i].strip():
        block.append(lines[i])
        i += 1
      out.extend(_fence(_dedent(block), "pycon"))
      continue
    if _is_table_border(line):
      flush()
      block = []
      while i < len(lines) and lines[i].strip():
        block.append(lines[i])
        i += 1
      out.extend(_rst_table(_dedent(block)))
      continue
    nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
    if not para and nxt and set(nxt) <= {"-"} and len(nxt) >= len(s) and len(nxt) > 2:
      out.extend([f"**{inline(s)}**", ""])
      i += 2
      continue
    if s.endswith("::"):
      # A literal block follows: everything more indented than this line.
      text = line.rstrip()[:-1]
      if text.strip():
        para.append(text)
      flush()
      base = _indent(line)
      i += 1
      block = []
      while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
        block.append(lines[i])
        i += 1
      while block and not block[0].strip():
        block = block[1:]
      out.append("")
      out.extend(_fence(_dedent(block), "text"))
      continue
    para.append(line)
    i += 1
  flush()
  return out


def _entries(lines: list[str]) -> list[tuple[str, str]]:
  """Google-style ``name: description`` entries (continuations indented)."""
  lines = _dedent(lines)
  entries: list[list[str]] = []
  for line in lines:
    if not line.strip():
      continue
    if _indent(line) == 0:
      entries.append([line.strip()])
    elif entries:
      entries[-1].append(line.strip())
    else:
      entries.append([line.strip()])
  out = []
  for e in entries:
    head, _, rest = e[0].partition(":")
    out.append((head.strip(), " ".join([rest.strip(), *e[1:]]).strip()))
  return out


def render_doc(doc: str) -> str:
  lines = doc.splitlines()
  out: list[str] = []
  i = 0
  free: list[str] = []

  def flush():
    if free:
      out.extend(render_text(free))
      free.clear()

  while i < len(lines):
    line = lines[i]
    m = _SECTION.match(line) if _indent(line) == 0 else None
    if not m:
      free.append(line)
      i += 1
      continue
    flush()
    title = line.strip()[:-1]
    i += 1
    body = []
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > 0):
      body.append(lines[i])
      i += 1
    out.extend([f"**{inline(title)}:**", ""])
    if m.group(1) in _LIST_SECTIONS and any(l.strip() for l in body):
      for name, desc in _entries(body):
        out.append(f"- `{name}`: {inline(desc)}" if desc else f"- {inline(name)}")
      out.append("")
    else:
      out.extend(render_text(body))
      out.append("")
  flush()
  text = "\n".join(out)
  text = re.sub(r"\n{3,}", "\n\n", text)
  return text.strip() + "\n"


# ---------------------------------------------------------------------------
# Signatures


def _clean_repr(text: str) -> str:
  text = _ADDRESS.sub("", text)
  text = re.sub(r"<class 'jax\.numpy\.(\w+)'>", r"jnp.\1", text)
  return re.sub(r"<class '([\w.]+)'>", r"\1", text)


def _default(value) -> str:
  if isinstance(value, enum.Enum):
    return f"{type(value).__name__}.{value.name}"
  return _clean_repr(repr(value))


def signature(obj, name: str) -> str:
  try:
    sig = inspect.signature(obj)
  except (TypeError, ValueError):
    return f"{name}(...)"
  parts, star_done = [], False
  for p in sig.parameters.values():
    if p.kind is p.VAR_POSITIONAL:
      parts.append(f"*{p.name}")
      star_done = True
      continue
    if p.kind is p.KEYWORD_ONLY and not star_done:
      parts.append("*")
      star_done = True
    if p.kind is p.VAR_KEYWORD:
      parts.append(f"**{p.name}")
      continue
    text = p.name
    if p.default is not p.empty:
      text += f"={_default(p.default)}"
    parts.append(text)
    if p.kind is p.POSITIONAL_ONLY:
      pass
  one_line = f"{name}({', '.join(parts)})"
  if len(one_line) <= 88:
    return one_line
  return f"{name}(\n" + "".join(f"    {p},\n" for p in parts) + ")"


# ---------------------------------------------------------------------------
# Objects


def _own_members(cls) -> list[tuple[str, object]]:
  """Public methods and properties defined by ``cls`` itself, with docstrings."""
  out = []
  for name, value in vars(cls).items():
    if name.startswith("_"):
      continue
    func = value.fget if isinstance(value, property) else value
    if isinstance(func, (staticmethod, classmethod)):
      func = func.__func__
    if not inspect.isfunction(func) or not func.__doc__:
      continue
    out.append((name, value))
  return out


def _constant_comment(name: str) -> str:
  """The comment block above ``NAME = ...`` in fsdp_jax's sources."""
  for path in sorted((ROOT / "fsdp_jax").rglob("*.py")):
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
      if re.match(rf"^{re.escape(name)}\s*(:[^=]*)?=", line):
        comment = []
        j = i - 1
        while j >= 0 and lines[j].startswith("#"):
          comment.insert(0, lines[j].lstrip("#").strip())
          j -= 1
        return " ".join(comment)
  return ""


def document(obj, qualname: str, level: int = 3) -> list[str]:
  h = "#" * level
  out = [f"{h} `{qualname}`", ""]
  short = qualname.split(".")[-1]
  if isinstance(obj, types.ModuleType):
    out.append(render_doc(inspect.getdoc(obj) or ""))
    members = module_members(obj)
    top = [n for n, m in members if n in fsdp_jax.__all__ and getattr(fsdp_jax, n) is m]
    if top:
      out.extend(["Also exported by `fsdp_jax` (documented there): "
                  + ", ".join(f"[`fsdp_jax.{n}`](#{_anchor('fsdp_jax.' + n)})" for n in top)
                  + ".", ""])
    for name, member in members:
      if name not in top:
        out.extend(document(member, f"{qualname}.{name}", level + 1))
    return out
  if inspect.isclass(obj) and issubclass(obj, enum.Enum):
    out.extend(_fence([f"class {qualname}(enum.Enum)"], "python"))
    out.append(render_doc(inspect.getdoc(obj) or ""))
    out.append("Members: " + ", ".join(f"`{m.name}`" for m in obj) + ".")
    out.append("")
    return out
  if inspect.isclass(obj):
    kind = "dataclass" if dataclasses.is_dataclass(obj) else "class"
    out.extend(_fence([f"{kind} {signature(obj, qualname)}"], "python"))
    out.append(render_doc(inspect.getdoc(obj) or ""))
    for name, member in _own_members(obj):
      if isinstance(member, property):
        out.extend([f"{h}# `{short}.{name}` (property)", ""])
        out.append(render_doc(inspect.getdoc(member.fget) or ""))
      else:
        func = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
        out.extend([f"{h}# `{short}.{name}`", ""])
        sig = signature(func, name)
        sig = re.sub(r"^(\w+)\(self, ", r"\1(", re.sub(r"^(\w+)\(self\)", r"\1()", sig))
        sig = sig.replace("(\n    self,\n", "(\n")
        out.extend(_fence([f"{short}.{sig}" if "\n" not in sig else f"{short}.{sig}"], "python"))
        out.append(render_doc(inspect.getdoc(func) or ""))
    return out
  if callable(obj) and (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
    out.extend(_fence([signature(obj, qualname)], "python"))
    out.append(render_doc(inspect.getdoc(obj) or ""))
    return out
  # A constant (or an instance, e.g. a built-in hook).
  value = _clean_repr(pprint.pformat(obj, width=80 - len(qualname)))
  value = value.replace("\n", "\n" + " " * (len(qualname) + 3))
  out.extend(_fence([f"{qualname} = {value}"], "python"))
  doc = _constant_comment(short)
  if not doc and callable(obj) and type(obj).__module__.startswith("fsdp_jax"):
    doc = f"An instance of `{type(obj).__name__}`."
  if doc:
    out.extend([inline(doc), ""])
  return out


def module_members(module, names=None) -> list[tuple[str, object]]:
  if names is None:
    names = getattr(module, "__all__", None)
  if names is None:
    names = []
    for name, value in vars(module).items():
      if name.startswith("_"):
        continue
      defined_here = getattr(value, "__module__", None) == module.__name__
      instance_here = (not inspect.isclass(value) and not inspect.isfunction(value)
                       and not isinstance(value, types.ModuleType)
                       and type(value).__module__ == module.__name__)
      if (defined_here and (inspect.isclass(value) or inspect.isfunction(value))) or instance_here:
        names.append(name)
  return [(n, getattr(module, n)) for n in names]


# Implementation modules documented in another module's section.
SECTION_OF = {"fsdp_jax._src.runtime.cluster": "fsdp_jax._src.runtime.distributed",
              "fsdp_jax._src.frameworks": "fsdp_jax._src.state",
              "fsdp_jax._src.runtime.preemption": "fsdp_jax._src.runtime.distributed"}


def _section_of(mod: str) -> str:
  """The section of a name defined in ``mod`` (a package's modules go to the
  package's section)."""
  for candidate in MODULE_ORDER:
    if mod.startswith(candidate + "."):
      return candidate
  return SECTION_OF.get(mod, mod)


def _module_of(name: str, obj) -> str:
  if isinstance(obj, types.ModuleType):
    return obj.__name__
  mod = getattr(obj, "__module__", None)
  if mod and mod.startswith("fsdp_jax") and (inspect.isclass(obj) or inspect.isfunction(obj)):
    return _section_of(mod)
  for candidate in MODULE_ORDER:  # constants: the module that defines them
    m = importlib.import_module(candidate)
    path = ROOT / (candidate.replace(".", "/") + ".py")
    if name in vars(m) and path.exists():
      if re.search(rf"^{re.escape(name)}\s*(:[^=]*)?=", path.read_text(), re.M):
        return candidate
  return "fsdp_jax"


def _anchor(title: str) -> str:
  a = title.strip().lower()
  a = re.sub(r"[^\w\- ]", "", a)
  return a.replace(" ", "-")


def _deprecated_names() -> list[str]:
  """The "Deprecated names" section, from fsdp_jax/_src/deprecations.py."""
  from fsdp_jax._src import deprecations  # pylint: disable=import-outside-toplevel
  public = {"fsdp_jax": fsdp_jax}
  for mod in [CUSTOM_MODULE, *SUBMODULES]:
    public[mod] = importlib.import_module(mod)
  out = [
      "## Deprecated names",
      "",
      "These still work and warn with a `DeprecationWarning` that names the",
      "replacement; they will be removed in a later release. The old module",
      "paths are aliases of the private implementation modules: each public",
      "name read through one warns and names its public spelling.",
      "",
      "| Deprecated | Use instead |",
      "|---|---|",
  ]
  for name, (new, _, _) in deprecations.MOVED_NAMES.items():
    out.append(f"| `fsdp_jax.{name}` | `{new}` |")
  for module in deprecations.MOVED_MODULES:
    impl = importlib.import_module(deprecations._implementation(module))  # pylint: disable=protected-access
    impl_path = pathlib.Path(impl.__file__)
    src = "\n".join(f.read_text() for f in (sorted(impl_path.parent.glob("*.py"))
                                          if impl_path.name == "__init__.py" else [impl_path]))
    homes = []
    for home, mod in public.items():
      for n in getattr(mod, "__all__", ()):
        obj = getattr(mod, n)
        home_mod = str(getattr(obj, "__module__", None))
        if ((home_mod == impl.__name__ or home_mod.startswith(impl.__name__ + "."))
            if inspect.isclass(obj)
            or inspect.isfunction(obj)
            else re.search(rf"^{re.escape(n)}\s*(:[^=]*)?=", src, re.M)):
          homes.append(home)
          break
    where = (" and ".join(f"`{h}`" for h in homes) + " (each name where `__all__` lists it)"
             if homes else "nothing public: internal, may change without notice")
    out.append(f"| module `fsdp_jax.{module}` (`from fsdp_jax.{module} import ...`) "
               f"| {where} |")
  out.append("")
  return out


def generate() -> str:
  groups: dict[str, list[tuple[str, object]]] = {}
  for name in fsdp_jax.__all__:
    obj = getattr(fsdp_jax, name)
    if isinstance(obj, types.ModuleType):
      continue  # the public sub-modules have their own sections
    groups.setdefault(_module_of(name, obj), []).append((name, obj))
  order = [m for m in MODULE_ORDER if m in groups] + sorted(set(groups) - set(MODULE_ORDER))
  out = [
      "# API reference",
      "",
      "<!-- Generated by docs/gen_api.py from the docstrings: do not edit by hand. -->",
      "",
      "The top level, `fsdp_jax` (its `__all__`), holds what a training script",
      "needs. The building blocks of a hand-written step are in `fsdp_jax.custom`;",
      "communication hooks, compiled-program inspection, multi-process set-up and",
      "the launcher are the public sub-modules `fsdp_jax.hooks`, `fsdp_jax.hlo`,",
      "`fsdp_jax.distributed` and `fsdp_jax.launch`. Everything under",
      "`fsdp_jax._src` is private. Old names keep working for now, with a",
      "warning: see [Deprecated names](#deprecated-names). Generated from the",
      "docstrings by `python docs/gen_api.py`.",
      "",
      "## Contents",
      "",
  ]
  for mod in order:
    names = ", ".join(f"[`{n}`](#{_anchor('fsdp_jax.' + n)})"
                      for n, _ in sorted(groups[mod], key=lambda t: t[0].lower()))
    out.append(f"- **{_group_title(mod)}**: {names}")
  custom = importlib.import_module(CUSTOM_MODULE)
  names = ", ".join(f"[`{n}`](#{_anchor(f'{CUSTOM_MODULE}.{n}')})"
                    for n in sorted(custom.__all__, key=str.lower))
  out.append(f"- **Custom steps (`{CUSTOM_MODULE}`)**: {names}")
  for mod in SUBMODULES:
    out.append(f"- [`{mod}`](#{_anchor(mod)})")
  out.extend(["- [Deprecated names](#deprecated-names)", ""])
  for mod in order:
    out.extend([f"## {_group_title(mod)}", ""])
    for name, obj in sorted(groups[mod], key=lambda t: t[0].lower()):
      out.extend(document(obj, f"fsdp_jax.{name}"))
  out.extend([f"## Custom steps (`{CUSTOM_MODULE}`)", ""])
  out.append(render_doc(inspect.getdoc(custom) or ""))
  for name, member in sorted(module_members(custom), key=lambda t: t[0].lower()):
    out.extend(document(member, f"{CUSTOM_MODULE}.{name}"))
  out.extend(["## Public sub-modules", ""])
  for mod in SUBMODULES:
    out.extend(document(importlib.import_module(mod), mod))
  out.extend(_deprecated_names())
  text = "\n".join(out)
  text = re.sub(r"\n{3,}", "\n\n", text)
  return text.rstrip() + "\n"


def _group_title(mod: str) -> str:
  if mod in TITLES:
    return TITLES[mod]
  module = importlib.import_module(mod)
  first = (inspect.getdoc(module) or mod).strip().splitlines()[0].rstrip(".")
  return re.sub(r"``([^`]+)``", r"\1", first)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--check", action="store_true",
                 help="exit 1 if docs/api.md differs from what would be generated")
  args = p.parse_args(argv)
  text = generate()
  if args.check:
    current = OUT.read_text() if OUT.exists() else ""
    if current != text:
      diff = difflib.unified_diff(current.splitlines(), text.splitlines(),
                                  "docs/api.md (committed)", "docs/api.md (generated)",
                                  lineterm="", n=1)
      print("\n".join(list(diff)[:80]))
      print("docs/api.md is out of date: run `python docs/gen_api.py`.")
      return 1
    print("docs/api.md is up to date.")
    return 0
  OUT.write_text(text)
  print(f"wrote {OUT.relative_to(ROOT)} ({len(text.splitlines())} lines)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
