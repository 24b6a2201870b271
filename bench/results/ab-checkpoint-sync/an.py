import re, sys, collections
pat = re.compile(r"\s*([\d.]+) \(\s*([\d.]+) ms\): (\S+?)/(\d+) (\w+)\((.*?)\)\s+=")
calls = []
for line in open(sys.argv[1]):
    m = pat.match(line)
    if m:
        t, d, comm, tid, name, args = m.groups()
        calls.append((float(t), float(d), comm, name, args))
span = calls[-1][0] - calls[0][0]
print("span ms", round(span))
by = collections.defaultdict(list)
for c in calls:
    by[(c[2], c[3])].append(c[1])
for k, v in sorted(by.items(), key=lambda kv: -sum(kv[1])):
    v.sort()
    n = len(v)
    print(k, n, "total ms %.1f" % sum(v), "p50 %.3f p90 %.3f p99 %.3f max %.3f" % (v[n//2], v[int(n*.9)], v[min(n-1,int(n*.99))], v[-1]))
print("long calls (>1.5ms):")
for c in calls:
    if c[1] > 1.5 and c[3] != 'futex':
        print("  %.3f %.3f %s %s %s" % (c[0]-calls[0][0], c[1], c[2], c[3], c[4][:60]))
