"""``fsdp_jax.search``: the configurations predicted to fit, fastest first.

Every candidate is an :class:`~fsdp_jax._src.planner.estimator.Estimate`
of one planner (:class:`~fsdp_jax._src.planner.estimator.Planner`): the
user's tree is traced once, the loss once per distinct per-device shape,
and each distinct per-device program is compiled once, however many
configurations share it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings
from typing import Any, Callable, Optional

import jax

from fsdp_jax._src import context as context_lib
from fsdp_jax._src.config import (RESHARD_AFTER_FORWARD, ActivationCheckpointing, CPUOffload,
                                  FSDPConfig, ShardingStrategy)
from fsdp_jax._src.context import CONTEXT, ContextParallel
from fsdp_jax._src.mesh import REPLICATE, SHARD, TENSOR
from fsdp_jax._src.quantization import Quantization
from fsdp_jax._src.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy
from fsdp_jax._src.planner.devices import device_spec
from fsdp_jax._src.planner.estimator import Estimate, Planner, check_mesh_shape

_SPACE_KEYS = ("config", "sharding_strategy", "use_orig_params", "mesh_shapes", "tensor",
               "context", "remat", "cpu_offload", "gradient_accumulation_steps", "accumulation",
               "lora")
_HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)  # pylint: disable=protected-access


# The activation checkpointing policies tried as savers, in this order: the
# least recomputation first ("dots" keeps the matmuls' outputs), then "full",
# then "offload" ("full" with the saved activations in host memory; only
# where the device has host memory apart from its own).
_POLICIES = ("dots", "full", "offload")


def _policies(wanted, device) -> list:
  """``space['remat']`` as policies (``True`` is ``"full"``), in the order
  they are tried, ``False`` first when present."""
  wanted = list(wanted)
  out = []
  for w in wanted:
    w = "full" if w is True else w
    if w is not False and w not in _POLICIES:
      raise ValueError(f"space['remat'] = {wanted!r}: each entry is False, True (= 'full') or "
                       f"one of {list(_POLICIES)}.")
    if w not in out:
      out.append(w)
  if "offload" in out and not has_host_memory(device):
    out.remove("offload")
  return sorted(out, key=lambda w: -1 if w is False else _POLICIES.index(w))


def has_host_memory(device) -> bool:
  """Whether ``ActivationCheckpointing("offload")`` saves device memory
  there: a device with host memory of its own (a GPU); the local CPU's
  "host" memory is its memory."""
  return not device.name.lower().startswith("cpu")


def _divisors(n: int) -> list:
  return [d for d in range(1, n + 1) if n % d == 0]


def _meshes(devices: int, strategy: ShardingStrategy, tensors, tensor_axis: str,
            contexts=(1,)) -> list:
  """The mesh shapes worth estimating for a strategy, as chains: a
  data-parallel axis per tensor size; HYBRID strategies over every
  replicate x shard split with both at least 2 (a replicate axis under the
  other strategies shards like one axis of its size, so it adds nothing).
  Each chain is one such mesh with each context size of ``contexts``
  (ascending) in turn: ``{"shard": S, "context": C}``, the devices of a
  sequence taken from the shard axis (the search keeps the first of a
  chain that fits)."""
  chains: dict = {}
  for t in tensors:
    for c in contexts:
      if devices % (t * c):
        continue
      dp = devices // (t * c)
      extra = ({CONTEXT: c} if c > 1 else {}) | ({tensor_axis: t} if t > 1 else {})
      if strategy in _HYBRID:
        for r in _divisors(dp):
          if 1 < r < dp:
            chains.setdefault((t, r), []).append({REPLICATE: r, SHARD: dp // r, **extra})
      else:
        chains.setdefault((t, 0), []).append({SHARD: dp, **extra})
  return list(chains.values())


def sequence_length(batch, config: FSDPConfig) -> Optional[int]:
  """The length of the sequences a ``"context"`` axis would split (the
  leaves :class:`~fsdp_jax.ContextParallel` selects, along its ``dim``),
  or None when no leaf has that dimension (or their lengths differ)."""
  cp = config.context_parallel or ContextParallel()
  lengths = {x.shape[cp.dim] for x, split in zip(jax.tree.leaves(batch),
                                                 context_lib.split_mask(cp, batch))
             if split and len(x.shape) > cp.dim}
  return lengths.pop() if len(lengths) == 1 else None


def _contexts(space: dict, devices: int, seq: Optional[int]) -> list:
  """The context sizes tried, ascending: ``space['context']``, or the
  powers of two up to 8 dividing ``devices`` and the sequence length (1:
  none)."""
  if "context" not in space:
    out, c = [], 1
    while c <= 8 and devices % c == 0 and (c == 1 or (seq is not None and seq % c == 0)):
      out.append(c)
      c *= 2
    return out
  wanted = sorted(set(space["context"]))
  for c in wanted:
    if not isinstance(c, int) or isinstance(c, bool) or c < 1:
      raise ValueError(f"space['context'] = {space['context']!r}: each entry is a context "
                       "size, an int >= 1 (1: no context axis).")
    if c > 1 and (seq is None or seq % c):
      what = ("no batch leaf has a sequence dimension to split" if seq is None else
              f"the sequence length {seq} is not divisible by {c}")
      raise ValueError(
          f"space['context'] = {space['context']!r}: context={c} splits each sequence into "
          f"{c} chunks, but {what}. Fix: use context sizes dividing the sequence length"
          + (f" ({[d for d in _divisors(seq) if d <= devices and devices % d == 0]})"
             if seq is not None else "") + ", or pad the sequences.")
    if devices % c:
      raise ValueError(f"space['context'] = {space['context']!r}: context={c} does not divide "
                       f"devices={devices}. Fix: use sizes dividing {devices}.")
  return wanted


def context_sizes(space: dict, devices: int, batch, config: FSDPConfig) -> list:
  """The context sizes a search over ``space`` tries (see :func:`_contexts`)."""
  return _contexts(space, devices, sequence_length(batch, config))


def data_parallel_rows(mesh_shape: dict, tensor_axis: str) -> int:
  """The devices a batch's rows are split over: every axis but the tensor
  and context axes."""
  return math.prod(v for k, v in mesh_shape.items() if k not in (tensor_axis, CONTEXT))


@dataclasses.dataclass(frozen=True)
class _Candidate:
  config: FSDPConfig
  mesh_shape: dict
  steps: int = 1


def _check_space(space) -> dict:
  space = dict(space or {})
  unknown = sorted(set(space) - set(_SPACE_KEYS))
  if unknown:
    raise ValueError(f"search(space=...) has unknown keys {unknown}. Fix: use "
                     f"{list(_SPACE_KEYS)}.")
  return space


def _lora_choices(config: FSDPConfig, wanted) -> list:
  """LoRA and QLoRA (the config's quantization, else nf4 in blocks of 64)."""
  lora = config.lora
  if lora is None:
    return [None]
  quant = lora.base_quantization or Quantization(dtype="nf4", block_size=64)
  choices = {"lora": dataclasses.replace(lora, base_quantization=None),
             "qlora": dataclasses.replace(lora, base_quantization=quant)}
  wanted = ("lora", "qlora") if wanted is None else tuple(wanted)
  bad = [w for w in wanted if w not in choices]
  if bad:
    raise ValueError(f"space['lora'] = {wanted!r}: each entry is 'lora' or 'qlora'.")
  return [choices[w] for w in wanted]


def search(loss_fn: Callable, *, optimizer, batch, devices: int,
           init_fn: Optional[Callable] = None, params: Any = None, device="cpu",
           memory_limit: Optional[int] = None, space: Optional[dict] = None,
           rng: Any = None, compile_step: Optional[bool] = None) -> list:
  """The configurations predicted to fit, as :class:`~fsdp_jax.Estimate` s
  ordered by predicted step time, best first.

  Candidates (each estimated as :func:`fsdp_jax.estimate` does, sharing
  compiled programs between candidates):

  * every sharding strategy and both layouts (flat and
    ``use_orig_params=True``);
  * meshes: one data-parallel axis, and for HYBRID_SHARD /
    _HYBRID_SHARD_ZERO2 every ``replicate x shard`` split; with tensor
    parallelism (``config.tensor_parallel``) every tensor size dividing
    ``devices`` up to 8 that divides the ruled dimensions;
  * context sizes (a ``"context"`` axis of size ``C`` taken from the
    shard axis): 1 (none), then the powers of two up to 8 dividing
    ``devices`` and the sequence length; each configuration keeps the
    first that fits (with the savers below): the smallest, the least
    communication. Its estimate notes which it picked;
  * with a LoRA config, LoRA and QLoRA;
  * memory savers, tried only for a candidate that does not fit without
    them and in this order, the first that fits kept: gradient accumulation
    over 2, 4, ... microbatches of the same global batch
    (``accumulation="sharded"``), then activation checkpointing
    (``FSDPConfig(activation_checkpointing=ActivationCheckpointing(policy))``:
    ``"dots"``, ``"full"``, then ``"offload"`` where the device has host
    memory of its own, not on ``"cpu"``), then CPU offload of the
    parameters. None of them makes a step faster. The policy picked is the
    estimate's ``config.activation_checkpointing`` (``describe_config()``
    says ``remat`` for ``"full"``, ``remat(dots)``, ``remat(offload)``).
    A base config that sets ``activation_checkpointing`` keeps it.
  * a base config without a wrap policy (the whole model one unit,
    gathered at once) that fits nowhere is searched again with one unit
    per layer (``ModuleWrapPolicy(["<name>.*"])`` over the largest list of
    subtrees, else a size-based policy), noted on each estimate; if nothing
    fits either, a warning names the policy to pass.

  Args:
    loss_fn, optimizer, batch, init_fn, params, device, rng: as for
      :func:`fsdp_jax.estimate` (``batch`` is the global batch).
    devices: the number of devices.
    memory_limit: bytes per device to fit in (default: the device's memory).
    space: narrows or widens the candidates: ``config`` (the base
      :class:`~fsdp_jax.FSDPConfig`: wrap policy, mixed precision, tensor
      parallel rules, LoRA), ``sharding_strategy``, ``use_orig_params``,
      ``mesh_shapes`` (explicit meshes instead of the enumerated ones),
      ``tensor`` (tensor sizes), ``context`` (context sizes; ``[1]``:
      none), ``remat`` (the checkpointing policies
      allowed: ``False``, ``True`` (``"full"``), ``"dots"``, ``"offload"``),
      ``cpu_offload`` (iterable of bools), ``gradient_accumulation_steps``,
      ``accumulation``, ``lora`` (``("lora", "qlora")``).
    compile_step: ``None`` (default): every candidate's peak is modelled,
      then the fastest that fits is confirmed by compiling its step with
      the savers it uses (as ``estimate(compile_step=None)`` on that
      configuration does: when the loss's program is small enough); one the
      compiled step does not fit goes on to the next savers, and is dropped
      when none fits, the next fastest then confirmed; ``True``: every
      candidate's step is compiled (exact, a compile each); ``False``:
      modelled only.

  Returns:
    The estimates that fit, fastest first (empty if none does). Each says
    whether its peak was compiled (``Estimate.compiled``).

  Raises:
    ValueError: a mesh shape that does not multiply to ``devices``, a tensor
      size that does not divide a ruled dimension, a ``space['context']``
      size that does not divide the sequence length or ``devices``, an unknown device, a
      batch no data-parallel size divides; each names the fix.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> params = {"w1": jax.ShapeDtypeStruct((256, 512), jnp.float32),
    ...           "w2": jax.ShapeDtypeStruct((512, 256), jnp.float32)}
    >>> def loss_fn(p, b):
    ...   return jnp.mean((jnp.tanh(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)
    >>> batch = {"x": jax.ShapeDtypeStruct((64, 256), jnp.float32),
    ...          "y": jax.ShapeDtypeStruct((64, 256), jnp.float32)}
    >>> found = fsdp_jax.search(loss_fn, optimizer=optax.adam(1e-3), batch=batch,
    ...     params=params, devices=8, device="H100-80GB",
    ...     space={"sharding_strategy": [fsdp_jax.ShardingStrategy.FULL_SHARD,
    ...                                  fsdp_jax.ShardingStrategy.NO_SHARD]})
    >>> [e.config.sharding_strategy.name for e in found][:1] in (["FULL_SHARD"], ["NO_SHARD"])
    True
    >>> all(a.step_seconds <= b.step_seconds for a, b in zip(found, found[1:]))
    True
  """
  planner = Planner(loss_fn, optimizer=optimizer, batch=batch, init_fn=init_fn, params=params,
                    rng=rng)
  return run(planner, devices=devices, device=device, memory_limit=memory_limit, space=space,
             compile_step=compile_step)


def per_layer_policy(planner: Planner, config: FSDPConfig):
  """``(policy, text)``: a wrap policy with one unit per layer for the
  planner's model: ``ModuleWrapPolicy(["<name>.*"])`` over the sequence of
  subtrees (the leaves named ``<name>.<i>...``) holding the most
  parameters, else a size-based policy at 1/8 of the parameters."""
  plan, _ = planner.plan(config, {SHARD: 1})
  groups: dict = {}
  total = 0
  for leaf in plan.leaves:
    total += leaf.numel
    parts = leaf.name.split(".")
    for k in range(1, len(parts)):
      if parts[k].isdigit():
        name = ".".join(parts[:k])
        indices, numel = groups.get(name, (set(), 0))
        groups[name] = (indices | {parts[k]}, numel + leaf.numel)
        break
  layered = {n: numel for n, (indices, numel) in groups.items() if len(indices) >= 2}
  if layered:
    name = max(layered, key=layered.get)
    return ModuleWrapPolicy([f"{name}.*"]), f'fsdp_jax.ModuleWrapPolicy(["{name}.*"])'
  threshold = max(1, total // 8)
  return (functools.partial(size_based_auto_wrap_policy, min_num_params=threshold),
          f"functools.partial(fsdp_jax.size_based_auto_wrap_policy, "
          f"min_num_params={threshold})")


def run(planner: Planner, *, devices: int, device="cpu", memory_limit: Optional[int] = None,
        space: Optional[dict] = None, compile_step: Optional[bool] = None,
        misses: Optional[list] = None) -> list:
  """:func:`_run`; a config without a wrap policy (one unit: the whole
  model gathered at once) whose search finds nothing is searched again with
  one unit per layer (:func:`per_layer_policy`, noted on each estimate);
  when that finds nothing either, a warning says so and names the policy
  to pass."""
  space = _check_space(space)
  base = space.get("config", FSDPConfig())
  found = _run(planner, devices=devices, device=device, memory_limit=memory_limit,
               space=space, compile_step=compile_step, misses=misses)
  if found or not isinstance(base, FSDPConfig) or base.auto_wrap_policy is not None:
    return found
  policy, text = per_layer_policy(planner, base)
  fix = (f"pass space={{'config': FSDPConfig(auto_wrap_policy={text}, ...)}} (a "
         "fsdp_jax.models bundle: its wrap_policy, or model.fsdp_config())")
  layered = _run(planner, devices=devices, device=device, memory_limit=memory_limit,
                 space={**space, "config": dataclasses.replace(base, auto_wrap_policy=policy)},
                 compile_step=compile_step, misses=misses)
  if not layered:
    warnings.warn("search: nothing fits. The config has no wrap policy, so the whole model is "
                  "one unit, gathered at once on every device; with one unit per layer "
                  f"({text}) nothing fits either. Fix: {fix}, with more devices, "
                  "LoRA/QLoRA, or fewer tokens per device.", stacklevel=2)
    return layered
  note = (f"search: the config has no wrap policy (one unit: the whole model gathered at "
          f"once) and nothing fit so; this is one unit per layer. Fix: {fix}")
  return [dataclasses.replace(e, notes=e.notes + (note,)) for e in layered]


def _run(planner: Planner, *, devices: int, device="cpu", memory_limit: Optional[int] = None,
         space: Optional[dict] = None, compile_step: Optional[bool] = None,
         misses: Optional[list] = None) -> list:
  """:func:`search` with a planner of one's own (several searches of one
  model share its traces and compiled programs: :meth:`Planner.with_batch`).
  ``misses``: a list that gets, for each candidate that does not fit (or
  that its confirmation dropped), its attempt with the smallest peak,
  smallest first (what ``python -m fsdp_jax.plan`` shows when nothing
  fits)."""
  space = _check_space(space)
  device = device_spec(device)
  if not isinstance(devices, int) or devices < 1:
    raise ValueError(f"devices={devices!r} must be a positive int.")
  base = space.get("config", FSDPConfig())
  if not isinstance(base, FSDPConfig):
    raise TypeError(f"space['config'] must be a fsdp_jax.FSDPConfig, got "
                    f"{type(base).__name__}.")
  tensor_axis = base.tensor_parallel.axis if base.tensor_parallel is not None else TENSOR
  strategies = list(space.get("sharding_strategy", list(ShardingStrategy)))
  layouts = list(space.get("use_orig_params", (False, True)))
  loras = _lora_choices(base, space.get("lora"))
  explicit_tensor = "tensor" in space
  if base.tensor_parallel is None:
    tensors = [1]
    if explicit_tensor and any(t != 1 for t in space["tensor"]):
      raise ValueError("space['tensor'] asks for tensor parallelism but space['config'] "
                       "has no tensor_parallel rules. Fix: pass config=FSDPConfig("
                       "tensor_parallel=fsdp_jax.TensorParallel(rules=[...])).")
  else:
    tensors = list(space.get("tensor", [t for t in _divisors(devices) if 1 < t <= 8]))
  remats = _policies(space.get("remat", (False,) + _POLICIES), device)
  if base.activation_checkpointing is not None:
    remats = [False]  # the base config's own checkpointing, kept
  offloads = list(space.get("cpu_offload", (False, True)))
  accumulation = space.get("accumulation", "sharded")
  rows = planner.batch_rows
  limit = int(memory_limit) if memory_limit is not None else None

  meshes_given = space.get("mesh_shapes")
  contexts = context_sizes(space, devices, planner.batch, base)
  chains = []
  for strategy, orig, lora in itertools.product(strategies, layouts, loras):
    # The base's reshard_after_forward=True/False is its own strategy's
    # (resolved); each strategy gets its own. A partial reshard (an int) is
    # kept for the strategies that free after the forward.
    reshard = base.reshard_after_forward
    if isinstance(reshard, bool) or strategy not in RESHARD_AFTER_FORWARD:
      reshard = None
    config = dataclasses.replace(base, sharding_strategy=strategy, use_orig_params=orig,
                                 lora=lora, cpu_offload=None, reshard_after_forward=reshard)
    if meshes_given is not None:
      meshes = [check_mesh_shape(m, config, devices) for m in meshes_given]
      if strategy in _HYBRID:
        # A HYBRID strategy shards within groups and replicates across them:
        # only the given meshes with a replicate axis.
        meshes = [m for m in meshes if m.get(REPLICATE, 1) > 1]
      chains += [[_Candidate(config, mesh)] for mesh in meshes]
    else:
      chains += [[_Candidate(config, mesh) for mesh in chain]
                 for chain in _meshes(devices, strategy, tensors, tensor_axis, contexts)]

  found, errors, tried = [], [], 0
  later: dict = {}  # id(estimate) -> (its chain's larger context sizes, the sizes before)
  saver_space = (remats, offloads, space.get("gradient_accumulation_steps"), accumulation)
  for chain in chains:
    # A chain's context sizes in turn, the smallest first (the least
    # communication: keys and values gathered over fewer devices); the
    # first that fits, with the savers it needs, is kept.
    closest, passed = None, []
    for cand in chain:
      dp = data_parallel_rows(cand.mesh_shape, tensor_axis)
      if rows % dp:
        errors.append(ValueError(
            f"the global batch of {rows} rows is not divisible by the data-parallel size "
            f"{dp} of mesh {cand.mesh_shape}. Fix: use a global batch that is a multiple of "
            f"{dp}, e.g. {-(-rows // dp) * dp}."))
        if meshes_given is not None:
          raise errors[-1]
        continue
      try:
        est, miss = _first_fit(planner, cand, device, limit, rows // dp, saver_space,
                               bool(compile_step))
      except (ValueError, NotImplementedError) as e:
        # An enumerated context size the step refuses (with tensor
        # parallelism, say), or an enumerated tensor size the model
        # cannot take, is skipped; what was asked for is an error.
        enumerated_cp = CONTEXT in cand.mesh_shape and "context" not in space
        divides = isinstance(e, ValueError) and "divide" in str(e)
        if (meshes_given is not None or not (divides or enumerated_cp)
            or (isinstance(e, ValueError) and not divides)
            or (explicit_tensor and not enumerated_cp)):
          raise
        errors.append(e)
        continue
      tried += 1
      if est is not None:
        found.append(_context_note(est, passed))
        later[id(found[-1])] = (chain[chain.index(cand) + 1:], passed)
        break
      passed.append(cand.mesh_shape.get(CONTEXT, 1))
      if closest is None or (miss.bytes_per_device["total"]
                             < closest.bytes_per_device["total"]):
        closest = miss
    else:
      if closest is not None and misses is not None:
        misses.append(closest)
  if not tried and errors:
    raise errors[0]
  found.sort(key=_speed)
  if compile_step is None:
    # Confirm the fastest: the same configuration (savers included) with its
    # step compiled, as estimate() compiles it (when the program is small
    # enough). One the compiled step does not fit goes on to the savers after
    # the one it used, compiled; one that none fits is dropped and the next
    # fastest is confirmed. Stops at the first that fits compiled.
    for _ in range(len(found)):
      if not found or found[0].compiled:
        break
      best = found.pop(0)
      dp = data_parallel_rows(best.mesh_shape, tensor_axis)
      # The candidate as enumerated: its savers are the start setting.
      config = dataclasses.replace(best.config, cpu_offload=None,
                                   activation_checkpointing=base.activation_checkpointing)
      est, closest = _first_fit(planner, _Candidate(config, best.mesh_shape),
                                device, limit, rows // dp, saver_space, None,
                                start=_setting(best, base))
      if est is not None:
        est = dataclasses.replace(est, notes=est.notes + tuple(
            n for n in best.notes if n.startswith(_CONTEXT_NOTE)))
      else:
        # Dropped: the larger context sizes of its chain, confirmed in turn.
        more, passed = later.get(id(best), ([], []))
        passed = passed + [best.mesh_shape.get(CONTEXT, 1)]
        for cand in more:
          dp = data_parallel_rows(cand.mesh_shape, tensor_axis)
          if rows % dp:
            continue
          try:
            est, miss = _first_fit(planner, cand, device, limit, rows // dp, saver_space, None)
          except (ValueError, NotImplementedError):
            continue  # as in the modelled pass, which tried it
          if est is not None:
            est = _context_note(est, passed)
            break
          passed.append(cand.mesh_shape.get(CONTEXT, 1))
          if miss.bytes_per_device["total"] < closest.bytes_per_device["total"]:
            closest = miss
      if est is not None:
        found.append(est)
        found.sort(key=_speed)
        if not est.compiled:
          break  # too large to compile by default: modelled
      elif misses is not None:
        misses.append(closest)
  if misses is not None:
    misses.sort(key=lambda e: e.bytes_per_device["total"])
  return found


_CONTEXT_NOTE = "search: context parallelism"


def _context_note(est: Estimate, smaller: list) -> Estimate:
  """The estimate with a note saying which context size the search kept
  (and the smaller ones that did not fit)."""
  c = est.mesh_shape.get(CONTEXT, 1)
  if c == 1 and not smaller:
    return est
  note = (f"{_CONTEXT_NOTE}: context={c}, each sequence split into {c} chunks over the "
          "'context' axis (keys and values all-gathered over it per layer)" if c > 1 else
          f"{_CONTEXT_NOTE}: none (no context axis)")
  if smaller:
    note += (f"; the smallest context size that fits: "
             f"{', '.join(f'context={s}' for s in smaller)} did not fit with any saver")
  return dataclasses.replace(est, notes=est.notes + (note,))


def _speed(e: Estimate):
  return (e.step_seconds, e.bytes_per_device["total"])


def _setting(est: Estimate, base: FSDPConfig) -> tuple:
  """An estimate's memory savers: (checkpointing policy or False, CPU
  offload, microbatches); the base config's own checkpointing is False."""
  offload = est.config.cpu_offload is not None and bool(est.config.cpu_offload.offload_params)
  ac = est.config.activation_checkpointing
  policy = False if ac is None or base.activation_checkpointing is not None else ac.policy
  return (policy, offload, est.gradient_accumulation_steps)


def _modelled_fixed(est: Estimate) -> int:
  """What no activation saver changes at the modelled peak: the stored
  state, gathered units, gradients (the modelled parts: a compiled total
  less modelled activations would mix two programs' figures). The running
  backward program's own peak is not counted: checkpointing shrinks it."""
  return (sum(est.parts.values()) - est.bytes_per_device["activations"]
          - est.parts.get("backward", 0))


def _first_fit(planner: Planner, cand: _Candidate, device, limit, local_rows: int,
               saver_space: tuple, compile_step, start: Optional[tuple] = None) -> tuple:
  """``(estimate, None)``: the candidate without memory savers if it fits,
  else the first saver setting that does (see :func:`search`);
  ``(None, closest)`` when none fits, ``closest`` the attempt with the
  smallest peak. ``compile_step`` as for :meth:`Planner.estimate`
  (``True`` compiles a remat setting where the loss can be rewritten with
  its checkpoints, and models it elsewhere). ``start``: a setting
  ``(remat, offload, microbatches)`` to begin at (the savers before it are
  skipped: a search's confirmation of what the modelled pass found)."""
  remats, offloads, steps_space, accumulation = saver_space
  # The savers that can help are chosen from the modelled estimate (cheap:
  # its programs are shared; a compiled one is the whole step's).
  base = planner.estimate(cand.config, cand.mesh_shape, device, memory_limit=limit,
                          compile_step=compile_step if start is None else False)
  b = base.bytes_per_device
  fixed = _modelled_fixed(base)
  steps = [s for s in (steps_space or [2 ** k for k in range(1, 12)])
           if s > 1 and local_rows % s == 0]
  settings = [(False, False, 1)]
  policies = [r for r in remats if r is not False]
  if fixed < base.memory_limit:
    settings += [(False, False, s) for s in steps]
    settings += [(r, False, s) for r in policies for s in [1] + steps]
  # CPU offload moves the stored parameters and optimizer state to the host.
  if True in offloads and fixed - b["params"] - b["optimizer"] < base.memory_limit:
    settings += [(r, True, s) for r in remats for s in [1] + steps]
  if start is not None:
    settings = settings[settings.index(start):] if start in settings else [start]
  closest = None
  for remat, offload, s in settings:
    if (remat, offload, s) == (False, False, 1) and start is None:
      est = base
    else:
      config = cand.config
      if offload:
        config = dataclasses.replace(config, cpu_offload=CPUOffload(offload_params=True))
      if remat and config.activation_checkpointing is None:
        config = dataclasses.replace(config,
                                     activation_checkpointing=ActivationCheckpointing(remat))
      est = planner.estimate(config, cand.mesh_shape, device, memory_limit=limit,
                             gradient_accumulation_steps=s,
                             accumulation=accumulation if s > 1 else "no_sync",
                             compile_step=None if (remat and compile_step) else compile_step)
    if est.fits:
      return est, None
    if closest is None or est.bytes_per_device["total"] < closest.bytes_per_device["total"]:
      closest = est
  return None, closest
