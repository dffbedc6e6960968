"""Priority by training value: which scoring jobs the scheduler runs first under contention.

A policy gives each task a scheduler priority (higher runs first) and learns
from the rewards its samples got. GRPO learns only from groups whose rewards
differ: a group whose samples all agree has zero advantage. The built-in
`DisagreementFirst` therefore runs first the tasks whose earlier samples
disagreed, then tasks not seen yet, then tasks whose samples agreed. A policy
only orders work: every job still runs, so rewards are the same with any policy.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Callable, Protocol

import numpy as np


class PriorityPolicy(Protocol):
  """Gives scoring jobs a priority from what earlier samples of their task scored."""

  def priority(self, task: Mapping[str, Any]) -> int:
    """The scheduler priority of a job scoring a sample of `task` (higher runs first)."""

  def record(self, task: Mapping[str, Any], rewards: Sequence[float]) -> None:
    """Learns from the rewards of `task`'s samples just scored (NaN: not scored)."""


class DisagreementFirst:
  """Tasks whose earlier samples disagreed first, then unseen tasks, then tasks whose samples agreed.

  Args:
    key: a task's identity (default: its "prompt" field).
  """

  DISAGREED, UNSEEN, AGREED = 2, 1, 0

  def __init__(self, key: Callable[[Mapping[str, Any]], Hashable] = lambda task: task["prompt"]):
    self._key = key
    self._disagreed: dict[Hashable, bool] = {}  # by task: whether its last scored group had differing rewards

  def priority(self, task: Mapping[str, Any]) -> int:
    """DISAGREED, UNSEEN or AGREED by the task's last scored group.

    Args:
      task: the task record.

    Returns:
      The scheduler priority.
    """
    disagreed = self._disagreed.get(self._key(task))
    if disagreed is None:
      return self.UNSEEN
    return self.DISAGREED if disagreed else self.AGREED

  def record(self, task: Mapping[str, Any], rewards: Sequence[float]) -> None:
    """Remembers whether `task`'s scored samples disagreed (unscored ones, NaN, left out).

    Args:
      task: the task record.
      rewards: its samples' rewards.
    """
    scored = np.asarray(rewards, np.float64)
    scored = scored[~np.isnan(scored)]
    if scored.size:
      self._disagreed[self._key(task)] = bool(np.ptp(scored) > 0)
