"""``python -m benchmarks data``: fsdp_jax.data's padding and throughput
(writes benchmarks/DATA.md).

A byte-level BPE of 8,192 tokens is trained here on Python's standard
library (tokenizers), with a chat template whose assistant turns sit in
``{% generation %}`` blocks; conversations of a user turn and an assistant
reply of log-normal length (median 120 words, sigma 0.9, at most 900
words: a long tail, as chat data has) are written to a JSONL file.
``sft_dataset`` reads it at ``--seq-len`` with each packing, one
tokenizing thread (then grain's threads for first fit): rows, padding,
tokens in the loss, and tokens per second for the whole pipeline (read,
template, tokenize, assistant mask, pack).

Then the train step (``--part train`` runs this part alone and keeps the
table above): a ``fsdp_jax.models`` Llama from a ``config.json`` on 8
simulated CPU devices (``simulate_cpu_devices(8)``, FSDP 8, AdamW,
``b.fsdp_config()``, ``shard_train_step``), fed by
``batches(sft_dataset(...), global_batch=8, mesh=mesh)``:

* packing: a small Llama's step on first-fit packed rows against padded rows
  (``packing=None``), alternating in one process after a warm-up step;
  tokens per second of the step (loss tokens, and non-padding tokens) and
  their ratio (median of the per-pair ratios);
* the pipeline feeding the step: a ~100M-parameter Llama; per step, the
  seconds in ``next(iterator)`` against the step's seconds
  (``block_until_ready`` on its loss separates them).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import tempfile
import textwrap
import time

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "DATA.md")
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
            "<|end|>{% else %}<|assistant|>{% generation %}{{ m['content'] }}<|end|>"
            "{% endgeneration %}{% endif %}{% endfor %}")


def tokenizer(vocab: int = 8192):
  import tokenizers
  import transformers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  files = sorted(glob.glob(os.path.join(os.path.dirname(textwrap.__file__), "*.py")))[:120]
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  special = ["<pad>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]
  tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=special,
                                       show_progress=False))
  fast = transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
      additional_special_tokens=special[2:])
  fast.chat_template = TEMPLATE
  return fast, files


def conversations(path: str, files: list, n: int, seed: int = 0, median: int = 120,
                  longest: int = 900) -> np.ndarray:
  words = " ".join(open(f, encoding="utf-8").read() for f in files[:20]).split()
  rng = random.Random(seed)
  lens = np.clip(np.random.default_rng(seed).lognormal(np.log(median), 0.9, n).astype(int), 5,
                 longest)

  def turn(k):
    i = rng.randrange(len(words) - k)
    return " ".join(words[i:i + k])

  with open(path, "w", encoding="utf-8") as f:
    for k in lens:
      f.write(json.dumps({"messages": [{"role": "user", "content": turn(max(3, k // 3))},
                                       {"role": "assistant", "content": turn(k)}]}) + "\n")
  return lens


SMALL = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4)
BIG = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
           num_attention_heads=12, num_key_value_heads=12)
TRAIN_HEADING = "## The train step"


def _pipeline_part(args, tok, path) -> str:
  """The pipeline alone: rows, padding and tokens/s of each packing."""
  import grain
  import fsdp_jax.data as fd
  lines = []
  for packing, threads in (("first_fit", 1), ("best_fit", 1), (None, 1), ("first_fit", 16)):
    t = time.perf_counter()
    rows = list(fd.sft_dataset(path, tok, seq_len=args.seq_len, packing=packing,
                               truncation="truncate",
                               read_options=grain.ReadOptions(num_threads=threads,
                                                              prefetch_buffer_size=64)))
    dt = time.perf_counter() - t
    seg = np.stack([r["segment_ids"] for r in rows])
    lab = np.stack([r["labels"] for r in rows])
    tokens = int((seg > 0).sum())
    lines.append(f"| {packing or 'none'} | {threads} | {len(rows):,} | {np.mean(seg == 0):.1%} | "
                 f"{np.mean(seg.max(1)):.2f} | {np.mean(lab != -100):.1%} | {tokens:,} | "
                 f"{tokens / dt:,.0f} |")
    print(lines[-1], flush=True)
  load = os.getloadavg()[0]
  table = "\n".join(
      ["| packing | threads | rows | padding | documents per row | loss tokens (of the slots) "
       "| tokens | tokens/s |", "|---|---|---|---|---|---|---|---|", *lines])
  return (
      "## The pipeline alone\n\n"
      f"{args.conversations:,} conversations, `seq_len={args.seq_len}`, "
      f"`truncation=\"truncate\"`, {os.cpu_count()} CPU cores, load average {load:.1f} "
      "when it finished (the machine was shared: the figures are lower bounds).\n\n"
      + table + "\n\n"
      "Most of the time is transformers' `apply_chat_template` with the assistant mask "
      "(Jinja in Python: threads share the interpreter lock). For scale: an 8B model at "
      "40% of an H100's bf16 peak trains on about 8,000 tokens a second per GPU.\n")


def _model(shape: dict, vocab: int, seq_len: int):
  """A fsdp_jax.models Llama from a config.json in a temp dir; its state, step
  and parameter count on 8 simulated devices (FSDP 8, AdamW)."""
  import jax
  import optax
  import fsdp_jax
  from fsdp_jax import models
  d = tempfile.mkdtemp(prefix="fsdp_jax_data_model_")
  with open(os.path.join(d, "config.json"), "w") as f:
    json.dump(dict(model_type="llama", vocab_size=vocab, tie_word_embeddings=False,
                   max_position_embeddings=max(2048, seq_len), **shape), f)
  b = models.from_pretrained(d, scan=True)
  mesh = fsdp_jax.make_mesh(shard=8)
  opt = optax.adamw(1e-4)
  config = b.fsdp_config()
  params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
      jax.eval_shape(b.init_fn, jax.random.key(0))))
  state = fsdp_jax.init_train_state(init_fn=b.init_fn, rng=jax.random.key(0), optimizer=opt,
                                    mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(b.loss_fn, opt, mesh=mesh, config=config)
  return state, step, mesh, params


def _timed(state, step, it):
  """One step: (state, seconds in next(it), seconds in the step, batch)."""
  import jax
  t0 = time.perf_counter()
  batch = next(it)
  t1 = time.perf_counter()
  state, metrics = step(state, batch)
  jax.block_until_ready(metrics["loss"])
  return state, t1 - t0, time.perf_counter() - t1, batch


def _shape_text(shape: dict, vocab: int, params: int) -> str:
  return (f"Llama, hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
          f"{shape['num_attention_heads']} heads ({shape['num_key_value_heads']} key/value), "
          f"MLP {shape['intermediate_size']}, vocabulary {vocab}, untied head: "
          f"{params:,} parameters")


def _scaled(files, tmp, name: str, n: int, seq_len: int, seed: int):
  """Conversations of the same log-normal shape scaled to ``seq_len`` (as
  the 2,048-token ones: median 120 words, at most 900, times seq_len / 2048)."""
  median, longest = max(5, 120 * seq_len // 2048), max(10, 900 * seq_len // 2048)
  path = os.path.join(tmp, name)
  conversations(path, files, n, seed=seed, median=median, longest=longest)
  return path, median, longest


def _packing_step(args, tok, files, tmp) -> str:
  """Tokens/s of the train step on packed rows against padded rows."""
  import fsdp_jax.data as fd
  vocab = len(tok)
  path, median, longest = _scaled(files, tmp, "train.jsonl", 600, args.train_seq_len, 2)
  state, step, mesh, params = _model(SMALL, vocab, args.train_seq_len)
  its = {p: fd.batches(fd.sft_dataset(path, tok, seq_len=args.train_seq_len, packing=p,
                                      truncation="truncate"), global_batch=8, mesh=mesh)
         for p in ("first_fit", None)}
  t = time.perf_counter()
  for p in its:  # warm-up: the compile (both give the same shapes: one program)
    state, _, _, _ = _timed(state, step, its[p])
  compile_s = time.perf_counter() - t
  res = {p: [] for p in its}  # (loss tokens/s, non-padding tokens/s, step s, padding)
  for r in range(args.steps):
    for p in (("first_fit", None) if r % 2 == 0 else (None, "first_fit")):
      state, _, dt, batch = _timed(state, step, its[p])
      seg = np.asarray(batch["segment_ids"])
      loss_tokens = int((np.asarray(batch["labels"]) != -100).sum())
      res[p].append((loss_tokens / dt, int((seg > 0).sum()) / dt, dt, float(np.mean(seg == 0)),
                     loss_tokens, int((seg > 0).sum())))
    print(f"packing step {r + 1}/{args.steps}: packed {res['first_fit'][-1][2]:.2f} s, "
          f"padded {res[None][-1][2]:.2f} s (load {os.getloadavg()[0]:.1f})", flush=True)
  med = lambda p, k: statistics.median(x[k] for x in res[p])
  ratio = lambda k: statistics.median(a[k] / b[k] for a, b in zip(res["first_fit"], res[None]))
  rows = []
  for p in its:
    rows.append(f"| {p or 'none (padded rows)'} | {statistics.mean(x[3] for x in res[p]):.1%} | "
                f"{med(p, 4):,.0f} / {med(p, 5):,.0f} | {med(p, 2):.2f} | {med(p, 0):,.0f} | "
                f"{med(p, 1):,.0f} |")
  rows.append(f"| **first_fit / none** | | {ratio(4):.2f}x / {ratio(5):.2f}x | {ratio(2):.2f}x | "
              f"**{ratio(0):.2f}x** | **{ratio(1):.2f}x** |")
  return (
      "### Packing: the step's tokens per second\n\n"
      f"{_shape_text(SMALL, vocab, params)}; `seq_len={args.train_seq_len}`, global batch 8 "
      "(one row per device), 600 conversations of the shape above scaled to the sequence (median "
      f"{median} words, at most {longest}; `truncation=\"truncate\"`). "
      "Packed (`first_fit`) and padded (`packing=None`) batches alternate in one process, "
      f"{args.steps} steps each after a warm-up step each (the compile, {compile_s:.0f} s: both "
      "batches have the same shapes and features, `segment_ids` and `positions` included, "
      "so it is one program). Tokens per second of the step alone (`next(iterator)` not "
      "counted), median over the steps; the ratio is the median of the per-pair ratios. "
      "Loss tokens: labels other than -100 (the assistant turns); non-padding tokens: "
      "`segment_ids > 0`.\n\n"
      "| rows | padding | tokens per step (loss / non-padding) | step s | loss tokens/s | "
      "non-padding tokens/s |\n"
      "|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
      "Both batches run the same compiled program. The attention kernel's work does depend "
      "on the segments (it skips key blocks no query of a block can see, a `lax.cond`), but "
      "the step-time ratio is within this shared machine's noise: it went from 1.01x to "
      "1.14x between runs of this section on 2026-11-29. The tokens-per-step ratio is the "
      "exact part of the gain, the tokens/s ratio the measured one.\n")


def _feeding(args, tok, files, tmp, pipeline_text: str) -> str:
  """The pipeline's seconds in next(iterator) against a ~100M model's step."""
  import cloudpickle
  import fsdp_jax.data as fd
  vocab = len(tok)
  # conversations scaled to the sequence (same log-normal shape, median in words)
  path, median, _ = _scaled(files, tmp, "short.jsonl", 400, args.big_seq_len, 1)
  t = time.perf_counter()
  state, step, mesh, params = _model(BIG, vocab, args.big_seq_len)
  init_s = time.perf_counter() - t
  ds = fd.sft_dataset(path, tok, seq_len=args.big_seq_len, packing="first_fit",
                      truncation="truncate")
  try:  # mp_prefetch sends the dataset to its worker processes with cloudpickle
    cloudpickle.dumps(ds)
    pickled = "`sft_dataset`'s dataset can be pickled, as `mp_prefetch` needs."
  except Exception as e:  # pylint: disable=broad-except
    pickled = (f"`sft_dataset`'s dataset cannot be pickled today (`{type(e).__name__}: "
               f"{str(e).splitlines()[0]}`), so `sft_dataset(...).mp_prefetch(...)` fails.")
  it = fd.batches(ds, global_batch=8, mesh=mesh)
  t = time.perf_counter()
  state, first_wait, _, _ = _timed(state, step, it)
  compile_s = time.perf_counter() - t
  waits, steps, tokens = [], [], []
  for r in range(args.big_steps):
    state, wait, dt, batch = _timed(state, step, it)
    waits.append(wait)
    steps.append(dt)
    tokens.append(int((np.asarray(batch["segment_ids"]) > 0).sum()))
    print(f"100M step {r + 1}/{args.big_steps}: next() {wait * 1e3:.1f} ms, step {dt:.2f} s "
          f"(load {os.getloadavg()[0]:.1f})", flush=True)
  share = sum(waits) / (sum(waits) + sum(steps))
  gpu_tps = 0.4 * 989e12 / (6 * params)
  one = [float(line.rsplit("|", 2)[1].replace(",", "")) for line in pipeline_text.splitlines()
         if line.startswith("| ") and line.split("|")[2].strip() == "1"]  # one thread's tokens/s
  pipe_tps = sum(tokens) / sum(waits)
  step_tps = sum(tokens) / sum(steps)
  rows = "\n".join(f"| {i + 1} | {w * 1e3:.1f} | {s:.2f} | {w / s:.2%} | {n:,} |"
                   for i, (w, s, n) in enumerate(zip(waits, steps, tokens)))
  return (
      "### The pipeline feeds the step\n\n"
      f"{_shape_text(BIG, vocab, params)}; FSDP 8, AdamW, float32; "
      f"`seq_len={args.big_seq_len}` (so one step takes seconds on this CPU, not minutes), "
      f"global batch 8, fed by `batches(sft_dataset(..., packing=\"first_fit\"), "
      f"global_batch=8, mesh=mesh)` (grain's default read options: 16 threads tokenizing "
      f"ahead) over 400 conversations of the same shape scaled to the sequence (median "
      f"{median} words). Init {init_s:.0f} s; the first step {compile_s:.0f} s (compile; its "
      f"`next()` {first_wait:.2f} s: the first rows, the packer filling its bins). Then "
      f"{args.big_steps} steps, each `next(iterator)` timed apart from the step "
      "(`block_until_ready` on the loss):\n\n"
      "| step | next() ms | step s | next() / step | non-padding tokens |\n"
      "|---|---|---|---|---|\n" + rows + "\n\n"
      f"Waiting on the pipeline: {share:.2%} of the wall time. Per second spent in `next()` "
      f"the caller got {pipe_tps:,.0f} non-padding tokens while the step consumed "
      f"{step_tps:,.0f} a second: it keeps up here by {pipe_tps / step_tps:,.0f}x. `next()` "
      "does not count the tokenizing grain's threads did during the step (they compete with the "
      "step for the cores instead); the packer, stacking and placing the batch "
      "(`make_array_from_process_local_data`) run in the caller's thread: `batches` has no "
      "prefetch of its own.\n\n"
      f"On an accelerator the step is the fast side: at 40% of an H200's 989 TFLOP/s (bf16, "
      f"dense) this model (6 x {params / 1e6:.1f}M FLOPs a token) trains on about "
      f"{gpu_tps:,.0f} tokens a second per chip, against the {min(one):,.0f}-{max(one):,.0f} "
      f"tokens/s one thread gave above (a lower bound: shared cores): about "
      f"{gpu_tps / max(one):.1f}-{gpu_tps / min(one):.1f} cores per chip, "
      f"{8 * gpu_tps / max(one):.0f}-{8 * gpu_tps / min(one):.0f} for 8 chips, more than one "
      "thread can give (the chat template holds the interpreter lock: compare the 16-thread "
      "row above). "
      "Processes would (grain's `mp_prefetch`, over as many cores). Overlapping `next()` "
      "with the running step (prefetching a batch ahead, or JAX's asynchronous dispatch, "
      "which does it by itself in a loop that does not wait on the step's outputs) hides "
      "the pipeline's time only while it is shorter than the step's: it saves at most "
      "`next()`'s share above, and adds no throughput. " + pickled + "\n")


def _write(args, pipeline_text: str, train_text: str) -> str:
  import jax
  text = (
      "# fsdp_jax.data: padding and throughput\n\n"
      "`python -m benchmarks data` (benchmarks/data.py) writes this file "
      "(`--part train`: the train step's section only).\n\n"
      + textwrap.dedent(__doc__.split("\n\n", 1)[1]).strip() + "\n\n"
      + pipeline_text + "\n" + TRAIN_HEADING + "\n\n"
      f"jax {jax.__version__}, {os.cpu_count()} CPU cores shared with other jobs (load "
      f"average {os.getloadavg()[0]:.1f} when this section finished: the absolute figures "
      "are lower bounds, the ratios are the result), 8 simulated CPU devices.\n\n"
      + train_text)
  with open(args.out, "w", encoding="utf-8") as f:
    f.write(text)
  print(f"wrote {args.out}")
  return text


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks data", description=__doc__)
  p.add_argument("--part", choices=("all", "pipeline", "train"), default="all",
                 help="pipeline: the pipeline alone; train: the train step (keeps the "
                      "pipeline's section of --out)")
  p.add_argument("--conversations", type=int, default=3000)
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--train-seq-len", type=int, default=512, help="the packing step's rows")
  p.add_argument("--steps", type=int, default=5, help="measured steps of each packing")
  p.add_argument("--big-seq-len", type=int, default=128, help="the ~100M model's rows")
  p.add_argument("--big-steps", type=int, default=5)
  p.add_argument("--out", default=OUT)
  args = p.parse_args(argv)
  import fsdp_jax
  fsdp_jax.simulate_cpu_devices(8)  # before JAX starts (sft_dataset asks its process index)
  old_pipeline = old_train = None
  if args.part != "all":
    old = open(args.out, encoding="utf-8").read() if os.path.exists(args.out) else ""
    if "## The pipeline alone" not in old or TRAIN_HEADING not in old:
      raise SystemExit(f"{args.out} has no sections to keep: run --part all once.")
    body = old.split("## The pipeline alone", 1)[1]
    old_pipeline = "## The pipeline alone" + body.split(TRAIN_HEADING, 1)[0].rstrip("\n") + "\n"
    old_train = body.split(TRAIN_HEADING, 1)[1].split("\n\n", 2)[2]  # after its load line
  tok, files = tokenizer()
  tmp = tempfile.mkdtemp(prefix="fsdp_jax_data_")
  path = os.path.join(tmp, "chat.jsonl")
  conversations(path, files, args.conversations)
  t = time.perf_counter()
  pipeline_text = old_pipeline if args.part == "train" else _pipeline_part(args, tok, path)
  print(f"pipeline part: {time.perf_counter() - t:.0f} s", flush=True)
  t = time.perf_counter()
  train_text = old_train if args.part == "pipeline" else (
      _packing_step(args, tok, files, tmp) + "\n" + _feeding(args, tok, files, tmp, pipeline_text))
  print(f"train part: {time.perf_counter() - t:.0f} s", flush=True)
  return _write(args, pipeline_text, train_text)
