#!/usr/bin/env bash
# Arbor's benchmark (issue 6), one command:
#
#   bench/run.sh            full run (~25 min): writes bench/results/ and bench/REPORT.md
#   bench/run.sh --smoke    the harness at a tiny rate (CI): dev build, SQLite, no
#                           LiteLLM; fails if any step or any request fails
#
# Options: --no-litellm, --no-postgres, --only "S1 S3" (scenarios to run).
# Environment: ARBOR_CORE / LOAD_CORE (default 0 / 1), S1_RATES, S2_RATES,
# S3_RATES, S6_RATES, FLOOR_RATES (space-separated rates; FLOOR_RATES are the
# S1 and S3 rates at which the floor runs too, default 100 500 1000 2000
# 3000), ARBOR_BIN and MOCK_BIN (another arbor or arbor-mock binary, for A/B
# runs), BENCH_OUT (write
# results and report there instead of bench/), LOAD_EXTRA (more arbor-bench load options), PG_URL (default
# postgres://postgres@127.0.0.1:5432), LITELLM (path of the litellm command;
# default: bench/.venv or the one on PATH; installed into bench/.venv when
# missing and BENCH_INSTALL_LITELLM=1), SQLITE_SYNC (normal: SQLite commits
# without the fsync per durable commit; default full), SQLITE_LOCKING
# (shared: other processes may open Arbor's database meanwhile; default
# exclusive, see `sqlite_url` in bench/common.sh).
#
# Arbor runs pinned to ARBOR_CORE; the mocks and the load client share
# LOAD_CORE. Everything listens on 127.0.0.1 and every load is bounded in
# rate, count and time.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
source "$ROOT/bench/common.sh"

SMOKE=0
USE_LITELLM=1
USE_POSTGRES=1
ONLY=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --smoke) SMOKE=1; USE_LITELLM=0; USE_POSTGRES=0 ;;
    --no-litellm) USE_LITELLM=0 ;;
    --no-postgres) USE_POSTGRES=0 ;;
    --only) ONLY="$2"; shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
wants() { [[ -z "$ONLY" || " $ONLY " == *" $1 "* ]]; }

ARBOR_CORE=${ARBOR_CORE:-0}
LOAD_CORE=${LOAD_CORE:-1}
if [[ $(nproc) -lt 2 ]]; then ARBOR_CORE=0; LOAD_CORE=0; fi
PG_URL=${PG_URL:-postgres://postgres@127.0.0.1:5432}
TARGET_DIR=${CARGO_TARGET_DIR:-$ROOT/target}

# The smoke uses the dev build that `cargo test` already made (it checks the
# harness, not the numbers); BENCH_PROFILE overrides either choice.
PROFILE=${BENCH_PROFILE:-$([[ $SMOKE == 1 ]] && echo dev || echo release)}
cargo build -q --profile "$PROFILE" -p arbor -p arbor-testkit -p arbor-bench
BIN=$TARGET_DIR/$([[ $PROFILE == dev ]] && echo debug || echo "$PROFILE")

# An A/B run names another Arbor build; the report then says so.
OTHER_ARBOR_BIN=${ARBOR_BIN:-}
# Arbor and the floor as built for speed: with profile-guided optimisation
# (bench/pgo.sh, ~10 min more) when an llvm-profdata that reads rustc's
# profiles is installed. BENCH_PGO=0 measures the plain release build.
PGO=0
FLOOR_BIN=$BIN/arbor-floor
if [[ $PROFILE == release && -z $OTHER_ARBOR_BIN && ${BENCH_PGO:-1} == 1 ]]; then
  if PGO_DIR=$(bench/pgo.sh); then
    PGO=1
    ARBOR_BIN=$PGO_DIR/arbor
    FLOOR_BIN=$PGO_DIR/arbor-floor
  else
    echo "bench/run.sh: no profile-guided build (above); measuring the plain release build" >&2
  fi
fi

WORK=$(mktemp -d "${TMPDIR:-/tmp}/arbor-bench.XXXXXX")
ARBOR_BIN=${ARBOR_BIN:-$BIN/arbor}
MOCK_BIN=${MOCK_BIN:-$BIN/arbor-mock}
if [[ -n "${BENCH_OUT:-}" ]]; then
  # Somewhere else (an A/B comparison): the committed results stay.
  RESULTS=$BENCH_OUT
  REPORT=$BENCH_OUT/REPORT.md
elif [[ $SMOKE == 1 ]]; then
  RESULTS=$WORK/results
  REPORT=$WORK/REPORT.md
else
  RESULTS=$ROOT/bench/results
  REPORT=$ROOT/bench/REPORT.md
fi
mkdir -p "$RESULTS"
# Results are appended to: start clean (the profile-*.txt files stay). The
# loads file exists from the start, even when --only skips S1.
rm -f "$RESULTS"/{parity,tree,saturation}.jsonl "$RESULTS"/{machine,litellm,postgres}.json
LOADS=$RESULTS/loads.jsonl
: >"$LOADS"
echo "work directory: $WORK"

PIDS=()
cleanup() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  if [[ $SMOKE == 1 ]]; then rm -rf "$WORK"; fi
}
trap cleanup EXIT

