#!/usr/bin/env python
"""Fine-tune a Hugging Face checkpoint of any fsdp_jax.models family with
fsdp_jax and save it back.

    python examples/finetune.py --checkpoint path/to/model --text data.txt --out tuned
    python examples/finetune.py            # a small random Llama, made here
    python examples/finetune.py --family qwen3   # a small random Qwen3 instead
    python examples/finetune.py --lora     # LoRA adapters, the base frozen
    python examples/finetune.py --qlora    # QLoRA: the frozen base stored in NF4
    python examples/finetune.py --context 2 --seq-len 4096   # each sequence over 2 devices
    python examples/finetune.py --checkpoint path/to/instruct --data chat.jsonl
                                           # TRL's JSONL rows, packed (fsdp_jax[data])

The checkpoint directory is what ``save_pretrained`` writes (``config.json``
and safetensors files, sharded with an index or not) for a Llama, Mistral,
Qwen2, Qwen3, Gemma 2, Gemma 3 (text), Phi-3 or GPT-2 model:
``fsdp_jax.models.from_pretrained`` reads its ``config.json`` into the
model's functions, WeightMap and wrap policy. Each device's shard of every
parameter is read straight from the files (``fsdp_jax.pretrained.load`` +
``init_train_state(pretrained=...)``): the whole model is never on one
host. The text is tokenized with the checkpoint's tokenizer when
transformers is installed and the directory has one, else byte by byte
(modulo the vocabulary). The tuned model is written to ``--out`` in Hugging
Face's layout with its ``config.json``, so
``transformers.AutoModelForCausalLM.from_pretrained(out)`` and vLLM read it.

With ``--lora`` only low-rank adapters train: each target kernel ``W``
(by default every attention and MLP projection, under PEFT's module names:
``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``,
``down_proj`` for Llama-like families) is seen as ``W + (alpha / rank) * A @ B``, with ``A`` and
``B`` trained and everything else frozen (no gradient, no optimizer state).
``--qlora`` also stores the frozen base kernels in QLoRA's 4-bit
NormalFloat (blocks of 64, one float32 scale each) and gathers them in it.
Either way the script prints what the plan says about the adapters, the
memory each device holds, and writes the adapters in PEFT's format to
``--out/adapter`` (``peft.PeftModel.from_pretrained(base_model,
out/adapter)`` loads them) besides the merged model in ``--out``.

With ``--data`` the training data is a JSONL file in TRL's forms
(``messages``, ``prompt``/``completion``, ``text``) read by
``fsdp_jax.data`` (``pip install fsdp_jax[data]``) with the checkpoint's
tokenizer (or ``--tokenizer``): packed first-fit into ``--seq-len`` rows, the
loss on the assistant turns, the last tenth of the rows held out; the
script prints the padding fraction and the tokens per second.

Every ``--eval-every`` steps the held-out tenth of the text is evaluated
with ``fsdp_jax.shard_eval_step`` (the train step's forward without the
backward, sharded the same way: PyTorch's ``model.eval()`` and
``torch.no_grad()``): its loss and perplexity are printed. At the end the
tuned weights are handed to inference code: ``fsdp_jax.reshard_params``
gives the model's own tree (LoRA merged, QLoRA decoded) split over a
``"tensor"`` axis by the family's rules, and ``fsdp_jax.models.generate``
continues a few held-out prompts with a KV cache, greedily and with
temperature / top-p sampling (``examples/llama_decode.py`` writes such a
decode loop out in plain JAX for ``examples/llama.py``).

With ``--context N`` each sequence is split into ``N`` chunks over a
``"context"`` mesh axis (``make_mesh(shard=..., context=N)``: context
parallelism, PyTorch's ``context_parallel()`` and torchtitan's
``--parallelism.context_parallel_degree N``): a sequence longer than one
device holds trains, the model code unchanged, the weights sharded over
shard x context (docs/context_parallel.md). The rows are then ``--seq-len``
tokens (a multiple of ``N``) instead of ``--seq-len + 1``, and the batch a
multiple of the data-parallel size ``devices / N``.

Without ``--checkpoint`` the script writes a small random model of
``--family`` (2 layers, grouped-query attention) with fsdp_jax itself first,
so it runs anywhere, torch or not. Without a GPU it simulates 8 CPU devices.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fsdp_jax
from fsdp_jax import models, pretrained

try:
  from tqdm.auto import tqdm
except ImportError:  # pragma: no cover
  tqdm = None

# The small random checkpoints made without --checkpoint (config.json's fields).
SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
             tie_word_embeddings=False, max_position_embeddings=2048)
RANDOM = {
    "llama": dict(SMALL, architectures=["LlamaForCausalLM"], rope_theta=10000.0,
                  hidden_act="silu", attention_bias=False, mlp_bias=False),
    "mistral": dict(SMALL, architectures=["MistralForCausalLM"], sliding_window=32),
    "qwen2": dict(SMALL, architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(SMALL, architectures=["Qwen3ForCausalLM"], head_dim=32),
    "gemma2": dict(SMALL, architectures=["Gemma2ForCausalLM"], head_dim=32,
                   query_pre_attn_scalar=32, sliding_window=32, tie_word_embeddings=True),
    "gemma3_text": dict(SMALL, architectures=["Gemma3ForCausalLM"], head_dim=32,
                        query_pre_attn_scalar=32, sliding_window=32, tie_word_embeddings=True),
    "phi3": dict(SMALL, architectures=["Phi3ForCausalLM"]),
    "gpt2": dict(architectures=["GPT2LMHeadModel"], vocab_size=256, n_embd=128, n_layer=2,
                 n_head=4, n_positions=1024),
}

# LoRA targets: PEFT's module names (the parameters are named as the
# checkpoint's modules); the short names of examples/llama.py are accepted
# too.
SHORT_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
               "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
QLORA = dict(dtype="nf4", block_size=64)  # QLoRA's NormalFloat4


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows defaults, except where the help already says what one is."""

  def _get_help_string(self, action):
    if action.default is None or "(default:" in (action.help or ""):
      return action.help
    return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=_HelpFormatter)
  p.add_argument("--checkpoint", default=None,
                 help="Hugging Face model directory of a supported family (default: a small "
                 "random one of --family, made here)")
  p.add_argument("--family", choices=models.FAMILIES, default="llama",
                 help="the family of the random checkpoint made without --checkpoint")
  p.add_argument("--data", default=None,
                 help="fine-tuning JSONL in TRL's forms ('messages', 'prompt'/'completion' or "
                 "'text' rows) through fsdp_jax.data (pip install fsdp_jax[data]): packed, the "
                 "loss on the assistant turns, the last tenth held out")
  p.add_argument("--tokenizer", default=None,
                 help="the tokenizer's directory for --data (default: the checkpoint's)")
  p.add_argument("--text", default=None, help="training text file (default: Python's "
                 "textwrap module source)")
  p.add_argument("--out", default=None, help="where to save the tuned model (default: a "
                 "temporary directory)")
  p.add_argument("--strategy", choices=[s.name for s in fsdp_jax.ShardingStrategy
                                        if s.name != "_HYBRID_SHARD_ZERO2"],
                 default="FULL_SHARD")
  p.add_argument("--replicate", type=int, default=None, help="replicate groups (HYBRID_SHARD)")
  p.add_argument("--context", type=int, default=None,
                 help="context parallelism: split each sequence into N chunks over a "
                 "'context' mesh axis of N devices (rows of --seq-len tokens, a multiple of N)")
  p.add_argument("--scan", action="store_true",
                 help="stack the layers and run them with lax.scan")
  p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
  p.add_argument("--remat", choices=("full", "dots", "offload"), default=None,
                 help="activation checkpointing of each layer: FSDPConfig("
                 "activation_checkpointing=ActivationCheckpointing(policy))")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--batch-size", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--lr", type=float, default=None,
                 help="learning rate (default: 1e-4; 1e-3 with --lora or --qlora)")
  p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto")
  p.add_argument("--cpu-devices", type=int, default=8)
  p.add_argument("--seed", type=int, default=0)
  lora = p.add_argument_group("LoRA and QLoRA")
  mode = lora.add_mutually_exclusive_group()
  mode.add_argument("--lora", action="store_true",
                    help="train LoRA adapters only; the base model is frozen")
  mode.add_argument("--qlora", action="store_true",
                    help="LoRA over a frozen base stored in NF4 (4-bit NormalFloat, blocks "
                    "of 64)")
  lora.add_argument("--rank", type=int, default=None, help="LoRA rank r (default: 8)")
  lora.add_argument("--alpha", type=float, default=None,
                    help="lora_alpha; the adapters are scaled by alpha / rank (default: 16)")
  lora.add_argument("--targets", default=None,
                    help="comma-separated patterns naming the kernels to adapt, PEFT's "
                    "module names (default: every attention and MLP projection of the "
                    "family, e.g. q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj; "
                    "the short names q, ..., down are accepted)")
  lora.add_argument("--lora-dropout", type=float, default=None,
                    help="dropout on the adapters' input (default: 0.0)")
  ev = p.add_argument_group("evaluation and sampling")
  ev.add_argument("--eval-every", type=int, default=10,
                  help="evaluate the held-out split every N steps, before the first and "
                  "after the last (0: never)")
  ev.add_argument("--eval-batches", type=int, default=2,
                  help="held-out batches (of --batch-size windows) per evaluation")
  ev.add_argument("--sample-tokens", type=int, default=24,
                  help="tokens to generate from each held-out prompt at the end (0: none)")
  ev.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
  ev.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling's p")
  args = p.parse_args(argv)
  if args.steps < 1 or args.batch_size < 1 or args.seq_len < 2:
    p.error("--steps, --batch-size and --seq-len must be positive (seq-len at least 2)")
  if args.context is not None and (args.context < 1 or args.seq_len % args.context):
    p.error(f"--context {args.context} needs --seq-len to be a multiple of it (each device "
            f"holds seq_len / N tokens of every row); got --seq-len {args.seq_len}, e.g. "
            f"--seq-len {-(-args.seq_len // max(args.context, 1)) * max(args.context, 1)}")
  if args.eval_every < 0 or args.eval_batches < 1 or args.sample_tokens < 0:
    p.error("--eval-every and --sample-tokens must be >= 0, --eval-batches >= 1")
  if args.temperature <= 0 or not 0 < args.top_p <= 1:
    p.error("--temperature must be positive and --top-p in (0, 1]")
  args.lora_mode = "qlora" if args.qlora else "lora" if args.lora else None
  given = [f for f, v in (("--rank", args.rank), ("--alpha", args.alpha),
                          ("--targets", args.targets), ("--lora-dropout", args.lora_dropout))
           if v is not None]
  if given and args.lora_mode is None:
    p.error(f"{', '.join(given)} need(s) --lora or --qlora")
  args.rank = 8 if args.rank is None else args.rank
  args.alpha = 16.0 if args.alpha is None else args.alpha
  args.lora_dropout = 0.0 if args.lora_dropout is None else args.lora_dropout
  targets = None if args.targets is None else tuple(
      t.strip() for t in args.targets.split(",") if t.strip())
  if targets is not None and not targets:
    p.error("--targets needs at least one pattern, e.g. --targets q_proj,v_proj")
  args.targets = None if targets is None else tuple(SHORT_NAMES.get(t, t) for t in targets)
  if args.rank < 1:
    p.error("--rank must be at least 1")
  if not 0 <= args.lora_dropout < 1:
    p.error("--lora-dropout must be in [0, 1)")
  if args.lr is None:
    args.lr = 1e-3 if args.lora_mode else 1e-4
  return args


