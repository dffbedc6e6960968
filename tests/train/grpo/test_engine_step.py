"""GRPO's host-reward mode over the rollout engine: on-policy batches, partial rollouts with versions, exact resume."""

import dataclasses

import jax
import numpy as np
import pytest

from test_host_step import N_NEW, TOK, _even_tokens_on_host, _prompts
from stepping import run_steps
from tolerances import ADAM_EPS
from ptx.config import GRPOConfig, MeshConfig, OptimizerConfig
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.rules import SamplingConfig
from ptx.sharding import make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.train.grpo.engine import EngineRewardStep
from ptx.data.lookahead import Lookahead
from ptx.train.grpo.update import RLSpec
from ptx.train.state import init_state, state_shardings

# Prompts of the arithmetic stream are at most 8 tokens (`_prompts`); decode calls of 2 tokens let updates land
# while later batches are mid-rollout.
ENGINE = EngineConfig(max_seqs=32, pages=32 * 2 + 1, page_size=8, max_seq_len=8 + N_NEW, decode_steps=2,
                      prefill_chunk=8, prefill_rows=8)
# One token in five ends a rollout, so rollouts finish at scattered decode calls and free their slots mid-step.
STOPS = tuple(range(3, 264, 5))
# Slots for 1.5 batches: batch k + 1 waits for batch k's slots, so part of it decodes after k's update.
STALE = dataclasses.replace(ENGINE, max_seqs=24)
# Pages of one position, 20 of them (one device's block, the sink apart): a group of 2 of the longest prompts takes
# 18 at its longest, so a batch's 8 groups are admitted a few at a time and those admitted last are preempted when
# the first grow (2 of them in the first step here).
ON_DEMAND = dataclasses.replace(ENGINE, page_size=1, pages=21, admission="on_demand")


class _RecordingReward:
  """`_even_tokens_on_host`, keeping every scored completion by its tokens (the reward sees whole groups)."""

  def __init__(self):
    self.calls = []
    self.completions = []

  def __call__(self, tokens, lengths, tasks):
    self.calls.append((tokens.shape[0], len(tasks)))
    self.completions += [tuple(row[:n].tolist()) for row, n in zip(np.asarray(tokens), np.asarray(lengths))]
    return _even_tokens_on_host(tokens, lengths, tasks)


def _setup(cfg, grpo_cfg, reward, engine=ENGINE):
  mesh = make_mesh(MeshConfig(data=2, fsdp=4))
  optimizer = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0, eps=ADAM_EPS), 10)
  shardings = state_shardings(cfg, optimizer, mesh, with_reference=grpo_cfg.uses_reference)
  state = init_state(cfg, optimizer, 0, mesh, with_reference=grpo_cfg.uses_reference)
  data = Lookahead(_prompts(None))
  spec = RLSpec(model=cfg, grpo=grpo_cfg, max_new_tokens=N_NEW, stop_ids=STOPS, pad_id=TOK.pad_id)
  step = EngineRewardStep(spec=spec, optimizer=optimizer, mesh=mesh, state_shardings=shardings, reward=reward,
                          prompts=data, engine=engine)
  return state, data, step


@pytest.mark.parametrize("engine", [ENGINE, ON_DEMAND], ids=["reserve", "on_demand"])
def test_on_policy_engine_rollouts_train_as_sampled(tiny_config, engine):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  reward = _RecordingReward()
  state, data, step = _setup(cfg, GRPOConfig(group_size=2, beta=0.04, max_staleness=0), reward, engine)
  state, history = run_steps(step, state, data, 2)
  assert int(state.step) == 2
  # A preempted sequence's context is prefilled again under the same parameters: its tokens and log-probs are
  # still the policy's, within the bound below.
  assert (sum(m["rollout/engine_preemptions"] for m in history) > 0) == (engine.admission == "on_demand")
  for m in history:
    assert m["rollout/staleness"] == 0.0 and m["rollout/staleness_mean"] == 0.0
    # The engine's log-probs against the update's forward over the assembled rows, both float32 at the sampling
    # parameters: a misplaced token, position or log-prob would be O(1); the two programs round ~1e-6 apart.
    assert m["rollout/logp_diff_max"] < 1e-4
    assert np.isfinite(m["loss"]) and 0.0 <= m["reward/mean"] <= 1.0
  # Groups are scored whole (2 rows per task), 8 per batch.
  assert all(rows == 2 * tasks for rows, tasks in reward.calls)
  assert sum(tasks for _, tasks in reward.calls) == 16


