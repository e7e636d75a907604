"""Real models train unchanged through fsdp_jax and match unsharded JAX.

Every test builds a model the way a user would (Flax linen, Flax NNX, plain
functions over dicts of arrays, ``lax.scan`` / ``nn.scan`` over stacked
layers), trains it for a few Adam steps with ``fsdp_jax.shard_train_step`` on
a simulated CPU mesh, and compares every step's loss and the final
parameters with plain single-device JAX (``jax.value_and_grad`` on the global
batch + ``optimizer.update`` + ``optax.apply_updates``).

The scan tests also read the compiled HLO to check that a stacked unit is
all-gathered one layer at a time, inside the loop bodies.
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
from flax import nnx

import fsdp_jax

import helpers
from helpers import collective_sizes, collectives_per_call, train_steps

# Training real models (transformers, nn.scan stacks) against references is
# slow; the HLO parser's check runs in the fast subset.
FULL_SHARD = fsdp_jax.ShardingStrategy.FULL_SHARD
SHARD_GRAD_OP = fsdp_jax.ShardingStrategy.SHARD_GRAD_OP
HYBRID_SHARD = fsdp_jax.ShardingStrategy.HYBRID_SHARD

NUM_STEPS = 4
LOSS_ATOL = 1e-5
PARAM_RTOL = 2e-4
PARAM_ATOL = 1e-6


def adam():
  return optax.adam(1e-2)


def normal(rng, shape, scale=1.0):
  # NumPy random numbers: no XLA compilation per shape, unlike jax.random.
  return (scale * rng.standard_normal(shape)).astype(np.float32)


def labels(rng, shape, num_classes):
  return rng.integers(0, num_classes, shape).astype(np.int32)


# --------------------------------------------------------------------------
# Helpers: reference training, sharded training, comparisons


def make_mesh(shard, replicate=None, first_device=0):
  n = shard * (replicate or 1)
  devices = jax.devices()[first_device:first_device + n]
  assert len(devices) == n
  return fsdp_jax.make_mesh(shard=shard, replicate=replicate, devices=devices)


# The reference is compiled without LLVM optimizations: it is 2-3x faster to
# compile and computes the same function.


def reference_train(loss_fn, params, optimizer, batches):
  """Single-device, unsharded training: the numbers fsdp_jax must reproduce."""
  return helpers.jit_reference_run(loss_fn, params, optimizer, batches)


def assert_sharded(state):
  """The stored params and the optimizer moments are really split N ways."""
  plan = state.plan
  n = plan.n
  assert n > 1
  for x in jax.tree_util.tree_leaves(state.params):
    local = x.addressable_shards[0].data
    assert local.size * n == x.size, (x.shape, local.shape)
  moments = [x for x in jax.tree_util.tree_leaves(state.opt_state) if np.ndim(x) >= 1]
  assert moments, "adam should hold per-parameter moments"
  for x in moments:
    assert x.addressable_shards[0].data.size * n == x.size, (x.shape,)


# The reference's tolerances unless a test gives others.
assert_trees_close = functools.partial(helpers.assert_trees_close, rtol=PARAM_RTOL,
                                       atol=PARAM_ATOL)


def assert_params_moved(new, old):
  """Training changed every parameter (so matching the reference means
  something: the sharded gradients and updates were right)."""
  for a, b in zip(jax.tree_util.tree_leaves(jax.device_get(new)),
                  jax.tree_util.tree_leaves(jax.device_get(old))):
    assert np.max(np.abs(np.asarray(a) - np.asarray(b))) > 1e-4


def fsdp_train(loss_fn, optimizer, mesh, config, batches, *, init_params=None,
               hlo=False, **init_kwargs):
  """Trains with fsdp_jax; returns (final full params, per-step losses, state,
  compiled HLO text or None)."""
  state = fsdp_jax.init_train_state(optimizer=optimizer, mesh=mesh, config=config,
                                    **init_kwargs)
  assert_sharded(state)
  if init_params is not None:  # init_fn, run per unit, built these values
    assert_trees_close(fsdp_jax.summon_full_params(state), init_params, rtol=1e-6, atol=1e-7)
  step = fsdp_jax.shard_train_step(loss_fn, optimizer, mesh=mesh, config=config)
  text = step.lower(state, batches[0]).compile().as_text() if hlo else None
  state, losses = train_steps(step, state, batches)
  assert int(state.step) == len(batches)
  assert_sharded(state)
  return fsdp_jax.summon_full_params(state), losses, state, text


def assert_matches_reference(losses, params, ref_losses, ref_params):
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=LOSS_ATOL)
  assert_trees_close(params, ref_params)


def unit_names(plan):
  return [u.name for u in plan.units]


def unit_leaf_names(plan, name):
  unit = plan.unit_by_name(name)
  return sorted(plan.leaves[i].name for i in unit.leaf_ids)


# --------------------------------------------------------------------------
# HLO inspection


_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s+"
    r"(?P<kind>all-gather-start|all-gather|reduce-scatter|all-reduce-start|all-reduce)\(")
_CALLEE = re.compile(
    r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_SHAPE = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str                # "all-gather" or "reduce-scatter" or "all-reduce"
  computation: str         # the HLO computation the instruction lives in
  shapes: tuple            # result shapes (several when XLA combined ops)
  op_name: str             # the JAX op name from the metadata

  @property
  def numels(self):
    return [int(np.prod(s, dtype=np.int64)) for s in self.shapes]


class Hlo:
  """A compiled HLO module's collectives and while loops.

  ``loops_of(op)`` says which while-loop bodies an instruction runs in (the
  bodies whose call graph reaches the instruction's computation)."""

  def __init__(self, text: str):
    self.collectives: list[Collective] = []
    calls = collections.defaultdict(set)
    self.while_bodies: list[str] = []
    current = None
    for line in text.splitlines():
      if line and not line[0].isspace():
        m = re.match(r"(?:ENTRY\s+)?%?([\w.\-]+)\s*\(", line)
        if m and line.rstrip().endswith("{"):
          current = m.group(1)
        continue
      if current is None:
        continue
      calls[current].update(_CALLEE.findall(line))
      for group in _BRANCHES.findall(line):
        calls[current].update(c.strip().lstrip("%") for c in group.split(",") if c.strip())
      if re.search(r"\swhile\(", line):
        self.while_bodies.append(re.search(r"\bbody=%?([\w.\-]+)", line).group(1))
      m = _COLLECTIVE.match(line)
      if m:
        kind = m.group("kind").replace("-start", "")
        shapes = [tuple(int(d) for d in s.split(",") if d) for s in _SHAPE.findall(m.group("type"))]
        if m.group("kind").endswith("-start"):
          shapes = shapes[len(shapes) // 2:]  # (operands..., results...)
        op = re.search(r'op_name="([^"]*)"', line)
        self.collectives.append(Collective(kind, current, tuple(shapes), op.group(1) if op else ""))
    self.reach = {}
    for body in self.while_bodies:
      seen, todo = set(), [body]
      while todo:
        c = todo.pop()
        if c not in seen:
          seen.add(c)
          todo.extend(calls.get(c, ()))
      self.reach[body] = seen

  def loops_of(self, op: Collective) -> set:
    return {b for b, comps in self.reach.items() if op.computation in comps}

  def ops(self, kind: str, label: str | None = None) -> list[Collective]:
    return [c for c in self.collectives if c.kind == kind and
            (label is None or f"fsdp_all_gather[{label}]" in c.op_name)]


def test_hlo_parser_finds_collectives_in_loop_bodies():
  text = """HloModule m, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%body (p: (s32[], f32[4,3])) -> (s32[], f32[4,3]) {
  %x = f32[1,3]{1,0} parameter(0)
  %all-gather.1 = f32[4,3]{1,0} all-gather(%x), channel_id=1, dimensions={0}, metadata={op_name="a/fsdp_all_gather[blocks]/all_gather"}
  %call.2 = f32[3] call(%all-gather.1), to_apply=%inner
}

%inner (q: f32[4,3]) -> f32[3] {
  %rs = f32[1,3]{1,0} reduce-scatter(%q), dimensions={0}, to_apply=%add, metadata={op_name="b"}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %ags = ((f32[2]{0}, f32[3]{0}), (f32[8]{0}, f32[12]{0})) all-gather-start(%a, %b), dimensions={0}
  %w = (s32[], f32[4,3]) while(%t), condition=%cond, body=%body
}
"""
  hlo = Hlo(text)
  assert hlo.while_bodies == ["body"]
  (ag_loop,) = hlo.ops("all-gather", "blocks")
  assert ag_loop.shapes == ((4, 3),) and hlo.loops_of(ag_loop) == {"body"}
  (rs,) = hlo.ops("reduce-scatter")
  assert rs.computation == "inner" and hlo.loops_of(rs) == {"body"}
  start = [c for c in hlo.ops("all-gather") if c.computation == "main"]
  assert start[0].shapes == ((8,), (12,)) and not hlo.loops_of(start[0])


# --------------------------------------------------------------------------
# 1. Flax linen transformer, class-based ModuleWrapPolicy({Block})

VOCAB, D_MODEL, HEADS, D_FF, SEQ = 37, 22, 2, 40, 8


class Block(nn.Module):
  """Pre-LayerNorm transformer block: causal self-attention, then an MLP."""

  @nn.compact
  def __call__(self, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
    h = nn.LayerNorm()(x)
    # No q/k/v biases: the key bias has an identically zero gradient (softmax
    # is shift invariant), which Adam would turn into sign noise.
    h = nn.MultiHeadDotProductAttention(num_heads=HEADS, use_bias=False)(h, h, mask=mask)
    x = x + h
    h = nn.LayerNorm()(x)
    h = nn.Dense(D_FF)(h)
    h = nn.Dense(D_MODEL)(nn.gelu(h))
    return x + h


class Transformer(nn.Module):
  num_blocks: int = 2

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D_MODEL)(tokens)
    x = x + self.param("pos_embed", nn.initializers.normal(0.02), (SEQ, D_MODEL))
    for _ in range(self.num_blocks):
      x = Block()(x)
    x = nn.LayerNorm()(x)
    return nn.Dense(VOCAB)(x)


TRANSFORMER = Transformer()


def transformer_loss(params, batch):
  tokens = batch["tokens"]
  logits = TRANSFORMER.apply(params, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def transformer_init(rng):
  return TRANSFORMER.init(rng, jnp.zeros((1, SEQ), jnp.int32))


@functools.lru_cache(maxsize=None)
def transformer_reference():
  rng = np.random.default_rng(100)
  batches = [{"tokens": labels(rng, (24, SEQ + 1), VOCAB)} for _ in range(NUM_STEPS)]
  params = jax.jit(transformer_init)(jax.random.key(0))
  losses, final = reference_train(transformer_loss, params, adam(), batches)
  return batches, params, losses, final


# SHARD_GRAD_OP on 4 devices with the original parameters, from materialised
# params and explicitly collected module classes: tests/test_user_models.py::
# test_lm1b_weighted_loss_matches_global_batch_jit[SHARD_GRAD_OP-4-orig]
# trains a linen Transformer that way against jit.
@pytest.mark.parametrize("strategy, shard, first_device, use_orig_params, from_init_fn", [
    pytest.param(FULL_SHARD, 3, 5, False, True, id="FULL_SHARD-3dev-flat"),
    pytest.param(FULL_SHARD, 8, 0, True, True, id="FULL_SHARD-8dev-orig"),
])
@pytest.mark.slow
def test_linen_transformer_matches_single_device(strategy, shard, first_device,
                                                 use_orig_params, from_init_fn):
  batches, params0, ref_losses, ref_params = transformer_reference()
  mesh = make_mesh(shard, first_device=first_device)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy,
                               auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({Block}),
                               use_orig_params=use_orig_params)
  if from_init_fn:  # module classes captured from init_fn automatically
    init = dict(init_fn=lambda rng: transformer_init(rng), rng=jax.random.key(0),
                init_params=params0)
  else:  # materialised params, module classes collected explicitly
    init = dict(params=params0, module_classes=fsdp_jax.module_classes(
        TRANSFORMER.init, jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32)))
  params, losses, state, _ = fsdp_train(transformer_loss, adam(), mesh, config,
                                        batches, **init)

  # The class-based policy found the two Block instances; everything else is
  # the root unit.
  plan = state.plan
  assert unit_names(plan) == ["params.Block_0", "params.Block_1", ""]
  for b in ("Block_0", "Block_1"):
    names = unit_leaf_names(plan, f"params.{b}")
    assert names == sorted(l.name for l in plan.leaves
                           if l.name.startswith(f"params.{b}."))
    assert len(names) == 12  # 2 LayerNorms, 2 Dense (2 each), q/k/v/out kernels
  assert all(not l.name.startswith("params.Block") for l in
             (plan.leaves[i] for i in plan.unit_by_name("").leaf_ids))

  assert ref_losses[-1] < ref_losses[0]
  assert_params_moved(ref_params, params0)
  assert_matches_reference(losses, params, ref_losses, ref_params)


@pytest.mark.slow
def test_linen_module_classes_captured_for_a_reused_init_fn():
  mesh = make_mesh(2)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({Block}))
  for _ in range(2):  # e.g. re-running a notebook cell, or a second experiment
    state = fsdp_jax.init_train_state(init_fn=transformer_init, rng=jax.random.key(0),
                                      optimizer=optax.sgd(0.1), mesh=mesh, config=config)
    assert unit_names(state.plan) == ["params.Block_0", "params.Block_1", ""]


