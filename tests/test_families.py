"""fsdp_jax.models against transformers, one tiny random model per family
(hidden 32, 2 layers, grouped-query attention, norms and biases perturbed
from their init, a sequence past the sliding window and past LongRoPE's
original length):

* loaded shard by shard onto 3 devices (which divide nothing), the logits
  and the loss are transformers' to 1e-4 and greedy ``generate`` is
  ``generate(do_sample=False)``'s, token for token; half the families run
  with ``scan=True`` (stacked layers, fused tensors cut per layer);
* ``pretrained.save`` writes a directory ``from_pretrained`` reads as it is
  (config.json, generation_config.json; Phi-3's and GPT-2's fused tensors
  joined back);
* LoRA on ``q_proj`` / ``v_proj`` (Llama, Qwen3, Phi-3, GPT-2: each way
  the projections are named and laid out): the adapter ``save_adapter``
  writes gives, under ``peft.PeftModel``, the logits of the merged model to
  1e-4 (for Phi-3 and GPT-2 the two targets are parts of one fused module),
  and reads back bitwise;
* tensor parallelism 4 x 2 with the family's rules (the five families whose
  split programs differ) trains to the numbers of one unsharded ``jax.jit``
  (those FSDP 8 reproduces) with no all-gather over ``"tensor"`` in the
  compiled step (no torch: this runs on Python 3.13 too);
* fused WeightMap rules (``concat``) and the errors of ``from_pretrained``.

One transformers model and one saved checkpoint per family (module
fixtures); each family's programs compile once.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import save_file

import fsdp_jax
from fsdp_jax import hlo, models, pretrained
from fsdp_jax._src.models.generate import _run as generate_program, special_tokens
from helpers import jit_reference_run, lazy_modules

# torch's CPU build is installed for Python 3.11 only; imported when a test uses it.
peft, torch, transformers = lazy_modules("peft", "torch", "transformers")

HF_REASON = ("needs torch, transformers and peft (pyproject's test extra installs torch's CPU "
             "build for Python 3.11, the one this machine's package index has)")
needs_hf = pytest.mark.skipif(transformers is None, reason=HF_REASON)

V, T, PROMPT, NEW = 64, 10, 6, 6
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
CONFIGS = {
    # Llama 3.x rotary scaling, read from transformers 5's rope_parameters.
    "llama": dict(BASE, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=8)),
    "mistral": dict(BASE, sliding_window=4),
    # Tied head, biases on q/k/v, a full then a sliding layer.
    "qwen2": dict(BASE, tie_word_embeddings=True, use_sliding_window=True, sliding_window=4,
                  max_window_layers=1),
    "qwen3": dict(BASE, head_dim=16),
    "gemma2": dict(BASE, head_dim=8, query_pre_attn_scalar=16, sliding_window=4,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma3_text": dict(BASE, head_dim=8, query_pre_attn_scalar=16, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                            "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default",
                                                               "rope_theta": 1e4}}),
    # LongRoPE past its original 8 positions, half the head dim rotated.
    "phi3": dict(BASE, sliding_window=5, max_position_embeddings=32,
                 original_max_position_embeddings=8,
                 rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                      partial_rotary_factor=0.5, short_factor=[1.0, 1.5],
                                      long_factor=[2.0, 3.0])),
    "gpt2": dict(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                 initializer_range=0.2),
}
FAMILIES = list(CONFIGS)
SCAN = {"mistral", "qwen3", "gemma3_text", "phi3"}  # loaded with stacked layers
IDS = np.random.default_rng(0).integers(0, V, (2, T)).astype(np.int32)


def _mesh(n, **kw):
  return fsdp_jax.make_mesh(shard=n, devices=jax.devices()[:n * kw.get("tensor", 1)], **kw)


def _config_dir(tmp_path, family) -> str:
  d = tmp_path / family
  d.mkdir()
  (d / "config.json").write_text(json.dumps({"model_type": family, **CONFIGS[family]}))
  return str(d)


# --------------------------------------------------------------------------
# One transformers model, its checkpoint and its numbers per family


class Hub:
  """A family's transformers model (norms and biases perturbed), saved."""

  def __init__(self, family, root):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        family, **CONFIGS[family], bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
      for name, p in model.named_parameters():
        if "norm" in name or "ln_" in name or name.endswith("bias"):
          p.add_(0.2 * torch.randn_like(p))
    self.model, self.dir = model, str(root / family)
    model.save_pretrained(self.dir)
    with open(os.path.join(self.dir, "generation_config.json"), "w") as f:
      json.dump({"do_sample": False, "max_new_tokens": 7}, f)
    with torch.no_grad():
      out = model(torch.tensor(IDS, dtype=torch.long), labels=torch.tensor(IDS, dtype=torch.long))
      self.logits, self.loss = out.logits.numpy(), float(out.loss)
      self.generated = model.generate(torch.tensor(IDS[:, :PROMPT], dtype=torch.long),
                                      do_sample=False, max_new_tokens=NEW,
                                      min_new_tokens=NEW).numpy()


