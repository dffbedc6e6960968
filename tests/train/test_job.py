"""The Job: built once per algorithm, checked before compiling, and run by `fit` update for update as scheduled."""

import dataclasses
import json
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ptx import config_io
from ptx import config_rules
from ptx import sharding
from ptx.config import (Config, ConfigError, DataConfig, DPOConfig, GRPOConfig, LoRAConfig, MeshConfig, OptimizerConfig,
                        RolloutConfig, TrainConfig)
from ptx.model_config import ModelConfig
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.tokenizer import ByteTokenizer
from ptx.train import streams
from ptx.train.job import dpo_job, grpo_host_job, grpo_job, sft_job
from ptx.train.loop import fit
from ptx.envs.exact_answer import ExactAnswerEnv
from ptx.sampling.engine.config import EngineConfig
from ptx.train.grpo.engine import EngineGRPOStep
from ptx.episodes.scoring import EnvReward

TOK = ByteTokenizer()


def _even_tokens(gen, task):
  """In-graph: the fraction of generated tokens that are even (varies within a group: the gradient is not 0)."""
  live = jnp.arange(gen.tokens.shape[1])[None] < gen.lengths[:, None]
  return ((gen.tokens % 2 == 0) & live).sum(axis=1) / jnp.maximum(gen.lengths, 1)


class _Moves(NamedTuple):
  """The largest |parameter change| of each optimizer update, by update index."""

  count: jax.Array
  largest: jax.Array


def _recording_stage(updates: int) -> optax.GradientTransformation:
  """An optax stage that changes nothing and records each update's largest entry."""

  def update(u, state, params=None):
    largest = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in jax.tree.leaves(u)]))
    return u, _Moves(state.count + 1, state.largest.at[state.count].set(largest))

  return optax.GradientTransformation(lambda params: _Moves(jnp.int32(0), jnp.zeros(updates)), update)


@dataclasses.dataclass(frozen=True)
class _Recorded:
  """A step kind that runs `inner` with the recording stage after its optimizer."""

  inner: Any
  updates: int

  lora = property(lambda self: self.inner.lora)

  def optimizer_stage(self):
    return _recording_stage(self.updates)

  def stream(self, data):
    return self.inner.stream(data)

  def build(self, *args):
    return self.inner.build(*args)

  def evaluator(self, *args):
    return self.inner.evaluator(*args)


def _grpo_cfg(**grpo) -> Config:
  model = ModelConfig(vocab_size=264, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32, mlp_dim=96)
  return Config(model=model,
                mesh=MeshConfig(data=2, fsdp=4),
                optim=OptimizerConfig(lr=1e-2, warmup_steps=0, min_lr_ratio=0.0, b1=0.0, b2=0.0, clip_norm=0.0),
                train=TrainConfig(steps=2, log_every=1, checkpoint_every=100),
                data=DataConfig(kind="rl", batch_size=8, seq_len=8, pack=False),
                grpo=GRPOConfig(group_size=2, kl_placement="none", beta=0.0, max_response_tokens=4, **grpo))


# Parameter rules beside the default (which shards embed over fsdp): mlp over fsdp, embed replicated.
PARAM_RULES = '--mesh.param_rules=["mlp=fsdp", "embed="]'


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
  """(Job, final state, run directory) of 2 GRPO steps of 2 epochs x 2 mini-batches, each optimizer update's largest
  move recorded, the parameters laid out by PARAM_RULES."""
  cfg = config_io.apply_overrides(_grpo_cfg(epochs=2, minibatches=2), [PARAM_RULES])
  job = grpo_job(cfg, TOK, _even_tokens)
  recorded = dataclasses.replace(job, step=_Recorded(job.step, job.total_updates))
  prompts = streams.grpo_prompts(cfg, TOK, ArithmeticTask(0, 2), in_graph=True)
  out = tmp_path_factory.mktemp("ppo")
  state, _ = fit(cfg, recorded, train_data=prompts, out=out, progress=False)
  return job, state, out


