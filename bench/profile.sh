#!/usr/bin/env bash
# Profiles Arbor's hot path with callgrind (instruction counts: repeatable
# whatever else the machine does). Arbor runs under valgrind; after a
# warm-up the counters are zeroed, a fixed number of turns is driven, and
# the counters are dumped and annotated. Writes bench/results/profile-*.txt.
#
#   bench/profile.sh            JSON turns and streamed turns, 300 of each
#   TURNS=1000 bench/profile.sh
#   ARBOR_BIN=/path/to/arbor PROFILE_OUT=/tmp/p bench/profile.sh   another build,
#                               written elsewhere (the committed profile stays)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TURNS=${TURNS:-300}
RATE=${RATE:-20}
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
cargo build -q --release -p arbor -p arbor-testkit -p arbor-bench
BIN=$TARGET_DIR/release
ARBOR_BIN=${ARBOR_BIN:-$BIN/arbor}
RESULTS=${PROFILE_OUT:-$ROOT/bench/results}
mkdir -p "$RESULTS"
source "$ROOT/bench/common.sh"
open_work profile keep
start_mock0
start_arbor0 valgrind --tool=callgrind --callgrind-out-file="$WORK/callgrind.out" "$ARBOR_BIN"
await_arbor 300 0.5

profile() { # NAME [arbor-bench args...]
  local name=$1; shift
  # Warm-up (connections, caches, prepared statements), then zero.
  taskset -c 1 "$BIN/arbor-bench" load --target arbor --base-url http://127.0.0.1:8080 --model mock-0 \
    --rate "$RATE" --duration 5 --warmup 0 --runs 1 --pool 64 --timeout 60 "$@" 2>/dev/null
  callgrind_control -z "$ARBOR_PID" >/dev/null
  taskset -c 1 "$BIN/arbor-bench" load --target arbor --base-url http://127.0.0.1:8080 --model mock-0 \
    --rate "$RATE" --duration "$(awk -v t="$TURNS" -v r="$RATE" 'BEGIN { print t / r }')" --warmup 0 --runs 1 \
    --pool 64 --timeout 60 --scenario "profile-$name" --out "$WORK/$name.jsonl" "$@"
  sleep 1
  callgrind_control -d "profile-$name" "$ARBOR_PID" >/dev/null
  sleep 1
  local dump; dump=$(ls -t "$WORK"/callgrind.out.* | head -n1)
  local ok; ok=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["ok"])' "$WORK/$name.jsonl")
  {
    echo "# callgrind: $name turns ($ok turns, Arbor on core 0 under valgrind, rate $RATE/s)"
    total=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }')
    echo "# instructions in total: $total; per turn: $(( total / (ok > 0 ? ok : 1) ))"
    echo
    echo "## inclusive (top 60)"
    callgrind_annotate --inclusive=yes --threshold=100 "$dump" 2>/dev/null | sed -n '/^Ir/,$p' | head -n 64 || true
    echo
    echo "## self (top 60)"
    callgrind_annotate --threshold=100 "$dump" 2>/dev/null | sed -n '/^Ir/,$p' | head -n 64 || true
  } >"$RESULTS/profile-$name.txt"
  cp "$dump" "$WORK/keep-$name.out"
  echo "wrote $RESULTS/profile-$name.txt"
}

profile json
profile stream --stream
kill "$ARBOR_PID"; wait "$ARBOR_PID" 2>/dev/null || true
echo "raw callgrind files in $WORK (callgrind_annotate, kcachegrind)"

# Sampling under real load (perf's software clock; this machine has no
# hardware counters): Arbor natively on core 0, JSON turns at PERF_RATE/s.
PERF_RATE=${PERF_RATE:-1000}
if command -v perf >/dev/null; then
  rm -f "$WORK/arbor.db"*
  start_arbor0 "$ARBOR_BIN"
  await_arbor 100 0.2
  taskset -c 1 "$BIN/arbor-bench" load --target arbor --base-url http://127.0.0.1:8080 --model mock-0 \
    --rate "$PERF_RATE" --duration 8 --warmup 2 --runs 1 --scenario perf &
  LOAD_PID=$!
  sleep 4
  perf record -e cpu-clock -F 1999 -g -p "$ARBOR_PID" -o "$WORK/perf.data" -- sleep 4 2>/dev/null
  wait "$LOAD_PID"
  {
    echo "# perf (cpu-clock samples) of Arbor under JSON turns at $PERF_RATE/s, 4 s (callers: perf report -g)"
    echo
    echo "## by shared object"
    perf report -i "$WORK/perf.data" --stdio --no-children --sort dso -g none 2>/dev/null | grep -v '^$' | grep -v '^#' | head -n 12 || true
    echo
    echo "## by symbol (self, top 60)"
    perf report -i "$WORK/perf.data" --stdio --no-children --sort dso,symbol -g none 2>/dev/null \
      | grep -v '^$' | grep -v '^#' | head -n 60 || true
  } | sed -E 's/[[:space:]]+-[[:space:]]+-[[:space:]]*$//; s/[[:space:]]+$//' >"$RESULTS/profile-perf.txt"
  echo "wrote $RESULTS/profile-perf.txt"
fi
