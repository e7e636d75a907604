"""ZeRO++-class communication: reshard_after_forward=k (hpZ), quantized
all-gathers (qwZ), quantized gradient reduction (qgZ), explicit prefetch.

* ``reshard_after_forward=k`` trains bitwise like ``FULL_SHARD``, and the
  compiled program's backward all-gathers run within groups of ``k``.
* Quantized collectives move the bytes their dtype says (counted in the
  compiled HLO, scales included) and add an error within a stated bound.
* Explicit prefetch shows in the compiled schedule.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax._src import hlo, quantization
from helpers import (assert_trees_close, mesh_for, mlp_batch, mlp_loss, mlp_params,
                     jit_reference_run, sharded_run, train_steps)

S = fsdp_jax.ShardingStrategy
Q = fsdp_jax.Quantization
WRAP = fsdp_jax.ModuleWrapPolicy(["blocks.*"])
STEPS = 3


def _groups(text: str) -> tuple:
  """Replica groups as XLA prints them (explicit ``{{0,1},{2,3}}``, iota or
  mesh form, which differ between jax releases) -> ((0, 1), (2, 3))."""
  return hlo.replica_groups(text)


def _consecutive(k: int, n: int) -> tuple:
  return tuple(tuple(range(j * k, (j + 1) * k)) for j in range(n // k))


@functools.lru_cache(maxsize=None)
def _run(strategy, n, replicate, orig, **kw):
  """Trains STEPS steps; returns the losses, the full parameters, the
  compiled step's HLO text (the program the steps ran: lowering it first
  compiles it once for both) and the plan."""
  kw = {k: v for k, v in kw.items()}
  params = mlp_params()
  batches = [mlp_batch(seed=10 + i) for i in range(STEPS)]
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP,
                               use_orig_params=orig, **kw)
  mesh, opt = mesh_for(strategy, n, replicate), optax.adam(1e-2)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config)
  text = step.lower(state, batches[0]).compile().as_text()
  plan = state.plan
  state, losses = train_steps(step, state, batches)
  return losses, fsdp_jax.summon_full_params(state), text, plan


def _compile(params, batch, mesh, loss=mlp_loss, opt=None, **kw):
  opt = opt or optax.adam(1e-2)
  cfg = fsdp_jax.FSDPConfig(auto_wrap_policy=kw.pop("auto_wrap_policy", WRAP), **kw)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=cfg)
  step = fsdp_jax.shard_train_step(loss, opt, mesh=mesh, config=cfg)
  return state, step.lower(state, batch).compile()


# ---------------------------------------------------------------------------
# reshard_after_forward=k (hpZ): exact, backward gathers within groups


HPZ_CASES = [  # (strategy, shard size, replicate, k, use_orig_params)
    # Each case in one layout: on a 1-D mesh, groups of half the shards (8
    # by 4, flat) and groups of 3 (6 by 3); over the 2-D meshes, pairs inside
    # each "shard" row (HYBRID_SHARD, flat) and groups of 4 over
    # ("replicate", "shard") (per-leaf). The flat and per-leaf gathers share
    # the grouping code; groups of a quarter of a 1-D mesh (8 by 2, per-leaf)
    # ran the same code as the HYBRID pairs and the per-leaf 4x2 case.
    (S.FULL_SHARD, 8, None, 4, False), (S.FULL_SHARD, 6, None, 3, False),
    (S.HYBRID_SHARD, 4, 2, 2, False), (S.FULL_SHARD, 4, 2, 4, True)]


def _check_backward_gathers_within_groups(text, plan, k, groups, case):
  """The compiled step gathers every unit once over the shard axes, and the
  resharded blocks (not the root) again in backward, within ``groups``."""
  colls = hlo.collectives(text)
  gathers = [c for c in colls if c.kind == "all-gather"]
  world = {tuple(sorted(g)) for c in colls if c.kind == "reduce-scatter"
           for g in _groups(c.replica_groups)}
  forward = [c for c in gathers if {tuple(sorted(g)) for g in _groups(c.replica_groups)} == world]
  backward = [c for c in gathers if _groups(c.replica_groups) == groups]
  units = len(plan.units)
  # Flat: one gather per unit; per-leaf (use_orig_params) may gather a
  # unit's leaves apart in forward.
  assert len(forward) == units or (plan.config.use_orig_params and len(forward) > units), case
  assert len(backward) == units - 1 and len(gathers) == len(forward) + units - 1, case
  # The group rebuilds the whole unit: the same result shape as the forward's.
  assert {c.shapes for c in backward} <= {c.shapes for c in forward}, case
  assert f"groups of {k}" in str(plan), case


@pytest.mark.slow
@pytest.mark.llvm_optimized
def test_reshard_after_forward_k_equals_full_shard_bitwise():
  """7x7 blocks and a 5x7 input layer: no mesh size here divides the units.
  The cases run in one test (the bitwise comparison needs XLA's default
  fusion emitters: it runs with XLA's default settings, in the process
  test_stacked_unit_regathers_within_groups_inside_the_loop needs anyway:
  conftest.py). Each hpZ step's compiled program is also checked: its
  backward all-gathers run within groups of k (formerly a test of its own,
  test_backward_gathers_run_within_groups_of_k, which compiled the same
  steps again)."""
  for strategy, n, replicate, k, orig in HPZ_CASES:
    case = f"{strategy.name} {replicate or 1}x{n} k={k} use_orig_params={orig}"
    ref_losses, ref_params, _, _ = _run(strategy, n, replicate, orig)
    losses, params, text, plan = _run(strategy, n, replicate, orig, reshard_after_forward=k)
    _check_backward_gathers_within_groups(text, plan, k, _consecutive(k, n * (replicate or 1)),
                                          case)
    assert losses == ref_losses, case
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                                            err_msg=case),
                 params, ref_params)


@pytest.mark.slow
def test_reshard_after_forward_k_with_bf16_accumulation_and_clipping():
  """bf16 gathers (uint16 secondary slices), no_sync accumulation (the
  probed backward) and clipping: still bitwise FULL_SHARD."""
  params, batches = mlp_params(), [mlp_batch(seed=i) for i in range(STEPS)]
  mp = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
  mesh, opt = mesh_for(None, 8), optax.adam(1e-2)
  out = {}
  for k in (True, 2):
    cfg = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, mixed_precision=mp, reshard_after_forward=k)
    state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=cfg)
    step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=cfg, max_norm=0.5,
                                     gradient_accumulation_steps=3)
    state, losses = train_steps(step, state, batches)
    out[k] = losses, fsdp_jax.summon_full_params(state)
  assert out[True][0] == out[2][0]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               out[True][1], out[2][1])


@pytest.mark.slow
@pytest.mark.llvm_optimized
def test_stacked_unit_regathers_within_groups_inside_the_loop():
  """A scan over stacked layers: the backward loop gathers each layer within
  groups of k; training is FULL_SHARD's: the same losses, the parameters to
  the last bit or two (FULL_SHARD's loop recomputes tanh's derivative, which
  jax 0.12 computes as one_minus_square and XLA may fuse into a multiply-add;
  hpZ's loop saves it)."""
  from jax import lax
  key = jax.random.split(jax.random.key(0), 3)
  params = {"inp": {"w": jax.random.normal(key[0], (5, 12)) * 0.3},
            "blocks": {"w": jax.random.normal(key[1], (3, 12, 12)) * 0.3,
                       "b": jnp.zeros((3, 12))},
            "out": {"w": jax.random.normal(key[2], (12, 3)) * 0.3}}

  def loss_fn(p, batch):
    x = jnp.tanh(batch["x"] @ p["inp"]["w"])
    x, _ = lax.scan(lambda h, blk: (jnp.tanh(h @ blk["w"] + blk["b"]), None), x, p["blocks"])
    return jnp.mean((x @ p["out"]["w"] - batch["y"]) ** 2)

  batches = [mlp_batch(seed=i) for i in range(STEPS)]
  mesh = mesh_for(None, 8)
  out = {}
  for k in (True, 4):
    cfg = fsdp_jax.FSDPConfig(stacked_layers=("blocks",), reshard_after_forward=k)
    losses, state = sharded_run(loss_fn, params, batches, optax.adam(1e-2), mesh, cfg)
    out[k] = (losses, fsdp_jax.summon_full_params(state))
  assert out[True][0] == out[4][0]
  jax.tree.map(lambda a, b: np.testing.assert_array_max_ulp(np.asarray(a), np.asarray(b), 2),
               out[True][1], out[4][1])
  _, compiled = _compile(params, batches[0], mesh, loss=loss_fn, auto_wrap_policy=None,
                         stacked_layers=("blocks",), reshard_after_forward=4)
  text = compiled.as_text()
  loops = hlo.loop_bodies(text)
  in_loop = [c for c in hlo.collectives(text) if c.kind == "all-gather" and c.computation in loops]
  assert [_groups(c.replica_groups) == _consecutive(4, 8) for c in in_loop].count(True) == 1
  assert len(in_loop) == 2  # the forward loop's gather over 8, the backward's within 4


@pytest.mark.slow
def test_memory_falls_between_full_shard_and_shard_grad_op():
  """compiled.memory_analysis() temporaries, and what the plan says is kept
  from forward to backward (4 blocks of 256 x 256 on 8 devices)."""
  params = mlp_params(d=256, d_in=32, blocks=4)
  batch = mlp_batch(d_in=32, n=16)
  mesh = mesh_for(None, 8)
  temp, kept = {}, {}
  for k in (True, 4, 2, False):
    state, compiled = _compile(params, batch, mesh, opt=optax.sgd(0.1), reshard_after_forward=k)
    temp[k] = compiled.memory_analysis().temp_size_in_bytes
    kept[k] = state.plan.bytes_kept_for_backward()
  assert temp[True] <= temp[4] <= temp[2] < temp[False]
  assert temp[True] < temp[2]
  block = (256 * 256 + 256) * 4  # bytes of one gathered block (fp32, 8 x 8224 elements)
  root = kept[True]              # the root unit is never resharded
  assert kept[4] == root + 4 * block // 4 and kept[2] == root + 4 * block // 2
  assert kept[False] == root + 4 * block


# ---------------------------------------------------------------------------
# Configuration


def test_reshard_after_forward_maps_to_the_strategies():
  C = fsdp_jax.FSDPConfig
  assert C().sharding_strategy is S.FULL_SHARD and C().reshard_after_forward is True
  assert C(reshard_after_forward=False).sharding_strategy is S.SHARD_GRAD_OP
  assert C(reshard_after_forward=False) == C(sharding_strategy=S.SHARD_GRAD_OP)
  assert C(reshard_after_forward=True) == C() == C(sharding_strategy=S.FULL_SHARD)
  assert C(sharding_strategy=S._HYBRID_SHARD_ZERO2).reshard_after_forward is False
  assert C(sharding_strategy=S.HYBRID_SHARD, reshard_after_forward=2).reshard_after_forward == 2
  assert C(sharding_strategy=S.NO_SHARD).reshard_after_forward is False
  assert hash(C(reshard_after_forward=4)) == hash(C(reshard_after_forward=np.int64(4)))


@pytest.mark.parametrize("kw,error,match", [
    (dict(sharding_strategy=S.SHARD_GRAD_OP, reshard_after_forward=True), ValueError,
     "conflicts with sharding_strategy=SHARD_GRAD_OP.*FULL_SHARD"),
    (dict(sharding_strategy=S.FULL_SHARD, reshard_after_forward=False), ValueError,
     "conflicts with sharding_strategy=FULL_SHARD.*SHARD_GRAD_OP"),
    (dict(sharding_strategy=S._HYBRID_SHARD_ZERO2, reshard_after_forward=2), ValueError,
     "HYBRID_SHARD with a secondary shard"),
    (dict(sharding_strategy=S.NO_SHARD, reshard_after_forward=True), ValueError,
     "NO_SHARD, which never gathers"),
    (dict(reshard_after_forward=1), ValueError, "greater than 1"),
    (dict(reshard_after_forward="4"), TypeError, "True, False, an int"),
    (dict(sharding_strategy=S.NO_SHARD, all_gather_quantization=Q()), ValueError,
     "needs a sharded strategy"),
    (dict(reduce_scatter_quantization=Q(), comm_hook=fsdp_jax.hooks.bf16_compress_hook),
     ValueError, "pass one of them"),
    (dict(all_gather_quantization=jnp.int8), TypeError, "fsdp_jax.Quantization"),
    (dict(forward_prefetch_units={"blocks.0": "blocks.0"}), ValueError, "lists itself"),
    (dict(backward_prefetch_units={"blocks.0": [3]}), TypeError, "unit names are strings"),
])
def test_bad_configs_are_refused(kw, error, match):
  with pytest.raises(error, match=match):
    fsdp_jax.FSDPConfig(**kw)


@pytest.mark.parametrize("kw,match", [
    (dict(reshard_after_forward=3), r"3 must divide 8.*one of \[2, 4\]"),
    (dict(reshard_after_forward=8), r"groups of all 8 devices are reshard_after_forward=True"),
    (dict(forward_prefetch_units={"blocks.0": ["block.1"]}),
     r"'block.1' is not a unit; the units are \['<root>', 'blocks.0', 'blocks.1', 'blocks.2'\]"),
    (dict(backward_prefetch_units={"<root>": ["blocks.1"]}), "never resharded"),
    (dict(sharding_strategy=S.SHARD_GRAD_OP, backward_prefetch_units={"blocks.2": ["blocks.1"]}),
     "SHARD_GRAD_OP keeps units gathered"),
])
def test_bad_plans_are_refused(kw, match):
  cfg = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, **kw)
  with pytest.raises(ValueError, match=match):
    fsdp_jax.init_train_state(params=mlp_params(), optimizer=optax.sgd(0.1),
                              mesh=mesh_for(None, 8), config=cfg)


