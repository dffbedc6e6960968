"""The environment protocol: a task record becomes an episode the model acts in.

`Environment.reset(task)` turns one task record into an `Episode`, whose
`prompt` is the first message to the model. Each `Episode.step(action)` takes
the model's text and returns a `Step`: either an observation for the next turn
or, when `done`, the final reward with a reason and an outcome label. A
single-turn episode is done after its first step. Episodes may hold resources
(a sandbox workspace), so callers `close()` them; environments hold none and
may serve many episodes from many threads at once.

`Environment.validate(task)` checks a record's fields by the rules `reset`
applies, without starting an episode or running any code, so a trainer can
check every record of its files before anything compiles.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from ptx.sandbox import run as sandbox


class Outcome(enum.StrEnum):
  """How an episode ended."""

  OK = "ok"  # solved
  WRONG = "wrong"  # answered, incorrectly (failing tests, a false check)
  NO_ANSWER = "no_answer"  # no answer could be found in the output
  TIMEOUT = "timeout"  # the program ran out of wall-clock time
  CRASHED = "crashed"  # the program died on a signal
  LIMIT = "limit"  # the program hit a resource limit
  INFRA_ERROR = "infra_error"  # the environment failed, not the model: retried


def from_sandbox(outcome: sandbox.Outcome) -> Outcome:
  """Maps a sandbox outcome to an episode outcome (a failing program is a wrong answer)."""
  return Outcome.WRONG if outcome == sandbox.Outcome.FAILED else Outcome(str(outcome))


@dataclasses.dataclass(frozen=True)
class Step:
  """The environment's answer to one action."""

  observation: str = ""  # the next message to the model; "" once done
  done: bool = False
  reward: float = 0.0  # meaningful once done
  outcome: Outcome | None = None  # set once done
  reason: str = ""  # for people: why this reward
  tool_calls: int = 0  # tool calls (commands, function calls) this step ran for the model
  tool_errors: int = 0  # of those, the ones refused or failed (unparsable, unknown, bad arguments, raised)

  @classmethod
  def final(cls, outcome: Outcome, reason: str, reward: float | None = None, *, tool_calls: int = 0,
            tool_errors: int = 0) -> Step:
    """A last step; the reward defaults to 1.0 for OK and 0.0 otherwise."""
    if reward is None:
      reward = 1.0 if outcome == Outcome.OK else 0.0
    return cls("", True, reward, outcome, reason, tool_calls, tool_errors)


class Episode(Protocol):
  """One attempt at one task."""

  prompt: str

  def step(self, action: str) -> Step:
    """Applies the model's action."""

  def close(self) -> None:
    """Releases what the episode holds."""


class Environment(Protocol):
  """Makes episodes from task records."""

  name: str
  max_turns: int  # the most actions an episode accepts
  sandboxed: bool  # runs model-written code in `ptx.sandbox.run` (its backend is reported); absent means False
  # Optional: `reply_tokens`, the most tokens of one reply in the policy's tokenizer where the environment bounds
  # them (docqa); evaluation sizes an episode's context with it.

  def validate(self, task: Mapping[str, Any]) -> None:
    """Checks `task`'s fields as `reset` does, without starting an episode: no sandbox, no model or task code runs.

    Raises:
      ValueError: naming the environment and the field.
    """

  def reset(self, task: Mapping[str, Any]) -> Episode:
    """Starts an episode for `task` (refused, as by `validate`, for a record with a bad field)."""


def sandbox_backend(env: Environment) -> str | None:
  """The sandbox backend that runs `env`'s model-written code (None for an environment that runs none).

  Raises:
    SandboxUnavailable: `env` runs code and no backend works here (naming the fix).
  """
  return str(sandbox.backend()) if getattr(env, "sandboxed", False) else None


@runtime_checkable
class PreparesAhead(Protocol):
  """An environment that can prepare episodes' initial states before it is asked for them (`ShellEnv` with a
  `ptx.envs.warm_pool.WarmPool`); a trainer tells it the next batch's tasks while the current one plays."""

  def expect(self, tasks: Iterable[Mapping[str, Any]], samples: int = 1) -> None:
    """Prepares `samples` episodes' initial states of each of `tasks` in the background."""


def field(task: Mapping[str, Any], name: str, kind: type | tuple[type, ...], env: str) -> Any:
  """Returns task[name], or raises an error that names the field and the environment.

  Args:
    task: the task record.
    name: the field.
    kind: the type(s) it must have.
    env: the environment's name, for the message.

  Returns:
    The value.
  """
  if name not in task:
    raise ValueError(f"{env} task record needs field {name!r}; it has {sorted(task)}")
  value = task[name]
  if not isinstance(value, kind):
    names = [k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,))]
    kinds = " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    raise ValueError(f"{env} task field {name!r} must be {kinds}, got {type(value).__name__}")
  return value


@dataclasses.dataclass
class SingleTurn:
  """An episode scored once by `score(action) -> Step`."""

  prompt: str
  score: Callable[[str], Step]

  def step(self, action: str) -> Step:
    """Scores the action; the episode is then done."""
    return self.score(action)

  def close(self) -> None:
    """Holds nothing."""
