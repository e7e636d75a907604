"""The blocked loss (``fsdp_jax.chunked_cross_entropy``) and the families'
``loss_fn`` built on it (``from_pretrained(loss_block_tokens=...)``):

* the loss and its gradients (hidden state, kernel) equal the unblocked
  head + cross-entropy: float32 to 1e-6, bf16 to 2e-3, block sizes that do
  not divide the tokens, soft-capping, ignored labels;
* a family's blocked ``loss_fn`` equals its unblocked one (loss and
  gradients through the parameters), tied and untied heads, Gemma 2's
  soft-capping; trained with AdamW through ``shard_train_step`` on a
  ``shard=2 x tensor=2`` mesh it gives one device's unblocked numbers, with
  nothing gathered over ``"tensor"`` (the vocabulary-parallel
  cross-entropy of each block);
* the compiled gradient's temporaries are a fraction of the unblocked
  loss's (abstract shapes, nothing allocated);
* bad input gets a clear error.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax import models
from fsdp_jax._src.planner import programs
from helpers import jit_reference_run

V, T = 40, 9
CONFIGS = {
    "llama": dict(model_type="llama", vocab_size=V, hidden_size=16, intermediate_size=24,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  initializer_range=0.3),
    # Tied head, final soft-capping.
    "gemma2": dict(model_type="gemma2", vocab_size=V, hidden_size=16, intermediate_size=24,
                   num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=4, query_pre_attn_scalar=4, sliding_window=4,
                   attn_logit_softcapping=2.0, final_logit_softcapping=1.5,
                   initializer_range=0.3),
}


def _reference(hidden, kernel, labels, soft_cap=None):
  """The unblocked head and cross-entropy: [tokens, vocab] logits."""
  logits = jnp.dot(hidden, kernel, preferred_element_type=jnp.float32)
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  ok = labels != -100
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(ok, labels, 0))
  return jnp.sum(jnp.where(ok, ce, 0.0))


def _inputs(dtype=jnp.float32, shape=(2, 7), d=12, vocab=30):
  k = jax.random.split(jax.random.key(0), 3)
  hidden = jax.random.normal(k[0], shape + (d,)).astype(dtype)
  kernel = (0.5 * jax.random.normal(k[1], (d, vocab))).astype(dtype)  # logits of std ~1.7
  labels = jax.random.randint(k[2], shape, 0, vocab)
  labels = labels.at[0, :3].set(-100).at[1, -1].set(-100)
  return hidden, kernel, labels


def _close(a, b, tol, norm=False):
  """max |a - b| within tol of max |b| (per array); with ``norm``, the
  relative error ||a - b|| / ||b|| (bf16 results: one bf16 unit in the last
  place is already 4e-3 of an element)."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    if norm:
      assert np.linalg.norm(x - y) <= tol * np.linalg.norm(y), (
          np.linalg.norm(x - y), np.linalg.norm(y))
    else:
      assert np.max(np.abs(x - y)) <= tol * max(np.max(np.abs(y)), 1e-30), (
          np.max(np.abs(x - y)), np.max(np.abs(y)))


@pytest.mark.parametrize("block, soft_cap", [(4, None), (100, None), (3, 2.0)])
def test_blocked_equals_unblocked_float32(block, soft_cap):
  """Blocks of 4 and 3 do not divide the 14 tokens (padded); 100, more
  than the tokens, is one block of 14."""
  hidden, kernel, labels = _inputs()
  blocked = lambda h, w: fsdp_jax.chunked_cross_entropy(h, w, labels, block_tokens=block,
                                                        soft_cap=soft_cap).total
  got = jax.jit(jax.value_and_grad(blocked, (0, 1)))(hidden, kernel)
  want = jax.jit(jax.value_and_grad(lambda h, w: _reference(h, w, labels, soft_cap),
                                    (0, 1)))(hidden, kernel)
  _close(got, want, 1e-6)
  loss = fsdp_jax.chunked_cross_entropy(hidden, kernel, labels, block_tokens=block)
  assert float(loss.weight) == 10.0  # 14 tokens, 4 ignored


def _unblocked16(hidden, kernel, labels, soft_cap):
  """The families' unblocked loss in a 16-bit dtype: logits in bf16,
  soft-capped (when ``soft_cap``), then the float32 cross-entropy."""
  logits = hidden @ kernel
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  logits = logits.astype(jnp.float32)
  ok = labels != -100
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(ok, labels, 0))
  return jnp.sum(jnp.where(ok, ce, 0.0))


