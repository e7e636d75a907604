#!/usr/bin/env python
"""A custom FSDP training step built from fsdp_jax's building blocks.

``fsdp_jax.shard_train_step`` covers the common loop. Research code that
needs several losses, EMA weights or its own optimizer loop writes its own
step inside ``jax.shard_map`` with the same pieces (docs/custom_step.md):

* ``fsdp_jax.custom.value_and_grad(loss_fn, plan=plan)``: on the local shards,
  gathers each unit right before its first use, runs the loss and its
  backward, and reduce-scatters each unit's gradient;
* ``fsdp_jax.custom.clip_grad_norm(grads, plan=plan, max_norm=...)``: PyTorch's
  ``clip_grad_norm_`` over all shards;
* ``fsdp_jax.custom.optimizer_step(optimizer, grads, opt_state, params, plan=plan)``:
  PyTorch's ``optimizer.step()``, the optax optimizer on the user's tree, run
  exactly on the shards;
* ``fsdp_jax.custom.param_specs(plan)``, ``fsdp_jax.custom.opt_state_specs(plan, opt)``,
  ``fsdp_jax.custom.batch_spec(plan)``: the ``PartitionSpec`` s for ``shard_map``.

Here: a regression MLP (a plain function of a dict of parameters) trained on
two losses, a data term and an L2 penalty (two ``value_and_grad`` calls, i.e.
two forward/backward passes, as two ``backward()`` calls in PyTorch), with
gradient clipping, and an exponential moving average (EMA) of the weights
that is kept sharded exactly like the weights. ``--verify`` also checks that
the building blocks compute what ``shard_train_step`` computes.

    python examples/custom_step.py
    python examples/custom_step.py --strategy SHARD_GRAD_OP --verify
"""

from __future__ import annotations

import argparse
import sys
import time

# Importing jax or fsdp_jax does not start a JAX backend; the device set-up
# in main() runs before anything does.
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import fsdp_jax

STRATEGIES = tuple(s.name for s in fsdp_jax.ShardingStrategy)
LAYERS = ("l1", "l2", "l3")


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
# Model, losses, data: plain single-device JAX code


def init_params(key, d_in: int, width: int) -> dict:
  """A 3-layer MLP: ``{"l1": {"w", "b"}, "l2": ..., "l3": ...}``."""
  sizes = [d_in, width, width, 1]
  params = {}
  for name, k, (a, b) in zip(LAYERS, jax.random.split(key, 3), zip(sizes, sizes[1:])):
    params[name] = {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros((b,))}
  return params


def predict(params, x):
  h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
  h = jnp.tanh(h @ params["l2"]["w"] + params["l2"]["b"])
  return h @ params["l3"]["w"] + params["l3"]["b"]


def main_loss(params, batch):
  """The data term: mean squared error over this device's batch."""
  return jnp.mean((predict(params, batch["x"]) - batch["y"]) ** 2)


def make_reg_loss(weight: float):
  def reg_loss(params, batch):
    """The second loss: an L2 penalty on the weight matrices."""
    del batch  # value_and_grad always passes the batch
    return weight * sum(jnp.sum(p["w"] ** 2) for p in params.values())
  return reg_loss


class Data:
  """``y = sin(x . a) + 0.1 * noise``; batch ``step`` depends only on
  ``(seed, step)``, the held-out set is "step 0"."""

  def __init__(self, d_in: int, seed: int):
    self.a = np.random.default_rng((seed, 999)).normal(size=(d_in,)) / np.sqrt(d_in) * 2
    self.d_in, self.seed = d_in, seed

  def batch(self, n: int, step: int) -> dict:
    rng = np.random.default_rng((self.seed, step))
    x = rng.normal(size=(n, self.d_in)).astype(np.float32)
    y = np.sin(x @ self.a)[:, None] + 0.1 * rng.normal(size=(n, 1))
    return {"x": x, "y": y.astype(np.float32)}


# ---------------------------------------------------------------------------
# The custom step


