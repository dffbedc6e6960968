"""GPU (H200) check: ptx Pallas flash attention vs cuDNN, one JSON line each.

  python benchmarks/attention_gpu.py
  python benchmarks/attention_gpu.py --seq-lens 8192 32768 --repeats 5

First checks correctness on small shapes (Pallas kernel and cuDNN against the
float32 reference, forward and gradients, in float32 and bfloat16; the Pallas
kernel also with packed segments, a sliding window and a soft-cap), then times
causal forward and forward+backward at each length (batch 1, head_dim 128,
GQA 8:1, bf16) and
prints TFLOP/s (causal FLOPs: fwd 2*B*H*T*T*D, fwd+bwd 3.5x that) and the
compiled memory of each forward+backward. Errors (e.g. out of memory)
are reported as JSON lines instead of stopping the run. Goal: Pallas forward
>= 60% of cuDNN's TFLOP/s, and the 1M-token forward+backward fits.

benchmarks/device_check.py reuses the pieces: `check` for the kernel checks,
`bench` over other kernels (ptx's default attention as a model runs it,
`model_default`, for each row layout a model declares; a candidate rewrite
of the GPU kernel run in the kernel's place, `gpu_kernel`) and `peers`.
"""

import argparse
import contextlib
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import ptx_kernels as pk
from ptx_kernels import implementation


def _emit(**row):
  """Prints one JSON line."""
  print(json.dumps(row), flush=True)


def cudnn(q, k, v):
  """jax.nn's cuDNN flash attention (causal), shaped like ptx_kernels'."""
  out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                     implementation="cudnn")
  return out, None


def pallas(tiles, q, k, v, interpret=False, **masks):
  """The ptx GPU kernel with the given tiles (interpreted on CPU when `interpret`)."""
  return pk.flash_attention(q, k, v, impl="pallas_gpu", block_sizes=tiles, interpret=interpret, **masks)


# The correctness check's cases, in the order it runs them: GQA, packing, window + soft-cap (`_cases`).
CASES = ("gqa_causal", "gqa_packed", "mqa_window_softcap")


