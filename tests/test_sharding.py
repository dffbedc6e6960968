"""Mesh construction and the logical-axis rules."""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from ptx import sharding
from ptx.config import MeshConfig


def test_mesh_fills_the_free_axis_and_is_auto():
  mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=-1, tensor=2, seq=1))
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2, "seq": 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize("cfg, message", [
    (MeshConfig(data=-1, fsdp=-1), "at most one axis"),
    (MeshConfig(data=3, fsdp=-1), "do not split"),
    (MeshConfig(data=2, fsdp=2, tensor=1, seq=1), "needs 4 devices, have 8"),
    (MeshConfig(data=0, fsdp=-1), "positive"),
])
def test_bad_mesh_sizes(cfg, message):
  with pytest.raises(ValueError, match=message):
    sharding.make_mesh(cfg)


def test_parameter_and_activation_rules_differ(mesh):
  names = ("batch", "seq", "embed")
  assert sharding.logical_to_spec(names, kind="activations") == P(("data", "fsdp", "expert"), "seq", None)
  assert sharding.logical_to_spec(("embed", "mlp"), kind="params") == P(("fsdp", "expert"), "tensor")
  # The fixture's mesh has no expert parallelism (expert=1): the specs are those of a mesh without the axis.
  assert sharding.logical_to_spec(names, shape=(4, 8, 16), mesh=mesh) == P(("data", "fsdp"), "seq", None)
  assert sharding.logical_to_spec(("embed", "mlp"), kind="params", shape=(16, 8), mesh=mesh) == P("fsdp", "tensor")


def test_expert_axis_splits_experts_first_and_doubles_as_fsdp_elsewhere():
  """MaxText's layout: experts over `expert`; other weights' embed and the batch over it too, never twice per array."""
  mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=2, expert=4, tensor=1, seq=1))
  spec = lambda names, shape, kind="params": sharding.logical_to_spec(names, kind=kind, shape=shape, mesh=mesh)
  assert spec(("experts", "embed", "mlp"), (8, 16, 6)) == P("expert", "fsdp", "tensor")
  assert spec(("experts", "mlp", "embed"), (8, 6, 16)) == P("expert", "tensor", "fsdp")
  assert spec(("embed", "mlp"), (16, 6)) == P(("fsdp", "expert"), "tensor")
  assert spec(("batch", "seq"), (8, 5), "activations") == P(("data", "fsdp", "expert"), "seq")
  # 6 experts do not split over 4 devices: the expert weight is replicated along `expert` by experts, and its
  # embed dimension takes the axis instead, as every other weight's does.
  assert spec(("experts", "embed", "mlp"), (6, 16, 6)) == P(None, ("fsdp", "expert"), "tensor")
  assert sharding.batch_sharding(mesh).spec == P(("data", "fsdp", "expert"), "seq")


def test_collisions_raise():
  rules = sharding.Rules(params={"heads": "tensor", "mlp": "tensor"}, activations={})
  with pytest.raises(ValueError, match="both map to mesh axis 'tensor'"):
    sharding.logical_to_spec(("heads", "mlp"), rules, kind="params")


def test_unknown_names_raise():
  with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
    sharding.logical_to_spec(("hidden",))
  with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
    sharding.Rules(params={"heads": "model"}, activations={})


def test_axes_that_do_not_divide_are_replicated(mesh):
  # 2 KV heads cannot split over tensor=4; 8 query heads can.
  assert sharding.logical_to_spec(("kv_heads",), kind="params", shape=(2,), mesh=mesh) == P(None)
  assert sharding.logical_to_spec(("heads",), kind="params", shape=(8,), mesh=mesh) == P("tensor")
  # batch over (data=2, fsdp=1): 6 rows split over data only.
  assert sharding.logical_to_spec(("batch",), shape=(6,), mesh=mesh) == P(("data", "fsdp"))
  assert sharding.logical_to_spec(("batch",), shape=(3,), mesh=mesh) == P(None)


def test_named_shardings_for_a_tree(mesh):
  names = {"w": ("embed", "mlp"), "b": ("mlp",)}
  shapes = {"w": (16, 8), "b": (8,)}
  out = sharding.named_shardings(names, shapes, mesh)
  assert out["w"].spec == P("fsdp", "tensor") and out["b"].spec == P("tensor")
  with pytest.raises(ValueError, match="do not match shape"):
    sharding.named_shardings({"w": ("embed",)}, {"w": (2, 2)}, mesh)


def test_constrain_is_a_no_op_without_a_mesh_and_applies_under_one(mesh):
  x = jax.numpy.ones((4, 8, 16))
  assert sharding.constrain(x, ("batch", "seq", "mlp")) is x
  f = jax.jit(lambda x: sharding.constrain(x * 2, ("batch", "seq", "mlp")))
  with jax.set_mesh(mesh):
    y = f(x)
  want = jax.sharding.NamedSharding(mesh, P(("data", "fsdp"), "seq", "tensor"))
  assert y.sharding.is_equivalent_to(want, 3) and y.addressable_shards[0].data.shape == (2, 8, 4)