# --- TCP_NODELAY for servers that do not set it (see bench/nodelay.c) --------
NODELAY=""
if command -v gcc >/dev/null && gcc -shared -fPIC -O2 -o "$WORK/nodelay.so" "$ROOT/bench/nodelay.c" -ldl; then
  NODELAY=$WORK/nodelay.so
else
  echo "warning: could not build bench/nodelay.c; the mock's streams will stall on Nagle's algorithm" >&2
fi

# --- the mocks (OpenAI wire protocol, prebuilt bodies) ---------------------
start_mock() { # PORT ARGS...
  local port=$1; shift
  LD_PRELOAD=$NODELAY taskset -c "$LOAD_CORE" "$MOCK_BIN" --protocol openai --listen "127.0.0.1:$port" "$@" \
    >"$WORK/mock-$port.log" 2>&1 &
  PIDS+=($!)
  # Any answer (a 404 for GET /) means it listens.
  wait_http "http://127.0.0.1:$port/"
}
MOCK0=9100; MOCK60=9101; MOCKSTREAM=9102
CHUNKS=20; CHUNK_DELAY_MS=5
start_mock $MOCK0 --chunks $CHUNKS
start_mock $MOCK60 --chunks $CHUNKS --delay-ms 60
start_mock $MOCKSTREAM --chunks $CHUNKS --chunk-delay-ms $CHUNK_DELAY_MS

# --- the floor (arbor-floor: Arbor's HTTP stack without Arbor) -----------------
# On Arbor's core, idle but for its own points: a stateless pass-through to
# the 0 ms mock and one to the streaming mock, each without and with the two
# group-committed fdatasyncs a durable turn waits for. What they add over
# the direct call, any server built this way pays on this machine.
declare -A FLOOR_PORT FLOOR_PID
start_floor() { # NAME PORT UPSTREAM_PORT FSYNCS
  mkdir -p "$WORK/floor-$1"
  taskset -c "$ARBOR_CORE" "$FLOOR_BIN" --listen "127.0.0.1:$2" --upstream "http://127.0.0.1:$3" \
    --fsyncs "$4" --data-dir "$WORK/floor-$1" >"$WORK/floor-$1.log" 2>&1 &
  PIDS+=($!)
  FLOOR_PID[$1]=$!
  FLOOR_PORT[$1]=$2
  wait_http "http://127.0.0.1:$2/"
}
start_floor floor-0 8090 $MOCK0 0
start_floor floor-2 8091 $MOCK0 2
start_floor stream-floor-0 8092 $MOCKSTREAM 0
start_floor stream-floor-2 8093 $MOCKSTREAM 2

# --- Arbor -------------------------------------------------------------------
ARBOR_PORT=8080
ARBOR=http://127.0.0.1:$ARBOR_PORT
ARBOR_PID=""
write_config() { # DATABASE_URL FILE
  {
    printf 'default_model = "mock-0"\n\n[storage]\ndatabase_url = "%s"\n' "$1"
    mock_model_toml mock-0 mock0 "$MOCK0"
    mock_model_toml mock-60 mock60 "$MOCK60"
    mock_model_toml mock-stream mockstream "$MOCKSTREAM"
  } >"$2"
}

