"""The speculative rollout engine: the rollout engine, with a drafter's tokens verified in one forward of the policy.

A verify round: every live sequence whose drafting is on gets up to
`SpeculativeConfig.drafts` drafted tokens after its context, never more than
its turn's remaining tokens minus one: the verify forward then writes only
positions its pages already cover (admission reserves nothing more) and a
turn never emits more than its budget. One forward feeds each live row its
pending token and drafts at positions length .. length + k, samples the
policy's token after each (`ptx.sampling.engine.acceptance`) and emits the
accepted drafts and one token more; a stop id inside that run ends the turn
there. The row's length advances by what it emitted, so the K/V written for
rejected drafts lies past it, where attention (bounded by each row's length
and each query's position) never reads and the next round writes first.

Recording routes (`RolloutEngine`'s `record_routes`), a verify keeps those
of the tokens it fed and the row keeps (the pending token and the accepted
drafts); a rejected draft's, like its K/V, are dropped.

Device drafters (`drafting.DeviceDrafter`: an `NgramDrafter`, or a
`DraftModel`'s `device_drafter`) draft and accept inside the call, so one
call runs up to `SpeculativeConfig.rounds` rounds
(`engine_programs.speculate_pages`, which takes the device drafter as a
static argument and a draft model's parameters beside it), each drafting
from the context the earlier rounds extended: the host's round trip is paid
once per up to rounds x (K + 1) tokens a row. A host `Drafter` proposes on
the host, one round per call. When drafting does not pay for a step (the cost model
below), the step runs the plain decode program, `decode_steps` tokens per row.

With a deterministic drafter (`NgramDrafter`, a host `Drafter`) the emitted
tokens are those the standard engine samples with the same seed (the same
uniform per token), so everything the engine promises (greedy equals
`generate`, reproducibility whatever the shapes, log-probs from the policy's
own logits) holds, drafting or not. A `DraftModel`'s drafts go through the
rejection rule with uniforms of their own: the tokens follow the policy's
distribution (greedy: its tokens), and the same seed, submission order and
engine shapes give the same tokens.

Cost model: a verify round costs `verify_cost` decode steps whatever the
drafts (it computes K + 1 positions per row) and gives each row its accepted
drafts plus one token; a decode step gives one. A sequence's tokens per
round (1 + its accepted drafts per round in which it could draft: drafting
on, room for a draft; a round in which the n-gram lookup finds nothing
counts, giving one token) is measured; once it has drafted in
`min_verifies` rounds, its drafting is turned off for good while that rate
is below `verify_cost`. A step verifies only when the live rows' expected
tokens per round (the measured rate, or 1 + k before `min_verifies`, for a
row that may draft k; 1 for a row without) reach `verify_cost` per row;
else decoding gives more tokens for the time. The host's time (one round
trip per call, and a host drafter's proposals) is outside the model.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ptx.model_config import ModelConfig
from ptx.models.decoder import Params
from ptx.sampling import buckets
from ptx.sampling.engine.drafters import Drafter, DraftModel, NgramDrafter
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.sequences import Completion, HostSequence, SeqState
from ptx.sampling.engine.programs import SpeculateRows, VerifyRows
from ptx.sampling.generation import LENGTH, STOP


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """How a `SpeculativeEngine` drafts, and the cost model that says when drafting pays."""

  # Tokens drafted per sequence and verify at most (K): the verify program feeds K + 1 per row.
  drafts: int = 4
  # A verify call's time in decode steps (those of the engine's decode calls) at the engine's shapes. 1.5 is an
  # estimate for an accelerator, where a step is bound by reading the weights, which K + 1 tokens per row read
  # once; a loaded 2-core CPU measured 2.6 at the SmolLM2-135M shape (8 rows). Set it from the `calibrate` line of
  # benchmarks/fast_mode.py on the machine that samples.
  verify_cost: float = 1.5
  # Verifies a sequence drafts in before its measured acceptance may turn its drafting off.
  min_verifies: int = 4
  # Verify rounds per device call with a drafter that drafts on the device (`NgramDrafter`, `DraftModel`): one host
  # round trip per up to rounds * (drafts + 1) tokens a row, as a decode call gives `decode_steps`.
  rounds: int = 4

  def __post_init__(self):
    for name in ("drafts", "min_verifies", "rounds"):
      if getattr(self, name) < 1:
        raise ValueError(f"SpeculativeConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.verify_cost < 1.0:
      raise ValueError(f"SpeculativeConfig.verify_cost must be >= 1 (a verify computes a decode step and more), got "
                       f"{self.verify_cost}")


@dataclasses.dataclass
class _Record:
  """One sequence's drafting: over its life (the cost model's), and in its current turn (its completion's)."""

  verifies: int = 0
  accepted: int = 0
  off: bool = False
  turn_drafted: int = 0
  turn_accepted: int = 0


class SpeculativeEngine(RolloutEngine):
  """A `RolloutEngine` whose sequences draft tokens that one forward of the policy verifies (module docstring).

  Its completions count each turn's drafted and accepted tokens.
  """

  def __init__(self, cfg: ModelConfig, config: EngineConfig = EngineConfig(), *, drafter: Drafter | DraftModel,
               speculative: SpeculativeConfig = SpeculativeConfig(), **engine_args):
    """A rollout engine (`RolloutEngine`'s arguments) that drafts with `drafter` under `speculative`.

    Raises:
      ValueError: for a draft model whose vocabulary is not the policy's.
    """
    if isinstance(drafter, DraftModel) and drafter.cfg.vocab_size != cfg.vocab_size:
      raise ValueError(f"DraftModel.cfg.vocab_size ({drafter.cfg.vocab_size}) must be the policy's "
                       f"({cfg.vocab_size}): a draft model shares the policy's tokenizer")
    super().__init__(cfg, config, **engine_args)
    self.drafter, self.speculative = drafter, speculative
    self._records: dict[int, _Record] = {}

  def _call_tokens(self) -> int:
    """A call's decode steps, or its verify rounds' positions when they write more."""
    return max(self.config.decode_steps, self.speculative.rounds * (self.speculative.drafts + 1))

  def _decode(self, params: Params, policy_version: int) -> list[Completion]:
    """One verify call over the live sequences when drafting pays for it, else one decode call."""
    live = self._admission.admitted(SeqState.LIVE)
    drafts = {s.seq_id: self._propose(s) for s in live}
    expected = sum(self._expected(s, len(drafts[s.seq_id])) for s in live)
    if not any(drafts.values()) or expected < self.speculative.verify_cost * len(live):
      return super()._decode(params, policy_version)
    return self._verify(params, policy_version, live, drafts)

  def _propose(self, seq: HostSequence) -> list[int]:
    record = self._records.setdefault(seq.seq_id, _Record())
    k = min(self.speculative.drafts, seq.remaining - 1)
    if record.off or k < 1:
      return []
    if isinstance(self.drafter, (DraftModel, NgramDrafter)):
      return [0] * k  # placeholders for the (up to) k drafts the device drafts
    return [int(t) for t in self.drafter.propose(seq.cached + [seq.pending], k)[:k]]

  def _expected(self, seq: HostSequence, k: int) -> float:
    """Tokens a verify is expected to give `seq` with k drafts."""
    record = self._records[seq.seq_id]
    if not k:
      return 1.0
    return 1.0 + (k if record.verifies < self.speculative.min_verifies else record.accepted / record.verifies)

  def _verify(self, params: Params, policy_version: int, live: list[HostSequence],
              drafts: dict[int, list[int]]) -> list[Completion]:
    """One verify call over the live sequences; returns the turns that finished."""
    if isinstance(self.drafter, (DraftModel, NgramDrafter)):
      return self._speculate(params, policy_version, live)
    packed = self._live_rows(live, lambda seq: seq.length + 1 + len(drafts[seq.seq_id]))
    n_drafts = np.full((packed.n_rows,), -1, np.int32)
    tokens = np.zeros((packed.n_rows, self.speculative.drafts + 1), np.int32)
    for seq in live:
      r, d = packed.row_of[seq.seq_id], drafts[seq.seq_id]
      n_drafts[r] = len(d)
      tokens[r, :1 + len(d)] = [seq.pending] + d
    rows = VerifyRows(*self._rows(packed.page_table, packed.lengths, tokens, n_drafts, packed.seq_ids, packed.sampled),
                      packed.pairs)
    statics = dict(self._statics, sampling=self.sampling, tempered_log_probs=self._decode_statics["tempered_log_probs"])
    self._k, self._v, out = self.programs.verify(params, self._k, self._v, rows, self._key, **statics)
    tokens, log_probs, accepted, routes = jax.device_get(tuple(out))
    done = []
    for seq in live:
      r, k = packed.row_of[seq.seq_id], len(drafts[seq.seq_id])
      run = tokens[r, :accepted[r] + 1].tolist()
      stop = next((i for i, t in enumerate(run) if t in seq.stop_ids), None)
      n = len(run) if stop is None else stop + 1
      finish = STOP if stop is not None else LENGTH if n == seq.remaining else 0
      if k:
        self._count(seq, 1, k, n - 1)
      # The n tokens fed before the emitted ones (the pending token and the accepted drafts) recorded their routes.
      done.append(self._emit(seq, run[:n], log_probs[r, :n].tolist(), finish, policy_version,
                             None if routes is None else routes[r, :n].copy()))
    return [c for c in done if c is not None]

  def _speculate(self, params: Params, policy_version: int, live: list[HostSequence]) -> list[Completion]:
    """One call of up to `rounds` verify rounds over the live sequences, drafting on the device (n-gram or model)."""
    spec = self.speculative
    per_call = spec.rounds * (spec.drafts + 1)
    # A round writes positions up to its length + drafts <= length + remaining - 1, within the turn's pages.
    packed = self._live_rows(live, lambda seq: seq.length + min(per_call, seq.remaining))
    # Room for the call's tokens after the longest context, in few widths (programs).
    width = buckets.bucket(max(s.length for s in live) + 1 + per_call, 64)
    context, drafts = np.zeros((packed.n_rows, width), np.int32), np.zeros((packed.n_rows,), np.int32)
    for seq in live:
      r = packed.row_of[seq.seq_id]
      context[r, :seq.length + 1] = seq.cached + [seq.pending]
      drafts[r] = 0 if self._records[seq.seq_id].off else spec.drafts
    rows = SpeculateRows(*self._rows(packed.page_table, packed.lengths, context, packed.live, packed.remaining, drafts,
                                     packed.stop_ids, packed.seq_ids, packed.sampled), packed.pairs)
    statics = {name: value for name, value in self._decode_statics.items() if name != "steps"}
    model = self.drafter if isinstance(self.drafter, DraftModel) else None
    self._k, self._v, out = self.programs.speculate(
        params, self._k, self._v, rows, model.params if model else None, self._key, **self._statics, **statics,
        drafter=model.device_drafter if model else self.drafter, drafts=spec.drafts, rounds=spec.rounds)
    tokens, log_probs, emitted, finish, drafted, accepted, verifies, routes = jax.device_get(tuple(out))
    done = []
    for seq in live:
      r = packed.row_of[seq.seq_id]
      if verifies[r]:
        self._count(seq, int(verifies[r]), int(drafted[r]), int(accepted[r]))
      done.append(self._emit(seq, tokens[r, :emitted[r]].tolist(), log_probs[r, :emitted[r]].tolist(),
                             int(finish[r]), policy_version, None if routes is None else routes[r, :emitted[r]].copy()))
    return [c for c in done if c is not None]

  def _count(self, seq: HostSequence, verifies: int, drafted: int, accepted: int) -> None:
    """Records verifies in which `seq` could draft; turns its drafting off when its measured rate does not pay."""
    record = self._records[seq.seq_id]
    record.verifies, record.accepted = record.verifies + verifies, record.accepted + accepted
    record.turn_drafted, record.turn_accepted = record.turn_drafted + drafted, record.turn_accepted + accepted
    spec = self.speculative
    record.off = record.verifies >= spec.min_verifies and 1 + record.accepted / record.verifies < spec.verify_cost

  def _emit(self, seq: HostSequence, tokens: list[int], log_probs: list[float], finish: int, policy_version: int,
            routes: np.ndarray | None) -> Completion | None:
    """The base engine's `_emit`, with the turn's drafted and accepted counts on its completion."""
    record = self._records.setdefault(seq.seq_id, _Record())
    done = super()._emit(seq, tokens, log_probs, finish, policy_version, routes)
    if done is None:
      return None
    done = dataclasses.replace(done, drafted=record.turn_drafted, accepted=record.turn_accepted)
    record.turn_drafted = record.turn_accepted = 0
    return done

  def _free(self, seq: HostSequence) -> None:
    super()._free(seq)
    self._records.pop(seq.seq_id, None)
