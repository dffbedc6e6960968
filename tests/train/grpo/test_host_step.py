"""GRPO's host-reward mode: on-policy it equals the fused step; stale, it runs ahead and reports its waiting."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_steps import MODEL, N_NEW, TOK, build, even_tokens, even_tokens_on_host, prompt_batches
from stepping import run_steps
from ptx.config import GRPOConfig
from ptx.sandbox import run as sandbox
from ptx.envs.base import Outcome, SingleTurn, Step
from ptx.envs.exact_answer import ExactAnswerEnv
from ptx.sampling.rules import SamplingConfig
from ptx.episodes.scoring import EnvReward

# Every host run's rollouts here: the temperature the stale run checks its importance ratios at, one sampling program
# for the file.
SAMPLING = SamplingConfig(temperature=0.8)


class _Ids:
  """Decodes token ids as their numbers ("5 17 2"), so a transcript gives back exactly the tokens sampled."""

  def decode(self, ids):
    return " ".join(map(str, ids))


def _ids(text):
  return [int(i) for i in text.split()]


def test_host_mode_on_policy_equals_the_fused_step():
  # Both keep transcripts of each step (`ptx.train.grpo.samples`): 6 rows, three groups of 2.
  grpo_cfg = GRPOConfig(group_size=2, beta=0.04, max_staleness=0, sampling=SAMPLING, samples_every=1, samples_rows=6)
  built = build(MODEL, grpo_cfg, even_tokens, tokenizer=_Ids())
  fused, fused_metrics = built.run(2)
  on_host = build(MODEL, grpo_cfg, even_tokens_on_host, kind="host", tokenizer=_Ids())
  host, host_metrics = on_host.run(2)
  _check_transcripts(built.step.take_samples(wait=True), on_host.step.take_samples(wait=True))
  # On-policy nothing is sampled ahead: a checkpoint holds no pipeline (`fit` saves what this returns).
  assert on_host.step.pipeline_state() is None
  # Two programs (rewards on the host, then their own update step): float32 rounding of reordered sums at most
  # (bit-equal here); ~1e-6 relative, atol for a loss or KL that lands near 0.
  for want, got in zip(fused_metrics, host_metrics):
    for key in ("reward/mean", "loss", "actor/kl_loss", "response_length/mean"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert got["rollout/staleness"] == 0.0 and 0.0 <= got["perf/device_wait_frac"] <= 1.0
  # The parameters after 2 updates: the same rounding, not amplified by Adam (ADAM_EPS, tolerances.py).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6),
               host.params, fused.params)


def _check_transcripts(fused, host):
  """The fused and host steps' transcripts of steps 1 and 2: the batches' prompts, the same completions, each with the
  reward its tokens earn."""
  assert sorted(fused) == sorted(host) == [1, 2]
  batches = prompt_batches(4)
  for step in (1, 2):
    batch = next(batches)
    want = [json.loads(line) for line in fused[step].decode().splitlines()]
    got = [json.loads(line) for line in host[step].decode().splitlines()]
    assert len(want) == len(got) == 6
    for r, (a, b) in enumerate(zip(want, got)):
      prompt = batch["prompts"][r // 2][-batch["prompt_lengths"][r // 2]:].tolist()
      assert a["step"] == step and a["row"] == r and a["group"] == r // 2 and _ids(a["prompt"]) == prompt
      assert {k: v for k, v in a.items() if k != "reward"} == {k: v for k, v in b.items() if k != "reward"}
      tokens = _ids(a["completion"])
      assert len(tokens) == a["completion_tokens"] <= N_NEW and a["finish_reason"] in ("stop", "length")
      # The reward in float32, in-graph or on the host, of these very tokens.
      expected = even_tokens_on_host(np.asarray([tokens + [0] * (N_NEW - len(tokens))]), [len(tokens)], None)[0]
      assert a["reward"] == pytest.approx(expected, abs=1e-6) and b["reward"] == pytest.approx(expected, abs=1e-6)
    assert any(0 < record["reward"] < 1 for record in want)  # rewards that tell rows apart


def test_stale_host_mode_reads_ahead_and_is_importance_corrected():
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", max_staleness=1, sampling=SAMPLING)
  built = build(MODEL, grpo_cfg, _ReportingReward(), kind="host")
  state, history = built.run(3)
  data = built.data
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
  """`even_tokens_on_host` with host metrics, as EnvReward has: the calls since the last take."""

  def __init__(self):
    self.calls = 0

  def __call__(self, tokens, lengths, tasks):
    self.calls += 1
    return even_tokens_on_host(tokens, lengths, tasks)

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
  """Components where only prompts with an odd first operand give a group with signal: 1 for their first sample."""
  odd = np.repeat([int(t["prompt"].split("+")[0]) % 2 for t in tasks], 2)
  return {"hit": (odd * (np.arange(len(odd)) % 2 == 0)).astype(np.float32), "zero": np.zeros(len(odd), np.float32)}


REFILL = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", max_staleness=2, filter_groups="refill",
                    max_refill_rounds=3, sampling=SAMPLING)


@pytest.fixture(scope="module")
def refilling():
  """4 refilling steps with 2 batches sampled ahead; what a checkpoint after step 2 holds of the run.

  Returns (the run, its metrics per step, {"state", "pipeline", "position"} after step 2).
  """
  built = build(MODEL, REFILL, _first_sample_of_odd_prompts, kind="host")
  state, history = built.run(2)
  saved = {"state": jax.tree.map(jnp.copy, state), "pipeline": jax.tree.map(np.asarray, built.step.pipeline_state()),
           "position": built.data.get_state()}
  _, rest = built.run(2)
  return built, history + rest, saved


def test_host_refill_takes_further_batches_until_every_group_has_signal(refilling):
  built, history, _ = refilling
  for m in history:
    kept = 8 * (m["filter_groups/rounds"]) - m["filter_groups/evicted"]
    assert m["filter_groups/unfilled"] == 0.0 and kept >= 8 and m["filter_groups/rounds"] >= 2
    # Reward components through the refill: every kept group scores 1, 0, a mean of halves, exact in float32.
    assert m["reward/hit/mean"] == pytest.approx(0.5) and m["reward/zero/mean"] == 0.0
  rounds = sum(m["filter_groups/rounds"] for m in history)
  assert built.data.get_state() == {"next_batch": int(rounds)}  # refill batches are consumed from the stream


def test_a_refilling_pipeline_taken_back_from_its_saved_state_continues_exactly(refilling):
  # What a checkpoint holds of the host pipeline (the batches sampled ahead, the stream position) is enough:
  # a fresh step object given it continues as the uninterrupted one does, refills consuming the stream included.
  uninterrupted, want, saved = refilling
  pipeline = saved["pipeline"]
  assert len(pipeline["index"]) == 2 and pipeline["batches"]["0"]["gen"]["tokens"].shape == (16, N_NEW)
  fresh = build(MODEL, REFILL, _first_sample_of_odd_prompts, kind="host")
  fresh.data.set_state(saved["position"])
  fresh.step.set_pipeline_state(pipeline)
  state, rest = run_steps(fresh.step, saved["state"], fresh.data, 2)
  for step_want, step_got in zip(want[2:], rest):
    drop = lambda m: {k: v for k, v in m.items() if not k.startswith(("timing_s/", "perf/"))}
    np.testing.assert_equal(drop(step_got), drop(step_want))
  assert all(m["filter_groups/rounds"] >= 2 for m in want) and want[3]["rollout/staleness"] > 0
  jax.tree.map(np.testing.assert_array_equal, state.params, uninterrupted.state.params)
