import json, sys, glob, statistics as st
# usage: cmp.py name... ; reads /tmp/ab/out-<name>-<round>/loads.jsonl
for name in sys.argv[1:]:
    for d in sorted(glob.glob(f"/tmp/ab/out-{name}-*")):
        rows=[json.loads(l) for l in open(d+"/loads.jsonl")]
        out=[]
        for rate in sorted({r["rate"] for r in rows}):
            direct=[r for r in rows if r["rate"]==rate and r["scenario"].startswith("S0")]
            arbor=[r for r in rows if r["rate"]==rate and r["scenario"] in ("S3","S1")]
            if not direct or not arbor: continue
            key="first_delta_us" if arbor[0]["stream"] else "latency_us"
            def med(rs,k,p): return st.median(r[k][p] for r in rs)
            o50=med(arbor,key,"p50")-med(direct,key,"p50"); o99=med(arbor,key,"p99")-med(direct,key,"p99")
            fe=med(arbor,"first_event_us","p50") if arbor[0]["stream"] else 0
            cpu=st.median(r["server_cpu_us_per_request"] or 0 for r in arbor)
            out.append(f"{int(rate)}/s ovh {o50:.0f}/{o99:.0f} first-ev {fe:.0f} cpu {cpu:.0f}")
        print(d.split("/")[-1].ljust(16), " | ".join(out))
