"""Session 42: intercepts of whole-window least-squares fits on session 41's bound-4 and bound-8 traces,
in windows of 256-2048 steps (how much pooling windows would narrow the kept fixed cost).
Run from the repository root: .venv/bin/python docs/measured/s42/windows.py"""
src=open("docs/measured/s41/fits.py").read().split("BOUNDS = ")[0].replace("os.path.dirname(os.path.abspath(__file__))", "\"docs/measured/s41\""); exec(src)
import numpy as np
for n in [4,8]:
    t, ms, x = load(n)
    for w in [256,512,1024,2048]:
        ics=[]
        for s in range(0, len(t)-w+1, w):
            c=np.linalg.lstsq(x[s:s+w], ms[s:s+w], rcond=None)[0]; ics.append(c[0])
        print(n, w, np.round(ics,2))
    # robust: huber-ish via iterated trimmed
