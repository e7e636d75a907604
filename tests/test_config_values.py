"""Policies are values: configs, wrap policies, mixed precision, offload,
quantization and hooks built separately from the same options are equal,
hash equal, and work together; ``shard_train_step`` takes its mesh and config
from the state when they are not given."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from tests.helpers import (assert_trees_close, mlp_batch, mlp_loss, mlp_params,
                           reference_run, train_steps)


def _full_config(policy):
  return fsdp_jax.FSDPConfig(
      sharding_strategy=fsdp_jax.ShardingStrategy.FULL_SHARD,
      auto_wrap_policy=policy(),
      mixed_precision=fsdp_jax.MixedPrecision(param_dtype=jnp.float32,
                                              reduce_dtype=jnp.float32),
      cpu_offload=fsdp_jax.CPUOffload(offload_params=False),
      ignored_states=["out.b"],
      stacked_layers=["stack"],
      comm_hook=fsdp_jax.hooks.LowPrecisionHook(dtype=jnp.float32),
      forward_prefetch_units={"blocks.0": ["blocks.1"]},
      all_gather_quantization=None,
      activation_checkpointing=fsdp_jax.ActivationCheckpointing("dots", units=["blocks.*"]),
  )


POLICIES = {
    "module_wrap": lambda: fsdp_jax.ModuleWrapPolicy({"blocks.*", "inp"}),
    "size_based_partial": lambda: functools.partial(
        fsdp_jax.size_based_auto_wrap_policy, min_num_params=20),
    "lambda_partial": lambda: functools.partial(
        fsdp_jax.lambda_auto_wrap_policy, lambda_fn=_is_block),
    "custom": lambda: fsdp_jax.CustomPolicy(_is_block),
}


def _is_block(node):
  return node.name.startswith("blocks.")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_separately_built_configs_are_equal_and_hash_equal(name):
  a, b = _full_config(POLICIES[name]), _full_config(POLICIES[name])
  assert a is not b and a.auto_wrap_policy is not b.auto_wrap_policy
  assert a == b
  assert hash(a) == hash(b)
  assert len({a, b}) == 1


def test_a_differing_field_makes_configs_unequal():
  base = dict(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({"blocks.*", "inp"}),
              mixed_precision=fsdp_jax.MixedPrecision(param_dtype=jnp.float32),
              ignored_states=["out.b"],
              comm_hook=fsdp_jax.hooks.LowPrecisionHook(dtype=jnp.float32),
              forward_prefetch_units={"blocks.0": ["blocks.1"]})
  changes = {
      "sharding_strategy": fsdp_jax.ShardingStrategy.SHARD_GRAD_OP,
      "auto_wrap_policy": fsdp_jax.ModuleWrapPolicy({"blocks.*"}),
      "mixed_precision": fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16),
      "ignored_states": ["inp.w"],
      "comm_hook": fsdp_jax.hooks.LowPrecisionHook(dtype=jnp.bfloat16),
      "forward_prefetch_units": {"blocks.0": ["blocks.2"]},
      "nonfinite": "skip",
      "activation_checkpointing": fsdp_jax.ActivationCheckpointing("full"),
  }
  assert fsdp_jax.FSDPConfig(**base) == fsdp_jax.FSDPConfig(**base)
  for field, value in changes.items():
    assert fsdp_jax.FSDPConfig(**{**base, field: value}) != fsdp_jax.FSDPConfig(**base), field


def test_policies_compare_by_value():
  assert fsdp_jax.ModuleWrapPolicy({"a", "b"}) == fsdp_jax.ModuleWrapPolicy(["b", "a"])
  assert hash(fsdp_jax.ModuleWrapPolicy({"a", "b"})) == hash(fsdp_jax.ModuleWrapPolicy(("b", "a")))
  assert fsdp_jax.ModuleWrapPolicy({"a"}) != fsdp_jax.ModuleWrapPolicy({"b"})
  assert fsdp_jax.CustomPolicy(_is_block) == fsdp_jax.CustomPolicy(_is_block)
  # Two different functions are two policies, whatever they compute.
  assert fsdp_jax.CustomPolicy(_is_block) != fsdp_jax.CustomPolicy(lambda n: _is_block(n))
  size = lambda n: functools.partial(fsdp_jax.size_based_auto_wrap_policy, min_num_params=n)
  assert fsdp_jax.FSDPConfig(auto_wrap_policy=size(10)) == fsdp_jax.FSDPConfig(
      auto_wrap_policy=size(10))
  assert fsdp_jax.FSDPConfig(auto_wrap_policy=size(10)) != fsdp_jax.FSDPConfig(
      auto_wrap_policy=size(11))


def test_dtype_spellings_are_one_value():
  a = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16)
  b = fsdp_jax.MixedPrecision(param_dtype="bfloat16")
  c = fsdp_jax.MixedPrecision(param_dtype=np.dtype(jnp.bfloat16))
  assert a == b == c and hash(a) == hash(b) == hash(c)
  h1 = fsdp_jax.FSDPConfig(comm_hook=fsdp_jax.hooks.LowPrecisionHook(dtype=jnp.bfloat16))
  h2 = fsdp_jax.FSDPConfig(comm_hook=fsdp_jax.hooks.LowPrecisionHook(dtype=jnp.dtype("bfloat16")))
  assert h1 == h2 and hash(h1) == hash(h2)


@pytest.mark.parametrize("cls", [fsdp_jax.FSDPConfig, fsdp_jax.MixedPrecision,
                                 fsdp_jax.CPUOffload, fsdp_jax.Quantization])
def test_configs_are_keyword_only_and_frozen(cls):
  with pytest.raises(TypeError):
    cls(None)
  obj = cls()
  with pytest.raises(dataclasses.FrozenInstanceError):
    setattr(obj, dataclasses.fields(cls)[0].name, None)


def _ref(batches):
  return reference_run(mlp_loss, mlp_params(), batches, optax.adam(1e-2))


@pytest.mark.slow
@pytest.mark.parametrize("n", [4, 3])
@pytest.mark.parametrize("name", ["module_wrap", "size_based_partial", "custom"])
def test_init_and_step_with_separately_built_configs(n, name):
  """The case that used to raise "different FSDPConfig": one config object for
  init_train_state, another (equal) one for shard_train_step."""
  mesh = fsdp_jax.make_mesh(shard=n, devices=jax.devices()[:n])
  make = lambda: fsdp_jax.FSDPConfig(auto_wrap_policy=POLICIES[name]())
  opt = optax.adam(1e-2)
  batches = [mlp_batch(seed=s) for s in range(3)]
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh,
                                    config=make())
  assert len(state.plan.units) > 1  # the policy wrapped something
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=make())
  state, losses = train_steps(step, state, batches)
  ref_losses, ref_params = _ref(batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params)


@pytest.mark.parametrize("n", [4, 3])
def test_step_takes_mesh_and_config_from_the_state(n):
  mesh = fsdp_jax.make_mesh(shard=n, devices=jax.devices()[:n])
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=POLICIES["module_wrap"](),
                               sharding_strategy=fsdp_jax.ShardingStrategy.SHARD_GRAD_OP)
  opt = optax.adam(1e-2)
  batches = [mlp_batch(seed=s) for s in range(3)]
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh,
                                    config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt)
  state, losses = train_steps(step, state, batches)
  ref_losses, ref_params = _ref(batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params)


def test_a_step_given_another_config_or_mesh_names_both():
  mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh,
                                    config=fsdp_jax.FSDPConfig())
  other = fsdp_jax.FSDPConfig(sharding_strategy=fsdp_jax.ShardingStrategy.SHARD_GRAD_OP)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, config=other)
  with pytest.raises(ValueError, match="different FSDPConfig(.|\n)*SHARD_GRAD_OP"):
    step(state, mlp_batch())
  other_mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=other_mesh)
  with pytest.raises(ValueError, match="mesh"):
    step(state, mlp_batch())
  with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
    fsdp_jax.shard_train_step(mlp_loss, opt, mesh={"shard": 4})


@pytest.mark.parametrize("cls", [fsdp_jax.FSDPConfig, fsdp_jax.MixedPrecision,
                                 fsdp_jax.CPUOffload, fsdp_jax.Quantization,
                                 fsdp_jax.ActivationCheckpointing])
def test_every_field_is_documented(cls):
  import inspect  # pylint: disable=import-outside-toplevel
  doc = inspect.getdoc(cls)
  missing = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")
             and f"{f.name}:" not in doc and f"``{f.name}``" not in doc]
  assert not missing, f"{cls.__name__}'s docstring does not describe {missing}"