start_arbor() { # NAME DATABASE_URL [PRELOAD]
  local name=$1 url=$2 dir=$WORK/arbor-$1
  mkdir -p "$dir"
  write_config "$url" "$dir/arbor.toml"
  # Arbor's default log level (info: one line per request) goes to a file.
  LD_PRELOAD=${3:-} taskset -c "$ARBOR_CORE" "$ARBOR_BIN" serve --data-dir "$dir" --listen "127.0.0.1:$ARBOR_PORT" \
    --config "$dir/arbor.toml" >"$dir/stdout" 2>"$dir/stderr" &
  ARBOR_PID=$!
  PIDS+=("$ARBOR_PID")
  wait_http "$ARBOR/healthz"
  # The admin key is printed on the first start only; a restart reuses it.
  ARBOR_KEY=$(sed -n 's/^    \(arb_[A-Za-z0-9_-]*\)$/\1/p' "$dir/stdout" | head -n1)
  if [[ -n "$ARBOR_KEY" ]]; then echo "$ARBOR_KEY" >"$dir/key"; elif [[ -f "$dir/key" ]]; then ARBOR_KEY=$(cat "$dir/key"); fi
  if [[ -z "$ARBOR_KEY" ]]; then echo "Arbor printed no admin key" >&2; cat "$dir/stdout" >&2; return 1; fi
  export ARBOR_BENCH_KEY=$ARBOR_KEY
  echo "Arbor ($name) pid $ARBOR_PID on $ARBOR"
}

stop_arbor() {
  kill "$ARBOR_PID"
  wait "$ARBOR_PID" 2>/dev/null || true
}

# --- load points -------------------------------------------------------------
if [[ $SMOKE == 1 ]]; then
  WARMUP=0.5; RUNS=1
else
  WARMUP=2; RUNS=3
fi
# Enough samples for a p99 at low rates, 5 s at high ones.
duration_for() { awk -v rate="$1" -v smoke="$SMOKE" 'BEGIN {
  if (smoke == 1) { print 1; exit }
  d = 500 / rate; if (d < 5) d = 5; if (d > 10) d = 10; print d }'; }

load() { # SCENARIO VARIANT TARGET RATE [extra arbor-bench args...]
  local scenario=$1 variant=$2 target=$3 rate=$4; shift 4
  local base model
  case "$target" in
    arbor) base=$ARBOR; model=${MODEL:-mock-0} ;;
    direct) base=http://127.0.0.1:${DIRECT_PORT:-$MOCK0}/v1; model=mock-model ;;
    litellm) base=http://127.0.0.1:$LITELLM_PORT/v1; model=mock-model ;;
    *floor-*) base=http://127.0.0.1:${FLOOR_PORT[$target]}/v1; model=mock-model ;;
  esac
  local kind=openai; [[ $target == arbor ]] && kind=arbor
  local pid_args=()
  [[ $target == arbor ]] && pid_args=(--server-pid "$ARBOR_PID")
  [[ $target == litellm ]] && pid_args=(--server-pid "$LITELLM_PID")
  [[ $target == *floor-* ]] && pid_args=(--server-pid "${FLOOR_PID[$target]}")
  local key_args=()
  [[ $target == litellm ]] && key_args=(--key "$LITELLM_KEY")
  taskset -c "$LOAD_CORE" "$BIN/arbor-bench" load --target "$kind" --base-url "$base" --model "$model" \
    --rate "$rate" --duration "$(duration_for "$rate")" --warmup "$WARMUP" --runs "$RUNS" \
    --scenario "$scenario" --variant "$variant" --out "$LOADS" "${pid_args[@]}" "${key_args[@]}" ${LOAD_EXTRA:-} "$@"
}

# The last point's success ratio, to stop climbing past saturation.
last_success_ratio() {
  tail -n 1 "$LOADS" | python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); print(r["ok"]/max(r["sent"],1))'
}
# Whether the last point was saturated: under 90% success, or a median
# latency above LIMIT_MS (queueing: the server no longer keeps up).
saturated() { # LIMIT_MS
  tail -n 1 "$LOADS" | python3 -c '
import json, sys
run = json.loads(sys.stdin.read())
p50 = (run["latency_us"] or {}).get("p50", 0)
sys.exit(0 if run["ok"] < 0.9 * max(run["sent"], 1) or p50 > float(sys.argv[1]) * 1000 else 1)' "$1"
}

