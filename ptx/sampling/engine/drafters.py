"""Drafters: what a speculative engine proposes after a sequence's context, for the policy to verify.

A host `Drafter` reads the tokens of one sequence (its prompt, what it
generated and the pending token) and proposes up to k next tokens; it is
deterministic (its proposal is a function of the context alone), so
accepting a draft exactly when the policy samples it keeps the policy's
distribution. The engine verifies its proposals one round per call.

A `DeviceDrafter` drafts on the device, for every row at once, inside the
speculative engine's loop of verify rounds (`engine_programs.speculate_pages`),
so a call runs several rounds without the host. It is hashable, a static
argument of that program, with two methods: `draft` proposes each row's
drafts after its context (with their distribution q, for a drafter that
samples), and `accept` turns the policy's logits after the pending token and
each draft into the tokens the row emits and the drafts it accepts
(`ptx.sampling.engine.acceptance`). `NgramDrafter` is one: a deterministic rule,
whose drafts are accepted exactly when the policy samples them.
`ModelDrafter` is the other, a `DraftModel`'s (`DraftModel.device_drafter`):
a small model of the policy's tokenizer samples the drafts, and its q enters
the rejection rule. The draft model's parameters are not part of it but an
argument of the program, so new parameters compile nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp

from ptx import sharding
from ptx.model_config import ModelConfig
from ptx.models.decoder import Params, hidden_states, unembed
from ptx.sampling.rules import SamplingConfig, invert_cdf, probabilities
from ptx.sampling.engine.acceptance import (ACCEPT_STREAM, DRAFT_STREAM, accept_deterministic, rejection_sample,
                                      uniforms)


class Drafter(Protocol):
  """Proposes tokens after a context."""

  def propose(self, context: Sequence[int], k: int) -> list[int]:
    """Up to `k` tokens expected after `context` (fewer, or none, when it has no guess)."""


class DeviceDrafter(Protocol):
  """Drafts for every row at once on the device, and accepts them; hashable (a static argument of its program)."""

  def draft(self, draft_params: Params | None, context_RL: jax.Array, lengths_R: jax.Array, wanted_R: jax.Array,
            K: int, seq_ids: jax.Array, sampled: jax.Array, key: jax.Array, *, sampling: SamplingConfig,
            rules: sharding.Rules) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Up to wanted_R[r] tokens after each row's context, and what `accept` needs of how they were drawn.

    Args:
      draft_params: a draft model's parameters, or None.
      context_RL: int32 [R, L]: row r's context, its pending token last, in
        its first lengths_R[r] columns.
      lengths_R: int32 [R].
      wanted_R: int32 [R]: drafts wanted, at most K (0: none).
      K: the drafts' width.
      seq_ids: int32 [R]: each row's sequence.
      sampled: int32 [R]: the index of each row's next token (its uniforms').
      key: the engine's PRNG key.
      sampling: the sampling rules.
      rules: the sharding rules.

    Returns:
      (int32 drafts [R, K], padded past each row's count; int32 counts [R];
      the drafts' distribution q [R, K, V], or None for deterministic drafts).
    """

  def accept(self, logits_RTV: jax.Array, drafts_RK: jax.Array, n_R: jax.Array, q: jax.Array | None,
             seq_ids: jax.Array, sampled: jax.Array, key: jax.Array, *,
             sampling: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """The tokens each row emits, given the policy's logits [R, K + 1, V] after its pending token and each draft.

    Returns:
      (int32 tokens [R, K + 1], int32 accepted drafts [R]); row r emits
      tokens[r, :accepted[r] + 1].
    """


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
  """Prompt lookup on the device: the tokens that followed an earlier occurrence of the context's last n tokens.

  Tries n = max_ngram down to min_ngram; no extra model. Pays where output
  repeats its input (code edits, quoting, extraction). A `DeviceDrafter`: it
  drafts inside the speculative engine's device loop
  (`engine_programs.speculate_pages`), so a call runs several verify rounds
  without a host round trip.
  """

  # Longest suffix looked up: longer suffixes find fewer but surer continuations.
  max_ngram: int = 3
  # Shortest suffix looked up.
  min_ngram: int = 1

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"NgramDrafter needs 1 <= min_ngram <= max_ngram, got min_ngram={self.min_ngram}, "
                       f"max_ngram={self.max_ngram}")

  def draft(self, draft_params: Params | None, context_RL: jax.Array, lengths_R: jax.Array, wanted_R: jax.Array,
            K: int, seq_ids: jax.Array, sampled: jax.Array, key: jax.Array, *, sampling: SamplingConfig,
            rules: sharding.Rules) -> tuple[jax.Array, jax.Array, None]:
    """`lookup`'s drafts, with no q: they are a function of the context."""
    return *self.lookup(context_RL, lengths_R, wanted_R, K), None

  def accept(self, logits_RTV: jax.Array, drafts_RK: jax.Array, n_R: jax.Array, q: None, seq_ids: jax.Array,
             sampled: jax.Array, key: jax.Array, *, sampling: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """The policy's tokens, each drawn with its own uniform, and the leading drafts they equal (decoding's tokens)."""
    uniforms_RT = uniforms(key, seq_ids, sampled, logits_RTV.shape[1])
    return accept_deterministic(logits_RTV, drafts_RK, n_R, uniforms_RT, sampling)

  def lookup(self, context_RL: jax.Array, lengths_R: jax.Array, k_R: jax.Array, K: int) -> tuple[jax.Array, jax.Array]:
    """Up to k_R[r] tokens after each row's context, copied from behind the latest occurrence of its last n tokens.

    For each n from max_ngram down, a match is an earlier window of n tokens
    equal to the context's last n that ends before the last token. The drafts
    follow the latest match that k tokens follow (in a loop, the nearest one
    is followed by a single token), else the earliest, which the most follow.

    Args:
      context_RL: int32 [R, L]: row r's context in its first lengths_R[r] columns.
      lengths_R: int32 [R].
      k_R: int32 [R]: drafts wanted, at most K (0: none).
      K: the drafts' width.

    Returns:
      (int32 drafts [R, K], 0 past each row's count; int32 counts [R]).
    """
    R, L = context_RL.shape
    at_R1 = jnp.arange(L, dtype=jnp.int32)[None]
    padded_RL = jnp.pad(context_RL, ((0, 0), (0, self.max_ngram)))
    lengths_R1, k_R1 = lengths_R[:, None], k_R[:, None]
    found_R, start_R = jnp.zeros((R,), bool), jnp.zeros((R,), jnp.int32)
    for n in range(self.max_ngram, self.min_ngram - 1, -1):
      suffix_Rn = jnp.take_along_axis(context_RL, jnp.clip(lengths_R1 - n + jnp.arange(n)[None], 0, L - 1), axis=1)
      match_RL = (at_R1 + n <= lengths_R1 - 1)
      for i in range(n):
        match_RL &= padded_RL[:, i:i + L] == suffix_Rn[:, i:i + 1]
      latest_full_R = jnp.max(jnp.where(match_RL & (at_R1 + n + k_R1 <= lengths_R1), at_R1, -1), axis=1)
      earliest_R = jnp.min(jnp.where(match_RL, at_R1, L), axis=1)
      hit_R = jnp.any(match_RL, axis=1) & ~found_R
      start_R = jnp.where(hit_R, jnp.where(latest_full_R >= 0, latest_full_R, earliest_R) + n, start_R)
      found_R |= hit_R
    counts_R = jnp.where(found_R, jnp.clip(jnp.minimum(k_R, lengths_R - start_R), 0, K), 0).astype(jnp.int32)
    drafts_RK = jnp.take_along_axis(context_RL, jnp.clip(start_R[:, None] + jnp.arange(K)[None], 0, L - 1), axis=1)
    return jnp.where(jnp.arange(K)[None] < counts_R[:, None], drafts_RK, 0).astype(jnp.int32), counts_R


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
  """A `DraftModel`'s drafting on the device: its config and window, static; its parameters are the program's."""

  cfg: ModelConfig
  window: int

  def draft(self, draft_params: Params | None, context_RL: jax.Array, lengths_R: jax.Array, wanted_R: jax.Array,
            K: int, seq_ids: jax.Array, sampled: jax.Array, key: jax.Array, *, sampling: SamplingConfig,
            rules: sharding.Rules) -> tuple[jax.Array, jax.Array, jax.Array]:
    """K tokens per row sampled from its last `window` context tokens, the first wanted_R[r] its drafts, with q.

    The window (left-aligned, then room for the drafts) is read afresh each
    round: the draft model runs K full forwards over it, with no cache of its
    own to keep in step with the pages. Draft j of a row whose next token is
    its sampled[r]-th uses that token's uniform of the draft stream.
    """
    R, L = context_RL.shape
    used_R = jnp.minimum(lengths_R, self.window)
    at_RW = jnp.arange(self.window + K)[None]
    window_RW = jnp.take_along_axis(context_RL, jnp.clip(lengths_R[:, None] - used_R[:, None] + at_RW, 0, L - 1),
                                    axis=1)
    window_RW = jnp.where(at_RW < used_R[:, None], window_RW, 0)
    draft_u_RK = uniforms(jax.random.fold_in(key, DRAFT_STREAM), seq_ids, sampled, K)

    def draw(j, carry):
      window_RW, q_RKV = carry
      # Only the last real position's logits: the vocabulary projection of every window position would cost more
      # than the layers of a small draft model.
      x_RWD, _ = hidden_states(draft_params, window_RW, self.cfg, rules=rules)
      x_R1D = jnp.take_along_axis(x_RWD, (used_R + j - 1)[:, None, None], axis=1)
      q_RV = probabilities(unembed(draft_params, x_R1D, self.cfg, rules)[:, 0], sampling)
      window_RW = window_RW.at[jnp.arange(R), used_R + j].set(invert_cdf(q_RV, draft_u_RK[:, j]))
      return window_RW, q_RKV.at[:, j].set(q_RV)

    q_RKV = jnp.zeros((R, K, self.cfg.vocab_size), jnp.float32)
    window_RW, q_RKV = jax.lax.fori_loop(0, K, draw, (window_RW, q_RKV))
    return jnp.take_along_axis(window_RW, used_R[:, None] + jnp.arange(K)[None], axis=1), wanted_R, q_RKV

  def accept(self, logits_RTV: jax.Array, drafts_RK: jax.Array, n_R: jax.Array, q: jax.Array, seq_ids: jax.Array,
             sampled: jax.Array, key: jax.Array, *, sampling: SamplingConfig) -> tuple[jax.Array, jax.Array]:
    """The rejection rule (`rejection_sample`): tests with uniforms of the accept stream, tokens with their own."""
    R, T, V = logits_RTV.shape
    return rejection_sample(probabilities(logits_RTV.reshape(R * T, V), sampling).reshape(R, T, V), q, drafts_RK, n_R,
                            uniforms(jax.random.fold_in(key, ACCEPT_STREAM), seq_ids, sampled, T - 1),
                            uniforms(key, seq_ids, sampled, T))


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModel:
  """A small model of the policy's vocabulary that drafts on the device from each sequence's last `window` tokens.

  It reads a window rather than keeping a cache: nothing of it has to follow
  the policy's pages through prefill, copies, `extend` or an update, and a
  drafter needs no more than the recent context to guess the next tokens. Its
  K draws cost K forwards of window + K tokens of the draft model per verify.
  """

  # The draft model's parameter tree, placed where the policy's rows run (replicated, or as training places it).
  params: Params
  cfg: ModelConfig
  # Context tokens the draft model reads: the sequence's last ones, its pending token included.
  window: int = 64

  def __post_init__(self):
    if self.window < 1:
      raise ValueError(f"DraftModel.window must be >= 1, got {self.window}")

  @property
  def device_drafter(self) -> ModelDrafter:
    """Its drafting, a static argument of the engine's program; `params` go to the program beside it."""
    return ModelDrafter(self.cfg, self.window)
