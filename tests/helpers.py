"""Shared test helpers: a small uneven MLP, the unsharded reference, meshes,
tree comparisons, a training loop, and background subprocesses."""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

import pytest

import fsdp_jax

REPO = Path(__file__).resolve().parents[1]

# The tests' programs on the simulated CPU devices are compiled with LLVM's
# optimisations off and, where this XLA has the choice (jaxlib 0.10), with
# its older fusion emitters instead of the MLIR ones (conftest.py puts these
# in XLA_FLAGS; the processes the tests launch inherit them, and the docs'
# and notebooks' fresh processes get them alone). The tests compile hundreds
# of small programs and run each a few times, so compiling is most of their
# time: the first flag takes about 30% off the suite's CPU time, the second
# another third of what is left at jaxlib 0.10. Neither changes the HLO (the
# schedules, buffer sizes and collectives the tests count) nor any
# floating-point result beyond rounding (XLA's CPU code is compiled without
# fast-math either way).
OPTIONAL_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
TEST_FLAGS_ENV = "FSDP_JAX_TEST_XLA_FLAGS"  # probed once; launched processes inherit it


def _xla_takes(flag: str) -> bool:
  """Whether this jaxlib's XLA knows ``flag`` (an unknown one aborts the
  process that reads it, so the probe runs in a fresh one)."""
  env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
  probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                         capture_output=True, check=False, timeout=120)
  return probe.returncode == 0


def _test_xla_flags() -> str:
  if TEST_FLAGS_ENV not in os.environ:
    flags = ["--xla_backend_optimization_level=0",
             *(f for f in OPTIONAL_XLA_FLAGS if _xla_takes(f))]
    os.environ[TEST_FLAGS_ENV] = " ".join(flags)
  return os.environ[TEST_FLAGS_ENV]


TEST_XLA_FLAGS = _test_xla_flags()

HYBRID = (fsdp_jax.ShardingStrategy.HYBRID_SHARD,
          fsdp_jax.ShardingStrategy._HYBRID_SHARD_ZERO2)


class LazyModule:
  """A module imported on first attribute access, for the heavy optional
  packages (torch, transformers, peft: seconds to import): collecting a
  test file that uses them does not import them; only running its tests
  does."""

  def __init__(self, name: str):
    self._name = name
    self._module = None

  def __getattr__(self, attr):
    if attr.startswith("__"):  # introspection (doctest collection), not a use
      raise AttributeError(attr)
    if self._module is None:
      self._module = importlib.import_module(self._name)
    return getattr(self._module, attr)


def lazy_modules(*names: str):
  """``LazyModule`` s of ``names``, or Nones when any is not installed."""
  if any(importlib.util.find_spec(n) is None for n in names):
    return (None,) * len(names)
  return tuple(LazyModule(n) for n in names)


FAMILY_VOCAB = 32


def family_configs(*, phi3_positions: int, gpt2_positions: int) -> dict:
  """The eight families' tiny transformers configs (vocabulary 32, hidden
  16, 2 layers, 4 query heads over 2 key/value heads; windows of 3 slots,
  gemma2's soft-capping, phi3's LongRoPE past 8 positions), keyed by
  ``model_type``. ``phi3_positions`` / ``gpt2_positions``: phi3's
  ``max_position_embeddings`` (it sets LongRoPE's attention factor) and
  gpt2's learned positions."""
  base = dict(vocab_size=FAMILY_VOCAB, hidden_size=16, intermediate_size=24,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              initializer_range=0.3)
  return {
      "llama": base,
      "mistral": dict(base, sliding_window=3),
      "qwen3": dict(base, head_dim=8),
      "gemma2": dict(base, head_dim=4, query_pre_attn_scalar=8, sliding_window=3,
                     attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
      "gemma3_text": dict(base, head_dim=4, query_pre_attn_scalar=8, sliding_window=3,
                          layer_types=["sliding_attention", "full_attention"]),
      "qwen2": dict(base, tie_word_embeddings=True, use_sliding_window=True, sliding_window=3,
                    max_window_layers=1),
      "phi3": dict(base, sliding_window=3, max_position_embeddings=phi3_positions,
                   original_max_position_embeddings=8,
                   rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                        short_factor=[1.0, 1.5], long_factor=[2.0, 3.0])),
      "gpt2": dict(vocab_size=FAMILY_VOCAB, n_embd=16, n_layer=2, n_head=4,
                   n_positions=gpt2_positions, initializer_range=0.3),
  }


