"""Attention memory and time on CPU, one JSON line per measurement.

  python benchmarks/attention.py                      # 4K..128K + 1M compile-only
  python benchmarks/attention.py --seq-lens 4096 8192 --time-up-to 8192

Memory is XLA's compiled figure (`memory_analysis()`: arguments + outputs +
temporaries) and needs no run; time is the best of `--repeats` runs after one
warm-up, measured only up to `--time-up-to` tokens (and, for the quadratic
naive path, only up to `--naive-up-to`). The 1M-token lines are compile-only:
blockwise on one device, and ring attention over 8 (fake) devices per device.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("PJRT_NPROC", "64")  # 8 threads can deadlock 8 devices' collectives (tests/conftest.py)

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ptx_kernels as pk  # noqa: E402

MiB = 2**20


def _programs(attention):
  """Jitted forward and forward+backward (vjp with a given dout) of attention."""
  def fwd(q, k, v):
    return attention(q, k, v)[0]

  def fwd_bwd(q, k, v, dout):
    out, vjp = jax.vjp(fwd, q, k, v)
    return out, vjp(dout)

  return jax.jit(fwd), jax.jit(fwd_bwd)


def _memory_mib(program, *args) -> float:
  """Compiled arguments + outputs + temporaries, in MiB."""
  mem = program.lower(*args).compile().memory_analysis()
  total = (mem.argument_size_in_bytes + mem.output_size_in_bytes
           + mem.temp_size_in_bytes)
  return round(total / MiB, 1)


def _best_seconds(program, args, repeats: int) -> float:
  """Best wall time of `repeats` runs after one warm-up."""
  jax.block_until_ready(program(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(program(*args))
    best = min(best, time.perf_counter() - start)
  return round(best, 4)


def _impls(block_sizes):
  """The single-device implementations to compare."""
  return {
      "naive": pk.reference_attention,
      "blockwise": functools.partial(pk.flash_attention, block_sizes=block_sizes),
  }


def bench_cpu(args):
  """Memory and time per implementation and sequence length on one device."""
  dtype = jnp.dtype(args.dtype)
  tiles = pk.BlockSizes(args.block_q, args.block_kv)
  for t in args.seq_lens:
    q_s = jax.ShapeDtypeStruct((1, t, args.heads, args.head_dim), dtype)
    kv_s = jax.ShapeDtypeStruct((1, t, args.kv_heads, args.head_dim), dtype)
    for name, attention in _impls(tiles).items():
      fwd, fwd_bwd = _programs(attention)
      row = dict(bench="attention_cpu", impl=name, seq_len=t, heads=args.heads,
                 kv_heads=args.kv_heads, head_dim=args.head_dim,
                 dtype=args.dtype, causal=True,
                 fwd_mib=_memory_mib(fwd, q_s, kv_s, kv_s),
                 fwd_bwd_mib=_memory_mib(fwd_bwd, q_s, kv_s, kv_s, q_s))
      limit = args.naive_up_to if name == "naive" else args.time_up_to
      if t <= limit:
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, dout = (jax.random.normal(key, s.shape, dtype)
                         for key, s in zip(keys, (q_s, kv_s, kv_s, q_s)))
        row["fwd_s"] = _best_seconds(fwd, (q, k, v), args.repeats)
        row["fwd_bwd_s"] = _best_seconds(fwd_bwd, (q, k, v, dout), args.repeats)
      print(json.dumps(row), flush=True)


def bench_1m(args):
  """Compile-only memory of 1M-token attention: blockwise and ring (per device)."""
  t = 2**20
  single = jax.ShapeDtypeStruct((1, t, 1, 64), jnp.float32)
  fwd, fwd_bwd = _programs(pk.flash_attention)
  print(json.dumps(dict(
      bench="attention_1m", impl="blockwise", devices=1, seq_len=t, heads=1,
      kv_heads=1, head_dim=64, dtype="float32",
      fwd_mib=_memory_mib(fwd, single, single, single),
      fwd_bwd_mib=_memory_mib(fwd_bwd, single, single, single, single))),
        flush=True)
  n = 8
  mesh = jax.make_mesh((1, 1, 1, n), ("data", "fsdp", "tensor", "seq"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 4)
  shard = NamedSharding(mesh, P(None, "seq"))
  q_s = jax.ShapeDtypeStruct((1, t, 8, 128), jnp.bfloat16, sharding=shard)
  kv_s = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.bfloat16, sharding=shard)
  # heads_per_pass None: one kv head (4 q heads) per ring pass; 1: one q head.
  for layout, per_pass in (("contiguous", None), ("zigzag", None), ("zigzag", 1)):
    fwd, fwd_bwd = _programs(functools.partial(
        pk.ring_attention, mesh=mesh, layout=layout, heads_per_pass=per_pass))
    print(json.dumps(dict(
        bench="attention_1m", impl="ring", layout=layout,
        heads_per_pass=per_pass or 4, devices=n, seq_len=t,
        heads=8, kv_heads=2, head_dim=128, dtype="bfloat16",
        fwd_mib_per_device=_memory_mib(fwd, q_s, kv_s, kv_s),
        fwd_bwd_mib_per_device=_memory_mib(fwd_bwd, q_s, kv_s, kv_s, q_s))),
          flush=True)


def main():
  """Parses flags and prints every measurement."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", type=int, nargs="+",
                      default=[4096, 8192, 16384, 32768, 65536, 131072])
  parser.add_argument("--heads", type=int, default=1)
  parser.add_argument("--kv-heads", type=int, default=1)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--block-q", type=int, default=512)
  parser.add_argument("--block-kv", type=int, default=512)
  parser.add_argument("--time-up-to", type=int, default=32768)
  parser.add_argument("--naive-up-to", type=int, default=8192)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--skip-1m", action="store_true")
  args = parser.parse_args()
  bench_cpu(args)
  if not args.skip_1m:
    bench_1m(args)


if __name__ == "__main__":
  main()
