"""Every strategy x layout x mesh trains like unsharded single-device JAX, and
the compiled step holds exactly the collectives the strategy implies."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax import hlo
from fsdp_jax import ShardingStrategy as S

from helpers import (HYBRID, assert_trees_close, mesh_for, mlp_batch, mlp_loss,
                     mlp_params, reference_run, sharded_run)

WRAP_BLOCKS = fsdp_jax.ModuleWrapPolicy(["blocks.*"])
STEPS = 4

# (strategy, shard size, replicate size, use_orig_params). mlp_params' units
# hold 56 elements (2, 4 and 8 divide them: no flat padding; 3 does not) and
# leaves of 5 or 7 rows (no mesh here divides them: every n pads the
# original layout). Every strategy runs on 1 and 3 devices in both layouts;
# meshes of 2, 4 and 8 take the same branches of the engine (a dividing
# flat unit, padded rows), so each runs once per layout, spread over the
# strategies (FULL_SHARD's original layout on 8: one row per device). Each
# 2-D strategy runs in both layouts, the two mesh widths split between them.
_DIVIDING = {S.FULL_SHARD: (4, 8), S.SHARD_GRAD_OP: (2, 4), S.NO_SHARD: (8, 2)}
CASES = (
    [(s, n, None, orig) for s in _DIVIDING for orig in (False, True)
     for n in (1, 3, _DIVIDING[s][orig])]
    + [(HYBRID[0], 2, 2, False), (HYBRID[0], 4, 2, True),
       (HYBRID[1], 4, 2, False), (HYBRID[1], 2, 2, True)]
    + [(S.FULL_SHARD, 4, 2, orig) for orig in (False, True)]  # FULL_SHARD over a 2-D mesh
)


def _id(case):
  s, n, r = case[:3]
  return f"{s.name}-{r}x{n}" if r else f"{s.name}-{n}"


def _train_id(case):
  return f"{_id(case)}-{'orig' if case[3] else 'flat'}"


@pytest.fixture(scope="module")
def reference():
  params = mlp_params()
  batches = [mlp_batch(seed=10 + i) for i in range(STEPS)]
  losses, final = reference_run(mlp_loss, params, batches, optax.adam(1e-2))
  return params, batches, losses, final


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_train_id)
def test_matches_unsharded_training(case, reference):
  strategy, n, replicate, use_orig_params = case
  params, batches, ref_losses, ref_final = reference
  mesh = mesh_for(strategy, n, replicate)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP_BLOCKS,
                               use_orig_params=use_orig_params)
  losses, state = sharded_run(mlp_loss, params, batches, optax.adam(1e-2), mesh, config)
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_final)
  assert int(state.step) == STEPS


def _compiled_collectives(strategy, n, replicate, use_orig_params=False, mixed_precision=None):
  mesh = mesh_for(strategy, n, replicate)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP_BLOCKS,
                               use_orig_params=use_orig_params,
                               mixed_precision=mixed_precision)
  opt = optax.adam(1e-2)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config)
  text = step.lower(state, mlp_batch()).compile().as_text()
  return state.plan, hlo.collectives(text)


def _operands(colls, kind, scalar=False):
  return [(shape, c) for c in colls if c.kind == kind for shape in c.shapes
          if (shape == ()) == scalar]


@pytest.mark.slow
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("strategy,n,replicate", [
    (S.FULL_SHARD, 8, None), (S.SHARD_GRAD_OP, 8, None), (S.NO_SHARD, 8, None),
    (S.HYBRID_SHARD, 4, 2), (S._HYBRID_SHARD_ZERO2, 4, 2), (S.FULL_SHARD, 3, None)])
def test_collectives_per_unit(strategy, n, replicate, use_orig_params):
  plan, colls = _compiled_collectives(strategy, n, replicate, use_orig_params)
  units = len(plan.units)
  assert units == 4  # three blocks and the root (inp, out)
  gathers = _operands(colls, "all-gather")
  scatters = _operands(colls, "reduce-scatter")
  reduces = _operands(colls, "all-reduce")
  if strategy is S.NO_SHARD:
    assert gathers == [] and scatters == []
    assert len(reduces) == units  # one gradient all-reduce per unit
  else:
    # FULL_SHARD/HYBRID re-gather every non-root unit for backward (all three
    # blocks' weights are needed there); the root is never resharded. Flat
    # units move with one collective each, original-layout units with one
    # per leaf, so the backward pass re-gathers only the leaves it reads: the
    # weights, not the biases (x @ w + b is saved; tanh' reads its output).
    resharded = strategy in (S.FULL_SHARD, S.HYBRID_SHARD)
    if use_orig_params:
      leaf_size = lambda i: plan.n * plan.chunk0(plan.leaves[i]) * plan.leaves[i].row_numel
      sizes = {u.index: [leaf_size(i) for i in u.leaf_ids] for u in plan.units}
      again = [leaf_size(i) for u in plan.units if not u.is_root for i in u.leaf_ids
               if plan.leaves[i].name.endswith(".w")]
    else:
      sizes = {u.index: [plan.padded_numel(u)] for u in plan.units}
      again = [plan.padded_numel(u) for u in plan.units if not u.is_root]
    expect_gathers = [x for v in sizes.values() for x in v] + (again if resharded else [])
    assert len(gathers) == len(expect_gathers)
    # The plan's count is an upper bound: every leaf of a resharded unit.
    assert len(gathers) <= plan.collectives_per_step()["all-gather"]
    assert (len(gathers) == plan.collectives_per_step()["all-gather"]) == (
        not (use_orig_params and resharded))
    assert len(scatters) == sum(map(len, sizes.values())) == (
        plan.collectives_per_step()["reduce-scatter"])
    if strategy in HYBRID:
      assert len(reduces) == units  # all-reduce over "replicate" after the scatter
      for _, c in reduces:
        # S groups of R devices (XLA prints the groups differently across
        # releases; Collective.groups reads every format).
        replicate = plan.axes.world_size // plan.axes.shard_size
        assert len(c.groups) == plan.axes.shard_size
        assert all(len(g) == replicate for g in c.groups)
    else:
      assert reduces == []
    # Never one gather of the whole model: every gather is one unit (or one
    # leaf of it).
    total = sum(plan.padded_numel(u) for u in plan.units)
    assert sorted(int(np.prod(s)) for s, _ in gathers) == sorted(expect_gathers)
    assert max(expect_gathers) < total
    assert sorted(int(np.prod(s)) for s, _ in scatters) == sorted(
        x // plan.n for v in sizes.values() for x in v)
  # The only scalar collectives are the step's metrics: the loss mean, and
  # the gradient norm's sum over the shard axes (none without shard axes).
  expected = 1 + bool(plan.axes.shard_axes)
  assert len(_operands(colls, "all-reduce", scalar=True)) == expected


@pytest.mark.slow
def test_bf16_gather_fp32_reduce_scatter():
  mp = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
  plan, colls = _compiled_collectives(S.FULL_SHARD, 4, None, mixed_precision=mp)
  _, colls32 = _compiled_collectives(S.FULL_SHARD, 4, None)
  gathers = [c for c in colls if c.kind == "all-gather"]
  # 16-bit floats are gathered as their uint16 bit patterns (2 bytes each).
  assert gathers and all(d == "u16" for c in gathers for d in c.dtypes)
  scatters = [c for c in colls if c.kind == "reduce-scatter"]
  assert scatters and all(d == "f32" for c in scatters for d in c.dtypes)
  gather_bytes = sum(c.bytes for c in gathers)
  gather_bytes32 = sum(c.bytes for c in colls32 if c.kind == "all-gather")
  assert gather_bytes * 2 == gather_bytes32


def test_full_params_round_trip_exact():
  params = mlp_params()
  for strategy, n, r in [(S.FULL_SHARD, 3, None), (S.NO_SHARD, 4, None), (S.HYBRID_SHARD, 2, 2)]:
    for orig in (False, True):
      config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, use_orig_params=orig,
                                   auto_wrap_policy=WRAP_BLOCKS)
      state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1),
                                        mesh=mesh_for(strategy, n, r), config=config)
      full = fsdp_jax.summon_full_params(state)
      jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                   full, params)


@pytest.mark.slow
def test_init_fn_matches_materialised_params():
  mesh = mesh_for(S.FULL_SHARD, 8)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS, use_orig_params=True)
  a = fsdp_jax.init_train_state(init_fn=lambda: mlp_params(), optimizer=optax.adam(1e-3),
                                mesh=mesh, config=config)
  b = fsdp_jax.init_train_state(params=mlp_params(), optimizer=optax.adam(1e-3),
                                mesh=mesh, config=config)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)),
               a.params, b.params)
  for x in jax.tree.leaves(a.params):
    assert x.sharding.spec == jax.sharding.PartitionSpec("shard")
    assert x.addressable_shards[0].data.shape[0] * 8 == x.shape[0]


def test_flat_layout_chunks_and_padding():
  """Device r holds chunk r of the unit's flattened, zero-padded leaves."""
  params = {"a": jnp.arange(10.0).reshape(2, 5), "b": jnp.arange(10.0, 13.0)}
  mesh = mesh_for(S.FULL_SHARD, 4)
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig())
  flat = state.params["_flat_param"]
  assert flat.shape == (16,)  # 13 elements padded to 4 x 4
  expected = np.concatenate([np.arange(13.0), np.zeros(3)])
  for shard in flat.addressable_shards:
    r = mesh.devices.flat[:].tolist().index(shard.device)
    np.testing.assert_array_equal(np.asarray(shard.data), expected[4 * r: 4 * r + 4])


