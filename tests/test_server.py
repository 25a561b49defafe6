"""The OpenAI-compatible server as users see it: a real `sluice serve` process on a loopback port,
driven by the official `openai` client (and httpx where the test needs the raw stream)."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Iterator

import httpx
import openai
import pytest

import sluice
from hf_reference import hf_tokenizer as load_hf_tokenizer
from server_utils import RemoteServer, metric, scrape_metrics, wait_until_idle
from sluice.model.default import ensure_default_model

SERVER_ARGS = ["--max-model-len", "2048", "--kv-cache-tokens", "16384"]
MESSAGES = [{"role": "user", "content": "Name three colors."}]
PROMPT = "The capital of France is Paris. The capital of Germany is"
LONG_PROMPT = " ".join(f"Item {i} is a {['red', 'green', 'blue'][i % 3]} box." for i in range(60))


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    with RemoteServer(SERVER_ARGS) as remote:
        yield remote


def test_health_and_models(server: RemoteServer, client: openai.OpenAI) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    for method in ("GET", "POST", "HEAD"):          # vLLM's /ping (SageMaker), and HEAD probes
        r = httpx.request(method, server.url + "/ping")
        assert r.status_code == 200 and (r.content == b"" if method == "HEAD" else r.json() == {"status": "ok"})
    head = httpx.head(server.url + "/health")
    assert head.status_code == 200 and head.content == b""
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert client.models.retrieve(models[0].id).id == models[0].id
    assert httpx.get(server.url + "/version").json() == {"version": sluice.__version__}   # as vLLM's


def test_chat_completion(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8)
    assert resp.id.startswith("chatcmpl-")
    assert resp.object == "chat.completion"
    assert resp.model == model
    assert len(resp.choices) == 1
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    usage = resp.usage
    assert usage is not None
    assert usage.prompt_tokens > 0
    assert 0 < usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None


def test_chat_streaming_with_usage(client: openai.OpenAI, model: str) -> None:
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, stream=True, stream_options={"include_usage": True},
    ))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    finish = [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0] in ("stop", "length")
    assert all(c.usage is None for c in body)
    content = "".join(c.choices[0].delta.content or "" for c in body)
    assert usage_chunk.usage.completion_tokens <= 8
    assert usage_chunk.usage.total_tokens == usage_chunk.usage.prompt_tokens + usage_chunk.usage.completion_tokens
    assert content or usage_chunk.usage.completion_tokens <= 1


def test_continuous_usage_stats(client: openai.OpenAI, model: str) -> None:
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far, growing
    to the final usage chunk's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    for chunks in (
        list(client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
                                            stream_options=options)),
        list(client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, seed=1, stream=True,
                                       stream_options=options)),
    ):
        assert all(c.usage is not None for c in chunks)
        done = [c.usage.completion_tokens for c in chunks]
        assert done == sorted(done) and done[0] < done[-1] and not chunks[-1].choices
        assert len({c.usage.prompt_tokens for c in chunks}) == 1
        final = chunks[-1].usage
        assert final.total_tokens == final.prompt_tokens + final.completion_tokens
    assert done[-1] == 16                     # two choices of 8
    plain = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=4, stream=True,
                                           stream_options={"include_usage": True}))
    assert [c.usage is not None for c in plain] == [False] * (len(plain) - 1) + [True]


def test_greedy_is_deterministic_and_stream_matches(client: openai.OpenAI, model: str) -> None:
    first = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    second = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert first.id.startswith("cmpl-") and first.object == "text_completion"
    assert first.choices[0].text == second.choices[0].text
    assert first.choices[0].text
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == first.choices[0].text
    assert chunks[-1].choices[0].finish_reason == first.choices[0].finish_reason


def test_chat_greedy_is_deterministic(client: openai.OpenAI, model: str) -> None:
    texts = {
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
        .choices[0].message.content
        for _ in range(2)
    }
    assert len(texts) == 1


def test_stop_string(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text = full.choices[0].text
    assert len(text) >= 4
    stop = text[len(text) // 2:len(text) // 2 + 2]
    expected = text[:text.find(stop)]
    stopped = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], extra_body={"ignore_eos": True}
    )
    assert stopped.choices[0].text == expected
    assert stopped.choices[0].finish_reason == "stop"


def test_prefix_cache_reports_cached_tokens(client: openai.OpenAI, model: str) -> None:
    first = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=1, temperature=0)
    second = client.completions.create(model=model, prompt=LONG_PROMPT, max_tokens=1, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 256
    details = second.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    assert 0 < details.cached_tokens <= second.usage.prompt_tokens


def test_cache_salt_keeps_prefix_cache_hits_within_the_salt(client: openai.OpenAI, model: str) -> None:
    """vLLM's cache_salt: a prompt cached under one salt is a hit for the same salt only."""
    prompt = f"[{uuid.uuid4().hex}] " + LONG_PROMPT

    def cached(salt=None) -> int:
        usage = client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                          extra_body={"cache_salt": salt} if salt else None).usage
        return usage.prompt_tokens_details.cached_tokens or 0

    assert cached("tenant-a") == 0 and cached("tenant-a") > 256
    assert cached("tenant-b") == 0 and cached() == 0 and cached() > 256