# Rows per table, for the parity check (same SQL on both backends).
PARITY_SQL="SELECT (SELECT count(*) FROM turns WHERE status = 'succeeded') || ' ' ||
  (SELECT count(*) FROM messages WHERE role = 'user') || ' ' ||
  (SELECT count(*) FROM messages WHERE role = 'assistant') || ' ' ||
  (SELECT count(*) FROM api_calls) || ' ' || (SELECT count(*) FROM cost_ledger) || ' ' ||
  (SELECT count(*) FROM turns)"
count_rows() { # BACKEND
  if [[ $1 == sqlite ]]; then
    # Python's own sqlite3 module: the sqlite3 shell may not be installed.
    python3 -c 'import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute(sys.argv[2]).fetchone()[0])' \
      "$WORK/arbor-sqlite/arbor.db" "$PARITY_SQL"
  else
    psql -qtA "$PG_URL/$PG_DB" -c "$PARITY_SQL"
  fi
}
parity() { # BACKEND RATE
  local backend=$1 rate=$2 before after
  before=$(count_rows "$backend")
  local mark; mark=$(wc -l <"$LOADS")
  taskset -c "$LOAD_CORE" "$BIN/arbor-bench" load --target arbor --base-url "$ARBOR" --model mock-0 \
    --rate "$rate" --duration "$(duration_for "$rate")" --warmup 0 --runs 1 --pool 256 \
    --scenario S4-parity --variant "$backend" --out "$LOADS"
  sleep 0.5
  after=$(count_rows "$backend")
  local line; line=$(tail -n +"$((mark + 1))" "$LOADS" | head -n1)
  python3 - "$backend" "$before" "$after" "$line" >>"$RESULTS/parity.jsonl" <<'EOF'
import json, sys
backend, before, after, line = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), sys.argv[4]
run = json.loads(line)
names = ["turns_succeeded", "user_messages", "assistant_messages", "api_calls", "cost_ledger", "turns"]
delta = {name: int(a) - int(b) for name, a, b in zip(names, after, before)}
ok = run["ok"]
match = all(delta[name] == ok for name in names)
print(json.dumps({"backend": backend, "sent": run["sent"], "ok": ok, "rows": delta, "match": match}))
EOF
  tail -n 1 "$RESULTS/parity.jsonl"
}

# SQLITE_SYNC=normal measures SQLite without the fsync per durable commit
# (the default is full; see ARCHITECTURE.md); SQLITE_LOCKING (common.sh).
SQLITE_URL=$(sqlite_url "$WORK/arbor-sqlite/arbor.db")
# The parity check counts rows from another process, which exclusive
# locking would refuse: that Arbor shares the file.
SQLITE_SHARED_URL=$(SQLITE_LOCKING=shared sqlite_url "$WORK/arbor-sqlite/arbor.db")

# --- the machine -------------------------------------------------------------
python3 - >"$RESULTS/machine.json" <<EOF
import json, os, platform, subprocess
def cmd(*args):
    try: return subprocess.run(args, capture_output=True, text=True).stdout.strip()
    except Exception as error: return str(error)
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
mem = next((line.split(":", 1)[1].strip() for line in open("/proc/meminfo") if line.startswith("MemTotal")), "?")
def release(key):
    section = open("$ROOT/Cargo.toml").read().split("[profile.release]", 1)[-1].split("[", 1)[0]
    values = {k.strip(): v.strip().strip('"') for k, _, v in (l.partition("=") for l in section.splitlines()) if v}
    return values.get(key, "?")
