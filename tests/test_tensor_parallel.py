"""Tensor parallelism composed with FSDP (FSDPConfig(tensor_parallel=...) on
make_mesh(shard=S, tensor=T)) against the unsharded single-device run of
the same model, loss and optimizer."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fsdp_jax
from fsdp_jax import hlo, pretrained
from helpers import assert_trees_close, jit_reference_run, plain, train_steps

S = fsdp_jax.ShardingStrategy

# --------------------------------------------------------------------------
# A small Llama-style model in plain JAX: attention with heads split over
# the tensor axis, a gated MLP, RMSNorms, an embedding and an untied head.

VOCAB, D, HEADS, HEAD_DIM, FF, LAYERS, SEQ = 40, 16, 8, 2, 24, 2, 6

RULES = [("*.wq", "colwise"), ("*.wk", "colwise"), ("*.wv", "colwise"), ("*.wo", "rowwise"),
         ("*.gate", "colwise"), ("*.up", "colwise"), ("*.down", "rowwise"),
         ("head", "colwise"), ("embed.embedding", (None, "tensor"))]


def model_params(seed=0, ff=FF, heads=HEADS, layers=LAYERS):
  keys = iter(jax.random.split(jax.random.key(seed), 64))
  w = lambda *shape: jax.random.normal(next(keys), shape) * (0.5 / np.sqrt(shape[0]))
  layer = lambda: {
      "attn_norm": jnp.ones((D,)) + 0.1 * jax.random.normal(next(keys), (D,)),
      "wq": {"kernel": w(D, heads * HEAD_DIM)}, "wk": {"kernel": w(D, heads * HEAD_DIM)},
      "wv": {"kernel": w(D, heads * HEAD_DIM)}, "wo": {"kernel": w(heads * HEAD_DIM, D)},
      "mlp_norm": jnp.ones((D,)),
      "gate": {"kernel": w(D, ff)}, "up": {"kernel": w(D, ff), "bias": w(1, ff)[0]},
      "down": {"kernel": w(ff, D), "bias": w(1, D)[0]},
  }
  return {"embed": {"embedding": w(VOCAB, D) * 4}, "layers": [layer() for _ in range(layers)],
          "norm": jnp.ones((D,)), "head": {"kernel": w(D, VOCAB), "bias": w(1, VOCAB)[0]}}


def rms(x, g):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def block(x, p, position=None):
  """``position``: applied to the queries and keys (rotary embeddings)."""
  b, t, _ = x.shape
  h = rms(x, p["attn_norm"])
  split = lambda y: y.reshape(b, t, -1, HEAD_DIM)
  q, k, v = (split(h @ p[n]["kernel"]) for n in ("wq", "wk", "wv"))
  if position is not None:
    q, k = position(q), position(k)
  s = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(HEAD_DIM)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
  a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(b, t, -1)
  x = x + a @ p["wo"]["kernel"]
  h = rms(x, p["mlp_norm"])
  m = jax.nn.silu(h @ p["gate"]["kernel"]) * (h @ p["up"]["kernel"] + p["up"]["bias"])
  return x + m @ p["down"]["kernel"] + p["down"]["bias"]


def logits_fn(params, tokens):
  x = params["embed"]["embedding"][tokens]
  for p in params["layers"]:
    x = block(x, p)
  return rms(x, params["norm"]) @ params["head"]["kernel"] + params["head"]["bias"]


def loss_fn(params, batch):
  logp = jax.nn.log_softmax(logits_fn(params, batch["tokens"]))
  return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))


def batches(n=2, size=12, seed=1):
  out = []
  for i in range(n):
    k = jax.random.split(jax.random.key(seed + i))
    out.append({"tokens": jax.random.randint(k[0], (size, SEQ), 0, VOCAB),
                "labels": jax.random.randint(k[1], (size, SEQ), 0, VOCAB)})
  return out


def run(params, loss, config, mesh, optimizer, data, **step_kw):
  state = fsdp_jax.init_train_state(params=params, optimizer=optimizer, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(loss, optimizer, mesh=mesh, config=config, **step_kw)
  state, losses = train_steps(step, state, data)
  return state, losses, step


def mesh(shard, tensor, replicate=None):
  n = shard * tensor * (replicate or 1)
  return fsdp_jax.make_mesh(shard=shard, tensor=tensor, replicate=replicate,
                            devices=jax.devices()[:n])


def tp_config(**kw):
  return fsdp_jax.FSDPConfig(tensor_parallel=fsdp_jax.TensorParallel(rules=RULES), **kw)


def assert_close_relative(actual, expected, rel):
  """Each leaf within ``rel`` of the reference, relative to the leaf's
  largest magnitude (Adam's update of a near-zero gradient element moves it
  by ~lr whatever its sign, so elementwise relative error is not the
  measure)."""
  actual, expected = plain(actual), plain(expected)
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for (path, a), e in zip(jax.tree_util.tree_flatten_with_path(actual)[0],
                          jax.tree.leaves(expected)):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    assert a.shape == e.shape, (jax.tree_util.keystr(path), a.shape, e.shape)
    err = np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-12)
    assert err <= rel, (jax.tree_util.keystr(path), err)


_REFERENCES = {}


def reference(key, loss, params, optimizer, data):
  """jit_reference_run, once per ``key`` in this module: the cases that train
  the same model, loss, optimizer and data share one single-device run."""
  if key is None or key not in _REFERENCES:
    result = jit_reference_run(loss, params, optimizer, data)
    if key is None:
      return result
    _REFERENCES[key] = result
  return _REFERENCES[key]


def check(params, loss, config, m, data=None, optimizer=None, rtol=1e-4, loss_tol=1e-5,
          ref_key=None):
  """``ref_key``: names the reference run (model, loss, optimizer, data) for
  the cases that share it."""
  data = batches() if data is None else data
  optimizer = optax.adamw(3e-2) if optimizer is None else optimizer
  ref_losses, ref_params = reference(ref_key, loss, params, optimizer, data)
  state, losses, step = run(params, loss, config, m, optimizer, data)
  np.testing.assert_allclose(losses, ref_losses, rtol=loss_tol, atol=loss_tol)
  assert_close_relative(fsdp_jax.summon_full_params(state), ref_params, rtol)
  return state, step


# --------------------------------------------------------------------------
# Against one device


# Every mesh shape, both layouts, the non-dividing 3 x 2 mesh in both (the
# other shapes each in one layout: 4 x 2 flat runs in most tests below,
# HYBRID with use_orig_params in test_whole_tensor_optimizers, and 2 x 4
# with use_orig_params against one device in the vocabulary-parallel,
# rotary and Muon tests).
@pytest.mark.parametrize("shard,tensor,replicate,orig", [
    (4, 2, None, True), (2, 2, 2, False), (3, 2, None, False), (3, 2, None, True),
    (1, 8, None, True)])
def test_matches_single_device(shard, tensor, replicate, orig):
  strategy = S.HYBRID_SHARD if replicate else S.FULL_SHARD
  cfg = tp_config(sharding_strategy=strategy, use_orig_params=orig)
  state, step = check(model_params(), loss_fn, cfg, mesh(shard, tensor, replicate),
                      ref_key="adamw")
  # Each device stores 1/(S*T) of every split leaf.
  for leaf, x in zip(state.plan.leaves, jax.tree.leaves(state.params) if orig else []):
    if leaf.tensor_dim is not None:
      assert x.addressable_shards[0].data.size * shard * tensor >= leaf.numel


@pytest.mark.parametrize("strategy", [S.SHARD_GRAD_OP, S.NO_SHARD, S._HYBRID_SHARD_ZERO2])
def test_every_strategy(strategy):
  replicate = 2 if strategy is S._HYBRID_SHARD_ZERO2 else None
  shard = 2 if replicate else 4
  check(model_params(), loss_fn, tp_config(sharding_strategy=strategy),
        mesh(shard, 2, replicate), ref_key="adamw")


@pytest.mark.parametrize("orig", [False, True])
def test_mixed_precision_bf16(orig):
  """bf16 compute with fp32 masters and reductions: the losses of FSDP alone
  with the same MixedPrecision, and parameters within 1e-3 of its (a
  quarter of bf16's half-ulp: the row-parallel partial sums are added in
  float32 and rounded once, but the compiler fuses and rounds the two
  programs' bf16 operations differently; measured 1.8e-4 on jax 0.12, 0 on
  0.10, with two layers), both within bf16 rounding of a single-device run
  that casts the parameters to bf16 in the loss. One layer: its column- and
  row-parallel matmuls are the casts and reductions a second layer
  repeats."""
  mp = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
  params, data, opt = model_params(layers=1), batches(2), optax.sgd(0.3)

  def bf16_loss(p, b):
    return loss_fn(jax.tree.map(lambda x: x.astype(jnp.bfloat16), p), b).astype(jnp.float32)

  fsdp = fsdp_jax.FSDPConfig(mixed_precision=mp, use_orig_params=orig)
  ref_state, ref_losses, _ = run(params, loss_fn, fsdp,
                                 fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4]), opt, data)
  state, losses, _ = run(params, loss_fn, tp_config(mixed_precision=mp, use_orig_params=orig),
                         mesh(4, 2), opt, data)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
  assert_close_relative(fsdp_jax.summon_full_params(state),
                        fsdp_jax.summon_full_params(ref_state), 1e-3)
  one_losses, _ = reference("bf16 sgd", bf16_loss, params, opt, data)
  np.testing.assert_allclose(losses, one_losses, rtol=2e-4, atol=2e-4)


def _wrapped_compiled(t):
  """(state, compiled step's HLO text) of the model wrapped per layer, with
  tensor parallelism on 4 x 2 (t=2) or FSDP alone on 4 devices (t=1)."""
  opt = optax.sgd(0.1)
  kw = dict(use_orig_params=True, auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["layers.*"]))
  cfg = tp_config(**kw) if t > 1 else fsdp_jax.FSDPConfig(**kw)
  m = mesh(4, 2) if t > 1 else fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
  state = fsdp_jax.init_train_state(params=model_params(), optimizer=opt, mesh=m, config=cfg)
  step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=m, config=cfg)
  return state, step.lower(state, batches(1)[0]).compile().as_text()


@pytest.fixture(scope="module")
def wrapped_tp():
  """One compile of the per-layer-wrapped tensor-parallel step, read by the
  tests of its stored slices, collectives and plan."""
  return _wrapped_compiled(2)


def test_split_leaves_stored_and_gathered_as_slices(wrapped_tp):
  """Stored 1/(S*T) per device; the FSDP all-gathers over 'shard' move 1/T
  of FSDP alone's bytes for the split leaves; Megatron's all-reduces run
  over 'tensor' (one forward per row-parallel matmul)."""
  results = {1: _wrapped_compiled(1), 2: wrapped_tp}
  state2, text2 = results[2]
  for leaf, x in zip(state2.plan.leaves, jax.tree.leaves(state2.params)):
    local = x.addressable_shards[0].data.size
    if leaf.tensor_dim is not None:
      assert local * 8 == x.size and x.size == leaf.numel, (leaf.name, x.shape)
  shard_group = {1: (0, 1, 2, 3), 2: (0, 2, 4, 6)}
  gathered = {t: sum(c.bytes for c in hlo.collectives(text)
                     if c.kind == "all-gather" and c.groups[0] == shard_group[t])
              for t, (_, text) in results.items()}
  # The split leaves are 98% of the elements: their gathers move half.
  assert gathered[2] < 0.52 * gathered[1], gathered
  tensor_reduces = [c for c in hlo.collectives(text2) if c.kind == "all-reduce"
                    and c.groups[0] == (0, 1)]
  # Two row-parallel matmuls per layer (wo, down): forward all-reduce each.
  assert len(tensor_reduces) >= 2 * LAYERS, len(tensor_reduces)


# --------------------------------------------------------------------------
# Composition


def test_stacked_layers_scan_accumulation_and_clipping():
  stacked, scan_loss = _stacked(model_params()), scan_loss_fn
  cfg = tp_config(stacked_layers=("layers",), use_orig_params=True)
  opt = WHOLE_TENSOR["clip_by_global_norm"]()
  data = batches()
  # Reference: clipping in the optimizer, two micro-batches averaged (the
  # single-device run of test_whole_tensor_optimizers' global-norm case).
  ref_losses, ref_params = reference(("clip_by_global_norm", True), scan_loss, stacked, opt,
                                     data)
  m = mesh(2, 4)
  state = fsdp_jax.init_train_state(params=stacked, optimizer=optax.adam(1e-2), mesh=m,
                                    config=cfg)
  step = fsdp_jax.shard_train_step(scan_loss, optax.adam(1e-2), mesh=m, config=cfg,
                                   max_norm=0.05, gradient_accumulation_steps=2)
  losses = []
  for b in data:
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params, rtol=1e-4, atol=1e-5)
  assert "[stacked x2] [tensor x4]" in str(state.plan)


def _stacked(params):
  return dict(params, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"]))


def scan_loss_fn(p, b):
  x = p["embed"]["embedding"][b["tokens"]]
  x, _ = jax.lax.scan(lambda x, lp: (block(x, lp), None), x, p["layers"])
  logits = rms(x, p["norm"]) @ p["head"]["kernel"] + p["head"]["bias"]
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, b["labels"][..., None], -1))


WHOLE_TENSOR = {
    # (Adam at 1e-2: the optimizer test_stacked_layers_scan_accumulation_and_
    # clipping clips by max_norm=, sharing this case's reference.)
    "clip_by_global_norm": lambda: optax.chain(optax.clip_by_global_norm(0.05),
                                               optax.adam(1e-2)),
    # A global norm and Adafactor at once, in both views: the clipped
    # gradients' squares are Adafactor's statistics (compared with FSDP
    # alone's below). The two share the single-device reference and FSDP
    # alone's run.
    "clip_by_global_norm+adafactor": lambda: optax.chain(optax.clip_by_global_norm(0.05),
                                                         optax.adafactor(3e-2)),
    "muon": lambda: optax.contrib.muon(3e-2),
    "lamb": lambda: optax.lamb(3e-2),
}


@pytest.mark.parametrize("name,mode,shape,orig,stacked", [
    ("clip_by_global_norm", "sharded", (3, 2, None), True, True),
    ("clip_by_global_norm+adafactor", "global", (2, 2, 2), False, True),
    ("clip_by_global_norm+adafactor", "sharded", (1, 8, None), False, True),
    ("muon", "sharded", (4, 2, None), False, False),
    ("muon", "global", (2, 4, None), True, False),
    ("lamb", "sharded", (2, 2, 2), True, False),
])
def test_whole_tensor_optimizers(name, mode, shape, orig, stacked):
  """Optimizers that reduce or transform whole parameters see each split
  leaf whole: a global norm sums the slices over the tensor axis too,
  Adafactor's row and column moments and Muon's orthogonalisation read the
  whole matrix (on the shards, or in the global view)."""
  # One layer unstacked (a layer's matrices are what these optimizers read
  # whole; each compile of the global view is about half a two-layer one's).
  params, loss = ((_stacked(model_params()), scan_loss_fn) if stacked else
                  (model_params(layers=1), loss_fn))
  cfg = tp_config(optimizer_update=mode, use_orig_params=orig,
                  stacked_layers=("layers",) if stacked else ())
  state, _ = check(params, loss, cfg, mesh(*shape), optimizer=WHOLE_TENSOR[name](),
                   ref_key=(name, stacked))
  assert state.plan.opt_update.mode == mode, state.plan.opt_update
  if "adafactor" in name:
    # The optimizer state is the whole leaves' (factored statistics over
    # whole rows and columns), as FSDP alone keeps it.
    key = ("alone", name, orig, stacked)
    if key not in _REFERENCES:
      alone = run(params, loss, fsdp_jax.FSDPConfig(use_orig_params=orig,
                                                    stacked_layers=cfg.stacked_layers),
                  fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4]),
                  WHOLE_TENSOR[name](), batches())[0]
      _REFERENCES[key] = fsdp_jax.optim_state_dict(alone)
    osd, ref = fsdp_jax.optim_state_dict(state), _REFERENCES[key]
    assert sorted(osd["state"]) == sorted(ref["state"])
    assert_close_relative(osd["state"], ref["state"], 1e-4)


def test_zeropp_quantized_gathers_and_hpz():
  """ZeRO++ over the shard axis: hpZ's secondary groups and int8 gathers
  run within each tensor slice; against one device with the same
  quantization error bound as FSDP alone (tests/test_zeropp.py)."""
  q = fsdp_jax.Quantization(dtype=jnp.int8, block_size=32)
  params = model_params(layers=1)
  data = batches(2)
  ref_losses, ref_params = jit_reference_run(loss_fn, params, optax.sgd(0.1), data)
  for cfg in (tp_config(reshard_after_forward=2, use_orig_params=True),
              tp_config(all_gather_quantization=q)):
    state, losses, _ = run(params, loss_fn, cfg, mesh(4, 2), optax.sgd(0.1), data)
    tol = 1e-5 if cfg.all_gather_quantization is None else 2e-2
    np.testing.assert_allclose(losses, ref_losses, rtol=tol, atol=tol)
    assert_trees_close(fsdp_jax.summon_full_params(state), ref_params,
                       rtol=max(tol, 1e-4), atol=max(tol, 1e-5))


def test_cpu_offload_clip_grad_norm_and_summon_write():
  """Offloaded parameters; shard_train_step(max_norm=...) clips by the norm
  over all of a split leaf's slices (the tensor axis too): the same as
  optax's global clip on one device."""
  cfg = tp_config(cpu_offload=fsdp_jax.CPUOffload(offload_params=True))
  ref_opt = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.5))
  data = batches(2)
  params = model_params(layers=1)
  ref_losses, ref_params = jit_reference_run(loss_fn, params, ref_opt, data)
  state, losses, _ = run(params, loss_fn, cfg, mesh(4, 2), optax.sgd(0.5), data,
                         max_norm=0.1)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params, rtol=1e-4, atol=1e-6)
  assert_close_relative(fsdp_jax.summon_full_params(state), ref_params, 1e-4)
  full = fsdp_jax.summon_full_params(state)
  changed = fsdp_jax.write_full_params(state, lambda p: jax.tree.map(lambda x: x * 2, p))
  assert_trees_close(fsdp_jax.summon_full_params(changed), jax.tree.map(lambda x: x * 2, full))


