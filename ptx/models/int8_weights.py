"""Int8 weights as qwix `QArray`s: per-output-channel symmetric quantisation and the products that read them.

A quantised weight is a `qwix.QArray` (a pytree of an int8 `qvalue` in the
weight's shape and a float32 `scale` of the same rank, 1 on the contracted
axes): w ~ qvalue * scale, scale = max |w| over the contracted axes / 127,
qvalue in [-127, 127], the rounding error at most scale / 2 per element. It sits in a parameter tree
where the float array sat, and `ptx.models.dense.dense` takes it as it takes
an array (`dot_general` below); so do the layers' `astype` and `reshape`.

The product reads the int8 bytes differently per backend. On TPU and GPU it
is weight-only: x times the dequantised weight, which XLA fuses into the
matmul's operand read. XLA:CPU does not fuse it: it writes the float weight
out and reads it back each call (slower than the float weights themselves),
so programs lowered for CPU quantise the activations too, per row, and run
an int8 x int8 dot with int32 accumulation (`ptx_kernels.xla_cpu_workarounds`
switches it, as it does the other CPU-shaped code).
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import qwix
from ptx_kernels import xla_cpu_workarounds

QArray = qwix.QArray

# qwix divides the absmax by 127.5, which puts a channel's largest value on a rounding edge (-127.5 rounds to
# -128, -127.49999 to -127): activations an ulp apart (another batch shape) then flip their largest element by a
# whole step. Scaling the absmax by 127.5 / 127 maps it to +-127 exactly, symmetric and off every edge.
_CALIBRATION = f"absmax,{127.5 / 127}"

DimensionNumbers = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]


def quantize(w: jax.Array, contracted: Sequence[int]) -> QArray:
  """Symmetric int8 `w` with one float32 scale per element of the axes not in `contracted` (its output channels).

  Args:
    w: a float weight.
    contracted: the axes its products contract (they share a scale).

  Returns:
    The `QArray`: int8 qvalue [w.shape] in [-127, 127], float32 scale [w.shape, 1 on `contracted`].
  """
  channels = [axis for axis in range(w.ndim) if axis not in contracted]
  # Scales from the float32 weight: a bfloat16 absmax / 127.5 would round the scale itself.
  return qwix.quantize(w.astype(jnp.float32), jnp.int8, channelwise_axes=channels, calibration_method=_CALIBRATION)


def dot_general(x: jax.Array, w: QArray, dimension_numbers: DimensionNumbers,
                preferred_element_type: Any = None) -> jax.Array:
  """`jax.lax.dot_general(x, w)` for an int8 `w` in the dtype of its scale (or `preferred_element_type`).

  Weight-only (the dequantised weight fused into the matmul), except in
  programs lowered for CPU (module docstring). No batch dimensions.
  """
  weight_only = functools.partial(_weight_only, dimension_numbers, preferred_element_type)
  int8_dot = functools.partial(_int8_dot, dimension_numbers, preferred_element_type)
  return xla_cpu_workarounds.platform_dependent(x, w, cpu=int8_dot, default=weight_only)


def take_rows(table: QArray, ids: jax.Array) -> jax.Array:
  """Rows `ids` [...] of an int8 table [V, D] quantised per row, dequantised: [..., D] in the scale's dtype."""
  return qwix.dequantize(jax.tree.map(lambda a: jnp.take(a, ids, axis=0), table))


def _weight_only(dimension_numbers, preferred_element_type, x: jax.Array, w: QArray) -> jax.Array:
  """x times the dequantised w (qwix dequantises a float operand's partner before the dot)."""
  return qwix.dot_general(x, w, dimension_numbers, preferred_element_type=preferred_element_type)


def _int8_dot(dimension_numbers, preferred_element_type, x: jax.Array, w: QArray) -> jax.Array:
  """x quantised per row (one scale per non-contracted element), then an int8 x int8 dot rescaled by both scales."""
  contracted = dimension_numbers[0][0]
  rows = [axis for axis in range(x.ndim) if axis not in contracted]
  x_rows = qwix.quantize(x, jnp.int8, channelwise_axes=rows, calibration_method=_CALIBRATION)
  return qwix.dot_general(x_rows, w, dimension_numbers, preferred_element_type=preferred_element_type)
