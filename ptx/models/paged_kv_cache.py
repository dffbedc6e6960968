"""A paged KV cache: every layer's K/V in a pool of fixed-size pages, read through per-row page tables.

Layout (L layers, P pages, S slots per page, N kv heads, K head_dim, R rows,
M pages per row, Q (row, page) pairs):

  k, v         L arrays [P, N, S, K] in the compute dtype (after RoPE); heads
               before slots, as in `kv_cache`, so pages feed the products untransposed;
               or L `Int8Pages`: int8 values [P, N, S, K] and float32 scales
               [P, N, S] (absmax / 127 of each slot and head, `kv_cache.quantize`).
               Or, where the decode step scans the layers, one pool of every
               layer's pages stacked, [L, P, N, S, K] (one `Int8Pages` of
               [L, P, ...] arrays): see "Layers" below.
               Multi-head latent attention pages one latent per slot (N = 1,
               K = `ModelConfig.cache_head_dim`) and no values: v is None and
               attention reads them as the first kv_lora_rank columns of k
  page_table   int32 [R, M]: page m of row r holds its positions [m * S, (m + 1) * S)
  lengths      int32 [R]: positions of each row already cached
  new_tokens   int32 [R]: how many of this call's T tokens are real for each
               row; the others are padding, written to the sink page
  pairs        `Pairs`: the (row, page, index) triples attention reads, sorted
               by row, padded with pairs past every row's length

A row's position p lives at slot p % S of page page_table[r, p // S]: there is
no left padding, the position is the index. Page 0 (of each shard, below) is
the sink: padding tokens and idle rows write there and no row's table names it
for a position below its length, so it is never read as data. The host side
(`ptx.sampling.engine.pages`) owns which pages a row holds; a page may sit in
several rows' tables (the G samples of a prompt share its full pages).

Attention (`ptx_kernels.paged_attention`) reads the pages the pairs name: the
caller lists each row's pages up to what the call fills, so a call costs the
pages the rows hold, not R times the longest row. This pure-JAX path is
XLA:CPU's and the reference of the Pallas kernel.

Which kernel attends (`kernel_for`, read from `ModelConfig.attention_impl`
once, by the rollout engine): this pure-JAX path, or with "pallas" the
platform's Pallas paged kernel (`ptx_kernels.paged_pallas`: it reads pages in
place where this path gathers them). "auto" keeps the pure-JAX path until the
Pallas paged kernels have been checked compiled on a device (they have run
interpreted only; `benchmarks/device_check.py`'s engine section compares the two).

Layers: the pool holds one array per layer where the decoder runs its
layers unrolled, and all of them stacked where it scans them
(`kv_cache.decode_scans`, read by `init_pool`; the decoder runs the layers as
the pool holds them). A stacked pool rides in the scan's carry, and layer l's
page p is page l * P + p of the same array seen as one pool of L * P pages (a
reshape, no copy): the writes scatter there and attention gathers there, the
layer index folded into the page ids, so no layer's pages are ever copied
out of the stack, and the Pallas paged kernels read it in place too.

Int8 pages (`init_pool(..., int8=True)`) hold a quarter of float32's bytes
(half of bfloat16's) plus 4 bytes a slot and head: a pool of the same memory
holds about twice the sequences in bfloat16. Each token's K/V is quantised
once, when it is written, with a scale of its own, so writing into a partly
filled page never rescales what it holds; attention dequantises the pages it
reads. The pure-JAX attention reads them; the Pallas paged kernels do not.

Under a mesh whose batch axes split the pool's pages, rows and pages are split
over them in the same blocks: a row's table and pairs hold page ids (and rows)
local to its block, and a `shard_map` runs the writes and the attention on each
device's own pages, so no page ever crosses devices. KV heads follow the
`tensor` rule as in training.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ptx_kernels
from jax.sharding import PartitionSpec
from ptx_kernels import implementation

from ptx import sharding
from ptx.model_config import ModelConfig
from ptx.models.attention import platform_kernel
from ptx.models.kv_cache import decode_scans, quantize

POOL_NAMES = ("batch", "kv_heads", None, "head_dim")
SINK_PAGE = 0


class Int8Pages(NamedTuple):
  """One layer's K or V pool in int8: values [P, N, S, K] and float32 scales [P, N, S] (a pytree of the two)."""

  values: jax.Array
  scales: jax.Array


