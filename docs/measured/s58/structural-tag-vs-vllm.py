"""Structural tags side by side: the same few-shot completions call (the model's examples call
get_weather with {"city": ...}; the tag's schema asks for {"town": ...}) to `sluice serve` (port
8000) and to vLLM 0.32 (port 8100), greedy, 40 tokens, with the constraint sent as
response_format and as structured_outputs.structural_tag. Run once per vLLM backend:

    python docs/measured/s58/structural-tag-vs-vllm.py LABEL >> docs/measured/s58/structural-tag-vs-vllm.txt
"""
import json
import sys

import httpx

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["town"], "properties": {"town": {"type": "string"}}}
TAGGED = {"triggers": ["<function="],
          "structures": [{"begin": "<function=get_weather>", "schema": SCHEMA, "end": "</function>"}]}
PROMPT = ('Q: What is the weather in Paris?\nA: <function=get_weather>{"city": "Paris"}</function>\n'
          'Q: What is the weather in Rome?\nA:')
BODIES = {
    "none": {},
    "response_format": {"response_format": {"type": "structural_tag", **TAGGED}},
    "structured_outputs": {"structured_outputs": {"structural_tag": json.dumps(TAGGED)}},
}
print(f"== {sys.argv[1] if len(sys.argv) > 1 else ''}")
for side, url in (("sluice", "http://127.0.0.1:8000/v1"), ("vllm", "http://127.0.0.1:8100/v1")):
    for how, extra in BODIES.items():
        r = httpx.post(f"{url}/completions", timeout=120, json={
            "model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 40, "temperature": 0, **extra})
        if r.status_code != 200:
            print(f"  {side:6s} {how:18s} HTTP {r.status_code}: {r.text[:200]}")
            continue
        c = r.json()["choices"][0]
        print(f"  {side:6s} {how:18s} {c['finish_reason']:6s} {c['text']!r}")
