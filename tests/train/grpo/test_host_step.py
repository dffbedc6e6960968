"""GRPO's host-reward mode: on-policy it equals the fused step; stale, it runs ahead and reports its waiting."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stepping import run_steps
from tolerances import ADAM_EPS
from ptx.config import GRPOConfig, MeshConfig, OptimizerConfig
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.tokenizer import ByteTokenizer
from ptx.sandbox import run as sandbox
from ptx.envs.base import Outcome, SingleTurn, Step
from ptx.envs.exact_answer import ExactAnswerEnv
from ptx.train.grpo.prompts import PromptBatches
from ptx.sampling.rules import SamplingConfig
from ptx.sharding import make_mesh
from ptx.train.optimizer import make_optimizer
from ptx.data.lookahead import Lookahead
from ptx.episodes.scoring import EnvReward
from ptx.train.grpo.host import HostRewardStep
from ptx.train.grpo.fused import make_grpo_step
from ptx.train.grpo.update import RLSpec
from ptx.train.state import init_state, state_shardings

TOK = ByteTokenizer()
N_NEW = 6


def _even_tokens(gen, task):
  """In-graph: the fraction of generated tokens that are even."""
  live = jnp.arange(gen.tokens.shape[1])[None] < gen.lengths[:, None]
  return ((gen.tokens % 2 == 0) & live).sum(axis=1) / jnp.maximum(gen.lengths, 1)


def _even_tokens_on_host(tokens, lengths, tasks):
  """The same reward as Python on the host."""
  return np.asarray([np.mean(row[:n] % 2 == 0) if n else 0.0 for row, n in zip(tokens, lengths)], np.float32)


def _prompts(answer_width):
  return PromptBatches(ArithmeticTask(0, 2), TOK, batch_size=8, prompt_len=8, answer_width=answer_width)


def _run(cfg, grpo_cfg, steps, *, host_reward=None):
  """`steps` RL steps of the fused step (host_reward None) or the host-reward step; (state, metrics per step)."""
  mesh = make_mesh(MeshConfig(data=2, fsdp=4))
  # The host-reward and fused updates are compared: Adam's eps keeps rounding from being amplified (tolerances.py).
  optimizer = make_optimizer(OptimizerConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0, eps=ADAM_EPS), 10)
  shardings = state_shardings(cfg, optimizer, mesh, with_reference=grpo_cfg.beta > 0)
  state = init_state(cfg, optimizer, 0, mesh, with_reference=grpo_cfg.beta > 0)
  kw = dict(max_new_tokens=N_NEW, stop_ids=(TOK.eos_id,), pad_id=TOK.pad_id)
  if host_reward is None:
    data = _prompts(4)
    step = make_grpo_step(RLSpec(model=cfg, grpo=grpo_cfg, **kw), _even_tokens, optimizer=optimizer, mesh=mesh,
                          state_shardings=shardings)
  else:
    data = Lookahead(_prompts(None))
    step = HostRewardStep(spec=RLSpec(model=cfg, grpo=grpo_cfg, **kw), optimizer=optimizer, mesh=mesh,
                          state_shardings=shardings, reward=host_reward, prompts=data)
  state, history = run_steps(step, state, data, steps)
  return state, history, data, step


def test_host_mode_on_policy_equals_the_fused_step(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=2, beta=0.04, max_staleness=0)
  fused, fused_metrics, *_ = _run(cfg, grpo_cfg, 2)
  host, host_metrics, *_ = _run(cfg, grpo_cfg, 2, host_reward=_even_tokens_on_host)
  # Two programs (rewards on the host, then their own update step): float32 rounding of reordered sums at most
  # (bit-equal here); ~1e-6 relative, atol for a loss or KL that lands near 0.
  for want, got in zip(fused_metrics, host_metrics):
    for key in ("reward/mean", "loss", "actor/kl_loss", "response_length/mean"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert got["rollout/staleness"] == 0.0 and 0.0 <= got["perf/device_wait_frac"] <= 1.0
  # The parameters after 2 updates: the same rounding, not amplified by Adam (ADAM_EPS, tolerances.py).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
               host.params, fused.params)


def test_stale_host_mode_reads_ahead_and_is_importance_corrected(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", max_staleness=1,
                        sampling=SamplingConfig(temperature=0.8))
  state, history, data, _ = _run(cfg, grpo_cfg, 3, host_reward=_ReportingReward())
  assert int(state.step) == 3
  assert [m["rollout/staleness"] for m in history] == [0.0, 1.0, 1.0]  # the first batch has nothing ahead of it
  assert [m["rewards/calls"] for m in history] == [1, 1, 1]  # each step reports the batch it scored
  # The first batch was sampled by the parameters that recompute its old log-probs, both at temperature 0.8: the
  # sampler's and the trainer's programs round differently, ~1e-6 per log-prob, so the ratios are 1 to ~1e-5.
  assert history[0]["rollout/is_ratio/max"] == pytest.approx(1.0, abs=1e-4)
  assert history[0]["rollout/is_ratio/min"] == pytest.approx(1.0, abs=1e-4)
  for m in history:
    assert 0.0 <= m["perf/device_wait_frac"] <= 1.0 and m["timing_s/step"] > 0 and "actor/is_weight" in m
  # Batch 4 was sampled ahead; the stream's position is still the next batch the loop takes.
  assert data.get_state() == {"next_batch": 3}
  assert next(data)["prompts"].shape == (8, 8) and data.get_state() == {"next_batch": 4}


class _ReportingReward:
  """`_even_tokens_on_host` with host metrics, as EnvReward has: the calls since the last take."""

  def __init__(self):
    self.calls = 0

  def __call__(self, tokens, lengths, tasks):
    self.calls += 1
    return _even_tokens_on_host(tokens, lengths, tasks)

  def take_metrics(self):
    calls, self.calls = self.calls, 0
    return {"rewards/calls": calls}


@dataclasses.dataclass(frozen=True)
class _FlakyCodeEnv:
  """A sandboxed single-turn env: "1" is right, "x" loses its environment (an infrastructure error)."""

  name: str = "flaky"
  max_turns: int = 1
  sandboxed: bool = True

  def reset(self, task):
    def score(action):
      if "x" in action:
        return Step.final(Outcome.INFRA_ERROR, "the environment went away")
      return Step.final(Outcome.OK if action == "1" else Outcome.WRONG, "")
    return SingleTurn(task["prompt"], score)


def test_env_reward_counts_outcomes_and_names_the_sandbox_backend():
  reward = EnvReward(_FlakyCodeEnv(), TOK, (TOK.eos_id,), 4)
  tokens = np.asarray([TOK.encode(t) + [TOK.eos_id] for t in ("1", "x", "2", "1")])
  rewards = reward(tokens, np.asarray([1, 1, 1, 1]), [{"prompt": "p"}])
  np.testing.assert_array_equal(rewards, [1.0, np.nan, 0.0, 1.0])  # NaN: out of the group's statistics
  metrics = reward.take_metrics()
  assert metrics["rewards/infra_error_frac"] == 0.25 and metrics["rewards/outcome/ok_frac"] == 0.5
  assert metrics["rewards/outcome/wrong_frac"] == 0.25 and metrics["rewards/outcome/timeout_frac"] == 0.0
  assert metrics["rewards/sandbox"] == str(sandbox.backend())
  assert reward.take_metrics() == {}  # nothing scored since


def test_env_reward_decodes_and_scores_each_sample_against_its_prompt_task():
  reward = EnvReward(ExactAnswerEnv(), TOK, (TOK.eos_id,), 2)
  tokens = np.asarray([TOK.encode("12") + [TOK.eos_id], TOK.encode("13") + [TOK.eos_id]])
  np.testing.assert_array_equal(reward(tokens, np.asarray([3, 3]), [{"prompt": "6+6=", "answer": "12"}]), [1.0, 0.0])


def _first_sample_of_odd_prompts(tokens, lengths, tasks):
  """1 for the first sample of a prompt with an odd first operand: the other groups have zero variance."""
  odd = np.repeat([int(t["prompt"].split("+")[0]) % 2 for t in tasks], 2)
  return (odd * (np.arange(len(odd)) % 2 == 0)).astype(np.float32)


def test_host_refill_takes_further_batches_until_every_group_has_signal(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", max_staleness=1, filter_groups="refill",
                        max_refill_rounds=3)
  state, history, data, _ = _run(cfg, grpo_cfg, 2, host_reward=_first_sample_of_odd_prompts)
  for m in history:
    kept = 8 * (m["filter_groups/rounds"]) - m["filter_groups/evicted"]
    assert m["filter_groups/unfilled"] == 0.0 and kept >= 8 and m["filter_groups/rounds"] >= 2
  rounds = sum(m["filter_groups/rounds"] for m in history)
  assert data.get_state() == {"next_batch": int(rounds)}  # refill batches are consumed from the stream


def test_a_refilling_pipeline_taken_back_from_its_saved_state_continues_exactly(tiny_config):
  # What a checkpoint holds of the host pipeline (the batches sampled ahead, the stream position) is enough:
  # a fresh step object given it continues as the uninterrupted one does, refills consuming the stream included.
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", max_staleness=2, filter_groups="refill",
                        max_refill_rounds=3)
  want_state, want, *_ = _run(cfg, grpo_cfg, 4, host_reward=_first_sample_of_odd_prompts)
  state, got, data, step = _run(cfg, grpo_cfg, 2, host_reward=_first_sample_of_odd_prompts)
  saved, position = jax.tree.map(np.asarray, step.pipeline_state()), data.get_state()
  assert len(saved["index"]) == 2 and saved["batches"]["0"]["gen"]["tokens"].shape == (16, N_NEW)
  _, _, fresh_data, fresh = _run(cfg, grpo_cfg, 0, host_reward=_first_sample_of_odd_prompts)
  fresh_data.set_state(position)
  fresh.set_pipeline_state(saved)
  state, rest = run_steps(fresh, state, fresh_data, 2)
  for step_want, step_got in zip(want, got + rest):
    drop = lambda m: {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))}
    np.testing.assert_equal(drop(step_got), drop(step_want))
  assert all(m["filter_groups/rounds"] >= 2 for m in want) and want[3]["rollout/staleness"] > 0
  jax.tree.map(np.testing.assert_array_equal, state.params, want_state.params)
