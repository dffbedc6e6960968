"""Composing one message to the model within a token budget: fixed text, ranked passages, a summarised history.

`ContextBuilder(tokenizer, budget).compose(fixed, passages, history)` renders
the parts in that order, by priority:
  fixed     always kept whole (instructions, the question, a tool call's
            status); when it cannot fit with the notes below, `compose`
            raises an error naming `fixed` and `ContextBuilder.budget`.
  passages  ranked: whole passages in rank order while they fit; the first
            that does not is cut at a token boundary (marked `[cut]`) when at
            least `min_cut_tokens` of it fit, else dropped, and the passages
            after it are left out; a note says how many were left out.
  history   one short line per earlier step (each cut to `line_tokens`),
            oldest first; when the budget is short, the oldest lines are
            merged into a count of what is not shown.

Invariant: the message never exceeds the budget, measured with the
tokenizer's `encode` on the whole rendered text (never a sum of parts, which
a BPE tokenizer need not respect). `compose` starts from the smallest
message that keeps the contract (the fixed part and the notes on everything
left out) and only ever keeps a larger candidate once it has measured it.

Episodes are append-only (token in, token out: `ptx.episodes.loop`), so a
builder never rewrites what the model already saw: an environment composes
the first prompt (instructions, question, top passages for the question)
and then each tool reply (this turn's new passages and the history summary)
as separate messages, each within its own budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ptx.data.tokenizer import Tokenizer

_CUT = " [cut]"
_HISTORY = "Earlier in this episode:"


@dataclasses.dataclass(frozen=True)
class Message:
  """A composed message and what it kept of each part."""

  text: str
  tokens: int  # len(tokenizer.encode(text)), at most the budget
  passages_whole: int  # the first passages_whole passages are shown whole
  passage_cut: bool  # the passage after them is shown cut
  passages_left_out: int  # passages not shown at all
  history_shown: int  # the newest history lines shown
  history_merged: int  # the oldest history lines counted, not shown


@dataclasses.dataclass(frozen=True)
class ContextBuilder:
  """Composes messages within `budget` tokens of `tokenizer` (see the module docstring).

  Attributes:
    tokenizer: counts tokens with `encode`.
    budget: the most tokens a composed message holds.
    line_tokens: the most tokens of one history line.
    min_cut_tokens: a passage that fits with fewer of its tokens is dropped, not cut.
  """

  tokenizer: Tokenizer
  budget: int
  line_tokens: int = 40
  min_cut_tokens: int = 16

  def __post_init__(self):
    for name in ("budget", "line_tokens", "min_cut_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"ContextBuilder.{name} must be >= 1, got {getattr(self, name)}")

  def count(self, text: str) -> int:
    """Tokens of `text`."""
    return len(self.tokenizer.encode(text))

  def line(self, text: str) -> str:
    """`text` as one line of at most `line_tokens` tokens (newlines become spaces; cut at a token boundary)."""
    flat = " ".join(text.split())
    if self.count(flat) <= self.line_tokens:
      return flat
    return self._prefix(flat, self.line_tokens - self.count(" …"), ok=lambda s: self.count(s) <= self.line_tokens,
                        suffix=" …") or ""

  def compose(self, fixed: str, passages: Sequence[str] = (), history: Sequence[str] = ()) -> Message:
    """The message: `fixed` whole, then as many ranked `passages` and recent `history` lines as fit.

    Args:
      fixed: text always kept whole.
      passages: passages, best first.
      history: earlier steps' summaries, oldest first (each becomes one line).

    Returns:
      The message and what it holds.

    Raises:
      ValueError: when `fixed` with the notes on what is left out exceeds the budget.
    """
    lines = [self.line(h) for h in history]
    parts = _Parts(fixed, passages, lines)
    smallest = parts.render(0, None, 0)
    if self.count(smallest) > self.budget:
      raise ValueError(f"ContextBuilder.compose: fixed is {self.count(fixed)} tokens; with the notes on what is left "
                       f"out the message needs {self.count(smallest)}, over ContextBuilder.budget={self.budget}")
    whole, cut = 0, None
    for passage in passages:
      if self.count(parts.render(whole + 1, None, 0)) <= self.budget:
        whole += 1
        continue
      most = self.count(passage) - 1  # a cut keeps less than the whole
      if most >= self.min_cut_tokens:
        cut = self._prefix(passage, most, ok=lambda s: self.count(parts.render(whole, s, 0)) <= self.budget,
                           suffix=_CUT, at_least=self.min_cut_tokens)
      break
    shown = next(n for n in range(len(lines), -1, -1)
                 if n == 0 or self.count(parts.render(whole, cut, n)) <= self.budget)
    text = parts.render(whole, cut, shown)
    return Message(text, self.count(text), whole, cut is not None, len(passages) - whole - (cut is not None), shown,
                   len(lines) - shown)

  def _prefix(self, text: str, most: int, *, ok, suffix: str, at_least: int = 0) -> str | None:
    """The longest `text[:n tokens] + suffix` with at_least <= n <= most that `ok` accepts, or None.

    Binary search over n: `ok` is monotone in n up to a tokenizer's merges at the seam, and whatever is returned
    has passed `ok` itself.
    """
    ids = self.tokenizer.encode(text)
    best, lo, hi = None, at_least, min(most, len(ids))
    while lo <= hi:
      n = (lo + hi) // 2
      # A cut inside a multi-byte character decodes to U+FFFD: drop it rather than show it.
      candidate = self.tokenizer.decode(ids[:n]).rstrip("\ufffd").rstrip() + suffix
      if ok(candidate):
        best, lo = candidate, n + 1
      else:
        hi = n - 1
    return best


@dataclasses.dataclass(frozen=True)
class _Parts:
  """The parts of one message, rendered with some of the passages and history lines."""

  fixed: str
  passages: Sequence[str]
  lines: Sequence[str]

  def render(self, whole: int, cut: str | None, shown: int) -> str:
    """The text with the first `whole` passages, then `cut` (a cut passage), and the newest `shown` history lines."""
    blocks = [self.fixed, *self.passages[:whole]]
    if cut is not None:
      blocks.append(cut)
    left_out = len(self.passages) - whole - (cut is not None)
    if left_out:
      blocks.append(f"[{left_out} more passage{'s' * (left_out > 1)} left out]")
    if self.lines:
      merged = len(self.lines) - shown
      history = [f"- ({merged} earlier line{'s' * (merged > 1)} not shown)"] if merged else []
      blocks.append("\n".join([_HISTORY, *history, *(f"- {line}" for line in self.lines[merged:])]))
    return "\n\n".join(b for b in blocks if b)
