"""Context parallelism composed with the rest (issue 53): a Flax linen
``nn.scan`` over attention layers, with and without ``stacked_layers``
(each layer gathered inside the loop), and bf16 mixed precision, under a
``"context"`` axis, against one device; a scan along the sequence itself
refused. Several processes are in
test_multiprocess.py; evaluation, checkpoints, accumulation, clipping and
LoRA in test_context_parallel.py."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from helpers import assert_trees_close, jit_reference_run, train_steps

VOCAB, D, KV, HEADS, SEQ, LAYERS = 11, 16, 4, 2, 16, 2


class Block(nn.Module):
  """One attention layer in jnp: positions from jnp.arange, a jnp.tril
  causal mask, grouped-query einsum attention. The carry (the hidden state)
  is split along the sequence."""

  @nn.compact
  def __call__(self, h, _):
    b, t, _ = h.shape
    pos = jnp.arange(t)
    x = nn.RMSNorm()(h)
    q = nn.Dense(HEADS * KV, use_bias=False, name="q")(x).reshape(b, t, HEADS, KV)
    k = nn.Dense(KV, use_bias=False, name="k")(x)
    v = nn.Dense(KV, use_bias=False, name="v")(x)
    q = q * (1 + 0.01 * pos[None, :, None, None])
    s = jnp.einsum("bqhd,bkd->bhqk", q, k) / np.sqrt(KV)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
    o = jnp.einsum("bhqk,bkd->bqhd", jax.nn.softmax(s, -1), v).reshape(b, t, HEADS * KV)
    return h + nn.Dense(D, use_bias=False, name="o")(o), None


class Decoder(nn.Module):

  @nn.compact
  def __call__(self, ids):
    h = nn.Embed(VOCAB, D)(ids).astype(jnp.float32)
    stack = nn.scan(nn.remat(Block, prevent_cse=False), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=LAYERS)
    h, _ = stack(name="layers")(h, None)
    return nn.Dense(VOCAB, name="head")(h).astype(jnp.float32)


MODEL = Decoder()


def loss_fn(params, batch):
  logits = MODEL.apply(params, batch["ids"])[:, :-1]
  labels = batch["ids"][:, 1:]
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), labels[..., None], -1)[..., 0]
  return fsdp_jax.WeightedLoss(total=jnp.sum(nll), weight=jnp.float32(nll.size))


def _ratio(params, batch):
  out = loss_fn(params, batch)
  return out.total / out.weight


@pytest.fixture(scope="module")
def setup():
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(MODEL.init, jax.random.key(0), jnp.ones((1, SEQ), jnp.int32))
  params = jax.tree.map(lambda x: rng.normal(0, 0.3, x.shape).astype(np.float32), shapes)
  batches = [{"ids": rng.integers(0, VOCAB, (2, SEQ)).astype(np.int32)} for _ in range(2)]
  return params, batches


@pytest.fixture(scope="module")
def reference(setup):
  """One device's two Adam steps (fp32), compiled once for both layer
  layouts below."""
  params, batches = setup
  return jit_reference_run(_ratio, params, optax.adam(1e-2), batches)


def _train(params, batches, mesh_kw, config):
  n = int(np.prod(list(mesh_kw.values())))
  mesh = fsdp_jax.make_mesh(**mesh_kw, devices=jax.devices()[:n])
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.adam(1e-2), mesh=mesh,
                                    config=config)
  state, losses = train_steps(fsdp_jax.shard_train_step(loss_fn), state, batches)
  return state, losses


@pytest.mark.parametrize("stacked,mesh_kw", [
    ((), dict(shard=2, context=2)),                # the scan's layers gathered whole
    (("params.layers",), dict(context=4)),        # one layer per iteration
])
def test_linen_scan_over_layers(setup, reference, stacked, mesh_kw):
  """nn.scan(nn.remat(Block)) whose carry is split along the sequence: the
  loss and parameters after two Adam steps equal one device's (fp32)."""
  params, batches = setup
  ref_losses, ref_params = reference
  config = fsdp_jax.FSDPConfig(stacked_layers=stacked)
  if stacked:
    state, losses = _train(params, batches, mesh_kw, config)
    assert [u.stacked for u in state.plan.units].count(True) == 1
  else:
    with pytest.warns(UserWarning, match="not declared stacked"):
      state, losses = _train(params, batches, mesh_kw, config)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params, rtol=1e-5, atol=1e-5)


def test_linen_scan_mixed_precision(setup):
  """bf16 parameters and compute (MixedPrecision), the layers stacked, on
  context=4: the losses and parameters within 2e-3 of one device's bf16
  run (the same config on one device)."""
  params, batches = setup
  mp = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
  config = fsdp_jax.FSDPConfig(mixed_precision=mp, stacked_layers=("params.layers",))
  one, one_losses = _train(params, batches, dict(shard=1), config)
  state, losses = _train(params, batches, dict(context=4), config)
  np.testing.assert_allclose(losses, one_losses, rtol=2e-3)
  assert_trees_close(fsdp_jax.summon_full_params(state), fsdp_jax.summon_full_params(one),
                     rtol=2e-3, atol=2e-3)


def test_scan_along_the_sequence_is_refused():
  """An RNN (a scan over the split sequence itself) is refused, named."""
  def rnn(p, b):
    h = p["emb"][b["ids"]]
    def cell(c, x):
      c = jnp.tanh(c @ p["w"] + x)
      return c, c
    _, ys = jax.lax.scan(cell, jnp.zeros((h.shape[0], h.shape[2])), h.swapaxes(0, 1))
    return jnp.mean(ys ** 2)

  mesh = fsdp_jax.make_mesh(context=2, devices=jax.devices()[:2])
  state = fsdp_jax.init_train_state(params={"emb": jnp.ones((VOCAB, 4)), "w": jnp.eye(4)},
                                    optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig())
  with pytest.raises(ValueError, match=r"cannot compute scan at .*test_context_compose.py.*"
                     r"a scan over values split along the sequence.*Fix:"):
    fsdp_jax.shard_train_step(rnn)(state, {"ids": np.zeros((2, 8), np.int32)})
