"""Pretrained weights in and out (fsdp_jax.pretrained).

The real clients: small random transformers models (Llama with grouped-query
attention and an untied head; GPT-2 with [in, out] Conv1D weights and a tied
head) saved with ``save_pretrained``, loaded into the Flax models of
``examples/llama.py`` and ``examples/gpt2.py`` through their WeightMaps,
compared with transformers' logits, trained, saved, and read back by
transformers' ``from_pretrained``. Then the formats, the transforms, the
errors, and a 2-process run that reads only its own devices' slices.
"""

from __future__ import annotations

import copy
import json
import os
import struct
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file, save_file

import fsdp_jax
from fsdp_jax import ShardingStrategy as S
from fsdp_jax import pretrained

from helpers import REPO, Background, assert_trees_close, subprocess_env, lazy_modules

sys.path.insert(0, str(REPO / "examples"))
import gpt2 as gpt2_example  # noqa: E402  pylint: disable=wrong-import-position
import llama as llama_example  # noqa: E402  pylint: disable=wrong-import-position

# torch's CPU build is installed for Python 3.11 only; imported when a test uses it.
torch, transformers = lazy_modules("torch", "transformers")

HF_REASON = ("needs torch and transformers (pyproject's test extra installs torch's CPU "
             "build for Python 3.11, the one this machine's package index has)")
needs_hf = pytest.mark.skipif(transformers is None, reason=HF_REASON)

TOKENS = np.random.default_rng(0).integers(0, 128, (2, 12)).astype(np.int32)


def _mesh(n, replicate=None):
  devices = jax.devices()[: n * (replicate or 1)]
  return fsdp_jax.make_mesh(shard=n, replicate=replicate, devices=devices)


def _init_fn(model):
  return lambda rng: model.init(rng, jnp.zeros((1, 8), jnp.int32))


# --------------------------------------------------------------------------
# Llama and GPT-2 from transformers


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
  """A small random LlamaForCausalLM (grouped-query attention, untied head),
  saved in safetensors shards with an index, as a PyTorch state dict
  (torch.save), and in bf16."""
  if transformers is None:
    pytest.skip(HF_REASON)
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
      vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
      tie_word_embeddings=False)
  model = transformers.LlamaForCausalLM(cfg).eval()
  root = tmp_path_factory.mktemp("llama")
  sharded, binary, bf16 = root / "sharded", root / "bin", root / "bf16"
  model.save_pretrained(sharded, max_shard_size="100KB")
  binary.mkdir()
  torch.save(model.state_dict(), binary / "pytorch_model.bin")  # a PyTorch state dict
  copy.deepcopy(model).to(torch.bfloat16).save_pretrained(bf16)
  rounded = transformers.LlamaForCausalLM.from_pretrained(bf16, dtype=torch.float32).eval()
  with torch.no_grad():
    logits = model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    logits_bf16 = rounded(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  return dict(dirs={"sharded": str(sharded), "bin": str(binary / "pytorch_model.bin"),
                    "bf16": str(bf16)},
              logits={"sharded": logits, "bin": logits, "bf16": logits_bf16},
              config=llama_example.LlamaConfig.from_pretrained(str(sharded)), hf_config=cfg)


LLAMA_CASES = {
    # strategy, shard, replicate, use_orig_params, scan (stacked layers), mixed precision, source
    "FULL_SHARD-4-flat": (S.FULL_SHARD, 4, None, False, False, False, "sharded"),
    "FULL_SHARD-3-orig-scan": (S.FULL_SHARD, 3, None, True, True, False, "sharded"),
    "SHARD_GRAD_OP-2-orig-bin": (S.SHARD_GRAD_OP, 2, None, True, False, False, "bin"),
    "HYBRID-2x2-flat-scan": (S.HYBRID_SHARD, 2, 2, False, True, False, "sharded"),
    "FULL_SHARD-8-flat-bf16ckpt-mp": (S.FULL_SHARD, 8, None, False, False, True, "bf16"),
}


def _llama_state(hf_llama, case, optimizer=None):
  strategy, n, r, orig, scan, mp, source = LLAMA_CASES[case]
  cfg = hf_llama["config"]
  model = llama_example.Llama(cfg, scan=scan)
  config = fsdp_jax.FSDPConfig(
      sharding_strategy=strategy, use_orig_params=orig,
      stacked_layers=("params.layers",) if scan else (),
      mixed_precision=fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16) if mp else None,
      auto_wrap_policy=None if scan else fsdp_jax.ModuleWrapPolicy({llama_example.Block}))
  src = pretrained.load(hf_llama["dirs"][source], llama_example.weight_map(cfg, scan=scan))
  state = fsdp_jax.init_train_state(
      init_fn=_init_fn(model), rng=jax.random.key(0), optimizer=optimizer or optax.adam(1e-3),
      mesh=_mesh(n, r), config=config, pretrained=src)
  return model, state, src


