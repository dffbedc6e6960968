"""The decoder's key/value cache: every layer's K/V per slot, optionally int8.

Layout (L layers, B sequences, S slots, N kv heads, K head_dim):

  k, v              L arrays [B, N, S, K] in the compute dtype, or int8; or
                    one array [L, B, N, S, K] of them stacked (`stacked`)
  k_scale, v_scale  L arrays [B, N, S] float32 (int8 only), or [L, B, N, S]
                    stacked: absmax / 127 of each slot and head; None otherwise

Multi-head latent attention caches one latent per slot (N = 1, K =
kv_lora_rank + the rotary width: `ModelConfig.cache_kv_heads` and
`cache_head_dim`) and no values: `v` and `v_scale` are None and attention
reads the values as the first kv_lora_rank columns of `k`, the absorbed
decode of `ptx.models.mla`. That is 35x (Kimi K2) to 71x (DeepSeek-V3)
less cache than expanded per-head K/V.

  starts            int32 [B]: the first slot of each row; slot s of row b
                    holds the token at position s - starts[b]
  index             int32 []: the next slot to write, the same for every row
  prefix, group     a cache of B prompts shared by G = group consecutive rows
                    each (`share_prefix`), or None and 1

A left-padded batch writes its prompts at slots [0, P) (row b's padding at
[0, starts[b])) and every later step at one shared slot, which is a single
in-place `dynamic_update_slice` instead of a per-row scatter. Slots
[starts[b], index) of row b are filled; attention (`attend`, on
`ptx_kernels.decode_attention`) reads only the blocks below `index`; on
XLA:CPU a decode step (one token) reads the whole cache in one block
instead, whose size the sampler keeps near the fill (`grow`). Keys are
cached after RoPE. Under a mesh whose `seq` axis the rules give the slots,
the cache stays sharded along it: each device attends over its own slots and
only the per-token partials are merged.

Groups (G samples of each prompt, as GRPO draws them) either copy each
prompt's K/V to their G rows (`repeat`) or keep one copy of it
(`share_prefix`): a `prefix` cache of B rows that row b * G + g reads, and
rows of their own for the generated tokens only, whose slot s holds
position len_b + s (`starts` = -len_b). A row then attends over both and
merges the two softmaxes through their log-sum-exps; the G rows of a prompt
query its prefix together, as G * T tokens of one sequence. The prompt part
of the cache is G times smaller, and a decode step reads it once per group.

Layout choices: which of the two layer layouts a cache has follows how the
decode step runs its layers (`decode_scans`, the one reader of
`ModelConfig.decode_loop`), and the decoder runs them as the cache holds
them. One array per layer when the layers run unrolled (XLA:CPU's choice):
a layer's weights are sliced out of their stack once, before the decode
loop, and each layer's cache is its own buffer. Every layer's stacked when
they run under a `lax.scan` (GPU and TPU: one layer body per token instead of
a few hundred kernel launches): the cache rides in the scan's carry, a write
is one in-place `dynamic_update_slice` at (layer, ..., index), and attention
reads its blocks straight out of the stack (`ptx_kernels.decode_attention`'s
`layer`), never copying a layer's cache out. Heads before slots, because
[B, N, S, K] feeds the attention dots with batch dims major and needs no
transpose.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ptx_kernels
from ptx_kernels import xla_cpu_workarounds

from ptx import sharding
from ptx.model_config import ModelConfig

KV_NAMES = ("batch", "kv_heads", "seq", "head_dim")
SCALE_NAMES = ("batch", "kv_heads", "seq")
# The axis before a stacked cache's own (`KVCache.stacked`): unsplit, as the parameter stacks' is by default.
LAYER_NAME = "layers"
# Cache slots per block of the attention loop: its memory grows with tokens x BLOCK_SLOTS, and only blocks up
# to the fill are read (see `_block_slots` for a decode step on XLA:CPU).
BLOCK_SLOTS = 512

# One cache array per layer (unrolled layers), or every layer's stacked in one [L, ...] array (scanned layers).
Arrays = tuple[jax.Array, ...] | jax.Array


def decode_scans(cfg: ModelConfig) -> bool:
  """Whether a decode step runs the layers under `lax.scan` over stacked caches: `ModelConfig.decode_loop`, read
  here only ("auto": unrolled on XLA:CPU, which copies a layer's weights out of a stack on every token; scanned on
  GPU and TPU, where unrolled layers cost a few hundred kernel launches a token)."""
  if cfg.decode_loop == "auto":
    return jax.default_backend() != "cpu"
  return cfg.decode_loop == "scan"


def stacked(arrays: Arrays) -> bool:
  """Whether cache arrays hold every layer stacked, [L, ...], rather than a tuple of one array per layer."""
  return not isinstance(arrays, tuple)


def layer_shape(arrays: Arrays) -> tuple[int, ...]:
  """The shape of one layer's array of a stack or tuple of them."""
  return arrays.shape[1:] if stacked(arrays) else arrays[0].shape


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """K/V of every layer for B sequences of S slots (see the module docstring)."""

  k: Arrays
  v: Arrays | None
  k_scale: Arrays | None
  v_scale: Arrays | None
  starts: jax.Array
  index: jax.Array
  prefix: "KVCache | None" = None
  group: int = dataclasses.field(default=1, metadata=dict(static=True))

  @property
  def quantized(self) -> bool:
    """Whether K/V are stored as int8 with per-slot, per-head scales."""
    return self.k_scale is not None

  @property
  def stacked(self) -> bool:
    """Whether the layers' K/V are stacked, [L, ...] (a scanned decode step: `decode_scans`), or a tuple of L."""
    return stacked(self.k)

  def attend(self, layer: int | jax.Array, q_BTHK: jax.Array, k_BTNK: jax.Array, v_BTNK: jax.Array,
             **kwargs) -> tuple[jax.Array, KVCache]:
    """`attend(self, ...)`: the decoder reaches every cache type (this, `PagedKVCache`) through this method."""
    return attend(self, layer, q_BTHK, k_BTNK, v_BTNK, **kwargs)

  def advance(self, n_tokens: int) -> KVCache:
    """`advance(self, n_tokens)`, the method every cache type has."""
    return advance(self, n_tokens)


