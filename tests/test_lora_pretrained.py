"""LoRA and QLoRA with pretrained weights (fsdp_jax.pretrained).

A small random transformers Llama saved with ``save_pretrained`` is loaded
into LoRA and QLoRA states of ``examples/llama.py``'s model (targets: the
query and value projections, whose WeightMap rules transpose and, for the
query, permute the rotary layout), trained a few steps, and written as a
PEFT adapter that ``peft.PeftModel.from_pretrained`` turns into our logits;
the adapter reads back bitwise, and the merged model saves for
transformers. Then the factor layouts and the errors, on a plain tree.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file, save_file

import fsdp_jax
from fsdp_jax import pretrained
from fsdp_jax._src import quantization as quant
from fsdp_jax._src.pretrained.peft import factor_layout
from fsdp_jax._src.state_dicts import convert

from helpers import REPO, lazy_modules

sys.path.insert(0, str(REPO / "examples"))
import llama as llama_example  # noqa: E402  pylint: disable=wrong-import-position

# torch's CPU build is installed for Python 3.11 only; imported when a test uses it.
peft, torch, transformers = lazy_modules("peft", "torch", "transformers")

HF_REASON = ("needs torch, transformers and peft (pyproject's test extra installs torch's CPU "
             "build for Python 3.11, the one this machine's package index has)")
needs_hf = pytest.mark.skipif(peft is None, reason=HF_REASON)

TOKENS = np.random.default_rng(0).integers(0, 128, (2, 12)).astype(np.int32)
TARGETS = ("*.q", "*.v")  # q_proj and v_proj


def _mesh(n):
  return fsdp_jax.make_mesh(shard=n, devices=jax.devices()[:n])


def _torch_logits(model):
  with torch.no_grad():
    return model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
  """A small random LlamaForCausalLM (grouped-query attention, untied
  head) saved with save_pretrained, and its logits."""
  if peft is None:
    pytest.skip(HF_REASON)
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
      vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      tie_word_embeddings=False)
  model = transformers.LlamaForCausalLM(cfg).eval()
  directory = tmp_path_factory.mktemp("llama") / "base"
  model.save_pretrained(directory)
  return dict(dir=str(directory), logits=_torch_logits(model),
              config=llama_example.LlamaConfig.from_pretrained(str(directory)))


def _state(base, *, scan=False, orig=False, n=4, lora=None, optimizer=None, rng=0):
  cfg = base["config"]
  model = llama_example.Llama(cfg, scan=scan)
  config = fsdp_jax.FSDPConfig(
      use_orig_params=orig, lora=lora, stacked_layers=("params.layers",) if scan else (),
      auto_wrap_policy=None if scan else fsdp_jax.ModuleWrapPolicy({llama_example.Block}))
  wm = llama_example.weight_map(cfg, scan=scan)
  state = fsdp_jax.init_train_state(
      init_fn=lambda r: model.init(r, jnp.zeros((1, 8), jnp.int32)), rng=jax.random.key(rng),
      optimizer=optimizer or optax.sgd(1e-3), mesh=_mesh(n), config=config,
      pretrained=pretrained.load(base["dir"], wm))
  return model, state, wm


@pytest.fixture(scope="module")
def plain(base):
  """``{scan: {parameter name: value}}``: the checkpoint through the
  WeightMap (stacked layers stacked), for both layer layouts."""
  tensors = load_file(os.path.join(base["dir"], "model.safetensors"))
  out = {}
  for scan in (False, True):
    params: dict = {}
    for name, x in tensors.items():
      rule, values = llama_example.weight_map(base["config"], scan=scan).checkpoint_rule(name)
      if rule.param is not None:
        params.setdefault("params." + rule.param_name(values), {})[
            values.get(rule.stack_axis_name)] = rule.chain.to_model(x)
    out[scan] = {k: np.stack([v[i] for i in sorted(v)]) if None not in v else v[None]
                 for k, v in params.items()}
  return out


@functools.lru_cache(maxsize=None)
def _round_trip(q):
  """``decode(encode(w))`` and ``encode(w)``, jitted as the state's are."""
  return (jax.jit(lambda w: quant.decode(quant.encode(w, q), q, w.shape[-1], w.dtype)),
          jax.jit(lambda w: quant.encode(w, q)))


def _stored(state) -> dict:
  """``{stored leaf name: full value}``: the base, lora_A and lora_B apart."""
  leaves = convert.storage_to_leaves(state.plan, state.params)
  return {state.plan.leaves[i].name: np.asarray(x) for i, x in leaves.items()}


