"""Where gathers go: ``loss_fn`` is traced once to a jaxpr and re-evaluated
with each unit's all-gather inserted right before the first equation that
reads one of its parameters.

* Calls into nested ``jit``/``closed_call`` jaxprs are inlined when they read
  parameters, so a model wrapped in an inner ``jax.jit`` still gathers unit by
  unit.
* A ``lax.scan`` whose scanned-over operands are leaves of a stacked unit is
  rebuilt so that each iteration gathers one layer from the layer's shard,
  instead of gathering the whole stack before the loop: a ``custom_vjp``
  pair of loops, each iteration gathering the next layer while it computes
  its own (:mod:`.loops`).
* Liveness does the rest: a gathered value dies after its last use. For
  FULL_SHARD the step wraps the evaluation in ``jax.checkpoint`` with
  :func:`fsdp_jax._src.collectives.remat_policy`, so the backward re-gathers.
* The model's own ``jax.checkpoint`` / ``nn.remat`` calls keep their policy
  (:mod:`.checkpoints`); ``FSDPConfig(activation_checkpointing=...)`` adds one
  around each selected unit's computation (:mod:`.regions` cuts the loss into
  the units' computations).
* The step's collectives are ordered against compute as PyTorch's prefetch
  settings order them (:mod:`.ordering`).

Modules, each importing only those before it: ``regions``, ``checkpoints``, ``loops``,
``ordering``, ``placement`` (the evaluator; it hands itself to the loops and
checkpoints it calls).
"""

from fsdp_jax._src.schedule.checkpoints import check_offload_backend as check_offload_backend
from fsdp_jax._src.schedule.checkpoints import checkpoint_units as checkpoint_units
from fsdp_jax._src.schedule.checkpoints import has_user_checkpoint as has_user_checkpoint
from fsdp_jax._src.schedule.checkpoints import selected_units as selected_units
from fsdp_jax._src.schedule.loops import NEXT_LAYER_SCOPE as NEXT_LAYER_SCOPE
from fsdp_jax._src.schedule.ordering import ordered as ordered
from fsdp_jax._src.schedule.placement import Gatherer as Gatherer
from fsdp_jax._src.schedule.placement import eval_with_gathers as eval_with_gathers