def init_cache(cfg: ModelConfig, batch: int, slots: int, *, starts: jax.Array | None = None, int8: bool = False,
               rules: sharding.Rules = sharding.DEFAULT_RULES) -> KVCache:
  """An empty cache of `slots` slots for `batch` sequences (call under jit).

  Args:
    cfg: the model config (layers, `cache_kv_heads`, `cache_head_dim`, compute dtype; an MLA model's cache has no
      values).
    batch: number of sequences B.
    slots: number of slots S per sequence.
    starts: int32 [B] first slot of each row (its left padding); default 0.
    int8: store K/V as int8 with float32 scales per slot and head.
    rules: sharding rules; the arrays are laid out by their logical names.

  Returns:
    A KVCache with every slot empty and `index` 0; its layers stacked when the decode step scans them
    (`decode_scans`), else one array each.
  """
  shape = (batch, cfg.cache_kv_heads, slots, cfg.cache_head_dim)
  values = cfg.cache_values

  def zeros(shape, dtype, names):
    if decode_scans(cfg):
      return sharding.constrain(jnp.zeros((cfg.n_layers,) + shape, dtype), (LAYER_NAME,) + names, rules)
    return tuple(sharding.constrain(jnp.zeros(shape, dtype), names, rules) for _ in range(cfg.n_layers))

  dtype = jnp.int8 if int8 else jnp.dtype(cfg.compute_dtype)
  starts = jnp.zeros((batch,), jnp.int32) if starts is None else jnp.asarray(starts, jnp.int32)
  return KVCache(
      k=zeros(shape, dtype, KV_NAMES), v=zeros(shape, dtype, KV_NAMES) if values else None,
      k_scale=zeros(shape[:-1], jnp.float32, SCALE_NAMES) if int8 else None,
      v_scale=zeros(shape[:-1], jnp.float32, SCALE_NAMES) if int8 and values else None,
      starts=sharding.constrain(starts, ("batch",), rules), index=jnp.zeros((), jnp.int32))


