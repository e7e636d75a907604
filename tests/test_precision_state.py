"""Mixed precision, model state, frozen parameters and communication hooks."""

from __future__ import annotations

import re

import flax.linen as nn
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
                     reference_run, shard_map_body, sharded_run, train_steps)

WRAP_BLOCKS = fsdp_jax.ModuleWrapPolicy(["blocks.*"])
BF16 = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32,
                               buffer_dtype=jnp.bfloat16)


# --------------------------------------------------------------------------
# What the loss function sees


def test_loss_sees_param_dtype_inputs_and_buffers():
  seen = {}

  def loss_fn(params, batch, model_state):
    seen["params"] = {jax.tree_util.keystr(p): x.dtype
                      for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    seen["x"], seen["ids"] = batch["x"].dtype, batch["ids"].dtype
    seen["buffer"] = model_state["count"].dtype
    return mlp_loss(params, batch), {"count": model_state["count"] + 1}

  mesh = mesh_for(S.FULL_SHARD, 4)
  config = fsdp_jax.FSDPConfig(mixed_precision=BF16, auto_wrap_policy=WRAP_BLOCKS)
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh, config=config,
                                    model_state={"count": jnp.zeros((), jnp.float32)})
  assert state.model_state["count"].dtype == jnp.bfloat16  # cast once, kept there
  step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config)
  batch = dict(mlp_batch(), ids=jnp.arange(24, dtype=jnp.int32))
  state, _ = step(state, batch)
  assert set(seen["params"].values()) == {jnp.dtype(jnp.bfloat16)}
  assert seen["x"] == jnp.bfloat16 and seen["ids"] == jnp.int32  # only floats are cast
  assert seen["buffer"] == jnp.bfloat16
  assert state.model_state["count"].dtype == jnp.bfloat16
  assert float(state.model_state["count"]) == 1.0
  # Master parameters stay in full precision.
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))


def test_reduce_dtype_falls_back_to_param_dtype():
  mp = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16)
  assert mp.effective_reduce_dtype == jnp.bfloat16
  mesh = mesh_for(S.FULL_SHARD, 4)
  config = fsdp_jax.FSDPConfig(mixed_precision=mp, auto_wrap_policy=WRAP_BLOCKS)
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh, config=config)
  lowered = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config).lower(
      state, mlp_batch()).as_text()
  # The program asks for bf16 reduce-scatters (the CPU backend later widens
  # 16-bit reductions to f32 internally; GPU backends reduce in bf16).
  scatters = re.findall(r"stablehlo.reduce_scatter.*?\}\) : \(tensor<[^>]*x(\w+)>\)", lowered,
                        re.S)
  assert scatters and set(scatters) == {"bf16"}


def test_mixed_precision_none_is_bitwise_unchanged():
  params, batches = mlp_params(), [mlp_batch(seed=i) for i in range(3)]
  mesh = mesh_for(S.FULL_SHARD, 3)
  runs = []
  for mp in (None, fsdp_jax.MixedPrecision()):
    config = fsdp_jax.FSDPConfig(mixed_precision=mp, auto_wrap_policy=WRAP_BLOCKS)
    losses, state = sharded_run(mlp_loss, params, batches, optax.adam(1e-2), mesh, config)
    runs.append((losses, fsdp_jax.summon_full_params(state)))
  assert runs[0][0] == runs[1][0]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               runs[0][1], runs[1][1])


def test_unsupported_dtype_is_refused():
  with pytest.raises(ValueError, match="param_dtype=int32 is not a floating-point dtype"):
    fsdp_jax.MixedPrecision(param_dtype=jnp.int32)


def test_per_unit_precision_override():
  def policy(node):
    if node.name == "blocks.1":
      return {"mixed_precision": None}  # this unit stays in full precision
    return node.name.startswith("blocks.")

  seen = {}

  def loss_fn(params, batch):
    seen.update({f"blocks.{i}": b["w"].dtype for i, b in enumerate(params["blocks"])})
    return mlp_loss(params, batch)

  mesh = mesh_for(S.FULL_SHARD, 4)
  config = fsdp_jax.FSDPConfig(mixed_precision=BF16, auto_wrap_policy=fsdp_jax.CustomPolicy(policy))
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config)
  text = step.lower(state, mlp_batch()).compile().as_text()
  assert seen == {"blocks.0": jnp.bfloat16, "blocks.1": jnp.float32, "blocks.2": jnp.bfloat16}
  gathers = [c for c in hlo.collectives(text) if c.kind == "all-gather"]
  assert sorted({d for c in gathers for d in c.dtypes}) == ["f32", "u16"]
  assert "[fp32]" in str(state.plan)


