"""Worker script for tests/test_multiprocess.py.

Run under the launcher (``python -m fsdp_jax.launch --nproc 2
--devices-per-proc 4 tests/mp_worker.py train --out r.json``) or started
directly with the launcher's environment. Modes:

* ``train``: FULL_SHARD on an 8-device ``("shard",)`` mesh and HYBRID_SHARD on
  a ``replicate=2 x shard=4`` mesh; each process feeds its part of the global
  batch; process 0 writes per-step losses, final parameters and the mesh
  layout (process of every mesh device) to ``--out``. :func:`train` is also
  what the test runs in one process on 8 devices for the reference numbers.
  Then tensor parallelism within the processes, and context parallelism
  (:func:`train_context`) with a context group spanning both processes and
  one within each.
* ``fail``: trains until ``--victim`` does ``--how`` (kill: SIGKILL itself,
  raise: an uncaught ValueError, exit: ``sys.exit(3)``) at step ``--at``; the others must then be
  stopped by the watchdog (they print FINISHED if they are not).
* ``barrier``: monitored_barrier passing, mismatching names, and timing out
  on a process that never arrives; process 0 writes what it saw to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

import numpy as np

STEPS = 5
GLOBAL_BATCH = 24


def np_params(seed=0, d_in=5, d=7, d_out=3, blocks=3):
  """helpers.mlp_params' uneven shapes, drawn with NumPy: no JAX random
  programs to compile, and bit-identical in every process."""
  rng = np.random.RandomState(seed)
  f32 = lambda *shape: (rng.standard_normal(shape) * 0.5).astype(np.float32)
  return {"inp": {"w": f32(d_in, d)},
          "blocks": [{"w": f32(d, d), "b": np.full((d,), 0.1, np.float32)}
                     for _ in range(blocks)],
          "out": {"w": f32(d, d_out)}}


def np_batch(seed, n=GLOBAL_BATCH, d_in=5, d_out=3):
  rng = np.random.RandomState(seed)
  return {"x": rng.standard_normal((n, d_in)).astype(np.float32),
          "y": rng.standard_normal((n, d_out)).astype(np.float32)}


def flat(tree):
  """``{"['blocks'][0]['w']": ndarray, ...}``: a tree as comparable leaves."""
  import jax
  return {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def dotted(tree):
  """``{"blocks.0.w": ndarray, ...}``: PyTorch-style names of the leaves."""
  import jax
  def name(path):
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
  return {name(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def lora_config():
  """LoRA on the blocks' kernels (int8 base), the output layer trained."""
  import jax.numpy as jnp
  import fsdp_jax
  return fsdp_jax.LoRA(targets=("blocks.*.w",), rank=2, alpha=4.0, trainable=("out",),
                       base_quantization=fsdp_jax.Quantization(dtype=jnp.int8, block_size=4))


def setup(strategy: str = "FULL_SHARD", lr: float = 1e-2, nonfinite: str = "propagate",
          lora: bool = False):
  """The state and step of the helpers' uneven MLP with Adam: FULL_SHARD on
  a ``("shard",)`` mesh of all devices, HYBRID on ``replicate=2 x shard=N/2``.
  Returns ``(state, step, mesh)``."""
  import jax
  import optax

  import fsdp_jax
  from helpers import mlp_loss

  S = fsdp_jax.ShardingStrategy
  strategy = S[strategy]
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, nonfinite=nonfinite,
                               lora=lora_config() if lora else None, use_orig_params=lora)
  if strategy in (S.HYBRID_SHARD, S._HYBRID_SHARD_ZERO2):
    mesh = fsdp_jax.make_mesh(replicate=2, shard=jax.device_count() // 2)
  else:
    mesh = fsdp_jax.make_mesh(shard=jax.device_count())
  opt = optax.adam(lr)
  state = fsdp_jax.init_train_state(params=np_params(), optimizer=opt, mesh=mesh,
                                    config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config)
  return state, step, mesh


def run_steps(state, step, first: int, last: int, bad_step=None, flags=None):
  """Steps ``first .. last-1`` on batches ``np_batch(100 + i)``; process p
  feeds rows ``p*B/P .. (p+1)*B/P`` of each global batch. At ``bad_step``
  the last row (the last process's) holds a NaN; ``flags`` collects each
  step's ``metrics["nonfinite"]``. Returns ``(state, losses)``."""
  import jax
  nproc, me = jax.process_count(), jax.process_index()
  per = GLOBAL_BATCH // nproc
  losses = []
  for i in range(first, last):
    batch = np_batch(seed=100 + i)
    if i == bad_step:
      batch["x"][-1, 0] = np.nan
    local = jax.tree.map(lambda x: x[me * per:(me + 1) * per], batch)
    state, metrics = step(state, local)
    losses.append(float(metrics["loss"]))
    if flags is not None:
      flags.append(bool(metrics["nonfinite"]))
  return state, losses


def train(strategy: str, steps: int = STEPS):
  """Trains the helpers' uneven MLP; returns (losses, params, layout).

  Works unchanged for one process with 8 devices and for 2 processes with 4
  each. ``layout`` is the process index of every device of the mesh, in mesh
  order.
  """
  import fsdp_jax
  state, step, mesh = setup(strategy)
  layout = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices).tolist()
  state, losses = run_steps(state, step, 0, steps)
  return losses, flat(fsdp_jax.summon_full_params(state)), layout


