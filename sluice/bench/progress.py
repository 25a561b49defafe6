"""The live progress line: workflows done, output tokens/s, errors."""
from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter, deque
from typing import Optional, TextIO

from sluice.bench.client import CallRecord
from sluice.bench.metrics import error_kind


class Progress:
    """Counters the runner updates and `display()` prints. Tokens here are text chunks as they
    stream (the exact count comes from usage at each call's end)."""

    def __init__(self) -> None:
        self.admitted = 0
        self.completed = 0
        self.failed = 0
        self.in_flight = 0
        self.calls = 0
        self.tokens = 0
        self.errors: Counter[str] = Counter()

    def add_tokens(self, n: int) -> None:
        self.tokens += n

    def call_done(self, call: CallRecord) -> None:
        self.calls += 1
        if not call.ok:
            self.errors[error_kind(call)] += 1

    def line(self, elapsed: float, rate: float, target: str) -> str:
        errs = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
        return (
            f"[{elapsed:7.1f}s] workflows: {self.completed} done, {self.failed} failed, "
            f"{self.admitted - self.completed - self.failed} running{target} | "
            f"calls {self.calls} ({self.in_flight} in flight) | "
            f"{rate:7.1f} tok/s | errors: {errs}"
        )

    async def display(
        self, t0: float, *, target: str = "", stream: TextIO = sys.stderr, every_s: Optional[float] = None
    ) -> None:
        """Print until cancelled: a self-overwriting line on a terminal (every second), a plain
        line every 10 s otherwise. The rate is over the last 5 s."""
        tty = stream.isatty()
        every = every_s if every_s is not None else (1.0 if tty else 10.0)
        history: deque[tuple[float, int]] = deque(maxlen=int(5 / min(every, 5)) + 1)
        try:
            while True:
                await asyncio.sleep(every)
                now = time.perf_counter() - t0
                history.append((now, self.tokens))
                (t_a, n_a), (t_b, n_b) = history[0], history[-1]
                rate = (n_b - n_a) / (t_b - t_a) if t_b > t_a else self.tokens / max(now, 1e-9)
                text = self.line(now, rate, target)
                stream.write(("\r" + text + "\x1b[K") if tty else text + "\n")
                stream.flush()
        except asyncio.CancelledError:
            if tty:
                stream.write("\n")
                stream.flush()
            raise
