"""Shared test helpers: a small uneven MLP, the unsharded reference, meshes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fsdp_jax

HYBRID = (fsdp_jax.ShardingStrategy.HYBRID_SHARD,
          fsdp_jax.ShardingStrategy._HYBRID_SHARD_ZERO2)


def mesh_for(strategy, n, replicate=None):
  devices = jax.devices()[: n * (replicate or 1)]
  if replicate is not None:
    return fsdp_jax.make_mesh(replicate=replicate, shard=n, devices=devices)
  return fsdp_jax.make_mesh(shard=n, devices=devices)


def mlp_params(seed=0, d_in=5, d=7, d_out=3, blocks=3):
  """Sizes chosen so no mesh size in the tests divides them."""
  k = jax.random.split(jax.random.key(seed), blocks + 2)
  return {
      "inp": {"w": jax.random.normal(k[0], (d_in, d)) * 0.5},
      "blocks": [{"w": jax.random.normal(k[i + 1], (d, d)) * 0.5,
                  "b": jnp.full((d,), 0.1)} for i in range(blocks)],
      "out": {"w": jax.random.normal(k[-1], (d, d_out)) * 0.5},
  }


def mlp_loss(params, batch):
  x = jnp.tanh(batch["x"] @ params["inp"]["w"])
  for blk in params["blocks"]:
    x = jnp.tanh(x @ blk["w"] + blk["b"])
  return jnp.mean((x @ params["out"]["w"] - batch["y"]) ** 2)


def mlp_batch(seed=1, n=24, d_in=5, d_out=3):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return {"x": jax.random.normal(k1, (n, d_in)), "y": jax.random.normal(k2, (n, d_out))}


def reference_run(loss_fn, params, batches, optimizer):
  """Unsharded single-device training: losses per step and final params."""
  state = optimizer.init(params)
  losses = []
  for batch in batches:
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, state = optimizer.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  return losses, params


def sharded_run(loss_fn, params, batches, optimizer, mesh, config):
  state = fsdp_jax.init_train_state(params=params, optimizer=optimizer, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(loss_fn, optimizer, mesh=mesh, config=config)
  losses = []
  for batch in batches:
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))
  return losses, state


def assert_trees_close(actual, expected, rtol=2e-4, atol=1e-6):
  a_leaves, a_def = jax.tree_util.tree_flatten(actual)
  e_leaves, e_def = jax.tree_util.tree_flatten(expected)
  assert a_def == e_def, (a_def, e_def)
  for a, e in zip(a_leaves, e_leaves):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)
