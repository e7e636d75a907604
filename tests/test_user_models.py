"""Models as users bring them: BatchNorm, dropout keys, weighted losses, NNX
state, equinox, and scanned layers.

Five model families, each written in the style of its public source and
checked against that framework's own single-device training loop on the
same global batch:

1. a Flax linen lm1b-style Transformer (flax/examples/lm1b): a padded,
   weighted cross-entropy returned as ``fsdp_jax.WeightedLoss``, and dropout
   keys from ``loss_fn(..., rng=)`` — against ``jax.jit``;
2. a Flax linen ResNet (flax/examples/imagenet) whose
   ``nn.BatchNorm(axis_name="batch")`` reduces over the data-parallel world
   through ``FSDPConfig(data_axis_name="batch")``, its ``batch_stats`` split
   from ``init_fn`` into the model state — against ``jax.jit``;
3. a Flax NNX Transformer with ``nnx.Dropout`` (its ``RngState`` in the model
   state), ``nnx.LayerNorm`` and ``nnx.BatchNorm`` — against ``nnx.jit``;
4. an equinox Transformer, wrapped by equinox module class — against
   ``eqx.filter_jit``;
5. a linen ``nn.scan(nn.remat(Block))`` stack, with and without
   ``stacked_layers`` — against ``jax.jit``.

Sizes are small and uneven (no mesh size divides them). Dropout cannot match
a global-batch program mask for mask (each device draws its own rows'
masks), so those references run the same computation on each device's rows
with the keys the step documents (``fold_in(fold_in(rng, step), device)``),
which proves the keys are different per step and device and deterministic;
the same models with dropout off are compared with the plain global-batch
program.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fsdp_jax
from fsdp_jax import CheckpointManager

from helpers import (REFERENCE_COMPILER_OPTIONS, assert_trees_close, jit_reference_run,
                     train_steps)

# Each test compiles a real model (a transformer, a ResNet) sharded and as the
# jitted reference: seconds apiece.
pytestmark = pytest.mark.slow

S = fsdp_jax.ShardingStrategy
FULL_SHARD, SHARD_GRAD_OP, NO_SHARD = S.FULL_SHARD, S.SHARD_GRAD_OP, S.NO_SHARD
HYBRID_SHARD, HYBRID_ZERO2 = S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2

NUM_STEPS = 3
LOSS_ATOL = 1e-5


def make_mesh(shard, replicate=None):
  devices = jax.devices()[: shard * (replicate or 1)]
  return fsdp_jax.make_mesh(shard=shard, replicate=replicate, devices=devices)


def world_of(shard, replicate):
  return shard * (replicate or 1)


def assert_moved(new, old, atol=1e-5):
  """Training changed the parameters (so matching means something)."""
  diffs = [np.max(np.abs(np.asarray(a) - np.asarray(b))) for a, b in
           zip(jax.tree.leaves(jax.device_get(new)), jax.tree.leaves(jax.device_get(old)))]
  assert max(diffs) > atol and np.mean([d > atol for d in diffs]) > 0.5, diffs


def device_keys(rng, step, world, micro=1):
  """The keys the step passes to ``loss_fn(..., rng=)``: one per device (and
  per microbatch with accumulation), in the order of the batch's rows."""
  out = []
  for d in range(world):
    key = jax.random.fold_in(jax.random.fold_in(rng, step), d)
    out.extend([key] if micro == 1 else [jax.random.fold_in(key, m) for m in range(micro)])
  return out


