"""benchmarks/engine_ops.py: a profile's operations summed by kind, loops' spans left out so nothing counts twice."""

import jax
import jax.numpy as jnp
import pytest


@pytest.fixture(scope="module")
def engine_ops(import_benchmark):
  return import_benchmark("engine_ops")


def test_operations_inside_a_loop_count_once_each_and_the_loop_itself_not_at_all(engine_ops, tmp_path):
  program = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, y: jnp.sin(y) @ y, x))
  x = jnp.ones((64, 64))
  program(x).block_until_ready()  # compiled outside the trace
  with jax.profiler.trace(str(tmp_path)):
    program(x).block_until_ready()
  ms, count = engine_ops.device_ops(str(tmp_path))
  assert not any(kind.startswith(("while", "end: ", "ThunkExecutor", "Threadpool")) for kind in ms), sorted(ms)
  sines = [kind for kind in count if "sine" in kind]
  assert sines and sum(count[kind] for kind in sines) == 3, dict(count)  # one per iteration
  assert all(value >= 0 for value in ms.values())


def test_a_directory_without_a_profile_is_refused(engine_ops, tmp_path):
  with pytest.raises(SystemExit, match="no profile was written under"):
    engine_ops.device_ops(str(tmp_path))
