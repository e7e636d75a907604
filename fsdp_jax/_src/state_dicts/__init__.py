"""State dicts of a sharded train state, as PyTorch FSDP names them.

A :class:`~fsdp_jax.ShardedTrainState` stores each unit's parameters in a
sharded layout (flat ``<unit>._flat_param`` buffers, or dim-0 shards of the
original leaves). The functions here convert to and from the three kinds of
PyTorch state dict, keyed by **dotted parameter names** (the unsharded tree's
paths, e.g. ``"params.Dense_0.kernel"`` or ``"blocks.0.w"``):

* ``StateDictType.FULL_STATE_DICT``: ``{name: full array}``. Arrays are
  replicated ``jax.Array`` s, or host ``numpy`` arrays with
  ``offload_to_cpu=True``; with ``rank0_only=True`` only process 0 gets them
  (every other process gets ``{}``).
* ``StateDictType.SHARDED_STATE_DICT``: ``{name: jax.Array}`` of the
  parameter's global shape, sharded over the state's shard axes (PyTorch's
  ShardedTensor). Loads onto any mesh, strategy and layout.
* ``StateDictType.LOCAL_STATE_DICT``: the stored arrays as they are (their
  addressable shards are this process's raw local shards), keyed by storage
  name, plus ``"_metadata"``: a JSON-able description of how to read them.
  Loads only onto the same layout and shard count.

Optimizer state dicts follow ``torch.optim.Optimizer.state_dict()``'s shape
where it fits optax: ``{"state": {name: {slot: array}}, "param_groups":
[{"params": [names], <path>: value, ...}]}``. A *slot* is a subtree of the
optax state that mirrors the parameters (Adam's ``"0.mu"`` and ``"0.nu"``);
optax keeps hyperparameters in closures, so the single parameter group holds
the remaining (non per-parameter) state leaves, e.g. Adam's ``"0.count"`` or
``inject_hyperparams``' ``"hyperparams.learning_rate"``.

Every conversion runs unit by unit with jitted programs whose outputs are
sharded, so at most one unit is ever gathered (FULL_STATE_DICT) and the
sharded kinds never hold a full parameter on one device when a dimension of
it divides the shard count.
"""

from fsdp_jax._src.naming import ROOT as ROOT, path_name as path_name
from fsdp_jax._src.state_dicts.convert import (
    BUFFER_FIELDS as BUFFER_FIELDS,
    LOCAL_METADATA_KEY as LOCAL_METADATA_KEY,
    MAX_LINES as MAX_LINES,
    OPT_STATE as OPT_STATE,
    OptLayout as OptLayout,
    OptimStateKeyType as OptimStateKeyType,
    PARAMS as PARAMS,
    canonical_sharding as canonical_sharding,
    clear_caches as clear_caches,
    data_fields as data_fields,
    dtype_name as dtype_name,
    ignored_entries as ignored_entries,
    is_key_dtype as is_key_dtype,
    is_masked as is_masked,
    layer_axis as layer_axis,
    leaves_to_storage as leaves_to_storage,
    on_devices as on_devices,
    opt_layout as opt_layout,
    param_names as param_names,
    place as place,
    present as present,
    problems as problems,
    replicated_sharding as replicated_sharding,
    require_state as require_state,
    require_type as require_type,
    shape_of as shape_of,
    shard_desc as shard_desc,
    split_storage as split_storage,
    storage_from_items as storage_from_items,
    storage_items as storage_items,
    storage_keys as storage_keys,
    storage_shape_by_key as storage_shape_by_key,
    storage_sharding_by_key as storage_sharding_by_key,
    storage_to_leaves as storage_to_leaves,
    to_host as to_host,
    to_pinned as to_pinned,
)
from fsdp_jax._src.state_dicts.model import (
    check_local_metadata as check_local_metadata,
    load_state_dict as load_state_dict,
    local_metadata as local_metadata,
    state_dict as state_dict,
)
from fsdp_jax._src.state_dicts.optim import (
    full_optim_state_dict as full_optim_state_dict,
    load_named_opt as load_named_opt,
    named_needs as named_needs,
    optim_named as optim_named,
    optim_state_dict as optim_state_dict,
    optim_state_dict_to_load as optim_state_dict_to_load,
    rekey_optim_state_dict as rekey_optim_state_dict,
    scatter_full_optim_state_dict as scatter_full_optim_state_dict,
    shard_full_optim_state_dict as shard_full_optim_state_dict,
)

__all__ = [
    "OptimStateKeyType", "full_optim_state_dict", "load_state_dict",
    "optim_state_dict", "optim_state_dict_to_load", "rekey_optim_state_dict",
    "scatter_full_optim_state_dict", "shard_full_optim_state_dict", "state_dict",
]