LOAD_CASES = {
    # scan (stacked layers), use_orig_params, shard, base quantization
    "flat-4": (False, False, 4, None),
    "orig-3-scan": (True, True, 3, None),
    "flat-3-int8": (False, False, 3, fsdp_jax.Quantization(dtype=jnp.int8, block_size=16)),
    "orig-3-scan-nf4": (True, True, 3, "nf4"),
}


@needs_hf
@pytest.mark.parametrize("case", list(LOAD_CASES))
def test_a_lora_state_loads_the_checkpoint(base, plain, case):
  """The merged parameters are the checkpoint's (B = 0), or for QLoRA its
  quantized round trip; the stored base is what init_train_state's own
  encode gives, bit for bit; the factors keep their init."""
  scan, orig, n, q = LOAD_CASES[case]
  if q == "nf4":
    q = fsdp_jax.Quantization(dtype="nf4", block_size=64)
  lora = fsdp_jax.LoRA(targets=TARGETS, rank=4, alpha=8.0, base_quantization=q)
  _, state, _ = _state(base, scan=scan, orig=orig, n=n, lora=lora)
  assert len(state.plan.lora_targets) == (2 if scan else 4)
  assert state.plan.lora_targets[0].endswith("attn.q.kernel")
  targets = state.plan.lora_targets
  expect = dict(plain[scan])
  if q is not None:
    expect.update({k: np.asarray(_round_trip(q)[0](expect[k])) for k in targets})
  got = fsdp_jax.summon_full_params(state)
  got = {".".join(str(getattr(k, "key", k)) for k in path): x
         for path, x in jax.tree_util.tree_leaves_with_path(got)}
  assert sorted(got) == sorted(expect)
  for k, x in got.items():
    np.testing.assert_array_equal(x, expect[k], err_msg=k)
  stored = _stored(state)
  for name in targets:
    w = plain[scan][name]
    want = w if q is None else np.asarray(_round_trip(q)[1](w))
    np.testing.assert_array_equal(stored[name + ".base"], want)
    assert not stored[name + ".lora_B"].any()
    a = stored[name + ".lora_A"]
    assert a.any() and np.abs(a).max() <= 1 / np.sqrt(w.shape[-2])


@needs_hf
def test_peft_loads_the_trained_adapter_and_it_reads_back_bitwise(base, tmp_path):
  """Train the adapters (and the final norm, PEFT's modules_to_save) a few
  steps; PEFT's model from our adapter gives our logits; load_adapter into a
  fresh state gives the same factors bitwise; the merged save gives
  transformers our logits."""
  lora = fsdp_jax.LoRA(targets=TARGETS, rank=4, alpha=8.0, trainable=("norm",))
  model, state, wm = _state(base, lora=lora, optimizer=optax.adam(1e-2))
  loss_fn = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
      model.apply(p, b["x"]), b["y"]).mean()
  step = fsdp_jax.shard_train_step(loss_fn, optax.adam(1e-2))
  toks = np.random.default_rng(1).integers(0, 128, (8, 13)).astype(np.int32)
  for _ in range(3):
    state, _ = step(state, {"x": toks[:, :-1], "y": toks[:, 1:]})
  ours = np.asarray(model.apply(fsdp_jax.summon_full_params(state), TOKENS))
  assert not np.allclose(ours, base["logits"], atol=1e-3)  # it trained

  written = pretrained.save_adapter(state, tmp_path / "adapter", wm,
                                    base_model_name_or_path=base["dir"])
  assert [os.path.basename(f) for f in written] == ["adapter_model.safetensors",
                                                    "adapter_config.json"]
  config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert config["target_modules"] == ["q_proj", "v_proj"]
  assert config["modules_to_save"] == ["model.norm"]
  assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
  tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  key = "base_model.model.model.layers.1.self_attn.v_proj"
  assert tensors[key + ".lora_A.weight"].shape == (4, 64)
  assert tensors[key + ".lora_B.weight"].shape == (32, 4)  # two key/value heads of 16
  assert len(tensors) == 2 * 2 * 2 + 1

  hf = transformers.LlamaForCausalLM.from_pretrained(base["dir"]).eval()
  theirs = _torch_logits(peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval())
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4)

  _, fresh, _ = _state(base, lora=lora, rng=7)
  before = _stored(fresh)
  back = _stored(pretrained.load_adapter(fresh, tmp_path / "adapter", wm))
  trained = _stored(state)
  for name, x in trained.items():
    np.testing.assert_array_equal(back[name], x, err_msg=name)
  assert not np.array_equal(before["params.layers_0.attn.q.kernel.lora_A"],
                            back["params.layers_0.attn.q.kernel.lora_A"])

  pretrained.save(state, tmp_path / "merged", wm)
  shutil.copy(os.path.join(base["dir"], "config.json"), tmp_path / "merged")
  merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
  np.testing.assert_allclose(_torch_logits(merged), ours, rtol=0, atol=1e-4)

  # The eval step with LoRA(dropout=0.05) is PEFT's model.eval() with
  # lora_dropout=0.05: no dropout, whatever the key.
  drop_lora = dataclasses.replace(lora, dropout=0.05)
  _, drop_state, _ = _state(base, lora=drop_lora, n=2, rng=7)
  drop_state = pretrained.load_adapter(drop_state, tmp_path / "adapter", wm)
  pretrained.save_adapter(drop_state, tmp_path / "dropout", wm)
  assert json.loads((tmp_path / "dropout" / "adapter_config.json").read_text())[
      "lora_dropout"] == 0.05
  hf = transformers.LlamaForCausalLM.from_pretrained(base["dir"]).eval()
  theirs = _torch_logits(peft.PeftModel.from_pretrained(hf, tmp_path / "dropout").eval())
  eval_step = fsdp_jax.shard_eval_step(lambda p, b: model.apply(p, b["x"]), outputs="batch")
  evals = [np.asarray(eval_step(drop_state, {"x": TOKENS}, rng=jax.random.key(k)))
           for k in (0, 1)]
  np.testing.assert_array_equal(evals[0], evals[1])
  np.testing.assert_allclose(evals[0], theirs, rtol=0, atol=1e-4)


