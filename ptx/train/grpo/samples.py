"""What GRPO sampled, for people to read: a few rows of some steps as JSON lines (`OUT/samples/step_N.jsonl`).

Every step kind keeps a `SampleLog` (`grpo.samples_every`, `samples_rows`,
`samples_max_bytes`): at the first step and every `samples_every`-th it keeps
the step's first `samples_rows` rows (row r is sample r % G of group r // G),
and `take(wait)` turns them into one file's text. A single-turn row
(`rows_of`) gives its prompt and completion decoded, its reward (the
weighted total, and the components when the reward has several; null where
the sample was not scored) and why it finished; an episode
(`ptx.episodes.loop.Trajectory`) gives its conversation (the task's prompt,
the model's turns, which hold its tool calls and commands, and the
environment's replies, which hold their outcomes), its reward, outcome and
end reason, and its turn and tool-call counts.

A file holds at most `samples_max_bytes` bytes: each row gets an equal share,
its long texts cut in the middle with a marker that says how many characters
went, and a row that still does not fit is left out, counted in a last line.

Nothing here waits on the device at the step that keeps its rows: the fused
step's rows stay device arrays until `take` fetches them, one step later
(once a later step is queued) or when the loop asks it to wait (before a
checkpoint, at the end). A step's file is written whole, so a resumed run
that samples a step again replaces its file rather than add to it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax

from ptx.algorithms import advantages as adv_lib
from ptx.config import GRPOConfig
from ptx.data.tokenizer import Tokenizer
from ptx.episodes.loop import Trajectory
from ptx.sampling.generation import LENGTH, STOP, Generation

# Bytes of a file kept for its last line, which counts the rows left out.
_RESERVE = 128
# Characters a text keeps at least: below this a row is left out rather than cut further.
_MIN_CHARS = 32
_FINISH = {STOP: "stop", LENGTH: "length"}


def rows_of(rollouts: dict[str, Any], gen: Generation, rewards: adv_lib.Rewards, n: int) -> dict[str, Any]:
  """The first `n` rows of a step's scored rollouts as `SampleLog.keep` takes them (jax or numpy arrays).

  Args:
    rollouts: `ptx.train.grpo.update.rollout_batch`'s rows [R, P + N].
    gen: their Generation (the N sampled columns).
    rewards: raw rewards [R], or named components {name: [R]}.
    n: rows to keep (at most R).

  Returns:
    {"prompts" [n, P] left-padded, "prompt_lengths" [n], "completions" [n, N], "lengths" [n], "finish" [n],
    "rewards" [n] or {name: [n]}}.
  """
  P = rollouts["tokens"].shape[1] - gen.tokens.shape[1]
  return {"prompts": rollouts["tokens"][:n, :P], "prompt_lengths": rollouts["segment_ids"][:n, :P].sum(axis=1),
          "completions": gen.tokens[:n], "lengths": gen.lengths[:n], "finish": gen.finish_reasons[:n],
          "rewards": jax.tree.map(lambda r: r[:n], rewards)}


class SampleLog:
  """The rows a step kind keeps of its steps, and their transcript files' text.

  Args:
    cfg: `samples_every` (0: keep nothing), `samples_rows`, `samples_max_bytes`, and `reward_weights` (a reward of
      components is also written as their weighted total).
    tokenizer: decodes single-turn rows; None keeps nothing (a step built without one, as tests build them).
  """

  def __init__(self, cfg: GRPOConfig, tokenizer: Tokenizer | None):
    self._every = cfg.samples_every if tokenizer is not None else 0
    self._rows, self._max_bytes, self._weights = cfg.samples_rows, cfg.samples_max_bytes, cfg.reward_weights
    self._decode = None if tokenizer is None else tokenizer.decode
    self._held: list[tuple[int, Callable[[], list[dict[str, Any]]]]] = []
    self._newest = 0

  @property
  def rows(self) -> int:
    """Rows kept of a due step (0 when nothing is kept): the fused step compiles that many into its outputs."""
    return self._rows if self._every else 0

  def due(self, step: int) -> bool:
    """Whether step `step` (1-based, as logged) keeps rows; called as each step is dispatched, in order."""
    self._newest = step
    return bool(self._every) and (step == 1 or step % self._every == 0)

  def keep(self, step: int, rows: dict[str, Any], group_size: int) -> None:
    """Keeps `rows_of`'s rows of `step`; device arrays are fetched only by `take`."""
    self._held.append((step, lambda: self._completions(jax.device_get(rows), group_size)))

  def keep_episodes(self, step: int, trajectories: Sequence[Trajectory], group_size: int) -> None:
    """Keeps the first rows of `step`'s episodes (in task, then sample order)."""
    kept = list(trajectories[:self._rows])
    self._held.append((step, lambda: [_episode(t, r, group_size) for r, t in enumerate(kept)]))

  def take(self, wait: bool = False) -> dict[int, bytes]:
    """The text of each held step's file, by step; then forgets them.

    Args:
      wait: take every held step, waiting for the device where its rows are
        still being computed; False takes only those before the newest step
        dispatched (finished or nearly, as the loop reads metrics).
    """
    ready = [(step, make) for step, make in self._held if wait or step < self._newest]
    self._held = [(step, make) for step, make in self._held if not (wait or step < self._newest)]
    return {step: _file([{"step": step, **record} for record in make()], self._max_bytes) for step, make in ready}

  def _completions(self, rows: dict[str, Any], group_size: int) -> list[dict[str, Any]]:
    """JSON records of host rows: decoded texts, rewards, finish reason."""
    components = rows["rewards"] if isinstance(rows["rewards"], dict) else None
    total = adv_lib.total_reward(rows["rewards"], self._weights)
    P, records = rows["prompts"].shape[1], []
    for r in range(len(rows["lengths"])):
      prompt, n = rows["prompts"][r, P - int(rows["prompt_lengths"][r]):], int(rows["lengths"][r])
      record = {"row": r, "group": r // group_size, "prompt": self._decode(prompt.tolist()),
                "completion": self._decode(rows["completions"][r, :n].tolist()), "completion_tokens": n,
                "finish_reason": _FINISH.get(int(rows["finish"][r]), str(int(rows["finish"][r]))),
                "reward": _number(total[r])}
      if components is not None:
        record["rewards"] = {name: _number(value[r]) for name, value in sorted(components.items())}
      records.append(record)
    return records