def share_prefix(prefix: KVCache, group: int, slots: int,
                 rules: sharding.Rules = sharding.DEFAULT_RULES) -> KVCache:
  """A cache of B * G rows with `slots` empty slots each, over the filled `prefix` of B prompts.

  Row b * G + g reads prompt b's K/V from `prefix` (never copied) and writes
  its own tokens from slot 0, which holds position len_b = prefix.index -
  prefix.starts[b]: the row's positions continue its prompt's.

  Args:
    prefix: a cache of B rows holding the prompts (after prefill).
    group: rows per prompt G.
    slots: slots per row for the tokens that follow the prompt.
    rules: sharding rules.

  Returns:
    The cache to decode with: `index` 0, `prefix` and `group` set.
  """
  if prefix.prefix is not None:
    raise ValueError("share_prefix: the prefix cache has a prefix of its own")
  B, N, _, K = layer_shape(prefix.k)
  shape = (B * group, N, slots, K)

  def zeros(like: Arrays | None, shape, names) -> Arrays | None:
    if like is None:
      return None
    if stacked(like):
      return sharding.constrain(jnp.zeros(like.shape[:1] + shape, like.dtype), (LAYER_NAME,) + names, rules)
    return tuple(sharding.constrain(jnp.zeros(shape, x.dtype), names, rules) for x in like)

  lengths = jnp.repeat(prefix.index - prefix.starts, group)
  return KVCache(k=zeros(prefix.k, shape, KV_NAMES), v=zeros(prefix.v, shape, KV_NAMES),
                 k_scale=zeros(prefix.k_scale, shape[:-1], SCALE_NAMES),
                 v_scale=zeros(prefix.v_scale, shape[:-1], SCALE_NAMES),
                 starts=sharding.constrain(-lengths, ("batch",), rules), index=jnp.zeros((), jnp.int32),
                 prefix=prefix, group=group)


def grow(cache: KVCache, slots: int, rules: sharding.Rules = sharding.DEFAULT_RULES) -> KVCache:
  """The cache with `slots` slots per row, the new ones empty (the same cache when it has that many)."""

  def pad(arrays: Arrays | None, names) -> Arrays | None:
    if arrays is None or layer_shape(arrays)[2] == slots:
      return arrays
    widths = [(0, 0)] * len(layer_shape(arrays))
    widths[2] = (0, slots - layer_shape(arrays)[2])
    if stacked(arrays):
      return sharding.constrain(jnp.pad(arrays, [(0, 0)] + widths), (LAYER_NAME,) + names, rules)
    return tuple(sharding.constrain(jnp.pad(x, widths), names, rules) for x in arrays)

  return dataclasses.replace(cache, k=pad(cache.k, KV_NAMES), v=pad(cache.v, KV_NAMES),
                             k_scale=pad(cache.k_scale, SCALE_NAMES), v_scale=pad(cache.v_scale, SCALE_NAMES))


def advance(cache: KVCache, n_tokens: int) -> KVCache:
  """Moves the write index past `n_tokens` slots just written."""
  return dataclasses.replace(cache, index=cache.index + n_tokens)


def write_layer(cache: KVCache, layer: int | jax.Array, k_BTNK: jax.Array, v_BTNK: jax.Array,
                rules: sharding.Rules = sharding.DEFAULT_RULES) -> KVCache:
  """Writes layer `layer`'s new K/V [B, T, N, K] at slots [index, index + T) (the keys alone in a cache without
  values). A stacked cache's layer may be traced (a scan over the layers): the write is in place in the stack."""
  seq = _seq_sharding(layer_shape(cache.k), rules)

  def put(stack: Arrays | None, new_BNT: jax.Array, names) -> Arrays | None:
    if stack is None:
      return None
    if stacked(stack):
      written = _write_slots(stack, new_BNT.astype(stack.dtype), cache.index, seq, layer)
      return sharding.constrain(written, (LAYER_NAME,) + names, rules)
    written = _write_slots(stack[layer], new_BNT.astype(stack[layer].dtype), cache.index, seq)
    return stack[:layer] + (sharding.constrain(written, names, rules),) + stack[layer + 1:]

  k_BNTK, v_BNTK = jnp.swapaxes(k_BTNK, 1, 2), jnp.swapaxes(v_BTNK, 1, 2)
  if not cache.quantized:
    return dataclasses.replace(cache, k=put(cache.k, k_BNTK, KV_NAMES), v=put(cache.v, v_BNTK, KV_NAMES))
  # A cache without values (multi-head latent attention's) quantises no values.
  (k8, k_scale), (v8, v_scale) = quantize(k_BNTK), (None, None) if cache.v is None else quantize(v_BNTK)
  return dataclasses.replace(
      cache, k=put(cache.k, k8, KV_NAMES), v=put(cache.v, v8, KV_NAMES),
      k_scale=put(cache.k_scale, k_scale, SCALE_NAMES), v_scale=put(cache.v_scale, v_scale, SCALE_NAMES))


