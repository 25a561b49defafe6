"""Fuzzing a real `sluice serve` process: whatever arrives, the answer is a 2xx or an OpenAI-shaped
4xx (Anthropic-shaped on its Messages API), never a 5xx or a hang, and the server is healthy and
idle afterwards.

Two generators: schemathesis, from the server's own OpenAPI schema (bodies that fit it and bodies
that break it), and hypothesis over raw bytes (truncated JSON, invalid UTF-8, lone surrogates).
Counts are bounded so the module runs in about a minute.
"""
from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

from server_utils import RemoteServer, wait_until_idle

MAX_MODEL_LEN = 128
MAX_REQUEST_BYTES = 65536
MAX_OUTPUT = 4  # tokens a call that passes every check may generate: the fuzz is after the checks
SERVER_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-tokens", "4096", "--max-n", "2",
               "--max-request-bytes", str(MAX_REQUEST_BYTES)]
FUZZ = settings(deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with RemoteServer(SERVER_ARGS) as remote:
        yield remote


def assert_answered(status: int, content_type: str, text: str, what: Any, path: str = "") -> None:
    assert status < 500, f"{status} for {what!r}: {text[:500]}"
    if 400 <= status < 500:
        assert content_type.startswith("application/json"), (status, content_type, what)
        body = json.loads(text)
        error = body["error"]
        if path.startswith("/v1/messages"):       # Anthropic's Messages API answers in its own shape
            assert body["type"] == "error" and set(error) == {"type", "message"} and error["message"], body
        else:
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error


def cap_output(case: Any) -> Any:
    """Calls that could pass every check ask for at most MAX_OUTPUT tokens; out-of-range values
    (zero, negative, past the context, wrong types) are kept, since those are what is tested."""
    body = case.body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and MAX_OUTPUT < value < MAX_MODEL_LEN:
                body[key] = MAX_OUTPUT
        if all(body.get(k) is None for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")):
            body["max_tokens"] = MAX_OUTPUT
    return case


def test_schema_fuzz(server: RemoteServer) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    cases = st.one_of(
        schema.as_strategy(GenerationMode.POSITIVE).map(cap_output),
        schema.as_strategy(GenerationMode.NEGATIVE).map(cap_output),
    )
    seen: dict[int, int] = {}

    @settings(FUZZ, max_examples=250)
    @given(cases)
    def fuzz(case: Any) -> None:
        response = case.call(base_url=server.url, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        content_type = response.headers.get("content-type") or [""]  # schemathesis: header -> values
        assert_answered(response.status_code, content_type[0], response.text, (case.method, case.path, case.body),
                        case.path)

    fuzz()
    assert seen.get(200) and seen.get(400), seen  # both valid and invalid calls were made
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    wait_until_idle(server, timeout=30)


_VALID = json.dumps({"prompt": "Hello", "max_tokens": MAX_OUTPUT}).encode()

raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda n: _VALID[:n], st.integers(0, len(_VALID) - 1)),               # truncated
    st.builds(lambda i, b: _VALID[:i] + bytes([b]) + _VALID[i + 1:],                # one byte changed
              st.integers(0, len(_VALID) - 1), st.integers(0x80, 0xFF)),
    st.builds(lambda parts: b'{"prompt": "' + "".join(parts).encode() + b'", "max_tokens": 2}',  # escapes
              st.lists(st.one_of(st.integers(0xD800, 0xDFFF).map(lambda c: f"\\u{c:04x}"),      # surrogates
                                 st.sampled_from(["x", "\\u0000", "\\n", "\\\"", "\u00e9"])), max_size=6)),
)


def test_raw_body_fuzz(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        @settings(FUZZ, max_examples=60)
        @given(path=st.sampled_from(["/completions", "/chat/completions", "/responses"]), body=raw_bodies)
        def fuzz(path: str, body: bytes) -> None:
            resp = http.post(path, content=body, headers={"content-type": "application/json"})
            assert_answered(resp.status_code, resp.headers.get("content-type", ""), resp.text, body)

        fuzz()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    wait_until_idle(server, timeout=30)
