"""The data a job trains on: supervised JSONL pipelines, and GRPO prompt batches.

`supervised` builds the training pipeline of `data.train_files` and the
held-out batches of `data.eval_files` for SFT and DPO (with DPO's
precomputed reference table when `dpo.reference="precomputed"`);
`rl_tasks` reads GRPO's rl records of `data.train_files`; `grpo_prompts`
turns random-access task records into the prompt batches a GRPO step reads
(for multi-turn episodes: each task's first prompt as its episode shows it,
`ptx.train.grpo.prompts.EpisodePrompts`).
The CLI, recipes and notebooks build their data here, so one config reads
the same data wherever it is launched.

Data that cannot train fails here, before anything compiles or is written:
files without records (`JsonlSource`), a training pipeline that yields no
batch (every record too long for data.seq_len, or bad and skipped), whose
first batch is read once to find out, an rl record that a GRPO batch or
its environment would refuse (every record is read once to find out), and
built-in episode tasks whose first prompts do not fit data.seq_len (the
first `SCAN` a run reads are measured).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Iterable, Sequence

import jax

from ptx import paths
from ptx.config import Config, ConfigError
from ptx.data.images import image_config
from ptx.data.pipeline import make_pipeline
from ptx.data.sources import JsonlSource, NoDataError
from ptx.data.tokenizer import Tokenizer
from ptx.envs.base import Environment
from ptx.episodes.turn_format import TurnFormat
from ptx.train.grpo.prompts import EpisodePrompts, JsonlTasks, PromptBatches, RecordPrompts, longest_prompt
from ptx.train.reference_pass import with_reference_table


def supervised(cfg: Config, tokenizer: Tokenizer, *, out: str | os.PathLike,
               init_params: Any = None) -> tuple[Iterable[dict[str, Any]], list[dict[str, Any]] | None]:
  """(training pipeline, held-out batches or None) of `cfg.data`'s JSONL files for SFT or DPO.

  Args:
    cfg: the job config; `data.kind` is "sft" or "preference".
    tokenizer: encodes the records.
    out: the run directory, local or gs:// (DPO's precomputed reference
      table goes to OUT/reference_logps/).
    init_params: the parameters training starts from, for the precomputed
      reference (None: the fresh init of `train.seed`).

  Raises:
    ConfigError: when `data.train_files` is empty.
    NoDataError: when the files hold no records, or the training pipeline
      (or the held-out one) keeps none of them.
  """
  data = cfg.data
  if not data.train_files:
    raise ConfigError("data.train_files is empty: set it to a list of JSONL files "
                      "(--data.train_files='[\"train.jsonl\"]')")
  pipeline = functools.partial(make_pipeline, tokenizer=tokenizer, images=image_config(cfg.model.vision, data),
                               process_index=jax.process_index(), process_count=jax.process_count())
  sources = {"train": JsonlSource(data.train_files)}
  streams = {"train": pipeline(sources["train"], cfg=data)}
  _first_batch(streams["train"], data.train_files)
  if data.eval_files:
    sources["eval"] = JsonlSource(data.eval_files)
    streams["eval"] = pipeline(sources["eval"], cfg=dataclasses.replace(data, shuffle=False, num_epochs=1))
  if data.kind == "preference" and cfg.dpo.reference_model == "precomputed":  # one pass now, no reference copy later
    streams = {name: with_reference_table(stream, source=sources[name], pipeline=pipeline, cfg=cfg,
                                          path=paths.path(out) / "reference_logps" / f"{name}.npy",
                                          init_params=init_params)
               for name, stream in streams.items()}
  return streams["train"], (list(streams["eval"]) if "eval" in streams else None)


def _first_batch(stream: Iterable[dict[str, Any]], files: Sequence[str]) -> None:
  """Reads a batch from a fresh iterator of `stream`; one that keeps no example raises its NoDataError."""
  try:
    next(iter(stream))
  except StopIteration:  # this host reads no record at all (fewer records than hosts, or no epochs)
    raise NoDataError(f"{', '.join(files)}: the training pipeline of this host yields no batch") from None


def rl_tasks(cfg: Config, tokenizer: Tokenizer, env: Environment, fields: Sequence[str], *,
             episodes: bool = False) -> JsonlTasks:
  """The rl records of `data.train_files` for GRPO, every one checked first: its prompt fits `data.seq_len` tokens
  and `env.validate` takes its fields.

  Args:
    cfg: the job config.
    tokenizer: encodes the prompts.
    env: the environment that scores the records, or plays them.
    fields: the fields each record needs, unless `data.task_fields` names them.
    episodes: the records are played as multi-turn episodes in `env`: the prompt that must fit is each episode's
      first (`EpisodePrompts`), and a record needs a "prompt" only where `env` reads one.

  Raises:
    NoDataError: when the files hold no records.
    RecordError: for the first bad record, naming its file, line and field.
  """
  tasks = JsonlTasks(cfg.data.train_files, cfg.data.task_fields or fields)
  tasks.check(_encoder(tokenizer, env if episodes else None), cfg.data.seq_len, env.validate)
  return tasks


# Built-in episode tasks measured at startup (at most): enough to find the longest prompts of a generator whose
# lengths vary by a few tokens (calculator, terminal) or are bounded by a budget (docqa), in about a second.
SCAN = 256


def check_builtin_prompts(cfg: Config, tokenizer: Tokenizer, env: Environment, tasks: Any, *, episodes: bool) -> None:
  """Measures the prompts of the first built-in tasks a run reads (at most `SCAN`), before anything compiles.

  Args:
    cfg: the job config (`data.seq_len`, and `train.steps` x `data.batch_size` tasks a run reads).
    tokenizer: encodes the prompts.
    env: the environment the tasks are scored or played in.
    tasks: random-access task records (built-in tasks, without a file to check whole).
    episodes: the tasks are played as multi-turn episodes: the prompt that must fit is each episode's first.

  Raises:
    ConfigError: naming --data.seq_len and the tokens the longest takes, when one does not fit.
    RecordError: for a task `env` refuses, named by its index.
  """
  count = min(SCAN, max(1, cfg.train.steps) * cfg.data.batch_size)
  index, n = longest_prompt(_encoder(tokenizer, env if episodes else None), tasks, count)
  if n > cfg.data.seq_len:
    what = "the first prompt of an episode of" if episodes else "the prompt of"
    raise ConfigError(f"data.seq_len={cfg.data.seq_len} is shorter than {what} task {index}: {n} tokens, the "
                      f"longest of the first {count} tasks ({env.name}'s text in the chat template): set "
                      f"data.seq_len={n} or more")


def grpo_prompts(cfg: Config, tokenizer: Tokenizer, tasks: Any, *, in_graph: bool,
                 episodes: Environment | None = None) -> PromptBatches:
  """Prompt batches of random-access task records for a GRPO step.

  Args:
    cfg: the job config (`data.batch_size` prompts of `data.seq_len` tokens).
    tokenizer: encodes prompts (and, in-graph, the answers).
    tasks: `tasks[i]` is a record with "prompt" (and "answer" in-graph).
    in_graph: for the fused step: "task" holds each record's answer as
      targets of `grpo.max_response_tokens` columns, and a DAPO refill step
      reads its extra rounds' prompts in the same batch; else "task" is the
      records, for a host reward.
    episodes: the environment multi-turn episodes of the tasks are played in: the batches' prompts are the
      episodes' first (`EpisodePrompts`), and a record needs a "prompt" only where it reads one; None: the
      records' own prompts (`RecordPrompts`).
  """
  rounds = cfg.grpo.refill_rounds if in_graph else 1
  return PromptBatches(tasks, tokenizer, batch_size=cfg.data.batch_size * rounds, prompt_len=cfg.data.seq_len,
                       answer_width=cfg.grpo.max_response_tokens if in_graph else None,
                       prompts=_encoder(tokenizer, episodes))


def _encoder(tokenizer: Tokenizer, episodes: Environment | None) -> RecordPrompts | EpisodePrompts:
  """The records' own prompts, or the first prompts of episodes in `episodes` (as `job.grpo_episode_job` plays
  them: `TurnFormat.of` the tokenizer)."""
  return RecordPrompts(tokenizer) if episodes is None else EpisodePrompts(episodes, TurnFormat.of(tokenizer))
