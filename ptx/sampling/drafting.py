"""Drafters: what a speculative engine proposes after a sequence's context, for the policy to verify.

Three kinds. A `Drafter` is host code that reads the tokens of one sequence
(its prompt, what it generated and the pending token) and proposes up to k
next tokens; it is deterministic (its proposal is a function of the context
alone), so accepting a draft exactly when the policy samples it keeps the
policy's distribution. `NgramDrafter` is such a deterministic rule computed
on the device, for every row at once, so that a call can verify several
rounds without the host. A `DraftModel` is a small model of the policy's
tokenizer that samples its drafts on the device, whose distribution enters
the rejection rule (`ptx.sampling.speculative`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp

from ptx.config import ModelConfig
from ptx.models.decoder import Params


class Drafter(Protocol):
  """Proposes tokens after a context."""

  def propose(self, context: Sequence[int], k: int) -> list[int]:
    """Up to `k` tokens expected after `context` (fewer, or none, when it has no guess)."""


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
  """Prompt lookup on the device: the tokens that followed an earlier occurrence of the context's last n tokens.

  Tries n = max_ngram down to min_ngram; no extra model. Pays where output
  repeats its input (code edits, quoting, extraction). It drafts inside the
  speculative engine's device loop (`engine_programs.speculate_pages`), so a
  call runs several verify rounds without a host round trip.
  """

  # Longest suffix looked up: longer suffixes find fewer but surer continuations.
  max_ngram: int = 3
  # Shortest suffix looked up.
  min_ngram: int = 1

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"NgramDrafter needs 1 <= min_ngram <= max_ngram, got min_ngram={self.min_ngram}, "
                       f"max_ngram={self.max_ngram}")

  def drafts(self, context_RL: jax.Array, lengths_R: jax.Array, k_R: jax.Array, K: int) -> tuple[jax.Array, jax.Array]:
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