def mesh_for(strategy, n, replicate=None):
  devices = jax.devices()[: n * (replicate or 1)]
  if replicate is not None:
    return fsdp_jax.make_mesh(replicate=replicate, shard=n, devices=devices)
  return fsdp_jax.make_mesh(shard=n, devices=devices)


def mlp_params(seed=0, d_in=5, d=7, d_out=3, blocks=3):
  """Sizes chosen so no mesh size in the tests divides them."""
  k = jax.random.split(jax.random.key(seed), blocks + 2)
  return {
      "inp": {"w": jax.random.normal(k[0], (d_in, d)) * 0.5},
      "blocks": [{"w": jax.random.normal(k[i + 1], (d, d)) * 0.5,
                  "b": jnp.full((d,), 0.1)} for i in range(blocks)],
      "out": {"w": jax.random.normal(k[-1], (d, d_out)) * 0.5},
  }


def mlp_loss(params, batch):
  x = jnp.tanh(batch["x"] @ params["inp"]["w"])
  for blk in params["blocks"]:
    x = jnp.tanh(x @ blk["w"] + blk["b"])
  return jnp.mean((x @ params["out"]["w"] - batch["y"]) ** 2)


def mlp_batch(seed=1, n=24, d_in=5, d_out=3):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"x": jax.random.normal(k1, (n, d_in)), "y": jax.random.normal(k2, (n, d_out))}


def reference_run(loss_fn, params, batches, optimizer):
  """Unsharded single-device training: losses per step and final params."""
  state = optimizer.init(params)
  losses = []
  for batch in batches:
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = optimizer.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  return losses, params


# Reference steps are compiled with TEST_XLA_FLAGS' options (as every test
# program is), also where a test runs with other flags.
REFERENCE_COMPILER_OPTIONS = {
    name: {"false": False, "true": True}.get(value, int(value) if value.isdigit() else value)
    for name, value in (f[2:].split("=", 1) for f in TEST_XLA_FLAGS.split())}


def jit_reference_run(loss_fn, params, optimizer, batches):
  """Unsharded training, one jitted step on one device: the numbers fsdp_jax
  must reproduce. Returns per-step losses and the final params on the host."""

  def ref_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  device = jax.devices()[0]
  params = jax.device_put(params, device)
  opt_state = optimizer.init(params)
  batches = jax.device_put(batches, device)
  compiled = jax.jit(ref_step).lower(params, opt_state, batches[0]).compile(
      compiler_options=REFERENCE_COMPILER_OPTIONS)
  losses = []
  for batch in batches:
    params, opt_state, loss = compiled(params, opt_state, batch)
    losses.append(float(loss))
  return losses, jax.device_get(params)


def train_steps(step, state, batches):
  """Runs ``batches`` through ``step``; returns (final state, per-step losses)."""
  losses = []
  for batch in batches:
    state, metrics = step(state, batch)  # donates the old state
    losses.append(float(metrics["loss"]))
  return state, losses


def sharded_run(loss_fn, params, batches, optimizer, mesh, config):
  state = fsdp_jax.init_train_state(params=params, optimizer=optimizer, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(loss_fn, optimizer, mesh=mesh, config=config)
  state, losses = train_steps(step, state, batches)
  return losses, state


def plain(tree):
  """Host arrays; typed PRNG keys as their key data."""
  return jax.device_get(jax.tree.map(
      lambda x: jax.random.key_data(x)
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x, tree))


def assert_trees_close(actual, expected, rtol=2e-4, atol=1e-6):
  """Same tree structure, same leaf shapes, leaves close; a failure names the
  leaf's path."""
  actual, expected = plain(actual), plain(expected)
  assert jax.tree.structure(actual) == jax.tree.structure(expected), (
      jax.tree.structure(actual), jax.tree.structure(expected))
  flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
  for (path, a), e in zip(flat_a, jax.tree.leaves(expected)):
    assert np.shape(a) == np.shape(e), (jax.tree_util.keystr(path), np.shape(a), np.shape(e))
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                               err_msg=jax.tree_util.keystr(path))