@needs_hf
@pytest.mark.slow
def test_stacked_layers_save_an_adapter_per_layer(base, tmp_path):
  lora = fsdp_jax.LoRA(targets=TARGETS, rank=4, alpha=16.0)
  model, state, wm = _state(base, scan=True, orig=True, n=3, lora=lora)
  state = fsdp_jax.write_full_params(state, lambda p: jax.tree.map(
      lambda x: x.replace(lora_B=x.lora_B + 0.01 * jnp.arange(x.lora_B.size).reshape(
          x.lora_B.shape) / x.lora_B.size) if hasattr(x, "lora_B") else x, p,
      is_leaf=lambda x: hasattr(x, "lora_B")))
  ours = np.asarray(model.apply(fsdp_jax.summon_full_params(state), TOKENS))
  pretrained.save_adapter(state, tmp_path / "adapter", wm)
  hf = transformers.LlamaForCausalLM.from_pretrained(base["dir"]).eval()
  theirs = _torch_logits(peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval())
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4)
  assert not np.allclose(theirs, base["logits"], atol=1e-3)
  back = pretrained.load_adapter(_state(base, scan=True, orig=True, n=3, lora=lora, rng=3)[1],
                                 tmp_path / "adapter", wm)
  for name, x in _stored(state).items():
    np.testing.assert_array_equal(_stored(back)[name], x, err_msg=name)


# --------------------------------------------------------------------------
# Factor layouts


@pytest.mark.parametrize("transforms,shape", [
    ((pretrained.transpose(),), (6, 4)),
    ((pretrained.transpose(), pretrained.rope_interleave(2)), (6, 8)),
    ((), (6, 4)),
    ((pretrained.rope_interleave(1),), (5, 4)),
])
def test_factors_invert_the_map(transforms, shape):
  """PEFT's ``lora_B.weight @ lora_A.weight`` is the checkpoint-layout image
  of ``A @ B``, and back exactly."""
  chain = pretrained.WeightMap([("w", "p", *transforms)]).rules[0].chain
  rng = np.random.default_rng(0)
  a = rng.normal(size=(shape[0], 3)).astype(np.float32)
  b = rng.normal(size=(3, shape[1])).astype(np.float32)
  ckpt_shape = chain.checkpoint_shape(shape)
  lay = factor_layout(chain, shape, ckpt_shape, "t")
  lora_a, lora_b = lay.to_peft(a, b)
  np.testing.assert_allclose(lora_b @ lora_a, chain.to_checkpoint(a @ b, ckpt_shape),
                             rtol=1e-6, atol=1e-6)
  a2, b2 = lay.from_peft(lora_a, lora_b, *shape, np.float32)
  np.testing.assert_array_equal(a2, a)
  np.testing.assert_array_equal(b2, b)