def chunks(batch, n):
  return [jax.tree.map(lambda x: x[i * (x.shape[0] // n):(i + 1) * (x.shape[0] // n)], batch)
          for i in range(n)]


# --------------------------------------------------------------------------
# 1. lm1b: flax/examples/lm1b/models.py, trimmed; weighted loss, dropout


@dataclasses.dataclass(frozen=True)
class LmConfig:
  vocab_size: int = 29
  emb_dim: int = 14
  num_heads: int = 2
  qkv_dim: int = 14
  mlp_dim: int = 22
  num_layers: int = 1  # one wrapped block and the root: two units
  max_len: int = 10
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  deterministic: bool = False


def shift_right(x, axis=1):
  pad_widths = [(0, 0)] * len(x.shape)
  pad_widths[axis] = (1, 0)
  padded = jnp.pad(x, pad_widths, mode="constant", constant_values=x.dtype.type(0))
  return jax.lax.dynamic_slice_in_dim(padded, 0, padded.shape[axis] - 1, axis)


class AddPositionEmbs(nn.Module):
  config: LmConfig

  @nn.compact
  def __call__(self, inputs):
    shape = (1, self.config.max_len, inputs.shape[-1])
    pe = self.param("pos_embedding", nn.initializers.normal(stddev=0.02), shape)
    return inputs + pe[:, :inputs.shape[1], :]


class MlpBlock(nn.Module):
  config: LmConfig

  @nn.compact
  def __call__(self, inputs):
    cfg = self.config
    x = nn.Dense(cfg.mlp_dim)(inputs)
    x = nn.relu(x)
    x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)
    out = nn.Dense(inputs.shape[-1])(x)
    return nn.Dropout(rate=cfg.dropout_rate)(out, deterministic=cfg.deterministic)


class EncoderDecoder1DBlock(nn.Module):
  config: LmConfig

  @nn.compact
  def __call__(self, inputs, decoder_mask=None):
    cfg = self.config
    x = nn.LayerNorm()(inputs)
    x = nn.MultiHeadDotProductAttention(
        num_heads=cfg.num_heads, qkv_features=cfg.qkv_dim, use_bias=False,
        broadcast_dropout=False, dropout_rate=cfg.attention_dropout_rate,
        deterministic=cfg.deterministic)(x, mask=decoder_mask)
    x = nn.Dropout(rate=cfg.dropout_rate)(x, deterministic=cfg.deterministic)
    x = x + inputs
    z = nn.LayerNorm()(x)
    z = MlpBlock(config=cfg)(z)
    return x + z


class Decoder(nn.Module):
  config: LmConfig

  @nn.compact
  def __call__(self, inputs, decoder_mask=None):
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.emb_dim,
                     embedding_init=nn.initializers.normal(stddev=1.0))
    y = embed(shift_right(inputs).astype("int32"))
    y = AddPositionEmbs(config=cfg, name="posembed_output")(y)
    y = nn.Dropout(rate=cfg.dropout_rate)(y, deterministic=cfg.deterministic)
    for lyr in range(cfg.num_layers):
      y = EncoderDecoder1DBlock(config=cfg, name=f"encoderdecoderblock_{lyr}")(y, decoder_mask)
    y = nn.LayerNorm(name="encoderdecoder_norm")(y)
    return embed.attend(y.astype(jnp.float32)) / jnp.sqrt(y.shape[-1])


class TransformerLM(nn.Module):
  config: LmConfig

  @nn.compact
  def __call__(self, inputs):
    decoder_mask = nn.combine_masks(
        nn.make_attention_mask(inputs > 0, inputs > 0), nn.make_causal_mask(inputs))
    return Decoder(config=self.config, name="decoder")(inputs, decoder_mask=decoder_mask)


def compute_weighted_cross_entropy(logits, targets, weights):
  """lm1b's loss: the weighted sum and the normalising factor."""
  onehot = jax.nn.one_hot(targets, logits.shape[-1])
  loss = -jnp.sum(onehot * nn.log_softmax(logits), axis=-1)
  return (loss * weights).sum(), weights.sum()


def lm_parts(model):
  """``(total, weight)`` of a batch, as lm1b's train_step computes them."""

  def parts(params, inputs, rng=None):
    weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
    rngs = None if rng is None else {"dropout": rng}
    logits = model.apply(params, inputs, rngs=rngs)
    return compute_weighted_cross_entropy(logits, inputs, weights)

  return parts


def lm_loss_fn(model):
  """The loss_fn given to fsdp_jax: lm1b's loss as a WeightedLoss."""
  parts = lm_parts(model)

  def loss_fn(params, batch):
    total, weight = parts(params, batch["inputs"])
    return fsdp_jax.WeightedLoss(total=total, weight=weight)

  return loss_fn


def lm_loss_rng(model):
  """The same with dropout: the step's key goes to ``rngs={"dropout": rng}``."""
  parts = lm_parts(model)

  def loss_fn(params, batch, *, rng):
    total, weight = parts(params, batch["inputs"], rng)
    return fsdp_jax.WeightedLoss(total=total, weight=weight)

  return loss_fn


def lm_batches(n_rows, seed=3):
  """Token rows padded with 0 to uneven lengths: devices hold different
  numbers of real tokens, so a mean of per-device ratios is wrong."""
  rng = np.random.default_rng(seed)
  cfg = LmConfig()
  out = []
  for _ in range(NUM_STEPS):
    tokens = rng.integers(1, cfg.vocab_size, (n_rows, cfg.max_len)).astype(np.int32)
    lengths = rng.integers(2, cfg.max_len + 1, n_rows)
    lengths[: n_rows // 3] = 2  # the first rows (device 0) are short
    tokens[np.arange(cfg.max_len)[None, :] >= lengths[:, None]] = 0
    out.append({"inputs": tokens})
  return out


LM_ROWS = 12
LM_OPT = optax.sgd(0.5, momentum=0.9)  # not scale invariant, unlike Adam


@functools.lru_cache(maxsize=None)
def lm_model(deterministic):
  return TransformerLM(LmConfig(deterministic=deterministic))


LM_X = jnp.ones((1, LmConfig().max_len), jnp.int32)


def lm_init(rng):
  return lm_model(True).init(rng, LM_X)


@functools.lru_cache(maxsize=None)
def lm_init_params():
  return jax.jit(lm_init)(jax.random.key(0))


@functools.lru_cache(maxsize=None)
def lm_reference():
  """lm1b's train step under one jax.jit on the global batch, dropout off."""
  model = lm_model(True)
  parts = lm_parts(model)

  def ref_step(params, opt_state, batch):
    def mean_loss(p):
      total, weight = parts(p, batch["inputs"])
      return total / weight
    loss, grads = jax.value_and_grad(mean_loss)(params)
    updates, opt_state = LM_OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, grads

  batches = lm_batches(LM_ROWS)
  params = lm_init_params()
  opt_state = LM_OPT.init(params)
  compiled = jax.jit(ref_step).lower(params, opt_state, batches[0]).compile(
      REFERENCE_COMPILER_OPTIONS)
  losses, first_grads = [], None
  for batch in batches:
    params, opt_state, loss, grads = compiled(params, opt_state, batch)
    first_grads = grads if first_grads is None else first_grads
    losses.append(float(loss))
  return batches, losses, jax.device_get(params), jax.device_get(first_grads)


def lm_config(strategy, orig, **kw):
  return fsdp_jax.FSDPConfig(
      sharding_strategy=strategy, use_orig_params=orig,
      auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({EncoderDecoder1DBlock}), **kw)


@pytest.mark.parametrize("strategy, shard, replicate, orig, accumulate", [
    pytest.param(FULL_SHARD, 3, None, False, None, id="FULL_SHARD-3-flat"),
    pytest.param(SHARD_GRAD_OP, 4, None, True, None, id="SHARD_GRAD_OP-4-orig"),
    pytest.param(HYBRID_SHARD, 2, 2, True, ("sharded", 3), id="HYBRID_SHARD-2x2-orig-sharded3"),
])
def test_lm1b_weighted_loss_matches_global_batch_jit(strategy, shard, replicate, orig,
                                                     accumulate):
  """The weighted loss is the global batch's ratio: over a shard axis that
  divides no size, over a hybrid mesh's both axes with sharded accumulation
  (no_sync accumulation: the dropout test below; NO_SHARD reduces over its
  shard axis as FULL_SHARD does, and runs the other families)."""
  batches, ref_losses, ref_params, ref_grads = lm_reference()
  world = world_of(shard, replicate)
  params0 = lm_init_params()
  # The test has teeth: a mean of per-device ratios is 1000x the tolerance off.
  parts = jax.jit(lm_parts(lm_model(True)))
  per_device = [parts(params0, c["inputs"]) for c in chunks(batches[0], world)]
  mean_of_ratios = np.mean([float(t) / float(w) for t, w in per_device])
  assert abs(mean_of_ratios - ref_losses[0]) > 1e-3

  mesh = make_mesh(shard, replicate)
  config = lm_config(strategy, orig)
  kw = {} if accumulate is None else dict(accumulation=accumulate[0],
                                          gradient_accumulation_steps=accumulate[1])
  if strategy in (FULL_SHARD, HYBRID_SHARD):  # module classes captured from init_fn
    init = dict(init_fn=lm_init, rng=jax.random.key(0))
  else:
    init = dict(params=params0, module_classes=fsdp_jax.module_classes(
        lm_model(True).init, jax.random.key(0), LM_X))
  state = fsdp_jax.init_train_state(optimizer=LM_OPT, mesh=mesh, config=config, **init)
  assert [u.name for u in state.plan.units] == ["params.decoder.encoderdecoderblock_0", ""]
  loss_fn = lm_loss_fn(lm_model(True))
  if strategy is FULL_SHARD:
    # The gradient itself, before any optimizer: the global ratio's, exactly.
    grads = fsdp_jax.summon_full_params(
        state, with_grads=True, grads=fsdp_jax.custom.sharded_grads(loss_fn, state, batches[0]))[1]
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
  step = fsdp_jax.shard_train_step(loss_fn, LM_OPT, mesh=mesh, config=config, **kw)
  state, losses = train_steps(step, state, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-6)
  assert_moved(ref_params, params0)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params, rtol=1e-4, atol=1e-6)


@functools.lru_cache(maxsize=None)
def lm_dropout_reference(world, micro):
  """The global batch, each device's rows run with the key the step gives
  that device (and microbatch): ``sum(total) / sum(weight)`` over all."""
  parts = lm_parts(lm_model(False))
  n = world * micro

  def ref_step(params, opt_state, batch, keys):
    def ratio(p):  # each device's (microbatch's) rows with its key, batched
      rows = batch["inputs"].reshape((n, -1) + batch["inputs"].shape[1:])
      t, w = jax.vmap(lambda c, k: parts(p, c, k))(rows, jnp.stack(keys))
      return jnp.sum(t) / jnp.sum(w)
    loss, grads = jax.value_and_grad(ratio)(params)
    updates, opt_state = LM_OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  batches = lm_batches(LM_ROWS * micro, seed=4)
  params = lm_init_params()
  opt_state = LM_OPT.init(params)
  rng = jax.random.key(7)
  keys0 = device_keys(rng, 0, world, micro)
  compiled = jax.jit(ref_step).lower(params, opt_state, batches[0], keys0).compile(
      REFERENCE_COMPILER_OPTIONS)
  losses = []
  for i, batch in enumerate(batches):
    params, opt_state, loss = compiled(params, opt_state, batch,
                                       device_keys(rng, i, world, micro))
    losses.append(float(loss))
  return batches, losses, jax.device_get(params)


@pytest.mark.parametrize("strategy, shard, replicate, orig, accumulate", [
    pytest.param(FULL_SHARD, 4, None, False, None, id="FULL_SHARD-4-flat"),
    pytest.param(HYBRID_ZERO2, 2, 2, True, ("no_sync", 2), id="_HYBRID_SHARD_ZERO2-2x2-orig-no_sync2"),
])
def test_lm1b_dropout_keys_per_step_and_device_and_resume(strategy, shard, replicate, orig,
                                                          accumulate, tmp_path):
  world = world_of(shard, replicate)
  micro = 1 if accumulate is None else accumulate[1]
  batches, ref_losses, ref_params = lm_dropout_reference(world, micro)
  mesh = make_mesh(shard, replicate)
  config = lm_config(strategy, orig)
  kw = {} if accumulate is None else dict(accumulation=accumulate[0],
                                          gradient_accumulation_steps=micro)

  def fresh(seed):
    return fsdp_jax.init_train_state(
        params=lm_init_params(), optimizer=LM_OPT, mesh=mesh, config=config,
        rng=jax.random.key(seed), module_classes=fsdp_jax.module_classes(
            lm_model(True).init, jax.random.key(0), LM_X))

  state = fresh(7)
  assert jax.dtypes.issubdtype(state.rng.dtype, jax.dtypes.prng_key)
  step = fsdp_jax.shard_train_step(lm_loss_rng(lm_model(False)), LM_OPT, mesh=mesh,
                                   config=config, **kw)
  final, losses = train_steps(step, state, batches)
  # Each device's rows dropped out with fold_in(fold_in(rng, step), device):
  # the same numbers as the reference that uses exactly those keys.
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=LOSS_ATOL)
  assert_trees_close(fsdp_jax.summon_full_params(final), ref_params, rtol=1e-4, atol=1e-6)
  # Dropout is on: the loss differs from the same run without it.
  assert abs(losses[0] - lm_reference()[1][0]) > 1e-3 or accumulate is not None

  # Resume: two steps, a checkpoint, a restore into a state built with
  # another key, the last step: bitwise the uninterrupted run.
  state, _ = train_steps(step, fresh(7), batches[:2])
  with CheckpointManager(tmp_path / "ckpt") as manager:
    manager.save(state)
    manager.wait_until_finished()
    restored = manager.restore(fresh(123))
  np.testing.assert_array_equal(jax.random.key_data(restored.rng),
                                jax.random.key_data(jax.random.key(7)))
  assert int(restored.step) == 2
  resumed, last = train_steps(step, restored, batches[2:])
  assert last == losses[2:]
  for a, b in zip(jax.tree.leaves(fsdp_jax.summon_full_params(resumed)),
                  jax.tree.leaves(fsdp_jax.summon_full_params(final))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_loss_fn_rng_without_a_key_in_the_state_is_refused():
  state, make_step = _tiny_state()  # init_train_state without rng=
  assert state.rng is None

  def loss_fn(params, batch, *, rng):  # dropout, as lm_loss_rng draws it
    keep = jax.random.bernoulli(rng, 0.9, batch["x"].shape)
    return jnp.mean((jnp.where(keep, batch["x"], 0.0) @ params["w"]) ** 2)

  with pytest.raises(ValueError, match=r"loss_fn takes rng=.*init_train_state"):
    make_step(loss_fn).lower(state, {"x": np.ones((4, 3), np.float32)})


# --------------------------------------------------------------------------
# 2. ResNet: flax/examples/imagenet/models.py, trimmed; synced BatchNorm

ModuleDef = Any


class ResNetBlock(nn.Module):
  filters: int
  conv: ModuleDef
  norm: ModuleDef
  act: Callable
  strides: tuple = (1, 1)

  @nn.compact
  def __call__(self, x):
    residual = x
    y = self.conv(self.filters, (3, 3), self.strides)(x)
    y = self.norm()(y)
    y = self.act(y)
    y = self.conv(self.filters, (3, 3))(y)
    y = self.norm(scale_init=nn.initializers.zeros_init())(y)
    if residual.shape != y.shape:
      residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
      residual = self.norm(name="norm_proj")(residual)
    return self.act(residual + y)


class ResNet(nn.Module):
  stage_sizes: tuple = (1, 1)
  num_classes: int = 5
  num_filters: int = 4
  act: Callable = nn.relu
  bn_axis_name: Optional[str] = "batch"

  @nn.compact
  def __call__(self, x, train: bool = True):
    conv = functools.partial(nn.Conv, use_bias=False)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, axis_name=self.bn_axis_name)
    x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
    x = norm(name="bn_init")(x)
    x = nn.relu(x)
    x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
    for i, block_size in enumerate(self.stage_sizes):
      for j in range(block_size):
        strides = (2, 2) if i > 0 and j == 0 else (1, 1)
        x = ResNetBlock(self.num_filters * 2 ** i, strides=strides, conv=conv, norm=norm,
                        act=self.act)(x)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(self.num_classes)(x)