def test_ppo_epochs_move_every_update_at_the_scheduled_learning_rate(ppo_run):
  # 2 epochs x 2 mini-batches: 4 optimizer updates a step, 8 in the run, one cosine over all 8.
  job, state, out = ppo_run
  assert job.updates_per_step == 4 and job.total_updates == 8
  moves = np.asarray(optax.tree_utils.tree_get(state.opt_state, "largest"))
  want = np.asarray([job.learning_rate(i) for i in range(8)])
  # Adam with b1 = b2 = 0 moves each weight by lr * g / (|g| + eps): the largest move is lr up to eps / |g| ~ 1e-6
  # relative. With the schedule cut at 2 updates (the bug this guards) updates 3-8 would move by 0.
  # The schedule is float32 arithmetic: 1e-5 relative against the float64 cosine.
  assert (want > 0).all() and want[-1] == pytest.approx(1e-2 * 0.5 * (1 + np.cos(7 * np.pi / 8)), rel=1e-5)
  np.testing.assert_allclose(moves, want, rtol=1e-4)
  logged = [json.loads(line)["lr"] for line in (out / "metrics.jsonl").read_text().splitlines()]
  # A step logs the lr of its first update: the same float32 schedule, so rounding only (approx's rel 1e-6).
  assert logged == pytest.approx([want[0], want[4]])


def test_jobs_compare_by_value_and_decide_the_reference_once():
  cfg = _grpo_cfg()
  assert grpo_job(cfg, TOK) == grpo_job(cfg, ByteTokenizer())
  assert grpo_job(cfg, TOK) != grpo_job(cfg, TOK, _even_tokens)
  for placement, beta, reference in (("none", 0.04, False), ("loss", 0.0, False), ("loss", 0.04, True),
                                     ("reward", 0.04, True)):
    grpo = dataclasses.replace(cfg.grpo, kl_placement=placement, beta=beta)
    assert grpo_job(dataclasses.replace(cfg, grpo=grpo), TOK).with_reference is reference
  host = grpo_host_job(cfg, TOK, EnvReward(ExactAnswerEnv(), TOK, (TOK.eos_id,), 2))
  assert host.algorithm == "grpo_host" and host == grpo_host_job(cfg, TOK, EnvReward(ExactAnswerEnv(), TOK,
                                                                                     (TOK.eos_id,), 2))
  sft_cfg = dataclasses.replace(cfg, data=DataConfig(batch_size=8, seq_len=16))
  assert sft_job(sft_cfg, TOK) == sft_job(sft_cfg, TOK) and not sft_job(sft_cfg, TOK).with_reference
  dpo_data = DataConfig(kind="preference", batch_size=8, seq_len=16, pack=False)
  for dpo, reference in ((DPOConfig(), True), (DPOConfig(reference="precomputed"), False),
                         (DPOConfig(loss_type="simpo"), False)):
    job = dpo_job(dataclasses.replace(cfg, data=dpo_data, dpo=dpo), TOK)
    assert job.with_reference is reference and (job.step.prepare is not None) is reference
  assert "grpo" in host.sections and "dpo" not in host.sections and "grpo" not in sft_job(sft_cfg, TOK).sections


def test_engine_rollouts_hold_the_batch_and_those_ahead_at_their_worst_case():
  cfg = dataclasses.replace(_grpo_cfg(rollouts="engine", max_staleness=1),
                            rollout=RolloutConfig(page_size=4, decode_steps=3))
  step = grpo_host_job(cfg, TOK, EnvReward(ExactAnswerEnv(), TOK, (TOK.eos_id,), 2)).step
  assert isinstance(step, EngineGRPOStep) and not isinstance(grpo_host_job(_grpo_cfg(), TOK, step.reward).step,
                                                             EngineGRPOStep)
  # 8 prompts x 2 samples x (1 + 1 batch ahead) slots; each holds 8 prompt columns + 4 new tokens in 3 pages of 4.
  assert step.engine == EngineConfig(max_seqs=32, pages=32 * 3 + 1, page_size=4, max_seq_len=12, decode_steps=3,
                                     prefill_rows=8)
  on_demand = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, pages=41, admission="on_demand"))
  assert grpo_host_job(on_demand, TOK, step.reward).step.engine == dataclasses.replace(step.engine, pages=41,
                                                                                       admission="on_demand")
  with pytest.raises(ConfigError, match="grpo.rollouts='engine' needs host rewards"):
    grpo_job(cfg, TOK)
  with pytest.raises(ValueError, match="rollout.page_size and rollout.decode_steps >= 1; got 0, 0 and 16"):
    RolloutConfig(page_size=0)


