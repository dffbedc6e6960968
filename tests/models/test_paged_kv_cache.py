"""Paged attention equals the reference over each row's contiguous keys, whatever pages hold them; no sink read."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ptx_kernels as pk
from ptx.model_config import ModelConfig
from ptx.models import paged_kv_cache
from ptx.sampling.engine.programs import reading_pairs

R, T, H, N, K, S, PAGES, M = 4, 3, 8, 2, 16, 4, 32, 6
# Cached positions per row before the call; row 3 is idle (no real tokens), row 2 a partial chunk.
LENGTHS = np.array([0, 9, 13, 5], np.int32)
NEW = np.array([3, 3, 1, 0], np.int32)
# Float32 on both sides, summed in another order (blocks vs one pass): a few ulps of values of size ~1.
ATOL = 1e-5


def _case(seed=0):
  rng = np.random.default_rng(seed)
  # Rows take scattered, distinct pages of one block; page 0 is the sink and holds garbage that must not leak in.
  pages = rng.permutation(np.arange(1, PAGES))[:R * M].reshape(R, M).astype(np.int32)
  k_pool, v_pool = (rng.normal(size=(PAGES, N, S, K)).astype(np.float32) for _ in range(2))
  q, k_new, v_new = (rng.normal(size=(R, T, heads, K)).astype(np.float32) for heads in (H, N, N))
  return pages, k_pool, v_pool, q, k_new, v_new


def _rows_view(pool, pages):
  """Each row's pages as its contiguous keys [R, M * S, N, K] (the pool is [P, N, S, K])."""
  return pool.transpose(0, 2, 1, 3)[pages].reshape(R, M * S, pool.shape[1], pool.shape[3])


def _expected(pages, k_pool, v_pool, q, k_new, v_new, **kw):
  """Reference attention of each row's real queries over its contiguous keys [0, length + new)."""
  k_rows, v_rows = (_rows_view(pool, pages).copy() for pool in (k_pool, v_pool))
  for r in range(R):
    for t in range(NEW[r]):
      k_rows[r, LENGTHS[r] + t], v_rows[r, LENGTHS[r] + t] = k_new[r, t], v_new[r, t]
  slots = np.broadcast_to(np.arange(M * S), (R, M * S))
  valid = (slots < (LENGTHS + NEW)[:, None]).astype(np.int32)
  positions = LENGTHS[:, None] + np.arange(T)[None]
  out, _ = pk.reference_attention(jnp.asarray(q), jnp.asarray(k_rows), jnp.asarray(v_rows), q_positions=positions,
                               kv_positions=slots, q_segment_ids=np.ones((R, T), np.int32), kv_segment_ids=valid,
                               **kw)
  return np.asarray(out), k_rows


