"""Peak bytes per device of initialisation and full-parameter access.

Compiles the programs fsdp_jax runs (without running the big ones) and reads
``compiled.memory_analysis()``: the init programs of
``init_train_state(init_fn=...)``, ``full_params`` / ``summon_full_params``,
``write_full_params`` and ``apply`` (one unit at a time), against the model's
full size. Writes a markdown table to stdout (quoted in docs/memory.md).

    python benchmarks/init_and_full_params.py [--layers 8] [--d-model 512]
"""

from __future__ import annotations

import argparse
import platform

import fsdp_jax


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--devices", type=int, default=8)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--d-model", type=int, default=512)
  args = ap.parse_args(argv)
  fsdp_jax.simulate_cpu_devices(args.devices)

  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from fsdp_jax._src import layout, state as state_lib, unit_init

  d, layers = args.d_model, args.layers

  def init_fn(rng):
    keys = jax.random.split(rng, 2 * layers + 1)
    params = {"embed": jax.random.normal(keys[-1], (1000, d)) * 0.02}
    for i in range(layers):
      params[f"block_{i}"] = {
          "w1": jax.random.normal(keys[2 * i], (d, 4 * d)) * 0.02,
          "w2": jax.random.normal(keys[2 * i + 1], (4 * d, d)) * 0.02,
          "b": jnp.zeros((4 * d,)),
      }
    return params

  mesh = fsdp_jax.make_mesh(shard=args.devices)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["block_*"]))
  rng = jax.random.key(0)
  abstract = jax.eval_shape(init_fn, rng)
  full_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  unit_bytes = max(
      sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract[f"block_{i}"]))
      for i in range(layers))
  plan = state_lib.build_plan(abstract, mesh=mesh, config=config)

  def peak(compiled):
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - \
        m.alias_size_in_bytes

  rows = []
  rows.append(("init_train_state(init_fn=...): the init programs (one unit after another)",
               unit_init.init_program(plan, init_fn, (rng,)).peak_bytes(rng)))
  state = fsdp_jax.init_train_state(init_fn=init_fn, rng=rng, optimizer=optax.sgd(0.1),
                                    mesh=mesh, config=config)
  stored = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params))
  rows.append(("stored parameter shards (state.params)", stored))
  replicated = NamedSharding(mesh, P())
  full_prog = jax.jit(lambda s: state_lib.unpack_all(plan, s), out_shardings=replicated)
  rows.append(("full_params / summon_full_params", peak(full_prog.lower(state.params).compile())))

  def write_back(s):
    from fsdp_jax._src.state import assemble_storage
    full = state_lib.unpack_all(plan, s)
    leaves = jax.tree.leaves(full)
    return assemble_storage(plan, {u.index: layout.pack_unit(plan, u, {i: leaves[i] for i in u.leaf_ids})
                                   for u in plan.units})

  wb = jax.jit(write_back, out_shardings=plan.storage_shardings())
  rows.append(("write_full_params (whole tree)", peak(wb.lower(state.params).compile())))
  apply_peaks = []
  for u in plan.units:
    sh = NamedSharding(mesh, plan.spec_for(u))
    arrays = layout.unit_storage(plan, u, state.params)
    prog = jax.jit(lambda a, u=u: layout.pack_unit(plan, u, layout.unpack_storage_full(plan, u, a)),
                   out_shardings={"flat": sh})
    apply_peaks.append(peak(prog.lower(arrays).compile()))
  rows.append(("apply (one unit at a time): largest unit program", max(apply_peaks)))

  print(f"Model: {layers} blocks of d_model={d} + embedding, "
        f"{sum(x.size for x in jax.tree.leaves(abstract)):,} float32 parameters "
        f"({full_bytes / 2**20:.1f} MiB); largest unit {unit_bytes / 2**20:.2f} MiB; "
        f"{args.devices} simulated CPU devices; jax {jax.__version__}; {platform.machine()}.\n")
  print("| program | peak bytes per device | / full model | / largest unit |")
  print("|---|---:|---:|---:|")
  for name, b in rows:
    print(f"| {name} | {b:,} ({b / 2**20:.2f} MiB) | {b / full_bytes:.3f} | {b / unit_bytes:.2f} |")


if __name__ == "__main__":
  main()