def train_lora(strategy: str, steps: int = STEPS):
  """LoRA with an int8 base: (losses, merged params)."""
  import fsdp_jax
  state, step, _ = setup(strategy, lora=True)
  state, losses = run_steps(state, step, 0, steps)
  return losses, flat(fsdp_jax.summon_full_params(state))


def train_tensor(steps: int = STEPS):
  """Tensor parallelism within a process (``tensor=4``), FSDP across
  processes (``shard=2``), on the helpers' MLP with 8-wide layers: (losses,
  params, layout)."""
  import jax
  import optax

  import fsdp_jax
  from helpers import mlp_loss

  rules = [("inp.w", "colwise"), ("blocks.0.w", "rowwise"), ("blocks.1.w", "colwise"),
           ("blocks.1.b", ("tensor",)), ("blocks.2.w", "rowwise")]
  config = fsdp_jax.FSDPConfig(tensor_parallel=fsdp_jax.TensorParallel(rules=rules))
  mesh = fsdp_jax.make_mesh(shard=2, tensor=jax.device_count() // 2)
  opt = optax.adam(1e-2)
  state = fsdp_jax.init_train_state(params=np_params(d=8), optimizer=opt, mesh=mesh,
                                    config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config)
  layout = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices).tolist()
  state, losses = run_steps(state, step, 0, steps)
  return losses, flat(fsdp_jax.summon_full_params(state)), layout


# name: (make_mesh's sizes, global batch rows, ContextParallel's options)
CONTEXT_MESHES = {
    # a context group over both processes, head-tail chunks (ppermutes across them)
    "context8": (dict(shard=1, context=8), 2, dict(load_balance=True)),
    "shard2_context4": (dict(shard=2, context=4), 4, {}),  # one within each, contiguous
}


def context_params(seed=0):
  """test_context_parallel's decoder parameters (two attention layers),
  drawn with NumPy."""
  import test_context_parallel as t
  rng = np.random.RandomState(seed)
  n = lambda *shape: (rng.standard_normal(shape) * 0.3).astype(np.float32)
  layers = [{"wq": n(t.D, t.HEADS * t.KV), "wk": n(t.D, t.KV), "wv": n(t.D, t.KV),
             "wo": n(t.HEADS * t.KV, t.D)} for _ in range(2)]
  return {"emb": n(t.VOCAB, t.D), "layers": layers, "head": n(t.D, t.VOCAB)}


