"""The host loop: keeps the device busy and reads metrics only when logging.

Step N + 1 is dispatched before step N's metrics are fetched, so the host
never waits for the device between steps; metrics cross to the host only on
logging steps.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import jax
import tqdm

from ptx.train.state import TrainState

StepFn = Callable[[TrainState, Any], tuple[TrainState, dict[str, jax.Array]]]
LogFn = Callable[[dict[str, float]], None]


def run(
    step_fn: StepFn,
    state: TrainState,
    batches: Iterator[Any],
    *,
    steps: int,
    log_every: int,
    on_log: LogFn,
    progress: bool = True,
    tokens_per_step: int | None = None,
) -> TrainState:
  """Runs `step_fn` until `state.step == steps`, logging every `log_every` steps.

  Args:
    step_fn: the jitted `step(state, batch) -> (state, metrics)`.
    state: the starting state (its `step` may be past 0 when resuming).
    batches: yields one global batch per step.
    steps: the step count to stop at.
    log_every: log every this many steps, and after the last one.
    on_log: receives `{"step", "tokens_per_s", "steps_per_s", **metrics}` as floats.
    progress: show a progress bar (on a terminal, a researcher wants to see it).
    tokens_per_step: tokens in one global batch, for `tokens_per_s`.

  Returns:
    The final state.
  """
  start = int(state.step)
  bar = tqdm.tqdm(total=steps, initial=start, disable=not progress, unit="step", dynamic_ncols=True)
  pending: tuple[int, dict[str, jax.Array]] | None = None
  last_time, last_step = time.perf_counter(), start
  for step in range(start + 1, steps + 1):
    state, metrics = step_fn(state, next(batches))
    if pending is not None:  # the previous step's metrics, read after this step was dispatched
      last_time, last_step = _report(pending, last_time, last_step, tokens_per_step, on_log, bar)
      pending = None
    if step % log_every == 0 or step == steps:
      pending = (step, metrics)
    bar.update(1)
  if pending is not None:
    _report(pending, last_time, last_step, tokens_per_step, on_log, bar)
  bar.close()
  return state


def _report(pending, last_time, last_step, tokens_per_step, on_log, bar):
  step, metrics = pending
  record = {k: float(v) for k, v in jax.device_get(metrics).items()}
  now = time.perf_counter()
  steps_per_s = (step - last_step) / max(now - last_time, 1e-9)
  record = {"step": step, **record, "steps_per_s": steps_per_s}
  if tokens_per_step is not None:
    record["tokens_per_s"] = steps_per_s * tokens_per_step
  bar.set_postfix({k: f"{v:.4g}" for k, v in record.items() if k in ("loss", "accuracy", "tokens_per_s")})
  on_log(record)
  return now, step
