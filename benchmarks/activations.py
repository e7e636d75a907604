"""``python -m benchmarks activations``: the loss's own memory, blocked
against unblocked, writes ``benchmarks/ACTIVATIONS.md``.

The head and cross-entropy of a Llama 3 sized vocabulary (128,256) at
8,192 tokens of width 4,096, with their gradients (``jax.grad`` with
respect to the hidden state and the head's kernel): the unblocked loss (the
families' ``loss_fn(loss_block_tokens=None)``: ``[tokens, vocab]`` logits,
float32 cross-entropy) against ``fsdp_jax.chunked_cross_entropy`` at
several block sizes. Every program is compiled from
``jax.ShapeDtypeStruct``s on the local backend (nothing is allocated);
the figures are XLA's ``memory_analysis()``: the temporaries (what the
program allocates besides its inputs and outputs) and the outputs (the two
gradients).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import fsdp_jax  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2 ** 30


def unblocked(hidden, kernel, labels):
  """The families' unblocked loss: logits in the parameters' dtype, then
  the float32 cross-entropy."""
  logits = (hidden @ kernel).astype(jnp.float32)
  ok = labels != -100
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(ok, labels, 0))
  return jnp.sum(jnp.where(ok, ce, 0.0))


def blocked(block):
  return lambda h, w, y: fsdp_jax.chunked_cross_entropy(h, w, y, block_tokens=block).total


def measure(fn, tokens, d, vocab, dtype) -> dict:
  args = (jax.ShapeDtypeStruct((tokens, d), dtype), jax.ShapeDtypeStruct((d, vocab), dtype),
          jax.ShapeDtypeStruct((tokens,), jnp.int32))
  t = time.perf_counter()
  m = jax.jit(jax.grad(fn, (0, 1))).lower(*args).compile().memory_analysis()
  return {"temp": m.temp_size_in_bytes, "out": m.output_size_in_bytes,
          "compile_s": time.perf_counter() - t}


def run(tokens: int, d: int, vocab: int, blocks: list, dtypes: list) -> list:
  rows = []
  for dtype in dtypes:
    base = measure(unblocked, tokens, d, vocab, dtype)
    rows.append((jnp.dtype(dtype).name, "unblocked", base, 1.0))
    for b in blocks:
      m = measure(blocked(b), tokens, d, vocab, dtype)
      rows.append((jnp.dtype(dtype).name, f"blocks of {b}", m, m["temp"] / base["temp"]))
  return rows


def table(rows, tokens, vocab) -> str:
  lines = ["| dtype | loss | temporaries | vs unblocked | outputs (gradients) | one block's "
           "float32 logits |", "|---|---|---|---|---|---|"]
  for dtype, name, m, ratio in rows:
    block = tokens if name == "unblocked" else int(name.split()[-1])
    lines.append(f"| {dtype} | {name} | {m['temp'] / GIB:.3f} GiB | {ratio:.3f} "
                 f"(1/{1 / ratio:.1f}) | {m['out'] / GIB:.3f} GiB | "
                 f"{block * vocab * 4 / GIB:.3f} GiB |")
  return "\n".join(lines)


def main(argv: list) -> int:
  p = argparse.ArgumentParser(prog="python -m benchmarks activations", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--d", type=int, default=4096)
  p.add_argument("--vocab", type=int, default=128256)
  p.add_argument("--blocks", default="256,512,1024,2048")
  p.add_argument("--out", default=os.path.join(HERE, "ACTIVATIONS.md"),
                 help="the report ('-': print it only)")
  a = p.parse_args(argv)
  blocks = [int(b) for b in a.blocks.split(",")]
  rows = run(a.tokens, a.d, a.vocab, blocks, [jnp.float32, jnp.bfloat16])
  body = table(rows, a.tokens, a.vocab)
  f32 = {name: m for dt, name, m, _ in rows if dt == "float32"}
  ratio_512 = f32["blocks of 512"]["temp"] / f32["unblocked"]["temp"] if "blocks of 512" in f32 \
      else None
  bf16 = {name: m for dt, name, m, _ in rows if dt == "bfloat16"}
  copy = a.d * a.vocab * 4
  bf16_base = (bf16["unblocked"]["temp"] - copy) / GIB
  bf16_512 = (bf16.get("blocks of 512", bf16["unblocked"])["temp"] - copy) / GIB
  report = f"""# The blocked loss: its memory

`python -m benchmarks activations` ({datetime.date.today().isoformat()}, jax
{jax.__version__}, {jax.default_backend()} backend, Python {platform.python_version()}):
the head and the cross-entropy of {a.tokens:,} tokens of width {a.d:,} over a
vocabulary of {a.vocab:,} (Llama 3's), with their gradients (`jax.grad` with
respect to the hidden state and the head's kernel), each program compiled
from `jax.ShapeDtypeStruct`s (nothing allocated). Temporaries: XLA's
`memory_analysis().temp_size_in_bytes`, what the program allocates besides
its inputs and its outputs (the two gradients, listed apart).

- **unblocked**: the families' `loss_fn(loss_block_tokens=None)`: logits
  `[tokens, vocab]` in the parameters' dtype, then the float32
  cross-entropy (`optax.softmax_cross_entropy_with_integer_labels`).
- **blocks of b**: `fsdp_jax.chunked_cross_entropy(..., block_tokens=b)`.

{body}

{"At blocks of 512 in float32 the loss's temporaries are "
 f"{f32['blocks of 512']['temp'] / GIB:.3f} GiB against {f32['unblocked']['temp'] / GIB:.3f} GiB "
 f"unblocked: 1/{1 / ratio_512:.1f}." if ratio_512 else ""}
The blocked loss's temporaries are a few blocks of logits (the block's
float32 logits and their cotangent, in the forward scan, the backward's
pass over blocks of tokens, and its pass over blocks of the vocabulary,
each `[tokens, vocab / blocks]`), and the per-token logsumexp the forward
keeps (`tokens x 4` bytes). The unblocked loss holds the whole logits
several times over (in float32: the logits, the softmax, their cotangent).

In bfloat16 on the CPU backend both programs also hold a float32 copy of
the `[d, vocab]` kernel ({a.d * a.vocab * 4 / GIB:.2f} GiB): XLA's CPU backend
computes a bf16 matmul in float32 (`float-normalization`), converting its
operands, and hoists the conversion of the kernel out of the loops (one
`f32[{a.d},{a.vocab}]` convert in each compiled program's entry). That copy
is the CPU's, not the loss's: a GPU multiplies bf16 directly. Less that
copy, blocks of 512 in bfloat16 hold {bf16_512:.3f} GiB against
{bf16_base:.3f} GiB unblocked (1/{bf16_base / bf16_512:.1f}). The float32
rows are free of it.

How it works, and what it is in Liger Kernel and Cut Cross-Entropy:
[docs/activation_checkpointing.md](../docs/activation_checkpointing.md#the-blocked-loss).
"""
  if a.out == "-":
    print(report)
  else:
    with open(a.out, "w") as f:
      f.write(report)
    print(body)
    print(f"wrote {a.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