# --------------------------------------------------------------------------
# Batch norm: model state, full precision norm units


class BNNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dense(6, use_bias=False, name="Dense_0")(x)  # BN cancels a bias here
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="BatchNorm_0")(x)
    x = jnp.tanh(x)
    x = nn.Dense(6, name="Dense_1")(x)
    return nn.Dense(3, name="Dense_2")(jnp.tanh(x))


def bn_loss(model):
  def loss_fn(params, batch, model_state):
    out, updates = model.apply({"params": params, "batch_stats": model_state}, batch["x"],
                               mutable=["batch_stats"])
    loss = jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)
    return loss, updates["batch_stats"]
  return loss_fn


@pytest.mark.slow
def test_batch_norm_state_replicated_and_matches_per_device_reference():
  model = BNNet()
  x = jnp.ones((2, 5))
  variables = model.init(jax.random.key(0), x)
  params, stats = variables["params"], variables["batch_stats"]
  loss_fn = bn_loss(model)
  world = 4
  mesh = mesh_for(S.FULL_SHARD, world)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["Dense_*"]))
  opt = optax.adam(1e-2)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config,
                                    model_state=stats)
  step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config)
  batches = [mlp_batch(seed=i) for i in range(3)]

  # Reference: each device normalises with its own batch's statistics (as in
  # PyTorch without SyncBatchNorm); the loss and the gradient are the means
  # over devices, and the running statistics are averaged over devices.
  @jax.jit  # one program (op by op, each step dispatched every vmapped op)
  def ref_step(params, stats, opt_state, batch):
    chunks = jax.tree.map(lambda a: a.reshape((world, -1) + a.shape[1:]), batch)

    def mean_loss(p):
      losses, new_stats = jax.vmap(lambda c: loss_fn(p, c, stats))(chunks)
      return jnp.mean(losses), jax.tree.map(lambda s: jnp.mean(s, 0), new_stats)

    (loss, new_stats), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), new_stats, opt_state, loss

  rp, rs, ro = params, stats, opt.init(params)
  for batch in batches:
    state, metrics = step(state, batch)
    rp, rs, ro, rl = ref_step(rp, rs, ro, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(rl), atol=1e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), rp)
  assert_trees_close(state.model_state, rs, rtol=1e-5)
  for leaf in jax.tree.leaves(state.model_state):
    assert leaf.sharding.spec == P()  # replicated, never sharded
    assert leaf.addressable_shards[0].data.shape == leaf.shape


@pytest.mark.slow
def test_batch_norm_units_stay_in_full_precision_when_auto_wrapping():
  model = BNNet()
  x = jnp.ones((2, 5))
  mesh = mesh_for(S.FULL_SHARD, 4)
  config = fsdp_jax.FSDPConfig(mixed_precision=BF16,
                               auto_wrap_policy=fsdp_jax.ModuleWrapPolicy([nn.Dense]))
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(
      init_fn=lambda k: model.init(k, x)["params"], rng=jax.random.key(0),
      optimizer=opt, mesh=mesh, config=config,
      module_classes=fsdp_jax.module_classes(model.init, jax.random.key(0), x),
      model_state=jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), variables["batch_stats"]))
  bn = [u for u in state.plan.units if "BatchNorm" in u.name]
  assert len(bn) == 1 and state.plan.mixed_precision(bn[0]) is None
  seen = {}

  def loss_fn(params, batch, model_state):
    seen.update({k: v["scale" if "BatchNorm" in k else "kernel"].dtype for k, v in params.items()})
    return bn_loss(model)(params, batch, model_state)

  step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config)
  state, metrics = step(state, mlp_batch())
  assert seen["BatchNorm_0"] == jnp.float32
  assert seen["Dense_0"] == jnp.bfloat16 and seen["Dense_2"] == jnp.bfloat16
  assert np.isfinite(float(metrics["loss"]))


# --------------------------------------------------------------------------
# Frozen parameters


