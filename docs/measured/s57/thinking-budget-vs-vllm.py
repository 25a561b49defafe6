"""Session 57: `thinking_token_budget` called the same way on sluice and on vLLM 0.32, both serving the
default model as `smollm2-135m` with `--reasoning-parser glm45 --reasoning-config
'{"reasoning_end_str": " Time to answer.</think>"}'` (the forced end is a transition phrase). Greedy
replies to two prompts: the few-shot chat of tests/test_server_reasoning.py (the model opens and closes
its own thought) and a completion whose prompt opens the thought (`<think>\\n` after the generation
prompt: the prompt's own thought token counts); then structured outputs with a thought: a regex on the
few-shot chat with a `<think>` prefill (the prompt opens the thought), on the plain few-shot chat (it opens
none) and on the opened completion. Prints each server's answers side by side.

    python docs/measured/s57/thinking-budget-vs-vllm.py http://127.0.0.1:8000 http://127.0.0.1:8100
"""
from __future__ import annotations

import json
import sys

import anthropic
import httpx
import openai

MODEL = "smollm2-135m"
THINK_SHOT = [
    {"role": "user", "content": "What is 2 plus 2?"},
    {"role": "assistant", "content": "<think>Two plus two makes four.</think>The answer is 4."},
    {"role": "user", "content": "What is 3 plus 3?"},
    {"role": "assistant", "content": "<think>Three plus three makes six.</think>The answer is 6."},
    {"role": "user", "content": "What is 5 plus 5?"},
]
OPENED = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
          "<|im_start|>user\nWhat is 5 plus 5? Think step by step.<|im_end|>\n<|im_start|>assistant\n<think>\n")
BUDGETS = [None, -1, 0, 1, 3, 8, 11, 40]


def probe(base: str) -> dict:
    out: dict = {}
    c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)

    def attempt(name, fn):
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 -- a peer's failure is a result here
            out[name] = f"ERROR {type(e).__name__}: {str(e)[:300]}"

    for b in BUDGETS:
        extra = {} if b is None else {"thinking_token_budget": b}

        def chat(extra=extra):
            m = c.chat.completions.create(model=MODEL, messages=THINK_SHOT, max_tokens=60, temperature=0,
                                          extra_body=extra).choices[0].message
            return {"reasoning": (m.model_extra or {}).get("reasoning"), "content": m.content}
        attempt(f"chat budget={b}", chat)

        def opened(extra=extra):
            r = c.completions.create(model=MODEL, prompt=OPENED, max_tokens=40, temperature=0, extra_body=extra)
            return r.choices[0].text
        attempt(f"completion (prompt opens the thought) budget={b}", opened)

    def stream():
        reasoning, content = "", ""
        for ch in c.chat.completions.create(model=MODEL, messages=THINK_SHOT, max_tokens=60, temperature=0, stream=True,
                                            extra_body={"thinking_token_budget": 3}):
            for choice in ch.choices:
                d = choice.delta.model_dump(exclude_none=True)
                reasoning += d.get("reasoning") or ""
                content += d.get("content") or ""
        return {"reasoning": reasoning, "content": content}
    attempt("chat streamed budget=3", stream)

    def messages():
        a = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=300)
        m = a.messages.create(model=MODEL, max_tokens=60, messages=THINK_SHOT, extra_body={"temperature": 0},
                              thinking={"type": "enabled", "budget_tokens": 3})
        return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content]
    attempt("messages budget_tokens=3", messages)

    regex = {"structured_outputs": {"regex": r"The answer is \d+\."}}
    prefill = {"continue_final_message": True, "add_generation_prompt": False}
    opened_chat = THINK_SHOT + [{"role": "assistant", "content": "<think>"}]
    for name, messages, extra in (("prefill <think>", opened_chat, {**prefill, **regex}),
                                  ("prefill <think> + budget 3", opened_chat,
                                   {**prefill, **regex, "thinking_token_budget": 3}),
                                  ("no thought opened", THINK_SHOT, regex)):
        def constrained(messages=messages, extra=extra):
            m = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                          extra_body=extra).choices[0]
            return {"reasoning": (m.message.model_extra or {}).get("reasoning"), "content": m.message.content,
                    "finish": m.finish_reason}
        attempt(f"chat regex, {name}", constrained)

    def constrained_completion():
        r = c.completions.create(model=MODEL, prompt=OPENED, max_tokens=60, temperature=0,
                                 extra_body={**regex, "thinking_token_budget": 4})
        return {"text": r.choices[0].text, "finish": r.choices[0].finish_reason}
    attempt("completion regex + budget 4 (prompt opens the thought)", constrained_completion)

    def bad():
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": THINK_SHOT, "max_tokens": 4, "thinking_token_budget": -2})
        return f"{r.status_code} {r.text[:160]}"
    attempt("budget=-2", bad)
    return out


def main() -> None:
    results = [probe(base) for base in sys.argv[1:]]
    for key in results[0]:
        print(f"== {key}")
        for base, r in zip(sys.argv[1:], results):
            print(f"  {base}: {json.dumps(r[key], ensure_ascii=False)}")
        if len(results) == 2:
            print(f"  same: {results[0][key] == results[1][key]}")


if __name__ == "__main__":
    main()
