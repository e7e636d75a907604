"""Context parallelism (make_mesh(..., context=C)): each sequence split into C
chunks over the "context" axis, the weights sharded over shard x context,
the model single-device code; checked against the unsharded single-device
run of the same model, loss and optimizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import json

import fsdp_jax
from fsdp_jax import hlo, models
from fsdp_jax._src import attention as attention_lib
from helpers import assert_trees_close, jit_reference_run, train_steps

S = fsdp_jax.ShardingStrategy
VOCAB, D, KV, HEADS, SEQ, LAYERS = 11, 16, 4, 2, 16, 2


def _params(seed=0):
  ks = iter(jax.random.split(jax.random.PRNGKey(seed), 4 * LAYERS + 2))
  n = lambda s: jax.random.normal(next(ks), s) * 0.3
  layers = [{"wq": n((D, HEADS * KV)), "wk": n((D, KV)), "wv": n((D, KV)),
             "wo": n((HEADS * KV, D))} for _ in range(LAYERS)]
  return {"emb": n((VOCAB, D)), "layers": layers, "head": n((D, VOCAB))}


def _rope(x, pos):
  """Rotate-half rotary embedding of ``x`` ``[b, t, ..., KV]`` at ``pos`` ``[t]``."""
  half = KV // 2
  ang = pos[:, None].astype(jnp.float32) / (10.0 ** (jnp.arange(half) / half))[None]
  shape = (1, pos.shape[0]) + (1,) * (x.ndim - 3) + (half,)
  c, s = jnp.cos(ang).reshape(shape), jnp.sin(ang).reshape(shape)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def _forward(p, ids, seg=None, window=None):
  """A causal decoder in plain JAX: einsum attention with one key/value head
  (grouped-query), rotary positions from jnp.arange, a causal mask from
  jnp.tril, packed documents (segment ids), a sliding window."""
  b, t = ids.shape
  h = jax.nn.one_hot(ids, VOCAB) @ p["emb"]
  pos = jnp.arange(t)
  mask = jnp.tril(jnp.ones((t, t), bool))[None]
  if window is not None:
    mask = mask & ((pos[:, None] - pos[None, :]) < window)[None]
  if seg is not None:
    mask = mask & (seg[:, :, None] == seg[:, None, :])
  for lp in p["layers"]:
    x = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
    q = _rope((x @ lp["wq"]).reshape(b, t, HEADS, KV), pos)
    k = _rope(x @ lp["wk"], pos)
    v = x @ lp["wv"]
    s = jnp.einsum("bqhd,bkd->bhqk", q, k) / np.sqrt(KV)
    s = jnp.where(mask[:, None], s, -1e9)
    o = jnp.einsum("bhqk,bkd->bqhd", jax.nn.softmax(s, -1), v)
    h = h + o.reshape(b, t, HEADS * KV) @ lp["wo"]
  return h @ p["head"]


def weighted_loss(p, batch):
  """The causal-LM loss: logits[:, :-1] against labels[:, 1:], a masked sum
  over the global token count."""
  logits = _forward(p, batch["ids"], batch.get("seg"), batch.get("window"))[:, :-1]
  labels, w = batch["ids"][:, 1:], batch["w"][:, 1:]
  nll = -jnp.sum(jax.nn.log_softmax(logits, -1) * jax.nn.one_hot(labels, VOCAB), -1)
  return fsdp_jax.WeightedLoss(total=jnp.sum(nll * w), weight=jnp.sum(w))


def mean_loss(p, batch):
  logits = _forward(p, batch["ids"])
  lp = jax.nn.log_softmax(logits, -1)
  return -jnp.mean(jnp.sum(lp * jax.nn.one_hot(batch["ids"], VOCAB), -1))


def _batches(b, seed=0, seg=False, steps=2):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(steps):
    x = {"ids": rng.integers(0, VOCAB, (b, SEQ)).astype(np.int32),
         "w": (rng.random((b, SEQ)) > 0.2).astype(np.float32)}
    if seg:  # documents of 5, 6 and 5 tokens: boundaries inside chunks of 4
      x["seg"] = np.tile(np.repeat(np.arange(3), [5, 6, 5]), (b, 1)).astype(np.int32)
    out.append(x)
  return out


def _ratio(loss_fn):
  def f(p, batch):
    out = loss_fn(p, batch)
    return out.total / out.weight if isinstance(out, fsdp_jax.WeightedLoss) else out
  return f


# One device's runs by key: cases of one loss, parameters and batches on
# other meshes or configs compare against one reference, compiled once.
_REFERENCES = {}


def _run(loss_fn, mesh_kw, batches, strategy=S.FULL_SHARD, params=None, config=None,
         atol=1e-5, eps=1e-8, ref_fn=None, ref_key=None):
  """Adam steps on the mesh equal to one device's (``ref_key``: a reference
  shared between cases of the same loss, parameters, batches and eps).
  Returns the final state and its step."""
  params, opt = _params() if params is None else params, optax.adam(1e-2, eps=eps)
  if ref_key is None or ref_key not in _REFERENCES:
    ref = jit_reference_run(_ratio(ref_fn or loss_fn), params, opt, batches)
    if ref_key is not None:
      _REFERENCES[ref_key] = ref
  ref_losses, ref_params = _REFERENCES[ref_key] if ref_key is not None else ref
  mesh = fsdp_jax.make_mesh(**mesh_kw, devices=jax.devices()[:int(np.prod(
      list(mesh_kw.values())))])
  cfg = config or fsdp_jax.FSDPConfig(sharding_strategy=strategy)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=cfg)
  step = fsdp_jax.shard_train_step(loss_fn)
  state, losses = train_steps(step, state, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params, rtol=1e-5, atol=atol)
  return state, step


def _balanced(strategy=S.FULL_SHARD, **kw):
  """ContextParallel(load_balance=True): device i holds chunks i and 2C-1-i."""
  return fsdp_jax.FSDPConfig(sharding_strategy=strategy, **kw,
                             context_parallel=fsdp_jax.ContextParallel(load_balance=True))


@pytest.mark.parametrize("mesh_kw,strategy,b,balanced", [
    (dict(shard=2, context=4), S.FULL_SHARD, 2, False),
    (dict(replicate=2, shard=2, context=2), S.HYBRID_SHARD, 4, False),
    # head-tail: the halos of labels[:, 1:] / logits[:, :-1] between chunks
    # on other devices and (device C-1's chunks C-1 and C) on the same one
    (dict(shard=2, context=4), S.FULL_SHARD, 2, True),
    # and under tensor parallelism (heads split, sequence parallelism on)
    (dict(shard=2, context=2, tensor=2), S.FULL_SHARD, 2, True),
])
def test_plain_model_matches_one_device(mesh_kw, strategy, b, balanced):
  tp = fsdp_jax.TensorParallel(rules=[("*.wq", "colwise"), ("*.wo", "rowwise")])
  kw = {"tensor_parallel": tp} if "tensor" in mesh_kw else {}
  state, _ = _run(weighted_loss, mesh_kw, _batches(b), strategy,
                  config=_balanced(strategy, **kw) if balanced else None,
                  ref_key=("weighted_loss", b))  # one reference for the cases of b rows
  # The weights are sharded over shard x context.
  assert state.plan.axes.shard_axes[-1] == "context"
  assert state.plan.n == mesh_kw["shard"] * mesh_kw["context"]


def windowed_loss(p, batch):
  """weighted_loss with a sliding window of 3 positions."""
  return weighted_loss(p, dict(batch, window=3))


@pytest.mark.parametrize("balanced", [False, True])
def test_context_8_packed_documents_and_window(balanced):
  """Documents crossing chunk boundaries (segment ids) and a sliding window
  on context=8: chunks of 2 tokens (head-tail balanced: 16 chunks of 1,
  every neighbour another device's or the device's own other chunk). Both
  cases against one reference run. (Folded: the same loss on shard=2 x
  context=2, the shard axis splitting only rows, as in test_plain_mean_loss
  and test_plain_model_matches_one_device; the documents' mask without the
  window, a term of this one. fsdp_jax.attention's window and documents on
  shard=2 x context=2: test_attention_functions.)"""
  _run(windowed_loss, dict(context=8), _batches(1, seed=3, seg=True),
       config=_balanced() if balanced else None, ref_key="context_8")


def blocked_loss(p, batch):
  """fsdp_jax.chunked_cross_entropy (blocks of 3, soft-capped) of the hidden
  state h[:, :-1] against labels[:, 1:]: a sliced sequence, the last
  device's last position padding."""
  h = jnp.tanh(p["emb"][batch["ids"]] @ p["layers"][0]["wq"])[:, :-1]
  labels = jnp.where(batch["w"][:, 1:] > 0, batch["ids"][:, 1:], -100)
  return fsdp_jax.chunked_cross_entropy(h, p["layers"][0]["wo"], labels, block_tokens=3,
                                        soft_cap=2.0)


