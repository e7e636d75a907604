"""The planner: what fits and how fast (``fsdp_jax.estimate``,
``fsdp_jax.search``, ``fsdp_jax.DeviceSpec``, ``python -m fsdp_jax.plan``).

Modules, each importing only those before it: ``devices`` (``DeviceSpec``
and its presets), ``segments`` (the loss's per-device program, cut where
the step gathers units), ``programs`` (each distinct segment compiled from
shapes), ``schedule`` (the segments in the step's order: the peak and the
time), ``estimator`` (``estimate``), ``search``.
"""

from fsdp_jax._src.planner.devices import DeviceSpec as DeviceSpec
from fsdp_jax._src.planner.devices import PRESETS as PRESETS
from fsdp_jax._src.planner.estimator import Estimate as Estimate
from fsdp_jax._src.planner.estimator import estimate as estimate
from fsdp_jax._src.planner.search import search as search