# --------------------------------------------------------------------------
# Checkpoints and state dicts


def test_checkpoint_reshards_across_meshes(tmp_path):
  """One layer: resharding reads each leaf's slices the same way whatever
  the depth (test_state_dicts_full_and_sharded loads two layers across
  tensor sizes)."""
  params = model_params(layers=1)
  data = batches(3, size=24)
  opt = optax.adam(1e-2)
  cfg = tp_config(use_orig_params=True)
  state, _, step = run(params, loss_fn, cfg, mesh(4, 2), opt, data[:1])
  with fsdp_jax.CheckpointManager(tmp_path / "ckpt") as mgr:
    mgr.save(state)
    mgr.wait_until_finished()
    # Resume on the same mesh: bitwise.
    same = mgr.restore(state)
    for a, b in zip(jax.tree.leaves(same.params), jax.tree.leaves(state.params)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    full = fsdp_jax.summon_full_params(state)
    moments = plain(fsdp_jax.optim_state_dict(state)["state"])
    s1, l1 = train_steps(step, same, data[1:])
    targets = [(fsdp_jax.FSDPConfig(), fsdp_jax.make_mesh(shard=8)),
               (tp_config(), mesh(2, 4)),
               (fsdp_jax.FSDPConfig(), fsdp_jax.make_mesh(shard=1, devices=jax.devices()[:1]))]
    for c, m in targets:
      target = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=m, config=c)
      restored = mgr.restore(target)
      assert_trees_close(fsdp_jax.summon_full_params(restored), full, rtol=0, atol=0)
      # Adam's moments resharded exactly (the state the next steps read).
      assert_trees_close(plain(fsdp_jax.optim_state_dict(restored)["state"]), moments,
                         rtol=0, atol=0)
      if c.tensor_parallel is not None:  # and it trains on: the same losses
        step2 = fsdp_jax.shard_train_step(loss_fn, opt, mesh=m, config=c)
        _, l2 = train_steps(step2, restored, data[1:])
        np.testing.assert_allclose(l2, l1, rtol=1e-5)


