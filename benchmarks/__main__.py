"""``python -m benchmarks <name> [options]``: run one measurement.

    python -m benchmarks all            # everything; writes RESULTS.md (= benchmarks/run.py)
    python -m benchmarks memory         # bytes per device of each compiled step
    python -m benchmarks collectives    # collectives per step from the compiled HLO
    python -m benchmarks compile_time   # lowering and compile seconds
    python -m benchmarks step_time      # step time, round-robin in one process
    python -m benchmarks offload        # CPU offload: device/host bytes, step time
    python -m benchmarks optimizers     # optimizers on shards vs the global view
    python -m benchmarks zeropp         # ZeRO++: bytes per link, memory, error
    python -m benchmarks init           # init_train_state and full-parameter access: memory
    python -m benchmarks init_time      # init_train_state against a plain jit init: seconds
    python -m benchmarks flags          # each CPU XLA flag: plain jit and fsdp_jax, with and without
    python -m benchmarks causes         # why SHARD_GRAD_OP and bf16 cost what they cost (CAUSES.md)
    python -m benchmarks handwritten    # against a hand-written shard_map FSDP, per-op breakdown
    python -m benchmarks scan           # scanned stacked layers: memory against depth (SCAN.md)
    python -m benchmarks gpu            # a 1B GPT on the GPUs vs plain jit (GPU.md)
    python -m benchmarks pretrained     # loading and saving pretrained weights (PRETRAINED.md)
    python -m benchmarks pretrained_copy  # the loader's host copies on this CPU
    python -m benchmarks lora           # LoRA and QLoRA against full fine-tuning (LORA.md)
    python -m benchmarks tensor_parallel  # FSDP x tensor parallelism (TENSOR_PARALLEL.md)
    python -m benchmarks sequence_parallel  # sequence parallelism under TP: activations, collectives (TENSOR_PARALLEL.md)
    python -m benchmarks tp_routes      # tensor parallelism left to the compiler vs explicit collectives
    python -m benchmarks mutants        # one-line bugs in the engine: the first test that catches each
    python -m benchmarks families       # fsdp_jax.models' families vs the example Llama (MODELS.md)
    python -m benchmarks eval           # the eval step and reshard_params: memory (EVAL.md)
    python -m benchmarks planner        # the planner against the compiled step: memory, time, cost, what fits (PLANNER.md)
    python -m benchmarks activations    # checkpointing policies and the blocked loss (ACTIVATIONS.md)
    python -m benchmarks data           # fsdp_jax.data: padding and tokens/s of the pipeline (DATA.md)
    python -m benchmarks context        # context parallelism: memory, longest sequence, collectives, time (CONTEXT.md)
    python -m benchmarks context_exact  # context parallelism trains 2,048-4,096-token packed rows as one device (CONTEXT.md)

``python -m benchmarks <name> --help`` lists a measurement's options.
"""

from __future__ import annotations

import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (module, function): each takes argv and either prints a table it
# returns or writes its own report.
MEASUREMENTS = {
    "all": ("benchmarks.run", "main"),
    "memory": ("benchmarks.measure", "memory"),
    "collectives": ("benchmarks.measure", "collectives"),
    "compile_time": ("benchmarks.measure", "compile_time"),
    "step_time": ("benchmarks.measure", "step_time"),
    "offload": ("benchmarks.offload", "main"),
    "optimizers": ("benchmarks.optimizers", "main"),
    "zeropp": ("benchmarks.zeropp", "main"),
    "init": ("benchmarks.init_and_full_params", "main"),
    "init_time": ("benchmarks.init_time", "main"),
    "flags": ("benchmarks.flags", "main"),
    "causes": ("benchmarks.causes", "main"),
    "handwritten": ("benchmarks.handwritten", "main"),
    "scan": ("benchmarks.scan_layers", "main"),
    "gpu": ("benchmarks.gpu", "main"),
    "pretrained": ("benchmarks.pretrained", "main"),
    "pretrained_copy": ("benchmarks.pretrained_copy", "main"),
    "lora": ("benchmarks.lora", "main"),
    "tensor_parallel": ("benchmarks.tensor_parallel", "main"),
    "sequence_parallel": ("benchmarks.sequence_parallel", "main"),
    "tp_routes": ("benchmarks.tp_routes", "main"),
    "mutants": ("benchmarks.mutants", "main"),
    "families": ("benchmarks.families", "main"),
    "eval": ("benchmarks.eval", "main"),
    "planner": ("benchmarks.planner", "main"),
    "activations": ("benchmarks.activations", "main"),
    "data": ("benchmarks.data", "main"),
    "context": ("benchmarks.context", "main"),
    "context_exact": ("benchmarks.context_exact", "main"),
}


def main(argv: list[str]) -> int:
  if not argv or argv[0] in ("-h", "--help") or argv[0] not in MEASUREMENTS:
    print(__doc__)
    if argv and argv[0] not in ("-h", "--help"):
      print(f"unknown measurement {argv[0]!r}; choose one of {', '.join(MEASUREMENTS)}",
            file=sys.stderr)
      return 2
    return 0
  module, fn = MEASUREMENTS[argv[0]]
  out = getattr(importlib.import_module(module), fn)(argv[1:])
  if isinstance(out, str):
    print(out)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
