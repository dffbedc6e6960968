"""The decoder's key/value cache: every layer's K/V per slot, optionally int8.

Layout (L layers, B sequences, S slots, N kv heads, K head_dim):

  k, v              L arrays [B, N, S, K] in the compute dtype, or int8
  k_scale, v_scale  L arrays [B, N, S] float32 (int8 only): absmax / 127 of
                    each slot and head; None otherwise
  positions         int32 [B, S]: the position of the token held by a slot
  segment_ids       int32 [B, S]: 1 for a filled slot, 0 for an empty one
  index             int32 []: the next slot to write, the same for every row

Attention masks by positions and segment ids alone (`ptx.models.attention`),
so the order of slots means nothing: a left-padded batch writes its prompts
at slots [0, P) and every later step at one shared slot, which is a single
in-place `dynamic_update_slice` instead of a per-row scatter. Keys are cached
after RoPE.

Measured layout choices (CPU, decode loop): one array per layer rather than a
stacked [L, ...] array, because reading a layer out of a stack is a copy per
token; heads before slots, because [B, N, S, K] feeds the attention dots with
batch dims major and needs no transpose.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ptx import sharding
from ptx.config import ModelConfig

KV_NAMES = ("batch", "kv_heads", "seq", "head_dim")
SCALE_NAMES = ("batch", "kv_heads", "seq")

Arrays = tuple[jax.Array, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """K/V of every layer for B sequences of S slots (see the module docstring)."""

  k: Arrays
  v: Arrays
  k_scale: Arrays | None
  v_scale: Arrays | None
  positions: jax.Array
  segment_ids: jax.Array
  index: jax.Array

  @property
  def quantized(self) -> bool:
    """Whether K/V are stored as int8 with per-slot, per-head scales."""
    return self.k_scale is not None


def init_cache(cfg: ModelConfig, batch: int, slots: int, *, int8: bool = False,
               rules: sharding.Rules = sharding.DEFAULT_RULES) -> KVCache:
  """An empty cache of `slots` slots for `batch` sequences (call under jit).

  Args:
    cfg: the model config (layers, KV heads, head_dim, compute dtype).
    batch: number of sequences B.
    slots: number of slots S per sequence.
    int8: store K/V as int8 with float32 scales per slot and head.
    rules: sharding rules; the arrays are laid out by their logical names.

  Returns:
    A KVCache with every slot empty and `index` 0.
  """
  shape = (batch, cfg.n_kv_heads, slots, cfg.head_dim)

  def zeros(shape, dtype, names):
    return tuple(sharding.constrain(jnp.zeros(shape, dtype), names, rules) for _ in range(cfg.n_layers))

  dtype = jnp.int8 if int8 else jnp.dtype(cfg.compute_dtype)
  return KVCache(
      k=zeros(shape, dtype, KV_NAMES), v=zeros(shape, dtype, KV_NAMES),
      k_scale=zeros(shape[:-1], jnp.float32, SCALE_NAMES) if int8 else None,
      v_scale=zeros(shape[:-1], jnp.float32, SCALE_NAMES) if int8 else None,
      positions=sharding.constrain(jnp.zeros((batch, slots), jnp.int32), ("batch", "seq"), rules),
      segment_ids=sharding.constrain(jnp.zeros((batch, slots), jnp.int32), ("batch", "seq"), rules),
      index=jnp.zeros((), jnp.int32))


def write_slots(cache: KVCache, positions_BT: jax.Array, segment_ids_BT: jax.Array) -> KVCache:
  """Records the positions and segment ids of T new tokens at slots [index, index + T)."""
  start = (jnp.zeros((), jnp.int32), cache.index)
  return dataclasses.replace(
      cache,
      positions=jax.lax.dynamic_update_slice(cache.positions, positions_BT.astype(jnp.int32), start),
      segment_ids=jax.lax.dynamic_update_slice(cache.segment_ids, segment_ids_BT.astype(jnp.int32), start))


def advance(cache: KVCache, n_tokens: int) -> KVCache:
  """Moves the write index past `n_tokens` slots just written."""
  return dataclasses.replace(cache, index=cache.index + n_tokens)


def write_layer(cache: KVCache, layer: int, k_BTNK: jax.Array, v_BTNK: jax.Array,
                rules: sharding.Rules = sharding.DEFAULT_RULES) -> KVCache:
  """Writes layer `layer`'s new K/V [B, T, N, K] at slots [index, index + T)."""
  zero = jnp.zeros((), jnp.int32)

  def put(stack: Arrays, new_BNT: jax.Array, names) -> Arrays:
    start = (zero, zero, cache.index) + (zero,) * (new_BNT.ndim - 3)
    written = jax.lax.dynamic_update_slice(stack[layer], new_BNT.astype(stack[layer].dtype), start)
    return stack[:layer] + (sharding.constrain(written, names, rules),) + stack[layer + 1:]

  k_BNTK, v_BNTK = jnp.swapaxes(k_BTNK, 1, 2), jnp.swapaxes(v_BTNK, 1, 2)
  if not cache.quantized:
    return dataclasses.replace(cache, k=put(cache.k, k_BNTK, KV_NAMES), v=put(cache.v, v_BNTK, KV_NAMES))
  (k8, k_scale), (v8, v_scale) = quantize(k_BNTK), quantize(v_BNTK)
  return dataclasses.replace(
      cache, k=put(cache.k, k8, KV_NAMES), v=put(cache.v, v8, KV_NAMES),
      k_scale=put(cache.k_scale, k_scale, SCALE_NAMES), v_scale=put(cache.v_scale, v_scale, SCALE_NAMES))


