"""The burst workload of `sluice bench`, driven straight into LLMEngine: no HTTP, no client.

Same workflows (sluice.bench.workload, seed 0, synthetic history), same concurrency and tool
latencies, same request parameters; the calls go to `LLMEngine.add_request` and the loop steps
the engine itself. Comparing its throughput with `sluice bench burst` against `sluice serve`
measures what the server and the client cost; its step trace shows what the engine alone does.

    .venv/bin/python benchmarks/engine_replay.py [--workflows 32] [--concurrency 32]
        [--max-num-batched-tokens 512] [--policy workflow] [--backend auto] [--step-trace PATH]
        [--speculative-config '{"method": "ngram"}'] [--kv-cache-tokens 24064] [--admission load]
        [--max-active-workflows N|auto|none] [--auto-overhead-band LOW,HIGH] [--calls-out PATH] [--phases]
        [--history synthetic|actual] [--seed N] [--close-step-tokens N|none] [--virtual-clock [--step-cost ...]]

Beside throughput, generation speed and TTFT it prints call latency (a call's submission to its
last token) and workflow latency (a workflow's first submission to its last call's end, tool
latencies included): what an agent waits for, and what a scheduler setting can trade TTFT against
(docs/benchmarks.md, session 51).

Besides the whole run it reports the *fed window*, from 30 s in to the last workflow's admission
(enough workflows to run that long): throughput and TTFT of the sustained regime, without the
start's ramp (and the `auto` bound's climb) or the drain.

`--history actual` puts the engine's own reply in each next call's conversation, as `sluice bench
--history actual` (the sustained pairs' setting) does; the default is the drawn reply text.

`--virtual-clock` runs the same engine (real forwards, real tokens, real drafts) on simulated
time: each step lasts what a linear model of its shape says (`--step-cost`, ms per prompt token,
per prompt token and 1k tokens of its context, per decode or draft row, per 1k tokens of decode
context, per step; the default is session 37's split of a Zen 4 trace, R^2 0.997), tool
latencies and submissions follow that clock, and the scheduler sees only it. The result no longer
depends on the host's speed or noise: two scheduler settings compare exactly, and runs can go side
by side (`--threads 1`). What it cannot show is a change to the step's real cost.
"""
from __future__ import annotations

import argparse
import heapq
import json
import statistics
import time
from pathlib import Path

from sluice.bench.metrics import percentile
from sluice.bench.workload import (History, RequestTarget, WorkloadConfig, append_step, initial_messages, make_workflow,
                                   request_body)
from sluice.cli import (parse_close_step_tokens, parse_max_active_workflows, parse_overhead_band,
                        parse_speculative_config)
from sluice.config import CacheConfig, EngineConfig, SchedulerConfig
from sluice.engine.llm_engine import LLMEngine, WorkflowInfo
from sluice.model.loader import load_model_config, resolve_model_path
from sluice.sampling_params import SamplingParams


# Session 37's split of a bound-9 Zen 4 step trace (docs/measured/s37/step-split.txt), with the
# per-step term raised from the forward's 5.3 ms by the 2.9 ms a step spends outside it (session
# 38: a real replay's wall clock less its trace's forward time, over 1,686 steps).
STEP_COST_MS = (0.518, 0.166, 0.865, 0.791, 8.2)
# The fed window's start: past the first workflows' ramp (and the `auto` bound's climb from 4).
FED_WARMUP_S = 30.0


class VirtualClock:
    """Simulated seconds for `--virtual-clock`: `LLMEngine.step_hook` advances it by each step's
    modelled cost, the replay by the idle time until the next call is due."""

    def __init__(self, cost_ms: tuple[float, ...]) -> None:
        self.now = 0.0
        per_token, per_token_ctx, per_row, per_decode_ctx, per_step = cost_ms
        # in the order of StepShape.features(): 1, rows, prompt tokens, prompt attention, decode context
        self.weights = (per_step, per_row, per_token, per_token_ctx, per_decode_ctx)

    def __call__(self) -> float:
        return self.now

    def on_step(self, sched) -> None:
        """Before the step's results are applied, so `num_computed_tokens` is still each entry's
        context (the shape the auto bound fits is taken after, one chunk further on)."""
        shape = LLMEngine._shape(sched, *LLMEngine._split(sched))
        self.now += sum(w * f for w, f in zip(self.weights, shape.features())) / 1e3


