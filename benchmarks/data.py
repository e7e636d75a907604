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
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
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


def conversations(path: str, files: list, n: int, seed: int = 0) -> np.ndarray:
  words = " ".join(open(f, encoding="utf-8").read() for f in files[:20]).split()
  rng = random.Random(seed)
  lens = np.clip(np.random.default_rng(seed).lognormal(np.log(120), 0.9, n).astype(int), 5, 900)

  def turn(k):
    i = rng.randrange(len(words) - k)
    return " ".join(words[i:i + k])

  with open(path, "w", encoding="utf-8") as f:
    for k in lens:
      f.write(json.dumps({"messages": [{"role": "user", "content": turn(max(3, k // 3))},
                                       {"role": "assistant", "content": turn(k)}]}) + "\n")
  return lens


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m benchmarks data", description=__doc__)
  p.add_argument("--conversations", type=int, default=3000)
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--out", default=OUT)
  args = p.parse_args(argv)
  import grain
  import fsdp_jax.data as fd
  tok, files = tokenizer()
  path = os.path.join(tempfile.mkdtemp(prefix="fsdp_jax_data_"), "chat.jsonl")
  conversations(path, files, args.conversations)
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
  text = (
      "# fsdp_jax.data: padding and throughput\n\n"
      "`python -m benchmarks data` (benchmarks/data.py) writes this file.\n\n"
      + textwrap.dedent(__doc__.split("\n\n", 1)[1]).strip() + "\n\n"
      f"{args.conversations:,} conversations, `seq_len={args.seq_len}`, "
      f"`truncation=\"truncate\"`, {os.cpu_count()} CPU cores, load average {load:.1f} "
      "when it finished (the machine was shared: the figures are lower bounds).\n\n"
      + table + "\n\n"
      "Most of the time is transformers' `apply_chat_template` with the assistant mask "
      "(Jinja in Python: threads share the interpreter lock). For scale: an 8B model at "
      "40% of an H100's bf16 peak trains on about 8,000 tokens a second per GPU.\n")
  with open(args.out, "w", encoding="utf-8") as f:
    f.write(text)
  print(f"wrote {args.out}")
  return table
