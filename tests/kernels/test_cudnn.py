"""cudnn_attention's mapping of ptx's rule onto jax.nn.dot_product_attention, run on the CPU through JAX's "xla".

cuDNN itself needs a GPU; what ptx writes is the mapping (row lengths, the window's bounds, the padding rows' zeros,
GQA, the scale), and JAX's "xla" implementation computes the same arguments as cuDNN does.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ptx_kernels as pk

B, T, H, KV, D = 2, 32, 4, 2, 16
LENGTHS = np.array([T, 21], np.int32)  # a full row and a padded one


def _reference(q, k, v, *, window=None, scale=None):
  """ptx's reference under right-padded rows' segment ids."""
  segments = jnp.asarray((np.arange(T)[None] < LENGTHS[:, None]).astype(np.int32))
  return pk.reference_attention(q, k, v, q_segment_ids=segments, kv_segment_ids=segments, window=window,
                                scale=scale)[0]


def _out_and_grads(fn, q, k, v):
  w = jax.random.normal(jax.random.key(3), q.shape, jnp.float32)
  loss = lambda q, k, v: jnp.sum(fn(q, k, v) * w)  # noqa: E731
  return fn(q, k, v), jax.grad(loss, (0, 1, 2))(q, k, v)


@pytest.mark.parametrize("window, scale", [(None, None), (5, 0.3)])
def test_right_padded_rows_match_the_reference(helpers, window, scale):
  q, k, v = helpers.make_qkv(0, B, T, T, H, KV, D)
  fast = functools.partial(pk.cudnn_attention, lengths=jnp.asarray(LENGTHS), window=window, scale=scale,
                           implementation="xla")
  out, grads = jax.jit(functools.partial(_out_and_grads, fast))(q, k, v)
  ref, ref_grads = jax.jit(functools.partial(_out_and_grads, functools.partial(_reference, window=window,
                                                                               scale=scale)))(q, k, v)
  # float32 both sides, the softmax summed in another order: ~1e-6 of the scale (helpers.assert_matches).
  assert helpers.rel_err(out, ref) < 1e-5
  assert np.all(np.asarray(out)[1, LENGTHS[1]:] == 0)
  for g, r in zip(grads, ref_grads):
    assert np.all(np.isfinite(np.asarray(g))) and helpers.rel_err(g, r) < 1e-5


def test_refuses_what_cudnn_cannot_say(helpers):
  q, k, v = helpers.make_qkv(0, 1, 8, 8, 2, 1, 8)
  with pytest.raises(ValueError, match="values as wide as keys"):
    pk.cudnn_attention(q, k, v[..., :4], lengths=jnp.array([8]), implementation="xla")
  with pytest.raises(ValueError, match="fixed at compile time"):
    pk.cudnn_attention(q, k, v, lengths=jnp.array([8]), window=jnp.int32(3), implementation="xla")