def test_state_dicts_full_and_sharded():
  params = model_params()
  cfg = tp_config()
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.adam(1e-2),
                                    mesh=mesh(4, 2), config=cfg)
  sd = fsdp_jax.state_dict(state)
  assert np.asarray(sd["layers.0.wq.kernel"]).shape == (D, HEADS * HEAD_DIM)
  np.testing.assert_array_equal(np.asarray(sd["layers.1.down.kernel"]),
                                np.asarray(params["layers"][1]["down"]["kernel"]))
  fresh = fsdp_jax.init_train_state(params=jax.tree.map(jnp.zeros_like, params),
                                    optimizer=optax.adam(1e-2), mesh=mesh(2, 4), config=cfg)
  loaded = fsdp_jax.load_state_dict(fresh, sd)
  assert_trees_close(fsdp_jax.summon_full_params(loaded), params, rtol=0, atol=0)


@pytest.mark.parametrize("shape,orig", [((2, 4), True)])
def test_vocab_parallel_embedding_and_cross_entropy_gather_nothing(shape, orig):
  """Megatron's vocabulary-parallel embedding and cross-entropy: with the
  embedding split by vocabulary rows and the head by columns, the lookup,
  the log-softmax's maximum and sum and the labels' logits are all-reduces
  of per-slice results (Hugging Face's ignore index -100 included): the
  logits are never gathered over 'tensor', and the numbers are one
  device's."""
  rules = [r for r in RULES if r[0] != "embed.embedding"] + [("embed.embedding",
                                                               ("tensor", None))]

  def ce_loss(params, batch):
    logits = logits_fn(params, batch["tokens"])
    labels = batch["labels"]
    valid = labels != -100
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
    # take_along_axis at -100 fills (NaN), masked out as the ignore index is.
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], -1)[..., 0]
    # A maximum over the vocabulary that is differentiated (not a shift).
    top = jnp.mean(jnp.max(logits, -1))
    # Indices past the vocabulary, clipped to its last token.
    clipped = jnp.take_along_axis(logits, (labels + VOCAB // 2)[..., None], -1, mode="clip")
    return (jnp.sum(jnp.where(valid, ce, 0)) - jnp.sum(jnp.where(valid, picked, 0))) / (
        2 * jnp.sum(valid)) + 0.1 * top + 0.01 * jnp.mean(jnp.where(valid[..., None], clipped, 0))

  data = batches()
  for b in data:
    b["labels"] = b["labels"].at[::3, 2:4].set(-100)
  cfg = fsdp_jax.FSDPConfig(tensor_parallel=fsdp_jax.TensorParallel(rules=rules),
                            use_orig_params=orig)
  # SGD: the parameters compare the gradients themselves (Adam's
  # normalisation of this loss's near-zero gradients amplifies rounding
  # differences past the tolerance even for FSDP alone on one device).
  state, _ = check(model_params(), ce_loss, cfg, mesh(*shape), data=data,
                   optimizer=optax.sgd(0.3))
  assert not state.plan.tensor_report.gathered, state.plan.tensor_report.gathered


# --------------------------------------------------------------------------
# The plan


def test_plan_shows_the_2d_layout_and_collectives(wrapped_tp):
  state = wrapped_tp[0]
  text = str(state.plan)
  assert "mesh {'shard': 4, 'tensor': 2}" in text
  assert "layers.0.tensor_parallel [tensor x2]" in text
  assert re.search(r"layers\.0\.wo\.kernel .* split \('tensor', None\)", text), text
  assert re.search(r"layers\.0\.wq\.kernel .* split \(None, 'tensor'\)", text), text
  assert "over 'shard': all-gather" in text
  # After tracing: Megatron's forward reduction per row-parallel matmul, a
  # reduce-scatter along the sequence (sequence parallelism, on by
  # default), and three all-reduces for the loss over the split vocabulary
  # (the log-softmax's maximum and sum, the labels' logits).
  m = re.search(r"'tensor' per step: (\d+) forward reduce-scatter", text)
  assert m and int(m.group(1)) == 2 * LAYERS, text
  m = re.search(r"'tensor' per step: (\d+) forward all-reduce", text)
  assert m and int(m.group(1)) == 3, text
  # The lookup in the feature-split embedding runs on the gathered table.
  assert re.search(r"gathered over 'tensor' \(runs unsplit\): gather at .*logits_fn", text), text
  # Bytes per device: 1/(S*T) of a split unit.
  unit = state.plan.unit_by_name("layers.0.tensor_parallel")
  numel = state.plan.unit_numel(unit)
  row = re.search(r"layers\.0\.tensor_parallel \[tensor x2\]\s+\d+\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)",
                  text)
  assert int(row.group(3).replace(",", "")) <= 1.05 * numel * 4 / 8


# --------------------------------------------------------------------------
# Flax linen and NNX: rules over their parameter names


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.RMSNorm(name="norm")(x)
    q = nn.Dense(HEADS * HEAD_DIM, use_bias=False, name="q_proj")(h)
    v = nn.Dense(HEADS * HEAD_DIM, use_bias=False, name="v_proj")(h)
    x = x + nn.Dense(D, name="o_proj")(jnp.tanh(q) * v)
    up = nn.Dense(FF, name="up_proj")(nn.RMSNorm(name="mlp_norm")(x))
    return x + nn.Dense(D, name="down_proj")(jax.nn.gelu(up))


class LinenModel(nn.Module):
  """One block: the rules match by module name, the same in every block."""

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D, name="embed_tokens")(tokens)
    x = LinenBlock(name="layers_0")(x)
    return nn.Dense(VOCAB, name="lm_head")(nn.RMSNorm(name="final_norm")(x))


LINEN_RULES = [("*.q_proj", "colwise"), ("*.v_proj", "colwise"), ("*.o_proj", "rowwise"),
               ("*.up_proj", "colwise"), ("*.down_proj", "rowwise"), ("lm_head", "colwise")]


def test_linen_model_rules():
  model = LinenModel()
  data = batches(2)
  params = model.init(jax.random.key(0), data[0]["tokens"])["params"]

  def loss(p, b):
    logp = jax.nn.log_softmax(model.apply({"params": p}, b["tokens"]))
    return -jnp.mean(jnp.take_along_axis(logp, b["labels"][..., None], -1))

  cfg = fsdp_jax.FSDPConfig(tensor_parallel=fsdp_jax.TensorParallel(rules=LINEN_RULES),
                            auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["layers_*"]))
  state, _ = check(params, loss, cfg, mesh(2, 4), data=data)
  names = {l.name: l.tensor_dim for l in state.plan.leaves}
  assert names["layers_0.o_proj.kernel"] == 0 and names["layers_0.o_proj.bias"] is None
  assert names["layers_0.up_proj.kernel"] == 1 and names["layers_0.up_proj.bias"] == 0