def test_blocked_loss_of_a_sliced_sequence():
  """The blocked loss on each device's chunk (labels past the sliced
  length ignored), its total and weight summed over the context axis."""
  _run(blocked_loss, dict(context=4), _batches(2, seed=6))  # two rows a device: flattened


def test_plain_mean_loss():
  """A plain mean over every token: the same on equal chunks."""
  _run(mean_loss, dict(shard=2, context=2), [{"ids": b["ids"]} for b in _batches(2)])


def _attention_params():
  ks = jax.random.split(jax.random.PRNGKey(1), 5)
  n = lambda k, s: jax.random.normal(k, s) * 0.3
  return {"emb": n(ks[0], (VOCAB, D)), "wq": n(ks[1], (D, 4 * KV)), "wk": n(ks[2], (D, 2 * KV)),
          "wv": n(ks[3], (D, 2 * KV)), "head": n(ks[4], (4 * KV, VOCAB))}


def _attention_loss(attend):
  """An embedding lookup, grouped-query attention by ``attend``, the next
  token's log-probability by take_along_axis, weighted by a cumulative sum
  along the sequence plus the weight two tokens back (a shift right:
  concatenate a head and w[:, :-2])."""
  def loss_fn(p, batch):
    ids = batch["ids"]
    b, t = ids.shape
    h = p["emb"][ids]
    q = (h @ p["wq"]).reshape(b, t, 4, KV)
    k, v = ((h @ p[w]).reshape(b, t, 2, KV) for w in ("wk", "wv"))
    o = attend(q, k, v, batch).reshape(b, t, 4 * KV)
    lp = jax.nn.log_softmax((o @ p["head"])[:, :-1], -1)
    w = batch["w"]
    back = jnp.concatenate([jnp.full((b, 2), 0.5, w.dtype), w[:, :-2]], 1)
    c = (jnp.cumsum(w, axis=1) + back)[:, :-1]
    return -jnp.mean(jnp.take_along_axis(lp, ids[:, 1:, None], -1)[..., 0] * c)
  return loss_fn


