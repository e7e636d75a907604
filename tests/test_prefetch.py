"""backward_prefetch, forward_prefetch and limit_all_gathers.

Each setting orders the step's collectives against its computation (see
``fsdp_jax.schedule.ordered``). The tests read the compiled, scheduled HLO:
the order of all-gathers and reduce-scatters, and which units' gathered
parameters are live at each instruction. Numbers never change.
"""

from __future__ import annotations

import functools

import jax
import optax
import pytest

import fsdp_jax
from fsdp_jax._src import hlo
from helpers import (assert_trees_close, mesh_for, mlp_batch, mlp_loss, mlp_params,
                     reference_run, sharded_run)

BP = fsdp_jax.BackwardPrefetch
FS = fsdp_jax.ShardingStrategy
# Every leaf in a unit of its own kind: inp, blocks.0..3, out (6 units, the
# root holds nothing), one matmul per unit.
WRAP = fsdp_jax.ModuleWrapPolicy(["inp", "blocks.*", "out"])
BLOCKS = 4
FORWARD = ["inp"] + [f"blocks.{i}" for i in range(BLOCKS)] + ["out"]


def _config(bp, fp, limit, strategy=FS.FULL_SHARD, **kw):
  return fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP,
                             backward_prefetch=bp, forward_prefetch=fp,
                             limit_all_gathers=limit, **kw)


@functools.lru_cache(maxsize=None)
def _compiled(bp, fp, limit, strategy=FS.FULL_SHARD, n=4):
  mesh = mesh_for(strategy, n)
  cfg = _config(bp, fp, limit, strategy)
  opt = optax.adam(1e-2)
  state = fsdp_jax.init_train_state(params=mlp_params(blocks=BLOCKS), optimizer=opt,
                                    mesh=mesh, config=cfg)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=cfg)
  return step.lower(state, mlp_batch(n=8)).compile().as_text()


def _backward_start(text) -> int:
  """Index of the first backward re-gather (a unit's second all-gather)."""
  seen = set()
  for k, ins in enumerate(hlo.entry_instructions(text)):
    if ins.opcode.startswith("all-gather") and not ins.opcode.endswith("-done"):
      unit = hlo._UNIT_GATHER.search(ins.op_name).group(1)
      if unit in seen:
        return k
      seen.add(unit)
  raise AssertionError("no backward re-gather in the program")


def _max_live(text, start=0, stop=None) -> int:
  return max(len(s) for s in hlo.live_gathered_units(text)[start:stop])


# (backward_prefetch, forward_prefetch, limit_all_gathers). The three
# settings move collectives in the schedule, each in its own branch: every
# pair of their values trains once (a pairwise cover of the 12 combinations;
# the schedule tests below compile every backward prefetch with and without
# forward prefetch under the limit).
PAIRWISE = [(BP.BACKWARD_PRE, False, True), (BP.BACKWARD_PRE, True, False),
            (BP.BACKWARD_POST, False, False), (BP.BACKWARD_POST, True, True),
            (None, False, False), (None, True, True)]


# ---------------------------------------------------------------------------
# Numbers: every setting trains exactly like the unsharded reference


@pytest.fixture(scope="module")
def reference():
  """The unsharded run every setting must reproduce: 3 Adam steps."""
  params, batch = mlp_params(blocks=BLOCKS), mlp_batch(n=12)
  return (params, batch) + tuple(reference_run(mlp_loss, params, [batch] * 3, optax.adam(1e-2)))


@pytest.mark.slow
@pytest.mark.parametrize("bp,fp,limit", PAIRWISE, ids=lambda v: str(getattr(v, "name", v)))
def test_every_setting_matches_unsharded_training(bp, fp, limit, reference):
  params, batch, ref_losses, ref_params = reference
  opt = optax.adam(1e-2)
  losses, state = sharded_run(mlp_loss, params, [batch] * 3, opt, mesh_for(None, 3),
                              _config(bp, fp, limit))
  assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params)