def _frozen_mask(params):
  mask = jax.tree.map(lambda _: True, params)
  mask["blocks"][1] = {"w": False, "b": False}
  return mask


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_frozen_parameters(use_orig_params):
  params = mlp_params()
  mask = _frozen_mask(params)
  if use_orig_params:
    mask["out"]["w"] = False  # frozen and trainable leaves share the root unit
  batches = [mlp_batch(seed=i) for i in range(3)]
  opt = optax.adam(1e-2)
  # Reference: only the trainable leaves are optimised.
  trainable = jax.tree.map(lambda x, m: x if m else None, params, mask)
  frozen = jax.tree.map(lambda x, m: None if m else x, params, mask)

  def ref_loss(t, batch):
    full = jax.tree.map(lambda m, a, b: a if m else b, mask, t, frozen,
                        is_leaf=lambda x: x is None)
    return mlp_loss(full, batch)

  ref_losses, ref_t = reference_run(ref_loss, trainable, batches, opt)
  mesh = mesh_for(S.FULL_SHARD, 4)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS, use_orig_params=use_orig_params)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config,
                                    requires_grad=mask)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config)
  text = step.lower(state, batches[0]).compile().as_text()
  state, losses = train_steps(step, state, batches)
  np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
  full = fsdp_jax.summon_full_params(state)
  # Frozen leaves never change; trainable ones match the reference.
  np.testing.assert_array_equal(np.asarray(full["blocks"][1]["w"]), np.asarray(params["blocks"][1]["w"]))
  assert_trees_close(jax.tree.map(lambda x, m: x if m else None, full, mask), ref_t)
  # No optimizer state for frozen leaves: Adam holds mu and nu for the
  # trainable elements only.
  n_trainable = sum(int(np.prod(l.shape)) for l, m in zip(jax.tree.leaves(params),
                                                          jax.tree.leaves(mask)) if m)
  opt_elems = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
  stored_trainable = sum(x.size for x in jax.tree.leaves(fsdp_jax.custom.split_trainable(
      state.plan, state.params)[0]))
  assert opt_elems == 2 * stored_trainable
  assert stored_trainable < sum(x.size for x in jax.tree.leaves(state.params))
  assert stored_trainable >= n_trainable
  # No gradient reduction for the frozen unit.
  scatters = [c for c in hlo.collectives(text) if c.kind == "reduce-scatter"]
  frozen_units = len(state.plan.units) - len(state.plan.trainable_units)
  # One per trainable unit; with use_orig_params one per trainable leaf.
  per_group = (lambda g: len(g)) if use_orig_params else (lambda g: 1)
  groups = sum(per_group(g) for u in state.plan.trainable_units
               for g in state.plan.dtype_groups(u) if not state.plan.leaves[g[0]].frozen)
  assert sum(len(c.shapes) for c in scatters) == groups
  assert frozen_units == 1  # blocks.1


def test_frozen_mask_that_does_not_match_the_tree():
  params = mlp_params()
  mesh = mesh_for(S.FULL_SHARD, 2)
  with pytest.raises(ValueError, match="requires_grad must be a tree of bools"):
    fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                              config=fsdp_jax.FSDPConfig(use_orig_params=True),
                              requires_grad={"inp": True, "typo": False})


def test_flat_unit_mixing_frozen_and_trainable_is_refused():
  params = mlp_params()
  mask = jax.tree.map(lambda _: True, params)
  mask["out"]["w"] = False  # shares the root unit with inp.w
  with pytest.raises(ValueError, match=r"mixes frozen \(out.w\) and trainable"):
    fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1),
                              mesh=mesh_for(S.FULL_SHARD, 2),
                              config=fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS),
                              requires_grad=mask)


# --------------------------------------------------------------------------
# Communication hooks


def _per_device_grads(params, batch, world):
  chunks = jax.tree.map(lambda a: a.reshape((world, -1) + a.shape[1:]), batch)
  return jax.vmap(lambda c: jax.grad(mlp_loss)(params, c))(chunks)


def _emulate_low_precision_hook(params, batch, world, dtype):
  """PyTorch's fp16/bf16 compress hook on every device's gradient: cast, divide
  by the pre-factor, sum over devices, divide by the post-factor, cast back."""
  pre, post = fsdp_jax.gradient_divide_factors(world)
  g = _per_device_grads(params, batch, world)
  low = jax.tree.map(lambda x: (x.astype(dtype) / jnp.asarray(pre, dtype)), g)
  summed = jax.tree.map(lambda x: jnp.sum(x.astype(jnp.float32), 0).astype(dtype), low)
  return jax.tree.map(lambda x: (x / jnp.asarray(post, dtype)).astype(jnp.float32), summed)


