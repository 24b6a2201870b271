#!/usr/bin/env bash
cd /work/main
export CARGO_TARGET_DIR=/var/tmp/arbor-ci-target
for round in "off 3" "f6 1" "f6 2" "off 4"; do
  set -- $round
  if [[ $1 == off ]]; then export ARBOR_SQLITE_GATHER_US=0; else unset ARBOR_SQLITE_GATHER_US; export ARBOR_SQLITE_GATHER_FROM=6; fi
  echo "=== $1-$2 $(date -u +%H:%M:%S)"
  S1_RATES="2000 3000" S2_RATES="3000" FLOOR_RATES="" ARBOR_BIN=/tmp/arbor-gather2 BENCH_OUT=/tmp/ab/gather-$1-$2 \
    bench/run.sh --only "S1 S2" --no-litellm --no-postgres > /tmp/ab/gather-$1-$2.log 2>&1
done
echo "=== done $(date -u +%H:%M:%S)"
