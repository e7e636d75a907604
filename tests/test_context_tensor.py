"""Context parallelism with tensor parallelism (make_mesh(shard=2, context=2,
tensor=2)): heads and MLP widths split over "tensor", each sequence over
"context", the weights sharded over shard x context; the model
single-device code. Checked against one unsharded device's AdamW steps."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax import hlo, models
from helpers import assert_trees_close, jit_reference_run, train_steps
import test_context_parallel as plain_model

MESH = dict(shard=2, context=2, tensor=2)
# devices (s, c, t) = 4 s + 2 c + t: context innermost before tensor
CONTEXT_GROUPS = {(0, 2), (1, 3), (4, 6), (5, 7)}
TENSOR_GROUPS = {(0, 1), (2, 3), (4, 5), (6, 7)}


def _megatron(rules):
  """TensorParallel(rules) with Megatron's collectives alone: sequence
  parallelism, where TensorParallel has it, off (its reduce-scatters and
  gathers along the sequence are another test's)."""
  names = {f.name for f in dataclasses.fields(fsdp_jax.TensorParallel)}
  return fsdp_jax.TensorParallel(
      rules=rules, **({"sequence_parallel": False} if "sequence_parallel" in names else {}))


def _train(loss_fn, params, batches, config, ref_fn=None, eps=1e-8):
  """Three AdamW steps on MESH and on one device: the losses and parameters
  equal (fp32, 1e-5); returns the state, its step and the one device's
  final parameters."""
  opt = optax.adamw(1e-2, eps=eps, weight_decay=0.1)
  ratio = plain_model._ratio(ref_fn or loss_fn)
  ref_losses, ref_params = jit_reference_run(ratio, params, opt, batches)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, config=config,
                                    mesh=fsdp_jax.make_mesh(**MESH))
  assert state.plan.axes.shard_axes == ("shard", "context")
  assert state.plan.axes.tensor_axes == ("tensor",)
  step = fsdp_jax.shard_train_step(loss_fn)
  state, losses = train_steps(step, state, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params, rtol=1e-5, atol=1e-5)
  return state, step, ref_params


def test_plain_model_collectives_and_eval():
  """The plain-JAX decoder of test_context_parallel (einsum attention, one
  key/value head, rotary from jnp.arange, jnp.tril mask, labels[:, 1:]):
  queries column-parallel (heads split), the output row-parallel. Three
  AdamW steps equal one device's. Over "context" the compiled step moves K
  and V alone (all-gathers of [1, T, kv], their gradients reduce-scattered)
  besides the scalar sums and the one-token halos; over "tensor" only
  Megatron's all-reduces (the row-parallel output forward; the input's and
  the replicated K/V chunks' cotangents backward), no all-gather. shard_eval_step
  gives one device's loss."""
  config = fsdp_jax.FSDPConfig(
      tensor_parallel=_megatron([("*.wq", "colwise"), ("*.wo", "rowwise")]))
  batches = plain_model._batches(2, steps=3)
  state, step, ref_params = _train(plain_model.weighted_loss, plain_model._params(), batches,
                                   config)
  assert not state.plan.tensor_report.gathered, state.plan.tensor_report.gathered
  seq, kv, d, layers = plain_model.SEQ, plain_model.KV, plain_model.D, plain_model.LAYERS
  moved = hlo.collectives(step.lower(state, batches[0]).compile().as_text())
  over = lambda groups: [c for c in moved if c.groups and set(c.groups) <= groups]
  kinds = sorted((c.kind, c.shapes) for c in over(CONTEXT_GROUPS) if c.kind != "all-reduce")
  assert kinds == [("all-gather", ((1, seq, kv),))] * (2 * layers) + [
      ("reduce-scatter", ((1, seq // 2, kv),))] * (2 * layers), kinds
  assert all(s == () for c in over(CONTEXT_GROUPS) for s in c.shapes
             if c.kind == "all-reduce")
  halos = [c.shapes for c in moved if c.kind == "collective-permute"]
  assert sorted(halos) == [((1, 1),)] * 2, halos
  tensor = over(TENSOR_GROUPS)
  assert {c.kind for c in tensor} == {"all-reduce"}, tensor
  # The replicated K/V's cotangents all-reduced on this device's chunk,
  # before the context all-gather's transpose, not on the gathered [1, seq, kv].
  assert sorted(c.shapes for c in tensor) == [((1, seq // 2, d),)] * layers + [
      ((1, seq // 2, d), (1, seq // 2, kv), (1, seq // 2, kv))] * layers, tensor
  # Evaluation: the same loss over both axes, no backward.
  b = batches[0]
  got = fsdp_jax.shard_eval_step(plain_model.weighted_loss, outputs="mean")(state, b)
  want = plain_model._ratio(plain_model.weighted_loss)(ref_params, b)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_llama_family(tmp_path, kv_heads):
  """fsdp_jax.models' llama with its tensor-parallel rules (heads, MLP
  width and vocabulary split), layers scanned, packed rows (a document
  boundary on the chunks' and one inside), its blocked loss (blocks of 3
  tokens) against one device's unblocked loss. Two key/value heads split
  as whole groups (the attention of each device's heads on its chunk, K/V
  gathered over "context" alone); one (fewer than the tensor size): the
  heads gathered over "tensor" for attention, still exact."""
  d = str(tmp_path)
  with open(f"{d}/config.json", "w") as f:
    json.dump({"model_type": "llama", "vocab_size": 40, "hidden_size": 16,
               "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": kv_heads, "max_position_embeddings": 64}, f)
  b = models.from_pretrained(d, scan=True, loss_block_tokens=3)
  unblocked = models.from_pretrained(d, scan=True, loss_block_tokens=None)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: np.asarray(rng.normal(0.0, 0.2, x.shape), x.dtype),
                        jax.eval_shape(b.init_fn, jax.random.key(0)))
  seq = plain_model.SEQ
  ids = rng.integers(0, 40, (2, seq)).astype(np.int32)
  labels = ids.copy()
  labels[0, 2:5] = -100
  seg = np.tile(np.repeat(np.arange(1, 4), [8, 3, 5]), (2, 1)).astype(np.int32)
  batches = [{"input_ids": ids, "labels": labels, "segment_ids": seg}] * 3
  state, step, _ = _train(b.loss_fn, params, batches, b.fsdp_config(tensor_parallel=True),
                          ref_fn=unblocked.loss_fn, eps=1e-4)
  assert any(l.tensor_dim is not None for l in state.plan.leaves if "k_proj" in l.name)
  attention = [w for w in state.plan.tensor_report.gathered if "attention" in w]
  assert bool(attention) == (kv_heads == 1), state.plan.tensor_report.gathered
  if kv_heads == 2:
    # Over "context": each device's key/value head, gathered along the
    # sequence (and the key side's segment ids), its gradient scattered
    # back; over "tensor": no head gathered. Layers scanned: the forward
    # scan's body gathers K and V, the backward's again (only the chunks
    # are saved), and scatters their gradients.
    moved = hlo.collectives(step.lower(state, batches[0]).compile().as_text())
    over = lambda groups: [c for c in moved if c.groups and set(c.groups) <= groups]
    kinds = sorted((c.kind, c.shapes) for c in over(CONTEXT_GROUPS) if c.kind != "all-reduce")
    assert kinds == [("all-gather", ((1, seq),))] + [("all-gather", ((1, seq, 1, 4),))] * 4 + [
        ("reduce-scatter", ((1, seq // 2, 1, 4),))] * 2, kinds
    assert not [c for c in over(TENSOR_GROUPS) if c.kind == "all-gather"
                and any(len(s) == 4 for s in c.shapes)]
