"""The planner (``fsdp_jax.estimate``, ``fsdp_jax.search``, ``DeviceSpec``,
``python -m fsdp_jax.plan``).

* the estimated peak against the compiled step's ``memory_analysis()``
  (argument + temp + output - alias) on the 8 test devices, for several
  strategies and layouts; a mesh larger than this machine estimated without
  its devices, its state bytes exact;
* the search: every candidate estimated, what fits returned fastest first,
  memory savers when nothing fits without them;
* the device presets and every bad input the planner refuses;
* the command line, on a model bundle of the contract
  ``fsdp_jax.models.from_pretrained`` returns.

One planner is shared by the module (its compiled programs are reused
across cases, as a search reuses them).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import fsdp_jax
from fsdp_jax._src.planner import step_program
from fsdp_jax._src.planner.estimator import Planner
from tests.helpers import TEST_XLA_FLAGS, subprocess_env

V, D, F, S, LAYERS = 64, 32, 96, 32, 2
ROWS_PER_DEVICE = 2
# the module (fsdp_jax._src.planner re-exports its function under the same name)
search_lib = importlib.import_module("fsdp_jax._src.planner.search")
OPT = optax.adamw(1e-3)
WRAP = fsdp_jax.ModuleWrapPolicy(["blocks.*"])


def init_fn(rng):
  k = jax.random.split(rng, 2 + 2 * LAYERS)
  n = lambda key, shape: 0.1 * jax.random.normal(key, shape)
  return {"embed": n(k[0], (V, D)), "head": n(k[1], (D, V)),
          "blocks": [{"w1": n(k[2 + 2 * i], (D, F)), "w2": n(k[3 + 2 * i], (F, D))}
                     for i in range(LAYERS)]}


def loss_fn(params, batch):
  x = params["embed"][batch["input_ids"]]
  for block in params["blocks"]:
    x = x + jnp.tanh(x @ block["w1"]) @ block["w2"]
  logp = jax.nn.log_softmax(x @ params["head"])
  return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))


def batch_for(rows):
  shape = jax.ShapeDtypeStruct((rows, S), jnp.int32)
  return {"input_ids": shape, "labels": shape}


BATCH = batch_for(8 * ROWS_PER_DEVICE)


@pytest.fixture(scope="module")
def planner():
  return Planner(loss_fn, optimizer=OPT, batch=BATCH, init_fn=init_fn)


def compiled_peak(config, mesh_shape, *, loss=loss_fn, batch=BATCH, **step_kw) -> int:
  """The real step's peak per device (its device memory), compiled from
  shapes."""
  mesh = fsdp_jax.make_mesh(**mesh_shape, devices=jax.devices()[:math.prod(mesh_shape.values())])
  state = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      init_fn=init_fn, rng=jax.random.key(0), optimizer=OPT, mesh=mesh, config=config))
  compiled = fsdp_jax.shard_train_step(loss, **step_kw).lower(state, batch).compile()
  ma = compiled.memory_analysis()
  if config.cpu_offload is not None:  # the state is in host memory
    entry = fsdp_jax.hlo.entry_memory_bytes(compiled.as_text())
    return (entry.argument_device_bytes + ma.temp_size_in_bytes + entry.output_device_bytes
            - max(0, ma.alias_size_in_bytes - entry.output_host_bytes))
  return (ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
          - ma.alias_size_in_bytes)


CASES = [
    ("FULL_SHARD", False, {"shard": 8}),
    ("SHARD_GRAD_OP", True, {"shard": 8}),
    ("HYBRID_SHARD", False, {"replicate": 2, "shard": 4}),
]


@pytest.mark.parametrize("strategy,orig,mesh_shape", CASES,
                         ids=[f"{s}-{'orig' if o else 'flat'}-{'x'.join(map(str, m.values()))}"
                              for s, o, m in CASES])
def test_estimate_matches_the_compiled_peak(planner, strategy, orig, mesh_shape):
  config = fsdp_jax.FSDPConfig(sharding_strategy=getattr(fsdp_jax.ShardingStrategy, strategy),
                               use_orig_params=orig, auto_wrap_policy=WRAP)
  est = planner.estimate(config, mesh_shape, fsdp_jax.DeviceSpec.preset("cpu"))
  truth = compiled_peak(config, mesh_shape)
  # the parts are the plan's bytes
  state = jax.eval_shape(lambda: fsdp_jax.init_train_state(
      init_fn=init_fn, rng=jax.random.key(0), optimizer=OPT, config=config,
      mesh=fsdp_jax.make_mesh(**mesh_shape, devices=jax.devices()[:8])))
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  shards = mesh_shape["shard"]  # a replicate axis holds copies
  assert est.bytes_per_device["params"] == nbytes(state.params) // shards
  # sharded slots (Adam's moments) and the replicated step count
  assert est.bytes_per_device["optimizer"] == (nbytes(state.opt_state.slots) // shards
                                               + nbytes(state.opt_state.leaves))
  assert est.fits and est.step_seconds > 0 and est.mesh_shape == mesh_shape
  # The step's own program, compiled on one device for the mesh's shapes.
  assert est.compiled and "compiled on the cpu backend" in est.notes[0]
  assert est.bytes_per_device["total"] == pytest.approx(truth, rel=0.01)
  # The modelled peak (the segments in the step's order), as for programs
  # too large to compile by default.
  modelled = planner.estimate(config, mesh_shape, fsdp_jax.DeviceSpec.preset("cpu"),
                              compile_step=False)
  assert not modelled.compiled and modelled.parts == est.parts
  within = modelled.bytes_per_device["total"] == pytest.approx(truth, rel=0.05)
  if (not within and (strategy, orig) == ("SHARD_GRAD_OP", True)
      and tuple(map(int, jax.__version__.split(".")[:2])) >= (0, 12)):
    # Known gap: jax 0.12's XLA assigns this step's buffers more tightly
    # (temp 208,872 bytes against 231,912 under jax 0.10, the same gathers
    # live at each point); the segment programs do not show it.
    pytest.xfail(f"modelled {modelled.bytes_per_device['total']} vs compiled {truth} on jax "
                 f"{jax.__version__}")
  assert within, (modelled.bytes_per_device["total"], truth, modelled.parts)


def loss_checkpointed(params, batch):
  """loss_fn with each block under jax.checkpoint (nn.remat per block)."""
  block = jax.checkpoint(lambda x, b: x + jnp.tanh(x @ b["w1"]) @ b["w2"])
  x = params["embed"][batch["input_ids"]]
  for b in params["blocks"]:
    x = block(x, b)
  logp = jax.nn.log_softmax(x @ params["head"])
  return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], -1))


BF16 = fsdp_jax.MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
COMPILED_CASES = [  # (name, loss, config, mesh, step options): where the model is approximate
    ("remat", loss_checkpointed, {}, {"shard": 8}, {}),
    ("bf16-3", loss_fn, {"mixed_precision": BF16}, {"shard": 3}, {}),
    ("accumulation", loss_fn, {}, {"shard": 8},
     {"gradient_accumulation_steps": 2, "accumulation": "sharded"}),
    ("offload", loss_fn, {"cpu_offload": fsdp_jax.CPUOffload(offload_params=True)},
     {"shard": 8}, {}),
]


@functools.cache
def estimate_written_checkpointed():
  """fsdp_jax.estimate of loss_checkpointed (FULL_SHARD on 8, the wrap
  policy): one estimate for the two tests that read it."""
  return fsdp_jax.estimate(loss_checkpointed, optimizer=OPT, batch=BATCH, init_fn=init_fn,
                           config=fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP),
                           mesh_shape={"shard": 8})


@pytest.mark.parametrize("loss,config_kw,mesh_shape,step_kw",
                         [c[1:] for c in COMPILED_CASES], ids=[c[0] for c in COMPILED_CASES])
def test_compiled_step_matches_where_the_model_does_not(loss, config_kw, mesh_shape, step_kw):
  """A model that checkpoints its blocks, bf16 parameters on 3 devices (no
  unit divides), sharded accumulation, CPU offload: the segments' schedule
  misses what XLA does across units there (recomputation run early); the
  compiled step does not. One known difference: XLA combines the step's
  all-reduce of the loss with the gradient norm's, and where it then
  computes the loss decides whether one logits-sized buffer ([rows, S, V]
  per device, float32 or the compute dtype) is kept to the end of the
  step; with stand-ins for the all-reduces that choice can differ."""
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, **config_kw)
  rows = 2 * mesh_shape["shard"] * step_kw.get("gradient_accumulation_steps", 1)
  if loss is loss_checkpointed:  # the same call as test_remat_what_if's
    assert (config, mesh_shape, step_kw, rows) == (fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP),
                                                   {"shard": 8}, {}, BATCH["labels"].shape[0])
    est = estimate_written_checkpointed()
  else:
    est = fsdp_jax.estimate(loss, optimizer=OPT, batch=batch_for(rows), init_fn=init_fn,
                            config=config, mesh_shape=mesh_shape, **step_kw)
  truth = compiled_peak(config, mesh_shape, loss=loss, batch=batch_for(rows), **step_kw)
  assert est.compiled
  short = truth - est.bytes_per_device["total"]
  compute = jnp.dtype(config.mixed_precision.param_dtype if config.mixed_precision else "float32")
  logits = {0} | {sign * 2 * S * V * size for size in (4, compute.itemsize) for sign in (1, -1)}
  assert any(abs(short - b) <= 0.015 * truth for b in logits), (
      est.bytes_per_device["total"], truth)


def test_remat_what_if_and_the_compile_step_choice(planner, monkeypatch):
  """remat=True rewrites the loss with a jax.checkpoint per unit and
  compiles that step: close to the step of the model written with them.
  Programs above the size limit are modelled unless asked. remat=True is
  FSDPConfig(activation_checkpointing=ActivationCheckpointing("full")),
  which the engine applies with LoRA too."""
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP)
  cpu = fsdp_jax.DeviceSpec.preset("cpu")
  plain = planner.estimate(config, {"shard": 8}, cpu)
  remat = planner.estimate(config, {"shard": 8}, cpu, remat=True)
  assert remat.remat and remat.compiled
  # the same as the estimate of the model written with them (which the test
  # above checks against its compiled step)
  written = estimate_written_checkpointed()
  assert written.compiled
  assert remat.bytes_per_device["total"] == pytest.approx(written.bytes_per_device["total"],
                                                          rel=0.01)
  assert remat.bytes_per_device["total"] < plain.bytes_per_device["total"]
  monkeypatch.setattr(step_program, "AUTO_EQUATIONS", 10)
  est = planner.estimate(config, {"shard": 8}, cpu)
  assert not est.compiled and any("equations: the peak is modelled" in n for n in est.notes)
  assert est.bytes_per_device["total"] != plain.bytes_per_device["total"]
  assert planner.estimate(config, {"shard": 8}, cpu, compile_step=True).compiled
  lora = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, use_orig_params=True,
                             lora=fsdp_jax.LoRA(targets=("blocks.*.w1",), rank=2))
  checkpointed = fsdp_jax.FSDPConfig(
      auto_wrap_policy=WRAP, use_orig_params=True, lora=lora.lora,
      activation_checkpointing=fsdp_jax.ActivationCheckpointing("full"))
  est = planner.estimate(lora, {"shard": 8}, cpu, remat=True, compile_step=True)
  assert est.compiled and est.remat and est.config == checkpointed
  again = planner.estimate(checkpointed, {"shard": 8}, cpu, compile_step=True)
  assert again.bytes_per_device == est.bytes_per_device


def loss_blocked(params, batch):
  """loss_fn with the families' blocked head and cross-entropy."""
  x = params["embed"][batch["input_ids"]]
  for block in params["blocks"]:
    x = x + jnp.tanh(x @ block["w1"]) @ block["w2"]
  return fsdp_jax.chunked_cross_entropy(x, params["head"], batch["labels"], block_tokens=16)


