"""In-graph generation: one prefill of the prompts, then a decode loop over a KV cache.

`generate_padded` is a pure function of arrays, to be jitted alone or inside
a larger program (an RL step); `generate` is the host entry point that pads
ragged prompts into shape buckets (`ptx.sampling.buckets`) and calls one
compiled program per bucket.

Layout: prompts are left-padded to P columns, so prompt b holds slots
[P - len_b, P) of the cache and generated token t of every row goes to slot
P + t. With `group_size` G each prompt is prefilled once for its G
consecutive rows (row b * G + g is sample g of prompt b): its K/V is copied
to each of them, or, for prompts of `SHARED_PREFIX_MIN_SLOTS` columns or
more, kept once and read by all G as their shared prefix, the rows' own
slots then holding generated token t at slot t
(`ptx.models.shared_prefix.prefill_groups`). The decode loop is a
`lax.while_loop` that stops at `max_new_tokens` or as soon as every row has
emitted one of its stop ids. On XLA:CPU, where a decode step reads its whole
cache, long budgets run it in phases over a cache that doubles between them,
so a step's attention costs what the filled part does (within 2x), not the
whole budget (`ptx_kernels.xla_cpu_workarounds`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from ptx_kernels import xla_cpu_workarounds

from ptx import sharding
from ptx.model_config import ModelConfig
from ptx.models import kv_cache, moe
from ptx.models.decoder import Params, decode_params, hidden_with_cache, layer_rope, tempered, token_log_probs, unembed
from ptx.models.shared_prefix import prefill_groups, shares_prompt_cache
from ptx.sampling import buckets
from ptx.sampling.rules import SamplingConfig, sample_tokens

# New tokens the first decode phase has cache room for (see `_phase_slots`). Small, so short generations
# read a cache near their fill.
PHASE_TOKENS = 16

# Finish reasons.
STOP = 1  # the row emitted one of its stop ids (counted in its length)
LENGTH = 2  # the row reached max_new_tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Generation:
  """Sampled continuations of R = B * G rows; row b * G + g is sample g of prompt b."""

  # int32 [R, N]: the generated tokens; pad_id after a row's length.
  tokens: jax.Array
  # int32 [R]: generated tokens per row, the stop token included.
  lengths: jax.Array
  # int32 [R]: STOP or LENGTH.
  finish_reasons: jax.Array
  # float32 [R, N]: log-prob of each token under the raw policy (temperature 1,
  # no truncation), as the training forward computes it, or with `tempered_log_probs`
  # under the policy at the sampling temperature (GRPO's); 0 after a row's length.
  log_probs: jax.Array
  # `moe.ROUTE_DTYPE` [R, P + N, L, k] with `record_routes`: the experts each MoE layer chose for each prompt
  # column, then each generated token; `moe.NO_ROUTE` on prompt padding, after a row's length and on a last token
  # that was never fed back (the budget's last, or the stop of the last row to stop). Else None.
  routes: jax.Array | None = None


class _Loop(NamedTuple):
  """The decode loop's carry."""

  t: jax.Array  # int32 []: tokens emitted so far by every row
  cache: kv_cache.KVCache
  tokens: jax.Array  # int32 [R, N]
  log_probs: jax.Array  # float32 [R, N]
  done: jax.Array  # bool [R]: the row has emitted a stop id
  lengths: jax.Array  # int32 [R]
  routes: jax.Array | None  # [R, N, L, k]: the experts of generated token t, written when it is fed (step t + 1)