def test_stale_engine_rollouts_span_updates_within_the_bound(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", max_staleness=1,
                        sampling=SamplingConfig(temperature=1.5))
  state, data, step = _setup(cfg, grpo_cfg, _RecordingReward(), STALE)
  state, history = run_steps(step, state, data, 3)
  assert history[0]["rollout/staleness"] == 0.0  # batch 0 was decoded under version 0 only
  for m in history[1:]:
    assert m["rollout/staleness"] <= 1.0 and "actor/is_weight" in m and np.isfinite(m["loss"])
  # Batches 1 and 2 were mid-rollout when an update landed: some of their tokens are one version old, some new.
  assert any(0.0 < m["rollout/staleness_mean"] < 1.0 for m in history[1:])
  assert data.get_state() == {"next_batch": 3}


# On-demand admission in a pool that holds every in-flight sequence at its longest: sequences hold only the pages
# they have grown into when the pipeline is saved, and nothing waits for pages, so the resume is still exact.
@pytest.mark.parametrize("engine", [STALE, dataclasses.replace(STALE, admission="on_demand")],
                         ids=["reserve", "on_demand"])
def test_engine_pipeline_resumes_exactly(tiny_config, engine):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", max_staleness=1,
                        sampling=SamplingConfig(temperature=1.5))
  full_reward, first_reward, resumed_reward = _RecordingReward(), _RecordingReward(), _RecordingReward()
  state, data, step = _setup(cfg, grpo_cfg, full_reward, engine)
  full, full_history = run_steps(step, state, data, 3)

  state, data, step = _setup(cfg, grpo_cfg, first_reward, engine)
  state, first = run_steps(step, state, data, 1)
  saved = jax.tree.map(np.asarray, step.pipeline_state())  # as a checkpoint holds it: host arrays
  # Batch 1 is in flight: sequences mid-rollout (tokens sampled, their cache to recompute) and finished groups.
  # (Each saved array carries one padding row, for orbax.)
  assert saved["engine"]["tokens_lengths"].max() > 0 and len(saved["batches"]["0"]["done"]) > 1
  position = data.get_state()
  _, data, resumed = _setup(cfg, grpo_cfg, resumed_reward, engine)
  data.set_state(position)
  resumed.set_pipeline_state(saved)
  state, rest = run_steps(resumed, state, data, 2)
  # Every completion is sampled token for token as without the stop, and each is scored exactly once.
  assert sorted(first_reward.completions + resumed_reward.completions) == sorted(full_reward.completions)
  for want, got in zip(full_history, first + rest):
    for key in ("reward/mean", "response_length/mean", "rollout/staleness_mean"):
      assert got[key] == want[key], key
    # The resumed engine re-prefills the saved contexts in other rows and calls than the first run computed them
    # in, so its cached keys and the log-probs it records round differently (seen: 1 float32 ulp of the loss);
    # a wrong token, position or version would move the loss by orders more.
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
  # Adam at lr 1e-3 turns those ulps of gradient into at most ~1e-7 of parameter over 3 steps.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6),
               state.params, full.params)


def test_engine_rollouts_refuse_refill(tiny_config):
  grpo_cfg = GRPOConfig(group_size=2, filter_groups="refill")
  with pytest.raises(ValueError, match="refill"):
    _setup(dataclasses.replace(tiny_config, n_layers=1), grpo_cfg, _RecordingReward())
