import os, sys, time, json
def snap(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            s = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        comm = s[s.index("(")+1:s.rindex(")")]
        f = s[s.rindex(")")+2:].split()
        out[tid] = (comm, (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"))
    return out
if __name__ == "__main__":
    pids = sys.argv[1:]
    print(json.dumps({"t": time.time(), **{p: snap(p) for p in pids}}))