def resnet_loss(model):
  """imagenet's train_step loss: cross-entropy plus an L2 penalty, the
  running statistics updated by the model's own forward."""

  def loss_fn(params, batch, model_state):
    logits, new_model_state = model.apply({**params, **model_state}, batch["image"],
                                          mutable=["batch_stats"])
    one_hot = jax.nn.one_hot(batch["label"], 5)
    loss = jnp.mean(optax.softmax_cross_entropy(logits, one_hot))
    weight_l2 = sum(jnp.sum(x ** 2) for x in jax.tree.leaves(params) if x.ndim > 1)
    return loss + 1e-4 * 0.5 * weight_l2, new_model_state

  return loss_fn


RESNET_OPT = optax.sgd(0.1, momentum=0.9, nesterov=True)
IMAGE = jnp.ones((1, 6, 6, 3))


def resnet_init(rng):
  return ResNet().init(rng, IMAGE, train=False)


def resnet_batches(n=12):
  rng = np.random.default_rng(21)
  return [{"image": rng.normal(size=(n, 6, 6, 3)).astype(np.float32),
           "label": rng.integers(0, 5, n).astype(np.int32)} for _ in range(NUM_STEPS)]


@functools.lru_cache(maxsize=None)
def resnet_reference():
  """The same model on the global batch under one jax.jit: BatchNorm with
  axis_name=None normalises over the whole batch."""
  model = ResNet(bn_axis_name=None)
  loss_fn = resnet_loss(model)
  variables = jax.jit(resnet_init)(jax.random.key(0))
  params, stats = {"params": variables["params"]}, {"batch_stats": variables["batch_stats"]}

  def ref_step(params, stats, opt_state, batch):
    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, stats)
    updates, opt_state = RESNET_OPT.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), stats, opt_state, loss

  batches = resnet_batches()
  opt_state = RESNET_OPT.init(params)
  step = jax.jit(ref_step).lower(params, stats, opt_state, batches[0]).compile(
      REFERENCE_COMPILER_OPTIONS)
  p, s, losses = params, stats, []
  for batch in batches:
    p, s, opt_state, loss = step(p, s, opt_state, batch)
    losses.append(float(loss))
  return batches, variables, losses, jax.device_get(p), jax.device_get(s)


