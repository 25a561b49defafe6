"""What structured outputs cost the engine: a batch of chat requests decoded free and then
constrained (a JSON schema, the same one for every request, as agent traffic sends it), straight
into LLMEngine with `sluice serve`'s speculative decoding.

Prints, for each mode: wall time, output tokens/s, steps, and (constrained) the time spent in
the grammar (token masks for every sampled position, matcher advances, draft validation), in total
and per step, beside the step's forward time.

    .venv/bin/python benchmarks/structured_outputs.py [--requests 32] [--max-tokens 128]
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 6}'] [--repeats 2]
"""
from __future__ import annotations

import argparse
import statistics
import time

from sluice.cli import parse_speculative_config
from sluice.config import CacheConfig, EngineConfig, SchedulerConfig
from sluice.engine import structured_output
from sluice.engine.llm_engine import LLMEngine
from sluice.model.loader import load_model_config, resolve_model_path
from sluice.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "skills"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}}
SUBJECTS = ["software engineer", "pilot", "chef", "gardener", "violinist", "nurse", "carpenter", "teacher"]


class _Timer:
    """Wraps GrammarState's methods to add up the time spent in them."""

    def __init__(self) -> None:
        self.total = 0.0
        self.calls = 0

    def wrap(self, cls, name: str) -> None:
        fn = getattr(cls, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total += time.perf_counter() - t0
                self.calls += 1

        setattr(cls, name, timed)


def run(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    steps, forward, out_tokens = 0, 0.0, 0
    texts = {}
    t0 = time.perf_counter()
    while eng.has_unfinished():
        s0 = time.perf_counter()
        outs = eng.step()
        forward += time.perf_counter() - s0
        steps += 1
        for o in outs:
            if o.finished:
                out_tokens += len(o.outputs[0].token_ids)
                texts[o.request_id] = (o.outputs[0].text, o.outputs[0].finish_reason)
    wall = time.perf_counter() - t0
    return {"wall": wall, "steps": steps, "tokens": out_tokens, "tok_s": out_tokens / wall, "texts": texts}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 6}')
    args = ap.parse_args()

    path = resolve_model_path(args.model)
    mcfg = load_model_config(path)
    eng = LLMEngine(EngineConfig(
        model_path=str(path), model=mcfg, cache=CacheConfig(kv_cache_tokens=65536),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512,
                                  max_model_len=mcfg.max_position_embeddings),
        speculative=parse_speculative_config(args.speculative_config)))
    tok = eng.tokenizer
    prompts = []
    for i in range(args.requests):
        subject = SUBJECTS[i % len(SUBJECTS)]
        messages = [{"role": "user", "content": f"Describe a fictional {subject} number {i} as a JSON object "
                                                f"with name, age, city and skills."}]
        prompts.append(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True),
                                  add_special_tokens=False))
    timer = _Timer()
    for name in ("masks", "consume", "valid_prefix", "rollback"):
        timer.wrap(structured_output.GrammarState, name)
    spec = StructuredOutputsParams(json=SCHEMA)
    eng.grammars.compile(spec)   # as the server does before the request reaches the engine
    modes = {
        "free": SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
        "json_schema": SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=spec),
    }
    run(eng, prompts[:4], modes["free"])   # warm-up
    print(f"{args.requests} requests, max_tokens {args.max_tokens}, speculative {args.speculative_config}")
    print("| mode | repeat | wall s | output tokens | tok/s | steps | grammar ms (per step) | finished by stop |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode, params in modes.items():
            timer.total, timer.calls = 0.0, 0
            r = run(eng, prompts, params)
            rates[mode].append(r["tok_s"])
            stops = sum(1 for _, reason in r["texts"].values() if reason == "stop")
            g = f"{timer.total * 1e3:.0f} ({timer.total * 1e3 / r['steps']:.2f})" if mode != "free" else "-"
            print(f"| {mode} | {rep} | {r['wall']:.2f} | {r['tokens']} | {r['tok_s']:.1f} | {r['steps']} | {g} | "
                  f"{stops}/{len(prompts)} |")
    print(f"median tok/s: free {statistics.median(rates['free']):.1f}, "
          f"json_schema {statistics.median(rates['json_schema']):.1f}")
    st = eng.stats()
    print(f"drafts {st.spec_draft_tokens_total}, accepted {st.spec_accepted_tokens_total}")


if __name__ == "__main__":
    main()
