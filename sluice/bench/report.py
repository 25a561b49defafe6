"""Results folders: JSON (per-call records and summaries), a Markdown table, PNG plots, the
request manifest; and the seed post's A-vs-B table for `sluice bench compare`."""
from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.image as mpimg  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from sluice.bench.client import CallRecord  # noqa: E402
from sluice.bench.metrics import (  # noqa: E402
    METRICS,
    WorkflowRecord,
    Stat,
    aggregate,
    aggregate_errors,
    percentile,
    ratio,
    ratio_interval,
    summarize,
    throughput_series,
)
from sluice.bench.run import RunResult, ScenarioSpec  # noqa: E402
from sluice.bench.workload import WorkloadConfig, approx_tokens, make_workflow, system_prompt  # noqa: E402

SCHEMA = "sluice-bench/1"


# ---------------------------------------------------------------- formatting


def fmt(value: Optional[float], unit: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if unit == "tok/s":
        return f"{value:.1f}"
    if unit == "s":
        return f"{value:.3f}" if value < 10 else f"{value:.1f}"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.3f}" if abs(value) < 1 else f"{value:.1f}"
    return f"{int(value)}"


def fmt_stat(stat: Stat, unit: str) -> str:
    if stat.mean is None:
        return "n/a"
    if stat.n > 1:
        return f"{fmt(stat.mean, unit)} ± {fmt(stat.std, unit)}"
    return fmt(stat.mean, unit)


def fmt_ratio(r: Optional[float]) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def _label(name: str, unit: str) -> str:
    return f"{name} ({unit})" if unit else name


def summary_table(runs: Sequence[RunResult]) -> str:
    """Markdown: one row per metric; mean ± std over repeats when there are several."""
    stats = aggregate([r.summary for r in runs])
    head = "| Metric | Value |" if len(runs) == 1 else f"| Metric | Mean ± std over {len(runs)} runs |"
    rows = [head, "|---|---:|"]
    for key, name, unit, _ in METRICS:
        rows.append(f"| {_label(name, unit)} | {fmt_stat(stats[key], unit)} |")
    errors = aggregate_errors([r.summary for r in runs])
    rows.append(f"| Failed calls by kind | {_errors_text(errors)} |")
    return "\n".join(rows)


def _errors_text(errors: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in errors.items()) or "none"


def paired_ratios(runs_a: Sequence[RunResult], runs_b: Sequence[RunResult]) -> dict[str, list[Optional[float]]]:
    """A/B of every figure for each repeat both sides ran (same seed, same workload): one ratio
    per pair of runs, in repeat order."""
    by_repeat = {r.repeat: r for r in runs_b}
    pairs = [(a.summary, by_repeat[a.repeat].summary) for a in sorted(runs_a, key=lambda r: r.repeat)
             if a.repeat in by_repeat]
    return {key: [ratio(getattr(a, key), getattr(b, key)) for a, b in pairs] for key, *_ in METRICS}


def compare_table(label_a: str, runs_a: Sequence[RunResult], label_b: str, runs_b: Sequence[RunResult]) -> str:
    """The seed post's table: each metric for A and B, and the ratio A/B (of the means); with
    several repeats also A/B of each pair of runs (same seed) and a 95% confidence interval of
    the ratio from those pairs (`ratio_interval`)."""
    sa = aggregate([r.summary for r in runs_a])
    sb = aggregate([r.summary for r in runs_b])
    pairs = paired_ratios(runs_a, runs_b)
    by_pair = max((len(v) for v in pairs.values()), default=0) > 1
    head = f"| Metric | {label_a} (A) | {label_b} (B) | A/B |" + (" A/B by repeat |" if by_pair else "")
    rows = [head, "|---|---:|---:|---:|" + ("---:|" if by_pair else "")]
    for key, name, unit, _ in METRICS:
        row = (f"| {_label(name, unit)} | {fmt_stat(sa[key], unit)} | {fmt_stat(sb[key], unit)} | "
               f"{fmt_ratio(ratio(sa[key].mean, sb[key].mean))} |")
        if by_pair:
            ci = ratio_interval(pairs[key])
            row += (" " + " / ".join("n/a" if r is None else f"{r:.2f}" for r in pairs[key])
                    + ("" if ci is None else f" (95% CI {ci[1]:.2f}-{ci[2]:.2f})") + " |")
        rows.append(row)
    ea = aggregate_errors([r.summary for r in runs_a])
    eb = aggregate_errors([r.summary for r in runs_b])
    rows.append(f"| Failed calls by kind | {_errors_text(ea)} | {_errors_text(eb)} | |" + (" |" if by_pair else ""))
    return "\n".join(rows)