def test_agent_follow_up_reuses_the_kv_of_its_own_reply(client: openai.OpenAI, model: str) -> None:
    """An agent sends its next call with the model's reply appended (then a tool result): the KV
    computed while decoding that reply must serve the next prompt, up to the last full block
    (the reply's last token is sampled, never fed back, so its KV does not exist)."""
    block = 16   # `sluice serve`'s default --block-size
    messages = [
        {"role": "system", "content": "You are a careful assistant. " + LONG_PROMPT},
        {"role": "user", "content": "Describe the boxes above in a few sentences."},
    ]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0)
    assert first.usage is not None and first.usage.completion_tokens > 2 * block
    reply = first.choices[0].message.content
    messages += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "[search result] " + " ".join(["the file was found"] * 20)},
    ]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=1, temperature=0)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    computed = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    # Past the first prompt's blocks: the reply's own KV was reused, not only the old prompt's.
    assert second.usage.prompt_tokens_details.cached_tokens >= computed // block * block
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens


def test_n_samples(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, n=2, seed=1)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage is not None and resp.usage.completion_tokens <= 12
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, stream=True)
    finished = {c.choices[0].index: c.choices[0].finish_reason for c in stream if c.choices[0].finish_reason}
    assert set(finished) == {0, 1}


def test_beam_search(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    """vLLM's `use_beam_search` through the official client: n distinct beams, best first (for
    beams that ran to max_tokens, by the sum of their tokens' logprobs); streamed, each beam comes
    as one delta with the same text; chat too; fields it cannot honour are a 400 naming them;
    a client that goes away mid-search leaves nothing running."""
    beams = {"use_beam_search": True}
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=3, logprobs=1, extra_body=beams)
    choices = sorted(resp.choices, key=lambda c: c.index)
    assert len({c.text for c in choices}) == 3
    assert resp.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in choices)
    full = [sum(c.logprobs.token_logprobs) for c in choices if c.finish_reason == "length"]
    assert full == sorted(full, reverse=True)
    streamed: dict[int, list[str]] = {}
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=3, stream=True, extra_body=beams):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).append(c.text)
    assert {i: "".join(t) for i, t in streamed.items()} == {c.index: c.text for c in choices}
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, n=2, extra_body=beams)
    assert len({c.message.content for c in chat.choices}) == 2
    for extra, param in (({"n": 11}, "n"), ({"stop": ["."]}, "stop"), ({"presence_penalty": 1.0}, "presence_penalty")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body={**beams, **extra})
        assert e.value.body["param"] == param
    with pytest.raises(httpx.ReadTimeout):   # the client gives up while the beams still run
        httpx.post(server.url + "/v1/completions", timeout=0.5, json={
            "model": model, "prompt": LONG_PROMPT, "max_tokens": 1200, "n": 4, "use_beam_search": True, "ignore_eos": True})
    wait_until_idle(server)


def test_predicted_outputs(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    """OpenAI's `prediction`: the same reply with the prediction as text or as text parts, the
    prediction's tokens drafted (the server's speculative counters move by more than the reply
    needs without it); a prediction of another type is a 400."""
    ask = [{"role": "user", "content": "Write two sentences about the sea."}]
    plain = client.chat.completions.create(model=model, messages=ask, max_tokens=40, temperature=0)
    text = plain.choices[0].message.content

    def accepted() -> float:
        return metric(scrape_metrics(server), "sluice:spec_decode_num_accepted_tokens_total")

    before = accepted()
    again = client.chat.completions.create(model=model, messages=ask, max_tokens=40, temperature=0,
                                           prediction={"type": "content", "content": text})
    assert again.choices[0].message.content == text
    assert accepted() - before >= 0.6 * again.usage.completion_tokens   # most tokens came as accepted drafts
    details = again.usage.completion_tokens_details   # OpenAI's: the prediction's tokens accepted, and the rest
    predicted = len(httpx.post(server.url + "/tokenize", json={"model": model, "prompt": text,
                                                                "add_special_tokens": False}).json()["tokens"])
    assert details.accepted_prediction_tokens >= 0.6 * again.usage.completion_tokens
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == predicted
    assert plain.usage.completion_tokens_details is None                   # no prediction, no details
    streamed = list(client.chat.completions.create(model=model, messages=ask, max_tokens=40, temperature=0, stream=True,
                                                   stream_options={"include_usage": True},
                                                   prediction={"type": "content", "content": text}))
    assert streamed[-1].usage.completion_tokens_details == details
    parts = client.chat.completions.create(model=model, messages=ask, max_tokens=40, temperature=0, prediction={
        "type": "content", "content": [{"type": "text", "text": text[:20]}, {"type": "text", "text": text[20:]}]})
    assert parts.choices[0].message.content == text
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ask, max_tokens=4, prediction={"type": "file", "content": "x"})


