"""The data a job trains on: supervised JSONL pipelines, and GRPO prompt batches.

`supervised` builds the training pipeline of `data.train_files` and the
held-out batches of `data.eval_files` for SFT and DPO (with DPO's
precomputed reference table when `dpo.reference="precomputed"`);
`rl_tasks` reads GRPO's rl records of `data.train_files`; `grpo_prompts`
turns random-access task records into the prompt batches a GRPO step reads.
The CLI, recipes and notebooks build their data here, so one config reads
the same data wherever it is launched.

Data that cannot train fails here, before anything compiles or is written:
files without records (`JsonlSource`), a training pipeline that yields no
batch (every record too long for data.seq_len, or bad and skipped), whose
first batch is read once to find out, and an rl record that a GRPO batch or
its environment would refuse (every record is read once to find out).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Iterable, Sequence

import jax

from ptx import paths
from ptx.config import Config, ConfigError
from ptx.data.pipeline import make_pipeline
from ptx.data.sources import JsonlSource, NoDataError
from ptx.data.tokenizer import Tokenizer
from ptx.train.grpo.prompts import JsonlTasks, PromptBatches
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
    raise ConfigError("data.train_files is empty: set --data.train_files='[\"train.jsonl\"]'")
  pipeline = functools.partial(make_pipeline, tokenizer=tokenizer, process_index=jax.process_index(),
                               process_count=jax.process_count())
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


def rl_tasks(cfg: Config, tokenizer: Tokenizer, env: Any, fields: Sequence[str]) -> JsonlTasks:
  """The rl records of `data.train_files` for GRPO, every one checked first: its prompt fits `data.seq_len` tokens
  and `env.validate` takes its fields.

  Args:
    cfg: the job config.
    tokenizer: encodes the prompts.
    env: the environment that scores the records (`ptx.envs.base.Environment`).
    fields: the fields each record needs, unless `data.task_fields` names them.

  Raises:
    NoDataError: when the files hold no records.
    RecordError: for the first bad record, naming its file, line and field.
  """
  tasks = JsonlTasks(cfg.data.train_files, cfg.data.task_fields or fields)
  tasks.check(tokenizer, cfg.data.seq_len, env.validate)
  return tasks


def grpo_prompts(cfg: Config, tokenizer: Tokenizer, tasks: Any, *, in_graph: bool) -> PromptBatches:
  """Prompt batches of random-access task records for a GRPO step.

  Args:
    cfg: the job config (`data.batch_size` prompts of `data.seq_len` tokens).
    tokenizer: encodes prompts (and, in-graph, the answers).
    tasks: `tasks[i]` is a record with "prompt" (and "answer" in-graph).
    in_graph: for the fused step: "task" holds each record's answer as
      targets of `grpo.max_response_tokens` columns, and a DAPO refill step
      reads its extra rounds' prompts in the same batch; else "task" is the
      records, for a host reward.
  """
  rounds = cfg.grpo.refill_rounds if in_graph else 1
  return PromptBatches(tasks, tokenizer, batch_size=cfg.data.batch_size * rounds, prompt_len=cfg.data.seq_len,
                       answer_width=cfg.grpo.max_response_tokens if in_graph else None)