def test_orig_layout_dim0_chunks():
  params = {"a": jnp.arange(15.0).reshape(5, 3), "s": jnp.asarray(2.0)}
  mesh = mesh_for(S.FULL_SHARD, 4)
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig(use_orig_params=True))
  assert state.params["a"].shape == (8, 3)   # 5 rows padded to 4 x 2
  assert state.params["s"].shape == (4,)     # a scalar is one row
  np.testing.assert_array_equal(np.asarray(state.params["a"])[5:], 0)


@pytest.mark.slow
def test_padding_gradients_stay_zero():
  params = mlp_params()
  mesh = mesh_for(S.FULL_SHARD, 8)
  for orig in (False, True):
    config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS, use_orig_params=orig)
    _, state = sharded_run(mlp_loss, params, [mlp_batch()] * 2, optax.adamw(1e-2), mesh, config)
    plan = state.plan
    if orig:
      for leaf, x in zip(plan.leaves, jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(x)[leaf.dim0:], 0)
    else:
      for u in plan.units:
        x = np.asarray(state.params[u.flat_key])
        np.testing.assert_array_equal(x[plan.flat_numel(u):], 0)


def test_optax_mask_with_original_params():
  """use_orig_params=True: optax masks over the original tree work."""
  params = mlp_params()
  mask = jax.tree.map(lambda _: True, params)
  mask["out"]["w"] = False  # no weight decay on the head
  opt = optax.adamw(1e-2, weight_decay=0.5, mask=mask)
  batches = [mlp_batch(seed=i) for i in range(3)]
  ref_losses, ref_final = reference_run(mlp_loss, params, batches, opt)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS, use_orig_params=True)
  losses, state = sharded_run(mlp_loss, params, batches, opt, mesh_for(S.FULL_SHARD, 3), config)
  np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_final)


