import subprocess, sys, re, collections, statistics, random
R=int(sys.argv[1]); only=sys.argv[2]; dirs=sys.argv[3:]
res=collections.defaultdict(lambda: collections.defaultdict(list))
for r in range(R):
    order=dirs[:] if r%2==0 else dirs[::-1]
    for d in order:
        out=subprocess.run(f"cd /tmp && PYTHONSAFEPATH=1 PYTHONPATH={d} /work/main/.venv/bin/python {d}/benchmarks/attention.py --no-torch --threads 2 --huge-pages --only '{only}'",shell=True,capture_output=True,text=True).stdout
        for line in out.splitlines():
            m=re.match(r'^((?:decode|verify|prefill)\S*(?: +\S+=\S+| \S+ after \S+)+)\s+(.*)$',line)
            if m:
                f=m.group(2).split()
                res[m.group(1)][d].append(float(f[3]))
for case,v in res.items():
    print(f"{case:28s}", "  ".join(f"{statistics.mean(v[d]):8.1f} ({min(v[d]):7.1f})" for d in dirs))
