"""Packed rows in the model families (no torch: runs on Python 3.13 too).

A batch of rows each holding several documents (``segment_ids``: 0 for
padding, 1, 2, ... per document; ``positions``: each token's position in
its document) gives the loss and the gradients of each document run alone,
summed by tokens, to float32 rounding: attention stays within a document
(sliding windows, soft-capping and mixed sliding/full layers in a scan
included), rotary and learned positions restart per document, and no target
is taken across a boundary. The same under ``shard_train_step`` on a mesh
that divides nothing. transformers' logits per document are checked in
tests/test_families.py.
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
from helpers import FAMILY_VOCAB, family_configs, jit_reference_run

V = FAMILY_VOCAB
# small windows (3 slots) that documents of 4-8 tokens reach past
CONFIGS = family_configs(phi3_positions=32, gpt2_positions=16)
SCAN = {"mistral", "gemma3_text"}  # stacked layers: a static and a per-layer window in the scan

# Two rows of 12: two documents of 4 then 4 of padding; three of 4 (one
# length: the documents alone are one batch, one program).
DOCS = [[4, 4], [4, 4, 4]]
T = 12


def _bundle(tmp_path, family):
  d = tmp_path / family
  d.mkdir()
  (d / "config.json").write_text(json.dumps({"model_type": family, **CONFIGS[family]}))
  b = models.from_pretrained(str(d), scan=family in SCAN)
  rng = np.random.default_rng(0)  # every leaf random (norms off their init)
  params = jax.tree.map(lambda x: np.asarray(rng.normal(0.0, 0.3, x.shape), x.dtype),
                        jax.eval_shape(b.init_fn, jax.random.key(0)))
  return b, params


def _packed(seed=0):
  """The packed batch and each document's tokens."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, V, (len(DOCS), T)).astype(np.int32)
  seg = np.zeros_like(ids)
  pos = np.zeros_like(ids)
  docs = []
  for r, lengths in enumerate(DOCS):
    at = 0
    for k, n in enumerate(lengths):
      seg[r, at:at + n] = k + 1
      pos[r, at:at + n] = np.arange(n)
      docs.append(ids[r, at:at + n])
      at += n
  batch = {"input_ids": ids, "labels": ids, "segment_ids": seg, "positions": pos}
  return batch, docs


@pytest.mark.parametrize("family", list(CONFIGS))
def test_packed_rows_give_each_documents_loss_and_gradients(family, tmp_path):
  b, params = _bundle(tmp_path, family)
  batch, docs = _packed()
  grad = jax.jit(jax.value_and_grad(lambda p, batch: (lambda l: (l.total, l.weight))(
      b.loss_fn(p, batch)), has_aux=True))
  (loss, weight), grads = grad(params, batch)
  assert float(weight) == sum(len(d) - 1 for d in docs)  # one target fewer per document
  alone = np.stack(docs)
  (ref_loss, ref_weight), ref_grads = grad(params, {"input_ids": alone, "labels": alone})
  assert float(ref_weight) == float(weight)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6, atol=1e-5)
  for a, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family, mesh_kw", [("llama", dict(shard=3)),
                                              ("mistral", dict(shard=3, tensor=2))])
def test_packed_loss_under_the_sharded_step_matches_one_device(tmp_path, family, mesh_kw):
  """FSDP over 3 devices (6 rows of 12, 2 per device), alone and with
  tensor parallelism over 2 (a sliding window: attention on each device's
  heads), three SGD steps: the packed losses of one unsharded jax.jit;
  shard_eval_step's loss of the untrained state is the first of them."""
  b, params = _bundle(tmp_path, family)
  batch, _ = _packed()
  batch = {k: np.concatenate([v, v[::-1], np.roll(v, 4, axis=1)]) for k, v in batch.items()}
  batches = [batch] * 3
  opt = optax.sgd(0.5)
  mean = lambda p, batch: (lambda l: l.total / l.weight)(b.loss_fn(p, batch))
  ref_losses, _ = jit_reference_run(mean, params, opt, batches)
  n = mesh_kw["shard"] * mesh_kw.get("tensor", 1)
  mesh = fsdp_jax.make_mesh(**mesh_kw, devices=jax.devices()[:n])
  config = b.fsdp_config(tensor_parallel="tensor" in mesh_kw)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(b.loss_fn, opt, mesh=mesh, config=config)
  evaluated = float(fsdp_jax.shard_eval_step(b.loss_fn)(state, batch))
  np.testing.assert_allclose(evaluated, ref_losses[0], rtol=0, atol=1e-5)
  losses = []
  for one in batches:
    state, metrics = step(state, one)
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
  assert ref_losses[2] < ref_losses[0] - 0.05
  unpacked = float(mean(params, {"input_ids": batch["input_ids"]}))
  assert abs(unpacked - ref_losses[0]) > 1e-3  # the packing changed the loss


def test_packed_inputs_of_another_shape_name_both_shapes(tmp_path):
  b, params = _bundle(tmp_path, "llama")
  batch, _ = _packed()
  with pytest.raises(ValueError, match=r"segment_ids has shape \[2, 11\].*input_ids has \[2, 12\]"):
    b.loss_fn(params, dict(batch, segment_ids=batch["segment_ids"][:, :-1]))
  with pytest.raises(ValueError, match=r"positions has shape \[12\].*input_ids has \[2, 12\]"):
    b.apply(params, batch["input_ids"], positions=np.arange(T))
