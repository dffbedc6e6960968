"""Multi-turn episodes over the rollout engine: the model samples a turn, the environment answers, the episode goes on.

`play(engine, params, env, tasks, fmt)` runs `samples` episodes of every task
at once. Each episode is one engine sequence, submitted with `keep=True`: the
engine samples a turn until one of the format's stop ids (the end of the
model's message) or the turn budget, the environment's `step` answers the
decoded text on a host thread, and its reply, encoded by `TurnFormat.reply`,
is appended to the live sequence with `RolloutEngine.extend`, so the cache is
never rebuilt and the next turn starts where the reply ends. While some
episodes wait on their tools, the engine decodes the others: the loop only
waits on a tool when nothing else can run.

That makes the schedule depend on tool timing: which turns share an engine
call, and so the order in which a row's float32 sums run. Tokens do not
depend on it (below), but the log-probs move by an ulp or two. With
`lockstep=True` replies join only when the engine can run nothing else (every
live episode waits on its tool, or on a slot that one holds), and then all at
once, in episode order: the points where they join follow from the tokens
alone, so every call and every log-prob does too, and two runs, or a run and
its resumption, play bitwise alike. Tools still run while the engine decodes
the other episodes' turns, but a reply that comes back early waits for the
slowest, as in turns taken in waves.

An episode ends when the environment says done, at the environment's turn
limit (`Environment.max_turns` steps), or when the context is full (the
next turn would not fit `max_context`): then it is scored 0 with outcome
LIMIT, since the environment never judged it; `max_episode_tokens` bounds
the tokens after the first prompt the same way. A step that raises scores the
episode INFRA_ERROR (the environment failed, not the model), which training
excludes from its group's baseline rather than score 0.

Trajectories are token in, token out: `Trajectory.tokens` is the first prompt,
then every turn's sampled tokens exactly as sampled (loss mask 1, with their
sampling log-probs and policy versions) and every reply's tokens (mask 0, log-
prob 0, version -1), in order; nothing is decoded and encoded again. Tokens are
reproducible: each sequence draws with its own id's stream (see
`ptx.sampling.engine.engine`), and ids are given in task and sample order before
anything runs, so tool timing never changes what is sampled.

An engine that records routes (routing replay) gives each trajectory the
experts every MoE layer chose for its tokens (`Trajectory.routes`): the
prompt's and the replies' from the prefill that wrote them, each sampled
token's from the forward that fed it; only the last token, never fed, has
none.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ptx.envs.base import Environment, Episode, Outcome, Step
from ptx.episodes.turn_format import TurnFormat
from ptx.models import moe
from ptx.sampling.engine.engine import RolloutEngine
from ptx.sampling.engine.sequences import Completion
from ptx.sampling.generation import STOP

Params = Any


@dataclasses.dataclass(frozen=True)
class Trajectory:
  """One finished episode, as the loss sees it."""

  task: int  # index into the tasks
  sample: int  # which of the task's samples
  prompt_len: int  # tokens[:prompt_len] is the first prompt
  tokens: np.ndarray  # int32 [n]: prompt, then model and environment tokens in order
  loss_mask: np.ndarray  # int32 [n]: 1 on the model's sampled tokens, 0 on the prompt and the replies
  log_probs: np.ndarray  # float32 [n]: sampling log-probs of the model's tokens, 0 elsewhere
  policy_versions: np.ndarray  # int32 [n]: the version each model token was sampled under, -1 elsewhere
  messages: tuple[Mapping[str, str], ...]  # the conversation as text: user prompt, then model turns and replies
  turns: int  # model turns sampled
  reward: float
  outcome: Outcome
  reason: str
  tool_wait_s: float  # seconds the episode's environment steps took, summed
  tool_calls: int  # tool calls the environment ran for the model (`Step.tool_calls`, summed)
  tool_errors: int  # of those, refused or failed
  # `moe.ROUTE_DTYPE` [n, L, k] from an engine that records routes: each token's experts (`moe.NO_ROUTE` on the
  # last, never fed); else None.
  routes: np.ndarray | None = None

  @property
  def infra_error(self) -> bool:
    """Whether the environment failed (the episode says nothing about the model)."""
    return self.outcome == Outcome.INFRA_ERROR

  def source_tokens(self) -> dict[str, int]:
    """Tokens by source: the first prompt, the model's, the environment's replies."""
    model = int(self.loss_mask.sum())
    return {"prompt": self.prompt_len, "model": model, "environment": len(self.tokens) - self.prompt_len - model}


@dataclasses.dataclass(eq=False)
class _Live:
  """Host state of one running episode."""

  task: int
  sample: int
  episode: Episode
  seq_id: int
  prompt: list[int]
  limit: int  # tokens it may hold, prompt and replies included
  tokens: list[int] = dataclasses.field(default_factory=list)
  mask: list[int] = dataclasses.field(default_factory=list)
  log_probs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
  turns: int = 0
  tool_wait_s: float = 0.0
  tool_calls: int = 0
  tool_errors: int = 0
  routes: np.ndarray | None = None  # the last turn's `Completion.routes`: every token's but the last

  @property
  def length(self) -> int:
    return len(self.prompt) + len(self.tokens)


def play(engine: RolloutEngine, params: Params, env: Environment, tasks: Sequence[Mapping[str, Any]],
         fmt: TurnFormat, *, samples: int = 1, max_turn_tokens: int = 256, max_context: int | None = None,
         max_episode_tokens: int | None = None, policy_version: int = 0,
         tool_threads: int = 16, lockstep: bool = False) -> list[Trajectory]:
  """Plays `samples` episodes of every task to the end; returns them in task, then sample order.

  Args:
    engine: the rollout engine (holding nothing: every episode is one of its
      sequences, kept between turns).
    params: the policy's parameters, as `engine.step` takes them.
    env: the environment; its `max_turns` bounds every episode.
    tasks: task records for `env.reset`.
    fmt: the episodes' token form (prompt, turn stop ids, replies).
    samples: episodes per task (a GRPO group); a task's samples share its
      prompt's pages.
    max_turn_tokens: tokens the model may sample in one turn.
    max_context: positions an episode may fill, prompt and replies included;
      default (and at most) the engine's `max_seq_len`.
    max_episode_tokens: tokens an episode may add after its first prompt,
      the model's and the replies' (a training row's width); default: only
      the context bounds it.
    policy_version: stamped on every sampled token.
    tool_threads: environment steps running at once.
    lockstep: take replies only when the engine can run nothing else, all
      at once, so the log-probs do not depend on tool timing (see the module
      docstring); False: each as soon as its tool returns.

  Returns:
    One `Trajectory` per episode.

  Raises:
    ValueError: naming the task, for a record `env.reset` refuses or a first
      prompt longer than the context.
  """
  limit = engine.config.max_seq_len if max_context is None else min(max_context, engine.config.max_seq_len)
  if max_turn_tokens < 1:
    raise ValueError(f"play: max_turn_tokens must be >= 1, got {max_turn_tokens}")
  stop_ids = fmt.stop_ids
  live: dict[int, _Live] = {}
  done: dict[tuple[int, int], Trajectory] = {}
  try:
    for index, task in enumerate(tasks):
      try:
        episodes = [env.reset(task) for _ in range(samples)]
      except ValueError as e:
        raise ValueError(f"play: task {index}: {e}") from None
      prompt = fmt.prompt(episodes[0].prompt)
      # Tokens the episode may hold: the engine could sample one past its last cached position, but a trajectory
      # longer than `room` would not fit the training row `max_episode_tokens` sizes.
      room = limit if max_episode_tokens is None else min(limit, len(prompt) + max_episode_tokens)
      budget = min(max_turn_tokens, room - len(prompt))
      if budget < 1:
        for episode in episodes:
          episode.close()
        raise ValueError(f"play: task {index}: its prompt of {len(prompt)} tokens leaves no room in a context of "
                         f"{room}")
      ids = engine.submit(prompt, max_new_tokens=budget, stop_ids=stop_ids, samples=samples, keep=True,
                          reserve=room)
      for sample, (seq_id, episode) in enumerate(zip(ids, episodes)):
        live[seq_id] = _Live(index, sample, episode, seq_id, prompt, room,
                             messages=[{"role": "user", "content": episode.prompt}])
    _run(engine, params, env, fmt, live, done, max_turn_tokens=max_turn_tokens,
         policy_version=policy_version, tool_threads=tool_threads, lockstep=lockstep)
  finally:
    for state in live.values():
      state.episode.close()
  return [done[key] for key in sorted(done)]


def _run(engine: RolloutEngine, params: Params, env: Environment, fmt: TurnFormat, live: dict[int, _Live],
         done: dict[tuple[int, int], Trajectory], *, max_turn_tokens: int,
         policy_version: int, tool_threads: int, lockstep: bool) -> None:
  """Steps the engine and the environment until every episode in `live` is done (moved to `done`)."""
  waiting: dict[concurrent.futures.Future, tuple[_Live, Completion]] = {}

  def finish(state: _Live, step: Step) -> None:
    engine.release(state.seq_id)
    state.episode.close()
    del live[state.seq_id]
    done[(state.task, state.sample)] = _trajectory(state, step)

  with concurrent.futures.ThreadPoolExecutor(tool_threads, thread_name_prefix="ptx-episode") as pool:
    while live:
      for completion in engine.step(params, policy_version=policy_version):
        state = live[completion.seq_id]
        state.tokens += completion.tokens.tolist()
        state.mask += [1] * len(completion.tokens)
        state.log_probs += completion.log_probs.tolist()
        state.versions += completion.policy_versions.tolist()
        state.routes = completion.routes
        state.turns += 1
        action = fmt.action(completion.tokens)
        state.messages.append({"role": "assistant", "content": action})
        waiting[pool.submit(_timed_step, state.episode, action)] = (state, completion)
      if not waiting:
        if engine.stalled:
          raise RuntimeError("play: the engine can admit no more episodes and none is running: its pages or slots "
                             "are too few for one group's turn (EngineConfig.pages, max_seqs)")
        continue
      if lockstep:
        if engine.busy and not engine.stalled:
          continue  # replies join only once the engine can run nothing else
        ready = concurrent.futures.wait(list(waiting)).done
      else:  # wait on a tool only when the engine has nothing left to decode
        ready, _ = concurrent.futures.wait(list(waiting), timeout=None if engine.stalled or not engine.busy else 0,
                                           return_when=concurrent.futures.FIRST_COMPLETED)
      # In episode order: the order of the replies decides the engine's rows.
      for future in sorted(ready, key=lambda f: waiting[f][0].seq_id):
        state, completion = waiting.pop(future)
        step, seconds = future.result()
        state.tool_wait_s += seconds
        state.tool_calls += step.tool_calls
        state.tool_errors += step.tool_errors
        if step.done:
          finish(state, step)
          continue
        if state.turns >= env.max_turns:
          finish(state, Step.final(Outcome.NO_ANSWER, f"out of turns ({env.max_turns}) without an answer"))
          continue
        reply = fmt.reply(state.messages, step.observation, closed=completion.finish_reason == STOP)
        budget = min(max_turn_tokens, state.limit - state.length - len(reply))
        if budget < 1:
          finish(state, Step.final(Outcome.LIMIT, f"the context of {state.limit} tokens is full after {state.turns} "
                                                  "turns"))
          continue
        state.tokens += reply
        state.mask += [0] * len(reply)
        state.log_probs += [0.0] * len(reply)
        state.versions += [-1] * len(reply)
        state.messages.append({"role": fmt.reply_role, "content": step.observation})
        engine.extend(state.seq_id, reply, max_new_tokens=budget)


def _timed_step(episode: Episode, action: str) -> tuple[Step, float]:
  """The environment's answer to `action` (INFRA_ERROR when the step raises) and the seconds it took."""
  start = time.perf_counter()
  try:
    step = episode.step(action)
  except Exception as e:  # noqa: BLE001 - any failure of the environment is its own, never the model's
    step = Step.final(Outcome.INFRA_ERROR, f"the environment's step raised {type(e).__name__}: {e}")
  return step, time.perf_counter() - start


def _trajectory(state: _Live, step: Step) -> Trajectory:
  n = len(state.prompt)
  routes = state.routes
  if routes is not None:
    routes = np.concatenate([routes, np.full_like(routes[:1], moe.NO_ROUTE)])
  return Trajectory(
      task=state.task, sample=state.sample, prompt_len=n,
      tokens=np.asarray(state.prompt + state.tokens, np.int32),
      loss_mask=np.asarray([0] * n + state.mask, np.int32),
      log_probs=np.asarray([0.0] * n + state.log_probs, np.float32),
      policy_versions=np.asarray([-1] * n + state.versions, np.int32),
      messages=tuple(state.messages), turns=state.turns, reward=float(step.reward),
      outcome=step.outcome or Outcome.INFRA_ERROR, reason=step.reason, tool_wait_s=state.tool_wait_s,
      tool_calls=state.tool_calls, tool_errors=state.tool_errors, routes=routes)
