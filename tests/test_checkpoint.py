"""Checkpointing the whole train state: exact resume, restore onto other device
counts (separate processes), strategies and layouts, retention, crash safety,
clear errors for mismatched or damaged checkpoints, no unpickling, and the
plain-tree export for inference."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import signal
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fsdp_jax
from fsdp_jax import CheckpointError, CheckpointManager, export_params, import_params
from fsdp_jax import ShardingStrategy as S
from fsdp_jax import ShardedTrainState
from fsdp_jax import full_optim_state_dict

from checkpoint_worker import MP_PARAMS, SMALL
from helpers import (Background, assert_trees_close, mesh_for, mlp_batch, mlp_loss, mlp_params,
                     subprocess_env, train_steps)

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoint_worker.py")
WRAP = fsdp_jax.ModuleWrapPolicy(["blocks.*"])
OPT = optax.adam(1e-2)
SEEDS = [30, 31, 32, 33]  # batches: 2 before the save, 2 after
BEFORE = 2


def _config(strategy=S.FULL_SHARD, orig=False):
  return fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP,
                             use_orig_params=orig)


def _abstract(mesh, config, params=None, optimizer=OPT):
  return jax.eval_shape(lambda: fsdp_jax.init_train_state(
      params=mlp_params() if params is None else params, optimizer=optimizer, mesh=mesh,
      config=config))


def _worker(spec: dict, log: str, nproc: int = 0) -> Background:
  """A checkpoint_worker.py subprocess (``nproc``: that many processes under
  ``python -m fsdp_jax.launch``)."""
  cmd = [sys.executable, WORKER, json.dumps(spec)]
  if nproc:
    cmd = [sys.executable, "-m", "fsdp_jax.launch", "--nproc", str(nproc),
           "--devices-per-proc", str(spec["devices"])] + cmd[1:]
  # Started at the module's start, waited for after the in-process tests.
  return Background(cmd, log, timeout=900, env=subprocess_env(JAX_PLATFORMS="cpu"))


def _spawn(spec: dict) -> Background:
  return _worker(spec, spec.get("log") or spec["out"] + ".log")


def _with_step(state, step: int):
  rep = NamedSharding(state.plan.mesh, P())
  return state.replace(step=jax.device_put(jnp.int32(step), rep))


def _assert_bitwise(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# Orbax's background threads may report a closed event loop after a failed read.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

# Each subprocess restores onto its own device count, strategy and layout.
RESTORE_CASES = [dict(devices=4, strategy="HYBRID_SHARD", shard=2, replicate=2, orig=True),
                 dict(devices=2, strategy="NO_SHARD", shard=2, orig=False),
                 dict(devices=3, strategy="SHARD_GRAD_OP", shard=3, orig=True)]


@pytest.fixture(scope="module")
def background(tmp_path_factory):
  """Processes started first so that they run beside the in-process tests:
  two that die in the middle of a save, and two jax.distributed processes
  (2 simulated devices each) that take state dicts and save a checkpoint."""
  base = tmp_path_factory.mktemp("background")
  procs = {where: (str(base / where),
                   _spawn(dict(mode="crash", where=where, devices=4, dir=str(base / where),
                               log=str(base / f"{where}.log"))))
           for where in ("write", "finalize")}
  spec = dict(mode="multiprocess", devices=2, orig=True, dir=str(base / "mp"),
              out=str(base / "mp"))
  procs["multiprocess"] = (spec, _worker(spec, str(base / "mp.log"), nproc=2))
  yield procs
  for _, proc in procs.values():
    proc.kill()


@pytest.fixture(scope="module")
def run(tmp_path_factory, background):
  """8 devices, FULL_SHARD, flat: train 2 steps, save (async), keep training
  right away (the step donates the state the save is reading), 2 more steps.
  Then start the processes that restore onto 4, 2 and 3 devices."""
  tmp = tmp_path_factory.mktemp("ckpt")
  directory = str(tmp / "run")
  mesh = mesh_for(S.FULL_SHARD, 8)
  config = _config()
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=OPT, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, OPT, mesh=mesh, config=config)
  for seed in SEEDS[:BEFORE]:
    state, _ = step(state, mlp_batch(seed=seed))
  at_save = jax.device_get(state)
  mngr = CheckpointManager(directory, max_to_keep=3)
  assert mngr.save(state)
  state, losses = train_steps(step, state, [mlp_batch(seed=s) for s in SEEDS[BEFORE:]])
  mngr.close()
  workers = []
  for i, case in enumerate(RESTORE_CASES):
    spec = dict(case, mode="restore_and_train", dir=directory, batch_seeds=SEEDS[BEFORE:],
                out=str(tmp / f"out{i}.npz"))
    workers.append((spec, _spawn(spec)))
  yield dict(dir=directory, mesh=mesh, config=config, step=step, at_save=at_save,
             final=state, losses=losses, workers=workers)
  for _, proc in workers:
    proc.kill()


@pytest.mark.slow
def test_resume_is_bitwise_exact(run):
  with CheckpointManager(run["dir"], read_only=True) as mngr:
    assert mngr.all_steps() == [BEFORE]
    restored = mngr.restore(_abstract(run["mesh"], run["config"]))
  assert int(restored.step) == BEFORE
  _assert_bitwise(restored, run["at_save"])
  restored, losses = train_steps(run["step"], restored,
                                 [mlp_batch(seed=s) for s in SEEDS[BEFORE:]])
  assert losses == run["losses"]
  _assert_bitwise(restored.params, run["final"].params)
  _assert_bitwise(restored.opt_state, run["final"].opt_state)


@pytest.mark.slow
def test_restore_on_4_2_3_devices_in_separate_processes(run):
  """Saved on 8 devices; each process restores onto its own device count,
  strategy and layout, and training continues with the same numbers."""
  procs = run["workers"]
  expected = {".".join(fsdp_jax._src.naming.key_name(k) for k in p): np.asarray(x) for p, x in
              jax.tree_util.tree_flatten_with_path(fsdp_jax.summon_full_params(run["final"]))[0]}
  for spec, proc in procs:
    rc, log = proc.wait(), proc.output()
    assert rc == 0, f"worker {spec} failed:\n{log[-4000:]}"
    with np.load(spec["out"]) as res:  # allow_pickle=False by default
      assert int(res["devices"]) == spec["devices"]
      assert int(res["restored_step"]) == BEFORE
      np.testing.assert_allclose(res["losses"], run["losses"], rtol=0, atol=1e-5)
      for name, value in expected.items():
        np.testing.assert_allclose(res[name], value, rtol=2e-4, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_restore_onto_other_strategy_and_layout_in_process(run):
  mesh = mesh_for(S._HYBRID_SHARD_ZERO2, 4, 2)
  config = _config(S._HYBRID_SHARD_ZERO2, orig=True)
  with CheckpointManager(run["dir"], read_only=True) as mngr:
    state = mngr.restore(_abstract(mesh, config))
  assert state.plan.config == config
  assert_trees_close(fsdp_jax.summon_full_params(state),
                     jax.tree.map(np.asarray, _full_from_host(run["at_save"])), rtol=0, atol=0)
  step = fsdp_jax.shard_train_step(mlp_loss, OPT, mesh=mesh, config=config)
  for seed in SEEDS[BEFORE:]:
    state, _ = step(state, mlp_batch(seed=seed))
  assert_trees_close(fsdp_jax.summon_full_params(state), fsdp_jax.summon_full_params(run["final"]))


def _full_from_host(host_state):
  plan = host_state.plan
  return jax.jit(lambda s: fsdp_jax._src.state.unpack_all(plan, s))(host_state.params)


# ---------------------------------------------------------------------------
# Small states for the remaining tests


def _small(n=2, optimizer=OPT, params=None, orig=False):
  mesh = fsdp_jax.make_mesh(shard=n, devices=jax.devices()[:n])
  params = params or {"w": jnp.arange(12.0).reshape(6, 2), "b": jnp.ones(3)}
  return fsdp_jax.init_train_state(params=params, optimizer=optimizer, mesh=mesh,
                                   config=fsdp_jax.FSDPConfig(use_orig_params=orig))


def test_retention_and_save_interval(tmp_path):
  state = _small()
  with CheckpointManager(tmp_path / "keep", max_to_keep=2, keep_period=2) as mngr:
    for s in range(1, 6):
      assert mngr.save(_with_step(state, s))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 4, 5]
    assert mngr.latest_step() == 5
    with pytest.raises(ValueError, match=r"step 5 is already saved.*manager\.delete\(5\)") as e:
      mngr.save(_with_step(state, 5), force=True)
    assert "manager.manager" not in str(e.value)  # names the public method
    mngr.delete(5)  # what the message says to do
    assert mngr.all_steps() == [2, 4]
    assert mngr.save(_with_step(state, 5), force=True)
    mngr.wait_until_finished()
    assert mngr.all_steps() == [2, 4, 5]
    with pytest.raises(ValueError, match="no checkpoint of step 7"):
      mngr.delete(7)
  with CheckpointManager(tmp_path / "keep", read_only=True) as mngr:
    with pytest.raises(ValueError, match="read_only=True, so step 5 is not deleted"):
      mngr.delete(5)  # orbax alone would skip it silently
    assert mngr.all_steps() == [2, 4, 5]
  with CheckpointManager(tmp_path / "every2", save_interval_steps=2,
                         enable_async_checkpointing=False) as mngr:
    assert mngr.save(_with_step(state, 1))  # orbax always writes a run's first save
    assert not mngr.save(_with_step(state, 3))
    assert mngr.save(_with_step(state, 4))
    assert mngr.save(_with_step(state, 5), force=True)
    assert mngr.all_steps() == [1, 4, 5]
    assert mngr.metadata(4)["saved_with"]["mesh"] == {"shard": 2}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["write", "finalize"])
def test_killed_save_leaves_previous_checkpoint(where, background):
  """SIGKILL while the async save of step 2 writes its arrays, or after it
  wrote them but before the commit: step 1 restores, the half-written step
  is ignored and cleaned up, and saving goes on."""
  directory, proc = background[where]
  rc, log = proc.wait(), proc.output()
  assert rc == -signal.SIGKILL, f"rc={rc}\n{log[-4000:]}"
  assert "KILLING" in log
  assert any(name.startswith("2") and name != "2" for name in os.listdir(directory)), \
      os.listdir(directory)
  mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
  small = {k: jnp.asarray(v) for k, v in SMALL.items()}
  target = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      params=small, optimizer=OPT, mesh=mesh, config=fsdp_jax.FSDPConfig()))
  with CheckpointManager(directory) as mngr:
    assert mngr.all_steps() == [1]
    state = mngr.restore(target)
    assert int(state.step) == 1
    assert_trees_close(fsdp_jax.summon_full_params(state), small, rtol=0, atol=0)  # not step 2's
    assert mngr.save(_with_step(state, 2))
    mngr.wait_until_finished()
    assert mngr.all_steps() == [1, 2]
  assert sorted(n for n in os.listdir(directory) if n[0].isdigit()) == ["1", "2"]


@pytest.mark.slow
def test_two_processes_state_dicts_and_checkpoint(background):
  """With 2 jax.distributed processes: rank0_only dicts are empty off process
  0, scatter_full_optim_state_dict takes the dict from process 0 only, and a
  checkpoint they save restores in this single process on 3 devices."""
  spec, proc = background["multiprocess"]
  rc, log = proc.wait(), proc.output()
  assert rc == 0, log[-4000:]
  results = []
  for pid in range(2):
    with open(f"{spec['out']}.{pid}.json") as fh:
      results.append(json.load(fh))
  for pid, res in enumerate(results):
    assert (res["process"], res["processes"], res["devices"]) == (pid, 2, 4)
    assert res["full_ok"] and res["mu_sum"] == 24.0 and res["w_sum"] == 552.0
  assert results[0]["full_keys"] == ["b", "w"] and results[1]["full_keys"] == []
  assert results[0]["osd_keys"] == ["param_groups", "state"] and results[1]["osd_keys"] == []
  params = {k: np.asarray(v, np.float32) for k, v in MP_PARAMS.items()}
  mesh = fsdp_jax.make_mesh(shard=3, devices=jax.devices()[:3])
  target = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      params=params, optimizer=OPT, mesh=mesh, config=fsdp_jax.FSDPConfig()))
  with CheckpointManager(spec["dir"], read_only=True) as mngr:
    assert mngr.metadata()["saved_with"]["process_count"] == 2
    state = mngr.restore(target)
  assert int(state.step) == 3
  assert_trees_close(fsdp_jax.summon_full_params(state), jax.tree.map(lambda x: 2 * x, params),
                     rtol=0, atol=0)
  mu = full_optim_state_dict(state)["state"]["w"]["0.mu"]
  np.testing.assert_array_equal(mu, np.ones((8, 3)))


# ---------------------------------------------------------------------------
# Errors


def test_mismatched_tree_names_paths_and_shapes(tmp_path):
  with CheckpointManager(tmp_path / "m") as mngr:
    mngr.save(_small())
    other = {"w": jnp.zeros((6, 3)), "b": jnp.ones(3), "c": jnp.ones(2)}
    with pytest.raises(ValueError) as e:
      mngr.restore(jax.eval_shape(lambda: _small(n=3, params=other)))
    msg = str(e.value)
    assert "params['w']: checkpoint (6, 2) float32, target (6, 3) float32" in msg
    assert "params['c']: in the target (2,) float32, not in the checkpoint" in msg
    assert "opt_state.state['w']['0.mu']: checkpoint (6, 2) float32, target (6, 3)" in msg
    assert "mesh {'shard': 2}" in msg and "mesh {'shard': 3}" in msg and "Fix:" in msg
    with pytest.raises(ValueError) as e:
      mngr.restore(_small(optimizer=optax.sgd(0.1, momentum=0.9)))
    msg = str(e.value)
    assert "opt_state.state['w']['0.mu']: in the checkpoint (6, 2) float32, not in the target" \
        in msg
    assert ("opt_state.state['w']['0.trace']: in the target (6, 2) float32, not in the "
            "checkpoint") in msg
    assert ("opt_state.param_groups[0]['0.count']: in the checkpoint () int32, not in the "
            "target") in msg
    # A saved key the target lacks names the init_train_state argument that adds it.
    keyed = _small().replace(rng=jax.random.key(0), step=jnp.asarray(7, jnp.int32))
    mngr.save(keyed, force=True)
    mngr.wait_until_finished()
    with pytest.raises(ValueError) as e:
      mngr.restore(_small(), step=7)
    assert ("rng: in the checkpoint (1 leaves), not in the target (build the target with "
            "init_train_state(..., rng=key) too)") in str(e.value), str(e.value)


def test_mismatched_flax_model_names_each_entry_once(tmp_path):
  """A Flax linen model's parameter names start with its "params" collection;
  the messages name the state field, then that name, without repeating it."""
  class Model(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
      x = nn.BatchNorm(use_running_average=False)(nn.Dense(self.width)(x))
      return nn.Dense(2)(x)

  mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  x = jnp.ones((2, 3))

  def build(width):
    return fsdp_jax.init_train_state(
        init_fn=lambda k: Model(width).init(k, x), rng=jax.random.key(0),
        optimizer=optax.adam(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())

  with CheckpointManager(tmp_path / "flax") as mngr:
    mngr.save(build(4))
    mngr.wait_until_finished()
    with pytest.raises(ValueError) as e:
      mngr.restore(jax.eval_shape(lambda: build(5)))
  msg = str(e.value)
  assert "params.params" not in msg and "state.params.Dense" not in msg, msg
  assert "each named by the train state field and the entry's keys" in msg
  assert "  params['params.Dense_0.bias']: checkpoint (4,) float32, target (5,) float32" in msg
  assert ("  opt_state.state['params.Dense_0.kernel']['0.mu']: checkpoint (3, 4) float32, "
          "target (3, 5) float32") in msg
  assert ("  model_state['batch_stats.BatchNorm_0.mean']: checkpoint (4,) float32, "
          "target (5,) float32") in msg


def _damage(path, how):
  state_dir = os.path.join(path, "state")
  data = [os.path.join(root, f) for root, _, files in os.walk(state_dir) for f in files
          if os.path.basename(root) == "d"]
  if how == "arrays":  # the array data files are gone
    for f in data:
      os.remove(f)
  elif how == "truncated":  # every data file cut short (e.g. a full disk)
    for f in data:
      with open(f, "r+b") as fh:
        fh.truncate(7)
  elif how == "no_state":  # the arrays' item directory is gone
    shutil.rmtree(state_dir)
  elif how == "meta":
    with open(os.path.join(path, "meta", "metadata"), "w") as fh:
      fh.write("{not json")
  elif how == "foreign":
    with open(os.path.join(path, "meta", "metadata"), "w") as fh:
      json.dump({"format": "something else"}, fh)


def test_damaged_checkpoint_gives_clear_error(tmp_path):
  directory = tmp_path / "bad"
  state = _small()
  kinds = ["arrays", "truncated", "no_state", "meta", "foreign"]
  with CheckpointManager(directory, enable_async_checkpointing=False) as mngr:
    for s in range(1, len(kinds) + 2):
      mngr.save(_with_step(state, s))
  for s, how in enumerate(kinds, start=2):
    _damage(os.path.join(directory, str(s)), how)
  with CheckpointManager(directory, read_only=True) as mngr:
    for s, how in enumerate(kinds, start=2):
      with pytest.raises(CheckpointError) as e:
        mngr.restore(state, step=s)
      msg = str(e.value)
      assert f"step {s}" in msg and str(directory) in msg, (how, msg)
      # The fix comes first; a low-level error (a TensorStore spec, ...) last.
      assert msg.startswith("Fix: restore another step with restore(target, step=S) "
                            "(finished steps: [1,"), msg
      if "Details:" in msg:
        assert msg.index("Details:") > msg.index(f"step {s} of the checkpoint"), msg
        assert "tensorstore_spec" not in msg.split("Details:")[0], msg
    assert int(mngr.restore(state, step=1).step) == 1
    with pytest.raises(FileNotFoundError, match=r"finished steps: \[1, 2, 3, 4, 5, 6\]"):
      mngr.restore(state, step=9)
  with pytest.raises(FileNotFoundError, match="No finished checkpoint"):
    CheckpointManager(tmp_path / "empty").restore(state)


def test_writable_manager_does_not_create_a_mistyped_tree(tmp_path):
  """A writable manager creates its directory but not missing parents (a
  typo must not grow a new tree), unless create_parents=True."""
  typo = tmp_path / "runz" / "exp1" / "ckpt"
  with pytest.raises(FileNotFoundError) as e:
    CheckpointManager(typo)
  msg = str(e.value)
  assert msg.startswith("Fix: check the path for a typo"), msg
  assert f"os.makedirs({str(typo.parent)!r})" in msg and "create_parents=True" in msg
  assert f"nearest existing directory is {tmp_path}" in msg, msg
  assert not (tmp_path / "runz").exists()
  # The last component alone is created, as before.
  with CheckpointManager(tmp_path / "ckpt", enable_async_checkpointing=False) as mngr:
    assert mngr.save(_small())
  assert (tmp_path / "ckpt" / "0").is_dir()
  with CheckpointManager(typo, create_parents=True, enable_async_checkpointing=False) as mngr:
    assert mngr.save(_small())
  assert (typo / "0").is_dir()
  # Read-only managers never create anything.
  missing = tmp_path / "nothing" / "here"
  with pytest.raises(FileNotFoundError, match="No finished checkpoint"):
    CheckpointManager(missing, read_only=True).restore(_small())
  assert not (tmp_path / "nothing").exists()
  (tmp_path / "a_file").write_text("x")
  with pytest.raises(NotADirectoryError, match=r"^Fix: pass a directory path"):
    CheckpointManager(tmp_path / "a_file")
  with pytest.raises(NotADirectoryError, match=r"its ancestor .*a_file is a file"):
    CheckpointManager(tmp_path / "a_file" / "ckpt")


def test_directory_made_by_another_process_meanwhile_is_not_a_file(tmp_path, monkeypatch):
  """Every process of a job builds its manager; one may create the
  directory between another's checks (it is then a directory, not a file)."""
  from fsdp_jax._src import checkpoint as ckpt_lib  # pylint: disable=import-outside-toplevel
  target = tmp_path / "ckpt"
  real_isdir = ckpt_lib.os.path.isdir
  calls = []

  def isdir_made_meanwhile(path):
    calls.append(path)
    if str(path) == str(target) and len(calls) == 1:
      target.mkdir()  # the other process, right after this check
      return False
    return real_isdir(path)

  monkeypatch.setattr(ckpt_lib.os.path, "isdir", isdir_made_meanwhile)
  ckpt_lib._check_creatable(str(target), False)  # pylint: disable=protected-access
  assert target.is_dir() and len(calls) >= 2


