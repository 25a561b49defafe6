"""One streaming `/v1/chat/completions` call, timed chunk by chunk, with its errors classified."""
from __future__ import annotations

import asyncio
import enum
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

import httpx


class CallStatus(str, enum.Enum):
    OK = "ok"
    TIMEOUT = "timeout"            # the per-call deadline passed (or an httpx timeout fired)
    HTTP = "http"                  # a non-200 status; see CallRecord.http_status
    CONNECTION = "connection"      # connect/read failures, and streams cut before `[DONE]`
    STREAM_ERROR = "stream_error"  # the server sent an error object inside a 200 stream
    PROTOCOL = "protocol"          # a chunk that is not the JSON an OpenAI stream carries


@dataclass
class CallRecord:
    """One chat call. Times are `time.perf_counter()` seconds relative to the run's start."""

    workflow_index: int
    step_index: int
    max_tokens: int
    send_time: float                       # just before the request is written
    first_token_time: Optional[float] = None   # first chunk carrying generated text
    last_token_time: Optional[float] = None    # last chunk carrying generated text
    end_time: Optional[float] = None           # stream closed (or the call failed)
    num_chunks: int = 0                    # chunks carrying generated text
    output_tokens: int = 0                 # usage.completion_tokens, else num_chunks
    output_tokens_from_usage: bool = False
    prompt_tokens: Optional[int] = None    # usage.prompt_tokens, when reported
    cached_tokens: Optional[int] = None    # usage.prompt_tokens_details.cached_tokens, when reported
    finish_reason: Optional[str] = None
    status: CallStatus = CallStatus.OK
    http_status: Optional[int] = None
    error: Optional[str] = None
    chunk_times: list[float] = field(default_factory=list)  # one per text chunk
    text: str = field(default="", repr=False)               # the streamed reply (not serialised)

    @property
    def ok(self) -> bool:
        return self.status is CallStatus.OK

    @property
    def ttft(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.send_time

    @property
    def latency(self) -> Optional[float]:
        return None if self.end_time is None else self.end_time - self.send_time

    @property
    def generation_speed(self) -> Optional[float]:
        """(output tokens - 1) / (last token time - first token time): tokens/s after the first."""
        if self.first_token_time is None or self.last_token_time is None or self.output_tokens < 2:
            return None
        span = self.last_token_time - self.first_token_time
        return (self.output_tokens - 1) / span if span > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "workflow_index": self.workflow_index,
            "step_index": self.step_index,
            "max_tokens": self.max_tokens,
            "send_time": _r(self.send_time),
            "first_token_time": _r(self.first_token_time),
            "last_token_time": _r(self.last_token_time),
            "end_time": _r(self.end_time),
            "num_chunks": self.num_chunks,
            "output_tokens": self.output_tokens,
            "output_tokens_from_usage": self.output_tokens_from_usage,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "status": self.status.value,
            "http_status": self.http_status,
            "error": self.error,
            "chunk_times": [_r(t) for t in self.chunk_times],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "CallRecord":
        fields = dict(d)
        fields["status"] = CallStatus(fields["status"])
        return cls(**fields)


def _r(t: Optional[float]) -> Optional[float]:
    return None if t is None else round(t, 5)


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI-compatible server. `base_url` ends in `/v1` (added when the URL has no path)."""

    base_url: str
    api_key: Optional[str] = None

    @staticmethod
    def from_url(url: str, api_key: Optional[str] = None) -> "Endpoint":
        url = url.rstrip("/")
        if httpx.URL(url).path in ("", "/"):
            url += "/v1"
        return Endpoint(url, api_key)

    @property
    def chat_url(self) -> str:
        return self.base_url + "/chat/completions"

    @property
    def root_url(self) -> str:
        """The server root (base_url without a trailing `/v1`), where `/health` and `/load` live."""
        return self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def make_http_client(concurrency: int) -> httpx.AsyncClient:
    """One pooled client per run. No proxies from the environment: they would be measured too."""
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30.0), trust_env=False)


_TEXT_KEYS = ("content", "reasoning_content", "reasoning")


async def stream_chat(
    http: httpx.AsyncClient,
    endpoint: Endpoint,
    body: dict[str, Any],
    record: CallRecord,
    *,
    t0: float,
    timeout_s: float,
    headers: Optional[dict[str, str]] = None,
    on_chunk: Optional[Callable[[int], None]] = None,
) -> CallRecord:
    """Send `body`, fill `record` as the stream arrives, and return it. Never raises for a
    failed call: the failure is classified in `record.status`. `on_chunk(n)` is told of each
    text chunk (for the live display)."""
    pieces: list[str] = []
    record.send_time = time.perf_counter() - t0
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(http, endpoint, body, record, pieces, t0, {**endpoint.headers(), **(headers or {})}, on_chunk)
    except TimeoutError:
        record.status, record.error = CallStatus.TIMEOUT, f"no complete response within {timeout_s:g} s"
    except httpx.TimeoutException as e:
        record.status, record.error = CallStatus.TIMEOUT, f"{type(e).__name__}: {e}"
    except httpx.TransportError as e:
        record.status, record.error = CallStatus.CONNECTION, f"{type(e).__name__}: {e}"
    except _CallFailed as e:
        record.status, record.error = e.status, e.message
    record.end_time = time.perf_counter() - t0
    record.text = "".join(pieces)
    if not record.output_tokens_from_usage:
        record.output_tokens = record.num_chunks
    return record


class _CallFailed(Exception):
    def __init__(self, status: CallStatus, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


async def _stream(
    http: httpx.AsyncClient,
    endpoint: Endpoint,
    body: dict[str, Any],
    record: CallRecord,
    pieces: list[str],
    t0: float,
    headers: dict[str, str],
    on_chunk: Optional[Callable[[int], None]],
) -> None:
    async with http.stream("POST", endpoint.chat_url, json=body, headers=headers) as resp:
        record.http_status = resp.status_code
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")[:500]
            raise _CallFailed(CallStatus.HTTP, f"HTTP {resp.status_code}: {detail}")
        done = False
        async for line in sse_lines(resp):
            now = time.perf_counter() - t0
            if not line.startswith("data:"):
                continue                          # blank separators, comments, `event:` lines
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                raise _CallFailed(CallStatus.PROTOCOL, f"not JSON: {data[:200]}") from None
            if not isinstance(chunk, dict):
                raise _CallFailed(CallStatus.PROTOCOL, f"not a JSON object: {data[:200]}")
            if "error" in chunk:
                raise _CallFailed(CallStatus.STREAM_ERROR, json.dumps(chunk["error"])[:500])
            _take_chunk(chunk, record, pieces, now, on_chunk)
        if not done:
            raise _CallFailed(CallStatus.CONNECTION, "stream ended before [DONE]")


_LINE_END = re.compile(rb"\r\n|\r|\n")


async def sse_lines(resp: httpx.Response) -> AsyncIterator[str]:
    """The lines of a server-sent-event stream, ended only where the SSE spec ends a line (CRLF,
    LF, CR). httpx's `aiter_lines` splits like `str.splitlines`, at U+0085/U+2028/U+2029 too, which
    a server's JSON may carry raw inside a string (pydantic writes them so): that would cut one
    event in two and count a good call as a protocol failure."""
    pending = b""
    async for data in resp.aiter_bytes():
        pending += data
        cr = pending.endswith(b"\r")             # may be the first half of a CRLF: keep it
        *lines, rest = _LINE_END.split(pending[:-1] if cr else pending)
        pending = rest + b"\r" if cr else rest
        for line in lines:
            yield line.decode("utf-8", errors="replace")
    pending = pending.rstrip(b"\r")
    if pending:
        yield pending.decode("utf-8", errors="replace")


def _take_chunk(
    chunk: dict[str, Any],
    record: CallRecord,
    pieces: list[str],
    now: float,
    on_chunk: Optional[Callable[[int], None]],
) -> None:
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        text = "".join(delta.get(k) or "" for k in _TEXT_KEYS)
        if text:
            if record.first_token_time is None:
                record.first_token_time = now
            record.last_token_time = now
            record.num_chunks += 1
            record.chunk_times.append(now)
            pieces.append(text)
            if on_chunk is not None:
                on_chunk(1)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        if isinstance(usage.get("completion_tokens"), int):
            record.output_tokens = usage["completion_tokens"]
            record.output_tokens_from_usage = True
        if isinstance(usage.get("prompt_tokens"), int):
            record.prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            record.cached_tokens = details["cached_tokens"]


async def get_json(http: httpx.AsyncClient, url: str, headers: dict[str, str], timeout_s: float = 5.0) -> Optional[Any]:
    """GET a JSON document; None when the server has none there (any error)."""
    try:
        resp = await http.get(url, headers=headers, timeout=timeout_s)
        if resp.status_code != 200:
            return None
        return resp.json()
    except (httpx.HTTPError, ValueError):
        return None
