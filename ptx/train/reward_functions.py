"""GRPO from plain Python reward functions, as TRL's and Tunix's users write them.

A reward function takes the batch's prompts and completions as lists (one
entry per sample, a prompt repeated for each of its G samples) and returns
one float per sample, or None where it cannot score one (the sample then
leaves its group's statistics and the loss):

    def brevity(prompts, completions, **fields):
      return [1.0 if len(c) < 20 else 0.0 for c in completions]

Other fields of the task records reach a function as keyword lists of the
same length (`answer=[...]`), when it declares them or takes `**fields`.
Several functions are named reward components (`grpo.reward_combine`,
`grpo.reward_weights` in sorted-name order). They run on the host while the
device samples the next batch (GRPO's host-reward mode, `ptx.train.grpo.host`).

`train_grpo(cfg, tasks=..., rewards=[...], tokenizer=..., out=...)` is the
whole run: the job, the prompt stream over `tasks` and `fit`. From a
pretrained model:

    start = ptx.from_pretrained("out/smollm2", ptx.FINETUNE["grpo"]())
    ptx.train_grpo(start.cfg, tasks=tasks, rewards=brevity, tokenizer=start.tokenizer,
                   init_params=start.params, out="out/grpo")
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ptx.config import Config
from ptx.data.tokenizer import Tokenizer
from ptx.train import streams
from ptx.train.job import grpo_host_job
from ptx.train.loop import fit
from ptx.episodes.scoring import decode_completions
from ptx.train.state import TrainState

RewardFunction = Callable[..., Sequence[float | None]]


@dataclasses.dataclass(frozen=True)
class RewardFunctions:
  """A HostReward (`ptx.train.grpo.host`) of plain Python reward functions.

  Attributes:
    fns: the reward functions; one gives a scalar reward, several give
      components named by each function's `__name__`.
    tokenizer: decodes completions (not compared: it is the job's data side).
    stop_ids: ids left out of the decoded text.
    group_size: samples per task (G).
  """

  fns: tuple[RewardFunction, ...]
  tokenizer: Tokenizer = dataclasses.field(compare=False)
  stop_ids: tuple[int, ...]
  group_size: int

  def __post_init__(self):
    names = [_name(fn) for fn in self.fns]
    if not names or len(set(names)) != len(names):
      raise ValueError(f"reward functions need distinct names (they name the reward components), got {names}")

  def __call__(self, tokens: np.ndarray, lengths: np.ndarray,
               tasks: Sequence[Mapping[str, Any]]) -> np.ndarray | dict[str, np.ndarray]:
    completions = decode_completions(self.tokenizer, tokens, lengths, self.stop_ids)
    rows = [task for task in tasks for _ in range(self.group_size)]
    prompts = [row["prompt"] for row in rows]
    fields = {key: [row.get(key) for row in rows] for key in rows[0] if key not in ("prompt", "where")}
    scores = {_name(fn): self._score(fn, prompts, completions, fields) for fn in self.fns}
    return scores if len(scores) > 1 else next(iter(scores.values()))

  @staticmethod
  def _score(fn: RewardFunction, prompts: list, completions: list[str], fields: dict[str, list]) -> np.ndarray:
    """float32 [R] of one function (NaN for None), with an error naming it when it returns the wrong count."""
    parameters = inspect.signature(fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    values = list(fn(prompts, completions, **{k: v for k, v in fields.items() if takes_all or k in parameters}))
    if len(values) != len(completions):
      raise ValueError(f"reward function {_name(fn)!r} returned {len(values)} values for {len(completions)} "
                       "completions (one per sample, None where it cannot score)")
    return np.asarray([np.nan if v is None else float(v) for v in values], np.float32)


def _name(fn: RewardFunction) -> str:
  return getattr(fn, "__name__", type(fn).__name__)


class _Cycle:
  """A list of task records as the endless, random-access source a prompt stream reads."""

  def __init__(self, tasks: Sequence[Mapping[str, Any]]):
    if not tasks:
      raise ValueError("train_grpo: tasks is empty")
    missing = [i for i, t in enumerate(tasks) if "prompt" not in t]
    if missing:
      raise ValueError(f"train_grpo: task {missing[0]} has no 'prompt'")
    self._tasks = tasks

  def __getitem__(self, index: int) -> Mapping[str, Any]:
    return self._tasks[index % len(self._tasks)]


def train_grpo(cfg: Config, *, tasks: Sequence[Mapping[str, Any]], rewards: RewardFunction | Sequence[RewardFunction],
               tokenizer: Tokenizer, out: str | pathlib.Path, init_params: Any = None, resume: bool = False,
               progress: bool = True) -> tuple[TrainState, dict[str, Any]]:
  """Trains `cfg.train.steps` GRPO steps on `tasks`, scored by plain Python reward functions.

  Args:
    cfg: the job config (`data.batch_size` prompts of `data.seq_len` tokens a
      step, `grpo.group_size` samples each; `ptx.FINETUNE["grpo"]()`, or
      `ptx.from_pretrained(dir, ...)` to start from a checkpoint).
    tasks: records with a "prompt" (a string, or chat messages rendered by
      the tokenizer's template) and any fields the rewards read; read in
      order and repeated.
    rewards: one reward function or several (named components).
    tokenizer: the model's tokenizer.
    out: the run directory.
    init_params: start from these parameters (`ptx.from_pretrained(dir, cfg)`'s
      params, whose cfg must be the one given here).
    resume: continue from the newest checkpoint in `out`.
    progress: show a progress bar.

  Returns:
    `fit`'s (state, summary).
  """
  fns = (rewards,) if callable(rewards) else tuple(rewards)
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, kind="rl", pack=False))  # tasks are rl records
  job = grpo_host_job(cfg, tokenizer, RewardFunctions(fns, tokenizer, (tokenizer.eos_id,), cfg.grpo.group_size))
  prompts = streams.grpo_prompts(cfg, tokenizer, _Cycle(tasks), in_graph=False)
  return fit(cfg, job, train_data=prompts, out=pathlib.Path(out), resume=resume, init_params=init_params,
             progress=progress)
