"""``python -m fsdp_jax.data.inspect``: what a fine-tuning file becomes.

    python -m fsdp_jax.data.inspect chat.jsonl --tokenizer DIR --seq-len 2048

Prints the rows ``sft_dataset`` makes (one epoch, one process, no
shuffle), documents per row and the padding fraction; the tokens taken into
the loss; the examples longer than ``seq_len`` (and what ``--truncation``
does with them); and one row decoded, each document on its own line, the
tokens in the loss between ``[[`` and ``]]``.
"""

from __future__ import annotations

import argparse
from typing import Optional

import grain
import numpy as np

from fsdp_jax._src.data import sources
from fsdp_jax._src.data.encode import IGNORE, LOSS_ON, TRUNCATION, Encoder, load_tokenizer
from fsdp_jax._src.data.pipeline import PACKING, sft_dataset

__all__ = ["main", "show_row", "summarize"]


def summarize(source, tokenizer, *, seq_len: int, packing: Optional[str] = "first_fit",
              loss_on: str = "assistant", chat_template: Optional[str] = None,
              truncation: str = "error", packing_bins: int = 64) -> dict:
  """The figures ``inspect`` prints, and the rows (one epoch, unshuffled,
  this process taking every row)."""
  src = sources.open_source(source)
  tok = load_tokenizer(tokenizer)
  encoder = Encoder(tok, seq_len=seq_len, loss_on=loss_on, chat_template=chat_template,
                    truncation="truncate")
  examples, too_long, first_long = 0, 0, None
  for i in range(len(src)):
    where, row = src[i]
    ids, _ = encoder.tokenize(where, row)
    examples += 1
    if len(ids) > seq_len:
      too_long += 1
      first_long = first_long or f"{where} ({len(ids)} tokens)"
  # The rows as sft_dataset makes them; examples too long for "error" are
  # dropped here so the rest can be counted (sft_dataset would raise).
  rows = list(sft_dataset(
      src.rows if isinstance(src, sources.ListSource) else src.paths, tok, seq_len=seq_len,
      packing=packing, loss_on=loss_on, chat_template=chat_template, shuffle_seed=None,
      truncation="drop" if truncation == "error" else truncation, packing_bins=packing_bins,
      shard_options=grain.sharding.NoSharding(), read_options=grain.ReadOptions(num_threads=1)))
  segments = np.asarray([r["segment_ids"] for r in rows]).reshape(len(rows), seq_len)
  labels = np.asarray([r["labels"] for r in rows]).reshape(len(rows), seq_len)
  docs = segments.max(axis=1) if len(rows) else np.zeros(0, int)
  return {"examples": examples, "rows": len(rows), "seq_len": seq_len,
          "documents": int(docs.sum()),
          "documents_per_row": ((float(docs.mean()), int(docs.min()), int(docs.max()))
                                if len(rows) else (0.0, 0, 0)),
          "tokens": int((segments > 0).sum()),
          "padding_fraction": float((segments == 0).mean()) if len(rows) else 0.0,
          "loss_tokens": int((labels != IGNORE).sum()),
          "too_long": too_long, "first_too_long": first_long, "truncation": truncation,
          "row_list": rows}


def show_row(row: dict, tokenizer) -> str:
  """One row decoded, a document a line, loss tokens between [[ and ]]."""
  lines = []
  ids, labels, seg = (np.asarray(row[k]) for k in ("input_ids", "labels", "segment_ids"))
  for s in sorted(set(seg.tolist()) - {0}):
    where = np.flatnonzero(seg == s)
    out, span = [], []
    for t in where:
      if labels[t] != IGNORE:
        span.append(int(ids[t]))
        continue
      if span:
        out.append("[[" + tokenizer.decode(span) + "]]")
        span = []
      out.append(tokenizer.decode([int(ids[t])]))
    if span:
      out.append("[[" + tokenizer.decode(span) + "]]")
    lines.append(f"  document {s} ({len(where)} tokens): " + " ".join(out))
  pad = int((seg == 0).sum())
  if pad:
    lines.append(f"  padding: {pad} tokens")
  return "\n".join(lines)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(prog="python -m fsdp_jax.data.inspect",
                              description="What sft_dataset makes of a fine-tuning file.")
  p.add_argument("paths", nargs="+", help="JSONL files")
  p.add_argument("--tokenizer", required=True, help="the tokenizer's directory")
  p.add_argument("--seq-len", type=int, required=True)
  p.add_argument("--packing", choices=[str(x).lower() for x in PACKING], default="first_fit")
  p.add_argument("--loss-on", choices=LOSS_ON, default="assistant")
  p.add_argument("--truncation", choices=TRUNCATION, default="error")
  p.add_argument("--chat-template", default=None, help="a file holding a Jinja chat template")
  p.add_argument("--show-row", type=int, default=0, help="which row to decode")
  args = p.parse_args(argv)
  template = None
  if args.chat_template:
    with open(args.chat_template, encoding="utf-8") as f:
      template = f.read()
  tok = load_tokenizer(args.tokenizer)
  s = summarize(args.paths, tok, seq_len=args.seq_len,
                packing=None if args.packing == "none" else args.packing,
                loss_on=args.loss_on, chat_template=template, truncation=args.truncation)
  mean, lo, hi = s["documents_per_row"]
  print(f"examples: {s['examples']:,} in {', '.join(args.paths)}")
  print(f"rows: {s['rows']:,} of {s['seq_len']} tokens ({args.packing} packing)")
  print(f"documents per row: {mean:.2f} (min {lo}, max {hi}); {s['documents']:,} documents")
  print(f"padding: {s['padding_fraction']:.1%} of the rows' tokens")
  print(f"tokens in the loss: {s['loss_tokens']:,} of {s['tokens']:,} "
        f"({s['loss_tokens'] / max(s['tokens'], 1):.1%}; loss_on={args.loss_on!r})")
  if s["too_long"]:
    what = {"error": "sft_dataset raises on the first (left out of the figures above)",
            "drop": "dropped", "truncate": "truncated to seq_len"}[args.truncation]
    print(f"longer than seq_len: {s['too_long']:,} example{'s' * (s['too_long'] != 1)}, "
          f"first {s['first_too_long']}: "
          f"{what}")
  else:
    print("longer than seq_len: none (nothing dropped or truncated)")
  if s["rows"]:
    k = min(max(args.show_row, 0), s["rows"] - 1)
    print(f"row {k} (loss tokens in [[ ]]):")
    print(show_row(s["row_list"][k], tok))
  return s