@needs_hf
@pytest.mark.parametrize("case", [c if c == "FULL_SHARD-4-flat" else pytest.param(
    c, marks=pytest.mark.slow) for c in LLAMA_CASES])
def test_llama_gives_transformers_logits(hf_llama, case):
  model, state, _ = _llama_state(hf_llama, case)
  params = fsdp_jax.summon_full_params(state)
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}  # fp32 masters
  logits = np.asarray(model.apply(params, TOKENS))
  np.testing.assert_allclose(logits, hf_llama["logits"][LLAMA_CASES[case][-1]], rtol=0,
                             atol=1e-4)


@needs_hf
@pytest.mark.slow
@pytest.mark.parametrize("case", ["FULL_SHARD-4-flat", "FULL_SHARD-3-orig-scan"])
def test_fine_tuned_llama_saves_for_transformers(hf_llama, case, tmp_path):
  """A few steps, then save: transformers' from_pretrained gives our logits."""
  model, state, _ = _llama_state(hf_llama, case, optax.adam(1e-2))
  loss_fn = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
      model.apply(p, b["x"]), b["y"]).mean()
  step = fsdp_jax.shard_train_step(loss_fn, optax.adam(1e-2))
  toks = np.random.default_rng(1).integers(0, 128, (12, 13)).astype(np.int32)
  losses = []
  for _ in range(3):
    state, metrics = step(state, {"x": toks[:, :-1], "y": toks[:, 1:]})
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0]
  ours = np.asarray(model.apply(fsdp_jax.summon_full_params(state), TOKENS))
  out = tmp_path / "tuned"
  written = pretrained.save(state, out, llama_example.weight_map(hf_llama["config"],
                                                                scan="scan" in case),
                            max_shard_size="60KB")
  assert len(written) > 1 and (out / "model.safetensors.index.json").exists()
  hf_llama["hf_config"].save_pretrained(out)
  reloaded = transformers.LlamaForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    theirs = reloaded(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-4)
  assert not np.allclose(theirs, hf_llama["logits"]["sharded"], atol=1e-3)  # it trained