Pool = jax.Array | Int8Pages
# One pool per layer (unrolled layers), or every layer's pages stacked in one [L, P, ...] pool (scanned layers).
Arrays = tuple[Pool, ...] | Pool


def stacked(pools: Arrays) -> bool:
  """Whether `pools` is every layer's stacked in one pool (an array or `Int8Pages` of [L, P, ...]), not a tuple."""
  return isinstance(pools, Int8Pages) or not isinstance(pools, tuple)


class Pairs(NamedTuple):
  """The (row, page) pairs attention reads, Q of them (see `ptx_kernels.paged_attention`)."""

  rows: jax.Array  # int32 [Q], ascending
  pages: jax.Array  # int32 [Q]
  index: jax.Array  # int32 [Q]: which page of its row


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """K/V pages of every layer and the rows that read them (see the module docstring)."""

  k: Arrays
  v: Arrays | None
  page_table: jax.Array
  lengths: jax.Array
  new_tokens: jax.Array
  pairs: Pairs
  # The Pallas paged kernel that attends (`kernel_for`); None: the pure-JAX path.
  kernel: implementation.Kernel | None = dataclasses.field(default=None, metadata=dict(static=True))

  @property
  def stacked(self) -> bool:
    """Whether the layers' pages are stacked in one pool (a scanned decode step: `kv_cache.decode_scans`)."""
    return stacked(self.k)

  def attend(self, layer: int | jax.Array, q_RTHK: jax.Array, k_RTNK: jax.Array, v_RTNK: jax.Array, *,
             positions: jax.Array, window: jax.Array | int | None, softcap: float | None, scale: float,
             rules: sharding.Rules = sharding.DEFAULT_RULES,
             sinks: jax.Array | None = None) -> tuple[jax.Array, PagedKVCache]:
    """Writes the real new tokens' K/V into their pages, then attends every query over its row's cached positions.

    Args:
      layer: the layer index (traced, under a scan over the layers, for a stacked pool).
      q_RTHK: queries [R, T, H, K] (after RoPE).
      k_RTNK: the new keys [R, T, N, K] (after RoPE).
      v_RTNK: the new values [R, T, N, Kv] (in pages without values, MLA's latents, the first Kv columns of
        k_RTNK, which they are: only their width is read).
      positions: int32 [R, T], lengths[:, None] + arange(T) (token t of row r
        goes to position lengths[r] + t).
      window: the layer's sliding window (None: all the past).
      softcap: tanh soft-cap on the logits.
      scale: logit scale.
      rules: the sharding rules (under a mesh: which axes split pages and heads).
      sinks: float32 [H] attention-sink logits of the layer's query heads (`ptx_kernels.with_sinks`); None: none.

    Returns:
      (the attention output [R, T, H, Kv] in q's dtype, the cache with the pages written).
    """
    mesh = jax.sharding.get_abstract_mesh()
    layered = stacked(self.k)  # the whole stack goes in, with the layer to fold into its page ids
    pick = lambda pools: pools if pools is None or layered else pools[layer]  # noqa: E731
    k_pool, v_pool = pick(self.k), pick(self.v)
    page_axes, head_axes = (None, None) if mesh.empty else _pool_axes(k_pool, mesh, rules, layered)
    attend_local = functools.partial(_attend_local, softcap=softcap, scale=scale, kernel=self.kernel,
                                     values_width=None if self.v is not None else v_RTNK.shape[-1])
    args = (k_pool, v_pool, self.page_table, self.lengths, self.new_tokens, self.pairs, q_RTHK,
            k_RTNK, v_RTNK, positions, window, sinks) + ((layer,) if layered else ())
    if page_axes is None:
      out, k, v = attend_local(*args)
    else:
      pool, rows = _pool_spec(k_pool, page_axes, head_axes, layered), PartitionSpec(page_axes)
      v_spec = None if v_pool is None else pool
      new = PartitionSpec(page_axes, None, head_axes, None)
      pairs = Pairs(rows, rows, rows)
      in_specs = (pool, v_spec, rows, rows, rows, pairs, new, new, new, rows,
                  None if window is None else PartitionSpec(), None if sinks is None else PartitionSpec(head_axes))
      in_specs += (PartitionSpec(),) if layered else ()
      out, k, v = jax.shard_map(attend_local, mesh=mesh, in_specs=in_specs, out_specs=(new, pool, v_spec),
                                check_vma=False)(*args)
    if layered:
      return out, dataclasses.replace(self, k=k, v=v)
    put = lambda stack, x: None if stack is None else stack[:layer] + (x,) + stack[layer + 1:]  # noqa: E731
    return out, dataclasses.replace(self, k=put(self.k, k), v=put(self.v, v))

  def advance(self, n_tokens: int) -> PagedKVCache:
    """The rows' lengths past the real tokens of the call just run (`n_tokens` is their padded count)."""
    del n_tokens
    return dataclasses.replace(self, lengths=self.lengths + self.new_tokens)


