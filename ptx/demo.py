"""`ptx demo`: a tiny model learns 2-digit addition by SFT, measured before and after.

The built-in task needs nothing but ptx: seeded arithmetic problems, the byte
tokenizer and the tiny Llama-style preset, trained by the same loop as
`ptx sft` (checkpoints, metrics.jsonl, TensorBoard). Held-out exact match is
measured with teacher forcing: a problem counts as solved when every answer
token and the end-of-sequence token are the model's argmax given the correct
prefix, which is exactly when greedy decoding reproduces the answer.
"""

from __future__ import annotations

import functools
import json
import pathlib

import jax
import jax.numpy as jnp

from ptx import config as config_lib
from ptx.algorithms import sft
from ptx.config import Config, DataConfig, OptimizerConfig, TrainConfig
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.batch import pad_batch, sft_example
from ptx.data.global_batch import to_global
from ptx.data.pipeline import make_pipeline
from ptx.data.sources import MemorySource
from ptx.data.tokenizer import ByteTokenizer
from ptx.models import forward
from ptx.sharding import make_mesh
from ptx.train.loop import fit
from ptx.train.state import initial_params

# Problems with seed 0 train, seed 1 is held out.
TRAIN_SEED, EVAL_SEED, EVAL_SIZE = 0, 1, 512
MAX_DIGITS = 2


def default_config() -> Config:
  """The demo's configuration: the tiny preset on 2-digit addition, 600 steps."""
  return Config(
      model=config_lib.MODEL_PRESETS["tiny"](),
      optim=OptimizerConfig(lr=3e-3, warmup_steps=20, weight_decay=0.01),
      train=TrainConfig(steps=600, log_every=50, checkpoint_every=200, eval_every=200),
      data=DataConfig(batch_size=64, seq_len=16, pack=False),
  )


def records(seed: int, n: int) -> list[dict[str, str]]:
  """The first `n` addition problems of a seed as SFT records."""
  task = ArithmeticTask(seed, MAX_DIGITS)
  return [{"prompt": r["prompt"], "completion": r["answer"]} for r in (task[i] for i in range(n))]


def exact_match(params, batch, *, model) -> jax.Array:
  """Fraction of rows whose every target token is the argmax (= greedy decoding is correct)."""
  logits = forward(params, batch["tokens"], model, positions=batch["positions"],
                   segment_ids=batch["segment_ids"])[:, :-1]
  targets, weights = sft.next_token_targets(batch)
  wrong = (jnp.argmax(logits, axis=-1) != targets) & (weights > 0)
  return jnp.mean(~jnp.any(wrong, axis=-1))


def run(cfg: Config, out: pathlib.Path, *, resume: bool = False, progress: bool = True) -> dict:
  """Trains and evaluates the demo; returns the summary (also printed as JSON)."""
  tokenizer = ByteTokenizer()
  if cfg.model.vocab_size < tokenizer.vocab_size:
    raise config_lib.ConfigError(
        f"model.vocab_size={cfg.model.vocab_size} is smaller than the byte tokenizer's {tokenizer.vocab_size}")
  train = make_pipeline(MemorySource(records(TRAIN_SEED, cfg.train.steps * cfg.data.batch_size), "arithmetic"),
                        tokenizer, cfg.data)
  held_out = [sft_example(tokenizer, r["prompt"], r["completion"]) for r in records(EVAL_SEED, EVAL_SIZE)]
  mesh = make_mesh(cfg.mesh)
  eval_batch = to_global(pad_batch(held_out, cfg.data.seq_len, tokenizer.pad_id), mesh)
  evaluate = jax.jit(functools.partial(exact_match, model=cfg.model))
  before = float(evaluate(initial_params(cfg.model, cfg.train.seed), eval_batch))
  state, summary = fit(cfg, loss_fn=functools.partial(sft.loss, model=cfg.model), train_data=train, out=out,
                       resume=resume, progress=progress)
  after = float(evaluate(state.params, eval_batch))
  summary = {**summary, "exact_match_before": before, "exact_match_after": after}
  print(f"\nheld-out exact match ({EVAL_SIZE} problems, {MAX_DIGITS}-digit addition): "
        f"{before:.1%} before SFT -> {after:.1%} after {summary['step']} steps")
  print(json.dumps({"demo": summary}))
  return summary
