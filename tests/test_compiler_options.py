"""fsdp_jax's own XLA settings: the strategy holds in the compiled step
whatever ``XLA_FLAGS`` the process has, and the user's other programs are not
compiled with anything of ours (benchmarks/FLAGS.md measures each setting).

Each case runs in a fresh process, because XLA reads ``XLA_FLAGS`` once per
process: 4 CPU devices, a 6-block MLP (one unit per block), FULL_SHARD and
SHARD_GRAD_OP compiled from ``shard_train_step``; all-gathers and
reduce-scatters per unit are counted in the compiled HLO and the peak bytes
per device taken from ``memory_analysis()``."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

import fsdp_jax
from fsdp_jax._src import mesh as mesh_lib
from tests.helpers import REPO, subprocess_env

_PROBE = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 4)
import jax.numpy as jnp, numpy as np, optax
import fsdp_jax
from fsdp_jax import hlo

D, H, BLOCKS = 64, 256, 6
rng = np.random.default_rng(0)
params = {f"block{i}": {"w1": rng.normal(size=(D, H)).astype(np.float32) * 0.1,
                        "w2": rng.normal(size=(H, D)).astype(np.float32) * 0.1}
          for i in range(BLOCKS)}
params["head"] = rng.normal(size=(D, 1)).astype(np.float32)

def loss_fn(p, batch):
  x = batch["x"]
  for i in range(BLOCKS):
    x = x + jnp.tanh(x @ p[f"block{i}"]["w1"]) @ p[f"block{i}"]["w2"]
  return jnp.mean((x @ p["head"]) ** 2)

batch = {"x": rng.normal(size=(8, D)).astype(np.float32)}
mesh = fsdp_jax.make_mesh(shard=4)
out = {"XLA_FLAGS": __import__("os").environ.get("XLA_FLAGS", "")}
for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
  config = fsdp_jax.FSDPConfig(
      sharding_strategy=fsdp_jax.ShardingStrategy[strategy],
      auto_wrap_policy=fsdp_jax.CustomPolicy(lambda node: node.name.startswith("block")))
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.adam(1e-3), mesh=mesh,
                                    config=config)
  step = fsdp_jax.shard_train_step(loss_fn, optax.adam(1e-3))
  compiled = step.lower(state, batch).compile()
  ma = compiled.memory_analysis()
  kinds = [c.kind for c in hlo.collectives(compiled.as_text())]
  out[strategy] = {
      "units": len(state.plan.units),
      "all_gathers": kinds.count("all-gather"),
      "reduce_scatters": kinds.count("reduce-scatter"),
      "peak": ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
              - ma.alias_size_in_bytes}
  state, metrics = step(state, batch)
  out[strategy]["loss"] = float(metrics["loss"])
print("RESULT " + json.dumps(out))
"""


def _probe(xla_flags: str) -> dict:
  proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                        timeout=300, cwd=REPO,
                        env=subprocess_env(JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags))
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-4000:]
  return json.loads(lines[0][len("RESULT "):])


@pytest.mark.slow
@pytest.mark.parametrize("xla_flags", [
    "",  # XLA's defaults: no simulate_cpu_devices()
    "--xla_disable_hlo_passes=dot_merger",  # the user's own list of disabled passes
    " ".join(fsdp_jax.custom.CPU_XLA_FLAGS),
], ids=["no_flags", "user_flags", "library_flags"])
def test_full_shard_regathers_whatever_the_process_flags(xla_flags):
  r = _probe(xla_flags)
  full, zero2 = r["FULL_SHARD"], r["SHARD_GRAD_OP"]
  units = full["units"]
  assert units == 7, r  # 6 blocks and the root
  # FULL_SHARD: every unit but the root is gathered again in backward.
  assert (full["all_gathers"], full["reduce_scatters"]) == (2 * units - 1, units), r
  assert (zero2["all_gathers"], zero2["reduce_scatters"]) == (units, units), r
  # ... and that is what holds its memory below SHARD_GRAD_OP's, which keeps
  # all six blocks gathered from their forward to their backward: 1.10 against
  # 1.52 MB with jax 0.10.2 and no flags (each block is 2 x 64 x 256 floats).
  block_bytes = 2 * 64 * 256 * 4
  assert full["peak"] <= zero2["peak"] - 2 * block_bytes, r
  assert full["loss"] == pytest.approx(zero2["loss"], rel=1e-6), r


