#!/usr/bin/env python
"""Train a Flax NNX model with fsdp_jax, through nnx.split / nnx.merge.

The model is a residual MLP classifier written as an ordinary ``nnx.Module``;
the data is synthetic (points labelled by a fixed random "teacher" network),
so the script runs offline. Nothing in the model knows about FSDP:

1. ``graphdef, params = nnx.split(model, nnx.Param)`` separates the module's
   structure from its parameters (an ``nnx.State``, a pytree);
2. ``fsdp_jax.module_classes(model)`` records which NNX class owns each
   subtree, so ``ModuleWrapPolicy({Block})`` can make every ``Block`` an FSDP
   unit, as ``ModuleWrapPolicy({Block})`` does for a PyTorch module;
3. the loss rebuilds the module inside the step with
   ``nnx.merge(graphdef, params)`` and calls it;
4. after training, ``nnx.update(model, fsdp_jax.summon_full_params(state))`` loads
   the trained parameters back into the NNX model, which is then used as
   usual (here: evaluated on held-out data).

Runs on 8 simulated CPU devices by default, or on the GPUs present:

    python examples/train_nnx.py
    python examples/train_nnx.py --strategy HYBRID_SHARD --use-orig-params
"""

from __future__ import annotations

import argparse
import sys
import time

# Importing jax, flax or fsdp_jax does not start a JAX backend; the device
# set-up in main() runs before anything does.
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding

import fsdp_jax

STRATEGIES = tuple(s.name for s in fsdp_jax.ShardingStrategy)


# ---------------------------------------------------------------------------
# Devices


def configure_devices(platform: str, cpu_devices: int) -> str:
  """``auto``: GPUs when ``JAX_PLATFORMS`` says so or ``nvidia-smi`` lists
  one, else ``cpu_devices`` simulated CPU devices (before JAX starts)."""
  if platform == "auto":
    platform = fsdp_jax.distributed.detect_platform()
  if platform == "cpu":
    try:
      fsdp_jax.simulate_cpu_devices(cpu_devices)
      jax.config.update("jax_platforms", "cpu")
    except RuntimeError:  # JAX already started (e.g. main() called twice)
      print(f"note: JAX is already initialised; using its {jax.device_count()} devices")
  return platform


# ---------------------------------------------------------------------------
# The NNX model: nothing FSDP-specific in it