@pytest.mark.parametrize("opt", [optax.sgd(0.1, momentum=0.9), optax.lion(1e-3),
                                 optax.adamw(1e-2, weight_decay=0.1)],
                         ids=["momentum", "lion", "adamw"])
def test_elementwise_optimizers(opt):
  params = mlp_params()
  batches = [mlp_batch(seed=i) for i in range(3)]
  ref_losses, ref_final = reference_run(mlp_loss, params, batches, opt)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS)
  losses, state = sharded_run(mlp_loss, params, batches, opt, mesh_for(S.FULL_SHARD, 4), config)
  np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_final)


def test_aux_output_and_metrics():
  def loss_fn(params, batch):
    loss = mlp_loss(params, batch)
    return loss, {"twice": 2 * loss}

  mesh = mesh_for(S.FULL_SHARD, 4)
  config = fsdp_jax.FSDPConfig()
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config)
  batch = mlp_batch()
  expected = float(mlp_loss(mlp_params(), batch))
  _, metrics = step(state, batch)
  np.testing.assert_allclose(float(metrics["loss"]), expected, atol=1e-6)
  np.testing.assert_allclose(float(metrics["aux"]["twice"]), 2 * expected, atol=2e-6)


def test_inner_jit_is_gathered_unit_by_unit():
  """A model wrapped in its own jax.jit still gathers one unit at a time."""
  loss = jax.jit(mlp_loss)
  params = mlp_params()
  batches = [mlp_batch(seed=i) for i in range(2)]
  ref_losses, ref_final = reference_run(mlp_loss, params, batches, optax.adam(1e-2))
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS)
  mesh = mesh_for(S.FULL_SHARD, 4)
  losses, state = sharded_run(loss, params, batches, optax.adam(1e-2), mesh, config)
  np.testing.assert_allclose(losses, ref_losses, atol=1e-5, rtol=0)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_final)
  opt = optax.adam(1e-2)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  text = fsdp_jax.shard_train_step(loss, opt, mesh=mesh, config=config).lower(
      state, batches[0]).compile().as_text()
  gathers = [c for c in hlo.collectives(text) if c.kind == "all-gather"]
  assert len(gathers) == 7  # 4 units + 3 backward re-gathers, not one big gather


