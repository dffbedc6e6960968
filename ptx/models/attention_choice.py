"""Which attention kernel runs a call when the model says "auto": one table, a reason per row.

`choose(need)` walks `TABLE` top to bottom and returns the first row whose
platform matches and whose condition holds for `need`, the static facts of a
call (platform, dtype, head widths, masks, row layout, mesh). Every reader
of `ModelConfig.attention_impl="auto"` (`ptx.models.attention.resolve`) asks
it, and a training run prints the row its steps take (`ptx.train.loop.fit`),
so the choice is made once per model and layout, in this one place.

The rows say what the measurements say (benchmarks/RESULTS.md):
cuDNN through `jax.nn.dot_product_attention` ran 188-634 TFLOP/s on an H200
where ptx's Pallas kernel ran 65-118 (12-04), so a GPU takes cuDNN wherever
cuDNN can compute the call exactly; on TPU JAX's splash attention, which
MaxText and Tunix train with at scale, runs until ptx's own TPU kernel has
been checked and timed on a TPU. The CPU rows keep what the CPU suite
measured. A call cuDNN or splash cannot express goes to ptx's kernel of the
platform, and each such row says what is missing.

Row layouts (what a call's segment ids can hold; the caller declares it,
since ids are traced values):
  packed        any segment ids: several sequences per row, padding (0)
                anywhere, e.g. packed SFT rows and GRPO's left-padded rows
  padded_right  one sequence per row from column 0, then padding, positions
                0, 1, ...: unpacked SFT rows and DPO's rows; cuDNN reads such
                a row as its length
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Literal

RowLayout = Literal["packed", "padded_right"]
ROW_LAYOUTS = ("packed", "padded_right")
Platform = Literal["cpu", "gpu", "tpu"]
# On CPU the materialised logits are the fastest while one row and head's [T, S] block stays small (1K x 1K: 4 MiB
# of float32; blockwise took 14% more CPU time on the short-sequence model, step and sampler tests); longer
# sequences take the blockwise kernel and its O(T) memory.
CPU_DENSE_MAX_PAIRS = 1024 * 1024
# cuDNN's flash attention takes head widths that are multiples of 8 up to 256 on Hopper and later (128 before);
# the dispatch assumes Hopper, and an older GPU's refusal names the width (jax's fused_attention_stablehlo).
CUDNN_MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class Need:
  """The static facts of an attention call that decide its kernel."""

  platform: Platform
  # The platform's Pallas kernel runs in the Pallas interpreter (`attention.interpret_pallas`: CPU tests).
  interpreted: bool = False
  # The activation rules split the sequence over the mesh into blocks the ring takes.
  ring: bool = False
  # What the segment ids hold (module docstring).
  rows: RowLayout = "packed"
  # Queries and keys are the same tokens (q_len == kv_len); False for queries against a longer prefix.
  self_attention: bool = True
  # Queries per row times keys per row.
  pairs: int = 0
  # The query/key head width and the value head width (narrower in multi-head latent attention).
  head_dim: int = 128
  v_head_dim: int = 128
  # The inputs are 16-bit floats (cuDNN computes bf16 and fp16 only).
  half_precision: bool = True
  # A tanh soft-cap on the logits.
  softcap: bool = False
  # Attention sinks, which need the lse's gradient (`ptx_kernels.with_sinks`).
  sinks: bool = False
  # The sliding window: None, "static" (a Python int) or "traced" (a per-layer window scanned with the layers).
  window: Literal["static", "traced"] | None = None
  # The platform's Pallas kernel takes these head widths (the GPU kernel: powers of two >= 16).
  pallas_takes_heads: bool = True

  @property
  def cudnn_takes_heads(self) -> bool:
    """Whether cuDNN's flash attention takes the head widths (equal, a multiple of 8, at most 256)."""
    return self.head_dim == self.v_head_dim and self.head_dim % 8 == 0 and self.head_dim <= CUDNN_MAX_HEAD_DIM

  @property
  def cudnn_computes(self) -> bool:
    """Whether cuDNN computes the call exactly: no GPU row that routes calls away from it holds (`refusal`)."""
    return refusal("cudnn", dataclasses.replace(self, platform="gpu", interpreted=False)) is None


@dataclasses.dataclass(frozen=True)
class Row:
  """One row of the table: on `platform`, when `when(need)`, run `impl`, because `reason`."""

  platform: Platform | None  # None: every platform
  when: Callable[[Need], bool]
  impl: str
  reason: str


