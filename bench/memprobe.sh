#!/usr/bin/env bash
# Memory over time under the S2 shape: Arbor on core 0 (fresh SQLite
# database) against the 60 ms mock on core 1, RATE JSON turns/s for SECONDS
# (the load client's defaults: a quarter second's worth of conversations,
# each replaced after 10 turns). Prints, each second, Arbor's RSS and peak
# RSS (KiB) and the conversations it holds in memory (the
# `arbor_conversations_loaded` gauge), then the load client's result line.
# Alternate two builds to compare them.
#
#   bench/memprobe.sh [ARBOR_BIN] [RATE] [SECONDS]    # defaults: the release build, 2000, 12
#
# EXTRA_TOML is appended to Arbor's config (e.g. "[server]
# idle_conversations_kept = 64"). MOCK_DELAY_MS sets the mock's delay
# (default 60): RSS against it gives the memory of a turn in flight.
# MEMPROBE_SPLIT=1 also prints RssAnon / RssFile / RssShmem. LOAD_ARGS adds
# arguments to the load client (e.g. --stream; MOCK_CHUNK_DELAY_MS spaces the
# mock's chunks). Needs a release build
# (cargo build --release -p arbor -p arbor-testkit -p arbor-bench).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
ARBOR_BIN=${1:-$BIN/arbor}
RATE=${2:-2000}
SECONDS_MEASURED=${3:-12}
source "$ROOT/bench/common.sh"
open_work memprobe
start_mock0 "${MOCK_DELAY_MS:-60}"
start_arbor0 "$ARBOR_BIN"
await_arbor 100 0.2
taskset -c 1 "$BIN/arbor-bench" load --target arbor --base-url http://127.0.0.1:8080 --model mock-0 \
  --rate "$RATE" --duration "$SECONDS_MEASURED" --warmup 0 --runs 1 --scenario memprobe ${LOAD_ARGS:-} >"$WORK/load.log" 2>&1 &
LOAD=$!
for second in $(seq 1 $((SECONDS_MEASURED + 2))); do
  sleep 1
  rss=$(awk '/^VmRSS/ {print $2}' "/proc/$ARBOR_PID/status")
  peak=$(awk '/^VmHWM/ {print $2}' "/proc/$ARBOR_PID/status")
  loaded=$(curl -s http://127.0.0.1:8080/metrics | awk '/^arbor_conversations_loaded / {print $2}')
  echo "t=${second}s rss ${rss} KiB, peak ${peak} KiB, conversations loaded ${loaded:-?}"
  if [[ -n ${MEMPROBE_SPLIT:-} ]]; then grep -E '^Rss' "/proc/$ARBOR_PID/status" | tr -s ' \t\n' ' '; echo; fi
done
wait "$LOAD" || true
grep -o 'run 1: .*' "$WORK/load.log"