@pytest.mark.parametrize("kw,error,match", [
    (dict(dtype=jnp.int16), ValueError, "not supported. Fix: pass one of"),
    (dict(dtype="uint4"), ValueError, "not supported"),
    (dict(block_size=0), ValueError, "positive int"),
    (dict(block_size=True), ValueError, "positive int"),
    (dict(dtype="int4", block_size=33), ValueError, "must be even; e.g. block_size=34"),
    (dict(rounding="up"), ValueError, "'nearest', 'stochastic' or None"),
    (dict(dtype=jnp.float8_e4m3fn, rounding="stochastic"), ValueError,
     "implemented for the integer formats"),
])
def test_bad_quantization_is_refused(kw, error, match):
  with pytest.raises(error, match=match):
    Q(**kw)


# ---------------------------------------------------------------------------
# Quantization: the bytes moved and the error added

FORMATS = [Q(dtype=jnp.int8), Q(dtype="int4", block_size=64), Q(dtype=jnp.float8_e4m3fn),
           Q(dtype=jnp.float8_e4m3fn, block_size=None), Q(dtype=jnp.float8_e5m2, block_size=32)]


@pytest.mark.parametrize("q", FORMATS, ids=lambda q: q.describe().replace(" ", ""))
def test_round_trip_error_is_within_half_a_step(q):
  """Integers round to nearest: |x - x'| <= scale / 2, scale = max|block| / M.
  fp8 rounds to nearest with 3 (e4m3) or 2 (e5m2) mantissa bits: |x - x'| <=
  |x| 2^-(m+1), plus half the smallest subnormal (times the scale)."""
  x = jax.random.normal(jax.random.key(3), (4, 1000)) * jnp.logspace(-3, 2, 1000)
  payload = quantization.encode(x, q)
  assert payload.dtype == jnp.uint8 and payload.shape == (4, q.payload_bytes(1000))
  back = quantization.decode(payload, q, 1000, jnp.float32)
  b, nb = q.blocks(1000)
  pad = jnp.pad(x, [(0, 0), (0, nb * b - 1000)]).reshape(4, nb, b)
  scale = jnp.repeat(jnp.max(jnp.abs(pad), -1) / q.max_value, b, axis=-1)[:, :1000]
  err = jnp.abs(back - x)
  if q.dtype.name in ("int8", "int4"):
    bound = scale / 2 * (1 + 1e-6)
  else:
    info = jnp.finfo(q.dtype)
    bound = jnp.abs(x) * 2.0 ** -(info.nmant + 1) + scale * float(info.smallest_subnormal) / 2
    bound = bound * (1 + 1e-6)
  assert bool(jnp.all(err <= bound)), float(jnp.max(err - bound))
  assert float(jnp.max(err)) > 0  # it did quantize