# Each hook once, each on its own mesh (the hook's arithmetic does not
# depend on the mesh: the world size enters through the divide factors).
@pytest.mark.slow
@pytest.mark.parametrize("hook,dtype,strategy,n,r", [
    (fsdp_jax.hooks.fp16_compress_hook, jnp.float16, S.FULL_SHARD, 4, None),
    (fsdp_jax.hooks.bf16_compress_hook, jnp.bfloat16, S.HYBRID_SHARD, 2, 2)],
    ids=["fp16-full-4", "bf16-hybrid-2x2"])
def test_compress_hooks_reproduce_pytorch(hook, dtype, strategy, n, r):
  params, batch = mlp_params(), mlp_batch()
  world = n * (r or 1)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP_BLOCKS,
                               comm_hook=hook)
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(1.0),
                                    mesh=mesh_for(strategy, n, r), config=config)
  grads = fsdp_jax.custom.sharded_grads(mlp_loss, state, batch)
  _, full = fsdp_jax.summon_full_params(state, with_grads=True, grads=grads)
  expected = _emulate_low_precision_hook(params, batch, world, dtype)
  exact = jax.grad(mlp_loss)(params, batch)
  eps = float(jnp.finfo(dtype).eps)
  per_device = _per_device_grads(params, batch, world)
  for a, e, d in zip(jax.tree.leaves(full), jax.tree.leaves(expected),
                     jax.tree.leaves(per_device)):
    # Equal to PyTorch's hook arithmetic up to one 16-bit rounding of a
    # summand (fp32-level differences in the per-device gradients can flip
    # one): the bound scales with the summands, not with their sum.
    summand = float(jnp.max(jnp.abs(d))) / fsdp_jax.gradient_divide_factors(world)[0]
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=eps, atol=2 * eps * summand)
  # ...and visibly compressed: not the exact fp32 gradient.
  diffs = [float(jnp.max(jnp.abs(a - x))) for a, x in zip(jax.tree.leaves(full), jax.tree.leaves(exact))]
  assert max(diffs) > 0


@pytest.mark.parametrize("hook,strategy", [(fsdp_jax.hooks.reduce_scatter_hook, S.FULL_SHARD),
                                           (fsdp_jax.hooks.allreduce_hook, S.NO_SHARD)])
def test_default_hooks_are_the_default_reduction(hook, strategy):
  params, batches = mlp_params(), [mlp_batch(seed=i) for i in range(2)]
  mesh = mesh_for(strategy, 4)
  out = []
  for h in (None, hook):
    config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP_BLOCKS,
                                 comm_hook=h)
    losses, state = sharded_run(mlp_loss, params, batches, optax.adam(1e-2), mesh, config)
    out.append(fsdp_jax.summon_full_params(state))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), *out)


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_stateless_hook_runs_under_no_sync_accumulation(use_orig_params):
  """A stateless hook reduces the accumulated gradient of a no_sync step, as
  it reduces every step's gradient (it was skipped: the accumulated gradient
  took the default reduction)."""
  seen = []

  def zero_hook(hook_state, grad, spec):
    seen.append(grad.shape)
    return fsdp_jax.custom.reduce_gradient(grad, spec) * 0, hook_state

  params, batch = mlp_params(), mlp_batch()
  mesh = mesh_for(S.FULL_SHARD, 4)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS, comm_hook=zero_hook,
                               use_orig_params=use_orig_params)
  opt = optax.sgd(0.5)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config,
                                   gradient_accumulation_steps=2, accumulation="no_sync")
  new, metrics = step(state, batch)
  assert len(seen) == len(state.plan.units)  # once per unit, on the accumulated gradient
  assert float(metrics["grad_norm"]) == 0.0
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               fsdp_jax.summon_full_params(new), params)