@pytest.fixture(scope="module")
def blocked():
  return Planner(loss_blocked, optimizer=OPT, batch=BATCH, init_fn=init_fn)


def _policy(name):
  return fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP,
                             activation_checkpointing=fsdp_jax.ActivationCheckpointing(name))


def test_estimate_reads_the_checkpointing_policy(blocked):
  """FSDPConfig(activation_checkpointing=...) is estimated with its policy,
  compiled and modelled: "dots" keeps the matmuls' outputs (more than
  "full"), "offload" counts the units' saved inputs as host memory (less
  device memory than "full"). The compiled estimate is the real step's
  peak; the modelled one is not under it by more than 5%."""
  cpu = fsdp_jax.DeviceSpec.preset("cpu")
  gpu = fsdp_jax.DeviceSpec.preset("H100-80GB")
  modelled = {p: blocked.estimate(_policy(p), {"shard": 8}, gpu, compile_step=False)
              for p in ("full", "dots", "offload")}
  total = {p: e.bytes_per_device["total"] for p, e in modelled.items()}
  assert total["offload"] < total["full"] < total["dots"], total
  assert modelled["offload"].host_bytes > 0 and modelled["full"].host_bytes == 0
  assert any("host memory" in n for n in modelled["offload"].notes)
  assert [e.describe_config().split()[-1] for e in modelled.values()] == [
      "remat", "remat(dots)", "remat(offload)"]
  for name in ("full", "dots"):
    est = blocked.estimate(_policy(name), {"shard": 8}, cpu)
    truth = compiled_peak(_policy(name), {"shard": 8}, loss=loss_blocked)
    assert est.compiled and est.bytes_per_device["total"] == pytest.approx(truth, rel=0.05)
    assert total[name] >= 0.95 * truth, (name, total[name], truth)


