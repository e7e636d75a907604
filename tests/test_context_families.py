"""Context parallelism for the eight families of fsdp_jax.models (no torch:
runs on Python 3.13 too): three steps on a "context" mesh equal one unsharded
device's losses and parameters, to 1e-5 in float32 (AdamW) and 2e-3 in bf16
mixed precision (SGD).

Each family runs through its defaults: fsdp_jax.attention (the blockwise
kernel, blocks of 512) and the blocked loss (fsdp_jax.chunked_cross_entropy),
re-evaluated on each device's chunk (fsdp_jax/_src/context_eval.py). The
families are spread over context=8, shard=2 x context=4 and
replicate=2 x shard=2 x context=2 (HYBRID_SHARD), with sequences of 8 to
1,024 tokens (chunks of 2 to 128): packed rows (segment_ids, positions)
whose documents cross the chunk boundaries for six families, plain rows
(positions from jnp.arange) for two; head-tail load balancing for three,
the unblocked loss for two, activation checkpointing for two. What each family adds: mistral's and qwen2's
sliding windows (3 slots, reaching back past chunks of 4 and 8), gemma2's
attention and final soft-capping with sliding and full layers, gemma3's
per-layer window in a scan (chunks of 2), phi3's LongRoPE (its long factors
chosen by the largest position of the whole batch: a maximum over the split
sequence), gpt2's learned positions (a lookup at split positions) with the
keys over two of the kernel's blocks.
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
from helpers import (FAMILY_VOCAB, assert_trees_close, family_configs, jit_reference_run,
                     train_steps)

S = fsdp_jax.ShardingStrategy
V = FAMILY_VOCAB
# windows of 3 slots; gpt2's 1,024 learned positions take the 1,024-token runs
CONFIGS = family_configs(phi3_positions=64, gpt2_positions=1024)
CONTEXT_8, SHARD_CONTEXT, HYBRID = (dict(context=8), dict(shard=2, context=4),
                                    dict(replicate=2, shard=2, context=2))
# Each family's run: the mesh, rows x tokens, packed rows or plain ones,
# layers scanned, head-tail load balancing (ContextParallel(load_balance=
# True)), the unblocked loss (loss_block_tokens=None: logits[:, :-1] against
# labels[:, 1:], a one-token halo from the next device) or the default
# blocked one, the framework's activation checkpointing (its policy).
RUNS = {
    "llama": dict(mesh=CONTEXT_8, rows=1, t=16),
    "mistral": dict(mesh=SHARD_CONTEXT, rows=2, t=64, packed=True, scan=True, balance=True,
                    checkpoint="dots"),
    "qwen3": dict(mesh=HYBRID, rows=4, t=8, unblocked=True),
    "gemma2": dict(mesh=SHARD_CONTEXT, rows=2, t=24, packed=True, checkpoint="full"),
    "gemma3_text": dict(mesh=CONTEXT_8, rows=1, t=16, packed=True, scan=True, unblocked=True),
    "qwen2": dict(mesh=HYBRID, rows=4, t=16, packed=True, balance=True),
    "phi3": dict(mesh=SHARD_CONTEXT, rows=4, t=32, packed=True),  # 2 rows a device
    "gpt2": dict(mesh=CONTEXT_8, rows=1, t=1024, packed=True, balance=True),
}
# Adam's update of an element is lr * g / (|g| + eps): near g = 0 a rounding
# difference d of the gradient (the sums over the chunks and then over the
# context axis add in another order than one device's; about 1e-7 in
# float32) moves it by lr * d / eps. The default eps (1e-8) turns that into
# 1e-4 on gradients that are zero or nearly so (qwen2's and gpt2's key
# biases have mathematically zero gradients: a bias added to every key
# shifts each query's scores by a constant); eps = 1e-3 bounds it at 1e-6
# and keeps the update sensitive to the gradient's scale (an element below
# eps moves by lr * g / eps), so a gradient off by a factor still fails.
LR, EPS = 1e-2, 1e-3


def _bundle(tmp_path, family):
  d = tmp_path / family
  d.mkdir()
  (d / "config.json").write_text(json.dumps({"model_type": family, **CONFIGS[family]}))
  run = RUNS[family]
  unblocked = {"loss_block_tokens": None} if run.get("unblocked") else {}
  b = models.from_pretrained(str(d), scan=run.get("scan", False), **unblocked)
  rng = np.random.default_rng(0)  # every leaf random (norms off their init)
  params = jax.tree.map(lambda x: np.asarray(rng.normal(0.0, 0.3, x.shape), x.dtype),
                        jax.eval_shape(b.init_fn, jax.random.key(0)))
  return b, params


def _batch(rows, t, packed, seed):
  """Random tokens, 15% of the labels -100; packed: rows of documents of 1
  to t/2 tokens (odd rows ending in padding, segment 0), their segment ids
  and per-document positions."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, V, (rows, t)).astype(np.int32)
  labels = np.where(rng.random((rows, t)) < 0.15, -100, ids).astype(np.int32)
  if not packed:
    return {"input_ids": ids, "labels": labels}
  seg, pos = np.zeros_like(ids), np.zeros_like(ids)
  for r in range(rows):
    at, k = 0, 1
    while at < t - (r % 2) * max(2, t // 8):
      n = min(int(rng.integers(1, t // 2 + 1)), t - at)
      seg[r, at:at + n], pos[r, at:at + n] = k, np.arange(n)
      at, k = at + n, k + 1
  return {"input_ids": ids, "labels": labels, "segment_ids": seg, "positions": pos}


def _batches(family):
  run = RUNS[family]
  t, packed = run["t"], run.get("packed", False)
  batches = [_batch(run["rows"], t, packed, seed) for seed in (0, 1, 0)]  # the last: trained on
  if packed:  # documents cross the chunk boundaries
    chunk = t // run["mesh"]["context"] // (2 if run.get("balance") else 1)
    seg = batches[0]["segment_ids"]
    at = np.arange(chunk, t, chunk)
    assert (seg[:, at - 1] == seg[:, at]).any(), seg
  if family == "phi3":  # LongRoPE's choice differs between the whole batch and some chunks
    long = lambda pos: pos.max() + 1 > CONFIGS["phi3"]["original_max_position_embeddings"]
    pos = batches[1]["positions"]
    chunks = [c for r in np.split(pos, run["mesh"]["shard"]) for c in np.split(
        r, run["mesh"]["context"], axis=1)]
    assert long(pos) and not all(long(c) for c in chunks)
  return batches


def _mean(loss_fn, dtype=None):
  def mean(p, batch):
    if dtype is not None:  # the mixed-precision reference: compute in dtype
      p = jax.tree.map(lambda x: x.astype(dtype), p)
    out = loss_fn(p, batch)
    return (out.total / out.weight).astype(jnp.float32)
  return mean


def _context_run(b, params, family, batches, optimizer, **config):
  mesh_kw = RUNS[family]["mesh"]
  mesh = fsdp_jax.make_mesh(**mesh_kw, devices=jax.devices()[:int(np.prod(
      list(mesh_kw.values())))])
  if "replicate" in mesh_kw:
    config["sharding_strategy"] = S.HYBRID_SHARD
  if RUNS[family].get("balance"):
    config["context_parallel"] = fsdp_jax.ContextParallel(load_balance=True)
  if RUNS[family].get("checkpoint"):
    config["activation_checkpointing"] = fsdp_jax.ActivationCheckpointing(
        RUNS[family]["checkpoint"])
  config = b.fsdp_config(**config)
  state = fsdp_jax.init_train_state(params=params, optimizer=optimizer, mesh=mesh,
                                    config=config)
  assert state.plan.axes.shard_axes[-1] == "context"
  return train_steps(fsdp_jax.shard_train_step(b.loss_fn), state, batches)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_family_trains_as_one_device(family, tmp_path):
  b, params = _bundle(tmp_path, family)
  batches = _batches(family)
  opt = optax.adamw(LR, eps=EPS)
  ref_losses, ref_params = jit_reference_run(_mean(b.loss_fn), params, opt, batches)
  state, losses = _context_run(b, params, family, batches, opt)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=0)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params, rtol=0, atol=1e-5)
  assert ref_losses[2] < ref_losses[0]


def test_bf16_mixed_precision_trains_as_one_device(tmp_path):
  """gemma2 (soft-capping, sliding layers) with MixedPrecision(param_dtype=
  bf16, reduce_dtype=float32) against one device computing the same loss
  on the parameters cast to bf16. SGD: Adam divides each update by the
  gradient's own size, and bf16 rounds a gradient by about 2^-8 of its
  leaf's scale, 1e-3 here, so Adam would move the updates of small
  gradients by up to the learning rate even between two one-device
  programs (fsdp_jax's mixed-precision step on one device and this
  reference differ by 1.4e-2 after three AdamW steps: XLA rounds bf16
  values at other places in each). Measured: 7e-4 (at lr 0.1, 1.9e-3,
  where a data-parallel run of the rows is 1.3e-3 from the reference and
  the reference 1.6e-3 from float32)."""
  family = "gemma2"
  b, params = _bundle(tmp_path, family)
  batches = _batches(family)
  opt = optax.sgd(0.05)
  ref_losses, ref_params = jit_reference_run(_mean(b.loss_fn, jnp.bfloat16), params, opt,
                                             batches)
  mp = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
  state, losses = _context_run(b, params, family, batches, opt, mixed_precision=mp)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-3, atol=0)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params, rtol=0, atol=2e-3)
  assert ref_losses[2] < ref_losses[0]


