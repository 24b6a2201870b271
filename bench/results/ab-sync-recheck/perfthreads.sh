#!/usr/bin/env bash
# perf record (cpu-clock, 4,999 Hz, 5 s in the middle of a 12 s load) of Arbor under RATE JSON
# turns/s; OUT.dso and OUT.sym: samples by thread and object, by thread and symbol.
#   perfthreads.sh ARBOR_BIN [RATE] [OUT]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
ARBOR_BIN=${1}; RATE=${2:-2000}; OUT=${3:-/tmp/arbor-perf}
source "$ROOT/bench/common.sh"
open_work perfthreads
start_pair0 "$ARBOR_BIN" 0
start_load12 "$RATE" pt
perf record -e cpu-clock -F 4999 -g -p "$ARBOR_PID" -o "$OUT.data" -- sleep 5 2>/dev/null
load_result
perf report -i "$OUT.data" --no-children --sort comm,dso --stdio -g none 2>/dev/null | grep "%" | head -20 > "$OUT.dso"
perf report -i "$OUT.data" --no-children --sort comm,sym --stdio -g none 2>/dev/null | grep -v "^#" | grep "%" | head -80 > "$OUT.sym"
