"""GRPO's transcripts on the host: which steps keep rows and when they are taken, their records, the byte cap.

The step kinds that keep them run in tests/train/grpo/test_host_step.py (fused and host, the same samples),
test_episode_step.py (episodes) and tests/test_cli_grpo.py (`ptx grpo` writes them and a resumed run rewrites them).
"""

import json
import re
import types

import numpy as np

from ptx.config import GRPOConfig
from ptx.data.tokenizer import ByteTokenizer
from ptx.sampling.generation import LENGTH, STOP, Generation
from ptx.train.grpo.fused import FusedStep
from ptx.train.grpo.samples import SampleLog, rows_of
from ptx.train.grpo.update import rollout_batch

TOK = ByteTokenizer()
P, N = 6, 40


def _rows(prompts, completions, rewards, group_size):
  """`rows_of` every row: prompts [B] left-padded to P, completions [B * G] padded to N (host arrays)."""
  prompt_ids = np.zeros((len(prompts), P), np.int32)
  for b, text in enumerate(prompts):
    ids = [TOK.bos_id] + TOK.encode(text)
    prompt_ids[b, P - len(ids):] = ids
  tokens, lengths = np.zeros((len(completions), N), np.int32), np.zeros((len(completions),), np.int32)
  for r, text in enumerate(completions):
    ids = TOK.encode(text)
    ids = ids + [TOK.eos_id] if len(ids) < N else ids[:N]
    tokens[r, :len(ids)], lengths[r] = ids, len(ids)
  finish = np.where(lengths < N, STOP, LENGTH).astype(np.int32)
  gen = Generation(tokens=tokens, lengths=lengths, finish_reasons=finish, log_probs=np.zeros((len(completions), N)))
  prompt_lengths = (prompt_ids != 0).sum(axis=1).astype(np.int32)
  return rows_of(rollout_batch(prompt_ids, prompt_lengths, gen, group_size), gen, rewards, len(completions))


def _records(text):
  return [json.loads(line) for line in text.decode().splitlines()]


def test_a_row_gives_its_decoded_texts_its_weighted_reward_and_components_null_where_unscored():
  log = SampleLog(GRPOConfig(group_size=2, samples_every=1, reward_weights=(2.0, 1.0)), TOK)
  rewards = {"correct": np.asarray([1.0, 0.0, 0.0, 1.0], np.float32),
             "short": np.asarray([0.5, np.nan, 1.0, 0.25], np.float32)}
  assert log.due(1)
  log.keep(1, _rows(["1+1=", "2+2="], ["2", "3", "x" * 50, "4"], rewards, 2), group_size=2)
  (step, text), = log.take(wait=True).items()
  records = _records(text)
  assert step == 1 and [(r["step"], r["row"], r["group"]) for r in records] == [(1, 0, 0), (1, 1, 0), (1, 2, 1),
                                                                               (1, 3, 1)]
  assert [r["prompt"] for r in records] == ["1+1=", "1+1=", "2+2=", "2+2="]  # bos and eos decode to nothing
  assert [r["completion"] for r in records] == ["2", "3", "x" * N, "4"]
  assert [(r["completion_tokens"], r["finish_reason"]) for r in records] == [(2, "stop"), (2, "stop"),
                                                                             (N, "length"), (2, "stop")]
  assert [r["reward"] for r in records] == [2.5, None, 1.0, 2.25]  # 2 x correct + short; NaN is null
  assert [r["rewards"] for r in records] == [{"correct": 1.0, "short": 0.5}, {"correct": 0.0, "short": None},
                                             {"correct": 0.0, "short": 1.0}, {"correct": 1.0, "short": 0.25}]


