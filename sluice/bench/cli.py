"""`sluice bench {burst,sustained,compare,soak}`: agent-workflow benchmarks of any OpenAI-compatible
endpoint (sluice, vLLM, llama.cpp's server), and a soak test of one."""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Optional, Sequence

from sluice.bench.client import Endpoint
from sluice.bench.floor import PromptCost, floor_rows, floor_table
from sluice.bench.report import compare_table, replot, summary_table, write_compare, write_manifest, write_results
from sluice.bench.run import (
    BURST,
    SUSTAINED,
    RunResult,
    ScenarioSpec,
    answers,
    fetch_model,
    run_repeats,
    server_info,
    wait_ready,
)
from sluice.bench.soak import SoakConfig, run_soak
from sluice.bench.workload import FloatRange, History, IntRange, WorkloadConfig

_D = WorkloadConfig()

WORKLOAD_HELP = textwrap.dedent(f"""\
    workload (token counts are approximate: text is drawn from common English words that are one
    BPE token each; the server's `usage` gives the true counts, which the results report):
      a system prompt of ~{_D.system_tokens} tokens (tool descriptions) shared by every workflow;
      a task of {_D.task_tokens} tokens (uniform), unique to the workflow;
      {_D.steps} steps (uniform), each one streaming /v1/chat/completions call with the whole
      conversation so far, its output forced to {_D.output_tokens} tokens (uniform;
      max_tokens + ignore_eos);
      after each non-last step, the assistant reply and a tool result of lognormal length
      (median {_D.tool_result_median:g}, sigma {_D.tool_result_sigma:g}, at most {_D.tool_result_max})
      are appended, then the workflow waits a tool latency of {_D.tool_latency_s} s (uniform).
    --scale F multiplies every token length and latency (not the step counts) after the explicit
    flags. Everything is drawn from --seed: the i-th workflow and its bodies are the same on
    every engine. Repeat r uses seed + r. Each call carries header X-Workflow-Id: <run-id>-<i>
    and, unless --no-send-workflow-fields, body fields workflow_id and is_last_step.
    """)


def _int_range(text: str) -> IntRange:
    lo, _, hi = text.replace(",", "-").partition("-")
    return IntRange(int(lo), int(hi or lo))


def _float_range(text: str) -> FloatRange:
    lo, _, hi = text.replace(",", "-").partition("-")
    return FloatRange(float(lo), float(hi or lo))


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    g.add_argument("--scale", type=float, default=1.0, help="multiply token lengths and tool latencies")
    g.add_argument("--system-tokens", type=int, default=_D.system_tokens)
    g.add_argument("--task-tokens", type=_int_range, default=_D.task_tokens, metavar="MIN-MAX")
    g.add_argument("--steps", type=_int_range, default=_D.steps, metavar="MIN-MAX")
    g.add_argument("--tool-result-tokens", type=float, default=_D.tool_result_median, metavar="MEDIAN")
    g.add_argument("--tool-result-sigma", type=float, default=_D.tool_result_sigma)
    g.add_argument("--tool-result-max", type=int, default=_D.tool_result_max)
    g.add_argument("--output-tokens", type=_int_range, default=_D.output_tokens, metavar="MIN-MAX")
    g.add_argument("--tool-latency", type=_float_range, default=_D.tool_latency_s, metavar="MIN-MAX",
                   help="seconds")
    g.add_argument("--temperature", type=float, default=_D.temperature)
    g.add_argument("--history", choices=[h.value for h in History], default=History.SYNTHETIC.value,
                   help="what stands for the assistant reply in later steps: 'synthetic' (drawn "
                        "text of the drawn length; bodies identical on every engine) or 'actual' "
                        "(the engine's own reply)")


