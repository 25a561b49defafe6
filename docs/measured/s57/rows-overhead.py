"""Per-step Python cost of building sampling rows and appending tokens for plain requests (the
default path), at the checkout this runs from."""
import sys, timeit
from sluice.engine.request import Request
from sluice.engine.model_runner import ModelRunner
from sluice.sampling_params import SamplingParams
p = SamplingParams(temperature=0.0, max_tokens=10_000)
reqs = [Request(f"r{i}", list(range(1000, 1400)), p, 10_000, 0.0, (2,)) for i in range(32)]
for r in reqs:
    for t in range(50):
        r.append_output_token(5 + t)
drafts = [[7, 8, 9, 10, 11]] * 32
def rows():
    for r, d in zip(reqs, drafts):
        ModelRunner._rows(r, d)
def stops():
    for r in reqs:
        r.check_stop(100_000)
n = 2000
for name, fn in (("rows (32 requests, 5 drafts)", rows), ("check_stop x32", stops)):
    best = min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6
    print(f"{name}: {best:.1f} us per step")