def test_completion_batch_of_prompts(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(model=model, prompt=[PROMPT, "One, two,"], max_tokens=4, temperature=0)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    single = client.completions.create(model=model, prompt="One, two,", max_tokens=4, temperature=0)
    assert next(c.text for c in resp.choices if c.index == 1) == single.choices[0].text


def test_token_id_prompt_and_default_max_tokens(client: openai.OpenAI, model: str) -> None:
    """Without max_tokens a request may use the rest of the context: 2048 - 2040 = 8 tokens here."""
    resp = client.completions.create(
        model=model, prompt=[42] * 2040, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.usage is not None and resp.usage.prompt_tokens == 2040
    assert resp.usage.completion_tokens == 8
    assert resp.choices[0].finish_reason == "length"


def test_logit_bias_and_allowed_token_ids(client: openai.OpenAI, model: str) -> None:
    """OpenAI's logit_bias (+100 forces a token, -100 bans one) and vLLM's allowed_token_ids."""
    from sluice.model.default import ensure_default_model
    from sluice.model.loader import load_tokenizer

    tok = load_tokenizer(ensure_default_model())
    prompt, greedy = "The capital of France is", {"max_tokens": 3, "temperature": 0}
    [banana] = tok.encode(" banana", add_special_tokens=False)
    forced = client.completions.create(model=model, prompt=prompt, logit_bias={str(banana): 100}, **greedy)
    assert forced.choices[0].text == " banana" * 3
    free = client.completions.create(model=model, prompt=prompt, **greedy).choices[0].text
    first = tok.encode(free, add_special_tokens=False)[0]
    banned = client.completions.create(model=model, prompt=prompt, logit_bias={str(first): -100}, **greedy)
    assert not banned.choices[0].text.startswith(tok.decode([first])), (free, banned.choices[0].text)
    yes, no = tok.encode(" yes", add_special_tokens=False) + tok.encode(" no", add_special_tokens=False)
    only = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=1.0, seed=1,
                                     extra_body={"allowed_token_ids": [yes, no]})
    text = only.choices[0].text
    assert text and text.replace(" yes", "").replace(" no", "") == "", text


def test_bad_words(client: openai.OpenAI, model: str) -> None:
    """vLLM's bad_words: the word's tokens (alone and after a space) are never generated, on both
    endpoints, streamed or not; other output is untouched up to the first place it would appear."""
    from sluice.model.default import ensure_default_model
    from sluice.model.loader import load_tokenizer

    tok = load_tokenizer(ensure_default_model())
    prompt, greedy = "The capital of France is", {"max_tokens": 8, "temperature": 0, "logprobs": 0}
    free = client.completions.create(model=model, prompt=prompt, **greedy).choices[0]
    word = free.logprobs.tokens[0].strip()
    banned_strs = {tok.decode([seq[0]]) for seq in (tok.encode(word, add_special_tokens=False),
                                                     tok.encode(" " + word, add_special_tokens=False)) if len(seq) == 1}
    assert free.logprobs.tokens[0] in banned_strs, (word, banned_strs)
    got = client.completions.create(model=model, prompt=prompt, extra_body={"bad_words": [word]}, **greedy).choices[0]
    assert got.logprobs.tokens and not banned_strs.intersection(got.logprobs.tokens), (free.text, got.text)
    # a two-token phrase of the free output: its second token is banned only right after its first
    toks = free.logprobs.tokens
    i = next(i for i in range(1, len(toks) - 1) if toks[i].strip().isalpha() and toks[i + 1].strip().isalpha())
    a, b = toks[i:i + 2]
    phrase = client.completions.create(model=model, prompt=prompt, extra_body={"bad_words": [a + b]}, **greedy).choices[0]
    pairs = list(zip(phrase.logprobs.tokens, phrase.logprobs.tokens[1:]))
    assert (a, b) not in pairs and phrase.logprobs.tokens[:i + 1] == toks[:i + 1], (free.text, phrase.text)
    chat = [{"role": "user", "content": "What is the capital of France? One word."}]
    plain = client.chat.completions.create(model=model, messages=chat, max_tokens=8, temperature=0)
    assert "Paris" in plain.choices[0].message.content
    streamed = client.chat.completions.create(model=model, messages=chat, max_tokens=8, temperature=0, stream=True,
                                              extra_body={"bad_words": ["Paris"]})
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text and "Paris" not in text, text


def test_repetition_detection(client: openai.OpenAI, model: str) -> None:
    """vLLM's repetition_detection: the greedy output up to the first token where it ends with a
    pattern of 1-2 tokens three times, finish reason "repetition" (stop_reason
    "repetition_detected"), whole or streamed; malformed parameters are a 400."""
    from test_stop_rules import reference_repeats

    kw = dict(model=model, prompt="la la la la la la la la", max_tokens=30, temperature=0)
    free = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    ids = free.model_extra["token_ids"]
    cut = next(k for k in range(1, len(ids) + 1) if reference_repeats(ids[:k], 2, 0, 3))
    detect = {"repetition_detection": {"max_pattern_size": 2, "min_count": 3}, "return_token_ids": True}
    got = client.completions.create(**kw, extra_body=detect).choices[0]
    assert (got.model_extra["token_ids"], got.finish_reason, got.model_extra["stop_reason"]) == (
        ids[:cut], "repetition", "repetition_detected")
    chunks = list(client.completions.create(**kw, stream=True, extra_body=detect))
    assert [t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids") or []] == ids[:cut]
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["repetition"]
    for bad in ({"max_pattern_size": 2, "min_count": 1}, {"max_pattern_size": 1, "min_pattern_size": 2, "min_count": 2},
                {"max_pattern_size": 2, "min_count": 2, "window": 5}, {"max_pattern_size": -1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw, extra_body={"repetition_detection": bad})
        assert "repetition_detection" in str(e.value), bad


def _streamed_sizes(client: openai.OpenAI, model: str, interval=None, max_tokens: int = 21) -> list[int]:
    """The number of token ids each streamed completion chunk carries (ids counted by vLLM's
    return_token_ids), for a greedy call that runs to max_tokens."""
    extra = {"return_token_ids": True, "ignore_eos": True}
    if interval is not None:
        extra["stream_interval"] = interval
    chunks = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body=extra)
    sizes = [len(ch.model_extra.get("token_ids") or []) for c in chunks for ch in c.choices]
    assert sum(sizes) == max_tokens
    return [n for n in sizes if n]


def test_stream_interval_per_request(client: openai.OpenAI, model: str) -> None:
    """A call's `stream_interval`: its first chunk at once, then chunks of at least that many
    tokens (this server speculates, so a step may give more), the last with what is left."""
    sizes = _streamed_sizes(client, model, interval=4)
    assert sizes[0] < 4 and all(n >= 4 for n in sizes[1:-1]) and len(sizes) <= 2 + 20 // 4, sizes
    assert len(_streamed_sizes(client, model)) > len(sizes)
    with pytest.raises(openai.BadRequestError):
        _streamed_sizes(client, model, interval=0)


def test_stream_interval_server_flag_is_the_floor() -> None:
    """`--stream-interval N`: every streamed call gets chunks of N tokens (here exactly N: no
    speculation, one token per step); a call may raise it but not lower it."""
    with RemoteServer(SERVER_ARGS + ["--stream-interval", "3", "--speculative-config", "none"]) as remote:
        client = openai.OpenAI(base_url=remote.base_url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        assert _streamed_sizes(client, model) == [1] + [3] * 6 + [2]
        assert _streamed_sizes(client, model, interval=2) == [1] + [3] * 6 + [2]
        assert _streamed_sizes(client, model, interval=5) == [1, 5, 5, 5, 5]
        text = client.completions.create(model=model, prompt=PROMPT, max_tokens=21, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
        streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=21, temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text


def test_truncate_prompt_tokens(client: openai.OpenAI, model: str) -> None:
    """vLLM's truncate_prompt_tokens: the call runs on the last k prompt tokens (the first k with
    truncation_side "right"; -1: as many as leave room for one output token), as if sent alone."""
    from sluice.model.default import ensure_default_model
    from sluice.model.loader import load_tokenizer

    ids = load_tokenizer(ensure_default_model()).encode(LONG_PROMPT)
    greedy = {"max_tokens": 6, "temperature": 0}
    for side, kept in ((None, ids[-20:]), ("left", ids[-20:]), ("right", ids[:20])):
        body = {"truncate_prompt_tokens": 20, **({"truncation_side": side} if side else {})}
        cut = client.completions.create(model=model, prompt=LONG_PROMPT, echo=True, extra_body=body, **greedy)
        alone = client.completions.create(model=model, prompt=kept, **greedy)
        assert cut.usage.prompt_tokens == 20 and cut.choices[0].text.endswith(alone.choices[0].text)
        assert cut.choices[0].text == client.completions.create(model=model, prompt=kept, echo=True, **greedy).choices[0].text
    short = client.completions.create(model=model, prompt=ids[:5], extra_body={"truncate_prompt_tokens": 20}, **greedy)
    assert short.usage.prompt_tokens == 5
    whole = client.completions.create(model=model, prompt=[42] * 2100, max_tokens=None,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == 2047 and whole.usage.completion_tokens == 1
    chat = client.chat.completions.create(model=model, messages=MESSAGES, extra_body={"truncate_prompt_tokens": 7}, **greedy)
    assert chat.usage.prompt_tokens == 7


def test_return_token_ids(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    """vLLM's return_token_ids: the prompt's ids (what /tokenize gives for the same request) and
    each choice's generated ids, whole or streamed chunk by chunk; absent unless asked for. With
    return_tokens_as_token_ids, logprobs name tokens "token_id:<id>"."""
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True}
    greedy = {"max_tokens": 12, "temperature": 0}
    prompt_ids = post(server, "/tokenize", {"messages": MESSAGES})["tokens"]
    whole = client.chat.completions.create(model=model, messages=MESSAGES, logprobs=True, top_logprobs=2,
                                           extra_body=extra, **greedy)
    ids = whole.choices[0].model_extra["token_ids"]
    assert whole.model_extra["prompt_token_ids"] == prompt_ids and len(ids) == whole.usage.completion_tokens
    assert [c.token for c in whole.choices[0].logprobs.content] == [f"token_id:{t}" for t in ids]
    assert all(t.token.startswith("token_id:") for c in whole.choices[0].logprobs.content for t in c.top_logprobs)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True, extra_body=extra, **greedy))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    assert [t for c in chunks for ch in c.choices for t in ch.model_extra.get("token_ids") or []] == ids
    assert "".join(ch.delta.content or "" for c in chunks for ch in c.choices) == whole.choices[0].message.content

    comp_ids = post(server, "/tokenize", {"prompt": PROMPT})["tokens"]
    comp = client.completions.create(model=model, prompt=PROMPT, n=2, seed=3, extra_body=extra, max_tokens=8)
    for choice in comp.choices:
        assert choice.model_extra["prompt_token_ids"] == comp_ids and len(choice.model_extra["token_ids"]) == 8
    streamed = list(client.completions.create(model=model, prompt=PROMPT, stream=True, logprobs=1,
                                              extra_body=extra, **greedy))
    firsts = [c.choices[0].model_extra.get("prompt_token_ids") for c in streamed if c.choices]
    assert firsts[0] == comp_ids and not any(firsts[1:])
    got = [t for c in streamed if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    plain = client.completions.create(model=model, prompt=PROMPT, logprobs=1, **greedy).choices[0]
    assert [int(t.removeprefix("token_id:")) for c in streamed if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.tokens] == got
    assert len(got) == len(plain.logprobs.tokens) and "".join(c.choices[0].text for c in streamed if c.choices) == plain.text
    raw = httpx.post(server.base_url + "/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 2}).json()
    assert "prompt_token_ids" not in raw and "token_ids" not in raw["choices"][0]


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3, temperature=0
    )
    choice = resp.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert resp.usage is not None and len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content).startswith(choice.message.content or "")


def test_completion_logprobs(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, logprobs=2, temperature=0)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) > 0
    assert all(x <= 0 for x in lp.token_logprobs)
    # the top 2, and the token itself (OpenAI's "up to logprobs+1 elements")
    assert all(2 <= len(top) <= 3 and top[tok] == x for tok, x, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_logprob_token_ids(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    """vLLM's logprob_token_ids: at every output position the logprobs of the named tokens (a
    classifier's labels), beside the sampled token's, instead of the top ones; the first
    position's agree with the prompt logprobs of the prompt followed by each label."""
    ids = post(server, "/tokenize", {"prompt": PROMPT})["tokens"]
    labels = post(server, "/tokenize", {"prompt": " Berlin Paris", "add_special_tokens": False})["tokens"]
    comp = client.completions.create(model=model, prompt=ids, max_tokens=3, logprobs=0, temperature=0,
                                     extra_body={"logprob_token_ids": labels}).choices[0].logprobs
    names = [post(server, "/detokenize", {"tokens": [t]})["prompt"] for t in labels]
    for token, top in zip(comp.tokens, comp.top_logprobs):
        assert set(top) == {token, *names}
    for name, label in zip(names, labels):
        scored = client.completions.create(model=model, prompt=ids + [label], max_tokens=1, temperature=0,
                                           extra_body={"prompt_logprobs": 0}).choices[0].model_extra["prompt_logprobs"]
        assert comp.top_logprobs[0][name] == pytest.approx(scored[-1][str(label)]["logprob"], abs=0.15)   # bf16
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                          extra_body={"logprob_token_ids": labels})
    for entry in chat.choices[0].logprobs.content:
        assert {t.token for t in entry.top_logprobs} == {entry.token, *names}
        assert entry.top_logprobs[0].token == entry.token     # the sampled token first, then the named ones


def test_echo(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, echo=True, temperature=0)
    assert resp.choices[0].text.startswith(PROMPT)


def test_echo_with_logprobs_scores_the_prompt(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    """What evaluation harnesses send for a loglikelihood (lm-eval's `local-completions`): token ids,
    `echo`, `logprobs`, `max_tokens` 1. The prompt's tokens come back with their logprobs (null for
    the first), and those of tokens the server generated itself agree with what it reported while
    generating them; the same call again is not answered from the prefix cache."""
    ids = httpx.post(server.url + "/tokenize", json={"model": model, "prompt": PROMPT}).json()["tokens"]
    gen = client.completions.create(model=model, prompt=ids, max_tokens=3, logprobs=1, temperature=0)
    gen_ids = httpx.post(server.url + "/tokenize", json={"model": model, "prompt": PROMPT + gen.choices[0].text,
                                                           "add_special_tokens": False}).json()["tokens"]
    assert gen_ids[:len(ids)] == ids
    full = ids + gen_ids[len(ids):len(ids) + 2]
    calls = [client.completions.create(model=model, prompt=full, max_tokens=1, echo=True, logprobs=1, temperature=0)
             for _ in range(2)]
    for resp in calls:
        lp = resp.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(full) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        assert all(1 <= len(top) <= 2 and top[tok] == x
                   for tok, x, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]))
        assert "".join(lp.tokens) == resp.choices[0].text
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        # bf16 logits on both paths (a prefill chunk here, decode steps there): within a few ulps
        for mine, theirs in zip(lp.token_logprobs[len(ids):len(full)], gen.choices[0].logprobs.token_logprobs):
            assert mine == pytest.approx(theirs, abs=0.15)
        assert resp.usage.prompt_tokens == len(full)
    assert calls[1].usage.prompt_tokens_details.cached_tokens == 0
    assert calls[1].choices[0].logprobs.token_logprobs == calls[0].choices[0].logprobs.token_logprobs

    only = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    assert only.choices[0].text == PROMPT and only.choices[0].finish_reason == "length"
    assert len(only.choices[0].logprobs.tokens) == len(ids) and only.choices[0].logprobs.token_logprobs[0] is None
    streamed = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1,
                                              temperature=0, stream=True))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == len(ids) + 2 and "".join(c.choices[0].text for c in streamed if c.choices).startswith(PROMPT)


