"""Two ways to run tensor parallelism inside FSDP's shard_map, measured.

    python -m benchmarks tp_routes [--d 256] [--f 1024] [--tokens 512]

A column-parallel then row-parallel MLP (``relu(x @ W1) @ W2``), weights
stored 2-D on a ``shard=4 x tensor=2`` mesh (each device 1/8), the batch
split over ``"shard"``. Both routes gather over ``"shard"`` explicitly:

* compiler: ``jax.shard_map(..., axis_names={"shard"})``, manual over the
  FSDP axis only; ``"tensor"`` is left to the compiler, which sees the
  weights' tensor sharding and a sharding constraint on the hidden
  activation (split over ``"tensor"``, Megatron's layout);
* explicit: fsdp_jax's step (manual over every axis, Megatron's collectives
  over ``"tensor"`` inserted by its evaluation of the loss).

Reported: collectives per axis and their bytes per device from the compiled
HLO (forward and backward of one step), and the gradient's error against
one device.
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import fsdp_jax

SHARD, TENSOR = 4, 2


def _axis(groups, mesh_devices) -> str:
  """'shard' or 'tensor' for a collective's device groups on a (4, 2) mesh."""
  g = tuple(groups[0]) if groups else ()
  ids = mesh_devices
  for col in range(ids.shape[1]):
    if g == tuple(int(d) for d in ids[:, col]):
      return "shard"
  for row in range(ids.shape[0]):
    if g == tuple(int(d) for d in ids[row]):
      return "tensor"
  return "all" if len(g) == ids.size or not g else str(g)


def _per_axis(text, ids) -> dict:
  out = collections.defaultdict(lambda: [0, 0])
  for c in fsdp_jax.hlo.collectives(text):
    key = f"{_axis(c.groups, ids)} {c.kind}"
    out[key][0] += 1
    out[key][1] += c.bytes
  return {k: {"count": v[0], "bytes": v[1]} for k, v in sorted(out.items())}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--d", type=int, default=256)
  parser.add_argument("--f", type=int, default=1024)
  parser.add_argument("--tokens", type=int, default=512)
  parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__),
                                                    "tp_routes.json"))
  args = parser.parse_args(argv)
  fsdp_jax.simulate_cpu_devices(SHARD * TENSOR)

  import jax  # after the device count is set
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax import lax
  from jax.sharding import NamedSharding, PartitionSpec as P

  d, f, b = args.d, args.f, args.tokens
  rng = np.random.default_rng(0)
  w1 = jnp.asarray(rng.normal(size=(d, f)) / np.sqrt(d), jnp.float32)
  w2 = jnp.asarray(rng.normal(size=(f, d)) / np.sqrt(f), jnp.float32)
  x = jnp.asarray(rng.normal(size=(b, d)), jnp.float32)

  def loss(params, batch):
    return jnp.mean((jax.nn.relu(batch["x"] @ params["w1"]) @ params["w2"]) ** 2)

  params = {"w1": w1, "w2": w2}
  ref = jax.grad(loss)(params, {"x": x})
  mesh = fsdp_jax.make_mesh(shard=SHARD, tensor=TENSOR)
  ids = np.vectorize(lambda dev: dev.id)(mesh.devices)
  results = {}

  # The compiler route: FSDP manual over "shard", "tensor" automatic.
  s1 = jax.device_put(w1, NamedSharding(mesh, P("shard", "tensor")))
  # W2's rows split over "tensor" within each shard block (shard-major).
  s2 = jax.device_put(w2, NamedSharding(mesh, P(("shard", "tensor"), None)))

  def body(w1, w2, x):
    def f_(w1, w2):
      a = lax.all_gather(w1, "shard", axis=0, tiled=True)
      c = lax.all_gather(w2, "shard", axis=0, tiled=True)
      h = jax.lax.with_sharding_constraint(jax.nn.relu(x @ a), P(None, "tensor"))
      return jnp.sum((h @ c) ** 2) / (b * d)  # the mean over the global batch
    # The gather's transpose reduce-scatters the gradient over "shard".
    return jax.grad(f_, (0, 1))(w1, w2)

  compiler = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("shard"), P("shard"), P("shard")),
                                   out_specs=(P("shard"), P("shard")), axis_names={"shard"}))
  xs = jax.device_put(x, NamedSharding(mesh, P("shard")))
  text = compiler.lower(s1, s2, xs).compile().as_text()
  g = dict(zip(("w1", "w2"), compiler(s1, s2, xs)))
  err = max(float(jnp.max(jnp.abs(g[k] - ref[k])) / jnp.max(jnp.abs(ref[k]))) for k in ref)
  results["compiler (axis_names={'shard'})"] = {"collectives": _per_axis(text, ids),
                                                 "grad_rel_err": err}

  # The explicit route: fsdp_jax's step.
  tp = fsdp_jax.TensorParallel(rules=[("w1", "colwise"), ("w2", "rowwise")])
  cfg = fsdp_jax.FSDPConfig(tensor_parallel=tp, use_orig_params=True)
  opt = optax.sgd(1.0)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=cfg)
  step = fsdp_jax.shard_train_step(loss, opt, mesh=mesh, config=cfg)
  text = step.lower(state, {"x": x}).compile().as_text()
  new, _ = step(state, {"x": x})
  full = fsdp_jax.summon_full_params(new)
  g = {k: params[k] - full[k] for k in params}
  err = max(float(jnp.max(jnp.abs(g[k] - ref[k])) / jnp.max(jnp.abs(ref[k]))) for k in ref)
  results["explicit (fsdp_jax)"] = {"collectives": _per_axis(text, ids), "grad_rel_err": err}

  meta = {"d": d, "f": f, "tokens": b, "mesh": dict(mesh.shape), "jax": jax.__version__,
          "weights_bytes": int(w1.nbytes + w2.nbytes),
          "activation_bytes_per_shard": int(b // SHARD * d * 4)}
  with open(args.out, "w") as fh:
    json.dump({"meta": meta, "routes": results}, fh, indent=1)
  print(json.dumps(meta))
  for route, r in results.items():
    print(f"{route}: grad rel err {r['grad_rel_err']:.1e}")
    for k, v in r["collectives"].items():
      print(f"  {k:<28} {v['count']:>3} x  {v['bytes']:>12,} bytes")
  return 0
