"""The decoder: a pure `forward(params, tokens, cfg)` and its Flax NNX module.

One decoder covers the Llama 3, Qwen2/2.5/3 and Gemma 2/3 families, and
their Mixture-of-Experts kin (`ptx.models.moe`), through `ModelConfig`. The
hot path is `forward`, a pure function of the parameter dict declared in
`ptx.models.params`; layers run under `lax.scan` over the
stacked `layers` axis (a Mixture of Experts with dense layers among its MoE
layers has a second stack, `dense_layers`, run in its layers' places), each
optionally rematerialised. `Decoder` is the NNX
module users hold: `model(tokens)` works eagerly, and
`nnx.split(model)` / `nnx.state(model)` give the same parameter tree that
training jits over. `forward_with_cache` runs the same layers over new
tokens against a KV cache (`ptx.models.kv_cache`) for sampling: unrolled
over a cache of one array per layer, or under scans over a stacked cache,
as the cache holds its layers (`kv_cache.decode_scans`, which reads
`ModelConfig.decode_loop`).

Numerics: parameters are stored in `param_dtype`, activations and matmuls run
in `compute_dtype`; norms, RoPE, attention softmax and the output logits are
float32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from jax.sharding import Mesh
from ptx_kernels import xla_cpu_workarounds

from ptx import sharding
from ptx.model_config import ModelConfig
from ptx.models import int8_weights
from ptx.models import kv_cache as kv_cache_lib
from ptx.models import lora
from ptx.models import mla
from ptx.models import moe
from ptx.models import paged_kv_cache
from ptx.models import params as params_lib
from ptx.models import rope
from ptx.models import vision
from ptx.models import attention_choice
from ptx.models.attention import attention, need_of, resolve
from ptx.models.attention_choice import RowLayout
from ptx.models.dense import dense
from ptx.models.gated_mlp import activation_of, gated_mlp
from ptx.models.rms_norm import rms_norm

Params = dict[str, Any]
# The caches the layers read and write: contiguous rows (sampling) or pages (the rollout engine); the layers reach
# either through its `attend` and `advance` methods.
Cache = kv_cache_lib.KVCache | paged_kv_cache.PagedKVCache

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def layer_windows(cfg: ModelConfig) -> np.ndarray | None:
  """Per-layer sliding windows (int32 [L]); global layers get an unbounded one."""
  if cfg.sliding_window is None:
    return None
  is_global = (np.arange(cfg.n_layers) + 1) % cfg.sliding_window_pattern == 0
  if cfg.sliding_window_pattern == 1:
    is_global[:] = False
  return np.where(is_global, np.iinfo(np.int32).max, cfg.sliding_window).astype(np.int32)


def attention_facts(cfg: ModelConfig, length: int, rows: RowLayout,
                    rules: sharding.Rules = sharding.DEFAULT_RULES) -> dict[str, Any]:
  """The facts `block` gives `ptx.models.attention.resolve` for rows of `length` tokens without a cache.

  From the config alone: a stack's windows are traced in a scan over the layers, numpy ints unrolled.
  """
  window = None if cfg.sliding_window is None else jnp.int32(0) if cfg.scan_layers else np.int32(cfg.sliding_window)
  return dict(q_len=length, kv_len=length, head_dim=cfg.qk_head_dim, v_head_dim=cfg.v_head_dim, rules=rules,
              rows=rows, dtype=cfg.compute_dtype, softcap=cfg.attn_logit_softcap is not None,
              sinks=cfg.attention_sinks, window=window)


def attention_row(cfg: ModelConfig, length: int, rows: RowLayout, rules: sharding.Rules) -> tuple[str, str]:
  """(implementation, reason) of the attention a layer runs over rows of `length` tokens without a cache.

  "auto" is the row of `attention_choice.TABLE` for `attention_facts`; a name is itself, or its refusal
  (ValueError). Call under the mesh.
  """
  facts = attention_facts(cfg, length, rows, rules)
  if cfg.attention_impl != "auto":
    return resolve(cfg.attention_impl, **facts), "model.attention_impl names it"
  row = attention_choice.choose(need_of(**facts))
  return row.impl, row.reason


# ((sin, cos) of global layers, (sin, cos) of local sliding-window layers), each float32 [B, T, head_dim // 2].
RopeAngles = tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def layer_rope(positions: jax.Array, cfg: ModelConfig) -> RopeAngles:
  """The RoPE angles of int32 positions [B, T] for global and for local layers (the same unless Gemma's local theta)."""
  compute = functools.partial(_layer_rope, cfg=cfg)
  return xla_cpu_workarounds.platform_dependent(positions, cpu=functools.partial(_materialized, compute),
                                                default=compute)


def _materialized(compute, positions: jax.Array) -> RopeAngles:
  """`compute(positions)` behind a conditional, so that XLA:CPU writes the [B, T, K/2] angles once.

  An XLA:CPU workaround (`ptx_kernels.xla_cpu_workarounds`): both branches
  compute the same angles; the conditional only stops XLA:CPU from fusing
  the trig into every rotated element. Other backends skip it (a
  conditional costs a GPU a host sync).
  """
  return jax.lax.cond(jnp.any(positions != 0), compute, compute, positions)


def _layer_rope(positions: jax.Array, cfg: ModelConfig) -> RopeAngles:
  """`layer_rope` as XLA sees it on every backend."""
  global_rope = rope.rope_angles(positions, rope.inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                                 rope.attention_factor(cfg.rope_scaling))
  if cfg.rope_local_theta is None:
    return global_rope, global_rope
  return global_rope, rope.rope_angles(positions, rope.inverse_frequencies(cfg.head_dim, cfg.rope_local_theta))


def forward(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    rows: RowLayout = "packed",
    images: vision.Images | None = None,
) -> jax.Array:
  """Runs the decoder on int32 tokens [B, T] and returns float32 logits [B, T, V].

  Args:
    params: the parameter tree of `ptx.models.params.param_specs(cfg)`.
    tokens: int32 token ids [B, T].
    cfg: the model config.
    positions: int32 [B, T]; defaults to 0..T-1 on every row.
    segment_ids: int32 [B, T]; tokens attend only within their segment and 0 marks padding; defaults to one per row.
    rules: the sharding rules for activation constraints (used under a mesh).
    rows: what `segment_ids` hold (`ptx.models.attention_choice.RowLayout`; None ids are one whole sequence per
      row, which every layout describes).
    images: image features that replace the image tokens' embeddings (`ptx.models.vision.Images`); None: text.

  Returns:
    float32 logits [B, T, V].
  """
  x, _ = hidden_states(params, tokens, cfg, positions=positions, segment_ids=segment_ids, rules=rules, rows=rows,
                       images=images)
  return unembed(params, x, cfg, rules)


def hidden_states(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    *,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    routes: jax.Array | None = None,
    rows: RowLayout = "packed",
    images: vision.Images | None = None,
) -> tuple[jax.Array, moe.Trace]:
  """The residual stream [B, T, D] after the last layer, before the final norm (`forward`'s args), and the MoE trace.

  Losses over long sequences project it to the vocabulary chunk by chunk
  (`ptx.models.chunked_logits`) instead of calling `forward`; the second
  result holds each Mixture-of-Experts layer's statistics and chosen experts
  (`ptx.models.moe.Trace`). `routes` (`moe.ROUTE_DTYPE` [B, T, L, k]) replays
  recorded experts (`moe.moe_mlp`'s `replay`).
  """
  x = vision.merge_features(embed(params, tokens, cfg, rules), images, rules)
  return decode_layers(params, x, cfg, positions=positions, segment_ids=segment_ids, rules=rules, routes=routes,
                       rows=rows)


def embed(params: Params, tokens: jax.Array, cfg: ModelConfig, rules: sharding.Rules) -> jax.Array:
  """Looks up token embeddings [B, T, D] in the compute dtype (rows of an int8 table dequantised)."""
  table = params["embed"]
  if isinstance(table, qwix.QArray):  # tied rollout parameters (`ptx.models.rollout_params`)
    x = int8_weights.take_rows(table, tokens).astype(cfg.compute_dtype)
  else:
    x = jnp.take(table, tokens, axis=0).astype(cfg.compute_dtype)
  if cfg.embed_scale:
    # HF Gemma rounds the sqrt(d) normaliser to the activation dtype first.
    x = x * jnp.asarray(math.sqrt(cfg.d_model), cfg.compute_dtype)
  return sharding.constrain(x, ("batch", "seq", "embed"), rules)


def unembed(params: Params, x: jax.Array, cfg: ModelConfig, rules: sharding.Rules) -> jax.Array:
  """Final norm and output projection; the logits are float32 for the loss."""
  x = rms_norm(x, params["final_norm"], cfg)
  w_DV = params["embed"].T if cfg.tie_embeddings else params["lm_head"]
  logits = dense("btd,dv->btv", x, w_DV.astype(cfg.compute_dtype), preferred_element_type=jnp.float32)
  if cfg.final_logit_softcap is not None:
    logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
  return sharding.constrain(logits, ("batch", "seq", "vocab"), rules)


def tempered(logits: jax.Array, temperature: float) -> jax.Array:
  """logits / temperature: the logits of the policy at that temperature (at 1, the logits themselves)."""
  return logits if temperature == 1.0 else logits / temperature


def token_log_probs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
  """Log-probabilities [B, T] of int32 tokens [B, T] under logits [B, T, V]."""
  # log-softmax in float32 whatever the dtype of the logits.
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  # A one-hot select rather than a gather: its gradient is elementwise,
  # where a gather's is a scatter into a zero-filled [B, T, V] array.
  is_token = tokens[..., None] == jax.lax.broadcasted_iota(tokens.dtype, logits.shape, logits.ndim - 1)
  return jnp.where(is_token, logp, 0.0).sum(axis=-1)


def forward_with_cache(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    cache: Cache,
    *,
    positions: jax.Array,
    last_only: bool = False,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    angles: RopeAngles | None = None,
) -> tuple[jax.Array, Cache]:
  """Runs the decoder on T new tokens against a KV cache, as `forward` does on a whole sequence.

  The tokens' K/V are written at slots [cache.index, cache.index + T) and
  every token attends over the filled slots of its row (`kv_cache.attend`):
  prefill is a call with the prompts (or one per chunk of them), decoding a
  call per token. The layers run as the cache holds them
  (`kv_cache.decode_scans`): over a cache of one array per layer, unrolled
  (a decode loop passes `decode_params`, unstacked once outside the loop);
  over a stacked cache, under scans over the stacked weights, the cache in
  their carry (`decode_params` leaves the weights stacked).

  Args:
    params: the parameter tree of `ptx.models.params.param_specs(cfg)`.
    tokens: int32 token ids [B, T].
    cfg: the model config.
    cache: the cache (`ptx.models.kv_cache.init_cache`), B rows; slot s of
      row b holds position s - cache.starts[b], so the tokens' positions are
      cache.index + t - cache.starts[b] (slots before a row's start are its
      padding, never attended to). Or a `ptx.models.paged_kv_cache.PagedKVCache`,
      whose row b takes the tokens at positions lengths[b] + t.
    positions: int32 [B, T] positions of the tokens in their sequences.
    last_only: return the logits of the last token only, [B, 1, V] (prefill
      needs no more, and [B, T, V] logits can be large).
    rules: the sharding rules for activation constraints (used under a mesh).
    angles: `layer_rope(positions, cfg)`, for a decode loop that computes
      every step's angles once before the loop rather than the trig per step.

  Returns:
    (float32 logits [B, T, V] or [B, 1, V], the cache with the tokens written).
  """
  x, cache, _ = hidden_with_cache(params, tokens, cfg, cache, positions=positions, rules=rules, angles=angles)
  if last_only:
    x = x[:, -1:]
  return unembed(params, x, cfg, rules), cache


def hidden_with_cache(
    params: Params,
    tokens: jax.Array,
    cfg: ModelConfig,
    cache: Cache,
    *,
    positions: jax.Array,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    angles: RopeAngles | None = None,
    routes: jax.Array | None = None,
) -> tuple[jax.Array, Cache, moe.Trace]:
  """`forward_with_cache`'s residual stream [B, T, D] before the final norm, for losses that project in chunks.

  Returns (x, the cache, the MoE trace of the new tokens: `moe.Trace`). `routes` replays recorded experts
  ([B, T, L, k], as `hidden_states` takes them). Every MoE layer runs dropless here, whatever
  `cfg.moe_capacity_factor`: samplers decode through this forward, and a sampled token must not depend on which
  other tokens share its device's batch. (The shared-prompt loss path, `shared_prefix.grouped_stats`, runs here
  too, dropless as well.)
  """
  cfg = dataclasses.replace(cfg, moe_capacity_factor=None)
  x = embed(params, tokens, cfg, rules)
  if not cache.stacked:
    layers = unstack_layers(params, cfg)["layers"]
  elif isinstance(params["layers"], tuple):
    raise ValueError(f"a stacked KV cache (model.decode_loop={cfg.decode_loop!r} scans the decode step's layers) "
                     "runs the stacked weights, got them unstacked: pass `decode_params(params, cfg)`")
  else:
    layers = _stacks(params)
  x, cache, trace = _run_layers(layers, x, cfg, positions=positions, segment_ids=None, rules=rules, cache=cache,
                                angles=angles, routes=routes)
  return x, cache.advance(tokens.shape[1]), trace


def decode_params(params: Params, cfg: ModelConfig) -> Params:
  """The parameter tree a decode loop passes every step, prepared once before it: as it is for a decode step that
  scans the layers (`kv_cache.decode_scans`), else unstacked (`unstack_layers`)."""
  return params if kv_cache_lib.decode_scans(cfg) else unstack_layers(params, cfg)


def _stacks(params: Params) -> Params:
  """The layer stacks of `params` ({stack: stacked weights}), without the other parameters."""
  return {stack: params[stack] for stack in params_lib.STACKS if stack in params}


def decode_layers(
    params: Params,
    x: jax.Array,
    cfg: ModelConfig,
    *,
    positions: jax.Array | None,
    segment_ids: jax.Array | None,
    rules: sharding.Rules,
    routes: jax.Array | None = None,
    rows: RowLayout = "packed",
) -> tuple[jax.Array, moe.Trace]:
  """Runs the layers of `params` (its layer stacks; others are ignored) over the residual stream x [B, T, D].

  The stacks run under scans, or unrolled (`cfg.scan_layers`). Returns (x, the MoE layers' trace,
  `moe.Trace`). `routes` replays recorded experts ([B, T, L, k]); `rows` says what `segment_ids` hold
  (`ptx.models.attention_choice.RowLayout`).
  """
  layers = _stacks(params)
  if not cfg.scan_layers:
    layers = unstack_layers(layers, cfg)["layers"]
  x, _, trace = _run_layers(layers, x, cfg, positions=positions, segment_ids=segment_ids, rules=rules, cache=None,
                            routes=routes, rows=rows)
  return x, trace


def _runs(cfg: ModelConfig) -> list[tuple[str, int, int]]:
  """The layers in order as runs of consecutive layers of one stack: (stack, first index in it, end index)."""
  owner = {i: (stack, j) for stack in params_lib.STACKS for j, i in enumerate(cfg.stack_layers(stack))}
  runs: list[tuple[str, int, int]] = []
  for i in range(cfg.n_layers):
    stack, j = owner[i]
    if runs and runs[-1][0] == stack and runs[-1][2] == j:
      runs[-1] = (stack, runs[-1][1], j + 1)
    else:
      runs.append((stack, j, j + 1))
  return runs


def _run_layers(
    layers: Params,
    x: jax.Array,
    cfg: ModelConfig,
    *,
    positions: jax.Array | None,
    segment_ids: jax.Array | None,
    rules: sharding.Rules,
    cache: Cache | None,
    angles: RopeAngles | None = None,
    routes: jax.Array | None = None,
    rows: RowLayout = "packed",
) -> tuple[jax.Array, Cache | None, moe.Trace]:
  """The layers of `decode_layers`, reading and writing `cache` when one is given; (x, cache, MoE trace).

  Stacks ({stack: stacked weights}) run as scans, one per run of
  consecutive layers of one stack (`_runs`), a stacked cache (or none) in
  their carry, each layer's global index scanned beside its weights; a tuple of
  per-layer trees in layer order (`unstack_layers`) runs the same body once
  per layer, unrolled, as a cache of one array per layer requires. `angles`
  are `layer_rope(positions)` when the caller has them already; `routes`
  [B, T, L, k] are replayed, MoE layer l (of `cfg.stack_layers("layers")`)
  reading [:, :, l].
  """
  B, T, _ = x.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  if segment_ids is None:
    segment_ids = jnp.ones((B, T), jnp.int32)
  global_rope, local_rope = layer_rope(positions, cfg) if angles is None else angles
  windows = layer_windows(cfg)

  def body(x, cache, layer, window, replay, index):
    # Global layers have an int32-max window, so "is local" is a traced flag.
    is_local = False if window is None else window < jnp.iinfo(jnp.int32).max
    sin, cos = (jnp.where(is_local, lo, gl) for lo, gl in zip(local_rope, global_rope))
    return block(layer, x, cfg, sin=sin, cos=cos, window=window, positions=positions,
                 segment_ids=segment_ids, rules=rules, cache=cache, layer_index=index, replay=replay, rows=rows)

  unrolled = isinstance(layers, tuple)
  if cfg.remat != "none":
    # The layer index stays a Python int unrolled: it picks the cache's per-layer arrays (a scan over a stacked
    # cache traces it). Unrolled, the guard keeps XLA from merging the backward's recomputation into the forward
    # (CSE), which would undo the remat (JAX's `jax.checkpoint` docs); a scan cannot merge them, and there the
    # guard only costs.
    traced_index = cache is not None and not unrolled
    body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=unrolled,
                          static_argnums=() if traced_index else (5,))
  replays = None if routes is None else jnp.moveaxis(routes, 2, 0)  # [L, B, T, k]: scanned, or indexed per layer
  moe_layers = cfg.stack_layers("layers") if cfg.moe.enabled else ()
  traces = []  # the MoE layers' traces, stacked: per layer unrolled, per run scanned
  if unrolled:
    for index, layer in enumerate(layers):
      replay = None if replays is None or index not in moe_layers else replays[moe_layers.index(index)]
      x, cache, trace = body(x, cache, layer, None if windows is None else windows[index], replay, index)
      if trace.routes is not None:
        traces.append(jax.tree.map(lambda a: a[None], trace))
  else:
    def scan_body(carry, per_layer):
      x, cache, trace = body(*carry, *per_layer)
      return (x, cache), trace

    for stack, start, end in _runs(cfg):
      indices = cfg.stack_layers(stack)[start:end]
      weights = layers[stack]
      if end - start < len(cfg.stack_layers(stack)):
        # A copy of the run's layers, only for a pattern that interleaves stacks (a scanned decode step pays it
        # every token).
        weights = jax.tree.map(lambda w: w[start:end], weights)
      run_replays = None if replays is None or stack != "layers" else replays[start:end]
      # A stacked cache is read and written at each layer's index in it, the layer's place in the model.
      layer_ids = None if cache is None else jnp.asarray(indices, jnp.int32)
      (x, cache), trace = jax.lax.scan(scan_body, (x, cache), (weights, None if windows is None else jnp.asarray(
          windows[list(indices)]), run_replays, layer_ids))
      if trace.routes is not None:
        traces.append(trace)
  if not traces:
    return x, cache, moe.Trace({}, None)
  stats, ids, dropped = jax.tree.map(lambda *a: jnp.concatenate(a), *traces)
  return x, cache, moe.Trace(stats, jnp.moveaxis(ids, 0, 2), None if dropped is None else jnp.any(dropped, axis=0))


