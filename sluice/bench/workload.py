"""Deterministic agent-workflow workloads.

A workflow is an agent loop: the run's shared system prompt (tool descriptions), a task unique to
the workflow, then k steps. Step j sends the whole conversation so far; after it, an assistant
reply and a synthetic tool result are appended and the workflow waits a tool latency.

Everything is a pure function of (seed, workflow index): the i-th workflow of a run, and every
request body it produces, are the same whatever the engine, the concurrency or the number of
workflows. Each workflow draws from its own `random.Random` seeded with a string, which Python
hashes with SHA-512, so the draws do not depend on PYTHONHASHSEED, the platform or numpy.

Token lengths are approximate: the client has no tokenizer. Text is drawn from `WORDS`, common
English words that are one token each (with their leading space) in byte-level BPE tokenizers;
checked against SmolLM2's tokenizer, where 1000 drawn words encode to exactly 1000 tokens. True
counts come from the server's `usage` and are reported beside the approximate ones.

The appended assistant reply is by default *synthetic*: drawn text of the length that step asked
for, not the engine's output, so that request bodies do not depend on what an engine generated
(greedy decoding differs across engines in bf16). `History.ACTUAL` appends the engine's reply
instead; the bodies then differ per engine and the manifest records what was really sent.
"""
from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass, replace
from typing import Any, Optional

WORDS: tuple[str, ...] = (
    "the of and to in is for on with as by at from that this it be are was an or not can will "
    "file data search result query list read write open close run test build check update create "
    "delete user value name type error status code line page text table field index key path time "
    "date year number count total item order price city state country report system server client "
    "request response model agent tool task step plan goal note summary source target input output "
    "format version module function method class object string integer array record event message "
    "queue cache memory disk network port host address service process thread job batch stream "
    "block node graph tree branch commit change issue review merge release deploy config option "
    "setting level mode range limit size start end first last next previous new old small large "
    "high low fast slow good best more less second third find show get set add remove move copy "
    "send return call use make take give keep weather market stock news email calendar meeting "
    "project team customer account payment invoice product store cart results found match matches "
    "score rank top week month day hour minute"
).split()

TOOL_NAMES: tuple[str, ...] = (
    "search", "read_file", "write_file", "run_tests", "query_db", "http_get", "calendar", "email",
)


class History(enum.Enum):
    """What stands for the assistant's reply in the conversation of the next step."""

    SYNTHETIC = "synthetic"   # drawn text of the step's output length: bodies engine-independent
    ACTUAL = "actual"         # the text the engine streamed back


@dataclass(frozen=True)
class IntRange:
    """Inclusive integer range, drawn uniformly."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if self.lo < 0 or self.hi < self.lo:
            raise ValueError(f"bad range {self.lo}-{self.hi}")

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)

    def scaled(self, f: float, floor: int = 1) -> "IntRange":
        lo = max(floor, round(self.lo * f))
        return IntRange(lo, max(lo, round(self.hi * f)))

    def __str__(self) -> str:
        return f"{self.lo}-{self.hi}"


@dataclass(frozen=True)
class FloatRange:
    """Closed float range, drawn uniformly."""

    lo: float
    hi: float

    def __post_init__(self) -> None:
        if self.lo < 0 or self.hi < self.lo:
            raise ValueError(f"bad range {self.lo}-{self.hi}")

    def draw(self, rng: random.Random) -> float:
        return rng.uniform(self.lo, self.hi)

    def scaled(self, f: float) -> "FloatRange":
        return FloatRange(self.lo * f, self.hi * f)

    def __str__(self) -> str:
        return f"{self.lo:g}-{self.hi:g}"


@dataclass(frozen=True)
class WorkloadConfig:
    """The distributions every workflow is drawn from. Token counts are approximate (words)."""

    seed: int = 0
    system_tokens: int = 400                              # shared system prompt (tool descriptions)
    task_tokens: IntRange = IntRange(50, 150)             # uniform
    steps: IntRange = IntRange(2, 6)                      # uniform; calls per workflow
    tool_result_median: float = 250.0                     # lognormal median, tokens
    tool_result_sigma: float = 0.5                        # lognormal sigma of ln(tokens)
    tool_result_max: int = 1000                           # clip of the lognormal draw
    output_tokens: IntRange = IntRange(40, 160)           # uniform; forced with ignore_eos
    tool_latency_s: FloatRange = FloatRange(0.5, 2.0)     # uniform wait after each non-last step
    history: History = History.SYNTHETIC
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if self.system_tokens < 0 or self.tool_result_median <= 0 or self.tool_result_sigma < 0:
            raise ValueError("token lengths must be positive")
        if self.steps.lo < 1:
            raise ValueError("a workflow has at least one step")
        if self.output_tokens.lo < 1:
            raise ValueError("output length must be at least one token")

    def scaled(self, f: float) -> "WorkloadConfig":
        """Every token length and tool latency times `f` (step counts unchanged)."""
        if f <= 0:
            raise ValueError("scale must be positive")
        return replace(
            self,
            system_tokens=round(self.system_tokens * f),
            task_tokens=self.task_tokens.scaled(f),
            tool_result_median=max(1.0, self.tool_result_median * f),
            tool_result_max=max(1, round(self.tool_result_max * f)),
            output_tokens=self.output_tokens.scaled(f),
            tool_latency_s=self.tool_latency_s.scaled(f),
        )

    def describe(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "system_prompt_tokens": self.system_tokens,
            "task_tokens": f"uniform {self.task_tokens}",
            "steps": f"uniform {self.steps}",
            "tool_result_tokens": (
                f"lognormal median {self.tool_result_median:g} sigma {self.tool_result_sigma:g}, "
                f"clipped to 1-{self.tool_result_max}"
            ),
            "output_tokens": f"uniform {self.output_tokens} (max_tokens + ignore_eos)",
            "tool_latency_s": f"uniform {self.tool_latency_s}",
            "history": self.history.value,
            "temperature": self.temperature,
            "token_unit": "words, ~1 BPE token each; server usage gives true counts",
        }


@dataclass(frozen=True)
class Step:
    output_tokens: int          # max_tokens of this call
    reply: str                  # synthetic assistant reply appended after it (History.SYNTHETIC)
    tool_name: str              # tool the reply "called"
    tool_result: str            # appended after the reply ("" on the last step)
    tool_result_tokens: int     # approximate length of tool_result
    tool_latency_s: float       # wait before the next step (0 on the last step)


@dataclass(frozen=True)
class Workflow:
    index: int
    task: str
    task_tokens: int
    steps: tuple[Step, ...]

    @property
    def num_steps(self) -> int:
        return len(self.steps)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def _lognormal_tokens(rng: random.Random, cfg: WorkloadConfig) -> int:
    x = rng.lognormvariate(math.log(cfg.tool_result_median), cfg.tool_result_sigma)
    return min(cfg.tool_result_max, max(1, round(x)))


def system_prompt(cfg: WorkloadConfig) -> str:
    """The run's shared system prompt: tool descriptions, ~cfg.system_tokens tokens."""
    if cfg.system_tokens == 0:
        return ""
    rng = random.Random(f"sluice-bench/system/{cfg.seed}")
    header = "You are an agent. Call one tool per step. Tools:"
    budget = max(0, cfg.system_tokens - len(header.split()))
    lines = [header]
    for k, name in enumerate(TOOL_NAMES):
        n = budget // len(TOOL_NAMES) + (1 if k < budget % len(TOOL_NAMES) else 0)
        lines.append(" ".join([name, *rng.choices(WORDS, k=max(0, n - 1))]))
    return "\n".join(lines)


