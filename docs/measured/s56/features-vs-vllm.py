"""Session 56: the session's features called the same way on sluice and on vLLM 0.32, both serving the
default model as `smollm2-135m` with `--enable-auto-tool-choice --tool-call-parser glm47
--reasoning-parser glm45`: reasoning (chat whole and streamed, Responses items, Anthropic thinking
blocks) and GLM-format tool calls on the few-shot prompts of tests/test_server_reasoning.py,
`repetition_detection` and `stream_interval` on a completion. Prints each server's answers side by
side (shapes and texts), so differences are visible.

    python docs/measured/s56/features-vs-vllm.py http://127.0.0.1:8000 http://127.0.0.1:8100
"""
from __future__ import annotations

import json
import sys

import anthropic
import openai

MODEL = "smollm2-135m"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
TOOL_SHOT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "user", "content": "What is the weather in Berlin?"},
]
THINK_SHOT = [
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "<think>Two plus two makes four.</think>The answer is 4."},
    {"role": "user", "content": "What is 3 plus 3?"},
    {"role": "assistant", "content": "<think>Three plus three makes six.</think>The answer is 6."},
    {"role": "user", "content": "What is 5 plus 5?"},
]
GREEDY = {"max_tokens": 120, "temperature": 0}


def probe(base: str) -> dict:
    out: dict = {}
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)

    def attempt(name, fn):
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 -- a peer's failure is a result here
            out[name] = f"ERROR {type(e).__name__}: {str(e)[:300]}"

    def chat():
        m = c.chat.completions.create(model=MODEL, messages=THINK_SHOT, **GREEDY).choices[0].message
        return {"content": m.content, **{k: v for k, v in (m.model_extra or {}).items() if v is not None}}
    attempt("chat", chat)

    def chat_stream():
        keys, reasoning, content = set(), "", ""
        for ch in c.chat.completions.create(model=MODEL, messages=THINK_SHOT, stream=True, **GREEDY):
            for choice in ch.choices:
                d = choice.delta.model_dump(exclude_none=True)
                keys |= set(d)
                reasoning += d.get("reasoning") or d.get("reasoning_content") or ""
                content += d.get("content") or ""
        return {"delta keys": sorted(keys), "reasoning": reasoning, "content": content}
    attempt("chat stream", chat_stream)

    def responses():
        r = c.responses.create(model=MODEL, input=THINK_SHOT, max_output_tokens=120, temperature=0)
        return [item.model_dump(exclude_none=True, include={"type", "content", "summary"}) for item in r.output]
    attempt("responses", responses)

    def messages():
        a = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=300)
        m = a.messages.create(model=MODEL, max_tokens=120, messages=THINK_SHOT, extra_body={"temperature": 0})
        return [b.model_dump(exclude={"signature", "citations"}, exclude_none=True) for b in m.content]
    attempt("messages", messages)

    def plain():      # a reply that does not think: where does it go?
        m = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                      max_tokens=20, temperature=0).choices[0].message
        return {"content": m.content, **{k: v for k, v in (m.model_extra or {}).items() if v is not None}}
    attempt("plain question (no thought)", plain)

    def glm_call():
        m = c.chat.completions.create(model=MODEL, messages=TOOL_SHOT, tools=TOOLS, **GREEDY).choices[0]
        return {"finish_reason": m.finish_reason, "content": m.message.content,
                "tool_calls": [(t.function.name, t.function.arguments) for t in m.message.tool_calls or []],
                **{k: v for k, v in (m.message.model_extra or {}).items() if v is not None}}
    attempt("glm tool call", glm_call)

    def repetition():
        kw = dict(model=MODEL, prompt="la la la la la la la la", max_tokens=30, temperature=0)
        r = c.completions.create(**kw, extra_body={"repetition_detection": {"max_pattern_size": 2, "min_count": 3}})
        return {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason,
                "stop_reason": (r.choices[0].model_extra or {}).get("stop_reason"), "tokens": r.usage.completion_tokens}
    attempt("repetition_detection", repetition)

    def interval():
        chunks = c.completions.create(model=MODEL, prompt="The capital of France is Paris. The capital of Germany is",
                                      max_tokens=21, temperature=0, stream=True,
                                      extra_body={"stream_interval": 5, "ignore_eos": True, "return_token_ids": True})
        return [len(ch.choices[0].model_extra.get("token_ids") or []) for ch in chunks if ch.choices]
    attempt("stream_interval 5: token ids per chunk", interval)
    return out


if __name__ == "__main__":
    results = {base: probe(base) for base in sys.argv[1:]}
    for name in next(iter(results.values())):
        print(f"## {name}")
        for base, res in results.items():
            print(f"{base}: {json.dumps(res[name], ensure_ascii=False)}")
        print()
