"""The engine loop on its own thread, with an asyncio front for the server.

The loop thread owns the LLMEngine: requests and aborts reach it through a command queue, and
outputs go back to each request's asyncio queue with `call_soon_threadsafe`. The HTTP event loop
therefore never touches scheduler state, and the model's forward pass (which releases the GIL in
torch ops) never waits on HTTP work.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional

from sluice.config import EngineConfig
from sluice.engine.errors import EngineDeadError, RequestRejected
from sluice.engine.llm_engine import LLMEngine, WorkflowInfo
from sluice.engine.openmp import release_calling_thread_pool
from sluice.engine.stats import EngineStats
from sluice.outputs import RequestOutput
from sluice.sampling_params import SamplingParams

logger = logging.getLogger("sluice.engine")

__all__ = ["AsyncEngine", "WorkflowInfo"]


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    workflow: Optional[WorkflowInfo]
    accepted: asyncio.Future
    stream: asyncio.Queue


@dataclass
class _Abort:
    request_id: str


def _deliver(deliveries: list) -> None:
    for stream, item in deliveries:
        stream.put_nowait(item)


class AsyncEngine:
    IDLE_TICK_S = 0.25   # how often an idle loop expires retentions and refreshes stats

    def __init__(self, config: EngineConfig, engine: Optional[LLMEngine] = None) -> None:
        self.config = config
        self.engine = engine or LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.grammars = self.engine.grammars   # thread-safe: the server compiles into its cache
        self.thinking_tags = self.engine.thinking_tags   # read-only
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._dead: Optional[BaseException] = None
        self._stats = self.engine.stats()
        self.step_hook = None  # test hook: callable run before every step (fault injection)

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # The loop's thread (which built the model, in `sluice serve`) gives up its OpenMP
        # workers: the engine thread's must be the only pool (sluice/engine/openmp.py).
        release_calling_thread_pool()
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10.0)

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def dead_error(self) -> Optional[BaseException]:
        return self._dead

    def stats(self) -> EngineStats:
        return self._stats

    # --- requests -----------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       workflow: Optional[WorkflowInfo] = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Raises RequestRejected/EngineDeadError before the first
        yield; closing the generator early (client gone) aborts the request."""
        if self._dead is not None:
            raise EngineDeadError(f"engine is not running: {self._dead}")
        assert self._loop is not None, "AsyncEngine.start() was not called"
        stream: asyncio.Queue = asyncio.Queue()
        accepted = self._loop.create_future()
        self._commands.put(_Add(request_id, list(prompt_token_ids), params, workflow, accepted, stream))
        finished = False
        try:
            await accepted  # raises RequestRejected
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            # Cancelled while waiting for acceptance, or closed early: the engine drops it
            # (an abort of a request that was rejected or never added is a no-op).
            if not finished:
                self._commands.put(_Abort(request_id))

    async def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    # --- the loop thread ------------------------------------------------------------------
    def _post(self, stream: asyncio.Queue, item) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(stream.put_nowait, item)

    def _resolve(self, fut: asyncio.Future, exc: Optional[BaseException]) -> None:
        def done() -> None:
            if fut.done():
                return
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(done)

    def _handle(self, cmd) -> None:
        eng = self.engine
        if isinstance(cmd, _Add):
            try:
                eng.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.workflow)
            except RequestRejected as e:
                self._resolve(cmd.accepted, e)
                return
            except Exception as e:  # noqa: BLE001 - a bad request must not kill the engine
                logger.exception("rejecting request %s", cmd.request_id)
                eng.abort_request(cmd.request_id)
                self._resolve(cmd.accepted, RequestRejected(f"invalid request: {e}"))
                return
            self._streams[cmd.request_id] = cmd.stream
            self._resolve(cmd.accepted, None)
        elif isinstance(cmd, _Abort):
            eng.abort_request(cmd.request_id)
            self._streams.pop(cmd.request_id, None)

    def _drain_commands(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self.IDLE_TICK_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while cmd is not None:
            self._handle(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                self._drain_commands(block=not eng.has_unfinished())
                if self.step_hook is not None:
                    self.step_hook()
                outputs = eng.step()
                deliveries = []
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
                    if stream is not None:
                        deliveries.append((stream, out))
                if deliveries:  # one wake-up of the event loop per step, not one per request
                    self._loop.call_soon_threadsafe(_deliver, deliveries)
                if not outputs and eng.has_unfinished() and eng.scheduler.running == []:
                    time.sleep(0.005)  # waiting work blocked on memory held elsewhere; do not spin
                if not eng.has_unfinished():
                    eng.scheduler.workflows.expire(eng.clock())
                self._stats = eng.stats()
        except BaseException as e:  # noqa: BLE001 - any failure kills the engine
            logger.exception("engine loop failed")
            self._dead = e
            self._fail_everything(e)

    def _fail_everything(self, exc: BaseException) -> None:
        err = EngineDeadError(f"engine loop failed: {type(exc).__name__}: {exc}")
        for stream in list(self._streams.values()):
            self._post(stream, err)
        self._streams.clear()
        # Reject commands that arrive from now on.
        while True:
            try:
                cmd = self._commands.get(timeout=0.1)
            except queue.Empty:
                if self._stop.is_set():
                    return
                continue
            if isinstance(cmd, _Add):
                self._resolve(cmd.accepted, err)
            elif cmd is None:
                return
