"""Subprocess worker for tests/test_checkpoint.py (the device count is fixed
per process, so restoring onto 4, 2 or 3 devices and crashing mid-save need
their own processes).

Run as ``python tests/checkpoint_worker.py '<json spec>'``. Importing this
module does nothing.
"""

from __future__ import annotations

import json
import os
import sys


def _setup(devices: int):
  import fsdp_jax
  fsdp_jax.simulate_cpu_devices(devices)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def restore_and_train(spec):
  """Restores the latest checkpoint onto a new mesh/strategy/layout, trains
  on the given batches and writes the losses and full parameters."""
  import jax
  import numpy as np
  import optax
  import fsdp_jax
  from fsdp_jax import CheckpointManager
  from fsdp_jax import state_dict
  from helpers import mesh_for, mlp_batch, mlp_loss, mlp_params, train_steps

  strategy = fsdp_jax.ShardingStrategy[spec["strategy"]]
  mesh = mesh_for(strategy, spec["shard"], spec.get("replicate"))
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy,
                               auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["blocks.*"]),
                               use_orig_params=spec["orig"])
  opt = optax.adam(1e-2)
  target = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      params=mlp_params(), optimizer=opt, mesh=mesh, config=config))
  with CheckpointManager(spec["dir"], read_only=True) as mngr:
    state = mngr.restore(target)
  restored_step = int(state.step)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config)
  state, losses = train_steps(step, state, [mlp_batch(seed=seed) for seed in spec["batch_seeds"]])
  params = state_dict(state, offload_to_cpu=True)
  np.savez(spec["out"], losses=np.array(losses), restored_step=restored_step,
           devices=len(jax.devices()), **params)


SMALL = {"w": [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]], "b": [1.0, 1.0, 1.0]}


def crash_during_save(spec):
  """Saves step 1, then dies by SIGKILL in the middle of saving step 2:
  ``where="write"`` while the background thread writes the arrays,
  ``where="finalize"`` after every file is written, before the commit."""
  import signal

  import jax
  import jax.numpy as jnp
  import optax
  import fsdp_jax
  from fsdp_jax import CheckpointManager

  mesh = fsdp_jax.make_mesh(shard=jax.device_count())
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def build(scale, step):
    params = {k: jnp.asarray(v) * scale for k, v in SMALL.items()}
    state = fsdp_jax.init_train_state(params=params, optimizer=optax.adam(1e-2), mesh=mesh,
                                      config=fsdp_jax.FSDPConfig())
    return state.replace(step=jax.device_put(jnp.int32(step), rep))

  mngr = CheckpointManager(spec["dir"])
  mngr.save(build(1.0, 1))
  mngr.wait_until_finished()
  state2 = build(2.0, 2)

  def die():
    sys.stdout.write("KILLING\n")
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)

  if spec["where"] == "finalize":
    from orbax.checkpoint._src.path import atomicity

    async def finalize(self, *a, **k):
      die()

    atomicity.AtomicRenameTemporaryPath.finalize = finalize
  else:
    from orbax.checkpoint._src.serialization import serialization

    original = serialization.async_serialize_from_host

    async def write(*a, **k):
      await original(*a, **k)
      die()

    serialization.async_serialize_from_host = write
  mngr.save(state2)
  mngr.wait_until_finished()
  sys.exit(3)  # not reached: the save above kills the process


MP_PARAMS = {"w": [[float(3 * i + j) for j in range(3)] for i in range(8)], "b": [1.0] * 5}


def multiprocess(spec):
  """Run by ``python -m fsdp_jax.launch --nproc 2 --devices-per-proc 2``:
  rank0_only state dicts, scatter_full_optim_state_dict from process 0, and
  a checkpoint saved by 2 processes (restored by the test in 1 process)."""
  from fsdp_jax import distributed
  distributed.initialize()
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  import fsdp_jax
  from fsdp_jax import CheckpointManager
  from fsdp_jax import (full_optim_state_dict, load_state_dict, optim_state_dict,
                        scatter_full_optim_state_dict, state_dict)

  T = fsdp_jax.StateDictType
  pid = jax.process_index()
  params = {k: np.asarray(v, np.float32) for k, v in MP_PARAMS.items()}
  mesh = fsdp_jax.make_mesh(shard=jax.device_count())
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.adam(1e-2), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig(use_orig_params=spec["orig"]))
  out = {"process": pid, "processes": jax.process_count(), "devices": jax.device_count()}
  full = state_dict(state, rank0_only=True, offload_to_cpu=True)
  out["full_keys"] = sorted(full)
  out["full_ok"] = all(np.array_equal(full[k], params[k]) for k in full)
  osd = full_optim_state_dict(state)  # rank0_only=True, PyTorch's default
  out["osd_keys"] = sorted(osd)
  if pid == 0:
    osd["state"]["w"]["0.mu"] = osd["state"]["w"]["0.mu"] + 1.0
  state = state.replace(opt_state=scatter_full_optim_state_dict(osd if pid == 0 else None, state))
  everywhere = optim_state_dict(state)  # rank0_only=False: every process
  out["mu_sum"] = float(everywhere["state"]["w"]["0.mu"].sum())
  sharded = state_dict(state, state_dict_type=T.SHARDED_STATE_DICT)
  state = load_state_dict(state, {k: v * 2 for k, v in sharded.items()},
                          state_dict_type=T.SHARDED_STATE_DICT)
  out["w_sum"] = float(state_dict(state)["w"].sum())
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  state = state.replace(step=jax.device_put(jnp.int32(3), rep))
  with CheckpointManager(spec["dir"]) as mngr:
    mngr.save(state)
    mngr.wait_until_finished()
  with open(spec["out"] + f".{pid}.json", "w") as fh:
    json.dump(out, fh)


if __name__ == "__main__":
  spec = json.loads(sys.argv[1])
  if spec["mode"] == "multiprocess":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    multiprocess(spec)
  else:
    _setup(spec["devices"])
    {"restore_and_train": restore_and_train, "crash": crash_during_save}[spec["mode"]](spec)
