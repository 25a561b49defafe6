"""Least-squares split of each step's forward time in an engine step trace (engine_replay.py
--step-trace): per prompt token, per prompt token and 1k tokens of its context, per decode or
draft row, per 1k tokens of decode context, per step. Usage: python step_split.py TRACE.jsonl"""
import json
import sys

import numpy as np

steps = [json.loads(line) for line in open(sys.argv[1])][5:]   # the first steps: start-up
X, y = [], []
for r in steps:
    p, pt = r["prefills"], r["prefill_tokens"]
    att = pt * (r["prefill_ctx"] / p + pt / (2 * p)) / 1e3 if p else 0.0
    X.append([pt, att, r["decodes"] + r["draft_tokens"], r["decode_ctx"] / 1e3, 1.0])
    y.append(r["forward_ms"])
X, y = np.array(X), np.array(y)
coef = np.linalg.lstsq(X, y, rcond=None)[0]
names = ["ms per prompt token", "ms per prompt token per 1k context", "ms per decode or draft row",
         "ms per 1k tokens of decode context", "ms per step"]
for name, c, col in zip(names, coef, X.T):
    print(f"{name:36s} {c:7.3f}   {c * col.sum() / 1e3:6.1f} s")
r2 = 1 - ((X @ coef - y) ** 2).sum() / ((y - y.mean()) ** 2).sum()
print(f"forward total {y.sum() / 1e3:.1f} s over {len(y)} steps, R^2 {r2:.3f}")
kinds = {"prompt only": lambda r: r["prefills"] and not r["decodes"],
         "mixed": lambda r: r["prefills"] and r["decodes"], "decode only": lambda r: not r["prefills"]}
for kind, pick in kinds.items():
    s = [r for r in steps if pick(r)]
    print(f"{kind:12s} {len(s):4d} steps, {sum(r['forward_ms'] for r in s) / 1e3:6.1f} s, "
          f"mean {np.mean([r['forward_ms'] for r in s]):6.0f} ms, prompt tokens {np.mean([r['prefill_tokens'] for r in s]):4.0f}, "
          f"decodes {np.mean([r['decodes'] for r in s]):4.1f}, drafts {np.mean([r['draft_tokens'] for r in s]):4.0f}")
