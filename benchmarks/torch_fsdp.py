#!/usr/bin/env python
"""PyTorch FSDP baseline: the benchmark GPT under
``torch.distributed.fsdp.FullyShardedDataParallel`` on CPU with gloo.

Runs ``world`` processes (``torch.multiprocessing.spawn``), each with
``--threads`` intra-op threads, wraps every ``Block`` as an FSDP unit
(``ModuleWrapPolicy({Block})``, ``device_id=torch.device("cpu")``), trains
with Adam on its slice of the same global batch as the JAX benchmark and
reports the median step time (per step, the slowest rank). With
``--weights`` (an ``.npz`` written by ``benchmarks/run.py``) the model starts
from the same weights as the JAX runs, so the first-step loss can be
compared with JAX's.

torch is optional: ``benchmarks/run.py`` skips this baseline when it is not
installed. Standalone use:

    python benchmarks/torch_fsdp.py --world 8 --steps 5 --json /tmp/torch.json

``--serve`` keeps the ranks alive and runs one step per ``step`` line on
stdin, printing ``STEP {"time_s": ..., "loss": ...}``; ``run.py`` uses it to
interleave PyTorch steps with the JAX measurements round by round, so that
load from other processes on a shared machine hits all variants alike.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import GPTConfig, make_batch  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Attention(nn.Module):
  def __init__(self, d, heads):
    super().__init__()
    self.heads = heads
    self.qkv = nn.Linear(d, 3 * d)
    self.proj = nn.Linear(d, d)

  def forward(self, x):
    b, t, d = x.shape
    q, k, v = self.qkv(x).split(d, dim=-1)
    q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(out.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
  def __init__(self, d):
    super().__init__()
    self.fc = nn.Linear(d, 4 * d)
    self.proj = nn.Linear(4 * d, d)

  def forward(self, x):
    return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
  """Same layout as ``benchmarks.models.Block`` (flax LayerNorm eps 1e-6)."""

  def __init__(self, d, heads):
    super().__init__()
    self.ln_1 = nn.LayerNorm(d, eps=1e-6)
    self.attn = Attention(d, heads)
    self.ln_2 = nn.LayerNorm(d, eps=1e-6)
    self.mlp = MLP(d)

  def forward(self, x):
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
  def __init__(self, cfg: GPTConfig):
    super().__init__()
    self.tok_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
    self.pos_embed = nn.Embedding(cfg.seq_len, cfg.d_model)
    self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.num_heads) for _ in range(cfg.num_layers))
    self.ln_f = nn.LayerNorm(cfg.d_model, eps=1e-6)
    self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size)

  def forward(self, tokens, targets):
    t = tokens.shape[1]
    x = self.tok_embed(tokens) + self.pos_embed(torch.arange(t))
    for blk in self.blocks:
      x = blk(x)
    logits = self.lm_head(self.ln_f(x)).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long())


def torch_name(flax_name: str) -> tuple[str, bool]:
  """``params.block_3.attn.qkv.kernel`` -> (``blocks.3.attn.qkv.weight``,
  transpose?)."""
  parts = flax_name.split(".")[1:]  # drop "params"
  if parts[0].startswith("block_"):
    parts = ["blocks", parts[0][len("block_"):]] + parts[1:]
  leaf = parts[-1]
  transpose = False
  if leaf == "kernel":
    parts[-1], transpose = "weight", True
  elif leaf == "scale":
    parts[-1] = "weight"
  elif leaf == "embedding":
    parts[-1] = "weight"
  return ".".join(parts), transpose


def load_weights(model: nn.Module, path: str) -> None:
  data = np.load(path)
  state = model.state_dict()
  loaded = set()
  for key in data.files:
    name, transpose = torch_name(key)
    w = torch.from_numpy(np.ascontiguousarray(data[key].T if transpose else data[key]))
    if state[name].shape != w.shape:
      raise ValueError(f"{key} -> {name}: shape {tuple(w.shape)} != {tuple(state[name].shape)}")
    state[name].copy_(w)
    loaded.add(name)
  missing = set(state) - loaded
  if missing:
    raise ValueError(f"weights file lacks {sorted(missing)}")


def _setup(rank, world, args, port):
  from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
  from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
  from torch.distributed.fsdp.wrap import ModuleWrapPolicy

  torch.set_num_threads(args.threads)
  dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                          world_size=world)
  cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
                  num_layers=args.layers, num_heads=args.heads)
  torch.manual_seed(0)
  model = GPT(cfg)
  if args.weights:
    with torch.no_grad():
      load_weights(model, args.weights)
  n_params = sum(p.numel() for p in model.parameters())
  strategy = ShardingStrategy[args.strategy]
  kw = {}
  if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
    # An explicit 2-D mesh: without it PyTorch 2.13 silently uses a shard
    # group of 1 on CPU (see DESIGN.md).
    from torch.distributed.device_mesh import init_device_mesh
    kw["device_mesh"] = init_device_mesh("cpu", (args.replicate, world // args.replicate))
  mp_policy = None
  if args.precision == "bf16":
    mp_policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
  model = FSDP(model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}),
               mixed_precision=mp_policy, device_id=torch.device("cpu"), **kw)
  opt = torch.optim.Adam(model.parameters(), lr=1e-3)
  batch = make_batch(cfg, args.global_batch, seed=args.seed)
  per = args.global_batch // world
  inp = torch.from_numpy(batch["inputs"][rank * per:(rank + 1) * per]).long()
  tgt = torch.from_numpy(batch["targets"][rank * per:(rank + 1) * per]).long()

  def step():
    """One timed train step: the slowest rank's seconds, the CPU seconds of
    all ranks together (user + system, each process's threads included)
    and the global mean loss."""
    dist.barrier()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    loss = model(inp, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    stats = torch.tensor([dt], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    sums = torch.tensor([(r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
                         r1.ru_stime - r0.ru_stime, r1.ru_minflt - r0.ru_minflt,
                         float(loss.detach())], dtype=torch.float64)
    dist.all_reduce(sums)
    return {"time_s": float(stats[0]), "cpu_s": float(sums[0]), "sys_s": float(sums[1]),
            "minflt": float(sums[2]), "loss": float(sums[3]) / world}

  return step, n_params


def _rss() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(rank, world, args, port, cmd_q, res_q):
  """Standalone: run warmup + steps. Serve: wait for commands from the
  launcher (``"step"`` / ``"quit"``) so that another program (run.py) can
  interleave PyTorch steps with its own measurements."""
  try:
    step, n_params = _setup(rank, world, args, port)
    if rank == 0:
      res_q.put(("ready", {"num_params": n_params}))
    n = args.warmup + args.steps
    i = 0
    while True:
      if args.serve:
        flag = torch.zeros(1, dtype=torch.int64)
        if rank == 0:
          flag[0] = 1 if cmd_q.get() == "step" else 0
        dist.broadcast(flag, src=0)
        if not int(flag[0]):
          break
      elif i >= n:
        break
      d = step()
      i += 1
      if rank == 0:
        res_q.put(("step", d))
    rss = [None] * world
    dist.all_gather_object(rss, _rss())
    if rank == 0:
      res_q.put(("done", {"max_rss_bytes_per_process": rss}))
    dist.barrier()
    dist.destroy_process_group()
  except Exception as e:  # report instead of hanging the launcher
    import traceback
    res_q.put(("error", {"rank": rank, "error": repr(e), "trace": traceback.format_exc()}))
    raise


class _Group:
  """The ``world`` spawned ranks and the launcher's end of their queues."""

  def __init__(self, args):
    ctx = mp.get_context("spawn")
    self.cmd_q, self.res_q = ctx.Queue(), ctx.Queue()
    self.procs = mp.start_processes(
        _worker, args=(args.world, args, _free_port(), self.cmd_q, self.res_q),
        nprocs=args.world, join=False, start_method="spawn")

  def get(self, timeout=900):
    kind, data = self.res_q.get(timeout=timeout)
    if kind == "error":
      raise RuntimeError(f"torch rank {data['rank']} failed: {data['error']}\n{data['trace']}")
    return kind, data

  def join(self):
    while not self.procs.join():
      pass


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--world", type=int, default=8)
  p.add_argument("--strategy", default="FULL_SHARD",
                 choices=("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"))
  p.add_argument("--replicate", type=int, default=2, help="HYBRID_SHARD replicate size")
  p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                 help="bf16: MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)")
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
  p.add_argument("--global-batch", type=int, default=8)
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--d-model", type=int, default=512)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--vocab", type=int, default=256)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--weights", default=None, help=".npz of flax parameters (dotted names)")
  p.add_argument("--json", default=None, help="where to write the results (standalone mode)")
  p.add_argument("--serve", action="store_true",
                 help="print READY, then run one step per 'step' line on stdin "
                      "(used by benchmarks/run.py to interleave measurements)")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  if args.global_batch % args.world:
    sys.exit(f"--global-batch {args.global_batch} is not a multiple of --world {args.world}")
  t0 = time.perf_counter()
  group = _Group(args)
  _, ready = group.get()
  info = {"strategy": args.strategy, "precision": args.precision, "world": args.world,
          "threads_per_process": args.threads, "num_params": ready["num_params"],
          "global_batch": args.global_batch, "seq_len": args.seq_len,
          "torch_version": torch.__version__, "setup_s": time.perf_counter() - t0}
  if args.serve:
    # Line protocol on stdin/stdout: "step" -> "STEP {json}", "quit" -> "DONE {json}".
    print("READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
      cmd = line.strip()
      if cmd not in ("step", "quit"):
        continue
      group.cmd_q.put(cmd)
      if cmd == "quit":
        break
      _, data = group.get()
      print("STEP " + json.dumps(data), flush=True)
    else:
      group.cmd_q.put("quit")
    _, done = group.get()
    group.join()
    print("DONE " + json.dumps(done), flush=True)
    return
  steps = [group.get()[1] for _ in range(args.warmup + args.steps)]
  _, done = group.get()
  group.join()
  timed = [s["time_s"] for s in steps[args.warmup:]]
  out = dict(info, step_times_s=timed, warmup_times_s=[s["time_s"] for s in steps[:args.warmup]],
             median_s=statistics.median(timed), losses=[s["loss"] for s in steps],
             cpu_s=[s["cpu_s"] for s in steps[args.warmup:]],
             wall_s=time.perf_counter() - t0, **done)
  with open(args.json, "w") as f:
    json.dump(out, f, indent=1)
  print(f"torch FSDP {args.strategy}/{args.precision} world {args.world}: median step "
        f"{out['median_s'] * 1e3:.0f} ms, losses {out['losses'][0]:.5f} -> "
        f"{out['losses'][-1]:.5f}, wall {out['wall_s']:.0f}s")


if __name__ == "__main__":
  main()
