"""Host-reward GRPO for the recipes whose reward runs on the host, and greedy pass@1 before and after.

The math verifier and sandboxed unit tests are Python on the host, so these
recipes run GRPO's host-reward mode (`ptx.train.grpo.host`): the device samples
batch k + 1 while the host scores batch k (`--grpo.max_staleness=0` for
strictly on-policy steps). Task records carry a rendered "prompt" string
plus the fields their environment reads ("answer", "tests").
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Sequence

import ptx
from ptx.envs.base import Environment

import launch


def tiny(prompt_len: int) -> ptx.Config:
  """The tiny preset of a host-reward recipe: a fresh byte-level model, 8 prompts x 2 samples of 16 bytes."""
  return ptx.Config(
      model=ptx.presets["tiny"](), optim=ptx.OptimizerConfig(lr=1e-4, warmup_steps=0, min_lr_ratio=1.0),
      train=ptx.TrainConfig(steps=10, log_every=1, checkpoint_every=10),
      data=ptx.DataConfig(kind="rl", batch_size=8, seq_len=prompt_len, pack=False),
      grpo=ptx.GRPOConfig(group_size=2, kl_placement="none", beta=0.0, max_response_tokens=16))


def qwen7b(grpo: ptx.GRPOConfig, *, steps: int, prompts: int, prompt_len: int) -> ptx.Config:
  """A pod preset for Qwen2.5-7B-Instruct (weights from --model-dir): bfloat16, full remat, constant lr 1e-6."""
  return ptx.Config(
      model=dataclasses.replace(ptx.presets["qwen2_5_7b"](), remat="full"),
      optim=ptx.OptimizerConfig(lr=1e-6, warmup_steps=10, min_lr_ratio=1.0),
      train=ptx.TrainConfig(steps=steps, log_every=1, checkpoint_every=25),
      data=ptx.DataConfig(batch_size=prompts, seq_len=prompt_len, pack=False, kind="rl"), grpo=grpo)


def small(*, prompt_len: int, response_len: int) -> ptx.Config:
  """A small-model preset (weights from --model-dir, e.g. SmolLM2-360M): the fine-tuning GRPO preset, 8 prompts x 4."""
  base = ptx.FINETUNE["grpo"]()
  return dataclasses.replace(
      base, data=ptx.DataConfig(kind="rl", batch_size=8, seq_len=prompt_len, pack=False),
      grpo=dataclasses.replace(base.grpo, group_size=4, max_response_tokens=response_len))


def train(args: argparse.Namespace, cfg: ptx.Config, params: Any, tokenizer, tasks: Any,
          env: Environment) -> tuple[ptx.TrainState, dict]:
  """Runs `cfg.train.steps` host-reward GRPO steps on `tasks` (random access, endless) scored by `env`.

  Where the samples are scored comes from the recipe's host scoring flags (`launch.parse(..., scoring="reward")`).
  """
  reward = ptx.EnvReward(env, tokenizer, (tokenizer.eos_id,), cfg.grpo.group_size, **args.reward_options)
  job = ptx.grpo_host_job(cfg, tokenizer, reward)
  prompts = ptx.grpo_prompts(cfg, tokenizer, tasks, in_graph=False)
  return ptx.fit(cfg, job, train_data=prompts, out=args.out, resume=args.resume, overwrite=args.overwrite,
                 init_params=params, evals=launch.evals(cfg, tokenizer), progress=launch.progress(args))


def pass_at_1(params: Any, cfg: ptx.Config, tokenizer, env: Environment, tasks: Sequence[dict]) -> float:
  """Greedy pass@1 of `params` on held-out `tasks`, each completion scored by `env`."""
  sampler = ptx.TextSampler(params, cfg.model, tokenizer, max_new_tokens=cfg.grpo.max_response_tokens,
                        sampling=ptx.SamplingConfig(greedy=True), mesh=ptx.make_mesh(cfg.mesh))
  return ptx.evaluate(sampler, env, list(tasks), k=1)["pass@k"]["1"]
