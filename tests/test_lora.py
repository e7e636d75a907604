"""LoRA and QLoRA (FSDPConfig(lora=...)) against a single-device reference
of the same math: the loss sees W + (alpha / r) * A @ B for each target, A
and B (and LoRA(trainable=...)) train, everything else is frozen."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax import hlo
from fsdp_jax._src import lora as lora_lib

S = fsdp_jax.ShardingStrategy
KEY = jax.random.key(7)


# --------------------------------------------------------------------------
# Models


def tiny_params(seed=0, vocab=13, d=10, layers=1, out=5):
  """Sizes no mesh size divides; one layer (its own wrapped unit beside the
  root's embedding and head) unless asked for more."""
  k = jax.random.split(jax.random.key(seed), 3 * layers + 2)
  return {
      "emb": jax.random.normal(k[0], (vocab, d)),
      "layers": [{"wq": jax.random.normal(k[3 * i + 1], (d, d)) * 0.3,
                  "wo": jax.random.normal(k[3 * i + 2], (d, d)) * 0.3,
                  "norm": jnp.ones((d,)) + 0.1 * i} for i in range(layers)],
      "head": jax.random.normal(k[-1], (d, out)) * 0.3,
  }


def tiny_loss(p, batch):
  h = p["emb"][batch["x"]]
  for layer in p["layers"]:
    h = h + jnp.tanh((h * layer["norm"]) @ layer["wq"]) @ layer["wo"]
  logits = h @ p["head"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def tiny_batches(n=3, rows=12, seq=3, vocab=13, out=5):
  out_b = []
  for s in range(n):
    k1, k2 = jax.random.split(jax.random.key(100 + s))
    out_b.append({"x": jax.random.randint(k1, (rows, seq), 0, vocab),
                  "y": jax.random.randint(k2, (rows, seq), 0, out)})
  return out_b


def stacked_params(seed=0, d=10, layers=3):
  k = jax.random.split(jax.random.key(seed), 4)
  return {"emb": jax.random.normal(k[0], (13, d)),
          "layers": {"wq": jax.random.normal(k[1], (layers, d, d)) * 0.3,
                     "wo": jax.random.normal(k[2], (layers, d, d)) * 0.3,
                     "norm": jnp.ones((layers, d))},
          "head": jax.random.normal(k[3], (d, 5)) * 0.3}


def stacked_loss(p, batch):
  h = p["emb"][batch["x"]]

  def body(h, layer):
    return h + jnp.tanh((h * layer["norm"]) @ layer["wq"]) @ layer["wo"], None

  h, _ = jax.lax.scan(body, h, p["layers"])
  logits = h @ p["head"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


# --------------------------------------------------------------------------
# The reference: the same math on one device, in plain JAX


def reference(params, loss_fn, lora, optimizer, batches, *, stacked=(), max_norm=None):
  """Trains A, B (and LoRA(trainable=...)) of the merged model unsharded;
  returns (losses, merged params)."""
  targets = lora_lib.find_targets(params, lora, stacked)
  stored = lora_lib.adapter_tree(params, lora, targets, KEY)
  trainable_ids = lora_lib.trainable_leaves(params, lora)
  mask = lora_lib.requires_grad_tree(stored, trainable_ids, lora_lib.user_treedef(stored))
  flat_mask = jax.tree.leaves(mask)
  flat, treedef = jax.tree.flatten(stored)
  train = [x if m else None for x, m in zip(flat, flat_mask)]
  frozen = [None if m else x for x, m in zip(flat, flat_mask)]

  def combine(t):
    return jax.tree.unflatten(treedef, [a if a is not None else b for a, b in zip(t, frozen)])

  def loss_of(t, batch):
    # alpha / rank written out, not LoRA.scaling: the reference does not
    # share the engine's scale.
    return loss_fn(lora_lib.merged_tree(combine(t), lora.alpha / lora.rank), batch)

  if max_norm is not None:
    optimizer = optax.chain(optax.clip_by_global_norm(max_norm), optimizer)

  @jax.jit  # one program on one device (op by op, each step recompiled its scans)
  def train_step(train, opt_state, batch):
    loss, g = jax.value_and_grad(loss_of)(train, batch)
    updates, opt_state = optimizer.update(g, opt_state, train)
    return optax.apply_updates(train, updates), opt_state, loss

  opt_state = optimizer.init(train)
  losses = []
  for batch in batches:
    train, opt_state, loss = train_step(train, opt_state, batch)
    losses.append(float(loss))
  return losses, lora_lib.merged_tree(combine(train), lora.alpha / lora.rank)


def run(params, loss_fn, lora, optimizer, batches, *, mesh, strategy=S.FULL_SHARD,
        use_orig_params=True, stacked=(), wrap=None, step=None, **step_kw):
  """Trains from a fresh state; ``step``: a step built here before (reused)."""
  cfg = fsdp_jax.FSDPConfig(sharding_strategy=strategy, use_orig_params=use_orig_params,
                            lora=lora, stacked_layers=stacked, auto_wrap_policy=wrap)
  state = fsdp_jax.init_train_state(params=params, optimizer=optimizer, mesh=mesh,
                                    config=cfg, rng=KEY)
  step = step or fsdp_jax.shard_train_step(loss_fn, mesh=mesh, config=cfg, **step_kw)
  losses = []
  for batch in batches:
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return state, losses


def assert_close(tree_a, tree_b, rtol=1e-4, atol=1e-5):
  for (p, a), b in zip(jax.tree_util.tree_flatten_with_path(tree_a)[0], jax.tree.leaves(tree_b)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol,
                               err_msg=jax.tree_util.keystr(p))


LORA = fsdp_jax.LoRA(targets=("*.wq", "*.wo"), rank=3, alpha=6.0, trainable=("head",))
WRAP = fsdp_jax.ModuleWrapPolicy(["layers.*"])


def _mesh(n, r=None):
  devices = jax.devices()[: n * (r or 1)]
  return (fsdp_jax.make_mesh(replicate=r, shard=n, devices=devices) if r
          else fsdp_jax.make_mesh(shard=n, devices=devices))


# --------------------------------------------------------------------------
# Numbers


ADAMW = optax.adamw(1e-2, weight_decay=0.1)


@pytest.fixture(scope="module")
def tiny_reference():
  """The unsharded run of tiny_params / LORA / ADAMW over tiny_batches()."""
  return reference(tiny_params(), tiny_loss, LORA, ADAMW, tiny_batches())


# Every strategy, both layouts, 3 and 4 devices (neither divides the sizes)
# and the HYBRID meshes, each case one compiled step (each strategy in one
# layout: the original parameters under FULL_SHARD and the ZeRO-2 hybrid,
# the flat ones under the others).
@pytest.mark.parametrize("strategy,n,r,use_orig_params", [
    (S.FULL_SHARD, 3, None, True),
    (S.SHARD_GRAD_OP, 4, None, False), (S.NO_SHARD, 2, None, False),
    (S.HYBRID_SHARD, 2, 2, False), (S._HYBRID_SHARD_ZERO2, 3, 2, True)])
def test_matches_single_device_reference_and_reduces_only_what_trains(
    tiny_reference, strategy, n, r, use_orig_params):
  """The losses and trained parameters are the reference's; only the
  adapters and trainable leaves are reduce-scattered (and all-reduced over
  replicas), and print(state.plan) counts what the compiled step does."""
  params, batches = tiny_params(), tiny_batches()
  ref_losses, ref_params = tiny_reference
  mesh = _mesh(n, r)
  cfg = fsdp_jax.FSDPConfig(sharding_strategy=strategy, use_orig_params=use_orig_params,
                            lora=LORA, auto_wrap_policy=WRAP)
  state = fsdp_jax.init_train_state(params=params, optimizer=ADAMW, mesh=mesh, config=cfg,
                                    rng=KEY)
  step = fsdp_jax.shard_train_step(tiny_loss, mesh=mesh, config=cfg)
  colls = hlo.collectives(step.lower(state, batches[0]).compile().as_text())
  count = lambda kind: sum(1 for c in colls if c.kind == kind for shape in c.shapes if shape)
  planned = state.plan.collectives_per_step()
  trainable = [l for l in state.plan.leaves if not l.frozen]
  if strategy is S.NO_SHARD:
    assert count("reduce-scatter") == 0
    assert count("all-reduce") == planned["all-reduce"]
  else:
    assert count("reduce-scatter") == planned["reduce-scatter"]
    assert planned["reduce-scatter"] == (len(trainable) if use_orig_params else
                                         len(state.plan.trainable_units))
    # Hybrid: one all-reduce over the replicas per trainable unit.
    assert count("all-reduce") == planned["all-reduce"] == (
        len(state.plan.trainable_units) if r else 0)
  losses = []
  for batch in batches:
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  full = fsdp_jax.summon_full_params(state)
  assert_close(full, ref_params)
  # The loss changed the adapters and the trainable head, nothing else.
  np.testing.assert_array_equal(full["emb"], params["emb"])
  np.testing.assert_array_equal(full["layers"][0]["norm"], params["layers"][0]["norm"])
  assert not np.allclose(full["layers"][0]["wq"], params["layers"][0]["wq"])
  assert not np.allclose(full["head"], params["head"])


def test_stacked_layers_scan_with_accumulation_and_clipping():
  params, batches = stacked_params(), tiny_batches(rows=12)
  opt = optax.adam(1e-2)
  ref_losses, ref_params = reference(params, stacked_loss, LORA, opt, batches,
                                     stacked=("layers",), max_norm=0.05)
  for orig in (True, False):
    state, losses = run(params, stacked_loss, LORA, opt, batches, mesh=_mesh(3),
                        use_orig_params=orig, stacked=("layers",), max_norm=0.05,
                        gradient_accumulation_steps=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_close(fsdp_jax.summon_full_params(state), ref_params)
    assert state.plan.lora_report.adapter_path == {"layers.wq", "layers.wo"}


def test_bf16_mixed_precision_matches_one_device(tiny_reference):
  params, batches = tiny_params(), tiny_batches()
  mp = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
  opt = ADAMW
  results = []
  for n in (1, 4):
    cfg = fsdp_jax.FSDPConfig(lora=LORA, use_orig_params=True, mixed_precision=mp,
                              auto_wrap_policy=WRAP)
    mesh = _mesh(n)
    state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=cfg,
                                      rng=KEY)
    step = fsdp_jax.shard_train_step(tiny_loss, mesh=mesh, config=cfg)
    losses = []
    for b in batches:
      state, m = step(state, b)
      losses.append(float(m["loss"]))
    results.append((losses, fsdp_jax.summon_full_params(state)))
  np.testing.assert_allclose(results[0][0], results[1][0], rtol=8e-3)  # 2 bf16 ulps
  assert_close(results[0][1], results[1][1], rtol=2e-2, atol=2e-3)
  # And close to the float32 reference (bf16 compute).
  ref_losses, _ = tiny_reference
  np.testing.assert_allclose(results[1][0], ref_losses, rtol=2e-2)


def test_flax_linen_model_targets_modules():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      q = nn.Dense(8, use_bias=False, name="wq")(x)
      v = nn.Dense(8, name="wv")(x)
      return nn.LayerNorm(name="norm")(x + nn.Dense(6, name="wo")(jnp.tanh(q) * v))

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(2):
        x = Block(name=f"block_{i}")(x)
      return nn.Dense(3, name="head")(x)

  model = Model()
  x = jax.random.normal(jax.random.key(0), (12, 6))
  y = jax.random.normal(jax.random.key(1), (12, 3))
  params = jax.jit(model.init)(jax.random.key(2), x)["params"]  # one program, not op by op
  loss_fn = lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)
  lora = fsdp_jax.LoRA(targets=("*.wq", "*.wv"), rank=2, alpha=4.0, trainable=("*.norm",))
  batches = [{"x": x, "y": y}] * 3
  opt = optax.adam(1e-2)
  ref_losses, ref_params = reference(params, loss_fn, lora, opt, batches)
  state, losses = run(params, loss_fn, lora, opt, batches, mesh=_mesh(4),
                      wrap=fsdp_jax.ModuleWrapPolicy(["block_*"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_close(fsdp_jax.summon_full_params(state), ref_params)
  names = {l.name for l in state.plan.leaves}
  assert "block_0.wq.kernel.lora_A" in names and "block_0.wv.bias" in names
  frozen = {l.name for l in state.plan.leaves if l.frozen}
  assert "block_0.wv.bias" in frozen and "block_0.norm.scale" not in frozen
  assert state.plan.lora_report.adapter_path == {f"block_{i}.w{c}.kernel"
                                                 for i in range(2) for c in "qv"}


def test_flax_nnx_model():
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, d, rngs):
      self.wq = nnx.Linear(d, d, rngs=rngs)
      self.wo = nnx.Linear(d, d, use_bias=False, rngs=rngs)
      self.norm = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, x):
      return self.norm(x + self.wo(jnp.tanh(self.wq(x))))

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([Block(6, rngs) for _ in range(2)])
      self.head = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
      for b in self.blocks:
        x = b(x)
      return self.head(x)

  # Built under one jit (op by op, each initialiser is a program of its own).
  graphdef = nnx.split(nnx.eval_shape(lambda: Model(nnx.Rngs(0))), nnx.Param)[0]
  params = jax.jit(lambda: nnx.split(Model(nnx.Rngs(0)), nnx.Param)[1])()

  def loss_fn(p, b):
    return jnp.mean((nnx.merge(graphdef, p)(b["x"]) - b["y"]) ** 2)

  x = jax.random.normal(jax.random.key(0), (12, 6))
  batches = [{"x": x, "y": jnp.sin(x[:, :3])}] * 3
  lora = fsdp_jax.LoRA(targets=("*.wq", "*.wo"), rank=2, trainable=("head",))
  opt = optax.adam(1e-2)
  ref_losses, ref_params = reference(params, loss_fn, lora, opt, batches)
  state, losses = run(params, loss_fn, lora, opt, batches, mesh=_mesh(3))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  full = fsdp_jax.summon_full_params(state)
  assert jax.tree.structure(full) == jax.tree.structure(params)
  assert_close(full, ref_params)
  names = {l.name for l in state.plan.leaves}
  assert "blocks.0.wq.kernel.lora_A" in names  # NNX's .value left out, as elsewhere
  assert state.plan.lora_report.adapter_path == {f"blocks.{i}.w{c}.kernel"
                                                 for i in range(2) for c in "qo"}


def test_adapter_path_skips_the_base_weight_gradient():
  """x @ A @ B beside x @ W: the compiled LoRA step does far fewer flops
  than the same step with the merged weight (which forms dW whole)."""
  d = 256
  params = {"w1": jax.random.normal(jax.random.key(0), (d, d)) / 16,
            "w2": jax.random.normal(jax.random.key(1), (d, d)) / 16}
  loss_fn = lambda p, b: jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"]) ** 2)
  batch = {"x": jax.random.normal(jax.random.key(2), (64, d))}
  mesh = _mesh(2)

  def flops(lora, requires_grad=None):
    cfg = fsdp_jax.FSDPConfig(lora=lora, use_orig_params=True)
    state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                      config=cfg, requires_grad=requires_grad)
    step = fsdp_jax.shard_train_step(loss_fn, mesh=mesh, config=cfg)
    return step.lower(state, batch).compile().cost_analysis()["flops"]

  full = flops(None)
  lora = flops(fsdp_jax.LoRA(targets=("w1", "w2"), rank=4))
  # Full fine-tuning forms both weight gradients (2 * 32 * d * d flops each
  # on a device holding 32 rows of the batch); LoRA forms neither, and its
  # adapters cost 4 / d of a matmul each.
  dw = 2 * 32 * d * d
  assert full - lora > 1.8 * dw
  assert lora < 0.8 * full


def test_embedding_lookup_falls_back_to_the_merged_weight_and_says_so():
  params, batches = tiny_params(), tiny_batches()
  lora = fsdp_jax.LoRA(targets=("emb", "*.wq"), rank=2)
  opt = optax.sgd(0.5)
  ref_losses, ref_params = reference(params, tiny_loss, lora, opt, batches)
  with pytest.warns(UserWarning, match="'emb' is used through"):
    state, losses = run(params, tiny_loss, lora, opt, batches, mesh=_mesh(3))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_close(fsdp_jax.summon_full_params(state), ref_params)
  text = str(state.plan)
  assert "merged weight W + scale * A @ B (its gradient formed whole): emb" in text
  assert "adapter path x @ W + scale * (x @ A) @ B: 1 of 2 targets" in text


def test_transposed_kernel_takes_the_adapter_path():
  """``h @ W.T`` (a tied projection, a PyTorch-layout kernel) is a matmul of
  the transposed kernel: (A @ B).T = B.T @ A.T, no merged weight."""
  d = 9
  params = {"proj": jax.random.normal(jax.random.key(0), (d, 4)) * 0.5,
            "mid": jnp.eye(4) + 0.1}
  loss_fn = lambda p, b: jnp.mean((jnp.tanh(b["x"] @ p["proj"] @ p["mid"]) @ p["proj"].T
                                   - b["x"]) ** 2)
  batches = [{"x": jax.random.normal(jax.random.key(s), (6, d))} for s in range(3)]
  lora = fsdp_jax.LoRA(targets=("proj",), rank=2, alpha=2.0)
  opt = optax.adam(5e-2)
  ref_losses, ref_params = reference(params, loss_fn, lora, opt, batches)
  state, losses = run(params, loss_fn, lora, opt, batches, mesh=_mesh(3))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_close(fsdp_jax.summon_full_params(state), ref_params)
  assert state.plan.lora_report.adapter_path == {"proj"} and not state.plan.lora_report.merged


def test_dropout_draws_per_step_and_is_refused_on_a_merged_use():
  params, batches = tiny_params(), tiny_batches()
  mesh = _mesh(2)
  lora = fsdp_jax.LoRA(targets=("*.wq",), rank=2, dropout=0.5)
  plain = fsdp_jax.LoRA(targets=("*.wq",), rank=2)
  opt = optax.sgd(1.0)
  # B starts at zero: dropout changes nothing in the first loss, then does.
  step = fsdp_jax.shard_train_step(tiny_loss, mesh=mesh,
                                   config=fsdp_jax.FSDPConfig(lora=lora, use_orig_params=True))
  s1, l1 = run(params, tiny_loss, lora, opt, batches, mesh=mesh, step=step)
  s2, l2 = run(params, tiny_loss, lora, opt, batches, mesh=mesh, step=step)  # a rerun
  l3, _ = reference(params, tiny_loss, plain, opt, batches)  # the same LoRA without dropout
  assert l1 == l2  # deterministic: the masks come from the state's rng
  assert l1[0] == pytest.approx(l3[0], rel=1e-6)
  assert l1[1:] != pytest.approx(l3[1:], rel=1e-6)
  bad = fsdp_jax.LoRA(targets=("emb",), rank=2, dropout=0.1)
  with pytest.raises(ValueError, match="dropout=0.1.*'emb'.*Fix: pass dropout=0.0"):
    run(params, tiny_loss, bad, opt, batches[:1], mesh=mesh)


# NF4 with flat parameters here; int8 with original parameters on N-D kernels
# (test_nd_quantized_base_matches_reference_on_decoded_weights).
@pytest.mark.parametrize("q,use_orig_params", [
    (fsdp_jax.Quantization(dtype="nf4", block_size=4), False)])
def test_quantized_base_matches_reference_on_decoded_weights(q, use_orig_params):
  params, batches = tiny_params(), tiny_batches()
  lora = fsdp_jax.LoRA(targets=("*.wq", "*.wo"), rank=3, base_quantization=q)
  opt = optax.adam(1e-2)
  ref_losses, ref_params = reference(params, tiny_loss, lora, opt, batches)
  state, losses = run(params, tiny_loss, lora, opt, batches, mesh=_mesh(3),
                      use_orig_params=use_orig_params, wrap=WRAP)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_close(fsdp_jax.summon_full_params(state), ref_params)
  base = [l for l in state.plan.leaves if l.name == "layers.0.wq.base"][0]
  assert base.dtype == np.uint8 and base.shape == (10, q.payload_bytes(10))
  assert base.frozen


def test_quantized_base_keeps_no_decoded_kernel_for_backward():
  """QLoRA decodes each kernel where it is used, and again in backward:
  its compiled step needs no more temporary memory than LoRA's (decoded
  kernels kept from forward would make it larger)."""
  params, batch = tiny_params(d=256, layers=2), tiny_batches(1, rows=8, seq=4)[0]
  mesh = _mesh(4)
  temp = {}
  for name, q in [("lora", None), ("qlora", fsdp_jax.Quantization(dtype="nf4", block_size=64))]:
    lora = fsdp_jax.LoRA(targets=("*.wq", "*.wo"), rank=4, base_quantization=q)
    cfg = fsdp_jax.FSDPConfig(use_orig_params=True, lora=lora, auto_wrap_policy=WRAP)
    state = fsdp_jax.init_train_state(params=params, optimizer=optax.adam(1e-3), mesh=mesh,
                                      config=cfg, rng=KEY)
    step = fsdp_jax.shard_train_step(tiny_loss, mesh=mesh, config=cfg)
    temp[name] = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
  assert temp["qlora"] <= temp["lora"], temp


def test_bf16_kernels_get_float32_adapters_as_in_peft():
  """PEFT's autocast_adapter_dtype: a 16-bit model's adapters (and their
  optimizer state) are float32; the adapter path runs in float32 and adds
  into the base matmul's bf16 output."""
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_params())
  batches = tiny_batches()
  opt = optax.adam(1e-2)
  state, losses = run(params, tiny_loss, LORA, opt, batches, mesh=_mesh(3))
  dtypes = {l.name: np.dtype(l.dtype) for l in state.plan.leaves}
  assert dtypes["layers.0.wq.lora_A"] == np.float32 and dtypes["layers.0.wq.base"] == jnp.bfloat16
  assert dtypes["head"] == jnp.bfloat16  # a fully trained leaf keeps its dtype
  full = fsdp_jax.summon_full_params(state)
  assert full["layers"][0]["wq"].dtype == jnp.bfloat16
  ref_losses, _ = reference(params, tiny_loss, LORA, opt, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-2)
  assert losses[-1] < losses[0]


def test_checkpoint_holds_adapters_only_and_resumes_bitwise(tmp_path):
  params, batches = tiny_params(d=128), tiny_batches()
  opt = optax.adam(1e-2)
  mesh = _mesh(4)
  cfg = fsdp_jax.FSDPConfig(lora=LORA, use_orig_params=True, auto_wrap_policy=WRAP)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=cfg, rng=KEY)
  step = fsdp_jax.shard_train_step(tiny_loss, mesh=mesh, config=cfg)
  state, _ = step(state, batches[0])
  with fsdp_jax.CheckpointManager(tmp_path / "ckpt") as mgr:
    mgr.save(state, force=True)
    mgr.wait_until_finished()
    meta = mgr.metadata()
  saved = set(meta["params"])
  assert saved == {l.name for l in state.plan.leaves if not l.frozen}
  size = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*") if f.is_file())
  base_bytes = sum(l.numel * 4 for l in state.plan.leaves if l.frozen)
  assert size < base_bytes  # the frozen base is not in it
  # Resume: a fresh state from the same base, restored, continues bitwise.
  fresh = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=cfg,
                                    rng=KEY)
  with fsdp_jax.CheckpointManager(tmp_path / "ckpt") as mgr:
    restored = mgr.restore(fresh)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(restored.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  s1, m1 = step(state, batches[1])
  s2, m2 = step(restored, batches[1])
  assert float(m1["loss"]) == float(m2["loss"])
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # A different LoRA is refused by name.
  other = fsdp_jax.FSDPConfig(lora=fsdp_jax.LoRA(targets=("*.wq", "*.wo"), rank=3, alpha=1.0,
                                                 trainable=("head",)),
                              use_orig_params=True, auto_wrap_policy=WRAP)
  target = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=other)
  with fsdp_jax.CheckpointManager(tmp_path / "ckpt") as mgr:
    with pytest.raises(ValueError, match="lora: checkpoint .*'alpha': 6.0"):
      mgr.restore(target)


