"""The train / held-out split of a task's problem space, by a stable hash of each problem's identity.

Every built-in task generator (arithmetic, countdown, needle, the recipes'
synthetic records) names each problem by a canonical identity (the
arithmetic problem with its operands in order for + and *, countdown's
sorted numbers and target, needle's key) and draws a problem for a split
only when `split_of(identity)` names that split, redrawing otherwise.

Invariants: the split is a function of the identity alone (BLAKE2b, not
Python's per-process `hash`), so it depends on no seed, index, size, process
or machine; a train stream and a held-out stream of the same task therefore
never share a problem, whatever their seeds and lengths. Redrawing from the
generator's own random stream keeps its distribution, conditioned on the
split, and keeps problem `i` a pure function of (seed, i).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import TypeVar

SPLITS = ("train", "held_out")
# One problem in 4 is held out: even one-digit addition (100 problems) keeps about 25 to score.
HELD_OUT_EVERY = 4
# Draws before a split is declared empty; a held-out draw succeeds with probability about 1/4.
MAX_DRAWS = 1000

T = TypeVar("T")


def check(owner: str, split: str) -> None:
  """Raises a ValueError naming `owner`.split unless `split` is one of SPLITS."""
  if split not in SPLITS:
    raise ValueError(f"{owner}.split must be one of {SPLITS}, got {split!r}")


def split_of(identity: str) -> str:
  """The split ("train" or "held_out") problem `identity` belongs to."""
  digest = hashlib.blake2b(identity.encode(), digest_size=8).digest()
  return "held_out" if int.from_bytes(digest, "little") % HELD_OUT_EVERY == 0 else "train"


def draw(owner: str, split: str, candidate: Callable[[], tuple[str, T]]) -> T:
  """The first of repeated `candidate()` draws (identity, problem) whose identity is in `split`.

  Raises:
    ValueError: no candidate of `split` in MAX_DRAWS draws (a problem space
      too small to have that side), naming `owner`.
  """
  for _ in range(MAX_DRAWS):
    identity, problem = candidate()
    if split_of(identity) == split:
      return problem
  raise ValueError(f"{owner}: no problem of split {split!r} in {MAX_DRAWS} draws; its problem space is too small")


def sizes(identities: Iterable[str]) -> dict[str, int]:
  """How many problems each split holds, given every problem of a (small) space by its identity.

  One entry per problem: an identity may name several ("3+5" names 3+5= and 5+3=).
  """
  counts = dict.fromkeys(SPLITS, 0)
  for identity in identities:
    counts[split_of(identity)] += 1
  return counts