@pytest.mark.parametrize("balance", [False, True])
def test_full_shard_keeps_chunks_not_the_gathered_sequence(balance, tmp_path):
  """What a FULL_SHARD step under a context axis keeps for its backward
  pass is this device's chunk: no layer keeps the all-gathered keys and
  values (the whole sequence's, C chunks) nor their blocks. The step
  rematerialises with its own policy, which JAX applies inside the
  attention's checkpoint too (jax-ml/jax#18817); the saved residuals are the
  checkpoints' ``reduce_precision`` equations in the traced step (jax
  inserts one on each), read from the jaxpr without compiling. Before the
  kernel named its output and logsumexp (which that policy saves), the
  backward pass ran the kernel's forward loops again and each layer kept
  their inputs: K and V of the whole sequence in the kernel's blocks
  (``[4, 1, 512, 4, 4]`` here)."""
  t, c = 2048, 4
  d = tmp_path / "llama"
  d.mkdir()
  # MHA (K/V as wide as the hidden state): the whole sequence's K holds
  # more than twice the largest chunk-sized residual (the MLP's [1, 512, 24])
  (d / "config.json").write_text(json.dumps({**CONFIGS["llama"], "model_type": "llama",
                                             "num_key_value_heads": 4,
                                             "max_position_embeddings": t}))
  b = models.from_pretrained(str(d))
  mesh = fsdp_jax.make_mesh(shard=2, context=c, devices=jax.devices())
  extra = {"context_parallel": fsdp_jax.ContextParallel(load_balance=True)} if balance else {}
  config = b.fsdp_config(**extra)
  opt = optax.sgd(0.1)
  state = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      init_fn=b.init_fn, rng=jax.random.key(0), optimizer=opt, mesh=mesh, config=config))
  step = fsdp_jax.shard_train_step(b.loss_fn, opt, mesh=mesh, config=config)
  batch = {k: jax.ShapeDtypeStruct((2, t), jnp.int32) for k in ("input_ids", "labels")}
  saved = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "reduce_precision":
        saved.append(tuple(e.outvars[0].aval.shape))
      for p in e.params.values():
        for j in (p if isinstance(p, (tuple, list)) else (p,)):
          inner = getattr(j, "jaxpr", j)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(step.jitted.trace(state, batch).jaxpr.jaxpr)
  kv = CONFIGS["llama"]["hidden_size"]  # 4 key-value heads x head_dim
  assert saved, "no checkpoint residuals found"
  whole = [s for s in saved if int(np.prod(s)) >= t * kv]
  assert not whole, f"residuals of the whole sequence's size (K: [1, {t}, {kv}]): {whole}"