def test_nd_factors_invert_the_map():
  """A [d, heads, head_dim] kernel from a [heads * head_dim, d] weight: PEFT's
  factors are A [d, r] and B [r, heads, head_dim] flattened, and back."""
  chain = pretrained.WeightMap([("w", "p", pretrained.transpose(), pretrained.reshape(
      (4, 2, 3), checkpoint_shape=(4, 6)))]).rules[0].chain
  rng = np.random.default_rng(0)
  a, b = rng.normal(size=(4, 2)), rng.normal(size=(2, 6))
  lay = factor_layout(chain, (4, 2, 3), (6, 4), "t", out_dims=2)
  lora_a, lora_b = lay.to_peft(a, b)
  np.testing.assert_allclose(lora_b @ lora_a, chain.to_checkpoint((a @ b).reshape(4, 2, 3),
                                                                  (6, 4)), rtol=1e-12)
  with pytest.raises(ValueError, match=r"mixes the kernel's axes.*LoRA\(input_dims=...\)"):
    factor_layout(chain, (4, 2, 3), (6, 4), "t", out_dims=1)  # [4 * 2] x [3]: rows mix


def test_a_map_that_mixes_axes_is_refused():
  chain = pretrained.WeightMap([("w", "p", pretrained.reshape(
      (3, 10), checkpoint_shape=(6, 5)))]).rules[0].chain
  with pytest.raises(ValueError, match=r"mixes the kernel's axes.*Fix: narrow"):
    factor_layout(chain, (3, 10), (6, 5), "LoRA target 'p'")
  scaled = pretrained.WeightMap([("w", "p", (lambda x: x * 2.0, lambda y: y / 2.0))])
  with pytest.raises(ValueError, match=r"not move the kernel's elements as a permutation"):
    factor_layout(scaled.rules[0].chain, (4, 4), (4, 4), "LoRA target 'p'")


# --------------------------------------------------------------------------
# N-D kernels: einsum projections of PyTorch Linear layers

N_D, N_HEADS, N_HEAD = 8, 2, 3
N_RULES = [("q_proj.weight", "q_proj.kernel", pretrained.transpose(),
            pretrained.reshape((N_D, N_HEADS, N_HEAD), checkpoint_shape=(N_D, N_HEADS * N_HEAD))),
           ("o_proj.weight", "o_proj.kernel", pretrained.transpose(),
            pretrained.reshape((N_HEADS, N_HEAD, N_D), checkpoint_shape=(N_HEADS * N_HEAD, N_D)))]
N_LORA = fsdp_jax.LoRA(targets=("q_proj", "o_proj"), rank=2, alpha=4.0,
                       input_dims={"o_proj": 2})


def _nd_forward(p, x):
  h = jnp.tanh(jnp.einsum("bd,dnh->bnh", x, p["q_proj"]["kernel"]))
  return jnp.einsum("bnh,nhd->bd", h, p["o_proj"]["kernel"])