@pytest.mark.llvm_optimized
def test_error_feedback_hook_carries_its_state():
  params, batch = mlp_params(), mlp_batch()
  world = 4
  hook = fsdp_jax.hooks.ErrorFeedbackHook(jnp.bfloat16)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS, comm_hook=hook)
  mesh = mesh_for(S.FULL_SHARD, world)
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  assert set(state.comm_hook_state) == {u.flat_key + "#0" for u in state.plan.units}
  for v in state.comm_hook_state.values():
    assert v.shape[0] == world and float(jnp.abs(v).max()) == 0
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config)
  state, _ = step(state, batch)
  # After one step each device's error is its own gradient minus its bf16
  # rounding, laid out like the unit's gradient buffer (padding rows zero).
  per_device = _per_device_grads(params, batch, world)
  block0 = state.comm_hook_state["blocks.0._flat_param#0"]
  for d in range(world):
    g = np.concatenate([np.ravel(per_device["blocks"][0]["b"][d]),
                        np.ravel(per_device["blocks"][0]["w"][d])])
    err = g - np.asarray(jnp.asarray(g).astype(jnp.bfloat16).astype(jnp.float32))
    got = np.ravel(np.asarray(block0[d]))[: g.size]
    # The error inherits g's fp32 rounding (g comes from another program
    # here): 1e-6 of |g|, against errors of order 1e-4.
    assert np.max(np.abs(err)) > 1e-4
    np.testing.assert_allclose(got, err, rtol=0, atol=1e-6 * np.max(np.abs(g)))
  assert float(jnp.abs(block0).max()) > 0
  state, metrics = step(state, batch)  # the state threads through
  assert np.isfinite(float(metrics["loss"]))


def test_hook_with_the_wrong_signature():
  def bad_hook(grad):
    return grad

  with pytest.raises(TypeError, match=r"hook\(state, grad, spec\)"):
    fsdp_jax.FSDPConfig(comm_hook=bad_hook)


# --------------------------------------------------------------------------
# Ignored states


# Both layouts, both mesh shapes, pairwise.
@pytest.mark.parametrize("strategy,n,r,use_orig_params", [
    (S.FULL_SHARD, 4, None, False), (S.HYBRID_SHARD, 2, 2, True)],
    ids=["full-4-flat", "hybrid-2x2-orig"])