def unstack_layers(params: Params, cfg: ModelConfig) -> Params:
  """The parameter tree with `layers` as a tuple of per-layer trees in layer order (every stack's), for decode loops.

  Slicing one layer out of the stacked weights is a copy. Inside a decode
  loop XLA:CPU repeats it for every token under a scan (XLA does not hoist
  slices out of loops), so there samplers slice once before the loop and run
  the layers unrolled (`decode_params`). Already unstacked params are
  returned as they are.
  """
  if isinstance(params["layers"], tuple):
    return params
  per_layer = {}
  for stack in params_lib.STACKS:
    if stack in params:
      per_layer.update({i: jax.tree.map(lambda w, j=j: w[j], params[stack])
                        for j, i in enumerate(cfg.stack_layers(stack))})
  rest = {key: value for key, value in params.items() if key not in params_lib.STACKS}
  return {**rest, "layers": tuple(per_layer[i] for i in range(cfg.n_layers))}


def block(
    p: Params,
    x: jax.Array,
    cfg: ModelConfig,
    *,
    sin: jax.Array,
    cos: jax.Array,
    window: jax.Array | None,
    positions: jax.Array,
    segment_ids: jax.Array,
    rules: sharding.Rules,
    cache: Cache | None = None,
    layer_index: int | None = None,
    replay: jax.Array | None = None,
    rows: RowLayout = "packed",
) -> tuple[jax.Array, Cache | None, moe.Trace]:
  """One pre-norm decoder layer. `cfg` flags select parameters, never values.

  Without a cache the tokens attend to each other; with one, their K/V are
  written into layer `layer_index` of the cache first (an int, or traced under a scan over a stacked cache) and
  they attend over its filled slots (`kv_cache.attend`). Returns (x, cache, the layer's MoE trace: its
  statistics, experts [B, T, k] and dropped tokens [B, T] (`moe.moe_mlp`, which `replay` is passed to); {}, None,
  None for a dense MLP).
  """
  dtype = cfg.compute_dtype
  h = rms_norm(x, p["attn_norm"], cfg)
  if cfg.mla.enabled and cache is not None:  # the absorbed form: one latent KV head, values its first C columns
    q, k = mla.absorbed_queries_and_latents(p, h, cfg, sin=sin, cos=cos)
    v = k[..., :cfg.mla.kv_lora_rank]
    scale = mla.softmax_scale(cfg)
  elif cfg.mla.enabled:
    q, k, v = mla.queries_keys_values(p, h, cfg, sin=sin, cos=cos)
    scale = mla.softmax_scale(cfg)
  else:
    q, k, v = _queries_keys_values(p, h, cfg, sin=sin, cos=cos)
    scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
  q = sharding.constrain(q, ("batch", "seq", "heads", "head_dim"), rules)
  k = sharding.constrain(k, ("batch", "seq", "kv_heads", "head_dim"), rules)
  v = sharding.constrain(v, ("batch", "seq", "kv_heads", "head_dim"), rules)
  # The sinks join a float32 softmax's denominator, whatever the parameters' dtype.
  sinks = p["sinks"].astype(jnp.float32) if cfg.attention_sinks else None
  if cache is None:
    out = attention(q, k, v, segment_ids=segment_ids, positions=positions, impl=cfg.attention_impl,
                    window=window, softcap=cfg.attn_logit_softcap, scale=scale, rules=rules,
                    ring_heads_per_pass=cfg.ring_heads_per_pass, sinks=sinks, rows=rows)
  else:
    out, cache = cache.attend(layer_index, q, k, v, positions=positions, window=window,
                              softcap=cfg.attn_logit_softcap, scale=scale, rules=rules, sinks=sinks)
    if cfg.mla.enabled:
      out = mla.latent_values(p, out, cfg)
  out = lora.project("bthk,hkd->btd", out, p["o"], dtype)
  if cfg.o_bias:
    out = out + p["o_bias"].astype(dtype)[None, None]
  if cfg.post_norms:
    out = rms_norm(out, p["attn_post_norm"], cfg)
  x = sharding.constrain(x + out, ("batch", "seq", "embed"), rules)

  h = rms_norm(x, p["mlp_norm"], cfg)
  trace = moe.Trace({}, None, None)
  if "router" in p:
    out, *layer_trace = moe.moe_mlp(p, h, cfg, token_mask=segment_ids != 0, rules=rules, replay=replay)
    trace = moe.Trace(*layer_trace)
    if "gate" in p:  # shared experts
      out = out + gated_mlp(p, h, activation_of(cfg), dtype, rules)
  else:
    out = gated_mlp(p, h, activation_of(cfg), dtype, rules)
  if cfg.post_norms:
    out = rms_norm(out, p["mlp_post_norm"], cfg)
  return sharding.constrain(x + out, ("batch", "seq", "embed"), rules), cache, trace


