"""Checkpoints and state dicts of states using frozen parameters, ignored
states and model state: save, restore and continue bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax import ShardingStrategy as S

from helpers import mesh_for, mlp_batch, mlp_loss, mlp_params

# Training, saving and restoring whole states is slow; the state dicts run
# in the fast subset.

def loss_with_state(params, batch, model_state):
  return mlp_loss(params, batch), {"steps": model_state["steps"] + 1.0}


def _setup(use_orig_params, ignored=("out",)):
  params = mlp_params()
  mask = jax.tree.map(lambda _: True, params)
  mask["blocks"][1] = {"w": False, "b": False}
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["blocks.*"]),
                               use_orig_params=use_orig_params,
                               ignored_states=list(ignored) or None)
  mesh = mesh_for(S.FULL_SHARD, 4)
  opt = optax.adam(1e-2)
  make = lambda: fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config,
                                           requires_grad=mask,
                                           model_state={"steps": jnp.zeros(())})
  step = fsdp_jax.shard_train_step(loss_with_state, opt, mesh=mesh, config=config, donate=False)
  return make, step


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.slow
def test_resume_with_frozen_and_model_state_is_bitwise(use_orig_params, tmp_path):
  make, step = _setup(use_orig_params, ignored=())
  batches = [mlp_batch(seed=i) for i in range(4)]
  state = make()
  for b in batches[:2]:
    state, _ = step(state, b)
  with fsdp_jax.CheckpointManager(tmp_path) as manager:
    manager.save(state)
    manager.wait_until_finished()
    restored = manager.restore(make())
  for b in batches[2:]:
    state, m1 = step(state, b)
    restored, m2 = step(restored, b)
    assert float(m1["loss"]) == float(m2["loss"])
  exact = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  jax.tree.map(exact, restored.params, state.params)
  jax.tree.map(exact, restored.opt_state, state.opt_state)
  assert float(restored.model_state["steps"]) == 4.0


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.slow
def test_checkpoint_keeps_one_copy_of_ignored_states(use_orig_params, tmp_path):
  """Every device trains its own copy of an ignored parameter; a checkpoint
  keeps the first device's copy (PyTorch saves rank 0's), and restoring gives
  every device that copy, optimizer moments included."""
  make, step = _setup(use_orig_params)
  state = make()
  for i in range(2):
    state, _ = step(state, mlp_batch(seed=i))
  key = lambda t: t["out"]["w"] if use_orig_params else t["out.w"]
  copies = np.asarray(key(state.params))
  assert np.max(np.abs(copies[0] - copies[1])) > 1e-5  # the copies differ
  with fsdp_jax.CheckpointManager(tmp_path) as manager:
    manager.save(state)
    manager.wait_until_finished()
    restored = manager.restore(make())
  got = np.asarray(key(restored.params))
  for d in range(got.shape[0]):
    np.testing.assert_array_equal(got[d], copies[0])
  mu = np.asarray(key(restored.opt_state.slots["0.mu"]))
  np.testing.assert_array_equal(mu[1], np.asarray(key(state.opt_state.slots["0.mu"]))[0])
  # The managed parameters restore exactly.
  exact = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  jax.tree.map(exact, fsdp_jax.summon_full_params(restored)["blocks"],
               fsdp_jax.summon_full_params(state)["blocks"])
  restored, metrics = step(restored, mlp_batch(seed=5))
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_state_dicts_with_frozen_and_ignored(use_orig_params):
  make, step = _setup(use_orig_params)
  state, _ = step(make(), mlp_batch())
  full = fsdp_jax.state_dict(state, state_dict_type=fsdp_jax.StateDictType.FULL_STATE_DICT)
  # Every parameter by its dotted name; the ignored one is the first device's copy.
  assert {"inp.w", "blocks.1.w", "out.w"} <= set(full)
  np.testing.assert_array_equal(np.asarray(full["out.w"]),
                                np.asarray(fsdp_jax.summon_full_params(state)["out"]["w"]))
  osd = fsdp_jax.optim_state_dict(state)
  # No optimizer state for the frozen block; the ignored leaf has its own.
  assert "blocks.1.w" not in osd["state"] and "out.w" in osd["state"]
  fresh = make()
  loaded = fsdp_jax.load_state_dict(fresh, full)
  loaded = loaded.replace(opt_state=fsdp_jax.optim_state_dict_to_load(loaded, osd))
  exact = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  jax.tree.map(exact, fsdp_jax.summon_full_params(loaded), fsdp_jax.summon_full_params(state))
  # The loaded state's dicts are the dicts it was loaded from (the ignored
  # leaf's per-device moments become the first device's, as PyTorch loads
  # rank 0's on every rank).
  jax.tree.map(exact, fsdp_jax.optim_state_dict(loaded), osd)