def test_modelled_checkpointed_peak_keeps_the_deferred_head_gradient(planner):
  """With checkpointed units and an unblocked loss XLA defers the head's
  kernel gradient to the end of the backward, keeping logits-sized buffers
  alive through the units' backwards: the modelled peak counts them (it
  was 15.8% under the compiled step without them)."""
  cpu = fsdp_jax.DeviceSpec.preset("cpu")
  modelled = planner.estimate(_policy("full"), {"shard": 8}, cpu, compile_step=False)
  truth = compiled_peak(_policy("full"), {"shard": 8})
  logits = ROWS_PER_DEVICE * S * V * 4
  assert modelled.parts["deferred"] == 2 * logits
  total = modelled.bytes_per_device["total"]
  assert total >= 0.95 * truth, (total, truth)  # never under (was 15.8% under)
  if tuple(map(int, jax.__version__.split(".")[:2])) < (0, 12):
    assert total == pytest.approx(truth, rel=0.05)
  else:
    # Known: jax 0.12's XLA does not defer it for this small model (its
    # step frees the logits early): over by the two buffers (+17.6%).
    assert total - 2 * logits == pytest.approx(truth, rel=0.05)


def test_search_tries_the_policies_before_cpu_offload(blocked):
  """Activation checkpointing policies are savers tried before CPU offload
  of the parameters: "dots" first (the least recomputation), then "full",
  then "offload" where the device has host memory of its own (not "cpu");
  the one picked is the estimate's config and its description."""
  cpu = fsdp_jax.DeviceSpec.preset("cpu")
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP)
  space = {"config": config, "sharding_strategy": [fsdp_jax.ShardingStrategy.FULL_SHARD],
           "use_orig_params": [False], "gradient_accumulation_steps": [1]}
  plain = blocked.estimate(config, {"shard": 8}, cpu, compile_step=True)
  dots = blocked.estimate(_policy("dots"), {"shard": 8}, cpu, compile_step=True)
  assert dots.bytes_per_device["total"] < plain.bytes_per_device["total"]
  found = search_lib.run(blocked, devices=8, space=space, compile_step=True,
                         memory_limit=dots.bytes_per_device["total"])
  assert [e.describe_config() for e in found] == ["FULL_SHARD flat shard=8 remat(dots)"]
  assert found[0].config.activation_checkpointing.policy == "dots"
  assert found[0].config.cpu_offload is None
  # modelled: below "full" but above "offload", on a device with host memory
  full = blocked.estimate(_policy("full"), {"shard": 8}, cpu, compile_step=False)
  offload = blocked.estimate(_policy("offload"), {"shard": 8}, cpu, compile_step=False)
  limit = (full.bytes_per_device["total"] + offload.bytes_per_device["total"]) // 2
  found = search_lib.run(blocked, devices=8, device="H100-80GB", space=space,
                         compile_step=False, memory_limit=limit)
  assert [e.describe_config() for e in found] == ["FULL_SHARD flat shard=8 remat(offload)"]
  on_cpu = search_lib.run(blocked, devices=8, space=space, compile_step=False,
                          memory_limit=limit)
  assert all(e.config.activation_checkpointing is None
             or e.config.activation_checkpointing.policy != "offload" for e in on_cpu)


def test_tensor_parallel_compiled_peak_keeps_the_logits():
  """Under tensor parallelism XLA combines the loss's all-reduce with the
  gradient norm's and computes the loss late, keeping the logits to the end
  of the step; the compiled estimate's stand-ins tie those all-reduces as
  the combiner does, so it is the real step's peak (it was 10% under).
  Megatron's all-reduces, sequence parallelism off: with it (reduce-scatters
  and all-gathers along the sequence) the estimate is 6% under the step's
  peak (268,609 against 285,721 bytes), not yet modelled."""
  tp = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, tensor_parallel=fsdp_jax.TensorParallel(
      rules=[("blocks.*.w1", "colwise"), ("blocks.*.w2", "rowwise")], sequence_parallel=False))
  shape = {"shard": 4, "tensor": 2}
  est = fsdp_jax.estimate(loss_fn, optimizer=OPT, batch=BATCH, init_fn=init_fn, config=tp,
                          mesh_shape=shape)
  assert est.compiled
  assert est.bytes_per_device["total"] == pytest.approx(compiled_peak(tp, shape), rel=0.01)


