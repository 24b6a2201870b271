"""The A/B table of bench/analysis.md's "profile-guided builds" section:
per build and round, S1's overhead over the direct call (p50 / p99) and CPU
per turn at 100, 1,000 and 2,000/s, S3's time-to-first-token overhead at
100/s, and the (plain) floor's CPU per request in the same run as the hour's
clock. Medians of each point's three runs.

    python3 bench/results/ab-pgo/compare.py bench/results/ab-pgo/rust
"""
import json,glob,collections,statistics as st,sys
root=sys.argv[1]
d=collections.defaultdict(dict)
for f in sorted(glob.glob(root+'/*-*/loads.jsonl')):
    name=f.split('/')[-2]
    for l in open(f):
        r=json.loads(l)
        key=(r['scenario'],r['variant'],r['rate'])
        lat=r.get('first_delta_us') if r.get('stream') else r.get('latency_us')
        d[name].setdefault(key,[]).append((lat['p50'],lat['p99'],r.get('server_cpu_us_per_request') or 0))
def med(name,key,i):
    v=d[name].get(key); 
    return st.median(x[i] for x in v) if v else None
names=sorted(d, key=lambda n:(n.rsplit('-',1)[1], n))
print('| build, round | S1 100/s overhead p50 / p99, CPU | S1 1,000/s | S1 2,000/s | S3 100/s TTFT overhead p50 / p99, CPU | floor (2 fsyncs) CPU at 100 / 1,000 / 2,000/s |')
print('|---|---|---|---|---|---|')
for n in names:
    cells=[]
    for rate in (100.0,1000.0,2000.0):
        a=('S1','sqlite',rate); b=('S0','direct',rate)
        if med(n,a,0) is None: cells.append('—'); continue
        cells.append('%d / %d µs, %d µs'%(med(n,a,0)-med(n,b,0), med(n,a,1)-med(n,b,1), med(n,a,2)))
    a=('S3','sqlite',100.0); b=('S0-stream','direct',100.0)
    cells.append('%d / %d µs, %d µs'%(med(n,a,0)-med(n,b,0), med(n,a,1)-med(n,b,1), med(n,a,2)) if med(n,a,0) else '—')
    fl=' / '.join('%d'%med(n,('F1','floor-2',r),2) if med(n,('F1','floor-2',r),2) else '—' for r in (100.0,1000.0,2000.0))
    b,r=n.rsplit('-',1)
    print('| %s, %s | %s | %s µs |'%(b,r,' | '.join(cells),fl))
