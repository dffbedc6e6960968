"""Drafters: what a speculative engine proposes after a sequence's context, for the policy to verify.

Two kinds. A `Drafter` is host code that reads the tokens of one sequence
(its prompt, what it generated and the pending token) and proposes up to k
next tokens; it is deterministic (its proposal is a function of the context
alone), so accepting a draft exactly when the policy samples it keeps the
policy's distribution. A `DraftModel` is a small model of the policy's
tokenizer that samples its drafts on the device, whose distribution enters
the rejection rule (`ptx.sampling.speculative`).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np

from ptx.config import ModelConfig
from ptx.models.decoder import Params


class Drafter(Protocol):
  """Proposes tokens after a context."""

  def propose(self, context: Sequence[int], k: int) -> list[int]:
    """Up to `k` tokens expected after `context` (fewer, or none, when it has no guess)."""


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
  """Prompt lookup: the tokens that followed an earlier occurrence of the context's last n tokens.

  Tries n = max_ngram down to min_ngram; no extra model. Pays where output
  repeats its input (code edits, quoting, extraction).
  """

  # Longest suffix looked up: longer suffixes find fewer but surer continuations.
  max_ngram: int = 3
  # Shortest suffix looked up.
  min_ngram: int = 1

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"NgramDrafter needs 1 <= min_ngram <= max_ngram, got min_ngram={self.min_ngram}, "
                       f"max_ngram={self.max_ngram}")

  def propose(self, context: Sequence[int], k: int) -> list[int]:
    """Up to `k` tokens after `context`, copied from behind the latest occurrence of its longest repeated suffix."""
    tokens = np.asarray(context, np.int64)
    for n in range(self.max_ngram, self.min_ngram - 1, -1):
      if k < 1 or len(tokens) <= n:
        continue
      # Windows ending before the last token: the suffix itself is no match, and a match has a token after it.
      windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
      hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
      if hits.size:
        # The latest match that k tokens follow (in a loop, the nearest one is followed by a single token), else
        # the earliest, which the most tokens follow.
        full = hits[hits + n + k <= len(tokens)]
        start = int(full[-1] if full.size else hits[0]) + n
        return tokens[start:start + k].tolist()
    return []


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
