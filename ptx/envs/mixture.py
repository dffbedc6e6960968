"""Several environments in one run: each task record names the environment that poses and scores it.

A mixture's record is `{"env": NAME, "task": RECORD}`: RECORD is a record of
the environment called NAME, which validates it, poses it and scores the
model's turns exactly as it would alone. `MixtureEnv` dispatches by that
name (`ptx grpo --env`'s: "terminal", "code"); it accepts as many turns as its most patient environment, and runs
model-written code when any of them does.

`MixedTasks` draws an endless stream from several task sources by weight:
record i comes from the source a generator seeded with (seed, i) picks, and
is that source's own record i, so the stream is random-access, a resumed
run reads the same records, and each source's held-out split stays held out
(the sources are training splits: `ptx grpo --env reasoning_gym,bfcl`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ptx.envs.base import Environment, Episode, field, first_prompt


@dataclasses.dataclass(frozen=True)
class MixtureEnv:
  """Records `{"env", "task"}` posed and scored by the environment they name.

  Attributes:
    names: what records call each environment (`ptx grpo --env`'s names: "terminal", "code").
    envs: the environments, one per name.
  """

  names: tuple[str, ...]
  envs: tuple[Environment, ...]
  name: str = "mixture"

  def __post_init__(self):
    if not self.names or len(set(self.names)) != len(self.names) or len(self.envs) != len(self.names):
      raise ValueError(f"MixtureEnv needs distinct names, one environment each, got {self.names} for "
                       f"{len(self.envs)} environments")

  @property
  def max_turns(self) -> int:
    """The most turns any of its environments accepts."""
    return max(env.max_turns for env in self.envs)

  @property
  def sandboxed(self) -> bool:
    """Whether any of its environments runs model-written code."""
    return any(getattr(env, "sandboxed", False) for env in self.envs)

  @property
  def reply_tokens(self) -> int:
    """The largest reply bound any of its environments declares (0: none declares one)."""
    return max(getattr(env, "reply_tokens", 0) for env in self.envs)

  def label(self, task: Mapping[str, Any]) -> str:
    """The name of the environment that plays `task` (training reports reward per label)."""
    return self._named(task)[0]

  def validate(self, task: Mapping[str, Any]) -> None:
    """Checks the record's "env" and, by that environment's rules, its "task"."""
    self._named(task)[1].validate(field(task, "task", dict, self.name))

  def reset(self, task: Mapping[str, Any]) -> Episode:
    """Starts an episode of the record's task in the environment it names."""
    return self._named(task)[1].reset(field(task, "task", dict, self.name))

  def first_prompt(self, task: Mapping[str, Any]) -> str:
    """The first prompt the named environment shows for the record's task."""
    return first_prompt(self._named(task)[1], field(task, "task", dict, self.name))

  def demonstration(self, task: Mapping[str, Any]) -> list[dict[str, str]]:
    """The named environment's demonstration of the record's task (chat messages), for SFT.

    Raises:
      ValueError: for a bad record, or an environment without demonstrations (named).
    """
    name, env = self._named(task)
    if not hasattr(env, "demonstration"):
      raise ValueError(f"{self.name}: environment {name!r} has no demonstrations")
    return env.demonstration(field(task, "task", dict, self.name))

  def _named(self, task: Mapping[str, Any]) -> tuple[str, Environment]:
    name = field(task, "env", str, self.name)
    if name not in self.names:
      raise ValueError(f"{self.name} task field 'env' must be one of {self.names}, got {name!r}")
    return name, self.envs[self.names.index(name)]


@dataclasses.dataclass(frozen=True)
class MixedTasks:
  """An endless, random-access weighted mix of task sources: record i is a pure function of (seed, i).

  Attributes:
    names: the environment name of each source (a record's "env").
    sources: random-access task sources (`source[i]` a record; endless, or cycling).
    weights: each source's sampling weight (empty: equal).
    seed: selects the draws.
  """

  names: tuple[str, ...]
  sources: tuple[Any, ...]
  weights: tuple[float, ...] = ()
  seed: int = 0

  def __post_init__(self):
    if not self.names or len(self.sources) != len(self.names) or (self.weights and
                                                                   len(self.weights) != len(self.names)):
      raise ValueError(f"MixedTasks needs one source and one weight per name, got names {self.names}, "
                       f"{len(self.sources)} sources, weights {self.weights}")
    if any(not w > 0 for w in self.weights):
      raise ValueError(f"MixedTasks.weights must be positive, got {self.weights}")

  def __getitem__(self, i: int) -> dict[str, Any]:
    weights = np.asarray(self.weights or (1.0,) * len(self.names))
    k = np.random.default_rng([self.seed, i]).choice(len(self.names), p=weights / weights.sum())
    return {"env": self.names[k], "task": self.sources[k][i]}


def weighted_names(entries: Sequence[str], what: str) -> tuple[tuple[str, ...], tuple[float, ...]]:
  """`NAME` or `NAME:WEIGHT` entries as (names, weights), a weight 1 where left out.

  Args:
    entries: the entries.
    what: what the names are, for errors ("reasoning-gym families").

  Raises:
    ValueError: naming an entry without a name or whose weight is not a positive finite number, or a name given
      twice.
  """
  names, weights = [], []
  for entry in entries:
    name, _, weight = entry.partition(":")
    try:
      value = float(weight) if weight else 1.0
    except ValueError:
      value = -1.0
    if not name or not 0 < value < float("inf"):
      raise ValueError(f"{what} are NAME or NAME:WEIGHT with a positive weight, got {entry!r}")
    names.append(name)
    weights.append(value)
  if len(set(names)) != len(names):
    raise ValueError(f"{what} must be distinct, got {names}")
  return tuple(names), tuple(weights)
