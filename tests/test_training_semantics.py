"""Gradient accumulation, clipping, full-parameter access and custom steps."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_jax
from fsdp_jax import hlo
from fsdp_jax import ShardingStrategy as S

from helpers import (assert_trees_close, mesh_for, mlp_batch, mlp_loss, mlp_params,
                     reference_run, train_steps)

WRAP_BLOCKS = fsdp_jax.ModuleWrapPolicy(["blocks.*"])


@functools.cache  # the same batches and unsharded run for every case below
def _accumulation_reference():
  batches = [mlp_batch(seed=i, n=48) for i in range(2)]
  return (batches,) + tuple(reference_run(mlp_loss, mlp_params(), batches,
                                          optax.sgd(0.1, momentum=0.9)))


# Every k with both accumulations, each accumulation in both layouts. SGD
# with momentum, not Adam: Adam's update does not change when every gradient
# is scaled by the same factor, so it would not see microbatch gradients
# summed instead of averaged.
@pytest.mark.slow
@pytest.mark.parametrize("k,accumulation,use_orig_params", [
    (2, "no_sync", False), (2, "sharded", True), (3, "no_sync", True),
    (3, "sharded", False), (4, "no_sync", False), (4, "sharded", True)])
def test_accumulation_equals_one_step(k, accumulation, use_orig_params):
  params = mlp_params()
  batches, ref_losses, ref_final = _accumulation_reference()
  mesh = mesh_for(S.FULL_SHARD, 4)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS, use_orig_params=use_orig_params)
  opt = optax.sgd(0.1, momentum=0.9)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config,
                                   gradient_accumulation_steps=k, accumulation=accumulation)
  state, losses = train_steps(step, state, batches)
  np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_final, rtol=1e-5)


def _reductions(accumulation, k, strategy=S.FULL_SHARD):
  mesh = mesh_for(strategy, 4)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP_BLOCKS)
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config,
                                   gradient_accumulation_steps=k, accumulation=accumulation)
  text = step.lower(state, mlp_batch(n=48)).compile().as_text()
  kind = "all-reduce" if strategy is S.NO_SHARD else "reduce-scatter"
  # Gradient operands only (XLA may combine the scalar loss mean into the
  # same all-reduce instruction).
  colls = [c for c in hlo.collectives(text) if c.kind == kind]
  grads = lambda c: sum(1 for s in c.shapes if s != ())
  loops = hlo.loop_bodies(text)
  in_loop = sum(grads(c) for c in colls if c.computation in loops)
  total = sum(grads(c) for c in colls)
  return len(state.plan.units), in_loop, total


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [S.FULL_SHARD, S.NO_SHARD])
def test_no_sync_reduces_once_per_unit_per_step(strategy):
  units, in_loop, total = _reductions("no_sync", 3, strategy)
  assert in_loop == 0 and total == units


def test_sharded_accumulation_reduces_every_microbatch():
  units, in_loop, total = _reductions("sharded", 3)
  # One reduce-scatter per unit inside the microbatch loop (run k times), none outside.
  assert in_loop == units and total == units


def test_microbatches_must_divide_the_local_batch():
  mesh = mesh_for(S.FULL_SHARD, 4)
  config = fsdp_jax.FSDPConfig()
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config,
                                   gradient_accumulation_steps=4)
  with pytest.raises(ValueError, match=r"local batch has 6 rows.*gradient_accumulation_steps=4"):
    step(state, mlp_batch(n=24))


def test_clipping_with_non_positive_max_norm():
  mesh = mesh_for(S.FULL_SHARD, 2)
  with pytest.raises(ValueError, match="max_norm=0.0 must be positive"):
    fsdp_jax.shard_train_step(mlp_loss, optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig(),
                              max_norm=0.0)
  with pytest.raises(ValueError, match="max_norm=-1.0 must be positive"):
    fsdp_jax.custom.clip_grad_norm({}, plan=None, max_norm=-1.0)


# A power sum (2 or 3: the same reduction) on every strategy, the maximum
# (inf) on both that hold replicas; 3 on the one without.
@pytest.mark.slow
@pytest.mark.parametrize("strategy,n,r,norm_type", [
    (S.NO_SHARD, 4, None, 2.0), (S.NO_SHARD, 4, None, float("inf")),
    (S.HYBRID_SHARD, 2, 2, 3.0), (S.HYBRID_SHARD, 2, 2, float("inf")),
    (S.FULL_SHARD, 3, None, 3.0)])
def test_clip_counts_replicated_gradients_once(strategy, n, r, norm_type):
  """The norm over NO_SHARD's replicated gradients, or HYBRID's replicas,
  equals the single-device norm of the full gradient."""
  params, batch = mlp_params(), mlp_batch()
  mesh = mesh_for(strategy, n, r)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP_BLOCKS)
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config, max_norm=1e-3,
                                   norm_type=norm_type)
  state, metrics = step(state, batch)
  grads = jax.tree.leaves(jax.grad(mlp_loss)(params, batch))
  if np.isinf(norm_type):
    expected = max(float(jnp.max(jnp.abs(g))) for g in grads)
  else:
    expected = float(sum(jnp.sum(jnp.abs(g) ** norm_type) for g in grads)) ** (1 / norm_type)
  np.testing.assert_allclose(float(metrics["grad_norm"]), expected, rtol=1e-5)
  # Clipped to max_norm: SGD moved the parameters by exactly lr * max_norm.
  delta = jax.tree.map(lambda a, b: a - b, fsdp_jax.summon_full_params(state), params)
  leaves = jax.tree.leaves(delta)
  if np.isinf(norm_type):
    moved = max(float(jnp.max(jnp.abs(d))) for d in leaves)
  else:
    moved = float(sum(jnp.sum(jnp.abs(d) ** norm_type) for d in leaves)) ** (1 / norm_type)
  # (new - old parameters of size ~0.5 differing by ~1e-5 loses ~3 digits in
  # float32: the check is on the clip coefficient, not on rounding.)
  np.testing.assert_allclose(moved, 0.1 * 1e-3 * expected / (expected + 1e-6), rtol=2e-3)


# --------------------------------------------------------------------------
# Full-parameter access


STRATEGY_CASES = [(S.FULL_SHARD, 3, None), (S.SHARD_GRAD_OP, 4, None), (S.NO_SHARD, 2, None),
                  (S.HYBRID_SHARD, 2, 2), (S._HYBRID_SHARD_ZERO2, 4, 2)]


@pytest.mark.slow
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("strategy,n,r", STRATEGY_CASES)
def test_full_param_access_and_write_back_round_trip(strategy, n, r, use_orig_params):
  params = mlp_params()
  mesh = mesh_for(strategy, n, r)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP_BLOCKS,
                               use_orig_params=use_orig_params)
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.adam(1e-3), mesh=mesh,
                                    config=config)
  exact = lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  host = fsdp_jax.summon_full_params(state, offload_to_cpu=True, rank0_only=True)
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(host))
  jax.tree.map(exact, host, params)
  # Write-back of the identity changes no stored bit, padding included.
  before = jax.tree.map(np.asarray, state.params)
  state2 = fsdp_jax.write_full_params(state, lambda p: p)
  jax.tree.map(exact, state2.params, before)
  # A real write-back lands exactly, and so does apply().
  state3 = fsdp_jax.write_full_params(state2, lambda p: jax.tree.map(lambda x: 2 * x + 1, p))
  jax.tree.map(exact, fsdp_jax.summon_full_params(state3), jax.tree.map(lambda x: 2 * x + 1, params))
  state4 = fsdp_jax.apply(state3, lambda name, x: jnp.zeros_like(x) if name.endswith(".b") else x)
  full4 = fsdp_jax.summon_full_params(state4)
  for i in range(3):
    exact(full4["blocks"][i]["b"], np.zeros(7))
    exact(full4["blocks"][i]["w"], 2 * params["blocks"][i]["w"] + 1)
  for x, spec in zip(jax.tree.leaves(state4.params),
                     jax.tree.leaves(fsdp_jax.custom.param_specs(state.plan))):
    assert x.sharding.spec == spec  # still sharded as the plan says


def test_full_grads_with_summon():
  params, batch = mlp_params(), mlp_batch()
  mesh = mesh_for(S.FULL_SHARD, 4)
  for orig in (False, True):
    config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS, use_orig_params=orig)
    state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                      config=config)
    grads = fsdp_jax.custom.sharded_grads(mlp_loss, state, batch)
    full, full_grads = fsdp_jax.summon_full_params(state, with_grads=True, grads=grads)
    assert_trees_close(full_grads, jax.grad(mlp_loss)(params, batch), rtol=1e-5)
  with pytest.raises(ValueError, match="with_grads=True\\) needs grads="):
    fsdp_jax.summon_full_params(state, with_grads=True)


def test_write_back_with_rank0_only_is_refused():
  mesh = mesh_for(S.FULL_SHARD, 2)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig())
  with pytest.raises(ValueError, match="rank0_only=True\\) is not supported"):
    fsdp_jax.write_full_params(state, lambda p: p, rank0_only=True)
  with pytest.raises(ValueError, match="shape"):
    fsdp_jax.write_full_params(state, lambda p: jax.tree.map(lambda x: x[:1], p))


def test_sync_module_states_single_process_is_a_no_op():
  params = mlp_params()
  mesh = mesh_for(S.FULL_SHARD, 4)
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig(sync_module_states=True))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               fsdp_jax.summon_full_params(state), params)


# --------------------------------------------------------------------------
# A custom step from the building blocks (docs/custom_step.md)


@pytest.mark.slow
def test_custom_step_with_two_losses_and_ema():
  """Two losses, gradient clipping and an EMA of the weights, written with
  fsdp_jax's building blocks; checked against the same math unsharded."""
  params, batches = mlp_params(), [mlp_batch(seed=i) for i in range(3)]
  mesh = mesh_for(S.FULL_SHARD, 4)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS)
  opt = optax.adam(1e-2)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  plan = state.plan

  def l2_loss(p, batch):
    del batch
    return 1e-3 * sum(jnp.sum(x ** 2) for x in jax.tree.leaves(p))

  vg_main = fsdp_jax.custom.value_and_grad(mlp_loss, plan=plan)
  vg_reg = fsdp_jax.custom.value_and_grad(l2_loss, plan=plan)
  p_specs = fsdp_jax.custom.param_specs(plan)
  o_specs, _ = fsdp_jax.custom.opt_state_specs(plan, opt)

  @functools.partial(jax.jit, compiler_options=fsdp_jax.custom.compiler_options(mesh))
  def custom_step(params, opt_state, ema, batch):
    def body(params, opt_state, ema, batch):
      out1, g1, _ = vg_main(params, batch)
      out2, g2, _ = vg_reg(params, batch)
      grads = jax.tree.map(jnp.add, g1, g2)
      grads, norm = fsdp_jax.custom.clip_grad_norm(grads, plan=plan, max_norm=0.5)
      params, opt_state = fsdp_jax.custom.optimizer_step(opt, grads, opt_state, params, plan=plan)
      ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, ema, params)  # sharded EMA
      loss = jax.lax.pmean(out1.loss + out2.loss, plan.axes.data_axes)
      return params, opt_state, ema, loss, norm

    return jax.shard_map(body, mesh=mesh,
                         in_specs=(p_specs, o_specs, p_specs, fsdp_jax.custom.batch_spec(plan)),
                         out_specs=(p_specs, o_specs, p_specs, P(), P()),
                         check_vma=False)(params, opt_state, ema, batch)

  p, o, ema = state.params, state.opt_state, state.params
  ref_p, ref_o, ref_ema = params, opt.init(params), params
  for batch in batches:
    p, o, ema, loss, norm = custom_step(p, o, ema, batch)
    total = lambda q: mlp_loss(q, batch) + l2_loss(q, batch)
    ref_loss, g = jax.value_and_grad(total)(ref_p)
    ref_norm = float(sum(jnp.sum(x ** 2) for x in jax.tree.leaves(g))) ** 0.5
    g = jax.tree.map(lambda x: x * min(0.5 / (ref_norm + 1e-6), 1.0), g)
    u, ref_o = opt.update(g, ref_o, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
    ref_ema = jax.tree.map(lambda e, q: 0.9 * e + 0.1 * q, ref_ema, ref_p)
    np.testing.assert_allclose(float(loss), float(ref_loss), atol=1e-5)
    np.testing.assert_allclose(float(norm), ref_norm, rtol=1e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state.replace(params=p)), ref_p)
  assert_trees_close(fsdp_jax.summon_full_params(state.replace(params=ema)), ref_ema)