def _pairs(pages, blocks=1):
  """Each row reads the pages its cached and new positions fill (rows 0 and 3 read 1 and 2 pages)."""
  return reading_pairs([row[:-(-end // S)] for row, end in zip(pages.tolist(), LENGTHS + NEW)], blocks)


def _attend(pages, pairs, k_pool, v_pool, q, k_new, v_new, *, window=None, softcap=None):
  cache = paged_kv_cache.PagedKVCache(k=(k_pool,), v=(v_pool,), page_table=jnp.asarray(pages),
                                      lengths=jnp.asarray(LENGTHS), new_tokens=jnp.asarray(NEW), pairs=pairs)
  positions = jnp.asarray(LENGTHS[:, None] + np.arange(T)[None])
  return cache.attend(0, q, k_new, v_new, positions=positions, window=window, softcap=softcap, scale=K ** -0.5)


@pytest.mark.parametrize("kw", [dict(), dict(window=4, softcap=5.0)], ids=["plain", "window_softcap"])
def test_paged_attention_equals_reference_over_contiguous_keys(kw):
  case = _case()
  out, cache = jax.jit(functools.partial(_attend, **kw))(case[0], _pairs(case[0]), *case[1:])
  expected, k_rows = _expected(*case, scale=K ** -0.5, **kw)
  for r in range(R):
    n = NEW[r]
    np.testing.assert_allclose(np.asarray(out[r, :n]), expected[r, :n], atol=ATOL, rtol=0)
  # The real tokens landed at their positions' pages; the new length counts them.
  k_after = _rows_view(np.asarray(cache.k[0]), case[0])
  for r in range(R):
    end = LENGTHS[r] + NEW[r]
    np.testing.assert_array_equal(k_after[r, :end], k_rows[r, :end])
  np.testing.assert_array_equal(np.asarray(cache.advance(T).lengths), LENGTHS + NEW)


def test_sink_page_contents_never_change_a_result():
  case = _case()
  pages, k_pool, v_pool = case[:3]
  poisoned = [pool.copy() for pool in (k_pool, v_pool)]
  for pool in poisoned:
    pool[paged_kv_cache.SINK_PAGE] = 1e6
  # Idle row 3 and the padding of row 2 write to the sink, and no row's table names it below its length.
  table = pages.copy()
  table[:, -1] = paged_kv_cache.SINK_PAGE
  clean = jax.jit(_attend)(table, _pairs(table), k_pool, v_pool, *case[3:])[0]
  dirty = jax.jit(_attend)(table, _pairs(table), *poisoned, *case[3:])[0]
  for r in range(R):
    np.testing.assert_array_equal(np.asarray(clean[r, :NEW[r]]), np.asarray(dirty[r, :NEW[r]]))


def test_sharded_pool_attends_and_copies_within_each_block(mesh):
  """Pages and rows split over data (2 blocks, local page ids), KV heads over tensor: the same numbers."""
  cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=H, n_kv_heads=4, head_dim=K, mlp_dim=32)
  rng = np.random.default_rng(1)
  pages, k_pool, v_pool, q, _, _ = _case()
  k_pool, v_pool = (rng.normal(size=(2 * PAGES, 4, S, K)).astype(np.float32) for _ in range(2))
  k_new, v_new = (rng.normal(size=(R, T, 4, K)).astype(np.float32) for _ in range(2))
  # Rows 0-1 live in block 0 (global pages 0..31), rows 2-3 in block 1 (global pages 32..63), with local ids.
  sharding = paged_kv_cache.pool_sharding(cfg, 2 * PAGES, S, mesh)
  assert sharding.spec[0] is not None and sharding.spec[1] == "tensor"
  on_mesh = lambda x: jax.device_put(x, sharding)  # noqa: E731
  rows = NamedSharding(mesh, P("data"))
  pairs = jax.device_put(_pairs(pages, blocks=2), rows)  # row ids local to each block, like the page ids
  on_rows = lambda x: jax.device_put(x, rows)  # noqa: E731
  with jax.set_mesh(mesh):
    out, cache = jax.jit(_attend)(on_rows(pages), pairs, on_mesh(k_pool), on_mesh(v_pool), on_rows(q),
                                  on_rows(k_new), on_rows(v_new))
  offsets = np.repeat([0, PAGES], R // 2)[:, None]
  expected, _ = _expected(pages + offsets, k_pool, v_pool, q, k_new, v_new, scale=K ** -0.5)
  for r in range(R):
    np.testing.assert_allclose(np.asarray(out[r, :NEW[r]]), expected[r, :NEW[r]], atol=ATOL, rtol=0)
  # A copy of local page 5 to local page 7 in both blocks moves global 5 -> 7 and 37 -> 39.
  with jax.set_mesh(mesh):
    src, dst = (jax.device_put(np.array(x, np.int32), rows) for x in ([5, 5], [7, 7]))
    k_copied, _ = jax.jit(paged_kv_cache.copy_pages)(cache.k, cache.v, src, dst)
  k_before, k_after = np.asarray(cache.k[0]), np.asarray(k_copied[0])
  np.testing.assert_array_equal(k_after[[7, 39]], k_before[[5, 37]])
  untouched = np.setdiff1d(np.arange(2 * PAGES), [7, 39])
  np.testing.assert_array_equal(k_after[untouched], k_before[untouched])
