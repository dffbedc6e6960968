"""The host loop of a training job (`ptx.train.job.Job`): steps, logging, evaluation, checkpoints, preemption.

The loop never waits on the device between steps: step N + 1 is dispatched
before step N's metrics are fetched, and metrics cross to the host only on
logging steps. Checkpoints (state + data position) are written
asynchronously every `checkpoint_every` steps and at the end. SIGTERM (a
preemption notice) makes the loop save at the next step boundary and return
normally; `resume=True` restores the newest complete checkpoint, so a
resumed run computes exactly the steps an uninterrupted one would. Every
step object has `pipeline_state()` and `set_pipeline_state(saved)`: one
that keeps work in flight across steps (GRPO's host-reward mode samples
ahead) checkpoints it through them.

With LoRA (`cfg.lora.rank > 0`) the state trains adapters over a frozen
base; checkpoints hold the adapters, optimizer and data position but not
the base, which a resumed run rebuilds as the first run did (from the seed,
or from the same `init_params`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import pathlib
import signal
import threading
import time
from typing import Any, Iterable, Iterator

import jax
import numpy as np
import tqdm

from ptx import config_io
from ptx.config import Config
from ptx.data.global_batch import to_global
from ptx.sharding import make_mesh, rules_of
from ptx.train.checkpoint import Checkpointer
from ptx.train.job import Job
from ptx.train.metrics import MetricsWriter
from ptx.train.state import TrainState, init_state, state_shardings



def fit(
    cfg: Config,
    job: Job,
    *,
    train_data: Iterable[dict[str, Any]],
    out: pathlib.Path,
    resume: bool = False,
    eval_data: Iterable[dict[str, Any]] | None = None,
    init_params: Any = None,
    progress: bool = True,
) -> tuple[TrainState, dict[str, Any]]:
  """Runs `job` for `cfg.train.steps` steps on `train_data`, writing to `out`.

  Args:
    cfg: the job's config: `fit` reads the loop (`train`) and the mesh; the
      sections the job uses are printed and saved as `out/config.json`.
    job: what to run (`ptx.train.job.sft_job`, `dpo_job`, `grpo_job`,
      `grpo_host_job`), built from the same `cfg`.
    train_data: iterable of host batches whose iterator has get_state/set_state
      (a `ptx.data.make_pipeline` dataset, `PromptBatches`), so checkpoints
      hold its position.
    out: run directory: config.json, metrics.jsonl, tensorboard/, checkpoints/.
    resume: continue from the newest restorable checkpoint in `out`, if any.
    eval_data: a finite iterable of host batches, evaluated every
      `cfg.train.eval_every` steps and at the end (supervised jobs).
    init_params: start from these parameters instead of a fresh init (under
      LoRA: the frozen base).
    progress: show a progress bar.

  Returns:
    (state, summary): the final state, and the final step, last logged
    metrics, wall time and whether the run stopped for preemption.

  Raises:
    ValueError: when `job` was built for another length or model than `cfg`.
  """
  built_for = {"train.steps": (job.total_updates // job.updates_per_step, cfg.train.steps),
               "model": (job.model, cfg.model), "mesh rules": (job.rules, rules_of(cfg.mesh))}
  differ = [name for name, (a, b) in built_for.items() if a != b]
  if differ:
    raise ValueError(f"fit: the job was built for another config ({', '.join(differ)} differ; the job's train.steps: "
                     f"{built_for['train.steps'][0]}, cfg's: {cfg.train.steps}); build the job from this cfg")
  # Every process runs this loop; only the first writes logs (checkpoints are collective).
  primary = jax.process_index() == 0
  out.mkdir(parents=True, exist_ok=True)
  if primary:
    print(config_io.dumps(cfg, job.sections), flush=True)
    config_io.save(cfg, out / "config.json", job.sections)
  mesh = make_mesh(cfg.mesh)
  batch_devices = mesh.shape["data"] * mesh.shape["fsdp"]
  if cfg.data.batch_size % batch_devices:
    raise ValueError(f"data.batch_size={cfg.data.batch_size} does not split over the {batch_devices} devices of the "
                     f"batch axes (mesh.data x mesh.fsdp = {mesh.shape['data']} x {mesh.shape['fsdp']})")
  optimizer = job.optimizer()
  shardings = state_shardings(job.model, optimizer, mesh, job.rules, with_reference=job.with_reference, lora=job.lora)
  data = job.step.stream(iter(train_data))
  step_fn = job.step.build(optimizer, mesh, shardings, data)
  start = functools.partial(init_state, job.model, optimizer, cfg.train.seed, mesh, job.rules,
                            with_reference=job.with_reference, params=init_params, lora=job.lora)
  checkpointer = Checkpointer(out / "checkpoints", keep=cfg.train.keep_checkpoints)
  state, resumed_from = None, None
  if resume:
    abstract = jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shardings,
                            jax.eval_shape(start))
    restored = checkpointer.restore(abstract.replace(base=None), data)
    if restored is not None:
      resumed_from, state, pipeline = restored
      if pipeline is not None:
        step_fn.set_pipeline_state(pipeline)
      if job.lora is not None:  # checkpoints leave out the frozen base
        state = state.replace(base=start().base)
      if primary:
        print(f"resumed from checkpoint step {resumed_from}", flush=True)
  if state is None:
    state = start()
  writer = MetricsWriter(out, resume_step=resumed_from, enabled=primary)
  place = functools.partial(to_global, mesh=mesh, rules=job.rules)
  evaluate = None if eval_data is None else job.step.evaluator(shardings, mesh, [place(b) for b in eval_data])
  # A step logs the learning rate of its first update.
  schedule = lambda step: job.learning_rate(step * job.updates_per_step)
  started = time.perf_counter()
  try:
    with _preemption_notice() as preempted:
      state, last = _steps(cfg, step_fn, state, data, place, checkpointer, writer, evaluate, schedule, preempted,
                           progress and primary)
    checkpointer.wait()
  finally:
    checkpointer.close()
    writer.close()
  summary = {"step": int(state.step), "preempted": preempted.is_set(), "resumed_from": resumed_from,
             "wall_s": round(time.perf_counter() - started, 3), **last}
  if primary:
    print(json.dumps({"summary": summary}), flush=True)
  return state, summary


def _steps(cfg, step_fn, state, data, place, checkpointer, writer, evaluate, schedule, preempted, progress):
  """The loop proper; returns the final state and the last logged record."""
  train = cfg.train
  start = int(state.step)
  bar = tqdm.tqdm(total=train.steps, initial=start, disable=not progress, unit="step", dynamic_ncols=True)
  pending, last = None, {}
  clock = (time.perf_counter(), start, 0)  # time, step and tokens at the previous log
  tokens = 0
  for step in range(start + 1, train.steps + 1):
    host_batch = next(data)
    tokens += _token_count(host_batch)
    state, metrics = step_fn(state, place(host_batch))
    if pending is not None:  # read step N's metrics only now that step N + 1 is queued
      last, clock = _log(pending, clock, tokens, schedule, writer, bar)
      pending = None
    if step % train.log_every == 0 or step == train.steps or preempted.is_set():
      pending = (step, metrics)
    if evaluate is not None and (step % train.eval_every == 0 or step == train.steps):
      writer.write({"step": step, **evaluate(state)})
    if step % train.checkpoint_every == 0 or step == train.steps or preempted.is_set():
      checkpointer.save(step, state.replace(base=None), data, pipeline=step_fn.pipeline_state())
    bar.update(1)
    if preempted.is_set():
      break
  if pending is not None:
    last, _ = _log(pending, clock, tokens, schedule, writer, bar)
  bar.close()
  return state, last


def _log(pending, clock, tokens, schedule, writer, bar):
  step, metrics = pending
  then, then_step, then_tokens = clock
  now = time.perf_counter()
  record = {"step": step, **{k: float(v) for k, v in jax.device_get(metrics).items()}}
  record["lr"] = float(schedule(step - 1))
  record["steps_per_s"] = (step - then_step) / max(now - then, 1e-9)
  if tokens > then_tokens:  # batches with a `tokens` array (not RL prompt batches)
    record["tokens_per_s"] = (tokens - then_tokens) / max(now - then, 1e-9)
  bar.set_postfix(loss=f"{record['loss']:.4g}", steps_s=f"{record['steps_per_s']:.3g}")
  writer.write(record)
  return record, (now, step, tokens)


def _token_count(batch: dict[str, Any]) -> int:
  """Token slots in a host batch (every `tokens` array, padding included)."""
  return sum(int(np.size(v)) for k, v in _flat(batch) if k == "tokens")


def _flat(batch: dict[str, Any]) -> Iterator[tuple[str, Any]]:
  for key, value in batch.items():
    yield from (_flat(value) if isinstance(value, dict) else [(key, value)])


@contextlib.contextmanager
def _preemption_notice() -> Iterator[threading.Event]:
  """Sets the yielded event on SIGTERM (main thread only); restores the old handler after."""
  event = threading.Event()
  if threading.current_thread() is not threading.main_thread():
    yield event
    return
  previous = signal.signal(signal.SIGTERM, lambda *_: event.set())
  try:
    yield event
  finally:
    signal.signal(signal.SIGTERM, previous)
