# Sourced by bench/profile.sh and bench/threadstat.sh: the 0 ms mock they
# both drive Arbor against, and waiting for the Arbor they start. Expects
# ROOT, BIN, WORK and the PIDS array of the sourcing script.

# Starts the OpenAI mock on core 1 (20 chunks, TCP_NODELAY like a real
# provider) on port 9100, and writes $WORK/arbor.toml: SQLite in $WORK and
# the model `mock-0` served by that mock.
start_mock0() {
  gcc -shared -fPIC -O2 -o "$WORK/nodelay.so" "$ROOT/bench/nodelay.c" -ldl
  LD_PRELOAD=$WORK/nodelay.so taskset -c 1 "$BIN/arbor-mock" --listen 127.0.0.1:9100 --chunks 20 \
    >"$WORK/mock.log" 2>&1 &
  PIDS+=($!)
  cat >"$WORK/arbor.toml" <<TOML
default_model = "mock-0"
[storage]
database_url = "sqlite://$WORK/arbor.db"
[providers.mock0]
kind = "openai"
base_url = "http://127.0.0.1:9100/v1"
[models."mock-0"]
provider = "mock0"
context_window = 128000
prices = { input = 150000, output = 600000 }
TOML
}

# Waits until Arbor answers on port 8080 (TRIES polls PAUSE seconds apart)
# and exports the admin key it printed to $WORK/stdout as ARBOR_BENCH_KEY.
await_arbor() { # TRIES PAUSE
  for _ in $(seq 1 "$1"); do curl -s -o /dev/null -m 2 http://127.0.0.1:8080/healthz && break; sleep "$2"; done
  ARBOR_BENCH_KEY=$(sed -n 's/^    \(arb_[A-Za-z0-9_-]*\)$/\1/p' "$WORK/stdout" | head -n1)
  export ARBOR_BENCH_KEY
}
