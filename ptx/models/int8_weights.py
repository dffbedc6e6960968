"""Int8 weights as qwix `QArray`s: per-output-channel symmetric quantisation, read weight-only.

A quantised weight is a `qwix.QArray` (a pytree of an int8 `qvalue` in the
weight's shape and a float32 `scale` of the same rank, 1 on the contracted
axes): w ~ qvalue * scale, scale = max |w| over the contracted axes / 127,
qvalue in [-127, 127], the rounding error at most scale / 2 per element. It
sits in a parameter tree where the float array sat; `ptx.models.dense.dense`
multiplies by it with `qwix.dot_general`, which dequantises it into the
product (TPU and GPU compilers fuse that into the matmul's operand read, so a
step reads the int8 bytes), and the layers' `astype` and `reshape` apply to
it as to an array. The activations stay float: weight-only.

XLA:CPU's dot reads float operands, so there the dequantised weight is
materialised first: on CPU int8 weights save memory but no time (SmolLM2-135M
decode, benchmarks/quantized_rollout.py: 0.94x float's tokens/s).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import qwix

# qwix divides the absmax by 127.5, mapping a channel's most negative value to -128 and its most positive to 127;
# scaling the absmax by 127.5 / 127 maps both to +-127: symmetric, one step size either way.
_CALIBRATION = f"absmax,{127.5 / 127}"


def quantize(w: jax.Array, contracted: Sequence[int]) -> qwix.QArray:
  """Symmetric int8 `w` with one float32 scale per element of the axes not in `contracted` (its output channels).

  Args:
    w: a float weight.
    contracted: the axes its products contract (they share a scale).

  Returns:
    The `QArray`: int8 qvalue [w.shape] in [-127, 127], float32 scale [w.shape, 1 on `contracted`].
  """
  channels = [axis for axis in range(w.ndim) if axis not in contracted]
  # Scales from the float32 weight: a bfloat16 absmax / 127 would round the scale itself.
  return qwix.quantize(w.astype(jnp.float32), jnp.int8, channelwise_axes=channels, calibration_method=_CALIBRATION)


def take_rows(table: qwix.QArray, ids: jax.Array) -> jax.Array:
  """Rows `ids` [...] of an int8 table [V, D] quantised per row, dequantised: [..., D] in the scale's dtype."""
  return qwix.dequantize(jax.tree.map(lambda a: jnp.take(a, ids, axis=0), table))