print(json.dumps({
    "cpu": cpu, "cores": os.cpu_count(), "memory": mem, "kernel": platform.release(),
    "rustc": cmd("rustc", "--version"), "commit": cmd("git", "-C", "$ROOT", "rev-parse", "--short", "HEAD"),
    # The results and report themselves do not make the code dirty.
    "dirty": bool(cmd("git", "-C", "$ROOT", "status", "--porcelain", "--untracked-files=no", "--", ".",
                      ":!bench/results", ":!bench/REPORT.md")),
    "date": cmd("date", "-u", "+%Y-%m-%d %H:%M UTC"), "arbor_core": $ARBOR_CORE, "load_core": $LOAD_CORE,
    "chunks": $CHUNKS, "chunk_delay_ms": $CHUNK_DELAY_MS, "smoke": $SMOKE == 1,
    "sqlite_sync": "${SQLITE_SYNC:-full}", "sqlite_locking": "${SQLITE_LOCKING:-exclusive}",
    # The release profile's code generation (Cargo.toml; the environment's overrides win).
    "build": "$PROFILE" if "$PROFILE" != "release" else "release: lto " + os.environ.get(
        "CARGO_PROFILE_RELEASE_LTO", release("lto")) + ", codegen-units " + os.environ.get(
        "CARGO_PROFILE_RELEASE_CODEGEN_UNITS", release("codegen-units")) + (
        ", profile-guided (bench/pgo.sh)" if $PGO == 1 else ""),
    "pgo": $PGO == 1,
    "loadavg_start": open("/proc/loadavg").read().split()[:3],
    # An A/B run measures another build than the harness's own.
    "arbor_bin": "$OTHER_ARBOR_BIN" or None,
    # How fast the machine is this hour (bench/calibrate.py); again at the end.
    "calibration_start": json.loads(cmd("python3", "$ROOT/bench/calibrate.py", "$WORK", "$ARBOR_CORE") or "null"),
}))
EOF

# --- SQLite: S0-S3, S4 (sqlite half), S5 -------------------------------------
start_arbor sqlite "$SQLITE_URL"

if [[ $SMOKE == 1 ]]; then
  S1_RATES="20"; S2_RATES="20"; S3_RATES="20"; S6_RATES=""; FLOOR_RATES="20"
else
  # S1 climbs until Arbor saturates (see the loop below), so the rates past
  # 4,000/s cost time only in an hour where it keeps up there; they are what
  # decides the ×100 throughput goal, which needs 100 times LiteLLM's highest
  # sustained rate (50 or 100/s on this machine).
  S1_RATES=${S1_RATES:-10 50 100 200 300 400 500 700 1000 1500 2000 3000 4000 5000 6000 8000 10000}
  S2_RATES=${S2_RATES:-500 1000 2000 3000}
  S3_RATES=${S3_RATES:-100 300 500}
  S6_RATES=${S6_RATES:-10 50 100 200 400}
  FLOOR_RATES=${FLOOR_RATES:-100 500 1000 2000 3000}
fi
floor_rate() { [[ " $FLOOR_RATES " == *" $1 "* ]]; }

if wants S1; then
  for rate in $S1_RATES; do
    load S0 direct direct "$rate"
    if floor_rate "$rate"; then
      load F1 floor-0 floor-0 "$rate"
      load F1 floor-2 floor-2 "$rate"
    fi
    load S1 sqlite arbor "$rate"
    if saturated 20; then
      echo "S1: Arbor is saturated at $rate rps (median over 20 ms or under 90% success); not climbing further"
      echo "{\"scenario\": \"S1\", \"saturated_at\": $rate}" >>"$RESULTS/saturation.jsonl"
      break
    fi
  done
fi

if wants S2; then
  # A fresh process (same database), so S2's peak RSS is its own and not
  # what S1's conversations left in memory.
  stop_arbor
  start_arbor sqlite "$SQLITE_URL"
  for rate in $S2_RATES; do
    DIRECT_PORT=$MOCK60 load S0-60ms direct direct "$rate"
    MODEL=mock-60 load S2 sqlite arbor "$rate"
    if saturated 80; then
      echo "S2: Arbor is saturated at $rate rps; not climbing further"
      echo "{\"scenario\": \"S2\", \"saturated_at\": $rate}" >>"$RESULTS/saturation.jsonl"
      break
    fi
  done
fi

if wants S3; then
  stop_arbor
  start_arbor sqlite "$SQLITE_URL"
  for rate in $S3_RATES; do
    DIRECT_PORT=$MOCKSTREAM load S0-stream direct direct "$rate" --stream
    if floor_rate "$rate"; then
      load F3 floor-0 stream-floor-0 "$rate" --stream
      load F3 floor-2 stream-floor-2 "$rate" --stream
    fi
    MODEL=mock-stream load S3 sqlite arbor "$rate" --stream
    if saturated 1000; then
      echo "{\"scenario\": \"S3\", \"saturated_at\": $rate}" >>"$RESULTS/saturation.jsonl"
      break
    fi
  done