@needs_hf
def test_gpt2_tied_head_loads_and_saves(tmp_path):
  torch.manual_seed(1)
  hf_cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                   n_head=4, bos_token_id=0, eos_token_id=0)
  hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
  hf.save_pretrained(tmp_path / "gpt2")
  with torch.no_grad():
    ref = hf(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  cfg = gpt2_example.GPT2Config.from_pretrained(str(tmp_path / "gpt2"))
  model = gpt2_example.GPT2(cfg)
  wm = gpt2_example.weight_map(cfg)
  state = fsdp_jax.init_train_state(
      init_fn=_init_fn(model), rng=jax.random.key(0), optimizer=optax.sgd(0.1),
      mesh=_mesh(3), config=fsdp_jax.FSDPConfig(use_orig_params=True),
      pretrained=pretrained.load(tmp_path / "gpt2", wm))
  ours = np.asarray(model.apply(fsdp_jax.summon_full_params(state), TOKENS))
  np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4)
  pretrained.save(state, tmp_path / "back", wm)
  assert "lm_head.weight" not in load_file(str(tmp_path / "back" / "model.safetensors"))
  hf_cfg.save_pretrained(tmp_path / "back")
  again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
  with torch.no_grad():
    np.testing.assert_allclose(again(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy(),
                               ours, rtol=0, atol=1e-4)


# --------------------------------------------------------------------------
# Transforms


def _hf_permute(w, n_heads):
  """transformers' convert_llama_weights_to_hf.py: Meta's interleaved rotary
  rows -> Hugging Face's half-split rows (per head)."""
  dim1, dim2 = w.shape
  return w.reshape(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(0, 2, 1, 3).reshape(
      dim1, dim2)


@pytest.mark.parametrize("heads,head_dim", [(1, 4), (4, 8), (2, 16)])
def test_rope_interleave_inverts_the_hf_conversion(heads, head_dim):
  meta = np.random.default_rng(0).normal(size=(heads * head_dim, 5)).astype(np.float32)
  hf = _hf_permute(meta, heads)
  # The model layout is [in, out]: transpose, then reorder the last axis.
  chain = pretrained.WeightMap([("w", "p", pretrained.transpose(),
                                 pretrained.rope_interleave(heads))]).rules[0].chain
  np.testing.assert_array_equal(chain.to_model(hf), meta.T)
  np.testing.assert_array_equal(chain.to_checkpoint(meta.T, hf.shape), hf)


def test_rope_interleave_refuses_a_width_that_is_not_heads():
  with pytest.raises(ValueError, match=r"rope_interleave\(num_heads=3\).*10 elements"):
    pretrained.rope_interleave(3).model_shape((4, 10))


@pytest.mark.parametrize("transforms", [
    (pretrained.transpose(),), (pretrained.transpose(), pretrained.rope_interleave(3)),
    (pretrained.reshape((3, 2, 5), checkpoint_shape=(6, 5)),),
    (pretrained.reshape((3, 10), checkpoint_shape=(6, 5)),),
    ((lambda x: x[::-1] * 2.0, lambda y: y[::-1] / 2.0),)])
def test_reading_a_slice_equals_slicing_the_whole(tmp_path, transforms):
  """A device's rows, read from the file alone, are the rows of the whole
  tensor; every transform inverts."""
  x = np.random.default_rng(1).normal(size=(6, 5)).astype(np.float32)
  save_file({"t": x}, str(tmp_path / "m.safetensors"))
  rule = pretrained.WeightMap([("t", "p", *transforms)]).rules[0]
  full = rule.chain.to_model(x)
  source = pretrained.load(tmp_path / "m.safetensors",
                           pretrained.WeightMap([("t", "p", *transforms)]))
  from fsdp_jax._src.pretrained.loading import LeafSource  # pylint: disable=import-outside-toplevel
  leaf = LeafSource(0, ("t",), False, rule.chain, x.shape)
  for a, b in [(0, full.shape[0]), (1, 3), (full.shape[0] - 1, full.shape[0])]:
    got = source.read_leaf(leaf, (slice(a, b),), np.float32)
    np.testing.assert_array_equal(got, full[a:b])
  np.testing.assert_allclose(rule.chain.to_checkpoint(full, x.shape), x)


def test_a_column_slice_reads_only_its_bytes(tmp_path):
  x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
  save_file({"t": x}, str(tmp_path / "m.safetensors"))
  source = pretrained.load(tmp_path / "m.safetensors",
                           pretrained.WeightMap([("t", "p", pretrained.transpose())]))
  from fsdp_jax._src.pretrained.loading import LeafSource  # pylint: disable=import-outside-toplevel
  leaf = LeafSource(0, ("t",), False, source.weight_map.rules[0].chain, x.shape)
  got = source.read_leaf(leaf, (slice(8, 16),), np.float32)  # model rows = checkpoint columns
  np.testing.assert_array_equal(got, x.T[8:16])
  assert source.bytes_read == 64 * 8 * 4


# --------------------------------------------------------------------------
# Every strategy and layout, on a plain tree


def _plain_checkpoint(tmp_path, dtype=np.float32):
  rng = np.random.default_rng(2)
  tensors = {f"blocks.{i}.fc.weight": rng.normal(size=(6, 5)).astype(dtype) for i in range(3)}
  tensors["head.weight"] = rng.normal(size=(2, 6)).astype(dtype)
  tensors["head.bias"] = rng.normal(size=(2,)).astype(dtype)
  save_file(tensors, str(tmp_path / "model.safetensors"))
  return tensors


PLAIN_RULES = [("blocks.{i}.fc.weight", "blocks_{i}.w", pretrained.transpose()),
               ("head.weight", "head.w", pretrained.transpose()), ("head.bias", "head.b")]


def _plain_init(rng=None):
  del rng
  return {**{f"blocks_{i}": {"w": jnp.zeros((5, 6))} for i in range(3)},
          "head": {"w": jnp.zeros((6, 2)), "b": jnp.zeros((2,))}}


@pytest.mark.parametrize("strategy,n,r,orig,offload", [
    (S.FULL_SHARD, 4, None, False, False), (S.FULL_SHARD, 3, None, True, False),
    (S.NO_SHARD, 2, None, False, False), (S._HYBRID_SHARD_ZERO2, 3, 2, True, False),
    (S.HYBRID_SHARD, 3, 2, False, False), (S.FULL_SHARD, 3, None, False, True)],
    ids=["full-4-flat", "full-3-orig", "no_shard-2", "hybrid_zero2-2x3-orig",
         "hybrid-2x3-flat", "full-3-offload"])
def test_every_strategy_layout_and_offload_loads_the_same_values(tmp_path, strategy, n, r, orig,
                                                                  offload):
  tensors = _plain_checkpoint(tmp_path)
  config = fsdp_jax.FSDPConfig(
      sharding_strategy=strategy, use_orig_params=orig,
      auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["blocks_*"]),
      cpu_offload=fsdp_jax.CPUOffload(offload_params=True) if offload else None)
  state = fsdp_jax.init_train_state(
      init_fn=_plain_init, optimizer=optax.adam(1e-3), mesh=_mesh(n, r), config=config,
      pretrained=pretrained.load(tmp_path / "model.safetensors",
                                 pretrained.WeightMap(PLAIN_RULES)))
  if offload:
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"pinned_host"}
  full = fsdp_jax.summon_full_params(state)
  expect = {**{f"blocks_{i}": {"w": tensors[f"blocks.{i}.fc.weight"].T} for i in range(3)},
            "head": {"w": tensors["head.weight"].T, "b": tensors["head.bias"]}}
  assert_trees_close(full, expect, rtol=0, atol=0)
  # Saved back from the shards, the file holds what it was loaded from.
  pretrained.save(state, tmp_path / "saved", pretrained.WeightMap(PLAIN_RULES))
  saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
  assert sorted(saved) == sorted(tensors)
  for name, x in tensors.items():
    np.testing.assert_array_equal(saved[name], x)
  # The optimizer state starts from the loaded parameters (zero moments).
  assert all(float(jnp.max(jnp.abs(x))) == 0 for x in jax.tree.leaves(state.opt_state)
             if jnp.issubdtype(x.dtype, jnp.floating))