def test_a_cudnn_family_is_planned_on_cpu(tmp_path):
  """A family built with attn_implementation="cudnn" (cuDNN's flash
  attention on the GPU, absent here) is planned with fsdp_jax.attention's
  blockwise kernel, of the same memory class: the same estimate as the
  default implementation's, and a note saying so."""
  (tmp_path / "config.json").write_text(json.dumps(
      {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
       "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}))
  tokens = jax.ShapeDtypeStruct((8, 32), jnp.int32)
  out = {}
  for impl in ("cudnn", None):
    model = fsdp_jax.models.from_pretrained(str(tmp_path), attn_implementation=impl)
    out[impl] = fsdp_jax.estimate(
        model.loss_fn, optimizer=OPT, batch={"input_ids": tokens, "labels": tokens},
        init_fn=model.init_fn, config=fsdp_jax.FSDPConfig(auto_wrap_policy=model.wrap_policy),
        mesh_shape={"shard": 8}, device="H100-80GB", compile_step=False)
  assert out["cudnn"].bytes_per_device == out[None].bytes_per_device
  assert any("blockwise kernel" in n for n in out["cudnn"].notes)
  assert not any("blockwise kernel" in n for n in out[None].notes)


def test_mesh_larger_than_the_machine(planner):
  """64 and 4 x 64 devices, estimated on this 8-device machine: the
  per-device state bytes are the plan's, exactly; the activations are the
  same as on 8 devices (the same per-device micro-batch)."""
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP)
  cpu = fsdp_jax.DeviceSpec.preset("cpu")
  small = planner.estimate(config, {"shard": 8}, cpu)
  big = Planner(loss_fn, optimizer=OPT, batch=batch_for(256 * ROWS_PER_DEVICE), init_fn=init_fn)
  big.programs_cache, big.optimizer_cache = planner.programs_cache, planner.optimizer_cache
  hybrid = fsdp_jax.FSDPConfig(sharding_strategy=fsdp_jax.ShardingStrategy.HYBRID_SHARD,
                               auto_wrap_policy=WRAP)
  for shape, cfg in (({"shard": 256}, config), ({"replicate": 4, "shard": 64}, hybrid)):
    est = big.estimate(cfg, shape, cpu)
    n = shape["shard"] if "replicate" in shape else 256
    # each unit is one flat parameter: ceil(numel / N) float32 values per device
    units = [V * D + D * V] + [2 * D * F] * LAYERS
    assert est.bytes_per_device["params"] == sum(-(-u // n) for u in units) * 4
    assert est.bytes_per_device["grads"] == est.bytes_per_device["params"]
    assert est.bytes_per_device["optimizer"] == 2 * est.bytes_per_device["params"] + 4
    assert est.bytes_per_device["activations"] == small.bytes_per_device["activations"]
    assert est.bytes_per_device["total"] < small.bytes_per_device["total"]
    assert jax.device_count() == 8  # nothing of the big meshes was built


# --------------------------------------------------------------------------
# search


def test_search_covers_the_space_and_orders_by_time():
  strategies = [fsdp_jax.ShardingStrategy.FULL_SHARD, fsdp_jax.ShardingStrategy.SHARD_GRAD_OP,
                fsdp_jax.ShardingStrategy.HYBRID_SHARD]
  found = fsdp_jax.search(loss_fn, optimizer=OPT, batch=BATCH, init_fn=init_fn, devices=8,
                          device="H100-80GB",
                          space={"config": fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP),
                                 "sharding_strategy": strategies})
  # 2 layouts x (FULL_SHARD, SHARD_GRAD_OP on 8; HYBRID_SHARD on 2x4 and 4x2): all fit
  seen = {(e.config.sharding_strategy.name, e.config.use_orig_params,
           tuple(e.mesh_shape.items())) for e in found}
  assert len(found) == len(seen) == 8
  assert {m for _, _, m in seen} == {(("shard", 8),), (("replicate", 2), ("shard", 4)),
                                     (("replicate", 4), ("shard", 2))}
  assert all(e.fits for e in found)
  times = [e.step_seconds for e in found]
  assert times == sorted(times)
  # the fastest confirmed by compiling its step, the rest modelled
  assert [e.compiled for e in found] == [True] + [False] * 7
  # SHARD_GRAD_OP gathers each unit once, FULL_SHARD twice: less communication
  comm = {(e.config.sharding_strategy.name, e.config.use_orig_params): sum(
      t for t, _ in e.comm_seconds.values()) for e in found if len(e.mesh_shape) == 1}
  assert comm[("SHARD_GRAD_OP", False)] < comm[("FULL_SHARD", False)]


def test_search_uses_memory_savers_only_when_needed(planner):
  """Under a memory limit below the plain step's peak, the first saver that
  fits is returned (here: more microbatches, or remat); with no saver
  allowed nothing fits. (search.run: the module's planner, its programs
  compiled once.)"""
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP)
  space = {"config": config, "sharding_strategy": [fsdp_jax.ShardingStrategy.FULL_SHARD],
           "use_orig_params": [False], "cpu_offload": [False]}
  plain = search_lib.run(planner, devices=8, space=space)
  assert len(plain) == 1 and plain[0].gradient_accumulation_steps == 1 and not plain[0].remat
  limit = plain[0].bytes_per_device["total"] - 1
  tight = search_lib.run(planner, devices=8, space=space, memory_limit=limit)
  assert len(tight) == 1
  est = tight[0]
  assert est.fits and est.bytes_per_device["total"] <= limit
  assert est.gradient_accumulation_steps > 1 or est.remat
  assert est.step_seconds >= plain[0].step_seconds
  nothing = search_lib.run(planner, devices=8, memory_limit=limit,
                           space={**space, "remat": [False], "gradient_accumulation_steps": [1],
                                  "context": [1]})
  assert nothing == []


def test_search_without_a_wrap_policy_tries_one_unit_per_layer(planner):
  """A config without a wrap policy makes the whole model one unit,
  gathered at once: when nothing fits so, the search tries one unit per
  layer (the list of blocks) and says so; when nothing fits either, it
  warns, naming the policy to pass."""
  cpu = fsdp_jax.DeviceSpec.preset("cpu")
  space = {"config": fsdp_jax.FSDPConfig(), "use_orig_params": [False], "remat": [False],
           "sharding_strategy": [fsdp_jax.ShardingStrategy.FULL_SHARD],
           "cpu_offload": [False], "gradient_accumulation_steps": [1]}
  layered = planner.estimate(fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP), {"shard": 8}, cpu,
                             compile_step=False)
  whole = planner.estimate(fsdp_jax.FSDPConfig(), {"shard": 8}, cpu, compile_step=False)
  limit = layered.bytes_per_device["total"]
  assert whole.bytes_per_device["total"] > limit
  [est] = search_lib.run(planner, devices=8, space=space, memory_limit=limit,
                         compile_step=False)
  assert est.config.auto_wrap_policy == fsdp_jax.ModuleWrapPolicy(["blocks.*"])
  assert any('ModuleWrapPolicy(["blocks.*"])' in n for n in est.notes)
  with pytest.warns(UserWarning, match=r'no wrap policy.*Fix: pass space=.*auto_wrap_policy='
                                       r'fsdp_jax\.ModuleWrapPolicy\(\["blocks\.\*"\]\)'):
    assert search_lib.run(planner, devices=8, space=space, memory_limit=limit // 2,
                          compile_step=False) == []


def test_search_given_meshes_skip_what_a_strategy_cannot_use(planner):
  """HYBRID strategies need a replicate axis: with only 1-D meshes given,
  they are skipped, not an error."""
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP)
  found = search_lib.run(planner, devices=8, compile_step=False, space={
      "config": config, "mesh_shapes": [{"shard": 8}], "use_orig_params": [False],
      "sharding_strategy": [fsdp_jax.ShardingStrategy.FULL_SHARD,
                            fsdp_jax.ShardingStrategy.HYBRID_SHARD]})
  assert [e.config.sharding_strategy.name for e in found] == ["FULL_SHARD"]
  assert not found[0].compiled


# --------------------------------------------------------------------------
# devices


