"""Model and optimizer state dicts: FULL / SHARDED / LOCAL round trips on every
strategy and layout, loading across meshes, strategies and layouts, and the
optimizer state dict conversions PyTorch documents."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax import ShardingStrategy as S, StateDictType as T
from fsdp_jax import ShardedTrainState
from fsdp_jax import (OptimStateKeyType, full_optim_state_dict, load_state_dict, optim_state_dict,
                      optim_state_dict_to_load, rekey_optim_state_dict,
                      scatter_full_optim_state_dict, shard_full_optim_state_dict, state_dict)
from fsdp_jax._src.state_dicts import canonical_sharding, clear_caches
from fsdp_jax._src.state_dicts import convert

from helpers import assert_trees_close, mesh_for, mlp_batch, mlp_loss, mlp_params

WRAP = fsdp_jax.ModuleWrapPolicy(["blocks.*"])
OPT = optax.adam(1e-2)
NAMES = ["blocks.0.b", "blocks.0.w", "blocks.1.b", "blocks.1.w", "blocks.2.b", "blocks.2.w",
         "inp.w", "out.w"]

# (strategy, shard size, replicate): every strategy, uneven shard sizes.
CASES = [(S.FULL_SHARD, 4, None), (S.SHARD_GRAD_OP, 3, None), (S.NO_SHARD, 2, None),
         (S.HYBRID_SHARD, 2, 2), (S._HYBRID_SHARD_ZERO2, 3, 2)]


def _id(case):
  s, n, r = case
  return f"{s.name}-{r}x{n}" if r else f"{s.name}-{n}"


def build(case, orig, params=None, optimizer=OPT):
  strategy, n, rep = case
  mesh = mesh_for(strategy, n, rep)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP,
                               use_orig_params=orig)
  return fsdp_jax.init_train_state(params=mlp_params() if params is None else params,
                                   optimizer=optimizer, mesh=mesh, config=config), mesh, config


def by_name(tree):
  return {".".join(fsdp_jax._src.naming.key_name(k) for k in p): np.asarray(x)
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def random_osd(seed=0):
  """A full optimizer state dict of adam over mlp_params with random values."""
  rng = np.random.default_rng(seed)
  shapes = {n: x.shape for n, x in by_name(mlp_params()).items()}
  return {"state": {n: {"0.mu": rng.standard_normal(s).astype(np.float32),
                        "0.nu": rng.random(s).astype(np.float32)} for n, s in shapes.items()},
          "param_groups": [{"params": list(NAMES), "0.count": np.int32(7)}]}


def assert_osd_equal(actual, expected):
  assert sorted(actual["state"]) == sorted(expected["state"])
  for n, slots in expected["state"].items():
    assert sorted(actual["state"][n]) == sorted(slots), n
    for k, v in slots.items():
      np.testing.assert_array_equal(np.asarray(actual["state"][n][k]), v, err_msg=f"{n} {k}")
  ga, ge = actual["param_groups"][0], expected["param_groups"][0]
  assert ga["params"] == ge["params"]
  assert sorted(ga) == sorted(ge)
  for k in ge:
    if k != "params":
      np.testing.assert_array_equal(np.asarray(ga[k]), np.asarray(ge[k]))


def assert_storage_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.shape == y.shape and x.sharding.is_equivalent_to(y.sharding, x.ndim)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def from_state_dicts(case, orig, model_sd, osd):
  """A state built straight from state dicts: the target is abstract
  (``jax.eval_shape`` of ``init_train_state``), so nothing is initialised."""
  abstract = jax.eval_shape(lambda: build(case, orig)[0])
  state = load_state_dict(abstract, model_sd)
  step = jax.device_put(jnp.zeros((), jnp.int32),
                        jax.sharding.NamedSharding(abstract.plan.mesh, jax.sharding.PartitionSpec()))
  return state.replace(opt_state=optim_state_dict_to_load(abstract, osd), step=step)


@pytest.fixture(scope="module")
def states():
  """One state per (case, layout), holding mlp_params and a random adam state."""
  out = {}
  model_sd, osd = by_name(mlp_params()), random_osd()
  for case in CASES:
    for orig in (False, True):
      out[(case, orig)] = from_state_dicts(case, orig, model_sd, osd)
  return out


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_round_trips(case, orig, states):
  state = states[(case, orig)]
  plan = state.plan
  params = by_name(mlp_params())
  osd = random_osd()
  blank = jax.tree.map(jnp.zeros_like, state)

  # FULL: dotted names of the unsharded tree, full arrays, host with offload.
  full = state_dict(state, offload_to_cpu=True, rank0_only=True)
  assert list(full) == NAMES
  for n in NAMES:
    assert isinstance(full[n], np.ndarray)
    np.testing.assert_array_equal(full[n], params[n])
  on_device = state_dict(state)
  assert all(isinstance(v, jax.Array) and v.sharding.is_fully_replicated
             for v in on_device.values())
  assert_osd_equal(optim_state_dict(state), osd)
  assert_osd_equal(full_optim_state_dict(state), osd)
  loaded = load_state_dict(blank, full)
  assert_storage_equal(loaded.params, state.params)

  # SHARDED: global shapes, sharded over the shard axes where a dimension divides.
  sharded = state_dict(state, state_dict_type=T.SHARDED_STATE_DICT)
  assert {n: v.shape for n, v in sharded.items()} == {n: v.shape for n, v in params.items()}
  for leaf in plan.leaves:
    assert sharded[leaf.name].sharding == canonical_sharding(plan, leaf)
  if plan.n == 3:  # out.w is (7, 3): split along dim 1 over the shard axis
    assert sharded["out.w"].sharding.spec == jax.sharding.PartitionSpec(None, "shard")
  for n in NAMES:
    np.testing.assert_array_equal(np.asarray(sharded[n]), params[n])
  loaded = load_state_dict(blank, sharded, state_dict_type=T.SHARDED_STATE_DICT)
  assert_storage_equal(loaded.params, state.params)
  sosd = optim_state_dict(state, state_dict_type=T.SHARDED_STATE_DICT, offload_to_cpu=False)
  assert_osd_equal(sosd, osd)
  opt = optim_state_dict_to_load(blank, sosd, state_dict_type=T.SHARDED_STATE_DICT)
  assert_storage_equal(opt, state.opt_state)

  # LOCAL: the stored arrays as they are, plus metadata; same plan only.
  local = state_dict(state, state_dict_type=T.LOCAL_STATE_DICT)
  meta = local.pop("_metadata")
  assert meta["layout"] == ("original" if orig else "flat") and meta["shard_size"] == plan.n
  assert sorted(local) == sorted(NAMES if orig else
                                 ["_flat_param"] + [f"blocks.{i}._flat_param" for i in range(3)])
  for x in local.values():
    assert x.shape[0] % plan.n == 0
  local["_metadata"] = meta
  loaded = load_state_dict(blank, local, state_dict_type=T.LOCAL_STATE_DICT)
  assert_storage_equal(loaded.params, state.params)
  losd = optim_state_dict(state, state_dict_type=T.LOCAL_STATE_DICT)
  opt = optim_state_dict_to_load(blank, losd, state_dict_type=T.LOCAL_STATE_DICT)
  assert_storage_equal(opt, state.opt_state)


@pytest.mark.slow
@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_load_onto_other_mesh_strategy_layout(case, orig, states):
  """FULL and SHARDED state dicts load onto a different mesh, strategy and
  layout (the next case, other layout) and read back the same values."""
  source = states[(case, orig)]
  target = states[(CASES[(CASES.index(case) + 1) % len(CASES)], not orig)]
  target = jax.tree.map(jnp.zeros_like, target)
  sharded = state_dict(source, state_dict_type=T.SHARDED_STATE_DICT)
  out = load_state_dict(target, sharded, state_dict_type=T.SHARDED_STATE_DICT)
  out = out.replace(opt_state=optim_state_dict_to_load(
      out, optim_state_dict(source, state_dict_type=T.SHARDED_STATE_DICT),
      state_dict_type=T.SHARDED_STATE_DICT))
  assert out.plan is target.plan
  assert_trees_close(fsdp_jax.summon_full_params(out), mlp_params(), rtol=0, atol=0)
  assert_osd_equal(full_optim_state_dict(out), random_osd())
  full = load_state_dict(target, state_dict(source))
  assert_trees_close(fsdp_jax.summon_full_params(full), mlp_params(), rtol=0, atol=0)


def _reference_with_opt_state(params, batches, optimizer):
  """Unsharded single-device training: final params and optax state."""
  @jax.jit
  def update(params, opt_state, batch):
    grads = jax.grad(mlp_loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  opt_state = optimizer.init(params)
  for b in batches:
    params, opt_state = update(params, opt_state, b)
  return params, opt_state


@pytest.fixture(scope="module")
def trained():
  """2 Adam steps of FULL_SHARD (flat) on 8 devices, and the unsharded run."""
  batches = [mlp_batch(seed=20 + i) for i in range(4)]
  state, mesh, config = build((S.FULL_SHARD, 8, None), orig=False)
  step = fsdp_jax.shard_train_step(mlp_loss, OPT, mesh=mesh, config=config)
  for b in batches[:2]:
    state, _ = step(state, b)
  return state, batches


def test_full_optim_state_dict_matches_unsharded_optax(trained):
  """Rekeyed by PARAM_ID, the full optimizer state dict of sharded training is
  the unsharded optax state, leaf by leaf (PyTorch: loadable into the
  non-wrapped optimizer)."""
  state, batches = trained
  ref_params, ref_opt = _reference_with_opt_state(mlp_params(), batches[:2], OPT)
  by_id = rekey_optim_state_dict(full_optim_state_dict(state), OptimStateKeyType.PARAM_ID, state)
  assert sorted(by_id["state"]) == list(range(len(NAMES)))
  assert by_id["param_groups"][0]["params"] == list(range(len(NAMES)))
  for slot in ("mu", "nu"):
    for i, ref in enumerate(jax.tree.leaves(getattr(ref_opt[0], slot))):
      np.testing.assert_allclose(by_id["state"][i][f"0.{slot}"], ref, rtol=2e-4, atol=1e-7)
  assert int(by_id["param_groups"][0]["0.count"]) == int(ref_opt[0].count) == 2
  back = rekey_optim_state_dict(by_id, OptimStateKeyType.PARAM_NAME, state)
  assert sorted(back["state"]) == sorted(NAMES)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params)


@pytest.mark.slow
def test_full_then_shard_then_load_trains_the_same(trained):
  """PyTorch's documented relationship: full_optim_state_dict ->
  shard_full_optim_state_dict (or scatter_full_optim_state_dict) -> load, with
  the full model state dict, continues training exactly like the uninterrupted
  run, on another mesh, strategy and layout."""
  state, batches = trained
  ref_params, _ = _reference_with_opt_state(mlp_params(), batches, OPT)
  model_sd = state_dict(state, offload_to_cpu=True, rank0_only=True)
  full_osd = full_optim_state_dict(state)
  for case, orig, convert in [((S.SHARD_GRAD_OP, 3, None), True, shard_full_optim_state_dict),
                              ((S.HYBRID_SHARD, 2, 2), False, scatter_full_optim_state_dict)]:
    target, mesh2, config2 = build(case, orig, params=jax.tree.map(jnp.zeros_like, mlp_params()))
    target = load_state_dict(target, model_sd)
    target = target.replace(opt_state=convert(full_osd, target))
    step2 = fsdp_jax.shard_train_step(mlp_loss, OPT, mesh=mesh2, config=config2)
    for b in batches[2:]:
      target, _ = step2(target, b)
    assert_trees_close(fsdp_jax.summon_full_params(target), ref_params)


def test_offload_and_rank0_only():
  state = next(iter(_small_states()))
  sharded = state_dict(state, state_dict_type=T.SHARDED_STATE_DICT, offload_to_cpu=True)
  assert all(v.sharding.memory_kind == "pinned_host" for v in sharded.values())
  local = state_dict(state, state_dict_type=T.LOCAL_STATE_DICT, offload_to_cpu=True)
  assert local["_flat_param"].sharding.memory_kind == "pinned_host"
  # PyTorch's optimizer default is offload_to_cpu=True: host / pinned host.
  assert isinstance(optim_state_dict(state)["state"]["w"]["0.mu"], np.ndarray)
  sosd = optim_state_dict(state, state_dict_type=T.SHARDED_STATE_DICT)
  assert sosd["state"]["w"]["0.mu"].sharding.memory_kind == "pinned_host"
  # Pinned-host values load back.
  back = load_state_dict(state, sharded, state_dict_type=T.SHARDED_STATE_DICT)
  assert_storage_equal(back.params, state.params)
  with pytest.raises(ValueError, match="rank0_only applies to FULL_STATE_DICT"):
    state_dict(state, state_dict_type=T.SHARDED_STATE_DICT, rank0_only=True)
  assert state_dict(state, rank0_only=True)  # process 0 gets the values


def _small_states():
  mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
  params = {"w": jnp.arange(12.0).reshape(6, 2), "b": jnp.ones(3)}
  yield fsdp_jax.init_train_state(params=params, optimizer=OPT, mesh=mesh,
                                  config=fsdp_jax.FSDPConfig())


# ---------------------------------------------------------------------------
# Errors


def test_load_errors_name_paths_shapes_and_fix(states):
  state = states[((S.FULL_SHARD, 4, None), False)]
  sd = state_dict(state, offload_to_cpu=True)
  bad = dict(sd)
  bad["blocks.0.w"] = np.zeros((7, 8), np.float32)
  del bad["out.w"]
  bad["extra.w"] = np.zeros(3)
  with pytest.raises(ValueError) as e:
    load_state_dict(state, bad)
  msg = str(e.value)
  assert 'Missing key(s) in state_dict: "out.w"' in msg
  assert 'Unexpected key(s) in state_dict: "extra.w"' in msg
  assert "size mismatch for blocks.0.w" in msg and "(7, 8)" in msg and "(7, 7)" in msg
  assert "'shard'" in msg and "Fix:" in msg
  # strict=False: missing keep their values, unexpected are ignored.
  partial = {k: v * 0 for k, v in sd.items() if k != "out.w"}
  partial["extra.w"] = np.zeros(3)
  out = load_state_dict(state, partial, strict=False)
  full = state_dict(out, offload_to_cpu=True)
  np.testing.assert_array_equal(full["out.w"], sd["out.w"])
  assert not full["inp.w"].any()


def test_local_state_dict_refuses_other_plan(states):
  state = states[((S.FULL_SHARD, 4, None), False)]
  local = state_dict(state, state_dict_type=T.LOCAL_STATE_DICT)
  other = states[((S.SHARD_GRAD_OP, 3, None), False)]
  with pytest.raises(ValueError) as e:
    load_state_dict(other, local, state_dict_type=T.LOCAL_STATE_DICT)
  msg = str(e.value)
  assert "('shard',) of total size 4" in msg and "'shard'" in msg and "N=3" in msg
  assert "SHARDED_STATE_DICT" in msg
  with pytest.raises(ValueError, match="original layout"):
    load_state_dict(states[((S.FULL_SHARD, 4, None), True)], local,
                    state_dict_type=T.LOCAL_STATE_DICT)
  with pytest.raises(ValueError, match="LOCAL_STATE_DICT"):
    load_state_dict(state, local)  # wrong type passed


def test_optimizer_state_dict_errors(states):
  state = states[((S.FULL_SHARD, 4, None), True)]
  osd = full_optim_state_dict(state)
  by_id = rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_ID, state)
  with pytest.raises(ValueError, match="rekey_optim_state_dict"):
    optim_state_dict_to_load(state, by_id)
  bad = {"state": {k: dict(v) for k, v in osd["state"].items()},
         "param_groups": [dict(osd["param_groups"][0])]}
  bad["state"]["inp.w"]["0.mu"] = np.zeros((5, 8), np.float32)
  del bad["state"]["out.w"]["0.nu"]
  with pytest.raises(ValueError) as e:
    shard_full_optim_state_dict(bad, state)
  msg = str(e.value)
  assert "state['inp.w']['0.mu']: shape (5, 8)" in msg and "(5, 7)" in msg
  assert "state['out.w']['0.nu']: missing" in msg and "Fix:" in msg
  # An optimizer with other slots (momentum's trace) does not take adam's state.
  sgd_state, _, _ = build((S.FULL_SHARD, 4, None), True, optimizer=optax.sgd(0.1, momentum=0.9))
  with pytest.raises(ValueError, match=r"unexpected slot\(s\) \['0.mu', '0.nu'\]"):
    optim_state_dict_to_load(sgd_state, osd)
  with pytest.raises(ValueError, match="not a parameter of this state"):
    rekey_optim_state_dict({"state": {"nope": {}}, "param_groups": []},
                           OptimStateKeyType.PARAM_ID, state)


# ---------------------------------------------------------------------------
# Generic over the state's fields; masked optimizer states


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateWithBuffers(ShardedTrainState):
  """A train state with a model_state field (Flax batch_stats), as the engine
  will grow one."""

  model_state: Any = None


def test_buffers_join_the_model_state_dict():
  state = next(iter(_small_states()))
  mesh = state.plan.mesh
  stats = {"batch_stats": {"bn": {"mean": jax.device_put(jnp.arange(3.0)),
                                  "var": jnp.ones(3)}}}
  ext = StateWithBuffers(step=state.step, params=state.params, opt_state=state.opt_state,
                         plan=state.plan, model_state=stats)
  sd = state_dict(ext, offload_to_cpu=True)
  assert sorted(sd) == ["b", "batch_stats.bn.mean", "batch_stats.bn.var", "w"]
  sd["batch_stats.bn.mean"] = sd["batch_stats.bn.mean"] + 1
  out = load_state_dict(ext, sd)
  assert out.model_state["batch_stats"]["bn"]["mean"].tolist() == [1.0, 2.0, 3.0]
  assert isinstance(out, StateWithBuffers) and out.plan is ext.plan


def test_masked_optimizer_state():
  """optax.masked leaves MaskedNode holes in the mirrored tree: state dicts
  hold only the parameters that have state, and load back into the holes."""
  params = {"w": jnp.arange(8.0).reshape(4, 2), "b": jnp.ones(3)}
  opt = optax.chain(optax.masked(optax.adam(1e-2), {"w": True, "b": False}), optax.sgd(0.1))
  mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh,
                                    config=fsdp_jax.FSDPConfig(use_orig_params=True))
  osd = full_optim_state_dict(state)
  assert sorted(osd["state"]) == ["w"]
  assert sorted(osd["state"]["w"]) == ["0.inner_state.0.mu", "0.inner_state.0.nu"]
  osd["state"]["w"]["0.inner_state.0.mu"] = np.full((4, 2), 3.0, np.float32)
  mesh3 = fsdp_jax.make_mesh(shard=3, devices=jax.devices()[:3])
  other = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh3,
                                    config=fsdp_jax.FSDPConfig(use_orig_params=True))
  other = other.replace(opt_state=shard_full_optim_state_dict(osd, other))
  np.testing.assert_array_equal(full_optim_state_dict(other)["state"]["w"]["0.inner_state.0.mu"],
                                np.full((4, 2), 3.0))
  step = fsdp_jax.shard_train_step(lambda p, b: jnp.sum(p["w"]) * jnp.mean(b) + jnp.sum(p["b"]),
                                   opt, mesh=mesh3, config=other.plan.config)
  other, _ = step(other, jnp.ones((3,)))
  assert int(other.step) == 1


@pytest.mark.slow
@pytest.mark.parametrize("orig", [False, True], ids=["flat", "orig"])
def test_stacked_layers_round_trip_and_unstack(orig):
  """A stacked unit (leading layer axis, sharded layer by layer) converts to
  the same named full arrays as an unstacked plan of the same tree."""
  k = jax.random.split(jax.random.key(3), 2)
  params = {"layers": {"w": jax.random.normal(k[0], (3, 8, 5)), "b": jnp.ones((3, 5))},
            "head": jax.random.normal(k[1], (5, 2))}
  mesh4 = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
  stacked = fsdp_jax.init_train_state(
      params=params, optimizer=OPT, mesh=mesh4,
      config=fsdp_jax.FSDPConfig(stacked_layers=("layers",), use_orig_params=orig))
  assert any(u.stacked for u in stacked.plan.units)
  sharded = state_dict(stacked, state_dict_type=T.SHARDED_STATE_DICT)
  assert sharded["layers.w"].shape == (3, 8, 5)
  assert sharded["layers.w"].sharding.spec == jax.sharding.PartitionSpec(None, "shard", None)
  mesh3 = fsdp_jax.make_mesh(shard=3, devices=jax.devices()[:3])
  flat = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      params=params, optimizer=OPT, mesh=mesh3, config=fsdp_jax.FSDPConfig(use_orig_params=not orig)))
  out = load_state_dict(flat, sharded, state_dict_type=T.SHARDED_STATE_DICT)
  assert_trees_close(fsdp_jax.summon_full_params(out), params, rtol=0, atol=0)
  osd = random_osd_for(params)
  stacked = stacked.replace(opt_state=optim_state_dict_to_load(stacked, osd))
  assert_osd_equal(full_optim_state_dict(stacked), osd)
  back = load_state_dict(stacked, state_dict(out))
  assert_storage_equal(back.params, stacked.params)


def random_osd_for(params, seed=1):
  rng = np.random.default_rng(seed)
  named = by_name(params)
  return {"state": {n: {"0.mu": rng.standard_normal(x.shape).astype(np.float32),
                        "0.nu": rng.random(x.shape).astype(np.float32)} for n, x in named.items()},
          "param_groups": [{"params": list(named), "0.count": np.int32(2)}]}


def test_program_caches_are_bounded_and_clearable():
  caches = (convert._unpack_fn, convert._pack_fn, convert._ignored_unpack_fn,
            convert._ignored_pack_fn)
  assert all(c.cache_info().maxsize == convert._CACHE_SIZE for c in caches)
  state, _, _ = build(CASES[0], False)
  clear_caches()
  sd = state_dict(state, state_dict_type=T.SHARDED_STATE_DICT)
  assert convert._unpack_fn.cache_info().currsize > 0
  clear_caches()
  assert all(c.cache_info().currsize == 0 for c in caches)
  load_state_dict(state, sd, state_dict_type=T.SHARDED_STATE_DICT)  # builds them again
  assert convert._pack_fn.cache_info().currsize > 0
