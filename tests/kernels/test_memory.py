"""Compiled memory of attention fwd+bwd, read from XLA without running it."""

import jax
import jax.numpy as jnp

import ptx_kernels as pk

MiB = 2**20


def test_blockwise_32k_causal_grad_fits_in_256_mib():
  shape = jax.ShapeDtypeStruct((1, 32768, 1, 64), jnp.float32)

  def loss(q, k, v):
    return jnp.sum(pk.flash_attention(q, k, v)[0])

  mem = jax.jit(jax.grad(loss, (0, 1, 2))).lower(
      shape, shape, shape).compile().memory_analysis()
  total = (mem.temp_size_in_bytes + mem.argument_size_in_bytes
           + mem.output_size_in_bytes)
  assert total <= 256 * MiB, f"{total / MiB:.0f} MiB"
