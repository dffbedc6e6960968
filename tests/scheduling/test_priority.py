"""ptx.scheduling.priority: groups whose samples disagreed are scored first, then unseen tasks, then agreeing ones."""

import numpy as np

from ptx.data.tokenizer import ByteTokenizer
from ptx.envs.base import Outcome, SingleTurn, Step
from ptx.scheduling.priority import DisagreementFirst
from ptx.episodes.scoring import EnvReward

TOK = ByteTokenizer()


def test_disagreement_first_ranks_disagreeing_then_unseen_then_agreeing_tasks():
  policy = DisagreementFirst()
  a, b, c, d = ({"prompt": p} for p in "abcd")
  policy.record(a, [1.0, 0.0, 1.0])
  policy.record(b, [0.5, 0.5, np.nan])  # the unscored sample is left out: the rest agree
  policy.record(d, [np.nan, np.nan])  # nothing scored: still unseen
  assert [policy.priority(t) for t in (a, b, c, d)] == [2, 0, 1, 1]
  policy.record(a, [0.0, 0.0])  # the newest group decides
  assert policy.priority(a) == 0


class _OrderEnv:
  """Single-turn: "1" is right; records the prompt of each sample in the order it is scored."""

  name, max_turns = "order", 1

  def __init__(self):
    self.scored = []

  def reset(self, task):
    def score(action):
      self.scored.append(task["prompt"])
      return Step.final(Outcome.OK if action == "1" else Outcome.WRONG, "")
    return SingleTurn(task["prompt"], score)


def _tokens(*texts):
  return np.asarray([TOK.encode(t) + [TOK.eos_id] for t in texts]), np.ones(len(texts), np.int32)


def test_env_reward_scores_disagreeing_groups_first_under_contention_and_rewards_are_unchanged():
  env = _OrderEnv()
  # One sample scored at a time: the order of scoring is the scheduler's order.
  reward = EnvReward(env, TOK, (TOK.eos_id,), group_size=2, concurrency=1, priority=DisagreementFirst())
  np.testing.assert_array_equal(reward(*_tokens("1", "0", "0", "0"), [{"prompt": "a"}, {"prompt": "b"}]),
                                [1, 0, 0, 0])  # a disagreed, b agreed
  env.scored.clear()
  rewards = reward(*_tokens("0", "0", "1", "1", "0", "1"), [{"prompt": "b"}, {"prompt": "c"}, {"prompt": "a"}])
  assert env.scored == ["a", "a", "c", "c", "b", "b"]
  np.testing.assert_array_equal(rewards, [0, 0, 1, 1, 0, 1])
