"""GRPO's host-reward mode over the rollout engine: on-policy batches, partial rollouts with versions, exact resume."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_steps import MODEL, N_NEW, build, even_tokens_on_host
from stepping import run_steps
from ptx.config import GRPOConfig
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.rules import SamplingConfig

# Prompts of the arithmetic stream are at most 8 tokens (`grpo_steps.prompt_batches`); decode calls of 2 tokens let
# updates land while later batches are mid-rollout.
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
# On-demand admission in a pool that holds every in-flight sequence at its longest: sequences hold only the pages
# they have grown into when the pipeline is saved, and nothing waits for pages, so the resume is still exact.
STALE_ENGINES = {"reserve": STALE, "on_demand": dataclasses.replace(STALE, admission="on_demand")}
STALE_GRPO = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", max_staleness=1,
                        sampling=SamplingConfig(temperature=1.5))


class _RecordingReward:
  """`even_tokens_on_host`, keeping every scored completion by its tokens (the reward sees whole groups)."""

  def __init__(self):
    self.calls = []
    self.completions = []

  def __call__(self, tokens, lengths, tasks):
    self.calls.append((tokens.shape[0], len(tasks)))
    self.completions += [tuple(row[:n].tolist()) for row, n in zip(np.asarray(tokens), np.asarray(lengths))]
    return even_tokens_on_host(tokens, lengths, tasks)


def _build(grpo_cfg, reward, engine):
  """The engine step of `grpo_cfg` over a fresh state, rollouts ending at STOPS."""
  return build(MODEL, grpo_cfg, reward, kind="engine", engine=engine, stop_ids=STOPS)


@pytest.mark.parametrize("engine", [ENGINE, ON_DEMAND], ids=["reserve", "on_demand"])
def test_on_policy_engine_rollouts_train_as_sampled(engine):
  reward = _RecordingReward()
  state, history = _build(GRPOConfig(group_size=2, beta=0.04, max_staleness=0), reward, engine).run(2)
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


@pytest.fixture(scope="module")
def stale_runs():
  """`stale_runs(name)`: 3 steps of STALE_GRPO on STALE_ENGINES[name], made once per module.

  Returns (the run, its reward, its metrics per step, what a checkpoint after step 1 holds: the state, the
  pipeline as host arrays, the stream position, and how many completions had been scored by then).
  """
  runs = {}

  def run(name):
    if name not in runs:
      reward = _RecordingReward()
      built = _build(STALE_GRPO, reward, STALE_ENGINES[name])
      state, first = built.run(1)
      # The pipeline waits for every group in flight to be scored: the completions scored so far are the run's first.
      pipeline = jax.tree.map(np.asarray, built.step.pipeline_state())
      saved = {"state": jax.tree.map(jnp.copy, state), "pipeline": pipeline, "position": built.data.get_state(),
               "scored": len(reward.completions)}
      _, rest = built.run(2)
      runs[name] = built, reward, first + rest, saved
    return runs[name]

  return run


def test_stale_engine_rollouts_span_updates_within_the_bound(stale_runs):
  built, _, history, _ = stale_runs("reserve")
  assert history[0]["rollout/staleness"] == 0.0  # batch 0 was decoded under version 0 only
  for m in history[1:]:
    assert m["rollout/staleness"] <= 1.0 and "actor/is_weight" in m and np.isfinite(m["loss"])
  # Batches 1 and 2 were mid-rollout when an update landed: some of their tokens are one version old, some new.
  assert any(0.0 < m["rollout/staleness_mean"] < 1.0 for m in history[1:])
  assert built.data.get_state() == {"next_batch": 3}


@pytest.mark.parametrize("engine", sorted(STALE_ENGINES))
def test_engine_pipeline_resumes_exactly(stale_runs, engine):
  full, full_reward, full_history, saved = stale_runs(engine)
  # Batch 1 is in flight: sequences mid-rollout (tokens sampled, their cache to recompute) and finished groups.
  # (Each saved array carries one padding row, for orbax.)
  pipeline = saved["pipeline"]
  assert pipeline["engine"]["tokens_lengths"].max() > 0 and len(pipeline["batches"]["0"]["done"]) > 1
  resumed_reward = _RecordingReward()
  resumed = _build(STALE_GRPO, resumed_reward, STALE_ENGINES[engine])
  resumed.data.set_state(saved["position"])
  resumed.step.set_pipeline_state(pipeline)
  state, rest = run_steps(resumed.step, saved["state"], resumed.data, 2)
  # Every completion is sampled token for token as without the stop, and each is scored exactly once.
  scored_first = full_reward.completions[:saved["scored"]]
  assert sorted(scored_first + resumed_reward.completions) == sorted(full_reward.completions)
  for want, got in zip(full_history[1:], rest):
    for key in ("reward/mean", "response_length/mean", "rollout/staleness_mean"):
      assert got[key] == want[key], key
    # The resumed engine re-prefills the saved contexts in other rows and calls than the first run computed them
    # in, so its cached keys and the log-probs it records round differently (seen: 1 float32 ulp of the loss);
    # a wrong token, position or version would move the loss by orders more.
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
  # Adam at lr 1e-3 turns those ulps of gradient into at most ~1e-7 of parameter over 3 steps.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6),
               state.params, full.state.params)


def test_engine_rollouts_refuse_refill():
  grpo_cfg = GRPOConfig(group_size=2, filter_groups="refill")
  with pytest.raises(ValueError, match="refill"):
    _build(grpo_cfg, _RecordingReward(), ENGINE)