def test_ignored_states_are_per_device_never_gathered_never_reduced(strategy, n, r,
                                                                    use_orig_params):
  params, batch = mlp_params(), mlp_batch()
  world = n * (r or 1)
  mesh = mesh_for(strategy, n, r)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP_BLOCKS,
                               use_orig_params=use_orig_params, ignored_states=["out"])
  opt = optax.sgd(0.5)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  assert [l.name for l in state.plan.ignored_leaves] == ["out.w"]
  assert "ignored" in str(state.plan)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config)
  text = step.lower(state, batch).compile().as_text()
  state, _ = step(state, batch)
  # Never gathered or reduced: only the 4 units' collectives (root = inp.w).
  colls = hlo.collectives(text)
  gathered = sorted(int(np.prod(s)) for c in colls if c.kind == "all-gather" for s in c.shapes)
  reduced = [s for c in colls if c.kind in ("reduce-scatter",) for s in c.shapes]
  assert len(state.plan.units) == 4
  assert len(reduced) == state.plan.collectives_per_step()["reduce-scatter"]
  assert len(reduced) == (7 if use_orig_params else 4)  # 7 leaves in the 4 units
  assert all(g != 21 for g in gathered)  # out.w has 7 x 3 = 21 elements
  # Each device's copy moved by its own (unreduced) gradient.
  stored = state.params["out"]["w"] if use_orig_params else state.params["out.w"]
  assert stored.shape == (world, 7, 3)
  chunks = jax.tree.map(lambda a: a.reshape((world, -1) + a.shape[1:]), batch)
  per_device = jax.vmap(lambda c: jax.grad(mlp_loss)(params, c))(chunks)["out"]["w"]
  copies = np.asarray(stored)
  for d in range(world):
    np.testing.assert_allclose(copies[d], params["out"]["w"] - 0.5 * per_device[d],
                               rtol=1e-5, atol=1e-6)
  assert np.max(np.abs(copies[0] - copies[1])) > 1e-4  # the copies differ, as in PyTorch
  # Managed parameters trained with gradients averaged over the world.
  full = fsdp_jax.summon_full_params(state)
  g = jax.grad(mlp_loss)(params, batch)
  np.testing.assert_allclose(full["blocks"][0]["w"], params["blocks"][0]["w"] - 0.5 * g["blocks"][0]["w"],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(full["out"]["w"], copies[0])  # full params: the first copy


def test_ignored_states_pattern_that_matches_nothing():
  with pytest.raises(ValueError, match="ignored_states entry 'head' matches no parameter"):
    fsdp_jax.init_train_state(params=mlp_params(), optimizer=optax.sgd(0.1),
                              mesh=mesh_for(S.FULL_SHARD, 2),
                              config=fsdp_jax.FSDPConfig(ignored_states=["head"]))


def test_cast_forward_inputs_for_an_inner_linen_unit():
  seen = {}

  class Probe(nn.Module):
    @nn.compact
    def __call__(self, x):
      seen[self.name] = x.dtype
      return nn.Dense(4)(x)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = Probe(name="a")(x)
      x = jnp.tanh(x).astype(jnp.float32)  # the model hands float32 to the next block
      return Probe(name="b")(x)

  model = Net()
  x = jnp.ones((8, 3))
  params = model.init(jax.random.key(0), x)["params"]
  fp16_cast = fsdp_jax.MixedPrecision(param_dtype=jnp.float16, cast_forward_inputs=True)
  policy = fsdp_jax.CustomPolicy(lambda node: {"mixed_precision": fp16_cast} if node.name == "b"
                                 else node.name == "a")
  mesh = mesh_for(S.FULL_SHARD, 2)
  config = fsdp_jax.FSDPConfig(mixed_precision=BF16, auto_wrap_policy=policy)
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)

  def loss_fn(p, batch):
    return jnp.mean(model.apply({"params": p}, batch["x"]).astype(jnp.float32) ** 2)

  step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config)
  state, metrics = step(state, {"x": x})
  # "a" (bf16, no cast_forward_inputs) sees the root-cast bf16 input; "b"
  # casts its float32 input to its own float16.
  assert seen == {"a": jnp.bfloat16, "b": jnp.float16}
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
@pytest.mark.parametrize("use_orig", [False, True], ids=["flat", "orig_params"])
def test_16bit_gradients_are_packed_as_bits(use_orig):
  """A flat unit's 16-bit gradient is written into its reduce buffer as
  uint16 bit patterns: the CPU backend has no bf16 ``dynamic_update_slice``
  and widened each update to float32 around the whole buffer (1.8x the step
  time; benchmarks/CAUSES.md). Same values: the reduction is unchanged.
  Original-layout units are not packed at all (one reduce-scatter per leaf)."""
  mesh = mesh_for(S.FULL_SHARD, 4)
  texts, results = {}, {}
  for reduce in ("bfloat16", "float32"):
    mp = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.dtype(reduce))
    config = fsdp_jax.FSDPConfig(mixed_precision=mp, use_orig_params=use_orig,
                                 auto_wrap_policy=WRAP_BLOCKS)
    state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=optax.sgd(0.1),
                                      mesh=mesh, config=config)
    step = fsdp_jax.shard_train_step(mlp_loss, optax.sgd(0.1))
    texts[reduce] = step.lower(state, mlp_batch()).compile().as_text()
    results[reduce] = fsdp_jax.summon_full_params(step(state, mlp_batch())[0])
  # The writes that build each unit's reduce buffer (XLA keeps them as
  # in-place updates, or turns them into one concatenate).
  writes = [m.group(1) for line in texts["bfloat16"].splitlines() if "fsdp_reduce_scatter[" in line
            for m in [re.search(r"= (\w+)\[[\d,]*\]\{[\d,]*\} (?:dynamic-update-slice|concatenate)\(",
                                line)] if m]
  if use_orig:
    # Reduced leaf by leaf: nothing is packed (8 leaves, 8 reduce-scatters).
    assert writes == []
    scatters = [c for c in hlo.collectives(texts["bfloat16"]) if c.kind == "reduce-scatter"]
    assert len(scatters) == 8, scatters
  else:
    assert writes and set(writes) == {"u16"}, sorted(set(writes))
  # A misplaced bit pattern would be garbage: the bf16 reduction's update is
  # the f32 reduction's up to bf16 rounding.
  assert_trees_close(results["bfloat16"], results["float32"], rtol=2e-2, atol=1e-3)


# A stateful hook runs in the backward pass, as each unit's gradient completes.


