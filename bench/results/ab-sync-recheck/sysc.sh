#!/usr/bin/env bash
set -euo pipefail
# Counts every system call of each Arbor thread (perf stat on the syscall tracepoints, 4 s in
# the middle of a 12 s load at RATE JSON turns/s) into OUT. The tracepoints slow Arbor down:
# the counts per turn hold, the latencies of that run do not.
#   OUT=... sysc.sh ARBOR_BIN [RATE]
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
ARBOR_BIN=${1}; RATE=${2:-2000}
source "$ROOT/bench/common.sh"
open_work sysc
start_pair0 "$ARBOR_BIN" 0
taskset -c 1 "$BIN/arbor-bench" load --target arbor --base-url http://127.0.0.1:8080 --model mock-0 \
  --rate "$RATE" --duration 12 --warmup 2 --runs 1 --scenario pt >"$WORK/load.log" 2>&1 &
LOAD_PID=$!
sleep 5
perf stat -e 'raw_syscalls:sys_enter' -e 'syscalls:sys_enter_*' --per-thread -p "$ARBOR_PID" -o "${OUT:-/tmp/arbor-syscalls.txt}" -- sleep 4 2>/dev/null || true
wait "$LOAD_PID"
grep -o "run 1: .*latency µs p50 [0-9]* p99 [0-9]*" "$WORK/load.log"
