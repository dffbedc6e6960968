"""The host loop of a training job (`ptx.train.job.Job`): steps, logging, evaluation, checkpoints, preemption.

The loop never waits on the device between steps: step N + 1 is dispatched
before step N's metrics are fetched, and metrics cross to the host only on
logging steps. Checkpoints (state + data position) are written
asynchronously every `checkpoint_every` steps and at the end, each started
only once the metrics lines through its step are on disk, so a resumed run
lacks none. SIGTERM (a preemption notice) makes the loop save at the next
step boundary and return normally; `resume=True` restores the newest
complete checkpoint, so a resumed run computes exactly the steps an
uninterrupted one would. Every step object has `pipeline_state()` and
`set_pipeline_state(saved)`: one that keeps work in flight across steps
(GRPO's host-reward mode samples ahead) checkpoints it through them. It also
has `take_samples(wait)`: transcripts of what a GRPO step sampled
(`ptx.train.grpo.samples`), which the loop writes as
`out/samples/step_<n>.jsonl` once a later step is queued, and every one
held before a checkpoint and at the end.

With LoRA (`cfg.lora.rank > 0`) the state trains adapters over a frozen
base; checkpoints hold the adapters, optimizer and data position but not
the base, which a resumed run rebuilds as the first run did (from the seed,
or from the same `init_params`).

Before the state is allocated, `ptx.train.memory_check` compiles the step
and refuses a run whose step would not fit the memory there is
(`train.memory_check`); the first step reuses those compiled programs.

What a run will not do: start over an earlier run in `out`
(`ptx.train.run_dir.check`: resume or overwrite it), resume with a config
that changes the model or the data stream (`run_dir.check_resume`), train
on a damaged checkpoint (`ptx.train.checkpoint` verifies checksums), or
keep going when it diverged: after `train.max_nonfinite_steps` optimizer
steps in a row with non-finite gradients (each skipped) it raises
`DivergedError`, and no checkpoint is written during such a streak, so the
newest one kept is the last with finite steps. The streak is read one step
late (step N's after step N + 1 is queued), as metrics are.

With `evals` (`ptx.train.checkpoint_evals`: the held-out suites of
`cfg.eval`) the loop evaluates the starting parameters before the first
step (a resumed run reads that baseline back from `out`), then every
`eval.every` steps and after the last; the summary lists the suites whose
pass@1 fell more than `eval.regression` below the baseline.

Logged records carry the data pipeline's accounting (`data/read`,
`data/skipped`, `data/truncated`, `data/dropped`, when the stream counts
them), and `tokens_per_s` / `samples_per_s` over exactly the steps between
two logs: token slots (padding included) of all hosts, and
`data.batch_size` sequences (GRPO: prompts) per step.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import pathlib
import signal
import textwrap
import threading
import time
from typing import Any, Iterable, Iterator

import jax
import numpy as np
import tqdm

from ptx import config_io, paths, sharding
from ptx.config import Config
from ptx.data.global_batch import to_global
from ptx.sharding import make_mesh, rules_of
from ptx.train import memory_check, run_dir
from ptx.train.checkpoint import Checkpointer
from ptx.train.checkpoint_evals import SuiteEvals
from ptx.train.job import Job
from ptx.train.metrics import MetricsWriter
from ptx.train.state import TrainState, abstract_state, init_state, state_shardings

log = logging.getLogger(__name__)

# The pipeline counters logged as `data/<name>` (`ptx.data.pipeline.BatchIterator.metrics`).
_DATA_COUNTS = ("read", "skipped", "truncated", "dropped")


class DivergedError(RuntimeError):
  """The run stopped: too many optimizer steps in a row had non-finite gradients."""


def fit(
    cfg: Config,
    job: Job,
    *,
    train_data: Iterable[dict[str, Any]],
    out: str | pathlib.Path,
    resume: bool = False,
    overwrite: bool = False,
    eval_data: Iterable[dict[str, Any]] | None = None,
    init_params: Any = None,
    evals: SuiteEvals | None = None,
    progress: bool = True,
) -> tuple[TrainState, dict[str, Any]]:
  """Runs `job` for `cfg.train.steps` steps on `train_data`, writing to `out`.

  Args:
    cfg: the job's config: `fit` reads the loop (`train`) and the mesh; the
      sections the job uses are saved as `out/config.json`, and the fields
      set beside the defaults printed.
    job: what to run (`ptx.train.job.sft_job`, `dpo_job`, `grpo_job`,
      `grpo_host_job`), built from the same `cfg`.
    train_data: iterable of host batches whose iterator has get_state/set_state
      (a `ptx.data.make_pipeline` dataset, `PromptBatches`), so checkpoints
      hold its position.
    out: run directory: config.json, metrics.jsonl, tensorboard/, checkpoints/, samples/ (GRPO).
    resume: continue the run in `out` from its newest intact checkpoint, if
      any; refused when `cfg` changes more than `run_dir.RESUMABLE_FIELDS`.
    overwrite: replace an earlier run in `out` (deletes its results); without
      `resume` or `overwrite` an earlier run there is refused.
    eval_data: a finite iterable of host batches, evaluated every
      `cfg.train.eval_every` steps and at the end (supervised jobs).
    init_params: start from these parameters instead of a fresh init (under
      LoRA: the frozen base).
    evals: the held-out suites of `cfg.eval`
      (`ptx.train.checkpoint_evals.build(cfg.eval, tokenizer)`), evaluated
      before the first step, every `eval.every` steps and after the last,
      into `out/evals/step_<n>/`; None when `cfg.eval` names no suite.
    progress: show a progress bar.

  Returns:
    (state, summary): the final state, and the final step, last logged
    metrics, wall time and whether the run stopped for preemption; with
    `evals`, "eval/regressions": each suite and step whose pass@1 fell more
    than `eval.regression` below the baseline.

  Raises:
    ValueError: when `job` was built for another length or model than `cfg`,
      or `evals` for another `cfg.eval`.
    ptx.train.run_dir.RunDirError: `out` holds an earlier run (neither
      `resume` nor `overwrite`), or `resume` changes the run's config.
    ptx.train.checkpoint.CheckpointError: every checkpoint is damaged.
    DivergedError: `cfg.train.max_nonfinite_steps` steps in a row were skipped.
    ptx.train.memory_check.OutOfMemory: the step does not fit the memory there is, estimated before the first
      step (`cfg.train.memory_check`) or reported by XLA while it runs.
  """
  built_for = {"train.steps": (job.total_updates // job.updates_per_step, cfg.train.steps),
               "model": (job.model, cfg.model), "mesh rules": (job.rules, rules_of(cfg.mesh))}
  differ = [name for name, (a, b) in built_for.items() if a != b]
  if differ:
    raise ValueError(f"fit: the job was built for another config ({', '.join(differ)} differ; the job's train.steps: "
                     f"{built_for['train.steps'][0]}, cfg's: {cfg.train.steps}); build the job from this cfg")
  if bool(cfg.eval.suites) != (evals is not None) or (evals is not None and evals.source != cfg.eval):
    raise ValueError(f"fit: cfg.eval names suites {list(cfg.eval.suites)} but evals holds "
                     f"{None if evals is None else [name for name, _, _ in evals.suites]} of another eval section; "
                     "pass evals=ptx.train.checkpoint_evals.build(cfg.eval, tokenizer)")
  sections = job.sections + (("eval",) if evals is not None else ())  # a run's config records its suites
  # Every process runs this loop; only the first writes logs (checkpoints are collective).
  primary = jax.process_index() == 0
  run_dir.agreed(functools.partial(_may_start, out, cfg, sections, resume=resume, overwrite=overwrite))
  if run_dir.replaces(out, resume=resume, overwrite=overwrite):
    if primary and not overwrite:
      print(f"{out} held a run that stopped before its first metrics line and checkpoint: starting again", flush=True)
    run_dir.clear(out, run_dir.RESULTS, primary=primary)
  out = paths.path(out)  # local or gs:// (`ptx.paths`): config, metrics, checkpoints and exports alike
  out.mkdir(parents=True, exist_ok=True)
  if primary:
    config_io.save(cfg, out / "config.json", sections)
    changed = config_io.fields(cfg, sections, changed_only=True)
    print(f"config: {out / 'config.json'}; {len(changed)} fields set beside the defaults:", flush=True)
    print(textwrap.fill(" ".join(changed) or "(none)", 118, initial_indent="  ", subsequent_indent="  ",
                        break_on_hyphens=False), flush=True)
  mesh = make_mesh(cfg.mesh)
  if primary:
    with jax.set_mesh(mesh):
      impl, reason = job.attention()
    print(f"attention: {impl} ({reason})", flush=True)
  batch_axes = sharding.as_tuple(sharding.logical_to_spec(("batch",), job.rules, mesh=mesh)[0])
  batch_devices = math.prod(mesh.shape[axis] for axis in batch_axes)
  if cfg.data.batch_size % batch_devices:
    raise ValueError(f"data.batch_size={cfg.data.batch_size} does not split over the {batch_devices} devices of the "
                     f"batch axes ({' x '.join(f'mesh.{a} = {mesh.shape[a]}' for a in batch_axes)})")
  optimizer = job.optimizer()
  shardings = state_shardings(job.model, optimizer, mesh, job.rules, with_reference=job.with_reference, lora=job.lora)
  data = job.step.stream(iter(train_data))
  step_fn = job.step.build(optimizer, mesh, shardings, data)
  start = functools.partial(init_state, job.model, optimizer, cfg.train.seed, mesh, job.rules,
                            with_reference=job.with_reference, params=init_params, lora=job.lora)
  if cfg.train.memory_check:  # before the state is allocated; the step's first call reuses the compiled programs
    estimate = memory_check.check(cfg, job, step_fn, abstract_state(shardings, start), mesh)
    if primary and estimate is not None:
      print(f"memory check: {estimate}", flush=True)
  checkpointer = Checkpointer(out / "checkpoints", keep=cfg.train.keep_checkpoints)
  state, resumed_from = None, None
  if resume:
    restored = checkpointer.restore(abstract_state(shardings, start).replace(base=None), data)
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
  checks = None if evals is None else evals.start(out, writer, model=job.model, lora=job.lora, mesh=mesh,
                                                  rules=job.rules, checkpoint_every=cfg.train.checkpoint_every,
                                                  primary=primary)
  # A step logs the learning rate of its first update.
  schedule = lambda step: job.learning_rate(step * job.updates_per_step)
  started = time.perf_counter()
  try:
    if checks is not None:
      checks.baseline(state, resumed_from)
    with _preemption_notice() as preempted:
      samples = functools.partial(_write_samples, out / "samples", enabled=primary)
      state, last = _steps(cfg, step_fn, state, data, place, checkpointer, writer, samples, evaluate, checks,
                           schedule, preempted, progress and primary)
    checkpointer.wait()
  except jax.errors.JaxRuntimeError as e:
    oom = memory_check.from_xla(e, cfg, job)
    if oom is None:
      raise
    raise oom from e
  finally:
    checkpointer.close()
    writer.close()
  summary = {"step": int(state.step), "preempted": preempted.is_set(), "resumed_from": resumed_from,
             "wall_s": round(time.perf_counter() - started, 3), **last}
  reasons = data.skip_reasons() if hasattr(data, "skip_reasons") else []
  if reasons:
    summary["data/first_skips"] = reasons
  if checks is not None:
    summary["eval/regressions"] = checks.regressions
  if primary:
    print(json.dumps({"summary": summary}), flush=True)
  return state, summary


def _may_start(out: pathlib.Path, cfg: Config, sections: tuple[str, ...], *, resume: bool, overwrite: bool) -> None:
  """Refuses an earlier run in `out` (unless resumed or overwritten) and a resume that changes the run."""
  run_dir.check(out, resume=resume, overwrite=overwrite)
  saved = run_dir.saved_config(out) if resume else None
  if saved is not None:
    run_dir.check_resume(saved, config_io.to_dict(cfg, sections), out)


def _steps(cfg, step_fn, state, data, place, checkpointer, writer, samples, evaluate, checks, schedule, preempted,
           progress):
  """The loop proper; returns the final state and the last logged record."""
  train = cfg.train
  start = int(state.step)
  bar = tqdm.tqdm(total=train.steps, initial=start, disable=not progress, unit="step", dynamic_ncols=True)
  meter = _Meter(start, samples_per_step=cfg.data.batch_size)
  guard = _DivergenceGuard(train.max_nonfinite_steps, checkpointer)
  pending, last = None, {}
  for step in range(start + 1, train.steps + 1):
    host_batch = next(data)
    meter.add(_token_count(host_batch) * jax.process_count())
    state, metrics = step_fn(state, place(host_batch))
    guard.queued(step, metrics)  # checks step - 1, whose metrics are now safe to read
    if pending is not None:  # read step N's metrics only now that step N + 1 is queued
      last = _log(pending, meter, schedule, writer, bar, data)
      pending = None
    samples(step_fn.take_samples())  # the steps before this one, finished or nearly now that it is queued
    if step % train.log_every == 0 or step == train.steps or preempted.is_set():
      pending = (step, metrics, meter.mark(step))
    if evaluate is not None and (step % train.eval_every == 0 or step == train.steps):
      writer.write({"step": step, **evaluate(state)})
    if step % train.checkpoint_every == 0 or step == train.steps or preempted.is_set():
      if guard.finite(step, metrics):
        # Every line through this step is durable before the checkpoint can be published: a run killed during
        # the next step resumes here and would never write this step's line again. The save waits for the step
        # anyway (it checksums the state), so reading its metrics now costs no overlap.
        if pending is not None:
          last = _log(pending, meter, schedule, writer, bar, data)
          pending = None
        samples(step_fn.take_samples(wait=True))
        writer.flush()
        checkpointer.save(step, state.replace(base=None), data, pipeline=step_fn.pipeline_state())
    # Before the next step donates the state; a preempted run stops without (its time is short).
    if checks is not None and checks.after(step, train.steps) and not preempted.is_set():
      checks.evaluate(step, state)
    bar.update(1)
    if preempted.is_set():
      break
  if pending is not None:
    last = _log(pending, meter, schedule, writer, bar, data)
  samples(step_fn.take_samples(wait=True))
  guard.finish()
  bar.close()
  return state, last


class _Meter:
  """Tokens counted step by step, so a log's throughput covers exactly the steps since the previous log."""

  def __init__(self, step: int, samples_per_step: int):
    self._samples_per_step = samples_per_step
    self._tokens = 0
    self._previous = (time.perf_counter(), step, 0)  # time, step and tokens at the previous log

  def add(self, tokens: int) -> None:
    """Counts one step of `tokens` token slots."""
    self._tokens += tokens

  def mark(self, step: int) -> tuple[int, int]:
    """(step, tokens through it): where the log of `step`, just queued, stops counting."""
    return step, self._tokens

  def rates(self, mark: tuple[int, int]) -> dict[str, float]:
    """steps_per_s, samples_per_s and (when batches have tokens) tokens_per_s since the previous log."""
    then, then_step, then_tokens = self._previous
    step, tokens = mark
    now = time.perf_counter()
    seconds = max(now - then, 1e-9)
    self._previous = (now, step, tokens)
    rates = {"steps_per_s": (step - then_step) / seconds,
             "samples_per_s": (step - then_step) * self._samples_per_step / seconds}
    if tokens > then_tokens:  # batches with a `tokens` array (not RL prompt batches)
      rates["tokens_per_s"] = (tokens - then_tokens) / seconds
    return rates