def _write_slots(store_BNS: jax.Array, new_BNT: jax.Array, index: jax.Array, seq: dict,
                 layer: jax.Array | int | None = None) -> jax.Array:
  """`store[:, :, index:index + T] = new`: one in-place update, run per device when `seq` shards the slots.

  With `layer`, the store is every layer's stacked, [L, B, N, S, ...], and the
  update lands in that layer: `store[layer, :, :, index:index + T] = new`.
  On a slot-sharded store a plain dynamic_update_slice makes GSPMD gather
  the whole store. Instead every device updates the T slots of its own slice
  nearest the index, keeping its old values where the new tokens do not land.
  """
  if layer is not None:  # the layer's index leads the update's start, and a layer axis of 1 the update
    new_BNT = new_BNT[None]
  lead = 0 if layer is None else 1
  start = lambda i, *layer: layer + (0, 0, i) + (0,) * (store_BNS.ndim - 3 - lead)  # noqa: E731
  layers = () if layer is None else (layer,)
  if not seq:
    return jax.lax.dynamic_update_slice(store_BNS, new_BNT, start(index, *layers))
  T = new_BNT.shape[2 + lead]

  def local(store, new, index, *layers):
    n = store.shape[2 + lead]
    width = min(T, n)  # a window of local slots that holds every slot the new tokens land on
    at = index - jax.lax.axis_index(seq["axis_name"]) * n  # the index in local slots
    first = jnp.clip(at, 0, n - width)
    token_W = first + jnp.arange(width) - at  # the new token each window slot takes, if in [0, T)
    lands = ((token_W >= 0) & (token_W < T)).reshape((1,) * (2 + lead) + (width,) + (1,) * (store.ndim - 3 - lead))
    moved = jnp.take(new, jnp.clip(token_W, 0, T - 1), axis=2 + lead)
    if layer is None:
      held = jax.lax.dynamic_slice_in_dim(store, first, width, axis=2)
    else:
      held = jax.lax.dynamic_slice(store, start(first, *layers), moved.shape)
    return jax.lax.dynamic_update_slice(store, jnp.where(lands, moved, held), start(first, *layers))

  batch, heads = seq["batch_axes"] or None, seq["head_axes"] or None
  lead_axes = (None,) * lead
  spec = jax.sharding.PartitionSpec(*lead_axes, batch, heads, seq["axis_name"], *(None,) * (store_BNS.ndim - 3 - lead))
  new_spec = jax.sharding.PartitionSpec(*lead_axes, batch, heads, *(None,) * (store_BNS.ndim - 2 - lead))
  scalar = jax.sharding.PartitionSpec()
  return jax.shard_map(local, mesh=seq["mesh"], in_specs=(spec, new_spec, scalar) + (scalar,) * lead,
                       out_specs=spec, check_vma=False)(store_BNS, new_BNT, index, *layers)