def _queries_keys_values(p: Params, h: jax.Array, cfg: ModelConfig, *, sin: jax.Array,
                         cos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Grouped-query attention's q [B, T, H, K], k and v [B, T, N, K] from the normed residual h [B, T, D]."""
  dtype = cfg.compute_dtype
  # lora.project is a plain einsum, plus the low-rank term of a LoRA-adapted weight.
  q = lora.project("btd,dhk->bthk", h, p["q"], dtype)
  k = lora.project("btd,dnk->btnk", h, p["k"], dtype)
  v = lora.project("btd,dnk->btnk", h, p["v"], dtype)
  if cfg.qkv_bias:
    q, k, v = (x + p[f"{name}_bias"].astype(dtype)[None, None] for x, name in ((q, "q"), (k, "k"), (v, "v")))
  if cfg.qk_norm:
    q, k = rms_norm(q, p["q_norm"], cfg), rms_norm(k, p["k_norm"], cfg)
  return rope.apply_rope(q, sin, cos), rope.apply_rope(k, sin, cos), v


class Decoder(nnx.Module):
  """The decoder as a Flax NNX module: `model(tokens) -> logits [B, T, V]`.

  Its attributes mirror the parameter tree (`embed`, `layers`, `final_norm`,
  `lm_head`), so `nnx.state(model, nnx.Param).to_pure_dict()` is exactly the
  dict that `forward` and the training step take.
  """

  def __init__(
      self,
      cfg: ModelConfig,
      *,
      rngs: nnx.Rngs | None = None,
      params: Params | None = None,
      mesh: Mesh | None = None,
      rules: sharding.Rules = sharding.DEFAULT_RULES,
  ):
    """Creates the model from fresh initialisation (`rngs`) or given `params`.

    Args:
      cfg: the model config.
      rngs: initialise parameters from `rngs.params()`.
      params: use this parameter tree instead (e.g. loaded or trained).
      mesh: place freshly initialised parameters sharded on this mesh.
      rules: the sharding rules for parameters and activations.
    """
    if (rngs is None) == (params is None):
      raise ValueError("Decoder: pass exactly one of rngs= or params=")
    self.cfg = cfg
    self.rules = rules
    if params is None:
      out_shardings = None if mesh is None else params_lib.param_shardings(cfg, mesh, rules)
      params = jax.jit(params_lib.init_params, static_argnums=0, out_shardings=out_shardings)(cfg, rngs.params())
    expected = jax.tree.structure(params_lib.abstract_params(cfg))
    if jax.tree.structure(params) != expected:
      raise ValueError(f"Decoder: parameter tree {jax.tree.structure(params)} does not match the config's {expected}")
    for name, value in params.items():
      setattr(self, name, nnx.data(jax.tree.map(nnx.Param, value)))

  @property
  def params(self) -> Params:
    """The parameter tree as a plain dict of arrays."""
    return nnx.to_pure_dict(nnx.state(self, nnx.Param))

  def __call__(
      self, tokens: jax.Array, *, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
  ) -> jax.Array:
    """Returns float32 logits [B, T, V] for int32 tokens [B, T] (see `forward`)."""
    return _jitted_forward(self.params, tokens, self.cfg, positions=positions, segment_ids=segment_ids,
                           rules=self.rules)


# Eager module calls compile once per config and shape (inlined under an outer jit).
_jitted_forward = jax.jit(forward, static_argnames=("cfg", "rules"))