def test_blocked_bfloat16_equals_unblocked():
  """bf16 inputs: the blocked loss's logits are the unblocked head's (bf16,
  soft-capped in bf16, widened for the softmax), so its loss equals the
  unblocked bf16 loss (1e-6) and the hidden state's gradient (no cap) is
  within 2e-3 of the unblocked one. The rest of the gradients are rounded
  in another order (the cap's backward, and the kernel's gradient, which
  XLA's CPU backend at jax 0.12 accumulates less exactly in the unblocked
  program): each is checked to be at least as close to the exact float32
  gradients as the unblocked bf16 loss's."""
  hidden, kernel, labels = _inputs(jnp.bfloat16, shape=(4, 16), d=32, vocab=100)
  f = lambda loss: jax.jit(jax.value_and_grad(loss, (0, 1)))
  for cap in (None, 3.0):
    got = f(lambda h, w: fsdp_jax.chunked_cross_entropy(
        h, w, labels, block_tokens=6, soft_cap=cap).total)(hidden, kernel)
    whole = f(lambda h, w: _unblocked16(h, w, labels, cap))(hidden, kernel)
    exact = f(lambda h, w: _reference(h, w, labels, cap))(hidden.astype(jnp.float32),
                                                         kernel.astype(jnp.float32))
    assert got[1][0].dtype == got[1][1].dtype == jnp.bfloat16
    _close(got[0], whole[0], 1e-6)
    if cap is None:
      _close(got[1][0], whole[1][0], 2e-3, norm=True)
    err = lambda a: [np.linalg.norm(np.float32(x) - y) for x, y in zip(a[1], exact[1])]
    assert all(e <= u * (1 + 1e-3) for e, u in zip(err(got), err(whole))), (err(got), err(whole))


def test_temporaries_are_block_sized():
  """The compiled gradient's temporaries, from shapes only: a few blocks of
  logits, not the [tokens, vocab] logits and their gradient."""
  h = jax.ShapeDtypeStruct((2048, 32), jnp.float32)
  w = jax.ShapeDtypeStruct((32, 4096), jnp.float32)
  y = jax.ShapeDtypeStruct((2048,), jnp.int32)
  temp = lambda f: jax.jit(jax.grad(f, (0, 1))).lower(h, w, y).compile(
      ).memory_analysis().temp_size_in_bytes
  blocked = temp(lambda h, w, y: fsdp_jax.chunked_cross_entropy(h, w, y, block_tokens=128).total)
  unblocked = temp(_reference)
  assert unblocked >= 2048 * 4096 * 4  # at least the logits
  assert blocked <= unblocked / 8, (blocked, unblocked)


def _family(tmp_path, name, **kw):
  d = tmp_path / name
  d.mkdir(exist_ok=True)
  (d / "config.json").write_text(json.dumps(CONFIGS[name]))
  return models.from_pretrained(str(d), **kw)


def _batch(rows=4):
  rng = np.random.default_rng(1)
  ids = rng.integers(0, V, (rows, T)).astype(np.int32)
  labels = ids.copy()
  labels[1, 2:6] = -100
  return {"input_ids": ids, "labels": labels}


def test_family_loss_blocked_equals_unblocked(tmp_path):
  """Llama's untied head (Gemma 2's tied and soft-capped one: the tensor
  parallel test below). Blocks of 4 tokens of the 2 x 9 positions (the last
  of each row predicts nothing)."""
  blocked = _family(tmp_path, "llama", loss_block_tokens=4)
  whole = _family(tmp_path, "llama", loss_block_tokens=None)
  params = jax.jit(blocked.init_fn)(jax.random.key(0))
  batch = _batch(2)
  mean = lambda f: lambda p: (lambda l: l.total / l.weight)(f(p, batch))
  got = jax.value_and_grad(mean(blocked.loss_fn))(params)
  want = jax.value_and_grad(mean(whole.loss_fn))(params)
  assert abs(float(got[0]) - float(want[0])) <= 1e-6 * abs(float(want[0]))
  _close(got[1], want[1], 1e-6)
  assert float(blocked.loss_fn(params, batch).weight) == 2 * (T - 1) - 4