def read_layer(cache: KVCache, layer: int, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
  """Returns layer `layer`'s K and V over all slots as [B, S, N, K] views of the [B, N, S, K] store."""
  k_BNSK, v_BNSK = cache.k[layer], cache.v[layer]
  if cache.quantized:
    k_BNSK = dequantize(k_BNSK, cache.k_scale[layer], dtype)
    v_BNSK = dequantize(v_BNSK, cache.v_scale[layer], dtype)
  # The swap folds into the attention dots' dimension numbers.
  return jnp.swapaxes(k_BNSK, 1, 2), jnp.swapaxes(v_BNSK, 1, 2)


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Symmetric int8 over the last axis (head_dim): returns (int8 x, float32 scales of x.shape[:-1])."""
  x32 = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x32), axis=-1) / 127.0
  safe = jnp.where(scale == 0.0, 1.0, scale)  # an all-zero head stores zeros, not NaN
  q = jnp.clip(jnp.round(x32 / safe[..., None]), -127, 127).astype(jnp.int8)
  return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
  """The inverse of `quantize`, in `dtype`."""
  return (q.astype(jnp.float32) * scale[..., None]).astype(dtype)


def repeat(cache: KVCache, n: int, rules: sharding.Rules = sharding.DEFAULT_RULES) -> KVCache:
  """Gives each sequence's cache to n consecutive rows: B rows become B * n (row b * n + g)."""

  def rep(x: jax.Array, names) -> jax.Array:
    return sharding.constrain(jnp.repeat(x, n, axis=0), names, rules)

  def rep_all(arrays: Arrays | None, names) -> Arrays | None:
    return None if arrays is None else tuple(rep(x, names) for x in arrays)

  return dataclasses.replace(
      cache, k=rep_all(cache.k, KV_NAMES), v=rep_all(cache.v, KV_NAMES),
      k_scale=rep_all(cache.k_scale, SCALE_NAMES), v_scale=rep_all(cache.v_scale, SCALE_NAMES),
      positions=rep(cache.positions, ("batch", "seq")), segment_ids=rep(cache.segment_ids, ("batch", "seq")))
