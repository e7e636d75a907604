"""CPUOffload(offload_params=True): params and optimizer state in pinned_host
memory, training that matches unsharded single-device JAX, what the compiled
step keeps on the device, full-parameter access, state dicts and checkpoints."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fsdp_jax
from fsdp_jax._src import offload
from fsdp_jax import CheckpointManager
from fsdp_jax import ShardingStrategy as S
from fsdp_jax.hlo import entry_memory_bytes
from fsdp_jax import load_state_dict, optim_state_dict, optim_state_dict_to_load, state_dict

from helpers import (assert_trees_close, mesh_for, mlp_batch, mlp_loss, mlp_params,
                     reference_run, shard_map_body, train_steps)

WRAP = fsdp_jax.ModuleWrapPolicy(["blocks.*"])
OFFLOAD = fsdp_jax.CPUOffload(offload_params=True)
STEPS = 3
OPT = optax.adam(1e-2)
HOST = "pinned_host"

# Checkpoints: orbax's background threads may report a closed event loop.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _config(strategy=S.FULL_SHARD, offloaded=True, **kw):
  return fsdp_jax.FSDPConfig(sharding_strategy=strategy, auto_wrap_policy=WRAP,
                             cpu_offload=OFFLOAD if offloaded else None, **kw)


def _batches(n=STEPS, seed=10):
  return [mlp_batch(seed=seed + i) for i in range(n)]


def _kinds(tree):
  return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _assert_offloaded(state):
  assert _kinds(state.params) == {HOST}
  assert _kinds(state.opt_state) == {HOST}
  assert state.step.sharding.memory_kind == "device"


def _assert_bitwise(a, b):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------
# Training matches the unsharded reference


CASES = [
    # strategy, shard, replicate, use_orig_params, max_norm. Flat units that
    # a mesh divides: HYBRID_SHARD 2x2 (8 devices: the compiled-step test
    # below).
    (S.FULL_SHARD, 3, None, False, None),
    (S.SHARD_GRAD_OP, 4, None, True, None),
    (S.HYBRID_SHARD, 2, 2, False, None),
    (S.FULL_SHARD, 3, None, False, 0.5),
    (S.HYBRID_SHARD, 2, 2, True, 0.5),
]


def _id(case):
  s, n, r, orig, clip = case
  return (f"{s.name}-{f'{r}x{n}' if r else n}-{'orig' if orig else 'flat'}"
          + (f"-clip{clip}" if clip else ""))


@functools.cache  # one unsharded run per clipping setting, shared by the cases
def _reference(max_norm):
  ref_opt = optax.adam(1e-2)
  if max_norm is not None:  # PyTorch's clip_grad_norm_ on the whole gradient
    ref_opt = optax.chain(optax.clip_by_global_norm(max_norm), ref_opt)
  return reference_run(mlp_loss, mlp_params(), _batches(), ref_opt)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_matches_unsharded_training(case):
  strategy, n, r, orig, max_norm = case
  params, batches = mlp_params(), _batches()
  ref_losses, ref_final = _reference(max_norm)

  mesh = mesh_for(strategy, n, r)
  config = _config(strategy, use_orig_params=orig)
  opt = optax.adam(1e-2)
  state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
  _assert_offloaded(state)
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config, max_norm=max_norm)
  norms = []
  losses = []
  for b in batches:
    old = state
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
    if max_norm is not None:
      norms.append(float(metrics["grad_norm"]))
    # donate=True: the host buffers of the old state were reused.
    assert all(x.is_deleted() for x in jax.tree.leaves(old.params))
    _assert_offloaded(state)
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_final)
  assert int(state.step) == STEPS
  if max_norm is not None:
    assert min(norms) > max_norm  # the clip was active on every step


@pytest.mark.slow
def test_bf16_mixed_precision():
  mp = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
  params, batches = mlp_params(), _batches()

  def ref_loss(p, b):  # full-precision masters, bf16 compute and inputs
    cast = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)
    return mlp_loss(cast(p), cast(b)).astype(jnp.float32)

  ref_losses, ref_final = reference_run(ref_loss, params, batches, optax.adam(1e-2))
  mesh = mesh_for(S.FULL_SHARD, 4)
  finals, all_losses = [], []
  for offloaded in (True, False):
    config = _config(mixed_precision=mp, offloaded=offloaded)
    opt = optax.adam(1e-2)
    state = fsdp_jax.init_train_state(params=params, optimizer=opt, mesh=mesh, config=config)
    step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config)
    state, losses = train_steps(step, state, batches)
    if offloaded:
      _assert_offloaded(state)
      assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    finals.append(fsdp_jax.summon_full_params(state))
    all_losses.append(losses)
  # bf16 sums in another order than the unsharded reference: bf16 tolerances.
  np.testing.assert_allclose(all_losses[0], ref_losses, rtol=0, atol=2e-2)
  assert_trees_close(finals[0], ref_final, rtol=2e-2, atol=2e-3)
  # The same program as without offload, up to where the optimizer runs.
  np.testing.assert_allclose(all_losses[0], all_losses[1], rtol=0, atol=1e-6)
  assert_trees_close(finals[0], finals[1], rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_init_fn_frozen_and_ignored_leaves():
  """Params from init_fn, a frozen unit and an ignored leaf: all stored on the
  host; training equals the same run without offload."""
  params, batches = mlp_params(), _batches(2)
  mesh = mesh_for(S.FULL_SHARD, 4)
  requires_grad = {"inp": {"w": False}, "blocks": [True] * 3, "out": True}
  results = []
  for offloaded in (True, False):
    config = _config(offloaded=offloaded, use_orig_params=True,
                     ignored_states=["out.w"])
    opt = optax.adam(1e-2)
    state = fsdp_jax.init_train_state(init_fn=lambda: params, optimizer=opt, mesh=mesh,
                                      config=config, requires_grad=requires_grad)
    if offloaded:
      _assert_offloaded(state)
    step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config)
    state, losses = train_steps(step, state, batches)
    if offloaded:
      _assert_offloaded(state)
    results.append((losses, fsdp_jax.summon_full_params(state)))
  np.testing.assert_allclose(results[0][0], results[1][0], rtol=0, atol=1e-6)
  assert_trees_close(results[0][1], results[1][1], rtol=1e-6, atol=1e-7)
  # The frozen leaf never moved.
  np.testing.assert_array_equal(np.asarray(results[0][1]["inp"]["w"]), params["inp"]["w"])


# ---------------------------------------------------------------------------
# What the compiled step keeps on the device


def _shard_bytes(tree) -> int:
  return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


@pytest.mark.slow
@pytest.mark.parametrize("strategy,n,r", [(S.FULL_SHARD, 8, None), (S.HYBRID_SHARD, 2, 2)])
def test_compiled_step_keeps_params_and_opt_state_on_host(strategy, n, r):
  mesh = mesh_for(strategy, n, r)
  batch = mlp_batch()
  mems = {}
  for offloaded in (True, False):
    config = _config(strategy, offloaded=offloaded)
    opt = optax.adam(1e-2)
    state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh,
                                      config=config)
    step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh, config=config, max_norm=1.0)
    mems[offloaded] = entry_memory_bytes(step.lower(state, batch).compile().as_text())
    if offloaded:
      off_state = state
      # Lowered on shapes alone (jax.eval_shape drops the shardings): the
      # same program, reading the state from host memory.
      abstract = jax.eval_shape(lambda: fsdp_jax.init_train_state(  # pylint: disable=cell-var-from-loop
          params=mlp_params(), optimizer=opt, mesh=mesh, config=config))
      shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
      assert entry_memory_bytes(step.lower(abstract, shapes).compile().as_text()) == mems[True]
  mem, base = mems[True], mems[False]
  n_params = len(jax.tree.leaves(off_state.params))
  n_opt = len(jax.tree.leaves(off_state.opt_state))
  # Arguments: step, params, opt_state, batch (x, y), in jit's flattening order.
  assert len(mem.arguments) == 1 + n_params + n_opt + 2
  assert [b.host for b in mem.arguments] == (
      [False] + [True] * (n_params + n_opt) + [False, False])
  # Outputs: the new state (same layout), then the metrics (grad_norm, loss, nonfinite).
  assert [b.host for b in mem.outputs] == (
      [False] + [True] * (n_params + n_opt) + [False, False, False])
  assert not any(b.host for b in base.arguments + base.outputs)
  state_bytes = _shard_bytes(off_state.params) + _shard_bytes(off_state.opt_state)
  assert mem.argument_host_bytes == state_bytes
  assert base.argument_device_bytes - mem.argument_device_bytes == state_bytes
  assert base.output_device_bytes - mem.output_device_bytes == state_bytes
  batch_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch)) // (n * (r or 1))
  assert mem.argument_device_bytes == 4 + batch_bytes  # the step counter and the batch


def test_entry_memory_bytes_parses_tuples_and_scalars():
  text = ("HloModule m, entry_computation_layout={(f32[4,2]{1,0:S(5)}, (s32[], bf16[3]{0}), "
          "pred[])->(f32[4,2]{1,0:S(5)}, f32[])}, num_partitions=2\n")
  mem = entry_memory_bytes(text)
  assert [(b.dtype, b.shape, b.host) for b in mem.arguments] == [
      ("f32", (4, 2), True), ("s32", (), False), ("bf16", (3,), False), ("pred", (), False)]
  assert (mem.argument_host_bytes, mem.argument_device_bytes) == (32, 4 + 6 + 1)
  assert (mem.output_host_bytes, mem.output_device_bytes) == (32, 4)


# ---------------------------------------------------------------------------
# Full parameters, state dicts


@pytest.mark.slow
def test_full_param_access_and_write_back():
  params = mlp_params()
  mesh = mesh_for(S.FULL_SHARD, 3)
  config = _config()
  state = fsdp_jax.init_train_state(params=params, optimizer=OPT, mesh=mesh, config=config)
  _assert_bitwise(fsdp_jax.summon_full_params(state), params)
  _assert_bitwise(fsdp_jax.summon_full_params(state, offload_to_cpu=True), params)
  batch = mlp_batch()
  grads = fsdp_jax.custom.sharded_grads(mlp_loss, state, batch)
  _, full_grads = fsdp_jax.summon_full_params(state, with_grads=True, grads=grads)
  assert_trees_close(full_grads, jax.grad(mlp_loss)(params, batch), rtol=1e-5, atol=1e-6)

  doubled = jax.tree.map(lambda x: x * 2, params)
  state = fsdp_jax.write_full_params(state, lambda p: jax.tree.map(lambda x: x * 2, p))
  _assert_offloaded(state)
  _assert_bitwise(fsdp_jax.summon_full_params(state), doubled)
  state = fsdp_jax.apply(state, lambda name, x: x * 0 if name.endswith(".b") else x)
  _assert_offloaded(state)
  expected = jax.tree.map(lambda x: x * 2, params)
  for blk in expected["blocks"]:
    blk["b"] = jnp.zeros_like(blk["b"])
  _assert_bitwise(fsdp_jax.summon_full_params(state), expected)

  # Training after the write-backs matches the reference from those params.
  batches = _batches()
  ref_losses, ref_final = reference_run(mlp_loss, expected, batches, optax.adam(1e-2))
  step = fsdp_jax.shard_train_step(mlp_loss, OPT, mesh=mesh, config=config)
  state, losses = train_steps(step, state, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=0, atol=1e-5)
  assert_trees_close(fsdp_jax.summon_full_params(state), ref_final)


class _Run:
  """FULL_SHARD on 4 devices, with or without offload, with one compiled step
  shared by the state-dict and checkpoint tests."""

  def __init__(self, offloaded: bool):
    self.mesh = mesh_for(S.FULL_SHARD, 4)
    self.config = _config(offloaded=offloaded)
    self.step = fsdp_jax.shard_train_step(mlp_loss, OPT, mesh=self.mesh, config=self.config)

  def init(self, params=None):
    return fsdp_jax.init_train_state(params=mlp_params() if params is None else params,
                                     optimizer=OPT, mesh=self.mesh, config=self.config)

  def train(self, batches, state=None):
    return train_steps(self.step, self.init() if state is None else state, batches)


@pytest.fixture(scope="module")
def runs():
  return {True: _Run(True), False: _Run(False)}


@pytest.mark.slow
def test_state_dicts_round_trip(runs):
  T = fsdp_jax.StateDictType
  params, batches = mlp_params(), _batches(2)
  state, _ = runs[True].train(batches)
  _, ref_final = reference_run(mlp_loss, params, batches, optax.adam(1e-2))

  full = state_dict(state, offload_to_cpu=True)
  assert all(isinstance(v, np.ndarray) for v in full.values())
  np.testing.assert_allclose(full["blocks.0.w"], ref_final["blocks"][0]["w"], rtol=2e-4, atol=1e-6)
  np.testing.assert_allclose(full["out.w"], ref_final["out"]["w"], rtol=2e-4, atol=1e-6)
  sharded = state_dict(state, state_dict_type=T.SHARDED_STATE_DICT)
  local = state_dict(state, state_dict_type=T.LOCAL_STATE_DICT)
  assert _kinds({k: v for k, v in local.items() if k != "_metadata"}) == {HOST}
  osd = optim_state_dict(state)
  local_osd = optim_state_dict(state, state_dict_type=T.LOCAL_STATE_DICT)
  host_osd = optim_state_dict(state, offload_to_cpu=True)
  zeros = jax.tree.map(jnp.zeros_like, params)

  # Into an offloaded state on another mesh and layout, and into one without offload.
  for cfg, n, sd_, kind in [
      (_config(S.SHARD_GRAD_OP, use_orig_params=True), 3, full, T.FULL_STATE_DICT),
      (_config(S.FULL_SHARD, offloaded=False), 3, sharded, T.SHARDED_STATE_DICT)]:
    other = fsdp_jax.init_train_state(params=zeros, optimizer=OPT, config=cfg,
                                      mesh=mesh_for(cfg.sharding_strategy, n))
    other = load_state_dict(other, sd_, state_dict_type=kind)
    other = other.replace(opt_state=optim_state_dict_to_load(other, osd))
    want = {HOST} if offload.offloads(cfg) else {"device"}
    assert _kinds(other.params) == want and _kinds(other.opt_state) == want
    _assert_bitwise(state_dict(other, offload_to_cpu=True), full)
    _assert_bitwise(optim_state_dict(other, offload_to_cpu=True), host_osd)
  # LOCAL: the same plan only.
  other = runs[True].init(zeros)
  other = load_state_dict(other, local, state_dict_type=T.LOCAL_STATE_DICT)
  other = other.replace(opt_state=optim_state_dict_to_load(
      other, local_osd, state_dict_type=T.LOCAL_STATE_DICT))
  _assert_offloaded(other)
  _assert_bitwise(other.params, state.params)
  _assert_bitwise(other.opt_state, state.opt_state)


# ---------------------------------------------------------------------------
# Checkpoints


def _abstract(mesh, config):
  return jax.eval_shape(lambda: fsdp_jax.init_train_state(
      params=mlp_params(), optimizer=OPT, mesh=mesh, config=config))


@pytest.mark.slow
def test_checkpoint_bitwise_resume(tmp_path, runs):
  run = runs[True]
  batches = _batches(4)
  whole, whole_losses = run.train(batches)
  state, losses = run.train(batches[:2])
  with CheckpointManager(tmp_path / "ckpt") as mngr:
    assert mngr.save(state)
    mngr.wait_until_finished()
    restored = mngr.restore(_abstract(run.mesh, run.config))
  _assert_offloaded(restored)
  assert int(restored.step) == 2
  resumed, rest = run.train(batches[2:], restored)
  assert losses + rest == whole_losses
  _assert_offloaded(resumed)
  _assert_bitwise(resumed.params, whole.params)
  _assert_bitwise(resumed.opt_state, whole.opt_state)


@pytest.mark.slow
@pytest.mark.parametrize("save_offloaded", [False, True], ids=["device-to-host", "host-to-device"])
def test_checkpoint_across_offload_strategies_and_device_counts(tmp_path, runs, save_offloaded):
  batches = _batches(3)
  run = runs[save_offloaded]
  src, _ = run.train(batches[:2])
  with CheckpointManager(tmp_path / "ckpt") as mngr:
    mngr.save(src)
    mngr.wait_until_finished()
    # Onto another strategy, device count and layout, with offload switched.
    dst_cfg = _config(S.HYBRID_SHARD, offloaded=not save_offloaded, use_orig_params=True)
    dst_mesh = mesh_for(S.HYBRID_SHARD, 3, 2)
    restored = mngr.restore(_abstract(dst_mesh, dst_cfg))
  want = {HOST} if not save_offloaded else {"device"}
  assert _kinds(restored.params) == want and _kinds(restored.opt_state) == want
  _assert_bitwise(state_dict(restored, offload_to_cpu=True), state_dict(src, offload_to_cpu=True))
  _assert_bitwise(optim_state_dict(restored, offload_to_cpu=True),
                  optim_state_dict(src, offload_to_cpu=True))
  # Both continue the same training.
  dst_step = fsdp_jax.shard_train_step(mlp_loss, OPT, mesh=dst_mesh, config=dst_cfg)
  a, la = run.train(batches[2:], src)
  b, lb = train_steps(dst_step, restored, batches[2:])
  np.testing.assert_allclose(la, lb, rtol=0, atol=1e-6)
  assert_trees_close(state_dict(a, offload_to_cpu=True), state_dict(b, offload_to_cpu=True),
                     rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------
# Errors


def test_backend_without_pinned_host_is_refused(monkeypatch):
  monkeypatch.setattr(offload, "memory_kinds", lambda device: ["device"])
  mesh = mesh_for(S.FULL_SHARD, 2)
  with pytest.raises(ValueError, match=r"(?s)pinned_host.*\['device'\].*drop cpu_offload"):
    fsdp_jax.init_train_state(params=mlp_params(), optimizer=optax.sgd(0.1), mesh=mesh,
                              config=_config())
  with pytest.raises(ValueError, match="has the memory kinds"):
    fsdp_jax.shard_train_step(mlp_loss, optax.sgd(0.1), mesh=mesh, config=_config())
  # Without offload nothing is checked.
  fsdp_jax.init_train_state(params=mlp_params(), optimizer=optax.sgd(0.1), mesh=mesh,
                            config=_config(offloaded=False))


def test_offload_params_false_is_no_offload():
  mesh = mesh_for(S.FULL_SHARD, 2)
  config = fsdp_jax.FSDPConfig(cpu_offload=fsdp_jax.CPUOffload(offload_params=False))
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=optax.adam(1e-2),
                                    mesh=mesh, config=config)
  assert _kinds(state.params) == _kinds(state.opt_state) == {"device"}


# ---------------------------------------------------------------------------
# One unit at a time: each gather reads a device copy made for it


def _on_host(aval) -> bool:
  return getattr(aval, "memory_space", None) == jax.memory.Space.Host


@pytest.mark.parametrize("strategy,n,r,orig", [
    (S.FULL_SHARD, 4, None, False), (S.FULL_SHARD, 3, None, True),
    (S.SHARD_GRAD_OP, 4, None, False), (S.HYBRID_SHARD, 2, 2, False)],
    ids=["full-4-flat", "full-3-orig", "grad_op-4", "hybrid-2x2"])
def test_each_gather_reads_its_own_device_copy_and_gradients_stay_on_device(strategy, n, r,
                                                                            orig):
  """The shards are not all copied to the device at the step's start: each
  gather (forward, and FULL_SHARD's backward re-gather) reads a copy of its
  unit's shards made right before it, and the gradient shards stay in device
  memory until the optimizer's copy to the host (no device computation in
  host memory)."""
  mesh = mesh_for(strategy, n, r)
  config = _config(strategy, use_orig_params=orig)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=OPT, mesh=mesh, config=config)
  step = fsdp_jax.shard_train_step(mlp_loss, OPT, mesh=mesh, config=config, max_norm=1.0)
  body = shard_map_body(jax.make_jaxpr(step.jitted)(state, mlp_batch()).jaxpr)
  eqns = body.eqns
  producer = {o: k for k, e in enumerate(eqns) for o in e.outvars}
  gathers = [k for k, e in enumerate(eqns) if e.primitive.name == "fsdp_all_gather"]
  to_device = [k for k, e in enumerate(eqns) if e.primitive.name == "device_put"
               and _on_host(e.invars[0].aval) and not _on_host(e.outvars[0].aval)]
  units = len(state.plan.units)
  resharded = sum(1 for u in state.plan.units if state.plan.reshard(u))
  assert len(gathers) == units + resharded
  assert len(to_device) == sum(len(eqns[g].invars) for g in gathers)  # one per operand
  previous = -1
  for g in gathers:
    # The gather's operands come from host-to-device copies (plus, for the
    # gradient, a device zero added to them), made after the previous gather.
    for v in eqns[g].invars:
      copies, stack, seen = set(), [v], set()
      while stack:  # back through ordering ties, the zeros' add, casts
        w = stack.pop()
        k = producer.get(w)
        if k is None or k in seen:
          continue
        seen.add(k)
        if k in to_device:
          copies.add(k)
        elif eqns[k].primitive.name == "optimization_barrier":
          stack.append(eqns[k].invars[eqns[k].outvars.index(w)])
        else:
          stack.extend(x for x in eqns[k].invars if not isinstance(x, jax.extend.core.Literal))
      assert len(copies) == 1, (g, copies)
      assert previous < min(copies) < g, (previous, copies, g)
    previous = g
  # Outside the host update (a compute_on("device_host") call: a jit on jax
  # 0.10, its own primitive on 0.12), only copies read host memory.
  host_readers = {e.primitive.name for e in eqns
                  if any(_on_host(getattr(v, "aval", None)) for v in e.invars)}
  assert host_readers <= {"device_put", "jit", "pjit", "compute_on"}, host_readers
  reduced = [e for e in eqns if e.primitive.name == "fsdp_reduce"]
  assert reduced and not any(_on_host(o.aval) for e in reduced for o in e.outvars)


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", ["sharded", "no_sync"])
def test_accumulation_and_a_stacked_scan_match_the_step_without_offload(accumulation):
  """Gradient accumulation (both kinds) and a ``lax.scan`` over a stacked
  unit: the offloaded step's numbers are the device step's, bit for bit."""
  rng = np.random.default_rng(0)
  f = lambda *s: jnp.asarray(rng.normal(0, 0.3, s), jnp.float32)
  params = {"embed": f(5, 8), "blocks": {"w": f(4, 8, 8), "b": f(4, 8)}, "head": f(8, 3)}

  def loss(p, batch):
    h = batch["x"] @ p["embed"]
    h, _ = jax.lax.scan(lambda h, blk: (jnp.tanh(h @ blk["w"] + blk["b"]), None), h,
                        p["blocks"])
    logits = h @ p["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  batches = [{"x": jnp.asarray(rng.normal(size=(24, 5)), jnp.float32),
              "y": jnp.asarray(rng.integers(0, 3, 24), jnp.int32)} for _ in range(3)]
  mesh = fsdp_jax.make_mesh(shard=3, devices=jax.devices()[:3])
  results = {}
  for offloaded in (False, True):
    config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["blocks"]),
                                 cpu_offload=OFFLOAD if offloaded else None)
    state = fsdp_jax.init_train_state(params=params, optimizer=OPT, mesh=mesh, config=config)
    step = fsdp_jax.shard_train_step(loss, OPT, mesh=mesh, config=config, max_norm=1.0,
                                     gradient_accumulation_steps=2, accumulation=accumulation)
    losses = []
    for b in batches:
      state, metrics = step(state, b)
      losses.append(metrics["loss"])
    if offloaded:
      _assert_offloaded(state)
    results[offloaded] = (losses, fsdp_jax.summon_full_params(state))
  _assert_bitwise(results[True], results[False])