class Loaded:
  """The checkpoint through fsdp_jax: the bundle, a state on 3 devices, its
  full parameters."""

  def __init__(self, hub: Hub, family: str):
    self.b = models.from_pretrained(hub.dir, scan=family in SCAN)
    self.mesh = _mesh(3)
    self.state = fsdp_jax.init_train_state(
        init_fn=self.b.init_fn, rng=jax.random.key(0), optimizer=optax.sgd(0.0),
        mesh=self.mesh, config=self.b.fsdp_config(),
        pretrained=pretrained.load(hub.dir, self.b.weight_map))
    self.params = fsdp_jax.summon_full_params(self.state)
    # apply and loss_fn in one program (the logits are compiled once).
    self.forward = jax.jit(lambda p: (self.b.apply(p, IDS), self.b.loss_fn(
        p, {"input_ids": IDS, "labels": IDS})))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  if transformers is None:
    pytest.skip(HF_REASON)
  root = tmp_path_factory.mktemp("families")
  hubs, loaded = {}, {}

  def get(family):
    if family not in hubs:
      hubs[family] = Hub(family, root)
      loaded[family] = Loaded(hubs[family], family)
    return hubs[family], loaded[family]

  return get


@needs_hf
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_loss_and_greedy_generate_match_transformers(checkpoints, family):
  hub, ours = checkpoints(family)
  logits, loss = ours.forward(ours.params)
  np.testing.assert_allclose(np.asarray(logits), hub.logits, rtol=0, atol=1e-4)
  assert np.abs(hub.logits).max() > 1.0  # logits that differ between tokens
  assert abs(float(loss) - hub.loss) < 1e-4
  assert float(loss.weight) == IDS.size - IDS.shape[0]  # shifted: T - 1 per row
  out = np.asarray(models.generate(ours.b, ours.params, IDS[:, :PROMPT], max_new_tokens=NEW))
  np.testing.assert_array_equal(out, hub.generated)
  assert len(set(out[:, PROMPT:].ravel().tolist())) > 1  # not one token repeated