@pytest.mark.parametrize("strategy, shard, replicate, orig", [
    pytest.param(FULL_SHARD, 3, None, False, id="FULL_SHARD-3-flat"),
    pytest.param(HYBRID_SHARD, 2, 2, True, id="HYBRID_SHARD-2x2-orig"),
])
def test_resnet_synced_batch_norm_matches_global_batch_jit(strategy, shard, replicate, orig):
  batches, variables, ref_losses, ref_params, ref_stats = resnet_reference()
  mesh = make_mesh(shard, replicate)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, use_orig_params=orig,
                               auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({ResNetBlock}),
                               data_axis_name="batch")
  # init_fn returns {"params", "batch_stats"}: the statistics become the
  # model state, never trained; only the parameters are sharded.
  state = fsdp_jax.init_train_state(init_fn=resnet_init, rng=jax.random.key(0),
                                    optimizer=RESNET_OPT, mesh=mesh, config=config)
  assert sorted(state.model_state) == ["batch_stats"]
  assert all(l.name.startswith("params.") for l in state.plan.leaves)
  assert_trees_close(state.model_state, {"batch_stats": variables["batch_stats"]}, rtol=0, atol=0)
  assert [u.name for u in state.plan.units] == ["params.ResNetBlock_0", "params.ResNetBlock_1", ""]
  step = fsdp_jax.shard_train_step(resnet_loss(ResNet()), RESNET_OPT, mesh=mesh, config=config)
  state, losses = train_steps(step, state, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=LOSS_ATOL)
  assert_moved(ref_params, {"params": variables["params"]})
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params)
  # The running statistics are the global batch's (each device computed the
  # same ones), and replicated.
  assert_trees_close(state.model_state, ref_stats, rtol=1e-5, atol=1e-6)
  assert_moved(ref_stats, {"batch_stats": variables["batch_stats"]})


def test_batch_norm_axis_name_unbound_says_which_names_exist_and_the_fix():
  mesh = make_mesh(2, 2)
  config = fsdp_jax.FSDPConfig(sharding_strategy=HYBRID_SHARD)
  state = fsdp_jax.init_train_state(init_fn=resnet_init, rng=jax.random.key(0),
                                    optimizer=RESNET_OPT, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(resnet_loss(ResNet()), RESNET_OPT, mesh=mesh, config=config)
  with pytest.raises(NameError) as e:
    step.lower(state, resnet_batches(4)[0])
  msg = str(e.value)
  assert "axis name 'batch'" in msg, msg
  assert "'replicate' (mesh axis, size 2), 'shard' (mesh axis, size 2)" in msg, msg
  assert "FSDPConfig(data_axis_name='batch')" in msg and "('replicate', 'shard')" in msg, msg


def test_per_device_batch_norm_warns():
  mesh = make_mesh(2)
  config = fsdp_jax.FSDPConfig()
  model = ResNet(bn_axis_name=None)
  state = fsdp_jax.init_train_state(init_fn=lambda k: model.init(k, IMAGE, train=False),
                                    rng=jax.random.key(0), optimizer=RESNET_OPT, mesh=mesh,
                                    config=config)
  step = fsdp_jax.shard_train_step(resnet_loss(model), RESNET_OPT, mesh=mesh, config=config)
  with pytest.warns(UserWarning, match=r"bn_init.*axis_name=None.*data_axis_name='batch'"):
    step.lower(state, resnet_batches(4)[0])


def test_data_axis_name_binds_every_collective_over_the_world():
  """psum, pmax, all_gather and axis_index over the model's own name run
  over ("replicate", "shard") on a hybrid mesh, with the world's size."""
  mesh = make_mesh(2, 2)
  config = fsdp_jax.FSDPConfig(sharding_strategy=HYBRID_SHARD, data_axis_name=("batch", "data"))
  state = fsdp_jax.init_train_state(params={"w": jnp.ones((3, 1))}, optimizer=optax.sgd(0.1),
                                    mesh=mesh, config=config)

  def loss_fn(params, batch):
    x = batch["x"]
    aux = {"mean": jax.lax.pmean(jnp.mean(x), "batch"),
           "max": jax.lax.pmax(jnp.max(x), "data"),
           "gathered": jnp.sum(jax.lax.all_gather(x[:, 0], "batch", tiled=True) ** 2),
           "index": jax.lax.axis_index("batch").astype(jnp.float32),
           "first_row": jax.lax.all_gather(x[0, 0], "batch")[jax.lax.axis_index("data")]}
    return jnp.mean((x @ params["w"]) ** 2), aux

  x = np.arange(24, dtype=np.float32).reshape(8, 3)
  step = fsdp_jax.shard_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, config=config)
  _, metrics = step(state, {"x": x})
  aux = jax.device_get(metrics["aux"])  # averaged over the devices
  np.testing.assert_allclose(aux["mean"], x.mean(), rtol=1e-6)
  np.testing.assert_allclose(aux["max"], x.max())
  np.testing.assert_allclose(aux["gathered"], np.sum(x[:, 0] ** 2))
  np.testing.assert_allclose(aux["index"], np.mean(np.arange(4)))  # 0..3, row-block order
  # Device d holds rows 2d, 2d+1: its first row's first entry is x[2d, 0].
  np.testing.assert_allclose(aux["first_row"], np.mean(x[0::2, 0]))


