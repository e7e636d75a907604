"""docs/design.md's map is the code's: every module of fsdp_jax/_src has a row
with a layer, and imports flow one way.

* a module of ``fsdp_jax/_src`` imports only modules of its own layer or of
  the layers below it (at the top of the file or inside a function);
* no import cycle among fsdp_jax modules (the public modules included);
* at most 5 imports of fsdp_jax modules made inside a function;
* no module over 900 lines.
"""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fsdp_jax"
SRC = PACKAGE / "_src"
MAX_LINES = 900
MAX_LOCAL_IMPORTS = 5


def _map() -> dict:
  """``{module under _src (dotted): layer}`` from docs/design.md's table."""
  rows = {}
  for line in (ROOT / "docs" / "design.md").read_text().splitlines():
    m = re.match(r"^\| (\d+) \| [a-z]+ \| `([\w.]+)` \|", line)
    if m:
      rows[m.group(2)] = int(m.group(1))
  return rows


def _modules(root=PACKAGE) -> dict:
  """``{dotted module name: path}`` of every module of the package."""
  out = {}
  for path in sorted(root.rglob("*.py")):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


def _imports(path: pathlib.Path, name: str, modules: dict):
  """``[(imported fsdp_jax module, inside a function)]`` of one file."""
  tree = ast.parse(path.read_text())
  inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(f) if n is not f}
  is_package = path.name == "__init__.py"
  out = []
  for node in ast.walk(tree):
    targets = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names if a.name.startswith("fsdp_jax")]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        pkg = name if is_package else name.rsplit(".", 1)[0]
        for _ in range(node.level - 1):
          pkg = pkg.rsplit(".", 1)[0]
        base = pkg + ("." + base if base else "")
      if base.startswith("fsdp_jax"):
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                   for a in node.names]
    for t in targets:
      if t in modules and t != name:
        out.append((t, id(node) in inside))
  return out


def _graph():
  modules = _modules()
  return modules, {m: _imports(p, m, modules) for m, p in modules.items()}


def _src_name(module: str):
  prefix = "fsdp_jax._src."
  return module[len(prefix):] if module.startswith(prefix) else None


def _cycles(edges: dict) -> list:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in edges[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


def test_every_module_has_a_row():
  rows = _map()
  src = {_src_name(m) for m in _modules(SRC)} - {None, ""}
  assert not sorted(src - set(rows)), f"docs/design.md's map lacks rows for {sorted(src - set(rows))}"
  assert not sorted(set(rows) - src), (
      f"docs/design.md's map names modules that do not exist: {sorted(set(rows) - src)}")


def test_imports_never_go_up_a_layer():
  rows = _map()
  modules, graph = _graph()
  wrong = []
  for module, imports in graph.items():
    me = _src_name(module)
    if me is None or me not in rows:
      continue
    for target, local in imports:
      other = _src_name(target)
      if other is None:
        wrong.append(f"{module} imports the public module {target}")
      elif rows.get(other, -1) > rows[me]:
        where = "inside a function" if local else "at the top"
        wrong.append(f"{module} (layer {rows[me]}) imports {target} (layer {rows[other]}) "
                     f"{where}")
  assert not wrong, "imports that go up a layer of docs/design.md's map:\n" + "\n".join(wrong)


def test_no_import_cycle():
  _, graph = _graph()
  edges = {m: {t for t, _ in imports} for m, imports in graph.items()}
  assert _cycles(edges) == []


def test_few_function_local_imports():
  _, graph = _graph()
  local = [f"{m} -> {t}" for m, imports in graph.items() for t, inside in imports if inside]
  assert len(local) <= MAX_LOCAL_IMPORTS, local


def test_no_module_over_900_lines():
  long = {m: n for m, p in _modules().items()
          if (n := len(p.read_text().splitlines())) > MAX_LINES}
  assert not long, long


def test_the_checks_see_violations(tmp_path):
  pkg = tmp_path / "fsdp_jax"
  (pkg / "_src").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "_src" / "__init__.py").write_text("")
  (pkg / "_src" / "a.py").write_text("from fsdp_jax._src import b\n")
  (pkg / "_src" / "b.py").write_text("def f():\n  from fsdp_jax._src.a import g\n")
  modules = {"fsdp_jax": pkg / "__init__.py", "fsdp_jax._src": pkg / "_src" / "__init__.py",
             "fsdp_jax._src.a": pkg / "_src" / "a.py", "fsdp_jax._src.b": pkg / "_src" / "b.py"}
  graph = {m: _imports(p, m, modules) for m, p in modules.items()}
  assert graph["fsdp_jax._src.a"] == [("fsdp_jax._src.b", False)]
  assert graph["fsdp_jax._src.b"] == [("fsdp_jax._src.a", True)]
  edges = {m: {t for t, _ in imports} for m, imports in graph.items()}
  assert _cycles(edges) == [["fsdp_jax._src.a", "fsdp_jax._src.b"]]
