"""How many workflows `GET /load` lets in flight: a fixed bound, or one the engine finds itself.

Under a steady stream of agent workflows, a workflow admitted beyond what keeps the machine busy
adds little throughput: its calls mostly queue, and every call in flight waits longer for its
first token and for each next one (docs/benchmarks.md, sessions 32-33: on the 2-core AVX2 host,
8 workflows in flight instead of 23-30 cost 0-8% of the throughput and gave 4-5x the
per-request generation speed and a 1.5-1.7x lower TTFT p50). How many is enough depends on the machine and the
model, so `max_active_workflows="auto"` lets the engine find it.

The signal is the engine's *overhead*: the share of the wall clock spent on what a step costs
regardless of what it carries, plus idle time. A step costs a fixed part (~19 ms for SmolLM2-135M
on that host, above all reading the weights through the cores once) plus a part that grows
with its rows, prompt tokens and the K/V they attend to. Fewer workflows mean smaller steps and
more of them for the same tokens, so more fixed cost per token, and more idle time while every
admitted workflow waits on a tool; that is what bounding the workflows costs in throughput
(session 33's replay: the extra steps times the fixed cost account for 44 of the 60 s that 4
workflows in flight took longer than ~23, and 17 of the 21 s that 8 did). A machine at
overhead O can give at most 1/(1-O) times its throughput by admitting more. So the controller raises the bound while
the overhead is above `OVERHEAD_HIGH` and lowers it while it is below `OVERHEAD_LOW`: the
fewest workflows that keep the fixed cost and idling between the two. The band is the trade
between throughput and latency, a server flag (`--auto-overhead-band LOW,HIGH`, default
0.06,0.09): a lower band keeps more workflows in flight, for throughput. On the Zen 4 host the
sustained pairs against vLLM (docs/benchmarks.md, sessions 39-42) met both 2x targets on average
with 12-13 workflows in flight (throughput 2.01x, TTFT p50 2.16x lower, means of five pairs), missed
throughput at 8-11 (1.96x) and TTFT p50 at 14-20 (1.93x); this band held 11.4-15.0 there
(the kept fixed cost 6.3-8.6 ms).

The fixed part is not configured but measured: the intercept of a least-squares fit of each
step's wall time on its shape over the last 512 steps. That intercept is an extrapolation to a
step of no rows, only as good as the window's small steps: a step's real cost is not quite
linear in its rows (a GEMM runs faster per row with more rows), so a window of large steps reads
it too high. Session 40 found the feedback this makes: more workflows, bigger steps, a higher
fixed cost, a higher overhead, more workflows (the bound wandered to 20-27). Session 41's step
traces at fixed bounds 4-24 on the Zen 4 host (docs/measured/s41/) put numbers on it: each
window's own fit gives 7-8 ms at bounds 4-8, 9-10 at 12 and 16 at 16-24. So the model keeps the
fit of the window with the smallest steps seen (by the 75th percentile of its decode rows, within
`REF_SLACK` of the smallest) and, for a window of larger steps, gives that fit's intercept times
the median ratio of the window's step times to what the kept fit predicts for them (over the
steps no larger than most of the kept window's, prefill-only steps among them). Replayed
through those traces it reads 7.2-7.9 ms (medians) at every bound (the ratio 0.97-1.04: the kept
fit prices the big steps well; only its intercept was out of their reach). The fixed cost
follows the machine's speed, not the size of the steps. A fit is kept only from a whole window,
and the bound holds at its start until one was seen: a fit of the first few seconds is noisy
(one pair kept 5.3 ms from 269 steps and sat at 8 workflows). Nor is one whole window's enough:
the kept fit is the one of median intercept among the latest nine small windows' (session 52: one
server of four kept a window's 3.9 ms where the windows before it read 8.0-8.8 and sat at 7-10
workflows instead of 12-16). Known weakness: whole windows of
small steps still read 6.4-8.6 ms, and the bound follows the kept value (7.2 ms: 10.6 workflows
in flight at the band 0.08,0.12, 9.7 ms: 11.4; sessions 41-42 kept 6.3-8.6 ms). About one
workflow per millisecond; near 12 in flight a workflow is worth 0.5-1% of the throughput and
~3% of TTFT p50 (session 42: 12.4 in flight on 6.8 ms kept, 15.0 on 8.6 ms, TTFT p50 2.09x and
1.95x lower than vLLM's), so the spread costs latency more than throughput.

The band alone does not stop on every machine. Where the fixed cost is a large share of every
step at any number in flight (weights streamed through AMX tiles, sessions 44-49: 0.16-0.23 at
16-32 workflows), the overhead never enters the band and the bound climbs to the maximum, each
workflow lengthening every step, and with it every waiting call's wait for its first token, for
little throughput (session 49 on that host: 16 -> 24 -> 32 in flight gave +6% and +0%, TTFT
p50 +24% and +20%). So a second signal caps the bound: the mean step against what the mean call's
own prompt costs (the prompt tokens and attention of the prompts the period completed, per
prompt, priced by the step-cost fit). A call's prompt waits for the steps before it; a step
longer than the call's own prompt compute makes that wait the larger part of its time to first
token. The bound rises only while the ratio (a moving average) is under the cap's low end and
falls while it is over its high end, whatever the band says, as long as the overhead is under
0.3 (`CAP_OVERHEAD`: above it more workflows could still give 1.4x the throughput, and short
prompts make any step long against them; `--auto-step-ratio LOW,HIGH|none`, default 0.8,1.0).
Priced so on the session 41 and 49 step traces, it reads 0.46 at 12 workflows and 0.65 at 16 on
the Zen 4 host, where the band binds first, and 0.94 at 16 and 1.28 at 24 on the AMX host, where
the band never does (session 50: the cap holds it at 14-17 there).

The bound follows a moving average of the periods' overheads, moves by one (more when far above
the band) at most once per `PERIOD_S`, and only while it binds: it rises only while as many
workflows as it allows are in flight, and falls only while no more than it allows are (lowering
it takes effect as workflows finish, so it must not keep falling meanwhile).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Optional

import numpy as np

logger = logging.getLogger("sluice.engine")


@dataclass(frozen=True)
class StepShape:
    """What a step carried, the regressors of its cost."""
    rows: int             # decode and draft rows
    prompt_tokens: int    # prefill tokens
    prompt_attn: float    # prefill tokens x the context they attend to, in 1k tokens
    decode_ctx: float     # decodes' context, in 1k tokens
    prompts_done: int = 0  # prompts this step completed (calls whose first token it sampled); not a regressor

    def features(self) -> tuple[float, ...]:
        return (1.0, float(self.rows), float(self.prompt_tokens), self.prompt_attn, self.decode_ctx)


class StepCostModel:
    """Least squares of step time on `StepShape` over the last `window` steps, and the fixed cost
    it implies (see the module docstring)."""

    MIN_STEPS = 32
    ROWS_Q = 75          # percentile of a window's decode rows that says how small its steps are
    REF_SLACK = 1.25     # a window this much larger than the smallest seen still counts as small
    # Steps a fit needs to be kept as the reference: a whole window. Session 41's second pair
    # kept a fit of 269 steps from the first 10 s at 5.3 ms, where whole windows of small steps
    # read 6.4-8.6 ms in the s41 traces, and the bound sat at 8 instead of 10-11.
    REF_MIN_STEPS = 512
    # Fits of small windows the kept one is chosen from (the one of median intercept among those
    # still small enough), the latest ones. One window's intercept is a noisy extrapolation: in
    # session 52 one of four servers kept a 3.9 ms fit where the windows before it read 8.0-8.8 ms,
    # and held 7-10 workflows in flight for the rest of the run instead of 12-16.
    REF_CANDIDATES = 9

    def __init__(self, window: int = 512) -> None:
        self.window = window
        self._x: deque[tuple[float, ...]] = deque(maxlen=window)
        self._y: deque[float] = deque(maxlen=window)
        self._ref: Optional[np.ndarray] = None   # coefficients of the kept fit, over all features
        self._ref_rows = float("inf")            # the smallest window's decode rows at the ROWS_Q-th percentile
        self._ref_reach = 0.0                    # the kept fit's window's at the 90th: the steps it predicts from data
        # (decode rows at ROWS_Q, at the 90th percentile, coefficients) of the latest small windows' fits
        self._candidates: deque[tuple[float, float, np.ndarray]] = deque(maxlen=self.REF_CANDIDATES)
        # How the last `fixed_cost` was found: None from the window's own fit, else the ratio
        # the kept fit was scaled by.
        self.scale: Optional[float] = None
        # The coefficients behind the last `fixed_cost` (the kept fit times `scale`, or the
        # window's own fit), for `prompt_cost`.
        self.coef: Optional[np.ndarray] = None

    def observe(self, shape: StepShape, seconds: float) -> None:
        self._x.append(shape.features())
        self._y.append(seconds)

    def __len__(self) -> int:
        return len(self._y)

    def fixed_cost(self) -> Optional[float]:
        """A step's fixed cost in seconds; None until enough steps were seen, or when they do not
        determine it (all of one shape, and no fit kept) or it comes out outside (0, the median
        step)."""
        self.scale, self.coef = None, None
        if len(self._y) < self.MIN_STEPS:
            return None
        x, y = np.asarray(self._x), np.asarray(self._y)
        median = float(np.median(y))
        coef = self._fit(x, y)
        decode_rows = x[x[:, 1] > 0, 1]
        rows = float(np.percentile(decode_rows, self.ROWS_Q)) if len(decode_rows) else float("inf")
        own = float(coef[0]) if coef is not None and 0.0 < coef[0] < median else None
        if own is not None and rows <= self.REF_SLACK * self._ref_rows:
            # Steps about as small as any seen: this window's intercept is as near as it gets.
            # Kept as the reference when it is a fit over enough steps, decodes among them, that
            # priced every feature. The size to match only ever falls, so that a bound climbing a
            # workflow at a time cannot carry the reference up with it.
            if len(y) >= min(self.REF_MIN_STEPS, self.window) and len(decode_rows) >= self.MIN_STEPS \
                    and np.all(np.ptp(x[:, 1:], axis=0) > 0):
                self._keep(rows, float(np.percentile(decode_rows, 90)), coef)
            self.coef = coef
            return own
        if self._ref is None:
            self.coef = coef if own is not None else None
            return own                   # nothing kept yet: the window's own fit, if it has one
        predicted = x @ self._ref
        if not np.all(predicted > 0):
            return None
        # Scaled on the steps the kept fit saw the like of (prefill-only steps are among them at
        # any bound), so that a slope it priced from small steps alone does not leak into the
        # scale; on all steps when too few are.
        near = x[:, 1] <= self._ref_reach
        ratio = y / predicted
        self.scale = float(np.median(ratio[near] if near.sum() >= self.MIN_STEPS // 2 else ratio))
        fixed = float(self._ref[0]) * self.scale
        if not 0.0 < fixed < median:
            return None
        self.coef = self._ref * self.scale
        return fixed

    def _keep(self, rows: float, reach: float, coef: np.ndarray) -> None:
        """A small window's fit joins the candidates; the kept fit becomes the one of median
        intercept among those whose windows are still within REF_SLACK of the smallest seen (the
        upper one of the middle two when they are even: a fixed cost read low is the failure seen)."""
        self._candidates.append((rows, reach, coef))
        self._ref_rows = min(rows, self._ref_rows)
        small = sorted((c for c in self._candidates if c[0] <= self.REF_SLACK * self._ref_rows),
                       key=lambda c: float(c[2][0]))
        _, self._ref_reach, self._ref = small[len(small) // 2]

    def prompt_cost(self, tokens: float, attn: float) -> Optional[float]:
        """Seconds the last fit (`fixed_cost`'s) gives `tokens` prompt tokens attending to `attn`
        (tokens x context, in 1k tokens) beside a step's other work; None without a fit or when
        it prices prompts at nothing."""
        if self.coef is None:
            return None
        cost = float(self.coef[2]) * tokens + float(self.coef[3]) * attn
        return cost if cost > 0.0 else None

    @staticmethod
    def _fit(x: np.ndarray, y: np.ndarray) -> Optional[np.ndarray]:
        """The least-squares coefficients (0 for a feature left out), or None when the steps do
        not determine the intercept."""
        coef, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
        if rank == x.shape[1]:
            return coef
        # Columns that never vary (no prefill in the window, say) leave the intercept free; fit
        # without them.
        keep = [0] + [j for j in range(1, x.shape[1]) if np.ptp(x[:, j]) > 0]
        if len(keep) == 1:
            return None
        sub, _, rank, _ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if rank < len(keep):
            return None
        coef = np.zeros(x.shape[1])
        coef[keep] = sub
        return coef


class WorkflowLimit:
    """The bound on workflows in flight: `fixed`, or found by the controller above (`auto`)."""

    OVERHEAD_HIGH = 0.09
    OVERHEAD_LOW = 0.06
    PERIOD_S = 5.0
    SMOOTHING = 0.3      # weight of the newest period in the overhead the bound follows
    INITIAL = 4
    WARMUP_STEPS = StepCostModel.REF_MIN_STEPS
    MINIMUM = 2

    MIN_PROMPTS = 4      # prompts a period must complete for its step ratio to count
    FAR_RATIO = 0.75     # a step ratio under this share of the cap's low end is far below it
    # The cap holds only while the overhead is under this: above it, more workflows could still
    # give 1/(1-O) >= 1.4x the throughput, more than the cap's latency is worth (short prompts
    # make any step long against them: the cap alone would pin the bound near its minimum).
    CAP_OVERHEAD = 0.3

    def __init__(self, fixed: Optional[int] = None, auto: bool = False, maximum: int = 64,
                 initial: Optional[int] = None, band: Optional[tuple[float, float]] = None,
                 step_ratio: Optional[tuple[float, float]] = None) -> None:
        assert not (auto and fixed is not None), "a bound is either fixed or automatic"
        self.auto = auto
        # (low, high): the overhead band the bound steers into (`--auto-overhead-band`).
        self.overhead_low, self.overhead_high = band if band is not None else (self.OVERHEAD_LOW, self.OVERHEAD_HIGH)
        assert 0.0 < self.overhead_low < self.overhead_high < 1.0, "the band must be 0 < low < high < 1"
        # (low, high): the cap on a step's length against a call's own prompt (`--auto-step-ratio`;
        # None: no cap). The server's default is SchedulerConfig's.
        self.step_ratio = step_ratio
        assert step_ratio is None or 0.0 < step_ratio[0] < step_ratio[1], "the step ratio must be 0 < low < high"
        self.last_step_ratio: Optional[float] = None
        self.maximum = max(1, maximum)
        start = initial if initial is not None else self.INITIAL
        self.value: Optional[int] = fixed if not auto else max(self.MINIMUM, min(self.maximum, start))
        self.cost = StepCostModel()
        self._period_start: Optional[float] = None
        self._last_end: Optional[float] = None
        self._reset_period(None, 0)
        self.last_overhead: Optional[float] = None
        self.adjustments = 0

    def room(self, active: int, idle: bool) -> Optional[int]:
        """New workflows the bound lets in with `active` in flight (None: no bound). `idle`: the
        engine has nothing running or waiting (every workflow in flight waits on a tool); then
        an `auto` bound lets one more in, since the engine would otherwise idle and a workflow
        admitted now costs the others nothing yet (work-conserving). A fixed bound is the
        operator's and holds."""
        if self.value is None:
            return None
        room = self.value - active
        return 1 if room <= 0 and idle and self.auto else room

    def observe_step(self, start: float, end: float, shape: StepShape, active: int) -> None:
        """A step ran from `start` to `end` (seconds, the engine's clock) carrying `shape`, and
        `active` workflows are in flight after it. Adjusts the bound when a period is over."""
        if not self.auto:
            return
        self.cost.observe(shape, end - start)
        if self._period_start is None or start - self._last_end > self.PERIOD_S:
            # The first step, or the first after a whole period without any: nothing was offered
            # then, which is no overhead of the bound's (a tool call takes seconds, not periods).
            self._reset_period(start, 0)
        self._last_end = end
        self._busy += end - start
        self._steps += 1
        self._peak_active = max(self._peak_active, active)
        self._prompt_tokens += shape.prompt_tokens
        self._prompt_attn += shape.prompt_attn
        self._prompts_done += shape.prompts_done
        if end - self._period_start >= self.PERIOD_S:
            self._close_period(end, active)

    def _reset_period(self, start: Optional[float], peak_active: int) -> None:
        self._period_start = start
        self._busy = 0.0        # seconds of steps this period
        self._steps = 0
        self._peak_active = peak_active   # most workflows in flight at a step's end this period
        self._prompt_tokens, self._prompt_attn, self._prompts_done = 0, 0.0, 0

    def _close_period(self, now: float, active: int) -> None:
        wall = now - self._period_start
        # The bound holds at its start until the model has seen WARMUP_STEPS steps, the small
        # ones the fixed cost is kept from (~20-40 s of traffic at the initial bound).
        fixed = self.cost.fixed_cost() if len(self.cost) >= min(self.WARMUP_STEPS, self.cost.window) else None
        if fixed is not None and wall > 0:
            idle = max(0.0, wall - self._busy)
            period = min(1.0, (self._steps * fixed + idle) / wall)
            overhead = period if self.last_overhead is None else \
                self.SMOOTHING * period + (1 - self.SMOOTHING) * self.last_overhead
            self.last_overhead = overhead
            self._observe_step_ratio()
            value = self.value
            if self._adjust(overhead, peak_active=self._peak_active, active=active):
                # What the decision saw, so a bound that climbs or falls can be read back from
                # the server's log: the fit's fixed cost, this period's steps and idle share.
                scale = self.cost.scale
                ratio = self.last_step_ratio
                logger.info("workflow bound %d -> %d: overhead %.3f (band %.2f-%.2f); this period "
                            "%.3f = %d steps x %.2f ms fixed%s + %.1f%% idle over %.2f s; "
                            "%d in flight (peak %d)%s", value, self.value, overhead, self.overhead_low,
                            self.overhead_high, period, self._steps, fixed * 1e3,
                            "" if scale is None else f" (kept fit x {scale:.2f})",
                            100.0 * idle / wall, wall, active, self._peak_active,
                            "" if ratio is None else f"; step {ratio:.2f} of a call's prompt "
                            f"(cap {self.step_ratio[0]:.2f}-{self.step_ratio[1]:.2f})")
        self._reset_period(now, active)

    def _observe_step_ratio(self) -> None:
        """The period's mean step against the mean prompt it completed, priced by the step-cost
        fit (the cap's signal; see the module docstring), into its moving average."""
        if self.step_ratio is None or self._prompts_done < self.MIN_PROMPTS or not self._steps:
            return
        call = self.cost.prompt_cost(self._prompt_tokens / self._prompts_done,
                                     self._prompt_attn / self._prompts_done)
        if call is None:
            return
        ratio = self._busy / self._steps / call
        self.last_step_ratio = ratio if self.last_step_ratio is None else \
            self.SMOOTHING * ratio + (1 - self.SMOOTHING) * self.last_step_ratio

    def _adjust(self, overhead: float, peak_active: int, active: int) -> bool:
        """Moves the bound by the rules above; True when it moved."""
        value = self.value
        # None without a cap, before its first reading, or while the overhead is over CAP_OVERHEAD
        ratio = self.last_step_ratio if overhead < self.CAP_OVERHEAD else None
        if ratio is not None and ratio > self.step_ratio[1] and active <= value:
            # Steps outlast what a call's own prompt costs: fewer workflows in flight.
            self.value = max(self.MINIMUM, value - 1)
        elif overhead > self.overhead_high and peak_active >= value and (ratio is None or ratio < self.step_ratio[0]):
            # Far below both: a quarter more at once, so that the climb from INITIAL takes
            # periods, not minutes (a period is 5 s).
            far = overhead > 2 * self.overhead_high and (ratio is None or ratio < self.FAR_RATIO * self.step_ratio[0])
            self.value = min(self.maximum, value + (max(1, value // 4) if far else 1))
        elif overhead < self.overhead_low and active <= value:
            self.value = max(self.MINIMUM, value - 1)
        if self.value == value:
            return False
        self.adjustments += 1
        return True