def test_data_axis_name_is_checked():
  with pytest.raises(ValueError, match="'shard' is a mesh axis name"):
    fsdp_jax.FSDPConfig(data_axis_name="shard")
  with pytest.raises(TypeError, match="data_axis_name=3"):
    fsdp_jax.FSDPConfig(data_axis_name=3)
  assert fsdp_jax.FSDPConfig(data_axis_name=["batch"]).data_axis_name == "batch"
  assert fsdp_jax.FSDPConfig(data_axis_name=("b", "d")) == fsdp_jax.FSDPConfig(
      data_axis_name=["b", "d"])


# --------------------------------------------------------------------------
# 3. NNX: a miniGPT in the style of the JAX AI stack's NNX tutorial, with
#    nnx.Dropout (its RngState in the model), nnx.LayerNorm and nnx.BatchNorm

NNX_VOCAB, NNX_DIM, NNX_HEADS, NNX_FF, NNX_SEQ = 23, 10, 2, 18, 6


def causal_attention_mask(seq_len):
  return jnp.tril(jnp.ones((seq_len, seq_len)))


class TransformerBlock(nnx.Module):

  def __init__(self, embed_dim, num_heads, ff_dim, *, rngs: nnx.Rngs, rate: float):
    # No biases: the key bias has an identically zero gradient (softmax is
    # shift invariant), which Adam turns into sign noise of rounding errors.
    self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim,
                                      decode=False, use_bias=False, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
    self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)
    self.linear1 = nnx.Linear(in_features=embed_dim, out_features=ff_dim, rngs=rngs)
    self.linear2 = nnx.Linear(in_features=ff_dim, out_features=embed_dim, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=rate, rngs=rngs)
    self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)

  def __call__(self, inputs, training: bool = False):
    mask = causal_attention_mask(inputs.shape[1])
    attention_output = self.mha(inputs_q=inputs, mask=mask)
    attention_output = self.dropout1(attention_output, deterministic=not training)
    out1 = self.layer_norm1(inputs + attention_output)
    ffn_output = self.linear2(nnx.relu(self.linear1(out1)))
    ffn_output = self.dropout2(ffn_output, deterministic=not training)
    return self.layer_norm2(out1 + ffn_output)


class TokenAndPositionEmbedding(nnx.Module):

  def __init__(self, maxlen, vocab_size, embed_dim, *, rngs: nnx.Rngs):
    self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
    self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

  def __call__(self, x):
    positions = jnp.arange(0, x.shape[1])[None, :]
    return self.token_emb(x) + self.pos_emb(positions)


class MiniGPT(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs, rate: float = 0.1, bn_axis_name="batch",
               num_blocks: int = 1):
    self.embedding = TokenAndPositionEmbedding(NNX_SEQ, NNX_VOCAB, NNX_DIM, rngs=rngs)
    self.blocks = nnx.List([TransformerBlock(NNX_DIM, NNX_HEADS, NNX_FF, rngs=rngs, rate=rate)
                            for _ in range(num_blocks)])
    self.norm = nnx.BatchNorm(NNX_DIM, momentum=0.9, axis_name=bn_axis_name, rngs=rngs)
    self.output_layer = nnx.Linear(in_features=NNX_DIM, out_features=NNX_VOCAB, rngs=rngs)

  def __call__(self, inputs, training: bool = False):
    # BatchNorm on the embeddings (after a bias it would cancel the bias's
    # gradient exactly, and Adam would amplify rounding noise).
    x = self.norm(self.embedding(inputs))
    for block in self.blocks:
      x = block(x, training=training)
    return self.output_layer(x)


def nnx_lm_loss(model, batch):
  logits = model(batch["x"], training=True)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def nnx_batches(n=12, seed=8):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(NUM_STEPS):
    tokens = rng.integers(0, NNX_VOCAB, (n, NNX_SEQ + 1)).astype(np.int32)
    out.append({"x": tokens[:, :-1], "y": tokens[:, 1:]})
  return out


NNX_OPT = optax.adam(1e-2)


def nnx_loss_fn(graphdef):
  """The glue: merge, run the model's own forward, return the new model
  state (batch statistics, dropout counts) with the loss."""

  def loss_fn(params, batch, model_state):
    model = nnx.merge(graphdef, params, model_state)
    loss = nnx_lm_loss(model, batch)
    return loss, nnx.state(model, nnx.Not(nnx.Param))

  return loss_fn


@functools.lru_cache(maxsize=None)
def nnx_reference(rate, world):
  """NNX's own loop (nnx.Optimizer, nnx.value_and_grad, nnx.jit) on the
  global batch; BatchNorm with axis_name=None normalises over all of it.
  With dropout, the devices are simulated with jax.vmap(axis_name="batch"):
  device d's rows run with its RngKey folded with d, the step's rule."""
  model = MiniGPT(rngs=nnx.Rngs(0), rate=rate, bn_axis_name=None if rate == 0 else "batch")
  params0 = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))  # update() mutates the model
  optimizer = nnx.Optimizer(model, NNX_OPT, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(nnx_lm_loss)(model, batch)
    optimizer.update(model, grads)
    return loss

  @nnx.jit
  def train_step_per_device(model, optimizer, batch):
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    per_device = jax.tree.map(lambda x: x.reshape((world, -1) + x.shape[1:]), batch)

    def device_loss(params, rows, d):
      keys_folded = jax.tree.map(
          lambda x: jax.random.fold_in(x, d)
          if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x, rest)
      m = nnx.merge(graphdef, params, keys_folded)
      loss = nnx_lm_loss(m, rows)
      return loss, nnx.state(m, nnx.Not(nnx.Param))

    def mean_loss(params):
      losses, states = jax.vmap(device_loss, in_axes=(None, 0, 0), axis_name="batch")(
          params, per_device, jnp.arange(world))
      return jnp.mean(losses), states

    (loss, states), grads = jax.value_and_grad(mean_loss, has_aux=True)(params)
    optimizer.update(model, grads)
    # Replicated model state: statistics averaged, counts advanced, keys kept.
    new_rest = jax.tree.map(
        lambda new, old: old if jax.dtypes.issubdtype(old.dtype, jax.dtypes.prng_key)
        else (jnp.mean(new, 0) if jnp.issubdtype(old.dtype, jnp.floating) else new[0]),
        states, rest)
    nnx.update(model, new_rest)
    return loss

  batches = nnx_batches()
  losses = [float((train_step if rate == 0 else train_step_per_device)(model, optimizer, b))
            for b in batches]
  return (batches, params0, losses, jax.tree.map(jnp.copy, nnx.state(model, nnx.Param)),
          jax.tree.map(jnp.copy, nnx.state(model, nnx.Not(nnx.Param))))


def nnx_sharded_model(rate, seed=0):
  model = MiniGPT(rngs=nnx.Rngs(seed), rate=rate)
  graphdef, state = nnx.split(model)
  return model, graphdef, state


@pytest.mark.parametrize("strategy, shard, replicate, orig", [
    pytest.param(FULL_SHARD, 3, None, False, id="FULL_SHARD-3-flat"),
    pytest.param(HYBRID_SHARD, 2, 2, True, id="HYBRID_SHARD-2x2-orig"),
])
def test_nnx_transformer_matches_nnx_jit(strategy, shard, replicate, orig):
  batches, params0, ref_losses, ref_params, ref_rest = nnx_reference(0.0, None)
  model, graphdef, whole = nnx_sharded_model(0.0)
  mesh = make_mesh(shard, replicate)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, use_orig_params=orig,
                               auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({TransformerBlock}),
                               data_axis_name="batch")
  # The whole NNX state: nnx.Param s are sharded, the rest (BatchStat,
  # RngKey, RngCount) becomes the model state.
  state = fsdp_jax.init_train_state(params=whole, optimizer=NNX_OPT, mesh=mesh, config=config,
                                    module_classes=fsdp_jax.module_classes(model))
  assert isinstance(state.model_state, nnx.State)
  assert [u.name for u in state.plan.units] == ["blocks.0", ""]
  assert not any("rngs" in l.name or l.name.startswith("norm.mean") for l in state.plan.leaves)
  step = fsdp_jax.shard_train_step(nnx_loss_fn(graphdef), NNX_OPT, mesh=mesh, config=config)
  state, losses = train_steps(step, state, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=LOSS_ATOL)
  assert_moved(ref_params, params0)
  params = fsdp_jax.summon_full_params(state)
  assert isinstance(params, nnx.State)
  assert_trees_close(params, ref_params)
  assert_trees_close(state.model_state, ref_rest, rtol=1e-5, atol=1e-6)
  # The trained state loads back into the NNX model.
  nnx.update(model, params, state.model_state)
  assert_trees_close(nnx.state(model, nnx.Param), ref_params)


