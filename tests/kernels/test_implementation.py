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