def _cases(b, t):
  """{name: (q heads, kv heads, mask arguments)} of each of CASES at batch b and length t."""
  # Three documents of t/2, t/4 and t/8 tokens, then padding (segment 0), in every row.
  lengths = [t // 2, t // 4, t // 8, t - t // 2 - t // 4 - t // 8]
  seg = jnp.asarray(np.broadcast_to(np.repeat([1, 2, 3, 0], lengths), (b, t)), jnp.int32)
  return {"gqa_causal": (8, 2, {}),
          "gqa_packed": (8, 2, dict(q_segment_ids=seg, kv_segment_ids=seg)),
          "mqa_window_softcap": (8, 1, dict(window=t // 8, softcap=5.0))}


@contextlib.contextmanager
def gpu_kernel(module):
  """Inside the block, ptx_kernels' "pallas_gpu" kernel is `module`: a candidate rewrite with pallas_gpu's functions.

  The kernel module is looked up when a call is traced, so a program traced inside the block runs `module`, its
  backward too (the custom VJP it traced is `module`'s), and one traced outside runs ptx_kernels.pallas_gpu.
  """
  saved = implementation._PALLAS["pallas_gpu"]
  implementation._PALLAS["pallas_gpu"] = module
  try:
    yield
  finally:
    implementation._PALLAS["pallas_gpu"] = saved


def with_gpu_kernel(module, attention):
  """`attention` traced with `module` as the "pallas_gpu" kernel (`gpu_kernel`), for `bench`."""
  def traced(*args):
    with gpu_kernel(module):
      return attention(*args)
  return traced


def _fwd_bwd(attention):
  """Jitted ((dq, dk, dv), out): the gradients of <out, dout> in q, k, v, and out, from one program."""
  def loss(q, k, v, dout):
    out = attention(q, k, v)[0]
    return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out
  return jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))


def _rel_err(got, want) -> float:
  """max |got - want| / max |want| in float32."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# Bound on each relative error per input dtype, as tests/kernels/conftest.py's assert_matches sets them: 1e-5 for
# float32 inputs, where only the order of the float32 sums differs; 1e-2 for bfloat16 inputs, whose outputs and
# gradients keep 8 mantissa bits (a rounding of up to 2^-9 at each of several steps) while every kernel accumulates
# in float32.
TOLERANCES = {"float32": 1e-5, "bfloat16": 1e-2}


def check(tiles, b=2, t=1024, d=128, interpret=False, dtypes=tuple(TOLERANCES), cases=CASES, with_cudnn=True):
  """Yields one row per case, dtype and kernel: max relative errors against the f32 reference, fwd and bwd.

  `tiles` None checks the kernel's default tiles per dtype (`pk.default_tiles`), what a model runs. `cases` names
  those of CASES to check, in this order; `with_cudnn` adds cuDNN's rows on a GPU.

  Every Pallas row comes before the cuDNN ones, so a cuDNN call that hangs (one did on the H200 on 12-04, the
  section's limit cutting the rest) costs no Pallas row; each check says on stderr what it starts.
  """
  keys = jax.random.split(jax.random.key(0), 4)
  # cuDNN flash attention takes fp16/bf16 only, and jax.nn's call has no segment ids or soft-cap.
  cudnn_rows = with_cudnn and jax.default_backend() == "gpu"
  table = _cases(b, t)
  runs = [("pallas_gpu", case) for case in cases] + [("cudnn", case) for case in cases if cudnn_rows]
  for name, case in runs:
    h, kv, masks = table[case]
    for dtype in dtypes:
      if name == "cudnn" and (dtype != "bfloat16" or masks):
        continue
      print(f"check: {case} {name} {dtype}", file=sys.stderr, flush=True)
      tol = TOLERANCES[dtype]
      q = jax.random.normal(keys[0], (b, t, h, d), dtype)
      k = jax.random.normal(keys[1], (b, t, kv, d), dtype)
      v = jax.random.normal(keys[2], (b, t, kv, d), dtype)
      dout = jax.random.normal(keys[3], q.shape, dtype)
      f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
      want_grads, want = _fwd_bwd(functools.partial(pk.reference_attention, **masks))(*f32)
      attention = cudnn if name == "cudnn" else functools.partial(pallas, tiles, interpret=interpret, **masks)
      row = dict(bench="attention_gpu_check", case=case, impl=name, dtype=dtype, batch=b,
                 seq_len=t, heads=h, kv_heads=kv, head_dim=d)
      if name == "pallas_gpu":
        used = tiles or pk.default_tiles("pallas_gpu", dtype)
        row.update(block_q=used.block_q, block_kv=used.block_kv)
      try:
        grads, out = _fwd_bwd(attention)(q, k, v, dout)
        errs = [_rel_err(out, want)] + [_rel_err(g, w) for g, w in zip(grads, want_grads)]
        yield dict(row, rel_err_out=errs[0], rel_err_dq=errs[1], rel_err_dk=errs[2], rel_err_dv=errs[3],
                   tolerance=tol, ok=max(errs) < tol)
      except Exception as e:  # Report and carry on with the other checks.
        yield dict(row, error=repr(e)[:500])


def check_paged(t_new=(1, 16), rows=8, pages_per_row=16, page_size=16, d=64, interpret=False,
                dtypes=tuple(TOLERANCES)):
  """Yields one row per case, dtype and query count: the Pallas paged kernel's relative error against the pure-JAX
  paged path in float32, forward (what the rollout engine runs with attention_impl="pallas").

  Rows of ragged lengths (a quarter of a page up to all `pages_per_row` pages) read their pages, shuffled over the
  pool, with t_new queries each at their last positions: 1 is a decode step, 16 a prefill chunk.
  """
  rng = np.random.default_rng(0)
  pool = 1 + rows * pages_per_row
  lengths = rng.integers(page_size // 4, pages_per_row * page_size + 1, rows).astype(np.int32)
  order = rng.permutation(np.arange(1, pool)).reshape(rows, pages_per_row)
  held = [order[r, :-(-int(n) // page_size)] for r, n in enumerate(lengths)]
  pair_rows = np.repeat(np.arange(rows, dtype=np.int32), [len(p) for p in held])
  pages = np.concatenate(held).astype(np.int32)
  index = np.concatenate([np.arange(len(p), dtype=np.int32) for p in held])
  for case, h, kv, masks in (("gqa", 8, 2, {}), ("mqa_window_softcap", 8, 1, dict(window=24, softcap=5.0))):
    for t in t_new:
      keys = jax.random.split(jax.random.key(t), 3)
      q_positions = jnp.asarray(np.maximum(lengths[:, None] - t + np.arange(t)[None], 0), jnp.int32)
      for dtype in dtypes:
        print(f"check_paged: {case} t={t} {dtype}", file=sys.stderr, flush=True)
        q = jax.random.normal(keys[0], (rows, t, h, d), dtype)
        k = jax.random.normal(keys[1], (pool, kv, page_size, d), dtype)
        v = jax.random.normal(keys[2], (pool, kv, page_size, d), dtype)
        args = dict(rows=pair_rows, pages=pages, index=index, lengths=jnp.asarray(lengths), q_positions=q_positions,
                    **masks)
        row = dict(bench="paged_attention_check", case=case, impl="pallas_gpu", dtype=dtype, rows=rows, queries=t,
                   heads=h, kv_heads=kv, head_dim=d, page_size=page_size, pairs=len(pages))
        try:
          want = pk.paged_attention(*(x.astype(jnp.float32) for x in (q, k, v)), impl="xla", **args)[0]
          got = jax.jit(functools.partial(pk.paged_attention, impl="pallas_gpu", interpret=interpret, **args))(
              q, k, v)[0]
          err = _rel_err(got, want)
          yield dict(row, rel_err_out=err, tolerance=TOLERANCES[dtype], ok=err < TOLERANCES[dtype])
        except Exception as e:  # Report and carry on with the other checks.
          yield dict(row, error=repr(e)[:500])


def _best_seconds(program, args, repeats):
  """Best wall time of `repeats` runs after one warm-up."""
  jax.block_until_ready(program(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(program(*args))
    best = min(best, time.perf_counter() - start)
  return best


def model_default(rows: str):
  """ptx's default attention as a model calls it (`ptx.models.attention.attention`, impl "auto"), causal, one
  document per row, declared as `rows` ("packed" or "padded_right": `ptx.models.attention_choice.RowLayout`,
  which decides whether cuDNN may take the call); the function returns (out, None) like the kernels."""
  from ptx.models.attention import attention  # here: the kernel checks run without ptx.models (and qwix)

  def default(q, k, v):
    b, t = q.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return attention(q, k, v, segment_ids=jnp.ones((b, t), jnp.int32), positions=positions, impl="auto",
                     rows=rows), None

  return default


def default_impl(t: int, head_dim: int, rows: str) -> str:
  """What "auto" runs for `model_default(rows)` on bfloat16 inputs of length t (`ptx.models.attention.resolve`,
  given what `attention` gives it for that call): the name its figures are."""
  from ptx.models.attention import resolve
  return resolve("auto", q_len=t, kv_len=t, head_dim=head_dim, rows=rows, dtype=jnp.bfloat16)


def bench(seq_lens, heads, repeats, kernels, reference=None):
  """Yields causal fwd and fwd+bwd TFLOP/s of each of `kernels`, one row per sequence length.

  Args:
    seq_lens: sequence lengths; batch 1, head_dim 128, bfloat16, heads / 8 KV heads (at least one).
    heads: query heads.
    repeats: timed calls per figure (the best is kept), after one warm-up.
    kernels: {name: attention(q, k, v) -> (out, _)}, timed in this order; a kernel's error (out of memory, a shape
      it does not take) goes in the row as `<name>_error` and the others still run.
    reference: the name in `kernels` that each other's TFLOP/s is divided by (`<name>_fwd_vs_<reference>`).

  Each forward+backward is compiled once, ahead of time, and its compiled memory (arguments, outputs, temporaries)
  reported as `<name>_fwd_bwd_gib`.
  """
  h, kv, d = heads, max(heads // 8, 1), 128
  for t in seq_lens:
    keys = jax.random.split(jax.random.key(t), 4)
    q = jax.random.normal(keys[0], (1, t, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, t, kv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, t, kv, d), jnp.bfloat16)
    dout = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    fwd_flops = 2.0 * h * t * t * d  # 4*H*T*T*D halved by causality.
    row = dict(bench="attention_gpu", seq_len=t, heads=h, kv_heads=kv, head_dim=d, dtype="bfloat16")
    seconds = {}  # (name, "fwd" or "fwd_bwd"): best seconds, unrounded for the ratios
    for name, attention in kernels.items():
      try:
        fwd = jax.jit(lambda q, k, v, a=attention: a(q, k, v)[0])
        seconds[name, "fwd"] = _best_seconds(fwd, (q, k, v), repeats)
        grad = _fwd_bwd(attention).lower(q, k, v, dout).compile()
        mem = grad.memory_analysis()
        row[f"{name}_fwd_bwd_gib"] = round(
            (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes) / 2**30, 2)
        seconds[name, "fwd_bwd"] = _best_seconds(grad, (q, k, v, dout), repeats)
      except Exception as e:  # OOM or an unsupported shape: report, go on.
        row[f"{name}_error"] = repr(e)[:300]
    for (name, part), s in seconds.items():
      row[f"{name}_{part}_s"] = round(s, 5)
      row[f"{name}_{part}_tflops"] = round((3.5 if part == "fwd_bwd" else 1.0) * fwd_flops / s / 1e12, 1)
      if name != reference and (reference, part) in seconds:
        row[f"{name}_{part}_vs_{reference}"] = round(seconds[reference, part] / s, 3)
    yield row


def _jax_triton(q, k, v):
  """JAX's own Pallas Triton flash attention (jax.experimental.pallas.ops.gpu.attention.mha), causal."""
  from jax.experimental.pallas.ops.gpu import attention as jax_attention
  return jax_attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True), None


def _jax_mosaic(q, k, v):
  """JAX's Mosaic GPU (Hopper: wgmma, TMA) flash attention forward (pallas.ops.gpu.attention_mgpu), causal."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  config = attention_mgpu.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2, causal=True)
  return attention_mgpu.attention(q, k, v, config), None


def peers(t, heads, repeats, tiles):
  """Yields one row: causal TFLOP/s at length t of ptx's kernel and of JAX's two GPU kernels, same shapes.

  JAX's Triton kernel takes as many KV heads as query heads, so every kernel here runs MHA (kv = heads);
  its Mosaic GPU kernel has no causal backward, so it is timed forward only. Says whether ptx's kernel is
  slower than Pallas on this GPU allows (JAX's Triton kernel is the like-for-like) or than Hopper allows.
  """
  keys = jax.random.split(jax.random.key(t), 4)
  q, k, v, dout = (jax.random.normal(key, (1, t, heads, 128), jnp.bfloat16) for key in keys)
  fwd_flops = 2.0 * heads * t * t * 128
  row = dict(bench="attention_gpu_peers", seq_len=t, heads=heads, kv_heads=heads, head_dim=128, dtype="bfloat16",
             block_q=tiles.block_q, block_kv=tiles.block_kv)
  kernels = (("ptx_pallas", functools.partial(pallas, tiles), True), ("jax_triton", _jax_triton, True),
             ("jax_mosaic", _jax_mosaic, False), ("cudnn", cudnn, True))
  for name, attention, backward in kernels:
    print(f"peers: {name}", file=sys.stderr, flush=True)
    try:
      seconds = _best_seconds(jax.jit(lambda q, k, v, a=attention: a(q, k, v)[0]), (q, k, v), repeats)
      row[f"{name}_fwd_tflops"] = round(fwd_flops / seconds / 1e12, 1)
      if backward:
        seconds = _best_seconds(_fwd_bwd(attention), (q, k, v, dout), repeats)
        row[f"{name}_fwd_bwd_tflops"] = round(3.5 * fwd_flops / seconds / 1e12, 1)
    except Exception as e:  # A kernel this JAX or GPU lacks: report, go on.
      row[f"{name}_error"] = repr(e)[:300]
  return row


def main():
  """Parses flags, checks correctness, then times every length."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", type=int, nargs="+",
                      default=[2**i for i in range(13, 21)])
  parser.add_argument("--heads", type=int, default=8, help="q heads; kv = heads/8")
  parser.add_argument("--block-q", type=int, default=128, help="timed tiles; the check runs the defaults")
  parser.add_argument("--block-kv", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  _emit(bench="attention_gpu_device", device=str(jax.devices()[0]),
        jax=jax.__version__)
  tiles = pk.BlockSizes(args.block_q, args.block_kv)
  for row in check(None):
    _emit(**row)
  for row in bench(args.seq_lens, args.heads, args.repeats,
                   {"pallas_gpu": functools.partial(pallas, tiles), "cudnn": cudnn}, reference="cudnn"):
    _emit(**row, block_q=tiles.block_q, block_kv=tiles.block_kv)


if __name__ == "__main__":
  main()