def test_nnx_dropout_rng_state_per_device_and_resume(tmp_path):
  world = 4
  batches, _, ref_losses, ref_params, ref_rest = nnx_reference(0.2, world)
  mesh = make_mesh(world)
  config = fsdp_jax.FSDPConfig(sharding_strategy=FULL_SHARD, data_axis_name="batch")

  def fresh(seed):
    _, graphdef, whole = nnx_sharded_model(0.2, seed)
    return graphdef, fsdp_jax.init_train_state(params=whole, optimizer=NNX_OPT, mesh=mesh,
                                               config=config)

  graphdef, state = fresh(0)
  keys = [x for x in jax.tree.leaves(state.model_state)
          if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)]
  assert keys  # the dropout streams' RngKey: typed keys in the model state
  step = fsdp_jax.shard_train_step(nnx_loss_fn(graphdef), NNX_OPT, mesh=mesh, config=config)
  final, losses = train_steps(step, state, batches)
  # Device d drew its masks from fold_in(key, d) at the stream's count.
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=LOSS_ATOL)
  assert_trees_close(fsdp_jax.summon_full_params(final), ref_params)
  assert_trees_close(final.model_state, ref_rest, rtol=1e-5, atol=1e-6)
  assert abs(losses[0] - nnx_reference(0.0, None)[2][0]) > 1e-3  # dropout is on

  # The model state's keys and counts are checkpointed: resume is bitwise.
  state, _ = train_steps(step, fresh(0)[1], batches[:2])
  with CheckpointManager(tmp_path / "ckpt") as manager:
    manager.save(state)
    manager.wait_until_finished()
    restored = manager.restore(fresh(5)[1])
  resumed, last = train_steps(step, restored, batches[2:])
  assert last == losses[2:]
  for a, b in zip(jax.tree.leaves((fsdp_jax.summon_full_params(resumed), resumed.model_state)),
                  jax.tree.leaves((fsdp_jax.summon_full_params(final), final.model_state))):
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
      a, b = jax.random.key_data(a), jax.random.key_data(b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_key_returned_changed_from_model_state_is_refused():
  mesh = make_mesh(2)
  config = fsdp_jax.FSDPConfig()
  state = fsdp_jax.init_train_state(params={"w": jnp.ones((3, 2))}, optimizer=optax.sgd(0.1),
                                    mesh=mesh, config=config,
                                    model_state={"key": jax.random.key(0)})

  def loss_fn(params, batch, model_state):
    key, sub = jax.random.split(model_state["key"])
    noise = jax.random.normal(sub, batch["x"].shape)
    return jnp.mean((batch["x"] + noise) @ params["w"]) ** 2, {"key": key}

  step = fsdp_jax.shard_train_step(loss_fn, optax.sgd(0.1), mesh=mesh, config=config)
  with pytest.raises(ValueError, match=r"new value for a PRNG key.*rng="):
    step.lower(state, {"x": np.ones((4, 3), np.float32)})


# --------------------------------------------------------------------------
# 4. equinox: a pre-LayerNorm Transformer written as eqx.Module s, the way
#    equinox's examples write one (per-example __call__, jax.vmap outside)

EQX_VOCAB, EQX_DIM, EQX_HEADS, EQX_FF, EQX_SEQ = 19, 10, 2, 22, 6


class EqxBlock(eqx.Module):
  attn_norm: eqx.nn.LayerNorm
  attention: eqx.nn.MultiheadAttention
  mlp_norm: eqx.nn.LayerNorm
  mlp: eqx.nn.MLP
  dropout: eqx.nn.Dropout

  def __init__(self, *, key, p=0.1):
    k1, k2 = jax.random.split(key)
    self.attn_norm = eqx.nn.LayerNorm(EQX_DIM)
    self.attention = eqx.nn.MultiheadAttention(EQX_HEADS, EQX_DIM, key=k1)
    self.mlp_norm = eqx.nn.LayerNorm(EQX_DIM)
    self.mlp = eqx.nn.MLP(EQX_DIM, EQX_DIM, EQX_FF, depth=1, activation=jax.nn.gelu, key=k2)
    self.dropout = eqx.nn.Dropout(p)

  def __call__(self, x, *, key=None):
    mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
    k1, k2 = (None, None) if key is None else jax.random.split(key)
    h = jax.vmap(self.attn_norm)(x)
    x = x + self.dropout(self.attention(h, h, h, mask=mask), key=k1, inference=key is None)
    h = jax.vmap(self.mlp)(jax.vmap(self.mlp_norm)(x))
    return x + self.dropout(h, key=k2, inference=key is None)


class EqxTransformer(eqx.Module):
  embedding: eqx.nn.Embedding
  positions: jax.Array
  blocks: list
  norm: eqx.nn.LayerNorm
  head: eqx.nn.Linear

  def __init__(self, *, key, num_blocks=1):
    keys = jax.random.split(key, num_blocks + 3)
    self.embedding = eqx.nn.Embedding(EQX_VOCAB, EQX_DIM, key=keys[0])
    self.positions = 0.02 * jax.random.normal(keys[1], (EQX_SEQ, EQX_DIM))
    self.blocks = [EqxBlock(key=k) for k in keys[2:-1]]
    self.norm = eqx.nn.LayerNorm(EQX_DIM)
    self.head = eqx.nn.Linear(EQX_DIM, EQX_VOCAB, key=keys[-1])

  def __call__(self, tokens, *, key=None):
    x = jax.vmap(self.embedding)(tokens) + self.positions
    keys = [None] * len(self.blocks) if key is None else jax.random.split(key, len(self.blocks))
    for block, k in zip(self.blocks, keys):
      x = block(x, key=k)
    return jax.vmap(self.head)(jax.vmap(self.norm)(x))


def eqx_loss(model, batch, key=None):
  keys = None if key is None else jax.random.split(key, batch["x"].shape[0])
  logits = jax.vmap(lambda x, k: model(x, key=k))(batch["x"], keys) if key is not None \
      else jax.vmap(model)(batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


EQX_OPT = optax.adam(1e-2)


@functools.lru_cache(maxsize=None)
def eqx_model():
  """EqxTransformer(key=key(0)), built once, under one jit (op by op, each
  of its initialisers' operations is a program of its own)."""
  return eqx.filter_jit(lambda k: EqxTransformer(key=k))(jax.random.key(0))


def eqx_batches(n=12):
  rng = np.random.default_rng(31)
  out = []
  for _ in range(NUM_STEPS):
    tokens = rng.integers(0, EQX_VOCAB, (n, EQX_SEQ + 1)).astype(np.int32)
    out.append({"x": tokens[:, :-1], "y": tokens[:, 1:]})
  return out


@functools.lru_cache(maxsize=None)
def eqx_reference(world):
  """equinox's own loop: eqx.filter_jit, eqx.filter_value_and_grad, optax.
  ``world=None``: dropout off, the global batch; else dropout on, each
  device's rows with the key the step gives that device."""
  model = eqx_model()
  params0 = eqx.filter(model, eqx.is_inexact_array)
  opt_state = EQX_OPT.init(params0)
  rng = jax.random.key(11)

  @eqx.filter_jit
  def make_step(model, opt_state, batch, keys):
    def loss_fn(model):
      if keys is None:
        return eqx_loss(model, batch)
      return jnp.mean(jnp.stack([eqx_loss(model, c, k)
                                 for c, k in zip(chunks(batch, len(keys)), keys)]))
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = EQX_OPT.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss

  batches = eqx_batches()
  losses = []
  for i, batch in enumerate(batches):
    keys = None if world is None else device_keys(rng, i, world)
    model, opt_state, loss = make_step(model, opt_state, batch, keys)
    losses.append(float(loss))
  return batches, params0, losses, eqx.filter(model, eqx.is_inexact_array)


# Both layouts, both ways in (init_fn from an abstract model, params);
# _HYBRID_SHARD_ZERO2 on a 2x2 mesh trains the lm1b model above.
@pytest.mark.parametrize("strategy, shard, replicate, orig, dropout", [
    pytest.param(FULL_SHARD, 3, None, False, False, id="FULL_SHARD-3-flat"),
    pytest.param(NO_SHARD, 2, None, True, True, id="NO_SHARD-2-orig-dropout"),
])
def test_equinox_transformer_matches_filter_jit(strategy, shard, replicate, orig, dropout):
  world = world_of(shard, replicate)
  batches, params0, ref_losses, ref_params = eqx_reference(world if dropout else None)
  model = eqx_model()
  params, static = eqx.partition(model, eqx.is_inexact_array)
  mesh = make_mesh(shard, replicate)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, use_orig_params=orig,
                               auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({EqxBlock}))
  # Module classes are read from the module tree; the model is not called.
  classes = fsdp_jax.module_classes(model)
  assert classes[("blocks", "0")] is EqxBlock and classes[("blocks", "0", "mlp")] is eqx.nn.MLP
  if strategy is FULL_SHARD:  # init straight into shards, from an abstract model
    abstract = eqx.filter_eval_shape(EqxTransformer, key=jax.random.key(0))
    init = dict(init_fn=lambda k: eqx.filter(EqxTransformer(key=k), eqx.is_inexact_array),
                module_classes=fsdp_jax.module_classes(abstract))
  else:
    init = dict(params=params, module_classes=classes)
  state = fsdp_jax.init_train_state(optimizer=EQX_OPT, mesh=mesh, config=config,
                                    rng=jax.random.key(0 if not dropout else 11), **init)
  assert [u.name for u in state.plan.units] == ["blocks.0", ""]
  assert_trees_close(fsdp_jax.summon_full_params(state), params0, rtol=1e-6, atol=1e-7)

  if dropout:
    def loss_fn(params, batch, *, rng):
      return eqx_loss(eqx.combine(params, static), batch, rng)
  else:
    def loss_fn(params, batch):
      return eqx_loss(eqx.combine(params, static), batch)

  step = fsdp_jax.shard_train_step(loss_fn, EQX_OPT, mesh=mesh, config=config)
  state, losses = train_steps(step, state, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=LOSS_ATOL)
  assert_moved(ref_params, params0)
  trained = fsdp_jax.summon_full_params(state)
  assert_trees_close(trained, ref_params)
  # The trained parameters combine back into a callable model (traced, not
  # run op by op: its numbers are the reference's, checked above).
  logits = eqx.filter_eval_shape(lambda m, x: m(x), eqx.combine(trained, static),
                                 batches[0]["x"][0])
  assert logits.shape == (EQX_SEQ, EQX_VOCAB)


# --------------------------------------------------------------------------
# 5. linen nn.scan(nn.remat(Block)): with and without stacked_layers

SCAN_LAYERS, SCAN_DIM, SCAN_FF, SCAN_IN, SCAN_OUT = 3, 10, 14, 5, 4


class ScanBlock(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    h = nn.LayerNorm()(x)
    h = nn.Dense(SCAN_FF)(h)
    h = nn.Dense(SCAN_DIM)(nn.gelu(h))
    return x + h, None


class ScanStack(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(SCAN_DIM, name="embed")(x)
    stack = nn.scan(nn.remat(ScanBlock, prevent_cse=False), variable_axes={"params": 0},
                    split_rngs={"params": True}, length=SCAN_LAYERS)
    x, _ = stack(name="blocks")(x, None)
    return nn.Dense(SCAN_OUT, name="head")(nn.LayerNorm()(x))


SCAN_MODEL = ScanStack()
SCAN_OPT = optax.adam(1e-2)


def scan_init(rng):
  return SCAN_MODEL.init(rng, jnp.ones((1, SCAN_IN)))


def scan_loss(params, batch):
  logits = SCAN_MODEL.apply(params, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


@functools.lru_cache(maxsize=None)
def scan_reference():
  rng = np.random.default_rng(41)
  batches = [{"x": rng.normal(size=(12, SCAN_IN)).astype(np.float32),
              "y": rng.integers(0, SCAN_OUT, 12).astype(np.int32)} for _ in range(NUM_STEPS)]
  params = jax.jit(scan_init)(jax.random.key(2))
  losses, final = jit_reference_run(scan_loss, params, SCAN_OPT, batches)
  return batches, params, losses, final


def fsdp_warnings(record):
  return [str(w.message) for w in record if str(w.message).startswith("fsdp_jax:")]


def test_linen_scan_stack_without_stacked_layers_is_flagged_with_the_fix():
  batches, params0, ref_losses, ref_params = scan_reference()
  mesh = make_mesh(3)
  config = fsdp_jax.FSDPConfig(sharding_strategy=FULL_SHARD)
  with pytest.warns(UserWarning) as record:
    state = fsdp_jax.init_train_state(init_fn=scan_init, rng=jax.random.key(2),
                                      optimizer=SCAN_OPT, mesh=mesh, config=config)
  (msg,) = fsdp_warnings(record)
  assert "'params.blocks' look like 3 stacked layers" in msg, msg
  assert "FSDPConfig(stacked_layers=('params.blocks',))" in msg, msg
  assert ("looks stacked, gathered whole: params.blocks (every leaf has a leading axis of 3)"
          in str(state.plan)), str(state.plan)
  step = fsdp_jax.shard_train_step(scan_loss, SCAN_OPT, mesh=mesh, config=config)
  with pytest.warns(UserWarning) as record:
    state, losses = train_steps(step, state, batches)
  msgs = fsdp_warnings(record)
  assert msgs and all("scans over the parameters params.blocks." in m for m in msgs), msgs
  assert "FSDPConfig(stacked_layers=('params.blocks',))" in msgs[0], msgs[0]
  assert "gathered whole before the loop (all 3 layers at once)" in msgs[0], msgs[0]
  # Still correct, just not layer by layer.
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=LOSS_ATOL)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params)


# One case: tests/test_activation_checkpointing.py::
# test_linen_scan_of_remat_blocks_gathers_one_layer_per_iteration trains the
# same nn.scan(nn.remat(Block)) declared stacked against jit on FULL_SHARD,
# SHARD_GRAD_OP (original layout) and HYBRID_SHARD 2x2 (flat), and counts its
# gathers per layer; here NO_SHARD, and that declaring it silences the warning
# of the test above.
@pytest.mark.parametrize("strategy, shard, replicate, orig", [
    pytest.param(NO_SHARD, 4, None, True, id="NO_SHARD-4-orig"),
])
def test_linen_scan_remat_stack_declared_stacked_matches_jit(strategy, shard, replicate, orig):
  batches, params0, ref_losses, ref_params = scan_reference()
  mesh = make_mesh(shard, replicate)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, use_orig_params=orig,
                               stacked_layers=("params.blocks",))
  import warnings  # pylint: disable=import-outside-toplevel
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    state = fsdp_jax.init_train_state(params=params0, optimizer=SCAN_OPT, mesh=mesh,
                                      config=config)
    step = fsdp_jax.shard_train_step(scan_loss, SCAN_OPT, mesh=mesh, config=config)
    state, losses = train_steps(step, state, batches)
  assert not fsdp_warnings(record), fsdp_warnings(record)
  blocks = state.plan.unit_by_name("params.blocks")
  assert blocks.stacked and blocks.num_layers == SCAN_LAYERS
  assert "looks stacked" not in str(state.plan)
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=LOSS_ATOL)
  assert_moved(ref_params, params0)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params)


