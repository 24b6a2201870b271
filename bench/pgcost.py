#!/usr/bin/env python3
"""What PostgreSQL itself spends, between two snapshots: the CPU of all its
processes (from /proc), the commits of one database, the WAL it wrote and
the rows each table gained, updated, updated in place (HOT) and had read by
sequential scans. The CPU is that of the processes alive at each snapshot,
so a backend that exits in between (a connection closed) takes its share
with it; Arbor's pool keeps its connections through a run.

    bench/pgcost.py snap URL DB > before.json
    ... load ...
    bench/pgcost.py diff URL DB before.json   # per turn started meanwhile
"""
import json
import os
import subprocess
import sys


def postgres_cpu_seconds():
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as stat:
                line = stat.read()
        except OSError:
            continue
        name = line[line.index("(") + 1 : line.rindex(")")]
        if name != "postgres":
            continue
        fields = line[line.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def query(url, database, sql):
    out = subprocess.run(["psql", "-qtAX", "-F", "\t", f"{url}/{database}", "-c", sql],
                         check=True, capture_output=True, text=True).stdout
    return [line.split("\t") for line in out.splitlines() if line]


def snap(url, database):
    [[commits]] = query(url, database, f"SELECT xact_commit FROM pg_stat_database WHERE datname = '{database}'")
    [[records, fpi, wal_bytes, syncs]] = query(url, database,
                                               "SELECT wal_records, wal_fpi, wal_bytes, wal_sync FROM pg_stat_wal")
    tables = {name: [int(value) for value in values] for name, *values in query(
        url, database, "SELECT relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, seq_tup_read FROM pg_stat_user_tables")}
    return {"cpu": postgres_cpu_seconds(), "commits": int(commits), "wal_records": int(records),
            "wal_fpi": int(fpi), "wal_bytes": int(float(wal_bytes)), "wal_syncs": int(syncs), "tables": tables}


def main():
    mode, url, database = sys.argv[1:4]
    if mode == "snap":
        json.dump(snap(url, database), sys.stdout)
        return
    # Statistics reach the views when a backend goes idle; give them a moment.
    subprocess.run(["sleep", "1"])
    before = json.load(open(sys.argv[4]))
    after = snap(url, database)
    turns = after["tables"]["turns"][0] - before["tables"].get("turns", [0])[0]
    per = lambda key: (after[key] - before[key]) / turns
    print(f"postgres per turn ({turns} turns): CPU {per('cpu') * 1e6:.0f} us, {per('commits'):.2f} commits, "
          f"{per('wal_records'):.1f} WAL records ({per('wal_fpi'):.2f} full pages), "
          f"{per('wal_bytes'):.0f} WAL bytes, {per('wal_syncs'):.2f} WAL syncs")
    for name, now in sorted(after["tables"].items()):
        was = before["tables"].get(name, [0, 0, 0, 0])
        ins, upd, hot, scanned = ((a - b) / turns for a, b in zip(now, was))
        if ins or upd or scanned:
            print(f"  {name:22} inserted {ins:5.2f}  updated {upd:5.2f} (in place {hot:5.2f})"
                  f"  read by whole-table scans {scanned:6.1f}")


main()
