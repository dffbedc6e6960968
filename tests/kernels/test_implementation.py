"""Choosing a flash kernel: names, the backend's default, and kernels the backend cannot run."""

import jax.numpy as jnp
import pytest

import ptx_kernels as pk
from ptx_kernels import implementation


def test_auto_is_blockwise_on_cpu_and_names_are_checked():
  assert implementation.choose("auto") == implementation.Kernel("blockwise")
  assert implementation.choose("pallas_tpu", interpret=True) == implementation.Kernel("pallas_tpu", True)
  with pytest.raises(ValueError, match="impl must be one of"):
    implementation.choose("flash")


@pytest.mark.parametrize("impl", implementation.PALLAS)
def test_a_pallas_kernel_off_its_backend_needs_the_interpreter(impl):
  x = jnp.zeros((1, 16, 1, 16))
  with pytest.raises(ValueError, match=f"{impl}' runs on a .PU, not on 'cpu'.*interpret=True"):
    pk.flash_attention(x, x, x, impl=impl)



@pytest.mark.parametrize("dtype, tiles", [(jnp.bfloat16, (128, 64)), (jnp.float16, (128, 64)),
                                          (jnp.float32, (64, 32))])
def test_the_gpu_kernel_default_tiles_follow_the_input_width(dtype, tiles):
  # Float32 inputs get the smaller tiles: 128 x 64 took Triton over a minute to compile on the H200.
  st = implementation.choose("pallas_gpu", True).static(None, 4096, 4096, 128, dtype, causal=True, softcap=None,
                                                         scale=None)
  assert (st.block_q, st.block_kv) == tiles == tuple(vars(pk.default_tiles("pallas_gpu", dtype)).values())
  # Named tiles win over the default; blockwise keeps BlockSizes()' 512 x 512 in any dtype.
  named = implementation.choose("pallas_gpu", True).static(pk.BlockSizes(32, 16), 4096, 4096, 128, dtype,
                                                           causal=True, softcap=None, scale=None)
  assert (named.block_q, named.block_kv) == (32, 16)
  assert pk.default_tiles("blockwise", dtype) == pk.BlockSizes()