@pytest.mark.parametrize("change, message", [
    (dict(data=DataConfig(kind="sft", batch_size=8, seq_len=8)), "data.kind='sft', but grpo reads 'rl' records"),
    (dict(grpo=GRPOConfig(minibatches=3)), "grpo.minibatches=3 must divide data.batch_size=8"),
    (dict(train=TrainConfig(grad_accum=3)), "train.grad_accum=3 must divide the 16 rollouts"),
    (dict(grpo=GRPOConfig(kl_target=0.1, kl_placement="loss")),
     r"grpo.kl_target \(adaptive KL\) needs grpo.kl_placement='reward'"),
    (dict(grpo=GRPOConfig(ref_sync_every=5), lora=LoRAConfig(rank=4)),
     "grpo.ref_sync_every: under LoRA"),
    (dict(model=ModelConfig(vocab_size=100)), "tokenizer vocab 259 > model vocab_size 100"),
    (dict(grpo=GRPOConfig(rollouts="engine", filter_groups="refill")), 'filter_groups="refill" samples further'),
])
def test_cross_field_rules_fail_before_compiling_naming_the_fields(change, message):
  cfg = dataclasses.replace(_grpo_cfg(), **change)
  with pytest.raises(ConfigError, match=message):
    grpo_job(cfg, TOK)


def test_an_attention_kernel_named_outright_must_run_on_the_backend():
  cfg = _grpo_cfg()
  pallas = dataclasses.replace(cfg.model, attention_impl="pallas")
  with pytest.raises(ConfigError, match="model.attention_impl='pallas' runs the GPU or TPU Pallas kernel, and this "
                                        "backend is 'cpu'"):
    grpo_job(dataclasses.replace(cfg, model=pallas), TOK)
  config_rules.check_attention(dataclasses.replace(pallas, head_dim=64), "gpu")
  config_rules.check_attention(dataclasses.replace(pallas, head_dim=80), "tpu")  # Mosaic takes any width
  with pytest.raises(ConfigError, match="on GPU needs model.head_dim a power of two >= 16 .*, got 80"):
    config_rules.check_attention(dataclasses.replace(pallas, head_dim=80), "gpu")
  for impl in ("auto", "xla", "blockwise", "ring"):  # auto picks what runs; the others run everywhere
    config_rules.check_attention(dataclasses.replace(pallas, attention_impl=impl, head_dim=80), "gpu")
  cudnn = dataclasses.replace(cfg.model, attention_impl="cudnn")  # the job's own check (`check_attention_kernel`)
  with pytest.raises(ConfigError, match="model.attention_impl='cudnn' cannot run this job: cudnn runs on a GPU only"):
    grpo_job(dataclasses.replace(cfg, model=cudnn), TOK)


def test_fit_refuses_a_job_built_for_another_config(tmp_path):
  cfg = _grpo_cfg()
  job = grpo_job(cfg, TOK)
  longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=5))
  with pytest.raises(ValueError, match=r"built for another config \(train.steps differ; the job's train.steps: 2"):
    fit(longer, job, train_data=[], out=tmp_path, progress=False)


def test_sharding_rules_come_from_the_config(ppo_run):
  from jax.sharding import PartitionSpec

  sft_data = DataConfig(batch_size=8, seq_len=16, pack=False)
  cfg = config_io.apply_overrides(dataclasses.replace(_grpo_cfg(), data=sft_data), [PARAM_RULES])
  for job in (sft_job(cfg, TOK), ppo_run[0]):
    assert job.rules.params["mlp"] == "fsdp" and job.rules.params["embed"] is None
    assert job.rules.activations == sharding.DEFAULT_RULES.activations
  # The state `fit` trained: up is [layers, embed, mlp], embed now replicated, mlp over fsdp.
  assert ppo_run[1].params["layers"]["up"].sharding.spec == PartitionSpec(None, None, "fsdp")
  for bad, message in ((["mlp=nowhere"], "unknown mesh axis 'nowhere'"), (["mlp"], "mesh.param_rules: 'mlp' is not")):
    with pytest.raises(ConfigError, match=message):
      sft_job(dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, param_rules=tuple(bad))), TOK)
