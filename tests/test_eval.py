"""Sharded evaluation (``fsdp_jax.shard_eval_step``) and the hand-off to
inference (``fsdp_jax.reshard_params``).

* The eval step gives what one ``jax.jit`` on one device computes on the same
  weights, loss and logits to 1e-5, on meshes of 1, 3, 4 and 8 devices (sizes
  that do not divide the parameters), HYBRID, tensor parallelism 4x2 and
  2x4, LoRA, QLoRA, bf16, CPU offload and a scan over stacked layers, each
  case folding in a strategy, a layout or an option that takes another code
  path (prefetch, hpZ, ``tensor_outputs="split"``, a WeightedLoss, model
  state and rng).
* Its program is forward only: each unit gathered once, no reduction, no
  optimizer state among the arguments.
* ``reshard_params`` equals ``summon_full_params`` exactly (cast where
  asked), replicated or split by TensorParallel rules, and a greedy decode
  with a KV cache on the resharded weights of a transformers checkpoint
  gives transformers' ``generate(do_sample=False)`` (its tokens recorded in
  tests/golden/llama_generate/, so the check runs without torch).
* Every bad input is refused with an error naming what and the fix.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax import hlo
from helpers import REPO

sys.path.insert(0, str(REPO / "examples"))
import llama as llama_example  # noqa: E402  pylint: disable=wrong-import-position
import llama_decode  # noqa: E402  pylint: disable=wrong-import-position

S = fsdp_jax.ShardingStrategy

# --------------------------------------------------------------------------
# A tiny decoder in plain JAX: embedding, two blocks, a final norm and a
# head; the embedding, the head and each block are units.

VOCAB, D, HEADS, HEAD_DIM, FF, LAYERS, SEQ, BATCH = 16, 8, 4, 2, 16, 2, 4, 24
WRAP = fsdp_jax.ModuleWrapPolicy(["layers.*", "embed", "head"])
RULES = (("*.wq", "colwise"), ("*.wk", "colwise"), ("*.wv", "colwise"), ("*.wo", "rowwise"),
         ("*.up", "colwise"), ("*.down", "rowwise"), ("head", "colwise"))


def model_params(seed=0):
  keys = iter(jax.random.split(jax.random.key(seed), 32))
  w = lambda *shape: jax.random.normal(next(keys), shape) * (0.7 / np.sqrt(shape[0]))
  layer = lambda: {"norm": 1.0 + 0.1 * jax.random.normal(next(keys), (D,)),
                   "wq": {"kernel": w(D, HEADS * HEAD_DIM)},
                   "wk": {"kernel": w(D, HEADS * HEAD_DIM)},
                   "wv": {"kernel": w(D, HEADS * HEAD_DIM)},
                   "wo": {"kernel": w(HEADS * HEAD_DIM, D)},
                   "up": {"kernel": w(D, FF), "bias": w(1, FF)[0]}, "down": {"kernel": w(FF, D)}}
  return {"embed": {"embedding": 3 * w(VOCAB, D)}, "layers": [layer() for _ in range(LAYERS)],
          "norm": jnp.ones((D,)), "head": {"kernel": w(D, VOCAB)}}


def rms(x, g):
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def block(x, p):
  b, t, _ = x.shape
  h = rms(x, p["norm"])
  q, k, v = (jnp.reshape(h @ p[n]["kernel"], (b, t, HEADS, HEAD_DIM)) for n in ("wq", "wk", "wv"))
  s = jnp.einsum("bthd,bshd->bhts", q, k) * HEAD_DIM ** -0.5
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9)
  a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, -1), v).reshape(b, t, -1)
  x = x + a @ p["wo"]["kernel"]
  return x + jax.nn.gelu(x @ p["up"]["kernel"] + p["up"]["bias"]) @ p["down"]["kernel"]


def logits_fn(params, tokens):
  x = params["embed"]["embedding"][tokens]
  if isinstance(params["layers"], dict):  # stacked: a scan over the layers
    x, _ = jax.lax.scan(lambda h, p: (block(h, p), None), x, params["layers"])
  else:
    for p in params["layers"]:
      x = block(x, p)
  return rms(x, params["norm"]) @ params["head"]["kernel"]


def nll(params, batch):
  """Per-token negative log-likelihood and the logits."""
  logits = logits_fn(params, batch["tokens"])
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return -jnp.take_along_axis(logp, batch["labels"][..., None], -1)[..., 0], logits


def per_example(params, batch):
  """For ``outputs="batch"``: every example's loss and logits."""
  losses, logits = nll(params, batch)
  return {"loss": losses.mean(-1), "logits": logits}