def _add_scenario_args(p: argparse.ArgumentParser, kind: Optional[str]) -> None:
    g = p.add_argument_group("scenario")
    g.add_argument("--concurrency", type=int, default=32, help="most workflows in flight (default 32)")
    if kind in (BURST, None):
        g.add_argument("--workflows", type=int, default=96, help="burst: number of workflows (default 96)")
    if kind in (SUSTAINED, None):
        g.add_argument("--window", type=float, default=1800.0, help="sustained: admission window in s (default 1800)")
        g.add_argument("--max-workflows", type=int, default=None, help="sustained: cap on admissions")
        g.add_argument("--admission", choices=["closed", "load"], default="closed",
                       help="sustained: 'closed' loop, or 'load': also wait while GET /load says "
                            "accepting=false (falls back to closed where the server has no /load)")
    g.add_argument("--timeout", type=float, default=600.0, help="per-call timeout in s (default 600)")
    g.add_argument("--repeats", type=int, default=1, help="run N times; report mean and std")


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("requests and output")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    g.add_argument("--run-id", default=None, help="workflow ids are <run-id>-<i> (default s<seed>)")
    g.add_argument("--send-workflow-fields", action=argparse.BooleanOptionalAction, default=True,
                   help="body fields workflow_id / is_last_step (off for servers that reject unknown fields)")
    g.add_argument("--out", type=Path, default=None, help="results folder (default bench-results/<scenario>-<time>)")
    g.add_argument("--manifest", type=Path, default=None,
                   help="write every request body (JSONL) and <stem>.summary.json of token lengths")
    g.add_argument("--quiet", action="store_true", help="no live progress display")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice bench",
        description=__doc__,
        epilog=WORKLOAD_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for kind, text in (
        (BURST, "a fixed set of workflows, at most --concurrency in flight"),
        (SUSTAINED, "closed loop for --window seconds, then drain"),
    ):
        p = sub.add_parser(kind, help=text, description=text, epilog=WORKLOAD_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
        p.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
        p.add_argument("--label", default=None, help="name in reports (default: the base URL)")
        _add_scenario_args(p, kind)
        _add_workload_args(p)
        _add_output_args(p)
    p = sub.add_parser(
        "compare", epilog=WORKLOAD_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
        help="run the same scenario on endpoints A and B, one at a time; print each metric and A/B",
        description="Run the same scenario and workload on A and on B, one at a time, and print the "
                    "seed post's table. With --repeats N the runs alternate A B, B A, A B ... (--order "
                    "interleaved, the default), so that a drift in the machine's speed reaches both "
                    "sides alike and neither side always goes first; the table then also gives A/B "
                    "for each pair of runs. With "
                    "--a-cmd/--b-cmd each server is launched before its turn and stopped after it "
                    "(interleaved: once per repeat, a fresh server for every run).",
    )
    p.add_argument("--scenario", choices=[BURST, SUSTAINED], default=BURST)
    p.add_argument("--order", choices=["interleaved", "sequential"], default="interleaved",
                   help="with --repeats N: pairs A B, B A, A B ... (default) or all of A's runs, then all of B's")
    for side in ("a", "b"):
        p.add_argument(f"--{side}", required=True, metavar="URL", help=f"base URL of {side.upper()}")
        p.add_argument(f"--{side}-model", default=None)
        p.add_argument(f"--{side}-label", default=None)
        p.add_argument(f"--{side}-cmd", default=None, metavar="SHELL",
                       help=f"command that serves {side.upper()} at its URL (launched, then stopped)")
    p.add_argument("--startup-timeout", type=float, default=900.0, help="for --a-cmd/--b-cmd")
    _add_scenario_args(p, None)
    _add_workload_args(p)
    _add_output_args(p)
    p = sub.add_parser(
        "soak", epilog=WORKLOAD_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
        help="sustained load with client aborts and malformed calls; fails on lost calls, leaks, memory growth",
        description="Sustained workflow load for --duration seconds with a share of calls abandoned by the "
                    "client and malformed requests mixed in; then checks that every accepted call completed, "
                    "every malformed one got a 4xx, no KV block leaked and resident memory stayed within "
                    "bound. Exit status 0 when all hold.",
    )
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", default=None, help="model name (default: first of GET /v1/models)")
    d = SoakConfig()
    g = p.add_argument_group("soak")
    g.add_argument("--duration", type=float, default=d.duration_s, help=f"seconds of admissions (default {d.duration_s:g})")
    g.add_argument("--concurrency", type=int, default=d.concurrency, help=f"workflow slots (default {d.concurrency})")
    g.add_argument("--abort-fraction", type=float, default=d.abort_fraction,
                   help=f"share of calls the client abandons (default {d.abort_fraction:g})")
    g.add_argument("--abort-within", type=float, default=d.abort_within_s,
                   help=f"an abandoned call is closed uniformly within this many seconds (default {d.abort_within_s:g})")
    g.add_argument("--malformed-fraction", type=float, default=d.malformed_fraction,
                   help=f"chance, before each call, of a malformed request too (default {d.malformed_fraction:g})")
    g.add_argument("--warmup", type=float, default=d.warmup_s,
                   help=f"seconds before the memory baseline is taken (default {d.warmup_s:g})")
    g.add_argument("--max-rss-growth-mib", type=float, default=d.max_rss_growth_mib,
                   help=f"bound on resident memory growth after the warm-up (default {d.max_rss_growth_mib:g})")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                   help=f"seconds for the server to go idle and free its blocks (default {d.drain_timeout_s:g})")
    g.add_argument("--timeout", type=float, default=d.call_timeout_s, help="per-call timeout in s")
    g.add_argument("--report", type=Path, default=None, help="write the report as JSON here")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    g.add_argument("--quiet", action="store_true", help="no progress lines")
    _add_workload_args(p)
    p = sub.add_parser("plot", help="redraw the plots from results.json files (several: overlaid)")
    p.add_argument("results", type=Path, nargs="+", help="results.json of a run (or of each side)")
    p.add_argument("--out", type=Path, required=True, help="folder for throughput.png and ttft.png")
    d = PromptCost()
    p = sub.add_parser(
        "floor", help="the TTFT an ideal engine would give a recorded run's calls (see sluice/bench/floor.py)",
        description="Replay each run's calls, at their send times and with the uncached prompt tokens the "
                    "server reported, through an ideal engine that computes prompt tokens at the given FLOP "
                    "rates and nothing else (decodes free), first come first served and shortest remaining "
                    "prompt first; print TTFT p50 / p90 beside the measured ones. The FLOP counts default to "
                    "SmolLM2-135M's, the rates to the bf16 peak of the AVX-512 BF16 hosts "
                    "(benchmarks/roofline.py measures a host's).")
    p.add_argument("results", type=Path, nargs="+", help="results.json of a run (or of each side)")
    p.add_argument("--linear-gflops", type=float, default=d.linear_rate / 1e9,
                   help=f"rate of the projections (default {d.linear_rate / 1e9:g})")
    p.add_argument("--attn-gflops", type=float, default=d.attn_rate / 1e9,
                   help=f"rate of prompt attention (default {d.attn_rate / 1e9:g})")
    p.add_argument("--linear-mflop-per-token", type=float, default=d.linear_flop_per_token / 1e6,
                   help=f"projections' FLOPs per prompt token (default SmolLM2-135M's, {d.linear_flop_per_token / 1e6:.2f})")
    p.add_argument("--attn-kflop-per-context-token", type=float, default=d.attn_flop_per_context_token / 1e3,
                   help=f"attention FLOPs per prompt token per token of context (default {d.attn_flop_per_context_token / 1e3:g})")
    p.add_argument("--poisson", type=int, default=0, metavar="N",
                   help="also replay each run's calls at Poisson arrivals of the same rate, N draws (default 0)")
    return parser


