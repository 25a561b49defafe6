"""The server process after startup: draining on SIGTERM, dying with the engine, the exit status.

    SERVING --first SIGTERM/SIGINT--> DRAINING --in-flight calls done, or --shutdown-timeout--> exit 0
    SERVING or DRAINING --engine loop failed--> DEAD --in-flight calls answered--> exit 1

While DRAINING or DEAD every `/v1/*` call that was not already in flight is answered 503 (with
`Connection: close`, so a client's pool moves to another replica) and `/health` is 503, so a load
balancer stops routing here. A call already in flight runs to its end: when draining, because it
was accepted; when the engine is dead, because the engine has already failed it and its error has
to reach the client. A second signal exits at once, cutting what is still running (status 1).

uvicorn's own SIGTERM handling closes the listening socket at once (new calls are refused, not
answered) and re-raises the signal on the way out, so the process dies with -SIGTERM instead of
exiting 0; `UvicornServer` takes the signals over.
"""
from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import signal
import threading
import time
from types import FrameType
from typing import Callable, Iterator, Optional

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.scheduler import SchedulerOutput
from sluice.server.protocol import APIError
from sluice.server.serving_messages import error_body

logger = logging.getLogger(__name__)


class Phase(enum.Enum):
    SERVING = "ok"
    DRAINING = "draining"
    DEAD = "unhealthy"


class ServerLifecycle:
    """The phase of the server, the count of `/v1/*` calls in flight, and the exit status.

    `supervise()` runs as a task for the app's lifetime: it notices a drain request or a dead
    engine, waits as described in the module docstring, then calls `stop` (which tells uvicorn
    to exit). `request_drain()` is safe to call from a signal handler."""

    POLL_S = 0.05
    DEAD_LINGER_S = 1.0     # least time /health reports the dead engine before the process exits
    DEAD_GRACE_S = 5.0      # most time the failed calls get to send their errors

    def __init__(self, engine: AsyncEngine, shutdown_timeout_s: float,
                 stop: Optional[Callable[[], None]] = None) -> None:
        self.engine = engine
        self.shutdown_timeout_s = shutdown_timeout_s
        self.stop = stop or (lambda: None)
        self.phase = Phase.SERVING
        self.in_flight = 0
        self.exit_code = 0
        self._drain_requested = False

    @property
    def accepting(self) -> bool:
        return self.phase is Phase.SERVING and self.engine.is_healthy

    def request_drain(self) -> None:
        self._drain_requested = True

    @property
    def drain_requested(self) -> bool:
        return self._drain_requested

    def refusal(self) -> APIError:
        if self.phase is Phase.DRAINING:
            return APIError(503, "the server is shutting down; retry on another replica",
                            code="server_shutting_down", headers={"Connection": "close"})
        return APIError(503, "the engine is not running; the server is restarting",
                        code="engine_dead", headers={"Connection": "close"})

    async def supervise(self) -> None:
        while not self._drain_requested and self.engine.is_healthy:
            await asyncio.sleep(self.POLL_S)
        if self.engine.is_healthy:
            await self._drain()
        if not self.engine.is_healthy:
            await self._die()
        self.stop()

    async def _drain(self) -> None:
        self.phase = Phase.DRAINING
        logger.info("draining: refusing new calls, waiting up to %.1f s for %d in flight",
                    self.shutdown_timeout_s, self.in_flight)
        deadline = time.monotonic() + self.shutdown_timeout_s
        while self.in_flight and time.monotonic() < deadline and self.engine.is_healthy:
            await asyncio.sleep(self.POLL_S)
        if self.in_flight and self.engine.is_healthy:
            logger.warning("shutdown timeout: cutting %d calls still in flight", self.in_flight)
        elif self.engine.is_healthy:
            logger.info("drained: no call in flight")

    async def _die(self) -> None:
        self.phase = Phase.DEAD
        self.exit_code = 1
        logger.error("engine loop failed (%s); answering the calls in flight, then exiting with status 1",
                     self.engine.dead_error)
        start = time.monotonic()
        while time.monotonic() - start < self.DEAD_LINGER_S or (
            self.in_flight and time.monotonic() - start < self.DEAD_GRACE_S
        ):
            await asyncio.sleep(self.POLL_S)


class LifecycleMiddleware:
    """Counts `/v1/*` calls in flight; refuses new ones with 503 unless the server is SERVING."""

    def __init__(self, app: ASGIApp, lifecycle: ServerLifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        lifecycle = self.lifecycle
        if not lifecycle.accepting:
            error = lifecycle.refusal()
            response = JSONResponse(error_body(error, scope["path"]), status_code=error.status_code,
                                    headers=error.headers)
            await response(scope, receive, send)
            return
        lifecycle.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            lifecycle.in_flight -= 1


class UvicornServer(uvicorn.Server):
    """uvicorn, with SIGTERM/SIGINT handed to the lifecycle: the first one drains, a second one
    exits at once. Signals are not re-raised on exit, so the exit status is the lifecycle's."""

    def __init__(self, config: uvicorn.Config, lifecycle: ServerLifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.stop = self._stop

    def _stop(self) -> None:
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        if not self.started or self.lifecycle.drain_requested:
            if self.started:
                logger.warning("second %s: exiting now", signal.Signals(sig).name)
                self.lifecycle.exit_code = 1
                self.force_exit = True
            self.should_exit = True
            return
        logger.info("%s received", signal.Signals(sig).name)
        self.lifecycle.request_drain()


def fail_after_busy_steps(engine: AsyncEngine, steps: int) -> Callable[[], None]:
    """A test hook for `engine.step_hook` (`--fault-inject-after-steps`): the engine loop raises
    on its first step after `steps` steps that had work to do."""
    count = 0

    def hook() -> None:
        nonlocal count
        if engine.engine.has_unfinished():
            count += 1
            if count > steps:
                raise RuntimeError(f"fault injected after {steps} engine steps (--fault-inject-after-steps)")

    return hook


def stall_after_busy_steps(engine: AsyncEngine, steps: int) -> None:
    """A test hook (`--fault-inject-stall-after-steps`): after `steps` engine steps that had work to
    do, the scheduler schedules nothing, as a faulty one might, until the engine's stall guard has
    failed the requests it held (`LLMEngine._check_stall`); then it schedules as usual again."""
    llm_engine = engine.engine
    scheduler = llm_engine.scheduler
    real = scheduler.schedule
    busy = 0
    stalls_before: Optional[int] = None   # set while the fault lasts

    def schedule() -> SchedulerOutput:
        nonlocal busy, stalls_before
        if stalls_before is None:
            busy += scheduler.has_unfinished()
            if busy <= steps:
                return real()
            stalls_before = llm_engine.num_stalls
            logger.warning("fault injected: the scheduler stalls after %d busy steps "
                           "(--fault-inject-stall-after-steps)", steps)
        if llm_engine.num_stalls == stalls_before:
            return SchedulerOutput()
        scheduler.schedule = real   # once: the guard has fired
        return real()

    scheduler.schedule = schedule