@needs_hf
@pytest.mark.parametrize("family", FAMILIES)
def test_save_reads_back_in_transformers(checkpoints, family, tmp_path):
  hub, ours = checkpoints(family)
  out = tmp_path / "saved"
  pretrained.save(ours.state, out, ours.b.weight_map, max_shard_size="20KB")
  assert (out / "config.json").exists() and (out / "model.safetensors.index.json").exists()
  assert json.loads((out / "generation_config.json").read_text())["max_new_tokens"] == 7
  assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
  with torch.no_grad():
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    logits = back(torch.tensor(IDS, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(logits, hub.logits, rtol=0, atol=1e-5)


# The adapter's names and layout: separate projections unstacked (llama)
# and stacked (qwen3), fused ones stacked (phi3) and in Conv1D's [in, out]
# layout (gpt2); the other families name their projections as Llama does.
@needs_hf
@pytest.mark.parametrize("family", ["llama", "qwen3", "phi3", "gpt2"])
def test_lora_adapter_reads_in_peft(checkpoints, family, tmp_path):
  """LoRA on q_proj and v_proj (for Phi-3 and GPT-2 two parts of the fused
  qkv_proj / c_attn, written as one PEFT module of rank 2r): PEFT over the
  transformers model gives the merged model's logits."""
  hub, ours = checkpoints(family)
  lora = fsdp_jax.LoRA(targets=("q_proj", "v_proj"), rank=2, alpha=4.0)
  config = ours.b.fsdp_config(lora=lora)
  untrained = fsdp_jax.init_train_state(
      init_fn=ours.b.init_fn, rng=jax.random.key(1), optimizer=optax.sgd(0.0), mesh=ours.mesh,
      config=config, pretrained=pretrained.load(hub.dir, ours.b.weight_map))
  bump = lambda w: w.replace(lora_B=w.lora_B + 0.5) if hasattr(w, "lora_B") else w
  state = fsdp_jax.write_full_params(untrained, lambda p: jax.tree.map(  # as if trained
      bump, p, is_leaf=lambda x: hasattr(x, "lora_B")))
  adapter = tmp_path / "adapter"
  pretrained.save_adapter(state, adapter, ours.b.weight_map)
  merged = np.asarray(ours.forward(fsdp_jax.summon_full_params(state))[0])
  assert np.abs(merged - hub.logits).max() > 1e-2  # the adapter changes the model
  with torch.no_grad():
    tuned = peft.PeftModel.from_pretrained(hub.model, str(adapter)).eval()
    peft_logits = tuned(torch.tensor(IDS, dtype=torch.long)).logits.numpy()
    tuned.unload()  # the base model, unwrapped for the other tests
  np.testing.assert_allclose(peft_logits, merged, rtol=0, atol=1e-4)
  # Read back into the untrained state (B = 0): the factors bitwise.
  back = pretrained.load_adapter(untrained, adapter, ours.b.weight_map)
  for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@needs_hf
def test_an_adapter_peft_trained_on_a_fused_module_loads_into_its_parts(checkpoints, tmp_path):
  """PEFT's adapter of Phi-3's fused qkv_proj (one rank-2 factor pair over
  q, k and v) read into LoRA targets q_proj, k_proj, v_proj: the shared
  factor and each part's rows; the merged model gives PEFT's logits."""
  hub, ours = checkpoints("phi3")
  config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["qkv_proj"],
                           init_lora_weights=False)  # B != 0
  torch.manual_seed(1)
  with torch.no_grad():
    tuned = peft.get_peft_model(hub.model, config).eval()
    peft_logits = tuned(torch.tensor(IDS, dtype=torch.long)).logits.numpy()
    tuned.save_pretrained(str(tmp_path / "adapter"))
    tuned.unload()
  lora = fsdp_jax.LoRA(targets=("q_proj", "k_proj", "v_proj"), rank=2, alpha=4.0)
  state = fsdp_jax.init_train_state(
      init_fn=ours.b.init_fn, rng=jax.random.key(1), optimizer=optax.sgd(0.0), mesh=ours.mesh,
      config=ours.b.fsdp_config(lora=lora), pretrained=pretrained.load(hub.dir, ours.b.weight_map))
  state = pretrained.load_adapter(state, tmp_path / "adapter", ours.b.weight_map)
  merged = np.asarray(ours.forward(fsdp_jax.summon_full_params(state))[0])
  np.testing.assert_allclose(merged, peft_logits, rtol=0, atol=1e-4)
  assert np.abs(peft_logits - hub.logits).max() > 1e-2


# --------------------------------------------------------------------------
# Batched generation and packed rows against transformers


def _left_padded(prompts, pad):
  width = max(len(p) for p in prompts)
  ids = np.full((len(prompts), width), pad, np.int64)
  mask = np.zeros((len(prompts), width), np.int64)
  for i, p in enumerate(prompts):
    ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
  return ids, mask


# Plain rotary (llama), soft-capped sliding attention (gemma2), LongRoPE's
# whole-sequence recompute (phi3), learned positions (gpt2).
@needs_hf
@pytest.mark.parametrize("family", ["llama", "gemma2", "phi3", "gpt2"])
def test_generate_serves_a_ragged_batch_stopping_at_eos_as_transformers(checkpoints, family):
  """Prompts of 6, 3 and 5 tokens in one batch, greedy: transformers'
  ``generate(do_sample=False)`` left-padded with the same end-of-sequence
  and pad tokens, token for token (finished rows padded, the loop stopped
  when all have finished); as a list of prompts and as input_ids with an
  attention_mask; one compiled program for all the calls."""
  hub, ours = checkpoints(family)
  prompts = [IDS[0, :PROMPT], IDS[1, :3], IDS[0, 2:7]]
  run = lambda *a, **kw: np.asarray(models.generate(ours.b, ours.params, *a,
                                                    max_new_tokens=NEW, **kw))
  free = run(prompts)  # no end-of-sequence token: every row runs NEW tokens
  assert free.shape == (3, PROMPT + NEW)
  eos = int(free[1, PROMPT + 1])  # the short prompt's second new token
  pad = (eos + 1) % V
  compiled = generate_program._cache_size()

  def theirs(ids, mask, **kw):
    with torch.no_grad():
      return hub.model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask),
                                do_sample=False, max_new_tokens=NEW, **kw).numpy()

  ids, mask = _left_padded(prompts, eos)
  out = run(prompts, eos_token_id=eos)  # pad: the eos
  np.testing.assert_array_equal(out, theirs(ids, mask, eos_token_id=eos, pad_token_id=eos))
  assert (out[1, PROMPT + 1:] == eos).all() and out.shape[1] > PROMPT + 2  # row 1 stopped early
  second = int(free[0, PROMPT + 3])
  ids, mask = _left_padded(prompts, pad)
  out = run(ids, attention_mask=mask, eos_token_id=[eos, second], pad_token_id=pad)
  np.testing.assert_array_equal(out, theirs(ids, mask, eos_token_id=[eos, second],
                                            pad_token_id=pad))
  assert (out[1, PROMPT + 2:] == pad).all()
  assert generate_program._cache_size() == compiled  # the same buckets: no new program


