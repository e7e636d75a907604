"""Head-tail load balancing of context parallelism: the attention blocks
each device of the ``"context"`` axis computes, with and without
``ContextParallel(load_balance=True)``.

A one-layer causal model through ``fsdp_jax.attention`` (blocks of 512
queries and 512 keys) on one sequence of ``--seq`` tokens split over
``context=C`` devices. Every (query block, key block) pair the kernel
computes (the ``lax.cond`` branch it takes: the pairs the causal mask does
not hide entirely) is counted per device by a ``jax.debug.callback`` in
the forward pass of ``shard_eval_step`` and of the train step's backward
(the backward pass skips the same pairs). Each device's count is
attributed from the query block's first global position (which chunk, so
which device, holds it). Prints a markdown table (benchmarks/CONTEXT.md).

    python -m benchmarks.context_balance [--seq 4096] [--context 4]
"""

from __future__ import annotations

import argparse
import collections

import fsdp_jax

fsdp_jax.simulate_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from fsdp_jax._src import attention as A  # noqa: E402
from fsdp_jax._src import context_layout  # noqa: E402

D, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 32, 2, 1, 16, 64


def loss_fn(p, batch):
  ids = batch["ids"]
  b, t = ids.shape
  h = p["emb"][ids]
  q = (h @ p["wq"]).reshape(b, t, HEADS, HEAD_DIM)
  k = (h @ p["wk"]).reshape(b, t, KV_HEADS, HEAD_DIM)
  v = (h @ p["wv"]).reshape(b, t, KV_HEADS, HEAD_DIM)
  o = fsdp_jax.attention(q, k, v).reshape(b, t, HEADS * HEAD_DIM)
  return jnp.mean((o @ p["wo"]) ** 2)


def params():
  ks = jax.random.split(jax.random.key(0), 5)
  n = lambda k, s: jax.random.normal(k, s) * 0.1
  return {"emb": n(ks[0], (VOCAB, D)), "wq": n(ks[1], (D, HEADS * HEAD_DIM)),
          "wk": n(ks[2], (D, KV_HEADS * HEAD_DIM)), "wv": n(ks[3], (D, KV_HEADS * HEAD_DIM)),
          "wo": n(ks[4], (HEADS * HEAD_DIM, D))}


class Counter:
  """Counts the (query block, key block) pairs the kernel computes, by the
  query block's first global position."""

  def __init__(self):
    self.hits = collections.Counter()
    self._orig = A._Layout.block_mask  # pylint: disable=protected-access

  def __enter__(self):
    orig, hits = self._orig, self.hits

    def record(q0):
      hits[int(q0)] += 1

    def block_mask(lay, i, j):  # called only in the branch that computes a block
      jax.debug.callback(record, jnp.min(lay.q_pos[i]))
      return orig(lay, i, j)

    A._Layout.block_mask = block_mask  # pylint: disable=protected-access
    return self

  def __exit__(self, *exc):
    A._Layout.block_mask = self._orig  # pylint: disable=protected-access

  def per_device(self, seq: int, c: int, balanced: bool) -> list:
    lay = context_layout.Layout(c, balanced)
    m = seq // lay.count
    out = [0] * c
    for q0, n in self.hits.items():
      out[lay.owner[q0 // m][0]] += n
    return out


def run(seq: int, c: int, balanced: bool, train: bool) -> list:
  mesh = fsdp_jax.make_mesh(context=c, devices=jax.devices()[:c])
  config = fsdp_jax.FSDPConfig(context_parallel=fsdp_jax.ContextParallel(load_balance=balanced))
  state = fsdp_jax.init_train_state(params=params(), optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=config)
  batch = {"ids": np.random.default_rng(0).integers(0, VOCAB, (1, seq)).astype(np.int32)}
  with Counter() as counter:
    if train:
      step = fsdp_jax.shard_train_step(loss_fn)
      _, metrics = step(state, batch)
      jax.block_until_ready(metrics)
    else:
      out = fsdp_jax.shard_eval_step(loss_fn)(state, batch)
      jax.block_until_ready(out)
    jax.effects_barrier()
  return counter.per_device(seq, c, balanced)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--context", type=int, default=4)
  args = ap.parse_args()
  seq, c = args.seq, args.context
  nb = -(-seq // A.BLOCK_K)
  print(f"T = {seq}, context = {c}, blocks of {A.BLOCK_Q} x {A.BLOCK_K}: {nb * (nb + 1) // 2} "
        f"of the {nb * nb} block pairs are under the causal diagonal\n")
  print("| layout | pass | blocks computed per device | total | max / mean |")
  print("|---|---|---|---|---|")
  for balanced in (False, True):
    for train in (False, True):
      counts = run(seq, c, balanced, train)
      name = "head-tail (`load_balance=True`)" if balanced else "contiguous"
      what = "train step (forward + backward)" if train else "eval (forward)"
      print(f"| {name} | {what} | {', '.join(map(str, counts))} | {sum(counts)} | "
            f"{max(counts) / np.mean(counts):.2f} |")


if __name__ == "__main__":
  main()
