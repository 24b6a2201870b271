#!/usr/bin/env bash
# Memory of long conversations gone quiet: Arbor on core 0 (fresh SQLite
# database) with the 0 ms mock on core 1; bench/treemem.py records
# CONVERSATIONS conversations of MESSAGES messages and runs a turn in each,
# printing RSS, peak RSS and the conversations' trees in memory as it goes,
# then again after WAIT seconds of quiet (the timed sweep). Alternate two
# builds, or two configs (EXTRA_TOML, e.g. "[server]
# idle_conversations_mb = 100000"), to compare them.
#
#   bench/treemem.sh [ARBOR_BIN] [CONVERSATIONS] [MESSAGES] [WAIT]   # defaults: the release build, 200, 2000, 20
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
ARBOR_BIN=${1:-$BIN/arbor}
CONVERSATIONS=${2:-200}
MESSAGES=${3:-2000}
WAIT=${4:-20}
source "$ROOT/bench/common.sh"
open_work treemem
start_mock0 0
start_arbor0 "$ARBOR_BIN"
await_arbor 100 0.2
python3 "$ROOT/bench/treemem.py" http://127.0.0.1:8080 "$ARBOR_PID" "$CONVERSATIONS" "$MESSAGES"
sleep "$WAIT"
echo "after ${WAIT} s quiet: rss $(awk '/^VmRSS/ {print $2}' "/proc/$ARBOR_PID/status") KiB," \
  "$(curl -s http://127.0.0.1:8080/metrics | grep -E '^arbor_conversations_(loaded|bytes) ' | tr '\n' ' ')"