@pytest.mark.slow
# Backward prefetch moves the backward re-gathers: HYBRID_SHARD (which
# re-gathers) with and without it; the strategies that gather nothing in
# the backward pass once each.
@pytest.mark.parametrize("strategy,n,replicate,bp", [
    (FS.HYBRID_SHARD, 2, 2, BP.BACKWARD_POST), (FS.HYBRID_SHARD, 2, 2, None),
    (FS._HYBRID_SHARD_ZERO2, 2, 2, BP.BACKWARD_POST), (FS.SHARD_GRAD_OP, 3, None, None),
    (FS.NO_SHARD, 4, None, BP.BACKWARD_POST)], ids=lambda v: str(getattr(v, "name", v)))
def test_other_strategies_with_settings(strategy, n, replicate, bp, reference):
  params, batch, ref_losses, ref_params = reference
  opt = optax.adam(1e-2)
  mesh = mesh_for(strategy, n, replicate)
  losses, state = sharded_run(mlp_loss, params, [batch] * 3, opt, mesh,
                              _config(bp, True, False, strategy))
  assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params)


@pytest.mark.slow
def test_settings_compose_with_accumulation_and_clipping():
  params, batch = mlp_params(blocks=BLOCKS), mlp_batch(n=16)
  opt = optax.sgd(0.1)
  mesh = mesh_for(None, 4)
  cfg = _config(BP.BACKWARD_POST, True, True)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=cfg)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=cfg, max_norm=0.5,
                                   gradient_accumulation_steps=2, accumulation="sharded")
  state, metrics = step(state, batch)
  loss, grads = jax.value_and_grad(mlp_loss)(params, batch)
  norm = optax.tree.norm(grads)
  clipped = jax.tree.map(lambda g: g * min(1.0, 0.5 / (float(norm) + 1e-6)), grads)
  expected = jax.tree.map(lambda p, g: p - 0.1 * g, params, clipped)
  assert abs(float(metrics["loss"]) - float(loss)) < 1e-5
  assert abs(float(metrics["grad_norm"]) - float(norm)) < 1e-5 * float(norm)
  assert_trees_close(fsdp_jax.summon_full_params(state), expected)


# ---------------------------------------------------------------------------
# The compiled schedule


@pytest.mark.parametrize("bp", [BP.BACKWARD_PRE, BP.BACKWARD_POST, None], ids=str)
@pytest.mark.parametrize("fp", [False, True])
def test_limit_all_gathers_keeps_at_most_two_units_gathered(bp, fp):
  text = _compiled(bp, fp, True)
  live = hlo.live_gathered_units(text)
  assert max(len(s) for s in live) <= 2, max(live, key=len)
  # The analysis sees every unit gathered at some point (it is not vacuous).
  assert set().union(*live) == set(FORWARD)


@pytest.mark.slow
def test_without_the_rate_limiter_gathers_run_ahead():
  """No rate limiter and forward prefetch: each gather waits only for the one
  before it, and the compiled program gathers every unit before the first
  matmul (all six live at once)."""
  text = _compiled(BP.BACKWARD_PRE, True, False)
  assert _max_live(text) == len(FORWARD)
  # Without forward_prefetch each gather also waits for the previous unit's
  # computation to start: fewer units run ahead, but still more than two.
  assert _max_live(_compiled(BP.BACKWARD_PRE, False, False)) > 2


def _forward_positions(text):
  ins = hlo.entry_instructions(text)
  gathers, dots = {}, []
  for k, i in enumerate(ins):
    m = hlo._UNIT_GATHER.search(i.op_name)
    if i.opcode == "all-gather" and m and m.group(1) not in gathers:
      gathers[m.group(1)] = k
    if i.opcode == "dot" and len(dots) < len(FORWARD):
      dots.append(k)  # the forward matmuls, one per unit, in order
  return gathers, dots


