"""The rollout engine's host-side sequences: their states, their finished turns, and their checkpoint form.

`RolloutEngine` keeps one `HostSequence` per sample of a request and moves it
through `SeqState`s; a finished turn leaves as a `Completion`. `snapshot`
and `restore` turn the unfinished sequences into flat host arrays and back,
for a checkpoint: a sequence is saved as its context (the tokens its cache
holds or is to hold), its pending token, what it sampled in this turn and its
RNG counter, never its pages.

An engine that records routes (routing replay) keeps beside `cached` the
experts its MoE layers chose for each cached token (`HostSequence.routes`):
whatever call wrote the token's K/V recorded them, so when the cache is
written again (after an update, a preemption or a restore) the new ones
replace them. A snapshot holds none: a restored engine prefills its contexts
again and records them then.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np


@dataclasses.dataclass(frozen=True)
class Completion:
  """One finished turn of one sequence."""

  seq_id: int
  # int32 [n]: the tokens sampled in this turn, the stop token included.
  tokens: np.ndarray
  # float32 [n]: their log-probs (raw policy, or tempered: see `RolloutEngine`).
  log_probs: np.ndarray
  # int32 [n]: the `policy_version` of the `step` call that sampled each token.
  policy_versions: np.ndarray
  # STOP or LENGTH.
  finish_reason: int
  # Drafts proposed in this turn, and those the policy accepted (`SpeculativeEngine`; 0 without drafting).
  drafted: int = 0
  accepted: int = 0
  # `moe.ROUTE_DTYPE` [c, L, k] from an engine that records routes: the experts of each of the c tokens its cache
  # holds, in position order (the sequence's whole context, prompt and earlier turns included, but the last token
  # this turn sampled, which was never fed); else None.
  routes: np.ndarray | None = None


class SeqState(enum.Enum):
  """Where a sequence is in the engine."""

  QUEUED = "queued"  # waiting for a slot and pages
  PREFILL = "prefill"  # admitted; tokens still to write before it decodes
  FOLLOWER = "follower"  # a group's sample waiting for its leader's prompt pages
  LIVE = "live"  # decoding
  HELD = "held"  # a turn finished; keeps its slot and pages for `extend`
  EXTEND = "extend"  # held, with an `extend` waiting for pages


@dataclasses.dataclass(eq=False)
class HostSequence:
  """Host-side bookkeeping of one sequence (one sample of one request)."""

  seq_id: int
  max_new: int
  stop_ids: tuple[int, ...]
  keep: bool
  feed: list[int]  # tokens to write before decoding: the prompt but its last token
  pending: int  # the token the next decode step feeds
  reserve: int = 0  # positions its pages cover from admission on (at least what its first turn needs)
  cached: list[int] = dataclasses.field(default_factory=list)  # the tokens in the cache, in position order
  state: SeqState = SeqState.QUEUED
  block: int = -1
  slot: int = -1
  pages: list[int] = dataclasses.field(default_factory=list)
  length: int = 0  # cached positions
  sampled: int = 0  # tokens sampled over the sequence's life: its RNG counter
  followers: list["HostSequence"] = dataclasses.field(default_factory=list)
  leader: "HostSequence | None" = None
  tokens: list[int] = dataclasses.field(default_factory=list)
  log_probs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  routes: list[np.ndarray] = dataclasses.field(default_factory=list)  # recording: [n, L, k] pieces aligned with cached

  @property
  def remaining(self) -> int:
    """Tokens this turn may still sample."""
    return self.max_new - len(self.tokens)

  def uncache(self) -> None:
    """Moves the cached tokens back to the feed: its cache is to be written again (new parameters, or preempted)."""
    self.feed, self.cached, self.length, self.routes = self.cached + self.feed, [], 0, []

  def cached_routes(self) -> np.ndarray:
    """The recorded routes of the cached tokens, one array (kept as the only piece, so later turns add to it)."""
    self.routes = [np.concatenate(self.routes)] if len(self.routes) > 1 else self.routes
    return self.routes[0]


_RAGGED = ("context", "stop_ids", "tokens", "log_probs", "versions")


def to_arrays(groups: list[list[HostSequence]], next_id: int, version: int | None) -> dict[str, np.ndarray]:
  """The sequences of `groups` (admitted ones alone, then queued groups) as flat host arrays.

  Args:
    groups: unfinished sequences in the order a restored engine queues them;
      a group's samples share its prompt pages once restored.
    next_id: the id the engine gives its next sequence.
    version: the policy version its cache holds (None: no step yet).
  """
  seqs = [s for g in groups for s in g]
  context = lambda s: (s.leader.cached + s.leader.feed) if s.state is SeqState.FOLLOWER else s.cached + s.feed
  ragged = {"context": [context(s) for s in seqs], "stop_ids": [list(s.stop_ids) for s in seqs],
            "tokens": [s.tokens for s in seqs], "log_probs": [s.log_probs for s in seqs],
            "versions": [s.versions for s in seqs]}
  out = {name: np.asarray([x for v in values for x in v], np.float32 if name == "log_probs" else np.int32)
         for name, values in ragged.items()}
  out.update({f"{name}_lengths": np.asarray([len(v) for v in values], np.int32) for name, values in ragged.items()})
  fields = {"seq_id": lambda s: s.seq_id, "pending": lambda s: s.pending, "max_new": lambda s: s.max_new,
            "keep": lambda s: s.keep, "sampled": lambda s: s.sampled, "reserve": lambda s: s.reserve}
  out.update({name: np.asarray([get(s) for s in seqs], np.int32) for name, get in fields.items()})
  out["group"] = np.asarray([i for i, g in enumerate(groups) for _ in g], np.int32)
  out["next_id"] = np.asarray(next_id, np.int64)
  out["version"] = np.asarray(-1 if version is None else version, np.int64)
  return out


def from_arrays(saved: dict[str, np.ndarray]) -> tuple[list[list[HostSequence]], int, int | None]:
  """(queued groups with leaders and followers linked, next id, policy version) of `to_arrays`' output."""
  saved = {k: np.asarray(v) for k, v in saved.items()}
  ragged = {}
  for name in _RAGGED:
    ends = np.cumsum(saved[f"{name}_lengths"])
    ragged[name] = [x.tolist() for x in np.split(saved[name], ends[:-1])] if len(ends) else []
  groups: dict[int, list[HostSequence]] = {}
  for i, seq_id in enumerate(saved["seq_id"].tolist()):
    seq = HostSequence(seq_id=seq_id, max_new=int(saved["max_new"][i]), stop_ids=tuple(ragged["stop_ids"][i]),
                       keep=bool(saved["keep"][i]), feed=ragged["context"][i], pending=int(saved["pending"][i]),
                       reserve=int(saved["reserve"][i]) if "reserve" in saved else 0,
                       sampled=int(saved["sampled"][i]), tokens=ragged["tokens"][i],
                       log_probs=ragged["log_probs"][i], versions=ragged["versions"][i])
    groups.setdefault(int(saved["group"][i]), []).append(seq)
  ordered = [group for _, group in sorted(groups.items())]
  for group in ordered:
    for follower in group[1:]:
      follower.leader = group[0]
    group[0].followers = group[1:]
  version = int(saved["version"])
  return ordered, int(saved["next_id"]), None if version < 0 else version