def test_large_updates_and_losses_compile_in_parts(planner, monkeypatch):
  """The optimizer's update of many leaves is compiled on the distinct
  leaves (once, twice, once plus the smallest) and summed over all: its
  memory as the whole update's, its flops and bytes within 5%, for AdamW and
  for a global-norm clip before it (not elementwise). A large loss's
  segments compile one at a time: the same estimate as compiled together."""
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP, use_orig_params=True)
  programs = importlib.import_module("fsdp_jax._src.planner.programs")
  for opt in (OPT, optax.chain(optax.clip_by_global_norm(1.0), OPT)):
    plan, _ = Planner(loss_fn, optimizer=opt, batch=BATCH, init_fn=init_fn).plan(
        config, {"shard": 8})
    leaves = programs.optimizer_inputs(plan)  # 6 leaves of 4 shapes
    assert len({(x.shape, x.dtype) for x in leaves}) == 4 < len(leaves)
    whole = programs.optimizer_program(plan, leaves)
    with monkeypatch.context() as m:
      m.setattr(programs, "WHOLE_UPDATE_LEAVES", 0)
      parts = programs.optimizer_program(plan, leaves)
    assert (parts.argument, parts.output, parts.alias) == (whole.argument, whole.output,
                                                           whole.alias)
    assert parts.temp == pytest.approx(whole.temp, abs=256)
    # (the time's inputs: XLA fuses a clip's norm differently per program)
    assert parts.flops == pytest.approx(whole.flops, rel=0.05)
    assert parts.bytes_accessed == pytest.approx(whole.bytes_accessed, rel=0.05)
  cpu = fsdp_jax.DeviceSpec.preset("cpu")
  together = planner.estimate(config, {"shard": 8}, cpu, compile_step=False)
  monkeypatch.setattr(programs, "SERIAL_COMPILE_EQUATIONS", 0)
  alone = Planner(loss_fn, optimizer=OPT, batch=BATCH, init_fn=init_fn).estimate(
      config, {"shard": 8}, cpu, compile_step=False)
  assert alone.bytes_per_device == together.bytes_per_device
  assert alone.step_seconds == pytest.approx(together.step_seconds, rel=1e-9)


def test_device_presets():
  presets = fsdp_jax.plan.PRESETS
  assert set(presets) == {"H100-80GB", "H200", "A100-80GB", "B200", "cpu"}
  h100, h200, a100, b200 = (fsdp_jax.DeviceSpec.preset(n)
                            for n in ("H100-80GB", "H200", "A100-80GB", "B200"))
  assert h100.memory_bytes == 80 * 2**30 and h100.hbm_bytes_per_s == 3.35e12
  assert h200.memory_bytes == 141 * 2**30 and h200.peak_flops == h100.peak_flops
  assert a100.peak_flops == 312e12 and b200.intra_node_bytes_per_s == 900e9
  for spec in (h100, h200, a100, b200):
    assert "nvidia.com" in spec.source and spec.devices_per_node == 8
    assert spec.intra_node_bytes_per_s > spec.inter_node_bytes_per_s
  assert "measured" in presets["cpu"].source
  with pytest.raises(ValueError, match=r"peak_flops=0 must be a positive number"):
    fsdp_jax.DeviceSpec("x", memory_bytes=1, peak_flops=0, hbm_bytes_per_s=1,
                        intra_node_bytes_per_s=1, inter_node_bytes_per_s=1, devices_per_node=1)


def test_axis_bandwidth_follows_the_mesh_position():
  from fsdp_jax._src.planner.schedule import axis_bandwidth  # pylint: disable=import-outside-toplevel
  h100 = fsdp_jax.DeviceSpec.preset("H100-80GB")
  shape = {"replicate": 8, "shard": 2, "tensor": 4}
  assert axis_bandwidth(shape, ("tensor",), h100) == (450e9, "intra")  # 4 adjacent devices
  assert axis_bandwidth(shape, ("shard",), h100) == (450e9, "intra")  # 2 x 4 = one node
  assert axis_bandwidth(shape, ("replicate",), h100) == (50e9, "inter")  # across 8 nodes


# --------------------------------------------------------------------------
# bad input


def test_bad_input_errors_name_the_fix():
  est = lambda **kw: fsdp_jax.estimate(
      loss_fn, optimizer=OPT, init_fn=init_fn, **{"batch": BATCH, "mesh_shape": {"shard": 8},
                                                  **kw})
  with pytest.raises(ValueError, match=r"multiplies to 6 devices .*not devices=8.*Fix: "
                                       r"choose sizes whose product is 8"):
    fsdp_jax.search(loss_fn, optimizer=OPT, batch=BATCH, init_fn=init_fn, devices=8,
                    space={"mesh_shapes": [{"replicate": 2, "shard": 3}]})
  tp = fsdp_jax.FSDPConfig(tensor_parallel=fsdp_jax.TensorParallel(rules=[("blocks.*.w1",
                                                                           "colwise")]))
  with pytest.raises(ValueError, match=r"splits dimension 1 of 'blocks.0.w1' .*size 96.* "
                                       r"tensor axis 'tensor' of size 7, which does not divide "
                                       r"it\. Fix"):
    est(config=tp, mesh_shape={"shard": 2, "tensor": 7}, batch=batch_for(14))
  with pytest.raises(ValueError, match=r"Unknown device 'H900'\. Fix: pass one of the presets "
                                       r"\['A100-80GB', 'B200', 'H100-80GB', 'H200', 'cpu'\]"):
    est(device="H900")
  with pytest.raises(ValueError, match=r"(?s)leading dimension that is not divisible by the "
                                       r"data-parallel size 8 .*'input_ids'\] of shape "
                                       r"\(12, 32\).*Fix: use a global batch size that is a "
                                       r"multiple of 8, e.g. 16"):
    est(batch=batch_for(12))
  with pytest.raises(ValueError, match=r"has axes \['model'\] fsdp_jax does not use"):
    est(mesh_shape={"model": 8})


# --------------------------------------------------------------------------
# python -m fsdp_jax.plan


class Bundle:
  """What fsdp_jax.models.from_pretrained returns, for the tiny model."""

  init_fn = staticmethod(init_fn)
  loss_fn = staticmethod(loss_fn)
  wrap_policy = WRAP
  tensor_parallel = (("blocks.*.w1", "colwise"), ("blocks.*.w2", "rowwise"))
  lora_targets = ("blocks.*.w1", "blocks.*.w2")


