#!/usr/bin/env python
"""Which collectives the GPU compiler keeps, and in which dtype, for a mesh
of several GPUs, compiled on a machine with one.

    python benchmarks/gpu_collectives.py --devices 8            # on a GPU host
    python benchmarks/gpu_collectives.py --devices 8 --cpu      # smoke run on CPU

On a GPU host the process poses as one of ``--devices`` single-GPU hosts
(JAX's mock GPU topology, ``1 x N x 1``: the local GPU is real, the others
are mocked, and NCCL is mocked). It compiles, and does not run:

* a ``psum_scatter`` of a bf16 vector over the mesh: does the reduce-scatter
  stay in bf16 (the CPU backend widens bf16 reductions to f32)?
* fsdp_jax's FULL_SHARD step of a small MLP with
  ``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16)`` and the same with
  ``reduce_dtype=f32``: its collectives by kind and dtype.

Prints its progress; the JSON object of results is rewritten to ``--out``
after each stage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--cpu", action="store_true", help="simulated CPU devices instead")
  p.add_argument("--step", action="store_true",
                 help="also compile fsdp_jax's step (always with --cpu)")
  p.add_argument("--out", default=None)
  args = p.parse_args(argv)
  n = args.devices

  import fsdp_jax  # pylint: disable=import-outside-toplevel  (before jax starts)
  import jax  # pylint: disable=import-outside-toplevel
  if args.cpu:
    fsdp_jax.simulate_cpu_devices(n)
  else:
    jax.config.update("jax_mock_gpu_topology", f"1x{n}x1")
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from fsdp_jax import hlo  # pylint: disable=import-outside-toplevel

  t_start = time.perf_counter()

  def say(what):  # progress, so that a stage that hangs shows where
    print(f"[{time.perf_counter() - t_start:6.1f} s] {what}", flush=True)
    if args.out:
      with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)

  def kinds(text):
    out: dict = {}
    for c in hlo.collectives(text):
      for dtype in c.dtypes:
        by = out.setdefault(c.kind, {})
        by[dtype] = by.get(dtype, 0) + 1
    return out

  result: dict = {}
  say("starting the backend")
  devices = jax.devices()
  result.update({"platform": devices[0].platform, "device_kind": devices[0].device_kind,
            "devices": len(devices), "local_devices": len(jax.local_devices()),
            "process_count": jax.process_count(), "jax": jax.__version__})
  say(f"backend up: {len(devices)} devices, {len(jax.local_devices())} local")
  mesh = fsdp_jax.make_mesh(shard=n, devices=devices[:n])

  # 1. a bf16 psum_scatter alone.
  x = jax.ShapeDtypeStruct((n * 4096,), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  f = jax.jit(jax.shard_map(lambda v: jax.lax.psum_scatter(v, "shard", tiled=True),
                            mesh=mesh, in_specs=P(), out_specs=P("shard")))
  try:
    result["psum_scatter_bf16"] = kinds(f.lower(x).compile().as_text())
  except Exception as e:  # pylint: disable=broad-except
    result["psum_scatter_bf16"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
  say(f"psum_scatter: {result['psum_scatter_bf16']}")

  # 2. fsdp_jax's step, compiled only.
  d, h, blocks = 256, 1024, 4
  rng = np.random.default_rng(0)
  params = {f"block{i}": {"w1": rng.normal(size=(d, h)).astype(np.float32) * 0.05,
                          "w2": rng.normal(size=(h, d)).astype(np.float32) * 0.05}
            for i in range(blocks)}

  def loss_fn(prm, batch):
    y = batch["x"]
    for i in range(blocks):
      y = y + jax.nn.gelu(y @ prm[f"block{i}"]["w1"]) @ prm[f"block{i}"]["w2"]
    return jnp.mean(y ** 2)

  xs = rng.normal(size=(n * 8, d)).astype(np.float32)
  batch = {"x": jax.make_array_from_callback(xs.shape, NamedSharding(mesh, P("shard")),
                                             lambda idx: xs[idx])}
  for reduce_dtype in ("bfloat16", "float32") if (args.step or args.cpu) else ():
    key = f"fsdp_step_reduce_{reduce_dtype}"
    try:
      config = fsdp_jax.FSDPConfig(
          auto_wrap_policy=fsdp_jax.CustomPolicy(lambda node: node.name.startswith("block")),
          mixed_precision=fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16,
                                                  reduce_dtype=jnp.dtype(reduce_dtype)))
      opt = optax.adam(1e-3)
      say(f"{key}: init")
      state = fsdp_jax.init_train_state(init_fn=lambda: params, optimizer=opt, mesh=mesh,
                                        config=config)
      step = fsdp_jax.shard_train_step(loss_fn, opt)
      say(f"{key}: compile")
      result[key] = kinds(step.lower(state, batch).compile().as_text())
    except Exception as e:  # pylint: disable=broad-except
      result[key] = f"failed: {type(e).__name__}: {str(e)[:300]}"
    say(f"{key}: {result[key]}")
  return result


if __name__ == "__main__":
  main()