class _DivergenceGuard:
  """Stops the run after `limit` optimizer steps in a row with non-finite gradients; 0 never stops."""

  def __init__(self, limit: int, checkpointer: Checkpointer):
    self._limit = limit
    self._checkpointer = checkpointer
    self._previous = None
    self._warned = False

  def queued(self, step: int, metrics: dict[str, Any]) -> None:
    """Checks the step before `step` (finished or nearly), then holds `step`'s streak for the next call."""
    if self._previous is not None:
      self._check(*self._previous)
    self._previous = (step, metrics.get("nonfinite_streak")) if self._limit else None

  def finite(self, step: int, metrics: dict[str, Any]) -> bool:
    """Whether `step` ended a run of finite steps, so its checkpoint may be written (waits for the step)."""
    streak = metrics.get("nonfinite_streak")
    if streak is None or int(streak) == 0:
      return True
    self._check(step, streak)
    if not self._warned:
      log.warning("step %d: %d step(s) in a row had non-finite gradients; not checkpointing until a finite step",
                  step, int(streak))
      self._warned = True
    return False

  def finish(self) -> None:
    """Checks the last step."""
    if self._previous is not None:
      self._check(*self._previous)
      self._previous = None

  def _check(self, step: int, streak: Any) -> None:
    if streak is None or not self._limit or int(streak) < self._limit:
      return
    kept = self._checkpointer.steps()
    where = f"the newest checkpoint kept is step {kept[-1]}" if kept else "no checkpoint was written"
    raise DivergedError(f"diverged: the last {int(streak)} optimizer steps (through step {step}) had non-finite "
                        f"gradients and were skipped (train.max_nonfinite_steps={self._limit}); {where}, the "
                        "last before the streak. Lower optim.lr or raise optim.warmup_steps, then --resume or "
                        "start again")


