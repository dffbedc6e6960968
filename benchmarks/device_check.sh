#!/usr/bin/env bash
# One-shot accelerator check (issues #25, #26, #27 and #29): every section of benchmarks/device_check.py in a process of
# its own, each under a hard time limit, all of them within DEVICE_CHECK_TOTAL_S (570 s: the whole run stays
# under 10 minutes, one device call, #27's sections under 8). Prints JSON lines to stdout and, when $OUT is set, also to
# $OUT/device_check.jsonl. Exits 0 whatever the sections do: a failure is a JSON line with an "error" field, and
# the next section runs.
#
#   bash benchmarks/device_check.sh            # on the GPU machine
#   bash benchmarks/device_check.sh --smoke    # tiny shapes on the CPU (or DEVICE_CHECK_SMOKE=1)
#   OUT=/tmp/out PYTHON=.venv/bin/python bash benchmarks/device_check.sh --smoke   # and /tmp/out/device_check.jsonl
#
# PYTHON picks the interpreter (default python3: on the GPU machine the image's, with its own JAX; the project's
# pins do not apply there). The checkout is put on PYTHONPATH, with kernels/ importable as ptx_kernels as
# pyproject.toml's package-dir maps it, so nothing needs installing.
set -u

REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
SMOKE=${DEVICE_CHECK_SMOKE:-0}
[ "${1:-}" = "--smoke" ] && SMOKE=1
TOTAL_S=${DEVICE_CHECK_TOTAL_S:-570}
# name:seconds in running order. A section may use its own seconds plus whatever earlier ones left unused,
# never the seconds reserved for the sections after it. GRPO runs last of #27's: it compiles the most. Another list
# runs some sections alone (DEVICE_CHECK_SECTIONS="kernels:100 attention:150"); env stops the run where JAX or
# the GPU is missing. rollout (#25's uniform anchor), agent (#26's) and fast (#29's rollout modes) run after #27's
# sections, on what they leave: rollout and agent first, as they need a known time (rollout: the tiny model's
# static and engine programs, never run on a device, guessed at ~40 s; agent: 1,024 episodes, ~100 s with its
# warm-ups), and fast last, as it prints a row per mode and uses whatever is left. The seconds follow the H200 runs
# of 12-04 (env ~10 s, attention ~35, sft ~25, memory ~15, grpo ~40; kernels ~110 with float32 at its 64 x 32
# default tiles, the Pallas checks first, and ~20 more for the paged kernel's checks, never run yet; fast ~55 per
# mode), each with 5 s or more to spare. stops (#25's stop-ended workload) is not in the list: it trains a model and
# compiles the engine's many buckets, minutes that the default run has no room for, so a call runs it alone;
# so does moe (#54's dense-vs-MoE step times: four models compiled, SFT and GRPO each).
SECTIONS=${DEVICE_CHECK_SECTIONS:-env:15 kernels:140 attention:45 sft:40 memory:30 grpo:50 rollout:60 agent:100 fast:90}

SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
ln -s "$REPO/kernels" "$SCRATCH/ptx_kernels"
export PYTHONPATH="$REPO:$SCRATCH${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# With $OUT, the lines also go to $OUT/device_check.jsonl and each section's stderr tail (XLA's and Python's
# warnings, the traceback of a crash) to $OUT/device_check.stderr.
LOG=/dev/null ERRLOG=/dev/null
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT" && LOG="$OUT/device_check.jsonl" ERRLOG="$OUT/device_check.stderr" && : >"$LOG" && : >"$ERRLOG"
fi
SMOKE_FLAG=
[ "$SMOKE" = 1 ] && SMOKE_FLAG=--smoke

# A JSON line the wrapper writes itself (the section's process gave none): the message keeps printable ASCII
# but quotes and backslashes, so it needs no JSON library.
fail_line() {
  local msg
  msg=$(printf '%s' "$2" | tr '\000-\037' ' ' | tr -cd '\040\041\043-\133\135-\176' | cut -c1-800)
  printf '{"section": "%s", "error": "%s", "load": %s}\n' "$1" "$msg" "$(cut -d' ' -f1 /proc/loadavg)" | tee -a "$LOG"
}

start=$(date +%s)
rest=0
for entry in $SECTIONS; do rest=$((rest + ${entry#*:})); done
for entry in $SECTIONS; do
  name=${entry%%:*}
  rest=$((rest - ${entry#*:}))
  limit=$((TOTAL_S - ($(date +%s) - start) - rest))
  if [ "$limit" -lt 5 ]; then
    fail_line "$name" "skipped: ${limit} s left of the ${TOTAL_S} s budget"
    continue
  fi
  timeout --kill-after=10 "$limit" "$PYTHON" "$REPO/benchmarks/device_check.py" --section "$name" \
    $SMOKE_FLAG 2>"$SCRATCH/stderr" | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  { echo "== $name (exit $rc)"; tail -c 200000 "$SCRATCH/stderr"; } >>"$ERRLOG"
  case $rc in
    0 | 2) ;;  # 2: the section printed its own error line
    3) exit 0 ;;  # env: no JAX or no GPU, said in its line; nothing else can run
    124 | 137) fail_line "$name" "timed out after ${limit} s: $(tail -c 400 "$SCRATCH/stderr")" ;;
    *) fail_line "$name" "exit code ${rc}: $(tail -c 600 "$SCRATCH/stderr")" ;;
  esac
done
exit 0
