"""`rollout.mode=fast`: one config switch; GRPO's engine samples the int8 tree while the update trains the float one,
logging the gap; evaluation samples on the mode's engine; settings without a fast path are refused, naming fields."""

import dataclasses

import jax
import numpy as np
import pytest
import qwix

from grpo_steps import MODEL, N_NEW, TOK, build, even_tokens_on_host
from ptx import config_io
from ptx.config import Config, ConfigError, EvalConfig, GRPOConfig, OptimizerConfig, RolloutConfig
from ptx.models.params import init_params
from ptx.envs.calculator import CalculatorEnv
from ptx.sampling.engine.config import EngineConfig
from ptx.sampling.engine.mode import RolloutMode
from ptx.sampling.rules import SamplingConfig
from ptx.sampling.engine.speculative import SpeculativeConfig, SpeculativeEngine
from ptx.train import checkpoint_evals, job, presets
from ptx.train.grpo.engine import EngineGRPOStep

# Prompts of the arithmetic stream are at most 8 tokens; groups of 2, 8 prompts a batch, one batch in flight.
ENGINE = EngineConfig(max_seqs=16, pages=16 * 2 + 1, page_size=8, max_seq_len=8 + N_NEW, decode_steps=2,
                      prefill_chunk=8, prefill_rows=8)
# verify_cost 1: drafting always pays, so the verify program runs whenever the n-gram drafter has a guess.
FAST = RolloutConfig(mode="fast", verify_cost=1.0)


def _fast_grpo_config(**changes) -> Config:
  cfg = dataclasses.replace(presets.TOY["grpo"](), rollout=RolloutConfig(mode="fast"))
  return dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, rollouts="engine"), **changes)


def test_the_switch_parses_and_builds_the_fast_engine_step():
  cfg = config_io.apply_overrides(presets.TOY["grpo"](), ["--rollout.mode=fast", "--grpo.rollouts=engine",
                                                          "--rollout.drafts=3", "--rollout.rounds=2"])
  built = job.grpo_host_job(cfg, TOK, even_tokens_on_host)
  assert isinstance(built.step, EngineGRPOStep) and "rollout" in built.sections
  assert built.step.mode == RolloutMode.of(cfg.rollout)
  assert built.step.mode.int8 and built.step.mode.speculative.drafts == 3 and not built.step.mode.exact
  assert built.step.mode.speculative.rounds == 2
  assert RolloutMode.of(RolloutConfig()).standard and RolloutMode.of(RolloutConfig()).exact
  with pytest.raises(ConfigError, match="rollout.mode"):
    config_io.apply_overrides(Config(), ["--rollout.mode=turbo"])
  with pytest.raises(ValueError, match="rollout.drafts"):
    RolloutConfig(drafts=0)
  with pytest.raises(ValueError, match=r"rollout.rounds \(0\)"):
    RolloutConfig(rounds=0)


@pytest.mark.parametrize("builder, changes, names", [
    # The fused in-graph mode samples with `generate`; so do static host rollouts.
    (lambda cfg: job.grpo_job(cfg, TOK), {"rollouts": "static"}, "grpo.rollouts=engine"),
    (lambda cfg: job.grpo_host_job(cfg, TOK, even_tokens_on_host), {"rollouts": "static"}, "grpo.rollouts=engine"),
    (lambda cfg: job.grpo_host_job(dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=4)), TOK,
                                   even_tokens_on_host), {}, "lora.rank"),
    (lambda cfg: job.grpo_episode_job(dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, max_staleness=0)),
                                      TOK, CalculatorEnv()), {}, "rollout.mode=standard"),
])
def test_settings_without_a_fast_path_are_refused_naming_the_fields(builder, changes, names):
  cfg = _fast_grpo_config()
  cfg = dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, **changes))
  with pytest.raises(ConfigError, match=names):
    builder(cfg)


