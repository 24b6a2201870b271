#!/usr/bin/env bash
# Memory of an open HTTP connection to Arbor: runs Arbor (core 0, fresh
# SQLite database), opens COUNT keep-alive connections to it, then sends one
# `GET /healthz` on each and keeps them open. Prints Arbor's anonymous RSS
# per connection after connecting and after the request. Alternate two
# builds to compare them.
#
#   bench/connmem.sh [ARBOR_BIN] [COUNT]    # defaults: the release build, 900
#
# COUNT must stay under the open-files limit (`ulimit -n`). Needs a release
# build (cargo build --release -p arbor -p arbor-testkit -p arbor-bench).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
ARBOR_BIN=${1:-$BIN/arbor}
COUNT=${2:-900}
source "$ROOT/bench/common.sh"
open_work connmem
start_pair0 "$ARBOR_BIN"
python3 - "$ARBOR_PID" "$COUNT" <<'PY'
import socket, sys, time
pid, count = int(sys.argv[1]), int(sys.argv[2])

def anon_kib():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1])

before = anon_kib()
sockets = [socket.create_connection(("127.0.0.1", 8080)) for _ in range(count)]
time.sleep(0.5)
connected = anon_kib()
for s in sockets:
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: arbor\r\n\r\n")
for s in sockets:
    s.recv(65536)
time.sleep(0.5)
answered = anon_kib()
print(f"{count} connections, RssAnon {before} -> {connected} -> {answered} KiB; "
      f"per connection {(connected - before) / count:.1f} KiB connected, "
      f"{(answered - before) / count:.1f} KiB after a request")
PY