def test_options_keep_the_users_disabled_passes(monkeypatch):
  mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  monkeypatch.setenv("XLA_FLAGS", "--xla_disable_hlo_passes=dot_merger,algsimp "
                     "--xla_disable_hlo_passes=cse_barrier_expander")
  opts = fsdp_jax.custom.compiler_options(mesh)
  # A program's option replaces the process's list: it must repeat the user's.
  assert opts["xla_disable_hlo_passes"] == "dot_merger,algsimp,cse_barrier_expander"
  assert opts["xla_cpu_experimental_ynn_fusion_type"] == ""
  monkeypatch.setenv("XLA_FLAGS", "")
  assert fsdp_jax.custom.compiler_options(mesh) == mesh_lib.CPU_COMPILER_OPTIONS


def test_unknown_options_are_left_out():
  """A later XLA may drop a CPU option: the step still compiles without it."""
  assert not mesh_lib._accepted("cpu", "xla_no_such_option_anywhere", True)  # pylint: disable=protected-access
  assert mesh_lib._accepted("cpu", "xla_cpu_experimental_ynn_fusion_type", "")  # pylint: disable=protected-access


def test_no_process_flag_slows_the_users_programs():
  """What ``simulate_cpu_devices`` puts in ``XLA_FLAGS`` reaches every
  program of the process. Each flag is measured on a plain ``jax.jit`` step
  in benchmarks/FLAGS.md; the YNN flag, which slowed it, is the step's own
  compiler option now and no process flag."""
  flags = os.environ.get("XLA_FLAGS", "")
  assert all(f in flags for f in fsdp_jax.custom.CPU_XLA_FLAGS), flags  # conftest.py set them
  assert "ynn" not in " ".join(fsdp_jax.custom.CPU_XLA_FLAGS)
  table = (Path(REPO) / "benchmarks" / "FLAGS.md").read_text()
  for flag in fsdp_jax.custom.CPU_XLA_FLAGS:
    assert f"| all but {flag} |" in table, f"{flag} is not measured in benchmarks/FLAGS.md"
  for name in mesh_lib.CPU_COMPILER_OPTIONS:
    assert name in table, f"{name} is not measured in benchmarks/FLAGS.md"