@pytest.mark.parametrize("q", [Q(dtype=jnp.int8), Q(dtype="int4", block_size=64)],
                         ids=["int8", "int4"])
def test_stochastic_rounding_is_unbiased_within_one_step(q):
  """Rounding to nearest turns every value under half a step into 0;
  stochastic rounding (floor(x / scale + u), u a hash of the value's bits and
  position) is off by less than one step and right on average, and the same
  input gives the same bytes."""
  rows, n = 64, 1024
  key = jax.random.split(jax.random.key(5), 2)
  small = jax.random.uniform(key[0], (rows, n), minval=0.05, maxval=0.45)  # in steps
  x = small.at[:, ::q.block_size].set(q.max_value)  # scale 1: one step = 1.0
  x = x * jax.random.choice(key[1], jnp.array([-1.0, 1.0]), (rows, n))
  round_trip = jax.jit(lambda x, stochastic: quantization.decode(
      quantization.encode(x, q, stochastic=stochastic), q, n, jnp.float32), static_argnums=1)
  back, nearest = round_trip(x, True), round_trip(x, False)
  assert bool(jnp.all(back == round_trip(x, True)))
  mask = jnp.abs(x) < 0.5
  assert bool(jnp.all(jnp.where(mask, nearest, 0) == 0))  # all rounded away
  assert bool(jnp.all(jnp.abs(back - x) < 1.0)) and float(jnp.max(jnp.abs(back - x))) > 0.5
  err = jnp.where(mask, back - x, 0)
  # Mean error over ~63k values of variance <= 1/4 each: |mean| < 4 sigma.
  count = int(jnp.sum(mask))
  assert abs(float(jnp.sum(err)) / count) < 4 * 0.5 / np.sqrt(count)
  assert float(jnp.sum(jnp.where(mask, jnp.abs(back), 0))) / count > 0.2  # not all 0