def test_prompt_logprobs_field(client: openai.OpenAI, model: str) -> None:
    """vLLM's `prompt_logprobs`: per prompt token {token id: logprob, rank, decoded_token}, the
    token itself and the top k, on both endpoints."""
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 2})
    plp = chat.model_extra["prompt_logprobs"]
    assert len(plp) == chat.usage.prompt_tokens and plp[0] is None
    for entry in plp[1:]:
        assert 2 <= len(entry) <= 3
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] and all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in entry.values())
    comp = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 0})
    plp = comp.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == comp.usage.prompt_tokens and plp[0] is None and all(len(e) == 1 for e in plp[1:])
    assert comp.choices[0].logprobs is None


def test_workflow_fields_and_unknown_fields_are_accepted(client: openai.OpenAI, model: str) -> None:
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, user="someone",
        extra_headers={"X-Workflow-Id": "wf-test"},
        extra_body={"workflow_id": "ignored-header-wins", "is_last_step": True, "top_k": 5, "min_p": 0.05,
                    "repetition_penalty": 1.1, "min_tokens": 1, "skip_special_tokens": True,
                    "some_future_field": {"x": 1}},
    )
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_a_client_named_request_id_is_the_response_id(client: openai.OpenAI, model: str) -> None:
    """vLLM's X-Request-Id header (or `request_id` field) names the response; the same name twice
    at once is no clash, since the engine keeps ids of its own."""
    import concurrent.futures

    tag = uuid.uuid4().hex[:8]
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                          extra_headers={"X-Request-Id": f"trace-{tag}"}, extra_body={"request_id": "x"})
    assert resp.id == f"chatcmpl-trace-{tag}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: client.completions.create(model=model, prompt=PROMPT, max_tokens=8,
                                                                 extra_body={"request_id": tag}), range(2)))
    assert [r.id for r in both] == [f"cmpl-{tag}"] * 2
    streamed = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=2, stream=True,
                                              extra_body={"request_id": tag}))
    assert {c.id for c in streamed} == {f"cmpl-{tag}"}
    assert client.completions.create(model=model, prompt=PROMPT, max_tokens=1).id.startswith("cmpl-")


