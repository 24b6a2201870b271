#!/usr/bin/env bash
# Per-thread cost of a JSON turn: runs Arbor (pinned to core 0, fresh SQLite
# database) against the 0 ms mock (core 1), drives RATE turns/s for 12 s and
# counts, over 5 s in the middle, each thread's CPU time, the SQLite
# writer's pwrite, fcntl and sync calls (about one pwrite per commit
# through the arbor-unix VFS layer, two per WAL frame before it; ~5 fcntl
# lock calls per commit), the pages the checkpointer copies (its pwrite
# calls), the tokio worker's pread and getrandom calls, and
# the disk's write requests and cache flushes, divided by the turns in the
# window. Alternate two builds to compare them; single runs vary by ~10% on
# a shared VM (far more in a slow hour).
#
#   bench/threadstat.sh [ARBOR_BIN] [RATE]      # defaults: the release build, 500
#
# EXTRA_TOML is appended to Arbor's config (e.g. "[server]
# idle_conversations_kept = 2048"; bench/common.sh).
#
# MOCK_DELAY_MS sets the mock's delay (default 0; 60 is S2's shape, where
# ~RATE*0.06 turns are in flight at once).
#
# STREAM=1 drives streamed turns instead (with MOCK_CHUNK_DELAY_MS=5, S3's
# mock: 20 chunks 5 ms apart).
#
# AFTER_START is a shell command run once Arbor answers, with ARBOR_PID set
# (an experiment's setup, e.g. `chrt` on one of its threads).
#
# LIMITED=1 drives the turns as a user with a credit balance (10^12 credits,
# made with `arbor users add` / `users credits`), whose calls hold credits
# before they are made; the default is the first admin, who is unlimited.
# Those commands open the database beside the running Arbor, so LIMITED=1
# runs it with SQLITE_LOCKING=shared (bench/common.sh).
#
# Needs perf (syscall tracepoints) and a release build
# (cargo build --release -p arbor -p arbor-testkit -p arbor-bench).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
ARBOR_BIN=${1:-$BIN/arbor}
RATE=${2:-500}
source "$ROOT/bench/common.sh"
[[ ${LIMITED:-0} == 1 ]] && export SQLITE_LOCKING=shared
open_work threadstat
start_pair0 "$ARBOR_BIN" "${MOCK_DELAY_MS:-0}"
after_start
if [[ ${LIMITED:-0} == 1 ]]; then
  ARBOR_BENCH_KEY=$("$ARBOR_BIN" users add bench-limited --data-dir "$WORK" --config "$WORK/arbor.toml")
  "$ARBOR_BIN" users credits bench-limited --set 1000000000000 --data-dir "$WORK" --config "$WORK/arbor.toml" 2>/dev/null
  export ARBOR_BENCH_KEY
fi
start_load12 "$RATE" threadstat
# The block device under $WORK: its write requests and cache flushes in the
# window (/sys/class/block/DEV/stat: writes completed, sectors written, flushes).
DISK=/sys/class/block/$(basename "$(df --output=source "$WORK" | tail -n1)")/stat
cp "$DISK" "$WORK/disk.before" 2>/dev/null || true
# Each thread's voluntary (it slept) and involuntary (it was preempted)
# switches, from /proc, around the same window.
switch_counts() {
  for task in /proc/"$ARBOR_PID"/task/*; do
    echo "$(cat "$task/comm") $(awk '/^(non)?voluntary_ctxt_switches/ {printf "%s ", $2}' "$task/status")"
  done >"$1" 2>/dev/null || true
}
switch_counts "$WORK/switches.before"
perf stat -e 'syscalls:sys_enter_pwrite64,syscalls:sys_enter_fcntl,syscalls:sys_enter_fsync,syscalls:sys_enter_fdatasync,syscalls:sys_enter_pread64,syscalls:sys_enter_getrandom,task-clock,context-switches' --per-thread -p "$ARBOR_PID" \
  -o "$WORK/perf.txt" -- sleep 5
switch_counts "$WORK/switches.after"
cp "$DISK" "$WORK/disk.after" 2>/dev/null || true
load_result >"$WORK/result"
python3 - "$WORK/perf.txt" "$((RATE * 5))" "$WORK/disk.before" "$WORK/disk.after" "$WORK/switches.before" "$WORK/switches.after" <<'PY'
import collections, os, re, sys
path, turns = sys.argv[1], int(sys.argv[2])
total = collections.defaultdict(float)
for line in open(path):
    match = re.match(r"\s*(\S+)-\d+\s+([\d.,]+)\s+(?:msec )?(\S+)", line)
    if match:
        thread, value, event = match.groups()
        total[(thread, event)] += float(value.replace(",", ""))
cpu = {thread: ms * 1000 / turns for (thread, event), ms in total.items() if event == "task-clock"}
writer = "arbor-sqlite-wr"
print(f"per turn at {turns // 5}/s: CPU {sum(cpu.values()):.0f} us (" +
      ", ".join(f"{thread} {us:.0f}" for thread, us in sorted(cpu.items(), key=lambda item: -item[1])) + "); "
      f"writer pwrite {total[(writer, 'syscalls:sys_enter_pwrite64')] / turns:.1f}, "
      f"fcntl {total[(writer, 'syscalls:sys_enter_fcntl')] / turns:.1f}, "
      f"fsync {total[(writer, 'syscalls:sys_enter_fsync')] / turns:.2f} "
      f"fdatasync {total[(writer, 'syscalls:sys_enter_fdatasync')] / turns:.2f} "
      f"(checkpointer {sum(total[('arbor-sqlite-ch', 'syscalls:sys_enter_' + call)] for call in ('fsync', 'fdatasync')) / turns:.2f}, "
      f"pages copied {total[('arbor-sqlite-ch', 'syscalls:sys_enter_pwrite64')] / turns:.1f}); "
      f"context switches {sum(v for (t, e), v in total.items() if e == 'context-switches') / turns:.1f}")
def switch_counts(path):
    counts = collections.defaultdict(lambda: [0, 0])
    for line in open(path):
        fields = line.split()
        if len(fields) >= 3:
            counts[" ".join(fields[:-2])][0] += int(fields[-2])
            counts[" ".join(fields[:-2])][1] += int(fields[-1])
    return counts
if all(os.path.exists(p) for p in sys.argv[5:7]):
    before, after = switch_counts(sys.argv[5]), switch_counts(sys.argv[6])
    rows = {t: [(after[t][i] - before[t][i]) / turns for i in (0, 1)] for t in after}
    print("context switches per turn by thread, slept + preempted: " + ", ".join(
        f"{t} {v:.1f} + {n:.1f}" for t, (v, n) in sorted(rows.items(), key=lambda item: -sum(item[1])) if v + n >= 0.05))
worker = "tokio-rt-worker"
print(f"worker per turn: pread {total[(worker, 'syscalls:sys_enter_pread64')] / turns:.2f}, "
      f"getrandom {total[(worker, 'syscalls:sys_enter_getrandom')] / turns:.2f}")
if all(os.path.exists(p) for p in sys.argv[3:5]):
    before, after = ([int(v) for v in open(p).read().split()] for p in sys.argv[3:5])
    delta = [b - a for a, b in zip(before, after)]
    flushes = f", flushes {delta[15] / turns:.2f}" if len(delta) > 15 else ""
    print(f"disk per turn (whole device): write requests {delta[4] / turns:.2f}, "
          f"KiB written {delta[6] / 2 / turns:.1f}{flushes}")
PY
cat "$WORK/result"