def test_a_file_holds_at_most_samples_max_bytes_long_texts_cut_with_a_marker_rows_that_do_not_fit_counted():
  cfg = GRPOConfig(group_size=1, samples_every=1, samples_rows=4, samples_max_bytes=4096)
  log = SampleLog(cfg, TOK)
  log.keep(1, _rows(["a", "b", "c", "d"], ["é" * 19] * 4, np.ones(4, np.float32), 1), group_size=1)
  text = log.take(wait=True)[1]
  assert len(text) <= 4096
  records = _records(text)
  assert len(records) == 4 and all(r["completion"] == "é" * 19 for r in records)  # short enough: whole
  # Long texts: each cut in the middle to fit its row's share, the marker saying how many characters went.
  long = SampleLog(cfg, TOK)
  long.keep_episodes(1, [_trajectory(["q" * 5000, "w" * 3000]), _trajectory(["e" * 10])], group_size=1)
  text = long.take(wait=True)[1]
  assert len(text) <= 4096
  first, second = _records(text)
  for message, (letter, n) in zip(first["messages"][1::2], (("q", 5000), ("w", 3000))):
    head, cut, tail = re.fullmatch(r"(\w*)\[\.\.\. (\d+) characters cut \.\.\.\](\w*)", message["content"]).groups()
    assert head == letter * len(head) and tail == letter * len(tail) and len(head) + int(cut) + len(tail) == n
  assert second["messages"][1]["content"] == "e" * 10
  # A row whose texts cannot be cut into its share (too many of them) is left out, and the last line counts it.
  crowded = SampleLog(GRPOConfig(group_size=1, samples_every=1, samples_rows=2, samples_max_bytes=4096), TOK)
  crowded.keep_episodes(1, [_trajectory(["z"] * 3), _trajectory(["y" * 40] * 200)], group_size=1)
  text = crowded.take(wait=True)[1]
  assert len(text) <= 4096
  kept, note = _records(text)
  assert kept["row"] == 0 and note == {"rows_left_out": 1, "samples_max_bytes": 4096}


def _trajectory(actions):
  """A finished episode of these model turns (each answered by a tool reply but the last), as `play` returns it."""
  messages = [{"role": "user", "content": "task"}]
  for i, action in enumerate(actions):
    messages += [{"role": "assistant", "content": action}] + ([{"role": "tool", "content": "ok"}]
                                                                if i < len(actions) - 1 else [])
  return types.SimpleNamespace(sample=0, infra_error=False, reward=1.0, outcome="ok", reason="done",
                               turns=len(actions), tool_calls=len(actions) - 1, tool_errors=0, messages=messages)


class _State:
  """What the fused step reads of a state: its step."""

  def __init__(self, step):
    self.step = step


def test_the_fused_step_keeps_rows_of_the_first_and_every_kth_step_and_gives_them_once_a_later_step_is_queued():
  rows = _rows(["1+1="], ["2"], np.ones(1, np.float32), 1)
  fn = lambda state, batch: (_State(state.step + 1), {"loss": 0.0}, rows)
  step = FusedStep(fn, SampleLog(GRPOConfig(group_size=1, samples_every=3), TOK), group_size=1)
  state, taken = _State(0), {}
  for _ in range(6):
    state, metrics = step(state, None)
    assert metrics == {"loss": 0.0}
    new = step.take_samples()
    assert not set(new) & set(taken) and all(k < state.step for k in new)  # never the step just queued
    taken.update(new)
  assert sorted(taken) == [1, 3] and sorted(step.take_samples(wait=True)) == [6]
  assert step.take_samples(wait=True) == {}
  # A resumed run counts from its restored state's step.
  resumed = FusedStep(fn, SampleLog(GRPOConfig(group_size=1, samples_every=3), TOK), group_size=1)
  resumed(_State(5), None)
  assert sorted(resumed.take_samples(wait=True)) == [6]


def test_samples_every_0_or_no_tokenizer_keeps_nothing_and_the_fused_step_returns_no_rows():
  for log in (SampleLog(GRPOConfig(samples_every=0), TOK), SampleLog(GRPOConfig(samples_every=1), None)):
    assert log.rows == 0 and not log.due(1)
    state = _State(0)
    step = FusedStep(lambda s, batch: (s, {"loss": 0.0}), log, group_size=4)  # built with sample_rows=log.rows: 0
    assert step(state, None) == (state, {"loss": 0.0})
    assert step.take_samples(wait=True) == {}
