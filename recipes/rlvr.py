"""Host-reward GRPO for the recipes whose reward runs on the host, and greedy pass@1 before and after.

The math verifier and sandboxed unit tests are Python on the host, so these
recipes run GRPO's host-reward mode (`ptx.train.rl_host`): the device samples
batch k + 1 while the host scores batch k (`--grpo.max_staleness=0` for
strictly on-policy steps). Task records carry a rendered "prompt" string
plus the fields their environment reads ("answer", "tests").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, Sequence

import ptx
from ptx.rl import evaluation
from ptx.rl.environments.base import Environment
from ptx.rl.prompt_batches import PromptBatches
from ptx.sampling.text import TextSampler
from ptx.train import rl_host, rl_step
from ptx.train.loop import fit

import launch


def tiny(prompt_len: int) -> ptx.Config:
  """The tiny preset of a host-reward recipe: a fresh byte-level model, 8 prompts x 2 samples of 16 bytes."""
  return ptx.Config(
      model=ptx.presets["tiny"](), optim=ptx.OptimizerConfig(lr=1e-4, warmup_steps=0, min_lr_ratio=1.0),
      train=ptx.TrainConfig(steps=10, log_every=1, checkpoint_every=10),
      data=ptx.DataConfig(batch_size=8, seq_len=prompt_len, pack=False, kind="rl"),
      grpo=ptx.GRPOConfig(group_size=2, kl_placement="none", beta=0.0, max_response_tokens=16))


def qwen7b(grpo: ptx.GRPOConfig, *, steps: int, prompts: int, prompt_len: int) -> ptx.Config:
  """A pod preset for Qwen2.5-7B-Instruct (weights from --model-dir): bfloat16, full remat, constant lr 1e-6."""
  return ptx.Config(
      model=dataclasses.replace(ptx.presets["qwen2_5_7b"](), remat="full"),
      optim=ptx.OptimizerConfig(lr=1e-6, warmup_steps=10, min_lr_ratio=1.0),
      train=ptx.TrainConfig(steps=steps, log_every=1, checkpoint_every=25),
      data=ptx.DataConfig(batch_size=prompts, seq_len=prompt_len, pack=False, kind="rl"), grpo=grpo)


def train(args: argparse.Namespace, cfg: ptx.Config, params: Any, tokenizer, tasks: Any,
          env: Environment) -> tuple[ptx.TrainState, dict]:
  """Runs `cfg.train.steps` host-reward GRPO steps on `tasks` (random access, endless) scored by `env`."""
  spec = rl_step.RLSpec(model=cfg.model, grpo=cfg.grpo,
                        max_new_tokens=cfg.grpo.max_response_tokens, stop_ids=(tokenizer.eos_id,),
                        pad_id=tokenizer.pad_id, grad_accum=cfg.train.grad_accum)
  prompts = rl_host.Lookahead(PromptBatches(tasks, tokenizer, batch_size=cfg.data.batch_size,
                                            prompt_len=cfg.data.seq_len, answer_width=None))
  reward = rl_host.env_reward(env, tokenizer, spec.stop_ids, cfg.grpo.group_size)
  make_step = functools.partial(rl_host.HostRewardStep, spec=spec, reward=reward, prompts=prompts)
  return fit(cfg, train_data=prompts, out=args.out, resume=args.resume, make_step=make_step, init_params=params,
             with_reference=cfg.grpo.beta > 0 and cfg.grpo.kl_placement != "none", progress=launch.progress(args))


def pass_at_1(params: Any, cfg: ptx.Config, tokenizer, env: Environment, tasks: Sequence[dict]) -> float:
  """Greedy pass@1 of `params` on held-out `tasks`, each completion scored by `env`."""
  sampler = TextSampler(params, cfg.model, tokenizer, max_new_tokens=cfg.grpo.max_response_tokens,
                        sampling=ptx.SamplingConfig(greedy=True), mesh=ptx.make_mesh(cfg.mesh))
  return evaluation.evaluate(sampler, env, list(tasks), k=1)["pass@k"]["1"]