def test_init_fn_gives_the_same_state_as_params():
  params = tiny_params()
  mesh = _mesh(3)
  cfg = fsdp_jax.FSDPConfig(lora=LORA, use_orig_params=False, auto_wrap_policy=WRAP)
  a = fsdp_jax.init_train_state(params=params, optimizer=optax.adam(1e-3), mesh=mesh,
                                config=cfg, rng=KEY)
  b = fsdp_jax.init_train_state(init_fn=lambda k: tiny_params(), optimizer=optax.adam(1e-3),
                                mesh=mesh, config=cfg, rng=KEY)
  # A's uniform draw runs in different programs (XLA may fuse it differently).
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)
  units = [u.display_name for u in a.plan.units]
  assert "layers.0.lora_adapters" in units and "trainable" in units


# --------------------------------------------------------------------------
# N-D kernels: Flax DenseGeneral / einsum attention

ND, HEADS, HEAD_DIM = 9, 3, 2


class _Attention(nn.Module):
  @nn.compact
  def __call__(self, x):
    q = nn.DenseGeneral((HEADS, HEAD_DIM), name="q")(x)          # [d, heads, head_dim]
    v = nn.DenseGeneral((HEADS, HEAD_DIM), use_bias=False, name="v")(x)
    s = jnp.einsum("btnh,bsnh->bnts", q, q) / np.sqrt(HEAD_DIM)
    a = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s), v)
    return x + nn.DenseGeneral(ND, axis=(-2, -1), name="o")(a)   # [heads, head_dim, d]


