"""Episodes as GRPO rollouts: rows hold the trajectories exactly, replies get no gradient, infra errors no baseline."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scripted_episodes import ENGINE, MODEL, ScriptedEnv

from ptx.algorithms import advantages as adv_lib
from ptx.algorithms import grpo
from ptx.config import GRPOConfig
from ptx.data.tokenizer import ByteTokenizer
from ptx.models import init_params
from ptx.envs.base import Outcome
from ptx.episodes.loop import play
from ptx.episodes.turn_format import TurnFormat
from ptx.sampling import LENGTH, STOP, SamplingConfig
from ptx.sampling.engine.engine import RolloutEngine
from ptx.train.grpo.episode_rows import episode_rollouts

CFG = MODEL
G = 2
TASKS = [{"prompt": "a", "turns": 2}, {"prompt": "bb", "turns": 3}, {"prompt": "ccc", "turns": 1}]


@pytest.fixture(scope="module")
def episodes():
  """G episodes per task: rewards from the last action's length (they differ within groups); task 2's tool fails."""
  params = init_params(CFG, jax.random.key(0))
  engine = RolloutEngine(CFG, ENGINE, sampling=SamplingConfig(temperature=1.0))
  env = ScriptedEnv(reward=lambda actions: float(len(actions[-1]) % 2), fail="ccc")
  trajectories = play(engine, params, env, TASKS, TurnFormat(ByteTokenizer()), samples=G, max_turn_tokens=6)
  return params, trajectories


def _rows(trajectories):
  P = max(t.prompt_len for t in trajectories)
  N = max(len(t.tokens) - t.prompt_len for t in trajectories)
  return episode_rollouts(trajectories, G, prompt_width=P + 3, width=N + 2)


def test_rows_hold_each_trajectory_and_mask_only_the_models_tokens(episodes):
  _, trajectories = episodes
  rows, gen, rewards = _rows(trajectories)
  width = rows["tokens"].shape[1]
  for r, t in enumerate(trajectories):
    real = rows["segment_ids"][r] == 1
    np.testing.assert_array_equal(rows["tokens"][r][real], t.tokens)
    np.testing.assert_array_equal(rows["loss_mask"][r][real], t.loss_mask)
    np.testing.assert_array_equal(rows["sampler_logps"][r][real], t.log_probs)
    assert rows["loss_mask"][r][~real].sum() == 0 and real[-2:].sum() == 0 and real.sum() == len(t.tokens)
    np.testing.assert_array_equal(rows["positions"][r][real], np.arange(len(t.tokens)))
    assert gen.lengths[r] == len(t.tokens) - t.prompt_len and width == rows["positions"].shape[1]
    assert gen.finish_reasons[r] == (LENGTH if t.outcome == Outcome.LIMIT else STOP)
  # Task 2's environment failed: NaN rewards, which leave the baseline (advantage exactly 0); the others keep theirs.
  assert [t.outcome for t in trajectories[4:]] == [Outcome.INFRA_ERROR] * 2
  assert np.isnan(rewards[4:]).all() and not np.isnan(rewards[:4]).any()
  adv = np.asarray(adv_lib.advantages(jnp.asarray(rewards), G, "grpo"))
  assert (adv[4:] == 0).all()
  np.testing.assert_array_equal(rewards[:4], [t.reward for t in trajectories[:4]])


@pytest.mark.parametrize("mode", grpo.AGGREGATIONS)
def test_replies_and_prompts_get_no_gradient_through_their_positions_loss(episodes, mode, monkeypatch):
  params, trajectories = episodes
  rows, gen, rewards = _rows(trajectories)
  cfg = dataclasses.replace(GRPOConfig(group_size=G, loss_agg_mode=mode, max_response_tokens=64), beta=0.0)
  rewards = np.where(np.isnan(rewards), np.nan, np.arange(len(rewards), dtype=np.float32) % 3)  # signal in groups
  batch = {k: jnp.asarray(v) for k, v in rows.items()}
  batch["loss_mask"] = batch["loss_mask"] * jnp.asarray(~np.isnan(rewards))[:, None]  # as `learn` masks them
  batch["advantages"] = adv_lib.advantages(jnp.asarray(rewards), G, "grpo")
  batch["old_logps"] = batch["sampler_logps"] - 0.01  # ratios off 1, inside the clip range
  batch.update(grpo.aggregation_inputs(batch["loss_mask"], cfg))

  # The loss reads the policy's per-token log-probs from `rollout_stats`; a probe added to them gives the
  # gradient of the loss with respect to every position's log-prob.
  real_stats = grpo.rollout_stats

  def probed(probe):
    def stats_with_probe(*a, **k):
      stats, moe_stats = real_stats(*a, **k)
      return stats._replace(log_probs=stats.log_probs + probe), moe_stats

    monkeypatch.setattr(grpo, "rollout_stats", stats_with_probe)
    value, _ = grpo.loss(params, batch, jax.random.key(0), model=CFG, grpo=cfg)
    return value

  grads = np.asarray(jax.grad(probed)(jnp.zeros(batch["tokens"].shape, jnp.float32)))
  model = np.asarray(batch["loss_mask"]) == 1
  assert (grads[~model] == 0).all()  # replies, prompts, padding and the failed episodes' tokens
  assert (np.abs(grads[model]) > 0).mean() > 0.5  # the model's tokens do get the policy gradient
  assert np.asarray(rows["loss_mask"]).sum() > model.sum()  # the infra-error rows held model tokens, now masked


def test_groups_must_be_whole_and_fit_the_widths(episodes):
  _, trajectories = episodes
  with pytest.raises(ValueError, match="not whole groups of 2"):
    episode_rollouts(trajectories[:3], G, prompt_width=64, width=256)
  with pytest.raises(ValueError, match="row 1 .* is not a sample of task 0"):
    episode_rollouts([trajectories[0], trajectories[2]], G, prompt_width=64, width=256)
  with pytest.raises(ValueError, match="the widths are 64 and 3"):
    episode_rollouts(trajectories, G, prompt_width=64, width=3)