@needs_hf
def test_nd_kernels_save_a_peft_adapter_for_linear_layers(tmp_path):
  """[d, heads, head_dim] and [heads, head_dim, d] kernels of PyTorch Linear
  weights: PEFT's model from the adapter gives our outputs, load_adapter
  reads it back bitwise, a QLoRA base loads from the checkpoint as init
  encodes it, and an input/output split the map cannot keep is refused."""
  rng = np.random.default_rng(0)
  params = {"q_proj": {"kernel": rng.normal(size=(N_D, N_HEADS, N_HEAD)).astype(np.float32)},
            "o_proj": {"kernel": rng.normal(size=(N_HEADS, N_HEAD, N_D)).astype(np.float32)}}
  wm = pretrained.WeightMap(N_RULES)
  weights = {"q_proj.weight": params["q_proj"]["kernel"].reshape(N_D, -1).T.copy(),
             "o_proj.weight": params["o_proj"]["kernel"].reshape(-1, N_D).T.copy()}
  save_file(weights, str(tmp_path / "model.safetensors"))

  class Torch(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.q_proj = torch.nn.Linear(N_D, N_HEADS * N_HEAD, bias=False)
      self.o_proj = torch.nn.Linear(N_HEADS * N_HEAD, N_D, bias=False)

    def forward(self, x):
      return self.o_proj(torch.tanh(self.q_proj(x)))

  model = Torch()
  model.load_state_dict({k: torch.tensor(v) for k, v in weights.items()})
  mesh = _mesh(3)
  make = lambda lora, seed: fsdp_jax.init_train_state(
      params=params, optimizer=optax.sgd(0.1), mesh=mesh, rng=jax.random.key(seed),
      config=fsdp_jax.FSDPConfig(lora=lora))
  bump = lambda w: w.replace(lora_B=w.lora_B + 0.1 * jnp.arange(w.lora_B.size).reshape(
      w.lora_B.shape) / w.lora_B.size)
  state = fsdp_jax.write_full_params(make(N_LORA, 0), lambda p: jax.tree.map(
      bump, p, is_leaf=lambda x: hasattr(x, "lora_B")))
  x = rng.normal(size=(5, N_D)).astype(np.float32)
  ours = np.asarray(_nd_forward(fsdp_jax.summon_full_params(state), x))
  pretrained.save_adapter(state, tmp_path / "adapter", wm, task_type=None)
  tensors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  assert {k: v.shape for k, v in tensors.items()} == {
      "base_model.model.q_proj.lora_A.weight": (2, N_D),
      "base_model.model.q_proj.lora_B.weight": (N_HEADS * N_HEAD, 2),
      "base_model.model.o_proj.lora_A.weight": (2, N_HEADS * N_HEAD),
      "base_model.model.o_proj.lora_B.weight": (N_D, 2)}
  with torch.no_grad():
    theirs = peft.PeftModel.from_pretrained(model, tmp_path / "adapter").eval()(
        torch.tensor(x)).numpy()
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-5)
  assert not np.allclose(ours, np.asarray(_nd_forward(params, x)), atol=1e-3)
  back = _stored(pretrained.load_adapter(make(N_LORA, 1), tmp_path / "adapter", wm))
  for name, value in _stored(state).items():
    np.testing.assert_array_equal(back[name], value, err_msg=name)

  q = fsdp_jax.Quantization(dtype=jnp.int8, block_size=4)
  qlora = dataclasses.replace(N_LORA, base_quantization=q)
  loaded = fsdp_jax.init_train_state(
      init_fn=lambda r: jax.tree.map(jnp.zeros_like, params), rng=jax.random.key(0),
      optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig(lora=qlora),
      pretrained=pretrained.load(tmp_path / "model.safetensors", wm))
  stored, want = _stored(loaded), _stored(make(qlora, 0))
  assert stored["q_proj.kernel.base"].shape == (N_D, q.payload_bytes(N_HEADS * N_HEAD))
  for name in ("q_proj.kernel.base", "o_proj.kernel.base"):
    np.testing.assert_array_equal(stored[name], want[name], err_msg=name)

  split = fsdp_jax.LoRA(targets=("q_proj",), rank=2, input_dims=2)  # [d * heads] x [head_dim]
  with pytest.raises(ValueError, match=r"'q_proj.kernel' -> 'q_proj.weight'.*mixes the kernel's "
                                       r"axes.*LoRA\(input_dims=...\)"):
    pretrained.save_adapter(make(split, 0), tmp_path / "bad", wm, task_type=None)
  assert not (tmp_path / "bad").exists()


# --------------------------------------------------------------------------
# Errors, on a plain tree

RULES = [("fc1.weight", "fc1.kernel", pretrained.transpose()),
         ("fc2.weight", "fc2.kernel", pretrained.transpose())]


def _plain_state(mesh, targets=("fc1", "fc2"), rank=2, alpha=4.0, rng=0):
  params = {"fc1": {"kernel": jnp.ones((6, 4))}, "fc2": {"kernel": jnp.ones((4, 6))}}
  return fsdp_jax.init_train_state(
      params=params, optimizer=optax.sgd(0.1), mesh=mesh, rng=jax.random.key(rng),
      config=fsdp_jax.FSDPConfig(lora=fsdp_jax.LoRA(targets=targets, rank=rank, alpha=alpha)))


@pytest.fixture(name="mesh2")
def _mesh2():
  return _mesh(2)


def test_save_adapter_refuses_a_state_without_lora(mesh2, tmp_path):
  state = fsdp_jax.init_train_state(params={"fc1": {"kernel": jnp.ones((6, 4))}},
                                    optimizer=optax.sgd(0.1), mesh=mesh2,
                                    config=fsdp_jax.FSDPConfig())
  with pytest.raises(ValueError, match=r"save_adapter: the state has no LoRA adapters.*Fix: "
                                       r"build the state with FSDPConfig\(lora="):
    pretrained.save_adapter(state, tmp_path / "a", pretrained.WeightMap(RULES))