def test_command_line_prints_the_search(tmp_path, capsys):
  out = tmp_path / "plan.json"
  (tmp_path / "config.json").write_text("{}")
  fsdp_jax.plan.main(["--hf-config", str(tmp_path / "config.json"), "--devices", "8",
                      "--device", "A100-80GB", "--seq", str(S), "--global-batch", "16",
                      "--lora", "--precision", "fp32", "--strategy", "FULL_SHARD",
                      "--layout", "orig", "--json", str(out), "--top", "1"],
                     model=Bundle())
  text = capsys.readouterr().out
  assert "configurations fit 8 x A100-80GB" in text
  assert "| 1 | FULL_SHARD orig shard=8 " in text and "| 2 | " not in text
  answer = json.loads(out.read_text())
  assert answer["closest"] == [] and answer["memory_limit_bytes"] == 80 * 2**30
  rows = answer["fits"]  # every estimate that fits: LoRA and QLoRA
  assert len(rows) == 2 and all("LoRA" in r["configuration"] for r in rows)
  assert {"QLoRA" in r["configuration"] for r in rows} == {True, False}
  steps = [r["step_seconds"] for r in rows]
  assert steps == sorted(steps)
  assert [r["compiled"] for r in rows] == [True, False]  # the fastest confirmed
  assert "| 1 | FULL_SHARD orig shard=8 " in text and " | compiled | yes | " in text


def test_command_line_explains_what_does_not_fit(tmp_path, capsys):
  """Nothing fits: the closest configurations, smallest peak first, each
  with its peak, the limit it misses and by how much, and what could close
  the gap; --json says so as an object (never an empty list)."""
  out = tmp_path / "plan.json"
  (tmp_path / "config.json").write_text("{}")
  fsdp_jax.plan.main(["--hf-config", str(tmp_path / "config.json"), "--devices", "8",
                      "--seq", str(S), "--global-batch", "16", "--memory-limit-gib", "0.000001",
                      "--strategy", "FULL_SHARD", "--strategy", "NO_SHARD", "--layout", "flat",
                      "--json", str(out)], model=Bundle())
  text = capsys.readouterr().out
  assert "Nothing fits 8 x H100-80GB (0.0 GiB each)" in text and "| 1 | " in text
  answer = json.loads(out.read_text())
  limit = int(0.000001 * 2**30)
  assert answer["fits"] == [] and answer["memory_limit_bytes"] == limit
  closest = answer["closest"]
  assert [r["configuration"].split()[0] for r in closest] == ["FULL_SHARD", "NO_SHARD"]
  totals = [r["bytes_per_device"]["total"] for r in closest]
  assert totals == sorted(totals)
  for r in closest:
    assert r["misses_by_bytes"] == r["bytes_per_device"]["total"] - limit > 0
    # the savers it does not use that free at least the gap, LoRA, more devices
    b, miss = r["bytes_per_device"], r["misses_by_bytes"]
    assert r["needs"].startswith("remat, ") == (
        "remat" not in r["configuration"] and b["activations"] >= miss)
    assert ("CPU offload" in r["needs"]) == (
        "offload" not in r["configuration"] and b["params"] + b["optimizer"] >= miss)
    assert "LoRA/QLoRA (--lora)" in r["needs"]
    sharded = b["grads"] + (0 if "offload" in r["configuration"] else
                            b["params"] + b["optimizer"])  # what more devices would shrink
    assert ("more devices" in r["needs"]) == (sharded > miss and "NO_SHARD" not in
                                              r["configuration"])
    gib = f"| {r['bytes_per_device']['total'] / 2**30:.2f} | modelled | "
    assert gib + f"{r['misses_by_bytes'] / 2**30:.2f} | " + r["needs"] + " |" in text
  # What closes a gap: the savers that free at least it, more devices
  # (the sharded state spread further: 8 x 6 / (6 - 2)), fewer tokens.
  est = fsdp_jax.Estimate(
      config=fsdp_jax.FSDPConfig(), mesh_shape={"shard": 8}, fits=False, step_seconds=1.0,
      bytes_per_device={"params": 1, "grads": 1, "optimizer": 4, "activations": 2,
                        "total": 12}, device=fsdp_jax.DeviceSpec.preset("cpu"),
      memory_limit=10)
  args = fsdp_jax.plan._parser().parse_args(
      ["--hf-config", ".", "--devices", "8", "--seq", "64", "--global-batch", "16"])
  assert fsdp_jax.plan._needs(est, 10, args) == (
      "remat, CPU offload, LoRA/QLoRA (--lora), more devices (about 12, all else equal), "
      "context parallelism (--context 2: each sequence split over 2 devices), "
      "fewer tokens per device (now 2 x 64)")
  # Offloaded: the parameters and optimizer state are off the device already
  # (8 x 1 / (1 - 0.5) devices for the gradients alone).
  moved = dataclasses.replace(
      est, config=fsdp_jax.FSDPConfig(cpu_offload=fsdp_jax.CPUOffload(offload_params=True)),
      bytes_per_device={**est.bytes_per_device, "total": 3})
  assert fsdp_jax.plan._needs(moved, 2.5, args) == (
      "remat, LoRA/QLoRA (--lora), more devices (about 16, all else equal), "
      "context parallelism (--context 2: each sequence split over 2 devices), "
      "fewer tokens per device (now 2 x 64)")
  # Under context=4 the tokens per device are the rows of shard=2 by a
  # quarter of the sequence; context=8 splits it further.
  ctx = dataclasses.replace(est, mesh_shape={"shard": 2, "context": 4})
  assert fsdp_jax.plan._needs(ctx, 10, args).endswith(
      "context parallelism (--context 8: each sequence split over 8 devices), "
      "fewer tokens per device (now 8 x 16)")


def test_command_line_mistakes_print_the_message_alone(tmp_path, capsys):
  """A mistake in the input: its message on stderr, exit status 2, no
  traceback."""
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_family"}))
  base = ["--hf-config", str(tmp_path / "config.json"), "--devices", "8", "--seq", str(S),
          "--global-batch", "16", "--strategy", "FULL_SHARD", "--layout", "flat"]

  def fails(args, model=Bundle(), **changes):
    argv = list(base)
    for flag, value in changes.items():
      argv[argv.index(flag) + 1] = value
    with pytest.raises(SystemExit) as e:
      fsdp_jax.plan.main(argv + args, model=model)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    return err

  assert "--device 'H900': Unknown device 'H900'. Fix: pass one of the presets" in fails(
      ["--device", "H900"])
  assert ("the global batch of 12 rows is not divisible by the data-parallel size 8 of mesh "
          "{'shard': 8}. Fix: use a global batch that is a multiple of 8, e.g. 16"
          in fails(["--context", "1"], **{"--global-batch": "12"}))  # context=2 would fit it
  assert "--devices 0: the number of devices must be at least 1" in fails(
      [], **{"--devices": "0"})
  assert "no_such_family" in fails([], model=None)
  assert "no config.json there" in fails([], model=None,
                                         **{"--hf-config": str(tmp_path / "none" / "x.json")})


