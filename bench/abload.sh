#!/usr/bin/env bash
# Latency of JSON turns at one rate for one build, without a profiler
# attached: Arbor on core 0 (fresh SQLite database) against the 0 ms mock
# on core 1, a 2 s warm-up, then one measured run of SECONDS. Prints the
# load client's result line. Alternate two builds to compare them; on a
# shared VM only runs made in the same minutes compare.
#
#   bench/abload.sh [ARBOR_BIN] [RATE] [SECONDS]    # defaults: the release build, 500, 15
#
# AFTER_START is a shell command run once Arbor answers, with ARBOR_PID set
# (an experiment's setup, as in threadstat.sh).
#
# STREAM=1 drives streamed turns instead (the result line then has their
# time to first token); MOCK_CHUNK_DELAY_MS=5 gives S3's mock, 20 chunks
# 5 ms apart.
#
# Needs a release build (cargo build --release -p arbor -p arbor-testkit -p arbor-bench).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
ARBOR_BIN=${1:-$BIN/arbor}
RATE=${2:-500}
SECONDS_MEASURED=${3:-15}
source "$ROOT/bench/common.sh"
open_work abload
start_pair0 "$ARBOR_BIN"
after_start
taskset -c 1 "$BIN/arbor-bench" load --target arbor --base-url http://127.0.0.1:8080 --model mock-0 \
  --rate "$RATE" --duration "$SECONDS_MEASURED" --warmup 2 --runs 1 --scenario abload \
  ${STREAM:+--stream} >"$WORK/load.log" 2>&1
grep -o 'run 1: .*' "$WORK/load.log"