def _always(need: Need) -> bool:
  del need
  return True


TABLE: tuple[Row, ...] = (
    Row(None, lambda n: n.ring, "ring",
        "the mesh splits the sequence: K/V blocks rotate and each hop runs ptx's kernel, which returns the lse "
        "that merges hops (cuDNN's and splash's carry no gradient)"),
    Row(None, lambda n: n.interpreted and n.pallas_takes_heads, "pallas",
        "the Pallas interpreter stands in for the platform's kernel (CPU tests)"),
    Row(None, lambda n: n.interpreted, "xla", "the interpreted Pallas kernel takes no such head width"),
    Row("cpu", lambda n: n.pairs <= CPU_DENSE_MAX_PAIRS, "xla",
        "materialised logits are the fastest on CPU while a row and head's [T, S] block stays small"),
    Row("cpu", _always, "blockwise", "pure-JAX flash attention: O(T) memory for long sequences on CPU"),
    Row("gpu", lambda n: not n.pallas_takes_heads and not n.cudnn_computes, "xla",
        "cuDNN cannot compute this call and ptx's GPU kernel needs head widths that are powers of two >= 16"),
    Row("gpu", lambda n: n.sinks, "pallas", "sinks need the lse's gradient; cuDNN's returned lse has none"),
    Row("gpu", lambda n: n.softcap, "pallas", "cuDNN has no logit soft-cap"),
    Row("gpu", lambda n: n.rows == "packed", "pallas",
        "cuDNN masks by causality and a length per row; packed segments and left padding need segment ids"),
    Row("gpu", lambda n: n.window == "traced", "pallas",
        "cuDNN fixes the window at compile time; a scanned per-layer window is traced"),
    Row("gpu", lambda n: not n.self_attention, "pallas",
        "cuDNN's causal mask is by index, for queries and keys that are the same tokens"),
    Row("gpu", lambda n: not n.half_precision, "pallas", "cuDNN computes bf16 and fp16 only"),
    Row("gpu", lambda n: not n.cudnn_takes_heads, "pallas",
        f"cuDNN needs equal query/key and value widths, multiples of 8 up to {CUDNN_MAX_HEAD_DIM}"),
    Row("gpu", _always, "cudnn",
        "causal, GQA, right padding and fixed windows: cuDNN ran 188-634 TFLOP/s where ptx's Pallas kernel ran "
        "65-118 (H200, 12-04)"),
    Row("tpu", lambda n: n.sinks, "pallas", "sinks need the lse's gradient; splash returns none"),
    Row("tpu", lambda n: not n.self_attention, "pallas",
        "splash masks by index, for queries and keys that are the same tokens"),
    Row("tpu", lambda n: n.window == "traced", "pallas",
        "splash's masks are fixed at compile time; a scanned per-layer window is traced"),
    Row("tpu", _always, "splash",
        "JAX's splash attention is proven at scale (MaxText, Tunix); ptx's TPU kernel has only run interpreted"),
)


def choose(need: Need) -> Row:
  """The first row of `TABLE` for `need`'s platform whose condition holds."""
  for row in TABLE:
    if row.platform in (None, need.platform) and row.when(need):
      return row
  raise AssertionError(f"no attention row for {need}")  # every platform ends with an unconditional row


# The platform each vendor kernel runs on, and the kernel that stands in for it in the Pallas interpreter.
_VENDOR = {"cudnn": "gpu", "splash": "tpu"}


def refusal(impl: str, need: Need) -> str | None:
  """Why `impl`, named outright, cannot compute the call `need` describes; None when it can.

  cuDNN and splash are refused for the reason of the first row that routes their platform's calls away from
  them; splash also runs in the TPU interpreter (`need.interpreted`), cuDNN only on a GPU. Other implementations
  are checked where they run (`ptx.models.attention.attention`, `ptx_kernels.implementation.choose`).
  """
  platform = _VENDOR.get(impl)
  if platform is None:
    return None
  if need.platform != platform or (need.interpreted and impl == "cudnn"):
    return f"{impl} runs on a {platform.upper()} only, not on {need.platform!r}" + (
        " (interpreted)" if need.interpreted else "")
  for row in TABLE:
    if row.platform != platform or row.impl == "xla":
      continue
    if row.impl == impl:
      return None
    if row.when(need):
      return row.reason
  raise AssertionError(f"{impl} has no row in TABLE")