def workload_from_args(args: argparse.Namespace) -> WorkloadConfig:
    cfg = WorkloadConfig(
        seed=args.seed,
        system_tokens=args.system_tokens,
        task_tokens=args.task_tokens,
        steps=args.steps,
        tool_result_median=args.tool_result_tokens,
        tool_result_sigma=args.tool_result_sigma,
        tool_result_max=args.tool_result_max,
        output_tokens=args.output_tokens,
        tool_latency_s=args.tool_latency,
        history=History(args.history),
        temperature=args.temperature,
    )
    return cfg if args.scale == 1.0 else cfg.scaled(args.scale)


def spec_from_args(args: argparse.Namespace, kind: str) -> ScenarioSpec:
    return ScenarioSpec(
        kind=kind,
        concurrency=args.concurrency,
        workflows=getattr(args, "workflows", 96),
        window_s=getattr(args, "window", 1800.0),
        max_workflows=getattr(args, "max_workflows", None),
        admission=getattr(args, "admission", "closed"),
        timeout_s=args.timeout,
    )


def _default_out(name: str) -> Path:
    return Path("bench-results") / f"{name}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


async def _bench_endpoint(
    endpoint: Endpoint, model: Optional[str], spec: ScenarioSpec, workload: WorkloadConfig, args: argparse.Namespace,
    first: int = 0, repeats: Optional[int] = None,
) -> tuple[list[RunResult], dict[str, Any]]:
    """Repeats first .. first + repeats - 1 (default: all of --repeats) of the series."""
    model = model or await fetch_model(endpoint)
    if model is None:
        raise SystemExit(f"no --model given and {endpoint.base_url}/models lists none")
    info = await server_info(endpoint)
    info["model"] = model
    runs = await run_repeats(
        endpoint, model, spec, workload,
        repeats=args.repeats if repeats is None else repeats, first=first, of=args.repeats,
        run_id=args.run_id, send_workflow_fields=args.send_workflow_fields,
        keep_bodies=args.manifest is not None, live=None if args.quiet else sys.stderr,
    )
    return runs, info


def _print_kept(files: dict[str, Path]) -> None:
    for kind, path in files.items():
        print(f"  {kind}: {path}")


