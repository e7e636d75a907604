"""Bad input gets a clear error naming the path, shape, mesh axis and fix."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import fsdp_jax
from fsdp_jax import ShardingStrategy as S

from fsdp_jax._src import loss as loss_lib
from helpers import REPO, mesh_for, mlp_batch, mlp_loss, mlp_params, subprocess_env, train_steps


def _state_and_step(loss_fn=mlp_loss, strategy=S.FULL_SHARD, n=8, replicate=None, opt=None,
                    step_opt=None, params=None, **kw):
  mesh = mesh_for(strategy, n, replicate)
  config = fsdp_jax.FSDPConfig(sharding_strategy=strategy, **kw)
  opt = opt or optax.adam(1e-3)
  state = fsdp_jax.init_train_state(params=params or mlp_params(), optimizer=opt, mesh=mesh,
                                    config=config)
  step = fsdp_jax.shard_train_step(loss_fn, step_opt or opt, mesh=mesh, config=config)
  return state, step


def test_batch_not_divisible_by_data_parallel_size():
  state, step = _state_and_step()
  batch = mlp_batch(n=20)
  with pytest.raises(ValueError) as e:
    step(state, batch)
  msg = str(e.value)
  for part in ("['x']", "(20, 5)", "not divisible by the data-parallel size 8",
               "('shard',)", "e.g. 24"):
    assert part in msg, msg


def test_batch_not_divisible_names_every_bad_leaf():
  """Like shard_map's check: every leaf whose leading dimension does not divide
  is named, not only the first one."""
  state, step = _state_and_step()
  batch = dict(mlp_batch(n=20), w=jnp.ones((12, 3)), ok=jnp.ones((16,)))
  with pytest.raises(ValueError) as e:
    step(state, batch)
  msg = str(e.value)
  for part in ("3 batch leaves", "['w'] of shape (12, 3)", "['x'] of shape (20, 5)",
               "['y'] of shape (20, 3)",
               "not divisible by the data-parallel size 8", "mesh axes ('shard',)",
               "{'shard': 8}", "Fix: use a global batch size that is a multiple of 8"):
    assert part in msg, msg
  assert "['ok']" not in msg, msg


def test_hybrid_world_is_replicate_times_shard():
  state, step = _state_and_step(strategy=S.HYBRID_SHARD, n=2, replicate=2)
  with pytest.raises(ValueError, match=r"data-parallel size 4 \(mesh axes \('replicate', 'shard'\)"):
    step(state, mlp_batch(n=6))


def test_scalar_batch_leaf():
  state, step = _state_and_step()
  batch = dict(mlp_batch(), lr=jnp.asarray(0.1))
  with pytest.raises(ValueError, match=r"Batch leaf \['lr'\] is a scalar"):
    step(state, batch)


def test_mesh_without_expected_axes():
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  with pytest.raises(ValueError, match=r"axes \('shard',\).*got axes \('data',\).*make_mesh"):
    fsdp_jax.init_train_state(params=mlp_params(), optimizer=optax.sgd(0.1), mesh=mesh,
                              config=fsdp_jax.FSDPConfig())


def _too_few_devices_regex(config):
  """The pattern the root conftest.py skips native-mode tests by."""
  for plugin in config.pluginmanager.get_plugins():
    if hasattr(plugin, "_TOO_FEW_DEVICES"):
      return plugin._TOO_FEW_DEVICES
  raise AssertionError("conftest.py defines no _TOO_FEW_DEVICES")


def test_make_mesh_with_too_few_cpu_devices_names_simulate_cpu_devices(pytestconfig):
  n = jax.device_count()
  with pytest.raises(ValueError) as e:
    fsdp_jax.make_mesh(shard=2 * n)
  msg = str(e.value)
  assert msg.startswith(f"make_mesh: replicate=1 x shard={2 * n} needs {2 * n} devices but "
                        f"only {n} are available; pass devices= or smaller sizes."), msg
  assert _too_few_devices_regex(pytestconfig).search(msg), msg
  if jax.devices()[0].platform == "cpu":
    assert (f"call fsdp_jax.simulate_cpu_devices({2 * n}) at the top of the script, before "
            "the first jax computation or jax.devices() call") in msg, msg
    assert f"JAX_NUM_CPU_DEVICES={2 * n}" in msg, msg
  if n >= 2:  # enough devices exist: the list passed is what is short
    with pytest.raises(ValueError) as e:
      fsdp_jax.make_mesh(replicate=2, shard=1, devices=jax.devices()[:1])
    assert "simulate_cpu_devices" not in str(e.value), str(e.value)


_ONE_CPU_DEVICE = """
import fsdp_jax
try:
  fsdp_jax.make_mesh(shard=8)