@pytest.mark.slow
def test_non_finite_values_are_never_hidden():
  for q in FORMATS:
    x = jnp.array([1.0, jnp.nan, 2.0, jnp.inf, -3.0])
    assert bool(jnp.all(jnp.isnan(quantization.decode(quantization.encode(x, q), q, 5,
                                                      jnp.float32))))
    if q.integer:
      assert bool(jnp.all(jnp.isnan(quantization.decode(
          quantization.encode(x, q, stochastic=True), q, 5, jnp.float32))))


WIDE = dict(d=64, d_in=32)  # 8 x 520 elements per block unit: whole quant blocks


@functools.lru_cache(maxsize=None)
def _wide_fp32_step():
  """The unquantized step of the wide MLP on 8 devices: the byte-count
  tests' baseline, compiled once."""
  return _compile(mlp_params(**WIDE), mlp_batch(d_in=32), mesh_for(None, 8))[1]


def _bytes(compiled, kind):
  cs = [c for c in hlo.collectives(compiled.as_text()) if c.kind == kind and c.shapes[0] != ()]
  return cs, sum(c.bytes for c in cs)


@pytest.mark.slow
@pytest.mark.parametrize("q,ratio", [
    (Q(dtype=jnp.int8), 0.3), (Q(dtype="int4"), 0.17), (Q(dtype=jnp.float8_e4m3fn), 0.3),
    (Q(dtype=jnp.float8_e4m3fn, block_size=None), 0.3)],
    ids=["int8", "int4", "fp8-block", "fp8-tensor"])