def test_session_id_names_the_workflow(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    """vLLM's `session_id` names the call's workflow (after the X-Workflow-Id header and
    `workflow_id`, before OpenAI's `prompt_cache_key` and `user`): its KV is retained for the next
    call, which `/load` counts."""
    def counted(*ids: str) -> int:
        return httpx.get(server.url + "/load", params={"pending": ",".join(ids)}, timeout=10).json()["pending_counted"]

    tag = uuid.uuid4().hex[:8]
    sess, wf, user = f"sess-{tag}", f"wf-{tag}", f"user-{tag}"
    client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, user=user, extra_body={"session_id": sess})
    assert counted(sess) == 1 and counted(user) == 0
    client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                   extra_body={"session_id": f"{sess}-2", "workflow_id": wf})
    assert counted(wf) == 1 and counted(f"{sess}-2") == 0
    key = f"conv-{tag}"       # OpenAI's prompt_cache_key (coding agents send their conversation's id), before user
    client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, user=f"{user}-2", prompt_cache_key=key)
    assert counted(key) == 1 and counted(f"{user}-2") == 0
    for body in ({"session_id": sess}, {"workflow_id": wf}, {"prompt_cache_key": key}):   # the last step ends each
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, extra_body={**body, "is_last_step": True})
    assert counted(sess, wf, key) == 0