def test_step_and_init_inside_an_outer_trace():
  """JAX takes compiler options on the outermost program only: inside the
  user's own ``jax.jit`` (or ``jax.eval_shape``) fsdp_jax's programs are
  plain ``jax.jit`` calls, with the same results."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  config = fsdp_jax.FSDPConfig()
  init_fn = lambda k: {"w": jax.random.normal(k, (5, 3))}
  init = lambda: fsdp_jax.init_train_state(init_fn=init_fn, rng=jax.random.key(0),
                                           optimizer=optax.sgd(0.1), mesh=mesh, config=config)
  abstract = jax.eval_shape(init)
  state = init()
  assert jax.tree.map(lambda x: x.shape, abstract.params) == \
      jax.tree.map(lambda x: x.shape, state.params)
  step = fsdp_jax.shard_train_step(lambda p, b: jnp.mean((b @ p["w"]) ** 2), optax.sgd(0.1),
                                   donate=False)
  batch = jnp.ones((2, 5))
  top_state, top = step(state, batch)
  nested_state, nested = jax.jit(lambda s, b: step.jitted(s, b))(state, batch)
  assert float(nested["loss"]) == float(top["loss"])
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), top_state.params,
                      nested_state.params)
  assert all(jax.tree.leaves(same)), same


def test_options_are_not_probed_under_a_trace():
  """Probing an option compiles a small program, which JAX refuses with
  options under a trace: there the answer is not cached as 'unknown'."""
  mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  mesh_lib._probe.cache_clear()  # pylint: disable=protected-access
  inside = jax.eval_shape(lambda: (fsdp_jax.custom.compiler_options(mesh), 0)[1])
  assert inside.shape == ()
  assert fsdp_jax.custom.compiler_options(mesh) == mesh_lib.compiler_options(mesh)
  assert set(fsdp_jax.custom.compiler_options(mesh)) == set(mesh_lib.CPU_COMPILER_OPTIONS)


def _block(blk, x):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  return x + jnp.tanh(x @ blk["w"])


def _loss(kind):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x + jnp.tanh(nn.Dense(4, use_bias=False)(x))

  def loss(p, batch):
    x = batch
    if kind == "plain":
      for blk in p["blocks"]:
        x = _block(blk, x)
    elif kind == "checkpoint":
      for blk in p["blocks"]:
        x = jax.checkpoint(_block)(blk, x)
    elif kind == "checkpoint_in_scan":
      stacked = jax.tree.map(lambda *a: jnp.stack(a), *p["blocks"])
      x, _ = jax.lax.scan(lambda c, blk: (jax.checkpoint(_block)(blk, c), None), x, stacked)
    elif kind == "nn_remat":
      for blk in p["blocks"]:
        x = nn.remat(Block)().apply({"params": {"Dense_0": {"kernel": blk["w"]}}}, x)
    return jnp.mean(x ** 2)

  return loss


@pytest.mark.parametrize("kind", ["plain", "checkpoint", "checkpoint_in_scan", "nn_remat"])
def test_ynn_fusions_are_off_only_for_a_checkpointing_loss(kind):
  """XLA's YNN fusions cost a checkpointing model memory (they fuse across
  the recomputation) and every other step nothing but speed: the step
  traces the loss and turns them off only when it calls ``jax.checkpoint``
  (``nn.remat``), however deeply nested."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy(["blocks.*"]))
  params = {"blocks": [{"w": jnp.full((4, 4), 0.1 * (i + 1))} for i in range(3)]}
  state = fsdp_jax.init_train_state(params=params, optimizer=optax.sgd(0.1), mesh=mesh,
                                    config=config)
  step = fsdp_jax.shard_train_step(_loss(kind), optax.sgd(0.1), mesh=mesh, config=config,
                                   donate=False)
  batch = jnp.ones((4, 4))
  _, metrics = step(state, batch)
  checkpointed = kind != "plain"
  assert step.jitted.options == fsdp_jax.custom.compiler_options(
      mesh, checkpointed=checkpointed)
  assert ("xla_cpu_experimental_ynn_fusion_type" in step.jitted.options) == checkpointed
  # The same numbers as the plain loss compiled with the checkpointing options.
  plain = fsdp_jax.shard_train_step(_loss("plain"), optax.sgd(0.1), mesh=mesh, config=config,
                                    donate=False)
  forced = plain._with_compiler_options(fsdp_jax.custom.compiler_options(mesh))  # pylint: disable=protected-access
  _, ref = forced(state, batch)
  assert float(metrics["loss"]) == pytest.approx(float(ref["loss"]), rel=1e-6)


def test_options_without_checkpointing_keep_ynn_fusions():
  mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
  full = fsdp_jax.custom.compiler_options(mesh)
  lean = fsdp_jax.custom.compiler_options(mesh, checkpointed=False)
  assert full["xla_cpu_experimental_ynn_fusion_type"] == ""
  assert lean == {k: v for k, v in full.items() if k != "xla_cpu_experimental_ynn_fusion_type"}