def make_custom_step(plan, optimizer, mesh, *, losses, max_norm, ema_decay):
  """``step(params, opt_state, ema, batch) -> (params, opt_state, ema,
  metrics)`` on the stored (sharded) arrays; the sum of ``losses`` is
  minimised. ``max_norm=None``: no clipping; ``ema_decay=None``: no EMA."""
  grad_fns = [fsdp_jax.custom.value_and_grad(loss, plan=plan) for loss in losses]
  p_specs = fsdp_jax.custom.param_specs(plan)
  o_specs, _ = fsdp_jax.custom.opt_state_specs(plan, optimizer)
  data_axes = plan.axes.data_axes

  def body(params, opt_state, ema, batch):
    # Everything here runs per device, on local shards and the local batch.
    outs, grads = [], None
    for vg in grad_fns:  # one forward/backward (gather, reduce-scatter) each
      out, g, _ = vg(params, batch)
      outs.append(out.loss)
      grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    metrics = {"losses": [jax.lax.pmean(l, data_axes) for l in outs]}
    if max_norm is not None:
      grads, metrics["grad_norm"] = fsdp_jax.custom.clip_grad_norm(grads, plan=plan,
                                                            max_norm=max_norm)
    # The optimizer sees the original tree and computes what it computes
    # unsharded; frozen parameters are left as they are.
    params, opt_state = fsdp_jax.custom.optimizer_step(optimizer, grads, opt_state, params,
                                                plan=plan)
    if ema_decay is not None:  # the EMA is sharded like the weights: no communication
      ema = jax.tree.map(lambda e, p: ema_decay * e + (1 - ema_decay) * p, ema, params)
    return params, opt_state, ema, metrics

  sharded = jax.shard_map(
      body, mesh=mesh,
      in_specs=(p_specs, o_specs, p_specs, fsdp_jax.custom.batch_spec(plan)),
      out_specs=(p_specs, o_specs, p_specs, P()),
      check_vma=False)
  # Donating the old params, optimizer state and EMA lets XLA update in place.
  # fsdp_jax's compiler options keep FULL_SHARD's backward re-gather on CPU.
  return jax.jit(sharded, donate_argnums=(0, 1, 2),
                 compiler_options=fsdp_jax.custom.compiler_options(mesh))


def copy_tree(tree):
  """A copy with the same shardings (the EMA starts as a copy of the
  weights; a copy, because the step donates both)."""
  return jax.jit(lambda t: jax.tree.map(jnp.copy, t))(tree)


def verify_against_shard_train_step(params0, optimizer, mesh, config, data, batch_size,
                                    sharding, steps: int = 3) -> float:
  """The custom step with the data loss alone, no clipping and no EMA, next
  to ``shard_train_step``: returns the largest parameter difference."""
  build = lambda: fsdp_jax.init_train_state(params=params0, optimizer=optimizer,
                                            mesh=mesh, config=config)
  state_a, state_b = build(), build()
  ref_step = fsdp_jax.shard_train_step(main_loss, optimizer, mesh=mesh, config=config)
  custom = make_custom_step(state_b.plan, optimizer, mesh, losses=[main_loss],
                            max_norm=None, ema_decay=None)
  p, o = state_b.params, state_b.opt_state
  ema = copy_tree(p)  # unused, carried through
  for step in range(1, steps + 1):
    batch = jax.device_put(data.batch(batch_size, step), sharding)
    state_a, _ = ref_step(state_a, batch)
    p, o, ema, _ = custom(p, o, ema, batch)
  a = fsdp_jax.summon_full_params(state_a)
  b = fsdp_jax.summon_full_params(state_b.replace(params=p))
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                            jax.tree.leaves(b)))