def test_quantized_gathers_move_fewer_bytes(q, ratio):
  """All-gather bytes in the compiled HLO, scales included, against fp32."""
  params, batch, mesh = mlp_params(**WIDE), mlp_batch(d_in=32), mesh_for(None, 8)
  base = _wide_fp32_step()
  _, quant = _compile(params, batch, mesh, all_gather_quantization=q)
  base_gathers, base_bytes = _bytes(base, "all-gather")
  gathers, got = _bytes(quant, "all-gather")
  assert len(gathers) == len(base_gathers)  # one collective per unit: values and scales together
  assert all(d == "u8" for c in gathers for d in c.dtypes)
  expected = sum(8 * q.payload_bytes(c.shapes[0][1]) for c in base_gathers)
  assert got == expected and got <= ratio * base_bytes, (got, base_bytes)


@pytest.mark.slow
@pytest.mark.parametrize("q,ratio", [(Q(dtype=jnp.int8), 0.3), (Q(dtype="int4"), 0.17)],
                         ids=["int8", "int4"])
def test_quantized_reduction_moves_fewer_bytes(q, ratio):
  """qgZ: the gradient moves as quantized all-to-all, no reduce-scatter left;
  bytes against the reduce-scatter's payload (its result x N)."""
  params, batch, mesh = mlp_params(**WIDE), mlp_batch(d_in=32), mesh_for(None, 8)
  base = _wide_fp32_step()
  _, quant = _compile(params, batch, mesh, reduce_scatter_quantization=q)
  scatters, base_bytes = _bytes(base, "reduce-scatter")
  assert _bytes(quant, "reduce-scatter")[0] == []
  a2a, got = _bytes(quant, "all-to-all")
  assert len(a2a) == len(scatters) and all(d == "u8" for c in a2a for d in c.dtypes)
  assert got <= ratio * 8 * base_bytes, (got, 8 * base_bytes)