def train_context(name: str, steps: int = 2):
  """Context parallelism on ``CONTEXT_MESHES[name]``: test_context_parallel's
  decoder (einsum attention, rotary, a WeightedLoss over ``logits[:, :-1]``)
  for ``steps`` Adam steps, then ``shard_eval_step`` of the loss on the
  last batch. Each process passes the rows its devices hold (all of them
  when one context group spans both processes) with their whole sequences.
  Returns (losses, params, eval loss, layout, the error a step gives when
  the processes of one context group pass different rows, or None)."""
  import jax
  import optax
  import fsdp_jax
  import test_context_parallel as t
  mesh_kw, b, cp = CONTEXT_MESHES[name]
  mesh = fsdp_jax.make_mesh(**mesh_kw)
  opt = optax.adam(1e-2)
  config = fsdp_jax.FSDPConfig(context_parallel=fsdp_jax.ContextParallel(**cp))
  state = fsdp_jax.init_train_state(params=context_params(), optimizer=opt, mesh=mesh,
                                    config=config)
  step = fsdp_jax.shard_train_step(t.weighted_loss)
  nproc, me = jax.process_count(), jax.process_index()
  per = b // nproc if mesh_kw["shard"] > 1 else b
  first = me * per if mesh_kw["shard"] > 1 else 0
  mine = lambda batch: jax.tree.map(lambda x: x[first:first + per], batch)
  losses = []
  batches = t._batches(b, seed=7, steps=steps)  # pylint: disable=protected-access
  for batch in batches:
    state, metrics = step(state, mine(batch))
    losses.append(float(metrics["loss"]))
  ev = float(fsdp_jax.shard_eval_step(t.weighted_loss)(state, mine(batch)))
  layout = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices).tolist()
  error = None
  if mesh_kw["shard"] == 1:  # each process its own row, as without a context axis: refused
    try:
      step(state, jax.tree.map(lambda x: x[me:me + 1], batch))
    except ValueError as e:
      error = str(e)
  return losses, flat(fsdp_jax.summon_full_params(state)), ev, layout, error


def train_skipping(strategy: str, steps: int = STEPS, bad_step: int = 2):
  """``train`` with ``FSDPConfig(nonfinite="skip")`` and a NaN in the last
  process's rows at ``bad_step``: returns (flags per step, skipped steps,
  step count, params)."""
  import jax
  import fsdp_jax
  state, step, _ = setup(strategy, nonfinite="skip")
  flags: list = []
  state, _ = run_steps(state, step, 0, steps, bad_step=bad_step, flags=flags)
  return (flags, int(jax.device_get(state.nonfinite_steps)), int(jax.device_get(state.step)),
          flat(fsdp_jax.summon_full_params(state)))


def checkpoint_round(directory: str, steps: int = 3):
  """Trains ``steps`` steps, saves a checkpoint to ``directory``, takes one
  more step. Returns ``(loss of that step, params after it)``."""
  import fsdp_jax
  from fsdp_jax import CheckpointManager
  state, step, _ = setup()
  state, _ = run_steps(state, step, 0, steps)
  with CheckpointManager(directory) as mngr:
    assert mngr.save(state)
    mngr.wait_until_finished()
  state, losses = run_steps(state, step, steps, steps + 1)
  return losses[0], flat(fsdp_jax.summon_full_params(state))


def resume_round(directory: str):
  """Restores the latest checkpoint of ``directory`` into a fresh state on
  this run's devices and takes the next step. Returns ``(loss, params)``."""
  import jax
  import fsdp_jax
  from fsdp_jax import CheckpointManager
  target, step, _ = setup()
  with CheckpointManager(directory, read_only=True) as mngr:
    state = mngr.restore(target)
  saved_step = int(jax.device_get(state.step))
  state, losses = run_steps(state, step, saved_step, saved_step + 1)
  return losses[0], flat(fsdp_jax.summon_full_params(state))


def data_round(directory: str):
  """fsdp_jax.data's batches from each process's share of 40 rows
  (grain.sharding.ShardByJaxProcess), saved with the state after 2 batches
  and restored into a fresh iterator: ``(global batches after the save,
  the same after the restore, the iterator files saved)``, or None without
  grain."""
  import importlib.util
  if importlib.util.find_spec("grain") is None:
    return None
  import grain
  import jax
  from jax.experimental import multihost_utils
  import fsdp_jax
  from fsdp_jax import CheckpointManager, data
  from fsdp_jax._src.data.pipeline import _shard

  state, _, _ = setup()

  def batches():
    rows = grain.MapDataset.source([{"x": np.full(3, i, np.int32)} for i in range(40)])
    rows = _shard(rows.shuffle(seed=1), grain.sharding.ShardByJaxProcess(drop_remainder=True))
    return data.batches(rows.to_iter_dataset(), global_batch=8, mesh=state.plan.mesh)

  def take(it, n):
    return [multihost_utils.process_allgather(next(it)["x"], tiled=True)[:, 0].tolist()
            for _ in range(n)]

  it = batches()
  take(it, 2)
  with CheckpointManager(directory) as mngr:
    mngr.save(state, data_iterator=it, force=True)
    mngr.wait_until_finished()
    after_save = take(it, 3)
    again = batches()
    mngr.restore(state, data_iterator=again)
  files = sorted(f for f in os.listdir(os.path.join(directory, str(int(jax.device_get(
      state.step))), "data_iterator")) if f.endswith(".json"))
  return after_save, take(again, 3), files


