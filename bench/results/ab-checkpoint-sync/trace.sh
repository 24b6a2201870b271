#!/usr/bin/env bash
# perf trace of Arbor's sync, write, lock and futex calls under RATE JSON
# turns/s (3 s in the middle of a 12 s load); the raw trace goes to OUT,
# summarised by an.py (per thread and call), bursts.py TRACE 9 (the
# writer's own checkpoints: pages it copied into the database file, fd 9,
# and that file's fsync) and gaps.py (gaps between the writer's WAL syncs).
#   trace.sh [ARBOR_BIN] [RATE] [OUT]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
ARBOR_BIN=${1:-$BIN/arbor}
RATE=${2:-2000}
OUT=${3:-/tmp/arbor-trace.txt}
source "$ROOT/bench/common.sh"
open_work trace
start_pair0 "$ARBOR_BIN" 0
taskset -c 1 "$BIN/arbor-bench" load --target arbor --base-url http://127.0.0.1:8080 --model mock-0 \
  --rate "$RATE" --duration 12 --warmup 2 --runs 1 --scenario threadstat >"$WORK/load.log" 2>&1 &
LOAD_PID=$!
sleep 5
perf trace -p "$ARBOR_PID" -e fdatasync,fsync,pwrite64,fcntl,futex -T -o "$OUT" -- sleep 3 || true
wait "$LOAD_PID"
grep -o "run 1: .*latency µs p50 [0-9]* p99 [0-9]*" "$WORK/load.log" || tail -n 3 "$WORK/load.log"
