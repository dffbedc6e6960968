"""The one attention entry point of the models; implementations live in `ptx_kernels`.

Masking is defined by segment ids and positions alone (`ptx_kernels.mask`),
so the same call serves packed training batches, KV-cache decoding and
sequence-sharded layouts: query t sees key s when they share a non-zero
segment id, when `kv_position[s] <= q_position[t]` (causal), and, with a
sliding window, when `q_position[t] - kv_position[s] < window`. A query that
sees no key returns zeros, never NaN.

Implementations (`impl`):
  xla        materialised [T, S] logits (`dense_attention`): fastest for short sequences
  blockwise  pure-JAX flash attention with an O(T) custom VJP (the CPU choice)
  pallas     ptx's Pallas kernel of the backend (GPU: Triton-style, TPU: Mosaic)
  cudnn      cuDNN's flash attention (GPU, bf16/fp16; causal rows of one sequence each, right-padded:
             `ptx_kernels.cudnn_attention`)
  splash     JAX's splash attention (TPU; self-attention with segments, windows, soft-caps:
             `ptx_kernels.splash_attention`)
  ring       context parallelism: K/V blocks rotate over the `seq` mesh axis, and each
             hop runs the backend's Pallas kernel (blockwise on CPU)
  auto       (the default) the row of `ptx.models.attention_choice.TABLE` for the call: ring where the mesh
             splits the sequence, cuDNN on GPU and splash on TPU where they compute the call exactly, ptx's
             Pallas kernel where they cannot, xla or blockwise on CPU by length

Which calls cuDNN computes depends on what the segment ids hold, which
traced ids cannot say: the caller declares it (`rows`, "packed" by default,
`attention_choice.RowLayout`). An implementation named outright that cannot
compute a call is refused, naming it and the table's reason.

`interpret_pallas` lets CPU tests run the model's Pallas paths: inside it the
platform's Pallas kernel is one of the two, run through the Pallas interpreter.

Shapes: q [B, T, H, K]; k [B, S, N, K], v [B, S, N, Kv] with H a multiple of N
(grouped queries share a KV head without K/V being repeated); every
implementation takes values of another width than queries and keys (Kv != K,
multi-head latent attention) as they are, unpadded.

Attention sinks (`sinks`, gpt-oss): one learned logit per query head that joins
every softmax's denominator and carries no value. Every implementation applies
them the same way, to its finished (out, lse) through `ptx_kernels.with_sinks`:
the kernels' backward passes already take the lse's cotangent, so the gradients
reach q, k, v and the sinks with no kernel of its own; the ring applies them
once per row, after its hops are merged. Without sinks the program is unchanged.

Under a mesh, blockwise and pallas run per device inside `shard_map` (batch
and heads sharded as the activation rules say, the sequence whole): their
tile loops have trip counts that depend on each row's positions and segments,
and a collective that GSPMD placed inside them would deadlock devices whose
rows differ (seen with ragged, left-padded rollouts on data x fsdp). Ring
attention runs under its own shard_map over `seq`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import ptx_kernels
from jax.sharding import PartitionSpec
from ptx_kernels import implementation
from ptx_kernels import lse as lse_lib

from ptx import sharding
from ptx.models import attention_choice
from ptx.models.attention_choice import RowLayout

IMPLEMENTATIONS = ("xla", "blockwise", "pallas", "cudnn", "splash", "ring", "auto")
_TOKEN_MASKS = ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_positions")
# The Pallas kernel that `interpret_pallas` puts in the platform's place. A jit cache key: a program traced inside
# the block is never reused outside it, nor one traced outside reused inside.
_INTERPRETED = jax.make_user_context(None)


def interpret_pallas(kernel: str = "pallas_gpu"):
  """A context in which the platform's Pallas kernel is `kernel`, run through the Pallas interpreter.

  For tests on CPU: inside it impl "pallas" and "auto" run `kernel`, and "ring" runs it on each hop. The default
  is the GPU kernel, whose generic interpreter is ~100x faster than the TPU one.

  Args:
    kernel: "pallas_gpu" or "pallas_tpu".

  Returns:
    The context manager.
  """
  if kernel not in implementation.PALLAS:
    raise ValueError(f"interpret_pallas kernel must be one of {implementation.PALLAS}, got {kernel!r}")
  return _INTERPRETED(kernel)


def resolve(impl: str, *, q_len: int, kv_len: int, head_dim: int, v_head_dim: int | None = None,
            rules: sharding.Rules = sharding.DEFAULT_RULES, rows: RowLayout = "packed", dtype=jnp.float32,
            softcap: bool = False, sinks: bool = False, window=None) -> str:
  """The implementation `impl` runs as here: "auto" made concrete (`attention_choice.choose`), any other name itself.

  Every reader of `ModelConfig.attention_impl` asks this, so the attention that runs and the layout and routing
  chosen around it agree. "ring" (the mesh splits the sequence into blocks the ring takes: self-attention, a length
  that is a multiple of twice the shards) is decided by the sequence alone, so callers that only ask whether the
  ring runs may leave the other facts at their defaults.

  Args:
    impl: one of IMPLEMENTATIONS.
    q_len: queries per row.
    kv_len: keys per row.
    head_dim: the query and key head width.
    v_head_dim: the value head width (None: head_dim; multi-head latent attention's is narrower).
    rules: the activation rules (where the sequence is sharded).
    rows: what the segment ids hold (`attention_choice.RowLayout`).
    dtype: the inputs' dtype.
    softcap: whether the logits are soft-capped.
    sinks: whether the call has attention sinks.
    window: the sliding window (None, a Python int, or a traced scalar).

  Returns:
    "xla", "blockwise", "pallas", "cudnn", "splash" or "ring".

  Raises:
    ValueError: for an unknown name, or "cudnn" or "splash" named for a call they cannot compute (the reason).
  """
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention impl {impl!r} is not one of {IMPLEMENTATIONS}")
  need = need_of(q_len=q_len, kv_len=kv_len, head_dim=head_dim, v_head_dim=v_head_dim, rules=rules, rows=rows,
                 dtype=dtype, softcap=softcap, sinks=sinks, window=window)
  if impl == "auto":
    return attention_choice.choose(need).impl
  refusal = attention_choice.refusal(impl, need)
  if refusal is not None:
    raise ValueError(f"attention impl {impl!r} cannot run this call: {refusal}; use 'auto'")
  return impl


def need_of(*, q_len: int, kv_len: int, head_dim: int, v_head_dim: int | None = None,
            rules: sharding.Rules = sharding.DEFAULT_RULES, rows: RowLayout = "packed", dtype=jnp.float32,
            softcap: bool = False, sinks: bool = False, window=None) -> attention_choice.Need:
  """The facts of a call that choose its kernel (`resolve`'s arguments), on this backend and mesh."""
  v_head_dim = v_head_dim or head_dim
  shards = sequence_shards(rules)
  platform = platform_kernel()
  backend = jax.default_backend()
  if platform is not None:
    backend = implementation.PLATFORM[platform.name]
  return attention_choice.Need(
      platform=backend if backend in ("gpu", "tpu") else "cpu",
      interpreted=platform is not None and platform.interpret,
      ring=shards > 1 and q_len == kv_len and q_len % (2 * shards) == 0,  # the ring's blocks, in either layout
      rows=rows, self_attention=q_len == kv_len, pairs=q_len * kv_len, head_dim=head_dim, v_head_dim=v_head_dim,
      half_precision=jnp.dtype(dtype).itemsize == 2, softcap=softcap, sinks=sinks,
      window=None if window is None else "static" if isinstance(window, (int, np.integer)) else "traced",
      pallas_takes_heads=platform is None or all(platform.takes_head_dim(d) for d in (head_dim, v_head_dim)))


def sequence_shards(rules: sharding.Rules) -> int:
  """How many devices of the current mesh the activation rules split the sequence over (1: none)."""
  mesh = jax.sharding.get_abstract_mesh()
  axis = rules.activations.get("seq")
  return mesh.shape[axis] if not mesh.empty and isinstance(axis, str) and axis in mesh.axis_names else 1


def platform_kernel() -> implementation.Kernel | None:
  """The platform's Pallas kernel (the interpreted stand-in inside `interpret_pallas`); None on CPU."""
  if _INTERPRETED.value is not None:
    return implementation.Kernel(_INTERPRETED.value, interpret=True)
  kernel = implementation.choose("auto")
  return None if kernel.name == "blockwise" else kernel


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    segment_ids: jax.Array,
    positions: jax.Array,
    impl: str = "xla",
    kv_segment_ids: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    window: jax.Array | int | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    rules: sharding.Rules = sharding.DEFAULT_RULES,
    ring_heads_per_pass: int | None = None,
    sinks: jax.Array | None = None,
    rows: RowLayout = "packed",
) -> jax.Array:
  """Causal grouped-query attention with packing, windows and soft-capping.

  Args:
    q: queries [B, T, H, K].
    k: keys [B, S, N, K].
    v: values [B, S, N, Kv] (Kv may differ from K).
    segment_ids: int32 [B, T] segment of each query (0 marks padding).
    positions: int32 [B, T] position of each query within its sequence.
    impl: one of IMPLEMENTATIONS.
    kv_segment_ids: int32 [B, S]; defaults to `segment_ids` (self-attention).
    kv_positions: int32 [B, S]; defaults to `positions`.
    window: sliding-window size in tokens (a Python int or a traced int32
      scalar, as per-layer windows are scanned); None attends to all the past.
    softcap: tanh soft-cap on the logits, `cap * tanh(logits / cap)`.
    scale: logit scale; defaults to K ** -0.5.
    rules: the activation rules that say how batch and heads are sharded.
    ring_heads_per_pass: query heads per ring pass (`ptx_kernels.ring_attention`).
    sinks: float32 [H] attention-sink logits of this layer's query heads
      (`ptx_kernels.with_sinks`); None: no sinks.
    rows: what the segment ids hold (`attention_choice.RowLayout`): "padded_right" promises one sequence per row
      from column 0 with positions 0, 1, ..., which lets cuDNN compute it.

  Returns:
    The attention output [B, T, H, Kv] in the dtype of `q`.
  """
  if sinks is not None:  # before any shard_map splits them
    lse_lib.check_sinks(sinks, q.shape[2])
  impl = resolve(impl, q_len=q.shape[1], kv_len=k.shape[1], head_dim=q.shape[-1], v_head_dim=v.shape[-1],
                 rules=rules, rows=rows, dtype=q.dtype, softcap=softcap is not None, sinks=sinks is not None,
                 window=window)
  masks = dict(q_segment_ids=segment_ids, q_positions=positions,
               kv_segment_ids=segment_ids if kv_segment_ids is None else kv_segment_ids,
               kv_positions=positions if kv_positions is None else kv_positions,
               causal=True, window=window, softcap=softcap, scale=scale)
  if impl == "xla":
    return _output(ptx_kernels.dense_attention(q, k, v, **masks), sinks)
  platform = platform_kernel()
  if impl in ("cudnn", "splash"):  # `resolve` refused calls they cannot compute, sinks among them
    vendor = functools.partial(_vendor, impl, interpret=platform is not None and platform.interpret)
    # Neither kernel's custom call says how its outputs vary over the mesh (splash's pallas_call fails the check).
    return _per_device(vendor, q, k, v, masks, rules, None, check_vma=False)
  if impl == "pallas" and platform is None:
    raise ValueError(f"attention impl 'pallas' needs a GPU or TPU, not {jax.default_backend()!r}; use 'blockwise' "
                     "or 'auto'")
  kernel = implementation.Kernel("blockwise") if impl == "blockwise" or platform is None else platform
  if impl == "ring":
    if jax.sharding.get_abstract_mesh().empty:
      raise ValueError("attention impl 'ring' runs over the `seq` axis of the current mesh; none is set")
    return _output(ptx_kernels.ring_attention(q, k, v, heads_per_pass=ring_heads_per_pass, impl=kernel.name,
                                              interpret=kernel.interpret, **masks), sinks)
  flash = functools.partial(ptx_kernels.flash_attention, impl=kernel.name, interpret=kernel.interpret)
  return _per_device(flash, q, k, v, masks, rules, sinks, check_vma=kernel.checks_vma)


def _output(out_lse: tuple[jax.Array, jax.Array], sinks: jax.Array | None) -> jax.Array:
  """The attention output of an implementation's (out, lse), with the sinks applied where there are any."""
  out, lse = out_lse
  return out if sinks is None else ptx_kernels.with_sinks(out, lse, sinks)[0]


def _vendor(impl: str, q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal, window,
            softcap, scale, interpret: bool) -> tuple[jax.Array, None]:
  """(out, no lse) of cuDNN or splash under ptx's masks, on the rows `resolve` let them take."""
  del kv_positions, causal  # both are by index, as `resolve`'s checks of the call promise
  if impl == "cudnn":  # right-padded rows: a row's length is its count of non-padding tokens
    del kv_segment_ids, q_positions, softcap
    return ptx_kernels.cudnn_attention(q, k, v, lengths=jnp.sum(q_segment_ids != 0, axis=1), window=window,
                                       scale=scale), None
  del q_positions
  return ptx_kernels.splash_attention(q, k, v, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                      window=None if window is None else int(window), softcap=softcap, scale=scale,
                                      interpret=interpret), None


def _per_device(flash, q, k, v, masks, rules: sharding.Rules, sinks, *, check_vma: bool) -> jax.Array:
  """Runs `flash(q, k, v, **masks) -> (out, lse)` on each device's rows and heads under shard_map (whole sequences).

  `check_vma`: whether shard_map may check varying manual axes (`implementation.Kernel.checks_vma`).
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return _output(flash(q, k, v, **masks), sinks)
  spec = lambda names, x: sharding.logical_to_spec(names, rules, shape=x.shape, mesh=mesh)
  q_spec = spec(("batch", None, "heads", None), q)
  kv_spec = spec(("batch", None, "kv_heads", None), k)
  if q_spec[2] != kv_spec[2]:  # Grouped heads stay together: shard both or neither.
    q_spec = kv_spec = PartitionSpec(q_spec[0], None, None, None)
  # Per-token masks are [B, T] arrays; a traced window scalar is replicated.
  arrays = {name: jnp.asarray(x) for name, x in masks.items()
            if name in _TOKEN_MASKS or (name == "window" and isinstance(x, jax.Array))}
  static = {name: x for name, x in masks.items() if name not in arrays}
  specs = {name: PartitionSpec() if name == "window" else PartitionSpec(q_spec[0], None) for name in arrays}

  sinks_spec = PartitionSpec(q_spec[2])  # split like q's heads; None (no sinks) is an empty tree

  def local(q, k, v, arrays, sinks):
    return _output(flash(q, k, v, **arrays, **static), sinks)

  return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, specs, sinks_spec), out_specs=q_spec,
                       check_vma=check_vma)(q, k, v, arrays, sinks)