def main_train(args, info):
  import jax
  out = {"world_size": info.world_size, "devices": jax.device_count(),
         "local_devices": jax.local_device_count()}
  for strategy in args.strategies.split(","):
    t = time.perf_counter()
    losses, params, layout = train(strategy, args.steps)
    out[strategy] = {"losses": losses, "params": {k: v.tolist() for k, v in params.items()}, "layout": layout,
                     "seconds": time.perf_counter() - t}
    flags, skipped, count, params = train_skipping(strategy, args.steps)
    out[strategy]["skipping"] = {"flags": flags, "skipped": skipped, "step": count,
                                 "params": {k: v.tolist() for k, v in params.items()}}
    losses, params = train_lora(strategy, args.steps)
    out[strategy]["lora"] = {"losses": losses,
                             "params": {k: v.tolist() for k, v in params.items()}}
  losses, params, layout = train_tensor(args.steps)
  out["tensor"] = {"losses": losses, "params": {k: v.tolist() for k, v in params.items()},
                   "layout": layout}
  for name in CONTEXT_MESHES:
    t = time.perf_counter()
    losses, params, ev, layout, error = train_context(name)
    out[name] = {"losses": losses, "params": {k: v.tolist() for k, v in params.items()},
                 "eval": ev, "layout": layout, "error": error,
                 "seconds": time.perf_counter() - t}
  if info.rank == 0:
    with open(args.out, "w") as f:
      json.dump(out, f)
  print(f"rank {info.rank}: done", flush=True)


def main_fail(args, info):
  import jax
  import optax

  import fsdp_jax
  from helpers import mlp_loss

  mesh = fsdp_jax.make_mesh(shard=jax.device_count())
  config = fsdp_jax.FSDPConfig()
  opt = optax.sgd(1e-3)
  state = fsdp_jax.init_train_state(params=np_params(), optimizer=opt, mesh=mesh,
                                    config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config)
  per = GLOBAL_BATCH // info.world_size
  batch = jax.tree.map(lambda x: x[info.rank * per:(info.rank + 1) * per], np_batch(0))
  for i in range(args.steps):
    if i == args.at and info.rank == args.victim:
      print(f"VICTIM {info.rank} {args.how} at {time.time():.3f}", flush=True)
      if args.how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
      if args.how == "exit":
        sys.exit(3)
      raise ValueError(f"injected failure in process {info.rank} at step {i}")
    state, metrics = step(state, batch)
    print(f"rank {info.rank} step {i} loss {float(metrics['loss']):.6f}", flush=True)
    time.sleep(0.05)
  print(f"rank {info.rank} FINISHED", flush=True)


def main_checkpoint(args, info):
  """Saves ``--save-dir`` from this run and resumes ``--restore-dir``;
  also takes a FULL state dict (rank0_only) across the processes."""
  import fsdp_jax
  from fsdp_jax import state_dict

  out = {}
  loss, params = checkpoint_round(args.save_dir)
  out["saved"] = {"loss": loss, "params": {k: v.tolist() for k, v in params.items()}}
  loss, params = resume_round(args.restore_dir)
  out["resumed"] = {"loss": loss, "params": {k: v.tolist() for k, v in params.items()}}
  state, _, _ = setup()
  full = state_dict(state, rank0_only=True, offload_to_cpu=True)
  ref = dotted(np_params())
  out["state_dict_keys"] = sorted(full)
  out["data"] = data_round(os.path.join(args.save_dir, "data"))
  out["state_dict_matches"] = (info.rank != 0 and full == {}) or (
      sorted(full) == sorted(ref)
      and all(np.array_equal(np.asarray(full[k]), ref[k]) for k in ref))
  if info.rank == 0:
    with open(args.out, "w") as f:
      json.dump(out, f)
  print(f"rank {info.rank}: checkpoint done", flush=True)