def _log(pending, meter: _Meter, schedule, writer, bar, data) -> dict[str, Any]:
  step, metrics, mark = pending
  # Numbers, and the few labels a step reports (`rewards/sandbox`: which backend scored it).
  record = {"step": step, **{k: v if isinstance(v, str) else float(v) for k, v in jax.device_get(metrics).items()}}
  record["lr"] = float(schedule(step - 1))
  record.update(meter.rates(mark))
  counts = data.metrics() if hasattr(data, "metrics") else {}
  record.update({f"data/{name}": float(counts[name]) for name in _DATA_COUNTS if name in counts})
  postfix = {"loss": f"{record['loss']:.4g}", "steps_s": f"{record['steps_per_s']:.3g}",
             "samples_s": f"{record['samples_per_s']:.3g}"}
  if "reward/mean" in record:  # what an RL run is watched for
    postfix = {"reward": f"{record['reward/mean']:.4g}", **postfix}
  if "tokens_per_s" in record:
    postfix["tokens_s"] = f"{record['tokens_per_s']:.4g}"
  if record.get("data/skipped") or record.get("data/dropped"):
    postfix["skipped"] = int(record.get("data/skipped", 0) + record.get("data/dropped", 0))
  bar.set_postfix(postfix)
  writer.write(record)
  return record


def _write_samples(directory: pathlib.Path, taken: dict[int, bytes], *, enabled: bool) -> None:
  """Writes each step's transcripts (`take_samples`) whole as `directory/step_<n>.jsonl`, replacing an earlier file."""
  if not enabled or not taken:
    return
  directory.mkdir(parents=True, exist_ok=True)
  for step, text in taken.items():
    paths.write_atomic(directory / f"step_{step}.jsonl", text)


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
