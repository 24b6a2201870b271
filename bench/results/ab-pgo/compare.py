"""The A/B table of bench/analysis.md's "profile-guided build" section: per
build and round, S1's overhead over the direct call (p50 / p99) and CPU per
turn at 100, 1,000 and 2,000/s, S3's time-to-first-token overhead at 100/s,
and the (plain) floor's CPU per request in the same run as the hour's clock.
Medians of each point's three runs.

    python3 bench/results/ab-pgo/compare.py bench/results/ab-pgo/rust
"""
import collections
import glob
import json
import statistics
import sys

# points[run][(scenario, variant, rate)] = [(p50, p99, cpu), ...], one per measured run
points = collections.defaultdict(lambda: collections.defaultdict(list))
for path in sorted(glob.glob(sys.argv[1] + "/*-*/loads.jsonl")):
    run = path.split("/")[-2]
    for line in open(path):
        row = json.loads(line)
        latency = row["first_delta_us"] if row.get("stream") else row["latency_us"]
        cpu = row.get("server_cpu_us_per_request") or 0
        points[run][(row["scenario"], row["variant"], row["rate"])].append((latency["p50"], latency["p99"], cpu))


def median(run, key, field):
    values = points[run].get(key)
    return statistics.median(value[field] for value in values) if values else None


def overhead(run, arbor, direct):
    """Arbor's p50 / p99 minus the direct call's, and Arbor's CPU per turn."""
    if median(run, arbor, 0) is None:
        return "—"
    p50, p99 = (median(run, arbor, i) - median(run, direct, i) for i in (0, 1))
    return f"{p50:.0f} / {p99:.0f} µs, {median(run, arbor, 2):.0f} µs"


RATES = (100.0, 1000.0, 2000.0)
print("| build, round | S1 100/s overhead p50 / p99, CPU | S1 1,000/s | S1 2,000/s "
      "| S3 100/s TTFT overhead p50 / p99, CPU | floor (2 fsyncs) CPU at 100 / 1,000 / 2,000/s |")
print("|---|---|---|---|---|---|")
for run in sorted(points, key=lambda run: (run.rsplit("-", 1)[1], run)):
    cells = [overhead(run, ("S1", "sqlite", rate), ("S0", "direct", rate)) for rate in RATES]
    cells.append(overhead(run, ("S3", "sqlite", 100.0), ("S0-stream", "direct", 100.0)))
    floors = (median(run, ("F1", "floor-2", rate), 2) for rate in RATES)
    floor = " / ".join("—" if cpu is None else f"{cpu:.0f}" for cpu in floors)
    build, round_ = run.rsplit("-", 1)
    print(f"| {build}, {round_} | {' | '.join(cells)} | {floor} µs |")
