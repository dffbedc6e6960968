"""A scripted multi-turn environment for episode tests: numbered observations, done after the task's turns."""

from ptx.model_config import ModelConfig
from ptx.envs.base import Outcome, Step
from ptx.sampling.engine.config import EngineConfig

# The model and engine of the episode tests (conftest's tiny_config): shared, so the files' compiled programs are one
# set in the run's compilation cache. Small pages and decode calls: turns end mid-call, episodes queue for slots.
MODEL = ModelConfig(vocab_size=264, d_model=40, n_layers=3, n_heads=8, n_kv_heads=2, head_dim=14, mlp_dim=96,
                    rope_theta=10_000.0, init_std=0.1)
ENGINE = EngineConfig(max_seqs=4, pages=160, page_size=8, max_seq_len=256, decode_steps=4, prefill_chunk=32,
                      prefill_rows=2)


class ScriptedEpisode:
  """Answers each action with a numbered observation (one tool call; the second fails); done after `turns` actions."""

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
    return Step(observation=f"obs {len(self.actions)} of {self.task['prompt']}", tool_calls=1,
                tool_errors=int(len(self.actions) == 2))

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