@pytest.mark.slow  # the module's training run
def test_loading_never_unpickles(run, tmp_path, monkeypatch):
  def refuse(*a, **k):
    raise AssertionError("checkpoint loading tried to unpickle")

  path = export_params(run["final"], tmp_path / "export")
  monkeypatch.setattr(pickle, "loads", refuse)
  monkeypatch.setattr(pickle, "load", refuse)
  monkeypatch.setattr(pickle, "Unpickler", refuse)
  monkeypatch.setattr(np, "load", refuse)
  with CheckpointManager(run["dir"], read_only=True) as mngr:
    mngr.metadata()
    mngr.restore(_abstract(run["mesh"], run["config"]))
  import_params(path)


# ---------------------------------------------------------------------------
# Other state fields, export


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateWithExtras(ShardedTrainState):
  """A train state with the fields the engine will grow."""

  model_state: Any = None
  rng: Any = None


def test_model_state_and_rng_round_trip(tmp_path):
  base = _small(n=4)
  stats = {"batch_stats": {"bn": {"mean": jnp.arange(3.0), "var": jnp.full(3, 2.0)}}}
  state = StateWithExtras(step=base.step, params=base.params, opt_state=base.opt_state,
                          plan=base.plan, model_state=stats, rng=jax.random.key(7))
  with CheckpointManager(tmp_path / "x") as mngr:
    mngr.save(state)
    other = _small(n=3, orig=True)
    target = StateWithExtras(step=other.step, params=other.params, opt_state=other.opt_state,
                             plan=other.plan,
                             model_state=jax.tree.map(jnp.zeros_like, stats),
                             rng=jax.random.key(0))
    restored = mngr.restore(target)
  assert isinstance(restored, StateWithExtras) and restored.plan is other.plan
  assert restored.model_state["batch_stats"]["bn"]["mean"].tolist() == [0.0, 1.0, 2.0]
  np.testing.assert_array_equal(jax.random.key_data(restored.rng),
                                jax.random.key_data(jax.random.key(7)))
  assert_trees_close(fsdp_jax.summon_full_params(restored), fsdp_jax.summon_full_params(base), rtol=0, atol=0)