def lora_config(args, model: models.CausalLM) -> "fsdp_jax.LoRA | None":
  """``FSDPConfig(lora=...)``: the adapters of ``--lora`` / ``--qlora``
  (by default on every projection of the family: ``model.lora_targets``)."""
  if args.lora_mode is None:
    return None
  return fsdp_jax.LoRA(
      targets=args.targets or model.lora_targets, rank=args.rank, alpha=args.alpha,
      dropout=args.lora_dropout,
      base_quantization=fsdp_jax.Quantization(**QLORA) if args.lora_mode == "qlora" else None)


def bytes_per_device(tree) -> int:
  """Bytes of the arrays of ``tree`` held by the fullest device."""
  per_device: dict = {}
  for x in jax.tree.leaves(tree):
    for shard in x.addressable_shards:
      per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
  return max(per_device.values(), default=0)


def memory_per_device(state, compiled) -> dict:
  """What one device holds: the stored parameters (frozen ones included),
  the gradient shards (one per trainable parameter shard: frozen
  parameters get none), the optimizer state, and the compiled step's peak
  from ``memory_analysis()`` (arguments + outputs - donated + temporaries)."""
  trainable, _ = fsdp_jax.custom.split_trainable(state.plan, state.params)
  ma = compiled.memory_analysis()
  out = {"params": bytes_per_device(state.params), "grads": bytes_per_device(trainable),
         "optimizer": bytes_per_device(state.opt_state)}
  if ma is not None:
    out["temp"] = int(ma.temp_size_in_bytes)
    out["peak"] = int(ma.argument_size_in_bytes + ma.output_size_in_bytes
                      - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
  return out


def configure_devices(platform: str, cpu_devices: int) -> None:
  """Simulated CPU devices unless a GPU is asked for or found; before JAX
  starts its backends."""
  if platform == "auto":
    platform = fsdp_jax.distributed.detect_platform()
  if platform == "cpu":
    fsdp_jax.simulate_cpu_devices(cpu_devices)


def make_random_checkpoint(directory: str, seed: int, family: str = "llama") -> None:
  """A small random model of ``family`` in Hugging Face's layout (weights and
  config.json), written by fsdp_jax."""
  os.makedirs(directory, exist_ok=True)
  config = {"model_type": family, **RANDOM[family], "torch_dtype": "float32"}
  with open(os.path.join(directory, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
  model = models.from_pretrained(directory)
  mesh = fsdp_jax.make_mesh(shard=1, devices=jax.devices()[:1])
  state = fsdp_jax.init_train_state(
      init_fn=model.init_fn, rng=jax.random.key(seed), optimizer=optax.sgd(0.0), mesh=mesh,
      config=model.fsdp_config())
  pretrained.save(state, directory, model.weight_map, overwrite=True)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(checkpoint: str):
  """The checkpoint's tokenizer if transformers and its files are there,
  else None (transformers may build an empty one from config.json alone)."""
  if not any(os.path.exists(os.path.join(checkpoint, f)) for f in TOKENIZER_FILES):
    return None
  try:
    import transformers  # pylint: disable=import-outside-toplevel  (optional)
    return transformers.AutoTokenizer.from_pretrained(checkpoint)
  except Exception:  # pylint: disable=broad-except  (no transformers, or unreadable files)
    return None


def tokenize(text: str, checkpoint: str, vocab_size: int) -> np.ndarray:
  """The checkpoint's tokenizer if transformers and its files are there,
  else bytes modulo the vocabulary."""
  tok = load_tokenizer(checkpoint)
  if tok is not None:
    ids = np.asarray(tok(text)["input_ids"], np.int32)
    print(f"tokenizer: {type(tok).__name__}, {len(ids):,} tokens")
    return ids
  ids = np.frombuffer(text.encode(), np.uint8).astype(np.int32) % vocab_size
  print(f"tokenizer: bytes modulo {vocab_size}, {len(ids):,} tokens")
  return ids


def sft_data(args, checkpoint: str, vocab_size: int, mesh, batch_size: int):
  """``--data``: JSONL rows in TRL's forms through ``fsdp_jax.data`` (the
  optional extra ``fsdp_jax[data]``): the last tenth of the rows held out;
  the rest packed first-fit into ``--seq-len`` rows (segment ids and
  positions per document), the loss on the assistant turns (completions,
  text), repeated as long as the steps ask. Returns the training batches
  (an iterator of global arrays), the held-out batches and the held-out
  token ids (the sampling prompts)."""
  try:
    from fsdp_jax import data  # pylint: disable=import-outside-toplevel  (optional extra)
  except ImportError as e:
    raise SystemExit(f"--data: {e}") from None
  tok = load_tokenizer(args.tokenizer or checkpoint)
  if tok is None:
    raise SystemExit(f"--data needs a tokenizer and {args.tokenizer or checkpoint} has none (or "
                     "transformers is missing): pass --tokenizer DIR (what save_pretrained "
                     "wrote; with a chat template for 'messages' rows)")
  if len(tok) > vocab_size:
    raise SystemExit(f"--data: the tokenizer has {len(tok):,} tokens, more than the model's "
                     f"vocabulary of {vocab_size:,}: pass the model's own tokenizer")
  with open(args.data, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  cut = len(rows) * 9 // 10
  common = dict(seq_len=args.seq_len, packing="first_fit", loss_on="assistant",
                truncation="truncate")
  train = data.sft_dataset(rows[:cut], tok, num_epochs=None, shuffle_seed=args.seed, **common)
  held = data.sft_dataset(rows[cut:], tok, shuffle_seed=None, **common)
  eval_batches = list(itertools.islice(data.batches(held, global_batch=batch_size, mesh=mesh),
                                       args.eval_batches))
  if not eval_batches:
    raise SystemExit(f"--data: the held-out tenth ({len(rows) - cut} rows) fills no batch of "
                     f"{batch_size} rows: use more rows or a smaller --batch-size")
  seg = np.asarray(eval_batches[0]["segment_ids"])
  held_ids = np.asarray(eval_batches[0]["input_ids"])[seg > 0]
  print(f"data: {cut:,} training and {len(rows) - cut:,} held-out rows of {args.data}, "
        f"tokenizer {type(tok).__name__} ({len(tok):,} tokens), packed first-fit into "
        f"{args.seq_len}-token rows, loss on the assistant turns")
  return data.batches(train, global_batch=batch_size, mesh=mesh), eval_batches, held_ids


# ---------------------------------------------------------------------------
# Evaluation: the held-out split, sharded as in training


def make_eval_step(model: models.CausalLM):
  """The train step's forward without the backward (PyTorch's ``model.eval()``
  and ``torch.no_grad()``): each unit gathered before its first use and
  freed after, no optimizer state read. The loss is the mean over every
  predicted token of the global batch (a ``WeightedLoss``: the sum and the
  count)."""

  def eval_loss(params, batch):
    logits = model.apply(params, batch["input_ids"])[:, :-1].astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"][:, 1:])
    return fsdp_jax.WeightedLoss(total=jnp.sum(nll), weight=jnp.float32(nll.size))

  return fsdp_jax.shard_eval_step(eval_loss, forward_inputs=("input_ids",))


def held_out_batches(ids: np.ndarray, batch_size: int, seq_len: int, count: int) -> list:
  """``count`` batches of evenly spaced windows of the held-out tokens."""
  starts = np.linspace(0, len(ids) - seq_len - 1, batch_size * count).astype(np.int64)
  windows = np.stack([ids[s:s + seq_len + 1] for s in starts])
  return [{"input_ids": w, "labels": w} for w in np.split(windows, count)]


def evaluate(eval_step, state, batches) -> dict:
  """Mean next-token loss over the held-out batches (equal sizes) and its
  perplexity."""
  loss = float(np.mean([float(eval_step(state, b)) for b in batches]))
  return {"loss": loss, "perplexity": math.exp(loss)}


# ---------------------------------------------------------------------------
# Sampling: the tuned weights resharded for inference, a KV-cache decode


def tensor_size(config: models.ModelConfig, devices: int) -> int:
  """The largest number of devices (at most 8) that splits every head, MLP
  column and vocabulary entry of ``config`` evenly."""
  sizes = (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size,
           config.vocab_size)
  return max(t for t in range(1, min(devices, 8) + 1)
             if devices % t == 0 and all(n % t == 0 for n in sizes))


def detokenizer(checkpoint: str):
  """Token ids -> text, the inverse of :func:`tokenize`."""
  tok = load_tokenizer(checkpoint)
  if tok is not None:
    return lambda ids: tok.decode([int(i) for i in ids])
  return lambda ids: bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def sample(state, model: models.CausalLM, prompts: np.ndarray, args, decode_text) -> dict:
  """Continues ``prompts`` from the tuned weights: ``reshard_params`` puts
  the model's own tree (LoRA merged) on a ``"tensor"`` mesh of the state's
  devices, each device holding its slice of every kernel the family's
  rules split, and ``models.generate`` decodes with a KV cache (one
  compiled program), greedily and with temperature / top-p sampling."""
  devices = list(state.plan.mesh.devices.flat)
  t = tensor_size(model.config, len(devices))
  mesh = fsdp_jax.make_mesh(shard=len(devices) // t, tensor=t, devices=devices)
  params = fsdp_jax.reshard_params(
      state, mesh=mesh, tensor_parallel=model.tensor_parallel,
      dtype=jnp.bfloat16 if args.precision == "bf16" else None)
  out = {}
  for mode, kw in (("greedy", {}), (f"temperature {args.temperature}, top-p {args.top_p}",
                                    dict(temperature=args.temperature, top_p=args.top_p,
                                         rng=jax.random.key(args.seed)))):
    tokens = np.asarray(models.generate(model, params, prompts,
                                        max_new_tokens=args.sample_tokens, **kw))
    out[mode] = tokens
    for row in tokens:
      print(f"sample ({mode}): {decode_text(row[:prompts.shape[1]])!r} -> "
            f"{decode_text(row[prompts.shape[1]:])!r}")
  print(f"sampled from reshard_params weights on mesh {dict(mesh.shape)} (kernels split over "
        "'tensor' by the family's tensor-parallel rules)")
  return out


def main(argv=None) -> dict:
  args = parse_args(argv)
  configure_devices(args.platform, args.cpu_devices)
  checkpoint = args.checkpoint
  if checkpoint is None:
    checkpoint = os.path.join(tempfile.mkdtemp(prefix=f"{args.family}_random_"), "checkpoint")
    make_random_checkpoint(checkpoint, args.seed, args.family)
    name = {"llama": "Llama", "gpt2": "GPT-2"}.get(args.family, args.family)
    print(f"no --checkpoint: wrote a small random {name} to {checkpoint}")
  if args.out and os.path.realpath(args.out) == os.path.realpath(checkpoint):
    raise SystemExit(f"--out {args.out} is the checkpoint being read; pick another directory")
  model = models.from_pretrained(checkpoint, scan=args.scan)
  print(f"model: {model}")

  n = jax.device_count()
  rep = args.replicate if args.strategy == "HYBRID_SHARD" else None
  ctx = args.context or 1
  if n % ((rep or 1) * ctx):
    raise SystemExit(f"{n} devices do not split into --replicate {rep or 1} x --context {ctx}")
  mesh = fsdp_jax.make_mesh(shard=n // ((rep or 1) * ctx), replicate=rep, context=args.context)
  fsdp_config = model.fsdp_config(
      sharding_strategy=fsdp_jax.ShardingStrategy[args.strategy],
      mixed_precision=(fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16)
                       if args.precision == "bf16" else None),
      lora=lora_config(args, model),
      activation_checkpointing=(fsdp_jax.ActivationCheckpointing(args.remat)
                                if args.remat else None))
  optimizer = optax.adamw(args.lr, weight_decay=0.0)
  t0 = time.perf_counter()
  source = pretrained.load(checkpoint, model.weight_map)
  state = fsdp_jax.init_train_state(
      init_fn=model.init_fn, rng=jax.random.key(args.seed), optimizer=optimizer, mesh=mesh,
      config=fsdp_config, pretrained=source)
  print(f"loaded {checkpoint} in {time.perf_counter() - t0:.1f} s onto {n} device(s), "
        f"{args.strategy}; this process read {source.bytes_read / 2**20:.1f} MiB")
  if args.context:
    print(f"context parallelism: each {args.seq_len}-token row split into {ctx} chunks of "
          f"{args.seq_len // ctx} over 'context' (mesh {dict(mesh.shape)}); the weights "
          f"sharded over {' x '.join(state.plan.axes.shard_axes)}")
  if args.lora_mode:
    print(f"{args.lora_mode.upper()}: targets {','.join(fsdp_config.lora.targets)}; "
          f"{len(state.plan.lora_targets)} kernels adapted")

  # The model's causal-LM loss: labels shifted inside, the mean over every
  # device's tokens (packed rows: within each document, -100 labels skipped).
  step = fsdp_jax.shard_train_step(model.loss_fn, optimizer)
  dp = n // ctx  # a multiple of the data-parallel size: the devices / the context size
  batch_size = -(-args.batch_size // dp) * dp
  # Rows of seq_len + 1 tokens (seq_len predicted); under context parallelism
  # seq_len tokens, which the context axis divides.
  window = args.seq_len if args.context else args.seq_len + 1
  if args.data:
    batches, eval_batches, held_out = sft_data(args, checkpoint, model.config.vocab_size,
                                               mesh, batch_size)
  else:
    if args.text:
      with open(args.text, encoding="utf-8", errors="replace") as f:
        text = f.read()
    else:
      import textwrap  # pylint: disable=import-outside-toplevel
      with open(textwrap.__file__, encoding="utf-8") as f:
        text = f.read()
    ids = tokenize(text, checkpoint, model.config.vocab_size)
    # The last tenth is held out for evaluation and prompts.
    ids, held_out = ids[:len(ids) * 9 // 10], ids[len(ids) * 9 // 10:]
    if min(len(ids), len(held_out)) < window + 1:
      raise SystemExit(f"the text has {len(ids) + len(held_out)} tokens: too few for "
                       f"--seq-len {args.seq_len} in the training split and the held-out tenth")
    rng = np.random.default_rng(args.seed)

    def next_batch():
      starts = rng.integers(0, len(ids) - args.seq_len - 1, batch_size)
      rows = np.stack([ids[s:s + window] for s in starts])
      return {"input_ids": rows, "labels": rows}  # window - 1 predicted tokens per row

    batches = iter([next_batch() for _ in range(args.steps)])
    eval_batches = held_out_batches(held_out, batch_size, window - 1, args.eval_batches)
  first = next(batches)
  batches = itertools.chain([first], batches)
  # Compiled once here (the steps below reuse it): tracing the step is also
  # what tells the plan how the loss uses each LoRA target.
  compiled = step.lower(state, first).compile()
  if args.lora_mode:
    for line in str(state.plan).splitlines():
      if line.startswith("  LoRA") or line.startswith("    adapter path") or (
          line.startswith("    merged weight")):
        print("plan: " + line.strip())
  memory = memory_per_device(state, compiled)
  peak = (f"; compiled step peak {memory['peak']:,} (temporaries {memory['temp']:,})"
          if "peak" in memory else "")
  print(f"memory per device (bytes): params {memory['params']:,}, grads {memory['grads']:,}, "
        f"optimizer state {memory['optimizer']:,}{peak}")
  eval_step = None
  if args.eval_every:  # packed rows: the model's own loss (segments, -100 labels)
    eval_step = (fsdp_jax.shard_eval_step(model.loss_fn) if args.data
                 else make_eval_step(model))
  evals = []

  def run_eval(at_step: int) -> None:
    result = evaluate(eval_step, state, eval_batches)
    evals.append({"step": at_step, **result})
    print(f"eval at step {at_step}: held-out loss {result['loss']:.4f}, perplexity "
          f"{result['perplexity']:.2f}")

  if eval_step is not None:
    run_eval(0)
  bar = tqdm(range(args.steps), desc="fine-tune") if tqdm is not None else range(args.steps)
  losses, tokens, slots, t_train = [], 0, 0, time.perf_counter()
  for _ in bar:
    batch = next(batches)
    if args.data:
      tokens += int(jnp.sum(batch["segment_ids"] > 0))
      slots += int(np.prod(batch["segment_ids"].shape))
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
    if tqdm is not None:
      bar.set_postfix(loss=f"{losses[-1]:.4f}")
    else:
      print(f"step {len(losses)}: loss {losses[-1]:.4f}")
    if eval_step is not None and (len(losses) % args.eval_every == 0 or len(losses) == args.steps):
      run_eval(len(losses))
  print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {args.steps} steps")
  if args.data:
    print(f"data: padding {1 - tokens / slots:.1%} of the rows' slots; {tokens:,} tokens in "
          f"{time.perf_counter() - t_train:.1f} s of training (evaluations included): "
          f"{tokens / (time.perf_counter() - t_train):,.0f} tokens/s")
  print("loss curve: " + " ".join(f"{x:.4f}" for x in losses))

  out = args.out or os.path.join(tempfile.mkdtemp(prefix="tuned_"), "tuned")
  # The weights, config.json and generation_config.json (the checkpoint's),
  # and the checkpoint's tokenizer with its chat template where it has one.
  has_tokenizer = any(os.path.exists(os.path.join(checkpoint, f)) for f in TOKENIZER_FILES)
  files = pretrained.save(state, out, model.weight_map, overwrite=args.out is not None,
                          tokenizer=checkpoint if has_tokenizer else None)
  merged = " (the adapters merged into the base)" if args.lora_mode else ""
  print(f"saved {len(files)} file(s) to {out} (Hugging Face's layout, with config.json)"
        f"{merged}")
  adapter = None
  if args.lora_mode:
    adapter = os.path.join(out, "adapter")
    pretrained.save_adapter(state, adapter, model.weight_map,
                            base_model_name_or_path=checkpoint, overwrite=True)
    print(f"saved the PEFT adapter to {adapter} (adapter_model.safetensors, "
          "adapter_config.json): peft.PeftModel.from_pretrained("
          f"AutoModelForCausalLM.from_pretrained({checkpoint!r}), {adapter!r})")
  samples = {}
  if args.sample_tokens:
    prompt_len = min(16, len(held_out) // 4)
    prompts = np.stack([held_out[:prompt_len], held_out[len(held_out) // 2:][:prompt_len]])
    samples = sample(state, model, prompts, args,
                     detokenizer((args.data and args.tokenizer) or checkpoint))
  return {"losses": losses, "out": out, "checkpoint": checkpoint, "adapter": adapter,
          "memory": memory, "evals": evals, "samples": samples}


if __name__ == "__main__":
  main()
