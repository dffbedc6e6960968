"""JAX's splash attention in the Pallas interpreter == ptx's reference with ptx's masks, forward and gradients.

The reference masks by position and is given positions that restart at each segment, as ptx's packer writes them;
splash masks by index. Equal results show the mapping of `ptx_kernels.splash` (precondition in its docstring).
T = 200 on 128-tiles: padded to 256 with segment id 0, a 2 x 2 grid of tiles, the second query tile of row 0 all
padding.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ptx_kernels as pk

B, T, D = 2, 200, 16
# Row 0: two documents, then padding from 110 on (through the whole second 128-tile); row 1: two documents and no
# padding of its own, so its last document meets the kernel's tile padding.
SEGMENTS = np.stack([np.r_[np.full(90, 1), np.full(20, 2), np.zeros(90)],
                     np.r_[np.full(130, 5), np.full(70, 7)]]).astype(np.int32)
CASES = {
    # name: (q heads, kv heads, value width, mask keywords)
    "causal_gqa": (4, 2, D, dict()),
    "causal_window_softcap_scale_mqa": (2, 1, D, dict(window=37, softcap=2.0, scale=0.3)),
    "noncausal_window_wider_values": (2, 2, 24, dict(causal=False, window=20)),
    "noncausal_gqa": (4, 2, D, dict(causal=False)),
}


def _restarting_positions(segments: np.ndarray) -> np.ndarray:
  """Token positions that restart at 0 wherever the segment id changes."""
  index = np.arange(segments.shape[1])
  changes = np.diff(segments, axis=1, prepend=-1) != 0
  return index - np.maximum.accumulate(np.where(changes, index, 0), axis=1)


def _outputs_and_grads(attention, q, k, v):
  """out and the gradients in q, k, v of a random weighting of it, from one jitted program."""
  def loss(q, k, v):
    out = attention(q, k, v)
    return jnp.sum(out * jax.random.normal(jax.random.key(5), out.shape, out.dtype)), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v)
  return out, grads


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference_f32(helpers, name):
  h, kv, dv, kw = CASES[name]
  q, k, _ = helpers.make_qkv(len(name), B, T, T, h, kv, D)
  v = jax.random.normal(jax.random.key(len(name) + 1), (B, T, kv, dv), jnp.float32)
  seg = jnp.asarray(SEGMENTS)
  pos = jnp.asarray(_restarting_positions(SEGMENTS))
  splash = functools.partial(pk.splash_attention, q_segment_ids=seg, kv_segment_ids=seg, block_sizes=pk.BlockSizes(
      128, 128), interpret=True, **kw)
  reference = lambda q, k, v: pk.reference_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg,
                                                     q_positions=pos, kv_positions=pos, **kw)[0]
  out, grads = _outputs_and_grads(splash, q, k, v)
  ref_out, ref_grads = _outputs_and_grads(reference, q, k, v)
  # float32 sums of the softmax and its gradients in another order (tiles, online rescaling): ~1e-6 of the scale.
  tol = 1e-5
  assert out.shape == ref_out.shape and out.dtype == q.dtype
  assert helpers.rel_err(out, ref_out) < tol
  for g, r in zip(grads, ref_grads):
    assert helpers.rel_err(g, r) < tol
  # Padding rows and keys are exact zeros, not merely small: out, dQ of padding queries, dK and dV of padding keys.
  padding = SEGMENTS == 0
  assert np.all(np.asarray(out)[padding] == 0) and np.all(np.asarray(grads[0])[padding] == 0)
  assert np.all(np.asarray(grads[1])[padding] == 0) and np.all(np.asarray(grads[2])[padding] == 0)


def test_refuses_what_splash_cannot_run():
  x = jnp.zeros((1, 128, 2, 16))
  with pytest.raises(ValueError, match="self-attention: q and k must be equally long"):
    pk.splash_attention(x, jnp.zeros((1, 256, 2, 16)), jnp.zeros((1, 256, 2, 16)), interpret=True)
  with pytest.raises(ValueError, match="window must be a Python int >= 1"):
    pk.splash_attention(x, x, x, window=jnp.int32(8), interpret=True)
  with pytest.raises(ValueError, match="window must be a Python int >= 1"):
    pk.splash_attention(x, x, x, window=0, interpret=True)
  with pytest.raises(ValueError, match="runs on a TPU, not on 'cpu': pass interpret=True"):
    pk.splash_attention(x, x, x)
