"""The optimizer on sharded parameters: the user's tree, exact numbers.

PyTorch users expect what FSDP with ``use_orig_params=True`` gives them: the
optimizer sees the original parameters. Here the optimizer's ``init`` and
``update`` are traced once on the **logical** tree that was passed to
``init_train_state`` (same paths, unpadded shapes and dtypes; frozen leaves
are ``None``), and the traced program is then evaluated on each device's
shards by :class:`ShardedEvaluator`:

* elementwise equations (all of adam, adamw, lion, sgd, masks, schedules)
  run on the local shards with no communication;
* a reduction over a whole parameter (a norm in ``clip_by_global_norm``,
  LAMB's trust ratio, ``apply_if_finite``'s check) becomes a local reduction
  with the padding excluded, and sums of such partial results stay local
  until a non-linear use forces one ``psum`` (``pmax``/``pmin``) over the
  shard axes: a global norm costs one scalar all-reduce;
* any other equation that reads a parameter-shaped value (a matrix product
  in Muon, a row/column reduction in Adafactor, a reshape) gathers that value
  to its logical shape first and runs on every device; results that must be
  stored sharded are sliced back to the device's shard.

Every rule computes exactly what the single-device program computes (up to
the order of floating-point sums), so the result is exact for any
transformation, and the cost follows what the transformation needs.

The optimizer state is stored as a :class:`ShardedOptState`: each leaf of
``optimizer.init(params)`` that belongs to one parameter and has its shape (a
*slot* entry, e.g. Adam's ``mu``) is stored sharded exactly like that
parameter (flat layout: one buffer per unit and slot); every other leaf
(counts, hyperparameters, Adafactor's factored rows and columns) is stored
replicated with its logical shape.
"""

from fsdp_jax._src.optim.stored import (
    MODES as MODES,
    OptEntry as OptEntry,
    OptLayout as OptLayout,
    ShardedOptState as ShardedOptState,
    build_layout as build_layout,
    cast as cast,
    grad_dtype as grad_dtype,
    logical_grads as logical_grads,
    logical_params as logical_params,
    slot_items as slot_items,
    slot_keys as slot_keys,
    slot_tree as slot_tree,
    state_bytes as state_bytes,
    storage_key as storage_key,
    stored_shapes as stored_shapes,
    stored_specs as stored_specs,
    user_tree as user_tree,
)
from fsdp_jax._src.optim.evaluator import (
    Assembler as Assembler,
    ELEMENTWISE as ELEMENTWISE,
    Geometry as Geometry,
    Partial as Partial,
    Rep as Rep,
    Shard as Shard,
    ShardedEvaluator as ShardedEvaluator,
    Splat as Splat,
    UpdateReport as UpdateReport,
    param_values as param_values,
    state_values as state_values,
)
from fsdp_jax._src.optim.update import (
    UpdateMode as UpdateMode,
    abstract_init as abstract_init,
    analyse as analyse,
    as_transformation as as_transformation,
    choose_mode as choose_mode,
    constant_init as constant_init,
    init_local as init_local,
    layout_for as layout_for,
    trace_init as trace_init,
    shard_index as shard_index,
    takes_value as takes_value,
    update_global as update_global,
    update_local as update_local,
)

__all__ = ["ShardedOptState", "OptLayout", "OptEntry", "UpdateReport"]
