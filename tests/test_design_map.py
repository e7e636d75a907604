"""docs/design.md's map is the code's: every module of fsdp_jax/_src has a row,
and imports only the modules its row allows (at the top, or inside a function
where the row says "later")."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "fsdp_jax" / "_src"


def _map():
  rows = {}
  for line in (ROOT / "docs" / "design.md").read_text().splitlines():
    m = re.match(r"^\| [a-z]+ \| `(\w+)` \|", line)
    if m:
      allowed = line.rstrip().removesuffix("|").rsplit("|", 1)[-1]  # the last cell
      top, _, later = allowed.partition("later")
      rows[m.group(1)] = (set(re.findall(r"`(\w+)`", top)),
                          set(re.findall(r"`(\w+)`", later)))
  return rows


def _imports(path: pathlib.Path, package: str):
  """(top-level, inside-function) fsdp_jax._src modules imported by a file."""
  tree = ast.parse(path.read_text())
  top, anywhere = set(), set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module:
      if node.module.startswith("fsdp_jax._src."):
        found = {node.module.split(".")[2]}
      elif node.module == "fsdp_jax._src":
        found = {a.name for a in node.names}
      else:
        continue
      anywhere |= found
      if node in tree.body:
        top |= found
  return top - {package}, anywhere - {package}


def _modules():
  for path in sorted(SRC.rglob("*.py")):
    rel = path.relative_to(SRC)
    yield rel.parts[0].removesuffix(".py"), path


def test_every_module_has_a_row():
  rows = _map()
  missing = sorted({m for m, _ in _modules()} - set(rows))
  assert not missing, f"docs/design.md's map lacks rows for {missing}"
  stale = sorted(set(rows) - {m for m, _ in _modules()})
  assert not stale, f"docs/design.md's map names modules that do not exist: {stale}"


def test_modules_import_only_what_the_map_allows():
  rows = _map()
  wrong = []
  for module, path in _modules():
    top_ok, later_ok = rows[module]
    top, anywhere = _imports(path, module)
    if top - top_ok:
      wrong.append(f"{path.relative_to(ROOT)} imports {sorted(top - top_ok)} at the top")
    if anywhere - top_ok - later_ok:
      wrong.append(f"{path.relative_to(ROOT)} imports {sorted(anywhere - top_ok - later_ok)}")
  assert not wrong, "imports the map in docs/design.md does not allow:\n" + "\n".join(wrong)


def test_the_check_sees_a_violation(tmp_path):
  bad = tmp_path / "x.py"
  bad.write_text("from fsdp_jax._src import step\ndef f():\n  from fsdp_jax._src.grads import g\n")
  assert _imports(bad, "x") == ({"step"}, {"step", "grads"})
