"""Activation checkpointing composes with FSDP units.

PyTorch wraps each transformer block in a checkpoint wrapper
(``apply_activation_checkpointing(model, check_fn=...)``) next to FSDP. In JAX
the model does it itself: ``jax.checkpoint`` (optionally with a policy) or
Flax's ``nn.remat`` around each block, ``nn.scan(nn.remat(Block))`` for stacked
layers. These tests take such models through ``fsdp_jax.shard_train_step``
with each block its own FSDP unit and check that

1. training matches unsharded single-device JAX *without* checkpointing
   (every step's loss, the final parameters);
2. the compiled step gathers every unit exactly as often as the same step
   without checkpointing (the re-computation in backward re-uses the unit's
   backward gather, it does not gather again) and reduce-scatters it once;
3. the checkpoint does its job: the compiled step's temporaries
   (``memory_analysis().temp_size_in_bytes``) drop for a model whose memory is
   activations;
4. the same for Flax linen ``nn.remat`` blocks and ``nn.scan(nn.remat(...))``
   over a stacked unit (one layer gathered per loop iteration);
5. checkpoint policies (``dots_with_no_batch_dims_saveable``, names) give the
   same numbers and collectives.
6. ``FSDPConfig(activation_checkpointing=ActivationCheckpointing(...))``,
   the framework checkpointing each unit of an unchanged model (PyTorch's
   ``apply_activation_checkpointing``): the same losses and parameters as
   the step without it (1e-6), the same all-gathers per unit, less memory,
   over the strategies, layouts, TP, LoRA, accumulation, offload, stacked
   layers and the three policies (spread over the cases), and its errors.

for FULL_SHARD and SHARD_GRAD_OP on 2, 3 and 4 devices and HYBRID_SHARD on a
2 x 2 mesh.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name

import fsdp_jax
from fsdp_jax import hlo as hlo_lib

from helpers import (assert_trees_close, collective_sizes, collectives_per_call,
                     jit_reference_run, mesh_for, train_steps)

# The tests that compile checkpointed and reference steps are slow; the
# policy checks on jaxprs run in the fast subset.
FULL_SHARD = fsdp_jax.ShardingStrategy.FULL_SHARD
SHARD_GRAD_OP = fsdp_jax.ShardingStrategy.SHARD_GRAD_OP
HYBRID_SHARD = fsdp_jax.ShardingStrategy.HYBRID_SHARD
RESHARDS = (FULL_SHARD, HYBRID_SHARD)  # free a unit after forward, re-gather it in backward

STEPS = 3
LOSS_ATOL = 1e-5

# Why FULL_SHARD with use_orig_params=True fails to build its step (see
# compile_step).
SHARED_REMAT_BODY = (
    "building the step failed. jax.checkpoint caches its trace, so the "
    "checkpointed blocks (same function, same shapes) share one body jaxpr; "
    "fsdp_jax.schedule.ordered inlines every remat body of the differentiated "
    "step keyed by jaxpr variable identity (_Sequence: env, alias, producer), "
    "so the inlined copies overwrite each other and a read finds no value. "
    "Fix: give each further inlined copy of a body new variables in "
    "_Sequence._flatten.")

# Why the memory tests of the resharding strategies and of stacked scans fail
# (see test_checkpoint_reduces_activation_memory).
NESTED_REMAT = (
    "the model's jax.checkpoint did not reduce the step's temporaries. JAX "
    "partially evaluates a jax.checkpoint nested inside another one with the "
    "outer policy (jax-ml/jax#18817); the FULL_SHARD/HYBRID_SHARD step runs the "
    "whole loss under jax.checkpoint(policy=collectives.remat_policy), and the "
    "scan over a stacked unit runs its rebuilt body under the same policy, "
    "which saves every intermediate but the gathered parameters, so the "
    "model's own checkpoint policy is ignored there. Fix: fsdp_jax/_src/schedule.py "
    "must re-bind each user checkpoint so its own policy decides its residuals "
    "(e.g. a custom_vjp whose forward is jax.vjp of the user's checkpoint).")


def adam():
  return optax.adam(1e-2)


def _id(case):
  strategy, n, replicate = case
  return f"{strategy.name}-{replicate}x{n}" if replicate else f"{strategy.name}-{n}"


# --------------------------------------------------------------------------
# Training and reading the compiled step


def reference_train(loss_fn, params, batches):
  """Unsharded single-device training without checkpointing."""
  return jit_reference_run(loss_fn, params, adam(), batches)


def compile_step(loss_fn, state, batch, mesh, config):
  step = fsdp_jax.shard_train_step(loss_fn, adam(), mesh=mesh, config=config)
  try:
    return step, step.lower(state, batch).compile()
  except KeyError as e:
    raise AssertionError(f"{SHARED_REMAT_BODY} ({type(e).__name__}: {e})") from e


def fsdp_train(loss_fn, params, batches, mesh, config, *, module_classes=None):
  """Trains with fsdp_jax. Returns ``(losses, full params, plan, compiled
  step)``."""
  state = fsdp_jax.init_train_state(params=params, optimizer=adam(), mesh=mesh, config=config,
                                    module_classes=module_classes)
  step, compiled = compile_step(loss_fn, state, batches[0], mesh, config)
  plan = state.plan
  state, losses = train_steps(step, state, batches)  # runs the executable compiled above
  return losses, fsdp_jax.summon_full_params(state), plan, compiled


def assert_matches_reference(losses, params, reference):
  ref_losses, ref_params = reference
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=LOSS_ATOL)
  assert_trees_close(params, ref_params)


_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<type>.*?)\s+"
    r"(?P<kind>all-gather|reduce-scatter)(?:-start)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s")
_SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")
_SCOPE = {"all-gather": "fsdp_all_gather", "reduce-scatter": "fsdp_reduce_scatter"}


def unit_collectives(text: str) -> list[tuple[str, str, str, tuple]]:
  """``(kind, unit label, computation, result numels)`` of every all-gather
  and reduce-scatter in a compiled module; the label comes from the
  ``fsdp_all_gather[<unit>]`` / ``fsdp_reduce_scatter[<unit>]`` scope in the
  op metadata."""
  out, comp = [], ""
  for line in text.splitlines():
    if line and not line[0].isspace():
      m = _COMPUTATION.match(line)
      if m and line.rstrip().endswith("{"):
        comp = m.group(1)
      continue
    m = _COLLECTIVE.match(line)
    if not m:
      continue
    kind = m.group("kind")
    op_name = re.search(r'op_name="([^"]*)"', line)
    label = re.search(re.escape(_SCOPE[kind]) + r"\[([^\]]*)\]", op_name.group(1) if op_name else "")
    shapes = [tuple(int(d) for d in s.split(",") if d) for s in _SHAPE.findall(m.group("type"))]
    if "-start(" in line:
      shapes = shapes[len(shapes) // 2:]  # (operands..., results...)
    out.append((kind, label.group(1) if label else "?",
                comp, tuple(int(np.prod(s, dtype=np.int64)) for s in shapes)))
  return out


def counts_per_unit(text: str) -> dict:
  """``{(kind, unit label): number of instructions}``."""
  return dict(collections.Counter((k, label) for k, label, _, _ in unit_collectives(text)))


def expected_counts(plan, strategy) -> dict:
  """What the step does without checkpointing (tests/test_engine.py; the
  memory tests below also compile both and compare): one gather per unit, a
  second one in backward for every non-root unit when the strategy reshards,
  one reduce-scatter per unit (with ``use_orig_params=True`` each of them one
  per leaf: every leaf of these blocks is needed in backward)."""
  out = {}
  for u in plan.units:
    gathers, reduces = collectives_per_call(plan, u)
    out[("all-gather", u.display_name)] = gathers * (
        2 if (strategy in RESHARDS and not u.is_root) else 1)
    out[("reduce-scatter", u.display_name)] = reduces
  return out


def temp_bytes(compiled) -> int:
  return compiled.memory_analysis().temp_size_in_bytes


# --------------------------------------------------------------------------
# 1, 2, 5. A plain-function pre-norm residual MLP, jax.checkpoint per block

D_IN, D, FF, D_OUT, BLOCKS = 5, 10, 17, 3, 3  # a block holds 367 parameters: padded on every mesh


def block(blk, x):
  """LayerNorm, an MLP of width FF, a residual connection."""
  mu = x.mean(-1, keepdims=True)
  h = (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * blk["scale"]
  h = checkpoint_name(jax.nn.gelu(h @ blk["w1"] + blk["b1"]), "ff_hidden")
  return x + jnp.tanh(h @ blk["w2"])


def make_loss(remat=None):
  """The model's loss with ``remat`` (e.g. ``jax.checkpoint``) applied to
  every block, the way a user applies it."""
  blk_fn = block if remat is None else remat(block)

  def loss_fn(params, batch):
    x = jnp.tanh(batch["x"] @ params["inp"]["w"])
    for blk in params["blocks"]:
      x = blk_fn(blk, x)
    return jnp.mean((x @ params["out"]["w"] - batch["y"]) ** 2)

  return loss_fn


def mlp_params(seed=0):
  rng = np.random.default_rng(seed)
  f32 = lambda shape, scale: (scale * rng.standard_normal(shape)).astype(np.float32)
  return {
      "inp": {"w": f32((D_IN, D), 0.5)},
      "blocks": [{"scale": 1.0 + f32((D,), 0.1), "w1": f32((D, FF), D ** -0.5),
                  "b1": f32((FF,), 0.1), "w2": f32((FF, D), FF ** -0.5)}
                 for _ in range(BLOCKS)],
      "out": {"w": f32((D, D_OUT), 0.5)},
  }


def mlp_batches(n=24):
  rng = np.random.default_rng(1)
  return [{"x": rng.standard_normal((n, D_IN)).astype(np.float32),
           "y": rng.standard_normal((n, D_OUT)).astype(np.float32)} for _ in range(STEPS)]


@functools.lru_cache(maxsize=None)
def mlp_reference():
  return reference_train(make_loss(), mlp_params(), mlp_batches())


WRAP_BLOCKS = fsdp_jax.ModuleWrapPolicy(["blocks.*"])
# With POLICY_CASES: every strategy on 2, 3 and 4 devices, HYBRID_SHARD on 2 x 2.
CASES = [(FULL_SHARD, 2, None), (FULL_SHARD, 3, None), (SHARD_GRAD_OP, 2, None),
         (SHARD_GRAD_OP, 4, None), (HYBRID_SHARD, 2, 2)]


def check_checkpointed_mlp(remat, case, use_orig_params):
  strategy, n, replicate = case
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP_BLOCKS,
                               use_orig_params=use_orig_params)
  losses, params, plan, compiled = fsdp_train(
      make_loss(remat), mlp_params(), mlp_batches(), mesh_for(strategy, n, replicate), config)
  assert [u.display_name for u in plan.units] == [f"blocks.{i}" for i in range(BLOCKS)] + ["<root>"]
  assert_matches_reference(losses, params, mlp_reference())
  # No gather added by the re-computation in backward, none lost.
  assert counts_per_unit(compiled.as_text()) == expected_counts(plan, strategy)


@pytest.mark.parametrize("case", CASES, ids=_id)
@pytest.mark.slow
def test_per_block_checkpoint_trains_like_unsharded_and_gathers_as_often(case):
  check_checkpointed_mlp(jax.checkpoint, case, use_orig_params=case[1] == 3)


POLICIES = {
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_anything_except_these_names": jax.checkpoint_policies.save_anything_except_these_names(
        "ff_hidden"),
}


# (HYBRID_SHARD with a policy: the linen scan test.)
POLICY_CASES = [((FULL_SHARD, 4, None), "dots_with_no_batch_dims_saveable"),
                ((SHARD_GRAD_OP, 3, None), "save_anything_except_these_names")]


@pytest.mark.parametrize("case, policy", POLICY_CASES,
                         ids=[f"{_id(c)}-{p}" for c, p in POLICY_CASES])
@pytest.mark.slow
def test_checkpoint_policies(case, policy):
  remat = functools.partial(jax.checkpoint, policy=POLICIES[policy])
  check_checkpointed_mlp(remat, case, use_orig_params=case[1] == 3)


# --------------------------------------------------------------------------
# 3. Activation memory: small weights, a long batch


M_D, M_FF, M_BLOCKS, M_BATCH = 32, 256, 4, 1024


def memory_params():
  rng = np.random.default_rng(2)
  f32 = lambda shape, scale: (scale * rng.standard_normal(shape)).astype(np.float32)
  return {"inp": {"w": f32((8, M_D), 0.3)},
          "blocks": [{"scale": np.ones((M_D,), np.float32), "w1": f32((M_D, M_FF), M_D ** -0.5),
                      "b1": np.zeros((M_FF,), np.float32), "w2": f32((M_FF, M_D), M_FF ** -0.5)}
                     for _ in range(M_BLOCKS)],
          "out": {"w": f32((M_D, 1), 0.3)}}


def memory_batch():
  rng = np.random.default_rng(3)
  return {"x": rng.standard_normal((M_BATCH, 8)).astype(np.float32),
          "y": rng.standard_normal((M_BATCH, 1)).astype(np.float32)}


def assert_activation_memory_drops(with_remat: int, without: int, per_device_rows: int,
                                   blocks: int = M_BLOCKS, ratio: float = 0.5):
  """The checkpointed step needs at most ``ratio`` of the temporaries, and
  saves at least one FF-wide float32 activation for each of ``blocks``
  blocks (of what backward would otherwise keep of each block at that
  width: the pre-activation, and the GELU output where it is saved)."""
  one_activation_per_block = blocks * per_device_rows * M_FF * 4
  assert with_remat <= ratio * without and without - with_remat >= one_activation_per_block, (
      f"temporaries per device with per-block checkpointing {with_remat / 2**20:.2f} MiB, "
      f"without {without / 2**20:.2f} MiB (expected a drop of at least "
      f"{one_activation_per_block / 2**20:.2f} MiB and at least half): " + NESTED_REMAT)


MEMORY_CASES = [(FULL_SHARD, 2, None), (SHARD_GRAD_OP, 2, None)]


@pytest.mark.parametrize("case", MEMORY_CASES, ids=_id)
@pytest.mark.slow
def test_checkpoint_reduces_activation_memory(case):
  """Temporaries per device (MiB, jax 0.10.2, CPU) without / with
  ``jax.checkpoint`` per block: SHARD_GRAD_OP-2 7.59 / 2.76. FULL_SHARD-2
  14.40 / 14.27 would not drop by itself (nor HYBRID_SHARD-2x2: 7.26 / 7.17): the
  step's own remat overrides the model's policy (NESTED_REMAT). With each
  user checkpoint re-bound as a custom_vjp in fsdp_jax/_src/schedule.py:
  FULL_SHARD-2 14.40 / 2.30 (HYBRID_SHARD-2x2 7.26 / 1.23), the same
  collectives. Since the step's remat recomputes cheap elementwise operations
  (collectives.remat_policy): FULL_SHARD-2 5.68 / 2.33, HYBRID_SHARD-2x2
  2.92 / 1.23."""
  strategy, n, replicate = case
  mesh = mesh_for(strategy, n, replicate)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP_BLOCKS)
  # Shapes are enough to compile.
  state = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      params=memory_params(), optimizer=adam(), mesh=mesh, config=config))
  batch = memory_batch()
  compiled = {name: compile_step(make_loss(remat), state, batch, mesh, config)[1]
              for name, remat in [("without", None), ("with", jax.checkpoint)]}
  # The same collectives with and without checkpointing ...
  counts = counts_per_unit(compiled["with"].as_text())
  assert counts == counts_per_unit(compiled["without"].as_text())
  assert counts == expected_counts(state.plan, strategy)
  # ... and fewer bytes of activations.
  assert_activation_memory_drops(temp_bytes(compiled["with"]), temp_bytes(compiled["without"]),
                                 M_BATCH // state.plan.axes.world_size)


# --------------------------------------------------------------------------
# 4. Flax linen: nn.remat per block, nn.scan(nn.remat(Block)) over a stacked unit


class LinenBlock(nn.Module):
  """Pre-LayerNorm residual MLP block; ``__call__(x, _)`` so nn.scan can run it."""

  features: int
  hidden: int

  @nn.compact
  def __call__(self, x, _=None):
    h = nn.Dense(self.hidden)(nn.LayerNorm()(x))
    return x + jnp.tanh(nn.Dense(self.features)(nn.gelu(h))), None


class LinenModel(nn.Module):
  """``blocks`` LinenBlocks, checkpointed with ``nn.remat`` when ``remat``;
  unrolled (one unit per block) or under ``nn.scan`` (one stacked unit)."""

  features: int
  hidden: int
  blocks: int
  remat: bool = False
  scan: bool = False
  policy: object = None

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.features, name="inp")(x)
    cls = LinenBlock
    if self.remat:
      # In a scan loop the re-computation cannot be merged with the forward
      # pass, so Flax recommends prevent_cse=False there.
      cls = nn.remat(LinenBlock, prevent_cse=not self.scan, policy=self.policy)
    if self.scan:
      stack = nn.scan(cls, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=self.blocks)
      x, _ = stack(self.features, self.hidden, name="blocks")(x, None)
    else:
      for i in range(self.blocks):
        x, _ = cls(self.features, self.hidden, name=f"block_{i}")(x)
    return nn.Dense(3, name="head")(x)


L_D, L_FF, L_BLOCKS = 12, 20, 2


def linen_loss(model):
  def loss_fn(params, batch):
    logits = model.apply(params, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  return loss_fn


def linen_batches(n=24):
  rng = np.random.default_rng(5)
  return [{"x": rng.standard_normal((n, 6)).astype(np.float32),
           "y": rng.integers(0, 3, (n,)).astype(np.int32)} for _ in range(STEPS)]


@functools.lru_cache(maxsize=None)
def linen_setup(scan: bool):
  model = LinenModel(L_D, L_FF, L_BLOCKS, scan=scan)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 6)))
  return params, reference_train(linen_loss(model), params, linen_batches())


@pytest.mark.parametrize("case", [(FULL_SHARD, 3, None), (SHARD_GRAD_OP, 4, None)], ids=_id)
@pytest.mark.slow
def test_linen_remat_per_block(case):
  strategy, n, replicate = case
  params, reference = linen_setup(scan=False)
  model = LinenModel(L_D, L_FF, L_BLOCKS, remat=True)
  # ModuleWrapPolicy({LinenBlock}) finds the blocks through nn.remat: the
  # checkpointed class is a subclass of LinenBlock.
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy,
                               auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({LinenBlock}),
                               use_orig_params=strategy is SHARD_GRAD_OP)
  classes = fsdp_jax.module_classes(model.init, jax.random.key(0), jnp.zeros((1, 6)))
  losses, full, plan, compiled = fsdp_train(
      linen_loss(model), params, linen_batches(), mesh_for(strategy, n, replicate), config,
      module_classes=classes)
  assert [u.display_name for u in plan.units] == [
      f"params.block_{i}" for i in range(L_BLOCKS)] + ["<root>"]
  assert_matches_reference(losses, full, reference)
  assert counts_per_unit(compiled.as_text()) == expected_counts(plan, strategy)


SCAN_CASES = [(FULL_SHARD, 2, None), (SHARD_GRAD_OP, 3, None), (HYBRID_SHARD, 2, 2)]


@pytest.mark.parametrize("case", SCAN_CASES, ids=_id)
@pytest.mark.slow
def test_linen_scan_of_remat_blocks_gathers_one_layer_per_iteration(case):
  strategy, n, replicate = case
  params, reference = linen_setup(scan=True)
  # A policy on the 2-D mesh, the plain checkpoint elsewhere.
  policy = (jax.checkpoint_policies.dots_with_no_batch_dims_saveable
            if strategy is HYBRID_SHARD else None)
  model = LinenModel(L_D, L_FF, L_BLOCKS, remat=True, scan=True, policy=policy)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, stacked_layers=("params.blocks",),
                               use_orig_params=strategy is SHARD_GRAD_OP)
  losses, full, plan, compiled = fsdp_train(
      linen_loss(model), params, linen_batches(), mesh_for(strategy, n, replicate), config)
  blocks = plan.unit_by_name("params.blocks")
  assert blocks.stacked and blocks.num_layers == L_BLOCKS
  assert_matches_reference(losses, full, reference)

  text = compiled.as_text()
  in_loop = hlo_lib.loop_bodies(text)
  ops = unit_collectives(text)
  sizes = collective_sizes(plan, blocks)  # one layer: its buffer, or each leaf's
  assert sum(sizes) == plan.padded_numel(blocks) // blocks.num_layers
  gathers = [op for op in ops if op[:2] == ("all-gather", "params.blocks")]
  scatters = [op for op in ops if op[:2] == ("reduce-scatter", "params.blocks")]
  # One layer per gather: the forward loop, plus the backward loop when the
  # strategy reshards (the user's re-computation re-uses it). Each loop
  # carries the next layer's gather; its first layer is gathered before it.
  looped = [op for op in gathers if op[2] in in_loop]
  assert len(looped) == (2 if strategy in RESHARDS else 1) * len(sizes), gathers
  assert len(gathers) == 2 * len(looped), gathers
  assert scatters and len(scatters) == len(sizes), scatters
  for _, _, comp, numels in gathers:
    assert len(numels) == 1 and numels[0] in sizes
  for _, _, comp, numels in scatters:
    assert len(numels) == 1 and numels[0] in [x // plan.n for x in sizes] and comp in in_loop
  assert max(n for op in ops for n in op[3]) < plan.padded_numel(blocks)  # never the stack
  root = next(u for u in plan.units if u.is_root)
  assert counts_per_unit(text)[("all-gather", "<root>")] == collectives_per_call(plan, root)[0]


@pytest.mark.parametrize("strategy", [FULL_SHARD, SHARD_GRAD_OP])
@pytest.mark.slow
def test_scan_of_remat_blocks_reduces_activation_memory(strategy):
  """nn.scan(nn.remat(Block)) over a stacked unit. Temporaries per device
  (MiB, jax 0.10.2, CPU, 2 devices) without / with nn.remat: FULL_SHARD
  15.45 / 15.45, SHARD_GRAD_OP 14.91 / 15.41 by itself: the rebuilt scan body runs
  under the step's remat policy, which overrides the model's, whatever the
  strategy (NESTED_REMAT). With each user checkpoint re-bound as a
  custom_vjp in fsdp_jax/_src/schedule.py: 15.45 / 2.70 and 14.91 / 2.49.
  Since the loop over the layers recomputes elementwise operations itself,
  saving only the costly results (the FF-wide pre-activation of each
  block): 4.00 / 2.24 and 4.25 / 2.49. The model's checkpoint then drops
  that pre-activation for every block but the one the backward loop is
  recomputing."""
  mesh = mesh_for(strategy, 2)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, stacked_layers=("params.blocks",))
  batch = {"x": memory_batch()["x"][:, :6], "y": np.zeros((M_BATCH,), np.int32)}
  plain = LinenModel(M_D, M_FF, M_BLOCKS, scan=True)
  state = jax.eval_shape(lambda: fsdp_jax.init_train_state(  # shapes are enough to compile
      params=plain.init(jax.random.key(0), jnp.zeros((1, 6))), optimizer=adam(), mesh=mesh,
      config=config))
  compiled = {name: compile_step(linen_loss(model), state, batch, mesh, config)[1]
              for name, model in [("without", plain), ("with", LinenModel(
                  M_D, M_FF, M_BLOCKS, remat=True, scan=True))]}
  assert counts_per_unit(compiled["with"].as_text()) == counts_per_unit(
      compiled["without"].as_text())
  assert_activation_memory_drops(temp_bytes(compiled["with"]), temp_bytes(compiled["without"]),
                                 M_BATCH // 2, blocks=M_BLOCKS - 1, ratio=0.65)


# --------------------------------------------------------------------------
# The step's remat recomputes elementwise work on every jax version


ACTIVATIONS = {
    "tanh": jnp.tanh, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu_erf": functools.partial(jax.nn.gelu, approximate=False), "sigmoid": jax.nn.sigmoid,
    "silu": jax.nn.silu, "softplus": jax.nn.softplus, "log2": lambda x: jnp.log2(1 + x * x),
    "erf": jax.scipy.special.erf,
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_remat_policy_saves_only_matmul_outputs(name):
  """Under the step's remat (``collectives.remat_policy``) a layer saves its
  matmul's output and recomputes the activation and its derivative. jax 0.12
  computes tanh's derivative with a primitive of its own (one_minus_square)
  and erfc's with two more; missing from the policy's list, they were saved
  for every tanh-GELU / erf-GELU layer. Activations that are calls (softplus
  is a jitted custom_jvp function) are recomputed when their body is."""
  import contextlib  # pylint: disable=import-outside-toplevel
  import io  # pylint: disable=import-outside-toplevel
  from jax.ad_checkpoint import print_saved_residuals  # pylint: disable=import-outside-toplevel
  from fsdp_jax._src import _compat, collectives  # pylint: disable=import-outside-toplevel
  act = ACTIVATIONS[name]

  def f(w, x):
    for _ in range(2):
      x = act(x @ w)
    return jnp.sum(x)

  out = io.StringIO()
  with _compat.classic_tracing(), contextlib.redirect_stdout(out):
    print_saved_residuals(jax.checkpoint(f, policy=collectives.remat_policy),
                          jnp.ones((4, 4)), jnp.ones((2, 4)))
  lines = out.getvalue().strip().splitlines()
  saved = [line.split("output of ")[1].split()[0] for line in lines if "output of" in line]
  assert saved and set(saved) == {"dot_general"}, lines


# --------------------------------------------------------------------------
# 6. FSDPConfig(activation_checkpointing=...): the framework checkpoints each
#    unit (PyTorch's apply_activation_checkpointing), the model unchanged


AC = fsdp_jax.ActivationCheckpointing
AC_ATOL = 1e-6  # float32: the recomputation repeats the same operations


def ac_count(loss_fn, state, batch) -> int:
  """``jax.checkpoint`` equations with a policy in the loss as the step
  traces it (at top level and in scan bodies): the framework's checkpoints
  (LoRA's adapter path adds checkpoints of its own, without a policy)."""
  from fsdp_jax._src import _compat, local_loss  # pylint: disable=import-outside-toplevel
  closed = local_loss.LocalLoss(loss_fn, state.plan).traced(batch)[0]

  def count(jaxpr):
    return sum((_compat.is_remat(e) and _compat.remat_params(e).policy is not None) + sum(count(j) for j in _compat.nested_jaxprs(e)
                                         if _compat.is_scan(e)) for e in jaxpr.eqns)
  return count(closed.jaxpr)


def ac_pair(loss_fn, params, batches, mesh, config, ac, *, checkpoints, steps_kw=None,
            module_classes=None):
  """Trains with ``config`` and with ``activation_checkpointing=ac``; asserts
  the same losses and parameters (to ``AC_ATOL``) and ``checkpoints``
  framework checkpoints in the loss. Returns ``{name: (losses, params, plan,
  compiled step)}``."""
  out = {}
  for name, cfg in [("without", config),
                    ("with", dataclasses.replace(config, activation_checkpointing=ac))]:
    state = fsdp_jax.init_train_state(params=params, optimizer=adam(), mesh=mesh, config=cfg,
                                      module_classes=module_classes)
    step = fsdp_jax.shard_train_step(loss_fn, adam(), mesh=mesh, config=cfg, **(steps_kw or {}))
    compiled = step.lower(state, batches[0]).compile()
    if name == "with":
      assert ac_count(loss_fn, state, batches[0]) == checkpoints
    plan = state.plan
    state, losses = train_steps(step, state, batches)
    out[name] = (losses, fsdp_jax.summon_full_params(state), plan, compiled)
  np.testing.assert_allclose(out["with"][0], out["without"][0], rtol=0, atol=AC_ATOL)
  assert_trees_close(out["with"][1], out["without"][1], rtol=AC_ATOL, atol=AC_ATOL)
  return out


def all_gathers(compiled) -> int:
  return sum(1 for k, _, _, _ in unit_collectives(compiled.as_text()) if k == "all-gather")


AC_CASES = [  # (strategy, devices, replicate, use_orig_params, policy)
    (FULL_SHARD, 2, None, False, "full"),
    (SHARD_GRAD_OP, 3, None, True, "dots"),
    (HYBRID_SHARD, 2, 2, False, "offload"),
]


@pytest.mark.parametrize("case", AC_CASES, ids=lambda c: f"{c[0].name}-{c[4]}")
def test_config_checkpointing_trains_as_without_and_gathers_as_often(case):
  strategy, n, replicate, orig, policy = case
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP_BLOCKS,
                               use_orig_params=orig)
  out = ac_pair(make_loss(), mlp_params(), mlp_batches(), mesh_for(strategy, n, replicate),
                config, AC(policy), checkpoints=BLOCKS)
  losses, params, plan, compiled = out["with"]
  if strategy is FULL_SHARD:
    assert_matches_reference(losses, params, mlp_reference())
  # FULL_SHARD's backward re-gather serves the recomputation; SHARD_GRAD_OP
  # gathers nothing more.
  assert counts_per_unit(compiled.as_text()) == counts_per_unit(out["without"][3].as_text())
  assert counts_per_unit(compiled.as_text()) == expected_counts(plan, strategy)


