"""MXFP4 checkpoint weights (gpt-oss's MoE experts), dequantised on read.

The format (OCP Microscaling Formats (MX) v1.0, MXFP4; transformers' `integrations/mxfp4.py`): config.json holds
`"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [...]}`, and a tensor `X` whose bf16 hub
layout is [E, C, R] (gpt-oss: `mlp.experts.gate_up_proj` [E, D, 2F] and `down_proj` [E, F, D], input features
before output ones) is stored transposed, in blocks of 32 along C, the contraction axis: `X_blocks`, uint8
[E, R, C / 32, 16], holds 32 FP4 (E2M1) codes per block, two to a byte, the even column in the low nibble; `X_scales`,
uint8 [E, R, C / 32], holds each block's E8M0 scale, 2^(s - 127), s = 255 meaning NaN. The tensors that have no
blocks (attention, router, biases, embeddings, lm_head: `modules_to_not_convert`) are stored unquantised.

Invariants:
  * A slice of X is dequantised from the experts and rows it covers and the column blocks that cover its columns,
    so a device reads only what it holds.
  * Exact: an FP4 value (two significant bits) times a power of two is formed in float32 without rounding,
    subnormals included (only |value| * 2^(s - 127) >= 2^128 overflows, to inf, as in any float32 or bfloat16
    reading); the caller casts it to the parameter dtype, which bfloat16 holds exactly too.
  * Blocks and scales are uint8, which safetensors' numpy reader slices itself (unlike FP8's float8 values).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

# `X` -> the tensors holding it.
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
# safetensors' dtype name of both.
PACKED_DTYPE = "U8"
# Values per block (one scale each), and the bytes holding them.
BLOCK = 32
BLOCK_BYTES = BLOCK // 2
# E2M1 codes 0..15 (sign bit, two exponent bits of bias 1, one mantissa bit; exponent 0 is subnormal).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)
# E8M0: a scale byte s is 2^(s - SCALE_BIAS), and SCALE_NAN is NaN.
SCALE_BIAS = 127
SCALE_NAN = 255

Index = tuple[slice, slice, slice]


def hub_shape(blocks_shape: tuple[int, ...]) -> tuple[int, int, int] | None:
  """The bf16 hub layout [E, C, R] of a tensor stored as blocks [E, R, C / 32, 16]; None for other block shapes."""
  if len(blocks_shape) != 4 or blocks_shape[-1] != BLOCK_BYTES:
    return None
  experts, rows, groups, _ = blocks_shape
  return experts, groups * BLOCK, rows


def dequantise(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """The values of MXFP4 blocks, row by row.

  Args:
    blocks: uint8 [..., R, G, 16], two FP4 codes a byte.
    scales: uint8 [..., R, G], a block's E8M0 scale.

  Returns:
    float32 [..., R, G * 32]: column 32 g + 2 j + k is byte j of block g's nibble k (0: low), times its scale.
  """
  codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)
  values = E2M1_VALUES[codes].reshape(*scales.shape, BLOCK)
  np.ldexp(values, scales.astype(np.int32)[..., None] - SCALE_BIAS, out=values)
  values[scales == SCALE_NAN] = np.nan
  return values.reshape(*scales.shape[:-1], -1)


def read_slice(read_blocks: Callable[[tuple[slice, ...]], np.ndarray],
               read_scales: Callable[[tuple[slice, ...]], np.ndarray], index: Index) -> np.ndarray:
  """Reads a slice of a tensor in its bf16 hub layout [E, C, R], dequantised from its MXFP4 blocks.

  Args:
    read_blocks: reads a slice of `X_blocks` [E, R, C / 32, 16].
    read_scales: reads a slice of `X_scales` [E, R, C / 32].
    index: the slice of X, a slice per axis (experts, columns, rows) with explicit start and stop.

  Returns:
    The slice, float32.
  """
  experts, cols, rows = index
  groups = slice(cols.start // BLOCK, -(-cols.stop // BLOCK))
  values = dequantise(read_blocks((experts, rows, groups, slice(0, BLOCK_BYTES))), read_scales((experts, rows, groups)))
  first = groups.start * BLOCK
  return values[..., cols.start - first:cols.stop - first].swapaxes(-1, -2)