def kernel_for(cfg: ModelConfig, page_size: int, int8: bool = False) -> implementation.Kernel | None:
  """The kernel that attends over a pool of these pages, as `ModelConfig.attention_impl` asks (module docstring).

  Args:
    cfg: the model config.
    page_size: token positions per page.
    int8: whether the pool holds int8 pages.

  Returns:
    The platform's Pallas paged kernel for "pallas" (interpreted inside
    `attention.interpret_pallas`), else None: the pure-JAX path.

  Raises:
    ValueError: naming the field, for "pallas" on a backend without a Pallas
      kernel, over int8 pages, or with heads or pages the kernel cannot tile.
  """
  if cfg.attention_impl != "pallas":
    return None
  kernel = platform_kernel()
  if kernel is None:
    raise ValueError(f"ModelConfig.attention_impl='pallas': the paged attention has no Pallas kernel on "
                     f"{jax.default_backend()!r}; use 'auto'")
  if int8:
    raise ValueError("ModelConfig.attention_impl='pallas' reads float pages only; EngineConfig.kv_dtype='int8' "
                     "pages are read by the pure-JAX path ('auto')")
  if not cfg.cache_values:
    raise ValueError("ModelConfig.attention_impl='pallas': the Pallas paged kernels read separate K and V pages; "
                     "model.mla's latent pages (values inside the keys) are read by the pure-JAX path ('auto')")
  for name, n in (("head_dim", cfg.head_dim), ("EngineConfig.page_size", page_size)):
    if not kernel.takes_head_dim(n):  # a page is the key tile of both dots: Triton tiles it as a head
      raise ValueError(f"ModelConfig.attention_impl='pallas': {kernel.name} needs {name} a power of two >= 16, "
                       f"got {n}")
  return kernel


def init_pool(cfg: ModelConfig, pages: int, page_size: int, int8: bool = False) -> tuple[Arrays, Arrays | None]:
  """Empty K and V pools, L arrays [pages, N, page_size, K] each, or L `Int8Pages` (call under jit to place them).

  Where the decode step scans the layers (`kv_cache.decode_scans`), each is one pool of the L layers stacked,
  [L, pages, ...]. An MLA model's V pool is None: its K pages hold latents, values included (module docstring).
  """
  shape = (pages, cfg.cache_kv_heads, page_size, cfg.cache_head_dim)

  def empty(*layers: int) -> Pool:
    if int8:
      return Int8Pages(jnp.zeros(layers + shape, jnp.int8), jnp.zeros(layers + shape[:-1], jnp.float32))
    return jnp.zeros(layers + shape, cfg.compute_dtype)

  def pools() -> Arrays:
    return empty(cfg.n_layers) if decode_scans(cfg) else tuple(empty() for _ in range(cfg.n_layers))

  values = pools() if cfg.cache_values else None
  return pools(), values


