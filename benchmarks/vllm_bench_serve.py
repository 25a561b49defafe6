"""vLLM's own serving benchmark (`vllm bench serve`) against sluice and vLLM, one server at a time.

A cross-check of `sluice bench` with the peer's tool: its datasets, its request shapes (streamed
/v1/completions or /v1/chat/completions, `ignore_eos`), its clock and its metrics (TTFT, TPOT,
ITL, output tok/s). Each side is a server launched by a shell command for each of its runs and
stopped after it; the runs alternate A B, B A, A B ... so a drift of the machine reaches both.

    .venv/bin/python benchmarks/vllm_bench_serve.py --out bench-results/vbs \\
        --side sluice http://127.0.0.1:8000 ".venv/bin/sluice serve --port 8000" \\
        --side vllm-0.32 http://127.0.0.1:8100 "scripts/serve-vllm.sh" \\
        --repeats 3 -- --dataset-name random --random-input-len 512 --random-output-len 128 \\
        --num-prompts 96 --max-concurrency 32 --ignore-eos --temperature 0

Everything after `--` goes to `vllm bench serve` as it is (plus --base-url, --model, --tokenizer,
--seed, --save-result and the result paths, set here). The model name is each server's first
`GET /v1/models` entry. Writes OUT/<label>/r<i>.json (vLLM's result files), OUT/<label>/r<i>.log,
and OUT/summary.md: each metric's mean and spread per side and the ratio of each side to the
last one, per repeat and overall.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from sluice.bench.cli import LaunchedServer
from sluice.bench.client import Endpoint
from sluice.bench.run import answers, wait_ready

# (key in vLLM's result json, label, higher is better)
METRICS = [
    ("completed", "completed requests", True),
    ("duration", "duration (s)", False),
    ("output_throughput", "output tok/s", True),
    ("total_token_throughput", "total tok/s", True),
    ("median_ttft_ms", "TTFT p50 (ms)", False),
    ("p90_ttft_ms", "TTFT p90 (ms)", False),
    ("p99_ttft_ms", "TTFT p99 (ms)", False),
    ("median_tpot_ms", "TPOT p50 (ms)", False),
    ("p90_tpot_ms", "TPOT p90 (ms)", False),
    ("median_itl_ms", "ITL p50 (ms)", False),
    ("median_e2el_ms", "E2E latency p50 (ms)", False),
]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    bench_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--side", nargs=3, action="append", metavar=("LABEL", "URL", "CMD"), required=True,
                   help="a server: its label, root URL (no /v1) and the shell command that serves it")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="repeat i uses seed + i (the same prompts on every side)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vllm", default=".peers/vllm/bin/vllm", help="the vllm executable")
    p.add_argument("--tokenizer", default=".peers/smollm2-hf", help="an HF folder with the served model's tokenizer")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if len(args.side) < 2:
        p.error("give at least two --side")
    return args, bench_args


def model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def run_one(args: argparse.Namespace, bench_args: list[str], label: str, url: str, cmd: str, repeat: int) -> dict:
    folder = args.out / label
    folder.mkdir(parents=True, exist_ok=True)
    endpoint = Endpoint.from_url(url + "/v1", None)
    if asyncio.run(answers(endpoint)):
        raise SystemExit(f"something already answers at {url}; stop it first")
    server = LaunchedServer(cmd, folder / f"r{repeat}.server.log")
    server.start()
    try:
        asyncio.run(wait_ready(endpoint, args.startup_timeout, server.alive))
        result = f"r{repeat}.json"
        command = [args.vllm, "bench", "serve", *bench_args, "--base-url", url, "--model", model_name(url),
                   "--tokenizer", args.tokenizer, "--seed", str(args.seed + repeat), "--disable-tqdm",
                   "--save-result", "--result-dir", str(folder), "--result-filename", result,
                   "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99"]
        started = time.time()
        with (folder / f"r{repeat}.log").open("w") as log:
            rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
        if rc != 0:
            raise SystemExit(f"{label} repeat {repeat}: vllm bench serve exited {rc} (see {folder}/r{repeat}.log)")
        data = json.loads((folder / result).read_text())
        data["_started"] = started
        return data
    finally:
        server.stop()


def fmt(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.2f}"


def summary(args: argparse.Namespace, bench_args: list[str], results: dict[str, list[dict]]) -> str:
    labels = list(results)
    ref = labels[-1]
    lines = [f"`vllm bench serve {' '.join(bench_args)}`, {args.repeats} repeats per side, alternating; "
             f"ratios are each side over {ref} (for times: {ref}'s over the side's, so >1 is better).", ""]
    head = "| metric | " + " | ".join(f"{lab} (mean ± std)" for lab in labels) + " | " + " | ".join(
        f"{lab} / {ref} (by repeat)" for lab in labels[:-1]) + " |"
    lines += [head, "|" + "---|" * (1 + 2 * len(labels) - 1)]
    for key, name, higher in METRICS:
        if any(key not in r for runs in results.values() for r in runs) or all(
                not r[key] for runs in results.values() for r in runs):
            continue   # absent, or zero everywhere (TPOT with one output token)
        cells = []
        for lab in labels:
            xs = [r[key] for r in results[lab]]
            sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
            cells.append(f"{fmt(statistics.mean(xs))} ± {fmt(sd)}")
        for lab in labels[:-1]:
            pairs = [(a[key], b[key]) for a, b in zip(results[lab], results[ref])]
            ratios = [(a / b if higher else b / a) if a > 0 and b > 0 else math.nan for a, b in pairs]
            mean_a = statistics.mean(p[0] for p in pairs)
            mean_b = statistics.mean(p[1] for p in pairs)
            overall = (mean_a / mean_b if higher else mean_b / mean_a) if mean_a > 0 and mean_b > 0 else math.nan
            cells.append(f"**{overall:.2f}x** ({', '.join(f'{x:.2f}' for x in ratios)})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args, bench_args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {label: [] for label, _, _ in args.side}
    for repeat in range(args.repeats):
        order = args.side if repeat % 2 == 0 else list(reversed(args.side))
        for label, url, cmd in order:
            print(f"repeat {repeat}: {label}", file=sys.stderr, flush=True)
            data = run_one(args, bench_args, label, url.rstrip("/"), cmd, repeat)
            results[label].append(data)
            print(f"  output {data['output_throughput']:.1f} tok/s, TTFT p50 {data['median_ttft_ms']:.0f} ms, "
                  f"TPOT p50 {data['median_tpot_ms']:.1f} ms, completed {data['completed']}",
                  file=sys.stderr, flush=True)
    text = summary(args, bench_args, results)
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
