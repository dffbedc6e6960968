"""ptx.rl.rewards: batch scoring for host-reward RL, with infra retries."""

import dataclasses
import threading

import pytest

from ptx.rl import rewards
from ptx.rl.environments import base, countdown, shell


def test_score_a_group_of_countdown_completions():
  task = countdown.CountdownTask(seed=0)[0]
  completions = [f"<answer>{task['solution']}</answer>", "<answer>1</answer>", "no answer", task["solution"]]
  steps = rewards.score(countdown.CountdownEnv(), [task] * 4, completions)
  assert [s.reward for s in steps] == [1.0, 0.0, 0.0, 0.0]
  assert [s.outcome for s in steps] == ["ok", "wrong", "no_answer", "no_answer"]


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
  steps = rewards.score(env, [{"id": i} for i in range(6)], ["right", "wrong"] * 3, concurrency=3)
  assert [s.outcome for s in steps] == ["ok", "wrong"] * 3
  assert env.calls == {i: 2 for i in range(6)}


def test_bad_batches_are_refused():
  with pytest.raises(ValueError, match="2 tasks but 1 completions"):
    rewards.score(countdown.CountdownEnv(), [{}, {}], ["x"])
  with pytest.raises(ValueError, match="multi-turn"):
    rewards.score(shell.ShellEnv(), [{}], ["x"])
