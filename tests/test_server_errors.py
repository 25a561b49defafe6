"""Bad requests get the right 4xx in OpenAI's error shape and leave the server healthy; API keys."""
from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.parse
from typing import Any, Iterator, Optional

import httpx
import openai
import pytest

from server_utils import RemoteServer

MAX_REQUEST_BYTES = 100_000
SERVER_ARGS = ["--max-model-len", "2048", "--kv-cache-tokens", "16384", "--max-request-bytes", str(MAX_REQUEST_BYTES)]
MODEL = "SmolLM2-135M-Instruct.Q4_1"
API_KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with RemoteServer(SERVER_ARGS) as remote:
        yield remote


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, **fields}


def assert_openai_error(resp: httpx.Response, status: int, param: Optional[str] = None,
                        code: Optional[str] = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


BAD_CHAT = {
    "messages_not_a_list": (chat(messages="hello"), "messages"),
    "messages_empty": (chat(messages=[]), "messages"),
    "message_without_role": (chat(messages=[{"content": "hi"}]), "messages"),
    "unknown_role": (chat(messages=[{"role": "robot", "content": "hi"}]), "messages"),
    "image_content_part": (chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "messages"),
    "content_wrong_type": (chat(messages=[{"role": "user", "content": 42}]), "messages"),
    "temperature_wrong_type": (chat(temperature="hot"), "temperature"),
    "max_tokens_wrong_type": (chat(max_tokens="many"), "max_tokens"),
    "stream_wrong_type": (chat(stream="sometimes"), "stream"),
    "max_tokens_zero": (chat(max_tokens=0), "max_tokens"),
    "prompt_logprobs_with_stream": (chat(prompt_logprobs=0, stream=True), "prompt_logprobs"),
    "truncate_prompt_tokens_zero": (chat(truncate_prompt_tokens=0), "messages"),
    "beam_search_with_stop": (chat(use_beam_search=True, stop=["."]), "stop"),
    "beam_search_too_wide": (chat(use_beam_search=True, n=11), "n"),
    "logprob_token_ids_without_logprobs": (chat(logprob_token_ids=[5]), "logprob_token_ids"),
    "logprob_token_ids_out_of_vocab": (chat(logprobs=True, logprob_token_ids=[49152]), "logprob_token_ids"),
    "request_id_too_long": (chat(request_id="r" * 257), "request_id"),
    "priority_not_an_integer": (chat(priority="high"), "priority"),
    "cache_salt_empty": (chat(cache_salt=""), "cache_salt"),
    "cache_salt_too_long": (chat(cache_salt="s" * 1025), "cache_salt"),
    "cache_salt_not_a_string": (chat(cache_salt=5), "cache_salt"),
    "max_tokens_negative": (chat(max_tokens=-5), "max_tokens"),
    "max_completion_tokens_zero": (chat(max_completion_tokens=0), "max_tokens"),
    "max_tokens_beyond_context": (chat(max_tokens=2048), "max_tokens"),
    "negative_temperature": (chat(temperature=-0.5), None),
    "top_p_zero": (chat(top_p=0.0), None),
    "top_p_above_one": (chat(top_p=1.5), None),
    "n_zero": (chat(n=0), None),
    "n_above_max": (chat(n=17), "n"),
    "too_many_stop_strings": (chat(stop=[f"s{i}" for i in range(17)]), "stop"),
    "empty_stop_string": (chat(stop=[""]), "stop"),
    "top_logprobs_above_bound": (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    "top_logprobs_without_logprobs": (chat(top_logprobs=2), "top_logprobs"),
    "logit_bias_key_not_a_token_id": (chat(logit_bias={"dog": 10}), "logit_bias"),
    "logit_bias_key_out_of_vocab": (chat(logit_bias={"49152": 10}), "logit_bias"),
    "logit_bias_key_unicode_digit": (chat(logit_bias={"\u00b2": 10}), "logit_bias"),
    "logit_bias_value_out_of_range": (chat(logit_bias={"42": 150}), None),
    "allowed_token_ids_out_of_vocab": (chat(allowed_token_ids=[1, 49152]), "allowed_token_ids"),
    "allowed_token_ids_empty": (chat(allowed_token_ids=[]), None),
    "seed_beyond_int64": (chat(seed=2**64), "seed"),
    "top_k_invalid": (chat(top_k=-3), None),
    "presence_penalty_out_of_range": (chat(presence_penalty=3.0), None),
    "min_tokens_above_max_tokens": (chat(min_tokens=10, max_tokens=4), None),
    "streaming_bad_request": (chat(stream=True, temperature=-1), None),
    "continue_final_message_with_generation_prompt": (chat(continue_final_message=True), "continue_final_message"),
    "continue_final_message_without_content": (chat(
        messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],
        continue_final_message=True, add_generation_prompt=False), "continue_final_message"),
    "chat_template_in_request": (chat(chat_template="{{ messages }}"), "chat_template"),
    "chat_template_kwargs_replacing_messages": (chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    "chat_template_kwargs_replacing_a_template_function": (chat(chat_template_kwargs={"raise_exception": 1}),
                                                            "chat_template_kwargs"),
    "chat_template_kwargs_not_an_object": (chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
    # Tool calls are parsed only by a server started with --enable-auto-tool-choice.
    "bad_words_empty": (chat(bad_words=["ok", " "]), "bad_words"),
    "bad_words_not_strings": (chat(bad_words=[7]), "bad_words"),
    "bad_words_beyond_128_sequences": (chat(bad_words=[f"w{i}" for i in range(65)]), "bad_words"),
    "bad_words_banning_every_allowed_token": (chat(bad_words=["Hello"], allowed_token_ids=[19556]), "bad_words"),
    "tools_without_auto_tool_choice": (chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),
    # A thinking budget needs --reasoning-parser (the model's thinking tags); this server has none.
    "thinking_token_budget_without_reasoning_parser": (chat(thinking_token_budget=8), "thinking_token_budget"),
    "thinking_token_budget_below_minus_one": (chat(thinking_token_budget=-2), "thinking_token_budget"),
    "thinking_token_budget_not_an_integer": (chat(thinking_token_budget=2.5), "thinking_token_budget"),
    "thinking_token_budget_a_bool": (chat(thinking_token_budget=True), "thinking_token_budget"),
}

BAD_COMPLETION = {
    "prompt_missing": ({"model": MODEL, "max_tokens": 4}, "prompt"),
    "prompt_wrong_type": (completion(prompt=12), "prompt"),
    "prompt_empty_list": (completion(prompt=[]), "prompt"),
    "prompt_token_out_of_vocab": (completion(prompt=[1, 2, 10_000_000]), "prompt"),
    "prompt_longer_than_context": (completion(prompt=[42] * 2100, max_tokens=None), "prompt"),
    "prompt_fills_context": (completion(prompt=[42] * 2048, max_tokens=None), "prompt"),
    "prompt_plus_max_tokens_beyond_context": (completion(prompt=[42] * 2000, max_tokens=100), "max_tokens"),
    "logprobs_above_bound": (completion(logprobs=21), "logprobs"),
    "logprobs_negative": (completion(logprobs=-1), "logprobs"),
    "suffix": (completion(suffix="end"), "suffix"),
    "best_of": (completion(best_of=3), "best_of"),
    "max_tokens_zero_without_echo": (completion(max_tokens=0), "max_tokens"),
    "prompt_logprobs_above_bound": (completion(prompt_logprobs=21), "prompt_logprobs"),
    "prompt_logprobs_negative": (completion(prompt_logprobs=-1), "prompt_logprobs"),
    "logprob_token_ids_with_echo_logprobs": (completion(echo=True, logprobs=1, logprob_token_ids=[5]),
                                             "logprob_token_ids"),
    "truncate_prompt_tokens_beyond_context": (completion(truncate_prompt_tokens=2049), "truncate_prompt_tokens"),
    "truncate_prompt_tokens_below_minus_one": (completion(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    "truncation_side_unknown": (completion(truncate_prompt_tokens=3, truncation_side="middle"), "truncation_side"),
    "truncate_prompt_tokens_zero": (completion(truncate_prompt_tokens=0), "prompt"),
    "thinking_token_budget_without_reasoning_parser": (completion(thinking_token_budget=0), "thinking_token_budget"),
    "prompt_logprobs_with_stream": (completion(prompt_logprobs=1, stream=True), "prompt_logprobs"),
}


BAD_TOKENIZE = {
    "prompt_wrong_type": ({"prompt": 12}, "prompt"),
    "neither_prompt_nor_messages": ({"text": "hi"}, "prompt"),
    "messages_empty": ({"messages": []}, "messages"),
    "continue_final_message_with_generation_prompt": (
        {"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True}, "continue_final_message"),
    "chat_template_kwargs_replacing_tools": (
        {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
}

BAD_DETOKENIZE = {
    "tokens_missing": ({}, "tokens"),
    "tokens_not_ints": ({"tokens": ["a"]}, "tokens"),
    "token_out_of_vocab": ({"tokens": [1, 49152]}, "tokens"),
    "token_negative": ({"tokens": [-1]}, "tokens"),
}


@pytest.mark.parametrize("body,param", BAD_TOKENIZE.values(), ids=BAD_TOKENIZE.keys())
def test_bad_tokenize_request(server: RemoteServer, body: dict[str, Any], param: Optional[str]) -> None:
    assert_openai_error(httpx.post(server.url + "/tokenize", json=body), 400, param=param)


@pytest.mark.parametrize("body,param", BAD_DETOKENIZE.values(), ids=BAD_DETOKENIZE.keys())
def test_bad_detokenize_request(server: RemoteServer, body: dict[str, Any], param: Optional[str]) -> None:
    assert_openai_error(httpx.post(server.url + "/detokenize", json=body), 400, param=param)


def test_tokenize_for_another_model_is_404(server: RemoteServer) -> None:
    for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
        assert_openai_error(httpx.post(server.url + path, json={"model": "other", **body}), 404,
                            code="model_not_found")


@pytest.mark.parametrize("body,param", BAD_CHAT.values(), ids=BAD_CHAT.keys())
def test_bad_chat_request(http: httpx.Client, body: dict[str, Any], param: Optional[str]) -> None:
    error = assert_openai_error(http.post("/chat/completions", json=body), 400, param=param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", BAD_COMPLETION.values(), ids=BAD_COMPLETION.keys())
def test_bad_completion_request(http: httpx.Client, body: dict[str, Any], param: Optional[str]) -> None:
    assert_openai_error(http.post("/completions", json=body), 400, param=param)


def test_a_request_id_header_past_its_bound_is_a_400(http: httpx.Client) -> None:
    resp = http.post("/completions", json=completion(), headers={"X-Request-Id": "x" * 257})
    assert_openai_error(resp, 400, param="X-Request-Id")
    assert http.post("/completions", json=completion(), headers={"X-Request-Id": "x" * 256}).status_code == 200


def test_context_length_errors_carry_a_code(http: httpx.Client) -> None:
    error = assert_openai_error(http.post("/completions", json=completion(prompt=[42] * 2100)), 400)
    assert error["code"] == "context_length_exceeded"
    assert "2048" in error["message"]


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_invalid_json(http: httpx.Client, path: str) -> None:
    resp = http.post(path, content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    assert_openai_error(resp, 400, code="invalid_json")
    assert_openai_error(http.post(path, content=b"[1, 2]"), 400)
    assert_openai_error(http.post(path, content=b"\xff\xfe"), 400)


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_invalid_unicode_in_strings(http: httpx.Client, path: str) -> None:
    """Invalid UTF-8 inside a JSON string, and lone UTF-16 surrogates escaped in valid JSON (which
    no tokenizer can encode), are the client's error; a surrogate pair is a valid character."""
    good = chat(messages=[{"role": "user", "content": "TEXT"}]) if path == "/chat/completions" else completion(
        prompt="TEXT")
    template = json.dumps(good).encode()
    for text in (b"caf\xe9", b"\xed\xa0\x80", b"\\ud800", b"x\\udfff", b"\\ude00\\ud83d"):
        assert_openai_error(http.post(path, content=template.replace(b"TEXT", text)), 400, code="invalid_json")
    resp = http.post(path, content=template.replace(b"TEXT", b"\\ud83d\\ude00"))
    assert resp.status_code == 200, resp.text


def test_chunked_body_over_the_limit(http: httpx.Client) -> None:
    """A body sent without Content-Length is cut off at --max-request-bytes as it streams in."""
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 1000 + 1):
            yield b"x" * 1000
        yield b'"}'

    assert_openai_error(http.post("/completions", content=chunks()), 413, code="request_too_large")


def test_non_finite_numbers(http: httpx.Client) -> None:
    for value in (b"NaN", b"Infinity", b"-Infinity"):
        body = b'{"prompt": "Hello", "max_tokens": 4, "temperature": ' + value + b"}"
        assert_openai_error(http.post("/completions", content=body), 400, param="temperature")


def test_unknown_model(http: httpx.Client, server: RemoteServer) -> None:
    assert_openai_error(http.post("/chat/completions", json=chat(model="gpt-5")), 404,
                        param="model", code="model_not_found")
    assert_openai_error(http.post("/completions", json=completion(model="")), 404, code="model_not_found")
    assert_openai_error(http.get("/models/gpt-5"), 404, code="model_not_found")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "model_not_found"


def test_bad_request_through_openai_client(server: RemoteServer) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=-1, stream=True)
    assert "temperature" in info.value.message


def test_request_too_large(http: httpx.Client) -> None:
    big = chat(messages=[{"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 1)}])
    assert_openai_error(http.post("/chat/completions", json=big), 413, code="request_too_large")


def test_wrong_method_and_unknown_route(http: httpx.Client) -> None:
    assert_openai_error(http.get("/chat/completions"), 405)
    assert_openai_error(http.post("/embeddings", json={}), 404)


def test_tools_with_tool_choice_none_need_no_parser(http: httpx.Client) -> None:
    body = chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="none")
    resp = http.post("/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["tool_calls"] == []


def test_model_field_may_be_omitted(http: httpx.Client) -> None:
    body = chat()
    del body["model"]
    resp = http.post("/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == MODEL


def test_server_is_healthy_after_bad_requests(server: RemoteServer, http: httpx.Client) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    resp = http.post("/completions", json=completion(max_tokens=2))
    assert resp.status_code == 200, resp.text
    load = httpx.get(server.url + "/load").json()
    assert load["running"] == 0


# -- API key ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_server() -> Iterator[RemoteServer]:
    args = ["--max-model-len", "512", "--kv-cache-tokens", "2048", "--api-key", API_KEY, "--metrics-require-auth",
            "--max-num-seqs", "1", "--max-waiting-requests", "1"]
    with RemoteServer(args) as remote:
        yield remote


def test_api_key_required_on_v1_and_tokenize(auth_server: RemoteServer) -> None:
    url = auth_server.base_url
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Basic {API_KEY}"}]:
        assert_openai_error(httpx.get(url + "/models", headers=headers), 401, code="invalid_api_key")
        assert_openai_error(httpx.post(url + "/completions", json=completion(), headers=headers), 401)
        assert_openai_error(httpx.post(auth_server.url + "/tokenize", json={"prompt": "a"}, headers=headers), 401)
        assert_openai_error(httpx.post(auth_server.url + "/detokenize", json={"tokens": [1]}, headers=headers), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0)
    assert client.models.list().data[0].id == MODEL
    resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert resp.usage is not None and resp.usage.completion_tokens <= 2
    ok = httpx.post(auth_server.url + "/tokenize", json={"prompt": "a"}, headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200 and ok.json()["count"] == 1


def test_health_open_and_metrics_guarded(auth_server: RemoteServer) -> None:
    assert httpx.get(auth_server.url + "/health").status_code == 200
    assert_openai_error(httpx.get(auth_server.url + "/metrics"), 401)
    resp = httpx.get(auth_server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == 200 and "sluice:num_requests_running" in resp.text


def test_queue_full_is_429_with_retry_after(auth_server: RemoteServer) -> None:
    """One running request (max-num-seqs 1) and one waiting (max-waiting-requests 1) fill the
    server; the next call is refused with 429 and Retry-After, and the two are aborted when their
    clients go away."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    long = completion(max_tokens=400, ignore_eos=True)

    async def load_until(key: str, value: int, http: httpx.AsyncClient) -> None:
        deadline = time.monotonic() + 30
        while (await http.get(auth_server.url + "/load")).json()[key] != value:
            assert time.monotonic() < deadline, f"{key} never reached {value}"
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=auth_server.base_url, headers=headers, timeout=120) as http:
            running = asyncio.create_task(http.post("/completions", json=long))
            await load_until("running", 1, http)
            waiting = asyncio.create_task(http.post("/completions", json=long))
            await load_until("waiting", 1, http)
            load = (await http.get(auth_server.url + "/load")).json()
            assert load["accepting"] is False and load["admissible_workflows"] == 0
            refused = await http.post("/completions", json=completion())
            error = assert_openai_error(refused, 429, code="rate_limit_exceeded")
            assert error["type"] == "rate_limit_error"
            assert int(refused.headers["retry-after"]) >= 1
            for task in (running, waiting):
                task.cancel()
            await asyncio.gather(running, waiting, return_exceptions=True)
            await load_until("running", 0, http)
            await load_until("waiting", 0, http)

    asyncio.run(scenario())


def test_load_long_polls_until_there_is_room_and_counts_pending_workflows(auth_server: RemoteServer) -> None:
    """`GET /load?wait=S` answers at once while there is room, holds its answer while there is
    none (one call running and one waiting fill this server) and answers as soon as room comes
    back, or after S; `pending=` ids are counted in `pending_counted` once the server has their
    calls; bad values are 400s."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    long = completion(max_tokens=400, ignore_eos=True)
    url = auth_server.url + "/load"

    async def get(http: httpx.AsyncClient, query: str) -> tuple[dict[str, Any], float]:
        t0 = time.monotonic()
        doc = (await http.get(url + query)).json()
        return doc, time.monotonic() - t0

    async def until(http: httpx.AsyncClient, key: str, value: int) -> None:
        deadline = time.monotonic() + 30
        while (await http.get(url)).json()[key] != value:
            assert time.monotonic() < deadline, f"{key} never reached {value}"
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=auth_server.base_url, headers=headers, timeout=120) as http:
            await until(http, "running", 0)
            doc, took = await get(http, "?wait=20")
            assert doc["admissible_workflows"] >= 1 and doc["pending_counted"] is None and took < 5
            doc, _ = await get(http, "?pending=wf-a,wf-b")
            assert doc["pending_counted"] == 0
            running = asyncio.create_task(http.post("/completions", json=long, headers={"X-Workflow-Id": "wf-a"}))
            await until(http, "running", 1)
            doc, _ = await get(http, "?pending=wf-a,wf-b")
            assert doc["pending_counted"] == 1 and doc["active_workflows"] == 1
            waiting = asyncio.create_task(http.post("/completions", json=long))
            await until(http, "waiting", 1)
            doc, took = await get(http, "?wait=0.4")
            assert doc["admissible_workflows"] == 0 and 0.35 <= took < 5
            held = asyncio.create_task(get(http, "?wait=25"))
            await asyncio.sleep(0.5)
            assert not held.done()
            waiting.cancel()                  # the queue frees: room again
            doc, took = await held
            assert doc["admissible_workflows"] >= 1 and doc["accepting"] is True and took < 20
            # More workflows in transit than the room: held (wf-a is counted, the ten are not).
            unseen = ",".join(f"wf-p{i}" for i in range(10))
            doc, took = await get(http, f"?wait=0.4&pending=wf-a,{unseen}")
            assert doc["pending_counted"] == 1 and doc["admissible_workflows"] < 10 and took >= 0.35
            running.cancel()
            await asyncio.gather(running, waiting, return_exceptions=True)
            await until(http, "running", 0)
        for bad in ("?wait=-1", "?wait=31", "?wait=soon", "?pending=" + "x" * 20000):
            assert_openai_error(httpx.get(url + bad), 400)

    asyncio.run(scenario())


def _raw_get(server: RemoteServer, path: str) -> tuple[int, str, bytes]:
    """GET `path` over a plain socket, its head sent in 4 KiB pieces as a network may deliver
    it (httpx refuses URLs past 64 KiB): status, content type, body."""
    port = int(server.url.rsplit(":", 1)[1])
    head = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for i in range(0, len(head), 4096):
            sock.sendall(head[i:i + 4096])
            time.sleep(0.001)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    lines, body = data.split(b"\r\n\r\n", 1)
    status = int(lines.split(b" ", 2)[1])
    ctype = next((l.split(b":", 1)[1].strip().decode() for l in lines.split(b"\r\n") if l.lower().startswith(b"content-type")), "")
    return status, ctype, body


def test_load_answers_the_longest_pending_list_it_documents(auth_server: RemoteServer) -> None:
    """`GET /load?pending=` takes up to 16,384 characters; 4-byte ones are 12 URL characters
    each, a 197 KB request line. uvicorn's parser refused heads past 16 KiB with a bare text
    400 (or a broken pipe) before the app saw them, depending on how the bytes arrived."""
    longest = urllib.parse.quote("\U00010000" * 16384)
    status, ctype, body = _raw_get(auth_server, "/load?pending=" + longest)
    assert status == 200 and ctype.startswith("application/json"), (status, ctype, body[:200])
    assert json.loads(body)["pending_counted"] == 0
    status, ctype, body = _raw_get(auth_server, "/load?pending=" + longest + "x")   # one past the bound
    assert status == 400 and ctype.startswith("application/json"), (status, ctype, body[:200])
    assert json.loads(body)["error"]["message"]
