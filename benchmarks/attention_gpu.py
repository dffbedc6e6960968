"""GPU (H200) check: ptx Pallas flash attention vs cuDNN, one JSON line each.

  python benchmarks/attention_gpu.py
  python benchmarks/attention_gpu.py --seq-lens 8192 32768 --repeats 5

First checks correctness on small shapes (Pallas kernel and cuDNN against the
float32 reference, forward and gradients), then times causal forward and
forward+backward at each length (batch 1, head_dim 128, GQA 8:1, bf16) and
prints TFLOP/s (causal FLOPs: fwd 2*B*H*T*T*D, fwd+bwd 3.5x that) and the
compiled memory of the Pallas forward+backward. Errors (e.g. out of memory)
are reported as JSON lines instead of stopping the run. Goal: Pallas forward
>= 60% of cuDNN's TFLOP/s, and the 1M-token forward+backward fits.
"""

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import ptx_kernels as pk


def _emit(**row):
  """Prints one JSON line."""
  print(json.dumps(row), flush=True)


def _cudnn(q, k, v):
  """jax.nn's cuDNN flash attention (causal), shaped like ptx_kernels'."""
  out = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                     implementation="cudnn")
  return out, None


def _pallas(tiles, q, k, v):
  """The ptx GPU kernel with the given tiles."""
  return pk.flash_attention(q, k, v, impl="pallas_gpu", block_sizes=tiles)


def _fwd_bwd(attention):
  """Jitted gradients of <out, dout> in q, k, v."""
  def loss(q, k, v, dout):
    return jnp.sum(attention(q, k, v)[0].astype(jnp.float32)
                   * dout.astype(jnp.float32))
  return jax.jit(jax.grad(loss, (0, 1, 2)))


def _rel_err(got, want) -> float:
  """max |got - want| / max |want| in float32."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def check(tiles):
  """Small-shape correctness of both kernels against the f32 reference."""
  b, t, h, kv, d = 2, 1024, 8, 1, 128
  keys = jax.random.split(jax.random.key(0), 4)
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):
    q = jax.random.normal(keys[0], (b, t, h, d), dtype)
    k = jax.random.normal(keys[1], (b, t, kv, d), dtype)
    v = jax.random.normal(keys[2], (b, t, kv, d), dtype)
    dout = jax.random.normal(keys[3], q.shape, dtype)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, dout)]
    want = pk.reference_attention(*f32[:3])[0]
    want_grads = _fwd_bwd(pk.reference_attention)(*f32)
    impls = {"pallas_gpu": functools.partial(_pallas, tiles)}
    if dtype == jnp.bfloat16:  # cuDNN flash attention takes fp16/bf16 only.
      impls["cudnn"] = _cudnn
    for name, attention in impls.items():
      try:
        out = jax.jit(lambda q, k, v: attention(q, k, v)[0])(q, k, v)
        grads = _fwd_bwd(attention)(q, k, v, dout)
        errs = [_rel_err(out, want)] + [
            _rel_err(g, w) for g, w in zip(grads, want_grads)]
        _emit(bench="attention_gpu_check", impl=name, dtype=jnp.dtype(dtype).name,
              rel_err_out=errs[0], rel_err_dq=errs[1], rel_err_dk=errs[2],
              rel_err_dv=errs[3], tolerance=tol, ok=max(errs) < tol)
      except Exception as e:  # Report and carry on with the other checks.
        _emit(bench="attention_gpu_check", impl=name, error=repr(e)[:500])


def _best_seconds(program, args, repeats):
  """Best wall time of `repeats` runs after one warm-up."""
  jax.block_until_ready(program(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(program(*args))
    best = min(best, time.perf_counter() - start)
  return best


def bench(args, tiles):
  """Causal fwd and fwd+bwd TFLOP/s of Pallas and cuDNN per sequence length."""
  h, kv, d = args.heads, args.heads // 8, 128
  for t in args.seq_lens:
    keys = jax.random.split(jax.random.key(t), 4)
    q = jax.random.normal(keys[0], (1, t, h, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, t, kv, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, t, kv, d), jnp.bfloat16)
    dout = jax.random.normal(keys[3], q.shape, jnp.bfloat16)
    fwd_flops = 2.0 * h * t * t * d  # 4*H*T*T*D halved by causality.
    row = dict(bench="attention_gpu", seq_len=t, heads=h, kv_heads=kv,
               head_dim=d, dtype="bfloat16", block_q=tiles.block_q,
               block_kv=tiles.block_kv)
    for name, attention in (("pallas_gpu", functools.partial(_pallas, tiles)),
                            ("cudnn", _cudnn)):
      try:
        fwd = jax.jit(lambda q, k, v, a=attention: a(q, k, v)[0])
        seconds = _best_seconds(fwd, (q, k, v), args.repeats)
        row[f"{name}_fwd_s"] = round(seconds, 5)
        row[f"{name}_fwd_tflops"] = round(fwd_flops / seconds / 1e12, 1)
        grad = _fwd_bwd(attention)
        if name == "pallas_gpu":
          mem = grad.lower(q, k, v, dout).compile().memory_analysis()
          row["pallas_gpu_fwd_bwd_gib"] = round(
              (mem.argument_size_in_bytes + mem.output_size_in_bytes
               + mem.temp_size_in_bytes) / 2**30, 2)
        seconds = _best_seconds(grad, (q, k, v, dout), args.repeats)
        row[f"{name}_fwd_bwd_s"] = round(seconds, 5)
        row[f"{name}_fwd_bwd_tflops"] = round(3.5 * fwd_flops / seconds / 1e12, 1)
      except Exception as e:  # OOM or an unsupported shape: report, go on.
        row[f"{name}_error"] = repr(e)[:300]
    if "pallas_gpu_fwd_tflops" in row and "cudnn_fwd_tflops" in row:
      row["fwd_vs_cudnn"] = round(
          row["pallas_gpu_fwd_tflops"] / row["cudnn_fwd_tflops"], 3)
    _emit(**row)


def main():
  """Parses flags, checks correctness, then times every length."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", type=int, nargs="+",
                      default=[2**i for i in range(13, 21)])
  parser.add_argument("--heads", type=int, default=8, help="q heads; kv = heads/8")
  parser.add_argument("--block-q", type=int, default=128)
  parser.add_argument("--block-kv", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  _emit(bench="attention_gpu_device", device=str(jax.devices()[0]),
        jax=jax.__version__)
  tiles = pk.BlockSizes(args.block_q, args.block_kv)
  check(tiles)
  bench(args, tiles)


if __name__ == "__main__":
  main()