@pytest.mark.parametrize("strategy,hops", [
    (S.FULL_SHARD, [("all-to-all", _consecutive(4, 8)), ("all-to-all", ((0, 4), (1, 5), (2, 6), (3, 7)))]),
    (S.HYBRID_SHARD, [("all-to-all", _consecutive(4, 8)), ("all-to-all", ((0, 4), (1, 5), (2, 6), (3, 7))),
                      ("all-gather", ((0, 4), (1, 5), (2, 6), (3, 7)))]),
])
@pytest.mark.slow
def test_quantized_reduction_is_hierarchical_on_a_2d_mesh(strategy, hops):
  """In-node (within "shard") first, then across "replicate"; every gradient
  collective moves uint8."""
  mesh = mesh_for(strategy, 4, 2)
  _, compiled = _compile(mlp_params(**WIDE), mlp_batch(d_in=32), mesh,
                         sharding_strategy=strategy, reduce_scatter_quantization=Q())
  across = ((0, 4), (1, 5), (2, 6), (3, 7))
  grads = [c for c in hlo.collectives(compiled.as_text()) if c.shapes[0] != () and (
      c.kind != "all-gather" or _groups(c.replica_groups) == across)]
  assert all(d == "u8" for c in grads for d in c.dtypes)
  found = collections.Counter((c.kind, _groups(c.replica_groups)) for c in grads)
  assert found == collections.Counter(hops * 4)  # the same hops for each of the 4 units


_grad = jax.jit(jax.grad(mlp_loss))  # one program per batch shape, not op by op


def _local_grads(params, batch, devices):
  """Each device's gradient of its mean loss (the rows it gets)."""
  rows = batch["x"].shape[0] // devices
  return [_grad(params, jax.tree.map(lambda x: x[j * rows:(j + 1) * rows], batch))
          for j in range(devices)]


INT8_NEAREST, INT4_STOCHASTIC = Q(dtype=jnp.int8, rounding="nearest"), Q(dtype="int4",
                                                                           block_size=32)


# Each hop count with one rounding, the three hops with both.
@pytest.mark.slow
@pytest.mark.parametrize("strategy,n,replicate,hops,q", [
    (S.FULL_SHARD, 8, None, 1, INT8_NEAREST), (S.FULL_SHARD, 4, 2, 2, INT4_STOCHASTIC),
    (S.HYBRID_SHARD, 4, 2, 3, INT8_NEAREST), (S.HYBRID_SHARD, 4, 2, 3, INT4_STOCHASTIC)],
    ids=["full-8-int8-nearest", "full-2x4-int4-stochastic", "hybrid-2x4-int8-nearest",
         "hybrid-2x4-int4-stochastic"])
