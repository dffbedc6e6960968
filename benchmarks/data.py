"""Throughput and packing efficiency of the ptx data pipeline.

Writes a JSONL file of SFT records whose token lengths (byte tokenizer) are
uniform in [min_len, max_len], runs the full pipeline on it (JSONL source,
shuffle, decode, tokenize, first-fit packing to [B, T]) and prints JSON lines:
tokens/s (non-pad tokens per second of wall time) and packing efficiency
(non-pad fraction of the slots). For comparison it also prints the packing
efficiency of grain's round-based FirstFitPackIterDataset on the same
lengths.

    .venv/bin/python benchmarks/data.py            # T=2048, records of 50..1500 tokens
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import grain
import numpy as np

from ptx.config import DataConfig
from ptx.data.pipeline import make_pipeline
from ptx.data.sources import JsonlSource
from ptx.data.tokenizer import ByteTokenizer


def _write_records(path: pathlib.Path, n: int, min_len: int, max_len: int, seed: int) -> np.ndarray:
  """SFT records of exactly the drawn token lengths (bos + prompt + completion + eos)."""
  lengths = np.random.default_rng(seed).integers(min_len, max_len + 1, n)
  with open(path, "w") as f:
    for length in lengths:
      prompt = int(length) // 3
      f.write(json.dumps({"prompt": "p" * prompt, "completion": "c" * (int(length) - prompt - 2)}) + "\n")
  return lengths


def _grain_round_efficiency(lengths: np.ndarray, seq_len: int, num_bins: int) -> float:
  ds = grain.MapDataset.source([{"tokens": np.ones(int(n), np.int32)} for n in lengths]).to_iter_dataset()
  packed = grain.experimental.FirstFitPackIterDataset(
      ds, length_struct={"tokens": seq_len}, num_packing_bins=num_bins, shuffle_bins=False)
  segments = np.stack([row["tokens_segment_ids"] for row in packed])
  return float((segments > 0).mean())


def main() -> None:
  """Runs the benchmark and prints one JSON line per measurement."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--records", type=int, default=4000)
  p.add_argument("--min-len", type=int, default=50)
  p.add_argument("--max-len", type=int, default=1500)
  p.add_argument("--seq-len", type=int, default=2048)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--num-bins", type=int, default=64)
  p.add_argument("--threads", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args()
  with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "records.jsonl"
    lengths = _write_records(path, args.records, args.min_len, args.max_len, args.seed)
    cfg = DataConfig(batch_size=args.batch_size, seq_len=args.seq_len, num_bins=args.num_bins,
                         num_epochs=1, seed=args.seed, num_threads=args.threads)
    start = time.perf_counter()
    it = iter(make_pipeline(JsonlSource(path), ByteTokenizer(), cfg))
    batches = sum(1 for _ in it)
    seconds = time.perf_counter() - start
  m = it.metrics()
  common = {"seq_len": args.seq_len, "batch_size": args.batch_size, "num_bins": args.num_bins,
            "records": args.records, "lengths": [args.min_len, args.max_len]}
  print(json.dumps({"metric": "data/tokens_per_s", "value": m["tokens"] / seconds, "batches": batches,
                    "seconds": seconds, "tokenizer": "byte", "packing": "first_fit", **common}))
  print(json.dumps({"metric": "data/packing_efficiency", "value": m["packing_efficiency"], **common}))
  grain_eff = _grain_round_efficiency(lengths, args.seq_len, args.num_bins)
  print(json.dumps({"metric": "data/packing_efficiency_grain_first_fit_rounds", "value": grain_eff, **common}))


if __name__ == "__main__":
  main()