fi

if wants S4; then
  stop_arbor
  start_arbor sqlite "$SQLITE_SHARED_URL"
  parity sqlite "$([[ $SMOKE == 1 ]] && echo 20 || echo 200)"
  stop_arbor
  start_arbor sqlite "$SQLITE_URL"
fi

if wants S5; then
  if [[ $SMOKE == 1 ]]; then
    tree_args=(--trunk 50 --branches 3 --branch-length 5 --repeats 2)
  else
    tree_args=()
  fi
  taskset -c "$LOAD_CORE" "$BIN/arbor-bench" tree --base-url "$ARBOR" --model mock-0 \
    --out "$RESULTS/tree.jsonl" "${tree_args[@]}"
  sed -i '$ s/"scenario":"S5"/"scenario":"S5","backend":"sqlite"/' "$RESULTS/tree.jsonl"
fi
stop_arbor

# --- PostgreSQL: S4 -----------------------------------------------------------
if [[ $USE_POSTGRES == 1 ]] && wants S4; then
  if pg_isready -h 127.0.0.1 -p 5432 -q; then
    PG_DB=arbor_bench
    psql -q "$PG_URL/postgres" -c "DROP DATABASE IF EXISTS $PG_DB" -c "CREATE DATABASE $PG_DB"
    start_arbor postgres "$PG_URL/$PG_DB"
    for rate in 100 300 500; do
      load S4 postgres arbor "$rate"
      if saturated 20; then break; fi
    done
    # Streamed turns on PostgreSQL sustained 300/s once a batch's events
    # became one statement (a4d8bc7); 500/s shows where they stop.
    for rate in 100 300 500; do
      MODEL=mock-stream load S4-stream postgres arbor "$rate" --stream
      if saturated 1000; then break; fi
    done
    parity postgres 200
    # This machine's PostgreSQL runs with autovacuum off, so nothing has
    # analyzed the tables S4 filled, and each connection keeps the plans it
    # made while they were nearly empty: the foreign-key check of a new
    # message's parent then walks the whole conversation through
    # messages_in_order instead of the primary key (S5's 10,000-message
    # conversation: ~50 million index entries read to record it, 2.9 s
    # against 0.3 s). With autovacuum on, as PostgreSQL ships, it analyzes
    # a table after it grows by 10%, which also replans those checks; this
    # does that once (bench/analysis.md).
    if [[ $(psql -qtA "$PG_URL/$PG_DB" -c "SHOW autovacuum") == off ]]; then
      psql -q "$PG_URL/$PG_DB" -c "ANALYZE"
    fi
    taskset -c "$LOAD_CORE" "$BIN/arbor-bench" tree --base-url "$ARBOR" --model mock-0 --out "$RESULTS/tree.jsonl"
    sed -i '$ s/"scenario":"S5"/"scenario":"S5","backend":"postgres"/' "$RESULTS/tree.jsonl"
    stop_arbor
  else
    echo '{"skipped": "PostgreSQL is not answering on 127.0.0.1:5432"}' >"$RESULTS/postgres.json"
  fi
fi

# --- LiteLLM: S6 ---------------------------------------------------------------
if [[ $USE_LITELLM == 1 ]] && wants S6; then
  LITELLM=${LITELLM:-}
  if [[ -z "$LITELLM" ]]; then
    if [[ -x $ROOT/bench/.venv/bin/litellm ]]; then LITELLM=$ROOT/bench/.venv/bin/litellm
    elif command -v litellm >/dev/null; then LITELLM=$(command -v litellm)
    elif [[ ${BENCH_INSTALL_LITELLM:-0} == 1 ]]; then
      python3 -m venv "$ROOT/bench/.venv" && "$ROOT/bench/.venv/bin/pip" install -q 'litellm[proxy]' \
        && LITELLM=$ROOT/bench/.venv/bin/litellm || true
    fi
  fi
  if [[ -n "$LITELLM" ]]; then
    LITELLM_PORT=4000
    LITELLM_KEY="sk-bench-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    cat >"$WORK/litellm.yaml" <<EOF
