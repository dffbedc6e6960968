"""GRPO over multi-turn episodes: each step plays G episodes of every task of its batch, then updates on them.

`EpisodeStep(state, batch)` builds a rollout engine on the training mesh (its
key from the state's rng and step, so a resumed run plays the same episodes),
plays the batch's tasks with the current parameters through
`ptx.episodes.loop.play`, lays the trajectories out as the learner's rows
(`ptx.train.grpo.episode_rows`: the loss on the model's sampled tokens only,
infrastructure errors out of their group's baseline) and runs the same jitted
update as the single-turn host mode. With `grpo.routing_replay="rollout"`
the engine records every token's experts and the update replays them
(`ptx.train.grpo.episode_rows`). Rollouts are on-policy: nothing is in
flight between steps, so a checkpoint needs nothing beyond the train state.

Metrics add, per step: `episodes/turns_mean`, `episodes/tool_calls_mean` and
`episodes/tool_errors_mean` (calls the environment ran, and refused or failed),
`timing_s/tool_wait_mean` (an episode's tool seconds),
`episodes/infra_error_frac`, the fraction of each outcome
(`episodes/outcome/<name>`), tokens per episode by source
(`episodes/tokens_<prompt|model|environment>_mean`), `timing_s/play` and
`timing_s/step`; in a mixture of environments (`ptx.envs.mixture`), each
one's mean reward (`episodes/reward/<env>`). A step that `grpo.samples_every` selects keeps its first
episodes' transcripts (`ptx.train.grpo.samples`): the conversation, reward,
outcome and end reason.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Sequence

import numpy as np
import optax
from jax.sharding import Mesh

from ptx.data.global_batch import to_global
from ptx.data.lookahead import Lookahead
from ptx.envs.base import Environment, PreparesAhead
from ptx.episodes.loop import play
from ptx.episodes.turn_format import TurnFormat
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.generation import Generation
from ptx.train.grpo.episode_rows import episode_rollouts
from ptx.train.grpo.samples import SampleLog
from ptx.train.grpo.update import GRPOStepKind, RLSpec, jit_learn, step_keys
from ptx.train.state import TrainState
from ptx.train.step import model_params


@dataclasses.dataclass(frozen=True)
class EpisodeGRPOStep(GRPOStepKind):
  """The multi-turn GRPO step of a Job: `spec`, the environment, the episodes' token form, the engine's shapes."""

  env: Environment
  fmt: TurnFormat
  engine: EngineConfig
  max_turn_tokens: int
  lockstep: bool

  def stream(self, data: Any) -> Lookahead:
    """The task batches as `fit` reads them: a `Lookahead`, so the step can tell the environment the next batch."""
    return Lookahead.of(data)

  def build(self, optimizer: optax.GradientTransformation, mesh: Mesh, state_shardings: TrainState,
            data: Any) -> "EpisodeStep":
    """The step object for `fit`, reading the next batch's tasks ahead of `data` (`stream`'s)."""
    return EpisodeStep(spec=self.spec, optimizer=optimizer, mesh=mesh, state_shardings=state_shardings, env=self.env,
                       fmt=self.fmt, engine=self.engine, max_turn_tokens=self.max_turn_tokens, lockstep=self.lockstep,
                       tasks=data)


class EpisodeStep:
  """`step(state, batch) -> (state, metrics)` of GRPO over episodes, for `fit`; `batch["task"]` holds B task records.

  Args:
    spec: the static step description; `max_new_tokens` is N, the columns
      an episode may fill after its first prompt (model and reply tokens).
    optimizer: the optax transformation of the state.
    mesh: the device mesh.
    state_shardings: the state's shardings.
    env: the environment the tasks are played in.
    fmt: the episodes' token form.
    engine: the engine's shapes for one device; `max_seq_len` is an
      episode's whole context, first prompt (at most max_seq_len - N
      tokens) included.
    max_turn_tokens: tokens the model may sample in one turn.
    tool_threads: environment steps running at once.
    lockstep: take the tools' replies only when the engine can run nothing
      else, all at once, so the log-probs, and a resumed run, do not depend
      on tool timing (`ptx.episodes.loop.play`).
    tasks: the batches `fit` reads (a `Lookahead`): an environment that
      `PreparesAhead` is told the next batch's tasks as each step starts, so
      their initial states (a warm pool's workspaces) are made while this
      step plays and learns. None: nothing is read ahead.

  Raises:
    ValueError: when the engine's context leaves no room for a prompt.
  """

  def __init__(self, *, spec: RLSpec, optimizer: optax.GradientTransformation, mesh: Mesh,
               state_shardings: TrainState, env: Environment, fmt: TurnFormat, engine: EngineConfig,
               max_turn_tokens: int, tool_threads: int = 16, lockstep: bool = True, tasks: Lookahead | None = None):
    self._prompt_width = engine.max_seq_len - spec.max_new_tokens
    if self._prompt_width < 1:
      raise ValueError(f"EngineConfig.max_seq_len ({engine.max_seq_len}) must exceed max_new_tokens "
                       f"({spec.max_new_tokens}): it holds the first prompt too")
    self._spec, self._mesh, self._env, self._fmt = spec, mesh, env, fmt
    self._engine_config = engine.on_mesh(mesh, spec.rules)
    self._max_turn_tokens, self._tool_threads, self._lockstep = max_turn_tokens, tool_threads, lockstep
    self._tasks = tasks
    self._samples = SampleLog(spec.grpo, fmt.tokenizer)
    self._learn = jit_learn(spec, optimizer, mesh, state_shardings)
    self._last_return: float | None = None

  def __call__(self, state: TrainState, batch: dict[str, Any]) -> tuple[TrainState, dict[str, Any]]:
    start = time.perf_counter()
    spec, G = self._spec, self._spec.grpo.group_size
    engine = RolloutEngine(spec.model, self._engine_config, sampling=spec.grpo.sampling, seed=step_keys(state)[0],
                           mesh=self._mesh, tempered_log_probs=True, pad_id=spec.pad_id, rules=spec.rules,
                           record_routes=spec.grpo.routing_replay == "rollout")
    k = int(state.step)
    expect_next(self._env, self._tasks, G)
    tasks = list(batch["task"])
    trajectories = play(engine, model_params(state, spec.lora), self._env, tasks, self._fmt,
                        samples=G, max_turn_tokens=self._max_turn_tokens, max_episode_tokens=spec.max_new_tokens,
                        policy_version=k, tool_threads=self._tool_threads, lockstep=self._lockstep)
    played = time.perf_counter()
    if self._samples.due(k + 1):
      self._samples.keep_episodes(k + 1, trajectories, G)
    rows, gen, rewards = episode_rollouts(trajectories, G, prompt_width=self._prompt_width,
                                          width=spec.max_new_tokens, pad_id=spec.pad_id)
    placed = to_global({"rows": rows, "gen": dataclasses.asdict(gen), "rewards": rewards}, self._mesh, spec.rules)
    state, metrics = self._learn(state, placed["rows"], Generation(**placed["gen"]), placed["rewards"])
    end = time.perf_counter()
    wall = end - (start if self._last_return is None else self._last_return)
    self._last_return = end
    label = getattr(self._env, "label", None)  # a mixture's: the environment each task was played in
    labels = None if label is None else [label(tasks[t.task]) for t in trajectories]
    return state, {**metrics, **episode_metrics(trajectories, labels), "timing_s/step": wall,
                   "timing_s/play": played - start}

  def take_samples(self, wait: bool = False) -> dict[int, bytes]:
    """The transcripts of the steps that kept episodes (`ptx.train.grpo.samples.SampleLog.take`), by step."""
    return self._samples.take(wait)

  def pipeline_state(self) -> None:
    """Nothing is in flight between steps: the train state is the whole checkpoint."""
    return None

  def set_pipeline_state(self, saved: Any) -> None:
    """Raises: a checkpoint of this step holds no pipeline."""
    raise ValueError("a multi-turn GRPO checkpoint holds no pipeline; this one was written by another step kind")


def expect_next(env: Environment, tasks: Lookahead | None, samples: int) -> None:
  """Tells an environment that `PreparesAhead` the tasks of the batch after the one being played (G samples each)."""
  if tasks is None or not isinstance(env, PreparesAhead):
    return
  try:
    batch = tasks.peek(0)
  except StopIteration:  # a finite stream's last batch is playing
    return
  env.expect(list(batch["task"]), samples)


def episode_metrics(trajectories, labels: Sequence[str] | None = None) -> dict[str, float]:
  """Per-step means over a step's episodes: turns, tool time, tokens by source, outcome fractions; with `labels`
  (one per episode: a mixture's environment), the mean reward of each label's episodes that were scored
  (`episodes/reward/<label>`, present on the steps that played the label)."""
  n = len(trajectories)
  by_label = collections.defaultdict(list)
  for t, name in zip(trajectories, labels or ()):
    if not t.infra_error:
      by_label[name].append(t.reward)
  sources = collections.Counter()
  for t in trajectories:
    sources.update(t.source_tokens())
  outcomes = collections.Counter(str(t.outcome) for t in trajectories)
  return {"episodes/turns_mean": float(np.mean([t.turns for t in trajectories])),
          "episodes/tool_calls_mean": float(np.mean([t.tool_calls for t in trajectories])),
          "episodes/tool_errors_mean": float(np.mean([t.tool_errors for t in trajectories])),
          "timing_s/tool_wait_mean": float(np.mean([t.tool_wait_s for t in trajectories])),
          "episodes/infra_error_frac": sum(t.infra_error for t in trajectories) / n,
          **{f"episodes/tokens_{source}_mean": count / n for source, count in sources.items()},
          **{f"episodes/outcome/{name}": count / n for name, count in sorted(outcomes.items())},
          **{f"episodes/reward/{name}": float(np.mean(rewards)) for name, rewards in sorted(by_label.items())}}
