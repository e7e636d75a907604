"""Tests and doctests run on 8 simulated CPU devices, configured once here.

With ``FSDP_JAX_TEST_DEVICES=native`` they run on the machine's own devices
instead (a GPU host's GPUs; one CPU device where there is no accelerator):
a test whose mesh needs more devices than the machine has is skipped, its
reason naming both counts (``benchmarks/gpu_session.sh`` runs the
GPU-relevant tests this way on one GPU).

The test session also shares one XLA compilation cache between its tests
(and its pytest-xdist workers): many tests build the same small programs
(packing a state, gathering full parameters, the unsharded references) as
fresh closures, which JAX's in-memory caches key by function identity and
recompile. The cache is keyed by the compiled program itself, so a hit is
the same executable; it lives in a temporary directory removed at the end
of the session. Processes the tests launch do not use it.

Test files are handed to the xdist workers whole (``--dist loadfile``, set in
pyproject.toml), so a module's fixtures (a trained reference, background
processes started once for the module) are set up once, and the files go out
longest first, by the seconds recorded in ``tests/durations.json``: the
longest files start at once instead of ending the run alone. Refresh that
record with ``python -m pytest --record-durations tests/durations.json``
(tests/README.md).

Python's cyclic garbage collector runs less often in test processes
(``gc.set_threshold`` below): tracing and lowering allocate millions of
short-lived containers, and at CPython's default threshold (a collection
every 700 net allocations) the collector took about 5% of the tests' CPU
time. Nothing in the tests depends on when cycles are collected.

Where Python is told not to write bytecode (``PYTHONDONTWRITEBYTECODE``),
the session compiles the project's own modules once (``fsdp_jax``,
``tests``, ``benchmarks``) into their ``__pycache__`` directories before
the tests start: every process the tests launch imports them, and
compiling their sources took about 0.3 CPU seconds a process.
"""

import collections
import compileall
import gc
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import pytest

import fsdp_jax
from tests.helpers import OPTIONAL_XLA_FLAGS, TEST_FLAGS_ENV, TEST_XLA_FLAGS

gc.set_threshold(50_000, 20, 20)  # the young generation: 700 by default (see above)

_NATIVE = os.environ.get("FSDP_JAX_TEST_DEVICES", "") == "native"
# Set in the process that runs an ``llvm_optimized`` test (see
# pytest_pyfunc_call below): XLA's default LLVM optimisations there.
_LLVM_ENV = "FSDP_JAX_TEST_LLVM_OPTIMIZED"
_LLVM_OPTIMIZED = os.environ.get(_LLVM_ENV) == "1"
if not _NATIVE:  # tests/helpers.py: TEST_XLA_FLAGS (LLVM optimisations off)
  if not _LLVM_OPTIMIZED:
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS]).strip()
  fsdp_jax.simulate_cpu_devices(8)
elif fsdp_jax.distributed.detect_platform() == "cpu":
  fsdp_jax.simulate_cpu_devices(1)  # the CPU flags, on the one CPU device
# fsdp_jax.data is the optional extra fsdp_jax[data]: without grain its
# modules' doctests are not collected (tests/test_data.py skips, saying why).
if importlib.util.find_spec("grain") is None or importlib.util.find_spec("transformers") is None:
  collect_ignore_glob = ["fsdp_jax/data/*", "fsdp_jax/_src/data/*"]
# make_mesh's error when a mesh asks for more devices than there are.
_TOO_FEW_DEVICES = re.compile(r"needs \d+ devices but only \d+ are available")

_CACHE_ENV = "FSDP_JAX_TEST_COMPILATION_CACHE"
_OWNS_CACHE = _CACHE_ENV not in os.environ
if _OWNS_CACHE:  # the controlling process; xdist workers inherit its directory
  os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="fsdp_jax_test_xla_cache_")
  if sys.dont_write_bytecode:  # see above; read by every process, written once
    for _package in ("fsdp_jax", "tests", "benchmarks"):
      compileall.compile_dir(pathlib.Path(__file__).parent / _package, quiet=2)
jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
  if _OWNS_CACHE and not hasattr(config, "workerinput"):
    shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


def _skip_when_too_few_devices():
  """In the native mode, a test whose mesh needs more devices than the
  machine has is skipped (with make_mesh's message) instead of failing."""
  try:
    return (yield)
  except Exception as e:  # pylint: disable=broad-except
    cause = e  # also under pytest.raises(...) expecting another error
    while _NATIVE and cause is not None:
      if isinstance(cause, ValueError) and _TOO_FEW_DEVICES.search(str(cause)):
        pytest.skip(f"{len(jax.devices())} device(s) here: {cause}")
      cause = cause.__cause__ or cause.__context__
    raise


def _own_process_flags(item):
  """The XLA flags a test runs with in its own process, or None to run it
  here. ``llvm_optimized``: without TEST_XLA_FLAGS. It compares, bit for
  bit, programs whose loops differ in shape (a unit's shards against the
  whole leaf), and without LLVM's optimisations XLA's CPU code for
  ``log1p``, ``tanh`` and ``erf_inv`` rounds the last iterations of a loop
  differently from the others. ``fusion_emitters``: without the older
  fusion emitters TEST_XLA_FLAGS chose (jaxlib 0.10; elsewhere the test runs
  here). It compares two differently fused programs bit for bit, and the
  older emitters round some fusions' results differently in the last bit."""
  ours = TEST_XLA_FLAGS.split()
  if item.get_closest_marker("llvm_optimized") is not None:
    drop = ours
  elif item.get_closest_marker("fusion_emitters") is not None:
    drop = [f for f in ours if f in OPTIONAL_XLA_FLAGS]
    if not drop:
      return None
  else:
    return None
  return [f for f in os.environ.get("XLA_FLAGS", "").split() if f not in drop], \
      [f for f in ours if f not in drop]