def parse_step_cost(text: str) -> tuple[float, ...]:
    values = tuple(float(v) for v in text.split(","))
    if len(values) != 5 or min(values) < 0:
        raise argparse.ArgumentTypeError("five non-negative numbers: ms per prompt token, per prompt token "
                                         "per 1k context, per decode row, per 1k decode context, per step")
    return values


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--workflows", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0, help="the workload's seed, as `sluice bench --seed`")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--policy", default="workflow")
    ap.add_argument("--aging-s", type=float, default=SchedulerConfig.aging_s)
    ap.add_argument("--decode-yield-steps", type=int, default=SchedulerConfig.decode_yield_steps)
    ap.add_argument("--max-active-workflows", type=parse_max_active_workflows,
                    default=SchedulerConfig.max_active_workflows,
                    help="as `sluice serve`'s flag, default auto (with --admission load)")
    ap.add_argument("--auto-overhead-band", type=parse_overhead_band, default=None, metavar="LOW,HIGH",
                    help="as `sluice serve`'s flag")
    ap.add_argument("--close-step-tokens", type=parse_close_step_tokens, default=SchedulerConfig.close_step_tokens,
                    metavar="N|none", help="as `sluice serve`'s flag")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--kv-cache-tokens", type=int, default=None, help="instead of --kv-cache-gib")
    ap.add_argument("--admission", choices=["none", "load"], default="none",
                    help="load: start a new workflow only while the engine is `accepting` (as "
                         "`sluice bench --admission load` does through GET /load)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--step-trace", default=None)
    ap.add_argument("--speculative-config", default=None, help="as `sluice serve`'s flag")
    ap.add_argument("--calls-out", default=None,
                    help="write one JSON line per call: id, submit and first-token times, prompt and cached tokens")
    ap.add_argument("--history", choices=[h.value for h in History], default=History.SYNTHETIC.value,
                    help="the assistant reply in the next call's history: drawn text, or the engine's own")
    ap.add_argument("--phases", action="store_true",
                    help="time the model's forward, the LM head and the sampler apart and print the split")
    ap.add_argument("--virtual-clock", action="store_true",
                    help="simulated time from a model of each step's cost (see the module docstring)")
    ap.add_argument("--step-cost", type=parse_step_cost, default=STEP_COST_MS, metavar="A,B,C,D,E",
                    help="the virtual clock's cost model (default: session 37's Zen 4 split)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for the forward")
    args = ap.parse_args()

    path = resolve_model_path(args.model)
    mcfg = load_model_config(path)
    clock = VirtualClock(args.step_cost) if args.virtual_clock else time.monotonic
    eng = LLMEngine(EngineConfig(
        model_path=str(path), model=mcfg,
        cache=(CacheConfig(kv_cache_tokens=args.kv_cache_tokens, block_size=args.block_size) if args.kv_cache_tokens
               else CacheConfig(kv_cache_gib=args.kv_cache_gib, block_size=args.block_size)),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_model_len=mcfg.max_position_embeddings, policy=args.policy,
                                  aging_s=args.aging_s, decode_yield_steps=args.decode_yield_steps,
                                  max_active_workflows=args.max_active_workflows,
                                  auto_overhead_band=args.auto_overhead_band,
                                  close_step_tokens=args.close_step_tokens),
        attention_backend=args.backend, step_trace_path=args.step_trace,
        speculative=parse_speculative_config(args.speculative_config), num_threads=args.threads), clock=clock)
    if args.virtual_clock:
        eng.step_hook = clock.on_step
        eng.step_timer = clock
    tok = eng.tokenizer
    phases = _time_phases(eng) if args.phases else None
    cfg = WorkloadConfig(seed=args.seed)
    target = RequestTarget(model="replay", run_id="replay")

    def prompt(body: dict) -> list[int]:
        text = tok.apply_chat_template(body["messages"], add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)

    history = History(args.history)
    flows = {i: make_workflow(cfg, i) for i in range(args.workflows)}
    conversations = {i: initial_messages(cfg, wf) for i, wf in flows.items()}   # what step j sends
    pending = list(range(args.workflows))[::-1]        # workflows not started, popped in order
    due: list[tuple[float, int, int]] = []             # (time, workflow, step) calls waiting on a tool
    started: dict[str, float] = {}
    ttft, speed = [], []
    call_latency: list[float] = []                     # submit to last token, per call
    wf_start: dict[int, float] = {}
    wf_latency: list[float] = []                       # first call's submit to last call's end
    emitted: dict[str, int] = {}                       # tokens each call had after the last step
    produced: list[tuple[float, int]] = []             # (step end, output tokens it produced)
    last_admission = None                              # when the last workflow was admitted
    t0 = clock()

    def submit(i: int, j: int, sent: float | None = None) -> None:
        """Workflow i's call j, sent at `sent` (a tool call's end: the loop only sees it between
        steps, while a server's client sends it then and it waits for the step running; its
        TTFT counts from then) or now."""
        wf = flows[i]
        body = request_body(cfg, target, wf, j, conversations[i])
        rid = f"w{i}-s{j}"
        eng.add_request(rid, prompt(body),
                        SamplingParams(max_tokens=body["max_tokens"], temperature=0.0, ignore_eos=True),
                        WorkflowInfo(f"wf{i}", j == wf.num_steps - 1), arrival_time=sent)
        started[rid] = clock() if sent is None else sent
        wf_start.setdefault(i, started[rid])

    gated = args.admission == "load"
    slots = args.concurrency   # free client slots: a workflow ended and the next is not started

    def admit() -> None:
        nonlocal slots, last_admission
        while slots and pending and (not gated or eng.stats().accepting):
            submit(pending.pop(), 0)
            slots -= 1
            if not pending:
                last_admission = clock()

    first: dict[str, float] = {}
    in_flight: list[tuple[int, int]] = []   # after each step: workflows in flight, their bound
    calls_out = open(args.calls_out, "w") if args.calls_out else None
    admit()
    while eng.has_unfinished() or due or pending:
        now = clock()
        while due and due[0][0] <= now:
            sent, i, j = heapq.heappop(due)
            submit(i, j, sent)
        admit()   # as `sluice bench --admission load` against the server: /load decides (an idle
                  # engine's exception to the `auto` bound is the scheduler's, WorkflowLimit.room)
        if not eng.has_unfinished():
            if args.virtual_clock:
                clock.now = max(now + 1e-3, due[0][0]) if due else now + 0.01
            else:
                time.sleep(max(0.0, min(0.05, due[0][0] - now)) if due else 0.0)
            continue
        outs = eng.step()
        lim = eng.scheduler.workflow_limit
        in_flight.append((eng.scheduler.workflows.num_active, lim.value or 0))
        step_tokens = 0
        for out in outs:
            rid = out.request_id
            n_now = len(out.outputs[0].token_ids)
            step_tokens += n_now - emitted.get(rid, 0)
            emitted[rid] = n_now
            if rid not in first and out.outputs[0].token_ids:
                first[rid] = clock()
                ttft.append(first[rid] - started[rid])
                if calls_out is not None:
                    calls_out.write(json.dumps({
                        "id": rid, "submit": round(started[rid] - t0, 4), "first": round(first[rid] - t0, 4),
                        "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": out.num_cached_tokens}) + "\n")
            if not out.finished:
                continue
            del emitted[rid]
            n = len(out.outputs[0].token_ids)
            end = clock()
            if n > 1:
                speed.append((n - 1) / max(1e-9, end - first[rid]))
            call_latency.append(end - started[rid])
            i, j = (int(x[1:]) for x in rid.split("-"))
            wf = flows[i]
            if j + 1 < wf.num_steps:
                step = wf.steps[j]
                append_step(conversations[i], step, step.reply if history is History.SYNTHETIC else out.outputs[0].text)
                heapq.heappush(due, (end + step.tool_latency_s, i, j + 1))
            else:
                slots += 1
                wf_latency.append(end - wf_start[i])
        produced.append((clock(), step_tokens))
    wall = clock() - t0
    out_tokens = sum(n for _, n in produced)
    if calls_out is not None:
        calls_out.close()
    q = statistics.quantiles(ttft, n=10)
    q99 = statistics.quantiles(ttft, n=100)[98]
    print(f"{args.workflows} workflows, concurrency {args.concurrency}, budget {args.max_num_batched_tokens}, "
          f"policy {args.policy}, backend {args.backend}, admission {args.admission}, history {history.value}, "
          f"KV {eng.scheduler.pool.num_blocks * eng.scheduler.block_size} tokens"
          + (f", virtual clock {','.join(map(str, args.step_cost))} (times below are modelled)" if args.virtual_clock else ""))
    print(f"wall {wall:.1f} s, output tokens {out_tokens}, aggregate {out_tokens / wall:.1f} tok/s, "
          f"generation speed p50 {statistics.median(speed):.1f} tok/s (p10 {percentile(speed, 10):.1f}), "
          f"TTFT p50 {statistics.median(ttft):.3f} s p90 {q[8]:.3f} s p99 {q99:.3f} s")
    # What an agent waits for: a call's whole answer, a workflow's whole chain (tool latencies included);
    # percentiles as `sluice bench` computes them.
    print(f"call latency p50 {statistics.median(call_latency):.3f} s p90 {percentile(call_latency, 90):.3f} s, "
          f"workflow latency p50 {statistics.median(wf_latency):.2f} s p90 {percentile(wf_latency, 90):.2f} s")
    if last_admission is not None and last_admission - t0 > 2 * FED_WARMUP_S:
        # The sustained regime: past the start's ramp, before the drain (no workflow left to admit).
        lo, hi = t0 + FED_WARMUP_S, last_admission
        tokens = sum(n for t, n in produced if lo < t <= hi)
        fed = [f - started[r] for r, f in first.items() if lo <= started[r] <= hi]
        if len(fed) >= 2:
            print(f"while fed ({FED_WARMUP_S:.0f} s to the last admission at {hi - t0:.1f} s): {tokens / (hi - lo):.1f} tok/s, "
                  f"TTFT p50 {statistics.median(fed):.3f} s p90 {statistics.quantiles(fed, n=10)[8]:.3f} s over {len(fed)} calls")
    st = eng.stats()
    print(f"prefix cache: {st.prefix_cache_hits / max(1, st.prefix_cache_queries):.1%} of prompt tokens hit, "
          f"{st.num_preemptions} preemptions")
    if st.spec_drafts_total:
        print(f"speculation: {st.spec_draft_tokens_total} draft tokens in {st.spec_drafts_total} verifications, "
              f"{st.spec_accepted_tokens_total / st.spec_draft_tokens_total:.0%} accepted, "
              f"{st.spec_accepted_tokens_total / st.spec_drafts_total:.2f} accepted per verification")
    lim = eng.scheduler.workflow_limit
    active = [a for a, _ in in_flight]
    line = f"workflows in flight per step: mean {statistics.mean(active):.1f}, max {max(active)}"
    if lim.auto:
        bounds = [b for _, b in in_flight]
        line += (f"; auto bound: mean {statistics.mean(bounds):.1f}, range {min(bounds)}-{max(bounds)}, "
                 f"final {lim.value}, {lim.adjustments} adjustments, last overhead "
                 f"{lim.last_overhead if lim.last_overhead is not None else float('nan'):.1%}")
    print(line)
    if phases is not None:
        for name, (secs, calls, rows) in phases.items():
            print(f"{name}: {secs:.1f} s of {wall:.1f} ({secs / wall:.0%}), {calls} calls, "
                  f"{secs / max(1, calls) * 1e3:.1f} ms/call" + (f", {rows} rows" if rows else ""))
    print(Path(args.step_trace).resolve() if args.step_trace else "")


def _time_phases(eng: LLMEngine) -> dict[str, list]:
    """Wrap the engine's model forward, LM head and sampler with timers: name -> [seconds, calls,
    rows] (rows: tokens through the forward, hidden rows through the LM head)."""
    acc: dict[str, list] = {}

    def timed(name: str, fn, rows_of=None):
        acc[name] = [0.0, 0, 0]

        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            rec = acc[name]
            rec[0] += time.perf_counter() - t
            rec[1] += 1
            rec[2] += rows_of(*a) if rows_of else 0
            return out
        return wrapper

    runner = eng.runner
    model = runner.model
    model.forward = timed("forward", model.forward, lambda ids, *_: ids.shape[0])
    model.compute_logits = timed("lm head", model.compute_logits, lambda h: h.shape[0])
    runner.sampler = timed("sampler", runner.sampler)
    eng.step = timed("engine step", eng.step)
    return acc


if __name__ == "__main__":
    main()