def test_the_loaded_state_shares_no_memory_with_the_file(tmp_path):
  """Contiguous slices are read through a memory map: what the state holds
  must be copies, so changing or removing the file changes nothing."""
  tensors = _plain_checkpoint(tmp_path)
  path = tmp_path / "model.safetensors"
  for orig in (False, True):
    state = fsdp_jax.init_train_state(
        init_fn=_plain_init, optimizer=optax.sgd(0.1), mesh=_mesh(2),
        config=fsdp_jax.FSDPConfig(use_orig_params=orig,
                                   auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["blocks_*"])),
        pretrained=pretrained.load(path, pretrained.WeightMap(PLAIN_RULES)))
    before = jax.tree.map(np.asarray, fsdp_jax.summon_full_params(state))
    data = path.read_bytes()
    path.write_bytes(data[:8] + data[8:].replace(tensors["head.bias"].tobytes(), b"\0" * 8))
    assert path.read_bytes() != data
    np.testing.assert_array_equal(before["head"]["b"], tensors["head.bias"])
    assert_trees_close(fsdp_jax.summon_full_params(state), before, rtol=0, atol=0)
    path.unlink()
    assert_trees_close(fsdp_jax.summon_full_params(state), before, rtol=0, atol=0)
    path.write_bytes(data)


def test_stacked_rule_fills_a_stacked_unit_and_ignored_leaves_load(tmp_path):
  tensors = _plain_checkpoint(tmp_path)
  rules = [("blocks.{i}.fc.weight", "blocks.w", pretrained.transpose()),
           ("head.weight", "head.w", pretrained.transpose()), ("head.bias", "head.b")]
  init = lambda: {"blocks": {"w": jnp.zeros((3, 5, 6))},
                  "head": {"w": jnp.zeros((6, 2)), "b": jnp.zeros((2,))}}
  config = fsdp_jax.FSDPConfig(stacked_layers=("blocks",), ignored_states=["head.b"])
  state = fsdp_jax.init_train_state(
      init_fn=init, optimizer=optax.sgd(0.1), mesh=_mesh(4), config=config,
      pretrained=pretrained.load(tmp_path / "model.safetensors", pretrained.WeightMap(rules)))
  full = fsdp_jax.summon_full_params(state)
  np.testing.assert_array_equal(full["blocks"]["w"],
                                np.stack([tensors[f"blocks.{i}.fc.weight"].T for i in range(3)]))
  np.testing.assert_array_equal(full["head"]["b"], tensors["head.bias"])