def test_quantized_reduction_error_is_bounded(strategy, n, replicate, hops, q):
  """The reduced gradient g = (1/W) sum_j g_j. Each hop rounds every value it
  sends to within one step of its block's scale, max|block| / M (half a step
  rounding to nearest), so hop h adds at most (1/W) sum_j max|g_j| / M per
  element (a partial sum's max is at most the sum of its terms' maxima);
  over ``hops`` hops: |error| <= hops (1 + 1/M)^hops (1/W) sum_j max|g_j| / M,
  half that rounding to nearest."""
  params, batch = mlp_params(), mlp_batch(n=48)
  world = n * (replicate or 1)
  cfg = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP,
                            use_orig_params=True, reduce_scatter_quantization=q)
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1),
                                    mesh=mesh_for(strategy, n, replicate), config=cfg)
  got = fsdp_jax.custom.sharded_grads(mlp_loss, state, batch)
  got = jax.tree.map(lambda g, p: np.asarray(g)[:p.shape[0]], got, params)
  exact = _grad(params, batch)
  locals_ = _local_grads(params, batch, world)
  m = q.max_value
  steps = 1.0 if q.stochastic(gradient=True) else 0.5
  bound = steps * hops * (1 + 1 / m) ** hops * sum(
      max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g)) for g in locals_) / (m * world)
  err = max(float(np.max(np.abs(a - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(exact)))
  assert 0 < err <= bound, (err, bound)


@pytest.mark.slow
def test_quantized_gather_is_straight_through_and_masters_stay_exact():
  """The forward sees the dequantized gathered copy (within half a step of
  each block's scale of the exact parameters); the gradient is the exact
  gradient at that copy (straight through the quantizer to the master
  shards); with a zero learning rate the stored masters never change."""
  params, batch = mlp_params(**WIDE), mlp_batch(d_in=32)
  q = Q(dtype=jnp.int8)

  def loss_fn(p, b):
    return mlp_loss(p, b), p  # aux: the parameters as the forward saw them

  mesh = mesh_for(None, 8)
  cfg = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, all_gather_quantization=q,
                            use_orig_params=True)
  # Learning rate 1 for the first step, 0 after it (one compiled step).
  opt = optax.sgd(lambda count: jnp.where(count == 0, 1.0, 0.0))
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=cfg)
  step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=cfg)
  new, metrics = step(state, batch)
  seen = metrics["aux"]
  # A scale covers a block of one device's shard of one unit: bounded by the
  # unit's largest value.
  unit_max = {}
  for path, y in jax.tree_util.tree_flatten_with_path(params)[0]:
    unit = jax.tree_util.keystr(path[:2]) if path[0].key == "blocks" else "root"
    unit_max[unit] = max(unit_max.get(unit, 0.0), float(jnp.max(jnp.abs(y))))
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(seen)[0],
                          jax.tree.leaves(params)):
    unit = jax.tree_util.keystr(path[:2]) if path[0].key == "blocks" else "root"
    assert float(jnp.max(jnp.abs(x - y))) <= unit_max[unit] / (2 * 127) * 1.0001
  assert any(float(jnp.max(jnp.abs(x - y))) > 0 for x, y in zip(jax.tree.leaves(seen),
                                                                  jax.tree.leaves(params)))
  got = jax.tree.map(lambda a, b: a - b, params, fsdp_jax.summon_full_params(new))  # sgd(1.0)
  dist = lambda a, b: max(float(jnp.max(jnp.abs(x - y)))
                          for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  grad = jax.jit(jax.grad(mlp_loss))
  at_seen, at_exact = grad(seen, batch), grad(params, batch)
  # Summation order (8 devices against one) and p - (p - g) rounding: ~1e-5
  # of the largest gradient; the exact parameters' gradient is far off.
  tol = 1e-5 * max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(at_exact))
  assert dist(got, at_seen) <= tol < dist(got, at_exact) / 100
  # At learning rate 0 the stored masters never change (never the
  # dequantized copy the forward saw).
  masters = fsdp_jax.summon_full_params(new)
  frozen = new
  for _ in range(2):
    frozen, _ = step(frozen, batch)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               fsdp_jax.summon_full_params(frozen), masters)


@pytest.mark.slow
def test_quantized_training_stays_close_to_unquantized():
  """30 Adam steps of the MLP on three data seeds (the GPT curves are in the
  strategies notebook). Stochastic rounding makes each run's gap a draw.
  ZeRO++ (int4 gradients in blocks of 32, int8 gathers, hpZ) over 12 seeds:
  mean +0.85% of the exact final loss, standard deviation 1.36%, from -2.4%
  to +2.3% on jax 0.10; mean +1.43%, deviation 1.31%, from -0.2% to +3.6%
  on jax 0.12 (a change in how XLA fuses the step changes the gradients'
  last bits and so every draw). Round-to-nearest int4 lands in the same range at this scale, so
  this bounds how close training stays (every run within 5%, the mean of
  three within 2.5%); test_stochastic_rounding_is_unbiased_within_one_step
  checks the rounding's bias."""
  params = mlp_params(d=32, d_in=16)
  mesh = mesh_for(None, 8)
  settings = {"exact": {}, "qwZ int8": dict(all_gather_quantization=Q()),
              "qgZ int8": dict(reduce_scatter_quantization=Q()),
              "ZeRO++": dict(all_gather_quantization=Q(), reshard_after_forward=4,
                             reduce_scatter_quantization=Q(dtype="int4", block_size=32))}
  gaps = {name: [] for name in settings}
  opt = optax.adam(3e-3)
  configs = {name: fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, **kw)
             for name, kw in settings.items()}
  # One compiled step per setting, run from a fresh state for each seed.
  steps = {name: fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=cfg)
           for name, cfg in configs.items()}
  # One initial state per setting, copied for each seed (the steps donate it).
  inits = {name: fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=cfg)
           for name, cfg in configs.items()}
  for seed in (0, 100, 200):
    batches = [mlp_batch(seed=seed + i, d_in=16, n=32) for i in range(30)]
    final = {}
    for name in configs:
      _, losses = train_steps(steps[name], jax.tree.map(jnp.copy, inits[name]), batches)
      final[name] = losses[-1]
    assert final["exact"] < 0.8 * mlp_loss(params, batches[0])  # it trained
    for name, loss in final.items():
      gaps[name].append(loss / final["exact"] - 1)
  for name, g in gaps.items():
    assert max(abs(x) for x in g) <= 0.05, (name, g)
    assert abs(np.mean(g)) <= 0.025, (name, g)