def test_load_adapter_names_a_wrong_rank_and_alpha(mesh2, tmp_path):
  pretrained.save_adapter(_plain_state(mesh2, rank=4), tmp_path / "a",
                          pretrained.WeightMap(RULES))
  with pytest.raises(ValueError, match=r"the adapter has rank r=4 .*tensor 'base_model.model."
                                       r"fc1.lora_A.weight' has shape \[4, 6\]\) .* rank=2\. "
                                       r"Fix: build the state with .*LoRA\(\.\.\., rank=4\)"):
    pretrained.load_adapter(_plain_state(mesh2, rank=2), tmp_path / "a",
                            pretrained.WeightMap(RULES))
  with pytest.raises(ValueError, match=r"lora_alpha=4.0 .* alpha=8.*alpha=4.0\)"):
    pretrained.load_adapter(_plain_state(mesh2, rank=4, alpha=8.0), tmp_path / "a",
                            pretrained.WeightMap(RULES))
  # A config that says the state's rank, over tensors of another: the shapes tell.
  config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
  (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "r": 2}))
  with pytest.raises(ValueError, match=r"tensor 'base_model.model.fc1.lora_A.weight' has shape "
                                       r"\[4, 6\], but LoRA target 'fc1.kernel' \(rank 2\) "
                                       r"needs \[2, 6\]"):
    pretrained.load_adapter(_plain_state(mesh2, rank=2), tmp_path / "a",
                            pretrained.WeightMap(RULES))


def test_load_adapter_names_missing_tensors_and_unknown_modules(mesh2, tmp_path):
  pretrained.save_adapter(_plain_state(mesh2), tmp_path / "a", pretrained.WeightMap(RULES))
  path = tmp_path / "a" / "adapter_model.safetensors"
  tensors = load_file(str(path))
  save_file({k: v for k, v in tensors.items() if "fc2.lora_B" not in k}, str(path))
  with pytest.raises(ValueError, match=r"1 tensor\(s\) of the state's LoRA targets are not in "
                                       r"the adapter: \['base_model.model.fc2.lora_B.weight'\]"
                                       r".*fix: the state's LoRA\(targets=...\)"):
    pretrained.load_adapter(_plain_state(mesh2), tmp_path / "a", pretrained.WeightMap(RULES))
  save_file(tensors, str(path))
  with pytest.raises(ValueError, match=r"2 adapter tensor\(s\) are for modules the state does "
                                       r"not adapt or train: \['base_model.model.fc2.lora_A."
                                       r"weight', .*fix: add their parameters to LoRA\(targets"):
    pretrained.load_adapter(_plain_state(mesh2, targets=("fc1",)), tmp_path / "a",
                            pretrained.WeightMap(RULES))


def test_save_adapter_needs_a_rule_for_each_target(mesh2, tmp_path):
  with pytest.raises(ValueError, match=r"no rule of the WeightMap maps LoRA target 'fc2.kernel'"
                                       r" \(shape \[4, 6\]\).*Fix: pass the WeightMap"):
    pretrained.save_adapter(_plain_state(mesh2), tmp_path / "a",
                            pretrained.WeightMap(RULES[:1]))
  assert not (tmp_path / "a").exists()


def test_lora_strict_load_names_the_kernel_not_its_base(mesh2, tmp_path):
  """lora_A / lora_B are never missing; a target without a tensor is named
  by its own name."""
  save_file({"fc1.weight": np.ones((4, 6), np.float32)}, str(tmp_path / "m.safetensors"))
  init = lambda: {"fc1": {"kernel": jnp.zeros((6, 4))}, "fc2": {"kernel": jnp.zeros((4, 6))}}
  with pytest.raises(ValueError, match=r"1 parameter\(s\) no checkpoint tensor loads: "
                                       r"'fc2.kernel' \("):
    fsdp_jax.init_train_state(
        init_fn=init, optimizer=optax.sgd(0.1), mesh=mesh2,
        config=fsdp_jax.FSDPConfig(lora=fsdp_jax.LoRA(targets=("fc1", "fc2"), rank=2)),
        pretrained=pretrained.load(tmp_path / "m.safetensors", pretrained.WeightMap(RULES)))