def cmd_scenario(args: argparse.Namespace, argv: Sequence[str]) -> int:
    kind = args.command
    spec = spec_from_args(args, kind)
    workload = workload_from_args(args)
    endpoint = Endpoint.from_url(args.base_url, args.api_key)
    runs, info = asyncio.run(_bench_endpoint(endpoint, args.model, spec, workload, args))
    label = args.label or endpoint.base_url
    out = args.out or _default_out(kind)
    files = write_results(out, label, runs, spec, workload, info, ["sluice", "bench", *argv])
    if args.manifest is not None:
        files["manifest"] = args.manifest
        files["manifest_summary"] = write_manifest(args.manifest, runs, workload)
    print(summary_table(runs))
    print(f"results in {out}:")
    _print_kept(files)
    return 0 if any(r.summary.ok_calls for r in runs) else 1


class LaunchedServer:
    """A server started by a shell command in its own process group; stopped with the group."""

    def __init__(self, command: str, log_path: Path):
        self.command = command
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen[bytes]] = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.command, shell=True, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        try:  # children that outlived the shell
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run_side(side: str, args: argparse.Namespace, spec: ScenarioSpec, workload: WorkloadConfig, out: Path,
              first: int = 0, repeats: Optional[int] = None) -> tuple[str, list[RunResult], dict[str, Any]]:
    """Repeats first .. first + repeats - 1 (default: all) on one side; with --{side}-cmd its
    server is launched before them and stopped after them."""
    url, model, label, cmd = (getattr(args, side), getattr(args, f"{side}_model"),
                              getattr(args, f"{side}_label"), getattr(args, f"{side}_cmd"))
    endpoint = Endpoint.from_url(url, args.api_key)
    label = label or endpoint.base_url
    log = out / (f"{side}.server.log" if repeats is None else f"{side}.server.r{first}.log")
    server = LaunchedServer(cmd, log) if cmd else None
    if server is not None and asyncio.run(answers(endpoint)):
        # The launched server could not bind the port and the runs would measure whatever holds
        # it (a server left running from earlier), with nothing to tell the two apart.
        raise SystemExit(f"{side.upper()}: something already answers at {endpoint.base_url}; stop it, or "
                         f"drop --{side}-cmd to measure it as it is")
    try:
        if server is not None:
            print(f"starting {side.upper()}: {cmd}", file=sys.stderr)
            server.start()
            asyncio.run(wait_ready(endpoint, args.startup_timeout, server.alive))
        print(f"{side.upper()} = {label}", file=sys.stderr)
        runs, info = asyncio.run(_bench_endpoint(endpoint, model, spec, workload, args, first, repeats))
        if server is not None and not server.alive():
            raise SystemExit(f"{side.upper()}: the server launched by --{side}-cmd exited during the run "
                             f"(log: {log}); its results are not from it")
    finally:
        if server is not None:
            server.stop()
    return label, runs, info


def cmd_compare(args: argparse.Namespace, argv: Sequence[str]) -> int:
    spec = spec_from_args(args, args.scenario)
    workload = workload_from_args(args)
    if Endpoint.from_url(args.a).base_url == Endpoint.from_url(args.b).base_url and not (args.a_cmd and args.b_cmd):
        print("warning: A and B are the same server: B will find A's prompts in its prefix cache",
              file=sys.stderr)
    out = args.out or _default_out(f"compare-{args.scenario}")
    command = ["sluice", "bench", *argv]
    runs: dict[str, list[RunResult]] = {"a": [], "b": []}
    labels: dict[str, str] = {}
    infos: dict[str, dict[str, Any]] = {}
    if args.order == "interleaved" and args.repeats > 1:
        # A B, B A, A B ...: a drift of the machine over the session reaches both sides alike,
        # each pair of runs (same seed, minutes apart) gives a ratio of its own, and neither side
        # always runs first in its pair (an A/A test with A first in all three pairs measured
        # 1.03x, CI 1.00-1.06).
        turns = [(side, r, 1) for r in range(args.repeats) for side in (("a", "b") if r % 2 == 0 else ("b", "a"))]
    else:
        turns = [(side, 0, None) for side in ("a", "b")]
    failure: Optional[BaseException] = None
    for side, first, count in turns:
        try:
            labels[side], got, info = _run_side(side, args, spec, workload, out, first, count)
        except (SystemExit, Exception) as e:  # a launch or a run failed: keep what was measured
            failure = e
            break
        runs[side].extend(got)
        infos.setdefault(side, info)
    if failure is not None:
        _write_partial_compare(out, args, runs, labels, infos, spec, workload, command, failure)
        raise failure
    sides = {}
    for side in ("a", "b"):
        files = write_results(out / side, labels[side], runs[side], spec, workload, infos[side], command)
        if args.manifest is not None:
            path = args.manifest.with_name(f"{args.manifest.stem}.{side}{args.manifest.suffix or '.jsonl'}")
            files["manifest"] = path
            files["manifest_summary"] = write_manifest(path, runs[side], workload)
        sides[side] = (labels[side], runs[side], files)
    (la, ra, fa), (lb, rb, fb) = sides["a"], sides["b"]
    order = args.order if args.repeats > 1 else "single"
    files = write_compare(out, la, ra, lb, rb, spec, workload, command, order=order)
    print(compare_table(la, ra, lb, rb))
    print(f"results in {out}:")
    _print_kept({**files, **{f"a/{k}": v for k, v in fa.items()}, **{f"b/{k}": v for k, v in fb.items()}})
    return 0