@pytest.mark.parametrize("which,balanced", [("fsdp_jax", False), ("jax.nn", False),
                                           ("fsdp_jax", True)])
def test_attention_functions(which, balanced, monkeypatch):
  """fsdp_jax.attention (packed documents crossing the chunks, a window, a
  soft cap: each device's queries against the gathered keys at their
  global positions) and jax.nn.dot_product_attention (traced as jnp).
  Head-tail balanced: the blockwise kernel (blocks of 2 queries and 4 keys)
  on each of a device's two chunks, the cumulative sum across them."""
  if balanced:
    monkeypatch.setattr(attention_lib, "BLOCK_Q", 2)
    monkeypatch.setattr(attention_lib, "BLOCK_K", 4)
  if which == "fsdp_jax":
    attend = lambda q, k, v, b: fsdp_jax.attention(q, k, v, segment_ids=b["seg"], window=3,
                                                   soft_cap=5.0)
  else:
    attend = lambda q, k, v, b: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                             local_window_size=(3, 0))
  batches = [dict(b, w=np.abs(b["w"] - 0.3)) for b in _batches(2, seed=5, seg=True)]
  loss = _attention_loss(attend)
  state, step = _run(loss, dict(shard=2, context=2), batches, params=_attention_params(),
                      config=_balanced() if balanced else None)
  if which == "fsdp_jax" and not balanced:
    # K and V all-gathered forward and again backward: only this device's
    # chunks are saved for the backward pass, not the gathered sequence.
    # (The trained step's own program: lowered again, compiled once.)
    text = step.lower(state, batches[0]).compile().as_text()
    kv = [c for c in hlo.collectives(text)
          if c.kind == "all-gather" and c.shapes[0][1:] == (SEQ, 2, KV)]
    assert len(kv) == 4, kv


