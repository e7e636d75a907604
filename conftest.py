"""Tests and doctests run on 8 simulated CPU devices, configured once here.

The test session also shares one XLA compilation cache between its tests
(and its pytest-xdist workers): many tests build the same small programs
(packing a state, gathering full parameters, the unsharded references) as
fresh closures, which JAX's in-memory caches key by function identity and
recompile. The cache is keyed by the compiled program itself, so a hit is
the same executable; it lives in a temporary directory removed at the end
of the session. Processes the tests launch do not use it.
"""

import os
import shutil
import tempfile

import jax

import fsdp_jax

fsdp_jax.simulate_cpu_devices(8)

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