# --------------------------------------------------------------------------
# 2. Flax NNX model through nnx.split / nnx.merge


class NnxBlock(nnx.Module):

  def __init__(self, d, rngs):
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.linear = nnx.Linear(d, d, rngs=rngs)

  def __call__(self, x):
    return x + jax.nn.gelu(self.linear(self.norm(x)))


class NnxMLP(nnx.Module):

  def __init__(self, d_in, d, d_out, num_blocks, rngs):
    self.inp = nnx.Linear(d_in, d, rngs=rngs)
    self.blocks = nnx.List([NnxBlock(d, rngs) for _ in range(num_blocks)])
    self.out = nnx.Linear(d, d_out, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)
    for block in self.blocks:
      x = block(x)
    return self.out(x)


NNX_BLOCKS = 3


@functools.lru_cache(maxsize=None)
def nnx_setup():
  model = NnxMLP(5, 13, 4, NNX_BLOCKS, nnx.Rngs(0))
  graphdef, params0 = nnx.split(model, nnx.Param)

  def loss_fn(params, batch):
    m = nnx.merge(graphdef, params)
    logits = m(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  rng = np.random.default_rng(7)
  batches = [{"x": normal(rng, (16, 5)), "y": labels(rng, (16,), 4)}
             for _ in range(NUM_STEPS)]
  ref_losses, ref_params = reference_train(loss_fn, params0, adam(), batches)
  return graphdef, params0, loss_fn, batches, ref_losses, ref_params


# HYBRID_SHARD 2x2 with the original parameters: tests/test_user_models.py::
# test_nnx_transformer_matches_nnx_jit trains an NNX transformer there (and on
# FULL_SHARD 3, flat) against NNX under jit, and loads the result back.
@pytest.mark.parametrize("strategy, shard, replicate, use_orig_params", [
    pytest.param(FULL_SHARD, 8, None, False, id="FULL_SHARD-8dev-flat"),
])
@pytest.mark.slow
def test_nnx_model_matches_single_device(strategy, shard, replicate, use_orig_params):
  num_blocks = NNX_BLOCKS
  graphdef, params0, loss_fn, batches, ref_losses, ref_params = nnx_setup()
  model = nnx.merge(graphdef, params0, copy=True)  # update() below mutates it

  mesh = make_mesh(shard, replicate)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy,
                               auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({NnxBlock}),
                               use_orig_params=use_orig_params)
  params, losses, state, _ = fsdp_train(
      loss_fn, adam(), mesh, config, batches, params=params0,
      module_classes=fsdp_jax.module_classes(model))

  # One unit per block, holding exactly that block's four parameters; the
  # input and output layers stay in the root unit.
  plan = state.plan
  assert len(plan.units) == num_blocks + 1
  for i in range(num_blocks):
    assert plan.units[i].name == f"blocks.{i}"
    assert unit_leaf_names(plan, f"blocks.{i}") == [
        f"blocks.{i}.linear.bias", f"blocks.{i}.linear.kernel",
        f"blocks.{i}.norm.bias", f"blocks.{i}.norm.scale"]
  root = plan.units[-1]
  assert root.is_root and root.name == ""
  assert sorted(plan.leaves[i].name for i in root.leaf_ids) == [
      "inp.bias", "inp.kernel", "out.bias", "out.kernel"]

  assert isinstance(params, nnx.State)
  assert_params_moved(ref_params, params0)
  assert_matches_reference(losses, params, ref_losses, ref_params)
  # The trained parameters load back into the NNX model.
  nnx.update(model, params)
  assert_trees_close(nnx.state(model, nnx.Param), ref_params)