def mean_loss(params, batch):
  """For ``outputs="mean"``: the device's mean loss."""
  return jnp.mean(nll(params, batch)[0])


def make_batch(seed=1):
  k = jax.random.split(jax.random.key(seed))
  return {"tokens": jax.random.randint(k[0], (BATCH, SEQ), 0, VOCAB),
          "labels": jax.random.randint(k[1], (BATCH, SEQ), 0, VOCAB)}


PARAMS = model_params()
BATCH_DATA = make_batch()
_reference = jax.jit(per_example)


def reference(params):
  """Single-device jit on the same weights (a host copy)."""
  return _reference(jax.device_get(params), BATCH_DATA)


def stacked(params):
  return {**params, "layers": jax.tree.map(lambda *x: jnp.stack(x), *params["layers"])}


# --------------------------------------------------------------------------
# The cases: (mesh sizes, FSDPConfig options, outputs, what else it covers)

LORA = fsdp_jax.LoRA(targets=("wq", "wv", "up", "head"), rank=2, alpha=4)
QLORA = fsdp_jax.LoRA(targets=("wq", "wk", "down"), rank=2, alpha=4,
                      base_quantization=fsdp_jax.Quantization(dtype="nf4", block_size=8))
CASES = {
    # one device: NO_SHARD, params in host memory; "mean" with a WeightedLoss,
    # model state and rng (fn_with_state below)
    "1-offload": (dict(shard=1), dict(sharding_strategy=S.NO_SHARD,
                                      cpu_offload=fsdp_jax.CPUOffload(offload_params=True)),
                  "mean"),
    "3-flat-LoRA-prefetch": (dict(shard=3), dict(lora=LORA, forward_prefetch=True,
                                                 limit_all_gathers=True), "batch"),
    "4-scan-SHARD_GRAD_OP": (dict(shard=4), dict(sharding_strategy=S.SHARD_GRAD_OP,
                                                 use_orig_params=True,
                                                 stacked_layers=("layers",)), "batch"),
    "8-HYBRID-2x4-orig-hpZ-QLoRA": (dict(replicate=2, shard=4), dict(
        sharding_strategy=S.HYBRID_SHARD, use_orig_params=True, reshard_after_forward=2,
        lora=QLORA), "batch"),
    "TP-4x2-bf16-split": (dict(shard=4, tensor=2), dict(
        tensor_parallel=fsdp_jax.TensorParallel(rules=RULES),
        mixed_precision=fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16)), "batch"),
    "TP-2x4-orig": (dict(shard=2, tensor=4), dict(
        use_orig_params=True, tensor_parallel=fsdp_jax.TensorParallel(rules=RULES)), "mean"),
}


def adapter(shape):
  """The values written into every LoRA factor of this shape."""
  return 0.3 * jnp.cos(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape))


def write_adapters(state):
  """``state`` with :func:`adapter`'s values in every LoRA factor."""
  factor = lambda path, x: (adapter(x.shape) if getattr(path[-1], "name", None)
                            in ("lora_A", "lora_B") else x)
  return fsdp_jax.write_full_params(state, lambda p: jax.tree_util.tree_map_with_path(factor, p))


def make_mesh(sizes):
  n = int(np.prod(list(sizes.values())))
  return fsdp_jax.make_mesh(**sizes, devices=jax.devices()[:n])


def fn_with_state(params, batch, model_state, rng):
  """A training-style loss (returns the new model state, which evaluation
  drops), a WeightedLoss, and a draw of the key the step passes."""
  losses, _ = nll(params, batch)
  w = batch["weight"]
  return ({"loss": fsdp_jax.WeightedLoss(total=jnp.sum(losses.mean(-1) * w) * model_state["scale"],
                                         weight=jnp.sum(w)),
           "draw": jax.random.uniform(rng)},
          {"scale": model_state["scale"] + 1})


