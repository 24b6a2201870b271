"""How fast this machine is right now, in the things a turn's cost depends
on most: a hand-off between two threads on one core (a turn makes a
dozen), waking a process on an idle core from the other one (a request
arriving at a quiet server; on a VM an idle core's wake-up can cost far
more than a busy one's), an fdatasync on the data directory's disk (a
durable turn makes two) back to back and 5 ms apart (what a quiet
server's commits pay; on some filesystems more, see ARCHITECTURE.md),
plain CPU (a loop that stays in cache), and memory (a copy larger than
the caches: a neighbour's memory traffic slows it while the CPU loop
does not notice). A shared VM varies by several times between hours; the
report prints these beside the run so that two runs can be compared
knowing whether the machine under them changed.

    python3 bench/calibrate.py DIR CORE   # prints one JSON object
"""
import json
import os
import sys
import time


def percentile(values, fraction):
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * fraction))]


def handoff(core, other_core=None, rounds=3000, pause=0.0):
    """Round trips of one byte to a process pinned to `core`, from this one
    pinned to `other_core` (the same core by default), `pause` seconds
    apart (so that the child's core goes idle in between)."""
    there_r, there_w = os.pipe()
    back_r, back_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.sched_setaffinity(0, {core})
        for _ in range(rounds):
            os.read(there_r, 1)
            os.write(back_w, b"x")
        os._exit(0)
    os.sched_setaffinity(0, {core if other_core is None else other_core})
    times = []
    for _ in range(rounds):
        if pause:
            time.sleep(pause)
        start = time.perf_counter()
        os.write(there_w, b"x")
        os.read(back_r, 1)
        times.append((time.perf_counter() - start) * 1e6)
    os.waitpid(child, 0)
    os.sched_setaffinity(0, set(range(os.cpu_count())))
    return times


def fdatasyncs(folder, count=1000, pause=0.0):
    """4 KiB overwrites each followed by fdatasync, `pause` seconds apart;
    the fdatasyncs' durations."""
    path = os.path.join(folder, "calibrate.tmp")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"\0" * 4096 * 64, 0)
        os.fsync(fd)
        times = []
        for i in range(count):
            os.pwrite(fd, b"x" * 4096, (i % 64) * 4096)
            start = time.perf_counter()
            os.fdatasync(fd)
            times.append((time.perf_counter() - start) * 1e6)
            if pause:
                time.sleep(pause)
        return times
    finally:
        os.close(fd)
        os.unlink(path)


def spin():
    best = None
    for _ in range(3):
        start = time.perf_counter()
        sum(range(2_000_000))
        elapsed = (time.perf_counter() - start) * 1e3
        best = elapsed if best is None else min(best, elapsed)
    return best


def copy(megabytes=64):
    """The best of five copies of `megabytes` into memory already touched
    (so page faults are not in it), in milliseconds."""
    source = bytes(megabytes << 20)
    target = bytearray(len(source))
    target[:] = source
    best = None
    for _ in range(5):
        start = time.perf_counter()
        target[:] = source
        elapsed = (time.perf_counter() - start) * 1e3
        best = elapsed if best is None else min(best, elapsed)
    return best


def main(folder, core):
    hops = handoff(core)
    other = (core + 1) % os.cpu_count()
    wakes = handoff(core, other, rounds=500, pause=0.001) if other != core else []
    syncs = fdatasyncs(folder)
    paused = fdatasyncs(folder, count=300, pause=0.005)
    print(json.dumps({
        "handoff_rt_us_p50": round(percentile(hops, 0.5), 1),
        "handoff_rt_us_p99": round(percentile(hops, 0.99), 1),
        "idle_wake_rt_us_p50": round(percentile(wakes, 0.5), 1) if wakes else None,
        "idle_wake_rt_us_p99": round(percentile(wakes, 0.99), 1) if wakes else None,
        "fdatasync_us_p50": round(percentile(syncs, 0.5), 1),
        "fdatasync_us_p99": round(percentile(syncs, 0.99), 1),
        "fdatasync_paused_us_p50": round(percentile(paused, 0.5), 1),
        "fdatasync_paused_us_p99": round(percentile(paused, 0.99), 1),
        "spin_ms": round(spin(), 1),
        "copy_64mib_ms": round(copy(), 1),
    }))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
