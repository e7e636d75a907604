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

Example:
  >>> import fsdp_jax.plan
  >>> sorted(fsdp_jax.plan.DeviceSpec.preset(n).name for n in ("B200", "H200"))
  ['B200', 'H200']
"""

from __future__ import annotations

import argparse
import json
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


def _model(path: str):
  """The model bundle of a config.json (``fsdp_jax.models.from_pretrained``)."""
  directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
  if not os.path.exists(os.path.join(directory, "config.json")):
    raise SystemExit(f"--hf-config {path!r}: no config.json there.")
  return models.from_pretrained(directory)


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


def main(argv=None, *, model=None) -> int:
  """``python -m fsdp_jax.plan``: prints the search as a table.

  ``model`` (for callers that build their own): a bundle with ``init_fn``,
  ``loss_fn``, ``wrap_policy``, ``tensor_parallel`` and ``lora_targets``,
  used instead of ``from_pretrained(--hf-config)``.

  Example:
    >>> from fsdp_jax.plan import main
    >>> main(["--hf-config", "no/such/dir", "--devices", "8", "--seq", "128",
    ...       "--global-batch", "8"])
    Traceback (most recent call last):
    ...
    SystemExit: --hf-config 'no/such/dir': no config.json there.
  """
  args = _parser().parse_args(argv)
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
  found = search(bundle.loss_fn, optimizer=optax.adamw(1e-4), batch=batch,
                 devices=args.devices, init_fn=bundle.init_fn, device=args.device,
                 memory_limit=limit, space=space)
  device = DeviceSpec.preset(args.device) if isinstance(args.device, str) else args.device
  print(f"{len(found)} configurations fit {args.devices} x {device.name} "
        f"({(limit or device.memory_bytes) / 2**30:.1f} GiB each), global batch "
        f"{args.global_batch} x {args.seq} tokens; fastest first:")
  print(table(found, args.top))
  if found:
    print()
    print(found[0])
  if args.json:
    with open(args.json, "w") as f:
      json.dump([{"configuration": e.describe_config(), "mesh_shape": e.mesh_shape,
                  "bytes_per_device": e.bytes_per_device, "compiled": e.compiled,
                  "step_seconds": e.step_seconds,
                  "tokens_per_second_per_device": e.tokens_per_second_per_device}
                 for e in found], f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
