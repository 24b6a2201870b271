#!/usr/bin/env bash
# Profiles Arbor on a long conversation (S5's shape, smaller so that it runs
# under valgrind) with callgrind: records a trunk and its branches through
# views, then `--repeats` times moves the head, loads the tree and the
# active path and runs a JSON turn at a branch's leaf. Prints the whole
# run's instructions and the functions a long conversation spends them in.
#
#   bench/treeprofile.sh                      the build in the target folder
#   ARBOR_BIN=/path/to/arbor bench/treeprofile.sh --trunk 1000   another build, other sizes
#   MOCK_PROTOCOL=anthropic bench/treeprofile.sh   the model behind Arbor's Anthropic adapter (or gemini)
#
# Defaults: --trunk 2000 --branches 20 --branch-length 50 --repeats 10. The
# raw callgrind file stays in the folder printed last.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
cargo build -q --release -p arbor -p arbor-testkit -p arbor-bench
BIN=$TARGET_DIR/release
ARBOR_BIN=${ARBOR_BIN:-$BIN/arbor}
source "$ROOT/bench/common.sh"
open_work treeprofile keep
start_mock0
start_arbor0 valgrind --tool=callgrind --callgrind-out-file="$WORK/callgrind.out" "$ARBOR_BIN"
await_arbor 300 0.5
args=(--trunk 2000 --branches 20 --branch-length 50 --repeats 10 "$@")
taskset -c 1 "$BIN/arbor-bench" tree --base-url http://127.0.0.1:8080 --model mock-0 --out "$WORK/tree.jsonl" \
  "${args[@]}" >/dev/null
callgrind_control -d tree "$ARBOR_PID" >/dev/null
sleep 2
dump=$(ls -t "$WORK"/callgrind.out.* | head -n1)
echo "# callgrind: S5's shape (${args[*]}), $(basename "$ARBOR_BIN")"
callgrind_annotate --inclusive=yes --threshold=100 "$dump" 2>/dev/null | grep -E \
  'PROGRAM TOTALS|NodeParts<L>::part|views::NodeView::write|tree::Tree::path_to|Provider>::stream::\{\{closure\}\} |FromRequest<S>>::from_request::\{\{closure\}\} |TrackedSeed<X> as serde_core::de::DeserializeSeed>::deserialize \[|TurnTask::drive::\{\{closure\}\} |Node as core::clone::Clone|Message as core::clone::Clone|mi_malloc_aligned|mi_free \[' \
  | cut -c1-170 || true
echo "raw: $dump"
