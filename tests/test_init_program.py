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
from fsdp_jax._src import unit_init
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


# Each strategy case once, a BatchNorm's statistics (model state: one more
# program) in two of them, both layouts and a 2-D mesh among them.
@pytest.mark.parametrize("strategy,n,use_orig,norm", [
    (S.FULL_SHARD, 4, False, False),
    pytest.param(S.FULL_SHARD, 3, True, True, marks=pytest.mark.slow),
    pytest.param(S.HYBRID_SHARD, 4, False, True, marks=pytest.mark.slow),
    pytest.param(S.NO_SHARD, 2, False, False, marks=pytest.mark.slow)],
    ids=["full-4-params", "full-3-orig-with_batch_stats", "hybrid-2x2-with_batch_stats",
         "no_shard-2-params"])
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
  peak = unit_init.init_program(plan, init_fn, (rng,)).peak_bytes(rng)
  model_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  unit_bytes = (2 * D * H + D + H + 2 * D) * 4
  shards = sum(plan.padded_numel(u) for u in plan.units) // 4 * 4  # float32, 1/4 each
  assert peak <= shards + 2 * unit_bytes, (peak, shards, unit_bytes, model_bytes)
  assert peak < 0.6 * model_bytes, (peak, model_bytes)


def _state_and_program(init_fn, rng, mesh, policy, use_orig=False):
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=policy, use_orig_params=use_orig)
  state = fsdp_jax.init_train_state(init_fn=init_fn, rng=rng, optimizer=optax.sgd(0.1),
                                    mesh=mesh, config=config)
  program = unit_init.init_program(state.plan, init_fn, (rng,))
  return state, program


@pytest.mark.parametrize("n,use_orig", [(4, False),
                                        pytest.param(3, False, marks=pytest.mark.llvm_optimized),
                                        (3, True)],
                         ids=["full-4", "full-3", "full-3-orig"])
def test_repeated_blocks_share_one_compiled_program(n, use_orig):
  """Six identical blocks (Flax folds each block's path into its key) share
  one program; the root unit has its own."""
  model = Model()
  init_fn, _ = _counted_init(model)
  rng = jax.random.key(3)
  mesh = fsdp_jax.make_mesh(shard=n, devices=jax.devices()[:n])
  state, program = _state_and_program(init_fn, rng, mesh, fsdp_jax.ModuleWrapPolicy({Block}),
                                      use_orig)
  assert len(state.plan.units) == BLOCKS + 1
  assert program.num_programs == 2
  expected = jax.jit(model.init)(rng, jnp.ones((2, D)))
  assert_trees_close(fsdp_jax.summon_full_params(state), expected, rtol=0, atol=0)


class ScaledBlock(nn.Module):
  scale: float
  width: int = D

  @nn.compact
  def __call__(self, x):
    y = nn.Dense(self.width, kernel_init=nn.initializers.normal(self.scale))(x)
    return x + nn.Dense(D)(y)


class Varied(nn.Module):
  """Blocks that differ from each other only in an initialiser's float
  constant, or in a width."""

  @nn.compact
  def __call__(self, x):
    for scale, width in [(0.02, D), (0.02, D), (0.5, D), (0.02, D), (0.02, 2 * D)]:
      x = ScaledBlock(scale, width)(x)
    return x


@pytest.mark.slow
@pytest.mark.llvm_optimized
def test_blocks_that_differ_in_a_float_constant_or_a_shape_get_their_own_program():
  model = Varied()
  rng = jax.random.key(5)
  init_fn = lambda k: model.init(k, jnp.ones((2, D)))
  mesh = fsdp_jax.make_mesh(shard=3, devices=jax.devices()[:3])
  state, program = _state_and_program(init_fn, rng, mesh, fsdp_jax.ModuleWrapPolicy({ScaledBlock}))
  # Five units (the root holds nothing) and three programs: 0.02 at width D
  # (three blocks), 0.5 at width D, 0.02 at width 2D.
  assert len(state.plan.units) == 5, [u.display_name for u in state.plan.units]
  assert program.num_programs == 3
  expected = jax.jit(init_fn)(rng)
  assert_trees_close(fsdp_jax.summon_full_params(state), expected, rtol=0, atol=0)
  # The 0.5 block really is drawn at its own scale.
  full = fsdp_jax.summon_full_params(state)["params"]
  assert float(jnp.std(full["ScaledBlock_2"]["Dense_0"]["kernel"])) > 0.3
  assert float(jnp.std(full["ScaledBlock_1"]["Dense_0"]["kernel"])) < 0.05


def test_a_hand_written_init_with_fold_in_and_a_raw_key():
  """``fold_in(rng, i)`` per block, on a raw ``PRNGKey``: the blocks share a
  program, and each gets its own numbers. (Uniform draws: jax 0.12's CPU
  ``erf_inv`` may differ in the last bit between a shard and the whole array,
  with or without sharing, so ``normal`` is compared through Flax above.)"""
  shapes = {"w": (D, 5), "b": (5,)}

  def init_fn(rng):
    return {f"block_{i}": {k: jax.random.uniform(jax.random.fold_in(rng, 10 * i + j), s)
                           for j, (k, s) in enumerate(shapes.items())}
            for i in range(4)}

  rng = jax.random.PRNGKey(1)
  mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
  state, program = _state_and_program(init_fn, rng, mesh, fsdp_jax.ModuleWrapPolicy(["block_*"]))
  assert [u.display_name for u in state.plan.units] == [f"block_{i}" for i in range(4)]
  assert program.num_programs == 1
  full = fsdp_jax.summon_full_params(state)
  assert_trees_close(full, jax.jit(init_fn)(rng), rtol=0, atol=0)
  assert not jnp.array_equal(full["block_0"]["w"], full["block_1"]["w"])


@pytest.mark.slow
@pytest.mark.llvm_optimized
def test_nnx_blocks_counted_keys_share_one_program():
  """NNX draws each parameter's key as ``fold_in(key, count)`` with a count
  it increments: the counts are worked out once, and the blocks share a
  program."""
  from flax import nnx

  class NnxBlock(nnx.Module):

    def __init__(self, rngs):
      self.a = nnx.Linear(D, 3 * D, rngs=rngs)
      self.b = nnx.Linear(3 * D, D, rngs=rngs)

  class NnxModel(nnx.Module):

    def __init__(self, rngs):
      blocks = [NnxBlock(rngs) for _ in range(4)]
      self.blocks = nnx.List(blocks) if hasattr(nnx, "List") else blocks

  init_fn = lambda k: nnx.state(NnxModel(nnx.Rngs(params=k)), nnx.Param)
  rng = jax.random.key(2)
  mesh = fsdp_jax.make_mesh(shard=3, devices=jax.devices()[:3])
  state, program = _state_and_program(init_fn, rng, mesh, fsdp_jax.ModuleWrapPolicy(["blocks.*"]))
  assert len(state.plan.units) == 4
  assert program.num_programs == 1
  full = jax.tree.leaves(fsdp_jax.summon_full_params(state))
  expected = jax.tree.leaves(jax.jit(init_fn)(rng))
  assert len(full) == len(expected) == 16
  for got, want in zip(full, expected):
    assert jnp.array_equal(got, want)
  assert not jnp.array_equal(full[1], full[5])  # the blocks' first kernels
