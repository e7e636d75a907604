#!/usr/bin/env python
"""The model families of ``fsdp_jax.models`` against the example Llama.

    python -m benchmarks families                  # writes benchmarks/MODELS.md
    python -m benchmarks families --hidden 64 --layers 2 --rounds 1 --out /tmp/MODELS.md

Each family (``fsdp_jax.models.from_pretrained`` of a ``config.json``) at
one size (hidden 256, 4 layers, 8 heads of 32 with 4 key/value heads, MLP
768, vocabulary 4096, untied head; GPT-2 has its own MLP of 4 x hidden and
no grouped-query attention), beside ``examples/llama.py``'s Flax Llama at
the same size (today's example, the baseline), on 8 simulated CPU devices:

* FSDP 8 (FULL_SHARD, AdamW, one unit per decoder layer): the compiled
  step's bytes per device (``memory_analysis()``: arguments + outputs -
  aliased + temporaries, and the temporaries alone), all-gathers and
  reduce-scatters per step from the HLO, and the step time as a ratio to
  the example Llama's (round-robin in this process, median of the
  per-round ratios);
* tensor parallelism 4 x 2 (``b.tensor_parallel``; the example Llama with
  the same Megatron rules over its names): all-gathers over ``"tensor"`` in
  the compiled step, and the step time as a ratio to FSDP 8 of the same
  model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import fsdp_jax  # noqa: E402  (importing starts no backend)

MiB = 2 ** 20
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2")
EXAMPLE_RULES = [("*.attn.q", "colwise"), ("*.attn.k", "colwise"), ("*.attn.v", "colwise"),
                 ("*.attn.o", "rowwise"), ("*.mlp.gate", "colwise"), ("*.mlp.up", "colwise"),
                 ("*.mlp.down", "rowwise"), ("params.embed.embedding", ("tensor", None)),
                 ("params.lm_head", "colwise")]


def _parse(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--hidden", type=int, default=256)
  p.add_argument("--intermediate", type=int, default=768)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--batch-per-device", type=int, default=1)
  p.add_argument("--rounds", type=int, default=5)
  p.add_argument("--families", default=",".join(FAMILIES))
  p.add_argument("--out", default=os.path.join(HERE, "MODELS.md"))
  return p.parse_args(argv)


def _config(family: str, a) -> dict:
  base = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
              num_hidden_layers=a.layers, num_attention_heads=a.heads,
              num_key_value_heads=a.kv_heads, tie_word_embeddings=False,
              max_position_embeddings=max(2048, a.seq_len))
  head = a.hidden // a.heads
  extra = {
      "llama": dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                         low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8192)),
      "mistral": dict(sliding_window=a.seq_len // 2),
      "qwen2": dict(use_sliding_window=False),
      "qwen3": dict(head_dim=head),
      "gemma2": dict(head_dim=head, query_pre_attn_scalar=head, sliding_window=a.seq_len // 2),
      "gemma3_text": dict(head_dim=head, query_pre_attn_scalar=head,
                          sliding_window=a.seq_len // 2),
      "phi3": dict(),
  }
  if family == "gpt2":
    return dict(model_type="gpt2", vocab_size=a.vocab, n_embd=a.hidden, n_layer=a.layers,
                n_head=a.heads, n_positions=max(1024, a.seq_len), tie_word_embeddings=False)
  return dict(model_type=family, **base, **extra[family])


class Variant:
  """One model under one mesh: its state, compiled step and measurements."""

  def __init__(self, name, init_fn, loss_fn, config, mesh, batch):
    import jax  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel
    opt = optax.adamw(1e-4)
    self.name, self.batch = name, batch
    self.state = fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0),
                                           optimizer=opt, mesh=mesh, config=config)
    self.step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=config)
    t0 = time.perf_counter()
    compiled = self.step.lower(self.state, batch).compile()
    self.compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    self.peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
                 + ma.temp_size_in_bytes)
    self.temp = ma.temp_size_in_bytes
    text = compiled.as_text()
    colls = fsdp_jax.hlo.collectives(text)
    self.gathers = sum(c.kind == "all-gather" for c in colls)
    self.scatters = sum(c.kind == "reduce-scatter" for c in colls)
    tensor_groups = {tuple(range(k, k + 2)) for k in range(0, 8, 2)}
    self.tensor_gathers = sum(c.kind == "all-gather" and set(c.groups) <= tensor_groups
                              for c in colls)
    self.params = sum(int(x.size) for x in jax.tree.leaves(
        fsdp_jax.summon_full_params(self.state)))
    self.times: list = []
    self.run()  # warm-up

  def run(self) -> float:
    import jax  # pylint: disable=import-outside-toplevel
    t0 = time.perf_counter()
    self.state, metrics = self.step(self.state, self.batch)
    jax.block_until_ready(metrics["loss"])
    dt = time.perf_counter() - t0
    self.times.append(dt)
    self.loss = float(metrics["loss"])
    return dt


def _example_llama(a):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import llama  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  cfg = llama.LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden,
                          intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                          num_attention_heads=a.heads, num_key_value_heads=a.kv_heads)
  model = llama.Llama(cfg)

  def loss_fn(params, batch):
    logits = model.apply(params, batch["input_ids"][:, :-1]).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["labels"][:, 1:]))

  init_fn = lambda rng: model.init(rng, jnp.zeros((1, 8), jnp.int32))
  policy = fsdp_jax.ModuleWrapPolicy({llama.Block})
  return init_fn, loss_fn, policy


def _ratios(times, base) -> float:
  return statistics.median(t / b for t, b in zip(times, base))


def main(argv=None) -> str:
  a = _parse(argv)
  fsdp_jax.simulate_cpu_devices(8)
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from fsdp_jax import models  # pylint: disable=import-outside-toplevel

  n = 8
  tokens = np.random.default_rng(0).integers(0, a.vocab, (n * a.batch_per_device,
                                                         a.seq_len + 1)).astype(np.int32)
  batch = {"input_ids": tokens, "labels": tokens}
  fsdp_mesh = fsdp_jax.make_mesh(shard=n)
  tp_mesh = fsdp_jax.make_mesh(shard=n // 2, tensor=2)
  rows = {}
  init_fn, loss_fn, policy = _example_llama(a)
  print("example Llama ...", flush=True)
  rows["example Llama (examples/llama.py)"] = (
      Variant("example/fsdp", init_fn, loss_fn, fsdp_jax.FSDPConfig(auto_wrap_policy=policy),
              fsdp_mesh, batch),
      Variant("example/tp", init_fn, loss_fn, fsdp_jax.FSDPConfig(
          auto_wrap_policy=policy, tensor_parallel=fsdp_jax.TensorParallel(rules=EXAMPLE_RULES)),
              tp_mesh, batch))
  for family in a.families.split(","):
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
      json.dump(_config(family, a), f)
    b = models.from_pretrained(d)
    print(f"{family} ...", flush=True)
    rows[family] = (Variant(f"{family}/fsdp", b.init_fn, b.loss_fn, b.fsdp_config(),
                            fsdp_mesh, batch),
                    Variant(f"{family}/tp", b.init_fn, b.loss_fn,
                            b.fsdp_config(tensor_parallel=True), tp_mesh, batch))
  variants = [v for pair in rows.values() for v in pair]
  for v in variants:
    v.times.clear()
  for r in range(a.rounds):
    order = variants[r % len(variants):] + variants[:r % len(variants)]
    for v in order:
      v.run()
    print(f"round {r + 1}/{a.rounds} (load {os.getloadavg()[0]:.1f})", flush=True)
  base_fsdp, _ = rows["example Llama (examples/llama.py)"]
  lines = []
  w = lines.append
  w("# Model families: memory and step time against the example Llama")
  w("")
  w(f"Measured {datetime.date.today()} by `python -m benchmarks families` "
    f"(`benchmarks/families.py`), jax {jax.__version__}, Python {platform.python_version()}, "
    f"{os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f} at the end: shared "
    "machine), 8 simulated CPU devices.")
  w("")
  w(f"Every model at one size: hidden {a.hidden}, {a.layers} layers, {a.heads} heads of "
    f"{a.hidden // a.heads} ({a.kv_heads} key/value heads), MLP {a.intermediate} (GPT-2: "
    f"{4 * a.hidden}, no grouped-query attention), vocabulary {a.vocab}, untied head; "
    f"{a.batch_per_device} x {a.seq_len} tokens per device; FULL_SHARD, AdamW, one FSDP unit "
    "per decoder layer; float32. The baseline is `examples/llama.py`'s Flax Llama, the ready "
    "model of the examples before `fsdp_jax.models` (FSDP 8; under tensor parallelism the "
    "same Megatron rules over its names). Step time: median over "
    f"{a.rounds} round-robin rounds of the ratio to the baseline's step in the same round.")
  w("")
  w("| model | parameters | FSDP 8: peak MiB per device | temporaries MiB | all-gathers / "
    "reduce-scatters per step | step time vs example Llama | TP 4x2: all-gathers over "
    "`tensor` | TP 4x2 step time vs its FSDP 8 |")
  w("|---|---:|---:|---:|---:|---:|---:|---:|")
  for name, (fs, tp) in rows.items():
    w(f"| {name} | {fs.params:,} | {fs.peak / MiB:.2f} | {fs.temp / MiB:.2f} | "
      f"{fs.gathers} / {fs.scatters} | {_ratios(fs.times, base_fsdp.times):.2f}x | "
      f"{tp.tensor_gathers} | {_ratios(tp.times, fs.times):.2f}x |")
  w("")
  w("Compile seconds (FSDP 8 / TP 4x2): " + ", ".join(
      f"{name.split(' ')[0]} {fs.compile_s:.0f} / {tp.compile_s:.0f}"
      for name, (fs, tp) in rows.items()) + ".")
  w("")
  w("Reading: the families' peak and step time against the example are what their "
    "architectures add at this size (Gemma's four norms per layer and soft-capping, Qwen3's "
    "and Gemma 3's q/k norms, GPT-2's larger MLP and learned positions); the `tensor` "
    "all-gathers column is the check of the Megatron layout: 0 means queries, keys and the "
    "MLP stay split over `\"tensor\"` through the rotary (the families' rotate-half, the "
    "example's `jnp.stack` of rotated pairs).")
  text = "\n".join(lines) + "\n"
  with open(a.out, "w") as f:
    f.write(text)
  print(f"wrote {a.out}")
  return text


if __name__ == "__main__":
  main()