# --------------------------------------------------------------------------
# What cannot be made exact is refused


def _tiny_state(model_state=None, **kw):
  mesh = make_mesh(2)
  config = fsdp_jax.FSDPConfig()
  state = fsdp_jax.init_train_state(params={"w": jnp.ones((3, 2))}, optimizer=optax.sgd(0.1),
                                    mesh=mesh, config=config, model_state=model_state)
  return state, lambda loss_fn: fsdp_jax.shard_train_step(loss_fn, optax.sgd(0.1), mesh=mesh,
                                                          config=config, **kw)


def test_weighted_loss_weight_that_depends_on_the_parameters_is_refused():
  state, make_step = _tiny_state()

  def loss_fn(params, batch):
    pred = batch["x"] @ params["w"]
    w = jax.nn.sigmoid(pred[:, 0])  # a weight computed from the model
    return fsdp_jax.WeightedLoss(total=jnp.sum(w * pred[:, 1] ** 2), weight=jnp.sum(w))

  with pytest.raises(ValueError, match=r"weight depends on the parameters \(w\)"):
    make_step(loss_fn).lower(state, {"x": np.ones((4, 3), np.float32)})


def test_weighted_loss_weight_from_model_state_is_refused_under_accumulation():
  state, make_step = _tiny_state(model_state={"scale": jnp.ones(())},
                                 gradient_accumulation_steps=2)

  def loss_fn(params, batch, model_state):
    per_example = (batch["x"] @ params["w"])[:, 0] ** 2
    w = model_state["scale"] * jnp.ones_like(per_example)
    return (fsdp_jax.WeightedLoss(total=jnp.sum(w * per_example), weight=jnp.sum(w)),
            {"scale": model_state["scale"] * 2})

  with pytest.raises(ValueError, match=r"weight depends on the model state.*accumulation"):
    make_step(loss_fn).lower(state, {"x": np.ones((4, 3), np.float32)})


