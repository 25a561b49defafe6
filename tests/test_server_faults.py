"""Faults a real `sluice serve` process must survive or handle: clients that vanish mid-stream in
numbers, overload, an engine loop that dies, a scheduler that stalls, and SIGTERM under load."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import httpx
import openai
import pytest

from server_utils import RemoteServer, metric, scrape_metrics, wait_until_idle

MAX_NUM_SEQS = 8
MAX_WAITING = 24
STORM = 24      # at most MAX_WAITING: the storm is never refused
OVERLOAD = 40   # above MAX_NUM_SEQS + MAX_WAITING: some are always refused
KV_TOKENS = 8192


def body(max_tokens: int, stream: bool, prompt: str = "Count to a thousand:") -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}


@dataclass
class CallResult:
    status: Optional[int] = None
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False           # the stream ended with [DONE]
    json: Optional[dict[str, Any]] = None
    cut: bool = False            # the client went away on purpose
    retry_after: Optional[str] = None

    @property
    def finish_reasons(self) -> list[str]:
        chunks = self.events + ([self.json] if self.json is not None else [])
        return [c["finish_reason"] for e in chunks for c in e.get("choices") or [] if c.get("finish_reason")]

    @property
    def error(self) -> Optional[dict[str, Any]]:
        found = [e["error"] for e in self.events if "error" in e]
        if self.json is not None and "error" in self.json:
            found.append(self.json["error"])
        return found[0] if found else None

    @property
    def completion_tokens(self) -> Optional[int]:
        usage = (self.json or {}).get("usage") or next((e["usage"] for e in self.events if e.get("usage")), None)
        return None if usage is None else usage["completion_tokens"]


async def call(http: httpx.AsyncClient, payload: dict[str, Any], result: CallResult,
               stop_after_events: Optional[int] = None) -> CallResult:
    """POST /v1/completions, filling `result` as the answer arrives (so a cancelled call keeps what
    it had); with `stop_after_events`, close the stream after that many events."""
    async with http.stream("POST", "/completions", json=payload) as resp:
        result.status = resp.status_code
        result.retry_after = resp.headers.get("retry-after")
        if not payload.get("stream") or resp.status_code != 200:
            result.json = json.loads(await resp.aread())
            return result
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                result.done = True
                break
            result.events.append(json.loads(data))
            if stop_after_events is not None and len(result.events) >= stop_after_events:
                result.cut = True
                break
    return result


async def run_all(coros: list) -> list:
    return await asyncio.gather(*coros)


# -- disconnect storm and overload ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    args = ["--max-model-len", "512", "--kv-cache-tokens", str(KV_TOKENS), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-waiting-requests", str(MAX_WAITING)]
    with RemoteServer(args) as remote:
        yield remote


def test_disconnect_storm_frees_every_block(server: RemoteServer) -> None:
    """STORM clients (streaming and not) close at random moments: in the queue, mid-prefill, mid-decode.
    Every request is aborted, and afterwards no block is referenced and the engine is idle."""
    rng = random.Random(7)
    before = scrape_metrics(server)
    n = STORM

    async def one(http: httpx.AsyncClient, i: int) -> CallResult:
        result = CallResult()
        stream = i % 4 != 0
        deadline = rng.uniform(0.0, 2.5)
        stop_after = rng.randint(1, 6) if stream and i % 2 else None
        try:
            async with asyncio.timeout(deadline):
                await call(http, body(400, stream, prompt=f"Request {i}: " + "tell a story " * rng.randint(1, 30)),
                           result, stop_after_events=stop_after)
        except TimeoutError:
            result.cut = True
        return result

    async def storm() -> list[CallResult]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            return await run_all([one(http, i) for i in range(n)])

    results = asyncio.run(storm())
    assert all(r.status in (None, 200) for r in results), [r.status for r in results]
    assert sum(r.cut for r in results) == n  # 400 tokens take far longer than 2.5 s

    after = wait_until_idle(server, timeout=30)
    assert metric(after, "sluice:num_requests_running") == 0 and metric(after, "sluice:num_requests_waiting") == 0
    total = metric(after, "sluice:kv_cache_blocks_total")
    unreferenced = sum(metric(after, f"sluice:kv_cache_blocks_{k}") for k in ("free", "evictable", "retained"))
    assert metric(after, "sluice:kv_cache_blocks_used") == 0 and unreferenced == total
    aborted = (metric(after, "sluice:request_success_total", finished_reason="abort")
               - metric(before, "sluice:request_success_total", finished_reason="abort"))
    finished = sum(metric(after, "sluice:request_success_total", finished_reason=r)
                   - metric(before, "sluice:request_success_total", finished_reason=r) for r in ("stop", "length"))
    # A client that left before its request reached the engine leaves nothing to abort.
    assert finished == 0 and n // 2 <= aborted <= n, (aborted, finished)

    resp = httpx.post(server.base_url + "/completions", json=body(4, stream=False), timeout=60)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4


def test_overload_refuses_with_429_and_completes_every_accepted_call(server: RemoteServer) -> None:
    """OVERLOAD calls at once against room for MAX_NUM_SEQS running + MAX_WAITING waiting: the excess gets 429 with
    Retry-After, and every accepted call (streaming or not) completes in full."""
    max_tokens = 12

    async def burst() -> list[CallResult]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as http:
            return await run_all([call(http, body(max_tokens, stream=i % 2 == 0), CallResult()) for i in range(OVERLOAD)])

    results = asyncio.run(burst())
    accepted = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status == 429]
    assert len(accepted) + len(refused) == len(results), [r.status for r in results]
    assert refused and len(accepted) >= MAX_NUM_SEQS
    for r in refused:
        assert r.error is not None and r.error["code"] == "rate_limit_exceeded"
        assert r.retry_after is not None and int(r.retry_after) >= 1
    for r in accepted:
        assert r.error is None and r.completion_tokens == max_tokens
        assert r.finish_reasons == ["length"]
        assert r.done or not r.events
    wait_until_idle(server, timeout=30)


# -- engine failure ------------------------------------------------------------------------------


def test_engine_failure_fails_calls_then_exits_nonzero() -> None:
    """The engine loop raises mid-generation: streams get an error event and [DONE], non-streaming
    calls a 503, /health turns 503, new calls are refused, and the process exits with status 1."""
    args = ["--max-model-len", "512", "--kv-cache-tokens", "4096", "--fault-inject-after-steps", "40"]
    with RemoteServer(args) as remote:
        async def scenario() -> tuple[list[CallResult], int, Optional[int]]:
            async with httpx.AsyncClient(base_url=remote.base_url, timeout=60) as http:
                results = await run_all([call(http, body(400, stream=i % 2 == 0), CallResult()) for i in range(4)])
                health = (await http.get(remote.url + "/health")).status_code
                try:
                    late: Optional[int] = (await http.post("/completions", json=body(4, False))).status_code
                except httpx.TransportError:
                    late = None  # already gone
                return results, health, late

        started = time.monotonic()
        results, health, late = asyncio.run(scenario())
        for r in results:
            assert r.error is not None and r.error["code"] == "engine_dead", r
            if r.json is not None:
                assert r.status == 503
            else:
                assert r.status == 200 and r.done and not r.finish_reasons
        assert health == 503
        assert late in (503, None)
        assert remote.proc is not None
        try:
            code = remote.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"server did not exit after its engine failed:\n{remote.log()}")
        assert code == 1, remote.log()
        assert time.monotonic() - started < 60
        assert "fault injected" in remote.log()


def test_a_stalled_scheduler_fails_its_calls_and_the_server_goes_on() -> None:
    """The scheduler stops scheduling mid-generation (a fault injected after 30 busy steps): after
    --stall-timeout the calls it held end with a 500 `generation_error`, or an error event in their
    stream, through the official client; /metrics counts the stall, no KV block stays held, and the
    server answers the next call as it did before the fault."""
    args = ["--max-model-len", "512", "--kv-cache-tokens", "4096", "--stall-timeout", "2",
            "--fault-inject-stall-after-steps", "30"]
    with RemoteServer(args) as remote:
        client = openai.OpenAI(base_url=remote.base_url, api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        long_call = {"model": model, "prompt": "Count to a thousand:", "max_tokens": 400,
                     "extra_body": {"ignore_eos": True}}

        def greedy() -> str:
            return client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                             temperature=0).choices[0].text

        def plain() -> openai.APIStatusError:
            with pytest.raises(openai.APIStatusError) as failed:
                client.completions.create(**long_call)
            return failed.value

        def streamed() -> tuple[openai.APIError, int]:
            chunks = 0
            with pytest.raises(openai.APIError) as failed:
                for _ in client.completions.create(**long_call, stream=True):
                    chunks += 1
            return failed.value, chunks

        before = greedy()   # 8 tokens: well under 30 busy steps
        started = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            plain_call, streamed_call = pool.submit(plain), pool.submit(streamed)
            error = plain_call.result(timeout=60)
            stream_error, chunks = streamed_call.result(timeout=60)
        assert time.monotonic() - started < 30
        assert error.status_code == 500 and error.code == "generation_error", error
        assert "could not schedule" in error.message
        assert stream_error.code == "generation_error" and "could not schedule" in stream_error.message
        assert chunks < 400   # it ended with the error, not with its tokens

        samples = wait_until_idle(remote)
        assert metric(samples, "sluice:engine_stalls_total") == 1
        assert greedy() == before
        assert "fault injected: the scheduler stalls" in remote.log()


# -- SIGTERM -------------------------------------------------------------------------------------


def test_sigterm_drains_in_flight_calls_then_exits_zero() -> None:
    """SIGTERM under load: calls in flight run to completion, new ones get 503 while draining,
    /health is 503, and the process exits 0."""
    max_tokens = 40
    with RemoteServer(["--max-model-len", "512", "--kv-cache-tokens", "4096", "--shutdown-timeout", "120"]) as remote:
        async def scenario() -> tuple[list[CallResult], httpx.Response, int]:
            async with httpx.AsyncClient(base_url=remote.base_url, timeout=120) as http:
                calls = [asyncio.create_task(call(http, body(max_tokens, stream=i % 3 != 0), CallResult()))
                         for i in range(6)]
                deadline = time.monotonic() + 60
                while True:
                    load = (await http.get(remote.url + "/load")).json()
                    if load["running"] + load["waiting"] == len(calls):
                        break
                    assert time.monotonic() < deadline, load
                    await asyncio.sleep(0.02)
                remote.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                async with httpx.AsyncClient(base_url=remote.base_url, timeout=30) as fresh:
                    refused = await fresh.post("/completions", json=body(4, stream=False))
                    health = (await fresh.get(remote.url + "/health")).status_code
                return await asyncio.gather(*calls), refused, health

        results, refused, health = asyncio.run(scenario())
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        assert health == 503
        for r in results:
            assert r.status == 200 and r.error is None, r
            assert r.completion_tokens == max_tokens and r.finish_reasons == ["length"]
            assert r.done or r.json is not None
        assert remote.proc is not None
        assert remote.proc.wait(timeout=30) == 0, remote.log()
        assert "drained" in remote.log()


def test_sigterm_cuts_calls_past_the_shutdown_timeout() -> None:
    """A call longer than --shutdown-timeout is cut when it expires; the exit status is still 0."""
    with RemoteServer(["--max-model-len", "2048", "--kv-cache-tokens", "4096", "--shutdown-timeout", "1"]) as remote:
        async def scenario() -> CallResult:
            async with httpx.AsyncClient(base_url=remote.base_url, timeout=60) as http:
                result = CallResult()
                task = asyncio.create_task(call(http, body(2000, stream=True), result))
                while not result.events:
                    await asyncio.sleep(0.02)
                remote.send_signal(signal.SIGTERM)
                started = time.monotonic()
                try:
                    await task
                except httpx.TransportError:
                    pass
                assert time.monotonic() - started < 15
                return result

        result = asyncio.run(scenario())
        assert not result.done and not result.finish_reasons
        assert remote.proc is not None
        assert remote.proc.wait(timeout=30) == 0, remote.log()
        assert "shutdown timeout" in remote.log()
