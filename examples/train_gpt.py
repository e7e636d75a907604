#!/usr/bin/env python
"""Train a small GPT-style character-level language model with fsdp_jax.

This is fsdp_jax's main example. It runs offline on a fresh machine: by
default the training text is the source code of a few modules of Python's
standard library (so it ships with every Python), or any text file given with
``--text PATH``.

Without a GPU the script simulates 8 CPU devices (``--cpu-devices``), so
every sharding strategy can be tried on a laptop:

    PYTHONPATH=. python examples/train_gpt.py
    PYTHONPATH=. python examples/train_gpt.py --strategy SHARD_GRAD_OP --use-orig-params
    PYTHONPATH=. python examples/train_gpt.py --strategy HYBRID_SHARD --replicate 2
    PYTHONPATH=. python examples/train_gpt.py --wrap size --print-plan

The steps, in the order PyTorch users know them:

1. pick the devices (``fsdp_jax.simulate_cpu_devices`` before JAX starts);
2. build a mesh (``fsdp_jax.make_mesh``) and an ``fsdp_jax.FSDPConfig``
   (sharding strategy, auto-wrap policy, ``use_orig_params``);
3. ``fsdp_jax.init_train_state(init_fn=...)`` materialises the model straight
   into its shards (PyTorch: wrapping the module in ``FullyShardedDataParallel``);
4. ``fsdp_jax.shard_train_step(loss_fn, ...)`` builds the jitted train step;
   ``loss_fn`` is ordinary single-device code over the full parameter tree;
5. ``fsdp_jax.full_params(state)`` gathers the parameters back, here to
   generate a sample (PyTorch: ``summon_full_params``).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import math
import os
import shutil
import subprocess
import sys
import time

# Importing jax, flax, optax or fsdp_jax does not start a JAX backend; only the
# first computation or jax.devices() call does. configure_devices() runs first
# thing in main(), before any of that, so it can still choose the platform and
# the number of simulated CPU devices.
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import fsdp_jax

try:  # Optional progress bar (pip install fsdp_jax[examples]).
  from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - depends on the environment
  tqdm = None

# Standard-library modules whose source is the default training text.
DEFAULT_TEXT_MODULES = ("textwrap", "string", "functools", "argparse")

STRATEGIES = tuple(s.name for s in fsdp_jax.ShardingStrategy)


# ---------------------------------------------------------------------------
# Devices


def gpu_available() -> bool:
  """Whether ``nvidia-smi`` exists and lists a GPU (never touches JAX)."""
  exe = shutil.which("nvidia-smi")
  if exe is None:
    return False
  try:
    out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.SubprocessError):
    return False
  return out.returncode == 0 and "GPU" in out.stdout


def configure_devices(platform: str, cpu_devices: int) -> str:
  """Chooses the JAX platform; must run before JAX initialises a backend.

  ``auto`` follows ``JAX_PLATFORMS`` when it is set, else uses GPUs when
  ``nvidia-smi`` finds one. On CPU, ``cpu_devices`` devices are simulated
  (with fsdp_jax's CPU XLA flags) so that sharding is real, not a no-op.

  Returns ``"cpu"`` or ``"gpu"``.
  """
  if platform == "auto":
    env = os.environ.get("JAX_PLATFORMS", "").lower()
    if env:
      platform = "gpu" if ("cuda" in env or "gpu" in env or "rocm" in env) else "cpu"
    else:
      platform = "gpu" if gpu_available() else "cpu"
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
  """A character vocabulary and a random-window batch sampler."""

  def __init__(self, text: str, seed: int):
    self.chars = sorted(set(text))
    self.index = {c: i for i, c in enumerate(self.chars)}
    self.tokens = self.encode(text)
    self.rng = np.random.default_rng(seed)

  @property
  def vocab_size(self) -> int:
    return len(self.chars)

  def encode(self, s: str) -> np.ndarray:
    # Characters outside the vocabulary (e.g. in --prompt) map to token 0.
    return np.array([self.index.get(c, 0) for c in s], dtype=np.int32)

  def decode(self, ids) -> str:
    return "".join(self.chars[int(i)] for i in ids)

  def batch(self, batch_size: int, seq_len: int) -> dict:
    """``batch_size`` random windows: inputs and next-character targets."""
    starts = self.rng.integers(0, len(self.tokens) - seq_len - 1, size=batch_size)
    windows = np.stack([self.tokens[s:s + seq_len + 1] for s in starts])
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
    weights = jax.nn.softmax(scores, axis=-1)
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


def make_mesh(strategy: fsdp_jax.ShardingStrategy, replicate: int | None):
  """A 2-D ``("replicate", "shard")`` mesh for the hybrid strategies, else 1-D."""
  if strategy.name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
    return fsdp_jax.make_mesh(replicate=replicate or 2)
  if replicate is not None:
    print(f"note: --replicate is only used by the hybrid strategies; "
          f"{strategy.name} shards over all devices.")
  return fsdp_jax.make_mesh()


def shard_batch(batch: dict, mesh) -> dict:
  """Places each batch leaf split along dim 0 over all mesh axes, as the step
  expects (passing host arrays also works; this just avoids a reshard)."""
  sharding = NamedSharding(mesh, P(tuple(mesh.axis_names)))
  return jax.device_put(batch, sharding)


def state_bytes_per_device(state) -> tuple[int, int]:
  """Bytes of params + optimizer state on one device, and in total."""
  leaves = jax.tree.leaves((state.params, state.opt_state))
  per_device = sum(x.addressable_shards[0].data.nbytes for x in leaves)
  return per_device, sum(x.nbytes for x in leaves)


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


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
                      "(None: 2)")
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
  t.add_argument("--steps", type=int, default=200, help="optimizer steps")
  t.add_argument("--batch-size", type=int, default=16,
                 help="global batch size (a multiple of the number of devices)")
  t.add_argument("--seq-len", type=int, default=64, help="context length in characters")
  t.add_argument("--lr", type=float, default=1e-2, help="peak AdamW learning rate")
  t.add_argument("--seed", type=int, default=0, help="seed for init and batches")
  t.add_argument("--log-every", type=int, default=20,
                 help="print a progress line every N steps (without tqdm)")
  t.add_argument("--sample-chars", type=int, default=40,
                 help="characters to generate after training (0: none)")
  t.add_argument("--prompt", default=None,
                 help="prompt for the generated sample (default: 'def ', or the "
                      "first 16 characters of --text)")
  args = p.parse_args(argv)
  if args.d_model % args.heads:
    p.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}")
  if args.steps < 1:
    p.error("--steps must be at least 1")
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  # 1. Devices: before anything makes JAX start a backend.
  platform = configure_devices(args.platform, args.cpu_devices)
  devices = jax.devices()
  if platform == "gpu" and devices[0].platform == "cpu":
    sys.exit("--platform gpu: JAX found no GPU (is jax[cuda] installed?); "
             "use --platform cpu to simulate devices instead.")
  print(f"devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform})")

  # Data.
  text, source = load_text(args.text)
  data = CharData(text, args.seed)
  if len(data.tokens) <= args.seq_len + 1:
    sys.exit(f"The text has {len(data.tokens)} characters; it needs more than "
             f"--seq-len + 1 = {args.seq_len + 1}.")
  print(f"text: {source}: {len(data.tokens):,} characters, vocabulary {data.vocab_size}")

  # 2. Mesh and FSDP options.
  strategy = fsdp_jax.ShardingStrategy[args.strategy]
  mesh = make_mesh(strategy, args.replicate)
  if args.batch_size % mesh.size:
    sys.exit(f"--batch-size {args.batch_size} must be a multiple of the "
             f"{mesh.size} devices (each device gets an equal slice).")
  config = fsdp_jax.FSDPConfig(
      sharding_strategy=strategy,
      auto_wrap_policy=make_wrap_policy(args.wrap, args.min_num_params),
      use_orig_params=args.use_orig_params)

  # Model and optimizer. Only elementwise optimizers give the same result as
  # unsharded training (each device updates its own shard); global-norm
  # clipping, for instance, would only see the local shard.
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
  t0 = time.perf_counter()
  state = fsdp_jax.init_train_state(
      init_fn=lambda rng: model.init(rng, dummy_tokens),
      rng=jax.random.key(args.seed), optimizer=optimizer, mesh=mesh, config=config)
  jax.block_until_ready(state)
  print(f"init: {time.perf_counter() - t0:.1f}s, mesh {dict(mesh.shape)}, "
        f"{args.strategy}, {len(state.plan.units)} FSDP units "
        f"({'original' if args.use_orig_params else 'flat'} parameters)")
  if args.print_plan:
    print(state.plan)

  # 4. The train step. loss_fn is plain single-device code: it gets the full,
  # original parameter tree (units are gathered inside the step) and this
  # device's slice of the batch.
  def loss_fn(params, batch):
    logits = model.apply(params, batch["inputs"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    return jnp.mean(losses)

  train_step = fsdp_jax.shard_train_step(loss_fn, optimizer, mesh=mesh, config=config)

  tokens_per_step = args.batch_size * args.seq_len
  losses = []
  steps = range(1, args.steps + 1)
  bar = tqdm(steps, desc=f"train {args.strategy}", unit="step") if tqdm else None
  t_start = time.perf_counter()
  t_first = None
  for step in (bar if bar is not None else steps):
    batch = shard_batch(data.batch(args.batch_size, args.seq_len), mesh)
    t_step = time.perf_counter()
    state, metrics = train_step(state, batch)  # the old state is donated
    loss = float(metrics["loss"])  # waits for the step
    now = time.perf_counter()
    losses.append(loss)
    if t_first is None:
      t_first = now  # the first step includes compilation
    tok_s = tokens_per_step / (now - t_step)
    if bar is not None:
      bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tok_s:,.0f}")
    elif step % args.log_every == 0 or step == args.steps:
      print(f"step {step:4d}  loss {loss:.4f}  {tok_s:10,.0f} tokens/s")
  if bar is not None:
    bar.close()
  t_end = time.perf_counter()

  # Results.
  per_device, total = state_bytes_per_device(state)
  n_params = sum(int(np.prod(leaf.shape)) for leaf in state.plan.leaves)
  steady = (t_end - t_first) / max(1, args.steps - 1)  # excludes compilation
  print(f"first loss {losses[0]:.4f} -> final loss {losses[-1]:.4f} "
        f"(uniform guess: {math.log(data.vocab_size):.4f})")
  timing = (f"train time {t_end - t_start:.1f}s "
            f"({t_first - t_start:.1f}s first step with compilation")
  if args.steps > 1:
    timing += (f", then {steady * 1e3:.0f} ms/step, "
               f"{tokens_per_step / steady:,.0f} tokens/s")
  print(timing + ")")
  print(f"model: {n_params:,} parameters; stored params + optimizer state: "
        f"{per_device:,} bytes per device (global arrays: {total:,} bytes)")

  # 5. Gather the full parameters (replicated) and sample from the model.
  sample = ""
  if args.sample_chars > 0:
    params = fsdp_jax.full_params(state)
    prompt = args.prompt
    if prompt is None:  # Python source starts many lines with "def "
      prompt = "def " if args.text is None else text[:16]
    sample = generate(model, params, data, prompt, args.sample_chars)
    print(f"sample (greedy): {sample!r}")
  return {"first_loss": losses[0], "final_loss": losses[-1], "losses": losses,
          "bytes_per_device": per_device, "sample": sample}


if __name__ == "__main__":
  main()
