"""Multi-turn GRPO tells an environment that prepares ahead (a warm pool's ShellEnv) the next batch's tasks."""

from ptx.envs.base import PreparesAhead
from ptx.envs.shell import ShellEnv
from ptx.train.grpo.episodes import EpisodeGRPOStep, expect_next
from ptx.data.lookahead import Lookahead


class _Batches:
  """Three batches of two tasks, resumable as `fit`'s streams are."""

  def __init__(self):
    self.i = 0

  def __iter__(self):
    return self

  def __next__(self):
    if self.i == 3:
      raise StopIteration
    self.i += 1
    return {"task": [{"id": f"{self.i}a"}, {"id": f"{self.i}b"}]}

  def get_state(self):
    return self.i

  def set_state(self, i):
    self.i = i


class _Preparing:
  def __init__(self):
    self.told = []

  def expect(self, tasks, samples=1):
    self.told.append(([t["id"] for t in tasks], samples))


def test_the_next_batch_is_announced_and_still_read_in_order():
  env, tasks = _Preparing(), EpisodeGRPOStep.stream(None, _Batches())
  assert isinstance(env, PreparesAhead) and isinstance(ShellEnv(), PreparesAhead)
  assert isinstance(tasks, Lookahead)
  ids = lambda batch: [t["id"] for t in batch["task"]]  # noqa: E731
  assert ids(next(tasks)) == ["1a", "1b"]  # fit takes batch 1; the step playing it announces batch 2
  expect_next(env, tasks, samples=4)
  assert env.told == [(["2a", "2b"], 4)]
  assert tasks.get_state() == 1  # a checkpoint here resumes at batch 2, which was only peeked
  assert ids(next(tasks)) == ["2a", "2b"] and ids(next(tasks)) == ["3a", "3b"]
  expect_next(env, tasks, samples=4)  # the last batch plays: nothing after it, nothing announced
  assert env.told == [(["2a", "2b"], 4)]


def test_environments_that_do_not_prepare_ahead_are_left_alone():
  tasks = Lookahead(_Batches())
  expect_next(object(), tasks, samples=2)  # no expect: nothing read ahead
  assert tasks.get_state() == 0
  expect_next(_Preparing(), None, samples=2)  # a step built without its stream
