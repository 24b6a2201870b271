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
start_load12 "$RATE" threadstat
perf trace -p "$ARBOR_PID" -e fdatasync,fsync,pwrite64,fcntl,futex -T -o "$OUT" -- sleep 3 || true
load_result