# --------------------------------------------------------------------------
# 3. lax.scan over stacked layers (plain function), stacked_layers=("blocks",)

SCAN_L, SCAN_D, SCAN_IN, SCAN_OUT = 3, 10, 5, 7


def scan_params():
  rng = np.random.default_rng(3)
  return {
      "embed": normal(rng, (SCAN_IN, SCAN_D), 0.4),
      "blocks": {"w": normal(rng, (SCAN_L, SCAN_D, SCAN_D), 0.3),
                 "b": normal(rng, (SCAN_L, SCAN_D), 0.1)},
      "head": normal(rng, (SCAN_D, SCAN_OUT), 0.4),
  }


def scan_loss(params, batch):
  h = batch["x"] @ params["embed"]

  def layer(h, blk):
    return h + jnp.tanh(h @ blk["w"] + blk["b"]), None

  h, _ = jax.lax.scan(layer, h, params["blocks"])
  logits = h @ params["head"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def scan_batches():
  rng = np.random.default_rng(11)
  return [{"x": normal(rng, (16, SCAN_IN)), "y": labels(rng, (16,), SCAN_OUT)}
          for _ in range(NUM_STEPS)]


@functools.lru_cache(maxsize=None)
def scan_reference():
  batches = scan_batches()
  params = scan_params()
  losses, final = reference_train(scan_loss, params, adam(), batches)
  return batches, params, losses, final


SCAN_CASES = {
    "FULL_SHARD-4dev-flat": (FULL_SHARD, 4, None, False),
    "SHARD_GRAD_OP-4dev-orig": (SHARD_GRAD_OP, 4, None, True),
    "HYBRID_SHARD-2x2-orig": (HYBRID_SHARD, 2, 2, True),
}
_SCAN_RESULTS: dict = {}


def scan_run(case):
  """Trains the scan model for ``case`` once per session; returns (full
  params, losses, plan, Hlo)."""
  if case not in _SCAN_RESULTS:
    strategy, shard, replicate, orig = SCAN_CASES[case]
    batches, params0, _, _ = scan_reference()
    config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, stacked_layers=("blocks",),
                                 use_orig_params=orig)
    params, losses, state, text = fsdp_train(
        scan_loss, adam(), make_mesh(shard, replicate), config, batches,
        params=params0, hlo=True)
    _SCAN_RESULTS[case] = (params, losses, state.plan, Hlo(text))
  return _SCAN_RESULTS[case]


