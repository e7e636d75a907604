"""fsdp_jax touches JAX internals in one module only (``fsdp_jax/_src/_compat.py``):
no other module imports ``jax._src`` or ``jax.interpreters``, reaches for
``xla_bridge`` or ``remat_p``, or reads a jaxpr equation's params by name
(its own primitives' ``spec`` aside)."""

import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fsdp_jax"
FORBIDDEN = re.compile(
    r"(?<![\w.])jax\._src|jax\.interpreters|xla_bridge|\bremat_p\b"
    r"|\b(?:eqn|eq|e|equation)\.params(?:\[(?!\"spec\"|\"secondary\")|\.get\(|\.items\(|,)")


def test_only_compat_touches_jax_internals():
  found = []
  for path in sorted(PACKAGE.rglob("*.py")):
    if path.name == "_compat.py":
      continue
    for n, line in enumerate(path.read_text().splitlines(), 1):
      code = line.split("#", 1)[0]
      if FORBIDDEN.search(code):
        found.append(f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}")
  assert not found, "JAX internals outside fsdp_jax/_src/_compat.py:\n" + "\n".join(found)


def test_the_check_sees_a_violation():
  assert FORBIDDEN.search("from jax._src import core")
  assert FORBIDDEN.search("n = eqn.params['num_consts']")
  assert FORBIDDEN.search("j = eqn.params.get('jaxpr')")
  assert FORBIDDEN.search("e.replace(params={**e.params, 'axis_name': a})")
  assert not FORBIDDEN.search('spec = eqn.params["spec"]')
  assert not FORBIDDEN.search('state.params["_flat_param"].shape')
  assert not FORBIDDEN.search("key = _params_key(eqn.params)")  # hashed whole, not read
