"""`ptx demo`: a tiny model learns multi-digit addition by SFT, measured before and after.

The built-in task needs nothing but ptx: seeded arithmetic problems, the byte
tokenizer and the tiny Llama-style preset. Held-out exact match is measured
with teacher forcing: a problem counts as solved when every answer token and
the end-of-sequence token are the model's argmax given the correct prefix,
which is exactly when greedy decoding reproduces the answer.
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys
import time
from typing import Iterator

import jax
import jax.numpy as jnp
import tqdm

from ptx import config as config_lib
from ptx.algorithms import sft
from ptx.config import Config, OptimizerConfig, TrainConfig
from ptx.data.arithmetic import ArithmeticTask
from ptx.data.batch import pad_batch, sft_example
from ptx.data.global_batch import to_global
from ptx.data.tokenizer import ByteTokenizer
from ptx.models import forward
from ptx.models.params import weight_decay_mask
from ptx.sharding import make_mesh
from ptx.train import loop
from ptx.train.optimizer import learning_rate_schedule, make_optimizer
from ptx.train.state import init_state, state_shardings
from ptx.train.step import make_train_step

# Problems with seed 0 train, seed 1 is held out.
TRAIN_SEED, EVAL_SEED, EVAL_SIZE = 0, 1, 512
MAX_DIGITS = 2


def default_config() -> Config:
  """The demo's configuration: the tiny preset on 2-digit addition, 600 steps."""
  return Config(
      model=config_lib.MODEL_PRESETS["tiny"](),
      optim=OptimizerConfig(lr=3e-3, warmup_steps=20, weight_decay=0.01),
      train=TrainConfig(steps=600, batch_size=64, seq_len=16, log_every=50),
  )


def batches(task: ArithmeticTask, cfg: TrainConfig, mesh, start: int = 0) -> Iterator[dict[str, jax.Array]]:
  """Yields global batches; step s holds problems s * batch_size ... (s + 1) * batch_size - 1."""
  tokenizer = ByteTokenizer()
  for step in range(start, sys.maxsize):
    rows = [task[step * cfg.batch_size + i] for i in range(cfg.batch_size)]
    examples = [sft_example(tokenizer, r["prompt"], r["answer"]) for r in rows]
    yield to_global(pad_batch(examples, cfg.seq_len, tokenizer.pad_id), mesh)


def exact_match(params, batch, *, model) -> jax.Array:
  """Fraction of rows whose every target token is the argmax (= greedy decoding is correct)."""
  logits = forward(params, batch["tokens"], model, positions=batch["positions"],
                   segment_ids=batch["segment_ids"])[:, :-1]
  targets, weights = sft.next_token_targets(batch)
  wrong = (jnp.argmax(logits, axis=-1) != targets) & (weights > 0)
  return jnp.mean(~jnp.any(wrong, axis=-1))


def run(cfg: Config, out: pathlib.Path, *, progress: bool = True) -> dict[str, float]:
  """Trains and evaluates; writes config.json and metrics.jsonl to `out`; returns the summary."""
  out.mkdir(parents=True, exist_ok=True)
  print(config_lib.dumps(cfg))
  config_lib.save(cfg, out / "config.json")
  tokenizer = ByteTokenizer()
  if cfg.model.vocab_size < tokenizer.vocab_size:
    raise config_lib.ConfigError(
        f"model.vocab_size={cfg.model.vocab_size} is smaller than the byte tokenizer's {tokenizer.vocab_size}")

  mesh = make_mesh(cfg.mesh)
  optimizer = make_optimizer(cfg.optim, cfg.train.steps, weight_decay_mask(cfg.model))
  shardings = state_shardings(cfg.model, optimizer, mesh)
  state = init_state(cfg.model, optimizer, cfg.train.seed, mesh)
  loss_fn = functools.partial(sft.loss, model=cfg.model)
  step_fn = make_train_step(loss_fn, optimizer, mesh=mesh, state_shardings=shardings,
                            grad_accum=cfg.train.grad_accum)

  eval_rows = [ArithmeticTask(EVAL_SEED, MAX_DIGITS)[i] for i in range(EVAL_SIZE)]
  eval_batch = to_global(pad_batch([sft_example(tokenizer, r["prompt"], r["answer"]) for r in eval_rows],
                                   cfg.train.seq_len, tokenizer.pad_id), mesh)
  evaluate = jax.jit(functools.partial(exact_match, model=cfg.model))
  before = float(evaluate(state.params, eval_batch))

  schedule = learning_rate_schedule(cfg.optim, cfg.train.steps)
  metrics_file = (out / "metrics.jsonl").open("w")

  def log(record: dict[str, float]) -> None:
    record["lr"] = float(schedule(record["step"] - 1))
    metrics_file.write(json.dumps(record) + "\n")
    metrics_file.flush()
    line = " ".join(f"{k}={v:.4g}" for k, v in record.items())
    tqdm.tqdm.write(line) if progress else print(line)

  started = time.perf_counter()
  task = ArithmeticTask(TRAIN_SEED, MAX_DIGITS)
  state = loop.run(step_fn, state, batches(task, cfg.train, mesh), steps=cfg.train.steps,
                   log_every=cfg.train.log_every, on_log=log, progress=progress,
                   tokens_per_step=cfg.train.batch_size * cfg.train.seq_len)
  metrics_file.close()
  after = float(evaluate(state.params, eval_batch))
  summary = {"steps": cfg.train.steps, "train_s": time.perf_counter() - started,
             "exact_match_before": before, "exact_match_after": after}
  print(f"\nheld-out exact match ({EVAL_SIZE} problems, {MAX_DIGITS}-digit addition): "
        f"{before:.1%} before SFT -> {after:.1%} after {cfg.train.steps} steps")
  print(json.dumps(summary))
  return summary
