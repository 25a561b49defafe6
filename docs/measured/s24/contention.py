import time
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.004: pass
    time.sleep(0.008)