def test_bf16_checkpoint_into_fp32_masters_and_strict_false_keeps_a_new_head(tmp_path):
  tensors = _plain_checkpoint(tmp_path, dtype=ml_dtypes.bfloat16)
  rules = [r for r in PLAIN_RULES if not r[0].startswith("head")]
  head_w = jnp.arange(12.0).reshape(6, 2)

  def init(rng=None):
    del rng
    tree = _plain_init()
    tree["head"]["w"] = head_w
    return tree

  state = fsdp_jax.init_train_state(
      init_fn=init, optimizer=optax.sgd(0.1), mesh=_mesh(3),
      config=fsdp_jax.FSDPConfig(),  # one flat unit: loaded and new leaves together
      pretrained=pretrained.load(tmp_path / "model.safetensors", pretrained.WeightMap(rules),
                                 strict=False))
  full = fsdp_jax.summon_full_params(state)
  assert full["blocks_0"]["w"].dtype == jnp.float32
  np.testing.assert_array_equal(full["blocks_1"]["w"],
                                tensors["blocks.1.fc.weight"].astype(np.float32).T)
  np.testing.assert_array_equal(full["head"]["w"], head_w)  # init_fn's value
  np.testing.assert_array_equal(full["head"]["b"], np.zeros(2))


def test_flax_linen_names_may_leave_out_params(tmp_path):
  x = np.random.default_rng(3).normal(size=(4, 3)).astype(np.float32)
  save_file({"fc.weight": x}, str(tmp_path / "m.safetensors"))
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  model = nn.Dense(4, use_bias=False, name="fc")
  state = fsdp_jax.init_train_state(
      init_fn=lambda rng: model.init(rng, jnp.zeros((1, 3))), rng=jax.random.key(0),
      optimizer=optax.sgd(0.1), mesh=_mesh(2), config=fsdp_jax.FSDPConfig(),
      pretrained=pretrained.load(tmp_path / "m.safetensors", pretrained.WeightMap(
          [("fc.weight", "kernel", pretrained.transpose())])))
  np.testing.assert_array_equal(fsdp_jax.summon_full_params(state)["params"]["kernel"], x.T)


# --------------------------------------------------------------------------
# Clear errors, nothing lost


@pytest.fixture(name="mesh2")
def _mesh2():
  """A mesh of 2, built before a test's ``pytest.raises`` (with one device,
  the test is skipped instead of catching make_mesh's error)."""
  return _mesh(2)


def _load_into(tmp_path, wm, mesh, strict=True, init=_plain_init, path=None):
  return fsdp_jax.init_train_state(
      init_fn=init, optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig(),
      pretrained=pretrained.load(path or tmp_path / "model.safetensors", wm, strict=strict))


def test_strict_names_every_uncovered_tensor_and_parameter(tmp_path, mesh2):
  _plain_checkpoint(tmp_path)
  wm = pretrained.WeightMap([("blocks.{i}.fc.weight", "blocks_{i}.w", pretrained.transpose())])
  with pytest.raises(ValueError) as e:
    _load_into(tmp_path, wm, mesh2)
  msg = str(e.value)
  assert "2 checkpoint tensor(s) no rule covers: 'head.bias', 'head.weight'" in msg
  assert "2 parameter(s) no checkpoint tensor loads: 'head.b', 'head.w'" in msg


def test_shape_mismatch_names_tensor_parameter_shapes_and_transforms(tmp_path, mesh2):
  _plain_checkpoint(tmp_path)
  wm = pretrained.WeightMap([("blocks.{i}.fc.weight", "blocks_{i}.w"),  # transpose forgotten
                             ("head.weight", "head.w", pretrained.transpose()),
                             ("head.bias", "head.b")])
  with pytest.raises(ValueError, match=(
      r"shape mismatch: tensor 'blocks.0.fc.weight' has shape \[6, 5\], which after no "
      r"transforms is \[6, 5\], but parameter 'blocks_0.w' has shape \[5, 6\]")):
    _load_into(tmp_path, wm, mesh2)