class NNXModel(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.up = nnx.Linear(D, FF, rngs=rngs)
    self.down = nnx.Linear(FF, D, rngs=rngs)
    self.head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = x + self.down(jax.nn.relu(self.up(x)) ** 2)
    return self.head(x)


def test_nnx_model_rules():
  graphdef, params = nnx.split(NNXModel(nnx.Rngs(0)), nnx.Param)
  data = batches(2)

  def loss(p, b):
    logits = nnx.merge(graphdef, p)(b["tokens"])
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, b["labels"][..., None], -1))

  rules = [("up", "colwise"), ("down", "rowwise"), ("head", "colwise")]
  cfg = fsdp_jax.FSDPConfig(tensor_parallel=fsdp_jax.TensorParallel(rules=rules),
                            use_orig_params=True)
  # SGD: relu(.)**2 leaves many gradients of down.kernel near zero, which
  # Adam's normalisation amplifies (FSDP alone differs from one device by
  # 1e-3 there under AdamW, as tensor parallelism does).
  state, _ = check(params, loss, cfg, mesh(4, 2), data=data, optimizer=optax.sgd(0.3))
  split = {l.name: l.tensor_dim for l in state.plan.leaves if l.tensor_dim is not None}
  assert split == {"up.kernel": 1, "up.bias": 0, "down.kernel": 0, "head.kernel": 1}, split