def make_workflow(cfg: WorkloadConfig, index: int) -> Workflow:
    """The index-th workflow of the run seeded cfg.seed; independent of every other index."""
    if index < 0:
        raise ValueError("workflow index must be non-negative")
    rng = random.Random(f"sluice-bench/workflow/{cfg.seed}/{index}")
    num_steps = cfg.steps.draw(rng)
    task_tokens = cfg.task_tokens.draw(rng)
    task = f"Task {index}: " + _words(rng, task_tokens)
    steps = []
    for j in range(num_steps):
        last = j == num_steps - 1
        out = cfg.output_tokens.draw(rng)
        tool = rng.choice(TOOL_NAMES)
        reply = _words(rng, out)
        n_result = 0 if last else _lognormal_tokens(rng, cfg)
        latency = 0.0 if last else cfg.tool_latency_s.draw(rng)
        steps.append(Step(
            output_tokens=out,
            reply=reply,
            tool_name=tool,
            tool_result=_words(rng, n_result) if n_result else "",
            tool_result_tokens=n_result,
            tool_latency_s=latency,
        ))
    return Workflow(index=index, task=task, task_tokens=task_tokens, steps=tuple(steps))


def initial_messages(cfg: WorkloadConfig, wf: Workflow, system: Optional[str] = None) -> list[dict[str, str]]:
    system = system_prompt(cfg) if system is None else system
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": wf.task})
    return msgs


def append_step(messages: list[dict[str, str]], step: Step, reply: str) -> None:
    """After a non-last step: the assistant's reply, then the tool's result (as a user turn,
    which every chat template accepts; not every template knows the `tool` role)."""
    messages.append({"role": "assistant", "content": reply})
    messages.append({"role": "user", "content": f"[{step.tool_name} result] {step.tool_result}"})


@dataclass(frozen=True)
class RequestTarget:
    """How the bodies address the server."""

    model: str
    run_id: str
    send_workflow_fields: bool = True   # body `workflow_id` / `is_last_step` (header always sent)


def workflow_id(target: RequestTarget, index: int) -> str:
    return f"{target.run_id}-{index}"


def request_body(
    cfg: WorkloadConfig, target: RequestTarget, wf: Workflow, step_index: int, messages: list[dict[str, str]]
) -> dict[str, Any]:
    """The body of one streaming chat call; `messages` is copied."""
    step = wf.steps[step_index]
    body: dict[str, Any] = {
        "model": target.model,
        "messages": [dict(m) for m in messages],
        "max_tokens": step.output_tokens,
        "ignore_eos": True,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.send_workflow_fields:
        body["workflow_id"] = workflow_id(target, wf.index)
        if step_index == wf.num_steps - 1:
            body["is_last_step"] = True
    return body


def synthetic_bodies(cfg: WorkloadConfig, target: RequestTarget, index: int) -> list[dict[str, Any]]:
    """Every body workflow `index` sends under History.SYNTHETIC, in order."""
    wf = make_workflow(cfg, index)
    messages = initial_messages(cfg, wf)
    bodies = []
    for j, step in enumerate(wf.steps):
        bodies.append(request_body(cfg, target, wf, j, messages))
        if j < wf.num_steps - 1:
            append_step(messages, step, step.reply)
    return bodies


def approx_tokens(text: str) -> int:
    """Approximate token count of workload text (one token per word)."""
    return len(text.split())