def test_command_line_sets_the_cpu_flags_before_jax_starts(tmp_path, monkeypatch, capsys):
  """The command adds fsdp_jax's CPU flags (the memory-minimising
  scheduler) to XLA_FLAGS before the model is built, when JAX has not
  started (XLA reads the scheduler from the process's flags only); the
  shell's own flags are kept."""
  monkeypatch.setattr(fsdp_jax._src._compat, "backends_initialized", lambda: False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
  with pytest.raises(SystemExit):  # stops at the missing config.json, after the flags
    fsdp_jax.plan.main(["--hf-config", str(tmp_path / "config.json"), "--devices", "8",
                        "--seq", str(S), "--global-batch", "16"])
  assert "no config.json there" in capsys.readouterr().err
  assert os.environ["XLA_FLAGS"].split() == ["--xla_dump_to=/nowhere",
                                             *fsdp_jax._src.mesh.CPU_XLA_FLAGS]


def test_search_confirms_the_setting_the_model_chose(planner, monkeypatch):
  """The search confirms the fastest by compiling the same configuration,
  savers included, as estimate() compiles it: when the compiled step
  without savers is far above the model (XLA's breadth-first CPU scheduler
  did that at Llama 3 8B's size), the CPU offload candidate the modelled
  pass found is still confirmed, with estimate()'s peak."""
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP)
  offload = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP,
                                cpu_offload=fsdp_jax.CPUOffload(offload_params=True))
  cpu = fsdp_jax.DeviceSpec.preset("cpu")
  plain = planner.estimate(config, {"shard": 8}, cpu, compile_step=False)
  moved = planner.estimate(offload, {"shard": 8}, cpu)
  assert moved.compiled
  limit = (moved.bytes_per_device["total"] + plain.bytes_per_device["total"]) // 2
  real = Planner._compiled_peak

  def far_above_without_savers(self, plan, *args):
    peak = real(self, plan, *args)
    return peak if plan.offloaded else 10 * peak

  monkeypatch.setattr(Planner, "_compiled_peak", far_above_without_savers)
  space = {"config": config, "sharding_strategy": [fsdp_jax.ShardingStrategy.FULL_SHARD],
           "use_orig_params": [False], "remat": [False], "gradient_accumulation_steps": [1]}
  found = search_lib.run(planner, devices=8, space=space, memory_limit=limit)
  assert [e.describe_config() for e in found] == ["FULL_SHARD flat shard=8 offload"]
  assert found[0].compiled
  assert found[0].bytes_per_device["total"] == moved.bytes_per_device["total"]
  # Every candidate compiled: which savers can help is still read from the
  # modelled peak's parts, not the compiled plain step's total.
  compiled = search_lib.run(planner, devices=8, space=space, memory_limit=limit,
                            compile_step=True)
  assert [(e.describe_config(), e.compiled, e.bytes_per_device["total"]) for e in compiled] == [
      ("FULL_SHARD flat shard=8 offload", True, moved.bytes_per_device["total"])]


# The child of the next test: a process without fsdp_jax's CPU flags.
_CHILD = """
import importlib, json, sys, warnings
from fsdp_jax._src.planner import programs
concurrency = programs.concurrency_scheduler()  # this process's own flags
import jax, jax.numpy as jnp, optax, fsdp_jax
from fsdp_jax._src.planner.estimator import Planner
search_lib = importlib.import_module("fsdp_jax._src.planner.search")
model = fsdp_jax.models.from_pretrained(sys.argv[1])
tokens = jax.ShapeDtypeStruct((16, 64), jnp.int32)
planner = Planner(model.loss_fn, optimizer=optax.adamw(1e-4), init_fn=model.init_fn,
                  batch={"input_ids": tokens, "labels": tokens})
config = fsdp_jax.FSDPConfig(auto_wrap_policy=model.wrap_policy)
cpu = fsdp_jax.DeviceSpec.preset("cpu")
plain = planner.estimate(config, {"shard": 8}, cpu)
remat = planner.estimate(config, {"shard": 8}, cpu, remat=True)
limit = (plain.bytes_per_device["total"] + remat.bytes_per_device["total"]) // 2
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  found = search_lib.run(planner, devices=8, memory_limit=limit, space={
      "config": config, "sharding_strategy": [fsdp_jax.ShardingStrategy.FULL_SHARD],
      "use_orig_params": [False], "cpu_offload": [False], "gradient_accumulation_steps": [1],
      "remat": [False, True]})
print(json.dumps({"concurrency": concurrency, "limit": limit,
                  "plain": plain.bytes_per_device["total"],
                  "remat": remat.bytes_per_device["total"],
                  "found": [[e.describe_config(), e.compiled, e.bytes_per_device["total"],
                             list(e.notes)] for e in found],
                  "warned": [str(w.message) for w in caught]}))
"""