def test_a_rule_to_a_parameter_the_model_lacks(tmp_path, mesh2):
  _plain_checkpoint(tmp_path)
  wm = pretrained.WeightMap(PLAIN_RULES[:2] + [("head.bias", "head.bias")])
  with pytest.raises(ValueError, match=r"maps tensor 'head.bias' to parameter 'head.bias', "
                                       r"which the model does not have"):
    _load_into(tmp_path, wm, mesh2)


def test_complex_does_not_convert_to_float(tmp_path, mesh2):
  path = tmp_path / "c.safetensors"
  _write_raw(path, {"head.bias": ("C64", [2], np.zeros(2, np.complex64).tobytes())})
  with pytest.raises(ValueError, match=r"'head.bias' is complex64, which does not convert to "
                                       r"parameter 'head.b''s float32"):
    _load_into(tmp_path, pretrained.WeightMap([("head.bias", "head.b")]), mesh2, strict=False,
               path=path)


def _write_raw(path, entries):
  header, data, off = {}, b"", 0
  for name, (dtype, shape, raw) in entries.items():
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
    data += raw
    off += len(raw)
  blob = json.dumps(header).encode()
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)) + blob + data)


def test_truncated_file_and_missing_shard_name_the_file(tmp_path):
  _plain_checkpoint(tmp_path)
  path = tmp_path / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[:-10])
  with pytest.raises(ValueError, match=r"model.safetensors: tensor '.*' .* needs bytes .* but "
                                       r"the file has \d+: a truncated file"):
    pretrained.load(path, pretrained.WeightMap(PLAIN_RULES))
  index = {"metadata": {}, "weight_map": {"head.bias": "model-00002-of-00002.safetensors"}}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(ValueError, match=r"lists model-00002-of-00002.safetensors, which is not "
                                       r"in .*: an incomplete download"):
    pretrained.load(tmp_path, pretrained.WeightMap(PLAIN_RULES))
  with pytest.raises(ValueError, match=r"nowhere.safetensors: no such file"):
    pretrained.load(tmp_path / "nowhere.safetensors", pretrained.WeightMap(PLAIN_RULES))


def test_a_torch_checkpoint_without_torch_names_the_fix(tmp_path, monkeypatch):
  (tmp_path / "pytorch_model.bin").write_bytes(b"")
  monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
  with pytest.raises(ImportError, match=r"needs torch. Fix: pip install torch"):
    pretrained.load(tmp_path / "pytorch_model.bin", pretrained.WeightMap(PLAIN_RULES))


def test_pretrained_needs_init_fn(tmp_path, mesh2):
  _plain_checkpoint(tmp_path)
  with pytest.raises(ValueError, match=r"pretrained=.*Fix: pass init_fn="):
    fsdp_jax.init_train_state(
        params=_plain_init(), optimizer=optax.sgd(0.1), mesh=mesh2,
        config=fsdp_jax.FSDPConfig(),
        pretrained=pretrained.load(tmp_path / "model.safetensors",
                                   pretrained.WeightMap(PLAIN_RULES)))


def test_save_refuses_an_existing_directory_and_a_failed_save_leaves_the_old_one(tmp_path, mesh2,
                                                                                 monkeypatch):
  _plain_checkpoint(tmp_path)
  state = _load_into(tmp_path, pretrained.WeightMap(PLAIN_RULES), mesh2)
  out = tmp_path / "out"
  pretrained.save(state, out, pretrained.WeightMap(PLAIN_RULES))
  before = (out / "model.safetensors").read_bytes()
  with pytest.raises(FileExistsError, match=r"exists. Fix: pick a new directory, or pass "
                                            r"overwrite=True"):
    pretrained.save(state, out, pretrained.WeightMap(PLAIN_RULES))
  from fsdp_jax._src.pretrained import files  # pylint: disable=import-outside-toplevel

  def broken(self, name, array):
    raise OSError("disk full")

  monkeypatch.setattr(files.SafetensorsWriter, "write", broken)
  with pytest.raises(OSError, match="disk full"):
    pretrained.save(state, out, pretrained.WeightMap(PLAIN_RULES), overwrite=True)
  assert (out / "model.safetensors").read_bytes() == before  # the old checkpoint, intact
  assert sorted(os.listdir(out)) == ["model.safetensors"]


