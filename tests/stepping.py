"""Running a train step for a few steps by hand, as `fit` would, keeping every step's metrics."""

import jax


def run_steps(step, state, data, n):
  """`n` calls of `step(state, next(data))`; returns the last state and the host copy of each step's metrics."""
  history = []
  for _ in range(n):
    state, metrics = step(state, next(data))
    history.append(jax.device_get(metrics))
  return state, history