# --------------------------------------------------------------------------
# Subprocesses

# Set by ``python -m fsdp_jax.launch`` (or a cluster) for its workers: a
# subprocess started by a test run under a launcher must not join that job.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT", "JAX_COORDINATOR_ADDRESS",
               "FSDP_JAX_DEVICES_PER_PROC", "FSDP_JAX_PLATFORM", "FSDP_JAX_LAUNCHED",
               "FSDP_JAX_PEER_TIMEOUT", "FSDP_JAX_RESTART_COUNT", "FSDP_JAX_MAX_RESTARTS")


def subprocess_env(**extra: str) -> dict:
  """This environment without the launcher's variables, with the repository
  first on PYTHONPATH, then ``extra``."""
  env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
  env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
  env.update(extra)
  return env


def compile_cache_env() -> dict:
  """Environment variables that give a subprocess the test run's JAX
  persistent compilation cache (conftest.py's directory): a restarted job,
  or a second process compiling the same program, reads what an earlier one
  compiled instead of compiling it again (one-process jobs: a multi-process
  job's programs get other keys at each start). Only for subprocesses whose
  test does not check compilation itself."""
  return {"JAX_COMPILATION_CACHE_DIR": os.environ["FSDP_JAX_TEST_COMPILATION_CACHE"],
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


class Background:
  """A command in the background, in its own process group, output to a log
  file (a pipe could fill up and stall it), with a hard timeout counted from
  its start; killed with its process group if still running at ``kill()``
  (launcher workers also die with their parent through PR_SET_PDEATHSIG)."""

  def __init__(self, cmd, log, timeout: float, env: dict | None = None, name: str | None = None):
    self.cmd = [str(c) for c in cmd]
    self.log_path = Path(log)
    self.name = name or self.log_path.stem
    self._log = open(self.log_path, "wb")
    self._start = time.monotonic()
    self.deadline = self._start + timeout
    self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=subprocess_env() if env is None else env,
                                 stdout=self._log, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    self.returncode = None
    self.seconds = None

  def wait(self) -> int:
    """The exit status; kills it and fails the test past the deadline."""
    if self.returncode is None:
      try:
        self.returncode = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        self.kill()
        pytest.fail(f"{self.name} timed out; output:\n{self.output()[-5000:]}")
      self.seconds = time.monotonic() - self._start
      self._log.close()
    return self.returncode

  def kill(self) -> None:
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, 9)
      self.proc.wait(timeout=30)
    self._log.close()

  def output(self) -> str:
    if not self._log.closed:
      self._log.flush()
    return self.log_path.read_text(errors="replace")

  def ok(self) -> str:
    """Waits; asserts exit status 0; returns the output."""
    self.wait()
    assert self.returncode == 0, (
        f"{self.name} exited with {self.returncode} after {self.seconds:.0f}s\n"
        f"command: {' '.join(self.cmd)}\noutput:\n{self.output()[-6000:]}")
    return self.output()


def collectives_per_call(plan, unit) -> tuple[int, int]:
  """``(all-gathers, reduce-scatters)`` that one gather and one gradient
  reduction of ``unit`` (one layer of a stacked unit) issue: one per dtype
  group, or one per leaf where leaves move on their own
  (``use_orig_params=True``)."""
  groups = plan.group_collectives(unit)
  return sum(g[2] for g in groups), sum(g[3] for g in groups)


def collective_sizes(plan, unit) -> list[int]:
  """Elements each all-gather of one gather of ``unit`` (one layer of a
  stacked unit) returns: the unit's padded buffer (flat layout), or each
  leaf padded along dim 0."""
  layers = unit.num_layers if unit.stacked else 1
  out = []
  for group, spec, gathers, _ in plan.group_collectives(unit):
    if gathers == 1:
      out.append(plan.n * spec.chunk)
    else:
      out += [plan.n * plan.chunk0(plan.leaves[i]) * plan.leaves[i].row_numel for i in group]
  assert layers >= 1
  return out


def shard_map_body(jaxpr):
  """The step's ``shard_map`` body (the per-device program) in ``jaxpr``."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "shard_map":
      return eqn.params["jaxpr"]
  for sub in jax.extend.core.subjaxprs(jaxpr):
    found = shard_map_body(sub)
    if found is not None:
      return found
  return None