def generate_padded(
    params: Params,
    prompt_tokens: jax.Array,
    prompt_lengths: jax.Array,
    stop_ids: jax.Array,
    rng: jax.Array,
    max_new_tokens: jax.Array | int,
    *,
    cfg: ModelConfig,
    sampling: SamplingConfig,
    budget: int,
    group_size: int = 1,
    kv_int8: bool = False,
    pad_id: int = 0,
    prefill_chunk: int | None = None,
    shared_prompts: bool | None = None,
    tempered_log_probs: bool = False,
    record_routes: bool = False,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
) -> Generation:
  """Samples up to `max_new_tokens` tokens after each of B left-padded prompts, G times each.

  Args:
    params: the decoder's parameter tree.
    prompt_tokens: int32 [B, P], each prompt right-aligned (left-padded).
    prompt_lengths: int32 [B] prompt lengths, each in 1..P.
    stop_ids: int32 [B, K] stop ids of each prompt, padded with -1.
    rng: a PRNG key; every uniform the sampler uses is drawn from it up front.
    max_new_tokens: int32 scalar <= budget (traced, so one program serves
      every value up to its budget).
    cfg: the model config.
    sampling: the sampling rules.
    budget: static generation capacity N (the width of the outputs).
    group_size: samples per prompt G.
    kv_int8: keep the KV cache in int8 with per-slot, per-head scales.
    pad_id: the token written after a row stops.
    prefill_chunk: prefill the prompts this many columns at a time (each
      chunk attends over the cache filled so far), so prefill memory grows
      with P * chunk rather than P * P; must divide P. None: one pass.
    shared_prompts: with G > 1, keep one copy of each prompt's K/V that its
      rows share (True) or copy it to every row (False); None: share prompts
      of at least `shared_prefix.SHARED_PREFIX_MIN_SLOTS` columns.
    tempered_log_probs: `log_probs` are those of softmax(logits /
      sampling.temperature), untruncated, as GRPO's loss takes them; False:
      the raw policy's.
    record_routes: return the experts every MoE layer chose for every token
      (`Generation.routes`, for routing replay); needs a MoE model.
    rules: sharding rules for activations and the cache (a mesh whose `seq`
      axis shards the cache's slots keeps it sharded: see `kv_cache`).

  Returns:
    A Generation of B * G rows and N columns.
  """
  P, R = prompt_tokens.shape[1], prompt_tokens.shape[0] * group_size
  if prefill_chunk is not None and P > prefill_chunk and P % prefill_chunk:
    raise ValueError(f"prefill_chunk {prefill_chunk} must divide the padded prompt length {P}")
  params = decode_params(params, cfg)  # once, outside the loop
  # The slots before a row's first generated token: its prompt's, unless its group shares them as a prefix.
  offset, seq_devices = (0 if shares_prompt_cache(group_size, P, shared_prompts) else P), _seq_devices(rules)
  phases = _phase_slots(offset, budget, seq_devices)
  if record_routes and not cfg.moe.enabled:
    raise ValueError("generate_padded: record_routes needs a Mixture-of-Experts model (model.moe.n_experts > 0)")
  prefill_logits_RV, cache, prompt_routes = prefill_groups(params, prompt_tokens, prompt_lengths, cfg, group_size,
                                            new_slots=phases[0] - offset, chunk=prefill_chunk, kv_int8=kv_int8,
                                            slot_multiple=seq_devices, shared_prompts=shared_prompts, rules=rules)
  lengths_R = jnp.repeat(prompt_lengths, group_size)
  stop_RK = jnp.repeat(stop_ids, group_size, axis=0)
  uniforms_NR = sharding.constrain(jax.random.uniform(rng, (budget, R)), (None, "batch"), rules)

  logprob_temperature = sampling.temperature if tempered_log_probs else 1.0

  def emit(loop: _Loop, logits_RV: jax.Array) -> _Loop:
    logits_RV = sharding.constrain(logits_RV, ("batch", "vocab"), rules)
    token = sample_tokens(logits_RV, uniforms_NR[loop.t], sampling)
    log_prob = token_log_probs(tempered(logits_RV, logprob_temperature)[:, None], token[:, None])[:, 0]
    live = ~loop.done
    token, log_prob = jnp.where(live, token, pad_id), jnp.where(live, log_prob, 0.0)
    column = (jnp.zeros((), jnp.int32), loop.t)
    stopped = live & jnp.any(token[:, None] == stop_RK, axis=-1)
    return loop._replace(
        t=loop.t + 1,
        tokens=jax.lax.dynamic_update_slice(loop.tokens, token[:, None], column),
        log_probs=jax.lax.dynamic_update_slice(loop.log_probs, log_prob[:, None], column),
        done=loop.done | stopped, lengths=loop.lengths + live.astype(jnp.int32))

  # Step t feeds token t - 1 at position length + t - 1 < P + N. The RoPE angles of every position, computed
  # once ([1, P + N, head_dim // 2], as the cache's size grows with P + N): each step gathers its rows' angles.
  angle_table = layer_rope(jnp.arange(P + budget, dtype=jnp.int32)[None, :], cfg)

  def step(loop: _Loop) -> _Loop:
    last_R1 = jax.lax.dynamic_slice_in_dim(loop.tokens, loop.t - 1, 1, axis=1)
    positions_R1 = (lengths_R + loop.t - 1)[:, None]
    angles_R1 = jax.tree.map(lambda table: jnp.take(table[0], positions_R1, axis=0), angle_table)
    x, cache, trace = hidden_with_cache(params, last_R1, cfg, loop.cache, positions=positions_R1, rules=rules,
                                        angles=angles_R1)
    routes = loop.routes
    if record_routes:  # token t - 1 is the row's own while the row has emitted more than t - 1 tokens
      fed = (loop.t - 1 < loop.lengths)[:, None, None, None]
      routes = jax.lax.dynamic_update_slice_in_dim(routes, jnp.where(fed, trace.routes, moe.NO_ROUTE), loop.t - 1,
                                                   axis=1)
    return emit(loop._replace(cache=cache, routes=routes), unembed(params, x, cfg, rules)[:, 0])

  def running(loop: _Loop) -> jax.Array:
    return (loop.t < max_new_tokens) & ~jnp.all(loop.done)

  start = _Loop(t=jnp.zeros((), jnp.int32), cache=cache,
                tokens=jnp.full((R, budget), pad_id, jnp.int32),
                log_probs=jnp.zeros((R, budget), jnp.float32),
                done=jnp.zeros((R,), bool), lengths=jnp.zeros((R,), jnp.int32),
                routes=moe.no_routes(R, budget, cfg) if record_routes else None)
  loop = emit(start, prefill_logits_RV)
  for slots in phases:
    # Step t writes the K/V of token t - 1 at slot offset + t - 1, so this cache serves steps t <= slots - offset.
    loop = jax.lax.while_loop(lambda loop, slots=slots: running(loop) & (loop.t <= slots - offset), step,
                              loop._replace(cache=kv_cache.grow(loop.cache, slots, rules)))
  routes = None
  if record_routes:
    routes = jnp.concatenate([jnp.repeat(prompt_routes, group_size, axis=0), loop.routes], axis=1)
  return Generation(tokens=loop.tokens, lengths=loop.lengths,
                    finish_reasons=jnp.where(loop.done, STOP, LENGTH).astype(jnp.int32), log_probs=loop.log_probs,
                    routes=routes)


