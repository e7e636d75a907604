"""fsdp_jax on a mesh of one device: what a single-GPU user runs, and what
``benchmarks/gpu_session.sh`` checks on a GPU (there, this module runs with
``FSDP_JAX_TEST_DEVICES=native`` on the one GPU). The engine under every
strategy and layout, bf16 mixed precision, gradient clipping and
accumulation, CPU offload, a scan over stacked layers, state dicts and
checkpoints, each against unsharded single-device JAX or bitwise against
the same run uninterrupted."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax import ShardingStrategy as S
from fsdp_jax import hlo

from helpers import (assert_trees_close, jit_reference_run, mlp_batch, mlp_loss, mlp_params,
                     train_steps)

WRAP = fsdp_jax.ModuleWrapPolicy(["blocks.*"])
STEPS = 3

# Orbax's background threads may report a closed event loop.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _mesh():
  return fsdp_jax.make_mesh(shard=1, devices=jax.devices()[:1])


def _batches(n=STEPS, seed=10):
  return [mlp_batch(seed=seed + i) for i in range(n)]


def _run(config, optimizer, batches=None, loss_fn=mlp_loss, params=None, **step_kw):
  params = mlp_params() if params is None else params
  state = fsdp_jax.init_train_state(params=params, optimizer=optimizer, mesh=_mesh(),
                                    config=config)
  step = fsdp_jax.shard_train_step(loss_fn, optimizer, **step_kw)
  return train_steps(step, state, _batches() if batches is None else batches)


def _bitwise(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@functools.cache
def _adam_reference():
  """The single-device run every strategy and layout below reproduces."""
  return jit_reference_run(mlp_loss, mlp_params(), optax.adam(1e-2), _batches())


@pytest.mark.parametrize("use_orig_params", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["flat", "orig"])
@pytest.mark.parametrize("strategy", [S.FULL_SHARD,
                                      pytest.param(S.SHARD_GRAD_OP, marks=pytest.mark.slow),
                                      pytest.param(S.NO_SHARD, marks=pytest.mark.slow)],
                         ids=lambda s: s.name)
def test_strategies_match_unsharded_training(strategy, use_orig_params):
  opt = optax.adam(1e-2)
  ref_losses, ref_final = _adam_reference()
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP,
                               use_orig_params=use_orig_params)
  state, losses = _run(config, opt)
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_final)
  assert int(state.step) == STEPS


@pytest.mark.parametrize("strategy", [S.FULL_SHARD, S.HYBRID_SHARD], ids=lambda s: s.name)
def test_a_shard_group_of_one_is_not_resharded(strategy):
  """PyTorch FSDP runs FULL_SHARD on a world of one as NO_SHARD: a unit's
  "gather" over one device is its own copy, so nothing is freed after
  forward or gathered again in backward (and the step needs no remat)."""
  mesh = (_mesh() if strategy is S.FULL_SHARD else
          fsdp_jax.make_mesh(replicate=1, shard=1, devices=jax.devices()[:1]))
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP)
  opt = optax.adam(1e-2)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh,
                                    config=config)
  units = state.plan.units
  assert len(units) == 4 and not any(state.plan.reshard(u) or state.plan.regather(u)
                                     for u in units)
  assert state.plan.collectives_per_step()["all-gather"] == len(units)
  text = fsdp_jax.shard_train_step(mlp_loss, opt).lower(state, mlp_batch()).compile().as_text()
  # One gather per unit (the GPU compiler drops collectives over one device).
  assert len([c for c in hlo.collectives(text) if c.kind == "all-gather"]) <= len(units)


def test_clipping_and_accumulation_match_unsharded_training():
  """clip_grad_norm_ (max_norm) and no_sync accumulation over 2 microbatches:
  the reference clips the mean gradient of the whole batch."""
  ref_opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
  ref_losses, ref_final = jit_reference_run(mlp_loss, mlp_params(), ref_opt, _batches())
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP)
  state, losses = _run(config, optax.adam(1e-2), max_norm=0.5, gradient_accumulation_steps=2)
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_final)


def test_bf16_mixed_precision_matches_the_cast_reference():
  """param_dtype bf16, reduce_dtype fp32: fp32 masters, bf16 compute. The
  reference is the same program written by hand (cast the parameters and
  inputs to bf16 inside the loss)."""
  mp = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)

  def ref_loss(p, b):
    cast = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)
    return mlp_loss(cast(p), cast(b)).astype(jnp.float32)

  opt = optax.adam(1e-2)
  ref_losses, ref_final = jit_reference_run(ref_loss, mlp_params(), opt, _batches())
  state, losses = _run(fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, mixed_precision=mp), opt)
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
  # One device reduces nothing: what may differ is how XLA fuses the bf16
  # arithmetic (on CPU the runs agree to 3e-7). The loss, a bf16 number, may
  # move by one bf16 ulp; parameters get the suite's bf16 tolerance.
  np.testing.assert_allclose(losses, ref_losses, rtol=2 ** -7, atol=0)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_final, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("use_orig_params", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["flat", "orig"])
def test_cpu_offload_keeps_state_on_host_and_trains_like_on_device(use_orig_params):
  opt = optax.adam(1e-2)
  runs = {}
  for offload in (True, False):
    config = fsdp_jax.FSDPConfig(
        auto_wrap_policy=WRAP, use_orig_params=use_orig_params,
        cpu_offload=fsdp_jax.CPUOffload(offload_params=True) if offload else None)
    runs[offload] = _run(config, opt)
  state, losses = runs[True]
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"pinned_host"}
  assert {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)} == {"pinned_host"}
  np.testing.assert_allclose(losses, runs[False][1], rtol=0, atol=1e-6)
  assert_trees_close(fsdp_jax.summon_full_params(state),
                     fsdp_jax.summon_full_params(runs[False][0]), rtol=1e-6, atol=1e-7)


def test_scan_over_stacked_layers_matches_unsharded_training():
  rng = np.random.default_rng(3)
  params = {"embed": jnp.asarray(rng.normal(size=(5, 16)) * 0.3, jnp.float32),
            "blocks": {"w": jnp.asarray(rng.normal(size=(4, 16, 16)) * 0.3, jnp.float32),
                       "b": jnp.full((4, 16), 0.1, jnp.float32)},
            "head": jnp.asarray(rng.normal(size=(16, 3)) * 0.3, jnp.float32)}

  def loss_fn(p, batch):
    h = batch["x"] @ p["embed"]
    h, _ = jax.lax.scan(lambda h, blk: (jnp.tanh(h @ blk["w"] + blk["b"]), None), h,
                        p["blocks"])
    return jnp.mean((h @ p["head"] - batch["y"]) ** 2)

  opt = optax.adam(1e-2)
  ref_losses, ref_final = jit_reference_run(loss_fn, params, opt, _batches())
  config = fsdp_jax.FSDPConfig(stacked_layers=("blocks",))
  state, losses = _run(config, opt, loss_fn=loss_fn, params=params)
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_final)


def test_state_dicts_round_trip():
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP)
  state, _ = _run(config, optax.adam(1e-2))
  full = fsdp_jax.state_dict(state)
  assert set(full) == {"inp.w", "out.w"} | {f"blocks.{i}.{k}" for i in range(3) for k in "wb"}
  fresh = fsdp_jax.init_train_state(params=mlp_params(seed=5), optimizer=optax.adam(1e-2),
                                    mesh=_mesh(), config=config)
  loaded = fsdp_jax.load_state_dict(fresh, full)
  _bitwise(loaded.params, state.params)
  sharded = fsdp_jax.state_dict(state, state_dict_type=fsdp_jax.StateDictType.SHARDED_STATE_DICT)
  _bitwise(fsdp_jax.load_state_dict(
      fresh, sharded, state_dict_type=fsdp_jax.StateDictType.SHARDED_STATE_DICT).params,
           state.params)


def test_checkpoint_resume_is_bitwise_exact(tmp_path):
  """Save after 2 steps, restore into an abstract state (``jax.eval_shape``
  of the init), train 2 more: the same bits as training 4 steps without
  stopping."""
  opt = optax.adam(1e-2)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP)
  batches = _batches(4)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=_mesh(),
                                    config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt)
  state, _ = train_steps(step, state, batches[:2])
  with fsdp_jax.CheckpointManager(str(tmp_path / "ckpt")) as mngr:
    assert mngr.save(state)
  state, losses = train_steps(step, state, batches[2:])
  abstract = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      params=mlp_params(), optimizer=opt, mesh=_mesh(), config=config))
  with fsdp_jax.CheckpointManager(str(tmp_path / "ckpt"), read_only=True) as mngr:
    assert mngr.all_steps() == [2]
    restored = mngr.restore(abstract)
  assert int(restored.step) == 2
  restored, restored_losses = train_steps(step, restored, batches[2:])
  assert restored_losses == losses
  _bitwise(restored.params, state.params)
  _bitwise(restored.opt_state, state.opt_state)
