"""Reading a compiled program: its collectives, their bytes and replica
groups, loop bodies and the order of gathers (the checks behind
``print(state.plan)`` and benchmarks/).

Example:
  >>> import jax, jax.numpy as jnp, fsdp_jax
  >>> text = jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile().as_text()
  >>> fsdp_jax.hlo.collectives(text)
  []
"""

from fsdp_jax._src.hlo import (
    Collective as Collective,
    Instruction as Instruction,
    collective_order as collective_order,
    collectives as collectives,
    entry_instructions as entry_instructions,
    held_across as held_across,
    live_gathered_units as live_gathered_units,
    loop_bodies as loop_bodies,
    replica_groups as replica_groups,
    summarize as summarize,
)
from fsdp_jax._src.offload import entry_memory_bytes as entry_memory_bytes

__all__ = [
    "Collective", "Instruction", "collective_order", "collectives",
    "entry_instructions", "entry_memory_bytes", "held_across", "live_gathered_units",
    "loop_bodies",
    "replica_groups", "summarize",
]