# The arguments of `generate_padded` that are static under jit.
STATIC_ARGNAMES = ("cfg", "sampling", "budget", "group_size", "kv_int8", "pad_id", "prefill_chunk", "shared_prompts",
                   "tempered_log_probs", "record_routes", "rules")
_generate_jit = jax.jit(generate_padded, static_argnames=STATIC_ARGNAMES)


def generate(
    params: Params,
    prompts: Sequence[Sequence[int]],
    *,
    cfg: ModelConfig,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    rng: jax.Array,
    stop_ids: Sequence[int] | Sequence[Sequence[int]] = (),
    group_size: int = 1,
    mesh: Mesh | None = None,
    kv_int8: bool = False,
    pad_id: int = 0,
    prefill_chunk: int | None = None,
    shared_prompts: bool | None = None,
    tempered_log_probs: bool = False,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    budget: int | None = None,
) -> Generation:
  """Samples continuations of ragged prompts with one compiled program per shape bucket.

  Args:
    params: the decoder's parameter tree (a TrainState's `.params`, or
      `Decoder.params`), placed as training placed it.
    prompts: B token-id sequences, each non-empty.
    cfg: the model config.
    max_new_tokens: tokens to generate at most per row.
    sampling: the sampling rules.
    rng: a PRNG key.
    stop_ids: ids that end a row, shared by all prompts or one sequence per prompt.
    group_size: samples per prompt G; each prompt is prefilled once.
    mesh: run sharded on this mesh (batch over the data axes, KV heads over
      `tensor`); None runs on the default device.
    kv_int8: keep the KV cache in int8 (per-slot, per-head scales).
    pad_id: the token that pads prompts and follows a stopped row.
    prefill_chunk: prefill long prompts this many tokens at a time (a power
      of two; prompts are padded to a power of two >= 8). None: one pass.
    shared_prompts: with groups, one copy of each prompt's K/V for its rows
      (True), a copy per row (False), or by the padded prompt's length
      (None: `generate_padded`).
    tempered_log_probs: return the log-probs of the policy at
      `sampling.temperature` instead of the raw policy's.
    rules: the sharding rules.
    budget: the decode length the compiled program holds, rounded up to a
      bucket (None: `max_new_tokens`'s). Calls with different
      `max_new_tokens` under one budget share one program, and a call with
      `max_new_tokens=1` compiles a longer call's program cheaply.

  Returns:
    A Generation of B * G rows and `max_new_tokens` columns.

  Raises:
    ValueError: `budget` below `max_new_tokens`.
  """
  if budget is not None and budget < max_new_tokens:
    raise ValueError(f"generate: budget={budget} is below max_new_tokens={max_new_tokens}")
  rows = buckets.bucket(len(prompts), 1 if mesh is None else _batch_devices(mesh, rules))
  tokens, lengths = buckets.left_pad(prompts, rows, buckets.bucket(max(len(p) for p in prompts), 8), pad_id)
  arrays = (tokens, lengths, buckets.stop_table(stop_ids, len(prompts), rows))
  context = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
  if mesh is not None:
    arrays = tuple(jax.device_put(x, _batch_sharding(x, mesh, rules)) for x in arrays)
  with context:
    out = _generate_jit(params, *arrays, rng, np.int32(max_new_tokens), cfg=cfg, sampling=sampling,
                        budget=buckets.bucket(budget or max_new_tokens, 8), group_size=group_size, kv_int8=kv_int8,
                        pad_id=pad_id, prefill_chunk=prefill_chunk, shared_prompts=shared_prompts,
                        tempered_log_probs=tempered_log_probs, rules=rules)
  n = len(prompts) * group_size
  if (n, max_new_tokens) == out.tokens.shape:
    return out
  return Generation(tokens=out.tokens[:n, :max_new_tokens], lengths=out.lengths[:n],
                    finish_reasons=out.finish_reasons[:n], log_probs=out.log_probs[:n, :max_new_tokens])