# ---------------------------------------------------------------------------
# Explicit prefetch

PF_WRAP = fsdp_jax.ModuleWrapPolicy(["inp", "blocks.*", "out"])


@functools.lru_cache(maxsize=None)
def _schedule(**kw):
  kw = dict(kw)
  for key in ("forward_prefetch_units", "backward_prefetch_units"):
    if key in kw:
      kw[key] = {u: list(t) for u, t in kw[key]}
  _, compiled = _compile(mlp_params(blocks=4), mlp_batch(n=8), mesh_for(None, 4),
                         auto_wrap_policy=PF_WRAP, **kw)
  return compiled.as_text()


def _forward_positions(text):
  gathers, dots = {}, []
  for k, ins in enumerate(hlo.entry_instructions(text)):
    m = hlo._UNIT_GATHER.search(ins.op_name)
    if ins.opcode == "all-gather" and m and m.group(1) not in gathers:
      gathers[m.group(1)] = k
    if ins.opcode == "dot" and len(dots) < 6:
      dots.append(k)  # the forward matmuls: inp, blocks.0..3, out
  return gathers, dict(zip(["inp", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "out"], dots))


def test_forward_prefetch_units_gather_before_the_unit_computes():
  explicit = (("blocks.0", ("blocks.1", "blocks.2")),)
  gathers, dots = _forward_positions(_schedule(forward_prefetch_units=explicit))
  assert gathers["blocks.1"] < gathers["blocks.2"] < dots["blocks.0"]
  # blocks.3 keeps the default (forward_prefetch=False): after blocks.2 starts.
  assert gathers["blocks.3"] > dots["blocks.2"]
  default_gathers, default_dots = _forward_positions(_schedule())
  assert default_gathers["blocks.2"] > default_dots["blocks.1"]  # not prefetched by default


def _backward(text):
  order = hlo.collective_order(text)
  start = next(k for k, item in enumerate(order) if item in order[:k])
  return order[start:]


@pytest.mark.slow
def test_backward_prefetch_units_gather_before_the_units_reduce_scatter():
  explicit = (("blocks.3", ("blocks.2", "blocks.1")),)
  for bp in (fsdp_jax.BackwardPrefetch.BACKWARD_PRE, None):
    order = _backward(_schedule(backward_prefetch=bp, backward_prefetch_units=explicit))
    pos = {item: k for k, item in enumerate(order)}
    rs3 = pos[("reduce-scatter", "blocks.3")]
    assert pos[("all-gather", "blocks.3")] < pos[("all-gather", "blocks.2")] < \
        pos[("all-gather", "blocks.1")] < rs3, order
  default = _backward(_schedule())
  pos = {item: k for k, item in enumerate(default)}
  assert pos[("all-gather", "blocks.1")] > pos[("reduce-scatter", "blocks.3")]


@pytest.mark.slow
def test_explicit_prefetch_keeps_the_numbers():
  params, batch = mlp_params(blocks=4), mlp_batch(n=12)
  opt = optax.adam(1e-2)
  ref_losses, ref_params = jit_reference_run(mlp_loss, params, opt, [batch] * 3)
  cfg = fsdp_jax.FSDPConfig(auto_wrap_policy=PF_WRAP, reshard_after_forward=2,
                            forward_prefetch_units={"inp": ["blocks.0", "blocks.1"]},
                            backward_prefetch_units={"blocks.3": ["blocks.1"]})
  losses, state = sharded_run(mlp_loss, params, [batch] * 3, opt, mesh_for(None, 4), cfg)
  assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params)


@pytest.mark.parametrize("kw,match", [
    (dict(forward_prefetch_units={"blocks.2": ["blocks.0"]}),
     r"lists 'blocks.0', which the forward pass gathers before it \(order: \['inp', "),
    (dict(backward_prefetch_units={"blocks.1": ["blocks.3"]}),
     "which the backward pass gathers before it"),
    (dict(backward_prefetch_units={"blocks.1": ["inp"]}),
     "'inp' has no all-gather in the backward pass"),
])
def test_impossible_prefetch_is_refused_when_the_step_is_built(kw, match):
  with pytest.raises(ValueError, match=match):
    _schedule(**{k: tuple((u, tuple(t)) for u, t in v.items()) for k, v in kw.items()})
