"""Beam search side by side: the same calls to `sluice serve` (port 8000) and vLLM 0.32 (port
8100), both bf16 and greedy-deterministic (temperature 0: vLLM's extra sampled candidate is then
its argmax, already among the 2n it considers). Prints each call's choices from both and their time.

    python docs/measured/s58/beam-search-vs-vllm.py > docs/measured/s58/beam-search-vs-vllm.txt
"""
import time

import httpx

SIDES = {"sluice": "http://127.0.0.1:8000/v1", "vllm": "http://127.0.0.1:8100/v1"}
CALLS = [
    ("completions", {"prompt": "The capital of France is", "n": 3, "max_tokens": 16}),
    ("completions", {"prompt": "Once upon a time, in a small village by the sea, there lived", "n": 4, "max_tokens": 16}),
    ("completions", {"prompt": "def fibonacci(n):\n", "n": 2, "max_tokens": 24, "length_penalty": 0.5}),
    ("chat", {"messages": [{"role": "user", "content": "What is the capital of France?"}], "n": 3, "max_tokens": 16}),
    ("chat", {"messages": [{"role": "user", "content": "Name three colors."}], "n": 4, "max_tokens": 24, "length_penalty": 2.0}),
]

for kind, body in CALLS:
    print(f"== {kind} {body}")
    got = {}
    for side, url in SIDES.items():
        req = {"model": "smollm2-135m", "use_beam_search": True, "temperature": 0.0, **body}
        t = time.perf_counter()
        r = httpx.post(f"{url}/{'chat/completions' if kind == 'chat' else 'completions'}", json=req, timeout=300)
        dt = time.perf_counter() - t
        r.raise_for_status()
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        got[side] = [((c["message"]["content"] if kind == "chat" else c["text"]), c["finish_reason"]) for c in choices]
        print(f"  {side:6s} {dt:6.2f} s")
        for text, reason in got[side]:
            print(f"         {reason:6s} {text!r}")
    print("  same choices:", got["sluice"] == got["vllm"])
