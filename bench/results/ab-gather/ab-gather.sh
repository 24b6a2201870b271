#!/usr/bin/env bash
# ABBA: gather off (ARBOR_SQLITE_GATHER_US=0) vs on (default 300)
cd /work/main
export CARGO_TARGET_DIR=/var/tmp/arbor-ci-target
for round in "off 1" "on 1" "on 2" "off 2"; do
  set -- $round
  if [[ $1 == off ]]; then export ARBOR_SQLITE_GATHER_US=0; else unset ARBOR_SQLITE_GATHER_US; fi
  echo "=== $1-$2 $(date -u +%H:%M:%S)"
  S1_RATES="2000 3000 4000" S2_RATES="3000" FLOOR_RATES="" ARBOR_BIN=/tmp/arbor-gather BENCH_OUT=/tmp/ab/gather-$1-$2 \
    bench/run.sh --only "S1 S2" --no-litellm --no-postgres > /tmp/ab/gather-$1-$2.log 2>&1
  grep -E '^\[S[12] arbor' /tmp/ab/gather-$1-$2.log | grep 'run [0-9]' | sed -E 's/header overhead.*(server core)/\1/' | cut -c1-200
done
echo "=== done $(date -u +%H:%M:%S)"
