#!/usr/bin/env bash
# The floor under Arbor's overhead on this machine: the same load, rate by
# rate, against the mock directly, against `arbor-floor` (a stateless
# pass-through on Arbor's HTTP stack, on Arbor's core) without and with the
# two durable writes a stateful turn needs, and against Arbor. What the
# floor adds, any server built this way pays here; the rest is Arbor's own
# work. Prints a Markdown table (medians over RUNS runs) and keeps the raw
# lines in OUT.
#
#   bench/floor.sh [RATE...]          # defaults: 100 500 1000 2000 3000
#
# STREAM=1 measures streamed turns (time to first token; the mock streams
# 20 chunks 5 ms apart, as in S3) instead of JSON ones. SECONDS_MEASURED
# (default 5) and RUNS (default 3) set each point's runs; OUT (default
# $TMPDIR/floor.jsonl) the raw results. SQLITE_SYNC=normal runs Arbor
# without its fsyncs (compare it with the floor's 0-fsync column).
#
# Needs a release build (cargo build --release -p arbor -p arbor-testkit -p arbor-bench);
# BIN_DIR points at another (CI's smoke runs the dev build at a tiny rate).
# Fails when a variant answered nothing at some rate.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${BIN_DIR:-${CARGO_TARGET_DIR:-$ROOT/target}/release}
RATES=("$@")
[[ ${#RATES[@]} -gt 0 ]] || RATES=(100 500 1000 2000 3000)
SECONDS_MEASURED=${SECONDS_MEASURED:-5}
RUNS=${RUNS:-3}
OUT=${OUT:-${TMPDIR:-/tmp}/floor.jsonl}
STREAM=${STREAM:-0}
source "$ROOT/bench/common.sh"
open_work floor
: >"$OUT"

start_mock0
MOCK_PORT=9100
MODEL=mock-0
STREAM_ARGS=()
if [[ $STREAM == 1 ]]; then
  LD_PRELOAD=$WORK/nodelay.so taskset -c 1 "$BIN/arbor-mock" --listen 127.0.0.1:9102 --chunks 20 \
    --chunk-delay-ms 5 >"$WORK/mock-stream.log" 2>&1 &
  PIDS+=($!)
  mock_model_toml mock-stream mockstream 9102 >>"$WORK/arbor.toml"
  MOCK_PORT=9102
  MODEL=mock-stream
  STREAM_ARGS=(--stream)
fi
start_arbor0 "$BIN/arbor"
mkdir -p "$WORK/floor"
taskset -c 0 "$BIN/arbor-floor" --listen 127.0.0.1:8090 --upstream "http://127.0.0.1:$MOCK_PORT" \
  >"$WORK/floor0.log" 2>&1 &
FLOOR0_PID=$!
PIDS+=("$FLOOR0_PID")
taskset -c 0 "$BIN/arbor-floor" --listen 127.0.0.1:8091 --upstream "http://127.0.0.1:$MOCK_PORT" \
  --fsyncs 2 --data-dir "$WORK/floor" >"$WORK/floor2.log" 2>&1 &
FLOOR2_PID=$!
PIDS+=("$FLOOR2_PID")
await_arbor 100 0.2
for port in 8090 8091; do
  for _ in $(seq 1 100); do curl -s -o /dev/null -m 2 "http://127.0.0.1:$port/" && break; sleep 0.2; done
done

load() { # VARIANT TARGET BASE_URL MODEL RATE [PID]
  local pid_args=()
  [[ -n ${6:-} ]] && pid_args=(--server-pid "$6")
  taskset -c 1 "$BIN/arbor-bench" load --target "$2" --base-url "$3" --model "$4" --rate "$5" \
    --duration "$SECONDS_MEASURED" --warmup 2 --runs "$RUNS" --scenario floor --variant "$1" \
    --out "$OUT" "${STREAM_ARGS[@]}" "${pid_args[@]}" >>"$WORK/load.log" 2>&1
}

# Rate by rate, every variant in the same minutes.
for rate in "${RATES[@]}"; do
  load direct openai "http://127.0.0.1:$MOCK_PORT/v1" mock-model "$rate"
  load floor-0 openai http://127.0.0.1:8090/v1 mock-model "$rate" "$FLOOR0_PID"
  load floor-2 openai http://127.0.0.1:8091/v1 mock-model "$rate" "$FLOOR2_PID"
  load arbor arbor http://127.0.0.1:8080 "$MODEL" "$rate" "$ARBOR_PID"
done

python3 - "$OUT" "$STREAM" <<'PY'
import json, statistics, sys
from collections import defaultdict

runs = defaultdict(list)
for line in open(sys.argv[1]):
    run = json.loads(line)
    runs[(run["variant"], run["rate"])].append(run)
measure = "first_delta_us" if sys.argv[2] == "1" else "latency_us"

def median(variant, rate, pick):
    values = [pick(run) for run in runs.get((variant, rate), [])]
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None

def fmt(us):
    return "—" if us is None else (f"{us / 1000:.2f} ms" if abs(us) >= 10_000 else f"{us:.0f} µs")

def column(variant, rate):
    p50 = median(variant, rate, lambda run: (run[measure] or {}).get("p50"))
    p99 = median(variant, rate, lambda run: (run[measure] or {}).get("p99"))
    direct50 = median("direct", rate, lambda run: (run[measure] or {}).get("p50"))
    direct99 = median("direct", rate, lambda run: (run[measure] or {}).get("p99"))
    if None in (p50, p99, direct50, direct99):
        return "—"
    ok = min(run["ok"] / max(run["sent"], 1) for run in runs[(variant, rate)])
    cpu = median(variant, rate, lambda run: run["server_cpu_us_per_request"])
    cell = f"{fmt(p50 - direct50)} / {fmt(p99 - direct99)}"
    if cpu is not None:
        cell += f", {cpu:.0f} µs CPU"
    if ok < 1:
        cell += f", {ok:.0%} ok"
    return cell

what = "time to first token" if sys.argv[2] == "1" else "whole answer"
print(f"Overhead p50 / p99 over the direct call ({what}), and the server's CPU per request; medians of each point's runs.\n")
print("| rate | direct p50 / p99 | floor, no fsync | floor, 2 fsyncs | Arbor |")
print("|---|---|---|---|---|")
for rate in sorted({rate for (_, rate) in runs}):
    direct = f"{fmt(median('direct', rate, lambda run: (run[measure] or {}).get('p50')))} / " \
             f"{fmt(median('direct', rate, lambda run: (run[measure] or {}).get('p99')))}"
    print(f"| {rate:g} | {direct} | {column('floor-0', rate)} | {column('floor-2', rate)} | {column('arbor', rate)} |")

silent = [f"{variant} at {rate:g}/s" for rate in sorted({rate for (_, rate) in runs})
          for variant in ("direct", "floor-0", "floor-2", "arbor")
          if not any(run["ok"] for run in runs.get((variant, rate), []))]
if silent:
    sys.exit("no successful requests: " + ", ".join(silent))
PY
