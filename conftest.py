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
"""

import os
import re
import shutil
import tempfile

import jax
import pytest

import fsdp_jax
from tests.helpers import TEST_XLA_FLAGS

_NATIVE = os.environ.get("FSDP_JAX_TEST_DEVICES", "") == "native"
if not _NATIVE:  # tests/helpers.py: TEST_XLA_FLAGS (LLVM optimisations off)
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS]).strip()
  fsdp_jax.simulate_cpu_devices(8)
elif fsdp_jax.distributed.detect_platform() == "cpu":
  fsdp_jax.simulate_cpu_devices(1)  # the CPU flags, on the one CPU device
# make_mesh's error when a mesh asks for more devices than there are.
_TOO_FEW_DEVICES = re.compile(r"needs \d+ devices but only \d+ are available")

_CACHE_ENV = "FSDP_JAX_TEST_COMPILATION_CACHE"
_OWNS_CACHE = _CACHE_ENV not in os.environ
if _OWNS_CACHE:  # the controlling process; xdist workers inherit its directory
  os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="fsdp_jax_test_xla_cache_")
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):  # pylint: disable=unused-argument
  return (yield from _skip_when_too_few_devices())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):  # pylint: disable=unused-argument
  return (yield from _skip_when_too_few_devices())
