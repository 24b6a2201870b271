# Sourced by the bench scripts (run.sh, profile.sh, threadstat.sh).

# The TOML of one OpenAI provider named PROVIDER on a loopback mock at PORT
# and the model MODEL it serves, at the prices every bench model has.
# MOCK_PROTOCOL=anthropic or gemini makes it a provider of that kind (the
# scripts that start the mock with `start_mock0` then start it speaking
# that protocol).
mock_model_toml() { # MODEL PROVIDER PORT
  local base_url
  case ${MOCK_PROTOCOL:-openai} in
    anthropic) base_url="http://127.0.0.1:$3" ;;
    gemini) base_url="http://127.0.0.1:$3/v1beta" ;;
    *) base_url="http://127.0.0.1:$3/v1" ;;
  esac
  cat <<TOML

[providers.$2]
kind = "${MOCK_PROTOCOL:-openai}"
base_url = "$base_url"

[models."$1"]
provider = "$2"
context_window = 128000
prices = { input = 150000, output = 600000 }
TOML
}

# The rest is for the scripts that drive one Arbor on core 0 against one
# mock on core 1 (abload, connmem, memprobe, pgturns, profile, threadstat).
# They expect ROOT and BIN from the sourcing script, and WORK and PIDS from
# `open_work`.

# Makes $WORK, a fresh temporary folder named after NAME, and the PIDS
# array; on exit every process in PIDS is stopped and $WORK removed, unless
# KEEP is `keep` (the folder then holds raw files the script points to).
open_work() { # NAME [KEEP]
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/arbor-$1.XXXXXX")
  PIDS=()
  KEEP_WORK=${2:-}
  trap close_work EXIT
}

close_work() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [[ $KEEP_WORK != keep ]]; then rm -rf "$WORK"; fi
}

# Starts the mock (OpenAI's protocol, or MOCK_PROTOCOL's) on core 1 (20 chunks, TCP_NODELAY like a real
# provider) on port 9100, answering after DELAY_MS (default 0), and writes
# $WORK/arbor.toml for it (`arbor_toml0`).
start_mock0() { # [DELAY_MS]
  gcc -shared -fPIC -O2 -o "$WORK/nodelay.so" "$ROOT/bench/nodelay.c" -ldl
  LD_PRELOAD=$WORK/nodelay.so taskset -c 1 "$BIN/arbor-mock" --protocol "${MOCK_PROTOCOL:-openai}" \
    --listen 127.0.0.1:9100 --chunks 20 \
    --delay-ms "${1:-0}" --chunk-delay-ms "${MOCK_CHUNK_DELAY_MS:-0}" >"$WORK/mock.log" 2>&1 &
  PIDS+=($!)
  arbor_toml0
}

# The URL of an SQLite database at PATH: SQLITE_SYNC=normal commits without
# the fsync per durable commit (default full, see the store's `Durability`);
# SQLITE_LOCKING=shared lets other processes open the file while Arbor runs
# (default exclusive: a benchmark's Arbor is alone with its database, and
# its transactions then make no lock system calls; see the store's
# `Locking`).
sqlite_url() { # PATH
  echo "sqlite://$1?locking=${SQLITE_LOCKING:-exclusive}${SQLITE_SYNC:+&synchronous=$SQLITE_SYNC}"
}

# Writes $WORK/arbor.toml: the database at DATABASE_URL (default SQLite in
# $WORK, see `sqlite_url`) and the model `mock-0` served by the mock on
# port 9100, then EXTRA_TOML when set (an experiment's settings, e.g.
# "[server]
# idle_conversations_kept = 2048").
arbor_toml0() { # [DATABASE_URL]
  {
    printf 'default_model = "mock-0"\n\n[storage]\ndatabase_url = "%s"\n' "${1:-$(sqlite_url "$WORK/arbor.db")}"
    mock_model_toml mock-0 mock0 9100
    if [[ -n "${EXTRA_TOML:-}" ]]; then printf '\n%s\n' "$EXTRA_TOML"; fi
  } >"$WORK/arbor.toml"
}

# Waits until URL answers at all (any status), for up to SECONDS (60).
wait_http() { # URL [SECONDS]
  local deadline=$((SECONDS + ${2:-60}))
  until curl -s -o /dev/null -m 2 "$1"; do
    if (( SECONDS > deadline )); then echo "no answer from $1" >&2; return 1; fi
    sleep 0.2
  done
}

# Starts `COMMAND... serve` on core 0 with $WORK's data and config, on port
# 8080 (COMMAND is the arbor binary, possibly behind a wrapper such as
# valgrind), and sets ARBOR_PID.
start_arbor0() { # COMMAND...
  taskset -c 0 "$@" serve --data-dir "$WORK" --listen 127.0.0.1:8080 --config "$WORK/arbor.toml" \
    >"$WORK/stdout" 2>"$WORK/stderr" &
  ARBOR_PID=$!
  PIDS+=("$ARBOR_PID")
}

# Runs $AFTER_START, when set, with ARBOR_PID set: an experiment's setup
# once Arbor answers (e.g. `chrt` or `renice` on one of its threads).
after_start() {
  if [[ -n "${AFTER_START:-}" ]]; then ARBOR_PID=$ARBOR_PID bash -c "$AFTER_START"; fi
}

# The usual pair: the 0 ms (or DELAY_MS) mock, and ARBOR_BIN on core 0 once
# it answers (ARBOR_PID and ARBOR_BENCH_KEY set).
start_pair0() { # ARBOR_BIN [DELAY_MS]
  start_mock0 "${2:-0}"
  start_arbor0 "$1"
  await_arbor 100 0.2
}

# Drives RATE JSON turns/s at the Arbor on port 8080 from core 1 in the
# background (a 2 s warm-up, then one 12 s run, logged to $WORK/load.log),
# sets LOAD_PID and returns 5 s in: a script measures in the load's middle,
# then calls `load_result`.
start_load12() { # RATE SCENARIO
  taskset -c 1 "$BIN/arbor-bench" load --target arbor --base-url http://127.0.0.1:8080 --model mock-0 \
    --rate "$1" --duration 12 --warmup 2 --runs 1 --scenario "$2" ${STREAM:+--stream} >"$WORK/load.log" 2>&1 &
  LOAD_PID=$!
  sleep 5
}

# Waits for `start_load12`'s load to end and prints its run's line.
load_result() {
  wait "$LOAD_PID"
  grep -o "run 1: .*latency µs p50 [0-9]* p99 [0-9]*" "$WORK/load.log" || tail -n 3 "$WORK/load.log"
}

# Waits until Arbor answers on port 8080 (TRIES polls PAUSE seconds apart)
# and exports the admin key it printed to $WORK/stdout as ARBOR_BENCH_KEY.
await_arbor() { # TRIES PAUSE
  for _ in $(seq 1 "$1"); do curl -s -o /dev/null -m 2 http://127.0.0.1:8080/healthz && break; sleep "$2"; done
  ARBOR_BENCH_KEY=$(sed -n 's/^    \(arb_[A-Za-z0-9_-]*\)$/\1/p' "$WORK/stdout" | head -n1)
  export ARBOR_BENCH_KEY
}