@needs_hf
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_packed_rows_match_each_document_alone_in_transformers(checkpoints, family):
  """Two documents (6 tokens past the sliding window of 4, and 4) packed in
  one row with 2 of padding: each span's logits are transformers' on the
  document alone (gemma2: soft-capped, sliding and full layers; mistral:
  stacked layers)."""
  hub, ours = checkpoints(family)
  docs = [IDS[0, :6], IDS[1, :4]]
  row = np.concatenate(docs + [np.zeros(2, np.int32)])[None]
  seg = np.asarray([[1] * 6 + [2] * 4 + [0] * 2])
  pos = np.asarray([list(range(6)) + list(range(4)) + [0, 0]])
  logits = np.asarray(ours.b.apply(ours.params, row, segment_ids=seg, positions=pos))[0]
  at = 0
  for d in docs:
    with torch.no_grad():
      alone = hub.model(torch.tensor(d[None], dtype=torch.long)).logits.numpy()[0]
    np.testing.assert_allclose(logits[at:at + len(d)], alone, rtol=0, atol=1e-4)
    at += len(d)


# --------------------------------------------------------------------------
# Tensor parallelism (no torch)


# The families whose tensor-parallel programs differ: biases on the split
# q/k/v and a tied, vocabulary-split head with mixed windows in the scan
# (qwen2), norms on split heads and an untied column-split head (qwen3),
# soft-capped grouped-query attention and Gemma's norms (gemma2), partial
# rotary on split heads and a static window (phi3), LayerNorm, a plain MLP
# and position embeddings (gpt2). Llama, Mistral and Gemma 3 combine these
# (their numbers are checked against transformers above).
TP_FAMILIES = ["qwen2", "qwen3", "gemma2", "phi3", "gpt2"]


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tensor_parallel_trains_as_one_device_without_tensor_gathers(family, tmp_path):
  """FSDP 4 x tensor 2 with the family's rules, layers stacked (scanned):
  the losses of three SGD steps on one batch (the second and third after
  updates) are those of one unsharded ``jax.jit``
  (which FSDP 8 reproduces: the engine's own tests), devices holding
  different numbers of tokens; the compiled step all-gathers nothing over
  ``"tensor"`` but the sequence (sequence parallelism: the norms and the
  residual stream split along it) and reduces over it."""
  b = models.from_pretrained(_config_dir(tmp_path, family), scan=True)
  rng = np.random.default_rng(0)  # random values for every leaf (norms off 1), no program
  params = jax.tree.map(lambda x: np.asarray(rng.normal(0.0, 0.2, x.shape), x.dtype),
                        jax.eval_shape(b.init_fn, jax.random.key(0)))
  ids = rng.integers(0, V, (8, T)).astype(np.int32)
  labels = ids.copy()
  labels[::3, 2:5] = -100
  batches = [{"input_ids": ids, "labels": labels}] * 3
  opt = optax.sgd(0.5)
  mean = lambda p, batch: (lambda l: l.total / l.weight)(b.loss_fn(p, batch))
  ref_losses, _ = jit_reference_run(mean, params, opt, batches)
  mesh, config = _mesh(4, tensor=2), b.fsdp_config(tensor_parallel=True)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(b.loss_fn, opt, mesh=mesh, config=config)
  compiled = step.lower(state, batches[0]).compile()
  losses = []
  for batch in batches:  # (full parameters of a tensor-split state take long to compile)
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
  assert ref_losses[2] < ref_losses[0] - 0.05  # the steps moved the parameters
  # Heads, widths and the vocabulary split; nothing gathered over "tensor".
  assert any(l.tensor_dim is not None for l in state.plan.leaves
             if "embed_tokens" in l.name or ".wte." in l.name)
  assert not state.plan.tensor_report.gathered, state.plan.tensor_report.gathered
  tensor_groups = {(0, 1), (2, 3), (4, 5), (6, 7)}
  collectives = hlo.collectives(compiled.as_text())
  over = lambda kind: [c for c in collectives
                       if c.kind == kind and set(c.groups) <= tensor_groups]
  # All-gathers of the sequence alone ([batch, T, width] before each
  # column-parallel matmul; GPT-2's position table's [T, width] gradient);
  # a row-parallel output reduce-scattered along it.
  assert over("all-gather") and all(T in c.shapes[0][:2] for c in over("all-gather"))
  assert over("reduce-scatter") and over("all-reduce")  # Megatron's reductions ran


