"""NF4 (QLoRA's NormalFloat4) block quantization.

* The format: ``Quantization(dtype="nf4")`` is a 4-bit, non-integer format
  (round to nearest only) whose configs compare equal across spellings.
* Round trip: every value decodes to the level nearest its scaled value, so
  the error is at most half the widest gap between levels times the block's
  absmax; zeros stay exact, a non-finite block decodes to NaN.
* Against bitsandbytes: the same packed code bytes and absmax as
  ``bitsandbytes.functional.quantize_4bit(quant_type="nf4")`` for the same
  flat float32 data (ties on the thresholds and partial last blocks
  included), and on a 2-D weight no more error than bitsandbytes' layout.
* In training: nf4 all-gathers (qwZ) move the nf4 payload and train close
  to unquantized gathers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax._src import hlo, quantization
from helpers import mesh_for, mlp_batch, mlp_loss, mlp_params, sharded_run

Q = fsdp_jax.Quantization
NF4 = Q(dtype="nf4", block_size=64)
LEVELS = np.asarray(quantization.NF4_LEVELS, np.float32)
HALF_GAP = float(np.max(np.diff(LEVELS))) / 2  # (1 - 0.7229568) / 2
BNB_REASON = ("bitsandbytes (and the torch it needs) is installed by the test extra on "
              "Python 3.11 only, where torch's CPU build is available")
WRAP = fsdp_jax.ModuleWrapPolicy(["blocks.*"])


def _round_trip(x, q=NF4):
  n = x.shape[-1]
  payload = quantization.encode(jnp.asarray(x), q)
  return np.asarray(payload), np.asarray(quantization.decode(payload, q, n, jnp.float32))


def _split(payload, n):
  """A flat payload -> (codes in value order, float32 scales)."""
  body = payload[:(n + 1) // 2]
  codes = np.stack([body >> 4, body & 15], axis=-1).reshape(-1)[:n]
  return codes, payload[(n + 1) // 2:].copy().view(np.float32)


def _block_absmax(x, b=64):
  n = x.shape[-1]
  nb = -(-n // b)
  pad = np.pad(np.abs(x), [(0, 0)] * (x.ndim - 1) + [(0, nb * b - n)])
  return np.repeat(pad.reshape(x.shape[:-1] + (nb, b)).max(-1), b, axis=-1)[..., :n]


# ---------------------------------------------------------------------------
# The format


def test_nf4_is_a_4bit_round_to_nearest_format():
  assert NF4.dtype.name == "nf4" and NF4.bits == 4 and NF4.integer is False
  assert NF4.max_value == 1.0 and NF4.block_size == 64
  for spelling in ("NF4", "Nf4", quantization.NF4):
    other = Q(dtype=spelling, block_size=64)
    assert other == NF4 and hash(other) == hash(NF4) and other.dtype == NF4.dtype
  assert NF4 != Q(dtype="int4", block_size=64) and NF4.dtype != np.dtype(np.int8)
  assert Q().dtype == np.dtype(np.int8)  # the default is unchanged
  assert eval(repr(NF4), {"Quantization": Q}) == NF4
  assert not NF4.stochastic(gradient=True) and not NF4.stochastic(gradient=False)
  assert NF4.describe() == "nf4, blocks of 64"
  assert NF4.blocks(1000) == (64, 16) and NF4.payload_bytes(1000) == 500 + 4 * 16
  assert Q(dtype="nf4", block_size=None).blocks(7) == (8, 1)
  assert Q(dtype="nf4", block_size=None).payload_bytes(7) == 4 + 4
  assert len(quantization.NF4_LEVELS) == 16 and quantization.NF4_LEVELS[7] == 0.0
  t = np.asarray(quantization.NF4_THRESHOLDS, np.float32)
  assert t.shape == (15,) and bool(np.all((LEVELS[:-1] < t) & (t < LEVELS[1:])))


@pytest.mark.parametrize("kw,match", [
    (dict(dtype="nf4", rounding="stochastic"), "implemented for the integer formats.*nf4"),
    (dict(dtype="nf4", block_size=63), r"dtype='nf4', block_size=63.*even; e.g. block_size=64"),
    (dict(dtype="nf3"), "not supported. Fix: pass one of.*\"nf4\""),
])
def test_bad_nf4_configs_are_refused(kw, match):
  with pytest.raises(ValueError, match=match):
    Q(**kw)


def test_nf4_refuses_stochastic_encoding():
  with pytest.raises(ValueError, match="stochastic rounding is for the integer formats, not nf4"):
    quantization.encode(jnp.ones((64,)), NF4, stochastic=True)


def test_fsdp_config_takes_nf4_and_the_plan_says_so():
  cfg = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, all_gather_quantization=NF4,
                            reduce_scatter_quantization=NF4)
  assert cfg == fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP,
                                    all_gather_quantization=Q(dtype="NF4", block_size=64),
                                    reduce_scatter_quantization=Q(dtype="nf4", block_size=64))
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=optax.sgd(0.1),
                                    mesh=mesh_for(None, 8), config=cfg)
  text = str(state.plan)
  assert "all-gather quantization: nf4, blocks of 64" in text
  assert "quantized all-to-all, nf4, blocks of 64, summed" in text


# ---------------------------------------------------------------------------
# Round trip


@pytest.mark.parametrize("shape", [(64,), (1000,), (3, 2, 1000), (5, 999), (7,)],
                         ids=lambda s: "x".join(map(str, s)))
def test_round_trip_takes_the_nearest_level(shape):
  """Every code is the nearest level to x / absmax (ties either way), so
  |x - x'| <= half the widest gap times the block's absmax."""
  n = shape[-1]
  x = np.asarray(jax.random.normal(jax.random.key(0), shape)) * np.logspace(-3, 1, n)
  x = x.astype(np.float32)
  payload, back = _round_trip(x)
  assert payload.dtype == np.uint8 and payload.shape == shape[:-1] + (NF4.payload_bytes(n),)
  assert back.shape == shape and back.dtype == np.float32
  amax = _block_absmax(x)
  flat_payload, flat_x = payload.reshape(-1, payload.shape[-1]), x.reshape(-1, n)
  for row, xs, am in zip(flat_payload, flat_x, amax.reshape(-1, n)):
    codes, scales = _split(row, n)
    assert codes.max() <= 15 and scales.shape == (-(-n // 64),)
    np.testing.assert_array_equal(np.repeat(scales, 64)[:n], am)  # scale = block absmax
    dist = np.abs(xs[:, None] / am[:, None] - LEVELS[None, :])
    assert bool(np.all(dist[np.arange(n), codes] <= dist.min(-1) + 1e-6))
  err = np.abs(back - x)
  assert bool(np.all(err <= HALF_GAP * amax * (1 + 1e-6))), float(np.max(err / amax))
  assert float(np.max(err)) > 0
  # Each block's largest magnitude is a level (+-1): it comes back exactly.
  top = np.abs(x) == amax
  np.testing.assert_array_equal(back[top], x[top])


def test_zeros_stay_exact_and_partial_blocks_keep_their_own_scale():
  x = np.zeros((2, 200), np.float32)
  x[0, 64:128] = np.linspace(-2.0, 2.0, 64)
  x[0, 130] = 0.25   # the partial last block (192..199) stays zero; block 2 has one value
  x[1, 195] = -3.0   # the partial last block holds one value
  payload, back = _round_trip(x)
  codes, scales = _split(payload[0], 200)
  np.testing.assert_array_equal(scales, [0.0, 2.0, 0.25, 0.0])
  assert bool(np.all(codes[x[0] == 0] == 7))  # level 0.0
  np.testing.assert_array_equal(back[x == 0], 0.0)
  assert back[0, 130] == 0.25 and back[1, 195] == -3.0
  np.testing.assert_array_equal(_split(payload[1], 200)[1], [0.0, 0.0, 0.0, 3.0])


def test_a_non_finite_block_decodes_to_nan_and_only_that_block():
  x = np.array(jax.random.normal(jax.random.key(1), (3, 256)), np.float32)
  x[0, 70] = np.nan
  x[1, 200] = np.inf
  x[2, 10] = -np.inf
  _, back = _round_trip(x)
  bad = {(0, 1), (1, 3), (2, 0)}
  for r in range(3):
    for blk in range(4):
      got = back[r, 64 * blk:64 * (blk + 1)]
      if (r, blk) in bad:
        assert bool(np.all(np.isnan(got)))
      else:
        assert bool(np.all(np.isfinite(got)))


def test_nf4_beats_int4_on_normal_data():
  """NF4's levels are normal quantiles: on Gaussian blocks its error is below
  int4's (measured: mean |error| 0.073 against 0.091, in units of sigma)."""
  x = jax.random.normal(jax.random.key(4), (64, 4096))
  err = {}
  for q in (NF4, Q(dtype="int4", block_size=64)):
    back = quantization.decode(quantization.encode(x, q), q, 4096, jnp.float32)
    err[q.dtype.name] = float(jnp.mean(jnp.abs(back - x)))
  assert 0 < err["nf4"] < 0.85 * err["int4"], err


