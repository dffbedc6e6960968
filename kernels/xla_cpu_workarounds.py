"""XLA:CPU workarounds: code shaped for XLA:CPU that other backends do not run.

Each workaround, where it sits, and why XLA:CPU needs it:

  RoPE barrier       `ptx.models.decoder.layer_rope`: XLA:CPU fuses sin and cos into every query and key
                     rotation and evaluates them per rotated element; a conditional makes it write the
                     [B, T, K/2] angles once (it expands `optimization_barrier` before fusion).
  cumulative sums    `ptx.sampling.rules.invert_cdf`: XLA:CPU lowers `jnp.cumsum` to a reduce-window
                     quadratic in its length, so it runs a log-depth associative scan instead.
  decode phases      `ptx.models.kv_cache.attend` and `ptx.sampling.generation._phase_slots`: XLA:CPU copies
                     every block a dot reads out of the cache, so a decode step reads its whole cache in one
                     block and the sampler keeps that cache near its fill, doubling it between phases.
  loop barrier       `blockwise.loop`: XLA:CPU slices bf16 in float32 and hoists the upcast of a
                     loop-invariant operand out of the loop, a float32 copy of the whole operand.
  bf16 tile writes   `blockwise.update_along`: XLA:CPU updates a bf16 array in float32, a full-size copy
                     per update; writing the raw 16 bits is in place.
  bf16 ring hops     `ring._rotate`: XLA:CPU permutes bf16 through float32 copies of the whole shard.

The first two go through `platform_dependent`, which picks the CPU code where a program is lowered
for CPU, whatever the default backend: a GPU would pay a host sync for the RoPE conditional, and a
CPU program traced on a GPU host a quadratic cumsum. The others are trace-time choices (`active`:
the default backend is CPU): the decode phases change the cache's shape and the loops, and inside
`platform_dependent`'s conditional XLA:CPU would compile the kernels' ones to a slightly different
program (it keeps the conditional around a collective).

Switch: all of them are on by default. `PTX_XLA_CPU_WORKAROUNDS=0` in the environment (read at
import) turns them off for the process; `with override(False):` does so for a block (A/B benchmarks,
tests of the plain path). Either way every program then takes the code other backends take.
"""

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax

ENV_VAR = "PTX_XLA_CPU_WORKAROUNDS"


def _from_environment() -> bool:
  value = os.environ.get(ENV_VAR, "1")
  if value not in ("0", "1"):
    raise ValueError(f"{ENV_VAR} must be 0 or 1, got {value!r}")
  return value == "1"


_enabled = _from_environment()


def enabled() -> bool:
  """Whether the workarounds are switched on (they still apply to CPU programs only)."""
  return _enabled


def active() -> bool:
  """Whether a program traced now takes the trace-time workarounds: switched on, and the default backend is CPU."""
  return _enabled and jax.default_backend() == "cpu"


def platform_dependent(*args: Any, cpu: Callable[..., Any], default: Callable[..., Any]) -> Any:
  """`cpu(*args)` in programs lowered for CPU while switched on, else `default(*args)`."""
  if not _enabled:
    return default(*args)
  return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


@contextlib.contextmanager
def override(on: bool) -> Iterator[None]:
  """Switches the workarounds on or off inside the block.

  The switch is read while tracing, which jit's caches do not see, so JAX's
  in-memory caches are cleared on entry and on exit: no program traced under
  one setting runs under the other.
  """
  global _enabled
  before = _enabled
  _enabled = bool(on)
  jax.clear_caches()
  try:
    yield
  finally:
    _enabled = before
    jax.clear_caches()
