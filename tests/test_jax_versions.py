"""fsdp_jax under the jax implementation switches of jax 0.10 to 0.12.

jax carries opt-in config flags that trace ``jax.checkpoint`` and
``lax.scan`` to new implementations (fsdp_jax/_src/_compat.py lists them and the
version each appeared in): ``jax_remat3`` (named in the 0.11 CHANGELOG with
``jax.custom_remat``), ``jax_scan3``, and ``jax_remat_barrier_no_cotangents``
(0.11+, changes ``jax_remat3``'s barriers). The step's jaxpr rewrite must
hold with each one set globally, as a user would set it: stacked layers are
still gathered one layer per loop iteration, FULL_SHARD still re-gathers in
backward and SHARD_GRAD_OP does not, a model's own ``jax.checkpoint`` keeps
its policy, and training matches unsharded training.

A flag set is skipped only on a jax that does not have the flag.
"""

from __future__ import annotations

import contextlib

import jax
import pytest

import fsdp_jax
from fsdp_jax._src import _compat

import test_activation_checkpointing as ac
import test_models as tm
from helpers import collectives_per_call

# Compiling train steps under each set of XLA flags is slow; the flags'
# switch itself runs in the fast subset.
FLAG_SETS = {
    "remat3": ("jax_remat3",),
    "scan3": ("jax_scan3",),
    "remat3-barrier_no_cotangents": ("jax_remat3", "jax_remat_barrier_no_cotangents"),
}


def require(flags):
  missing = [f for f in flags if not _compat.has_flag(f)]
  if missing:
    pytest.skip(f"jax {jax.__version__} has no config flag {', '.join(missing)}: "
                "there is no implementation to switch to")


@contextlib.contextmanager
def flags_on(flags):
  """Sets ``flags`` globally (``jax.config.update``, as a user would) for the
  block."""
  old = {f: jax.config.values[f] for f in flags}
  try:
    for f in flags:
      jax.config.update(f, True)
    yield
  finally:
    for f, v in old.items():
      jax.config.update(f, v)


def primitive_names(fn, *args) -> set:
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  names = set()

  def walk(j):
    for e in j.eqns:
      names.add(e.primitive.name)
      for sub in _compat.nested_jaxprs(e):
        walk(sub)

  walk(jaxpr)
  return names


@pytest.mark.parametrize("flag_set", list(FLAG_SETS))
def test_flags_switch_the_implementation_and_the_step_pins_the_classic_one(flag_set):
  """The flags really change what jax traces (so the tests below test
  something), and fsdp_jax's step traces the classic equations under them."""
  flags = FLAG_SETS[flag_set]
  require(flags)
  batch = tm.scan_batches()[0]
  params = tm.scan_params()

  def checkpointed(params, batch):
    return jax.checkpoint(tm.scan_loss)(params, batch)

  classic = primitive_names(checkpointed, params, batch)
  assert {"scan", "remat2"} <= classic
  with flags_on(flags):
    switched = primitive_names(checkpointed, params, batch)
    with _compat.classic_tracing():
      pinned = primitive_names(checkpointed, params, batch)
  if "jax_remat3" in flags:
    assert "remat2" not in switched
  if "jax_scan3" in flags:
    assert "scan" not in switched
  assert "call_hi_primitive" in switched
  assert {"scan", "remat2"} <= pinned and "call_hi_primitive" not in pinned
  # Restored after the block.
  assert all(not jax.config.values[f] for f in flags)


@pytest.mark.parametrize("case", ["FULL_SHARD-4dev-flat", "SHARD_GRAD_OP-4dev-orig"])
@pytest.mark.parametrize("flag_set", list(FLAG_SETS))
@pytest.mark.slow
def test_stacked_scan_under_flag(flag_set, case):
  flags = FLAG_SETS[flag_set]
  require(flags)
  # The reference is computed without the flags: under jax_scan3, jax 0.10
  # to 0.12 cannot differentiate a scan at all (Scan3 has no reverse-mode
  # rule), and the flags do not change the numbers.
  batches, params0, ref_losses, ref_params = tm.scan_reference()
  strategy, shard, replicate, orig = tm.SCAN_CASES[case]
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, stacked_layers=("blocks",),
                               use_orig_params=orig)
  with flags_on(flags):
    params, losses, state, text = tm.fsdp_train(
        tm.scan_loss, tm.adam(), tm.make_mesh(shard, replicate), config, batches,
        params=params0, hlo=True)
  tm.assert_matches_reference(losses, params, ref_losses, ref_params)
  hlo = tm.Hlo(text)
  gathers, _, backward, _ = tm.stacked_gather_report(state.plan, hlo, "blocks")
  per_call = collectives_per_call(state.plan, state.plan.unit_by_name("blocks"))[0]
  if strategy is tm.SHARD_GRAD_OP:
    assert len(gathers) == per_call  # gathered once per layer, kept for backward
    assert not any(hlo.loops_of(op) & backward for op in gathers)
  else:
    # Re-gathered layer by layer in the backward loop.
    assert len(gathers) == 2 * per_call
    assert any(hlo.loops_of(op) & backward for op in gathers)


@pytest.mark.parametrize("case", [(ac.FULL_SHARD, 2, None), (ac.SHARD_GRAD_OP, 3, None)],
                         ids=ac._id)
@pytest.mark.parametrize("flag_set", list(FLAG_SETS))
@pytest.mark.slow
def test_activation_checkpointing_under_flag(flag_set, case):
  """A model's own jax.checkpoint per block, with a policy: the same numbers
  as unsharded training and the same gathers per unit as without the flag
  (FULL_SHARD re-gathers every block once in backward; SHARD_GRAD_OP keeps
  its gathers, which jax_remat3 alone would recompute)."""
  flags = FLAG_SETS[flag_set]
  require(flags)
  ac.mlp_reference()  # computed (and cached) without the flags
  remat = lambda f: jax.checkpoint(
      f, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  with flags_on(flags):
    ac.check_checkpointed_mlp(remat, case, use_orig_params=case[1] == 3)
