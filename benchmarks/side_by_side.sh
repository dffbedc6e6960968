#!/bin/sh
# ptx against Tunix on the config of the Tunix harness (TUNIX_BENCH=path/to/tunix_bench.py, not shipped), alternating.
#
#   TUNIX_BENCH=path/to/tunix_bench.py sh benchmarks/side_by_side.sh /tmp/tunix-venv/bin/python [OUT_DIR]
#
# Runs, in turn: SFT (3 pairs of benchmarks/train.py and tunix_bench.py --parts sft), ptx's
# scanned-layers SFT, the sampler (benchmarks/sampling.py, 5 alternated rounds) and the GRPO step
# (benchmarks/grpo.py, 3 alternated rounds); ~7 minutes on 2 cores. Run it on a quiet machine:
# the load average goes into OUT_DIR/load.txt. Every run's JSON line stays in OUT_DIR; the last
# lines printed (benchmarks/run_medians.py) are every run's figure, the median of the per-run
# medians on each side and their ratio, which the README's benchmark table quotes. Every run
# times an odd number of steps, for which the harness's per-run median is the median.
set -eu
TUNIX=${1:?usage: side_by_side.sh TUNIX_PYTHON [OUT_DIR]}
OUT=${2:-/tmp/ptx-side-by-side}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ANCHOR=${TUNIX_BENCH:?set TUNIX_BENCH to the Tunix harness tunix_bench.py (not shipped with ptx)}
PY=$ROOT/.venv/bin/python
mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/load.txt
cd "$ROOT"
uptime > "$OUT/load.txt"
for i in 1 2 3; do
  "$PY" benchmarks/train.py --steps 9 > "$OUT/train_ptx_$i.log"
  "$TUNIX" "$ANCHOR" --parts sft --steps 9 > "$OUT/train_tunix_$i.log"
  uptime >> "$OUT/load.txt"
done
"$PY" benchmarks/train.py --steps 9 --scan-layers > "$OUT/train_ptx_scan.log"
"$PY" benchmarks/sampling.py --parts anchor --rounds 5 --runs 5 --tunix-python "$TUNIX" > "$OUT/sampling.log"
uptime >> "$OUT/load.txt"
"$PY" benchmarks/grpo.py --rounds 3 --steps 5 --tunix-python "$TUNIX" > "$OUT/grpo.log"
uptime >> "$OUT/load.txt"
"$PY" benchmarks/run_medians.py "$OUT"