def _episode(t: Trajectory, row: int, group_size: int) -> dict[str, Any]:
  """The JSON record of one episode: its conversation, reward, outcome and counts."""
  return {"row": row, "group": row // group_size, "sample": t.sample,
          "reward": None if t.infra_error else _number(t.reward), "outcome": str(t.outcome), "end_reason": t.reason,
          "turns": t.turns, "tool_calls": t.tool_calls, "tool_errors": t.tool_errors,
          "messages": [dict(m) for m in t.messages]}


def _number(x: Any) -> float | None:
  """A reward as JSON takes it: a float, or null for NaN (unscored)."""
  x = float(x)
  return x if math.isfinite(x) else None


def _file(records: list[dict[str, Any]], max_bytes: int) -> bytes:
  """JSON lines of `records` in at most `max_bytes` bytes: each within an equal share, or left out and counted."""
  room = max_bytes - _RESERVE
  share = room // max(len(records), 1)
  lines = [_line(record, share) for record in records]
  kept, size = [], 0
  for line in lines:
    if size + len(line) > room:
      break
    kept.append(line)
    size += len(line)
  if len(kept) < len(lines):
    kept.append((json.dumps({"rows_left_out": len(lines) - len(kept), "samples_max_bytes": max_bytes}) + "\n")
                .encode())
  return b"".join(kept)


def _line(record: dict[str, Any], budget: int) -> bytes:
  """`record` as one JSON line of at most `budget` bytes, its long texts cut, where `_MIN_CHARS` a text allows."""
  limit = budget
  while True:
    line = (json.dumps(_cut(record, limit), ensure_ascii=False) + "\n").encode("utf-8", errors="replace")
    if len(line) <= budget or limit <= _MIN_CHARS:
      return line
    limit = max(min(limit // 2, limit * budget // len(line)), _MIN_CHARS)


def _cut(value: Any, limit: int) -> Any:
  """`value` with every text longer than `limit` characters cut in the middle, a marker saying how much went."""
  if isinstance(value, dict):
    return {k: _cut(v, limit) for k, v in value.items()}
  if isinstance(value, list):
    return [_cut(v, limit) for v in value]
  if not isinstance(value, str) or len(value) <= limit:
    return value
  head = limit // 2
  return f"{value[:head]}[... {len(value) - limit} characters cut ...]{value[len(value) - (limit - head):]}"