def test_model_state_from_the_model_and_model_state_argument_conflict():
  variables = jax.eval_shape(resnet_init, jax.random.key(0))
  variables = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), variables)
  with pytest.raises(ValueError, match=r"'batch_stats'.*model_state= was passed too"):
    fsdp_jax.init_train_state(params=variables, optimizer=RESNET_OPT, mesh=make_mesh(2),
                              config=fsdp_jax.FSDPConfig(),
                              model_state={"batch_stats": variables["batch_stats"]})


def test_nnx_rng_state_in_state_dicts():
  """Typed keys among the buffers survive every state-dict kind (a FULL
  state dict on the host keeps them as jax arrays)."""

  class Small(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(3, 5, rngs=rngs)
      self.dropout = nnx.Dropout(0.5, rngs=rngs)

  _, whole = nnx.split(Small(nnx.Rngs(3)))
  state = fsdp_jax.init_train_state(params=whole, optimizer=optax.sgd(0.1), mesh=make_mesh(2),
                                    config=fsdp_jax.FSDPConfig())
  T = fsdp_jax.StateDictType
  for kind, kw in [(T.FULL_STATE_DICT, {"offload_to_cpu": True}), (T.FULL_STATE_DICT, {}),
                   (T.SHARDED_STATE_DICT, {}), (T.LOCAL_STATE_DICT, {})]:
    sd = fsdp_jax.state_dict(state, state_dict_type=kind, **kw)
    (key_name,) = [k for k in sd if k.startswith("dropout.rngs.key")]
    assert jax.dtypes.issubdtype(sd[key_name].dtype, jax.dtypes.prng_key)
    back = fsdp_jax.load_state_dict(state, sd, state_dict_type=kind)
    assert_trees_close(back.model_state, state.model_state, rtol=0, atol=0)
    assert_trees_close(fsdp_jax.summon_full_params(back), fsdp_jax.summon_full_params(state), rtol=0, atol=0)
