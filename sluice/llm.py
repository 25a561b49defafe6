"""The offline API: `LLM(model).generate(prompts, params)`."""
from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from sluice.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig, parse_dtype, reasoning_tags
from sluice.engine.llm_engine import LLMEngine
from sluice.model.loader import load_model_config, resolve_model_path
from sluice.outputs import RequestOutput
from sluice.sampling_params import STREAM_FINAL_ONLY, SamplingParams

Prompt = Union[str, list[int]]


class LLM:
    def __init__(
        self,
        model: Optional[str] = None,
        dtype: str | torch.dtype = "bfloat16",
        max_model_len: Optional[int] = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        kv_cache_tokens: Optional[int] = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        scheduling_policy: str = "fcfs",
        attention_backend: str = "auto",
        seed: int = 0,
        kv_cache_gib: Optional[float] = None,         # instead of kv_cache_tokens
        max_state_snapshots: Optional[int] = None,    # hybrid models (see CacheConfig)
        speculative_config: Optional[dict] = None,    # e.g. {"method": "ngram"}; see SpeculativeConfig
        huge_pages: bool = True,                      # weights and KV cache on transparent huge pages
        weight_format: str = "auto",                  # "native": a GGUF's Q4_1/Q8_0 linears kept in blocks; "bf16"; "auto": by path
        chat_template: Optional[str] = None,          # a Jinja template's text, in place of the model's own
        reasoning_parser: Optional[str] = None,       # a thinking model's tags (thinking_token_budget)
        reasoning_config: Optional[dict] = None,      # vLLM's --reasoning-config keys
    ) -> None:
        path: Path = resolve_model_path(model)
        cfg = load_model_config(path)
        max_len = max_model_len or cfg.max_position_embeddings
        self.engine = LLMEngine(EngineConfig(
            model_path=str(path),
            model=cfg,
            cache=CacheConfig(block_size=block_size, kv_cache_gib=kv_cache_gib,
                              kv_cache_tokens=None if kv_cache_gib is not None else
                              kv_cache_tokens or max(max_len, 16384),
                              enable_prefix_caching=enable_prefix_caching, max_state_snapshots=max_state_snapshots),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_len, policy=scheduling_policy),
            dtype=parse_dtype(dtype) if isinstance(dtype, str) else dtype,
            seed=seed,
            attention_backend=attention_backend,
            huge_pages=huge_pages,
            weight_format=weight_format,
            speculative=SpeculativeConfig.from_dict(speculative_config) if speculative_config is not None else None,
            chat_template=chat_template,
            reasoning=reasoning_tags(reasoning_parser, reasoning_config),
        ))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run all prompts to completion in one continuous batch; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = []
        for prompt, p in zip(prompts, plist, strict=True):
            rid = f"offline-{next(self._ids)}"
            tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if p.stream_interval is None:   # only the final outputs are read: no output per step
                p = dataclasses.replace(p, stream_interval=STREAM_FINAL_ONLY)
            self.engine.add_request(rid, tokens, p)
            ids.append(rid)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[r] for r in ids]

    def chat(self, messages: list[dict], params: Optional[SamplingParams] = None,
             tools: Optional[list[dict]] = None) -> RequestOutput:
        """One chat reply; `tools` (OpenAI's function definitions) are rendered as the server
        renders them. The reply is text: `sluice.server.tool_calls.parse_tool_calls` finds calls."""
        from sluice.server.tool_calls import prepare_chat

        messages, tools = prepare_chat(messages, tools, self.tokenizer.info.chat_template)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        return self.generate([self.tokenizer.encode(text, add_special_tokens=False)], params)[0]