# ---------------------------------------------------------------------------
# Main


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--strategy", choices=STRATEGIES, default="FULL_SHARD",
                 help="sharding strategy (the hybrid ones use a 2 x N/2 mesh)")
  p.add_argument("--use-orig-params", action="store_true",
                 help="per-leaf sharding instead of one flat parameter per unit")
  p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                 help="auto: GPUs if present, else simulated CPU devices")
  p.add_argument("--cpu-devices", type=int, default=8,
                 help="number of simulated CPU devices on CPU")
  p.add_argument("--d-in", type=int, default=8, help="input features")
  p.add_argument("--width", type=int, default=128, help="hidden width")
  p.add_argument("--steps", type=int, default=200, help="optimizer steps")
  p.add_argument("--batch-size", type=int, default=128,
                 help="global batch size (a multiple of the number of devices)")
  p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
  p.add_argument("--l2", type=float, default=1e-4, help="weight of the L2 loss")
  p.add_argument("--max-norm", type=float, default=1.0,
                 help="clip the summed gradient to this total norm")
  p.add_argument("--ema-decay", type=float, default=0.95, help="EMA decay per step")
  p.add_argument("--seed", type=int, default=0, help="seed for init and data")
  p.add_argument("--log-every", type=int, default=25, help="print every N steps")
  p.add_argument("--verify", action="store_true",
                 help="also check the building blocks against shard_train_step")
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error("--steps must be at least 1")
  if not 0 <= args.ema_decay < 1:
    p.error("--ema-decay must be in [0, 1)")
  if not args.max_norm > 0:
    p.error("--max-norm must be positive")
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
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy,
                               auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(set(LAYERS)),
                               use_orig_params=args.use_orig_params)
  optimizer = optax.adam(args.lr)
  params0 = init_params(jax.random.key(args.seed), args.d_in, args.width)
  state = fsdp_jax.init_train_state(params=params0, optimizer=optimizer, mesh=mesh,
                                    config=config)
  plan = state.plan
  print(f"mesh {dict(mesh.shape)}, {args.strategy}, units "
        f"{[u.display_name for u in plan.units]}")

  data = Data(args.d_in, args.seed)
  sharding = NamedSharding(mesh, fsdp_jax.custom.batch_spec(plan))
  reg_loss = make_reg_loss(args.l2)
  step_fn = make_custom_step(plan, optimizer, mesh, losses=[main_loss, reg_loss],
                             max_norm=args.max_norm, ema_decay=args.ema_decay)

  params, opt_state = state.params, state.opt_state
  ema = copy_tree(params)
  history = []
  t0 = time.perf_counter()
  for step in range(1, args.steps + 1):
    batch = jax.device_put(data.batch(args.batch_size, step), sharding)
    params, opt_state, ema, metrics = step_fn(params, opt_state, ema, batch)
    data_loss, l2 = (float(x) for x in metrics["losses"])
    history.append(data_loss)
    if step % args.log_every == 0 or step in (1, args.steps):
      print(f"step {step:4d}  data loss {data_loss:.4f}  l2 loss {l2:.5f}  "
            f"grad_norm {float(metrics['grad_norm']):.3f}")
  print(f"first data loss {history[0]:.4f} -> final data loss {history[-1]:.4f} "
        f"({time.perf_counter() - t0:.1f}s, first step with compilation)")

  # The full weights and the full EMA weights: the EMA has the stored layout
  # of the params, so it gathers through the same plan.
  state = state.replace(step=state.step + args.steps, params=params, opt_state=opt_state)
  full = fsdp_jax.summon_full_params(state)
  full_ema = fsdp_jax.summon_full_params(state.replace(params=ema))
  held_out = data.batch(4096, 0)
  eval_loss = jax.jit(main_loss)
  raw, smooth = float(eval_loss(full, held_out)), float(eval_loss(full_ema, held_out))
  print(f"held-out MSE: weights {raw:.4f}, EMA weights {smooth:.4f} "
        f"(initial {float(eval_loss(params0, held_out)):.4f})")
  result = {"first_loss": history[0], "final_loss": history[-1], "losses": history,
            "held_out": raw, "held_out_ema": smooth}
  if args.verify:
    diff = verify_against_shard_train_step(params0, optimizer, mesh, config, data,
                                           args.batch_size, sharding)
    print(f"verify: value_and_grad + optimizer_step in shard_map vs shard_train_step, "
          f"3 steps: max |param difference| = {diff:.2e}")
    result["verify_max_diff"] = diff
  return result


if __name__ == "__main__":
  main()