class Case:
  """A state on the case's mesh, its eval step run once, and the reference
  on the weights the state holds."""

  def __init__(self, name):
    sizes, opts, self.outputs = CASES[name]
    self.name = name
    self.stacked = "stacked_layers" in opts
    wrap = fsdp_jax.ModuleWrapPolicy(["embed", "head"]) if self.stacked else WRAP
    self.config = fsdp_jax.FSDPConfig(auto_wrap_policy=wrap, **opts)
    self.params = stacked(PARAMS) if self.stacked else PARAMS
    extra = {}
    if name == "1-offload":
      extra = dict(model_state={"scale": jnp.float32(2.0)}, rng=jax.random.key(7))
    self.state = fsdp_jax.init_train_state(params=self.params, optimizer=optax.sgd(0.1),
                                           mesh=make_mesh(sizes), config=self.config, **extra)
    weights = self.params
    if "lora" in opts:  # known, non-zero adapters: the adapter path adds something
      self.state = write_adapters(self.state)
      weights = fsdp_jax.summon_full_params(self.state)  # merged
    mp = self.config.mixed_precision
    if mp is not None:  # the step computes in param_dtype
      weights = jax.tree.map(lambda x: x.astype(mp.param_dtype), weights)
    self.ref = reference(weights)
    if name == "1-offload":
      self.fn, batch = fn_with_state, {**BATCH_DATA, "weight": jnp.arange(BATCH, dtype=jnp.float32)}
    else:
      self.fn = per_example if self.outputs == "batch" else mean_loss
      batch = BATCH_DATA
    kw = dict(tensor_outputs="split") if name.endswith("-split") else {}
    self.step = fsdp_jax.shard_eval_step(self.fn, outputs=self.outputs,
                                         forward_inputs=("tokens",) if mp else None, **kw)
    # Only what the forward reads: an eval job restores no optimizer state.
    self.bare = self.state.replace(opt_state=None)
    self.batch = batch
    self.out = self.step(self.bare, batch)


@pytest.fixture(scope="module")
def cases():
  made = {}

  def get(name):
    if name not in made:
      made[name] = Case(name)
    return made[name]

  return get


@pytest.mark.parametrize("name", list(CASES))
def test_eval_step_matches_single_device_jit(cases, name):
  c = cases(name)
  out, ref = c.out, c.ref
  if c.outputs == "batch":
    tol = 1e-5
    if c.config.mixed_precision is not None:
      assert out["logits"].dtype == jnp.bfloat16  # computed in param_dtype
      tol = 1e-2  # bf16 logits: the same arithmetic, rounded at one ulp (2**-8) of ~1
    np.testing.assert_allclose(np.asarray(out["logits"], np.float32),
                               np.asarray(ref["logits"], np.float32), rtol=0, atol=tol)
    np.testing.assert_allclose(out["loss"], ref["loss"], rtol=0, atol=tol)
    data = c.state.plan.axes.data_axes
    assert out["logits"].shape == (BATCH, SEQ, VOCAB)
    spec = out["logits"].sharding.spec
    assert spec[0] == (data[0] if len(data) == 1 else data)  # rows split like the batch
    if name.endswith("-split"):  # the column-parallel head's logits stay split
      assert spec[2] == "tensor"
      shard = out["logits"].addressable_shards[0].data
      assert shard.shape == (BATCH // 4, SEQ, VOCAB // 2)
  elif name == "1-offload":
    w = np.arange(BATCH, dtype=np.float32)
    expected = 2.0 * np.sum(np.asarray(ref["loss"]) * w) / np.sum(w)
    np.testing.assert_allclose(out["loss"], expected, rtol=1e-6)
    # the key: fold_in(fold_in(state.rng, step), device index 0)
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(7), 0), 0)
    assert float(out["draw"]) == float(jax.random.uniform(key))
    other = c.step(c.bare, c.batch, rng=jax.random.key(8))["draw"]
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(8), 0), 0)
    assert float(other) == float(jax.random.uniform(key))
  else:
    np.testing.assert_allclose(out, np.mean(ref["loss"]), rtol=0, atol=1e-5)
    assert out.dtype == jnp.float32 and out.shape == ()