def test_save_writes_what_the_checkpoint_held_in_its_layout(tmp_path, mesh2):
  tensors = _plain_checkpoint(tmp_path)
  state = _load_into(tmp_path, pretrained.WeightMap(PLAIN_RULES), mesh2)
  pretrained.save(state, tmp_path / "out", pretrained.WeightMap(PLAIN_RULES),
                  max_shard_size=200, dtype=jnp.bfloat16)
  index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
  assert sorted(index["weight_map"]) == sorted(tensors)
  back = {}
  for name in set(index["weight_map"].values()):
    back.update(load_file(str(tmp_path / "out" / name)))
  for k, v in tensors.items():
    assert back[k].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back[k], v.astype(ml_dtypes.bfloat16))


CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def _tiny_tokenizer():
  """A WordLevel tokenizer with a chat template (no download)."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                              eos_token="</s>", chat_template=CHAT_TEMPLATE)


@needs_hf
def test_save_carries_the_tokenizer_and_its_chat_template(tmp_path, mesh2):
  _plain_checkpoint(tmp_path)
  state = _load_into(tmp_path, pretrained.WeightMap(PLAIN_RULES), mesh2)
  wm = pretrained.WeightMap(PLAIN_RULES)
  tok = _tiny_tokenizer()
  messages = [{"role": "user", "content": "hello world"}]
  want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  assert want == "<user>hello world</s><assistant>"
  pretrained.save(state, tmp_path / "a", wm, tokenizer=tok)  # the object: save_pretrained
  pretrained.save(state, tmp_path / "b", wm, tokenizer=tmp_path / "a")  # a directory: copied
  for d in ("a", "b"):
    back = transformers.AutoTokenizer.from_pretrained(tmp_path / d)
    assert back.chat_template == CHAT_TEMPLATE, d
    assert back.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == want
    assert back("hello world")["input_ids"] == [2, 3]
  assert sorted(os.listdir(tmp_path / "b")) == sorted(os.listdir(tmp_path / "a"))
  with pytest.raises(ValueError, match=r"save\(tokenizer='.*empty'\): no tokenizer files there "
                     r"\(looked for tokenizer.json, "):
    (tmp_path / "empty").mkdir()
    pretrained.save(state, tmp_path / "c", wm, tokenizer=str(tmp_path / "empty"))
  assert not (tmp_path / "c").exists()  # refused before anything is written


# --------------------------------------------------------------------------
# Two processes: each reads its own devices' slices


@pytest.mark.slow
@needs_hf
def test_two_processes_each_read_their_own_slices(hf_llama, tmp_path):
  out = tmp_path / "result"
  worker = REPO / "tests" / "pretrained_worker.py"
  spec = dict(checkpoint=hf_llama["dirs"]["sharded"], out=str(out),
              save=str(tmp_path / "saved"))
  run = Background([sys.executable, "-m", "fsdp_jax.launch", "--nproc", "2",
                    "--devices-per-proc", "2", "--platform", "cpu", str(worker),
                    json.dumps(spec)], tmp_path / "log.txt", timeout=600,
                   env=subprocess_env(JAX_PLATFORMS="cpu"))
  run.ok()
  results = [json.loads((tmp_path / f"result.{r}").read_text()) for r in (0, 1)]
  total = sum(int(np.prod(s)) * 4 for s in _shapes(hf_llama["dirs"]["sharded"]).values())
  for res in results:
    assert res["bytes_read"] <= 0.6 * total, (res["bytes_read"], total)
    np.testing.assert_allclose(np.array(res["logits"]), hf_llama["logits"]["sharded"],
                               rtol=0, atol=1e-4)
  hf_llama["hf_config"].save_pretrained(tmp_path / "saved")
  again = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved").eval()
  with torch.no_grad():
    np.testing.assert_allclose(again(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy(),
                               hf_llama["logits"]["sharded"], rtol=0, atol=1e-4)


def _shapes(directory):
  from fsdp_jax._src.pretrained import files  # pylint: disable=import-outside-toplevel
  return {n: i.shape for n, i in files.open_checkpoint(directory).tensors.items()}
