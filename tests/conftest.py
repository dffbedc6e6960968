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


@pytest.fixture
def tiny_config():
  """A float32 Llama-style config whose dimensions are pairwise distinct.

  Sharded dimensions are distinct multiples of the mesh sizes (heads 8,
  mlp 96, vocab 264) and unsharded ones are primes (head_dim 7 is odd, so
  RoPE uses head_dim 14), so a swapped axis cannot pass unnoticed.
  """
  from ptx.config import ModelConfig

  return ModelConfig(vocab_size=264, d_model=40, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=14,
                     mlp_dim=96, rope_theta=10_000.0, init_std=0.1)
