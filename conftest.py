"""Tests and doctests run on 8 simulated CPU devices, configured once here."""

import fsdp_jax

fsdp_jax.simulate_cpu_devices(8)
