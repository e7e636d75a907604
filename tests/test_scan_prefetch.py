"""Scans over stacked layers: the next layer's gather rides in the loop carry.

A ``lax.scan`` over a stacked unit runs as a pair of loops. The forward loop
gathers layer ``i+1`` while it computes layer ``i``; the backward loop
re-gathers layer ``i-1`` while it differentiates layer ``i`` and
reduce-scatters layer ``i``'s gradient. Checked here: the numbers (against
unsharded JAX, for scans with everything a body can hold), the memory (at
most two gathered layers, whatever the depth) and where the prefetch
settings put the next gather in the compiled loop bodies.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax._src import hlo as hlo_lib
from helpers import assert_trees_close, mesh_for, reference_run, sharded_run

FS = fsdp_jax.ShardingStrategy
BP = fsdp_jax.BackwardPrefetch
D, L, D_IN, D_OUT = 12, 5, 5, 3


def params0(seed=0, layers=L, d=D):
  rng = np.random.default_rng(seed)
  f = lambda *s, scale=0.3: jnp.asarray(rng.normal(0, scale, s), jnp.float32)
  return {"embed": f(D_IN, d), "shared": 1.0 + f(d, scale=0.1), "head": f(d, D_OUT),
          "blocks": {"w": f(layers, d, d), "b": f(layers, d, scale=0.1),
                     "g": 1.0 + f(layers, d, scale=0.1)}}


def make_loss(reverse=False, unroll=1, layers=L):
  """A scan with what bodies hold: an int carry and int outputs, per-layer
  outputs read by the loss, a transposed weight, a parameter of another unit
  and an activation closed over, and a scanned-over input besides the
  layers."""

  def loss(params, batch):
    h = batch["x"] @ params["embed"]
    mask = jax.nn.sigmoid(h)  # an activation (rows, D)
    scales = 1 + jax.nn.sigmoid(h[:, :layers]).T[..., None]  # (layers, rows, 1), scanned over

    def layer(carry, xs):
      h, count = carry
      blk, scale = xs
      y = jnp.tanh(h @ blk["w"].T + blk["b"]) * blk["g"] * params["shared"] * mask * scale
      return (h + y, count + 1), (jnp.mean(y ** 2), count)

    (h, count), (aux, counts) = jax.lax.scan(
        layer, (h, jnp.int32(0)), (params["blocks"], scales), reverse=reverse,
        unroll=unroll)
    logits = h @ params["head"]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return ce + 0.1 * jnp.sum(aux * (1 + counts)) / (count + 1)

  return loss


def batches(n=3, rows=24):
  rng = np.random.default_rng(7)
  return [{"x": jnp.asarray(rng.normal(size=(rows, D_IN)), jnp.float32),
           "y": jnp.asarray(rng.integers(0, D_OUT, rows), jnp.int32)} for _ in range(n)]


CASES = {
    # strategy, shard, replicate, use_orig_params, forward_prefetch,
    # backward_prefetch, reverse, unroll
    "FULL_SHARD-3dev-flat-pre": (FS.FULL_SHARD, 3, None, False, False, BP.BACKWARD_PRE, False, 1),
    "FULL_SHARD-8dev-orig-post-fp-reverse-unroll2": (FS.FULL_SHARD, 8, None, True, True,
                                                     BP.BACKWARD_POST, True, 2),
    "FULL_SHARD-4dev-flat-none": (FS.FULL_SHARD, 4, None, False, True, None, False, 1),
    "SHARD_GRAD_OP-2dev-flat-reverse": (FS.SHARD_GRAD_OP, 2, None, False, True, None, True, 1),
    "HYBRID_SHARD-2x2-orig": (FS.HYBRID_SHARD, 2, 2, True, False, BP.BACKWARD_PRE, False, 3),
}


def config_for(case, **kw):
  strategy, _, _, orig, fp, bp, _, _ = CASES[case]
  return fsdp_jax.FSDPConfig(sharding_strategy=strategy, stacked_layers=("blocks",),
                             use_orig_params=orig, forward_prefetch=fp,
                             backward_prefetch=bp, **kw)


@functools.cache  # one unsharded run per loop direction and unroll, shared by the cases
def _reference(reverse, unroll):
  return reference_run(make_loss(reverse, unroll), params0(), batches(), optax.adam(1e-2))


# One case in the fast subset (-m "not slow"); the others run in the full suite.
_FAST = ("SHARD_GRAD_OP-2dev-flat-reverse",)


@pytest.mark.parametrize("case", [c if c in _FAST else pytest.param(c, marks=pytest.mark.slow)
                                  for c in CASES])
def test_scan_matches_single_device(case):
  strategy, shard, replicate, _, _, _, reverse, unroll = CASES[case]
  loss = make_loss(reverse, unroll)
  opt = optax.adam(1e-2)
  ref_losses, ref_params = _reference(reverse, unroll)
  mesh = mesh_for(strategy, shard, replicate)
  losses, state = sharded_run(loss, params0(), batches(), opt, mesh, config_for(case))
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params)


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", ["no_sync", "sharded"])
def test_scan_under_gradient_accumulation(accumulation):
  """no_sync differentiates the full parameters (the loops' probes); the
  sharded accumulation reduces every microbatch."""
  loss = make_loss()
  opt = optax.sgd(0.1)
  ref_losses, ref_params = reference_run(loss, params0(), batches(2), opt)
  mesh = mesh_for(FS.FULL_SHARD, 3)
  config = config_for("FULL_SHARD-3dev-flat-pre")
  state = fsdp_jax.init_train_state(params=params0(), optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(loss, opt, mesh=mesh, config=config,
                                   gradient_accumulation_steps=2, accumulation=accumulation)
  losses = []
  for b in batches(2):
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_params)


# --------------------------------------------------------------------------
# Memory: two gathered layers, whatever the depth


def _deep_loss(params, batch):
  h = batch["x"] @ params["embed"]

  def layer(h, blk):
    return h + jnp.tanh(h @ blk["w"].T) @ blk["w2"], None

  h, _ = jax.lax.scan(layer, h, params["blocks"])
  return jnp.mean((h @ params["head"]) ** 2)


@functools.lru_cache(maxsize=None)
def _temp_mib(layers, strategy=FS.FULL_SHARD, n=4, d=256):
  params = {"embed": jnp.ones((8, d)), "head": jnp.ones((d, 4)),
            "blocks": {"w": jnp.ones((layers, d, d)), "w2": jnp.ones((layers, d, d))}}
  mesh = mesh_for(strategy, n)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, stacked_layers=("blocks",))
  opt = optax.sgd(0.1)
  state = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      params=params, optimizer=opt, mesh=mesh, config=config))
  step = fsdp_jax.shard_train_step(_deep_loss, opt, mesh=mesh, config=config)
  compiled = step.lower(state, {"x": jnp.ones((n, 8))}).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2 ** 20


def test_full_shard_scan_holds_two_gathered_layers_at_any_depth():
  """A layer is 0.5 MiB gathered (two 256x256 float32 weights), 0.125 MiB per
  device sharded; activations are a few KiB. Each layer deeper adds its
  sharded gradient, never a gathered layer nor a part of one. Measured
  (jax 0.10.2): 2.27 MiB at 4 layers, 5.01 at 20 (0.17 per layer); before
  the loops carried the next layer, when the backward pass saved each
  layer's transposed weight: 2.76 and 8.81 (0.38 per layer)."""
  layer, shard = 0.5, 0.125
  shallow, deep = _temp_mib(4), _temp_mib(20)
  assert deep - shallow <= 16 * 1.5 * shard, (shallow, deep)
  # Besides the sharded gradients: two gathered layers, the full gradient of
  # one and the transposed weight its backward reads.
  assert shallow - 4 * shard <= 4 * layer, shallow


def test_shard_grad_op_scan_keeps_each_gathered_layer_for_backward():
  """SHARD_GRAD_OP keeps what forward gathered: memory grows by a gathered
  layer per layer (ZeRO-2), and the backward loop gathers nothing."""
  layer = 0.5
  grows = _temp_mib(8, FS.SHARD_GRAD_OP) - _temp_mib(4, FS.SHARD_GRAD_OP)
  assert grows >= 4 * layer, grows


# --------------------------------------------------------------------------
# Where the next gather goes


_INS = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")


def _calls_dot(rhs, comps) -> bool:
  """Whether the instruction is a fusion whose computation holds a dot (the
  CPU backend's YNN fusions wrap a matmul with what it feeds)."""
  m = re.search(r"calls=%([\w.\-]+)", rhs)
  return bool(m) and " fusion(" in rhs and any(" dot(" in l for l in comps.get(m.group(1), ()))


def _loop_graphs(text):
  """For each while body that gathers a layer of ``blocks``: ``{instruction:
  (kind, operand names)}`` with kind 'gather' (the conditional holding the
  all-gather), 'dot', 'scatter' (the reduce-scatter) or ''."""
  comps, current = {}, None
  for line in text.splitlines():
    if line and not line[0].isspace():
      current = line.split(" ", 1)[0].lstrip("%") if line.rstrip().endswith("{") else None
      if current:
        comps[current] = []
      continue
    if current:
      comps[current].append(line)
  gathering = {c for c, lines in comps.items()
               if any(" all-gather(" in l and "fsdp_all_gather[blocks]" in l for l in lines)}
  graphs = []
  for body in hlo_lib.loop_bodies(text) & set(comps):
    graph = {}
    for line in comps[body]:
      m = _INS.match(line)
      if not m:
        continue
      name, rest = m.groups()
      rhs = rest.split(" metadata=")[0]
      if " conditional(" in rhs and any(f"%{g}" in rhs for g in gathering):
        kind = "gather"
      elif " dot(" in rhs or _calls_dot(rhs, comps):  # XLA may fuse the matmul
        kind = "dot"
      elif " reduce-scatter(" in rhs:
        kind = "scatter"
      else:
        kind = ""
      graph[name] = (kind, re.findall(r"%([\w.\-]+)", rhs))
    if any(k == "gather" for k, _ in graph.values()):
      graphs.append(graph)
  return graphs


def _ancestors(graph, name) -> set:
  seen, todo = set(), list(graph[name][1])
  while todo:
    n = todo.pop()
    if n in graph and n not in seen:
      seen.add(n)
      todo.extend(graph[n][1])
  return seen


def _before(graph, name) -> set:
  """The kinds of the instructions ``name`` depends on."""
  return {graph[n][0] for n in _ancestors(graph, name)} - {""}


def _one(graph, kind):
  (name,) = [n for n, (k, _) in graph.items() if k == kind]
  return name


def _compiled_text(forward_prefetch, backward_prefetch):
  mesh = mesh_for(FS.FULL_SHARD, 3)
  config = fsdp_jax.FSDPConfig(stacked_layers=("blocks",), forward_prefetch=forward_prefetch,
                               backward_prefetch=backward_prefetch)
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=params0(), optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(make_loss(), opt, mesh=mesh, config=config)
  return step.lower(state, batches(1)[0]).compile().as_text()


@pytest.mark.parametrize("forward_prefetch", [pytest.param(True, marks=pytest.mark.slow), False])
def test_forward_prefetch_places_the_next_gather(forward_prefetch):
  graphs = _loop_graphs(_compiled_text(forward_prefetch, BP.BACKWARD_PRE))
  forward = [g for g in graphs if not any(k == "scatter" for k, _ in g.values())]
  assert len(forward) == 1, graphs
  (graph,) = forward
  waits_for = _before(graph, _one(graph, "gather"))
  if forward_prefetch:
    assert "dot" not in waits_for  # free to start with the iteration
  else:
    assert "dot" in waits_for  # after the layer's first matmul


@pytest.mark.parametrize("backward_prefetch", [BP.BACKWARD_PRE, BP.BACKWARD_POST, None])
def test_backward_prefetch_places_the_next_gather(backward_prefetch):
  graphs = _loop_graphs(_compiled_text(False, backward_prefetch))
  backward = [g for g in graphs if any(k == "scatter" for k, _ in g.values())]
  assert len(backward) == 1, graphs
  (graph,) = backward
  gather, scatter = _one(graph, "gather"), _one(graph, "scatter")
  dots = [n for n, (k, _) in graph.items() if k == "dot"]
  assert dots
  if backward_prefetch is BP.BACKWARD_PRE:  # before the gradient computation
    assert "dot" not in _before(graph, gather) and "gather" in _before(graph, scatter)
  elif backward_prefetch is BP.BACKWARD_POST:  # after it, before the reduce-scatter
    assert all(d in _ancestors(graph, gather) for d in dots)
    assert "gather" in _before(graph, scatter)
  else:  # after the reduce-scatter
    assert "scatter" in _before(graph, gather)


@pytest.mark.slow
@pytest.mark.parametrize("unroll, layers", [(1, L), (2, 4)])
def test_benchmark_counts_each_gather_once(unroll, layers):
  """The loops' next-layer gather is a conditional that skips the last
  iteration; benchmarks/hlo_stats counts what runs: every layer gathered
  once per pass (twice for FULL_SHARD), the root once."""
  from benchmarks import hlo_stats  # pylint: disable=import-outside-toplevel
  n = 4
  mesh = mesh_for(FS.FULL_SHARD, n)
  config = fsdp_jax.FSDPConfig(stacked_layers=("blocks",))
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=params0(layers=layers), optimizer=opt, mesh=mesh,
                                    config=config)
  step = fsdp_jax.shard_train_step(make_loss(unroll=unroll, layers=layers), opt, mesh=mesh,
                                   config=config)
  text = step.lower(state, batches(1)[0]).compile().as_text()
  gathers = hlo_stats.collective_stats(text, n)["all-gather"]
  plan = state.plan
  blocks, root = plan.unit_by_name("blocks"), next(u for u in plan.units if u.is_root)
  assert gathers["executions"] == 2 * layers + 1, gathers
  assert gathers["payload"] == 4 * (2 * plan.padded_numel(blocks) + plan.padded_numel(root))
