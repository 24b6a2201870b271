#!/usr/bin/env bash
# A long conversation read from the store (not from memory): the first
# build records a conversation of MESSAGES messages (default 5,000) on a
# fresh SQLite database, then each build given is started on that database
# in turn (pinned to core 0; a fresh process holds nothing of the
# conversation) and its whole tree and its active path are read 15 times
# each (bench/coldtree.py). Alternate two builds to compare them:
#
#   bench/coldtree.sh BASE NEW BASE NEW BASE NEW
#   MESSAGES=10000 bench/coldtree.sh BUILD BUILD
#
# (S5 reads a tree the server still holds after recording it.) Needs a
# release build (cargo build --release -p arbor -p arbor-testkit).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
(($# > 0)) || { echo "usage: $0 ARBOR_BIN..." >&2; exit 2; }
source "$ROOT/bench/common.sh"
open_work coldtree
start_pair0 "$1" 0
python3 "$ROOT/bench/coldtree.py" record "$WORK" "${MESSAGES:-5000}"
# The admin key is printed only when the database is first made.
KEY=$ARBOR_BENCH_KEY
for build in "$@"; do
  kill "$ARBOR_PID"
  wait "$ARBOR_PID" 2>/dev/null || true
  start_arbor0 "$build"
  await_arbor 100 0.2
  ARBOR_BENCH_KEY=$KEY
  export ARBOR_BENCH_KEY
  echo -n "$build: "
  python3 "$ROOT/bench/coldtree.py" read "$WORK"
done
