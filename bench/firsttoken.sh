#!/usr/bin/env bash
# Where a streamed turn's first token waits, from Arbor's system calls alone:
# runs Arbor (pinned to core 0, fresh SQLite database) against S3's mock (20
# chunks 5 ms apart, core 1), drives RATE streamed turns/s for 12 s and
# records, over 5 s in the middle, the tracepoints of the calls on the
# first token's path (`perf record`). For each request Arbor sends to the
# mock it then finds, going back, the `fdatasync` that made the turn's
# start durable (the last one to return before the request went out) and
# the WAL write of that commit, and going forward the first bytes back on
# that connection. Prints p50 / p90 / p99 of each stretch:
#
#   WAL write -> sync        the commit written, until its fdatasync starts
#   sync                     the fdatasync itself
#   sync -> request out      the writer answering, the engine starting the
#                            turn, the HTTP client sending (back from the
#                            durable write to the request on the wire)
#   request out -> answer in the mock's response head (and loopback)
#
# The pairing is by order, not by connection, so it holds where turns
# rarely overlap within these few hundred µs: low rates (the default, 50/s).
#
#   bench/firsttoken.sh [ARBOR_BIN] [RATE]
#
# Needs perf (syscall tracepoints), ss, and a release build
# (cargo build --release -p arbor -p arbor-testkit -p arbor-bench).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
ARBOR_BIN=${1:-$BIN/arbor}
RATE=${2:-50}
export MOCK_CHUNK_DELAY_MS=${MOCK_CHUNK_DELAY_MS:-5} STREAM=1
source "$ROOT/bench/common.sh"
open_work firsttoken
start_pair0 "$ARBOR_BIN"
after_start
start_load12 "$RATE" firsttoken
calls=(sys_enter_pwrite64 sys_enter_fdatasync sys_exit_fdatasync sys_enter_writev sys_enter_recvfrom
  sys_exit_recvfrom)
perf record -q -o "$WORK/calls.data" "${calls[@]/#/-esyscalls:}" -p "$ARBOR_PID" -- sleep 5 >/dev/null 2>&1
# Arbor's sockets by file descriptor: those to the mock (port 9100).
ss -tnpH >"$WORK/sockets"
perf script -i "$WORK/calls.data" >"$WORK/calls.txt" 2>/dev/null
python3 "$ROOT/bench/firsttoken.py" "$WORK/calls.txt" "$WORK/sockets" "$ARBOR_PID"
wait "$LOAD_PID"
grep -o 'run 1: .*' "$WORK/load.log" || tail -n 3 "$WORK/load.log"
