#!/usr/bin/env bash
# How long idle OpenMP threads should spin (issue 30, item 6): the engine's 16-row decode step
# (scripts/step_time.py) under OMP_WAIT_POLICY=PASSIVE and under GOMP_SPINCOUNT=N (OMP_WAIT_POLICY unset: spin N
# times, then sleep; 300000 is libgomp's own default), interleaved, REPS times each, on a quiet machine, beside
# BUSY Python busy loops, and beside one torch process multiplying matrices on 2 threads (a second
# OpenMP program, as another server or a test run would be). One JSON line per run in OUT.
#
#   scripts/spin_policy.sh                          # 16 x 2,048 int4, spins 2000 5000 300000, 3 reps
#   SPINS="2000" REPS=2 LENGTH=1024 scripts/spin_policy.sh
#
# Settings (environment): CONFIG (int4), ROWS (16), LENGTH (2048), STEPS (6), SPINS ("2000 5000 300000"),
# REPS (3), BUSY (2), OUT (out/spin-policy.jsonl), PYTHON (.venv/bin/python). The competing processes are this
# script's children, ended when it exits.
set -euo pipefail

PYTHON=${PYTHON:-.venv/bin/python}
CONFIG=${CONFIG:-int4}
ROWS=${ROWS:-16}
LENGTH=${LENGTH:-2048}
STEPS=${STEPS:-6}
SPINS=${SPINS:-2000 5000 300000}
REPS=${REPS:-3}
BUSY=${BUSY:-2}
OUT=${OUT:-out/spin-policy.jsonl}
mkdir -p "$(dirname "$OUT")"
: > "$OUT"

pids=()
stop() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    pids=()
}
trap stop EXIT INT TERM

run() {  # $1: the load's name; the rest: the environment of the run
    local load=$1; shift
    local line
    line=$(env -u OMP_WAIT_POLICY -u GOMP_SPINCOUNT "$@" "$PYTHON" scripts/step_time.py --rows "$ROWS" \
        --length "$LENGTH" --config "$CONFIG" --steps "$STEPS" 2>/dev/null)
    echo "{\"load\": \"$load\", \"run\": $line}" | tee -a "$OUT"
}

for load in quiet busy torch; do
    if [ "$load" = busy ]; then
        for _ in $(seq "$BUSY"); do python3 -c 'while True: pass' & pids+=($!); done
    elif [ "$load" = torch ]; then
        "$PYTHON" -c 'import torch
torch.set_num_threads(2)
a = torch.randn(1024, 1024)
while True:
    a @ a' & pids+=($!)
    fi
    sleep 3
    for _ in $(seq "$REPS"); do
        run "$load" OMP_WAIT_POLICY=PASSIVE
        for n in $SPINS; do run "$load" GOMP_SPINCOUNT="$n"; done
    done
    stop
    sleep 10
done