model_list:
  - model_name: mock-model
    litellm_params:
      model: openai/mock-model
      api_base: http://127.0.0.1:$MOCK0/v1
      api_key: sk-mock
litellm_settings:
  telemetry: false
EOF
    # One worker, pinned like Arbor; the model price map from the package,
    # not the network.
    LITELLM_MASTER_KEY=$LITELLM_KEY LITELLM_LOCAL_MODEL_COST_MAP=True \
      taskset -c "$ARBOR_CORE" "$LITELLM" --config "$WORK/litellm.yaml" --host 127.0.0.1 \
      --port $LITELLM_PORT --num_workers 1 >"$WORK/litellm.log" 2>&1 &
    LITELLM_PID=$!
    PIDS+=("$LITELLM_PID")
    if wait_http "http://127.0.0.1:$LITELLM_PORT/health/liveliness" 120; then
      version=$("${LITELLM%/litellm}/python" -c 'import importlib.metadata as m; print(m.version("litellm"))' 2>/dev/null || echo "?")
      echo "{\"version\": \"$version\"}" >"$RESULTS/litellm.json"
      for rate in $S6_RATES; do
        load S6 litellm litellm "$rate" --timeout 30
        # LiteLLM's own median is ~15-20 ms here; 100 ms means queueing.
        if saturated 100; then
          echo "S6: LiteLLM is saturated at $rate rps; not climbing further"
          echo "{\"scenario\": \"S6\", \"saturated_at\": $rate}" >>"$RESULTS/saturation.jsonl"
          break
        fi
      done
    else
      echo "{\"error\": $(tail -n 20 "$WORK/litellm.log" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')}" \
        >"$RESULTS/litellm.json"
    fi
    kill "$LITELLM_PID" 2>/dev/null || true
  else
    echo '{"error": "litellm is not installed (pip install \"litellm[proxy]\" into bench/.venv, or set BENCH_INSTALL_LITELLM=1)"}' \
      >"$RESULTS/litellm.json"
  fi
fi

# --- the report ------------------------------------------------------------------
# The machine may be shared: the load average at the end says how much.
python3 - "$RESULTS/machine.json" "$(python3 "$ROOT/bench/calibrate.py" "$WORK" "$ARBOR_CORE" || true)" <<'EOF'
import json, sys
machine = json.load(open(sys.argv[1]))
machine["loadavg_end"] = open("/proc/loadavg").read().split()[:3]
machine["calibration_end"] = json.loads(sys.argv[2] or "null")
json.dump(machine, open(sys.argv[1], "w"))
EOF
python3 "$ROOT/bench/report.py" "$RESULTS" "$REPORT"
if [[ $SMOKE == 1 ]]; then
  # Every request must have succeeded, every scenario must have written.
  python3 - "$RESULTS" <<'EOF'
import json, sys, pathlib
results = pathlib.Path(sys.argv[1])
runs = [json.loads(line) for line in (results / "loads.jsonl").read_text().splitlines()]
seen = {(run["scenario"], run["target"], run["stream"]) for run in runs}
for needed in [("S0", "openai", False), ("S1", "arbor", False), ("S3", "arbor", True), ("S0-stream", "openai", True),
               ("F1", "openai", False), ("F3", "openai", True)]:
    assert needed in seen, f"no result for {needed}"
for run in runs:
    assert run["sent"] > 0 and run["ok"] == run["sent"], f"failed requests: {run}"
    assert run["latency_us"], f"no latencies: {run}"
stream = [run for run in runs if run["target"] == "arbor" and run["stream"]]
assert all(run["first_delta_us"] and run["delta_gap_us"] for run in stream), "stream timings missing"
parity = [json.loads(line) for line in (results / "parity.jsonl").read_text().splitlines()]
assert parity and all(check["match"] for check in parity), f"parity: {parity}"
tree = [json.loads(line) for line in (results / "tree.jsonl").read_text().splitlines()]
assert tree and tree[0]["load_tree_us"] and tree[0]["switch_branch_us"], f"tree: {tree}"
print("bench smoke: ok")
EOF
  grep -q "| scenario |" "$REPORT"
else
  echo "wrote $REPORT"
fi