def pool_sharding(cfg: ModelConfig, pages: int, page_size: int, mesh: jax.sharding.Mesh,
                  rules: sharding.Rules = sharding.DEFAULT_RULES, int8: bool = False):
  """Where one layer's pool lives on `mesh` (a NamedSharding, or `Int8Pages` of them): pages over the batch axes,
  KV heads over `tensor`."""
  shape = (pages, cfg.cache_kv_heads, page_size, cfg.cache_head_dim)
  spec = sharding.logical_to_spec(POOL_NAMES, rules, shape=shape, mesh=mesh)
  placed = jax.sharding.NamedSharding(mesh, spec)
  return Int8Pages(placed, jax.sharding.NamedSharding(mesh, PartitionSpec(*spec[:3]))) if int8 else placed


def pools_sharding(cfg: ModelConfig, placement):
  """Where `init_pool`'s K (or V) pools live, from one layer's `placement` (`pool_sharding`): L of it, or the
  stack's (its layer axis unsplit) where the layers are stacked (`kv_cache.decode_scans`)."""
  if not decode_scans(cfg):
    return (placement,) * cfg.n_layers
  return jax.tree.map(lambda s: jax.sharding.NamedSharding(s.mesh, PartitionSpec(None, *s.spec)), placement)


def page_blocks(pages: int, mesh: jax.sharding.Mesh | None, rules: sharding.Rules = sharding.DEFAULT_RULES) -> int:
  """How many blocks the batch axes split pages (and rows) into: 1 without a mesh."""
  if mesh is None:
    return 1
  axes = sharding.logical_to_spec(("batch",), rules, shape=(pages,), mesh=mesh)[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
  n = 1
  for axis in axes:
    n *= mesh.shape[axis]
  return n


def copy_pages(k: Arrays, v: Arrays | None, sources: jax.Array, targets: jax.Array,
               rules: sharding.Rules = sharding.DEFAULT_RULES) -> tuple[Arrays, Arrays | None]:
  """Copies page sources[i] to targets[i] in every layer (ids local to their block; pairs of the sink are no-ops)."""

  layered = stacked(k)
  # A stack's pages are its axis 1, every layer's copied at once.
  pages = (lambda ids: (slice(None), ids)) if layered else (lambda ids: ids)  # noqa: E731

  def local(k, v, sources, targets):
    copy = lambda pools: jax.tree.map(lambda x: x.at[pages(targets)].set(x[pages(sources)]), pools)  # noqa: E731
    return copy(k), copy(v)

  mesh = jax.sharding.get_abstract_mesh()
  one = k if layered else k[0]
  page_axes, head_axes = (None, None) if mesh.empty else _pool_axes(one, mesh, rules, layered)
  if page_axes is None:
    return local(k, v, sources, targets)
  pool, pairs = _pool_spec(one, page_axes, head_axes, layered), PartitionSpec(page_axes)
  pool = pool if layered else (pool,) * len(k)
  v_specs = None if v is None else pool
  return jax.shard_map(local, mesh=mesh, in_specs=(pool, v_specs, pairs, pairs), out_specs=(pool, v_specs),
                       check_vma=False)(k, v, sources, targets)


def _attend_local(k_pool, v_pool, table_RM, lengths_R, new_R, pairs, q_RTHK, k_RTNK, v_RTNK, positions_RT, window,
                  sinks, layer=None, *, softcap, scale, kernel, values_width):
  """`PagedKVCache.attend` on one block of pages and rows: (out, k_pool, v_pool; v_pool None without values).

  With `layer`, the pools are every layer's stacked, [L, P, ...]: seen as one pool of L * P pages, layer l's page
  p is page l * P + p (module docstring).
  """
  R, T, N, K = k_RTNK.shape
  if layer is not None:
    L, P = _values(k_pool).shape[:2]
    k_pool, v_pool = (jax.tree.map(lambda x: x.reshape((L * P,) + x.shape[2:]), pool) for pool in (k_pool, v_pool))
    first_page = layer * P
  S = _values(k_pool).shape[2]
  real_RT = jnp.arange(T, dtype=jnp.int32)[None] < new_R[:, None]
  page_RT = jnp.take_along_axis(table_RM, jnp.clip(positions_RT // S, 0, table_RM.shape[1] - 1), axis=1)
  page_RT = jnp.where(real_RT, page_RT, SINK_PAGE)
  slot_RT = positions_RT % S
  if layer is not None:
    page_RT, pairs = page_RT + first_page, pairs._replace(pages=pairs.pages + first_page)

  where = (page_RT.reshape(-1), slice(None), slot_RT.reshape(-1))

  def write(pool, new_RTNK):
    # Advanced indices on axes 0 and 2: the indexed view is [R * T, N, K] ([R * T, N] of the scales).
    new = new_RTNK.reshape(R * T, N, K)
    if isinstance(pool, Int8Pages):
      values, scales = quantize(new)
      return Int8Pages(pool.values.at[where].set(values), pool.scales.at[where].set(scales))
    return pool.at[where].set(new.astype(pool.dtype))

  k_pool = write(k_pool, k_RTNK)
  v_pool = None if v_pool is None else write(v_pool, v_RTNK)
  scales = lambda pool: pool.scales if isinstance(pool, Int8Pages) else None  # noqa: E731
  impl = dict(impl="xla") if kernel is None else dict(impl=kernel.name, interpret=kernel.interpret)
  out, lse = ptx_kernels.paged_attention(q_RTHK, _values(k_pool), _values(v_pool), k_scales=scales(k_pool),
                                         v_scales=scales(v_pool), rows=pairs.rows, pages=pairs.pages,
                                         index=pairs.index, lengths=lengths_R + new_R, q_positions=positions_RT,
                                         window=window, softcap=softcap, scale=scale, values_width=values_width,
                                         **impl)
  if sinks is not None:
    out, _ = ptx_kernels.with_sinks(out, lse, sinks)
  if layer is not None:
    k_pool, v_pool = (jax.tree.map(lambda x: x.reshape((L, P) + x.shape[1:]), pool) for pool in (k_pool, v_pool))
  return out, k_pool, v_pool


def _values(pool: Pool | None) -> jax.Array | None:
  """One layer's pool array: its int8 values for `Int8Pages` (None for no pool)."""
  return pool.values if isinstance(pool, Int8Pages) else pool


def _pool_axes(pool: Pool, mesh, rules: sharding.Rules, layered: bool = False):
  """(mesh axes splitting the pages, mesh axes splitting the KV heads) of one layer's pool on `mesh` (of every
  layer's, with `layered`, whose layer axis is unsplit).

  Query heads split over the KV heads' axes: H is a multiple of N, so each
  device holds whole GQA groups.
  """
  spec = sharding.logical_to_spec(POOL_NAMES, rules, shape=_values(pool).shape[int(layered):], mesh=mesh)
  return spec[0], spec[1]


def _pool_spec(pool: Pool, page_axes, head_axes, layered: bool = False):
  """The shard_map spec of one layer's pool (of a stack of them, with `layered`): a PartitionSpec, or `Int8Pages`
  of the values' and scales'."""
  layers = (None,) * layered
  spec = PartitionSpec(*layers, page_axes, head_axes, None, None)
  if isinstance(pool, Int8Pages):
    return Int8Pages(spec, PartitionSpec(*layers, page_axes, head_axes, None))
  return spec