def test_eval_step_runs_the_adapters_without_dropout(cases):
  """PEFT's eval mode: with LoRA(dropout=0.5) the eval step's outputs are
  those of the same weights without dropout and do not change with the key;
  the only randomness fn sees is its own rng, the key passed to the step."""
  c = cases("3-flat-LoRA-prefetch")  # the same weights, LoRA without dropout
  lora = fsdp_jax.LoRA(targets=LORA.targets, rank=LORA.rank, alpha=LORA.alpha, dropout=0.5)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, lora=lora, forward_prefetch=True,
                               limit_all_gathers=True)
  state = write_adapters(fsdp_jax.init_train_state(
      params=PARAMS, optimizer=optax.sgd(0.1), mesh=c.state.plan.mesh, config=config,
      rng=jax.random.key(3)))

  def fn(params, batch, rng):
    return {**per_example(params, batch), "draw": jax.random.uniform(rng, (BATCH // 3,))}

  step = fsdp_jax.shard_eval_step(fn, outputs="batch")
  one, two = (step(state.replace(opt_state=None), BATCH_DATA, rng=jax.random.key(k))
              for k in (1, 2))
  for name in ("logits", "loss"):
    np.testing.assert_array_equal(one[name], two[name], err_msg=name)
    np.testing.assert_allclose(one[name], c.out[name], rtol=0, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(one[name], c.ref[name], rtol=0, atol=1e-5, err_msg=name)
  # fn's own key: fold_in(fold_in(key, step 0), device index); device 0's rows first
  for k, out in ((1, one), (2, two)):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(k), 0), 0)
    np.testing.assert_array_equal(out["draw"][:BATCH // 3],
                                  jax.random.uniform(key, (BATCH // 3,)))
  assert not np.allclose(one["draw"], two["draw"])


@pytest.mark.parametrize("name", ["3-flat-LoRA-prefetch", "4-scan-SHARD_GRAD_OP"])
def test_eval_program_is_forward_only(cases, name):
  """Each unit is gathered once (a stacked unit once per layer, in its
  loop), nothing is reduced, and the arguments are the parameter shards and
  the batch: no optimizer state."""
  c = cases(name)
  compiled = c.step.lower(c.bare, c.batch).compile()
  text = compiled.as_text()
  kinds = [x.kind for x in hlo.collectives(text)]
  units = c.state.plan.units
  assert "reduce-scatter" not in kinds and "all-reduce" not in kinds, kinds
  outside = [x for x in hlo.collectives(text) if x.kind == "all-gather"]
  if not c.stacked:
    # one gather per unit; the root is never resharded and stays gathered
    assert len(outside) == len(units), (len(outside), [u.display_name for u in units])
  else:
    assert hlo.loop_bodies(text)  # the stacked layers' gathers run in a loop
  params = sum(s.data.nbytes for x in jax.tree.leaves(c.state.params)
               for s in x.addressable_shards if s.device == jax.devices()[0])
  batch = sum(x.nbytes // c.state.plan.axes.world_size for x in jax.tree.leaves(c.batch))
  args = compiled.memory_analysis().argument_size_in_bytes
  assert params + batch <= args <= params + batch + 64  # + the step count


# --------------------------------------------------------------------------
# reshard_params


def _merged_by_hand(params):
  """The LoRA targets' effective kernels (numpy, float64): the weights the
  state was built from plus alpha / rank * A @ B, the factors written."""
  scale = LORA.alpha / LORA.rank
  out = {}
  for path, w in jax.tree_util.tree_flatten_with_path(params)[0]:
    name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    if name.endswith(".kernel") and name.split(".")[-2] in LORA.targets:
      a = np.asarray(adapter((w.shape[0], LORA.rank)), np.float64)
      b = np.asarray(adapter((LORA.rank, w.shape[1])), np.float64)
      out[name] = np.asarray(w, np.float64) + scale * a @ b
  return out


@pytest.mark.parametrize("name", ["3-flat-LoRA-prefetch", "4-scan-SHARD_GRAD_OP", "1-offload",
                                  "TP-2x4-orig"])
def test_reshard_params_replicated(cases, name):
  """The user's tree, replicated over the state's mesh: the weights the
  state was built from, bit for bit (LoRA: the merged kernels), and what
  summon_full_params returns."""
  c = cases(name)
  out = fsdp_jax.reshard_params(c.state)
  assert jax.tree.structure(out) == jax.tree.structure(c.params)  # the user's tree
  full = fsdp_jax.summon_full_params(c.state)
  merged = _merged_by_hand(c.params) if c.config.lora is not None else {}
  flat = jax.tree_util.tree_flatten_with_path(out)[0]
  for (path, a), b, f in zip(flat, jax.tree.leaves(c.params), jax.tree.leaves(full)):
    name = ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert a.sharding.is_fully_replicated and a.sharding.mesh == c.state.plan.mesh
    np.testing.assert_array_equal(np.asarray(a), np.asarray(f))
    if name in merged:
      np.testing.assert_allclose(np.asarray(a), merged[name], rtol=0, atol=1e-6)
    elif c.config.lora is None:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if c.config.lora is not None:
    assert len(merged) == len(c.state.plan.lora_targets)


def test_reshard_params_to_a_tensor_mesh(cases):
  """Onto the state's devices, in another order, as one tensor group: each
  split leaf's 1/T slice per device (stacked layers: never along the layer
  axis), cast to bf16 as asked, the values summon_full_params' cast. (The
  decode test below reshards unstacked layers onto a tensor mesh.)"""
  c = cases("4-scan-SHARD_GRAD_OP")
  n = c.state.plan.mesh.size
  target = fsdp_jax.make_mesh(tensor=n, devices=list(c.state.plan.mesh.devices.flat)[::-1])
  rules = fsdp_jax.TensorParallel(rules=[("*.wq", "colwise"), ("*.down", "rowwise")])
  out = fsdp_jax.reshard_params(c.state, mesh=target, tensor_parallel=rules, dtype=jnp.bfloat16)
  lead = 1  # the layer axis
  first = out["layers"]
  q, down = first["wq"]["kernel"], first["down"]["kernel"]
  assert q.sharding.mesh == target
  assert q.sharding.spec[lead + 1] == "tensor" and down.sharding.spec[lead] == "tensor"
  assert q.addressable_shards[0].data.shape[lead + 1] == q.shape[lead + 1] // n
  assert down.addressable_shards[0].data.shape[lead] == down.shape[lead] // n
  assert first["wk"]["kernel"].sharding.is_fully_replicated
  full = fsdp_jax.summon_full_params(c.state)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(full)):
    assert a.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b.astype(jnp.bfloat16)))


def test_greedy_decode_on_resharded_weights_matches_transformers():
  """A transformers Llama (tests/golden/llama_generate/, made by
  make_llama_generate.py with save_pretrained) loaded into examples/llama.py's
  model shard by shard, resharded to a tensor=2 mesh: examples/llama_decode.py's
  KV-cache greedy decode gives the tokens of transformers'
  generate(do_sample=False) on that checkpoint."""
  golden = REPO / "tests" / "golden" / "llama_generate"
  expected = json.loads((golden / "generate.json").read_text())
  config = llama_example.LlamaConfig.from_pretrained(str(golden))
  model = llama_example.Llama(config)
  state = fsdp_jax.init_train_state(
      init_fn=lambda rng: model.init(rng, jnp.zeros((1, 4), jnp.int32)), rng=jax.random.key(0),
      optimizer=optax.sgd(0.0), mesh=make_mesh(dict(shard=2)), config=fsdp_jax.FSDPConfig(),
      pretrained=fsdp_jax.pretrained.load(str(golden), llama_example.weight_map(config)))
  params = fsdp_jax.reshard_params(
      state, mesh=fsdp_jax.make_mesh(tensor=2, devices=jax.devices()[:2]),
      tensor_parallel=fsdp_jax.TensorParallel(rules=llama_decode.TP_RULES))
  q = params["params"]["layers_0"]["attn"]["q"]["kernel"]
  assert tuple(q.sharding.spec) == (None, "tensor")
  got = llama_decode.generate(params, config, np.asarray(expected["prompts"]),
                              max_new_tokens=expected["max_new_tokens"])
  np.testing.assert_array_equal(got, expected["tokens"])


def test_top_p_keeps_the_smallest_set_reaching_p():
  """Nucleus sampling draws from the most likely tokens whose probability
  reaches p, in proportion; greedy takes the most likely."""
  logits = jnp.log(jnp.tile(jnp.array([[0.5, 0.3, 0.15, 0.05]]), (2048, 1)))
  draws = np.asarray(llama_decode.sample_token(logits, jax.random.key(0), temperature=1.0,
                                               top_p=0.75))
  assert set(draws.tolist()) == {0, 1}  # 0.5 + 0.3 reach 0.75: never 2 or 3
  assert abs(np.mean(draws == 0) - 0.5 / 0.8) < 0.05
  assert int(llama_decode.sample_token(logits, None)[0]) == 0  # greedy


# --------------------------------------------------------------------------
# Bad input


def test_bad_outputs_are_refused():
  with pytest.raises(ValueError, match=r"outputs='sum'.*'mean'.*'batch'"):
    fsdp_jax.shard_eval_step(mean_loss, outputs="sum")
  with pytest.raises(ValueError, match=r"tensor_outputs='gather'.*'whole'.*'split'"):
    fsdp_jax.shard_eval_step(mean_loss, tensor_outputs="gather")


def test_batch_output_without_a_batch_axis(cases):
  c = cases("3-flat-LoRA-prefetch")
  step = fsdp_jax.shard_eval_step(lambda p, b: {"mean": mean_loss(p, b),
                                                "logits": nll(p, b)[1]}, outputs="batch")
  with pytest.raises(ValueError, match=r"output \['mean'\] has shape \(\) .*axis 0 over the "
                     r"data-parallel mesh axes \('shard',\).*8 batch rows.*outputs='mean'"):
    step(c.bare, c.batch)
  step = fsdp_jax.shard_eval_step(lambda p, b: nll(p, b)[0].T, outputs="batch")
  with pytest.raises(ValueError, match=r"output \(root\) has shape \(4, 8\)"):
    step(c.bare, c.batch)


def test_reshard_params_bad_input(cases):
  c = cases("3-flat-LoRA-prefetch")
  tp = fsdp_jax.TensorParallel(rules=[("*.wq", "colwise")])
  others = fsdp_jax.make_mesh(tensor=3, devices=jax.devices()[3:6])
  with pytest.raises(ValueError, match=r"devices \[3, 4, 5\].*devices \[0, 1, 2\].*"
                     r"make_mesh\(tensor=3, devices=state.plan.mesh.devices.flat\)"):
    fsdp_jax.reshard_params(c.state, mesh=others, tensor_parallel=tp)
  with pytest.raises(ValueError, match=r"rule '\*\.nothing' \('colwise'\) matches no parameter"):
    fsdp_jax.reshard_params(c.state, mesh=make_mesh(dict(shard=1, tensor=3)),
                            tensor_parallel=fsdp_jax.TensorParallel(
                                rules=[("*.nothing", "colwise")]))
  with pytest.raises(ValueError, match=r"'layers\.0\.wq\.kernel' \(shape \(8, 8\), size 8\) over "
                     r"the tensor axis 'tensor' of size 3, which does not divide it"):
    fsdp_jax.reshard_params(c.state, mesh=make_mesh(dict(shard=1, tensor=3)),
                            tensor_parallel=tp)
  with pytest.raises(ValueError, match=r"axis 'tensor', but the target mesh has axes "
                     r"\{'shard': 3\}.*make_mesh\(tensor=8\)"):
    fsdp_jax.reshard_params(c.state, tensor_parallel=tp)
  with pytest.raises(ValueError, match="must be a floating dtype"):
    fsdp_jax.reshard_params(c.state, dtype=jnp.int8)
  with pytest.raises(TypeError, match="must be a fsdp_jax.TensorParallel"):
    fsdp_jax.reshard_params(c.state, tensor_parallel=[("*.wq", "colwise")])