class _NDModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="head")(_Attention(name="blk_0")(x))


ND_LORA = fsdp_jax.LoRA(targets=("q", "v", "o"), rank=2, alpha=4.0, trainable=("head",),
                        input_dims={"*.o": 2})


@pytest.fixture(scope="module")
def nd_model():
  model = _NDModel()
  x = jax.random.normal(jax.random.key(0), (12, 3, ND))
  y = jax.random.normal(jax.random.key(1), (12, 3, 4))
  params = jax.jit(model.init)(jax.random.key(2), x)["params"]  # one program, not op by op
  loss_fn = lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)
  return params, loss_fn, [{"x": x, "y": y}] * 2


def test_nd_factors_and_their_merge():
  """A [d, heads, head_dim] kernel gets A [d, r] and B [r, heads, head_dim];
  input_dims=2 makes a [heads, head_dim, d] kernel's A [heads, head_dim, r]
  and B [r, d]; the merged kernel is W + s * einsum over r."""
  params = {"q": {"w": jnp.ones((ND, HEADS, HEAD_DIM))}, "o": {"w": jnp.ones((HEADS, HEAD_DIM, ND))}}
  lora = fsdp_jax.LoRA(targets=("q", "o"), rank=2, input_dims={"o": 2})
  stored = lora_lib.adapter_tree(params, lora, lora_lib.find_targets(params, lora), KEY)
  q, o = stored["q"]["w"], stored["o"]["w"]
  assert (q.lora_A.shape, q.lora_B.shape) == ((ND, 2), (2, HEADS, HEAD_DIM))
  assert (o.lora_A.shape, o.lora_B.shape) == ((HEADS, HEAD_DIM, 2), (2, ND))
  o = o.replace(lora_B=jnp.arange(2.0 * ND).reshape(2, ND))
  np.testing.assert_allclose(lora_lib.merge(o, 0.5),
                             1 + 0.5 * jnp.einsum("nhr,rd->nhd", o.lora_A, o.lora_B), rtol=1e-6)


