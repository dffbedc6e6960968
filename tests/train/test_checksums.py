"""Checkpoint checksums: one fingerprint per array whatever its layout, and any changed element changes it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ptx.config import MeshConfig
from ptx.sharding import make_mesh
from ptx.train import checksums


def _tree():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(16,)), jnp.bfloat16),
          "count": jnp.asarray(7, jnp.int32),
          "mask": jnp.asarray(rng.random(8) > 0.5),
          "key": jax.random.key(3),
          "skipped": None}


def test_the_fingerprint_does_not_depend_on_the_mesh_or_sharding():
  tree = _tree()
  single = checksums.array_checksums(tree)
  assert set(single) == {"['w']", "['b']", "['count']", "['mask']", "['key']"}
  for axes, spec in (((8, 1), PartitionSpec("fsdp", None)), ((2, 4), PartitionSpec("data", "fsdp")),
                     ((1, 8), PartitionSpec(None, "fsdp"))):
    mesh = make_mesh(MeshConfig(data=axes[0], fsdp=axes[1]))
    sharded = dict(tree, w=jax.device_put(tree["w"], NamedSharding(mesh, spec)))
    assert checksums.array_checksums(sharded) == single, f"mesh {axes}"


@pytest.mark.parametrize("leaf", ["w", "b", "count", "mask"])
def test_one_changed_element_changes_the_fingerprint(leaf):
  tree = _tree()
  before = checksums.array_checksums(tree)
  flat = np.array(tree[leaf]).reshape(-1)
  flat[flat.size // 2] = (~flat[flat.size // 2]) if flat.dtype == bool else flat[flat.size // 2] + 1
  changed = dict(tree, **{leaf: jnp.asarray(flat.reshape(np.shape(tree[leaf])), tree[leaf].dtype)})
  after = checksums.array_checksums(changed)
  assert after[f"['{leaf}']"] != before[f"['{leaf}']"]
  assert {k: v for k, v in after.items() if k != f"['{leaf}']"} == \
      {k: v for k, v in before.items() if k != f"['{leaf}']"}


def test_swapping_two_elements_changes_the_fingerprint():
  """Position matters: a sum without position weights would not see two values trade places."""
  w = np.arange(16, dtype=np.float32)
  swapped = w.copy()
  swapped[[3, 11]] = swapped[[11, 3]]
  assert checksums.array_checksums([jnp.asarray(w)]) != checksums.array_checksums([jnp.asarray(swapped)])


def test_host_checksums_see_dtype_shape_values_and_keys():
  state = {"read": 12, "parent": {"next_index": 3}, "rows": np.arange(6, dtype=np.int32).reshape(2, 3)}
  base = checksums.host_checksum(state)
  assert checksums.host_checksum(dict(state)) == base
  assert checksums.host_checksum({**state, "read": 13}) != base
  assert checksums.host_checksum({**state, "rows": state["rows"].reshape(3, 2)}) != base
  assert checksums.host_checksum({**state, "rows": state["rows"].astype(np.int64)}) != base
  assert checksums.gathered(base) == [base]
