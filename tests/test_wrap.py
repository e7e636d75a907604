"""Wrap policies choose units the way PyTorch's _recursive_wrap does."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import fsdp_jax
from fsdp_jax._src import lora as lora_lib
from fsdp_jax._src.build import build_plan

from helpers import mesh_for


def _units(params, policy, **kw):
  mesh = mesh_for(fsdp_jax.ShardingStrategy.FULL_SHARD, 2)
  cfg = fsdp_jax.FSDPConfig(auto_wrap_policy=policy, **kw)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  plan = build_plan(abstract, mesh=mesh, config=cfg)
  return {u.display_name: sorted(plan.leaves[i].name for i in u.leaf_ids) for u in plan.units}


def z(*shape):
  return jnp.zeros(shape)


TREE = {
    "a": {"x": z(10, 10)},              # 100 params
    "b": {"y": z(3)},                   # 3
    "c": [{"w": z(20, 20)}, {"w": z(20, 20)}],   # a list (ModuleList) of 2 x 400
    "big": {"child": {"k": z(150)}, "own": z(60)},
}


def test_size_based_respects_min_num_params_and_lists():
  policy = functools.partial(fsdp_jax.size_based_auto_wrap_policy, min_num_params=100)
  units = _units(TREE, policy)
  # "c" is a list: its elements are wrapped, the list itself never is.
  assert units["c.0"] == ["c.0.w"] and units["c.1"] == ["c.1.w"]
  assert "c" not in units
  assert units["a"] == ["a.x"]
  # "big": its child (150) is wrapped; the 60 it has left is < 100, so "big"
  # is not wrapped and the root takes "own".
  assert units["big.child"] == ["big.child.k"]
  assert "big" not in units
  assert units["<root>"] == ["b.y", "big.own"]


def test_size_based_parent_decides_on_what_children_left():
  policy = functools.partial(fsdp_jax.size_based_auto_wrap_policy, min_num_params=50)
  units = _units(TREE, policy)
  assert units["big.child"] == ["big.child.k"]
  assert units["big"] == ["big.own"]  # 60 >= 50 remains after the child
  assert units["<root>"] == ["b.y"]


def test_size_based_does_not_descend_into_small_nodes():
  # With min 1000 nothing is large enough: everything is the root unit.
  policy = functools.partial(fsdp_jax.size_based_auto_wrap_policy, min_num_params=1000)
  units = _units(TREE, policy)
  assert list(units) == ["<root>"]


def test_size_based_force_leaf_modules():
  policy = functools.partial(fsdp_jax.size_based_auto_wrap_policy, min_num_params=100,
                             force_leaf_modules={"big"})
  units = _units(TREE, policy)
  # As in PyTorch's _recursive_wrap, a node that is not descended into is not
  # wrapped either: "big" and its child fall to the root unit.
  assert "big" not in units and "big.child" not in units
  assert units["<root>"] == ["b.y", "big.child.k", "big.own"]


def test_module_wrap_policy_with_patterns():
  units = _units(TREE, fsdp_jax.ModuleWrapPolicy({"c.*", "a"}))
  assert set(units) == {"a", "c.0", "c.1", "<root>"}


def test_lambda_and_custom_policies():
  lam = functools.partial(fsdp_jax.lambda_auto_wrap_policy,
                          lambda_fn=lambda node: node.name == "big.child")
  assert set(_units(TREE, lam)) == {"big.child", "<root>"}
  custom = fsdp_jax.CustomPolicy(lambda node: node.numel == 400)
  assert set(_units(TREE, custom)) == {"c.0", "c.1", "<root>"}


def test_module_wrap_policy_with_linen_classes():
  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(6)(nn.LayerNorm()(x))

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(6)(x)
      for _ in range(3):
        x = Block()(x)
      return nn.Dense(2)(x)

  model = Model()
  x = jnp.ones((2, 5))
  classes = fsdp_jax.module_classes(model.init, jax.random.key(0), x)
  assert classes[("params", "Block_0")] is Block
  mesh = mesh_for(fsdp_jax.ShardingStrategy.FULL_SHARD, 4)
  cfg = fsdp_jax.FSDPConfig(auto_wrap_policy=fsdp_jax.ModuleWrapPolicy({Block}))
  # init_fn captures the module classes itself.
  state = fsdp_jax.init_train_state(init_fn=lambda k: model.init(k, x), rng=jax.random.key(0),
                                    optimizer=optax.sgd(0.1), mesh=mesh, config=cfg)
  names = [u.display_name for u in state.plan.units]
  assert names == ["params.Block_0", "params.Block_1", "params.Block_2", "<root>"]
  # Each block unit holds exactly the block's Dense and LayerNorm parameters.
  block0 = state.plan.units[0]
  assert sorted(state.plan.leaves[i].name for i in block0.leaf_ids) == [
      "params.Block_0.Dense_0.bias", "params.Block_0.Dense_0.kernel",
      "params.Block_0.LayerNorm_0.bias", "params.Block_0.LayerNorm_0.scale"]


def test_policy_that_claims_no_leaf_is_an_error():
  with pytest.raises(ValueError, match=r"claims no parameter.*'a'"):
    _units(TREE, fsdp_jax.ModuleWrapPolicy({"encoder.*"}))


def test_stacked_pattern_that_matches_nothing_is_an_error():
  with pytest.raises(ValueError, match="stacked_layers pattern 'layers' matches no subtree"):
    _units(TREE, None, stacked_layers=("layers",))


def test_stacked_unit_needs_a_common_layer_axis():
  tree = {"layers": {"w": z(4, 3, 3), "b": z(5, 3)}}
  with pytest.raises(ValueError, match=r"same leading layer axis.*layers.b: \(5, 3\)"):
    _units(tree, None, stacked_layers=("layers",))


class _LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(6)(nn.LayerNorm()(x))


class _LinenModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(2):
      x = _LinenBlock()(x)
    return nn.Dense(2)(x)


def _plan_units(abstract, policy, classes):
  mesh = mesh_for(fsdp_jax.ShardingStrategy.FULL_SHARD, 2)
  plan = build_plan(abstract, mesh=mesh, config=fsdp_jax.FSDPConfig(auto_wrap_policy=policy),
                    module_types=classes)
  return {u.display_name: sorted(plan.leaves[i].name for i in u.leaf_ids) for u in plan.units}


def _linen_tree():
  init = lambda k: _LinenModel().init(k, jnp.ones((2, 5)))
  return jax.eval_shape(init, jax.random.key(0)), fsdp_jax.module_classes(init, jax.random.key(0))


def test_module_wrap_policy_takes_a_linen_class_name():
  abstract, classes = _linen_tree()
  by_name = _plan_units(abstract, fsdp_jax.ModuleWrapPolicy({"_LinenBlock"}), classes)
  assert by_name == _plan_units(abstract, fsdp_jax.ModuleWrapPolicy({_LinenBlock}), classes)
  assert list(by_name) == ["params._LinenBlock_0", "params._LinenBlock_1", "<root>"]
  # A name of a Flax class works the same; names and classes mix.
  dense = _plan_units(abstract, fsdp_jax.ModuleWrapPolicy(["Dense", _LinenBlock]), classes)
  assert dense == _plan_units(abstract, fsdp_jax.ModuleWrapPolicy([nn.Dense, _LinenBlock]),
                              classes)
  assert set(dense) == {"params._LinenBlock_0.Dense_0", "params._LinenBlock_0",
                        "params._LinenBlock_1.Dense_0", "params._LinenBlock_1",
                        "params.Dense_0"}


def test_module_wrap_policy_string_that_matches_a_path_stays_a_pattern():
  abstract, classes = _linen_tree()
  # "params.Dense_0" is a path; "Dense" alone matches no path, so it is the class.
  units = _plan_units(abstract, fsdp_jax.ModuleWrapPolicy({"params.Dense_0"}), classes)
  assert list(units) == ["params.Dense_0", "<root>"]


def test_module_wrap_policy_takes_nnx_and_equinox_class_names():
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import equinox as eqx  # pylint: disable=import-outside-toplevel

  class NnxBlock(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(4, 4, rngs=rngs)

  class NnxModel(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([NnxBlock(rngs), NnxBlock(rngs)])
      self.out = nnx.Linear(4, 2, rngs=rngs)

  model = NnxModel(nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  classes = fsdp_jax.module_classes(model)
  units = _plan_units(params, fsdp_jax.ModuleWrapPolicy({"NnxBlock"}), classes)
  assert units == _plan_units(params, fsdp_jax.ModuleWrapPolicy({NnxBlock}), classes)
  assert list(units) == ["blocks.0", "blocks.1", "<root>"]

  class EqxBlock(eqx.Module):
    linear: eqx.nn.Linear

    def __init__(self, key):
      self.linear = eqx.nn.Linear(4, 4, key=key)

  class EqxModel(eqx.Module):
    blocks: list
    out: eqx.nn.Linear

    def __init__(self, key):
      k = jax.random.split(key, 3)
      self.blocks = [EqxBlock(k[0]), EqxBlock(k[1])]
      self.out = eqx.nn.Linear(4, 2, key=k[2])

  emodel = EqxModel(jax.random.key(0))
  eparams = eqx.filter(emodel, eqx.is_inexact_array)
  eclasses = fsdp_jax.module_classes(emodel)
  units = _plan_units(eparams, fsdp_jax.ModuleWrapPolicy({"EqxBlock"}), eclasses)
  assert units == _plan_units(eparams, fsdp_jax.ModuleWrapPolicy({EqxBlock}), eclasses)
  assert list(units) == ["blocks.0", "blocks.1", "<root>"]


def test_module_wrap_policy_string_that_is_neither_path_nor_class_name():
  abstract, classes = _linen_tree()
  with pytest.raises(ValueError) as e:
    _plan_units(abstract, fsdp_jax.ModuleWrapPolicy({"Blok"}), classes)
  msg = str(e.value)
  assert "'Blok' is neither a subtree path pattern nor a module class name" in msg
  assert "dotted path pattern" in msg and "'params.layers_*'" in msg
  assert "'params._LinenBlock_0'" in msg
  assert "or the name of a module class" in msg
  assert "'Dense', 'LayerNorm', '_LinenBlock', '_LinenModel'" in msg
  assert "ModuleWrapPolicy({Dense})" in msg and "ModuleWrapPolicy({'Dense'})" in msg
  # A plain tree has no module classes: the message says how to give them.
  with pytest.raises(ValueError, match=r"'Block' is neither.*no module classes are "
                                       r"known.*module_classes=fsdp_jax.module_classes"):
    _units(TREE, fsdp_jax.ModuleWrapPolicy({"Block"}))


# --------------------------------------------------------------------------
# A module pattern names the module's weight, whatever its leaf is called

WEIGHTS = {
    "embed": {"embedding": z(12, 8)},                        # Flax's nn.Embed
    "attn": {"q": {"w": z(8, 2, 4), "b": z(2, 4)},           # einsum modules (Haiku, tunix)
             "o": {"w": z(2, 4, 8)}},
    "mlp": {"up": {"proj": z(8, 12), "b": z(12)}},           # one leaf of 2 or more dims
    "norm": {"scale": z(8)},
}


def test_module_patterns_name_w_embedding_and_lone_matrix_leaves():
  """LoRA targets and tensor-parallel rules name a module's weight: its
  'kernel'/'weight'/'w'/'embedding' leaf, else its one leaf of two or more
  dims (a colwise rule takes the module's bias too); ignored_states (as
  LoRA's trainable) name the module's whole subtree."""
  lora = fsdp_jax.LoRA(targets=("q", "o", "up", "embed"), input_dims={"o": 2})
  names = {t.name for t in lora_lib.find_targets(WEIGHTS, lora).values()}
  assert names == {"attn.q.w", "attn.o.w", "mlp.up.proj", "embed.embedding"}
  tp = fsdp_jax.TensorParallel(rules=[("embed", ("tensor", None)),
                                      ("*.q", (None, "tensor", None)), ("up", "colwise")])
  mesh = fsdp_jax.make_mesh(shard=2, tensor=2, devices=jax.devices()[:4])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), WEIGHTS)
  plan = build_plan(abstract, mesh=mesh, config=fsdp_jax.FSDPConfig(
      tensor_parallel=tp, use_orig_params=True, ignored_states=("norm",)))
  dims = {l.name: l.tensor_dim for l in plan.leaves if l.tensor_dim is not None}
  assert dims == {"embed.embedding": 0, "attn.q.w": 1, "mlp.up.proj": 1, "mlp.up.b": 0}
  assert [l.name for l in plan.ignored_leaves] == ["norm.scale"]


def test_module_with_several_weights_is_refused_naming_them_and_the_fix():
  tree = {"attn": {"qkv": {"wa": z(8, 16), "wb": z(8, 16), "bias": z(16)}}}
  match = (r"names module 'attn.qkv', which holds several weights: 'wa' \(8, 16\), 'wb' "
           r"\(8, 16\). Fix: name the leaf itself, e.g. 'attn.qkv.wa' \(or '\*.qkv.wa'")
  with pytest.raises(ValueError, match="LoRA target 'qkv' " + match):
    lora_lib.find_targets(tree, fsdp_jax.LoRA(targets=("qkv",)))
  mesh = fsdp_jax.make_mesh(shard=2, tensor=2, devices=jax.devices()[:4])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  with pytest.raises(ValueError, match=r"TensorParallel rule '\*.qkv' " + match):
    build_plan(abstract, mesh=mesh, config=fsdp_jax.FSDPConfig(
        tensor_parallel=fsdp_jax.TensorParallel(rules=[("*.qkv", "colwise")])))
  # Naming the leaf works.
  assert [t.name for t in lora_lib.find_targets(
      tree, fsdp_jax.LoRA(targets=("qkv.wa",))).values()] == ["attn.qkv.wa"]