def test_generate_takes_params_in_any_sharding(tmp_path):
  """The same tokens from the full tree on one device and from a copy split
  by the family's Megatron layout over a 4 x 2 mesh (greedy), and a
  sampled run that depends on its key."""
  b = models.from_pretrained(_config_dir(tmp_path, "qwen2"))
  params = jax.tree.map(lambda x: np.asarray(np.random.default_rng(0).normal(0, 0.3, x.shape),
                                             x.dtype),
                        jax.eval_shape(b.init_fn, jax.random.key(0)))
  mesh = _mesh(4, tensor=2)
  P = jax.sharding.PartitionSpec

  def place(path, x):
    name = jax.tree_util.keystr(path)
    spec = (P(None, "tensor") if any(k in name for k in ("q_proj", "k_proj", "v_proj",
                                                          "gate_proj", "up_proj")) and x.ndim == 2
            else P("tensor", None) if "o_proj" in name or "down_proj" in name
            else P("tensor", "shard") if "embed_tokens" in name else P())
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))

  split = jax.tree_util.tree_map_with_path(place, params)
  prompt = IDS[:, :PROMPT]
  one = models.generate(b, params, prompt, max_new_tokens=NEW)
  np.testing.assert_array_equal(models.generate(b, split, prompt, max_new_tokens=NEW), one)
  sampled = [np.asarray(models.generate(b, params, prompt, max_new_tokens=NEW, temperature=1.0,
                                        top_p=0.9, rng=jax.random.key(k))) for k in (0, 1)]
  assert (sampled[0][:, :PROMPT] == prompt).all() and (sampled[0] != sampled[1]).any()