def _batch_sharding(x: np.ndarray, mesh: Mesh, rules: sharding.Rules) -> NamedSharding:
  names = ("batch",) + (None,) * (x.ndim - 1)
  return NamedSharding(mesh, sharding.logical_to_spec(names, rules, shape=x.shape, mesh=mesh))


def _batch_devices(mesh: Mesh | jax.sharding.AbstractMesh, rules: sharding.Rules, logical: str = "batch") -> int:
  """How many ways `logical` (the batch: the padded batch is a multiple of it) is split on `mesh`."""
  axes = sharding.logical_to_spec((logical,), rules, mesh=mesh)[0] or ()
  return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def _phase_slots(offset: int, budget: int, multiple: int) -> list[int]:
  """Cache sizes of the decode phases: room for PHASE_TOKENS new tokens, doubling up to offset + budget - 1 slots.

  On XLA:CPU every decode step reads its whole cache (`kv_cache.attend`),
  so the cache grows between phases, one copy each, and a step costs at
  most about twice its filled part; elsewhere a step reads the filled
  blocks only and one phase holds the whole budget. `offset` is the slots
  before the first new token (the prompt's, or 0 under a shared prefix).
  The last token is sampled but never fed back, hence budget - 1. Sizes
  are rounded up to a multiple of the devices along `seq`.
  """
  round_up = lambda n: -(-n // multiple) * multiple  # noqa: E731
  sizes, room = [], PHASE_TOKENS
  while room < budget - 1 and xla_cpu_workarounds.active():
    sizes.append(round_up(offset + room))
    room *= 2
  return sizes + [round_up(max(offset + budget - 1, 1))]


def _seq_devices(rules: sharding.Rules) -> int:
  """How many ways the current mesh splits the cache's slots (1 without a mesh)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else _batch_devices(mesh, rules, "seq")