# --------------------------------------------------------------------------
# Bad input


def _init(params, cfg, m):
  return fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=m, config=cfg)


def test_errors_name_leaf_shape_axis_and_fix():
  params = model_params()
  tp = lambda rules: fsdp_jax.FSDPConfig(tensor_parallel=fsdp_jax.TensorParallel(rules=rules))
  with pytest.raises(ValueError, match=r"'\*\.nope' \('colwise'\) matches no parameter.*Fix"):
    _init(params, tp([("*.nope", "colwise")]), mesh(4, 2))
  with pytest.raises(ValueError, match=r"'layers.0.wq.kernel' \(shape \(16, 16\)\) is matched by "
                                       r"two TensorParallel rules.*Fix"):
    _init(params, tp([("*.wq", "colwise"), ("layers.0.wq", "rowwise")]), mesh(4, 2))
  odd = model_params(ff=FF + 2)
  with pytest.raises(ValueError, match=r"dimension 1 of 'layers.0.gate.kernel' \(shape \(16, 26\), "
                                       r"size 26\) over the tensor axis 'tensor' of size 4.*Fix"):
    _init(odd, tp(RULES), mesh(2, 4))
  with pytest.raises(ValueError, match=r"tensor_parallel.*mesh has axes \('shard',\).*"
                                       r"make_mesh\(shard=S, tensor=T\)"):
    _init(params, tp(RULES), fsdp_jax.make_mesh(shard=8))
  with pytest.raises(ValueError, match=r"'tensor' axis of size 2.*no tensor_parallel rules.*Fix"):
    _init(params, fsdp_jax.FSDPConfig(), mesh(4, 2))
  with pytest.raises(ValueError, match="rowwise but matches the 1-D 'layers.0.up.bias'"):
    _init(params, tp([("*.up.bias", "rowwise")]), mesh(4, 2))
  with pytest.raises(ValueError, match="exactly one dimension"):
    fsdp_jax.TensorParallel(rules=[("head", ("tensor", "tensor"))])
  with pytest.raises(ValueError, match="is not 'colwise', 'rowwise'"):
    fsdp_jax.TensorParallel(rules=[("head", "columnwise")])


