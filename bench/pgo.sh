#!/usr/bin/env bash
# Builds Arbor, and the benchmark's floor (`arbor-floor`), with profile-guided
# optimisation, and prints the folder that holds both binaries:
#
#   bench/pgo.sh            -> $CARGO_TARGET_DIR/pgo/<host>/release
#
# 1. Both are built instrumented (`-Cprofile-generate`) in a target folder
#    of their own, so neither build invalidates the other or the plain one.
# 2. Each runs the turns the benchmark measures, pinned like the benchmark:
#    JSON turns at 500/s and streamed turns at 100/s against the 0 ms mock
#    (20 chunks), Arbor on SQLite and, when PostgreSQL answers at PG_URL,
#    on PostgreSQL too; the floor with its two fsyncs. Each stops on SIGTERM
#    so that its exit writes the profile.
# 3. The profiles are merged (`llvm-profdata`) and both are built again with
#    `-Cprofile-use`: the compiler inlines, lays out and orders branches by
#    what ran, and keeps code that never ran out of the way.
#
# The profile is of the turn path: code the training never ran (other
# providers' adapters, tools, the tree routes) is laid out as cold. A
# deployment whose traffic differs should train on its own (TRAIN_RATE,
# TRAIN_STREAM_RATE, or this script as a template). Only Rust code is
# optimised: the C linked in (the bundled SQLite, mimalloc) is built as
# before. GCC's profile-guided build of it was tried and measured no
# faster (bench/analysis.md, "Since the thirty-fourth run").
#
# Needs `llvm-profdata` from LLVM 19 or later (it reads the raw profiles of
# rustc's LLVM; Debian: `apt-get install llvm-19`); LLVM_PROFDATA overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}
HOST=$(rustc -vV | sed -n 's/^host: //p')
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
TRAIN_RATE=${TRAIN_RATE:-500}
TRAIN_STREAM_RATE=${TRAIN_STREAM_RATE:-100}

find_profdata() {
  if [[ -n "${LLVM_PROFDATA:-}" ]]; then echo "$LLVM_PROFDATA"; return; fi
  # The newest LLVM installed; rustc's raw profiles need 19 or later.
  local newest
  newest=$(ls -d /usr/lib/llvm-*/bin/llvm-profdata 2>/dev/null | sort -t- -k2 -n | tail -n1)
  local major=${newest#/usr/lib/llvm-}; major=${major%%/*}
  if [[ -z "$newest" || $major -lt 19 ]]; then
    echo "bench/pgo.sh: needs llvm-profdata from LLVM 19 or later (apt-get install llvm-19, or set LLVM_PROFDATA)" >&2
    exit 1
  fi
  echo "$newest"
}
PROFDATA=$(find_profdata)

# The mock and the load client are the plain release build's.
cargo build -q --release -p arbor-testkit -p arbor-bench >&2
BIN=$TARGET_DIR/release

BUILD=(-q --release --target "$HOST" -p arbor -p arbor-testkit --bin arbor --bin arbor-floor)
GEN_DIR=$TARGET_DIR/pgo-generate
RAW=$GEN_DIR/profiles
GEN=$GEN_DIR/$HOST/release
rm -rf "$RAW"
mkdir -p "$RAW"
RUSTFLAGS="-Cprofile-generate=$RAW" cargo build --target-dir "$GEN_DIR" "${BUILD[@]}" >&2

source "$ROOT/bench/common.sh"
open_work pgo

train_load() { # NAME RATE TARGET [arbor-bench args...]
  local name=$1 rate=$2 target=$3; shift 3
  local model=mock-0 base=http://127.0.0.1:8080
  if [[ $target == openai ]]; then model=mock-model; base=$base/v1; fi
  taskset -c 1 "$BIN/arbor-bench" load --target "$target" --base-url "$base" --model "$model" --rate "$rate" \
    --duration 10 --warmup 1 --runs 1 --scenario "pgo-$name" "$@" >"$WORK/$name.log" 2>&1 \
    || { cat "$WORK/$name.log" >&2; exit 1; }
  grep -o "run 1: [0-9]*/[0-9]* ok" "$WORK/$name.log" | sed "s|^|bench/pgo.sh: $name |" >&2
}

stop() { # PID: SIGTERM, so that the exit handlers write the profile
  kill -TERM "$1"
  wait "$1" || true
}

start_mock0 0

# Arbor on SQLite, then on PostgreSQL when it answers.
train_arbor() { # NAME DATABASE_URL
  arbor_toml0 "$2"
  start_arbor0 "$GEN/arbor"
  await_arbor 100 0.2
  train_load "$1-json" "$TRAIN_RATE" arbor
  train_load "$1-stream" "$TRAIN_STREAM_RATE" arbor --stream
  stop "$ARBOR_PID"
}
train_arbor sqlite "sqlite://$WORK/arbor.db"
if pg_isready -q -d "$PG_URL" 2>/dev/null; then
  database=arbor_pgo_$$
  psql -q "$PG_URL/postgres" -c "DROP DATABASE IF EXISTS $database" -c "CREATE DATABASE $database" >&2
  train_arbor postgres "$PG_URL/$database"
  psql -q "$PG_URL/postgres" -c "DROP DATABASE IF EXISTS $database" >&2
fi

# The floor, with both durable writes, on the same port and loads.
mkdir -p "$WORK/floor"
taskset -c 0 "$GEN/arbor-floor" --listen 127.0.0.1:8080 --upstream http://127.0.0.1:9100 --fsyncs 2 \
  --data-dir "$WORK/floor" >"$WORK/floor.log" 2>&1 &
FLOOR_PID=$!
PIDS+=("$FLOOR_PID")
wait_http http://127.0.0.1:8080/
train_load floor-json "$TRAIN_RATE" openai
train_load floor-stream "$TRAIN_STREAM_RATE" openai --stream
stop "$FLOOR_PID"

# Named by content, so that a new profile changes the flags and Cargo
# rebuilds (it does not look inside a file the flags name).
"$PROFDATA" merge -o "$WORK/merged.profdata" "$RAW"/*.profraw
USE_DIR=$TARGET_DIR/pgo
mkdir -p "$USE_DIR"
PROFILE=$USE_DIR/arbor-$(sha256sum "$WORK/merged.profdata" | cut -c1-16).profdata
cp "$WORK/merged.profdata" "$PROFILE"
RUSTFLAGS="-Cprofile-use=$PROFILE" cargo build --target-dir "$USE_DIR" "${BUILD[@]}" >&2
# Older profiles are no longer named by any build.
find "$USE_DIR" -maxdepth 1 -name 'arbor-*.profdata' ! -path "$PROFILE" -delete
echo "$USE_DIR/$HOST/release"
