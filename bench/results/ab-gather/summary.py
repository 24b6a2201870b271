"""Per round of the gathering A/B (bench/analysis.md, "Gathering durable
commits under load"): S1 and S2 per rate, each measured run's Arbor CPU a
turn, p50 and p99 (ms). Rounds: off-N (no wait), on-N (wait from three
waited-on writes), f6-N (from six), final-N (the landed build, 50d6137:
from six, with constants).

    python3 bench/results/ab-gather/summary.py bench/results/ab-gather
"""
import json
import sys
from pathlib import Path

for name in ["off-1", "on-1", "on-2", "off-2", "off-3", "f6-1", "f6-2", "off-4", "final-1", "off-5", "final-2"]:
    path = Path(sys.argv[1]) / name / "loads.jsonl"
    points = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["scenario"] in ("S1", "S2") and row.get("variant") == "sqlite":
            latency = row["latency_us"]
            points.setdefault((row["scenario"], int(row["rate"])), []).append(
                (row.get("server_cpu_us_per_request") or 0, latency["p50"] / 1000, latency["p99"] / 1000))
    cells = []
    for (scenario, rate), runs in sorted(points.items()):
        cpu = "/".join(f"{c:.0f}" for c, _, _ in runs)
        p50 = "/".join(f"{p:.1f}" for _, p, _ in runs)
        p99 = "/".join(f"{p:.1f}" for _, _, p in runs)
        cells.append(f"{scenario} {rate}/s: CPU {cpu} µs, p50 {p50}, p99 {p99} ms")
    print(f"{name}: " + " | ".join(cells))