# --------------------------------------------------------------------------
# Pretrained weights


def _weight_map(params):

  rules = []
  for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    if name.endswith(".kernel"):  # PyTorch's [out, in] weight
      rules.append((name[:-len("kernel")] + "weight", name, pretrained.transpose()))
    else:
      rules.append((name, name))
  return pretrained.WeightMap(rules)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
  """``layers -> (params, weight map, directory)``: a Hugging Face-layout
  checkpoint of model_params(layers=layers), written once for the module's
  loading tests."""
  made = {}

  def get(layers):
    if layers not in made:
      params = model_params(layers=layers)
      wm = _weight_map(params)
      src = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1),
                                      mesh=fsdp_jax.make_mesh(shard=8),
                                      config=fsdp_jax.FSDPConfig())
      path = tmp_path_factory.mktemp(f"hf_{layers}_layers") / "in"
      pretrained.save(src, path, wm)
      made[layers] = params, wm, path
    return made[layers]

  return get


@pytest.mark.parametrize("orig", [False, True])
def test_pretrained_loader_reads_each_devices_2d_slice(hf_checkpoint, tmp_path, orig):
  """A Hugging Face-layout checkpoint (PyTorch [out, in] weights) loads into
  the tensor-parallel layout: each device's shard is read from its tensor
  slice of the file (a transposed column range for a row-parallel kernel),
  and saving writes the same tensors back."""

  params, wm, path = hf_checkpoint(LAYERS)
  cfg = tp_config(use_orig_params=orig, auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["layers.*"]))
  for m in (mesh(4, 2), mesh(3, 2), mesh(1, 8)):
    state = fsdp_jax.init_train_state(
        init_fn=lambda rng: model_params(seed=5), rng=jax.random.key(0),
        optimizer=optax.sgd(0.1), mesh=m, config=cfg,
        pretrained=pretrained.load(path, wm))
    assert_trees_close(fsdp_jax.summon_full_params(state), params, rtol=0, atol=0)
  pretrained.save(state, tmp_path / "out", wm)
  back = fsdp_jax.init_train_state(
      init_fn=lambda rng: model_params(seed=5), rng=jax.random.key(0),
      optimizer=optax.sgd(0.1), mesh=fsdp_jax.make_mesh(shard=8), config=fsdp_jax.FSDPConfig(),
      pretrained=pretrained.load(tmp_path / "out", wm))
  assert_trees_close(fsdp_jax.summon_full_params(back), params, rtol=0, atol=0)


# --------------------------------------------------------------------------
# LoRA: adapters split with their kernel


