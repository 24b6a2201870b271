import sys, re, collections
# writer timeline: fdatasync (fd 11) start/end incl. continued lines
ev=[]
pend={}
for l in open(sys.argv[1]):
    f=l.split()
    if not f or not f[0][0].isdigit(): 
        continue
    if 'sqlite-w' not in l: continue
    t=float(f[0])
    m=re.search(r"\(\s*([\d.]+) ms\)", l)
    if 'fdatasync(fd: 11)' in l and m:
        ev.append((t, float(m.group(1)))); 
    elif 'continued]: fdatasync' in l and m:
        ev.append((t, float(m.group(1))))
ev.sort()
gaps=[(b[0]-(a[0]+a[1]), a[0]+a[1]) for a,b in zip(ev,ev[1:])]
print("syncs", len(ev))
big=[g for g in gaps if g[0]>2.5]
print("gaps > 2.5 ms:", len(big))
for g,t in big[:30]: print("  %.2f at %.1f" % (g, t))