# Flat parameters on 4 devices here; original parameters on 3 in
# test_nd_quantized_base_matches_reference_on_decoded_weights.
@pytest.mark.parametrize("n,use_orig_params", [(4, False)])
def test_dense_general_kernels_match_single_device_reference(nd_model, n, use_orig_params):
  """LoRA on DenseGeneral projections [d, heads, head_dim] and an output
  projection [heads, head_dim, d] (input_dims=2): each is a matmul operand of
  its dot_general, computed through the adapter path."""
  params, loss_fn, batches = nd_model
  opt = optax.adam(1e-2)
  ref_losses, ref_params = reference(params, loss_fn, ND_LORA, opt, batches)
  state, losses = run(params, loss_fn, ND_LORA, opt, batches, mesh=_mesh(n),
                      use_orig_params=use_orig_params, wrap=fsdp_jax.ModuleWrapPolicy(["blk_*"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_close(fsdp_jax.summon_full_params(state), ref_params)
  report = state.plan.lora_report
  assert report.adapter_path == {f"blk_0.{m}.kernel" for m in "qvo"}
  assert not report.merged
  # The state dict holds the N-D factors by name, and loads back.
  sd = fsdp_jax.state_dict(state)
  assert sd["blk_0.o.kernel.lora_A"].shape == (HEADS, HEAD_DIM, 2)
  assert sd["blk_0.q.kernel.lora_B"].shape == (2, HEADS, HEAD_DIM)
  fresh = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=state.plan.mesh,
                                    config=state.plan.config, rng=KEY)
  assert_close(fsdp_jax.summon_full_params(fsdp_jax.load_state_dict(fresh, sd)),
               ref_params)


def test_nd_kernel_contracted_over_other_dims_falls_back_and_names_input_dims(nd_model):
  params, loss_fn, batches = nd_model
  lora = fsdp_jax.LoRA(targets=("o",), rank=2)  # input_dims=1: [heads] x [head_dim, d]
  mesh = _mesh(2)
  cfg = fsdp_jax.FSDPConfig(lora=lora, use_orig_params=True)
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=cfg, rng=KEY)
  with pytest.warns(UserWarning, match=r"'blk_0.o.kernel' is used through a dot_general "
                                       r"contracting kernel dims \(0, 1\).*input_dims"):
    fsdp_jax.shard_train_step(loss_fn, mesh=mesh, config=cfg).lower(state, batches[0])


def test_nd_quantized_base_matches_reference_on_decoded_weights(nd_model):
  """QLoRA on N-D kernels: each kernel row (its output dims flattened) is
  quantized; the loss sees the decoded base plus the adapter."""
  params, loss_fn, batches = nd_model
  q = fsdp_jax.Quantization(dtype=jnp.int8, block_size=4)
  lora = dataclasses.replace(ND_LORA, base_quantization=q)
  opt = optax.adam(1e-2)
  ref_losses, ref_params = reference(params, loss_fn, lora, opt, batches)
  state, losses = run(params, loss_fn, lora, opt, batches, mesh=_mesh(3))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  assert_close(fsdp_jax.summon_full_params(state), ref_params)
  shapes = {l.name: l.shape for l in state.plan.leaves}
  assert shapes["blk_0.q.kernel.base"] == (ND, q.payload_bytes(HEADS * HEAD_DIM))
  assert shapes["blk_0.o.kernel.base"] == (HEADS, HEAD_DIM, q.payload_bytes(ND))


# --------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("lora,match", [
    (fsdp_jax.LoRA(targets=("*.wk",)),
     r"LoRA target '\*.wk' matches no parameter.*'layers.0.wq'.*Fix the pattern"),
    (fsdp_jax.LoRA(targets=("*.norm",)),
     r"'layers.0.norm' of shape \(10,\), which is not 2-D.*Fix: narrow the pattern"),
    (fsdp_jax.LoRA(targets=("*.wq",), input_dims=2),
     r"input_dims=...\) gives target 'layers.0.wq' \(shape \(10, 10\)\) 2 input.*Fix"),
    (fsdp_jax.LoRA(targets=("*.wq",), rank=11),
     r"rank=11\) is larger than a dimension of target 'layers.0.wq' \(shape \(10, 10\): "
     r"10 inputs, 10 outputs\), whose min\(m, n\) = 10 is the smallest.*Fix: pass "
     r"rank<=10"),
    # The limit that fits every target: the head's 5 outputs, not the first
    # target's 10.
    (fsdp_jax.LoRA(targets=("*.wq", "head", "*.wo"), rank=11),
     r"rank=11\) is larger than a dimension of target 'head' \(shape \(10, 5\): 10 inputs, "
     r"5 outputs\), whose min\(m, n\) = 5 is the smallest over all 3 targets .*; 2 other "
     r"target\(s\) are below the rank too \('layers.0.wo', 'layers.0.wq'\)\. Fix: pass "
     r"rank<=5, or narrow "
     r"targets=\('\*.wq', 'head', '\*.wo'\) to leave out 'head' and the others"),
    (fsdp_jax.LoRA(targets=("*.wq",), trainable=("nothing",)),
     r"trainable=...\) entry 'nothing' matches no parameter"),
    (fsdp_jax.LoRA(targets=("*.wq",), trainable=("layers",),
                   base_quantization=fsdp_jax.Quantization(dtype=jnp.int8)),
     r"'layers.0.wq'.*LoRA\(trainable=...\).*base_quantization"),
])
def test_bad_targets_are_refused_naming_pattern_leaf_shape_and_fix(lora, match):
  with pytest.raises(ValueError, match=match):
    fsdp_jax.init_train_state(params=tiny_params(), optimizer=optax.sgd(0.1), mesh=_mesh(2),
                              config=fsdp_jax.FSDPConfig(lora=lora, use_orig_params=True))


def test_bad_options_are_refused():
  with pytest.raises(ValueError, match="rank=0"):
    fsdp_jax.LoRA(targets=("a",), rank=0)
  with pytest.raises(ValueError, match="dropout=1.0"):
    fsdp_jax.LoRA(targets=("a",), dropout=1.0)
  with pytest.raises(ValueError, match="targets"):
    fsdp_jax.LoRA(targets=())
  with pytest.raises(ValueError, match=r"input_dims=...\) for '\*.o': 0 must be a positive"):
    fsdp_jax.LoRA(targets=("a",), input_dims={"*.o": 0})
  with pytest.raises(ValueError, match="stochastic"):
    fsdp_jax.LoRA(targets=("a",), base_quantization=fsdp_jax.Quantization(rounding="stochastic"))
  with pytest.raises(TypeError, match="lora=.*fsdp_jax.LoRA"):
    fsdp_jax.FSDPConfig(lora={"targets": "a"})
  with pytest.raises(ValueError, match="requires_grad=.*LoRA\\(trainable"):
    fsdp_jax.init_train_state(params=tiny_params(), optimizer=optax.sgd(0.1), mesh=_mesh(2),
                              config=fsdp_jax.FSDPConfig(lora=LORA),
                              requires_grad={"emb": False})