@pytest.mark.parametrize("name, block", [("llama", 6), ("gemma2", 5)])
def test_family_trains_blocked_under_tensor_parallelism(name, block, tmp_path):
  """Llama (column-parallel lm_head; blocks of 6 divide a device's 18
  tokens, so the final norm's output, a partial sum over "tensor", reaches
  the blocks unpadded and is summed there) and Gemma 2 (tied head split by
  vocabulary, soft-capped; blocks of 5, padded) on shard=2 x tensor=2,
  three AdamW steps with the blocked loss: the numbers of one device's
  unblocked loss, and the blocks' cross-entropy ran on the vocabulary
  slices (nothing gathered over "tensor")."""
  blocked = _family(tmp_path, name, loss_block_tokens=block)
  whole = _family(tmp_path, name, loss_block_tokens=None)
  params = jax.device_get(jax.jit(blocked.init_fn)(jax.random.key(0)))
  batches = [_batch()] * 3
  opt = optax.adamw(1e-2)
  mean = lambda p, b: (lambda l: l.total / l.weight)(whole.loss_fn(p, b))
  ref_losses, ref_params = jit_reference_run(mean, params, opt, batches)
  mesh = fsdp_jax.make_mesh(shard=2, tensor=2, devices=jax.devices()[:4])
  config = blocked.fsdp_config(tensor_parallel=True)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(blocked.loss_fn, opt, mesh=mesh, config=config)
  losses = []
  for batch in batches:
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  assert ref_losses[2] < ref_losses[0] - 0.05
  assert not state.plan.tensor_report.gathered, state.plan.tensor_report.gathered
  _close(fsdp_jax.summon_full_params(state), ref_params, 1e-5)


def test_errors(tmp_path):
  hidden, kernel, labels = _inputs()
  cce = fsdp_jax.chunked_cross_entropy
  for bad in (0, -3, 2.5, True, None):
    with pytest.raises(ValueError, match=r"block_tokens=.*positive int"):
      cce(hidden, kernel, labels, block_tokens=bad)
  with pytest.raises(ValueError, match=r"hidden's last dimension is 12 .* takes 30"):
    cce(hidden, kernel.T, labels, block_tokens=4)
  with pytest.raises(ValueError, match=r"labels have shape \(2, 6\).*\(2, 7\)"):
    cce(hidden, kernel, labels[:, :6], block_tokens=4)
  with pytest.raises(ValueError, match="integer class ids"):
    cce(hidden, kernel, labels.astype(jnp.float32), block_tokens=4)
  with pytest.raises(ValueError, match="soft_cap"):
    cce(hidden, kernel, labels, block_tokens=4, soft_cap=-1.0)
  for bad in (0, 1.5, True, "512"):
    with pytest.raises(ValueError, match=r"loss_block_tokens=.*positive int"):
      _family(tmp_path, "llama", loss_block_tokens=bad)


def test_planner_counts_every_block():
  """XLA's cost_analysis() counts a loop's body once: of the blocked loss
  (4 blocks of 64 tokens) one block forward, one of each backward pass.
  With planner.programs.uncounted_loop_flops' addition the blocked loss's value
  and gradient count what the unblocked head's do (its logits and their
  two gradient matmuls, one program without loops) to 2% (softmax work
  aside, as the planner adds matmuls only)."""
  n, d, vocab = 256, 64, 512
  shapes = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((d, vocab), jnp.float32),
            jax.ShapeDtypeStruct((n,), jnp.int32))

  def blocked(h, w, y):
    out = fsdp_jax.chunked_cross_entropy(h, w, y, block_tokens=64)
    return out.total

  def unblocked(h, w, y):
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(h @ w, y))

  def counted(f, grad):
    g = jax.grad(f, argnums=(0, 1)) if grad else f
    return jax.jit(g).lower(*shapes).compile().cost_analysis()["flops"]

  fwd, bwd = programs.uncounted_loop_flops(jax.make_jaxpr(blocked)(*shapes).jaxpr.eqns)
  assert fwd > 0 and bwd > 0
  np.testing.assert_allclose(counted(blocked, False) + fwd, counted(unblocked, False), rtol=0.02)
  # the blocked backward computes the logits twice more (one per pass)
  matmul = 2.0 * n * d * vocab
  np.testing.assert_allclose(counted(blocked, True) + fwd + bwd,
                             counted(unblocked, True) + 2 * matmul, rtol=0.02)
