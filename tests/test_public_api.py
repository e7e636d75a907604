"""The public API: what it holds, what it no longer holds, and its docstrings.

* every name listed in an ``__all__`` of the public modules resolves;
* every deprecated name of ``fsdp_jax/_src/deprecations.py`` still works and
  warns with a ``DeprecationWarning`` naming its replacement;
* ``fsdp_jax.state_dict`` stays the function, even after an import from the
  old module path ``fsdp_jax.state_dict``;
* no public module exists at the top level besides the listed ones;
* every public callable has a docstring with an example (``>>>``), except the
  few listed in ``WITHOUT_EXAMPLE``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pathlib
import pkgutil
import subprocess
import sys
import warnings

import pytest

import fsdp_jax
from fsdp_jax._src import deprecations

ROOT = pathlib.Path(__file__).resolve().parents[1]
PUBLIC_MODULES = ("fsdp_jax", "fsdp_jax.custom", "fsdp_jax.hooks", "fsdp_jax.hlo",
                  "fsdp_jax.pretrained", "fsdp_jax.models", "fsdp_jax.distributed",
                  "fsdp_jax.launch", "fsdp_jax.plan", "fsdp_jax.data")

# Public callables whose docstring has no runnable example: this list may only
# shrink. Add an example (tiny meshes, tiny params) rather than a name here.
# Those left need an initialized multi-process run (a barrier, the preemption
# protocol, the process description), which a doctest in one process cannot
# start; their docstrings and docs/multihost.md show them in literal blocks,
# and tests/test_multiprocess.py and tests/test_fault_tolerance.py run them
# in real worker processes.
WITHOUT_EXAMPLE = {
    "fsdp_jax.DistributedInfo", "fsdp_jax.MonitoredBarrierError",
    "fsdp_jax.monitored_barrier", "fsdp_jax.distributed.DistributedInfo",
    "fsdp_jax.distributed.MonitoredBarrierError",
    "fsdp_jax.distributed.handle_preemption", "fsdp_jax.distributed.info",
    "fsdp_jax.distributed.monitored_barrier", "fsdp_jax.distributed.should_stop",
    "fsdp_jax.distributed.shutdown", "fsdp_jax.distributed.install_failure_hooks",
}


# Public modules of an optional extra: checked where the extra is installed.
EXTRAS = {"fsdp_jax.data": ("grain", "transformers")}


def _installed(mod_name: str) -> bool:
  return all(importlib.util.find_spec(n) is not None for n in EXTRAS.get(mod_name, ()))


def _public_names():
  for mod_name in filter(_installed, PUBLIC_MODULES):
    mod = importlib.import_module(mod_name)
    for name in mod.__all__:
      yield mod_name, name


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_all_names_resolve(module):
  if not _installed(module):
    pytest.skip(f"{module} needs the extra's packages {EXTRAS[module]}")
  mod = importlib.import_module(module)
  assert len(set(mod.__all__)) == len(mod.__all__), "duplicates in __all__"
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)  # no public name is deprecated
    for name in mod.__all__:
      assert getattr(mod, name) is not None, f"{module}.{name}"


def test_top_level_keeps_what_a_training_script_needs():
  for name in ("FSDPConfig", "make_mesh", "init_train_state", "shard_train_step",
               "summon_full_params", "state_dict", "CheckpointManager", "custom", "hooks",
               "hlo", "distributed"):
    assert name in fsdp_jax.__all__, name
  for moved in deprecations.MOVED_NAMES:
    assert moved not in fsdp_jax.__all__, moved


@pytest.mark.parametrize("name", sorted(deprecations.MOVED_NAMES))
def test_moved_name_warns_and_works(name):
  new, module, attr = deprecations.MOVED_NAMES[name]
  with pytest.warns(DeprecationWarning, match=rf"fsdp_jax\.{name} is deprecated: use {new}"):
    old = getattr(fsdp_jax, name)
  assert old is getattr(importlib.import_module(module), attr)
  # The replacement is public and the same object.
  parent, _, leaf = new.rpartition(".")
  assert getattr(importlib.import_module(parent), leaf) is old


@pytest.mark.parametrize("module", deprecations.MOVED_MODULES)
def test_moved_module_warns_and_works(module):
  impl = importlib.import_module(deprecations._implementation(module))
  alias = importlib.import_module(f"fsdp_jax.{module}")
  # A public name read through the old path: the same object, and a warning
  # naming its public spelling; one with no public spelling says it is internal.
  public = {}
  for mod_name, name in _public_names():
    obj = getattr(importlib.import_module(mod_name), name)
    home = str(getattr(obj, "__module__", None))
    if (home == impl.__name__ or home.startswith(impl.__name__ + ".")) and (
        inspect.isclass(obj) or inspect.isfunction(obj)):
      public.setdefault(name, f"{mod_name}.{name}")
  names = sorted(public) or sorted(n for n, v in vars(impl).items()
                                   if not n.startswith("_") and inspect.isfunction(v)
                                   and (v.__module__ == impl.__name__
                                        or v.__module__.startswith(impl.__name__ + ".")))[:1]
  assert names, module
  for name in names:
    with pytest.warns(DeprecationWarning) as record:
      value = getattr(alias, name)
    assert value is getattr(impl, name)
    msg = str(record[0].message)
    assert msg.startswith(f"fsdp_jax.{module}.{name} is deprecated: use "), msg
    if name in public:
      assert public[name] in msg, msg
    else:
      assert "internal" in msg, msg


def test_plan_module_is_the_planner_and_keeps_its_old_names():
  """``fsdp_jax.plan`` is the planner's public module; the names it held as
  an alias of the private plan module still work, with a warning."""
  plan = importlib.import_module("fsdp_jax.plan")
  assert plan.estimate is fsdp_jax.estimate and plan.search is fsdp_jax.search
  with pytest.warns(DeprecationWarning, match=r"fsdp_jax\.plan\.Plan is deprecated: use "
                                              r"fsdp_jax\.Plan\."):
    assert plan.Plan is fsdp_jax.Plan
  with pytest.warns(DeprecationWarning, match=r"use fsdp_jax\.custom\.param_specs"):
    assert plan.param_specs is fsdp_jax.custom.param_specs


def test_from_old_module_path_import_warns():
  code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
          "try:\n"
          "  from fsdp_jax.config import FSDPConfig\n"
          "except DeprecationWarning as e:\n"
          "  print(e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, cwd=str(ROOT))
  assert "fsdp_jax.config.FSDPConfig is deprecated: use fsdp_jax.FSDPConfig." in out.stdout, (
      out.stdout + out.stderr)


def test_state_dict_stays_the_function():
  from fsdp_jax._src.state_dicts import state_dict as impl
  assert fsdp_jax.state_dict is impl
  with pytest.warns(DeprecationWarning, match=r"fsdp_jax\.full_optim_state_dict"):
    from fsdp_jax.state_dict import full_optim_state_dict  # noqa: F401
  assert fsdp_jax.state_dict is impl and callable(fsdp_jax.state_dict)
  importlib.import_module("fsdp_jax.state_dict")  # the old module path, as `import a.b`
  assert fsdp_jax.state_dict is impl
  code = ("import warnings; warnings.simplefilter('ignore')\n"
          "import fsdp_jax.state_dict\n"
          "from fsdp_jax.state_dict import full_optim_state_dict\n"
          "import fsdp_jax\n"
          "print(type(fsdp_jax.state_dict).__name__)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, cwd=str(ROOT))
  assert out.stdout.strip() == "function", out.stdout + out.stderr
  assert full_optim_state_dict is fsdp_jax.full_optim_state_dict


def test_names_load_on_first_use():
  """A bare ``import fsdp_jax`` (and the launcher's) imports neither JAX nor
  the engine; every public name and submodule loads when first read."""
  code = ("import sys, fsdp_jax, fsdp_jax.launch\n"
          "print('jax' in sys.modules, 'fsdp_jax.models' in sys.modules,"
          " callable(fsdp_jax.models.from_pretrained), callable(fsdp_jax.pretrained.load),"
          " fsdp_jax.FSDPConfig.__module__, 'jax' in sys.modules)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, cwd=str(ROOT))
  assert out.stdout.split() == ["False", "False", "True", "True", "fsdp_jax._src.config",
                                "True"], out.stdout + out.stderr
  assert set(fsdp_jax.__all__) | set(fsdp_jax._SUBMODULES) <= set(dir(fsdp_jax))


def test_type_checkers_see_the_names_that_load():
  """``fsdp_jax/__init__.py``'s ``if TYPE_CHECKING:`` imports (what editors
  and type checkers read) are exactly the names the package loads on first
  use, from the same modules."""
  tree = ast.parse((ROOT / "fsdp_jax" / "__init__.py").read_text())
  block = next(n for n in tree.body if isinstance(n, ast.If)
               and getattr(n.test, "id", None) == "TYPE_CHECKING")
  seen: dict = {}
  for node in block.body:
    assert isinstance(node, ast.ImportFrom), ast.dump(node)
    for alias in node.names:
      seen.setdefault(node.module, []).append(alias.name)
  submodules = seen.pop("fsdp_jax")
  assert sorted(submodules) == sorted(fsdp_jax._SUBMODULES)
  assert {m: sorted(n) for m, n in seen.items()} == {
      m: sorted(n) for m, n in fsdp_jax._PUBLIC.items()}


def test_no_other_public_top_level_module():
  listed = {m.rpartition(".")[2] for m in PUBLIC_MODULES[1:]}
  found = {m.name for m in pkgutil.iter_modules(fsdp_jax.__path__)
           if not m.name.startswith("_")}
  assert found == listed


def _has_example(obj) -> bool:
  doc = inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isroutine(obj)) else None
  if doc is None:  # an instance (a built-in hook): its class documents it
    doc = inspect.getdoc(type(obj)) or ""
  return ">>>" in doc


def test_public_callables_have_docstring_examples():
  missing, listed_with_example = [], []
  for mod_name, name in _public_names():
    obj = getattr(importlib.import_module(mod_name), name)
    if inspect.ismodule(obj) or not callable(obj):
      continue
    qual = f"{mod_name}.{name}"
    has = _has_example(obj)
    if not has and qual not in WITHOUT_EXAMPLE:
      missing.append(qual)
    if has and qual in WITHOUT_EXAMPLE:
      listed_with_example.append(qual)
  assert not missing, f"public callables without a >>> example in their docstring: {missing}"
  assert not listed_with_example, (
      f"these have an example now: remove them from WITHOUT_EXAMPLE: {listed_with_example}")
  for qual in WITHOUT_EXAMPLE:
    mod_name, _, name = qual.rpartition(".")
    assert name in importlib.import_module(mod_name).__all__, f"stale entry {qual}"


def test_name_patterns_as_documented():
  """docs/migration.md: in wrap-policy, ignored_states and stacked_layers
  patterns, '*' and '?' stay within one dotted segment, '**' crosses dots,
  and brackets match themselves."""
  import jax
  import jax.numpy as jnp
  import optax

  params = {"blocks": {"b0": {"dense": {"w": jnp.ones(4)}}, "b1": {"dense": {"w": jnp.ones(4)}}},
            "head": {"w": jnp.ones(2)}, "x[0]": jnp.ones(2)}
  mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])

  def units(pattern):
    config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({pattern}))
    state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                      config=config)
    return [u.display_name for u in state.plan.units if u.display_name != "<root>"]

  assert units("blocks.*") == ["blocks.b0", "blocks.b1"]        # not blocks.b0.dense
  assert units("blocks.b?") == ["blocks.b0", "blocks.b1"]
  assert units("blocks.**.dense") == ["blocks.b0.dense", "blocks.b1.dense"]
  assert units("**.dense") == ["blocks.b0.dense", "blocks.b1.dense"]
  with pytest.raises(ValueError, match=r"claims no parameter"):  # '*' does not cross a dot
    units("*.dense")
  with pytest.raises(ValueError, match=r"matches no parameter"):
    fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                              config=fsdp_jax.FSDPConfig(ignored_states=["*.dense.w"]))
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig(ignored_states=["**.dense.w"]))
  assert len(state.plan.ignored_leaves) == 2
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig(ignored_states=["x[0]"]))
  assert len(state.plan.ignored_leaves) == 1  # brackets are literal, not a character class
