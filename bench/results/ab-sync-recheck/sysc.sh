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
start_load12 "$RATE" pt
perf stat -e 'raw_syscalls:sys_enter' -e 'syscalls:sys_enter_*' --per-thread -p "$ARBOR_PID" -o "${OUT:-/tmp/arbor-syscalls.txt}" -- sleep 4 2>/dev/null || true
load_result