@pytest.mark.parametrize("balanced", [False, True])
def test_llama_family(tmp_path, balanced):
  """fsdp_jax.models' llama (through fsdp_jax.attention, layers scanned),
  packed rows, its default blocked loss (fsdp_jax.chunked_cross_entropy,
  blocks of 3 tokens: not dividing the chunks of 4) on shard=2 x context=4:
  each device's chunk's blocked loss summed over the context axis, equal to
  one device's unblocked training."""
  d = str(tmp_path)
  with open(f"{d}/config.json", "w") as f:
    json.dump({"model_type": "llama", "vocab_size": 40, "hidden_size": 16,
               "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 64}, f)
  b = models.from_pretrained(d, scan=True, loss_block_tokens=3)
  unblocked = models.from_pretrained(d, scan=True, loss_block_tokens=None)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: np.asarray(rng.normal(0.0, 0.2, x.shape), x.dtype),
                        jax.eval_shape(b.init_fn, jax.random.key(0)))
  ids = rng.integers(0, 40, (2, SEQ)).astype(np.int32)
  labels = ids.copy()
  labels[0, 2:5] = -100
  # documents of 8, 3 and 5 tokens: one boundary on the chunks' (8), one inside
  seg = np.tile(np.repeat(np.arange(1, 4), [8, 3, 5]), (2, 1)).astype(np.int32)
  batches = [{"input_ids": ids, "labels": labels, "segment_ids": seg}] * 2
  # Adam's eps above the gradients' float32 rounding (1e-8 turns a ~1e-7
  # gradient's last-bit differences into 1e-3 relative updates).
  cp = fsdp_jax.ContextParallel(load_balance=balanced)  # head-tail: 8 chunks of 2
  _run(b.loss_fn, dict(shard=2, context=4), batches, params=params,
       config=b.fsdp_config(context_parallel=cp), eps=1e-4, ref_fn=unblocked.loss_fn,
       ref_key="llama")  # both cases: one device's unblocked run, compiled once


@pytest.mark.parametrize("balanced", [False, True])
def test_only_keys_and_values_move_over_context(balanced):
  """Over the context groups the compiled step moves, per layer, K and V
  forward (all-gathers of [batch, T, kv_dim]) and their gradients back
  (reduce-scatters of [batch, T/C, kv_dim]); besides those, the labels'
  and weights' one-token halos and the loss's scalar sums. Nothing else
  (no logits, no hidden states). Head-tail balanced: the same, each halo
  from two neighbours, and the batch's leaves (ids, weights) each fetched
  as two half-chunks from the contiguous split."""
  mesh = fsdp_jax.make_mesh(shard=2, context=2, devices=jax.devices()[:4])
  state = fsdp_jax.init_train_state(params=_params(), optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=_balanced() if balanced else fsdp_jax.FSDPConfig())
  text = fsdp_jax.shard_train_step(weighted_loss).lower(state, _batches(2)[0]).compile().as_text()
  context_groups = {(0, 1), (2, 3)}  # context innermost: devices (s, c) = 2 s + c
  moved = [c for c in hlo.collectives(text)
           if c.kind != "collective-permute" and set(c.groups) <= context_groups]
  kinds = sorted((c.kind, c.shapes) for c in moved if c.kind != "all-reduce")
  assert kinds == [("all-gather", ((1, SEQ, KV),))] * (2 * LAYERS) + [
      ("reduce-scatter", ((1, SEQ // 2, KV),))] * (2 * LAYERS), kinds
  assert all(s == () for c in moved if c.kind == "all-reduce" for s in c.shapes)
  halos = [c for c in hlo.collectives(text) if c.kind == "collective-permute"]
  want = [((1, 1),)] * 4 + [((1, SEQ // 4),)] * 4 if balanced else [((1, 1),)] * 2
  assert sorted(c.shapes for c in halos) == want, halos


def test_errors():
  mesh = fsdp_jax.make_mesh(shard=2, context=2, devices=jax.devices()[:4])
  state = fsdp_jax.init_train_state(params=_params(), optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig())
  step = fsdp_jax.shard_train_step(weighted_loss)
  b = _batches(2)[0]
  with pytest.raises(ValueError, match=r"\['ids'\] has shape \(2, 15\).*not divisible by "
                     r"the context axis size 2.*16"):
    step(state, {"ids": b["ids"][:, :15], "w": b["w"][:, :15]})
  with pytest.raises(ValueError, match=r"(?s)different sequence lengths.*\['w'\]: shape \(2, 8\)"):
    step(state, {"ids": b["ids"], "w": b["w"][:, :8]})

  def flipped(p, batch):  # reverses the sequence: refused, named
    return jnp.mean(jnp.flip(_forward(p, batch["ids"]), axis=1) ** 2)

  with pytest.raises(ValueError, match=r"(?s)cannot compute rev.*mixes positions.*"
                     r"Fix:"):
    fsdp_jax.shard_train_step(flipped)(state, b)

  def per_token(p, batch):
    return jnp.mean(_forward(p, batch["ids"])), _forward(p, batch["ids"])

  with pytest.raises(ValueError, match="split along the sequence"):
    fsdp_jax.shard_train_step(per_token)(state, b)


def test_config_and_mesh():
  assert dict(fsdp_jax.make_mesh(context=8).shape) == {"shard": 1, "context": 8}
  assert tuple(fsdp_jax.make_mesh(replicate=2, shard=2, context=2).axis_names) == (
      "replicate", "shard", "context")
  mesh = fsdp_jax.make_mesh(shard=2, context=2, tensor=2)
  assert tuple(mesh.axis_names) == ("shard", "context", "tensor")
  cp = fsdp_jax.ContextParallel(leaves=["ids"])
  assert cp == fsdp_jax.ContextParallel(leaves=("ids",)) and hash(cp) == hash(
      fsdp_jax.ContextParallel(leaves="ids"))
  assert fsdp_jax.FSDPConfig(context_parallel=cp) == fsdp_jax.FSDPConfig(
      context_parallel=fsdp_jax.ContextParallel(leaves=("ids",)))
  with pytest.raises(ValueError, match="strategy='ring'.*all_gather"):
    fsdp_jax.ContextParallel(strategy="ring")
  with pytest.raises(TypeError, match="load_balance='yes'"):
    fsdp_jax.ContextParallel(load_balance="yes")
  # With tensor parallelism: weights over shard x context, slices over
  # tensor (test_context_tensor.py trains it as one device).
  tp = fsdp_jax.TensorParallel(rules=[("*.wq", "colwise")])
  axes = fsdp_jax.init_train_state(params=_params(), optimizer=optax.sgd(0.1), mesh=mesh,
                                   config=fsdp_jax.FSDPConfig(tensor_parallel=tp)).plan.axes
  assert (axes.shard_axes, axes.tensor_axes, axes.context_size) == (
      ("shard", "context"), ("tensor",), 2)
  plan = fsdp_jax.init_train_state(
      params=_params(), optimizer=optax.sgd(0.1), config=fsdp_jax.FSDPConfig(context_parallel=cp),
      mesh=fsdp_jax.make_mesh(shard=2, context=2, devices=jax.devices()[:4])).plan
  specs = fsdp_jax.custom.batch_specs(plan, {"ids": np.zeros((2, 8)), "pos": np.zeros((2, 8))})
  assert specs == {"ids": jax.P("shard", "context"), "pos": jax.P("shard")}  # leaves=["ids"]
  with pytest.raises(ValueError, match="make_mesh\\(..., context=C\\)"):
    fsdp_jax.init_train_state(params=_params(), optimizer=optax.sgd(0.1),
                              mesh=fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2]),
                              config=fsdp_jax.FSDPConfig(context_parallel=cp))


def test_eval_step():
  """shard_eval_step on a context axis: a weighted mean and per-example
  outputs, as one device computes them; head-tail balanced too (the batch
  passed in its natural order, permuted by the step: the weighted mean;
  the per-example outputs' reduction over the sequence is the mean's),
  where a sequence length 2C does not divide is refused, naming the fix."""
  mesh = fsdp_jax.make_mesh(shard=2, context=2, devices=jax.devices()[:4])
  params = _params()
  b = _batches(2)[0]
  per_example = lambda p, x: jnp.mean(_forward(p, x["ids"]) ** 2, axis=(1, 2))
  both = ((weighted_loss, "mean"), (per_example, "batch"))
  for config, cases in ((fsdp_jax.FSDPConfig(), both), (_balanced(), both[:1])):
    state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                      config=config)
    for fn, outputs in cases:
      got = fsdp_jax.shard_eval_step(fn, outputs=outputs)(state, b)
      want = _ratio(fn)(params, b)
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match=r"\['ids'\] has shape \(2, 14\).*not divisible by 2 x "
                     r"the context axis size 2 \(ContextParallel\(load_balance=True\).*4 chunks"
                     r".*multiple of 4, e.g. 16.*or use load_balance=False"):
    fsdp_jax.shard_eval_step(weighted_loss)(state, {"ids": b["ids"][:, :14],
                                                    "w": b["w"][:, :14]})


def test_checkpoint_restores_onto_another_context_size(tmp_path):
  """Checkpoints are stored unit by unit: one saved on shard=2 x context=2
  restores onto shard=4 (no context axis) and onto context=4."""
  params = {"a": {"w": jnp.arange(35.0).reshape(7, 5)}, "b": {"w": jnp.ones((5, 3))}}
  opt = optax.adam(1e-2)
  build = lambda **kw: fsdp_jax.init_train_state(
      params=params, optimizer=opt, config=fsdp_jax.FSDPConfig(),
      mesh=fsdp_jax.make_mesh(**kw, devices=jax.devices()[:int(np.prod(list(kw.values())))]))
  with fsdp_jax.CheckpointManager(str(tmp_path)) as mngr:
    mngr.save(build(shard=2, context=2))
  for kw in (dict(shard=4), dict(shard=1, context=4)):
    with fsdp_jax.CheckpointManager(str(tmp_path), read_only=True) as mngr:
      state = mngr.restore(jax.eval_shape(lambda: build(**kw)))  # pylint: disable=cell-var-from-loop
    assert state.plan.axes.context_size == kw.get("context", 1)
    assert_trees_close(fsdp_jax.summon_full_params(state), params, rtol=0, atol=0)


def test_composes_with_accumulation_clipping_and_lora():
  """Gradient accumulation (2 microbatches) with clipping, as one device's
  clipped full-batch step; LoRA, as the same LoRA run without a context axis."""
  params, batches = _params(), _batches(4)
  opt = optax.adam(1e-2)
  ref = optax.chain(optax.clip_by_global_norm(0.5), opt)
  ref_losses, ref_params = jit_reference_run(_ratio(weighted_loss), params, ref, batches)
  mesh = lambda **kw: fsdp_jax.make_mesh(**kw, devices=jax.devices()[:4])
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh(shard=2, context=2),
                                    config=fsdp_jax.FSDPConfig())
  step = fsdp_jax.shard_train_step(weighted_loss, max_norm=0.5, gradient_accumulation_steps=2)
  state, losses = train_steps(step, state, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params, rtol=1e-5, atol=1e-5)
  config = fsdp_jax.FSDPConfig(lora=fsdp_jax.LoRA(rank=2, targets=["layers.*.wq",
                                                                   "layers.*.wv"]))
  runs = []
  for kw in (dict(shard=2, context=2), dict(shard=4)):
    state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh(**kw),
                                      config=config)
    runs.append(train_steps(fsdp_jax.shard_train_step(weighted_loss), state, batches)[1])
  np.testing.assert_allclose(runs[0], runs[1], rtol=1e-5)
  assert runs[0][1] < runs[0][0]


def test_rng_and_custom_specs():
  """The key a loss draws from is the same across a context group (the
  dropout mask of the whole sequence, each device using its chunk): a step
  on shard=2 x context=2 equals one on shard=2. A hand-written step gets
  per-leaf specs from batch_specs (with load_balance too: its gradients
  one device's); batch_spec refuses, naming it."""
  def dropout_loss(p, batch, rng):
    logits = _forward(p, batch["ids"])
    keep = jax.random.bernoulli(rng, 0.7, logits.shape)
    return jnp.mean(jnp.where(keep, logits, 0.0) ** 2)

  losses = []
  for kw in (dict(shard=2, context=2), dict(shard=2)):
    mesh = fsdp_jax.make_mesh(**kw, devices=jax.devices()[:int(np.prod(list(kw.values())))])
    state = fsdp_jax.init_train_state(params=_params(), optimizer=optax.adam(1e-2), mesh=mesh,
                                      config=fsdp_jax.FSDPConfig(), rng=jax.random.key(3))
    losses.append(train_steps(fsdp_jax.shard_train_step(dropout_loss), state,
                              [{"ids": b["ids"]} for b in _batches(2)])[1])
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
  plan = fsdp_jax.init_train_state(
      params=_params(), optimizer=optax.sgd(0.1), config=fsdp_jax.FSDPConfig(),
      mesh=fsdp_jax.make_mesh(shard=2, context=2, devices=jax.devices()[:4])).plan
  with pytest.raises(ValueError, match="batch_specs"):
    fsdp_jax.custom.batch_spec(plan)
  specs = fsdp_jax.custom.batch_specs(plan, {"ids": np.zeros((2, 8)), "n": np.zeros(2)})
  assert specs == {"ids": jax.P("shard", "context"), "n": jax.P("shard")}
  # A shard_map of its own over batch_specs (fsdp_jax.custom.sharded_grads)
  # with load_balance: each device fetches its head-tail chunks from the
  # contiguous split, the gradients one device's.
  mesh = fsdp_jax.make_mesh(shard=2, context=2, devices=jax.devices()[:4])
  state = fsdp_jax.init_train_state(params=_params(), optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=_balanced())
  b = _batches(2)[0]
  grads = fsdp_jax.custom.sharded_grads(weighted_loss, state, b)
  _, full = fsdp_jax.summon_full_params(state, with_grads=True, grads=grads)
  ref = jax.jit(jax.grad(_ratio(weighted_loss)))(_params(), b)
  assert_trees_close(full, ref, rtol=1e-5, atol=1e-6)


def test_ops_along_other_dimensions():
  """argmax, sort and cummax over the vocabulary and a per-token matmul of
  a sliced sequence run on the chunk (an accuracy as aux); a reverse
  cumulative sum along the sequence and attention over a sliced sequence
  are refused."""
  def loss(p, b):
    logits = _forward(p, b["ids"])
    acc = jnp.mean(jnp.argmax(logits, -1) == b["ids"])
    top = jnp.sort(logits, axis=-1)[..., -1]
    per_token = logits[:, 1:] @ p["head"].T  # a matmul on a sliced sequence
    return jnp.mean(logits ** 2) + 0.1 * jnp.mean(top) + jnp.mean(
        jax.lax.cummax(logits, axis=2)) + jnp.mean(per_token ** 2), acc

  params, b = _params(), {"ids": _batches(2)[0]["ids"]}
  mesh = fsdp_jax.make_mesh(shard=2, context=2, devices=jax.devices()[:4])
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig())
  _, metrics = fsdp_jax.shard_train_step(loss)(state, b)
  want = loss(params, b)
  np.testing.assert_allclose([float(metrics["loss"]), float(metrics["aux"])],
                             [float(want[0]), float(want[1])], rtol=1e-5)
  rev = lambda p, b: jnp.mean(jax.lax.cumsum(_forward(p, b["ids"]), axis=1, reverse=True))
  with pytest.raises(ValueError, match="reverse cumulative sum along the split sequence"):
    fsdp_jax.shard_train_step(rev)(state, b)
  sliced = lambda p, b: jnp.mean(jnp.einsum("bqv,bkv->bqk", *[_forward(p, b["ids"])[:, 1:]] * 2))
  with pytest.raises(ValueError, match="dot_general.*a matmul gathering a sliced sequence"):
    fsdp_jax.shard_train_step(sliced)(state, b)