def test_generate_compiles_once_per_bucket_and_reads_its_stop_tokens(tmp_path):
  """Prompts of 2 to 8 tokens and 3 to 8 new tokens share one program (the
  buckets of 8); the end-of-sequence and pad tokens come from
  generation_config.json, else config.json; the loop stops when every row
  has finished; a ragged row is the same prompt run alone."""
  d = _config_dir(tmp_path, "llama")
  b = models.from_pretrained(d)
  params = jax.tree.map(lambda x: np.asarray(np.random.default_rng(0).normal(0, 0.3, x.shape),
                                             x.dtype),
                        jax.eval_shape(b.init_fn, jax.random.key(0)))
  run = lambda prompts, n, **kw: np.asarray(models.generate(b, params, prompts,
                                                            max_new_tokens=n, **kw))
  before = generate_program._cache_size()
  ragged = run([IDS[0, :3], IDS[1, :5]], 3)
  alone = run([IDS[1, :8], IDS[1, :5]], 8)
  two = run(IDS[:, :2], 5)
  # Each row's first new token ends it: the loop stops after one step.
  assert run(IDS[:, :2], 5, eos_token_id=two[:, 2].tolist()).shape == (2, 3)
  assert generate_program._cache_size() == before + 1  # one program for every call
  np.testing.assert_array_equal(ragged[1], alone[1, 3:11])  # row 1: its prompt + 3 tokens
  assert (ragged[0, :2] == 0).all()  # left-padded with 0 (no pad or eos token known)
  (tmp_path / "llama" / "generation_config.json").write_text(
      json.dumps({"eos_token_id": [5, 7], "pad_token_id": 9}))
  special = lambda d, **kw: special_tokens(models.from_pretrained(d), **kw)
  assert special(d) == ([5, 7], 9)
  assert special(d, eos_token_id=3) == ([3], 9)
  (tmp_path / "llama" / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
  assert special(d) == ([4], 4)  # pad: the first eos
  config = json.loads((tmp_path / "llama" / "config.json").read_text())
  (tmp_path / "llama" / "config.json").write_text(json.dumps(dict(config, pad_token_id=2)))
  assert special(d) == ([4], 2)


def test_generate_errors_name_the_fix(tmp_path):
  b = models.from_pretrained(_config_dir(tmp_path, "llama"))
  params = jax.eval_shape(b.init_fn, jax.random.key(0))  # never reached
  ids = IDS[:, :4]
  cases = [
      (dict(attention_mask=np.ones((2, 3))), r"attention_mask has shape \[2, 3\] where "
                                             r"input_ids has \[2, 4\]"),
      (dict(attention_mask=np.asarray([[1, 1, 1, 1], [0, 0, 0, 0]])),
       r"row 1 of attention_mask is all padding.*drop the empty rows"),
      (dict(attention_mask=np.asarray([[1, 1, 1, 1], [1, 1, 0, 0]])),
       r"row 1 of attention_mask is right-padded.*pads on the left.*padding_side='left'"),
      (dict(attention_mask=np.asarray([[1, 1, 1, 2], [1, 1, 1, 1]])), r"other than 0 and 1"),
      (dict(eos_token_id="</s>"), r"eos_token_id='</s>': pass a token id"),
  ]
  for kw, match in cases:
    with pytest.raises(ValueError, match=match):
      models.generate(b, params, ids, max_new_tokens=2, **kw)
  with pytest.raises(ValueError, match=r"either a list of prompts.*or input_ids.*not both"):
    models.generate(b, params, [[1, 2], [3]], attention_mask=np.ones((2, 2)), max_new_tokens=2)


# --------------------------------------------------------------------------
# Fused tensors in a WeightMap (no torch)


def test_concat_rule_loads_saves_and_adapts_a_fused_kernel(tmp_path):
  """Separate q/k/v tensors joined into one fused kernel (concat, then the
  transpose): each device's rows read from the parts, saved back as the
  three tensors bitwise, and a LoRA adapter on the fused kernel written as
  three PEFT modules that share lora_A (read back bitwise)."""
  rng = np.random.default_rng(0)
  tensors = {f"layers.{i}.{n}_proj.weight": rng.standard_normal((rows, 6)).astype(np.float32)
             for i in range(2) for n, rows in (("q", 8), ("k", 4), ("v", 4))}
  tensors["head.weight"] = rng.standard_normal((5, 6)).astype(np.float32)
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  save_file(tensors, str(ckpt / "model.safetensors"))
  wm = pretrained.WeightMap([
      (tuple(f"layers.{{i}}.{n}_proj.weight" for n in "qkv"), "layers.{i}.qkv.kernel",
       pretrained.concat([8, 4, 4], axis=0), pretrained.transpose()),
      ("head.weight", "head.kernel", pretrained.transpose())])
  init = lambda *_: {"layers": [{"qkv": {"kernel": jnp.zeros((6, 16))}} for _ in range(2)],
                     "head": {"kernel": jnp.zeros((6, 5))}}
  mesh = _mesh(3)
  source = pretrained.load(str(ckpt), wm)
  state = fsdp_jax.init_train_state(init_fn=init, optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig(), pretrained=source)
  assert source.bytes_read == sum(x.nbytes for x in tensors.values())  # each byte once
  full = fsdp_jax.summon_full_params(state)
  for i in range(2):
    want = np.concatenate([tensors[f"layers.{i}.{n}_proj.weight"] for n in "qkv"]).T
    np.testing.assert_array_equal(np.asarray(full["layers"][i]["qkv"]["kernel"]), want)
  pretrained.save(state, tmp_path / "out", wm, config=False)
  from safetensors.numpy import load_file
  back = load_file(str(tmp_path / "out" / "model.safetensors"))
  assert sorted(back) == sorted(tensors)
  for k, v in tensors.items():
    np.testing.assert_array_equal(back[k], v)
  # LoRA on the fused kernel: three PEFT modules, lora_A shared, rank 2 each.
  config = fsdp_jax.FSDPConfig(lora=fsdp_jax.LoRA(targets=("qkv",), rank=2, alpha=4.0))
  lora_state = fsdp_jax.init_train_state(init_fn=init, optimizer=optax.sgd(0.1), mesh=mesh,
                                         config=config, rng=jax.random.key(0),
                                         pretrained=pretrained.load(str(ckpt), wm))
  bump = lambda w: w.replace(lora_B=w.lora_B + 1.0) if hasattr(w, "lora_B") else w
  lora_state = fsdp_jax.write_full_params(lora_state, lambda p: jax.tree.map(
      bump, p, is_leaf=lambda x: hasattr(x, "lora_B")))
  pretrained.save_adapter(lora_state, tmp_path / "adapter", wm)
  adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
  a = {n: adapter[f"base_model.model.layers.0.{n}_proj.lora_A.weight"] for n in "qkv"}
  assert all(x.shape == (2, 6) for x in a.values()) and (a["q"] == a["v"]).all()
  assert adapter["base_model.model.layers.0.k_proj.lora_B.weight"].shape == (4, 2)
  fused = fsdp_jax.summon_full_params(lora_state)["layers"][0]["qkv"]["kernel"]
  base = np.concatenate([tensors[f"layers.0.{n}_proj.weight"] for n in "qkv"])
  delta = np.concatenate([adapter[f"base_model.model.layers.0.{n}_proj.lora_B.weight"]
                          @ a[n] for n in "qkv"])
  np.testing.assert_allclose(np.asarray(fused).T, base + 2.0 * delta, rtol=0, atol=1e-5)
  fresh = fsdp_jax.init_train_state(init_fn=init, optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=config, rng=jax.random.key(1),
                                    pretrained=pretrained.load(str(ckpt), wm))
  fresh = pretrained.load_adapter(fresh, tmp_path / "adapter", wm)
  for x, y in zip(jax.tree.leaves(fresh.params), jax.tree.leaves(lora_state.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_fused_rules_are_checked():
  with pytest.raises(ValueError, match=r"a tuple of parameter patterns needs split"):
    pretrained.WeightMap([("a.weight", ("q.kernel", "k.kernel"), pretrained.transpose())])
  with pytest.raises(ValueError, match=r"split\(\) / concat\(\) must be the first transform"):
    pretrained.WeightMap([("a.weight", ("q", "k"), pretrained.transpose(), pretrained.split())])
  with pytest.raises(ValueError, match=r"gives 3 sizes for 2 tensors"):
    pretrained.WeightMap([("a.weight", ("q", "k"), pretrained.split([1, 2, 3]))])


# --------------------------------------------------------------------------
# Errors that point the right way (no torch)


def test_errors_name_the_fix(tmp_path):
  (tmp_path / "bert").mkdir()
  (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
  with pytest.raises(ValueError, match=r"model_type 'bert'.*Supported: llama, mistral, qwen2, "
                                       r"qwen3, gemma2, gemma3_text, phi3, gpt2"):
    models.from_pretrained(tmp_path / "bert")
  with pytest.raises(ValueError, match=r"reads as a Hugging Face Hub id.*local.*download it"):
    models.from_pretrained("meta-llama/Llama-3.2-1B")
  with pytest.raises(ValueError, match=r"reads as a Hugging Face Hub id"):
    pretrained.load("Qwen/Qwen3-0.6B", pretrained.WeightMap([]))
  adapter = tmp_path / "adapter"
  adapter.mkdir()
  (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
  save_file({"x": np.zeros(1, np.float32)}, str(adapter / "adapter_model.safetensors"))
  for call in (lambda: models.from_pretrained(adapter),
               lambda: pretrained.load(str(adapter), pretrained.WeightMap([]))):
    with pytest.raises(ValueError, match=r"this is an adapter: load the base, then "
                                         r"load_adapter"):
      call()
  rope = dict(CONFIGS["llama"], rope_parameters={"rope_type": "yarn", "factor": 2.0})
  (tmp_path / "yarn").mkdir()
  (tmp_path / "yarn" / "config.json").write_text(json.dumps({"model_type": "llama", **rope}))
  with pytest.raises(ValueError, match=r"rope type 'yarn' is not supported.*default, linear, "
                                       r"llama3, longrope"):
    models.from_pretrained(tmp_path / "yarn")


def test_a_checkpoint_of_another_size_names_the_config_field(tmp_path):
  """Every shape disagrees: the error says which config.json field, not
  "fix the WeightMap rules"."""
  small = models.from_pretrained(_config_dir(tmp_path, "qwen3"))
  big = dict(CONFIGS["qwen3"], hidden_size=48)
  (tmp_path / "big").mkdir()
  (tmp_path / "big" / "config.json").write_text(json.dumps({"model_type": "qwen3", **big}))
  b = models.from_pretrained(tmp_path / "big")
  state = fsdp_jax.init_train_state(init_fn=b.init_fn, rng=jax.random.key(0),
                                    optimizer=optax.sgd(0.1), mesh=_mesh(1),
                                    config=b.fsdp_config())
  pretrained.save(state, tmp_path / "big", b.weight_map, overwrite=True)
  with pytest.raises(ValueError, match=r"hidden_size 48 in config.json, model built for 32"):
    fsdp_jax.init_train_state(init_fn=small.init_fn, rng=jax.random.key(0),
                              optimizer=optax.sgd(0.1), mesh=_mesh(1),
                              config=small.fsdp_config(),
                              pretrained=pretrained.load(str(tmp_path / "big"), small.weight_map))
