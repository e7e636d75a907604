#!/usr/bin/env python
"""Sequence parallelism under tensor parallelism: activations per device and
the collectives over 'tensor', against FSDP alone and TP without it.

    python -m benchmarks sequence_parallel             # sequence_parallel.json (~10 min)
    python -m benchmarks sequence_parallel --seq-len 64 --tiny 16 --layers 1  # smoke

A Llama decoder from ``fsdp_jax.models`` (its family's TensorParallel rules)
compiled on 8 simulated CPU devices, never run:

* FSDP8: ``make_mesh(shard=8)``, one sequence per device (global batch 8);
* FSDP4 x TP2 with and without ``sequence_parallel``: ``make_mesh(shard=4,
  tensor=2)``, one sequence per tensor group (global batch 4).

Activation bytes per device: the compiled step's ``temp`` (``memory_analysis``)
at ``--seq-len`` minus its value at ``--tiny`` tokens. Collectives over
'tensor' from the compiled HLO (``fsdp_jax.hlo.collectives``; bytes per
device: an all-gather's result, a reduce-scatter's input, an all-reduce's
buffer).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import fsdp_jax  # noqa: E402
from fsdp_jax import hlo, models  # noqa: E402

TENSOR_GROUPS = {(0, 1), (2, 3), (4, 5), (6, 7)}


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name, default in (("d-model", 256), ("layers", 4), ("heads", 8), ("kv-heads", 2),
                        ("ffn", 688), ("vocab", 1024), ("seq-len", 1024), ("tiny", 16)):
    p.add_argument(f"--{name}", type=int, default=default)
  p.add_argument("--scan", action="store_true", help="stacked layers (a scan)")
  p.add_argument("--json", default=os.path.join(HERE, "sequence_parallel.json"))
  return p.parse_args(argv)


def _family(args):
  d = tempfile.mkdtemp()
  json.dump({"model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.d_model,
             "intermediate_size": args.ffn, "num_hidden_layers": args.layers,
             "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
             "max_position_embeddings": max(args.seq_len, 64)},
            open(os.path.join(d, "config.json"), "w"))
  return models.from_pretrained(d, scan=args.scan)


def _compile(b, config, mesh, batch, seq):
  opt = optax.adamw(1e-3)
  state = fsdp_jax.init_train_state(init_fn=b.init_fn, rng=jax.random.key(0), optimizer=opt,
                                    mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(b.loss_fn, opt, mesh=mesh, config=config)
  ids = np.zeros((batch, seq), np.int32)
  compiled = step.lower(state, {"input_ids": ids, "labels": ids}).compile()
  return compiled


def _tensor_collectives(text) -> dict:
  out: dict = {}
  for c in hlo.collectives(text):
    if c.groups and set(c.groups) <= TENSOR_GROUPS:
      k = out.setdefault(c.kind, [0, 0])
      k[0] += 1
      k[1] += c.bytes
  return out


def measure(args) -> dict:
  b = _family(args)
  with_tp = b.fsdp_config(tensor_parallel=True)
  sp = lambda on: dataclasses.replace(with_tp, tensor_parallel=dataclasses.replace(
      with_tp.tensor_parallel, sequence_parallel=on))
  cases = {
      "FSDP8": (b.fsdp_config(), fsdp_jax.make_mesh(shard=8), 8),
      "FSDP4xTP2": (sp(False), fsdp_jax.make_mesh(shard=4, tensor=2), 4),
      "FSDP4xTP2+SP": (sp(True), fsdp_jax.make_mesh(shard=4, tensor=2), 4),
  }
  rows = {}
  for name, (config, mesh, batch) in cases.items():
    row = {}
    for seq in (args.tiny, args.seq_len):
      t0 = time.time()
      c = _compile(b, config, mesh, batch, seq)
      m = c.memory_analysis()
      row[seq] = {"temp": int(m.temp_size_in_bytes), "argument": int(m.argument_size_in_bytes),
                  "compile_s": round(time.time() - t0, 1),
                  "tensor": _tensor_collectives(c.as_text())}
      print(name, seq, row[seq], flush=True)
    row["activations"] = row[args.seq_len]["temp"] - row[args.tiny]["temp"]
    rows[name] = row
  base = rows["FSDP8"]["activations"]
  for name, row in rows.items():
    row["ratio_to_FSDP8"] = row["activations"] / base
  return {"args": vars(args), "rows": {k: {str(s): v for s, v in r.items()}
                                        for k, r in rows.items()},
          "jax": jax.__version__, "python": platform.python_version(),
          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main(argv=None):
  args = _parse(argv)
  fsdp_jax.simulate_cpu_devices(8)
  result = measure(args)
  with open(args.json, "w") as f:
    json.dump(result, f, indent=1)
  for name, row in result["rows"].items():
    print(f"{name}: activations {row['activations'] / 2**20:.2f} MiB/device, "
          f"{row['ratio_to_FSDP8']:.3f}x FSDP8; 'tensor' at {args.seq_len}: "
          f"{row[str(args.seq_len)]['tensor']}")


if __name__ == "__main__":
  main()
