"""Randomness that is wrong by construction is refused with the fix.

A ``loss_fn`` that draws random bits from a key that is a constant of its
trace (closed over from outside, or made inside from a Python number) would
give every device and every step the same random numbers: the step refuses
it, naming the user's line, ``loss_fn(..., *, rng)`` and
``init_train_state(rng=)``. Keys from ``rng=`` (split, folded, carried
through a scan), keys derived from the batch, and keys marked with
``fsdp_jax.constant_key`` pass. Flax's error for a model that needs a key
and got none carries the same hint.
"""

from __future__ import annotations

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax

from helpers import mesh_for

KEY = jax.random.key(3)
RAW_KEY = jax.random.PRNGKey(3)


class DropoutMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Dense(6)(x)
    x = nn.Dropout(0.5, deterministic=not train)(x)
    return nn.Dense(1)(x)


MODEL = DropoutMLP()
PARAMS = MODEL.init({"params": jax.random.key(0), "dropout": jax.random.key(1)},
                    jnp.ones((1, 5)))


def _batch(rows=12):
  rng = np.random.default_rng(0)
  return {"x": rng.normal(size=(rows, 5)).astype(np.float32),
          "y": rng.normal(size=(rows, 1)).astype(np.float32),
          "seed": np.arange(rows, dtype=np.int32)}


def _run(loss_fn, n=3, steps=1):
  state = fsdp_jax.init_train_state(params=PARAMS, optimizer=optax.sgd(0.1),
                                    mesh=mesh_for(fsdp_jax.ShardingStrategy.FULL_SHARD, n),
                                    config=fsdp_jax.FSDPConfig(), rng=jax.random.key(7))
  step = fsdp_jax.shard_train_step(loss_fn)
  losses = []
  for _ in range(steps):
    state, metrics = step(state, _batch())
    losses.append(float(metrics["loss"]))
  return state, losses


def _mse(out, batch):
  return jnp.mean((out - batch["y"]) ** 2)


def closed_over_flax(params, batch):
  return _mse(MODEL.apply(params, batch["x"], rngs={"dropout": KEY}), batch)


def made_inside(params, batch):
  noise = jax.random.normal(jax.random.key(0), batch["x"].shape)
  return _mse(MODEL.apply(params, batch["x"] + noise, train=False), batch)


def raw_key_closed_over(params, batch):
  mask = jax.random.bernoulli(RAW_KEY, 0.5, batch["x"].shape)
  return _mse(MODEL.apply(params, batch["x"] * mask, train=False), batch)


def constant_key_in_a_scan(params, batch):
  def body(h, _):
    return h + 0.1 * jax.random.normal(KEY, h.shape), None
  x, _ = jax.lax.scan(body, batch["x"], None, length=3)
  return _mse(MODEL.apply(params, x, train=False), batch)


@pytest.mark.parametrize("loss_fn", [closed_over_flax, made_inside, raw_key_closed_over,
                                     constant_key_in_a_scan])
def test_a_key_that_is_a_constant_of_the_trace_is_refused(loss_fn):
  with pytest.raises(ValueError) as e:
    _run(loss_fn)
  msg = str(e.value)
  assert "a key that is a constant of its trace" in msg, msg
  assert "test_rng_checks.py:" in msg, msg  # the user's line, not a library's
  assert "def loss_fn(params, batch, *, rng)" in msg, msg
  assert "rng=jax.random.key(seed) to fsdp_jax.init_train_state" in msg, msg
  assert "fold_in(fold_in(rng, step), device_index)" in msg, msg
  assert "fsdp_jax.constant_key(key)" in msg, msg


def test_a_loss_that_takes_rng_but_also_uses_a_constant_key_is_told_to_use_it():
  def loss_fn(params, batch, *, rng):
    del rng
    return closed_over_flax(params, batch)
  with pytest.raises(ValueError, match=r"use the rng it already gets"):
    _run(loss_fn)


def from_rng(params, batch, *, rng):
  return _mse(MODEL.apply(params, batch["x"], rngs={"dropout": rng}), batch)


def split_and_folded(params, batch, *, rng):
  a, b = jax.random.split(jax.random.fold_in(rng, 3))
  noise = 0.1 * jax.random.normal(a, batch["x"].shape)
  return _mse(MODEL.apply(params, batch["x"] + noise, rngs={"dropout": b}), batch)


def carried_through_a_scan(params, batch, *, rng):
  def body(carry, _):
    h, key = carry
    key, sub = jax.random.split(key)
    return (h + 0.1 * jax.random.normal(sub, h.shape), key), None
  (x, _), _ = jax.lax.scan(body, (batch["x"], rng), None, length=3)
  return _mse(MODEL.apply(params, x, train=False), batch)


def derived_from_the_batch(params, batch):
  keys = jax.vmap(lambda s: jax.random.fold_in(KEY, s))(batch["seed"])
  noise = jax.vmap(lambda k: jax.random.normal(k, (5,)))(keys)
  return _mse(MODEL.apply(params, batch["x"] + 0.1 * noise, train=False), batch)


def marked_constant(params, batch):
  noise = jax.random.normal(fsdp_jax.constant_key(KEY), batch["x"].shape)
  return _mse(MODEL.apply(params, batch["x"] + 0.1 * noise, train=False), batch)


@pytest.mark.parametrize("loss_fn", [from_rng, split_and_folded, carried_through_a_scan,
                                     derived_from_the_batch, marked_constant])
def test_keys_from_rng_the_batch_or_marked_constant_pass(loss_fn):
  _, losses = _run(loss_fn, steps=2)
  assert all(np.isfinite(losses)) and losses[0] != losses[1], losses


@pytest.mark.parametrize("n", [1, 3, 4])
def test_a_marked_constant_key_gives_the_numbers_of_unsharded_jax(n):
  """constant_key changes nothing but the check: each device draws from the
  same key for its rows (what the loss says), so the step's loss is that of
  one jax.jit over the global batch with that noise repeated per device."""
  _, losses = _run(marked_constant, n=n)
  batch = _batch()
  rows = batch["x"].shape[0] // n
  noise = jnp.tile(jax.random.normal(KEY, (rows, 5)), (n, 1))
  want = jax.jit(lambda p: _mse(MODEL.apply(p, batch["x"] + 0.1 * noise, train=False),
                                batch))(PARAMS)
  np.testing.assert_allclose(losses[0], float(want), rtol=1e-6)


def test_flax_missing_rng_error_carries_the_fix():
  def loss_fn(params, batch):
    return _mse(MODEL.apply(params, batch["x"]), batch)  # dropout, no rngs
  with pytest.raises(flax.errors.InvalidRngError) as e:
    _run(loss_fn)
  notes = "\n".join(getattr(e.value, "__notes__", []))
  assert "def loss_fn(params, batch, *, rng)" in notes, notes
  assert "rngs={'dropout': rng}" in notes and "init_train_state" in notes, notes
