"""The host loop of a training job: steps, logging, evaluation, checkpoints, preemption.

The loop never waits on the device between steps: step N + 1 is dispatched
before step N's metrics are fetched, and metrics cross to the host only on
logging steps. Checkpoints (state + data position) are written
asynchronously every `checkpoint_every` steps and at the end. SIGTERM (a
preemption notice) makes the loop save at the next step boundary and return
normally; `resume=True` restores the newest complete checkpoint, so a
resumed run computes exactly the steps an uninterrupted one would. A step
function that keeps work in flight across steps (GRPO's host-reward mode
samples ahead) checkpoints it too, through `pipeline_state()` and
`set_pipeline_state(saved)`.

With LoRA (`cfg.lora.rank > 0`) the state trains adapters over a frozen
base; checkpoints hold the adapters, optimizer and data position but not
the base, which a resumed run rebuilds as the first run did (from the seed,
or from the same `init_params`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import pathlib
import signal
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import jax
import numpy as np
import optax
import tqdm

from ptx import config as config_lib
from ptx.config import Config
from ptx.data.global_batch import to_global
from ptx.models.params import weight_decay_mask
from ptx.sharding import make_mesh
from ptx.train.checkpoint import Checkpointer
from ptx.train.metrics import MetricsWriter
from ptx.train.optimizer import learning_rate_schedule, make_optimizer
from ptx.train.state import TrainState, init_state, state_shardings
from ptx.train.step import LossFn, make_train_step, reference_params, trainable_loss

log = logging.getLogger(__name__)


def fit(
    cfg: Config,
    *,
    loss_fn: LossFn | None = None,
    train_data: Iterable[dict[str, Any]],
    out: pathlib.Path,
    resume: bool = False,
    eval_data: Iterable[dict[str, Any]] | None = None,
    prepare: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None,
    make_step: Callable[..., Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]] | None = None,
    init_params: Any = None,
    with_reference: bool = False,
    progress: bool = True,
    updates_per_step: int = 1,
    optimizer_stage: optax.GradientTransformation | None = None,
) -> tuple[TrainState, dict[str, Any]]:
  """Trains `cfg.train.steps` steps of `loss_fn` on `train_data`, writing to `out`.

  Args:
    cfg: the job config (printed and saved as `out/config.json`).
    loss_fn: `loss(params, batch, rng) -> (loss, metrics)`, static config bound.
    train_data: iterable of host batches whose iterator has get_state/set_state
      (a `ptx.data.make_pipeline` dataset), so checkpoints hold its position.
    out: run directory: config.json, metrics.jsonl, tensorboard/, checkpoints/.
    resume: continue from the newest restorable checkpoint in `out`, if any.
    eval_data: a finite iterable of host batches, evaluated every
      `cfg.train.eval_every` steps and at the end.
    prepare: the algorithm's batch preparation from the frozen reference
      (`TrainState.ref_params`, a copy of the initial parameters), e.g. DPO.
    make_step: `make_step(optimizer=, mesh=, state_shardings=) -> step(state,
      batch)` replaces the supervised step built from `loss_fn` (e.g. GRPO's
      fused step). A step object with `pipeline_state() -> host arrays |
      None` and `set_pipeline_state(saved)` has its work in flight saved with
      every checkpoint and handed back on resume.
    init_params: start from these parameters instead of a fresh init (under
      LoRA: the frozen base).
    with_reference: keep a frozen copy of the initial parameters
      (implied by `prepare`).
    progress: show a progress bar.
    updates_per_step: optimizer updates one step makes (an RL step's epochs x
      mini-batches, `GRPOConfig.updates_per_step`): the learning-rate schedule
      spans `cfg.train.steps` times this many updates.
    optimizer_stage: an optax stage chained after the optimizer, whose state
      the step reads and writes (`rl_step.coefficient_stage`).

  Returns:
    (state, summary): the final state, and the final step, last logged
    metrics, wall time and whether the run stopped for preemption.
  """
  # Every process runs this loop; only the first writes logs (checkpoints are collective).
  primary = jax.process_index() == 0
  out.mkdir(parents=True, exist_ok=True)
  if primary:
    print(config_lib.dumps(cfg), flush=True)
    config_lib.save(cfg, out / "config.json")
  mesh = make_mesh(cfg.mesh)
  lora = cfg.lora if cfg.lora.rank > 0 else None
  # Adapters are all matrices: every one of them decays.
  updates = cfg.train.steps * updates_per_step
  optimizer = make_optimizer(cfg.optim, updates, None if lora else weight_decay_mask(cfg.model))
  if optimizer_stage is not None:
    optimizer = optax.chain(optimizer, optimizer_stage)
  with_reference = with_reference or prepare is not None
  shardings = state_shardings(cfg.model, optimizer, mesh, with_reference=with_reference, lora=lora)
  if make_step is None:
    step_fn = make_train_step(loss_fn, optimizer, mesh=mesh, state_shardings=shardings,
                              grad_accum=cfg.train.grad_accum, prepare=prepare, lora=lora)
  else:
    step_fn = make_step(optimizer=optimizer, mesh=mesh, state_shardings=shardings)
  start = functools.partial(init_state, cfg.model, optimizer, cfg.train.seed, mesh, with_reference=with_reference,
                            params=init_params, lora=lora)
  checkpointer = Checkpointer(out / "checkpoints", keep=cfg.train.keep_checkpoints)
  data = iter(train_data)
  state, resumed_from = None, None
  if resume:
    abstract = jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shardings,
                            jax.eval_shape(start))
    restored = checkpointer.restore(abstract.replace(base=None), data)
    if restored is not None:
      resumed_from, state, pipeline = restored
      if pipeline is not None and hasattr(step_fn, "set_pipeline_state"):
        step_fn.set_pipeline_state(pipeline)
      elif pipeline is not None:  # e.g. a host-reward run resumed in fused mode: those batches are sampled again
        log.warning("checkpoint step %d holds batches sampled ahead that this run's step does not take; "
                    "they are dropped", resumed_from)
      if lora is not None:  # checkpoints leave out the frozen base
        state = state.replace(base=start().base)
      if primary:
        print(f"resumed from checkpoint step {resumed_from}", flush=True)
  if state is None:
    state = start()
  writer = MetricsWriter(out, resume_step=resumed_from, enabled=primary)
  evaluate = None if eval_data is None else _evaluator(loss_fn, prepare, shardings, mesh, eval_data, lora)
  lr_of_update = learning_rate_schedule(cfg.optim, updates)
  schedule = lambda step: lr_of_update(step * updates_per_step)  # a step logs the lr of its first update
  started = time.perf_counter()
  try:
    with _preemption_notice() as preempted:
      state, last = _steps(cfg, step_fn, state, data, mesh, checkpointer, writer, evaluate, schedule,
                           preempted, progress and primary)
    checkpointer.wait()
  finally:
    checkpointer.close()
    writer.close()
  summary = {"step": int(state.step), "preempted": preempted.is_set(), "resumed_from": resumed_from,
             "wall_s": round(time.perf_counter() - started, 3), **last}
  if primary:
    print(json.dumps({"summary": summary}), flush=True)
  return state, summary


def _steps(cfg, step_fn, state, data, mesh, checkpointer, writer, evaluate, schedule, preempted, progress):
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
    state, metrics = step_fn(state, to_global(host_batch, mesh))
    if pending is not None:  # read step N's metrics only now that step N + 1 is queued
      last, clock = _log(pending, clock, tokens, schedule, writer, bar)
      pending = None
    if step % train.log_every == 0 or step == train.steps or preempted.is_set():
      pending = (step, metrics)
    if evaluate is not None and (step % train.eval_every == 0 or step == train.steps):
      writer.write({"step": step, **evaluate(state)})
    if step % train.checkpoint_every == 0 or step == train.steps or preempted.is_set():
      in_flight = step_fn.pipeline_state() if hasattr(step_fn, "pipeline_state") else None
      checkpointer.save(step, state.replace(base=None), data, pipeline=in_flight)
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


def _evaluator(loss_fn, prepare, shardings, mesh, eval_data, lora) -> Callable[[TrainState], dict[str, float]]:
  """Returns `evaluate(state) -> {"eval/...": mean}`, weighted like the training loss."""

  @functools.partial(jax.jit, in_shardings=(shardings, None))
  def metrics(state, batch):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      if prepare is not None:
        batch = prepare(reference_params(state), batch)
      return trainable_loss(loss_fn, state.base, lora, dropout=False)(state.params, batch, state.rng)[1]

  batches = [to_global(b, mesh) for b in eval_data]

  def evaluate(state):
    totals: dict[str, float] = {}
    for batch in batches:
      m = jax.device_get(metrics(state, batch))
      w = float(m["weight"])
      for key, value in m.items():
        totals[key] = totals.get(key, 0.0) + (w if key == "weight" else w * float(value))
    weight = totals.get("weight", 0.0) or 1.0
    return {f"eval/{k}": (v if k == "weight" else v / weight) for k, v in totals.items()}

  return evaluate


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