def stacked_gather_report(plan, hlo, unit_name):
  """Checks the HLO gathers stacked unit ``unit_name`` one layer at a time,
  and reduce-scatters its gradient one layer at a time inside loop bodies.

  Each loop carries the next layer's gather: the first layer of a pass is
  gathered before its loop, every other one inside it. Returns ``(gathers,
  forward, backward, before)``: the unit's all-gathers inside loops, the loop
  bodies that gather a layer but reduce no gradient, the loop bodies that
  reduce-scatter a layer's gradient, and the gathers before a loop (as
  many as ``gathers``: one per loop and leaf)."""
  unit = plan.unit_by_name(unit_name)
  assert unit.stacked and unit.num_layers > 1
  layer_numel = plan.padded_numel(unit) // unit.num_layers  # one layer, all shards
  stack_numel = plan.padded_numel(unit)
  # One gather of a layer: the layer's buffer, or each leaf's layer
  # (use_orig_params=True).
  sizes = collective_sizes(plan, unit)
  assert sum(sizes) == layer_numel

  everything = hlo.ops("all-gather", unit_name)
  assert everything, f"no all-gather of unit {unit_name!r} in the HLO"
  for op in everything:
    assert len(op.numels) == 1 and op.numels[0] in sizes, (
        f"{unit_name} all-gather of shape {op.shapes}, expected one layer ({sizes} "
        f"elements) (the stack has {stack_numel})")
  for op in hlo.ops("all-gather"):  # nothing, whatever its label, gathers the stack
    assert max(op.numels) < stack_numel, op
  gathers = [op for op in everything if hlo.loops_of(op)]
  before = [op for op in everything if not hlo.loops_of(op)]
  assert sorted(op.shapes for op in before) == sorted(op.shapes for op in gathers), (
      f"{unit_name}: gathers before the loops {before}, in them {gathers}: each loop "
      "should gather its first layer before it and the others inside it")

  scatters = hlo.ops("reduce-scatter", unit_name)
  assert scatters, f"no reduce-scatter of unit {unit_name!r}"
  for op in scatters:  # each layer's gradient is reduced inside the backward loop
    assert len(op.numels) == 1 and op.numels[0] in [x // plan.n for x in sizes], op
    assert hlo.loops_of(op), op
  backward = set().union(*(hlo.loops_of(op) for op in scatters))
  gathering = set().union(*(hlo.loops_of(op) for op in gathers))
  forward = gathering - backward
  assert forward, "no forward loop gathers a layer"
  return gathers, forward, backward, before


@pytest.mark.parametrize("case", list(SCAN_CASES))
@pytest.mark.slow
def test_scan_stacked_layers_match_single_device(case):
  batches, params0, ref_losses, ref_params = scan_reference()
  params, losses, plan, hlo = scan_run(case)
  strategy = SCAN_CASES[case][0]

  blocks = plan.unit_by_name("blocks")
  assert blocks.stacked and blocks.num_layers == SCAN_L
  assert unit_leaf_names(plan, "blocks") == ["blocks.b", "blocks.w"]
  assert unit_leaf_names(plan, "") == ["embed", "head"]

  assert_params_moved(ref_params, params0)
  assert_matches_reference(losses, params, ref_losses, ref_params)

  gathers, forward, backward, _ = stacked_gather_report(plan, hlo, "blocks")
  per_call = collectives_per_call(plan, blocks)[0]  # 2 with use_orig_params: b, w
  if strategy is SHARD_GRAD_OP:
    # ZeRO-2: one gather per layer in the forward loop, kept for backward.
    assert len(gathers) == per_call
    assert not any(hlo.loops_of(op) & backward for op in gathers)
  elif per_call == 1:
    # Resharded after forward: a second gather in the backward loop.
    assert len(gathers) == 2
  else:
    # ...of each leaf the backward pass reads: blocks.w, and blocks.b where
    # it recomputes tanh's input from it (jax 0.10; 0.12 reads tanh's
    # saved output).
    assert per_call + 1 <= len(gathers) <= 2 * per_call
    w_layer = max(collective_sizes(plan, blocks))  # blocks.w, the largest leaf
    assert any(hlo.loops_of(op) & backward and op.numels[0] == w_layer for op in gathers)


@pytest.mark.parametrize("case", ["FULL_SHARD-4dev-flat", "HYBRID_SHARD-2x2-orig"])
@pytest.mark.slow
def test_scan_full_shard_regathers_each_layer_in_backward_loop(case):
  _, _, plan, hlo = scan_run(case)
  gathers, forward, backward, _ = stacked_gather_report(plan, hlo, "blocks")
  # The loop that reduce-scatters layer i's gradient must itself gather
  # layer i (FULL_SHARD frees it after forward), and the forward loop too.
  assert any(hlo.loops_of(op) & backward for op in gathers), (
      "the backward loop does not all-gather its layer")
  assert any(hlo.loops_of(op) & forward for op in gathers)


# --------------------------------------------------------------------------
# 4. Flax linen nn.scan over a block, stacked_layers=("params.blocks",)

LSCAN_L, LSCAN_D = 4, 12


class ScanBlock(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(LSCAN_D)(nn.LayerNorm()(x))
    return x + jnp.tanh(h), None


class LinenScanModel(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(LSCAN_D, name="inp")(x)
    stack = nn.scan(ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=LSCAN_L)
    x, _ = stack(name="blocks")(x, None)
    return nn.Dense(3, name="head")(x)


LSCAN_MODEL = LinenScanModel()


def lscan_init(rng):
  return LSCAN_MODEL.init(rng, jnp.zeros((1, 6)))


def lscan_loss(params, batch):
  return optax.softmax_cross_entropy_with_integer_labels(
      LSCAN_MODEL.apply(params, batch["x"]), batch["y"]).mean()


@functools.lru_cache(maxsize=None)
def lscan_reference():
  rng = np.random.default_rng(5)
  batches = [{"x": normal(rng, (8, 6)), "y": labels(rng, (8,), 3)}
             for _ in range(NUM_STEPS)]
  params0 = jax.jit(lscan_init)(jax.random.key(1))
  ref_losses, ref_params = reference_train(lscan_loss, params0, adam(), batches)
  return batches, params0, ref_losses, ref_params


@pytest.mark.parametrize("strategy, use_orig_params, from_init_fn", [
    pytest.param(FULL_SHARD, False, True, id="FULL_SHARD-4dev-flat"),
    pytest.param(SHARD_GRAD_OP, True, False, id="SHARD_GRAD_OP-4dev-orig"),
])
@pytest.mark.slow
def test_linen_nn_scan_matches_single_device(strategy, use_orig_params, from_init_fn):
  batches, params0, ref_losses, ref_params = lscan_reference()
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy,
                               stacked_layers=("params.blocks",),
                               use_orig_params=use_orig_params)
  if from_init_fn:
    init = dict(init_fn=lambda rng: lscan_init(rng), rng=jax.random.key(1),
                init_params=params0)
  else:
    init = dict(params=params0)
  params, losses, state, text = fsdp_train(lscan_loss, adam(), make_mesh(4), config,
                                           batches, hlo=True, **init)

  plan = state.plan
  blocks = plan.unit_by_name("params.blocks")
  assert blocks.stacked and blocks.num_layers == LSCAN_L
  assert unit_leaf_names(plan, "params.blocks") == [
      "params.blocks.Dense_0.bias", "params.blocks.Dense_0.kernel",
      "params.blocks.LayerNorm_0.bias", "params.blocks.LayerNorm_0.scale"]
  assert_params_moved(ref_params, params0)
  assert_matches_reference(losses, params, ref_losses, ref_params)
  # nn.scan lowers to lax.scan over the stacked params: one layer per gather.
  stacked_gather_report(plan, Hlo(text), "params.blocks")


# --------------------------------------------------------------------------
# 5. Plain-function MLP with lambda_auto_wrap_policy


@pytest.mark.slow
def test_plain_mlp_lambda_policy_matches_single_device():
  d_in, d, d_out, num_layers = 6, 18, 5, 3
  rng = np.random.default_rng(9)
  params0 = {
      "layers": [{"dense": {"w": normal(rng, (d_in if i == 0 else d, d), d ** -0.5),
                            "b": normal(rng, (d,), 0.1)},
                  "norm": {"scale": 1.0 + normal(rng, (d,), 0.1),
                           "bias": normal(rng, (d,), 0.1)}}
                 for i in range(num_layers)],
      "head": {"w": normal(rng, (d, d_out), d ** -0.5), "b": np.zeros((d_out,), np.float32)},
  }

  def loss_fn(params, batch):
    h = batch["x"]
    for layer in params["layers"]:
      h = jax.nn.relu(h @ layer["dense"]["w"] + layer["dense"]["b"])
      mu = h.mean(-1, keepdims=True)
      var = ((h - mu) ** 2).mean(-1, keepdims=True)
      h = (h - mu) * jax.lax.rsqrt(var + 1e-5) * layer["norm"]["scale"] + layer["norm"]["bias"]
    pred = h @ params["head"]["w"] + params["head"]["b"]
    return jnp.mean((pred - batch["y"]) ** 2)

  rng = np.random.default_rng(13)
  batches = [{"x": normal(rng, (16, d_in)), "y": normal(rng, (16, d_out))}
             for _ in range(NUM_STEPS)]
  ref_losses, ref_params = reference_train(loss_fn, params0, adam(), batches)

  # Wrap each element of the "layers" list (path depth 2), not its "dense"
  # and "norm" children (depth 3), which `startswith("layers.")` would wrap.
  policy = functools.partial(
      fsdp_jax.lambda_auto_wrap_policy,
      lambda_fn=lambda node: len(node.path) == 2 and node.path[0] == "layers")
  config = fsdp_jax.FSDPConfig(sharding_strategy=FULL_SHARD, auto_wrap_policy=policy)
  params, losses, state, _ = fsdp_train(loss_fn, adam(), make_mesh(8), config, batches,
                                        params=params0)

  plan = state.plan
  assert unit_names(plan) == ["layers.0", "layers.1", "layers.2", ""]
  for i in range(num_layers):
    assert unit_leaf_names(plan, f"layers.{i}") == sorted(
        f"layers.{i}.{m}.{p}" for m, p in
        [("dense", "w"), ("dense", "b"), ("norm", "scale"), ("norm", "bias")])
  assert unit_leaf_names(plan, "") == ["head.b", "head.w"]
  assert sorted(state.params) == ["_flat_param", "layers.0._flat_param",
                                  "layers.1._flat_param", "layers.2._flat_param"]

  assert_params_moved(ref_params, params0)
  assert_matches_reference(losses, params, ref_losses, ref_params)