def test_plan_printout():
  mesh = mesh_for(S.FULL_SHARD, 3)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS))
  text = str(state.plan)
  assert "FULL_SHARD" in text and "N=3" in text
  for name in ("blocks.0", "blocks.1", "blocks.2", "<root>", "inp.w", "out.w"):
    assert name in text
  # 56 params in a block padded to 57 (3 x 19): padding 1, 19 x 4 bytes per device.
  line = next(l for l in text.splitlines() if l.strip().startswith("blocks.0 "))
  assert line.split()[1:] == ["2", "56", "1", "76"]
  assert "7 all-gather" in text and "4 reduce-scatter" in text


def test_state_repr_fits_a_screen():
  """repr(state) stays a few lines for any model (here 32 layers, 129
  parameters, one unit); print(state.plan) shows the plan whole."""
  params = {"blocks": [{"w": jnp.ones((4, 4)), "b": jnp.zeros(4), "g": jnp.ones(4),
                        "h": jnp.ones(4)} for _ in range(32)], "out": jnp.ones((4, 2))}
  mesh = mesh_for(S.FULL_SHARD, 2)
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.adam(0.1), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig(), rng=jax.random.key(0))
  text = repr(state)
  assert len(text) < 2000 and text.count("\n") < 5, text
  assert text.startswith("ShardedTrainState(step=0, params=<1 array, 904 elements>") and (
      "129 parameters (904 elements), mesh {'shard': 2}" in text), text
  assert repr(state.plan) in text and "blocks.31.w" in str(state.plan)


