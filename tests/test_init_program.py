"""``init_train_state(init_fn=...)``: one trace and one program for all
units, the unsharded init's values, and about one unit in memory at a time
(benchmarks/INIT.md times it against a plain ``jax.jit`` init)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import fsdp_jax
from fsdp_jax._src import state as state_lib
from tests.helpers import assert_trees_close, mesh_for

D, H, BLOCKS = 64, 256, 6
S = fsdp_jax.ShardingStrategy


class Block(nn.Module):

  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(D)(jnp.tanh(nn.Dense(H)(nn.LayerNorm()(x))))


class Model(nn.Module):
  norm: bool = False  # a BatchNorm: a model state besides the parameters

  @nn.compact
  def __call__(self, x):
    for _ in range(BLOCKS):
      x = Block()(x)
    if self.norm:
      x = nn.BatchNorm(use_running_average=False)(x)
    return nn.Dense(1)(x)


def _counted_init(model):
  calls = []

  def init_fn(rng):
    calls.append(1)
    return model.init(rng, jnp.ones((2, D)))

  return init_fn, calls


@pytest.mark.parametrize("strategy,n,use_orig", [
    (S.FULL_SHARD, 4, False), (S.FULL_SHARD, 3, True), (S.HYBRID_SHARD, 4, False),
    (S.NO_SHARD, 2, False)], ids=["full-4", "full-3-orig", "hybrid-2x2", "no_shard-2"])
@pytest.mark.parametrize("norm", [False, True], ids=["params", "with_batch_stats"])
def test_values_match_the_unsharded_init_and_init_fn_is_traced_once(strategy, n, use_orig,
                                                                     norm):
  model = Model(norm=norm)
  init_fn, calls = _counted_init(model)
  replicate = 2 if strategy is S.HYBRID_SHARD else None
  mesh = mesh_for(strategy, n, replicate)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, use_orig_params=use_orig,
                               auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({Block}))
  state = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(3),
                                    optimizer=optax.adam(1e-3), mesh=mesh, config=config)
  assert len(state.plan.units) == BLOCKS + 1
  # One trace for every unit (a BatchNorm's statistics: one more program).
  assert len(calls) == (2 if norm else 1), len(calls)
  expected = jax.jit(model.init)(jax.random.key(3), jnp.ones((2, D)))
  assert_trees_close(fsdp_jax.summon_full_params(state), {"params": expected["params"]},
                     rtol=0, atol=0)
  if norm:
    assert_trees_close(state.model_state, {"batch_stats": expected["batch_stats"]},
                       rtol=0, atol=0)


def test_a_device_holds_about_one_unit_at_a_time():
  """Peak bytes per device of the init program: the stored shards (its
  outputs) and about one unit, far below the model."""
  model = Model()
  init_fn, _ = _counted_init(model)
  mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["params.Block_*"]))
  rng = jax.random.key(0)
  abstract = jax.eval_shape(init_fn, rng)
  plan = state_lib.build_plan(abstract, mesh=mesh, config=config)
  ma = state_lib.init_program(plan, init_fn, (rng,)).lower(rng).compile().memory_analysis()
  peak = ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
  model_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  unit_bytes = (2 * D * H + D + H + 2 * D) * 4
  shards = sum(plan.padded_numel(u) for u in plan.units) // 4 * 4  # float32, 1/4 each
  assert peak <= shards + 2 * unit_bytes, (peak, shards, unit_bytes, model_bytes)
  assert peak < 0.6 * model_bytes, (peak, model_bytes)