def _lora_runs(params, loss, lora, rules, tp_mesh, data, orig=True) -> dict:
  """``{1: (state, losses) of LoRA with FSDP alone on 4 devices, 2: ... with
  tensor parallelism on tp_mesh}``, trained with Adam on ``data``."""
  opt = optax.adam(1e-2)
  runs = {}
  for t in (1, 2):
    cfg = fsdp_jax.FSDPConfig(
        lora=lora, use_orig_params=orig,
        tensor_parallel=fsdp_jax.TensorParallel(rules=rules) if t > 1 else None)
    m = tp_mesh if t > 1 else fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
    state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=m, config=cfg,
                                      rng=jax.random.key(3))
    step = fsdp_jax.shard_train_step(loss, opt, mesh=m, config=cfg)
    runs[t] = train_steps(step, state, data)
  return runs


# Colwise adapters with use_orig_params: test_lora_on_nd_kernels_splits_adapters_by_heads.
@pytest.mark.parametrize("orig,quantized", [(False, False), (True, True)])
def test_lora_adapters_split_with_their_kernel(orig, quantized):
  """LoRA on column- and row-parallel kernels: a colwise kernel's lora_B and
  a rowwise kernel's lora_A are split with it (the other factor replicated);
  the same numbers as LoRA with FSDP alone. QLoRA's row-blocked base splits
  with a rowwise kernel."""
  q = fsdp_jax.Quantization(dtype=jnp.int8, block_size=8) if quantized else None
  targets = ("*.wo", "*.down") if quantized else ("*.wq", "*.wv", "*.wo", "*.down")
  lora = fsdp_jax.LoRA(targets=targets, rank=4, alpha=8.0, trainable=("head",),
                       base_quantization=q)
  runs = _lora_runs(model_params(layers=1), loss_fn, lora, RULES, mesh(4, 2), batches(3),
                    orig=orig)
  np.testing.assert_allclose(runs[2][1], runs[1][1], rtol=1e-5, atol=1e-5)
  assert runs[1][1][-1] < runs[1][1][0]
  assert_close_relative(fsdp_jax.summon_full_params(runs[2][0]),
                        fsdp_jax.summon_full_params(runs[1][0]), 1e-4)
  dims = {l.name: l.tensor_dim for l in runs[2][0].plan.leaves}
  assert dims["layers.0.wo.kernel.base"] == 0 and dims["layers.0.wo.kernel.lora_A"] == 0
  assert dims["layers.0.wo.kernel.lora_B"] is None
  if not quantized:
    assert dims["layers.0.wq.kernel.lora_A"] is None and dims["layers.0.wq.kernel.lora_B"] == 1


def test_qlora_colwise_split_is_refused():
  lora = fsdp_jax.LoRA(targets=("*.wq",), rank=2,
                       base_quantization=fsdp_jax.Quantization(dtype="nf4", block_size=8))
  cfg = fsdp_jax.FSDPConfig(lora=lora, use_orig_params=True,
                            tensor_parallel=fsdp_jax.TensorParallel(rules=RULES))
  with pytest.raises(NotImplementedError, match=r"'layers.0.wq.kernel' \(shape \(16, 16\)\) is "
                                                r"quantized.*column-wise.*Fix"):
    _init(model_params(), cfg, mesh(4, 2))


@pytest.mark.parametrize("quantized", [False, True])
def test_pretrained_into_lora_tensor_parallel(hf_checkpoint, quantized):
  """A checkpoint loads into a LoRA state under tensor parallelism: each
  device reads its slice of the base (QLoRA: its rows, encoded on the host
  as at init), the factors start as at init (B = 0), and the merged model
  is the checkpoint (exactly; within int8 rounding for QLoRA)."""
  params, wm, path = hf_checkpoint(1)
  q = fsdp_jax.Quantization(dtype=jnp.int8, block_size=8) if quantized else None
  lora = fsdp_jax.LoRA(targets=("*.wo", "*.down"), rank=2, base_quantization=q)
  cfg = fsdp_jax.FSDPConfig(lora=lora, use_orig_params=True,
                            tensor_parallel=fsdp_jax.TensorParallel(rules=RULES))
  load = lambda c, m: fsdp_jax.summon_full_params(fsdp_jax.init_train_state(
      init_fn=lambda rng: model_params(seed=5, layers=1), rng=jax.random.key(0),
      optimizer=optax.sgd(0.1), mesh=m, config=c,
      pretrained=pretrained.load(path, wm)))
  full = load(cfg, mesh(4, 2))
  # The same bytes as FSDP alone loads (the same host encode, row by row).
  alone = load(fsdp_jax.FSDPConfig(lora=lora, use_orig_params=True),
               fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4]))
  assert_trees_close(full, alone, rtol=0, atol=0)
  tol = 0.02 if quantized else 0
  assert_trees_close(full, params, rtol=tol, atol=tol)


# --------------------------------------------------------------------------
# Rotary embeddings: slices, concatenations and pads of head-split values