def test_config_checkpointing_with_tensor_parallelism_and_mixed_precision_units():
  """FSDP x TP (2 x 2), the blocks' MLPs split; only ``blocks.1`` selected."""
  config = fsdp_jax.FSDPConfig(
      auto_wrap_policy=WRAP_BLOCKS,
      tensor_parallel=fsdp_jax.TensorParallel(rules=[("*.w1", "colwise"), ("*.b1", "colwise"),
                                                     ("*.w2", "rowwise")]))
  mesh = fsdp_jax.make_mesh(shard=2, tensor=2, devices=jax.devices()[:4])
  params = mlp_params()
  for blk in params["blocks"]:  # widths the tensor axis divides
    blk["w1"], blk["b1"], blk["w2"] = blk["w1"][:, :16], blk["b1"][:16], blk["w2"][:16]
  out = ac_pair(make_loss(), params, mlp_batches()[:2], mesh, config,
                AC("full", units="blocks.1"), checkpoints=1)
  # The units' gathers as without; tensor parallelism's own collectives in
  # blocks.1 (an all-gather where a split activation meets a replicated
  # operation) run again in its recomputation, as in Megatron's.
  counts = {k: counts_per_unit(out[k][3].as_text()) for k in ("with", "without")}
  fsdp = lambda c: {k: v for k, v in c.items() if k[1] != "?"}
  assert fsdp(counts["with"]) == fsdp(counts["without"])
  assert counts["with"][("all-gather", "?")] == counts["without"][("all-gather", "?")] + 1


