"""Counts the pages in a copy of an SQLite write-ahead log by the table or
index they belong to: which b-trees a busy Arbor rewrites, commit after
commit.

    cp DATA/arbor.db /tmp/db && cp DATA/arbor.db-wal /tmp/wal   # while it runs
    python3 bench/walcount.py /tmp/db /tmp/wal

Only the frames of the WAL's current generation are counted (a WAL that
started over keeps older frames behind them, with another salt). Pages the
database copy does not know yet count as "?".
"""
import collections
import sqlite3
import struct
import sys

PAGE_HEADER = 24


def main(database, wal_path):
    data = open(wal_path, "rb").read()
    page_size = struct.unpack(">I", data[8:12])[0]
    salt = data[16:24]
    owner = dict((page, name) for name, page in sqlite3.connect(database).execute("SELECT name, pageno FROM dbstat"))
    frames, commits, offset = [], 0, 32
    while offset + PAGE_HEADER + page_size <= len(data) and data[offset + 8 : offset + 16] == salt:
        page, size_after_commit = struct.unpack(">II", data[offset : offset + 8])
        frames.append(page)
        commits += size_after_commit != 0
        offset += PAGE_HEADER + page_size
    if not frames:
        sys.exit("no frames in this WAL")
    print(f"{len(frames)} frames, {commits} commits, {len(frames) / max(commits, 1):.1f} frames per commit")
    for name, count in collections.Counter(owner.get(page, "?") for page in frames).most_common():
        print(f"{name:40s} {count:7d} {100 * count / len(frames):5.1f}%")


if __name__ == "__main__":
    main(*sys.argv[1:3])
