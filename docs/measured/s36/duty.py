import time
end=time.time()+600
while time.time()<end:
    t=time.perf_counter()
    while time.perf_counter()-t<0.03: pass
    time.sleep(0.07)