class Block(nnx.Module):
  """A pre-LayerNorm residual MLP block; each one becomes an FSDP unit."""

  def __init__(self, width: int, *, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class ResMLP(nnx.Module):
  """Input projection, ``num_blocks`` residual blocks, a classifier head."""

  def __init__(self, d_in: int, width: int, num_classes: int, num_blocks: int, *,
               rngs: nnx.Rngs):
    self.inp = nnx.Linear(d_in, width, rngs=rngs)
    self.blocks = nnx.List([Block(width, rngs=rngs) for _ in range(num_blocks)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.head = nnx.Linear(width, num_classes, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


# ---------------------------------------------------------------------------
# Synthetic data: a fixed random teacher network labels Gaussian points


class TeacherData:
  """``x ~ N(0, I)``, ``y = argmax(teacher(x))`` for a random 2-layer tanh
  teacher. Batch ``step`` (from 1) depends only on ``(seed, step)``; the
  held-out set is "step 0"."""

  def __init__(self, d_in: int, num_classes: int, seed: int):
    rng = np.random.default_rng((seed, 12345))
    self.w1 = rng.normal(size=(d_in, 64)) / np.sqrt(d_in)
    self.w2 = rng.normal(size=(64, num_classes)) / np.sqrt(64)
    self.d_in, self.seed = d_in, seed

  def sample(self, n: int, rng) -> dict:
    x = rng.normal(size=(n, self.d_in)).astype(np.float32)
    y = np.argmax(np.tanh(x @ self.w1) @ self.w2, axis=-1).astype(np.int32)
    return {"x": x, "y": y}

  def batch(self, n: int, step: int) -> dict:
    return self.sample(n, np.random.default_rng((self.seed, step)))

  def held_out(self, n: int) -> dict:
    return self.sample(n, np.random.default_rng((self.seed, 0)))  # steps start at 1


def evaluate(model: ResMLP, data: dict) -> tuple[float, float]:
  """Loss and accuracy of an (ordinary, unsharded) NNX model."""
  logits = model(jnp.asarray(data["x"]))
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, data["y"]).mean()
  return float(loss), float(jnp.mean(jnp.argmax(logits, -1) == data["y"]))


# ---------------------------------------------------------------------------
# Main


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--strategy", choices=STRATEGIES, default="FULL_SHARD",
                 help="sharding strategy (the hybrid ones use a 2 x N/2 mesh)")
  p.add_argument("--use-orig-params", action="store_true",
                 help="keep the nnx.State tree (each leaf sharded on dim 0) instead "
                      "of one flat parameter per unit")
  p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                 help="auto: GPUs if present, else simulated CPU devices")
  p.add_argument("--cpu-devices", type=int, default=8,
                 help="number of simulated CPU devices on CPU")
  p.add_argument("--d-in", type=int, default=16, help="input features")
  p.add_argument("--classes", type=int, default=8, help="number of classes")
  p.add_argument("--width", type=int, default=64, help="hidden width")
  p.add_argument("--blocks", type=int, default=3, help="residual blocks (FSDP units)")
  p.add_argument("--steps", type=int, default=150, help="optimizer steps")
  p.add_argument("--batch-size", type=int, default=128,
                 help="global batch size (a multiple of the number of devices)")
  p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
  p.add_argument("--seed", type=int, default=0, help="seed for init and data")
  p.add_argument("--log-every", type=int, default=25, help="print every N steps")
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error("--steps must be at least 1")
  if args.log_every < 1:
    p.error("--log-every must be at least 1")
  return args


def main(argv=None) -> dict:
  args = parse_args(argv)
  platform = configure_devices(args.platform, args.cpu_devices)
  devices = jax.devices()
  if platform == "gpu" and devices[0].platform == "cpu":
    sys.exit("--platform gpu: JAX found no GPU; use --platform cpu.")
  print(f"devices: {len(devices)} x {devices[0].device_kind} ({devices[0].platform})")

  strategy = fsdp_jax.ShardingStrategy[args.strategy]
  hybrid = strategy.name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
  mesh = fsdp_jax.make_mesh(replicate=2) if hybrid else fsdp_jax.make_mesh()
  if args.batch_size % mesh.size:
    sys.exit(f"--batch-size {args.batch_size} must be a multiple of the {mesh.size} devices.")

  # The NNX model, as usual (here on the default device; it is small).
  model = ResMLP(args.d_in, args.width, args.classes, args.blocks,
                 rngs=nnx.Rngs(args.seed))
  # 1. Structure and parameters. params is an nnx.State: a pytree.
  graphdef, params = nnx.split(model, nnx.Param)

  # 2. Class-based wrapping: every Block is an FSDP unit, the rest (input
  # layer, final norm, head) is the root unit.
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy,
                               auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({Block}),
                               use_orig_params=args.use_orig_params)
  optimizer = optax.adam(args.lr)
  state = fsdp_jax.init_train_state(params=params, optimizer=optimizer, mesh=mesh,
                                    config=config,
                                    module_classes=fsdp_jax.module_classes(model))
  print(state.plan)

  # 3. The loss rebuilds the module from the full parameters of this step
  # (the step gathers each Block's unit right before the Block runs).
  def loss_fn(params, batch):
    m = nnx.merge(graphdef, params)
    logits = m(batch["x"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
    return loss, {"accuracy": accuracy}  # aux: averaged over devices in metrics

  step_fn = fsdp_jax.shard_train_step(loss_fn, optimizer, mesh=mesh, config=config)
  sharding = NamedSharding(mesh, fsdp_jax.custom.batch_spec(state.plan))

  data = TeacherData(args.d_in, args.classes, args.seed)
  held_out = data.held_out(2048)
  before = evaluate(model, held_out)
  losses = []
  t0 = time.perf_counter()
  for step in range(1, args.steps + 1):
    batch = jax.device_put(data.batch(args.batch_size, step), sharding)
    state, metrics = step_fn(state, batch)
    losses.append(float(metrics["loss"]))
    if step % args.log_every == 0 or step in (1, args.steps):
      print(f"step {step:4d}  loss {losses[-1]:.4f}  "
            f"train accuracy {float(metrics['aux']['accuracy']):.3f}")
  print(f"first loss {losses[0]:.4f} -> final loss {losses[-1]:.4f} "
        f"({time.perf_counter() - t0:.1f}s, first step with compilation)")

  # 4. Back into the NNX model: the full parameters (an nnx.State with the
  # structure nnx.split produced), copied to one device, then nnx.update.
  trained = jax.device_put(fsdp_jax.summon_full_params(state), devices[0])
  nnx.update(model, trained)
  after = evaluate(model, held_out)
  print(f"nnx.update: loaded the trained parameters into the NNX model; held-out "
        f"loss {before[0]:.4f} -> {after[0]:.4f}, accuracy {before[1]:.3f} -> {after[1]:.3f}")
  return {"first_loss": losses[0], "final_loss": losses[-1], "losses": losses,
          "held_out_before": before, "held_out_after": after,
          "units": [u.name for u in state.plan.units]}


if __name__ == "__main__":
  main()
