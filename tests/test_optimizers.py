"""Optimizers as users bring them: every optax transformation sees the tree
passed to ``init_train_state`` and computes what it computes unsharded, under
every strategy, both layouts and meshes that do not divide the leaf sizes.

Two levels:

* the update alone (``fsdp_jax.custom.optimizer_step`` inside ``shard_map``), fed
  the same gradients as plain single-device optax: this isolates the
  optimizer and checks every optimizer in optax and optax.contrib;
* whole ``shard_train_step`` runs against single-device training for the
  optimizers real users run (clipping + adamw, lamb, adafactor, masks,
  multi_transform), plus the state-dict and checkpoint paths of state that
  is not shaped like the parameters.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import fsdp_jax
from fsdp_jax._src import hlo, layout, optim
from fsdp_jax._src import state as state_lib
from fsdp_jax import ShardingStrategy as S

from helpers import mesh_for

STEPS = 3
RTOL = 1e-5  # relative to the largest entry of each leaf


def _params(seed=0):
  """Leaf sizes no mesh size here divides; ``mid.w`` is large enough for
  Adafactor to factor it (both dims >= 128)."""
  k = jax.random.split(jax.random.key(seed), 6)
  return {
      "inp": {"w": jax.random.normal(k[0], (5, 130)) * 0.3, "b": jnp.full((130,), 0.1)},
      "mid": {"w": jax.random.normal(k[1], (130, 129)) * 0.1},
      "out": {"w": jax.random.normal(k[2], (129, 3)) * 0.3, "b": jnp.zeros((3,))},
  }


def _grads(params, t):
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(100 + t), len(leaves))
  return treedef.unflatten([jax.random.normal(k, x.shape) * (1.0 + t)
                            for k, x in zip(keys, leaves)])


WRAP = fsdp_jax.ModuleWrapPolicy({"inp", "mid"})

# (strategy, shard size, replicate size)
UPDATE_CASES = [(S.FULL_SHARD, 8, None), (S.SHARD_GRAD_OP, 4, None), (S.NO_SHARD, 3, None),
                (S.HYBRID_SHARD, 3, 2), (S._HYBRID_SHARD_ZERO2, 2, 2)]


def _case_id(case):
  s, n, r = case
  return f"{s.name}-{r}x{n}" if r else f"{s.name}-{n}"


def _storage(plan, trees):
  """Full trees -> the stored layout (global arrays), as init packs params;
  one program for all of them."""
  def pack(trees):
    out = []
    for tree in trees:
      flat = jax.tree_util.tree_leaves(tree)
      per_unit = {u.index: layout.pack_unit(plan, u, {i: flat[i] for i in u.leaf_ids})
                  for u in plan.units}
      ignored = state_lib.pack_ignored(plan, flat) if plan.ignored_leaves else {}
      out.append(state_lib.assemble_storage(plan, per_unit, ignored))
    return out

  shardings = plan.storage_shardings()
  return jax.jit(pack, out_shardings=[shardings] * len(trees))(trees)


_STORED_GRADS = {}  # (case, layout, steps, wrap) -> the stored gradients of _params()


def _update_run(optimizer, case, use_orig_params, *, value=None, steps=STEPS, params=None,
                mode="auto", wrap=WRAP):
  """``steps`` sharded optimizer steps on fixed gradients; returns the full
  params and the state."""
  strategy, n, r = case
  key = (case, use_orig_params, steps, wrap) if params is None else None
  params = _params() if params is None else params
  mesh = mesh_for(strategy, n, r)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=wrap,
                               use_orig_params=use_orig_params, optimizer_update=mode)
  state = fsdp_jax.init_train_state(params=params, optimizer=optimizer, mesh=mesh, config=config)
  plan = state.plan
  p_specs = fsdp_jax.custom.param_specs(plan)
  g_specs = fsdp_jax.custom.split_trainable(plan, p_specs)[0]
  o_specs, _ = fsdp_jax.custom.opt_state_specs(plan, optimizer)

  def body(g, s, p):
    return fsdp_jax.custom.optimizer_step(optimizer, g, s, p, plan=plan, value=value)

  step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(g_specs, o_specs, p_specs),
                               out_specs=(p_specs, o_specs), check_vma=False))
  p, s = state.params, state.opt_state
  stored = _STORED_GRADS.get(key) if key else None
  if stored is None:  # the same stored gradients for every optimizer
    stored = _storage(plan, [_grads(params, t) for t in range(steps)])
    if key:
      _STORED_GRADS[key] = stored
  for g in stored:
    p, s = step(fsdp_jax.custom.split_trainable(plan, g)[0], s, p)
  state = state.replace(params=p, opt_state=s)
  return fsdp_jax.summon_full_params(state), state


def _reference(optimizer, *, value=None, steps=STEPS, params=None):
  params = _params() if params is None else params
  s = optimizer.init(params)
  kw = {} if value is None else {"value": value}
  for t in range(steps):
    u, s = optimizer.update(_grads(params, t), s, params, **kw)
    params = optax.apply_updates(params, u)
  return params, s


_REFERENCES = {}


def _cached_reference(name, value=None):
  """``_reference`` of a named optimizer with the default parameters and
  steps, computed once per file: the layouts and strategies compare with
  the same single-device run."""
  if name not in _REFERENCES:
    _REFERENCES[name] = _reference(OPTIMIZERS[name], value=value)
  return _REFERENCES[name]


def assert_close_to_largest(actual, expected, rtol=RTOL):
  """Every leaf agrees to ``rtol`` relative to its largest entry."""
  a_leaves, a_def = jax.tree_util.tree_flatten(actual)
  e_leaves, e_def = jax.tree_util.tree_flatten(expected)
  assert a_def == e_def, (a_def, e_def)
  for path_a, a, e in zip(jax.tree_util.tree_flatten_with_path(actual)[0], a_leaves, e_leaves):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    assert a.shape == e.shape, (path_a[0], a.shape, e.shape)
    scale = max(np.max(np.abs(e)), 1e-12)
    err = np.max(np.abs(a - e)) / scale
    assert err <= rtol, f"{jax.tree_util.keystr(path_a[0])}: max error {err:.2e} of the largest entry"


# ---------------------------------------------------------------------------
# Every optimizer in optax and optax.contrib (the update alone)

LR = 1e-2


def _every_optimizer():
  c = optax.contrib
  out = {
      # optax's optimizers, as their aliases build them
      "adabelief": optax.adabelief(LR), "adadelta": optax.adadelta(LR),
      "adafactor": optax.adafactor(LR), "adagrad": optax.adagrad(LR), "adam": optax.adam(LR),
      "adamax": optax.adamax(LR), "adamaxw": optax.adamaxw(LR), "adamw": optax.adamw(LR),
      "adan": optax.adan(LR), "amsgrad": optax.amsgrad(LR), "fromage": optax.fromage(LR),
      "lamb": optax.lamb(LR), "lars": optax.lars(LR), "lion": optax.lion(LR),
      "nadam": optax.nadam(LR), "nadamw": optax.nadamw(LR),
      "noisy_sgd": optax.noisy_sgd(LR, key=jax.random.key(3)),
      "novograd": optax.novograd(LR), "optimistic_adam": optax.optimistic_adam(LR),
      "optimistic_adam_v2": optax.optimistic_adam_v2(LR),
      "optimistic_gradient_descent": optax.optimistic_gradient_descent(LR),
      "polyak_sgd": optax.polyak_sgd(), "radam": optax.radam(LR), "rmsprop": optax.rmsprop(LR),
      "rprop": optax.rprop(LR), "sgd": optax.sgd(LR), "sgd_momentum": optax.sgd(LR, 0.9, True),
      "sign_sgd": optax.sign_sgd(LR), "signum": optax.signum(LR), "sm3": optax.sm3(LR),
      "yogi": optax.yogi(LR),
      # optax.contrib
      "acprop": c.acprop(LR), "ademamix": c.ademamix(LR), "adopt": c.adopt(LR),
      "cocob": c.cocob(LR), "dadapt_adamw": c.dadapt_adamw(LR), "dog": c.dog(LR),
      "dowg": c.dowg(LR), "madgrad": c.madgrad(LR), "mechanize": c.mechanize(optax.adam(LR)),
      "momo": c.momo(LR), "momo_adam": c.momo_adam(LR), "muon": c.muon(LR),
      "prodigy": c.prodigy(LR), "sam": c.sam(optax.sgd(LR), optax.sgd(LR)),
      "schedule_free": c.schedule_free(optax.adam(LR), LR),
      "schedule_free_adamw": c.schedule_free_adamw(LR),
      "schedule_free_sgd": c.schedule_free_sgd(LR),
      "simplified_ademamix": c.simplified_ademamix(LR),
      "reduce_on_plateau": optax.chain(optax.adam(LR), c.reduce_on_plateau(patience=1)),
      "galore": c.galore(LR, rank=4, update_proj_gap=2),
      # transformations users chain
      "clip_by_global_norm+adamw": optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(LR)),
      "clip+sgd": optax.chain(optax.clip(0.3), optax.sgd(LR)),
      "clip_by_block_rms+adam": optax.chain(optax.clip_by_block_rms(0.5), optax.adam(LR)),
      "adaptive_grad_clip+sgd": optax.chain(optax.adaptive_grad_clip(0.1), optax.sgd(LR)),
      "centralize+adam": optax.chain(optax.centralize(), optax.adam(LR)),
      "zero_nans+adam": optax.chain(optax.zero_nans(), optax.adam(LR)),
      "ema+sgd": optax.chain(optax.ema(0.9), optax.sgd(LR)),
      "normalize_by_update_norm": optax.chain(optax.normalize_by_update_norm(), optax.sgd(LR)),
      "flatten(adam)": optax.flatten(optax.adam(LR)),
      "inject_hyperparams": optax.inject_hyperparams(optax.adamw)(
          learning_rate=optax.cosine_decay_schedule(LR, 10), weight_decay=0.1),
      "apply_if_finite": optax.apply_if_finite(optax.adam(LR), 3),
      "MultiSteps": optax.MultiSteps(optax.adam(LR), every_k_schedule=2),
      "masked": optax.masked(optax.adam(LR), lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
      "adamw(mask=callable)": optax.adamw(LR, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
      "adamw(mask=tree)": optax.adamw(LR, mask={"inp": {"w": True, "b": False},
                                               "mid": {"w": True},
                                               "out": {"w": True, "b": False}}),
      "multi_transform": optax.multi_transform(
          {"big": optax.adamw(LR), "small": optax.sgd(LR, 0.9)},
          lambda p: jax.tree.map(lambda x: "big" if x.ndim > 1 else "small", p)),
      "keep_params_nonnegative": optax.chain(optax.sgd(LR), optax.keep_params_nonnegative()),
  }
  return out


OPTIMIZERS = _every_optimizer()
# Transformations that take the loss (``value=``); the step passes the global mean loss.
NEEDS_VALUE = {"polyak_sgd", "momo", "momo_adam", "reduce_on_plateau"}


# The update of these is checked under every strategy and both layouts below
# (on 3 devices too, FULL_SHARD), with the optimizer state.
KEY_OPTIMIZERS = ["clip_by_global_norm+adamw", "clip+sgd", "lamb", "adafactor",
                  "adamw(mask=tree)", "multi_transform", "muon", "MultiSteps"]
# Purely entrywise updates (no reduction over a leaf or across leaves, no
# reshape, no random draw, no mask): the stored layout changes nothing in
# them, so each runs on one layout, alternating; every other optimizer runs
# on both (a flat unit holds several leaves in one buffer: reductions,
# reshapes, noise and masks see its leaf boundaries).
ENTRYWISE = ["acprop", "adabelief", "adadelta", "adagrad", "adam", "adamax", "adamaxw",
             "adamw", "adan", "ademamix", "adopt", "amsgrad", "cocob", "ema+sgd",
             "inject_hyperparams", "keep_params_nonnegative", "lion", "madgrad", "nadam",
             "nadamw", "optimistic_adam", "optimistic_adam_v2", "optimistic_gradient_descent",
             "radam", "rmsprop", "rprop", "schedule_free", "schedule_free_adamw",
             "schedule_free_sgd", "sgd", "sgd_momentum", "sign_sgd", "signum",
             "simplified_ademamix", "yogi"]
# Updates whose only coupling across entries is a sum over the whole tree
# (global norms and inner products) or over each whole leaf (per-leaf
# norms): the same Partial sums over the leaves' entries in a layout, so each
# runs on one layout, alternating (a global norm and lamb's per-leaf norms
# run in both layouts on every strategy below, with the key optimizers);
# reductions along some axes, reshapes, noise and masks run on both.
GLOBAL_SUM = ["dadapt_adamw", "dog", "dowg", "mechanize", "momo", "momo_adam",
              "normalize_by_update_norm", "polyak_sgd", "prodigy", "sam",
              # a sum over each whole leaf (lamb's, on every strategy below)
              "clip_by_block_rms+adam", "fromage", "lars", "novograd"]
EVERY_RUNS = ([(name, orig) for name in sorted(OPTIMIZERS)
               if name not in KEY_OPTIMIZERS + ENTRYWISE + GLOBAL_SUM for orig in (False, True)]
              + [(name, i % 2 == 1) for i, name in enumerate(ENTRYWISE)]
              + [(name, i % 2 == 0) for i, name in enumerate(GLOBAL_SUM)])


@pytest.mark.slow
@pytest.mark.parametrize("name,use_orig_params", EVERY_RUNS,
                         ids=[f"{n}-{'orig' if o else 'flat'}" for n, o in EVERY_RUNS])
def test_every_optimizer_update_matches_optax(name, use_orig_params):
  """The sharded update of every optax / optax.contrib optimizer equals
  single-device optax on the same gradients (3 devices: no leaf divides)."""
  opt = OPTIMIZERS[name]
  value = jnp.float32(0.7) if name in NEEDS_VALUE else None
  got, _ = _update_run(opt, (S.FULL_SHARD, 3, None), use_orig_params, value=value)
  want, _ = _cached_reference(name, value=value)
  assert_close_to_largest(got, want)


# The key optimizers whose update reduces or gathers across the shards (a
# global norm, per-leaf norms, replicated factored statistics, Muon's whole
# matrices) run on every case (each on 8, 4, 3 and 2x3 devices: no leaf
# divides), in one layout, alternating, so that every case runs in both
# layouts and every optimizer in both layouts (the sharded update alone on
# FULL_SHARD-3 is checked for every other optimizer above). The masks,
# MultiSteps and clipping entry by entry reduce nothing across the shards:
# each runs on FULL_SHARD-3 in both layouts and one more strategy.
COLLECTIVE_OPTIMIZERS = ["clip_by_global_norm+adamw", "lamb", "adafactor", "muon"]
STRATEGY_RUNS = ([(name, (S.FULL_SHARD, 3, None), orig) for name in KEY_OPTIMIZERS
                  if name not in COLLECTIVE_OPTIMIZERS for orig in (False, True)]
                 + [(name, case, (i + j) % 2 == 1) for i, name in enumerate(COLLECTIVE_OPTIMIZERS)
                    for j, case in enumerate(UPDATE_CASES)]
                 + [(name, UPDATE_CASES[1 + i], i % 2 == 1) for i, name in enumerate(
                     n for n in KEY_OPTIMIZERS if n not in COLLECTIVE_OPTIMIZERS)])


@pytest.mark.slow
@pytest.mark.parametrize("name,case,use_orig_params", STRATEGY_RUNS,
                         ids=[f"{n}-{_case_id(c)}-{'orig' if o else 'flat'}"
                              for n, c, o in STRATEGY_RUNS])
def test_update_matches_optax_on_every_strategy(name, case, use_orig_params):
  opt = OPTIMIZERS[name]
  got, state = _update_run(opt, case, use_orig_params)
  want, want_state = _cached_reference(name)
  assert_close_to_largest(got, want)
  # The optimizer state too, named per parameter (PyTorch's layout).
  osd = fsdp_jax.full_optim_state_dict(state)
  ref = _named_state(want_state, state.plan)
  for pname, slots in ref["state"].items():
    for slot, x in slots.items():
      assert_close_to_largest(osd["state"][pname][slot], x)
  for k, x in ref["groups"].items():
    np.testing.assert_allclose(np.asarray(osd["param_groups"][0][k], np.float64),
                               np.asarray(x, np.float64), rtol=1e-5, atol=1e-6)


def _named_state(opt_state, plan):
  """A single-device optax state, named as optim_state_dict names it."""
  lay = optim.build_layout(plan, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype), opt_state))
  names = [l.name for l in plan.leaves]
  state, groups = {}, {}
  for e, x in zip(lay.entries, jax.tree.leaves(opt_state)):
    if e.kind == "group":
      groups[e.path] = x
    else:
      state.setdefault(names[e.param], {})[e.slot] = x
  return {"state": state, "groups": groups}


@pytest.mark.slow
@pytest.mark.parametrize("use_orig_params,names", [
    (False, ("clip_by_global_norm+adamw", "adafactor")), (True, ("adafactor", "muon"))],
    ids=["flat", "orig"])
def test_global_mode_matches(use_orig_params, names):
  """``optimizer_update="global"`` (the compiler partitions the update)
  computes the same. Adafactor (state shaped like the parameters and
  replicated factored state) in both layouts, a global norm and Muon's
  matrix iterations in one each: the compiler partitions the optimizer's
  arithmetic, the layout is only packed and unpacked around it."""
  for name in names:
    opt = OPTIMIZERS[name]
    got = _global_run(opt, use_orig_params)
    want, _ = _cached_reference(name)
    assert_close_to_largest(got, want)


def _global_run(opt, use_orig_params, case=(S.FULL_SHARD, 3, None)):
  """``shard_train_step`` with a loss whose gradient is the fixed gradient."""
  strategy, n, r = case
  params = _params()
  mesh = mesh_for(strategy, n, r)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP,
                               use_orig_params=use_orig_params, optimizer_update="global")
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  assert state.plan.opt_update.mode == "global"

  def loss_fn(p, batch):  # d loss / d p = g (the batch carries g, one row per device)
    g = jax.tree.map(lambda x: x[0], batch)
    return sum(jnp.sum(a * b) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(g)))

  step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config)
  layout0 = _shardings(state)
  for t in range(STEPS):
    g = _grads(params, t)
    batch = jax.tree.map(lambda x: jnp.broadcast_to(x[None], (n * (r or 1),) + x.shape), g)
    state, _ = step(state, batch)
    assert _shardings(state) == layout0  # the step keeps the state's layout
  return fsdp_jax.summon_full_params(state)


def _shardings(state):
  return jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), (state.params, state.opt_state))


# ---------------------------------------------------------------------------
# What the optimizer sees


class _Recorder:
  """An optax transformation that records the trees it is given."""

  def __init__(self):
    self.seen = {}

  def transformation(self):
    def record(kind, tree):
      self.seen[kind] = jax.tree_util.tree_map_with_path(
          lambda p, x: (jax.tree_util.keystr(p), tuple(x.shape), jnp.dtype(x.dtype).name), tree)

    def init(params):
      record("init", params)
      return optax.EmptyState()

    def update(updates, state, params=None):
      record("updates", updates)
      record("params", params)
      return updates, state

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("use_orig_params", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["flat", "orig"])
def test_optimizer_sees_the_users_tree(use_orig_params):
  params = _params()
  params["mid"]["w"] = params["mid"]["w"].astype(jnp.bfloat16)
  rec = _Recorder()
  opt = optax.chain(rec.transformation(), optax.sgd(LR))
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({"inp", "mid", "out"}),
                               use_orig_params=use_orig_params)
  mesh = mesh_for(S.FULL_SHARD, 3)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)

  def loss_fn(p, batch):
    h = jnp.tanh(batch["x"] @ p["inp"]["w"] + p["inp"]["b"])
    h = jnp.tanh(h @ p["mid"]["w"].astype(jnp.float32))
    return jnp.mean((h @ p["out"]["w"] + p["out"]["b"] - batch["y"]) ** 2)

  step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config)
  batch = {"x": jnp.ones((6, 5)), "y": jnp.zeros((6, 3))}
  state, _ = step(state, batch)
  want = jax.tree_util.tree_map_with_path(
      lambda p, x: (jax.tree_util.keystr(p), tuple(x.shape), jnp.dtype(x.dtype).name), params)
  for kind in ("init", "updates", "params"):
    assert rec.seen[kind] == want, kind


def test_frozen_leaves_are_none_for_the_optimizer():
  params = _params()
  rec = _Recorder()
  opt = optax.chain(rec.transformation(), optax.adam(LR))
  requires_grad = {"inp": True, "mid": False, "out": True}
  for use_orig_params in (False, True):
    config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, use_orig_params=use_orig_params)
    fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh_for(S.FULL_SHARD, 3),
                              config=config, requires_grad=requires_grad)
    assert rec.seen["init"]["mid"]["w"] is None
    assert rec.seen["init"]["inp"]["w"][1] == (5, 130)


# ---------------------------------------------------------------------------
# Whole training steps against single-device training


def _mlp_loss(p, batch):
  h = jnp.tanh(batch["x"] @ p["inp"]["w"] + p["inp"]["b"])
  h = jnp.tanh(h @ p["mid"]["w"])
  return jnp.mean((h @ p["out"]["w"] + p["out"]["b"] - batch["y"]) ** 2)


def _batches(n_steps=4, rows=24):
  out = []
  for t in range(n_steps):
    k1, k2 = jax.random.split(jax.random.key(50 + t))
    out.append({"x": jax.random.normal(k1, (rows, 5)), "y": jax.random.normal(k2, (rows, 3))})
  return out


TRAIN_OPTIMIZERS = ["clip_by_global_norm+adamw", "clip+sgd", "lamb", "adafactor",
                    "adamw(mask=tree)", "adamw(mask=callable)", "multi_transform"]
TRAIN_CASES = [(S.FULL_SHARD, 3, None), (S.SHARD_GRAD_OP, 3, None), (S.NO_SHARD, 2, None),
               (S.HYBRID_SHARD, 3, 2), (S._HYBRID_SHARD_ZERO2, 3, 2)]
# Every optimizer on FULL_SHARD; a global norm or factored moments under
# every other strategy (the update alone is checked under every strategy
# and both layouts above). The step around the update is the same for
# every optimizer: each run in one layout, alternating, so that both
# optimizers with collectives or replicated state in the update train in
# both layouts, and FULL_SHARD too.
TRAIN_RUNS = ([("clip_by_global_norm+adamw", TRAIN_CASES[0], False),
               ("adafactor", TRAIN_CASES[0], True)]
              + [(name, TRAIN_CASES[0], i % 2 == 1)
                 for i, name in enumerate(TRAIN_OPTIMIZERS[1:3] + TRAIN_OPTIMIZERS[4:])]
              + [(("clip_by_global_norm+adamw", "adafactor")[j % 2], case, j // 2 == 1)
                 for j, case in enumerate(TRAIN_CASES[1:])])


@pytest.mark.slow
@pytest.mark.parametrize("name,case,use_orig_params", TRAIN_RUNS,
                         ids=[f"{n}-{_case_id(c)}-{'orig' if o else 'flat'}"
                              for n, c, o in TRAIN_RUNS])
def test_training_matches_single_device(name, case, use_orig_params):
  opt = OPTIMIZERS[name]
  strategy, n, r = case
  params, batches = _params(), _batches()
  mesh = mesh_for(strategy, n, r)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP,
                               use_orig_params=use_orig_params)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(_mlp_loss, opt, mesh=mesh, config=config)
  layout0 = _shardings(state)
  ref_p, ref_s = params, opt.init(params)
  for batch in batches:
    state, metrics = step(state, batch)
    assert _shardings(state) == layout0
    loss, g = jax.value_and_grad(_mlp_loss)(ref_p, batch)
    u, ref_s = opt.update(g, ref_s, ref_p)
    ref_p = optax.apply_updates(ref_p, u)
    assert abs(float(metrics["loss"]) - float(loss)) <= 1e-5
  assert_close_to_largest(fsdp_jax.summon_full_params(state), ref_p)


@pytest.mark.slow
def test_clip_by_global_norm_costs_one_scalar_all_reduce():
  """clip_by_global_norm + adamw compiles to adamw's collectives plus one
  scalar all-reduce: no gather of the model."""
  def ops(opt, use_orig_params):
    mesh = mesh_for(S.FULL_SHARD, 3)
    config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, use_orig_params=use_orig_params)
    state = fsdp_jax.init_train_state(params=_params(), optimizer=opt, mesh=mesh, config=config)
    step = fsdp_jax.shard_train_step(_mlp_loss, opt, mesh=mesh, config=config, donate=False)
    text = step.jitted.lower(state, _batches(1)[0]).compile().as_text()
    return hlo.summarize(text)

  for use_orig_params in (False, True):
    base = ops(optax.adamw(LR), use_orig_params)
    clipped = ops(OPTIMIZERS["clip_by_global_norm+adamw"], use_orig_params)
    assert clipped["all-gather"] == base["all-gather"]
    assert clipped["reduce-scatter"] == base["reduce-scatter"]
    assert clipped["all-reduce"]["operands"] == base["all-reduce"]["operands"] + 1
    assert clipped["all-reduce"]["bytes"] == base["all-reduce"]["bytes"] + 4


# ---------------------------------------------------------------------------
# State that is not shaped like the parameters


@functools.lru_cache(maxsize=None)
def _adafactor_state(use_orig_params):
  """Three Adafactor steps on FULL_SHARD over 3 devices, once per layout for
  the tests below (which only read the state)."""
  opt = OPTIMIZERS["adafactor"]
  _, state = _update_run(opt, (S.FULL_SHARD, 3, None), use_orig_params)
  return opt, state


# init is constants only: zero slots (adam, in masks and chains), factored
# zeros (adafactor), hyperparameters, a flattened state, arrays of constants
# (muon's coefficients), counters (MultiSteps).
CONSTANT_INITS = {name: OPTIMIZERS[name] for name in [
    "adam", "adafactor", "flatten(adam)", "muon", "MultiSteps", "multi_transform",
    "adamw(mask=tree)"]}
CONSTANT_INITS["inject_hyperparams(constants)"] = optax.inject_hyperparams(optax.adamw)(
    learning_rate=LR, weight_decay=0.1)
# init reads the params (a copy of them), holds a nonzero slot or a key, or
# computes (a schedule's value at step 0).
GENERAL_INITS = {name: OPTIMIZERS[name] for name in [
    "schedule_free", "adagrad", "noisy_sgd", "inject_hyperparams"]}


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_constant_init_is_stored_as_the_evaluated_init(use_orig_params):
  """An ``optimizer.init`` made of constants is stored without a program:
  the same tree, dtypes, shardings and bits (padding included: 3 devices
  divide no leaf) as ``init`` evaluated on the shards; any other init is
  evaluated."""
  mesh = mesh_for(S.FULL_SHARD, 3)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, use_orig_params=use_orig_params)
  state = fsdp_jax.init_train_state(params=_params(), optimizer=optax.sgd(LR), mesh=mesh,
                                    config=config)
  for name, opt in {**CONSTANT_INITS, **GENERAL_INITS}.items():
    closed, shapes = optim.trace_init(state.plan, opt)
    plan = dataclasses.replace(state.plan, opt_layout=optim.layout_for(state.plan, opt, shapes),
                               optimizer=opt)
    fast = optim.constant_init(plan, plan.opt_layout, closed)
    if name in GENERAL_INITS:
      assert fast is None, name
      continue
    assert fast is not None, name
    evaluated = state_lib._init_opt_state(plan, opt, state.params)  # no jaxpr: evaluated
    assert jax.tree.structure(fast) == jax.tree.structure(evaluated), name
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(fast)[0],
                            jax.tree.leaves(evaluated)):
      where = f"{name}: {jax.tree_util.keystr(path)}"
      assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype)
      assert a.sharding == b.sharding, (where, a.sharding, b.sharding)
      bits = lambda x: np.atleast_1d(np.asarray(x)).view(np.uint8)
      np.testing.assert_array_equal(bits(a), bits(b), err_msg=where)


@pytest.mark.slow
@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_factored_state_is_replicated_and_named_per_parameter(use_orig_params):
  opt, state = _adafactor_state(use_orig_params)
  lay = state.opt_state.layout
  kinds = {(e.slot, state.plan.leaves[e.param].name): e.kind
           for e in lay.entries if e.kind != "group"}
  # mid.w (130 x 129) is factored: its row/column statistics are replicated
  # per-parameter state; the others keep a full second moment, sharded.
  v_row = [k for k in kinds if k[1] == "mid.w" and k[0].endswith("v_row")]
  assert v_row and kinds[v_row[0]] == "param"
  v_full = [k for k in kinds if k[1] == "inp.w" and k[0].endswith(".v")]
  assert v_full and kinds[v_full[0]] == "slot"
  osd = fsdp_jax.full_optim_state_dict(state)
  _, want_state = _cached_reference("adafactor")
  ref = _named_state(want_state, state.plan)
  for pname, slots in ref["state"].items():
    for slot, x in slots.items():
      assert osd["state"][pname][slot].shape == np.shape(x)
      assert_close_to_largest(osd["state"][pname][slot], x)


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_factored_state_reshards_through_state_dicts(use_orig_params):
  """full -> shard onto another device count and layout -> training goes on
  as unsharded; LOCAL and rekeyed dicts round-trip."""
  opt, state = _adafactor_state(use_orig_params)
  full = fsdp_jax.full_optim_state_dict(state)
  mesh = mesh_for(S.FULL_SHARD, 4)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, use_orig_params=not use_orig_params)
  target = fsdp_jax.init_train_state(params=fsdp_jax.summon_full_params(state), optimizer=opt,
                                     mesh=mesh, config=config)
  target = target.replace(opt_state=fsdp_jax.shard_full_optim_state_dict(full, target))
  again = fsdp_jax.full_optim_state_dict(target)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               again, full)
  by_id = fsdp_jax.rekey_optim_state_dict(full, fsdp_jax.OptimStateKeyType.PARAM_ID, target)
  back = fsdp_jax.rekey_optim_state_dict(by_id, fsdp_jax.OptimStateKeyType.PARAM_NAME, target)
  assert sorted(back["state"]) == sorted(full["state"])
  scattered = fsdp_jax.scatter_full_optim_state_dict(full, target)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               scattered, target.opt_state)
  local = fsdp_jax.optim_state_dict(target, state_dict_type=fsdp_jax.StateDictType.LOCAL_STATE_DICT)
  loaded = fsdp_jax.optim_state_dict_to_load(
      target, local, state_dict_type=fsdp_jax.StateDictType.LOCAL_STATE_DICT)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               loaded, target.opt_state)


@pytest.mark.parametrize("use_orig_params", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["flat", "orig"])
def test_factored_state_checkpoint_restores_on_other_mesh(use_orig_params, tmp_path):
  opt, state = _adafactor_state(use_orig_params)
  with fsdp_jax.CheckpointManager(tmp_path) as manager:
    manager.save(state, force=True)
    manager.wait_until_finished()
    config = fsdp_jax.FSDPConfig(sharding_strategy=S.SHARD_GRAD_OP, auto_wrap_policy=WRAP,
                                 use_orig_params=use_orig_params)
    target = fsdp_jax.init_train_state(params=_params(), optimizer=opt,
                                       mesh=mesh_for(S.SHARD_GRAD_OP, 4), config=config)
    restored = manager.restore(target)
  a, b = fsdp_jax.full_optim_state_dict(restored), fsdp_jax.full_optim_state_dict(state)
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig"])
def test_plan_reports_true_optimizer_bytes(use_orig_params):
  for name in ("adamw", "adafactor", "clip_by_global_norm+adamw"):
    opt = OPTIMIZERS[name]
    mesh = mesh_for(S.FULL_SHARD, 3)
    config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, use_orig_params=use_orig_params)
    state = fsdp_jax.init_train_state(params=_params(), optimizer=opt, mesh=mesh, config=config)
    dev = mesh.devices.flat[0]
    held = sum(s.data.nbytes for x in jax.tree.leaves(state.opt_state)
               for s in x.addressable_shards if s.device == dev)
    sharded, replicated = optim.state_bytes(state.plan, state.opt_state.layout)
    assert sharded + replicated == held
    assert f"optimizer state: {held:,} bytes/device" in str(state.plan)


# ---------------------------------------------------------------------------
# Refused, with the transformation named


@pytest.mark.parametrize("opt, inner, arg", [
    (optax.lbfgs(LR), "scale_by_zoom_linesearch", "value_fn"),
    (optax.contrib.sophia(LR), "hutchinson_estimator_diag_hessian", "obj_fn"),
], ids=["lbfgs", "sophia"])
def test_transformation_that_needs_other_arguments_is_refused(opt, inner, arg):
  mesh = mesh_for(S.FULL_SHARD, 3)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP)
  with pytest.raises(ValueError) as e:
    fsdp_jax.init_train_state(params=_params(), optimizer=opt, mesh=mesh, config=config)
  msg = str(e.value)
  assert f"update ({inner})" in msg and arg in msg and "Fix:" in msg


def test_offload_refuses_collectives_in_the_update():
  mesh = mesh_for(S.FULL_SHARD, 3)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP,
                               cpu_offload=fsdp_jax.CPUOffload(offload_params=True))
  with pytest.raises(ValueError, match=r"needs collectives.*Fix:.*max_norm"):
    fsdp_jax.init_train_state(params=_params(), optimizer=OPTIMIZERS["clip_by_global_norm+adamw"],
                              mesh=mesh, config=config)


def test_global_mode_refuses_ignored_states():
  mesh = mesh_for(S.FULL_SHARD, 3)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, ignored_states=["out"],
                               optimizer_update="global")
  with pytest.raises(ValueError, match=r"ignored_states.*Fix"):
    fsdp_jax.init_train_state(params=_params(), optimizer=optax.adam(LR), mesh=mesh, config=config)


def test_step_refuses_a_different_optimizer():
  mesh = mesh_for(S.FULL_SHARD, 3)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP)
  state = fsdp_jax.init_train_state(params=_params(), optimizer=optax.adam(LR), mesh=mesh,
                                    config=config)
  step = fsdp_jax.shard_train_step(_mlp_loss, optax.sgd(LR, 0.9), mesh=mesh, config=config)
  with pytest.raises(ValueError, match="the optimizer you pass"):
    step(state, _batches(1)[0])


def test_the_optimizer_is_given_once():
  """shard_train_step(loss_fn) takes init_train_state's optimizer: the same
  numbers as passing it, and one step serves states built with different
  optimizers (on meshes of 3 and 8 devices), each with its own (never a
  trace made for another)."""
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP)
  chain = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(LR, weight_decay=0.1))
  batches = _batches(2)
  step = fsdp_jax.shard_train_step(_mlp_loss)
  for opt, n in ((chain, 3), (optax.sgd(LR, 0.9), 8), (optax.adafactor(LR), 3)):
    mesh = mesh_for(S.FULL_SHARD, n)
    given, taken = (fsdp_jax.init_train_state(params=_params(), optimizer=opt, mesh=mesh,
                                              config=config) for _ in range(2))
    explicit = fsdp_jax.shard_train_step(_mlp_loss, opt)
    for b in batches:
      given, m_given = explicit(given, b)
      taken, m_taken = step(taken, b)
      assert float(m_given["loss"]) == float(m_taken["loss"])
    jax.tree.map(np.testing.assert_array_equal, fsdp_jax.summon_full_params(given),
                 fsdp_jax.summon_full_params(taken))
    assert taken.plan.optimizer is given.plan.optimizer


def test_docs_list_exactly_the_verified_optimizers():
  """docs/optimizers.md's verified list is what this file checks."""
  import pathlib
  import re
  text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "optimizers.md").read_text()
  section = text.split("## Verified optimizers")[1]
  listed = section.split("\n\n`clip_by_global_norm+adamw`, `clip+sgd`")[0]
  names = set(re.findall(r"`([^`]+)`", listed.split("steps):", 1)[1]))
  assert names == set(OPTIMIZERS), names ^ set(OPTIMIZERS)
  for name in KEY_OPTIMIZERS + TRAIN_OPTIMIZERS:
    assert f"`{name}`" in section
  assert set(ENTRYWISE) <= set(OPTIMIZERS) - set(KEY_OPTIMIZERS)
  assert set(GLOBAL_SUM) <= set(OPTIMIZERS) - set(KEY_OPTIMIZERS) - set(ENTRYWISE)
  assert {n for n, _ in EVERY_RUNS} | set(KEY_OPTIMIZERS) == set(OPTIMIZERS)
