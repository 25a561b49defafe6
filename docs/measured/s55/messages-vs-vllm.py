"""Session 55: the same Anthropic Messages API calls to sluice and to vLLM 0.32 (both serving the
default model as `smollm2-135m`, both with `--enable-auto-tool-choice --tool-call-parser hermes`),
through the official anthropic client; prints each answer's shape (fields, block types, stop
reason, usage keys, event sequence) side by side, and the texts, so differences are visible.

    python docs/measured/s55/messages-vs-vllm.py http://127.0.0.1:8000 http://127.0.0.1:8100
"""
from __future__ import annotations

import json
import sys

import anthropic
import httpx

MODEL = "smollm2-135m"
GREEDY = {"temperature": 0}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"name": "get_weather", "description": "The current weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
FEW_SHOT = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_0", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "text", "text": "What is the weather in Berlin?"}]},
]


def probe(base: str) -> dict:
    client = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=120)
    out: dict = {}
    msg = client.messages.create(model=MODEL, system="You answer in one sentence.", messages=QUESTION,
                                 max_tokens=40, extra_body=GREEDY)
    out["text"] = {"keys": sorted(msg.model_dump(exclude_none=True)), "blocks": [b.type for b in msg.content],
                   "stop_reason": msg.stop_reason, "usage": msg.usage.model_dump(exclude_none=True),
                   "text": msg.content[0].text if msg.content else None}
    cut = client.messages.create(model=MODEL, messages=QUESTION, max_tokens=3, extra_body=GREEDY)
    out["cut"] = {"stop_reason": cut.stop_reason, "output_tokens": cut.usage.output_tokens}
    stop = client.messages.create(model=MODEL, messages=QUESTION, max_tokens=40, extra_body=GREEDY,
                                  stop_sequences=["Paris"])
    out["stop_sequence"] = {"stop_reason": stop.stop_reason, "stop_sequence": stop.stop_sequence,
                            "text": stop.content[0].text if stop.content else None}
    raw = httpx.post(base + "/v1/messages", json={"model": MODEL, "messages": QUESTION, "max_tokens": 8,
                                                  "stream": True, **GREEDY}, timeout=120).text
    out["stream_events"] = [line.removeprefix("event: ") for line in raw.splitlines() if line.startswith("event: ")]
    tool = client.messages.create(model=MODEL, messages=FEW_SHOT, tools=TOOLS, max_tokens=48, extra_body=GREEDY)
    out["tool"] = {"blocks": [b.model_dump(exclude={"id"}) for b in tool.content], "stop_reason": tool.stop_reason}
    with client.messages.stream(model=MODEL, messages=FEW_SHOT, tools=TOOLS, max_tokens=48, extra_body=GREEDY) as s:
        final = s.get_final_message()
    out["tool_streamed"] = {"blocks": [b.model_dump(exclude={"id"}) for b in final.content],
                            "stop_reason": final.stop_reason}
    forced = client.messages.create(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=48, extra_body=GREEDY,
                                    tool_choice={"type": "tool", "name": "get_weather"})
    out["forced"] = {"blocks": [b.model_dump(exclude={"id"}) for b in forced.content], "stop_reason": forced.stop_reason}
    out["count_tokens"] = client.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens
    bad = httpx.post(base + "/v1/messages", json={"model": MODEL, "messages": QUESTION}, timeout=60)
    out["error_missing_max_tokens"] = {"status": bad.status_code, "body_keys": sorted(bad.json()),
                                       "error": bad.json().get("error")}
    return out


def main() -> None:
    results = {base: probe(base) for base in sys.argv[1:]}
    for key in next(iter(results.values())):
        print(f"## {key}")
        for base, res in results.items():
            print(f"  {base}: {json.dumps(res[key], ensure_ascii=False)}")


if __name__ == "__main__":
    main()
