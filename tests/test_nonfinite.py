"""Non-finite steps: every step reports the global gradient norm and a
``nonfinite`` flag; ``FSDPConfig(nonfinite=...)`` propagates, skips (state
bitwise unchanged, counted) or raises (naming the step and the first
parameter), the same way on every device, under every strategy and under
gradient accumulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax import ShardingStrategy as S

from helpers import mesh_for, mlp_batch, mlp_loss, mlp_params

WRAP = fsdp_jax.ModuleWrapPolicy(["blocks.*"])
CASES = [(S.FULL_SHARD, 3, None), (S.SHARD_GRAD_OP, 4, None), (S.NO_SHARD, 2, None),
         (S.HYBRID_SHARD, 3, 2), (S._HYBRID_SHARD_ZERO2, 2, 2)]


def _id(case):
  s, n, r = case
  return f"{s.name}-{r}x{n}" if r else f"{s.name}-{n}"


def _bad_batch(seed=7, row=0):
  """A batch whose row ``row`` has a NaN input: its loss and gradients are NaN."""
  b = mlp_batch(seed=seed)
  x = np.asarray(b["x"]).copy()
  x[row, 0] = np.nan
  return {"x": jnp.asarray(x), "y": b["y"]}


def _bitwise(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _build(case, use_orig_params, nonfinite, opt=None, **step_kw):
  strategy, n, r = case
  opt = opt or optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
  mesh = mesh_for(strategy, n, r)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP,
                               use_orig_params=use_orig_params, nonfinite=nonfinite)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config, donate=False,
                                   **step_kw)
  return state, step, opt


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_metrics_report_the_global_norm(case):
  state, step, opt = _build(case, False, "propagate")
  batch = mlp_batch(seed=3)
  _, metrics = step(state, batch)
  grads = jax.grad(mlp_loss)(mlp_params(), batch)
  np.testing.assert_allclose(float(metrics["grad_norm"]), float(optax.tree.norm(grads)),
                             rtol=1e-5)
  assert metrics["nonfinite"].dtype == jnp.bool_ and not bool(metrics["nonfinite"])


# Every strategy (where the flag is agreed on: shards, replicas), each in
# one layout, alternating, so that both layouts skip (their optimizer
# states differ) on 1-D and 2-D meshes.
SKIP_RUNS = [(case, i % 2 == 0) for i, case in enumerate(CASES)]


@pytest.mark.slow
@pytest.mark.parametrize("case,use_orig_params", SKIP_RUNS,
                         ids=[f"{_id(c)}-{'orig' if o else 'flat'}" for c, o in SKIP_RUNS])
def test_skip_leaves_the_state_bitwise_unchanged(case, use_orig_params):
  state, step, _ = _build(case, use_orig_params, "skip")
  state, _ = step(state, mlp_batch(seed=1))
  before = state
  after, metrics = step(state, _bad_batch())
  assert bool(metrics["nonfinite"]) and not np.isfinite(float(metrics["grad_norm"]))
  _bitwise((after.params, after.opt_state, after.step), (before.params, before.opt_state, before.step))
  assert int(after.nonfinite_steps) == 1 and int(after.step) == 1
  # Training goes on as if the bad batch had never come.
  resumed, m1 = step(after, mlp_batch(seed=2))
  clean, m2 = step(before, mlp_batch(seed=2))
  _bitwise((resumed.params, resumed.opt_state, resumed.step),
           (clean.params, clean.opt_state, clean.step))
  assert not bool(m1["nonfinite"]) and int(resumed.nonfinite_steps) == 1


def test_propagate_is_the_default_and_applies_the_update():
  """The default behaves as unsharded training does: the NaN reaches the
  parameters, and the step says so."""
  assert fsdp_jax.FSDPConfig().nonfinite == "propagate"
  state, step, _ = _build((S.FULL_SHARD, 3, None), False, "propagate", opt=optax.adam(1e-2))
  assert state.nonfinite_steps is None
  after, metrics = step(state, _bad_batch())
  assert bool(metrics["nonfinite"]) and int(after.step) == 1
  full = fsdp_jax.summon_full_params(after)
  assert not all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(full))


def _one_bad_leaf_loss(params, batch):
  """Finite loss; the gradient of ``blocks.1.b`` alone is inf where a row of
  ``z`` is 0 (d/db sqrt(|b * z|) at 0)."""
  base = mlp_loss(params, batch)
  b = params["blocks"][1]["b"]
  return base + jnp.mean(jnp.sqrt(jnp.abs(batch["z"][:, :1] * b[None, :])))


@pytest.mark.slow
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_raise_names_the_step_and_the_parameter(use_orig_params):
  opt = optax.adam(1e-2)
  mesh = mesh_for(S.FULL_SHARD, 3)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, use_orig_params=use_orig_params,
                               nonfinite="raise")
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(_one_bad_leaf_loss, opt, mesh=mesh, config=config)
  good = dict(mlp_batch(seed=1), z=jnp.ones((24, 1)))
  state, metrics = step(state, good)
  assert "nonfinite_leaves" not in metrics
  before = jax.tree.map(np.asarray, (state.params, state.opt_state))
  z = np.ones((24, 1), np.float32)
  z[5] = 0.0
  with pytest.raises(fsdp_jax.NonFiniteError) as e:
    step(state, dict(mlp_batch(seed=2), z=jnp.asarray(z)))
  msg = str(e.value)
  assert msg.startswith("Step 1: non-finite gradients")
  assert "'blocks.1.b'" in msg and "Fix:" in msg
  assert e.value.parameters == ["blocks.1.b"] and e.value.step == 1
  _bitwise((e.value.state.params, e.value.state.opt_state), before)
  assert int(e.value.state.step) == 1


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", ["no_sync", "sharded"])
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_skip_under_gradient_accumulation(accumulation, use_orig_params):
  """A NaN in one microbatch skips the whole step."""
  state, step, _ = _build((S.FULL_SHARD, 3, None), use_orig_params, "skip",
                          gradient_accumulation_steps=2, accumulation=accumulation)
  after, metrics = step(state, _bad_batch(row=1))  # row 1: device 0, microbatch 0
  assert bool(metrics["nonfinite"])
  _bitwise((after.params, after.opt_state, after.step), (state.params, state.opt_state, state.step))
  assert int(after.nonfinite_steps) == 1


def test_every_device_decides_the_same_with_ignored_states():
  """An ignored parameter's gradient is per device: a NaN on one device's
  copy makes every device skip (one flag, agreed over the data axes)."""
  opt = optax.adam(1e-2)
  mesh = mesh_for(S.FULL_SHARD, 4)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, ignored_states=["blocks.1.b"],
                               nonfinite="skip")
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(_one_bad_leaf_loss, opt, mesh=mesh, config=config,
                                   donate=False)
  z = np.ones((24, 1), np.float32)
  z[20] = 0.0  # only the last device's rows
  after, metrics = step(state, dict(mlp_batch(seed=2), z=jnp.asarray(z)))
  assert bool(metrics["nonfinite"])
  _bitwise((after.params, after.opt_state), (state.params, state.opt_state))


def test_offloaded_skip_keeps_the_host_state():
  opt = optax.adam(1e-2)
  mesh = mesh_for(S.FULL_SHARD, 3)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, nonfinite="skip",
                               cpu_offload=fsdp_jax.CPUOffload(offload_params=True))
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config, donate=False)
  after, metrics = step(state, _bad_batch())
  assert bool(metrics["nonfinite"])
  _bitwise((after.params, after.opt_state), (state.params, state.opt_state))
  assert {x.sharding.memory_kind for x in jax.tree.leaves(after.params)} == {"pinned_host"}


def test_global_update_mode_skips_too():
  mesh = mesh_for(S.FULL_SHARD, 3)
  opt = optax.adamw(1e-2)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, nonfinite="skip", optimizer_update="global")
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config, donate=False)
  after, metrics = step(state, _bad_batch())
  assert bool(metrics["nonfinite"])
  _bitwise((after.params, after.opt_state), (state.params, state.opt_state))


def test_nonfinite_is_checked():
  with pytest.raises(ValueError, match="nonfinite='ignore'.*'propagate'"):
    fsdp_jax.FSDPConfig(nonfinite="ignore")