def _rope(x):
  t, dh = x.shape[1], x.shape[-1]
  angle = jnp.arange(t)[:, None] / (100.0 ** (jnp.arange(dh // 2) / (dh // 2)))[None]
  cos = jnp.concatenate([jnp.cos(angle)] * 2, -1)[None, :, None, :]
  sin = jnp.concatenate([jnp.sin(angle)] * 2, -1)[None, :, None, :]
  rotated = jnp.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1)  # rotate_half
  return x * cos + rotated * sin


def _rope_halves(x):
  """rotate_half with jnp.split (a primitive from jax 0.10)."""
  t, dh = x.shape[1], x.shape[-1]
  angle = jnp.arange(t)[:, None] / (100.0 ** (jnp.arange(dh // 2) / (dh // 2)))[None]
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _rope_pairs(x):
  """Interleaved pairs (Meta's layout): strided slices and jnp.stack."""
  t, dh = x.shape[1], x.shape[-1]
  angle = jnp.arange(t)[:, None] / (100.0 ** (jnp.arange(dh // 2) / (dh // 2)))[None]
  cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
  x1, x2 = x[..., ::2], x[..., 1::2]
  return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).reshape(x.shape)


def _tensor_groups(m) -> set:
  """The device groups of the mesh's tensor axis, as HLO replica groups."""
  devices = np.moveaxis(m.devices, m.axis_names.index("tensor"), -1)
  return {tuple(sorted(d.id for d in row)) for row in devices.reshape(-1, devices.shape[-1])}


def test_rotary_attention_keeps_heads_split():
  """Rotary variants run on the head slices: Llama's rotate_half by slices
  and a concatenation (with a pad along another axis), by jnp.split, and
  interleaved pairs by strided slices and jnp.stack. Nothing of the model
  is gathered over 'tensor', in the report or in the compiled step."""
  ropes = [lambda y: _rope(jnp.pad(y, ((0, 0),) * 4)), lambda y: _rope_pairs(_rope_halves(y))]

  def rope_loss(params, batch):
    x = params["embed"]["embedding"][batch["tokens"]]
    for p, rope in zip(params["layers"], ropes):
      x = block(x, p, position=rope)
    logp = jax.nn.log_softmax(rms(x, params["norm"]) @ params["head"]["kernel"]
                              + params["head"]["bias"])
    return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))

  m = mesh(2, 4)
  cfg = fsdp_jax.FSDPConfig(use_orig_params=True, tensor_parallel=fsdp_jax.TensorParallel(
      rules=[r for r in RULES if r[0] != "embed.embedding"]))  # a replicated embedding
  state, step = check(model_params(), rope_loss, cfg, m, optimizer=optax.sgd(0.3))
  assert not state.plan.tensor_report.gathered, state.plan.tensor_report.gathered
  text = step.lower(state, batches(1)[0]).compile().as_text()
  groups = _tensor_groups(m)
  assert any(c.kind == "all-reduce" and set(c.groups) <= groups for c in hlo.collectives(text))
  gathers = [c for c in hlo.collectives(text) if c.kind == "all-gather" and set(c.groups) <= groups]
  assert not gathers, gathers


# --------------------------------------------------------------------------
# N-D (einsum) kernels: module patterns on 'w' leaves, LoRA split with them

N_HEADS, N_DIM = 4, 2


def nd_params(seed=0):
  """An einsum model whose modules keep their weight in 'w' (Gemma-style
  [d, heads, head_dim] projections, a [heads, head_dim, d] output)."""
  keys = iter(jax.random.split(jax.random.key(seed), 16))
  w = lambda *shape: jax.random.normal(next(keys), shape) * (0.5 / np.sqrt(shape[0]))
  layer = lambda: {"q": {"w": w(D, N_HEADS, N_DIM)}, "k": {"w": w(D, N_HEADS, N_DIM)},
                   "v": {"w": w(D, N_HEADS, N_DIM)}, "o": {"w": w(N_HEADS, N_DIM, D)},
                   "norm": {"scale": jnp.ones((D,))}}
  return {"embed": {"embedding": w(VOCAB, D) * 4}, "layers": [layer(), layer()],
          "head": {"w": w(D, VOCAB)}}


def nd_loss(p, batch):
  x = p["embed"]["embedding"][batch["tokens"]]
  for lp in p["layers"]:
    h = rms(x, lp["norm"]["scale"])
    q, k, v = (jnp.einsum("btd,dnh->btnh", h, lp[n]["w"]) for n in "qkv")
    s = jnp.einsum("btnh,bsnh->bnts", _rope_halves(q), _rope_halves(k)) / np.sqrt(N_DIM)
    a = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, -1), v)
    x = x + jnp.einsum("btnh,nhd->btd", a, lp["o"]["w"])
  logp = jax.nn.log_softmax(x @ p["head"]["w"])
  return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))


ND_RULES = [("*.q", (None, "tensor", None)), ("*.k", (None, "tensor", None)),
            ("*.v", (None, "tensor", None)), ("*.o", ("tensor", None, None))]


def test_lora_on_nd_kernels_splits_adapters_by_heads():
  """Rules and LoRA targets name modules whose weight is 'w'; the heads
  dimension splits each kernel, and with it lora_B of the [d, heads,
  head_dim] projections and lora_A of the [heads, head_dim, d] output:
  the numbers of LoRA with FSDP alone, nothing gathered over 'tensor'."""
  lora = fsdp_jax.LoRA(targets=("q", "v", "o"), rank=2, alpha=4.0, input_dims={"o": 2})
  runs = _lora_runs(nd_params(), nd_loss, lora, ND_RULES, mesh(3, 2), batches(2))
  np.testing.assert_allclose(runs[2][1], runs[1][1], rtol=1e-5, atol=1e-5)
  assert_close_relative(fsdp_jax.summon_full_params(runs[2][0]),
                        fsdp_jax.summon_full_params(runs[1][0]), 1e-4)
  plan = runs[2][0].plan
  dims = {l.name: l.tensor_dim for l in plan.leaves}
  assert (dims["layers.0.q.w.base"], dims["layers.0.q.w.lora_A"], dims["layers.0.q.w.lora_B"]
          ) == (1, None, 1)
  assert (dims["layers.0.o.w.base"], dims["layers.0.o.w.lora_A"], dims["layers.0.o.w.lora_B"]
          ) == (0, 0, None)
  assert dims["layers.0.k.w"] == 1 and not plan.tensor_report.gathered
  assert plan.lora_report.adapter_path == {f"layers.{i}.{n}.w" for i in range(2) for n in "qvo"}
