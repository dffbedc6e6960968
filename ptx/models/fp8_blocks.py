"""FP8 block-scaled checkpoint weights (DeepSeek-V3, Kimi K2, Qwen3 *-FP8), dequantised on read.

The format: config.json holds `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [bm, bn]}`, and each quantised linear weight
`X.weight` ([out, in]) is stored as float8 e4m3 next to `X.weight_scale_inv`, float32 (or bfloat16) of
shape [ceil(out / bm), ceil(in / bn)]. The weight is `weight * scale_inv`, scale (i, j) covering rows
[i bm, (i + 1) bm) and columns [j bn, (j + 1) bn), the last block of an axis cut short where bm or bn
does not divide it. Tensors without a scale (norms, embeddings, lm_head, MoE routers,
`modules_to_not_convert`) are stored unquantised. A `scale_fmt` of "ue8m0" (DeepSeek-V3.1) only says
that the stored scales are powers of two, so it reads the same way.

Invariants:
  * A slice of a weight is dequantised from the same slice of float8 values and from the rows and
    columns of the scale grid that cover it, so a device reads only what it holds.
  * The product is formed in float32: exact up to one rounding, e4m3 values holding 4 significant
    bits; the caller casts it to the parameter dtype.
  * safetensors' numpy reader has no float8 type, so the float8 values are read from the file's
    bytes at the offsets of its header, through a memory map of which only the slice's pages are
    read (its torch reader would make torch a dependency of loading).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from ptx.models.hf_config import HFConfigError

# safetensors dtype names: of the quantised weights, and of the scales numpy reads (with ml_dtypes' bfloat16).
E4M3 = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16")
# `X.weight` -> `X.weight_scale_inv`.
SCALE_SUFFIX = "_scale_inv"

Index = tuple[slice, slice]


def block_size(quantization: dict[str, Any], where: str) -> tuple[int, int]:
  """The weight block size of a config.json's FP8 `quantization_config` (quant_method "fp8").

  Args:
    quantization: config.json's `quantization_config`.
    where: the file, for error messages.

  Returns:
    (rows, columns) of a scale block.

  Raises:
    HFConfigError: naming the field, for FP8 that ptx does not read: another float8 format, static activation
      scales (calibrated to quantise activations, which a dequantised model would drop silently), or per-tensor
      scales (no `weight_block_size`).
  """
  # transformers' FP8 config has no `fmt`: e4m3 is the only format it reads.
  fmt = quantization.get("fmt", "e4m3")
  if fmt != "e4m3":
    raise HFConfigError(f"{where}: quantization_config fmt={fmt!r} is not supported; ptx reads quant_method 'fp8' "
                        "with fmt 'e4m3' (float8 weights with block scales)")
  scheme = quantization.get("activation_scheme", "dynamic")
  if scheme != "dynamic":
    raise HFConfigError(f"{where}: quantization_config activation_scheme={scheme!r} is not supported; ptx reads "
                        "'dynamic' (weights alone quantised)")
  block = quantization.get("weight_block_size")
  if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
    raise HFConfigError(f"{where}: quantization_config weight_block_size={block!r} is not two positive integers "
                        "(per-tensor FP8 scales are not supported)")
  return block[0], block[1]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
  """The shape of the scale grid of a weight of `shape` (every block, the cut-short last ones too)."""
  return tuple(-(-n // b) for n, b in zip(shape, block))


def read_e4m3(file: str | os.PathLike, offset: int, shape: tuple[int, int], index: Index) -> np.ndarray:
  """Reads the slice `index` of a float8 e4m3 tensor from its bytes in a safetensors file.

  Args:
    file: the safetensors file.
    offset: the tensor's first byte in the file (past the header).
    shape: the tensor's shape.
    index: a slice per axis.

  Returns:
    The slice, of dtype float8_e4m3fn.
  """
  data = np.memmap(file, np.uint8, "r", offset=offset, shape=shape)
  # A copy, so that the map is closed once `data` goes out of scope.
  return np.array(data[index]).view(jnp.float8_e4m3fn)


def read_slice(read_values: Callable[[Index], np.ndarray], read_scales: Callable[[Index], np.ndarray], index: Index,
               block: tuple[int, int]) -> np.ndarray:
  """Reads a slice of a dequantised weight: its float8 values and the scales that cover them.

  Args:
    read_values: reads a slice of the float8 weight.
    read_scales: reads a slice of its scale grid (`weight_scale_inv`).
    index: the slice of the weight, a slice per axis with explicit start and stop.
    block: (rows, columns) of a scale block.

  Returns:
    The slice of `weight * scale_inv`, float32.
  """
  grid = tuple(slice(s.start // b, -(-s.stop // b)) for s, b in zip(index, block))
  scales = read_scales(grid).astype(np.float32)
  # Each row's (column's) block, counted from the first block read.
  rows, cols = (np.arange(s.start, s.stop) // b - g.start for s, b, g in zip(index, block, grid))
  return read_values(index).astype(np.float32) * scales[rows][:, cols]