def test_fast_grpo_samples_the_int8_tree_and_trains_the_float_one(monkeypatch):
  sampled_from = []
  original = SpeculativeEngine.step

  def recording(self, params, **kwargs):
    sampled_from.append(params)
    return original(self, params, **kwargs)

  monkeypatch.setattr(SpeculativeEngine, "step", recording)
  grpo_cfg = GRPOConfig(group_size=2, beta=0.0, kl_placement="none", max_staleness=0,
                        sampling=SamplingConfig(temperature=0.7))
  # Adam's default eps: nothing here is compared with another program's parameters.
  built = build(MODEL, grpo_cfg, even_tokens_on_host, kind="engine", eps=OptimizerConfig().eps, engine=ENGINE,
                mode=RolloutMode.of(FAST))
  initial = jax.tree.map(np.asarray, built.state.params)
  state, history = built.run(2)

  # The engine got the int8 tree (projections as QArrays, placed like their weights); the state keeps float arrays,
  # and the update moved them.
  tree = sampled_from[-1]
  assert isinstance(tree["layers"]["q"], qwix.QArray) and tree["layers"]["q"].qvalue.dtype == np.int8
  assert tree["layers"]["q"].qvalue.sharding.spec == state.params["layers"]["q"].sharding.spec
  assert all(leaf.dtype == np.float32 for leaf in jax.tree.leaves(state.params))
  assert not np.allclose(np.asarray(state.params["layers"]["q"]), initial["layers"]["q"])
  for m in history:
    # The policy's recomputed log-probs against the int8 sampler's: a real gap, small for int8 weights (the int8
    # test of tests/models measured under 0.05 nats), finite, with the truncated importance weight in the loss.
    assert 0.0 < m["rollout/logp_gap_abs"] < 0.5 and np.isfinite(m["rollout/logp_mismatch_kl"])
    assert 0.0 < m["rollout/is_ratio/min"] <= m["rollout/is_ratio/max"] and "actor/is_weight" in m
    # The speculative engine's counts (a random tiny model rarely repeats its prompt, so drafts may be few or none;
    # tests/sampling/test_speculative.py checks them exactly).
    assert np.isfinite(m["loss"]) and m["rollout/drafted"] >= 0 and 0.0 <= m["rollout/draft_acceptance"] <= 1.0


def _evals(sampling, **changes):
  section = EvalConfig(suites=("arithmetic",), n=6, k=2, max_new_tokens=presets.ANSWER_WIDTH, sampling=sampling)
  return dataclasses.replace(checkpoint_evals.build(section, TOK), **changes)


def _completions(report):
  return [(s["task"], s["sample"], s["completion"]) for s in report["samples"]]


def _count_verifies(monkeypatch) -> list:
  """Appends to the list it returns at each verify call of a speculative engine."""
  verifies = []
  original = SpeculativeEngine._verify
  monkeypatch.setattr(SpeculativeEngine, "_verify", lambda self, *a: verifies.append(1) or original(self, *a))
  return verifies


def test_greedy_eval_on_the_speculative_engine_equals_standard_and_fast_mode_evaluates(tiny_config):
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  params = init_params(cfg, jax.random.key(3))
  greedy = SamplingConfig(greedy=True)
  standard = _evals(greedy).evaluate(params, cfg)["arithmetic"]
  # The n-gram drafter over the float tree: the engine's greedy tokens are generate's, drafted or not.
  drafting = RolloutMode(speculative=SpeculativeConfig(verify_cost=1.0))
  speculative = _evals(greedy, mode=drafting).evaluate(params, cfg)["arithmetic"]
  # (No "=" precedes an arithmetic prompt's last token, so nothing is drafted at the first call, whose decode_steps
  # then finish every answer: the multi-turn test below runs the verify path.)
  assert _completions(speculative) == _completions(standard)
  # --rollout.mode=fast as `ptx eval` and checkpoint evaluations build it: int8 weights, n-gram drafts.
  fast_evals = checkpoint_evals.build(_evals(greedy).source, TOK, FAST)
  assert fast_evals.mode.int8
  fast = fast_evals.evaluate(params, cfg)["arithmetic"]
  assert len(fast["samples"]) == 12 and 0.0 <= fast["pass@k"]["1"] <= 1.0


def test_multi_turn_greedy_eval_on_the_speculative_engine_equals_standard(tiny_config, monkeypatch):
  """Episodes `extend` their sequences between turns; drafting over the float tree keeps every greedy token."""
  verifies = _count_verifies(monkeypatch)
  cfg = dataclasses.replace(tiny_config, n_layers=1)
  params = init_params(cfg, jax.random.key(5))
  section = EvalConfig(suites=("calculator",), n=2, k=1, max_new_tokens=6, sampling=SamplingConfig(greedy=True))
  standard = checkpoint_evals.build(section, TOK).evaluate(params, cfg)["calculator"]
  drafting = RolloutMode(speculative=SpeculativeConfig(verify_cost=1.0))
  speculative = dataclasses.replace(checkpoint_evals.build(section, TOK), mode=drafting).evaluate(params, cfg)
  assert _completions(speculative["calculator"]) == _completions(standard) and verifies  # the verify path ran


def test_int8_pages_are_a_switch_of_either_mode_and_make_the_sampler_inexact(tiny_config):
  for mode in ("standard", "fast"):
    built = RolloutMode.of(RolloutConfig(mode=mode, kv_dtype="int8"))
    assert built.kv_int8 and not built.exact and not built.standard
    assert built.engine(tiny_config, ENGINE).config.kv_dtype == "int8"
  assert RolloutMode.of(RolloutConfig()).engine(tiny_config, ENGINE).config.kv_dtype == "auto"
  cfg = config_io.apply_overrides(presets.TOY["grpo"](), ["--rollout.kv_dtype=int8"])
  with pytest.raises(ConfigError, match="rollout.kv_dtype=int8 stores the rollout engine's pages"):
    job.grpo_job(cfg, TOK)
  with pytest.raises(ValueError, match="rollout.kv_dtype must be auto or int8"):
    RolloutConfig(kv_dtype="fp8")