@pytest.mark.slow  # the module's training run
def test_export_and_import_plain_tree(run, tmp_path):
  final = fsdp_jax.summon_full_params(run["final"])
  path = export_params(run["final"], tmp_path / "export")
  tree = import_params(path)
  assert jax.tree.structure(tree) == jax.tree.structure(mlp_params())
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(tree))
  assert_trees_close(tree, final, rtol=0, atol=0)
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[1])
  on_dev = import_params(path, sharding=dev)
  assert all(x.sharding == dev for x in jax.tree.leaves(on_dev))
  plain = ocp.StandardCheckpointer().restore(os.path.join(path, "params"))
  assert_trees_close(plain, final, rtol=0, atol=0)
  state = fsdp_jax.init_train_state(params=tree, optimizer=OPT, mesh=mesh_for(S.NO_SHARD, 2),
                                    config=_config(S.NO_SHARD))
  assert_trees_close(fsdp_jax.summon_full_params(state), final, rtol=0, atol=0)
  with pytest.raises(FileExistsError, match="force=True"):
    export_params(run["final"], path)
  with pytest.raises(FileNotFoundError, match="not a parameter export"):
    import_params(tmp_path)


def test_empty_fields_do_not_block_restore(tmp_path):
  """A state class with extra, empty fields (model_state=None, ...) restores a
  checkpoint saved without them, and the other way round."""
  base = _small(n=2)
  extended = StateWithExtras(step=base.step, params=base.params, opt_state=base.opt_state,
                             plan=base.plan)
  with CheckpointManager(tmp_path / "a") as mngr:
    mngr.save(base)
    restored = mngr.restore(extended)
  assert isinstance(restored, StateWithExtras) and restored.rng is None
  with CheckpointManager(tmp_path / "b") as mngr:
    mngr.save(extended)
    assert int(mngr.restore(base).step) == 0
    with pytest.raises(ValueError, match="rng: in the target"):
      mngr.restore(extended.replace(rng=jax.random.key(1)))