# ---------------------------------------------------------------- plots


def _check_png(path: Path, min_colors: int = 3) -> bool:
    """Look at a saved plot before keeping it: it must read back as an image of a sane size
    that is not blank. A failing plot is deleted."""
    try:
        img = mpimg.imread(path)
    except (OSError, ValueError, SyntaxError):
        img = None
    ok = (
        img is not None
        and img.ndim == 3
        and img.shape[0] >= 200
        and img.shape[1] >= 200
        and len(np.unique(img.reshape(-1, img.shape[2])[::97], axis=0)) >= min_colors
    )
    if not ok:
        path.unlink(missing_ok=True)
        print(f"warning: plot {path.name} came out blank or unreadable; not kept", file=sys.stderr)
    return ok


def _smooth(values: Sequence[float], k: int) -> np.ndarray:
    """Centred moving average over `k` bins, averaging only the bins that exist at the edges."""
    v = np.asarray(values, dtype=np.float64)
    k = min(k, len(v))  # np.convolve(mode="same") returns max(len(v), k) values
    if k <= 1:
        return v
    kernel = np.ones(k)
    return np.convolve(v, kernel, mode="same") / np.convolve(np.ones_like(v), kernel, mode="same")


def plot_throughput(path: Path, series: Sequence[tuple[str, Sequence[RunResult]]], spec: ScenarioSpec) -> bool:
    """Output tokens/s over time (1 s bins, 5 s moving average), one line per run."""
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    points = 0
    for k, (label, runs) in enumerate(series):
        for r in runs:
            t, rate = throughput_series(r.calls, r.wall_time_s, bin_s=1.0)
            points += sum(1 for x in rate if x > 0)
            name = label if len(runs) == 1 else f"{label} run {r.repeat + 1}"
            ax.plot(t, _smooth(rate, 5), color=colors[k % len(colors)], alpha=1.0 if r.repeat == 0 else 0.45,
                    lw=1.6, label=name)
            ax.axhline(r.summary.output_throughput, color=colors[k % len(colors)], ls=":", lw=1)
    if spec.kind == "sustained":
        ax.axvline(spec.window_s, color="grey", ls="--", lw=1, label="window closes")
    ax.set_xlabel("seconds since first admission")
    ax.set_ylabel("output tokens/s (5 s average)")
    ax.set_title(f"{spec.kind}: output throughput over time (dotted: run average)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    if points == 0:
        path.unlink(missing_ok=True)
        print(f"warning: no tokens to plot in {path.name}; not kept", file=sys.stderr)
        return False
    return _check_png(path)


def plot_ttft(path: Path, series: Sequence[tuple[str, Sequence[RunResult]]], spec: ScenarioSpec) -> bool:
    """TTFT distribution of successful calls (all runs pooled) as an empirical CDF, with
    p50/p90/p99 marked; log time axis when the spread is wide."""
    data = [(label, sorted(t for r in runs for c in r.calls if c.ok and (t := c.ttft) is not None))
            for label, runs in series]
    everything = [t for _, ts in data for t in ts]
    if not everything:
        print(f"warning: no TTFT to plot in {path.name}; not kept", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (label, ts) in enumerate(data):
        if not ts:
            continue
        c = colors[k % len(colors)]
        frac = np.arange(0, len(ts) + 1) / len(ts)
        ax.step([ts[0], *ts], frac, where="post", color=c, lw=1.6, label=f"{label} ({len(ts)} calls)")
        for q, marker in ((50, "o"), (90, "s"), (99, "^")):
            v = percentile(ts, q)
            ax.plot([v], [q / 100], marker=marker, color=c, ls="none", label=f"{label} p{q} = {v:.3g} s")
    if max(everything) / max(min(everything), 1e-4) > 50:
        ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of calls")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{spec.kind}: TTFT distribution (successful calls, CDF)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return _check_png(path)


# ---------------------------------------------------------------- files


def results_document(
    label: str,
    runs: Sequence[RunResult],
    spec: ScenarioSpec,
    workload: WorkloadConfig,
    server: dict[str, Any],
    command: Sequence[str],
) -> dict[str, Any]:
    stats = aggregate([r.summary for r in runs])
    return {
        "schema": SCHEMA,
        "label": label,
        "command": list(command),
        "scenario": spec.describe(),
        "workload": workload.describe(),
        "repeats": len(runs),
        "server": server,
        "aggregate": {k: s.to_json() for k, s in stats.items()},
        "errors": aggregate_errors([r.summary for r in runs]),
        "runs": [r.to_json() for r in runs],
    }


def write_results(
    folder: Path,
    label: str,
    runs: Sequence[RunResult],
    spec: ScenarioSpec,
    workload: WorkloadConfig,
    server: dict[str, Any],
    command: Sequence[str],
) -> dict[str, Path]:
    """results.json, summary.md, throughput.png and ttft.png in `folder`; returns what was kept."""
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    doc = results_document(label, runs, spec, workload, server, command)
    out["json"] = folder / "results.json"
    out["json"].write_text(json.dumps(doc, indent=1) + "\n")
    out["markdown"] = folder / "summary.md"
    out["markdown"].write_text(_summary_markdown(label, runs, spec, workload, server, command))
    if plot_throughput(folder / "throughput.png", [(label, runs)], spec):
        out["throughput_png"] = folder / "throughput.png"
    if plot_ttft(folder / "ttft.png", [(label, runs)], spec):
        out["ttft_png"] = folder / "ttft.png"
    return out


def _summary_markdown(
    label: str, runs: Sequence[RunResult], spec: ScenarioSpec, workload: WorkloadConfig,
    server: dict[str, Any], command: Sequence[str],
) -> str:
    lines = [
        f"# sluice bench {spec.kind}: {label}",
        "",
        f"- Command: `{' '.join(command)}`",
        f"- Server: {server.get('base_url')} (version: {json.dumps(server.get('version'))})",
        f"- Scenario: {json.dumps(spec.describe())}",
        f"- Workload: {json.dumps(workload.describe())}",
        f"- Runs: {len(runs)} (seeds {', '.join(str(r.seed) for r in runs)}), started {runs[0].started_at if runs else '-'}",
        "",
        summary_table(runs),
        "",
    ]
    return "\n".join(lines)


def write_compare(
    folder: Path,
    label_a: str,
    runs_a: Sequence[RunResult],
    label_b: str,
    runs_b: Sequence[RunResult],
    spec: ScenarioSpec,
    workload: WorkloadConfig,
    command: Sequence[str],
    order: str = "sequential",
    incomplete: Optional[str] = None,
) -> dict[str, Path]:
    """compare.json, compare.md and the overlaid plots. `order` says how the runs were taken:
    "interleaved" (pairs A B, B A, A B ...), "sequential" (all of A's, then all of B's) or "single".
    `incomplete`: why the comparison stopped early (its runs are the pairs completed before)."""
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    sa = aggregate([r.summary for r in runs_a])
    sb = aggregate([r.summary for r in runs_b])
    pairs = paired_ratios(runs_a, runs_b)
    doc = {
        "schema": SCHEMA,
        "command": list(command),
        "scenario": spec.describe(),
        "workload": workload.describe(),
        "a": {"label": label_a, "aggregate": {k: s.to_json() for k, s in sa.items()}},
        "b": {"label": label_b, "aggregate": {k: s.to_json() for k, s in sb.items()}},
        "order": order,
        "ratio_a_over_b": {k: ratio(sa[k].mean, sb[k].mean) for k in sa},
        "ratio_a_over_b_by_repeat": pairs,
        "ratio_a_over_b_ci95": {k: (None if (ci := ratio_interval(v)) is None else
                                    {"geometric_mean": ci[0], "low": ci[1], "high": ci[2]})
                                for k, v in pairs.items()},
        "runs_started_at": {"a": [r.started_at for r in runs_a], "b": [r.started_at for r in runs_b]},
    }
    if incomplete is not None:
        doc["incomplete"] = incomplete
    out["json"] = folder / "compare.json"
    out["json"].write_text(json.dumps(doc, indent=1) + "\n")
    out["markdown"] = folder / "compare.md"
    out["markdown"].write_text(
        f"# sluice bench compare ({spec.kind}): {label_a} vs {label_b}\n\n"
        f"- Command: `{' '.join(command)}`\n- Scenario: {json.dumps(spec.describe())}\n"
        f"- Workload: {json.dumps(workload.describe())}\n- Repeats: {len(runs_a)} each, order: {order}\n"
        + (f"- **Incomplete**: {incomplete}\n" if incomplete is not None else "") + "\n"
        + compare_table(label_a, runs_a, label_b, runs_b) + "\n"
    )
    series = [(label_a, runs_a), (label_b, runs_b)]
    if plot_throughput(folder / "throughput.png", series, spec):
        out["throughput_png"] = folder / "throughput.png"
    if plot_ttft(folder / "ttft.png", series, spec):
        out["ttft_png"] = folder / "ttft.png"
    return out


def _dist(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"count": 0}
    v = np.asarray(values, dtype=np.float64)
    return {
        "count": int(v.size),
        "min": float(v.min()),
        "mean": round(float(v.mean()), 3),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "max": float(v.max()),
    }


def manifest_summary(runs: Sequence[RunResult], workload: WorkloadConfig) -> dict[str, Any]:
    """Token-length distributions of the workflows the runs admitted (approximate tokens, i.e.
    words), and the server-reported prompt tokens beside the approximate prompt lengths."""
    per_run = []
    for r in runs:
        wl = replace(workload, seed=r.seed)
        wfs = [make_workflow(wl, w.index) for w in sorted(r.workflows, key=lambda w: w.index)]
        approx_prompt = [sum(approx_tokens(m["content"]) for m in b.body["messages"]) for b in r.bodies]
        server_prompt = [c.prompt_tokens for c in r.calls if c.prompt_tokens is not None]
        per_run.append({
            "repeat": r.repeat,
            "seed": r.seed,
            "workflows": len(wfs),
            "calls": len(r.bodies),
            "system_prompt_tokens": approx_tokens(system_prompt(wl)),
            "task_tokens": _dist([w.task_tokens for w in wfs]),
            "steps_per_workflow": _dist([w.num_steps for w in wfs]),
            "tool_result_tokens": _dist([s.tool_result_tokens for w in wfs for s in w.steps[:-1]]),
            "output_tokens": _dist([s.output_tokens for w in wfs for s in w.steps]),
            "tool_latency_s": _dist([s.tool_latency_s for w in wfs for s in w.steps[:-1]]),
            "prompt_tokens_approx": _dist(approx_prompt),
            "prompt_tokens_server": _dist(server_prompt),
            "output_tokens_server": _dist([c.output_tokens for c in r.calls if c.output_tokens_from_usage]),
        })
    return {"schema": SCHEMA, "workload": workload.describe(), "runs": per_run}


def write_manifest(path: Path, runs: Sequence[RunResult], workload: WorkloadConfig) -> Path:
    """Every request body of the runs, one JSON object a line, ordered by (repeat, workflow,
    step) so manifests of two engines diff cleanly; and beside it `<stem>.summary.json`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in runs:
            for b in sorted(r.bodies, key=lambda b: (b.workflow_index, b.step_index)):
                f.write(json.dumps({
                    "repeat": r.repeat,
                    "workflow_index": b.workflow_index,
                    "step_index": b.step_index,
                    "headers": b.headers,
                    "body": b.body,
                }, separators=(",", ":")) + "\n")
    summary_path = manifest_summary_path(path)
    summary_path.write_text(json.dumps(manifest_summary(runs, workload), indent=1) + "\n")
    return summary_path


def manifest_summary_path(path: Path) -> Path:
    return path.with_name(path.name.removesuffix(".jsonl") + ".summary.json")


# ---------------------------------------------------------------- reading results back


def load_results(path: Path) -> tuple[str, list[RunResult], ScenarioSpec]:
    """(label, runs, scenario) from a results.json written by `write_results`."""
    doc = json.loads(Path(path).read_text())
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: not a {SCHEMA} results file")
    sc = doc["scenario"]
    spec = ScenarioSpec(
        kind=sc["scenario"],
        concurrency=sc["concurrency"],
        workflows=sc.get("workflows", 0),
        window_s=sc.get("window_s") or 1.0,
        max_workflows=sc.get("max_workflows"),
        admission=sc.get("admission", "closed"),
        timeout_s=sc["call_timeout_s"],
    )
    runs = []
    for r in doc["runs"]:
        calls = [CallRecord.from_json(c) for c in r["calls"]]
        workflows = [WorkflowRecord.from_json(w) for w in r["workflows"]]
        runs.append(RunResult(
            repeat=r["repeat"], seed=r["seed"], run_id=r["run_id"], started_at=r["started_at"],
            wall_time_s=r["wall_time_s"], calls=calls, workflows=workflows,
            summary=summarize(calls, workflows, r["wall_time_s"]), load_gate=r.get("load_gate"),
        ))
    return doc["label"], runs, spec


def replot(paths: Sequence[Path], out: Path) -> dict[str, Path]:
    """Draw throughput.png and ttft.png into `out` from one or more results.json files
    (several: overlaid, as `compare` draws them)."""
    loaded = [load_results(p) for p in paths]
    spec = loaded[0][2]
    series = [(label, runs) for label, runs, _ in loaded]
    out.mkdir(parents=True, exist_ok=True)
    kept: dict[str, Path] = {}
    if plot_throughput(out / "throughput.png", series, spec):
        kept["throughput_png"] = out / "throughput.png"
    if plot_ttft(out / "ttft.png", series, spec):
        kept["ttft_png"] = out / "ttft.png"
    return kept
