"""Test setup: 8 fake CPU devices before JAX is imported, strict numerics."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (must follow the XLA_FLAGS above)
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_threefry_partitionable", True)


@pytest.fixture
def mesh():
  """A (data=2, tensor=4) mesh over the 8 fake devices."""
  from ptx.config import MeshConfig
  from ptx.sharding import make_mesh

  return make_mesh(MeshConfig(data=2, fsdp=1, tensor=4, seq=1))
