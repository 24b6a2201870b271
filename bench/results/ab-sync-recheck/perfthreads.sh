#!/usr/bin/env bash
# perf record (cpu-clock, 4,999 Hz, 5 s in the middle of a 12 s load) of Arbor under RATE JSON
# turns/s; OUT.dso and OUT.sym: samples by thread and object, by thread and symbol.
#   perfthreads.sh ARBOR_BIN [RATE] [OUT]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
ARBOR_BIN=${1}; RATE=${2:-2000}; OUT=${3:-/tmp/arbor-perf}
source "$ROOT/bench/common.sh"
open_work perfthreads
start_pair0 "$ARBOR_BIN" 0
taskset -c 1 "$BIN/arbor-bench" load --target arbor --base-url http://127.0.0.1:8080 --model mock-0 \
  --rate "$RATE" --duration 12 --warmup 2 --runs 1 --scenario pt >"$WORK/load.log" 2>&1 &
LOAD_PID=$!
sleep 5
perf record -e cpu-clock -F 4999 -g -p "$ARBOR_PID" -o "$OUT.data" -- sleep 5 2>/dev/null
wait "$LOAD_PID"
grep -o "run 1: .*latency µs p50 [0-9]* p99 [0-9]*" "$WORK/load.log"
perf report -i "$OUT.data" --no-children --sort comm,dso --stdio 2>/dev/null | grep -v "^#" | grep -v "^$" | grep "%" | head -20 > "$OUT.dso"
perf report -i "$OUT.data" --no-children --sort comm,sym --stdio -g none 2>/dev/null | grep -v "^#" | grep "%" | head -80 > "$OUT.sym"
