"""Every collective carries its unit's name, so a profiler trace shows which
unit's gather or reduce-scatter is running."""

from __future__ import annotations

import re

import optax

import fsdp_jax
from fsdp_jax import ShardingStrategy as S

from helpers import mesh_for, mlp_batch, mlp_loss, mlp_params


def test_collectives_are_labelled_per_unit():
  mesh = mesh_for(S.FULL_SHARD, 4)
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["blocks.*"]))
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh, config=config)
  text = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config).lower(
      state, mlp_batch()).compile().as_text()
  names = {}
  for line in text.splitlines():
    m = re.search(r" (all-gather|reduce-scatter)\(.*op_name=\"([^\"]*)\"", line)
    if m:
      names.setdefault(m.group(1), []).append(m.group(2))
  units = ["<root>", "blocks.0", "blocks.1", "blocks.2"]
  for u in units:
    assert sum(f"fsdp_all_gather[{u}]" in n for n in names["all-gather"]) == (1 if u == "<root>" else 2)
    assert sum(f"fsdp_reduce_scatter[{u}]" in n for n in names["reduce-scatter"]) == 1
  # Backward re-gathers are marked as rematerialised.
  assert sum("rematted_computation" in n for n in names["all-gather"]) == 3
