"""The sharded train state: building it (from parameters or an init function,
never holding the full model on one device) and reading the full parameters
back."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fsdp_jax._src import mesh as mesh_lib
from fsdp_jax._src import frameworks, layout, lora as lora_lib, offload, optim, unit_init
from fsdp_jax._src.build import leaf_positions, build_plan
from fsdp_jax._src.config import FSDPConfig, is_float_dtype, is_key_dtype
from fsdp_jax._src.plan import Plan, UnitSpec, hook_key, hook_state_spec, split_trainable


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ShardedTrainState:
  """Train state of a sharded model: a pytree, with the plan as static data.

  Attributes:
    step: number of optimizer steps taken (int32 scalar).
    params: the stored parameter shards: ``{"<unit>._flat_param": array}``
      (flat layout) or the original tree of padded dim-0 shards
      (``use_orig_params=True``). Global ``jax.Array`` s sharded over the mesh,
      in ``pinned_host`` memory with ``CPUOffload(offload_params=True)``.
    opt_state: the optax state of the trainable params (frozen parameters
      have none), sharded like them; every leaf in ``pinned_host`` memory with
      CPU offload.
    model_state: non-trainable model state (Flax ``batch_stats``, PyTorch's
      buffers): replicated on every device, in ``buffer_dtype``; or None.
      Kept in device memory, with or without CPU offload.
    comm_hook_state: the per-device state of a stateful communication hook,
      or None (device memory, like ``step``).
    nonfinite_steps: with ``FSDPConfig(nonfinite="skip")``, the number of
      steps skipped because their gradients were not finite (int32 scalar);
      None otherwise.
    rng: the key passed as ``init_train_state(rng=...)`` (typed or raw, or a
      pytree of keys), replicated; None otherwise. It never changes: a
      ``loss_fn`` that accepts ``rng=`` gets ``fold_in(fold_in(rng, step),
      device_index)`` at each step. Saved and restored by checkpoints.
    plan: the :class:`~fsdp_jax.Plan` (units, layout, mesh, config).

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=optax.sgd(0.1), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> int(state.step), jax.tree.map(jnp.shape, state.params)  # one flat shard per device
    (0, {'_flat_param': (8,)})
  """

  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any = None
  comm_hook_state: Any = None
  nonfinite_steps: Any = None
  rng: Any = None
  plan: Plan = dataclasses.field(default=None, metadata=dict(static=True))

  def replace(self, **changes) -> "ShardedTrainState":
    return dataclasses.replace(self, **changes)

  def __repr__(self) -> str:
    """A few lines whatever the model's size: the step, how many arrays
    each part holds, and the plan's one line (``print(state.plan)`` shows
    the plan whole)."""
    try:
      step = str(int(jax.device_get(self.step)))
    except Exception:  # pylint: disable=broad-except  (traced, or not an array)
      step = _arrays(self.step)
    parts = [f"step={step}"] + [
        f"{name}={_arrays(getattr(self, name))}"
        for name in ("params", "opt_state", "model_state", "comm_hook_state",
                     "nonfinite_steps", "rng") if getattr(self, name) is not None]
    return "ShardedTrainState(" + ", ".join(parts) + f",\n  plan={self.plan!r})"


def _arrays(tree) -> str:
  """``"<3 arrays, 1,234 elements>"`` (a scalar: its dtype): a part of the state."""
  leaves = jax.tree_util.tree_leaves(tree)
  if len(leaves) == 1 and not jnp.shape(leaves[0]):
    x = leaves[0]
    return f"{getattr(x, 'dtype', type(x).__name__)}[]"
  numel = sum(int(np.prod(np.shape(x), dtype=np.int64)) for x in leaves)
  return f"<{len(leaves)} array{'s' * (len(leaves) != 1)}, {numel:,} elements>"


# --------------------------------------------------------------------------
# Names and module classes


def opt_state_specs(plan: Plan, optimizer: optax.GradientTransformation):
  """``(specs, shapes)`` of the optimizer state for ``plan``'s stored params.

  The state is a :class:`~fsdp_jax._src.optim.ShardedOptState`: the leaves of
  ``optimizer.init(params)`` that belong to a parameter and have its shape are
  sharded like that parameter, every other leaf (counts, hyperparameters,
  factored statistics) is replicated. ``specs`` are the ``PartitionSpec`` s
  for ``jax.shard_map``; ``shapes`` the ``jax.ShapeDtypeStruct`` s (with
  shardings) of the stored state.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = fsdp_jax.make_mesh(shard=2, devices=jax.devices()[:2])
    >>> opt = optax.adam(1e-3)
    >>> state = fsdp_jax.init_train_state(params={"w": jnp.ones((4, 2))},
    ...     optimizer=opt, mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> specs, shapes = fsdp_jax.custom.opt_state_specs(state.plan, opt)
    >>> specs.slots == {"0.mu": {"_flat_param": P("shard")},
    ...                 "0.nu": {"_flat_param": P("shard")}}  # sharded like the params
    True
    >>> specs.leaves == {"0.count": P()}  # replicated
    True
    >>> shapes.slots["0.mu"]["_flat_param"].shape  # the global (padded) shape
    (8,)
  """
  lay = optim.layout_for(plan, optim.as_transformation(optimizer))
  return optim.stored_specs(plan, lay), optim.stored_shapes(plan, lay)


def _storage_specs(plan: Plan):
  return jax.tree.map(lambda s: s.spec, plan.storage_shardings(),
                      is_leaf=lambda x: isinstance(x, NamedSharding))


# --------------------------------------------------------------------------
# Building the state


@mesh_lib.own_mesh
def init_train_state(*, optimizer: optax.GradientTransformation, mesh: Mesh,
                     config: FSDPConfig, params: Any = None,
                     init_fn: Optional[Callable[..., Any]] = None,
                     rng: Any = None,
                     module_classes: Optional[dict] = None,
                     model_state: Any = None,
                     requires_grad: Any = None,
                     pretrained: Any = None) -> ShardedTrainState:
  """Builds the sharded train state (PyTorch: wrapping a module in FSDP).

  Pass either materialised ``params`` (a pytree of arrays) or ``init_fn``
  (called as ``init_fn(rng)``, e.g. ``lambda k: model.init(k, x)``, or
  ``init_fn()`` when ``rng`` is None). With ``init_fn`` the shapes come from
  one trace of ``init_fn``, and each unit is materialised by its own jitted
  program straight into its shards, so the full model never exists on one
  device (PyTorch's ``param_init_fn`` / meta-device initialisation). Units
  that repeat a structure (a transformer's blocks) share one compiled
  program; the values are ``jax.jit(init_fn)``'s.

  Args:
    optimizer: an optax ``GradientTransformation``; its state is built on the
      local shards and sharded like the parameters.
    mesh: from :func:`fsdp_jax.make_mesh`.
    config: a :class:`fsdp_jax.FSDPConfig`.
    params: materialised parameters, or None.
    init_fn: an initialiser, or None.
    rng: the argument of ``init_fn``, and the state's key (``state.rng``,
      kept as given, typed ``jax.random.key`` or raw): a ``loss_fn`` that
      accepts a keyword argument ``rng`` gets ``fold_in(fold_in(rng, step),
      device_index)`` at every step.
    module_classes: subtree path -> module class (Flax linen, NNX or
      equinox), for ``ModuleWrapPolicy`` with classes (collected
      automatically from ``init_fn`` for Flax linen; see
      :func:`fsdp_jax.module_classes`).
    model_state: non-trainable state threaded through the step (Flax
      ``batch_stats``; PyTorch's buffers): replicated, never sharded, cast once
      to ``MixedPrecision.buffer_dtype`` and kept there. With model state the
      step calls ``loss_fn(params, batch, model_state)``, which returns
      ``(loss, new_model_state)`` or ``((loss, aux), new_model_state)``.
      Filled automatically when ``params`` (or what ``init_fn`` returns) is a
      Flax linen variables dict with collections besides ``"params"`` (they
      become the model state, ``{"params": ...}`` the parameters), or an NNX
      ``State`` with variables other than ``nnx.Param`` (``nnx.BatchStat``,
      ``nnx.RngKey``, ...: the model state). Typed PRNG keys in it are
      constants of the state: inside the step each device's ``loss_fn``
      sees ``fold_in(key, device_index)``. See docs/models.md.
    requires_grad: a tree of bools shaped like the params (or a prefix of
      it); ``False`` marks frozen leaves (PyTorch ``requires_grad=False``):
      no gradient reduction, no optimizer state, never updated. With
      ``use_orig_params=False`` a unit must be all frozen or all trainable.
    pretrained: a checkpoint to start from
      (:func:`fsdp_jax.pretrained.load`): with ``init_fn``, which gives the
      tree, shapes and dtypes (traced abstractly: a loaded leaf is never
      computed), the values come from the checkpoint, each device's shard
      read from the file as a slice and converted to the leaf's dtype.
      Leaves the checkpoint does not cover (``load(..., strict=False)``)
      keep ``init_fn``'s values. The optimizer state is initialised from
      the loaded parameters.

  With ``config.cpu_offload=CPUOffload(offload_params=True)`` the stored
  params and the optimizer state are written straight into ``pinned_host``
  memory (``ValueError`` if the devices have none).

  Returns:
    A :class:`ShardedTrainState` with ``step == 0``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, fsdp_jax
    >>> mesh = fsdp_jax.make_mesh(shard=4, devices=jax.devices()[:4])
    >>> params = {"w": jnp.ones((10, 3)), "b": jnp.zeros((3,))}
    >>> state = fsdp_jax.init_train_state(
    ...     params=params, optimizer=optax.adam(1e-3), mesh=mesh,
    ...     config=fsdp_jax.FSDPConfig())
    >>> state.params["_flat_param"].shape   # 33 elements padded to 4 x 9
    (36,)

    A Flax model's collections besides ``"params"`` become the model state,
    and ``rng`` is kept as the state's key:

    >>> import flax.linen as nn
    >>> model = nn.Sequential([nn.Dense(4), nn.BatchNorm(use_running_average=False)])
    >>> state = fsdp_jax.init_train_state(
    ...     init_fn=lambda k: model.init(k, jnp.ones((2, 3))), rng=jax.random.key(0),
    ...     optimizer=optax.adam(1e-3), mesh=mesh, config=fsdp_jax.FSDPConfig())
    >>> sorted(state.model_state), [l.name for l in state.plan.leaves][:2]
    (['batch_stats'], ['params.layers_0.bias', 'params.layers_0.kernel'])
    >>> state.rng.dtype
    key<fry>
  """
  if (params is None) == (init_fn is None):
    raise ValueError("init_train_state: pass exactly one of params= or init_fn=.")
  if pretrained is not None and init_fn is None:
    raise ValueError(
        "init_train_state(pretrained=...) takes the parameters' tree, shapes and dtypes from "
        "init_fn= and their values from the checkpoint. Fix: pass init_fn=lambda rng: "
        "model.init(rng, example_input) instead of params= (it is traced, not run, for the "
        "leaves the checkpoint loads).")
  optimizer = optim.as_transformation(optimizer)
  if offload.offloads(config):
    offload.check_backend(mesh)
  # Inputs made on other devices (under a user's jax.set_mesh(other_mesh))
  # are read to host; the state's programs place them on ``mesh``.
  rng, model_state = _off_other_devices((rng, model_state), mesh)
  init_args = () if rng is None else (rng,)
  if config.sync_module_states and jax.process_count() > 1:
    # PyTorch's sync_module_states: every process starts from process 0's
    # parameters (and model state, and init rng).
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    if params is not None:
      params = multihost_utils.broadcast_one_to_all(params)
    if model_state is not None:
      model_state = _broadcast_keys_too(multihost_utils.broadcast_one_to_all, model_state)
    if rng is not None:
      data = multihost_utils.broadcast_one_to_all(jax.random.key_data(rng)
                                                  if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key)
                                                  else rng)
      rng = jax.random.wrap_key_data(data) if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key) else data
      init_args = (rng,)
  if config.lora is not None:
    params, init_fn = _with_adapters(config, params, init_fn, init_args, rng)
  captured = {}
  replicated = NamedSharding(mesh, P())
  traced = None  # init_fn's jaxpr, and where each parameter leaf is among its outputs
  if init_fn is not None:
    abstract, captured, closed = frameworks.trace_capturing(init_fn, *init_args)
    whole = abstract
    abstract, ms_abstract, what = frameworks.split_model_state(abstract)
    positions = (list(range(len(jax.tree_util.tree_leaves(whole)))) if ms_abstract is None
                 else leaf_positions(whole, abstract))
    traced = None if positions is None else (closed, positions)
    if ms_abstract is not None:
      _check_one_model_state(model_state, what, "init_fn returns")
      whole_init = init_fn
      init_fn = lambda *a: frameworks.split_model_state(whole_init(*a))[0]
      # Only the model state is materialised here (replicated, as stored):
      # XLA drops the parameters' initialisers from this program.
      model_state = jax.jit(lambda *a: frameworks.split_model_state(whole_init(*a))[1],
                            out_shardings=replicated)(*init_args)
  else:
    params, ms_split, what = frameworks.split_model_state(params)
    if ms_split is not None:
      _check_one_model_state(model_state, what, "params holds")
      model_state = ms_split
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x)), params)
  types = dict(captured)
  types.update(module_classes or {})
  plan = build_plan(abstract, mesh=mesh, config=config, module_types=types,
                    requires_grad=requires_grad, model_state=model_state)
  for name, layers in plan.stacked_hints:
    warnings.warn(frameworks.stacked_hint_message(name, layers), stacklevel=2)

  if params is not None:
    params = _off_other_devices(params, mesh)
  storage_leaves: dict = {}
  shardings = plan.storage_shardings()
  if pretrained is not None:
    storage_leaves, loaded_ignored = _load_pretrained(plan, pretrained, init_fn, init_args,
                                                      traced)
  elif init_fn is not None:
    storage_leaves = unit_init.init_program(plan, init_fn, init_args, traced=traced)(
        *jax.tree_util.tree_leaves(init_args))
  else:  # one program packs every unit
    flat = jax.tree_util.tree_leaves(params)
    storage_leaves = jax.jit(
        lambda xs: {u.index: layout.pack_unit(plan, u, {i: xs[i] for i in u.leaf_ids},
                                              replicate=True) for u in plan.units},
        out_shardings={u.index: _unit_out_shardings(plan, u, shardings) for u in plan.units})(
            {i: flat[i] for u in plan.units for i in u.leaf_ids})
  ignored = {}
  if plan.ignored_leaves:
    ign_sh = plan.sharding(plan.ignored_spec())
    if init_fn is not None:
      make = lambda *a: pack_ignored(plan, jax.tree_util.tree_leaves(init_fn(*a)))
      ignored = jax.jit(make, out_shardings=ign_sh)(*init_args)
    else:
      flat = jax.tree_util.tree_leaves(params)
      ignored = jax.jit(lambda xs: pack_ignored(plan, xs), out_shardings=ign_sh)(
          {l.index: flat[l.index] for l in plan.ignored_leaves})
  if pretrained is not None:
    ignored.update(loaded_ignored)
  storage = assemble_storage(plan, storage_leaves, ignored)
  init_closed, init_shapes = optim.trace_init(plan, optimizer)  # one trace, used twice
  plan = with_optimizer(plan, optimizer, init_shapes=init_shapes)
  opt_state = _init_opt_state(plan, optimizer, storage, closed=init_closed)
  step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
  # The state owns its buffers: the step donates them, and the caller's
  # arrays must survive that. (device_put would alias the caller's buffer
  # on the first device even with may_alias=False; a jitted copy does not.)
  owned = jax.jit(lambda t: jax.tree.map(jnp.copy, t), out_shardings=replicated)
  if model_state is not None:
    mp = config.mixed_precision
    if mp is not None and mp.buffer_dtype is not None:
      model_state = jax.tree.map(
          lambda x: jnp.asarray(x).astype(mp.buffer_dtype) if is_float_dtype(_dtype(x))
          else jnp.asarray(x), model_state)
    model_state = owned(model_state)
  skipped = (jax.device_put(jnp.zeros((), jnp.int32), replicated)
             if plan.nonfinite == "skip" else None)
  return ShardedTrainState(step=step, params=storage, opt_state=opt_state,
                           model_state=model_state,
                           comm_hook_state=_init_hook_state(plan), nonfinite_steps=skipped,
                           rng=None if rng is None else owned(rng), plan=plan)


def abstract_plan(*, optimizer, mesh, config: FSDPConfig, params: Any = None,
                  init_fn: Optional[Callable[..., Any]] = None, rng: Any = None,
                  module_classes: Optional[dict] = None, requires_grad: Any = None,
                  update_mode: bool = True):
  """The plan :func:`init_train_state` would build, with the optimizer's
  layout (and, with ``update_mode``, how its update runs, which evaluates
  it once): nothing is allocated.

  ``params`` may be abstract (``jax.ShapeDtypeStruct`` s) and ``mesh`` a
  ``jax.sharding.AbstractMesh`` (devices this process does not have):
  ``init_fn`` is traced, never run. Returns ``(plan, model state shapes or
  None, the user's tree as shapes, module classes found while tracing)``;
  pass the last two back as ``params`` and ``module_classes`` to plan
  another mesh or config without tracing ``init_fn`` again.
  """
  if (params is None) == (init_fn is None):
    raise ValueError("pass exactly one of params= or init_fn=.")
  optimizer = optim.as_transformation(optimizer)
  init_args = () if rng is None else (rng,)
  types: dict = {}
  if params is None:
    params, types, _ = frameworks.trace_capturing(init_fn, *init_args)
  user = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype(x)), params)
  types.update(module_classes or {})
  # Only traced: zeros of the user's shapes (LoRA's adapters drawn on top).
  init_fn = lambda *_: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), user)
  if config.lora is not None:
    _, init_fn = _with_adapters(config, None, init_fn, init_args, rng)
  abstract = jax.eval_shape(init_fn, *init_args)
  abstract, ms_abstract, _ = frameworks.split_model_state(abstract)
  plan = build_plan(abstract, mesh=mesh, config=config, module_types=types,
                    requires_grad=requires_grad, model_state=ms_abstract)
  _, init_shapes = optim.trace_init(plan, optimizer)
  if update_mode:
    plan = with_optimizer(plan, optimizer, init_shapes=init_shapes)
  else:
    plan = dataclasses.replace(plan, opt_layout=optim.layout_for(plan, optimizer, init_shapes),
                               optimizer=optimizer)
  return plan, ms_abstract, user, types


def _with_adapters(config: FSDPConfig, params, init_fn, init_args, rng):
  """LoRA: ``(params, init_fn)`` giving the stored tree, each target kernel
  a :class:`~fsdp_jax._src.lora.LoRAWeight` (its ``A`` drawn from ``rng``,
  key 0 without one)."""
  lora = config.lora
  if lora.dropout and rng is None:
    raise ValueError(
        f"FSDPConfig(lora=LoRA(dropout={lora.dropout})): the adapters' dropout draws its "
        "masks from the state's key, one per step and device, and init_train_state got no "
        "rng. Fix: pass init_train_state(..., rng=jax.random.key(0)), or dropout=0.0.")
  whole = jax.eval_shape(init_fn, *init_args) if init_fn is not None else params
  lora_lib.check_user_tree(whole, "init_train_state with FSDPConfig(lora=...)")
  targets = lora_lib.find_targets(whole, lora, config.stacked_layers)
  key = jax.random.key(0) if rng is None else rng
  if init_fn is not None:
    user_init = init_fn
    return None, lambda *a: lora_lib.adapter_tree(user_init(*a), lora, targets, key)
  return jax.jit(lambda p: lora_lib.adapter_tree(p, lora, targets, key))(params), None


def _load_pretrained(plan: Plan, source, init_fn, init_args, traced):
  """``({unit index: stored arrays}, {ignored leaf id: arrays})`` read from
  the checkpoint ``source``; the units it does not cover whole get
  ``init_fn``'s values where it does not."""
  sources = source.resolve(plan)
  partial = {u.index for u in plan.units if any(i not in sources for i in u.leaf_ids)}
  init = {}
  if partial:
    init = unit_init.init_program(plan, init_fn, init_args, traced=traced)(
        *jax.tree_util.tree_leaves(init_args), units=partial)
  out = {}
  # The units with the largest leaves first: a leaf's rows are held on the
  # host while its unit is read, best while little else is loaded.
  order = sorted(plan.units, key=lambda u: -max(
      [plan.leaves[i].numel * np.dtype(plan.leaves[i].dtype).itemsize for i in u.leaf_ids],
      default=0))
  for unit in order:
    if not any(i in sources for i in unit.leaf_ids):
      out[unit.index] = init[unit.index]
      continue
    loaded = source.unit_arrays(plan, unit, sources)
    out[unit.index] = (source.with_init(plan, unit, sources, loaded, init[unit.index])
                       if unit.index in partial else loaded)
  return out, source.ignored_arrays(plan, sources)


def _dtype(x):
  """A leaf's dtype as JAX will hold it (``jnp.result_type``: float64 NumPy
  arrays are float32 without x64), PRNG key dtypes included (which
  ``jnp.result_type`` refuses)."""
  dtype = getattr(x, "dtype", None)
  if dtype is not None and is_key_dtype(dtype):
    return dtype
  return jnp.result_type(x)


def _check_one_model_state(model_state, what: str, where: str) -> None:
  if model_state is not None:
    raise ValueError(
        f"init_train_state: {where} model state ({what}) and model_state= was passed "
        "too. Pass one: drop model_state= to use the model's own (it becomes "
        "state.model_state), or pass only the parameters (e.g. variables['params'], or "
        "nnx.split(model, nnx.Param, ...)'s first state).")


def _broadcast_keys_too(broadcast, tree):
  """``broadcast(tree)`` for a tree that may hold typed PRNG keys (sent as
  their key data)."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  keys = [is_key_dtype(_dtype(x)) for x in leaves]
  data = broadcast([jax.random.key_data(x) if k else x for x, k in zip(leaves, keys)])
  impls = [jax.random.key_impl(x) if k else None for x, k in zip(leaves, keys)]
  out = [jax.random.wrap_key_data(d, impl=i) if k else d
         for d, k, i in zip(data, keys, impls)]
  return jax.tree_util.tree_unflatten(treedef, out)


def _off_other_devices(params, mesh: Mesh):
  """Arrays that live on devices outside ``mesh`` (e.g. the full params of
  a state on another mesh, or arrays made under a user's
  ``jax.set_mesh(other_mesh)``) are read to host first; the packing
  programs put each shard where it belongs."""
  devices = set(mesh.devices.flat)

  def move(x):
    if not isinstance(x, jax.Array):
      return x
    try:
      elsewhere = x.committed and x.sharding.device_set != devices
    except Exception:  # pylint: disable=broad-except  # a tracer (abstract init)
      return x
    if not elsewhere:
      return x
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):  # a typed key: its data, wrapped again
      return jax.random.wrap_key_data(np.asarray(jax.device_get(jax.random.key_data(x))),
                                      impl=jax.random.key_impl(x))
    return np.asarray(jax.device_get(x))

  return jax.tree.map(move, params)


def with_optimizer(plan: Plan, optimizer, *, init_shapes=None) -> Plan:
  """``plan`` with the optimizer's state layout and what its update needs
  (shown by ``print(state.plan)``)."""
  lay = optim.layout_for(plan, optimizer, init_shapes)
  plan = dataclasses.replace(plan, opt_layout=lay, optimizer=optimizer)
  return dataclasses.replace(plan, opt_update=optim.choose_mode(plan, optimizer))


def _init_hook_state(plan: Plan):
  """A stateful hook's initial state, one copy per device."""
  if not plan.stateful_hook:
    return None
  hook = plan.comm_hook
  world = plan.axes.world_size
  sharding = NamedSharding(plan.mesh, hook_state_spec(plan))
  out = {}
  for unit in plan.trainable_units:
    for gi, (_, spec) in enumerate(plan.gather_specs(unit)):
      shape = plan.prefix(unit) + (spec.n, spec.chunk)

      def one(shape=shape, dtype=spec.reduce_dtype):
        st = hook.init(shape, dtype)
        return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (world,) + x.shape), st)

      out[hook_key(unit, gi)] = jax.jit(one, out_shardings=sharding)()
  return out


def _unit_out_shardings(plan: Plan, unit: UnitSpec, shardings):
  sh = plan.sharding(plan.spec_for(unit))
  if plan.use_orig_params:
    return {i: sh for i in unit.leaf_ids}
  return {"flat": sh}


def assemble_storage(plan: Plan, per_unit: dict, ignored: Optional[dict] = None):
  """``{unit index: pack_unit output}`` (and ``{leaf id: per-device copies}``
  of ignored leaves) -> the state's params tree."""
  ignored = ignored or {}
  if plan.use_orig_params:
    leaves = [None] * len(plan.leaves)
    for u in plan.units:
      for i in u.leaf_ids:
        leaves[i] = per_unit[u.index][i]
    for l in plan.ignored_leaves:
      leaves[l.index] = ignored[l.index]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)
  out = {u.flat_key: per_unit[u.index]["flat"] for u in plan.units}
  out.update({plan.ignored_key(l): ignored[l.index] for l in plan.ignored_leaves})
  return out


def pack_ignored(plan: Plan, full_leaves) -> dict:
  """Ignored leaves -> one copy per device (global ``(world, *shape)``)."""
  world = plan.axes.world_size
  return {l.index: jnp.broadcast_to(full_leaves[l.index][None], (world,) + l.shape)
          for l in plan.ignored_leaves}


def ignored_storage(plan: Plan, storage) -> dict:
  """``{leaf id: stored per-device copies}`` of the ignored leaves."""
  if plan.use_orig_params:
    leaves = jax.tree_util.tree_leaves(storage)
    return {l.index: leaves[l.index] for l in plan.ignored_leaves}
  return {l.index: storage[plan.ignored_key(l)] for l in plan.ignored_leaves}


def _init_opt_state(plan: Plan, optimizer, storage, closed=None):
  """``optimizer.init`` on the user's tree, evaluated on each device's shards
  (see :mod:`fsdp_jax._src.optim`) and stored as a ``ShardedOptState``."""
  lay = plan.opt_layout
  if closed is not None and not any(isinstance(x, jax.core.Tracer)
                                    for x in jax.tree_util.tree_leaves(storage)):
    constant = optim.constant_init(plan, lay, closed)
    if constant is not None:
      return constant
  specs = optim.stored_specs(plan, lay)
  trainable = split_trainable(plan, storage)[0]
  in_specs = split_trainable(plan, _storage_specs(plan))[0]
  fn = jax.shard_map(lambda t: optim.init_local(plan, optimizer, lay, offload.to_device(t),
                                                closed=closed),
                     mesh=plan.mesh, in_specs=(in_specs,), out_specs=specs, check_vma=False)
  out_sh = jax.tree.map(lambda s: s.sharding, optim.stored_shapes(plan, lay))
  return jax.jit(fn, out_shardings=out_sh)(trainable)


# --------------------------------------------------------------------------
# Full parameters


def unpack_all(plan: Plan, storage, *, replicate: bool = False):
  """Stored global arrays -> the original tree (global view; ``replicate``:
  see :func:`layout.unpack_storage_full`)."""
  leaves = [None] * len(plan.leaves)
  for u in plan.units:
    arrays = layout.unit_storage(plan, u, storage)
    for i, x in layout.unpack_storage_full(plan, u, arrays, replicate=replicate).items():
      leaves[i] = x
  for i, x in ignored_storage(plan, storage).items():
    leaves[i] = x[0]  # the first device's copy (PyTorch: rank 0's)
  return jax.tree_util.tree_unflatten(plan.treedef, leaves)
