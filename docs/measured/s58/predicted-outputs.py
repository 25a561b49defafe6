"""Predicted outputs through `sluice serve` (port 8000, every default: bf16, prompt lookup on):
one chat call of 200 greedy tokens, then the same call with the reply itself as the prediction,
with the reply edited in three places (a few tokens each), and with unrelated text; three rounds,
one call at a time. Prints each call's wall time and the drafts the server accepted for it.

    python docs/measured/s58/predicted-outputs.py > docs/measured/s58/predicted-outputs.txt
"""
import re
import time

import httpx

URL = "http://127.0.0.1:8000"
ASK = [{"role": "system", "content": "You are a careful assistant."},
       {"role": "user", "content": "Write a Python function that parses a CSV file of orders "
                                   "(id, customer, amount) and returns the total amount per customer, with a docstring."}]


def accepted() -> float:
    text = httpx.get(URL + "/metrics").text
    return float(re.search(r"^sluice:spec_decode_num_accepted_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))


def call(prediction=None):
    body = {"model": "smollm2-135m", "messages": ASK, "max_tokens": 200, "temperature": 0}
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    a, t = accepted(), time.perf_counter()
    r = httpx.post(URL + "/v1/chat/completions", json=body, timeout=300).json()
    return r["choices"][0]["message"]["content"], time.perf_counter() - t, accepted() - a, r["usage"]["completion_tokens"]


base, *_ = call()
words = base.split(" ")
edited = " ".join(w if i not in (10, 40, 80) else w.upper() + "X" for i, w in enumerate(words))
unrelated = "The quick brown fox jumps over the lazy dog. " * 20
for rnd in range(3):
    for label, pred in (("none", None), ("exact", base), ("edited", edited), ("unrelated", unrelated)):
        text, dt, acc, n = call(pred)
        print(f"round {rnd} {label:9s} {dt:6.3f} s  {n} tokens  {acc:5.0f} drafts accepted  same reply: {text == base}")