def test_round_trip_under_jit_and_one_scale_per_row():
  q = Q(dtype="nf4", block_size=None)
  x = jax.random.normal(jax.random.key(2), (4, 301))
  back = jax.jit(lambda x: quantization.decode(quantization.encode(x, q), q, 301,
                                               jnp.bfloat16))(x)
  assert back.dtype == jnp.bfloat16 and back.shape == (4, 301)
  amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
  err = jnp.abs(back.astype(jnp.float32) - x)
  assert bool(jnp.all(err <= HALF_GAP * amax * 1.01))  # bf16 output rounding


# ---------------------------------------------------------------------------
# Against bitsandbytes


@pytest.fixture(scope="module")
def bnb():
  pytest.importorskip("bitsandbytes", reason=BNB_REASON)
  import bitsandbytes.functional
  return bitsandbytes.functional


def _bnb_quantize(bnb, x):
  import torch
  packed, state = bnb.quantize_4bit(torch.from_numpy(np.ascontiguousarray(x)), blocksize=64,
                                    quant_type="nf4")
  return packed, state


def _on_thresholds(n, seed):
  """Values exactly on bitsandbytes' decision thresholds after scaling (ties)
  for random block absmaxes: the float32 nearest to threshold * absmax."""
  rng = np.random.default_rng(seed)
  t = np.asarray(quantization.NF4_THRESHOLDS, np.float32)
  nb = -(-n // 64)
  amax = rng.uniform(0.5, 2.0, nb).astype(np.float32)
  x = (rng.choice(t, n) * np.repeat(amax, 64)[:n]).astype(np.float32)
  x[::64] = amax  # each block's absmax
  return x


def _data(kind, n, seed):
  rng = np.random.default_rng(seed)
  if kind == "normal":
    return (rng.standard_normal(n) * 0.02).astype(np.float32)
  if kind == "heavy":  # outliers and all-zero blocks
    x = rng.standard_t(2, n).astype(np.float32)
    x[64:128] = 0.0
    return x
  return _on_thresholds(n, seed)


@pytest.mark.parametrize("kind", ["normal", "heavy", "ties"])
@pytest.mark.parametrize("n", [64, 4096, 1000, 6401, 33])
def test_same_bytes_and_absmax_as_bitsandbytes(bnb, n, kind):
  """Flat float32 data: our packed codes are bitsandbytes' bytes (first value
  in the high nibble; a value on a threshold takes the lower code; a partial
  last block, which bitsandbytes divides by its absmax where full blocks
  multiply by the reciprocal, included), our scales its absmax, and both
  dequantize to the same float32 values."""
  x = _data(kind, n, seed=n)
  packed, state = _bnb_quantize(bnb, x)
  payload = np.asarray(jax.jit(lambda v: quantization.encode(v, NF4))(jnp.asarray(x)))
  body, scales = payload[:(n + 1) // 2], payload[(n + 1) // 2:].copy().view(np.float32)
  np.testing.assert_array_equal(body, packed.numpy().reshape(-1))
  absmax = state.absmax.numpy()
  if kind == "heavy" and n >= 128:
    assert absmax[1] == 0.0 and scales[1] == 0.0  # an all-zero block: scale 0 in both
  np.testing.assert_array_equal(scales, absmax)
  ours = np.asarray(quantization.decode(jnp.asarray(payload), NF4, n, jnp.float32))
  np.testing.assert_array_equal(ours, bnb.dequantize_4bit(packed, state).numpy().reshape(-1))


def test_ties_do_occur_where_reciprocal_and_division_differ(bnb):
  """The tie data really tests the rounding rule: rounding a threshold up
  would change bytes, and dividing a full block instead of multiplying by the
  reciprocal would too."""
  x = _on_thresholds(4096, seed=4096)
  scaled_mul = x * np.repeat(np.float32(1) / np.abs(x).reshape(-1, 64).max(-1), 64)
  scaled_div = x / np.repeat(np.abs(x).reshape(-1, 64).max(-1), 64)
  t = np.asarray(quantization.NF4_THRESHOLDS, np.float32)
  assert int(np.isin(scaled_mul, t).sum()) > 100
  assert int(np.sum(np.isin(scaled_mul, t) != np.isin(scaled_div, t))) > 10
  packed, _ = _bnb_quantize(bnb, x)
  codes = np.stack([packed.numpy().reshape(-1) >> 4, packed.numpy().reshape(-1) & 15], -1)
  on = np.isin(scaled_mul, t)
  lower = np.searchsorted(t, scaled_mul[on], side="left")  # thresholds strictly below
  np.testing.assert_array_equal(codes.reshape(-1)[on], lower)


def test_error_on_a_weight_is_no_worse_than_bitsandbytes(bnb):
  """A [in, out] weight quantized along our last axis (out) against
  bitsandbytes on PyTorch's [out, in] layout (blocks along in): the blocks
  differ, the mean error must not be larger by more than 1%."""
  import torch
  w = np.asarray(jax.random.normal(jax.random.key(7), (768, 512)), np.float32) * 0.02
  _, back = _round_trip(w)
  ours = float(np.mean(np.abs(back - w)))
  packed, state = bnb.quantize_4bit(torch.from_numpy(np.ascontiguousarray(w.T)), blocksize=64,
                                    quant_type="nf4")
  theirs_w = bnb.dequantize_4bit(packed, state).numpy()
  assert theirs_w.shape == w.T.shape
  theirs = float(np.mean(np.abs(theirs_w.T - w)))
  assert 0 < ours <= theirs * 1.01, (ours, theirs)
  assert ours < 0.2 * float(np.mean(np.abs(w)))  # it is a close copy


# ---------------------------------------------------------------------------
# In training: nf4 all-gathers (qwZ)

WIDE = dict(d=64, d_in=32)  # 8 x 520 values per block unit


def test_nf4_gathers_move_the_nf4_payload():
  params, batch, mesh = mlp_params(**WIDE), mlp_batch(d_in=32), mesh_for(None, 8)
  compiled = {}
  for name, q in (("base", None), ("nf4", NF4)):
    cfg = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, all_gather_quantization=q)
    state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                      config=cfg)
    step = fsdp_jax.shard_train_step(mlp_loss, optax.sgd(0.1), mesh=mesh, config=cfg)
    compiled[name] = [c for c in hlo.collectives(step.lower(state, batch).compile().as_text())
                      if c.kind == "all-gather" and c.shapes[0] != ()]
  base, quant = compiled["base"], compiled["nf4"]
  assert len(quant) == len(base) > 0
  assert all(d == "u8" for c in quant for d in c.dtypes)
  expected = sum(8 * NF4.payload_bytes(c.shapes[0][1]) for c in base)
  got = sum(c.bytes for c in quant)
  assert got == expected and got <= 0.16 * sum(c.bytes for c in base), (got, expected)