def main_sync(args, info):
  """sync_module_states: every process passes different parameters (and
  model state); with the option they all start from process 0's."""
  import jax
  import optax
  import fsdp_jax
  out = {}
  for sync in (True, False):
    params = np_params(seed=info.rank)  # differs between processes
    config = fsdp_jax.FSDPConfig(sync_module_states=sync)
    mesh = fsdp_jax.make_mesh(shard=jax.device_count())
    state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                      config=config,
                                      model_state={"stat": np.full((3,), float(info.rank), np.float32)})
    full = fsdp_jax.summon_full_params(state, offload_to_cpu=True)
    out[str(sync)] = {"params": {k: v.tolist() for k, v in flat(full).items()},
                      "stat": np.asarray(jax.device_get(
                          state.model_state["stat"].addressable_shards[0].data)).tolist()}
  with open(f"{args.out}.{info.rank}", "w") as f:
    json.dump(out, f)
  print(f"rank {info.rank}: sync done", flush=True)


def main_barrier(args, info):
  from fsdp_jax import distributed

  seen = {}
  distributed.monitored_barrier("start", timeout=30)
  seen["pass"] = "ok"
  try:  # names differ: every process must notice
    distributed.monitored_barrier(f"name-{info.rank}", timeout=10)
    seen["mismatch"] = None
  except distributed.MonitoredBarrierError as e:
    seen["mismatch"] = str(e)
  if info.rank == args.victim:
    time.sleep(args.timeout + 2)  # alive, heartbeating, never arrives
  else:
    t = time.monotonic()
    try:
      distributed.monitored_barrier("late", timeout=args.timeout)
      seen["timeout"] = None
    except distributed.MonitoredBarrierError as e:
      seen["timeout"] = str(e)
      seen["missing"] = list(e.missing)
    seen["waited"] = time.monotonic() - t
  if info.rank == 0:
    with open(args.out, "w") as f:
      json.dump(seen, f)
  print(f"rank {info.rank}: barrier done {seen}", flush=True)


def exit_after(seconds: float, name: str) -> None:
  """A hard time limit: the process exits with status 99 after ``seconds``,
  whatever it is doing then."""

  def time_limit():
    print(f"{name}: TIME LIMIT of {seconds:g} s reached", file=sys.stderr, flush=True)
    os._exit(99)

  timer = threading.Timer(seconds, time_limit)
  timer.daemon = True
  timer.start()


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("mode", choices=("train", "fail", "barrier", "checkpoint", "sync"))
  p.add_argument("--save-dir")
  p.add_argument("--restore-dir")
  p.add_argument("--out")
  p.add_argument("--strategies", default="FULL_SHARD,HYBRID_SHARD")
  p.add_argument("--steps", type=int, default=STEPS)
  p.add_argument("--victim", type=int, default=1)
  p.add_argument("--at", type=int, default=3)
  p.add_argument("--how", choices=("kill", "raise", "exit"), default="kill")
  p.add_argument("--timeout", type=float, default=3.0)
  p.add_argument("--max-seconds", type=float, default=300.0,
                 help="hard limit: exit 99 after this long, whatever happens")
  args = p.parse_args(argv)
  exit_after(args.max_seconds, "mp_worker")

  from fsdp_jax import distributed
  # Some tests start this worker directly, not through the launcher: the
  # explicit call a script run that way makes (a no-op under the launcher).
  distributed.install_failure_hooks()
  info = distributed.initialize()  # first thing: before JAX starts
  print(f"rank {info.rank}/{info.world_size} local {info.local_rank} "
        f"source {info.source}", flush=True)
  {"train": main_train, "fail": main_fail, "barrier": main_barrier,
   "checkpoint": main_checkpoint, "sync": main_sync}[args.mode](args, info)
  # As PyTorch's destroy_process_group: shut down while the interpreter is
  # whole (a rank once aborted in a native thread during interpreter
  # teardown, after its work was done).
  distributed.shutdown()


if __name__ == "__main__":
  main()
