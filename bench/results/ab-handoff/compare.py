"""Summarises the hand-off A/B in this folder: for each build and round, the
median over three runs of Arbor's TTFT overhead over the direct call (p50 /
p99, µs), the time to the first event, and Arbor's CPU per turn.

    python3 bench/results/ab-handoff/compare.py base linger
"""
import glob
import json
import os
import statistics as st
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for name in sys.argv[1:]:
    for path in sorted(glob.glob(f"{HERE}/s3-{name}-*.jsonl")):
        rows = [json.loads(line) for line in open(path)]
        out = []
        for rate in sorted({row["rate"] for row in rows}):
            direct = [row for row in rows if row["rate"] == rate and row["scenario"].startswith("S0")]
            arbor = [row for row in rows if row["rate"] == rate and row["scenario"] == "S3"]
            if not direct or not arbor:
                continue

            def med(runs, key, pct):
                return st.median(run[key][pct] for run in runs)

            o50 = med(arbor, "first_delta_us", "p50") - med(direct, "first_delta_us", "p50")
            o99 = med(arbor, "first_delta_us", "p99") - med(direct, "first_delta_us", "p99")
            first = med(arbor, "first_event_us", "p50")
            cpu = st.median(run["server_cpu_us_per_request"] or 0 for run in arbor)
            out.append(f"{int(rate)}/s TTFT overhead {o50:.0f} / {o99:.0f}, first event {first:.0f}, CPU {cpu:.0f}")
        print(os.path.basename(path).ljust(20), " | ".join(out))
