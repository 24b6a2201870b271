"""Reads `perf script` output of Arbor's system calls (bench/firsttoken.sh)
and prints where a streamed turn's first token waited: the stretches
between the start commit's WAL write, its fdatasync, the request to the
mock and the mock's first bytes back on that connection.

    python3 bench/firsttoken.py CALLS.txt SOCKETS.txt ARBOR_PID
"""
import collections
import re
import sys

STRETCHES = [
    ("WAL write -> sync", "wal_write", "sync_in"),
    ("sync", "sync_in", "sync_out"),
    ("sync -> request out", "sync_out", "request_out"),
    ("request out -> answer in", "request_out", "answer_in"),
]
# Turns at the start of the window may have begun before it.
SKIP = 5


def upstream_sockets(path, pid):
    """Arbor's descriptors of its connections to the mock (port 9100)."""
    upstream = set()
    for line in open(path):
        fields = line.split()
        if len(fields) >= 5 and f"pid={pid}," in line and fields[4].endswith(":9100"):
            upstream.add(int(re.search(rf"pid={pid},fd=(\d+)", line).group(1)))
    return upstream


def calls(path, upstream):
    """The calls in time order, each as (µs, kind, descriptor), or for a
    write to the database and a sync (µs, kind, thread)."""
    marks, receiving = [], {}
    for line in open(path):
        match = re.match(r"\s*\S+\s+(\d+)\s+\[\d+\]\s+([\d.]+):\s+syscalls:(\w+):(.*)", line)
        if not match:
            continue
        tid, seconds, call, args = match.groups()
        at = float(seconds) * 1e6
        fd = re.search(r"fd: (0x[0-9a-f]+)", args)
        fd = int(fd.group(1), 16) if fd else None
        if call == "sys_enter_recvfrom":
            receiving[tid] = fd
        elif call == "sys_exit_recvfrom":
            fd, returned = receiving.pop(tid, None), int(args.split()[-1], 16)
            if fd in upstream and 0 < returned < 1 << 62:
                marks.append((at, "answer_in", fd))
        elif call == "sys_enter_pwrite64":
            marks.append((at, "wal_write", tid))
        elif call == "sys_enter_fdatasync":
            marks.append((at, "sync_in", tid))
        elif call == "sys_exit_fdatasync":
            marks.append((at, "sync_out", None))
        elif call == "sys_enter_writev" and fd in upstream:
            marks.append((at, "request_out", fd))
    marks.sort()
    return marks


def turns(marks):
    """For each request to the mock, the times of the marks around it."""
    for index, (at, kind, connection) in enumerate(marks):
        if kind != "request_out":
            continue
        found = {"request_out": at}
        wanted = ["sync_out", "sync_in", "wal_write"]
        back, writer = index - 1, None
        while back >= 0 and wanted:
            earlier, earlier_kind, owner = marks[back]
            if earlier_kind == "request_out" and wanted[0] == "sync_out":
                break  # another request went out since the last sync
            # The commit's WAL write is the syncing thread's (the
            # checkpointer writes the database file meanwhile).
            if earlier_kind == wanted[0] and (earlier_kind != "wal_write" or owner == writer):
                found[wanted.pop(0)] = earlier
                if earlier_kind == "sync_in":
                    writer = owner
            back -= 1
        for later, later_kind, fd in marks[index + 1 :]:
            if later_kind == "answer_in" and fd == connection:
                found["answer_in"] = later
                break
        yield found


def main(calls_path, sockets_path, pid):
    upstream = upstream_sockets(sockets_path, pid)
    if not upstream:
        sys.exit("no connection from Arbor to the mock was open")
    spans = collections.defaultdict(list)
    for number, found in enumerate(turns(calls(calls_path, upstream))):
        if number < SKIP:
            continue
        for name, start, end in STRETCHES:
            if start in found and end in found:
                spans[name].append(found[end] - found[start])
    for name, _, _ in STRETCHES:
        values = sorted(spans[name])
        if not values:
            print(f"{name:26s} not seen")
            continue
        pick = lambda q: values[min(len(values) - 1, int(len(values) * q))]
        print(f"{name:26s} n={len(values):4d}  p50 {pick(0.5):6.0f} µs  p90 {pick(0.9):6.0f} µs  p99 {pick(0.99):6.0f} µs")


if __name__ == "__main__":
    main(*sys.argv[1:4])
