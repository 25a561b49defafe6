src=open("docs/measured/s41/fits.py").read().split("BOUNDS = ")[0].replace("os.path.dirname(os.path.abspath(__file__))", "\"docs/measured/s41\""); exec(src)
import numpy as np
def ols(x,y): return np.linalg.lstsq(x,y,rcond=None)[0]
def trimmed(x,y,k=3.0,it=3):
    m=np.ones(len(y),bool)
    for _ in range(it):
        c=ols(x[m],y[m]); r=y-x@c; mad=np.median(np.abs(r[m]-np.median(r[m])))*1.4826
        m=np.abs(r)<=k*mad
    return ols(x[m],y[m])
def huber(x,y,k=1.345,it=20):
    c=ols(x,y)
    for _ in range(it):
        r=y-x@c; s=np.median(np.abs(r))*1.4826+1e-9; u=np.abs(r)/s
        w=np.where(u<=k,1.0,k/u); sw=np.sqrt(w)
        c=ols(x*sw[:,None],y*sw)
    return c
def l1(x,y,it=50):
    c=ols(x,y)
    for _ in range(it):
        r=np.abs(y-x@c); w=1/np.maximum(r,1e-3); sw=np.sqrt(w); c=ols(x*sw[:,None],y*sw)
    return c
def deconly(x,y):
    m=x[:,2]==0
    return ols(x[m][:,[0,1,4]],y[m])
def lowtrim(x,y):
    # fit, then keep residuals below 75th pct (timing noise is one-sided: interruptions only add)
    c=ols(x,y); r=y-x@c; m=r<=np.percentile(r,75); return ols(x[m],y[m])
E={"ols":ols,"trim3":trimmed,"huber":huber,"l1":l1,"deconly":deconly,"lowtrim":lowtrim}
for n in [4,8,12]:
    t, ms, x = load(n)
    for w in [512,2048]:
        for name,f in E.items():
            ics=[f(x[s:s+w],ms[s:s+w])[0] for s in range(0,len(t)-w+1,w//2 if w==512 else w)]
            print(n,w,f"{name:8s}",np.round(ics,2), "sd %.2f"%np.std(ics))