def _write_partial_compare(out: Path, args: argparse.Namespace, runs: dict[str, list[RunResult]],
                           labels: dict[str, str], infos: dict[str, dict[str, Any]], spec: ScenarioSpec,
                           workload: WorkloadConfig, command: list[str], failure: BaseException) -> None:
    """After a failed turn: each side's completed runs, and the comparison of the repeats both
    sides completed, so that an hour of runs is not lost to the last launch."""
    reason = f"stopped early: {failure}"
    kept: dict[str, Path] = {}
    for side in ("a", "b"):
        if runs[side]:
            files = write_results(out / side, labels[side], runs[side], spec, workload, infos[side], command)
            kept.update({f"{side}/{k}": v for k, v in files.items()})
    common = {r.repeat for r in runs["a"]} & {r.repeat for r in runs["b"]}
    if common:
        ra = [r for r in runs["a"] if r.repeat in common]
        rb = [r for r in runs["b"] if r.repeat in common]
        order = args.order if args.repeats > 1 else "single"
        kept.update(write_compare(out, labels["a"], ra, labels["b"], rb, spec, workload, command, order=order,
                                  incomplete=f"{reason}; {len(common)} of {args.repeats} repeats on both sides"))
    if kept:
        print(f"{reason}; partial results in {out}:", file=sys.stderr)
        for name, path in kept.items():
            print(f"  {name}: {path}", file=sys.stderr)


def cmd_soak(args: argparse.Namespace) -> int:
    config = SoakConfig(
        duration_s=args.duration, concurrency=args.concurrency, abort_fraction=args.abort_fraction,
        abort_within_s=args.abort_within, malformed_fraction=args.malformed_fraction, warmup_s=args.warmup,
        max_rss_growth_mib=args.max_rss_growth_mib, drain_timeout_s=args.drain_timeout,
        call_timeout_s=args.timeout, seed=args.seed,
    )
    endpoint = Endpoint.from_url(args.base_url, args.api_key)

    async def run():
        model = args.model or await fetch_model(endpoint)
        if model is None:
            raise SystemExit(f"no --model given and {endpoint.base_url}/models lists none")
        return await run_soak(endpoint, model, workload_from_args(args), config,
                              live=None if args.quiet else sys.stderr)

    report = asyncio.run(run())
    print(report.table())
    if args.report is not None:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        print(f"report: {args.report}")
    return 0 if report.passed else 1


def cmd_floor(args: argparse.Namespace) -> int:
    for name in ("linear_gflops", "attn_gflops", "linear_mflop_per_token", "attn_kflop_per_context_token"):
        if not getattr(args, name) > 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.poisson < 0:
        raise SystemExit("--poisson must be 0 or more")
    cost = PromptCost(linear_flop_per_token=args.linear_mflop_per_token * 1e6,
                      attn_flop_per_context_token=args.attn_kflop_per_context_token * 1e3,
                      linear_rate=args.linear_gflops * 1e9, attn_rate=args.attn_gflops * 1e9)
    rows = []
    for path in args.results:
        try:
            rows.extend(floor_rows(path, cost, poisson=args.poisson))
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"{path}: {e}") from None
    print(floor_table(rows, cost))
    return 0


def main(argv: list[str]) -> int:
    argv = list(argv)
    args = build_parser().parse_args(argv)
    if args.command == "plot":
        _print_kept(replot(args.results, args.out))
        return 0
    if args.command == "soak":
        return cmd_soak(args)
    if args.command == "floor":
        return cmd_floor(args)
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.command == "compare":
        return cmd_compare(args, argv)
    return cmd_scenario(args, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