def test_the_step_ignores_a_user_context_mesh():
  """init_train_state, the step, summon_full_params and state_dict run
  inside a user's jax.set_mesh(other_mesh) and ``with mesh:`` (the inputs
  made there too) as outside it: the same numbers, bitwise, and the same
  compiled step."""
  mesh = mesh_for(S.FULL_SHARD, 3)
  other = jax.make_mesh((2, 4), ("data", "model"))  # Explicit axes, all 8 devices
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS)
  opt = optax.adam(1e-2)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config)

  def train():
    state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh,
                                      config=config, rng=jax.random.key(0))
    state, metrics = step(state, jax.tree.map(jnp.asarray, mlp_batch()))
    return float(metrics["loss"]), fsdp_jax.summon_full_params(state), fsdp_jax.state_dict(state)

  expected = train()
  with jax.set_mesh(other):
    inside = train()
  with pytest.warns(DeprecationWarning, match="with mesh"), other:
    legacy = train()
  for got in (inside, legacy):
    assert got[0] == expected[0]
    assert_trees_close(got[1:], expected[1:], rtol=0, atol=0)


# NO_SHARD unpacks each unit from this device's replicated copy (no
# communication). Pre-norm residual GELU blocks whose activations outweigh
# their parameters.
NS_D, NS_BLOCKS, NS_BATCH = 120, 6, 128


@functools.cache  # the original-layout fp32 figure is every case's baseline
def _no_shard_temp(n, *, use_orig_params, param_dtype):
  k = jax.random.split(jax.random.key(0), NS_BLOCKS)
  params = {"blocks": [{"w": jax.random.normal(k[i], (NS_D, NS_D)) / 11, "b": jnp.zeros(NS_D)}
                       for i in range(NS_BLOCKS)]}

  def loss(p, batch):
    x = batch["x"]
    for blk in p["blocks"]:
      h = (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)
      x = x + jax.nn.gelu(h @ blk["w"] + blk["b"])
    return jnp.mean(x ** 2)

  mesh = mesh_for(S.NO_SHARD, n)
  mp = None if param_dtype is None else fsdp_jax.MixedPrecision(param_dtype=param_dtype)
  config = fsdp_jax.FSDPConfig(sharding_strategy=S.NO_SHARD, auto_wrap_policy=WRAP_BLOCKS,
                               use_orig_params=use_orig_params, mixed_precision=mp)
  opt = optax.sgd(0.1)
  state = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      params=params, optimizer=opt, mesh=mesh, config=config))
  step = fsdp_jax.shard_train_step(loss, opt, mesh=mesh, config=config)
  batch = jax.ShapeDtypeStruct((NS_BATCH * n, NS_D), jnp.float32)
  compiled = step.jitted.lower(state, {"x": batch}).compile()
  return compiled.memory_analysis().temp_size_in_bytes


# Each layout and dtype once; 2 and 3 devices (the mesh changes only the
# batch: NO_SHARD keeps every unit whole on each device).
@pytest.mark.parametrize("n,use_orig_params,param_dtype", [
    (2, False, None), pytest.param(3, False, jnp.bfloat16, marks=pytest.mark.slow),
    (2, True, jnp.bfloat16)], ids=["flat-2", "flat-bf16-3", "orig-bf16-2"])
def test_no_shard_does_not_keep_unpacked_parameters_until_backward(n, use_orig_params,
                                                                   param_dtype):
  """NO_SHARD's unpacking of a unit copies (slices of the flat parameter,
  casts to ``param_dtype``); the backward pass unpacks again rather than
  keeping every unit's copy from forward to backward. So the step needs at
  most two units' copies more than the original layout in fp32, where the
  leaves are the stored arrays themselves (MiB on 2 devices, jax 0.10.2:
  1.58 / 1.43 / 1.43 against 1.76, keeping the copies 1.98 / 1.81 / 1.81;
  jax 0.12: 1.58 / 1.57 / 1.57 against 1.76, keeping them 1.98 / 1.75 /
  1.75)."""
  views = _no_shard_temp(n, use_orig_params=True, param_dtype=None)
  temp = _no_shard_temp(n, use_orig_params=use_orig_params, param_dtype=param_dtype)
  unit_bytes = (NS_D * NS_D + NS_D) * 4
  assert temp <= views + 2 * unit_bytes, (temp, views, unit_bytes)
