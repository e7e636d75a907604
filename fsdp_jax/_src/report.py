"""What ``print(state.plan)`` shows, and the counts behind it: collectives
per step, gathered bytes kept from forward to backward.

Functions of a :class:`~fsdp_jax.Plan` (``Plan.__str__``,
``Plan.collectives_per_step`` and ``Plan.bytes_kept_for_backward`` call
them); the plan is read through its own methods, so this module imports
nothing of the plan's.
"""

from __future__ import annotations

import numpy as np

from fsdp_jax._src import collectives
from fsdp_jax._src.config import ShardingStrategy, gradient_divide_factors


def collectives_per_step(plan) -> dict[str, int]:
  """Collectives the strategy implies per step (upper bound for FULL_SHARD:
  a unit whose parameters the backward does not need is not re-gathered).

  A unit (per dtype) is gathered and reduced with one collective each;
  with ``use_orig_params=True`` with one per leaf (see
  :func:`fsdp_jax._src.collectives.gathers_per_leaf`), and all-reduced
  once per unit over the replicate axes. A stacked unit's scan gathers
  its first layer before each of its loops and the others inside it: two
  gather instructions per pass (hpZ's stacked units: one; a scan unrolled
  ``u`` times repeats the loop's instruction ``u`` times)."""
  strategy = plan.config.sharding_strategy
  out = {"all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}
  for u in plan.units:
    for _, spec, gathers, reduces in plan.group_collectives(u):
      if strategy is ShardingStrategy.NO_SHARD:
        out["all-reduce"] += 1 if reduces else 0
        continue
      per_pass = 2 if u.stacked and not spec.secondary else 1
      out["all-gather"] += per_pass * (
          gathers + (1 if spec.secondary else gathers) * plan.reshard(u))
      out["reduce-scatter"] += reduces
      if plan.config.is_hybrid and reduces:
        out["all-reduce"] += 1
  return out


def bytes_kept_for_backward(plan) -> int:
  """Bytes of gathered parameters each device holds from the forward pass
  to the backward pass (outside a scan over stacked layers, which keeps
  one layer's worth per iteration).

  Units that are not resharded (the root, every unit under
  ``SHARD_GRAD_OP``) count whole, in the bytes their all-gather moves
  (quantized when ``all_gather_quantization`` is set); with
  ``reshard_after_forward=k`` a resharded unit counts ``1/k`` of that (its
  secondary shard); with ``reshard_after_forward=True`` it counts 0.
  ``NO_SHARD`` gathers nothing: 0.
  """
  if not plan.axes.shard_axes:
    return 0
  total = 0
  for unit in plan.units:
    layers = unit.num_layers if unit.stacked else 1
    for _, spec in plan.gather_specs(unit):
      dtype, length = collectives.payload_row(spec)
      full = spec.n * length * np.dtype(dtype).itemsize * layers
      if not spec.reshard:
        total += full
      elif spec.secondary:
        total += full // spec.secondary
  return total


def _zeropp_lines(plan) -> list[str]:
  cfg = plan.config
  lines = []
  k = cfg.reshard_after_forward
  if not isinstance(k, bool):
    lines.append(
        f"  reshard after forward onto groups of {k}: each device keeps 1/{k} of every "
        f"resharded unit for the backward all-gather, which runs within its group of {k}; "
        f"gathered bytes kept forward->backward: {bytes_kept_for_backward(plan):,}/device")
  if cfg.all_gather_quantization is not None:
    lines.append(f"  all-gather quantization: {cfg.all_gather_quantization.describe()} "
                 "(floating-point units; master shards exact)")
  if cfg.reduce_scatter_quantization is not None:
    hier = " (within 'shard', then across 'replicate')" if (
        len(plan.axes.shard_axes) > 1 or plan.axes.replicate_axes) else ""
    q = cfg.reduce_scatter_quantization
    implied = ", stochastic rounding" if q.rounding is None and q.stochastic(gradient=True) else ""
    lines.append(f"  gradient reduction: quantized all-to-all, "
                 f"{q.describe()}{implied}, summed in float32{hier}")
  for name in ("forward_prefetch_units", "backward_prefetch_units"):
    for unit, targets in getattr(cfg, name):
      lines.append(f"  {name}: {unit} -> {', '.join(targets)}")
  return lines


def bytes_per_step(plan) -> dict:
  """``{axis: {collective: bytes per device per step}}`` of the FSDP
  collectives (the buffers each device gathers or reduces: a unit's
  gathered size, re-gathered ones twice; the gradient in the reduce dtype).
  A tensor-parallel unit's buffers are one tensor slice's."""
  out: dict = {}
  if not plan.axes.shard_axes and not plan.axes.replicate_axes:
    return out
  shard = "+".join(plan.axes.shard_axes) or None
  rep = "+".join(plan.axes.replicate_axes) or None
  for u in plan.units:
    layers = u.num_layers if u.stacked else 1
    for group, spec, _, reduces in plan.group_collectives(u):
      dtype, length = collectives.payload_row(spec)
      size = spec.n * length * layers
      if shard is not None:
        d = out.setdefault(shard, {})
        d["all-gather"] = d.get("all-gather", 0) + size * np.dtype(dtype).itemsize * (
            1 + bool(plan.reshard(u)))
        if reduces:
          d["reduce-scatter"] = d.get("reduce-scatter", 0) + size * np.dtype(
              spec.reduce_dtype).itemsize
      if rep is not None and reduces:
        d = out.setdefault(rep, {})
        per = length * layers if shard is not None else size
        d["all-reduce"] = d.get("all-reduce", 0) + per * np.dtype(spec.reduce_dtype).itemsize
  return out


def _tensor_lines(plan) -> list:
  tp = plan.config.tensor_parallel
  if tp is None:
    return []
  split = [l for l in plan.leaves if l.tensor_dim is not None]
  numel = sum(l.numel for l in split)
  total = sum(l.numel for l in plan.leaves)
  out = [f"  tensor parallel over {tp.axis!r} (T={plan.t}): {len(split)} leaves split "
         f"({100 * numel / max(total, 1):.1f}% of elements), each stored as its 1/{plan.t} "
         f"slice sharded over {plan.axes.shard_axes or '()'}; the others replicated over "
         f"{tp.axis!r}"]
  rep = plan.tensor_report
  if rep is None or not rep.traced:
    out.append(f"    collectives over {tp.axis!r}: known once the step is traced")
    return out
  if not rep.counts:
    out.append(f"    collectives over {tp.axis!r} per step: none")
  for kind, (count, nbytes) in sorted(rep.counts.items()):
    out.append(f"    {tp.axis!r} per step: {count} {kind} ({nbytes:,} bytes/device)")
  for why, count in sorted(rep.gathered.items()):
    out.append(f"    gathered over {tp.axis!r} (runs unsplit): {why} x{count}")
  return out


def _lora_lines(plan) -> list:
  lora = plan.config.lora
  if lora is None:
    return []
  trainable = sum(l.numel for l in plan.leaves if not l.frozen)
  total = sum(l.numel for l in plan.leaves)
  out = [f"  {lora.describe()}: {len(plan.lora_targets)} targets; trainable "
         f"{trainable:,} of {total:,} stored elements ({100 * trainable / max(total, 1):.2f}%)"]
  rep = plan.lora_report
  if rep is None or not (rep.adapter_path or rep.merged):
    out.append("    each target is computed as x @ W + scale * (x @ A) @ B where the loss "
               "uses it in a matmul (known once the step is traced)")
    return out
  out.append(f"    adapter path x @ W + scale * (x @ A) @ B: {len(rep.adapter_path)} of "
             f"{len(plan.lora_targets)} targets")
  for name, why in sorted(rep.merged.items()):
    out.append(f"    merged weight W + scale * A @ B (its gradient formed whole): {name}, "
               f"used by {why}")
  return out


def _split_text(lead: tuple, leaf, plan) -> str:
  """``(None, 'tensor')``: the leaf's sharding over the tensor axis."""
  axis = plan.axes.tensor_axes[0]
  dims = ["None"] * len(leaf.layer_shape)
  dims[leaf.tensor_dim] = repr(axis)
  return "(" + ", ".join(["None"] * len(lead) + dims) + ")"


def summary(plan) -> str:
  """``repr(plan)``: one line (strategy, layout, units, parameters, mesh).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> state.plan
    Plan(FULL_SHARD, flat parameters, 1 unit, 1 parameter (8 elements), mesh {'shard': 2}; print(plan) shows it whole)
  """
  cfg = plan.config
  units, leaves = len(plan.units), len(plan.leaves)
  numel = sum(l.numel for l in plan.leaves)
  extra = "".join(f", {what}" for what, on in (
      ("LoRA", cfg.lora is not None), ("tensor parallel", cfg.tensor_parallel is not None))
      if on)
  return (f"Plan({cfg.sharding_strategy.name}, "
          f"{'original parameters' if plan.use_orig_params else 'flat parameters'}{extra}, "
          f"{units} unit{'s' * (units != 1)}, {leaves} parameter{'s' * (leaves != 1)} "
          f"({numel:,} elements), mesh {dict(plan.mesh.shape)}; print(plan) shows it whole)")


def describe(plan) -> str:
  cfg = plan.config
  mp = cfg.mixed_precision
  lines = [
      f"FSDP plan: {cfg.sharding_strategy.name}, "
      f"{'original parameters' if plan.use_orig_params else 'flat parameters'}, "
      f"mesh {dict(plan.mesh.shape)}, shard over {plan.axes.shard_axes or '()'} "
      f"(N={plan.n}), data-parallel world {plan.axes.world_size}",
  ]
  if mp is not None:
    lines.append(f"  mixed precision: param {mp.param_dtype}, reduce "
                 f"{mp.effective_reduce_dtype}, buffers {mp.buffer_dtype}")
  if cfg.activation_checkpointing is not None:
    lines.append(f"  activation checkpointing: {cfg.activation_checkpointing.describe()}, "
                 "each unit's computation recomputed in backward")
  ignored = [l.name for l in plan.ignored_leaves]
  if ignored:
    lines.append(f"  ignored (a full copy per device, never gathered, gradients not "
                 f"reduced): {', '.join(ignored)}")
  lines.extend(_lora_lines(plan))
  lines.extend(_tensor_lines(plan))
  frozen = sum(l.frozen for l in plan.leaves)
  if frozen:
    lines.append(f"  frozen parameters: {frozen} of {len(plan.leaves)} (no gradient, no optimizer state)")
  header = f"  {'unit':<32} {'leaves':>6} {'numel':>12} {'padding':>8} {'bytes/device':>13}"
  lines.append(header)
  total_numel = total_bytes = 0
  for u in plan.units:
    numel = plan.unit_numel(u)
    padded = plan.padded_numel(u)
    itemsize = max(np.dtype(plan.leaves[i].dtype).itemsize for i in u.leaf_ids)
    per_dev = padded // (plan.n * plan.tensor_size(u)) * itemsize
    total_numel += numel
    total_bytes += per_dev
    tag = " [stacked x%d]" % u.num_layers if u.stacked else ""
    if u.tensor:
      tag += f" [{plan.axes.tensor_axes[0]} x{plan.t}]"
    if "mixed_precision" in u.override_dict:
      mpu = u.override_dict["mixed_precision"]
      tag += " [fp32]" if mpu is None else f" [{mpu.param_dtype}]"
    lines.append(f"  {u.display_name + tag:<32} {len(u.leaf_ids):>6} {numel:>12,} "
                 f"{padded - numel:>8,} {per_dev:>13,}")
    for i in u.leaf_ids:
      leaf = plan.leaves[i]
      split = ""
      if leaf.tensor_dim is not None:
        lead = (None,) if u.stacked else ()
        split = " split " + _split_text(lead, leaf, plan)
      lines.append(f"      {leaf.name:<40} {str(leaf.shape):<18} {np.dtype(leaf.dtype).name}"
                   + (" frozen" if leaf.frozen else "") + split)
  lines.append(f"  {'total':<32} {len(plan.leaves):>6} {total_numel:>12,} "
               f"{'':>8} {total_bytes:>13,}")
  for name, layers in plan.stacked_hints:
    lines.append(f"  looks stacked, gathered whole: {name} (every leaf has a leading axis "
                 f"of {layers}); if a scan runs over it: "
                 f"FSDPConfig(stacked_layers=({name!r},))")
  coll = collectives_per_step(plan)
  lines.append("  collectives per step: " + ", ".join(f"{v} {k}" for k, v in coll.items() if v))
  for axis, kinds in bytes_per_step(plan).items():
    lines.append(f"    over {axis!r}: " + ", ".join(f"{k} {v:,} bytes/device"
                                              for k, v in kinds.items()))
  lines.extend(_zeropp_lines(plan))
  if plan.opt_layout is not None:
    lines.append(f"  optimizer state: {plan.opt_layout.describe(plan)}")
    if plan.opt_update is not None:
      lines.append(f"  optimizer update: {plan.opt_update.describe()}")
  pre, post = gradient_divide_factors(plan.axes.world_size)
  lines.append(f"  gradient divide factors: pre {pre:g}, post {post:g}")
  return "\n".join(lines)
