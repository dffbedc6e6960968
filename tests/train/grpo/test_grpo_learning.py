"""GRPO learns: a tiny model taught 1-digit addition by SFT raises its sampled exact-match reward under GRPO.

The same for a tiny Mixture of Experts of the same active width (the held-out figures of both: `ptx demo`,
benchmarks/RESULTS.md).
"""

import dataclasses
import functools

import jax
import pytest

from ptx.algorithms import sft
from ptx.config import GRPOConfig, MeshConfig, OptimizerConfig
from ptx.model_config import MODEL_PRESETS, MoeConfig
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.batch import pad_batch, sft_example
from ptx.data.tokenizer import ByteTokenizer
from ptx.train.grpo import token_rewards
from ptx.train.grpo.prompts import PromptBatches
from ptx.sharding import make_mesh
from ptx.train.grpo import fused, update
from ptx.train.optimizer import make_optimizer
from ptx.train.state import init_state, state_shardings
from ptx.train.step import make_train_step

TOK = ByteTokenizer()
# "9+9=" then "18" and eos. 90 SFT steps leave the sampled exact match at 0.42-0.62 (SFT seeds 0-2), room both ways;
# 60 left it at 0.24-0.30, where most groups score all 0 and GRPO had little signal (seed 1 fell to 0.20).
SFT_STEPS, RL_STEPS, PROMPTS, WIDTH = 90, 60, 32, 3
GRPO = GRPOConfig(group_size=8, beta=0.0, kl_placement="none", max_response_tokens=WIDTH)


def _sft_batches(seed):
  """SFT_STEPS batches of 64 one-digit additions of task seed `seed`."""
  task = ArithmeticTask(seed, 1)
  for step in range(SFT_STEPS):
    rows = [task[step * 64 + i] for i in range(64)]
    yield pad_batch([sft_example(TOK, r["prompt"], r["answer"]) for r in rows], 8, TOK.pad_id)


def _exact_match(mesh, spec):
  """params -> the mean exact match of 8 samples of each of 128 prompts of another seed (a fixed key), jitted once.

  The prompts are training problems: one-digit addition's train side has 74, and GRPO trains on them all.
  """
  batch = next(PromptBatches(ArithmeticTask(1, 1), TOK, batch_size=128, prompt_len=6, answer_width=WIDTH))

  @jax.jit
  def score(params, batch):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      gen = update.sample(params, batch["prompts"], batch["prompt_lengths"], jax.random.key(7), spec)
      targets = jax.numpy.repeat(batch["task"]["targets"], spec.grpo.group_size, axis=0)
      return token_rewards.target_reward(gen, {"targets": targets}).mean()

  return lambda params: float(score(params, batch))


# The tiny preset's MLP of 384 as 8 experts of 192, 2 per token: the same active width.
MODELS = {"dense": MODEL_PRESETS["tiny"](),
          "moe": dataclasses.replace(MODEL_PRESETS["tiny"](),
                                     moe=MoeConfig(n_experts=8, experts_per_token=2, expert_mlp_dim=192))}


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(MODELS))
def test_grpo_raises_the_exact_match_reward_of_an_sft_model(model):
  cfg = MODELS[model]
  mesh = make_mesh(MeshConfig(data=2, fsdp=1), devices=jax.devices()[:2])  # 2 cores: 2 devices compile and run fastest
  sft_optim = make_optimizer(OptimizerConfig(lr=3e-3, warmup_steps=5, weight_decay=0.01), SFT_STEPS)
  state = init_state(cfg, sft_optim, 0, mesh)
  step = make_train_step(functools.partial(sft.loss, model=cfg), sft_optim, mesh=mesh,
                         state_shardings=state_shardings(cfg, sft_optim, mesh))
  for batch in _sft_batches(0):
    state, _ = step(state, batch)
  # 5e-4 after a 5-step warmup: Adam's first steps move every weight by about lr, and at 1e-3 from the first step
  # one SFT seed's training reward fell 0.28 -> 0.07 in a step and ended below where it started.
  rl_optim = make_optimizer(OptimizerConfig(lr=5e-4, warmup_steps=5, min_lr_ratio=1.0), RL_STEPS)
  params = state.params
  state = init_state(cfg, rl_optim, 0, mesh, params=params)
  spec = update.RLSpec(model=cfg, grpo=GRPO, max_new_tokens=WIDTH, stop_ids=(TOK.eos_id,), pad_id=TOK.pad_id)
  exact_match = _exact_match(mesh, spec)
  before = exact_match(params)
  step = fused.make_grpo_step(spec, token_rewards.target_reward, optimizer=rl_optim, mesh=mesh,
                              state_shardings=state_shardings(cfg, rl_optim, mesh))
  prompts = PromptBatches(ArithmeticTask(2, 1), TOK, batch_size=PROMPTS, prompt_len=6, answer_width=WIDTH)
  for _ in range(RL_STEPS):
    state, metrics = step(state, next(prompts))
  after = exact_match(state.params)
  print(f"sampled exact match: {before:.3f} after SFT, {after:.3f} after GRPO")
  assert 0.05 < before < 0.8, f"SFT left the model at {before:.3f}: nothing for GRPO to show"
  # Observed (SFT seeds 0, 1, 2 for the model and its SFT data), dense: 0.417 -> 0.618, 0.511 -> 0.672, 0.623 ->
  # 0.822; MoE (12-07): 0.469 -> 0.724, 0.590 -> 0.666, 0.516 -> 0.688. The gain asked for is about half the smallest
  # seen, above the 1,024 samples' noise (a standard error of ~0.015).
  gain = {"dense": 0.08, "moe": 0.04}[model]
  assert after > before + gain, f"GRPO moved exact match from {before:.3f} to {after:.3f}"