def _unused_plugins(config) -> list:
  """The ``-p no:...`` options of pyproject.toml's addopts (the cache, and
  pytest plugins the suite does not use that other packages install: their
  imports cost each pytest process seconds), which a fresh pytest process
  started with ``-o addopts=`` must repeat."""
  opts = config.getini("addopts")
  return [a for flag, value in zip(opts, opts[1:]) if flag == "-p" and value.startswith("no:")
          for a in (flag, value)]


# Set in a process running own-process tests: where it writes their reports.
_REPORTS_ENV = "FSDP_JAX_TEST_OWN_PROCESS_REPORTS"
_own_process_reports: dict = {}  # nodeid -> [(when, outcome, text)] of a finished group


def _run_own_process_group(item, flags) -> None:
  """Runs ``item`` and the other selected tests of its file that need the
  same flags in one fresh pytest process (one start-up and one module
  import for all of them), recording each test's reports."""
  xla_flags, test_flags = flags
  path = item.nodeid.split("::", 1)[0]
  group = [i.nodeid for i in item.session.items
           if i.nodeid.split("::", 1)[0] == path and i.nodeid not in _own_process_reports
           and _own_process_flags(i) == flags]
  with tempfile.TemporaryDirectory(prefix="fsdp_jax_own_process_") as tmp:
    reports = pathlib.Path(tmp) / "reports.jsonl"
    env = dict(os.environ, **{_LLVM_ENV: "1", "XLA_FLAGS": " ".join(xla_flags),
                              TEST_FLAGS_ENV: " ".join(test_flags), _REPORTS_ENV: str(reports)})
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-o", "addopts=",
         *_unused_plugins(item.config), *group],
        cwd=item.config.rootpath, env=env, capture_output=True, text=True, timeout=600)
    lines = reports.read_text().splitlines() if reports.exists() else []
  for nodeid in group:
    _own_process_reports[nodeid] = []
  for line in lines:
    r = json.loads(line)
    _own_process_reports.setdefault(r["nodeid"], []).append((r["when"], r["outcome"], r["text"]))
  for nodeid in group:  # a test with no report: the process died before it ended
    if not any(when == "teardown" for when, _, _ in _own_process_reports[nodeid]):
      _own_process_reports[nodeid].append(
          ("call", "failed", f"no report (exit status {proc.returncode}):\n"
                             f"{(proc.stdout + proc.stderr)[-6000:]}"))


def pytest_pyfunc_call(pyfuncitem):
  """A test marked ``llvm_optimized`` or ``fusion_emitters`` runs in a fresh
  pytest process with some of TEST_XLA_FLAGS left out
  (:func:`_own_process_flags`), together with its file's other selected
  tests that need the same flags; each reports its own outcome here."""
  flags = None if _NATIVE or _LLVM_OPTIMIZED else _own_process_flags(pyfuncitem)
  if flags is None:
    return None
  if pyfuncitem.nodeid not in _own_process_reports:
    _run_own_process_group(pyfuncitem, flags)
  where = f"in its own process (XLA_FLAGS={' '.join(flags[0])!r})"
  for when, outcome, text in _own_process_reports[pyfuncitem.nodeid]:
    if outcome == "failed":
      pytest.fail(f"{pyfuncitem.nodeid} failed {where}, {when}:\n{text[-6000:]}", pytrace=False)
  for when, outcome, text in _own_process_reports[pyfuncitem.nodeid]:
    if outcome == "skipped":
      pytest.skip(f"skipped {where}: {text[-2000:]}")
  return True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):  # pylint: disable=unused-argument
  return (yield from _skip_when_too_few_devices())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):  # pylint: disable=unused-argument
  return (yield from _skip_when_too_few_devices())


# --------------------------------------------------------------------------
# Longest files first (see the module docstring)

_DURATIONS = pathlib.Path(__file__).parent / "tests" / "durations.json"


def pytest_addoption(parser):
  parser.addoption("--record-durations", metavar="PATH", default=None,
                   help="write each test file's seconds (setup, call and teardown of its "
                        "tests) to PATH as JSON, longest first (tests/durations.json orders "
                        "the files of a run)")


def _file_of(nodeid: str) -> str:
  return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
  """Files in descending recorded seconds (unrecorded files after them, in
  their order); each file's tests stay together and in their order."""
  try:
    seconds = json.loads(_DURATIONS.read_text())
  except (OSError, ValueError):
    return
  files = list(dict.fromkeys(_file_of(item.nodeid) for item in items))
  rank = {f: (-seconds.get(f, 0.0), k) for k, f in enumerate(files)}
  items.sort(key=lambda item: rank[_file_of(item.nodeid)])


_recorded = collections.Counter()


def pytest_runtest_logreport(report):
  _recorded[_file_of(report.nodeid)] += report.duration
  if os.environ.get(_REPORTS_ENV):  # an own-process group (pytest_pyfunc_call)
    with open(os.environ[_REPORTS_ENV], "a") as f:
      f.write(json.dumps({"nodeid": report.nodeid, "when": report.when,
                          "outcome": report.outcome, "text": report.longreprtext}) + "\n")


def pytest_sessionfinish(session, exitstatus):  # pylint: disable=unused-argument
  path = session.config.getoption("--record-durations")
  if path and not hasattr(session.config, "workerinput") and _recorded:
    pathlib.Path(path).write_text(json.dumps(
        {f: round(t, 1) for f, t in _recorded.most_common()}, indent=1) + "\n")