@jax.custom_vjp
def _doubled_grad(w):
  return w


_doubled_grad.defvjp(lambda w: (w, None), lambda _, ct: (2.0 * ct,))


@jax.custom_jvp
def _clipped_relu(w):
  return jnp.maximum(w, 0.0)


_clipped_relu.defjvp(lambda primals, tangents: (_clipped_relu(primals[0]),
                                                3.0 * tangents[0]))


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_custom_derivative_rules_on_parameters_are_kept(use_orig_params):
  """A jax.custom_vjp / custom_jvp function applied to a parameter keeps its
  rule in the step (its parameters are gathered before it; its body is not
  differentiated in its place)."""
  def loss_fn(p, b):
    w = _doubled_grad(p["a"]["w"]) + _clipped_relu(p["b"]["w"])
    return jnp.mean((b["x"] @ w) ** 2)

  params = {"a": {"w": jnp.linspace(-1, 1, 12).reshape(4, 3)},
            "b": {"w": jnp.linspace(-0.5, 1, 12).reshape(4, 3)}}
  batches = [{"x": jnp.arange(16.0).reshape(4, 4) / 10}]
  ref_losses, ref_final = reference_run(loss_fn, params, batches, optax.sgd(0.1))
  mesh = mesh_for(S.FULL_SHARD, 2)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["a"]),
                               use_orig_params=use_orig_params)
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=config)
  step = fsdp_jax.shard_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, config=config)
  state, losses = train_steps(step, state, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_final, rtol=1e-6)
