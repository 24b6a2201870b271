#!/usr/bin/env bash
# JSON (or streamed) turns on PostgreSQL: runs Arbor (pinned to core 0) on a
# fresh database `arbor_pgturns` of the machine's PostgreSQL against the 0 ms
# mock (core 1), drives RATE turns/s for 12 s (2 s warm-up) and prints the
# load client's line (latency, TTFT, Arbor's own overhead). With
# COUNT_STATEMENTS=1 it instead drives 5 turns/s for 4 s with sqlx's
# statement log on and prints the statements per turn by kind (the round
# trips a turn costs). Alternate two builds to compare them. It also prints
# what PostgreSQL spent per turn (bench/pgcost.py: its CPU, commits, WAL
# and rows by table).
# With KEEP=keep its work folder (Arbor's log in stderr) is left in /tmp.
#
#   bench/pgturns.sh [ARBOR_BIN] [RATE] [--stream]   # defaults: the release build, 20
#
# Needs PostgreSQL on 127.0.0.1:5432 (trust auth; PG_URL overrides) and a
# release build (cargo build --release -p arbor -p arbor-testkit -p arbor-bench).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
ARBOR_BIN=${1:-$BIN/arbor}
RATE=${2:-20}
shift $(($# < 2 ? $# : 2))
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
source "$ROOT/bench/common.sh"
open_work pgturns ${KEEP:-}
psql -q "$PG_URL/postgres" -c "DROP DATABASE IF EXISTS arbor_pgturns" -c "CREATE DATABASE arbor_pgturns" 2>/dev/null
start_mock0
arbor_toml0 "$PG_URL/arbor_pgturns"
if [[ ${COUNT_STATEMENTS:-0} == 1 ]]; then
  RUST_LOG=info,sqlx::query=debug start_arbor0 "$ARBOR_BIN"
  RATE=5 DURATION=4 WARMUP=0
else
  start_arbor0 "$ARBOR_BIN"
  DURATION=12 WARMUP=2
fi
await_arbor 100 0.2
python3 "$ROOT/bench/pgcost.py" snap "$PG_URL" arbor_pgturns >"$WORK/pg-before.json"
taskset -c 1 "$BIN/arbor-bench" load --target arbor --base-url http://127.0.0.1:8080 --model mock-0 \
  --rate "$RATE" --duration "$DURATION" --warmup "$WARMUP" --runs 1 --scenario pgturns "$@" >"$WORK/load.log" 2>&1
if [[ ${COUNT_STATEMENTS:-0} == 1 ]]; then
  # Statements logged between the first and the last "turn finished".
  python3 - "$WORK/stderr" <<'PY'
import collections, re, sys
lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in open(sys.argv[1])]
finished = [i for i, line in enumerate(lines) if "turn finished" in line]
turns = len(finished) - 1
kinds = collections.Counter()
for line in lines[finished[0] + 1 : finished[-1] + 1]:
    match = re.search(r'summary="([^"]*)"', line)
    if match:
        kinds[match.group(1)[:40]] += 1
print(f"{sum(kinds.values()) / turns:.1f} statements per turn over {turns} turns")
for kind, count in kinds.most_common():
    print(f"  {count / turns:5.2f}  {kind}")
PY
else
  grep -o "run 1: .*" "$WORK/load.log" || tail -n 3 "$WORK/load.log"
fi
python3 "$ROOT/bench/pgcost.py" diff "$PG_URL" arbor_pgturns "$WORK/pg-before.json"