def test_config_checkpointing_with_lora_accumulation_and_offload():
  """LoRA adapters on the blocks' matmuls, two microbatches, parameters in
  host memory; ``dots`` on the units a predicate selects."""
  config = fsdp_jax.FSDPConfig(
      auto_wrap_policy=WRAP_BLOCKS, lora=fsdp_jax.LoRA(targets=("*.w1", "*.w2"), rank=2),
      cpu_offload=fsdp_jax.CPUOffload(offload_params=True))
  ac = AC("dots", units=lambda name: name not in ("blocks.0", "<root>"))
  ac_pair(make_loss(), mlp_params(), mlp_batches()[:2], mesh_for(FULL_SHARD, 2), config, ac,
          checkpoints=BLOCKS - 1, steps_kw={"gradient_accumulation_steps": 2})


def test_config_checkpointing_of_stacked_layers_checkpoints_each_layer():
  """A scan over stacked layers: the checkpoint goes in the scan body, one
  layer at a time, and the loops still gather one layer per iteration."""
  model = LinenModel(L_D, L_FF, L_BLOCKS, scan=True)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 6)))
  config = fsdp_jax.FSDPConfig(stacked_layers=("params.blocks",),
                               mixed_precision=fsdp_jax.MixedPrecision(reduce_dtype=jnp.float32))
  out = ac_pair(linen_loss(model), params, linen_batches()[:2], mesh_for(FULL_SHARD, 2),
                config, AC("offload"), checkpoints=1)
  with_, without = (unit_collectives(out[k][3].as_text()) for k in ("with", "without"))
  assert sorted(op[:2] for op in with_) == sorted(op[:2] for op in without)
  in_loop = hlo_lib.loop_bodies(out["with"][3].as_text())
  assert [op for op in with_ if op[:2] == ("all-gather", "params.blocks") and op[2] in in_loop]


