"""How much a foreign thread's CPU time costs the engine's step: decode steps of a fixed batch,
alternating blocks with a noise process running (SIGCONT) and stopped (SIGSTOP)."""
import os, signal, subprocess, sys, time, statistics
import torch
from sluice import LLM, SamplingParams
busy_ms, period_ms = sys.argv[1], sys.argv[2]
B, CTX, BLOCK, ROUNDS = 16, 1024, 24, 12
llm = LLM(None, dtype="bfloat16", max_model_len=4096, kv_cache_tokens=B * 1700 + 4096, max_num_seqs=64,
          max_num_batched_tokens=2048, enable_prefix_caching=False)
eng = llm.engine
noise = subprocess.Popen([sys.executable, "docs/measured/s43/noise.py", busy_ms, period_ms])
os.kill(noise.pid, signal.SIGSTOP)
g = torch.Generator().manual_seed(1)
for i in range(B):
    eng.add_request(f"r{i}", torch.randint(100, 40000, (CTX,), generator=g).tolist(),
                    SamplingParams(temperature=0, max_tokens=BLOCK * ROUNDS * 2 + 50, ignore_eos=True))
while any(r.num_output_tokens == 0 for r in eng.scheduler.running + eng.scheduler.waiting):
    eng.step()
res = {"quiet": [], "noise": []}
for r in range(ROUNDS * 2):
    mode = "noise" if r % 2 else "quiet"
    os.kill(noise.pid, signal.SIGCONT if mode == "noise" else signal.SIGSTOP)
    time.sleep(0.05)
    t0 = time.perf_counter()
    for _ in range(BLOCK):
        eng.step()
    res[mode].append((time.perf_counter() - t0) / BLOCK * 1e3)
noise.kill()
q, n = res["quiet"], res["noise"]
print("quiet", [round(x, 1) for x in q]); print("noise", [round(x, 1) for x in n])
d = [b - a for a, b in zip(q, n)]
print(f"busy {busy_ms} ms / {period_ms} ms: quiet median {statistics.median(q):.2f} ms, noise {statistics.median(n):.2f}, "
      f"paired diff median {statistics.median(d):.2f} ms ({100*statistics.median(d)/statistics.median(q):.1f}%)")
