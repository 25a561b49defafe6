import time
# ~30% duty busy loop, like a server's Python thread / bench client beside the engine
while True:
    t=time.perf_counter()
    while time.perf_counter()-t<0.003: pass
    time.sleep(0.007)
