"""The flash kernels behind one interface: which one runs, its rules, and its calls.

Three kernels compute the same attention (the rule of `mask.py`) from the same
pieces: "blockwise" (pure JAX, any backend), "pallas_gpu" (Triton-style) and
"pallas_tpu" (Mosaic); "auto" names the default backend's Pallas kernel, and
blockwise elsewhere. `flash_attention` runs one over whole sequences and
`ring_attention` runs one on each ring hop, so both choose, check and call it
here and raise the same errors.

A hop's forward folds (out, lse) over its keys into a float32 accumulator
through the LSE; its backward, given the LSE and delta of the attention over
all keys, adds that hop's exact share of dQ, dK and dV into float32
accumulators. Inputs are tile multiples (callers pad with segment id 0).
"""

import dataclasses
import types

import jax
import jax.numpy as jnp

from ptx_kernels import blockwise
from ptx_kernels import lse as lse_lib
from ptx_kernels import pallas_gpu
from ptx_kernels import pallas_tpu
from ptx_kernels.block_sizes import BlockSizes

IMPLS = ("auto", "blockwise", "pallas_gpu", "pallas_tpu")
PALLAS = ("pallas_gpu", "pallas_tpu")
_PALLAS = dict(zip(PALLAS, (pallas_gpu, pallas_tpu)))
# The platform each Pallas kernel compiles for.
PLATFORM = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}
_AUTO = {backend: name for name, backend in PLATFORM.items()}
# Triton's tensor-core dots need tiles of at least 16 rows; TPU tiles are
# (8, 128) vregs.
_MIN_TILE = {"blockwise": 1, "pallas_gpu": 16, "pallas_tpu": 128}
# Tiles when the caller names none, by kernel and input width in bytes. The GPU
# kernel keeps its q, k, v tiles and accumulators in shared memory and
# registers, where BlockSizes()' 512 x 512 (sized for TPU VMEM) does not fit:
# 16-bit inputs take 128 x 64 (what its benchmark times); float32 inputs take
# 64 x 32, since at 128 x 64 Triton's compile of one float32 forward+backward
# ran past a minute on the H200 (benchmarks/RESULTS.md, 12-04 third run).
_DEFAULT_TILES = {("pallas_gpu", 2): BlockSizes(128, 64),
                  ("pallas_gpu", 4): BlockSizes(64, 32)}


def default_tiles(name: str, dtype) -> BlockSizes:
  """The tiles kernel `name` runs on inputs of `dtype` when the caller names none."""
  return _DEFAULT_TILES.get((name, jnp.dtype(dtype).itemsize), BlockSizes())


@dataclasses.dataclass(frozen=True)
class Kernel:
  """One concrete kernel (never "auto"); hashable, so a custom VJP can hold it static."""

  name: str
  interpret: bool = False  # run a Pallas kernel through the Pallas interpreter (CPU)

  @property
  def _pallas(self) -> types.ModuleType | None:
    """The Pallas module of this kernel, None for blockwise."""
    return _PALLAS.get(self.name)

  @property
  def checks_vma(self) -> bool:
    """Whether a shard_map around this kernel may check varying manual axes.

    The generic Pallas interpreter (interpreted pallas_gpu) evaluates the
    kernel body on shard_map's varying values, and the body's loops, which
    start from fresh constants, then fail the check (jax 0.10.2).
    """
    return not (self.interpret and self.name == "pallas_gpu")

  def static(self, block_sizes: BlockSizes | None, q_len: int, kv_len: int,
             head_dim: int, dtype, *, causal: bool, softcap,
             scale) -> blockwise.Static:
    """Compile-time settings; tiles fit the sequences and the kernel's minimum."""
    tiles = (block_sizes or default_tiles(self.name, dtype)).clamp(
        q_len, kv_len, minimum=_MIN_TILE[self.name])
    return blockwise.Static(
        causal=causal, softcap=None if softcap is None else float(softcap),
        scale=head_dim ** -0.5 if scale is None else float(scale),
        block_q=tiles.block_q, block_kv=tiles.block_kv)

  def takes_head_dim(self, head_dim: int) -> bool:
    """Whether the kernel runs heads of this width (only the GPU kernel has a rule)."""
    return self.name != "pallas_gpu" or pallas_gpu.takes_head_dim(head_dim)

  def check(self, q: jax.Array, v: jax.Array) -> None:
    """Raises ValueError if the kernel cannot run on q [B,T,H,D], v [B,S,KV,Dv]."""
    if self.name == "pallas_gpu":
      pallas_gpu.check_head_dims(q.shape, v.shape)

  def attention(self, q, k, v, mi, st: blockwise.Static):
    """Differentiable (out [B,T,H,Dv] in q.dtype, lse [B,H,T]) over all keys."""
    if self._pallas is None:
      return blockwise.attention(q, k, v, mi, st)
    return self._pallas.attention(q, k, v, mi, st, self.interpret)

  def forward(self, q, k, v, mi, st: blockwise.Static, acc):
    """acc = (out [B,T,H,Dv] f32, lse [B,H,T]) with these keys' attention merged in."""
    if self._pallas is None:
      return blockwise.forward(q, k, v, mi, st, acc=acc)
    # Float32, as the backward's shares: a bf16 output per hop would round
    # what the float32 accumulator keeps.
    out, lse = self._pallas.forward(q, k, v, mi, st, self.interpret,
                                    jnp.float32)
    return lse_lib.merge_lse([acc[0], out], [acc[1], lse])

  def backward(self, q, k, v, mi, st: blockwise.Static, lse, delta, dout,
               grads):
    """grads = (dq, dk, dv) float32 plus these keys' share, given the full lse and delta."""
    if self._pallas is None:
      return blockwise.backward(q, k, v, mi, st, lse, delta, dout, grads)
    # Float32 shares: a ring adds one per hop, and rounding each to bf16
    # first would lose what the float32 accumulators keep.
    share = self._pallas.backward(q, k, v, mi, st, lse, delta,
                                  dout.astype(q.dtype), self.interpret,
                                  jnp.float32)
    return tuple(g + s for g, s in zip(grads, share))


def choose(impl: str, interpret: bool = False, portable: str = "blockwise") -> Kernel:
  """The kernel that `impl` names, checked against the default backend.

  Args:
    impl: one of IMPLS; "auto" is the default backend's Pallas kernel (TPU or
      GPU) and "blockwise" elsewhere.
    interpret: run a Pallas kernel through the Pallas interpreter (on CPU).
    portable: what the caller calls its pure-JAX kernel, for the error
      message (`ptx_kernels.paged` calls it "xla").

  Returns:
    The concrete kernel.

  Raises:
    ValueError: for an unknown name, or a Pallas kernel that the default
      backend cannot run uninterpreted.
  """
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  backend = jax.default_backend()
  if impl == "auto":
    impl = _AUTO.get(backend, "blockwise")
  needs = PLATFORM.get(impl)
  if needs is not None and not interpret and backend != needs:
    raise ValueError(
        f"impl {impl!r} runs on a {needs.upper()}, not on {backend!r}: pass "
        f"interpret=True for the Pallas interpreter, or use {portable!r}")
  return Kernel(impl, interpret)
