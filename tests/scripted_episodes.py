"""A scripted multi-turn environment for episode tests: numbered observations, done after the task's turns."""

from ptx.rl.environments.base import Outcome, Step


class ScriptedEpisode:
  """Answers each action with a numbered observation; done after the task's `turns` actions."""

  def __init__(self, env, task):
    self.env, self.task, self.actions = env, task, []
    self.prompt = task["prompt"]

  def step(self, action):
    self.actions.append(action)
    self.env.hook(self.task, len(self.actions))
    if self.env.fail is not None and self.task["prompt"].startswith(self.env.fail):
      raise OSError("the tool's machine went away")
    if len(self.actions) >= self.task["turns"]:
      return Step.final(Outcome.OK, "scripted", reward=self.env.reward(self.actions))
    return Step(observation=f"obs {len(self.actions)} of {self.task['prompt']}")

  def close(self):
    self.env.closed += 1


class ScriptedEnv:
  """Episodes of `ScriptedEpisode`; `hook(task, calls)` runs in every step, `fail` a prompt prefix whose steps raise.

  The final reward is `reward(actions)` (default 1.0).
  """

  name, sandboxed = "scripted", False

  def __init__(self, max_turns=4, hook=lambda task, n: None, fail=None, reward=lambda actions: 1.0):
    self.max_turns, self.hook, self.fail, self.reward = max_turns, hook, fail, reward
    self.episodes, self.closed = [], 0

  def reset(self, task):
    episode = ScriptedEpisode(self, task)
    self.episodes.append(episode)
    return episode
