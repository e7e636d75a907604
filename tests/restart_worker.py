"""A resumable training script for the fault-tolerance tests in
tests/test_fault_tolerance.py, written the way examples/train_gpt.py shows:

* resume from the latest finished checkpoint, data position included;
* ``distributed.should_stop(step)`` after every step: on SIGTERM every
  process stops after the same step, saves, and exits with
  ``distributed.EXIT_RESTART``.

Run under the launcher (``python -m fsdp_jax.launch --nproc 2
--devices-per-proc 2 --max-restarts 6 tests/restart_worker.py --dir CKPT
--out result.npz``) or alone (one process, ``FSDP_JAX_DEVICES_PER_PROC``
devices).

The data is a stream of batches read from a position that does not follow
the step: a batch at a position divisible by 3 is followed by one that is
skipped (as a filter would drop a record), so a run resumed without the
saved position would read other batches. Each process feeds its own rows of
every global batch.

For the test's fault injection every process writes, after each step, the
step to ``--progress/rank<R>.attempt<A>`` (A: the launcher's
``FSDP_JAX_RESTART_COUNT``) and its pid to ``...pid``; every process prints
``RESUMED``/``STOPPED``/``DONE`` lines. At the end process 0 writes the
final parameters and optimizer state (full, as numpy) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mp_worker import GLOBAL_BATCH, exit_after, np_batch, np_params  # noqa: E402  (NumPy only)


def next_batch(position: int):
  """The global batch at ``position`` and the position after it."""
  return np_batch(seed=1000 + position), position + (2 if position % 3 == 0 else 1)


def _write(path: str, text: str) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--dir", required=True, help="checkpoint directory")
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--save-every", type=int, default=4)
  p.add_argument("--out", required=True, help="final params + optimizer state (.npz)")
  p.add_argument("--progress", default=None, help="directory for progress and pid files")
  p.add_argument("--step-sleep", type=float, default=0.0)
  p.add_argument("--max-seconds", type=float, default=150.0,
                 help="hard limit: exit 99 after this long, whatever happens")
  args = p.parse_args(argv)
  exit_after(args.max_seconds, "restart_worker")

  from fsdp_jax import distributed
  info = distributed.initialize()   # first thing: before JAX starts
  distributed.handle_preemption()   # SIGTERM: stop at an agreed step, save, exit 75

  import jax
  import optax

  import fsdp_jax
  from fsdp_jax import CheckpointManager
  from helpers import mlp_loss

  rank, world = info.rank, info.world_size
  attempt = int(os.environ.get("FSDP_JAX_RESTART_COUNT", "0"))
  mesh = fsdp_jax.make_mesh(shard=jax.device_count())
  config = fsdp_jax.FSDPConfig()
  optimizer = optax.adam(1e-2)

  def build_state():
    # One block: every kind of leaf, the fewest arrays to save and restore.
    return fsdp_jax.init_train_state(params=np_params(blocks=1), optimizer=optimizer,
                                     mesh=mesh, config=config)

  train_step = fsdp_jax.shard_train_step(mlp_loss, optimizer, mesh=mesh, config=config)
  manager = CheckpointManager(args.dir)

  # Resume: the latest finished checkpoint, with the data position saved in it.
  latest = manager.latest_step()
  if latest is None:
    state, position = build_state(), 0
  else:
    state = manager.restore(jax.eval_shape(build_state), step=latest)
    position = manager.data_state(latest)["position"]
  start = int(state.step)
  print(f"RESUMED rank {rank} attempt {attempt} step {start} position {position}", flush=True)
  if args.progress:
    base = os.path.join(args.progress, f"rank{rank}.attempt{attempt}")
    _write(base + ".pid", str(os.getpid()))

  per = GLOBAL_BATCH // world
  for step in range(start + 1, args.steps + 1):
    batch, position = next_batch(position)
    local = {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}
    state, metrics = train_step(state, local)
    loss = float(metrics["loss"])
    if args.progress:
      _write(base, str(step))
    stop = distributed.should_stop(step)
    if step % args.save_every == 0 or stop:
      manager.save(state, force=stop, data_state={"position": position})
    if stop:
      manager.wait_until_finished()
      print(f"STOPPED rank {rank} attempt {attempt} step {step} position {position}",
            flush=True)
      manager.close()
      distributed.shutdown()
      sys.exit(distributed.EXIT_RESTART)
    print(f"rank {rank} step {step} loss {loss!r}", flush=True)
    if args.step_sleep:
      time.sleep(args.step_sleep)
  manager.wait_until_finished()
  manager.close()

  params = fsdp_jax.state_dict(state, rank0_only=True, offload_to_cpu=True)
  osd = fsdp_jax.full_optim_state_dict(state)  # rank0_only
  if rank == 0:
    arrays = {f"params/{k}": np.asarray(v) for k, v in params.items()}
    for path, leaf in jax.tree_util.tree_flatten_with_path(osd)[0]:
      if isinstance(leaf, str):
        continue
      arrays["opt" + jax.tree_util.keystr(path)] = np.asarray(leaf)
    arrays["step"] = np.asarray(int(state.step))
    arrays["position"] = np.asarray(position)
    np.savez(args.out, **arrays)
  print(f"DONE rank {rank} attempt {attempt} step {int(state.step)} position {position}",
        flush=True)
  distributed.shutdown()


if __name__ == "__main__":
  main()
