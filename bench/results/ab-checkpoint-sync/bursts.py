import sys
lines=[l for l in open(sys.argv[1]) if 'sqlite-w' in l]
fd=sys.argv[2]
idx=[i for i,l in enumerate(lines) if 'pwrite64(fd: %s,'%fd in l]
print("writer db-file pwrites", len(idx))
if idx:
  bursts=[]; start=idx[0]; prev=idx[0]
  for i in idx[1:]:
    if i-prev>20: bursts.append((start,prev)); start=i
    prev=i
  bursts.append((start,prev))
  for a,b in bursts:
    dur=[l for l in lines[b:b+4] if 'continued' in l or 'fdatasync(fd: %s)'%fd in l]
    print("burst", lines[a].split()[0], "->", lines[b].split()[0], "pages", sum(1 for i in idx if a<=i<=b), "| sync:", " ".join(d.split('(')[1].split(')')[0] for d in dur if d.split()[0][0].isdigit()))
