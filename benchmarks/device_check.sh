#!/usr/bin/env bash
# One-shot accelerator check (issue #58 item 4 by default; #25, #26, #27, #29 and #54 on request): sections of
# benchmarks/device_check.py, each in a process of its own under a hard time limit, all of them within
# DEVICE_CHECK_TOTAL_S (570 s: the whole run stays under 10 minutes, one device call). Prints JSON lines to stdout
# and, when $OUT is set, also to $OUT/device_check.jsonl. Exits 0 whatever the sections do: a failure is a JSON line
# with an "error" field, and the next section runs.
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
# never the seconds reserved for the sections after it. Another list runs some sections alone
# (DEVICE_CHECK_SECTIONS="kernels:100 attention:150"); env stops the run where JAX or the GPU is missing.
#
# The default run is issue #58 item 4's, what a GPU user gets by default: attention (ptx's default against cuDNN,
# then #27's peers at 16K: ~35 s on the H200 for three lengths, two here), SFT and GRPO at the SmolLM2 shape (~25 s
# and ~40 s there) and at Llama-3.2-1B's (not run yet: half the layers to compile, 8,192 tokens a step; ~35 s
# guessed for each), the engine's decode against the roofline (8 engine programs: a decode per row count and loop,
# a prefill per loop, at ~15 s each as fast mode's compiled there, 12-04), and last the reverted kernel rewrite
# (six checks at 5-31 s each, as the current kernel's took, then ~25 s of timing), whose per-case limit makes a
# hang cost one case and whose timing may use what the others left. Each budget has 10 s or more to spare.
#
# Out of the default run, each still runnable alone (or all in a second call, DEVICE_CHECK_SECTIONS="env:15
# kernels:140 memory:30 rollout:60 agent:100 fast:90 decode_1b:120", 555 s): kernels (#27's checks of the current
# kernel, every case passed on the H200 12-04, third run; ~130 s with the paged kernel's never-run checks), memory
# (#27's 1M-token compile, measured in the second run: 1.66x the floor), rollout (#25's uniform anchor), agent
# (#26's, measured in the third run) and fast (#29's modes, measured twice), none of them #58's, and decode_1b
# (decode at the 1B shape: eight more programs, past the default run's seconds). stops (#25's stop-ended workload)
# and moe (#54's dense-vs-MoE step times) were never in it: they train or compile for minutes, so a call runs each
# alone.
SECTIONS=${DEVICE_CHECK_SECTIONS:-env:15 attention:45 sft:35 sft_1b:55 grpo:45 grpo_1b:60 decode:140 tile_runs:175}

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
