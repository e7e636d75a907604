"""The planner: what fits and how fast, for any mesh, without its devices.

:func:`estimate` predicts one configuration's memory per device and step
time; :func:`search` returns the configurations predicted to fit, fastest
first; :class:`DeviceSpec` describes a device (presets ``"H100-80GB"``,
``"H200"``, ``"A100-80GB"``, ``"B200"``, ``"cpu"``). The same names are at
the top level (``fsdp_jax.estimate``...). See docs/planner.md.

From the command line, for a Hugging Face ``config.json`` (its model built
by :func:`fsdp_jax.models.from_pretrained`; nothing is allocated)::

    python -m fsdp_jax.plan --hf-config path/config.json --devices 64 \\
        --device H100-80GB --seq 4096 --global-batch 256 [--lora]
    python -m fsdp_jax.plan --hf-config path/config.json --devices 8 \\
        --seq 131072 --global-batch 8      # long sequences: context sizes tried

Example:
  >>> import fsdp_jax.plan
  >>> sorted(fsdp_jax.plan.DeviceSpec.preset(n).name for n in ("B200", "H200"))
  ['B200', 'H200']
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from fsdp_jax._src import deprecations as _deprecations
from fsdp_jax._src.config import FSDPConfig, MixedPrecision, ShardingStrategy
from fsdp_jax._src.lora import LoRA
from fsdp_jax._src.models import families as models
from fsdp_jax._src.tensor import TensorParallel
from fsdp_jax._src.planner import programs
from fsdp_jax._src.planner.devices import device_spec
from fsdp_jax._src.planner.estimator import Planner
from fsdp_jax._src.planner.search import run as _run_search
from fsdp_jax._src.planner.search import context_sizes as _context_sizes
from fsdp_jax._src.planner import (
    PRESETS as PRESETS,
    DeviceSpec as DeviceSpec,
    Estimate as Estimate,
    estimate as estimate,
    search as search,
)

__all__ = ["DeviceSpec", "Estimate", "PRESETS", "estimate", "main", "search"]

# ``fsdp_jax.plan`` was once an alias of the private plan module: its names
# still resolve, with a DeprecationWarning naming their place now.
_PUBLIC_SPELLING = {"Plan": "fsdp_jax.Plan", "param_specs": "fsdp_jax.custom.param_specs",
                    "batch_spec": "fsdp_jax.custom.batch_spec",
                    "split_trainable": "fsdp_jax.custom.split_trainable",
                    "merge_trainable": "fsdp_jax.custom.merge_trainable"}
_OLD = {name: (module, f"use {_PUBLIC_SPELLING[name]}." if name in _PUBLIC_SPELLING else
               f"use {module}.{name} (internal: it may change without notice).")
        for module, names in (
            ("fsdp_jax._src.plan", ("Plan", "LeafSpec", "UnitSpec", "Ordering", "LoopPrefetch",
                                    "param_specs", "batch_spec", "split_trainable",
                                    "merge_trainable", "hook_key", "hook_state_spec")),
            ("fsdp_jax._src.report", ("collectives_per_step", "bytes_kept_for_backward",
                                      "bytes_per_step", "describe")))
        for name in names}
__getattr__ = _deprecations.module_getattr(__name__, _OLD)


# --------------------------------------------------------------------------
# python -m fsdp_jax.plan


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m fsdp_jax.plan",
      description="Which FSDP configurations fit, fastest first, for a Hugging Face "
                  "config.json (nothing is allocated; the model is built by "
                  "fsdp_jax.models.from_pretrained).")
  p.add_argument("--hf-config", required=True,
                 help="a config.json, or the checkpoint directory holding one")
  p.add_argument("--devices", type=int, required=True, help="number of devices")
  p.add_argument("--device", default="H100-80GB",
                 help=f"a device preset: {', '.join(sorted(PRESETS))}")
  p.add_argument("--seq", type=int, required=True, help="sequence length (tokens)")
  p.add_argument("--global-batch", type=int, required=True, help="sequences per step")
  p.add_argument("--lora", action="store_true",
                 help="LoRA fine-tuning of the family's targets: LoRA and QLoRA (nf4)")
  p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
  p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                 help="compute dtype: bf16 (MixedPrecision(param_dtype=bf16, "
                      "reduce_dtype=fp32) over fp32 master weights) or fp32")
  p.add_argument("--context", type=int, action="append", default=None,
                 help="a context size to try (repeatable; 1: no context axis). Default: 1, "
                      "2, 4, 8 where they divide --devices and --seq, the smallest that fits "
                      "kept (each sequence split over that many devices)")
  p.add_argument("--tensor-parallel", action="store_true",
                 help="also try the family's tensor-parallel rules (tensor sizes up to 8)")
  p.add_argument("--strategy", action="append", default=None,
                 choices=[s.name for s in ShardingStrategy],
                 help="a sharding strategy to try (repeatable; default: all five)")
  p.add_argument("--layout", choices=("flat", "orig", "both"), default="both",
                 help="flat parameters, use_orig_params=True, or both (default)")
  p.add_argument("--memory-limit-gib", type=float, default=None,
                 help="GiB per device to fit in (default: the device's memory)")
  p.add_argument("--top", type=int, default=10, help="rows to print (default 10)")
  p.add_argument("--json", default=None, help="also write every estimate to this file")
  return p


def _search_contexts(space: dict, devices: int, seq: int, config) -> list:
  """The context sizes the search tries (its errors as the command's)."""
  batch = {"input_ids": jax.ShapeDtypeStruct((1, seq), jnp.int32)}
  try:
    return _context_sizes(space, devices, batch, config)
  except ValueError as e:
    raise _UserError(f"--context: {e}") from e


def _configs(bundle, args):
  """The base FSDPConfig the search varies."""
  kw = {"auto_wrap_policy": getattr(bundle, "wrap_policy", None)}
  if getattr(bundle, "scan", False) or getattr(bundle, "stacked_layers", None):
    kw["stacked_layers"] = tuple(bundle.stacked_layers)
  if args.precision == "bf16":
    kw["mixed_precision"] = MixedPrecision(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
  if args.tensor_parallel and getattr(bundle, "tensor_parallel", None):
    rules = bundle.tensor_parallel
    kw["tensor_parallel"] = rules if isinstance(rules, TensorParallel) else TensorParallel(
        rules=tuple(rules))
  if args.lora:
    kw["lora"] = LoRA(targets=tuple(bundle.lora_targets), rank=args.rank,
                      alpha=2.0 * args.rank)
  return FSDPConfig(**kw)


def table(estimates: list, top: Optional[int] = None) -> str:
  """A markdown table of estimates: rank, configuration, memory per device
  (and whether the step was compiled for it or its peak modelled), step
  time, tokens per second per device.

  Example:
    >>> from fsdp_jax.plan import table
    >>> print(table([]))
    | # | configuration | memory/device GiB | peak | fits | step s | tokens/s/device |
    |---|---|---|---|---|---|---|
  """
  rows = ["| # | configuration | memory/device GiB | peak | fits | step s | tokens/s/device |",
          "|---|---|---|---|---|---|---|"]
  for k, e in enumerate(estimates[:top] if top else estimates, 1):
    rows.append(f"| {k} | {e.describe_config()} | {e.bytes_per_device['total'] / 2**30:.2f} | "
                f"{'compiled' if e.compiled else 'modelled'} | "
                f"{'yes' if e.fits else 'no'} | {e.step_seconds:.3f} | "
                f"{e.tokens_per_second_per_device:,.0f} |")
  return "\n".join(rows)


class _UserError(Exception):
  """A mistake in the command line's input: its message is printed alone."""


def _model(path: str):
  """The model bundle of a config.json (``fsdp_jax.models.from_pretrained``)."""
  directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
  if not os.path.exists(os.path.join(directory, "config.json")):
    raise _UserError(f"--hf-config {path!r}: no config.json there.")
  try:
    return models.from_pretrained(directory)
  except (ValueError, TypeError, NotImplementedError, FileNotFoundError) as e:
    raise _UserError(f"--hf-config {path!r}: {e}") from e


def _needs(e: Estimate, limit: int, args) -> str:
  """What could close the gap of an estimate that does not fit: each saver
  it does not use whose bytes are at least the gap (remat: the
  activations; CPU offload: the parameters and optimizer state), LoRA, more
  devices (its sharded state spread further), fewer tokens."""
  b = e.bytes_per_device
  miss = b["total"] - limit
  out = []
  if not e.remat and b["activations"] >= miss:
    out.append("remat")
  offloaded = e.config.cpu_offload is not None and e.config.cpu_offload.offload_params
  if not offloaded and b["params"] + b["optimizer"] >= miss:
    out.append("CPU offload")
  if e.config.lora is None:
    out.append("LoRA/QLoRA (--lora)")
  elif e.config.lora.base_quantization is None:
    out.append("QLoRA")
  # The stored state shards over the data-parallel axes: more devices shrink
  # it (what is on the device: offloaded parameters and optimizer state are not).
  sharded = b["grads"] + (0 if offloaded else b["params"] + b["optimizer"])
  if e.config.sharding_strategy != ShardingStrategy.NO_SHARD and sharded > miss > 0:
    more = math.ceil(e.devices * sharded / (sharded - miss))
    out.append(f"more devices (about {more}, all else equal)")
  c = e.mesh_shape.get("context", 1)
  if (b["activations"] >= miss and args.seq % (2 * c) == 0
      and e.devices % (2 * c * e.mesh_shape.get("tensor", 1)) == 0):
    out.append(f"context parallelism (--context {2 * c}: each sequence split over "
               f"{2 * c} devices)")
  rows = math.prod(v for k, v in e.mesh_shape.items() if k in ("replicate", "shard"))
  out.append(f"fewer tokens per device (now {args.global_batch // max(1, rows)} x "
             f"{args.seq // c})")
  return ", ".join(out)


def _policy_name(e: Estimate):
  """The activation checkpointing policy an estimate uses (None: none)."""
  ac = e.config.activation_checkpointing
  if ac is None:
    return None
  return ac.policy if isinstance(ac.policy, str) else getattr(ac.policy, "__name__", "custom")


def _rows(found: list) -> list:
  return [{"configuration": e.describe_config(), "mesh_shape": e.mesh_shape,
           "context": e.mesh_shape.get("context", 1),
           "bytes_per_device": e.bytes_per_device, "compiled": e.compiled,
           "activation_checkpointing": _policy_name(e),
           "step_seconds": e.step_seconds,
           "tokens_per_second_per_device": e.tokens_per_second_per_device} for e in found]


def main(argv=None, *, model=None) -> int:
  """``python -m fsdp_jax.plan``: prints the search as a table; when
  nothing fits, the closest configurations, by how much each misses the
  memory limit and what could close the gap. A mistake in the input (an
  unknown device or model, a batch the devices do not divide...) prints its
  message alone to stderr and exits with status 2.

  ``--json FILE`` writes an object: ``fits`` (the configurations that fit,
  fastest first: ``configuration``, ``mesh_shape``, ``context`` (its
  context size, 1: none), ``bytes_per_device``,
  ``compiled``, ``step_seconds``, ``tokens_per_second_per_device``),
  ``closest`` (when nothing fits: the nearest misses, smallest peak first,
  each also with ``misses_by_bytes`` and ``needs``), ``devices``,
  ``device``, ``memory_limit_bytes``, ``global_batch``, ``seq``,
  ``context_sizes`` (those tried).

  Long sequences: the search tries context sizes (``--context``; by
  default 1, 2, 4 and 8 where they divide ``--devices`` and ``--seq``),
  keeping for each configuration the smallest that fits; the printed
  estimate says which it picked.

  ``model`` (for callers that build their own): a bundle with ``init_fn``,
  ``loss_fn``, ``wrap_policy``, ``tensor_parallel`` and ``lora_targets``,
  used instead of ``from_pretrained(--hf-config)``.

  On CPU the command sets fsdp_jax's CPU XLA flags for its own process
  before JAX starts (:func:`fsdp_jax.simulate_cpu_devices`'s, the number of
  devices aside): XLA reads its scheduler from them only, so the answer is
  the same whatever ``XLA_FLAGS`` the shell has.

  Example:
    >>> from fsdp_jax.plan import main
    >>> main(["--hf-config", "no/such/dir", "--devices", "8", "--seq", "128",
    ...       "--global-batch", "8"])
    Traceback (most recent call last):
    ...
    SystemExit: 2
  """
  args = _parser().parse_args(argv)
  try:
    return _main(args, model)
  except _UserError as e:
    print(f"python -m fsdp_jax.plan: error: {e}", file=sys.stderr)
    raise SystemExit(2) from None


def _main(args, model) -> int:
  if args.devices < 1:
    raise _UserError(f"--devices {args.devices}: the number of devices must be at least 1.")
  for flag, value in (("--seq", args.seq), ("--global-batch", args.global_batch),
                      ("--top", args.top), *(("--context", c) for c in args.context or ())):
    if value < 1:
      raise _UserError(f"{flag} {value}: must be at least 1.")
  try:
    device = device_spec(args.device)
  except ValueError as e:
    raise _UserError(f"--device {args.device!r}: {e}") from e
  programs.use_cpu_flags()
  bundle = model if model is not None else _model(args.hf_config)
  config = _configs(bundle, args)
  batch = {"input_ids": jax.ShapeDtypeStruct((args.global_batch, args.seq), jnp.int32),
           "labels": jax.ShapeDtypeStruct((args.global_batch, args.seq), jnp.int32)}
  limit = None if args.memory_limit_gib is None else int(args.memory_limit_gib * 2**30)
  space = {"config": config,
           "use_orig_params": {"flat": [False], "orig": [True], "both": [False, True]}[
               args.layout]}
  if args.strategy:
    space["sharding_strategy"] = [ShardingStrategy[name] for name in args.strategy]
  if args.context:
    space["context"] = sorted(set(args.context))
  contexts = _search_contexts(space, args.devices, args.seq, config)
  misses: list = []
  planner = Planner(bundle.loss_fn, optimizer=optax.adamw(1e-4), batch=batch,
                    init_fn=bundle.init_fn)
  try:
    found = _run_search(planner, devices=args.devices, device=device, memory_limit=limit,
                        space=space, misses=misses)
  except ValueError as e:
    if "Fix" not in str(e):  # the search's input checks name the fix
      raise
    raise _UserError(str(e)) from e
  limit = limit or device.memory_bytes
  where = (f"{args.devices} x {device.name} ({limit / 2**30:.1f} GiB each), global batch "
           f"{args.global_batch} x {args.seq} tokens")
  closest = [] if found else misses[:args.top]
  if found:
    print(f"{len(found)} configurations fit {where}; fastest first:")
    print(table(found, args.top))
    print()
    c = found[0].mesh_shape.get("context", 1)
    print(f"Context parallelism (context sizes tried: {contexts}): "
          + (f"context={c}, each sequence split into chunks of {args.seq // c} tokens over "
             f"{c} devices." if c > 1 else "none: it fits without a context axis."))
    print(found[0])
  elif not closest:
    print(f"Nothing fits {where}.")
  else:
    print(f"Nothing fits {where}. The closest, smallest peak first:")
    rows = ["| # | configuration | memory/device GiB | peak | misses by GiB | would need |",
            "|---|---|---|---|---|---|"]
    for k, e in enumerate(closest, 1):
      total = e.bytes_per_device["total"]
      rows.append(f"| {k} | {e.describe_config()} | {total / 2**30:.2f} | "
                  f"{'compiled' if e.compiled else 'modelled'} | "
                  f"{(total - limit) / 2**30:.2f} | {_needs(e, limit, args)} |")
    print("\n".join(rows))
  if args.json:
    out = {"devices": args.devices, "device": device.name, "memory_limit_bytes": limit,
           "global_batch": args.global_batch, "seq": args.seq, "context_sizes": contexts,
           "fits": _rows(found),
           "closest": [dict(r, misses_by_bytes=e.bytes_per_device["total"] - limit,
                            needs=_needs(e, limit, args))
                       for r, e in zip(_rows(closest), closest)]}
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