def test_forward_prefetch_issues_the_next_gather_before_the_current_matmul():
  gathers, dots = _forward_positions(_compiled(BP.BACKWARD_PRE, True, False))
  for k in range(len(FORWARD) - 1):
    assert gathers[FORWARD[k + 1]] < dots[k], (FORWARD[k + 1], gathers, dots)


@pytest.mark.parametrize("limit", [True, False])
def test_without_forward_prefetch_the_next_gather_waits_for_the_current_unit(limit):
  gathers, dots = _forward_positions(_compiled(BP.BACKWARD_PRE, False, limit))
  for k in range(len(FORWARD) - 1):
    assert gathers[FORWARD[k + 1]] > dots[k], (FORWARD[k + 1], gathers, dots)


def _backward_pairs(text):
  """(current, next) backward units and the order of their collectives."""
  order = hlo.collective_order(text)
  start = next(k for k, (kind, u) in enumerate(order)
               if kind == "all-gather" and (kind, u) in order[:k])
  backward = order[start:]
  regathered = [u for kind, u in backward if kind == "all-gather"]
  pos = {item: k for k, item in enumerate(backward)}
  return list(zip(regathered, regathered[1:])), pos


@pytest.mark.parametrize("bp", [BP.BACKWARD_PRE, BP.BACKWARD_POST], ids=str)
def test_backward_prefetch_gathers_next_unit_before_current_reduce_scatter(bp):
  pairs, pos = _backward_pairs(_compiled(bp, False, True))
  assert len(pairs) == BLOCKS  # out -> blocks.3 -> ... -> blocks.0 (inp needs no re-gather)
  for c, n in pairs:
    assert pos[("all-gather", n)] < pos[("reduce-scatter", c)], (c, n, pos)


def test_no_backward_prefetch_gathers_next_unit_after_current_reduce_scatter():
  pairs, pos = _backward_pairs(_compiled(None, False, True))
  assert len(pairs) == BLOCKS
  for c, n in pairs:
    assert pos[("reduce-scatter", c)] < pos[("all-gather", n)], (c, n, pos)


@pytest.mark.slow
def test_backward_pre_holds_two_units_post_and_none_one():
  """PyTorch: BACKWARD_PRE holds the current and next unit's parameters at
  the peak; BACKWARD_POST and None free the current unit first."""
  peaks = {}
  for bp in (BP.BACKWARD_PRE, BP.BACKWARD_POST, None):
    text = _compiled(bp, False, True)
    peaks[bp] = _max_live(text, _backward_start(text))
  assert peaks == {BP.BACKWARD_PRE: 2, BP.BACKWARD_POST: 1, None: 1}


@pytest.mark.slow
def test_reduce_scatters_run_in_gradient_order():
  for bp in (BP.BACKWARD_PRE, BP.BACKWARD_POST, None):
    order = [u for kind, u in hlo.collective_order(_compiled(bp, False, True))
             if kind == "reduce-scatter"]
    assert order == FORWARD[::-1], (bp, order)


@pytest.mark.slow
def test_shard_grad_op_keeps_units_gathered_for_backward():
  """SHARD_GRAD_OP does not free units after forward (PyTorch's rate limiter
  has nothing to wait for): one gather per unit, reductions in order."""
  text = _compiled(BP.BACKWARD_PRE, False, True, FS.SHARD_GRAD_OP)
  order = hlo.collective_order(text)
  assert [u for k, u in order if k == "all-gather"] == FORWARD
  assert [u for k, u in order if k == "reduce-scatter"] == FORWARD[::-1]
  assert _max_live(text) > 2


@pytest.mark.parametrize("kw,match", [
    (dict(backward_prefetch="BACKWARD_PRE"), "BackwardPrefetch"),
    (dict(forward_prefetch=1), "forward_prefetch"),
    (dict(limit_all_gathers=None), "limit_all_gathers")])
def test_bad_settings_are_refused(kw, match):
  with pytest.raises(TypeError, match=match):
    fsdp_jax.FSDPConfig(**kw)
