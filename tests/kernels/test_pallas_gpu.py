"""GPU Pallas (Triton-style) flash attention, interpreted on CPU, == reference."""

import functools

import jax.numpy as jnp
import pytest

import ptx_kernels as pk

TILES = pk.BlockSizes(block_q=32, block_kv=16)


def _gpu(**kw):
  return functools.partial(pk.flash_attention, impl="pallas_gpu", interpret=True,
                           block_sizes=TILES, **kw)


@pytest.mark.parametrize("h, kv, kw", [
    (8, 2, dict(packed=True)),
    (8, 1, dict(window=9, softcap=7.5)),
    (4, 4, dict(causal=False)),
])
def test_matches_reference_f32(helpers, h, kv, kw):
  b, t, d = 2, 64, 16
  q, k, v = helpers.make_qkv(h * kv, b, t, t, h, kv, d)
  kw = dict(kw)
  if kw.pop("packed", False):
    seg = helpers.ragged_segments(1, b, t)
    kw.update(q_segment_ids=seg, kv_segment_ids=seg)
  helpers.assert_matches(_gpu(**kw), functools.partial(pk.reference_attention, **kw),
                         q, k, v)


def test_bf16_and_explicit_positions(helpers):
  q, k, v = helpers.make_qkv(3, 1, 32, 48, 8, 1, 32, jnp.bfloat16)
  pos = dict(q_positions=jnp.arange(16, 48)[None], kv_positions=jnp.arange(48)[None])
  helpers.assert_matches(_gpu(**pos), functools.partial(pk.reference_attention, **pos),
                         q, k, v, tol=1e-2)  # bfloat16: see assert_matches


def test_head_dim_must_suit_triton():
  x = jnp.zeros((1, 16, 1, 24))
  with pytest.raises(ValueError, match="power of two"):
    pk.flash_attention(x, x, x, impl="pallas_gpu", interpret=True)
