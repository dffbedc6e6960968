"""ptx.episodes.scoring: batch scoring for host-reward RL, with infra retries."""

import dataclasses
import threading

import pytest

from ptx.episodes import scoring

from ptx.scheduling import scheduler
from running_calls import Running
from ptx.envs import base, countdown, shell


def test_score_a_group_of_countdown_completions():
  task = countdown.CountdownTask(seed=0)[0]
  completions = [f"<answer>{task['solution']}</answer>", "<answer>1</answer>", "no answer", task["solution"]]
  steps = scoring.score(countdown.CountdownEnv(), [task] * 4, completions)
  # One assertion over rewards, outcomes and reasons: a failure says why each completion scored as it did.
  assert [(s.reward, s.outcome) for s in steps] == [(1.0, "ok"), (0.0, "wrong"), (0.0, "no_answer"),
                                                    (0.0, "no_answer")], [s.reason for s in steps]


@dataclasses.dataclass(frozen=True)
class FlakyEnv:
  """Its verifier fails once per episode with an infrastructure error."""

  name: str = "flaky"
  max_turns: int = 1
  calls: dict = dataclasses.field(default_factory=dict)
  lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

  def reset(self, task):
    def score(action):
      with self.lock:
        self.calls[task["id"]] = self.calls.get(task["id"], 0) + 1
        first = self.calls[task["id"]] == 1
      if first:
        return base.Step.final(base.Outcome.INFRA_ERROR, "verifier host lost")
      return base.Step.final(base.Outcome.OK if action == "right" else base.Outcome.WRONG, "checked")
    return base.SingleTurn("p", score)


def test_infra_errors_are_retried_and_wrong_answers_are_not():
  env = FlakyEnv()
  steps = scoring.score(env, [{"id": i} for i in range(6)], ["right", "wrong"] * 3, concurrency=3)
  assert [s.outcome for s in steps] == ["ok", "wrong"] * 3
  assert env.calls == {i: 2 for i in range(6)}


def test_bad_batches_are_refused():
  with pytest.raises(ValueError, match="2 tasks but 1 completions"):
    scoring.score(countdown.CountdownEnv(), [{}, {}], ["x"])
  with pytest.raises(ValueError, match="multi-turn"):
    scoring.score(shell.ShellEnv(), [{}], ["x"])


# Only a hang reaches this (a pass takes milliseconds): it turns a regression into a failure.
HANG_S = 30


def test_concurrency_bounds_the_step_calls_running_at_once():
  running, all_in = Running(), threading.Barrier(3)

  def step():
    with running:
      all_in.wait(HANG_S)  # three at once, no fewer: each batch of three must overlap in full
    return base.Step.final(base.Outcome.OK, "checked")

  steps = scoring.run_steps([step] * 6, concurrency=3)
  assert [s.outcome for s in steps] == ["ok"] * 6 and running.peak == 3


def test_a_timed_out_step_is_an_infra_error_and_keeps_its_slot_until_its_call_returns():
  running, told = Running(), []

  def step():
    with running:
      told.append(scheduler.abandoned().wait(HANG_S))  # runs on past its timeout, until told it is over
    return base.Step.final(base.Outcome.OK, "too late")

  # 0.05 s: the calls end only once their attempts timed out, so the value only sets the test's length.
  steps = scoring.run_steps([step] * 5, concurrency=2, timeout_s=0.05)
  assert [s.outcome for s in steps] == ["infra_error"] * 5
  assert all(s.reason == "scoring failed: no result within 0.05 s" for s in steps), steps
  # A call whose attempt was over before a thread was free is never started; every other one was
  # told, and none ran beside two others.
  assert all(told) and running.peak <= 2 and running.now == 0
