"""Multi-turn episodes as GRPO rollouts: the learner's rows, Generation and rewards from `Trajectory`s.

A group is the G episodes of one task (`ptx.episodes.loop.play(...,
samples=G)`); row b * G + g is sample g of task b, as for single-turn
rollouts, so `ptx.train.grpo.update.learn` trains on them unchanged: every loss
aggregation mode, surrogate and KL placement. The row is the first prompt
(left-padded to the prompt width) followed by everything the episode added,
the model's turns and the environment's replies in order; the loss mask is 1
on the model's sampled tokens only, so a reply's tokens are context for the
turns after it and never a target. Sampler log-probs are the turns' own.
Trajectories that recorded their routes (`Trajectory.routes`, routing
replay) give the rows `routes` [R, P + N, L, k]: every token's experts, the
replies' included (their prefill's: the cache the next turn read was built with
them), `moe.NO_ROUTE` on padding and on an episode's last token.

An episode whose environment failed (outcome INFRA_ERROR) gets a NaN reward:
it leaves its group's mean and spread and the loss (`learn` masks NaN rows),
never scored 0. One that filled its context finishes as LENGTH (for
`grpo.mask_truncated`); every other as STOP.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ptx.envs.base import Outcome
from ptx.episodes.loop import Trajectory
from ptx.models import moe
from ptx.sampling.generation import LENGTH, STOP, Generation
from ptx.train.grpo.update import rollout_batch


def episode_rollouts(trajectories: Sequence[Trajectory], group_size: int, *, prompt_width: int, width: int,
                     pad_id: int = 0) -> tuple[dict[str, np.ndarray], Generation, np.ndarray]:
  """The training rows [R, prompt_width + width], their Generation and rewards [R] of G episodes per task.

  Args:
    trajectories: in task, then sample order (as `play` returns them), G per task.
    group_size: G.
    prompt_width: columns of the left-padded first prompt (P).
    width: columns after it (N): the longest episode's model and reply tokens.
    pad_id: the token of padding columns.

  Returns:
    (rows as `rollout_batch` lays them out, with the loss mask on the model's
    tokens only, and `routes` when the trajectories recorded them; Generation
    of the N columns; rewards, NaN for infrastructure errors).

  Raises:
    ValueError: when the trajectories are not whole groups of one task each,
      or an episode does not fit the widths.
  """
  if not trajectories or len(trajectories) % group_size:
    raise ValueError(f"episode_rollouts: {len(trajectories)} trajectories are not whole groups of {group_size}")
  B, R = len(trajectories) // group_size, len(trajectories)
  prompts, prompt_lengths = np.full((B, prompt_width), pad_id, np.int32), np.zeros((B,), np.int32)
  tokens, log_probs = np.full((R, width), pad_id, np.int32), np.zeros((R, width), np.float32)
  mask, lengths, finish = np.zeros((R, width), np.int32), np.zeros((R,), np.int32), np.zeros((R,), np.int32)
  rewards = np.zeros((R,), np.float32)
  recorded = trajectories[0].routes
  routes = (None if recorded is None else
            np.full((R, prompt_width + width) + recorded.shape[1:], moe.NO_ROUTE, recorded.dtype))
  for r, t in enumerate(trajectories):
    b, prompt = r // group_size, t.tokens[:t.prompt_len]
    first = trajectories[b * group_size]
    if t.task != first.task or not np.array_equal(prompt, first.tokens[:first.prompt_len]):
      raise ValueError(f"episode_rollouts: row {r} (task {t.task}) is not a sample of task {first.task}: a group "
                       "is the G episodes of one task, in sample order")
    n = len(t.tokens) - t.prompt_len
    if t.prompt_len > prompt_width or n > width:
      raise ValueError(f"episode_rollouts: task {t.task} sample {t.sample} has a prompt of {t.prompt_len} and "
                       f"{n} tokens after it; the widths are {prompt_width} and {width}")
    prompts[b, prompt_width - t.prompt_len:], prompt_lengths[b] = prompt, t.prompt_len
    tokens[r, :n], log_probs[r, :n] = t.tokens[t.prompt_len:], t.log_probs[t.prompt_len:]
    mask[r, :n], lengths[r] = t.loss_mask[t.prompt_len:], n
    finish[r] = LENGTH if t.outcome == Outcome.LIMIT else STOP
    rewards[r] = np.nan if t.infra_error else t.reward
    if routes is not None:
      routes[r, prompt_width - t.prompt_len:prompt_width + n] = t.routes
  gen = Generation(tokens=tokens, lengths=lengths, finish_reasons=finish, log_probs=log_probs, routes=routes)
  rows = {k: np.asarray(v) for k, v in rollout_batch(prompts, prompt_lengths, gen, group_size).items()}
  gen = dataclasses.replace(gen, routes=None)  # the rows hold them
  rows["loss_mask"] = rows["loss_mask"] * np.concatenate([np.zeros((R, prompt_width), np.int32), mask], axis=1)
  return rows, gen, rewards