def test_config_checkpointing_reduces_activation_memory():
  """The memory model of section 3, checkpointed by the config instead of
  the model: temporaries per device (jax 0.10.2, CPU, 2 devices) 5.71 MiB
  without, 2.88 MiB with (the block's last add and tanh stay outside its
  checkpoint, which ends at the last read of its parameters; a
  jax.checkpoint around the whole block: 2.33 MiB). SHARD_GRAD_OP and the
  other policies: docs/activation_checkpointing.md."""
  strategy = FULL_SHARD
  mesh = mesh_for(strategy, 2)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP_BLOCKS)
  batch = memory_batch()
  compiled = {}
  for name, cfg in [("without", config), ("with", dataclasses.replace(
      config, activation_checkpointing=AC()))]:
    state = jax.eval_shape(lambda cfg=cfg: fsdp_jax.init_train_state(
        params=memory_params(), optimizer=adam(), mesh=mesh, config=cfg))
    compiled[name] = compile_step(make_loss(), state, batch, mesh, cfg)[1]
  assert counts_per_unit(compiled["with"].as_text()) == counts_per_unit(
      compiled["without"].as_text())
  assert_activation_memory_drops(temp_bytes(compiled["with"]), temp_bytes(compiled["without"]),
                                 M_BATCH // 2, ratio=0.55)


def test_activation_checkpointing_values_and_errors(monkeypatch):
  assert AC() == AC("full", None) and hash(AC("dots", "blocks.*")) == hash(AC("dots", ["blocks.*"]))
  assert AC("full") != AC("dots")
  assert fsdp_jax.FSDPConfig(activation_checkpointing=AC("dots", ("a.*",))) == fsdp_jax.FSDPConfig(
      activation_checkpointing=AC(policy="dots", units="a.*"))
  with pytest.raises(ValueError, match=r"policy='selective'.*'full', 'dots', 'offload'"):
    AC("selective")
  with pytest.raises(TypeError, match="activation_checkpointing=.*ActivationCheckpointing"):
    fsdp_jax.FSDPConfig(activation_checkpointing="full")
  mesh = mesh_for(FULL_SHARD, 2)

  def step_for(ac):
    config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS, activation_checkpointing=ac)
    state = jax.eval_shape(lambda: fsdp_jax.init_train_state(
        params=mlp_params(), optimizer=adam(), mesh=mesh, config=config))
    fsdp_jax.shard_train_step(make_loss(), adam(), mesh=mesh, config=config).lower(
        state, mlp_batches()[0])

  state = fsdp_jax.init_train_state(
      params=mlp_params(), optimizer=adam(), mesh=mesh, config=fsdp_jax.FSDPConfig(
          auto_wrap_policy=WRAP_BLOCKS, activation_checkpointing=AC("dots", "blocks.*")))
  assert "activation checkpointing: dots (blocks.*)" in str(state.plan)
  with pytest.raises(ValueError, match=r"'layers\.\*' names no unit\. The units are: "
                                       r"<root>, blocks\.0, blocks\.1, blocks\.2"):
    step_for(AC(units=["blocks.*", "layers.*"]))
  from fsdp_jax._src import offload  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(offload, "memory_kinds", lambda d: ["device"])
  with pytest.raises(ValueError, match=r"policy='offload'.*'pinned_host'.*\['device'\]"):
    step_for(AC("offload"))