# -- /tokenize and /detokenize (vLLM's endpoints), and vLLM's chat template fields --------------

CHAT = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is"},
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    """The reference: transformers' tokenizer and chat template from the served GGUF."""
    return load_hf_tokenizer(ensure_default_model())


def post(server: RemoteServer, path: str, body: dict) -> dict:
    resp = httpx.post(server.url + path, json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def reference_chat_ids(hf_tokenizer, messages: list[dict], **options) -> list[int]:
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return hf_tokenizer.encode(text, add_special_tokens=False)


def test_tokenize_prompt_matches_transformers_and_detokenize_inverts_it(
    server: RemoteServer, client: openai.OpenAI, model: str, hf_tokenizer
) -> None:
    text = LONG_PROMPT + " café 🐍"
    got = post(server, "/tokenize", {"model": model, "prompt": text, "return_token_strs": True})
    assert got["tokens"] == hf_tokenizer.encode(text)
    assert got["token_strs"] == hf_tokenizer.convert_ids_to_tokens(got["tokens"])
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 2048
    assert post(server, "/tokenize", {"prompt": text})["token_strs"] is None
    # what a completion with the same prompt runs on
    usage = client.completions.create(model=model, prompt=text, max_tokens=1).usage
    assert usage is not None and usage.prompt_tokens == got["count"]
    assert post(server, "/detokenize", {"model": model, "tokens": got["tokens"]}) == {"prompt": text}
    # special tokens are kept, as the tokenizer's decode keeps them by default
    im_start = hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert post(server, "/detokenize", {"tokens": [im_start] + got["tokens"][:3]})["prompt"] == (
        hf_tokenizer.decode([im_start] + got["tokens"][:3]))


def test_tokenize_chat_is_the_prompt_chat_completions_run_on(
    server: RemoteServer, client: openai.OpenAI, model: str, hf_tokenizer
) -> None:
    question = CHAT[:2]
    for add in (True, False):
        got = post(server, "/tokenize", {"messages": question, "add_generation_prompt": add})
        assert got["tokens"] == reference_chat_ids(hf_tokenizer, question, add_generation_prompt=add)
    usage = client.chat.completions.create(model=model, messages=question, max_tokens=1).usage
    assert usage is not None and usage.prompt_tokens == post(server, "/tokenize", {"messages": question})["count"]
    # template variables pass through (SmolLM2's template ignores this one)
    assert post(server, "/tokenize", {"messages": question, "chat_template_kwargs": {"enable_thinking": False}}) == (
        post(server, "/tokenize", {"messages": question}))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = post(server, "/tokenize", {"messages": question, "tools": tools})
    usage = client.chat.completions.create(model=model, messages=question, tools=tools, tool_choice="none",
                                           max_tokens=1).usage
    assert usage is not None and usage.prompt_tokens == with_tools["count"] > len(
        reference_chat_ids(hf_tokenizer, question, add_generation_prompt=True))


def test_continue_final_message_continues_the_assistant_turn(
    server: RemoteServer, client: openai.OpenAI, model: str, hf_tokenizer
) -> None:
    fields = {"continue_final_message": True, "add_generation_prompt": False}
    got = post(server, "/tokenize", {"messages": CHAT, **fields})
    assert got["tokens"] == reference_chat_ids(hf_tokenizer, CHAT, continue_final_message=True)
    closed = reference_chat_ids(hf_tokenizer, CHAT, add_generation_prompt=False)
    assert closed[:len(got["tokens"])] == got["tokens"] and len(closed) > len(got["tokens"])
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, extra_body=fields)
    same = client.completions.create(model=model, prompt=got["tokens"], max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == same.choices[0].text
    assert reply.usage is not None and reply.usage.prompt_tokens == got["count"]
    # vLLM's chat `echo`: the final (assistant) message's text leads the reply, whole or streamed
    echoed = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0,
                                            extra_body={**fields, "echo": True})
    assert echoed.choices[0].message.content == CHAT[-1]["content"] + same.choices[0].text
    chunks = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, stream=True,
                                            extra_body={**fields, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed.choices[0].message.content
    plain = client.chat.completions.create(model=model, messages=CHAT[:2], max_tokens=4, temperature=0,
                                           extra_body={"echo": True})   # the final message is the user's
    assert plain.choices[0].message.content == client.chat.completions.create(
        model=model, messages=CHAT[:2], max_tokens=4, temperature=0).choices[0].message.content


def test_load_and_metrics(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    # its own request, cut by max_tokens, so the counters below hold whatever ran before (or alone)
    resp = client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    wait_until_idle(server)
    load = httpx.get(server.url + "/load").json()
    assert set(load) == {"running", "waiting", "waiting_tokens", "kv_usage", "accepting", "admissible_workflows",
                         "active_workflows", "max_active_workflows", "pending_counted"}
    assert load["pending_counted"] is None        # no `pending` ids asked about
    assert load["accepting"] is True and 0.0 <= load["kv_usage"] <= 1.0
    assert load["admissible_workflows"] >= 1
    samples = scrape_metrics(server)
    names = {key.partition("{")[0] for key in samples}
    for name in [
        "sluice:num_requests_running", "sluice:num_requests_waiting", "sluice:kv_cache_usage_perc",
        "sluice:kv_cache_blocks_total", "sluice:kv_cache_blocks_used", "sluice:kv_cache_blocks_retained",
        "sluice:kv_cache_blocks_evictable", "sluice:kv_cache_blocks_free", "sluice:prefix_cache_queries_total",
        "sluice:prefix_cache_hits_total", "sluice:num_preemptions_total", "sluice:prompt_tokens_total",
        "sluice:generation_tokens_total", "sluice:time_to_first_token_seconds_bucket",
        "sluice:inter_token_latency_seconds_bucket", "sluice:e2e_request_latency_seconds_count",
        "sluice:request_success_total", "sluice:accepting_requests", "sluice:admissible_workflows",
        "sluice:decode_yield_steps_total", "sluice:active_workflows", "sluice:max_active_workflows",
    ]:
        assert name in names, name
    assert metric(samples, "sluice:admissible_workflows") >= 1
    assert metric(samples, "sluice:kv_cache_blocks_total") == 16384 // 16
    assert metric(samples, "sluice:time_to_first_token_seconds_count") > 0
    assert metric(samples, "sluice:generation_tokens_total") > 0
    assert metric(samples, "sluice:request_success_total", finished_reason="length") > 0


def test_request_phase_histograms_split_each_request(server: RemoteServer, client: openai.OpenAI, model: str) -> None:
    """Queue, prefill and decode time of each finished request: one observation each, and
    together no longer than the request itself."""
    wait_until_idle(server)
    phases = ("queue", "prefill", "decode")
    before = scrape_metrics(server)
    resp = client.completions.create(model=model, prompt="Count: 1, 2, 3,", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 12
    wait_until_idle(server)
    after = scrape_metrics(server)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    for phase in phases:
        assert delta(f"sluice:request_{phase}_time_seconds_count") == 1, phase
        assert delta(f"sluice:request_{phase}_time_seconds_sum") >= 0, phase
    assert delta("sluice:request_decode_time_seconds_sum") > 0  # 11 tokens after the first
    engine_total = sum(delta(f"sluice:request_{phase}_time_seconds_sum") for phase in phases)
    assert 0 < engine_total <= delta("sluice:e2e_request_latency_seconds_sum")
    assert (delta("sluice:request_queue_time_seconds_sum") + delta("sluice:request_prefill_time_seconds_sum")
            <= delta("sluice:time_to_first_token_seconds_sum"))


def _long_chat_body(model: str, stream: bool) -> dict:
    return {"model": model, "messages": MESSAGES, "max_tokens": 1500, "ignore_eos": True, "stream": stream}


def test_client_disconnect_mid_stream_aborts(server: RemoteServer, model: str) -> None:
    aborted_before = metric(scrape_metrics(server), "sluice:request_success_total", finished_reason="abort")
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        with http.stream("POST", "/chat/completions", json=_long_chat_body(model, stream=True)) as resp:
            assert resp.status_code == 200
            events = []
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[len("data: "):]))
                if len(events) == 3:  # role chunk + two content chunks
                    load = httpx.get(server.url + "/load").json()
                    assert load["running"] + load["waiting"] == 1
                    break
    samples = wait_until_idle(server)
    assert metric(samples, "sluice:request_success_total", finished_reason="abort") == aborted_before + 1


def test_client_disconnect_while_waiting_for_full_response_aborts(server: RemoteServer, model: str) -> None:
    aborted_before = metric(scrape_metrics(server), "sluice:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/chat/completions", json=_long_chat_body(model, stream=False), timeout=2.0)
    samples = wait_until_idle(server)
    assert metric(samples, "sluice:request_success_total", finished_reason="abort") == aborted_before + 1


@pytest.mark.parametrize("text", ["", "plain", 'quote " and \\ backslash', "line\nbreak\ttab\r",
                                  "ctrl \x00\x01\x1f del \x7f", "é 中文 🙂 \u2028\u2029", "</script>"])
def test_text_chunk_template_is_the_pydantic_chunk(text):
    """The streaming fast path renders exactly the JSON value pydantic renders for the chunk."""
    import json

    from sluice.server.protocol import (ChatCompletionStreamChoice, ChatCompletionStreamResponse,
                                        CompletionChoice, CompletionResponse, DeltaMessage)
    from sluice.server.serving_base import TextChunkTemplate, sse_event

    def chat(t):
        return sse_event(ChatCompletionStreamResponse(id="chatcmpl-1", created=5, model="m", choices=[
            ChatCompletionStreamChoice(index=2, delta=DeltaMessage(content=t))]))

    def completion(t):
        return sse_event(CompletionResponse(id="cmpl-1", created=5, model="m",
                                            choices=[CompletionChoice(index=1, text=t)]))

    for render in (chat, completion):
        fast = TextChunkTemplate(render)(text)
        assert fast.startswith("data: ") and fast.endswith("\n\n")
        assert json.loads(fast[6:-2]) == json.loads(render(text)[6:-2])
        # one event is one line even for readers that split like str.splitlines (httpx)
        assert len(fast[:-2].splitlines()) == len(render(text)[:-2].splitlines()) == 1


SEPARATORS = "a\x85b\u2028c\u2029d"


def test_streamed_text_with_unicode_line_separators_stays_one_line_per_event(server: RemoteServer,
                                                                              model: str) -> None:
    """Text holding U+0085/U+2028/U+2029 (which JSON leaves raw) streams as one line per event for
    httpx's `iter_lines`, which splits like `str.splitlines`: the completion's echoed prompt and
    the Responses API's echoed instructions come back intact."""
    def events(path: str, body: dict) -> list[dict]:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            with http.stream("POST", path, json=body) as resp:
                assert resp.status_code == 200
                return [json.loads(line[6:]) for line in resp.iter_lines()
                        if line.startswith("data: ") and line != "data: [DONE]"]

    completion = events("/completions", {"model": model, "prompt": SEPARATORS, "echo": True,
                                         "max_tokens": 2, "temperature": 0, "stream": True})
    assert "".join(c["text"] for e in completion for c in e["choices"]).startswith(SEPARATORS)
    responses = events("/responses", {"model": model, "input": "Hi", "instructions": SEPARATORS,
                                      "max_output_tokens": 2, "stream": True, "store": False})
    assert responses[0]["type"] == "response.created"
    assert responses[0]["response"]["instructions"] == SEPARATORS


def test_speculative_server_streams_the_same_text(server: RemoteServer, model: str) -> None:
    """The default server speculates (prompt lookup): the official client's streamed greedy text,
    logprobs and usage equal those of a server with `--speculative-config none` (several tokens
    may arrive per chunk); bad values of the flag are a startup error; /metrics counts drafts and
    accepted tokens."""
    wait_until_idle(server)
    before = scrape_metrics(server)
    spec_client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    with RemoteServer(SERVER_ARGS + ["--speculative-config", "none"]) as plain_server:
        client = openai.OpenAI(base_url=plain_server.base_url, api_key="unused", max_retries=0, timeout=120)
        for prompt in (LONG_PROMPT, PROMPT):
            kw = dict(model=model, prompt=prompt, max_tokens=40, temperature=0, logprobs=2)
            plain = client.completions.create(**kw)
            chunks = list(spec_client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            assert text == plain.choices[0].text
            tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
            assert tokens == plain.choices[0].logprobs.tokens
            lps = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
            assert lps == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=0.3)   # bf16
            assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
            assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
                plain.choices[0].finish_reason]
        assert metric(wait_until_idle(plain_server), "sluice:spec_decode_num_draft_tokens_total") == 0
    m = wait_until_idle(server)
    drafted = (metric(m, "sluice:spec_decode_num_draft_tokens_total")
               - metric(before, "sluice:spec_decode_num_draft_tokens_total"))
    accepted = (metric(m, "sluice:spec_decode_num_accepted_tokens_total")
                - metric(before, "sluice:spec_decode_num_accepted_tokens_total"))
    assert 0 < accepted <= drafted
    proc = subprocess.run([sys.executable, "-m", "sluice.cli", "serve", "--speculative-config", '{"method": "eagle"}'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unsupported speculative method" in proc.stderr


def test_chat_template_and_default_kwargs_flags(tmp_path) -> None:
    """`--chat-template FILE` replaces the model's template; `--default-chat-template-kwargs` gives
    every chat its variables unless the request's `chat_template_kwargs` sets them; the request's
    `reasoning_effort` and `documents` reach the template as those variables. Bad values are a
    startup error."""
    from sluice.model.loader import load_tokenizer

    own = load_tokenizer(ensure_default_model()).info.chat_template
    template = tmp_path / "chat.jinja"
    template.write_text("[{{ greeting }}|{{ reasoning_effort | default('-') }}|{{ documents | default([]) | length }}]" + own)
    args = SERVER_ARGS + ["--chat-template", str(template), "--default-chat-template-kwargs", '{"greeting": "Ahoy"}']
    with RemoteServer(args) as remote:
        def prompt(**body) -> str:
            ids = post(remote, "/tokenize", {"messages": MESSAGES, **body})["tokens"]
            return post(remote, "/detokenize", {"tokens": ids})["prompt"]

        assert prompt().startswith("[Ahoy|-|0]")
        assert prompt(chat_template_kwargs={"greeting": "Hi"}).startswith("[Hi|-|0]")
        assert prompt(documents=[{"title": "a", "text": "b"}, {"title": "c", "text": "d"}]).startswith("[Ahoy|-|2]")
        client = openai.OpenAI(base_url=remote.base_url, api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
        high = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, reasoning_effort="high")
        assert high.usage.prompt_tokens > plain.usage.prompt_tokens     # "[Ahoy|high|0]" against "[Ahoy|-|0]"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {"messages": []}})
    for flags, message in ((["--chat-template", str(tmp_path / "missing.jinja")], "neither a file nor a Jinja template"),
                           (["--default-chat-template-kwargs", "[1]"], "must be a JSON object"),
                           (["--default-chat-template-kwargs", '{"tools": 1}'], "may not set tools")):
        proc = subprocess.run([sys.executable, "-m", "sluice.cli", "serve", *flags], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
