"""Ragged paged attention: each row's queries over the pages it holds, at a cost that follows the pages held.

K/V live in a pool of pages [P, S, KV, D] (S slots per page). The work is a
flat list of Q (row, page) pairs: pair i says that page pages[i] holds
positions [index[i] * S, (index[i] + 1) * S) of row rows[i]. Every pair's
page is gathered once ([Q, S, KV, D]), scored against its row's queries, and
the pairs of a row are merged by an online softmax over segments (max, sum of
exponentials, weighted values per row). Rows of very different lengths cost
what their own pages do, not the longest row's: the flat list is as long as
the pages actually held, where a dense [B, S_max] view costs B times the
longest. Pairs are sorted by row; padding pairs name a position past every
row's length (index >= ceil(max length / S)), so they are masked out.

Key slot s of pair i has position index[i] * S + s and is visible to query t
of row r = rows[i] iff it is below lengths[r] and, as in `mask.py`, causal
(q_position >= kv_position) and within the window. Float32 throughout; a row
with no visible key gets out 0 and lse -inf.
"""

import jax
import jax.numpy as jnp

from ptx_kernels import mask as mask_lib


def paged_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, *, rows: jax.Array, pages: jax.Array,
    index: jax.Array, lengths: jax.Array, q_positions: jax.Array, causal: bool = True, window=None,
    softcap: float | None = None, scale: float | None = None,
) -> tuple[jax.Array, jax.Array]:
  """Attention of T queries per row over the pages its (row, page) pairs name.

  Args:
    q: queries [R, T, H, D].
    k_pages: the key pool [P, S, KV, D].
    v_pages: the value pool [P, S, KV, Dv].
    rows: int32 [Q] the row of each pair, ascending.
    pages: int32 [Q] the page of each pair.
    index: int32 [Q] which page of its row the pair's page is (its first
      position over S).
    lengths: int32 [R] positions of each row that hold keys (the new
      tokens' included).
    q_positions: int32 [R, T] the queries' positions.
    causal, window, softcap, scale: as in `flash_attention`.

  Returns:
    (out [R, T, H, Dv] in q.dtype, lse [R, H, T] float32).
  """
  r, t, h, d = q.shape
  _, s, kvh, _ = k_pages.shape
  if q.shape[3] != k_pages.shape[3] or h % kvh or k_pages.shape[:3] != v_pages.shape[:3]:
    raise ValueError(f"q {q.shape}, k_pages {k_pages.shape} and v_pages {v_pages.shape} do not fit together")
  window = mask_lib.check_window(window)
  scale = d ** -0.5 if scale is None else scale
  g = h // kvh
  q_RKGTD = q.reshape(r, t, kvh, g, d).transpose(0, 2, 3, 1, 4).astype(jnp.float32)
  k_QSKD, v_QSKD = k_pages[pages].astype(jnp.float32), v_pages[pages].astype(jnp.float32)
  # Scores of each pair's page against its row's queries: [Q, KV, G, T, S].
  scores = jnp.einsum("qkgtd,qskd->qkgts", q_RKGTD[rows], k_QSKD) * scale
  if softcap is not None:
    scores = softcap * jnp.tanh(scores / softcap)
  kv_pos_QS = index[:, None] * s + jnp.arange(s, dtype=jnp.int32)[None]
  dist_QTS = q_positions[rows][:, :, None] - kv_pos_QS[:, None, :]
  ok = (kv_pos_QS < lengths[rows][:, None])[:, None, :]
  if causal:
    ok &= dist_QTS >= 0
  if window is not None:
    ok &= dist_QTS < window
  scores = jnp.where(ok[:, None, None], scores, -jnp.inf)
  # The online softmax across a row's pairs, as segment reductions over the sorted rows.
  segments = dict(segment_ids=rows, num_segments=r, indices_are_sorted=True)
  m_RKGT = jax.ops.segment_max(jnp.max(scores, axis=-1), **segments)
  m_safe = jnp.where(jnp.isfinite(m_RKGT), m_RKGT, 0.0)
  p = jnp.exp(scores - m_safe[rows][..., None])
  l_RKGT = jax.ops.segment_sum(jnp.sum(p, axis=-1), **segments)
  acc = jax.ops.segment_sum(jnp.einsum("qkgts,qskd->qkgtd", p, v_QSKD), **segments)
  safe = jnp.where(l_RKGT > 0, l_RKGT, 1.0)
  out = (acc / safe[..., None]).transpose(0, 3, 1, 2, 4).reshape(r, t, h, -1)
  lse = jnp.where(l_RKGT > 0, m_safe + jnp.log(safe), -jnp.inf).reshape(r, h, t)
  return out.astype(q.dtype), lse
