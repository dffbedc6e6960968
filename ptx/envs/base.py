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

A record's "prompt" is what the record holds: a string, or chat messages
(`ptx.data.chat`: a list of role/content objects). The data layer renders
it for the model (`ptx.data.records`: messages through the chat template,
once); environments read it with `prompt_text` (a single-turn episode's
prompt, for people and for evaluation) or `user_turn` (a multi-turn episode
poses its task as one user turn, so its messages must be just that).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

from ptx.data.chat import validate_messages
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
  # them (docqa); evaluation sizes an episode's context with it. `first_prompt(task) -> str`, the text an episode's
  # first prompt shows, where `reset` would claim something (a sandbox workspace) to find it (`first_prompt` below).

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


def prompt_field(task: Mapping[str, Any], env: str) -> str | list[dict[str, Any]]:
  """Returns task["prompt"], a string or chat messages, or raises an error that names the field and the environment.

  Args:
    task: the task record.
    env: the environment's name, for the message.

  Returns:
    The string, or the messages (checked by `ptx.data.chat.validate_messages`).
  """
  if "prompt" not in task:
    raise ValueError(f"{env} task record needs field 'prompt'; it has {sorted(task)}")
  value = task["prompt"]
  if isinstance(value, str):
    return value
  if not isinstance(value, list):
    raise ValueError(f"{env} task field 'prompt' must be a string or chat messages (a list of role/content objects), "
                     f"got {type(value).__name__}")
  try:
    validate_messages(value)
  except ValueError as e:
    raise ValueError(f"{env} task field 'prompt': {e}") from None
  return value


def prompt_text(task: Mapping[str, Any], env: str) -> str:
  """A single-turn task's prompt as text: the string, or the content of the last user message of chat messages.

  The model reads the whole prompt as the data layer renders it; this text only names the request (an episode's
  `prompt`), so the other messages (a system prompt) are left out.

  Raises:
    ValueError: as `prompt_field`.
  """
  prompt = prompt_field(task, env)
  if isinstance(prompt, str):
    return prompt
  return next((m["content"] for m in reversed(prompt) if m["role"] == "user"), prompt[-1]["content"])


def user_turn(task: Mapping[str, Any], env: str) -> str:
  """A multi-turn task's prompt as the text of the one user turn its episodes start from.

  Raises:
    ValueError: as `prompt_field`, and for chat messages other than a single user message (an episode poses its
      task as one user turn; a system prompt or earlier turns would be lost).
  """
  prompt = prompt_field(task, env)
  if isinstance(prompt, str):
    return prompt
  if [m["role"] for m in prompt] != ["user"]:
    raise ValueError(f"{env} task field 'prompt': an episode starts from one user turn, so chat messages must be a "
                     f"single user message, got roles {[m['role'] for m in prompt]}")
  return prompt[0]["content"]


def first_prompt(env: Environment, task: Mapping[str, Any]) -> str:
  """The text of the first prompt an episode of `task` shows the model (before the chat template).

  The environment's `first_prompt` where it has one, else an episode's, started and closed at once.

  Raises:
    ValueError: for a record the environment refuses.
  """
  if (method := getattr(env, "first_prompt", None)) is not None:
    return method(task)
  episode = env.reset(task)
  try:
    return episode.prompt
  finally:
    episode.close()


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

  def demonstration(self, answer: str, refusal: str) -> list[dict[str, str]]:
    """This episode answered by `answer`, as chat messages (the prompt, the answer), for SFT.

    Args:
      answer: the right answer, as the model would write it.
      refusal: how the error starts when the episode does not score it 1, the outcome and reason following
        ("bfcl task 'simple_3': its expected calls score").

    Raises:
      ValueError: when the episode does not score the answer 1.
    """
    step = self.step(answer)
    if step.outcome != Outcome.OK:
      raise ValueError(f"{refusal} {step.outcome}: {step.reason}")
    return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": answer}]