def attend(cache: KVCache, layer: int | jax.Array, q_BTHK: jax.Array, k_BTNK: jax.Array, v_BTNK: jax.Array, *,
           positions: jax.Array, window: jax.Array | int | None, softcap: float | None, scale: float,
           rules: sharding.Rules = sharding.DEFAULT_RULES,
           sinks: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
  """Writes T new tokens' K/V into layer `layer`, then attends their queries over the filled slots.

  A cache with a shared `prefix` (`share_prefix`) also attends over each
  row's prompt there, merged with its own slots through the log-sum-exps.

  Args:
    cache: the cache, B rows.
    layer: the layer index (traced, under a scan over the layers, for a stacked cache).
    q_BTHK: queries [B, T, H, K] (after RoPE).
    k_BTNK: the new keys [B, T, N, K] (after RoPE).
    v_BTNK: the new values [B, T, N, Kv]; in a cache without values (MLA's latents) the first Kv columns of
      k_BTNK, which they are: only their width is read.
    positions: int32 [B, T] positions of the new tokens.
    window: the layer's sliding window (None: all the past).
    softcap: tanh soft-cap on the logits.
    scale: logit scale.
    rules: the sharding rules; a `seq`-sharded cache is attended in place.
    sinks: float32 [H] attention-sink logits of the layer's query heads (`ptx_kernels.with_sinks`), applied
      once, after the slots' shards and the prefix are merged; None: none.

  Returns:
    (the attention output [B, T, H, Kv] in q's dtype, the cache with the K/V written).
  """
  values_width = None if cache.v is not None else v_BTNK.shape[-1]
  cache = write_layer(cache, layer, k_BTNK, v_BTNK, rules)
  B, T = positions.shape
  view = lambda stack: _kernel_view(stack, layer)  # noqa: E731
  out, lse, (k, v, k_scale, v_scale) = ptx_kernels.decode_attention(
      q_BTHK, view(cache.k), view(cache.v), k_scale=view(cache.k_scale), v_scale=view(cache.v_scale),
      lengths=jnp.broadcast_to(cache.index + T, (B,)), starts=cache.starts, q_positions=positions,
      window=window, softcap=softcap, scale=scale, block_kv=_block_slots(T, cache.k), return_cache=True,
      values_width=values_width, **_kernel_layer(cache.k, layer), **_seq_sharding(layer_shape(cache.k), rules))

  def put(stack: Arrays | None, x_BSNK: jax.Array | None) -> Arrays | None:
    # Carry on with the arrays the kernel threaded through its loop, so the cache is never copied.
    if stack is None:
      return None
    if stacked(stack):
      return jnp.swapaxes(x_BSNK, 2, 3)
    return stack[:layer] + (jnp.swapaxes(x_BSNK, 1, 2),) + stack[layer + 1:]

  cache = dataclasses.replace(cache, k=put(cache.k, k), v=put(cache.v, v), k_scale=put(cache.k_scale, k_scale),
                              v_scale=put(cache.v_scale, v_scale))
  if cache.prefix is not None:
    out_prefix, lse_prefix = _attend_prefix(cache.prefix, cache.group, layer, q_BTHK, positions, window=window,
                                            softcap=softcap, scale=scale, values_width=values_width, rules=rules)
    out, lse = ptx_kernels.merge_lse([out, out_prefix], [lse, lse_prefix])
  if sinks is not None:
    out, _ = ptx_kernels.with_sinks(out, lse, sinks)
  return out.astype(q_BTHK.dtype), cache


def _attend_prefix(prefix: KVCache, group: int, layer: int | jax.Array, q_RTHK: jax.Array, positions_RT: jax.Array, *,
                   window: jax.Array | int | None, softcap: float | None, scale: float, values_width: int | None,
                   rules: sharding.Rules) -> tuple[jax.Array, jax.Array]:
  """Attention of R = B * G rows' queries over their prompts' K/V: (out [R, T, H, Kv], lse [R, H, T])."""
  R, T, H, K = q_RTHK.shape
  B = R // group
  view = lambda stack: _kernel_view(stack, layer)  # noqa: E731
  # A prompt's G rows are G * T queries of one sequence: the prefix is read once per group.
  out_BQHK, lse_BHQ = ptx_kernels.decode_attention(
      q_RTHK.reshape(B, group * T, H, K), view(prefix.k), view(prefix.v), k_scale=view(prefix.k_scale),
      v_scale=view(prefix.v_scale), lengths=jnp.broadcast_to(prefix.index, (B,)), starts=prefix.starts,
      q_positions=positions_RT.reshape(B, group * T), window=window, softcap=softcap, scale=scale,
      block_kv=_block_slots(T, prefix.k), values_width=values_width, **_kernel_layer(prefix.k, layer),
      **_seq_sharding(layer_shape(prefix.k), rules))
  lse_RHT = jnp.swapaxes(lse_BHQ.reshape(B, H, group, T), 1, 2).reshape(R, H, T)
  return out_BQHK.reshape(R, T, H, -1), lse_RHT


def _block_slots(T: int, keys: Arrays) -> int:
  """Cache slots per attention block for T new tokens over the layers' key stores `keys`."""
  if T == 1 and xla_cpu_workarounds.active():
    # XLA:CPU copies each block out of the cache: one token reads it whole, the sampler bounds its size.
    return layer_shape(keys)[2]
  return BLOCK_SLOTS


def _kernel_view(stack: Arrays | None, layer: int | jax.Array) -> jax.Array | None:
  """The decode kernel's [B, S, N, K] view of a layer's [B, N, S, K] store (of every layer's, [L, B, S, N, K], in a
  stack, which the kernel indexes itself: `_kernel_layer`): the swap folds into its products."""
  if stack is None:
    return None
  return jnp.swapaxes(stack, 2, 3) if stacked(stack) else jnp.swapaxes(stack[layer], 1, 2)


def _kernel_layer(keys: Arrays, layer: int | jax.Array) -> dict:
  """The decode kernel's `layer` argument: the layer to read out of a stacked cache; none for a tuple of layers."""
  return dict(layer=layer) if stacked(keys) else {}


def _seq_sharding(layer_BNSK: tuple[int, ...], rules: sharding.Rules) -> dict:
  """The decode kernel's mesh arguments when the current mesh shards the slots of a cache layer of this shape."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return {}
  batch, heads, slots, _ = (sharding.logical_to_spec(KV_NAMES, rules, shape=layer_BNSK, mesh=mesh))
  if slots is None:
    return {}
  as_tuple = lambda axes: () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)  # noqa: E731
  if len(as_tuple(slots)) != 1:
    raise ValueError(f"the KV cache's slots may be sharded over one mesh axis, got {slots}")
  if mesh.shape[as_tuple(slots)[0]] == 1:
    # Unsplit slots need no shard_map: its merge gathers and its backward's
    # psums would stay in the program as collectives over one device.
    return {}
  return dict(mesh=mesh, axis_name=as_tuple(slots)[0], batch_axes=as_tuple(batch), head_axes=as_tuple(heads))


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Symmetric int8 over the last axis (head_dim): returns (int8 x, float32 scales of x.shape[:-1])."""
  x32 = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x32), axis=-1) / 127.0
  safe = jnp.where(scale == 0.0, 1.0, scale)  # an all-zero head stores zeros, not NaN
  q = jnp.clip(jnp.round(x32 / safe[..., None]), -127, 127).astype(jnp.int8)
  return q, scale


def repeat(cache: KVCache, n: int, rules: sharding.Rules = sharding.DEFAULT_RULES) -> KVCache:
  """Gives each sequence's cache to n consecutive rows: B rows become B * n (row b * n + g)."""

  def rep(x: jax.Array, names) -> jax.Array:
    return sharding.constrain(jnp.repeat(x, n, axis=0), names, rules)

  def rep_all(arrays: Arrays | None, names) -> Arrays | None:
    if arrays is None:
      return None
    if stacked(arrays):
      return sharding.constrain(jnp.repeat(arrays, n, axis=1), (LAYER_NAME,) + names, rules)
    return tuple(rep(x, names) for x in arrays)

  return dataclasses.replace(
      cache, k=rep_all(cache.k, KV_NAMES), v=rep_all(cache.v, KV_NAMES),
      k_scale=rep_all(cache.k_scale, SCALE_NAMES), v_scale=rep_all(cache.v_scale, SCALE_NAMES),
      starts=rep(cache.starts, ("batch",)))