def _fan_in_params():
  """The wide MLP with weights ~ N(0, 1 / fan_in): unsaturated tanh units."""
  return jax.tree.map(lambda w: w * (2 / np.sqrt(w.shape[0])) if w.ndim == 2 else w,
                      mlp_params(**WIDE))


def test_nf4_gathered_training_stays_close_to_unquantized():
  """10 Adam steps: the forward sees nf4 copies of the weights (within half
  the widest level gap of each unit's largest value), and the losses follow
  the unquantized run's within 5% (2.5% at most measured on jax 0.10; int4
  gathers 1.3%, int8 0.25%)."""
  params = _fan_in_params()
  batches = [mlp_batch(seed=20 + i, d_in=32, n=32) for i in range(10)]
  mesh = mesh_for(None, 8)
  runs = {}
  for name, q in (("exact", None), ("nf4", NF4)):
    cfg = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, all_gather_quantization=q)
    runs[name], _ = sharded_run(mlp_loss, params, batches, optax.adam(3e-3), mesh, cfg)
  exact, nf4 = np.asarray(runs["exact"]), np.asarray(runs["nf4"])
  assert exact[-1] < 0.9 * exact[0]  # it trained
  assert not np.array_equal(exact, nf4)  # the gathers were quantized
  np.testing.assert_allclose(nf4, exact, rtol=0.05)

  cfg = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, all_gather_quantization=NF4,
                            use_orig_params=True)
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.0), mesh=mesh,
                                    config=cfg)
  step = fsdp_jax.shard_train_step(lambda p, b: (mlp_loss(p, b), p), optax.sgd(0.0),
                                   mesh=mesh, config=cfg)
  _, metrics = step(state, batches[0])
  # A scale covers a block of one device's shard of one unit: bounded by the
  # unit's largest value.
  unit_of = lambda path: jax.tree_util.keystr(path[:2]) if path[0].key == "blocks" else "root"
  unit_max = {}
  for path, y in jax.tree_util.tree_flatten_with_path(params)[0]:
    unit_max[unit_of(path)] = max(unit_max.get(unit_of(path), 0.0), float(jnp.max(jnp.abs(y))))
  errs = []
  for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(metrics["aux"])[0],
                          jax.tree.leaves(params)):
    errs.append(float(jnp.max(jnp.abs(x - y))))
    assert errs[-1] <= HALF_GAP * unit_max[unit_of(path)] * 1.0001, (path, errs[-1])
  assert max(errs) > 0


def test_nf4_gradient_reduction_rounds_to_nearest_within_half_a_gap():
  """qgZ with nf4 (allowed; round to nearest): one all-to-all hop on 8
  devices; each device's gradient piece is off by at most half the widest
  gap times its block's absmax, so the mean over W devices by at most
  HALF_GAP (1/W) sum_j max|g_j|."""
  params, batch = _fan_in_params(), mlp_batch(n=48, d_in=32)
  cfg = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, use_orig_params=True,
                            reduce_scatter_quantization=NF4)
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1),
                                    mesh=mesh_for(None, 8), config=cfg)
  got = fsdp_jax.custom.sharded_grads(mlp_loss, state, batch)
  got = jax.tree.map(lambda g, p: np.asarray(g)[:p.shape[0]], got, params)
  exact = jax.grad(mlp_loss)(params, batch)
  locals_ = [jax.grad(mlp_loss)(params, jax.tree.map(lambda x: x[6 * j:6 * (j + 1)], batch))
             for j in range(8)]
  bound = HALF_GAP * sum(max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g))
                         for g in locals_) / 8 * 1.001
  err = max(float(np.max(np.abs(a - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(exact)))
  assert 0 < err <= bound, (err, bound)