@pytest.mark.parametrize("policy", ["offload", "full"])
def test_offload_policy_marks_the_units_activations_for_host_memory(policy):
  """``"offload"``: each checkpoint's residuals are the unit's gathered
  parameters (on the device: the strategy keeps or re-gathers them) and the
  activations it reads, moved to host memory (``f32<host>``); on this CPU
  backend the copy is a no-op, on a GPU it frees device memory. ``"full"``
  keeps them on the device."""
  from fsdp_jax._src import _compat, local_loss  # pylint: disable=import-outside-toplevel
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP_BLOCKS, activation_checkpointing=AC(policy))
  state = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      params=mlp_params(), optimizer=adam(), mesh=mesh_for(FULL_SHARD, 2), config=config))
  closed = local_loss.LocalLoss(make_loss(), state.plan).traced(mlp_batches()[0])[0]
  params = set(closed.jaxpr.invars[:len(state.plan.leaves)])
  eqns = [e for e in closed.jaxpr.eqns
          if _compat.is_remat(e) and _compat.remat_params(e).policy is not None]
  assert len(eqns) == BLOCKS
  for eqn in eqns:
    args = [jnp.ones(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    saved = _compat.saved_residuals(lambda *a, eqn=eqn: _compat.bind_eqn(eqn, a), *args)
    on_host = [str(aval) for aval, _ in saved if "<host>" in str(aval)]
    activations = [v for v in eqn.invars if v not in params]
    assert len(saved) == len(eqn.invars), saved  # the inputs, nothing computed
    assert len(on_host) == (len(activations) if policy == "offload" else 0), saved