@pytest.mark.slow
def test_search_confirmation_matches_estimate_without_cpu_flags(tmp_path):
  """In a process without fsdp_jax's CPU XLA flags (XLA:CPU's breadth-first
  scheduler, which no program option changes), the search confirms the
  candidate its modelled pass found with the same compiled peak as
  estimate() on that candidate, and says the scheduler differs (what the
  command line avoids by setting the flags in its own process)."""
  (tmp_path / "config.json").write_text(json.dumps(
      {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
  # The test run's compile-speed flags, not fsdp_jax's CPU flags.
  env = {k: v for k, v in subprocess_env(XLA_FLAGS=TEST_XLA_FLAGS).items()
         if k != "JAX_NUM_CPU_DEVICES"}
  out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  child = json.loads(out.stdout.strip().splitlines()[-1])
  assert child["concurrency"] is True
  assert child["remat"] <= child["limit"] < child["plain"]
  [(name, compiled, total, notes)] = child["found"]
  assert name == "FULL_SHARD flat shard=8 remat" and compiled and total == child["remat"]
  assert any("schedules breadth-first" in n for n in notes) and child["warned"]


@pytest.mark.slow
def test_command_line_help_runs_as_a_module():
  out = subprocess.run([sys.executable, "-m", "fsdp_jax.plan", "--help"], capture_output=True,
                       text=True, check=True)
  assert "--hf-config" in out.stdout and "H100-80GB" in out.stdout


# --------------------------------------------------------------------------
# context parallelism: a "context" axis in the mesh


@pytest.fixture(scope="module")
def llama_bundle(tmp_path_factory):
  """A one-block Llama (rotary, grouped-query attention, SwiGLU) from
  fsdp_jax.models."""
  d = tmp_path_factory.mktemp("llama")
  (d / "config.json").write_text(json.dumps(
      {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
       "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}))
  return fsdp_jax.models.from_pretrained(str(d))


def test_estimate_with_a_context_axis_matches_the_compiled_peak(llama_bundle):
  """On shard x context (C = 2, 4) the estimate is the real step's peak:
  the per-device batch is rows / (shard) x sequence / C, the weights are
  sharded over shard x context, and the keys and values each layer
  gathers whole over "context" count in the modelled peak too. The step's
  program compiled on one device (the estimate's default here) is checked
  on C = 2; on C = 4 (the same code path, a size that also divides
  everything) the plan's bytes and the modelled peak are."""
  model = llama_bundle
  tokens = jax.ShapeDtypeStruct((8, 256), jnp.int32)
  batch = {"input_ids": tokens, "labels": tokens}
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=model.wrap_policy)
  planner = Planner(model.loss_fn, optimizer=OPT, batch=batch, init_fn=model.init_fn)
  cpu = fsdp_jax.DeviceSpec.preset("cpu")
  modelled = {}
  for shape in ({"shard": 4, "context": 2}, {"shard": 2, "context": 4}):
    mesh = fsdp_jax.make_mesh(**shape, devices=jax.devices()[:8])
    state = jax.eval_shape(lambda: fsdp_jax.init_train_state(  # pylint: disable=cell-var-from-loop
        init_fn=model.init_fn, rng=jax.random.key(0), optimizer=OPT, mesh=mesh, config=config))
    ma = fsdp_jax.shard_train_step(model.loss_fn).lower(state, batch).compile().memory_analysis()
    truth = (ma.argument_size_in_bytes + ma.temp_size_in_bytes + ma.output_size_in_bytes
             - ma.alias_size_in_bytes)
    modelled[shape["context"]] = est = planner.estimate(config, shape, cpu, compile_step=False)
    if shape["context"] == 2:
      est = planner.estimate(config, shape, cpu)
      assert est.compiled
      assert est.bytes_per_device["total"] == pytest.approx(truth, rel=0.05)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.params))
    assert est.mesh_shape == shape
    assert est.bytes_per_device["params"] == nbytes // 8  # over shard x context
    assert "context" in est.comm_seconds  # K and V gathered over it
    assert modelled[shape["context"]].bytes_per_device["total"] == pytest.approx(truth, rel=0.05)
  # the same tokens per device; context=4 gathers each layer's K and V over
  # twice the rows (4 x 256 tokens against 2 x 256): f32 [rows, 256, 2 heads, 8]
  kv = 2 * 256 * 2 * 8 * 4
  grown = modelled[4].bytes_per_device["total"] - modelled[2].bytes_per_device["total"]
  assert kv <= grown <= 4 * kv, grown


def test_search_picks_a_context_size_when_the_sequence_does_not_fit_otherwise(planner):
  """With a memory limit no configuration without a context axis meets
  (one row of 32 tokens per device, accumulating, is the least it can
  hold), the search keeps context=2 (rows of 16 tokens), the smallest
  context size that fits, confirmed compiled, and says so."""
  config = fsdp_jax.FSDPConfig(auto_wrap_policy=WRAP)
  cpu = fsdp_jax.DeviceSpec.preset("cpu")
  one = planner.estimate(config, {"shard": 8}, cpu, gradient_accumulation_steps=2,
                         accumulation="sharded")
  two = planner.estimate(config, {"shard": 4, "context": 2}, cpu,
                         gradient_accumulation_steps=4, accumulation="sharded")
  limit = (one.bytes_per_device["total"] + two.bytes_per_device["total"]) // 2
  assert two.bytes_per_device["total"] < limit < one.bytes_per_device["total"]
  space = {"config": config, "sharding_strategy": [fsdp_jax.ShardingStrategy.FULL_SHARD],
           "use_orig_params": [False], "remat": [False], "cpu_offload": [False]}
  found = search_lib.run(planner, devices=8, space=space, memory_limit=limit)
  assert [(e.describe_config(), e.compiled) for e in found] == [
      ("FULL_SHARD flat shard=4xcontext=2 accum=4(sharded)", True)]
  assert found[0].bytes_per_device["total"] == two.bytes_per_device["total"]
  assert any("context=2, each sequence split into 2 chunks" in n and "context=1 did not fit" in n
             for n in found[0].notes)
  # Without the limit the search keeps no context axis (the least communication).
  plain = search_lib.run(planner, devices=8, space=space, compile_step=False)
  assert [e.mesh_shape for e in plain] == [{"shard": 8}]


def test_context_bad_input_names_the_fix():
  est = lambda **kw: fsdp_jax.estimate(loss_fn, optimizer=OPT, init_fn=init_fn, **kw)
  with pytest.raises(ValueError, match=r"sequence length 32 \(dim 1\) is not divisible by the "
                                       r"context axis size 3\. Fix: pad the sequences to a "
                                       r"multiple of 3, e.g\. 33"):
    est(mesh_shape={"shard": 2, "context": 3}, batch=batch_for(4))
  with pytest.raises(ValueError, match=r"context=3 splits each sequence into 3 chunks, but the "
                                       r"sequence length 32 is not divisible by 3\. Fix: use "
                                       r"context sizes dividing the sequence length \(\[1, 2, 4\]\)"):
    fsdp_jax.search(loss_fn, optimizer=OPT, batch=BATCH, init_fn=init_fn, devices=12,
                    space={"context": [1, 3]})


def test_command_line_answers_for_long_sequences(tmp_path, capsys):
  """A global batch smaller than the devices (one long sequence each for
  4 of 8 devices): the command keeps context=2; --context narrows the
  sizes, and one that does not divide --seq is a message, status 2."""
  out = tmp_path / "plan.json"
  (tmp_path / "config.json").write_text("{}")
  base = ["--hf-config", str(tmp_path / "config.json"), "--devices", "8", "--seq", str(S),
          "--global-batch", "4", "--strategy", "FULL_SHARD", "--layout", "flat",
          "--precision", "fp32"]
  fsdp_jax.plan.main(base + ["--json", str(out), "--top", "1"], model=Bundle())
  text = capsys.readouterr().out
  assert "| 1 | FULL_SHARD flat shard=4xcontext=2 " in text
  assert "Context parallelism (context sizes tried: [1, 2, 4, 8]): context=2" in text
  answer = json.loads(out.read_text())
  assert answer["context_sizes"] == [1, 2, 4, 8] and answer["fits"][0]["context"] == 2
  assert answer["fits"][0]["mesh_shape"] == {"shard": 4, "context": 2}
  for args, message in ((["--context", "3"], "--context: space['context'] = [3]: context=3 "
                                             "splits each sequence into 3 chunks"),
                        (["--context", "0"], "--context 0: must be at least 1")):
    with pytest.raises(SystemExit) as e:
      fsdp_jax.plan.main(base + args, model=Bundle())
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and message in err, err
