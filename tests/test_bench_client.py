"""The streaming client against a real loopback HTTP server that misbehaves on request:
chunk timing, usage parsing and the classification of failures."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from sluice.bench.client import CallRecord, CallStatus, Endpoint, make_http_client, stream_chat


def _sse(obj: object) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _delta(text: str, finish: str | None = None) -> bytes:
    return _sse({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})


USAGE = {"choices": [], "usage": {"prompt_tokens": 42, "completion_tokens": 3,
                                  "prompt_tokens_details": {"cached_tokens": 32}}}


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    body = json.loads(await reader.readexactly(length))
    mode = body["model"]
    if mode == "503":
        msg = b'{"error": "overloaded"}'
        writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(msg), msg))
        await writer.drain()
        writer.close()
        return
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
    writer.write(_sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.write(_delta("a"))
    await writer.drain()
    if mode == "stall":
        await asyncio.sleep(30)
    elif mode == "error":
        writer.write(_sse({"error": {"message": "engine died", "code": 500}}))
    elif mode == "bad":
        writer.write(_sse(b"{not json"))
    elif mode in ("ok", "nousage"):
        for text in (" b", " c"):
            await asyncio.sleep(0.05)
            writer.write(_delta(text, "length" if text == " c" else None))
            await writer.drain()
        if mode == "ok":
            writer.write(_sse(USAGE))
        writer.write(_sse(b"[DONE]"))
    elif mode == "separators":
        # JSON with U+2028/U+0085 raw in its strings (as pydantic writes them), CRLF and CR line
        # ends, and writes that split a character and a CRLF in two
        first = json.dumps({"choices": [{"index": 0, "delta": {"content": " x\u2028y"}}]}, ensure_ascii=False)
        last = json.dumps({"choices": [{"index": 0, "delta": {"content": "\x85z"}, "finish_reason": "stop"}]},
                          ensure_ascii=False)
        stream = (b"data: " + first.encode() + b"\r\n\r\n" + b"data: " + last.encode() + b"\r\r"
                  + b"data: [DONE]\r\n\r\n")
        cuts = [stream.index("\u2028".encode()) + 1, stream.index(b"\r\n") + 1, stream.index("\x85".encode()) + 1]
        for begin, end in zip([0] + cuts, cuts + [len(stream)]):
            writer.write(stream[begin:end])
            await writer.drain()
            await asyncio.sleep(0.02)
    # mode "cut": close without [DONE]
    await writer.drain()
    writer.close()


async def _call(endpoint: Endpoint, mode: str, timeout_s: float = 5.0) -> CallRecord:
    rec = CallRecord(workflow_index=0, step_index=0, max_tokens=3, send_time=0.0)
    chunks: list[int] = []
    async with make_http_client(2) as http:
        return await stream_chat(http, endpoint, {"model": mode, "stream": True}, rec,
                                 t0=time.perf_counter(), timeout_s=timeout_s, on_chunk=chunks.append)


def run(coro):  # no pytest-asyncio here: drive each case with asyncio.run
    return asyncio.run(coro)


async def _with_server(mode: str, timeout_s: float = 5.0) -> CallRecord:
    srv = await asyncio.start_server(_handle, "127.0.0.1", 0)
    try:
        port = srv.sockets[0].getsockname()[1]
        return await _call(Endpoint.from_url(f"http://127.0.0.1:{port}"), mode, timeout_s)
    finally:
        srv.close()


def test_endpoint_urls():
    e = Endpoint.from_url("http://h:1")
    assert e.base_url == "http://h:1/v1" and e.chat_url == "http://h:1/v1/chat/completions"
    assert e.root_url == "http://h:1"
    assert Endpoint.from_url("http://h:1/v1/").base_url == "http://h:1/v1"
    assert Endpoint.from_url("http://h:1/api/v1").root_url == "http://h:1/api"
    assert Endpoint("http://h/v1", api_key="k").headers() == {"Authorization": "Bearer k"}


def test_good_stream_with_usage():
    rec = run(_with_server("ok"))
    assert rec.status is CallStatus.OK and rec.http_status == 200
    assert rec.num_chunks == 3 and len(rec.chunk_times) == 3
    assert rec.text == "a b c"
    assert rec.output_tokens == 3 and rec.output_tokens_from_usage
    assert (rec.prompt_tokens, rec.cached_tokens) == (42, 32)
    assert rec.finish_reason == "length"
    assert rec.send_time < rec.first_token_time < rec.last_token_time <= rec.end_time
    assert rec.chunk_times[0] == rec.first_token_time and rec.chunk_times[-1] == rec.last_token_time
    assert rec.generation_speed is not None and rec.generation_speed > 0


def test_stream_without_usage_counts_chunks():
    rec = run(_with_server("nousage"))
    assert rec.ok and rec.output_tokens == 3 and not rec.output_tokens_from_usage
    assert rec.prompt_tokens is None and rec.cached_tokens is None


def test_http_status_is_classified():
    rec = run(_with_server("503"))
    assert rec.status is CallStatus.HTTP and rec.http_status == 503
    assert "overloaded" in rec.error and rec.first_token_time is None


def test_per_call_timeout_covers_a_stalled_stream():
    rec = run(_with_server("stall", timeout_s=0.5))
    assert rec.status is CallStatus.TIMEOUT
    assert rec.num_chunks == 1 and rec.output_tokens == 1     # what did arrive is kept
    assert 0.4 < rec.end_time - rec.send_time < 5


def test_stream_cut_before_done_is_a_connection_failure():
    rec = run(_with_server("cut"))
    assert rec.status is CallStatus.CONNECTION and "[DONE]" in rec.error


def test_unicode_line_separators_inside_json_do_not_split_events():
    """SSE ends lines only at CRLF, LF or CR: U+2028/U+0085 raw inside a chunk's JSON (vLLM's
    pydantic chunks carry them so) is text, not a line break, even split across reads."""
    rec = run(_with_server("separators"))
    assert rec.status is CallStatus.OK, rec.error
    assert rec.text == "a x\u2028y\x85z" and rec.num_chunks == 3 and rec.finish_reason == "stop"


def test_error_event_and_bad_json():
    assert run(_with_server("error")).status is CallStatus.STREAM_ERROR
    assert run(_with_server("bad")).status is CallStatus.PROTOCOL


def test_connection_refused():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rec = run(_call(Endpoint.from_url(f"http://127.0.0.1:{port}"), "ok"))
    assert rec.status is CallStatus.CONNECTION and rec.http_status is None


def test_record_json_round_trip():
    rec = run(_with_server("ok"))
    back = CallRecord.from_json(json.loads(json.dumps(rec.to_json())))
    assert back.status is CallStatus.OK
    assert back.output_tokens == rec.output_tokens and back.chunk_times == pytest.approx(rec.chunk_times, abs=1e-4)
