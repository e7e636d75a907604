#!/usr/bin/env python
"""Train a small GPT-style character-level language model with fsdp_jax.

This is fsdp_jax's main example. It runs offline on a fresh machine: by
default the training text is the source code of a few modules of Python's
standard library (so it ships with every Python), or any text file given with
``--text PATH``.

Without a GPU the script simulates 8 CPU devices (``--cpu-devices``), so
every sharding strategy can be tried on a laptop:

    python examples/train_gpt.py
    python examples/train_gpt.py --strategy SHARD_GRAD_OP --use-orig-params
    python examples/train_gpt.py --strategy HYBRID_SHARD --replicate 2
    python examples/train_gpt.py --wrap size --print-plan
    python examples/train_gpt.py --precision bf16 --max-norm 1.0 --accumulate 2
    python examples/train_gpt.py --offload   # params + optimizer state in host memory

Checkpoints (orbax, through ``fsdp_jax.CheckpointManager``) and resuming a
run that was interrupted (keep ``--steps``: the learning-rate schedule
depends on it). A checkpoint holds the train state and the data position
(the number of the next global batch), so the resumed run continues exactly
like an uninterrupted one:

    python examples/train_gpt.py --steps 200 --checkpoint-dir /tmp/gpt --save-every 50
    python examples/train_gpt.py --steps 200 --checkpoint-dir /tmp/gpt --resume

With ``--checkpoint-dir`` a SIGTERM (preemption: SLURM, Kubernetes, a cloud
spot instance, or ``kill``) does not lose the steps since the last
checkpoint: every process finishes its step, they all stop after the same
one, save it, and exit with status 75 ("restart me"). Run with ``--resume``
from the start and the job can be restarted as often as needed, by the
launcher after a failure (``--max-restarts``) or by the scheduler:

    python -m fsdp_jax.launch --nproc 2 --devices-per-proc 4 --platform cpu \\
        --max-restarts 3 examples/train_gpt.py --checkpoint-dir /tmp/gpt --resume

Several processes (like ``torchrun``), here 2 processes x 4 simulated CPU
devices; each process feeds its own half of every global batch and only
process 0 prints:

    python -m fsdp_jax.launch --nproc 2 --devices-per-proc 4 --platform cpu \\
        examples/train_gpt.py --steps 50

The steps, in the order PyTorch users know them:

1. pick the devices (``fsdp_jax.simulate_cpu_devices`` before JAX starts, or
   ``fsdp_jax.distributed.initialize()`` under the launcher);
2. build a mesh (``fsdp_jax.make_mesh``) and an ``fsdp_jax.FSDPConfig``
   (sharding strategy, auto-wrap policy, mixed precision, ``use_orig_params``,
   ``cpu_offload``);
3. ``fsdp_jax.init_train_state(init_fn=...)`` materialises the model straight
   into its shards (PyTorch: wrapping the module in ``FullyShardedDataParallel``),
   or ``CheckpointManager.restore`` loads a saved one;
4. ``fsdp_jax.shard_train_step(loss_fn, ...)`` builds the jitted train step
   (with ``max_norm=``: PyTorch's ``clip_grad_norm_``; with
   ``gradient_accumulation_steps=``: ``no_sync()`` accumulation);
   ``loss_fn`` is ordinary single-device code over the full parameter tree;
5. ``fsdp_jax.shard_eval_step(eval_loss)`` evaluates the held-out tenth of
   the text every ``--eval-every`` steps: the train step's forward, sharded
   the same way, without the backward (PyTorch: ``model.eval()`` and a
   forward under ``torch.no_grad()``); it prints the loss and perplexity;
6. ``fsdp_jax.summon_full_params(state)`` gathers the parameters back, here to
   generate a sample (PyTorch: ``summon_full_params``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import math
import os
import sys
import time

# Importing jax, flax, optax or fsdp_jax does not start a JAX backend; only the
# first computation or jax.devices() call does. configure_devices() (or
# fsdp_jax.distributed.initialize() under the launcher) runs first thing in
# main(), before any of that, so it can still choose the platform and the
# number of simulated CPU devices.
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

import fsdp_jax

try:  # Optional progress bar (pip install fsdp_jax[examples]).
  from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - depends on the environment
  tqdm = None

# Standard-library modules whose source is the default training text.
DEFAULT_TEXT_MODULES = ("textwrap", "string", "functools", "argparse")

STRATEGIES = tuple(s.name for s in fsdp_jax.ShardingStrategy)

# Assumed dense peak TFLOP/s of one device, (bf16, fp32), for the MFU estimate.
# fp32 on these GPUs means TF32 tensor cores (XLA's default for fp32 matmuls).
# SXM parts; PCIe cards are slower. Anything else: pass --peak-tflops.
GPU_PEAK_TFLOPS = {"H200": (989.0, 495.0), "H100": (989.0, 495.0),
                   "A100": (312.0, 156.0)}
# The CPU "peak" is a nominal 1 TFLOP/s per process (all its simulated
# devices share the host's cores): enough to compare runs, not a measurement.
CPU_PEAK_TFLOPS = 1.0


# ---------------------------------------------------------------------------
# Devices


def launched() -> bool:
  """Whether ``python -m fsdp_jax.launch``, srun or mpirun started this process
  as one of several.

  Then ``fsdp_jax.distributed.initialize()`` sets up the devices and joins the
  other processes, instead of this script simulating CPU devices itself."""
  if "FSDP_JAX_DEVICES_PER_PROC" in os.environ:  # python -m fsdp_jax.launch
    return True
  # srun / mpirun with several tasks: jax.distributed detects the cluster.
  for var in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
    if int(os.environ.get(var, "1") or 1) > 1:
      return True
  return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def configure_devices(platform: str, cpu_devices: int) -> str:
  """Chooses the JAX platform; must run before JAX initialises a backend.

  ``auto`` follows ``JAX_PLATFORMS`` when it is set, else uses GPUs when
  ``nvidia-smi`` finds one. On CPU, ``cpu_devices`` devices are simulated
  (with fsdp_jax's CPU XLA flags) so that sharding is real, not a no-op.

  Returns ``"cpu"`` or ``"gpu"``.
  """
  if platform == "auto":
    platform = fsdp_jax.distributed.detect_platform()
  if platform == "cpu":
    try:
      fsdp_jax.simulate_cpu_devices(cpu_devices)
      jax.config.update("jax_platforms", "cpu")  # don't probe for accelerators
    except RuntimeError:
      # JAX already started in this process (e.g. main() called twice, or from
      # a notebook): keep the devices it has.
      print(f"note: JAX is already initialised; using its {jax.device_count()} "
            "devices instead of simulating --cpu-devices")
  return platform


# ---------------------------------------------------------------------------
# Data: characters -> integer tokens, random windows as batches


def load_text(path: str | None) -> tuple[str, str]:
  """Returns ``(text, description)``: the file at ``path``, or by default the
  source of a few standard-library modules (their docstrings if the sources
  were stripped from this Python install)."""
  if path is not None:
    with open(path, encoding="utf-8", errors="replace") as f:
      return f.read(), path
  parts = []
  for name in DEFAULT_TEXT_MODULES:
    module = importlib.import_module(name)
    try:
      parts.append(inspect.getsource(module))
    except (OSError, TypeError):  # a Python shipped without .py sources
      parts.extend(doc for obj in vars(module).values()
                   if isinstance(doc := getattr(obj, "__doc__", None), str))
  desc = "source of stdlib modules " + ", ".join(DEFAULT_TEXT_MODULES)
  return "\n".join(parts), desc


class CharData:
  """A character vocabulary, a random-window batch sampler over the first
  nine tenths of the text, and the last tenth held out for evaluation."""

  def __init__(self, text: str, seed: int):
    self.chars = sorted(set(text))
    self.index = {c: i for i, c in enumerate(self.chars)}
    tokens = self.encode(text)
    self.tokens, self.held_out = tokens[:len(tokens) * 9 // 10], tokens[len(tokens) * 9 // 10:]
    self.seed = seed

  @property
  def vocab_size(self) -> int:
    return len(self.chars)

  def encode(self, s: str) -> np.ndarray:
    # Characters outside the vocabulary (e.g. in --prompt) map to token 0.
    return np.array([self.index.get(c, 0) for c in s], dtype=np.int32)

  def decode(self, ids) -> str:
    return "".join(self.chars[int(i)] for i in ids)

  def batch(self, batch_size: int, seq_len: int, *, step: int, process: int = 0,
            num_processes: int = 1) -> dict:
    """Process ``process``'s rows of global batch number ``step``: inputs and
    next-character targets of random windows.

    The global batch (``batch_size`` windows) depends only on ``(seed,
    step)``; each of ``num_processes`` processes takes its own equal, disjoint
    slice of it, in process order. So every process feeds different rows,
    the global batch is the same for any number of processes, and a run
    resumed from a checkpoint sees the batches of the uninterrupted run."""
    rng = np.random.default_rng((self.seed, step))
    starts = rng.integers(0, len(self.tokens) - seq_len - 1, size=batch_size)
    per = batch_size // num_processes
    starts = starts[process * per:(process + 1) * per]
    windows = np.stack([self.tokens[s:s + seq_len + 1] for s in starts])
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}

  def eval_batch(self, batch_size: int, seq_len: int, *, index: int, count: int,
                 process: int = 0, num_processes: int = 1) -> dict:
    """Process ``process``'s rows of held-out batch ``index`` of ``count``:
    the held-out split cut into ``count * batch_size`` evenly spaced
    windows, the same in every evaluation."""
    starts = np.linspace(0, len(self.held_out) - seq_len - 1, count * batch_size)
    starts = starts.astype(np.int64)[index * batch_size:(index + 1) * batch_size]
    per = batch_size // num_processes
    starts = starts[process * per:(process + 1) * per]
    windows = np.stack([self.held_out[s:s + seq_len + 1] for s in starts])
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}


# ---------------------------------------------------------------------------
# Model: a pre-LayerNorm GPT in Flax linen


class CausalSelfAttention(nn.Module):
  """Multi-head self-attention where position t only sees positions <= t."""

  num_heads: int

  @nn.compact
  def __call__(self, x):
    batch, seq, d_model = x.shape
    head_dim = d_model // self.num_heads
    qkv = nn.Dense(3 * d_model, name="qkv")(x)
    q, k, v = jnp.split(qkv.reshape(batch, seq, 3 * self.num_heads, head_dim), 3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    # The softmax runs in float32 also under bf16 mixed precision.
    weights = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, d_model)
    return nn.Dense(d_model, name="proj")(out)


class MLP(nn.Module):
  """The position-wise feed-forward network (4x expansion, GELU)."""

  @nn.compact
  def __call__(self, x):
    d_model = x.shape[-1]
    h = nn.gelu(nn.Dense(4 * d_model, name="fc")(x))
    return nn.Dense(d_model, name="proj")(h)


class Block(nn.Module):
  """A pre-LN transformer block; ``--wrap block`` makes each one an FSDP unit."""

  num_heads: int

  @nn.compact
  def __call__(self, x):
    x = x + CausalSelfAttention(self.num_heads, name="attn")(nn.LayerNorm(name="ln_1")(x))
    return x + MLP(name="mlp")(nn.LayerNorm(name="ln_2")(x))


class GPT(nn.Module):
  """Token + position embeddings, ``num_layers`` blocks, final LN, LM head."""

  vocab_size: int
  max_len: int
  d_model: int
  num_layers: int
  num_heads: int

  @nn.compact
  def __call__(self, tokens):
    seq = tokens.shape[1]
    x = nn.Embed(self.vocab_size, self.d_model, name="tok_embed")(tokens)
    x = x + nn.Embed(self.max_len, self.d_model, name="pos_embed")(jnp.arange(seq))
    for i in range(self.num_layers):
      x = Block(self.num_heads, name=f"block_{i}")(x)
    x = nn.LayerNorm(name="ln_f")(x)
    return nn.Dense(self.vocab_size, name="lm_head")(x)  # logits


# ---------------------------------------------------------------------------
# FSDP setup


def make_wrap_policy(kind: str, min_num_params: int):
  """The auto-wrap policy: which subtrees become FSDP units."""
  if kind == "block":
    # Class-based, like PyTorch's ModuleWrapPolicy({TransformerBlock}).
    # init_train_state(init_fn=...) records which linen class owns each subtree.
    return fsdp_jax.ModuleWrapPolicy({Block})
  if kind == "size":
    return functools.partial(fsdp_jax.size_based_auto_wrap_policy,
                             min_num_params=min_num_params)
  return None  # the whole model is one (root) unit


def make_mixed_precision(precision: str):
  """``bf16``: PyTorch's usual ``MixedPrecision(param_dtype=torch.bfloat16,
  reduce_dtype=torch.float32)``: units are cast to bf16 before their
  all-gather (half the bytes), compute runs in bf16, gradients are reduced in
  fp32, and the sharded master weights and Adam state stay fp32."""
  if precision == "bf16":
    return fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
  return None


def make_mesh(strategy: fsdp_jax.ShardingStrategy, replicate: int | None, say=print):
  """A 2-D ``("replicate", "shard")`` mesh for the hybrid strategies, else 1-D.

  With several processes, ``make_mesh`` orders the devices process by process,
  so the hybrid default (one replica group per process) shards within a
  process and replicates across processes."""
  if strategy.name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
    default = jax.process_count() if jax.process_count() > 1 else 2
    return fsdp_jax.make_mesh(replicate=replicate or default)
  if replicate is not None:
    say(f"note: --replicate is only used by the hybrid strategies; "
        f"{strategy.name} shards over all devices.")
  return fsdp_jax.make_mesh()


def place_batch(local_batch: dict, sharding: NamedSharding) -> dict:
  """Places this process's rows of the global batch on the mesh, split along
  dim 0 over the data-parallel axes as the step expects. With one process
  the local batch is the global batch; with several, the global array is
  assembled from every process's rows, in process order. (Passing host arrays
  to the step also works; this just avoids a reshard.)"""
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x),
                      local_batch)


def state_bytes_per_device(state) -> tuple[int, int]:
  """Bytes of params + optimizer state on one device, and in total."""
  leaves = jax.tree.leaves((state.params, state.opt_state))
  per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
  return per_device, sum(x.nbytes for x in leaves)


# ---------------------------------------------------------------------------
# Throughput and MFU (an estimate)


def flops_per_token(plan, num_layers: int, d_model: int, seq_len: int) -> int:
  """Model FLOPs per trained token: ``6 N + 12 L d T``.

  ``N`` counts the parameters used in matmuls (the embedding tables are
  lookups, so they are left out; the LM head is counted): forward and
  backward cost about 6 FLOPs per parameter per token. The attention scores
  and the weighted sum of values add ``12 L d T`` (PaLM's appendix B; this
  model computes the full ``T x T`` scores, masked or not). Recomputation is
  not counted (it is *model* FLOPs)."""
  n = sum(int(np.prod(leaf.shape)) for leaf in plan.leaves if "_embed." not in leaf.name)
  return 6 * n + 12 * num_layers * d_model * seq_len


def default_peak_tflops(platform: str, device_kind: str, precision: str):
  """The assumed peak TFLOP/s of one device (GPU) or one process (CPU), or
  None when unknown."""
  if platform == "cpu":
    return CPU_PEAK_TFLOPS
  for name, (bf16, fp32) in GPU_PEAK_TFLOPS.items():
    if name in device_kind.upper():
      return bf16 if precision == "bf16" else fp32
  return None


class Throughput:
  """Tokens/s and MFU over the steps since the last report; the first step
  of a run (compilation) is only used when nothing else is available."""

  def __init__(self, tokens_per_step: int, flops_per_token: int, peak_flops):
    self.tokens_per_step = tokens_per_step
    self.flops_per_token = flops_per_token
    self.peak_flops = peak_flops
    self.window = []   # step times since the last report
    self.first = None  # the first step's time (includes compilation)
    self.steady = []   # every step time after the first

  def add(self, seconds: float) -> None:
    if self.first is None:
      self.first = seconds
      return
    self.window.append(seconds)
    self.steady.append(seconds)

  def _rates(self, times):
    tok_s = self.tokens_per_step * len(times) / sum(times)
    mfu = (tok_s * self.flops_per_token / self.peak_flops if self.peak_flops else None)
    return tok_s, mfu

  def report(self):
    """``(tokens/s, mfu or None, compiling)`` over the window, which is then
    reset; ``compiling``: only the first step (with compilation) was timed."""
    compiling = not self.window
    times = self.window or [self.first]
    self.window = []
    return (*self._rates(times), compiling)

  def overall(self):
    return self._rates(self.steady) if self.steady else None


def fmt_mfu(mfu) -> str:
  return "n/a" if mfu is None else f"{100 * mfu:.2f}%"


# ---------------------------------------------------------------------------
# Sampling


def generate(model: GPT, params, data: CharData, prompt: str, num_chars: int) -> str:
  """Greedy decoding with the full (gathered) parameters.

  The context lives in a fixed-size buffer so that one compiled function
  serves every step: thanks to the causal mask, the unused (zero) positions
  after the cursor do not affect the logits at the cursor.
  """
  max_len = model.max_len

  @jax.jit
  def next_token(params, buf, pos):
    logits = model.apply(params, buf[None])[0]
    return jnp.argmax(logits[pos])

  ids = list(data.encode(prompt)) or [0]
  for _ in range(num_chars):
    context = ids[-max_len:]
    buf = np.zeros(max_len, np.int32)
    buf[:len(context)] = context
    ids.append(int(next_token(params, buf, len(context) - 1)))
  return data.decode(ids)


# ---------------------------------------------------------------------------
# Main


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
  """Shows defaults, except None (an option that is off unless given)."""

  def _get_help_string(self, action):
    if action.default is None:
      return action.help
    return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      epilog="Multi-process: run under `python -m fsdp_jax.launch --nproc N "
             "[--devices-per-proc M] examples/train_gpt.py ...`; the script then calls "
             "fsdp_jax.distributed.initialize() (the launcher's devices replace "
             "--platform/--cpu-devices), each process feeds --batch-size / N rows of "
             "every global batch, and only process 0 prints.",
      formatter_class=_HelpFormatter)
  g = p.add_argument_group("FSDP")
  g.add_argument("--strategy", choices=STRATEGIES, default="FULL_SHARD",
                 help="sharding strategy (torch.distributed.fsdp.ShardingStrategy)")
  g.add_argument("--use-orig-params", action="store_true",
                 help="keep the original parameter tree (each leaf sharded on dim 0) "
                      "instead of one flat parameter per unit")
  g.add_argument("--wrap", choices=("block", "size", "none"), default="block",
                 help="auto-wrap policy: one unit per transformer Block (class-based), "
                      "size-based, or the whole model as one unit")
  g.add_argument("--min-num-params", type=int, default=20_000,
                 help="min_num_params of the size-based policy (--wrap size)")
  g.add_argument("--replicate", type=int, default=None,
                 help="size of the 'replicate' mesh axis for the hybrid strategies "
                      "(None: the number of processes, or 2 with one process)")
  g.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                 help="bf16: MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32): "
                      "bf16 gathers and compute, fp32 gradient reduction and master weights")
  g.add_argument("--offload", action="store_true",
                 help="CPUOffload(offload_params=True): keep the sharded params and "
                      "optimizer state in host memory (pinned_host); each step copies "
                      "the shards to the device for the gathers and runs the optimizer "
                      "on the host")
  g.add_argument("--print-plan", action="store_true",
                 help="print the FSDP plan: units, leaves, bytes per device")
  d = p.add_argument_group("devices")
  d.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                 help="auto: GPUs if JAX_PLATFORMS says so or nvidia-smi finds one, "
                      "else simulated CPU devices")
  d.add_argument("--cpu-devices", type=int, default=8,
                 help="number of simulated CPU devices when running on CPU")
  m = p.add_argument_group("model")
  m.add_argument("--d-model", type=int, default=64, help="embedding width")
  m.add_argument("--layers", type=int, default=2, help="number of transformer blocks")
  m.add_argument("--heads", type=int, default=4, help="attention heads per block")
  t = p.add_argument_group("training")
  t.add_argument("--text", default=None, metavar="PATH",
                 help="UTF-8 text file to train on (default: Python stdlib sources)")
  t.add_argument("--steps", type=int, default=200,
                 help="optimizer steps in total (with --resume: including the "
                      "checkpoint's steps)")
  t.add_argument("--batch-size", type=int, default=16,
                 help="global batch size (a multiple of the number of devices)")
  t.add_argument("--seq-len", type=int, default=64, help="context length in characters")
  t.add_argument("--lr", type=float, default=1e-2, help="peak AdamW learning rate")
  t.add_argument("--max-norm", type=float, default=None,
                 help="clip gradients to this total norm (PyTorch's clip_grad_norm_, "
                      "over all shards); the log shows the pre-clip norm")
  t.add_argument("--accumulate", type=int, default=1, metavar="K",
                 help="gradient accumulation: split each device's part of every global "
                      "batch into K microbatches (PyTorch's no_sync()); the global batch "
                      "per optimizer step stays --batch-size")
  t.add_argument("--seed", type=int, default=0, help="seed for init and batches")
  t.add_argument("--log-every", type=int, default=20,
                 help="print a progress line every N steps (when stderr is not a "
                      "terminal or tqdm is not installed; else a progress bar)")
  t.add_argument("--peak-tflops", type=float, default=None,
                 help="assumed peak TFLOP/s for the MFU estimate: of one GPU, or of one "
                      f"process's host on CPU (default: {CPU_PEAK_TFLOPS:g} on CPU; "
                      "989 bf16 / 495 fp32 (TF32) on H100/H200; 312/156 on A100; "
                      "else MFU is not shown)")
  t.add_argument("--eval-every", type=int, default=50, metavar="N",
                 help="evaluate the held-out tenth of the text every N steps and after the "
                      "last (0: never)")
  t.add_argument("--eval-batches", type=int, default=2,
                 help="held-out batches (of --batch-size windows) per evaluation")
  t.add_argument("--sample-chars", type=int, default=40,
                 help="characters to generate after training (0: none)")
  t.add_argument("--prompt", default=None,
                 help="prompt for the generated sample (default: 'def ', or the "
                      "first 16 characters of --text)")
  c = p.add_argument_group("checkpoints")
  c.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                 help="save the train state and the data position here with "
                      "fsdp_jax.CheckpointManager (every --save-every steps, at the end, "
                      "and on SIGTERM, which then exits with status 75)")
  c.add_argument("--save-every", type=int, default=100, metavar="N",
                 help="checkpoint every N steps (and at the last step)")
  c.add_argument("--keep", type=int, default=3,
                 help="number of checkpoints to keep (max_to_keep)")
  c.add_argument("--resume", action="store_true",
                 help="restore the latest checkpoint in --checkpoint-dir and continue "
                      "from its step and data position up to --steps (starts from "
                      "scratch if there is none, so it is safe to pass on every start)")
  args = p.parse_args(argv)
  if args.d_model % args.heads:
    p.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
  if args.steps < 1:
    p.error("--steps must be at least 1")
  if args.accumulate < 1:
    p.error("--accumulate must be at least 1")
  if args.max_norm is not None and not args.max_norm > 0:
    p.error("--max-norm must be positive")
  if args.save_every < 1:
    p.error("--save-every must be at least 1")
  if args.log_every < 1:
    p.error("--log-every must be at least 1")
  if args.eval_every < 0 or args.eval_batches < 1:
    p.error("--eval-every must be >= 0 and --eval-batches >= 1")
  if args.resume and args.checkpoint_dir is None:
    p.error("--resume needs --checkpoint-dir")
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  # 1. Devices: before anything makes JAX start a backend.
  if launched():
    # Started by python -m fsdp_jax.launch: initialize() sets up this
    # process's devices (the launcher's --devices-per-proc) and joins the
    # others through jax.distributed. Under srun/mpirun (no launcher) the
    # failure hooks make a crashing process stop the others promptly; the
    # launcher installs them itself, so there this call does nothing.
    fsdp_jax.distributed.install_failure_hooks()
    info = fsdp_jax.distributed.initialize()
    platform = info.platform
  else:
    platform = configure_devices(args.platform, args.cpu_devices)
  devices = jax.devices()
  if platform == "gpu" and devices[0].platform == "cpu":
    sys.exit("--platform gpu: JAX found no GPU (is jax[cuda] installed?); "
             "use --platform cpu to simulate devices instead.")
  rank, nproc = jax.process_index(), jax.process_count()
  is_main = rank == 0
  say = print if is_main else (lambda *a, **k: None)  # only process 0 prints
  where = f" in {nproc} processes ({jax.local_device_count()} each)" if nproc > 1 else ""
  say(f"devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}){where}")

  # Data.
  text, source = load_text(args.text)
  data = CharData(text, args.seed)
  if min(len(data.tokens), len(data.held_out)) <= args.seq_len + 1:
    sys.exit(f"The text has {len(data.tokens) + len(data.held_out)} characters; its training "
             f"nine tenths and its held-out tenth each need more than --seq-len + 1 = "
             f"{args.seq_len + 1}.")
  say(f"text: {source}: {len(data.tokens) + len(data.held_out):,} characters "
      f"({len(data.held_out):,} held out for evaluation), vocabulary {data.vocab_size}")

  # 2. Mesh and FSDP options.
  strategy = fsdp_jax.ShardingStrategy[args.strategy]
  mesh = make_mesh(strategy, args.replicate, say)
  if args.batch_size % mesh.size:
    sys.exit(f"--batch-size {args.batch_size} must be a multiple of the "
             f"{mesh.size} devices (each device gets an equal slice).")
  per_device = args.batch_size // mesh.size
  if per_device % args.accumulate:
    sys.exit(f"--accumulate {args.accumulate}: each device's {per_device} rows of the "
             f"global batch must split into {args.accumulate} equal microbatches; use a "
             f"--batch-size that is a multiple of {mesh.size * args.accumulate}.")
  config = fsdp_jax.FSDPConfig(
      sharding_strategy=strategy,
      auto_wrap_policy=make_wrap_policy(args.wrap, args.min_num_params),
      mixed_precision=make_mixed_precision(args.precision),
      use_orig_params=args.use_orig_params,
      cpu_offload=fsdp_jax.CPUOffload(offload_params=True) if args.offload else None)

  # Model and optimizer. The optimizer sees the model's own parameter tree and
  # computes what it computes unsharded (optax.clip_by_global_norm, masks and
  # multi_transform included); --max-norm is PyTorch's clip_grad_norm_ in the
  # step.
  model = GPT(vocab_size=data.vocab_size, max_len=args.seq_len, d_model=args.d_model,
              num_layers=args.layers, num_heads=args.heads)
  warmup = max(1, args.steps // 10)
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=args.lr, warmup_steps=warmup,
      decay_steps=max(args.steps, warmup + 1), end_value=args.lr / 10)
  optimizer = optax.adamw(schedule, b2=0.99, weight_decay=0.01)

  # 3. The sharded train state. With init_fn the full model never exists on
  # one device: each unit is initialised by its own program into its shards.
  dummy_tokens = np.zeros((1, args.seq_len), np.int32)

  def build_state():
    return fsdp_jax.init_train_state(
        init_fn=lambda rng: model.init(rng, dummy_tokens),
        rng=jax.random.key(args.seed), optimizer=optimizer, mesh=mesh, config=config)

  manager = None
  if args.checkpoint_dir is not None:
    # Every process opens the same directory; orbax coordinates the writes.
    manager = fsdp_jax.CheckpointManager(args.checkpoint_dir, max_to_keep=args.keep)
    # SIGTERM (preemption) now stops the loop below at a step every process
    # agrees on, instead of killing the job: see should_stop() there.
    fsdp_jax.distributed.handle_preemption()
  state = None
  next_batch = 1  # the data position: the number of the next global batch
  t0 = time.perf_counter()
  if args.resume:
    latest = manager.latest_step()
    if latest is None:
      say(f"resume: no finished checkpoint in {manager.directory}; starting from scratch")
    else:
      # The target only gives the plan and tree structure: build it abstractly
      # (jax.eval_shape allocates and initialises nothing), then restore.
      # The checkpoint may come from another mesh, strategy or layout.
      state = manager.restore(jax.eval_shape(build_state), step=latest)
      data_state = manager.data_state(latest)  # saved with the state, below
      next_batch = data_state["next_batch"] if data_state else latest + 1
      saved = manager.metadata(latest)["saved_with"]
      say(f"resumed from step {latest} in {manager.directory}, next batch {next_batch} "
          f"(saved with {saved['sharding_strategy']}, mesh {saved['mesh']}, "
          f"{saved['process_count']} process(es))")
  if state is None:
    state = build_state()
  jax.block_until_ready(state)
  start_step = int(state.step)  # the optimizer's step count (0 when fresh)
  say(f"{'restore' if start_step else 'init'}: {time.perf_counter() - t0:.1f}s, mesh "
      f"{dict(mesh.shape)}, {args.strategy}, {len(state.plan.units)} FSDP units "
      f"({'original' if args.use_orig_params else 'flat'} parameters, {args.precision}"
      f"{', params and optimizer state offloaded to host memory' if args.offload else ''})")
  if args.print_plan:
    say(state.plan)

  # 4. The train step. loss_fn is plain single-device code: it gets the full,
  # original parameter tree (units are gathered inside the step, in bf16 with
  # --precision bf16) and this device's slice of the batch.
  def loss_fn(params, batch):
    logits = model.apply(params, batch["inputs"]).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.mean(losses)

  train_step = fsdp_jax.shard_train_step(
      loss_fn, optimizer, mesh=mesh, config=config,
      max_norm=args.max_norm, gradient_accumulation_steps=args.accumulate,
      # Under mixed precision only the model's inputs are cast, not the
      # targets (PyTorch casts the forward's arguments only).
      forward_inputs=("inputs",))
  batch_sharding = NamedSharding(mesh, fsdp_jax.custom.batch_spec(state.plan))

  # 5. The eval step: the same forward, sharded the same way, no backward and
  # no optimizer state; the loss is the mean over every held-out token.
  def eval_loss(params, batch):
    logits = model.apply(params, batch["inputs"]).astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return fsdp_jax.WeightedLoss(total=jnp.sum(losses), weight=jnp.float32(losses.size))

  eval_step = fsdp_jax.shard_eval_step(eval_loss, forward_inputs=("inputs",))
  eval_batches = [place_batch(data.eval_batch(args.batch_size, args.seq_len, index=i,
                                              count=args.eval_batches, process=rank,
                                              num_processes=nproc), batch_sharding)
                  for i in range(args.eval_batches)] if args.eval_every else []
  evals = []

  def evaluate(at_step: int) -> None:
    loss = float(np.mean([float(eval_step(state, b)) for b in eval_batches]))
    evals.append((at_step, loss))
    say(f"eval {at_step:4d}  held-out loss {loss:.4f}  perplexity {math.exp(loss):.2f}")

  # Throughput, MFU (an estimate) and the stored state's size.
  bytes_dev, bytes_total = state_bytes_per_device(state)
  where_state = "host bytes/device" if args.offload else "bytes/device"
  n_params = sum(int(np.prod(leaf.shape)) for leaf in state.plan.leaves)
  tokens_per_step = args.batch_size * args.seq_len
  fpt = flops_per_token(state.plan, args.layers, args.d_model, args.seq_len)
  peak = args.peak_tflops
  if peak is None:
    peak = default_peak_tflops(platform, devices[0].device_kind, args.precision)
  peak_units = nproc if platform == "cpu" else len(devices)
  peak_flops = peak * 1e12 * peak_units if peak else None
  if peak:
    per = "per CPU process" if platform == "cpu" else "per device"
    times = f" x {peak_units}" if peak_units > 1 else ""
    peak_desc = f"an assumed peak of {peak:g} TFLOP/s {per}{times} (--peak-tflops)"
  else:
    peak_desc = "an unknown peak (pass --peak-tflops to see MFU)"
  say(f"MFU is an estimate: {fpt:,} model FLOPs/token (6 x params + attention) "
      f"over {peak_desc}")
  meter = Throughput(tokens_per_step, fpt, peak_flops)

  losses, norms, saved_steps = [], [], []
  steps = range(start_step + 1, args.steps + 1)
  if not steps:
    say(f"nothing to train: the state is at step {start_step} and --steps is {args.steps}")
  use_bar = tqdm is not None and is_main and sys.stderr.isatty() and len(steps) > 0
  bar = (tqdm(steps, desc=f"train {args.strategy} {args.precision}", unit="step")
         if use_bar else None)
  t_start = time.perf_counter()
  for step in (bar if bar is not None else steps):
    local = data.batch(args.batch_size, args.seq_len, step=next_batch, process=rank,
                       num_processes=nproc)  # this process's rows
    next_batch += 1
    batch = place_batch(local, batch_sharding)
    t_step = time.perf_counter()
    state, metrics = train_step(state, batch)  # the old state is donated
    loss = float(metrics["loss"])  # waits for the step
    meter.add(time.perf_counter() - t_step)
    losses.append(loss)
    norm = float(metrics["grad_norm"]) if args.max_norm is not None else None
    norms.append(norm)
    if bar is not None:
      tok_s, mfu, _ = meter.report()
      post = {"loss": f"{loss:.3f}"}
      if norm is not None:
        post["grad_norm"] = f"{norm:.3f}"
      post.update(tok_s=f"{tok_s:,.0f}", MFU=f"~{fmt_mfu(mfu)}",
                  state=f"{bytes_dev / 1024:,.0f}KiB/dev" + (" (host)" if args.offload else ""))
      bar.set_postfix(post)
    elif step % args.log_every == 0 or step == args.steps:
      tok_s, mfu, compiling = meter.report()
      line = f"step {step:4d}  loss {loss:.4f}"
      if norm is not None:
        line += f"  grad_norm {norm:.4f}"
      line += (f"  {tok_s:10,.0f} tokens/s  MFU~{fmt_mfu(mfu)}  "
               f"state {bytes_dev:,} {where_state}")
      if compiling:
        line += "  (first step: includes compilation)"
      say(line)
    if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
      evaluate(step)
    if manager is None:
      continue
    # True on every process after the same step once a SIGTERM reached any.
    stop = fsdp_jax.distributed.should_stop(step)
    if step % args.save_every == 0 or step == args.steps or stop:
      # Async: returns once the arrays are copied off the devices. The data
      # position goes into the same checkpoint.
      if manager.save(state, force=stop, data_state={"next_batch": next_batch}):
        saved_steps.append(step)
    if stop:
      manager.wait_until_finished()
      manager.close()
      if bar is not None:
        bar.close()
      say(f"preempted (SIGTERM): saved step {step} in {manager.directory}; exiting with "
          f"status {fsdp_jax.distributed.EXIT_RESTART} so that the job is restarted "
          "(run it with --resume)")
      sys.exit(fsdp_jax.distributed.EXIT_RESTART)
  if bar is not None:
    bar.close()
  t_end = time.perf_counter()

  # Results.
  if losses:
    say(f"first loss {losses[0]:.4f} -> final loss {losses[-1]:.4f} "
        f"(uniform guess: {math.log(data.vocab_size):.4f})")
    timing = (f"train time {t_end - t_start:.1f}s "
              f"({meter.first:.1f}s first step with compilation")
    overall = meter.overall()
    if overall is not None:
      steady = sum(meter.steady) / len(meter.steady)
      timing += (f", then {steady * 1e3:.0f} ms/step, {overall[0]:,.0f} tokens/s, "
                 f"MFU~{fmt_mfu(overall[1])} (estimate)")
    say(timing + ")")
  say(f"model: {n_params:,} parameters; stored params + optimizer state: "
      f"{bytes_dev:,} bytes per device (global arrays: {bytes_total:,} bytes)"
      + (", in host memory (--offload)" if args.offload else ""))
  if manager is not None:
    manager.wait_until_finished()
    if saved_steps:
      say(f"checkpoint: saved steps {saved_steps} in {manager.directory} "
          f"(kept: {manager.all_steps()})")
    manager.close()

  # 6. Gather the full parameters (replicated) and sample from the model.
  sample = ""
  if args.sample_chars > 0:
    params = fsdp_jax.summon_full_params(state)  # every process calls it (a collective)
    if nproc > 1:
      # Replicated, so each process can read it; process 0 samples alone on
      # its own first device, from a host copy.
      params = jax.device_get(params)
    if is_main:
      prompt = args.prompt
      if prompt is None:  # Python source starts many lines with "def "
        prompt = "def " if args.text is None else text[:16]
      sample = generate(model, params, data, prompt, args.sample_chars)
      say(f"sample (greedy): {sample!r}")
  return {"first_loss": losses[0] if losses else None,
          "final_loss": losses[-1] if losses else None, "losses": losses,
          "grad_norms": norms, "start_step": start_step, "final_step": int(state.step),
          "saved_steps": saved_steps, "bytes_per_device": bytes_dev, "sample": sample,
          "evals": evals}


if __name__ == "__main__":
  main()