except ValueError as e:
  print("ERROR", e)
"""


def test_make_mesh_on_one_cpu_device_says_how_to_simulate_more():
  proc = subprocess.run([sys.executable, "-c", _ONE_CPU_DEVICE], capture_output=True, text=True,
                        timeout=120, cwd=REPO,
                        env={k: v for k, v in subprocess_env(JAX_PLATFORMS="cpu").items()
                             if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")})
  out = proc.stdout
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert ("ERROR make_mesh: replicate=1 x shard=8 needs 8 devices but only 1 are available; "
          "pass devices= or smaller sizes. On CPU, simulate them: call "
          "fsdp_jax.simulate_cpu_devices(8) at the top of the script, before the first jax "
          "computation or jax.devices() call (or set JAX_NUM_CPU_DEVICES=8 in the "
          "environment).") in out, out


def test_hybrid_needs_2d_mesh():
  mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
  with pytest.raises(ValueError, match=r"HYBRID_SHARD needs a 2-D mesh.*make_mesh\(replicate=R, shard=S\)"):
    fsdp_jax.init_train_state(params=mlp_params(), optimizer=optax.sgd(0.1), mesh=mesh,
                              config=fsdp_jax.FSDPConfig(sharding_strategy=S.HYBRID_SHARD))


def test_flat_unit_mixing_dtypes():
  params = {"w": jnp.ones((3, 3), jnp.float32), "h": jnp.ones((3,), jnp.bfloat16)}
  mesh = mesh_for(S.FULL_SHARD, 2)
  with pytest.raises(ValueError) as e:
    fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                              config=fsdp_jax.FSDPConfig())
  msg = str(e.value)
  assert "'<root>' mixes dtypes ['bfloat16', 'float32']" in msg
  assert "h: bfloat16" in msg and "use_orig_params=True" in msg


def test_mixed_dtypes_with_original_params_gather_once_per_dtype():
  params = {"w": jnp.ones((3, 3), jnp.float32), "h": jnp.ones((3,), jnp.bfloat16)}
  mesh = mesh_for(S.FULL_SHARD, 2)
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=fsdp_jax.FSDPConfig(use_orig_params=True))
  assert len(state.plan.dtype_groups(state.plan.units[0])) == 2
  full = fsdp_jax.summon_full_params(state)
  assert full["h"].dtype == jnp.bfloat16 and full["w"].dtype == jnp.float32


def test_non_scalar_loss():
  state, step = _state_and_step(loss_fn=lambda p, b: (b["x"] @ p["inp"]["w"]) ** 2)
  with pytest.raises(ValueError, match=r"scalar floating-point loss.*jnp.mean"):
    step(state, mlp_batch())


def test_optimizer_state_that_does_not_match():
  """The error names the leaves that differ, not every leaf of both."""
  state, step = _state_and_step(opt=optax.adam(1e-3), step_opt=optax.sgd(0.1, momentum=0.9))
  with pytest.raises(ValueError, match="optimizer state does not match") as e:
    step(state, mlp_batch())
  msg = str(e.value)
  assert "slots only in optimizer.init(params): 0.trace (one leaf per parameter)" in msg, msg
  assert "slots only in the state: 0.mu, 0.nu (one leaf per parameter)" in msg, msg
  assert "only in the state: 0.count ()" in msg, msg
  assert "blocks.0" not in msg, msg
  assert "leave it out of shard_train_step" in msg, msg


def test_state_from_another_config():
  mesh = mesh_for(S.FULL_SHARD, 4)
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(params=mlp_params(), optimizer=opt, mesh=mesh,
                                    config=fsdp_jax.FSDPConfig())
  step = fsdp_jax.shard_train_step(mlp_loss, opt, mesh=mesh,
                                   config=fsdp_jax.FSDPConfig(use_orig_params=True))
  with pytest.raises(ValueError, match="different FSDPConfig") as e:
    step(state, mlp_batch())
  msg = str(e.value)
  assert "  use_orig_params: state False, step True\n" in msg, msg
  # Only the fields that differ: not the 20-field reprs of both configs.
  assert "FSDPConfig(" not in msg and "sharding_strategy" not in msg, msg
  assert "forward_prefetch" not in msg and "mixed_precision" not in msg, msg


def test_prefetch_settings_are_accepted():
  cfg = fsdp_jax.FSDPConfig(forward_prefetch=True, limit_all_gathers=False,
                            backward_prefetch=None)
  assert (cfg.forward_prefetch, cfg.limit_all_gathers, cfg.backward_prefetch) == (True, False, None)


def test_config_is_keyword_only():
  with pytest.raises(TypeError):
    fsdp_jax.FSDPConfig(S.FULL_SHARD)  # pylint: disable=too-many-function-args


def test_params_or_init_fn():
  mesh = mesh_for(S.FULL_SHARD, 2)
  with pytest.raises(ValueError, match="exactly one of params= or init_fn="):
    fsdp_jax.init_train_state(optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())


# --------------------------------------------------------------------------
# Communication hooks that return the wrong thing


def _hook_forgets_state(state, grad, spec):
  return fsdp_jax.custom.reduce_gradient(grad, spec)  # no state


def _hook_returns_unreduced(state, grad, spec):
  return grad, state  # the (N, S) buffer, not this device's shard


class _StatefulForgetsState:
  stateful = True

  def init(self, shape, dtype):
    return jnp.zeros(shape, jnp.float32)

  def __call__(self, state, grad, spec):
    return fsdp_jax.custom.reduce_gradient(grad, spec)

  def __repr__(self):
    return "StatefulForgetsState()"


class _StatefulDropsARow(_StatefulForgetsState):

  def __call__(self, state, grad, spec):
    return fsdp_jax.custom.reduce_gradient(grad, spec), state[1:]

  def __repr__(self):
    return "StatefulDropsARow()"


@pytest.mark.parametrize("hook, name, words", [
    (_hook_forgets_state, "test_errors._hook_forgets_state",
     ["Fix: return (reduced, state) from comm_hook", "it returned an array of shape (28,) float32",
      "for a gradient of shape (8, 28)", "reduced shard (shape (28,))"]),
    (_hook_returns_unreduced, "test_errors._hook_returns_unreduced",
     ["Fix: return this device's reduced shard as the first value of comm_hook",
      "it returned an array of shape (8, 28) float32", "has shape (28,)"]),
    (_StatefulForgetsState(), "StatefulForgetsState()",
     ["Fix: return (reduced, state) from comm_hook", "it returned an array of shape (28,) float32"]),
    (_StatefulDropsARow(), "StatefulDropsARow()",
     ["Fix: return a new state shaped like the one it was given", "got (8, 28)",
      "returned (7, 28)"]),
], ids=["stateless", "unreduced", "stateful", "stateful-state"])
def test_comm_hook_return_value_is_checked(hook, name, words):
  state, step = _state_and_step(n=8, comm_hook=hook)
  with pytest.raises(TypeError) as e:
    step(state, mlp_batch())
  msg = str(e.value)
  assert msg.startswith("Fix:"), msg
  assert name in msg, msg
  for w in words:
    assert w in msg, (w, msg)


# --------------------------------------------------------------------------
# Integer leaves among the trainable parameters


@pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig", "flat"])
def test_integer_trainable_leaf_is_refused_at_init(use_orig_params):
  params = {"w": jnp.ones((4, 3)), "count": jnp.arange(3, dtype=jnp.int32)}
  mesh = mesh_for(S.FULL_SHARD, 2)
  config = fsdp_jax.FSDPConfig(use_orig_params=use_orig_params)
  with pytest.raises(TypeError) as e:
    fsdp_jax.init_train_state(params=params, optimizer=optax.adam(1e-2), mesh=mesh,
                              config=config)
  msg = str(e.value)
  assert msg.startswith("Fix: pass requires_grad=jax.tree.map(lambda x: "
                        "jnp.issubdtype(x.dtype, jnp.inexact), params)"), msg
  assert "model_state=" in msg and "'count' (int32, shape (3,))" in msg, msg
  assert "'w'" not in msg
  # A requires_grad that still marks it trainable: the fix names requires_grad.
  with pytest.raises(TypeError, match=r"^Fix: set those leaves to False in requires_grad"):
    fsdp_jax.init_train_state(params=params, optimizer=optax.adam(1e-2), mesh=mesh,
                              config=config, requires_grad={"w": True, "count": True})


def test_integer_leaf_trains_once_frozen_as_the_error_says():
  params = {"w": jnp.ones((4, 3)), "count": jnp.arange(3, dtype=jnp.int32)}
  mesh = mesh_for(S.FULL_SHARD, 2)
  config = fsdp_jax.FSDPConfig(use_orig_params=True)
  opt = optax.sgd(0.1)
  state = fsdp_jax.init_train_state(
      params=params, optimizer=opt, mesh=mesh, config=config,
      requires_grad=jax.tree.map(lambda x: jnp.issubdtype(x.dtype, jnp.inexact), params))

  def loss(p, b):
    return jnp.sum(p["w"]) * jnp.mean(b) + jnp.sum(p["count"]).astype(jnp.float32)

  step = fsdp_jax.shard_train_step(loss, opt, mesh=mesh, config=config)
  state, metrics = step(state, jnp.ones((4, 3)))
  assert float(metrics["loss"]) == 15.0
  full = fsdp_jax.summon_full_params(state)
  np.testing.assert_array_equal(np.asarray(full["count"]), [0, 1, 2])
  np.testing.assert_allclose(np.asarray(full["w"]), 0.9, rtol=1e-6)


@pytest.mark.parametrize("bad, words", [
    ("x", ["forward_inputs='x' is a string", "Fix: forward_inputs=('x',)"]),
    (3, ["collection of top-level batch keys", "got 3"]),
])
def test_forward_inputs_must_be_a_collection_of_keys(bad, words):
  mesh = mesh_for(S.FULL_SHARD, 2)
  config = fsdp_jax.FSDPConfig()
  with pytest.raises(TypeError) as e:
    fsdp_jax.shard_train_step(mlp_loss, optax.adam(1e-3), mesh=mesh, config=config,
                              forward_inputs=bad)
  for w in words:
    assert w in str(e.value), str(e.value)


def test_forward_inputs_key_the_batch_lacks_is_named():
  mp = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16)
  state, _ = _state_and_step(n=2, mixed_precision=mp)
  step = fsdp_jax.shard_train_step(mlp_loss, optax.adam(1e-3), mesh=state.plan.mesh,
                                   config=state.plan.config, forward_inputs=("x", "inputs"))
  with pytest.raises(KeyError) as e:
    step(state, mlp_batch())
  msg = str(e.value)
  for part in ("forward_inputs names 'inputs'", "Its keys: 'x', 'y'", "Fix:"):
    assert part in msg, msg
  # A key the batch has is fine, and "x" is not matched as a substring of a longer key.
  step = fsdp_jax.shard_train_step(mlp_loss, optax.adam(1e-3), mesh=state.plan.mesh,
                                   config=state.plan.config, forward_inputs=("x",))
  _, metrics = step(state, mlp_batch())
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.parametrize("prim, name", [("fsdp_all_gather_p", "fsdp_all_gather"),
                                        ("fsdp_reduce_p", "fsdp_reduce")])
def test_collective_primitive_outside_a_step_is_named(prim, name):
  from fsdp_jax._src import collectives
  with pytest.raises(RuntimeError, match=f"^{name} only runs inside fsdp_jax's sharded step"):
    getattr(collectives, prim).bind(jnp.ones(3), spec=None, stored_dtype=np.dtype("float32"))


def test_make_mesh_leaving_devices_idle_warns_and_devices_silences_it():
  n = jax.device_count()
  with pytest.warns(UserWarning) as record:
    mesh = fsdp_jax.make_mesh(replicate=2, shard=n // 4)
  assert mesh.devices.size == n // 2
  msg = str(record[0].message)
  assert record[0].filename == __file__, record[0].filename  # the caller's line
  for part in (f"make_mesh(replicate=2, shard={n // 4}) uses {n // 2} of the {n} devices",
               f"devices=jax.devices()[:{n // 2}]"):
    assert part in msg, msg
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    fsdp_jax.make_mesh(shard=3, devices=jax.devices()[:3])  # a subset on purpose
    fsdp_jax.make_mesh(shard=n // 2, tensor=2)  # every device


# --------------------------------------------------------------------------
# A family bundle's inputs (fsdp_jax.models)

_TINY = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def _tiny(tmp_path, family="llama", scan=False, **extra):
  import json  # pylint: disable=import-outside-toplevel
  from fsdp_jax import models  # pylint: disable=import-outside-toplevel
  d = tmp_path / f"{family}{len(list(tmp_path.iterdir()))}"
  d.mkdir()
  (d / "config.json").write_text(json.dumps({"model_type": family, **_TINY, **extra}))
  return models.from_pretrained(d, scan=scan)


def test_token_ids_outside_the_vocabulary_are_refused_before_any_nan(tmp_path):
  b = _tiny(tmp_path)
  params = jax.eval_shape(b.init_fn, jax.random.key(0))
  ok = np.ones((8, 6), np.int32)
  high = ok.copy()
  high[3, 2], high[5, 1] = 64, 70
  vocab = "vocab_size 64 (config.json), ids 0..63"
  with pytest.raises(ValueError, match=r"^loss_fn: batch\['input_ids'\] holds token id 70 "
                     r"\(its largest\).*" + re.escape(vocab)):
    b.loss_fn(params, {"input_ids": high})
  with pytest.raises(ValueError, match=r"^loss_fn: batch\['labels'\] holds token id -3 "):
    b.loss_fn(params, {"input_ids": ok, "labels": np.where(high == 64, -3, -100)})
  with pytest.raises(ValueError, match=r"^apply: input_ids holds token id 70 "):
    b.apply(params, jnp.asarray(high))  # a jax.Array is read back too
  # -100 labels are transformers' ignored ones: no error.
  jax.eval_shape(b.loss_fn, params, {"input_ids": ok, "labels": np.full_like(ok, -100)})
  # The train and eval steps check the global batch before placing it (no
  # program compiled: the error comes first).
  mesh = mesh_for(S.FULL_SHARD, 2)
  state = fsdp_jax.init_train_state(params=jax.tree.map(jnp.zeros_like, params),
                                    optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=b.fsdp_config())
  step = fsdp_jax.shard_train_step(b.loss_fn, optax.sgd(0.1), mesh=mesh, config=b.fsdp_config())
  for run in (step, fsdp_jax.shard_eval_step(b.loss_fn)):
    with pytest.raises(ValueError, match=r"^loss_fn: batch\['input_ids'\] holds token id 70 "):
      run(state, {"input_ids": high})


def test_labels_of_another_shape_name_both_shapes(tmp_path):
  b = _tiny(tmp_path)
  params = jax.eval_shape(b.init_fn, jax.random.key(0))
  ids = np.ones((2, 6), np.int32)
  msg = r"batch\['labels'\] has shape \[2, 5\] where batch\['input_ids'\] has \[2, 6\]"
  with pytest.raises(ValueError, match="^loss_fn: " + msg):
    b.loss_fn(params, {"input_ids": ids, "labels": ids[:, 1:]})
  with pytest.raises(ValueError, match=msg):  # traced: checked by shapes
    jax.jit(b.loss_fn)(params, {"input_ids": ids, "labels": ids[:, 1:]})


def test_parameters_of_another_model_name_the_first_differing_path(tmp_path):
  llama = _tiny(tmp_path)
  qwen3 = _tiny(tmp_path, "qwen3", head_dim=4)
  ids = np.ones((1, 4), np.int32)
  key = jax.random.key(0)
  params = jax.eval_shape(qwen3.init_fn, key)
  with pytest.raises(ValueError, match=re.escape(
      "apply: the parameters are not this llama model's (2 layers, hidden 16, 4 heads, 2 "
      "key/value, vocabulary 64): model.layers.0.self_attn.k_norm.weight (shape (4,)) is not "
      "one of its parameters (and 3 more differences).")):
    jax.eval_shape(llama.apply, params, ids)
  own = jax.eval_shape(llama.init_fn, key)
  wide = _tiny(tmp_path, hidden_size=32)
  with pytest.raises(ValueError, match=re.escape(
      "loss_fn: the parameters are not this llama model's (2 layers, hidden 32, ")):
    jax.eval_shape(wide.loss_fn, own, {"input_ids": ids})
  with pytest.raises(ValueError, match=re.escape(
      "lm_head.kernel has shape (16, 64) where this model's is (32, 64)")):
    jax.eval_shape(wide.apply, own, ids)
  del own["model"]["norm"]
  with pytest.raises(ValueError, match=re.escape("model.norm.weight (shape (16,)) is missing")):
    jax.eval_shape(llama.apply, own, ids)
  # The other layer layout: a list of layers into a scanned bundle.
  scanned = _tiny(tmp_path, scan=True)
  with pytest.raises(ValueError, match=re.escape(
      "The layers are a list (from_pretrained(scan=False)); this bundle stacks them")):
    jax.eval_shape(scanned.apply, jax.eval_shape(llama.init_fn, key), ids)
  jax.eval_shape(scanned.apply, jax.eval_shape(scanned.init_fn, key), ids)  # its own: fine


# --------------------------------------------------------------------------
# The WeightedLoss weight check sees through checkpoint, custom_vjp and loops


def _custom_vjp(loss_fn):
  """``loss_fn`` as a ``jax.custom_vjp`` function whose rule is its own vjp."""

  @jax.custom_vjp
  def f(params, batch):
    return loss_fn(params, batch)

  def fwd(params, batch):
    return jax.vjp(loss_fn, params, batch)

  f.defvjp(fwd, lambda vjp, ct: vjp(ct))
  return f


def test_a_checkpointed_family_loss_trains_as_the_plain_one(tmp_path):
  """A family's WeightedLoss under jax.checkpoint, jax.remat with a policy
  or a custom_vjp rule: its weight comes from the labels inside the
  wrapped call, so the step takes it and trains as with the plain loss
  (2 steps: losses and parameters to 1e-6);
  a weight computed from a parameter inside the call is still refused,
  naming that parameter only."""
  b = _tiny(tmp_path, num_hidden_layers=1)
  mesh = mesh_for(S.FULL_SHARD, 3)
  opt = optax.sgd(0.5)
  ids = np.random.default_rng(0).integers(0, 64, (3, 5)).astype(np.int32)
  batches = [{"input_ids": ids, "labels": np.roll(ids, k, axis=1)} for k in (1, 2)]
  state = fsdp_jax.init_train_state(init_fn=b.init_fn, rng=jax.random.key(0), optimizer=opt,
                                    mesh=mesh, config=b.fsdp_config())
  b_params = fsdp_jax.summon_full_params(state)

  def train(loss_fn):
    step = fsdp_jax.shard_train_step(loss_fn, opt, mesh=mesh, config=b.fsdp_config())
    s = jax.tree.map(jnp.copy, state)  # the step donates its input
    s, losses = train_steps(step, s, batches)
    return losses, fsdp_jax.summon_full_params(s)

  ref_losses, ref_params = train(b.loss_fn)
  for wrapped in (jax.checkpoint(b.loss_fn), _custom_vjp(b.loss_fn)):
    losses, params = train(wrapped)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6),
                 params, ref_params)
    assert not np.allclose(params["lm_head"]["kernel"], b_params["lm_head"]["kernel"])
  # jax.remat with a policy: the same primitive as jax.checkpoint, another
  # param; the step takes it (lowered only: no compile).
  dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
  fsdp_jax.shard_train_step(jax.remat(b.loss_fn, policy=dots), opt, mesh=mesh,
                            config=b.fsdp_config()).lower(state, batches[0])

  def from_a_parameter(params, batch):
    out = b.loss_fn(params, batch)
    return fsdp_jax.WeightedLoss(
        total=out.total, weight=out.weight * jax.nn.sigmoid(params["model"]["norm"]["weight"][0]))

  step = fsdp_jax.shard_train_step(jax.checkpoint(from_a_parameter), opt, mesh=mesh,
                                   config=b.fsdp_config())
  with pytest.raises(ValueError, match=r"weight depends on the parameters "
                     r"\(model\.norm\.weight\)\. .*Fix: compute the weight from the batch"):
    step.lower(state, batches[0])


def test_weight_dependence_is_seen_through_loops_and_conds():
  """needed_inputs follows scan carries and while loops to a fixed point and
  each cond branch; eval_outputs computes the weight with zeros for the
  operands it does not read."""
  def fn(w, v, x, n):
    # carry (a, b): b picks up v in the second iteration through a
    (a, b), ys = jax.lax.scan(lambda c, xi: ((v * xi, c[0] + c[1]), w * xi),
                              (jnp.float32(0), jnp.float32(0)), x)
    i, acc = jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] + x[c[0]]),
                                (0, jnp.float32(0)))
    sel = jax.lax.cond(n > 2, lambda u, t: (u * 2, t + 1), lambda u, t: (u, t), w, acc)
    return jnp.sum(ys), a, b, acc, sel[0], sel[1], jax.checkpoint(lambda p, q: (p * 3, q))(w, n)

  closed = jax.make_jaxpr(fn)(jnp.float32(1), jnp.float32(2), jnp.arange(4.0), 3)
  jaxpr = closed.jaxpr
  # inputs: w 0, v 1, x 2, n 3
  expect = {0: {0, 2}, 1: {1, 2}, 2: {1, 2}, 3: {2, 3}, 4: {0, 3}, 5: {2, 3}, 6: {0}, 7: {3}}
  for out, ins in expect.items():
    assert loss_lib.needed_inputs(jaxpr, [out]) == ins, out
  args = [None, None, jnp.arange(4.0), 3]
  assert float(loss_lib.eval_outputs(jaxpr, closed.consts, args, [3])[0]) == 3.0
  assert float(loss_lib.eval_outputs(jaxpr, closed.consts, args, [5])[0]) == 4.0


def test_generate_checks_its_prompt_and_parameters(tmp_path):
  from fsdp_jax import models  # pylint: disable=import-outside-toplevel
  llama, qwen3 = _tiny(tmp_path), _tiny(tmp_path, "qwen3", head_dim=4)
  params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                        jax.eval_shape(qwen3.init_fn, jax.random.key(0)))
  ids = np.array([[1, 2, 3]], np.int32)
  with pytest.raises(ValueError, match=r"^generate: the parameters are not this llama "
                     r"model's .*k_norm.weight \(shape \(4,\)\) is not one of its parameters"):
    models.generate(llama, params, ids, max_new_tokens=2)  # refused as it is traced
  with pytest.raises(ValueError, match=r"^generate: input_ids holds token id 64 \(its largest\)"):
    models.generate(qwen3, params, ids + 61, max_new_tokens=2)