def _hook_runs(monkeypatch, *, in_backward, strategy, n, r, orig, offload=False, ignored=False,
               steps=2):
  from fsdp_jax._src import grads as grads_lib
  if not in_backward:  # the path kept for stacked units: after the backward pass
    monkeypatch.setattr(grads_lib, "_gates_apply", lambda plan, state: False)
  params, batch = mlp_params(), mlp_batch()
  config = fsdp_jax.FSDPConfig(
      sharding_strategy=strategy, auto_wrap_policy=WRAP_BLOCKS, use_orig_params=orig,
      comm_hook=fsdp_jax.hooks.ErrorFeedbackHook(jnp.bfloat16),
      ignored_states=["out.w"] if ignored else None,
      cpu_offload=fsdp_jax.CPUOffload(offload_params=True) if offload else None)
  mesh = mesh_for(strategy, n, r)
  opt = optax.adam(1e-2)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config, max_norm=1.0)
  losses = []
  for i in range(steps):
    state, metrics = step(state, mlp_batch(seed=20 + i))
    losses.append(metrics["loss"])
  monkeypatch.undo()
  return losses, state.params, state.comm_hook_state, state.opt_state


# Two cases compare differently fused programs bit for bit: they need XLA's
# default fusion emitters at jaxlib 0.10, and run with XLA's default
# settings (llvm_optimized) in the process test_error_feedback_hook_carries_its_state
# needs anyway, rather than in a second process of their own.
@pytest.mark.parametrize("strategy,n,r,orig,offload,ignored", [
    (S.FULL_SHARD, 4, None, False, False, False),
    pytest.param(S.FULL_SHARD, 3, None, True, False, True, marks=pytest.mark.slow),
    pytest.param(S.SHARD_GRAD_OP, 3, None, False, False, True,
                 marks=[pytest.mark.slow, pytest.mark.llvm_optimized]),
    pytest.param(S.HYBRID_SHARD, 2, 2, True, False, False, marks=pytest.mark.slow),
    pytest.param(S.FULL_SHARD, 3, None, False, True, False,
                 marks=[pytest.mark.slow, pytest.mark.llvm_optimized])],
    ids=["full-4-flat", "full-3-orig-ignored", "grad_op-3-ignored", "hybrid-2x2-orig",
         "full-3-offload"])
def test_stateful_hook_in_the_backward_pass_matches_the_hook_after_it(monkeypatch, strategy, n,
                                                                      r, orig, offload,
                                                                      ignored):
  """Losses, parameters, optimizer state and the hook's state after two
  steps (the second reads the state the first left): bit for bit those of running the hook on the full gradients after
  the backward pass."""
  kw = dict(strategy=strategy, n=n, r=r, orig=orig, offload=offload, ignored=ignored)
  got = _hook_runs(monkeypatch, in_backward=True, **kw)
  want = _hook_runs(monkeypatch, in_backward=False, **kw)
  la, lb = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(la) == len(lb)
  for a, b in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # The hook's state moved: it is each device's own rounding error.
  assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(got[2])) > 0


@pytest.mark.parametrize("in_backward", [True, False], ids=["in_backward", "after"])
def test_stateful_hook_reduces_each_unit_before_the_next_units_backward(monkeypatch,
                                                                        in_backward):
  """In the step's program the hook's reduce-scatter of the last block comes
  before the backward matmuls of the first block: a unit's full gradient is
  reduced as soon as it is complete, not kept until the whole backward pass
  has run (the path kept for stacked units, checked here as the contrast)."""
  from fsdp_jax._src import grads as grads_lib
  if not in_backward:
    monkeypatch.setattr(grads_lib, "_gates_apply", lambda plan, state: False)
  mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS,
                               comm_hook=fsdp_jax.hooks.ErrorFeedbackHook(jnp.bfloat16))
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, optax.sgd(0.1), mesh=mesh, config=config)
  names = [e.primitive.name for e in shard_map_body(
      jax.make_jaxpr(step.jitted)(state, mlp_batch()).jaxpr).eqns]
  scatters = [k for k, name in enumerate(names) if name == "reduce_scatter"]
  matmuls = [k for k, name in enumerate(names) if name == "dot_general"]
  assert len(scatters) == len(state.plan.units)  # one reduction per unit (and dtype group)
  if in_backward:
    assert scatters[0] < matmuls[-1], (scatters, matmuls)
  else:
    assert scatters[0] > matmuls[-1], (scatters, matmuls)
