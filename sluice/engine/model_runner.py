"""Turns a SchedulerOutput into one forward pass over the flattened batch, then samples."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from torch import nn

from sluice import hugepages
from sluice.attention.base import AttentionMetadata, StateMetadata
from sluice.config import EngineConfig
from sluice.engine.request import Request
from sluice.engine.sampler import Sampler, SamplingRow, logprob_entries
from sluice.engine.scheduler import SchedulerOutput
from sluice.engine.spec_decode import accept
from sluice.engine.state_pool import StateLayout
from sluice.engine.structured_output import leaves_a_token
from sluice.model.registry import model_cache_spec
from sluice.outputs import Logprob


@dataclass
class RunnerOutput:
    # One entry per sampling request, in the order of SchedulerOutput.scheduled: the tokens the
    # step yields for it (one; or, verifying drafts, the accepted drafts and one sampled token).
    sampled_token_ids: list[list[int]]
    # Per entry, None or one {token: Logprob} per yielded token (None if no request asked).
    logprobs: Optional[list[Optional[list[dict[int, Logprob]]]]]
    # Requests computing prompt positions for their prompt logprobs: request id -> the entries of
    # the prompt tokens after those its `prompt_logprobs` list holds, in order.
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)


def kv_bytes_per_token(config: EngineConfig) -> int:
    spec = model_cache_spec(config.model)
    if spec is not None:
        return max(1, spec.bytes_per_token(config.dtype))
    m = config.model
    return 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * torch.finfo(config.dtype).bits // 8


def _compiled_argmax(model: nn.Module):
    """The cpu backend's row-wise argmax when the model runs on that backend, else None (torch's)."""
    backends = {getattr(m, "backend", None) for m in model.modules()}
    if any(getattr(b, "name", None) == "cpu" for b in backends):
        return torch.ops.sluice.argmax_rows
    return None


class ModelRunner:
    def __init__(self, config: EngineConfig, model: nn.Module, num_blocks: int,
                 state: Optional[StateLayout] = None) -> None:
        """`state`: a hybrid model's recurrent-state slots, as engine/cache_plan.py planned them."""
        self.config = config
        self.model = model
        self.block_size = config.cache.block_size
        m = config.model
        spec = model_cache_spec(m)
        self.state_tensors: list[torch.Tensor] = []   # hybrid models: every [num_slots, ...] state tensor
        if spec is None:
            shape = (num_blocks, self.block_size, m.num_key_value_heads, m.head_dim)
            # [layers][k|v]: [num_blocks, block_size, num_kv_heads, head_dim]
            flat = hugepages.zeros([(shape, config.dtype)] * (2 * m.num_hidden_layers), config.huge_pages)
            self.kv_caches = list(zip(flat[0::2], flat[1::2]))
        else:
            # [layers][the layer's tensors]: paged [num_blocks, block_size, ...] or state [num_slots, ...]
            self.kv_caches = spec.allocate(num_blocks, self.block_size, state.num_slots if state else 0,
                                           config.dtype, config.huge_pages)
            self.state_tensors = [t for layer, specs in zip(self.kv_caches, spec.layers)
                                  for t, s in zip(layer, specs) if not s.paged]
        self.sampler = Sampler(argmax=_compiled_argmax(model))

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        entries = list(zip(out.scheduled, out.samples))
        # Single-token queries first: the attention backends batch them as decodes.
        order = sorted(range(len(entries)), key=lambda i: entries[i][0][1] != 1)
        spec = out.spec_tokens
        input_ids, positions, meta = self._prepare([entries[i][0] for i in order], spec)
        if self.state_tensors:
            self._init_states(out.state_inits)
            meta.state = self._state_meta([entries[i][0][0] for i in order], out.state_saves)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)          # [T, hidden]
        scoring = [(j, req, n) for j, (req, n) in enumerate(entries[i][0] for i in order) if req.needs_prompt_logprobs]
        prompt_lps = {}
        if scoring:
            starts = meta.query_start_loc.tolist()
            prompt_lps = {req.request_id: self._prompt_logprobs(req, n, hidden, starts[j]) for j, req, n in scoring}

        # Logits at each sampling entry's last position; a speculating entry's last 1 + k.
        ends = meta.query_start_loc[1:].tolist()
        rows: list[SamplingRow] = []
        hidden_rows: list[int] = []
        first_row: dict[str, int] = {}
        for j, i in enumerate(order):
            if not entries[i][1]:
                continue
            req = entries[i][0][0]
            drafts = spec.get(req.request_id, ())
            first_row[req.request_id] = len(rows)
            hidden_rows.extend(range(ends[j] - 1 - len(drafts), ends[j]))
            rows.extend(self._rows(req, drafts))
        if not rows:
            return RunnerOutput([], None, prompt_lps)
        index = torch.tensor(hidden_rows, dtype=torch.int64)
        logits = self.model.compute_logits(hidden.index_select(0, index))       # [N, vocab]
        sampled = self.sampler(logits, rows)
        tokens = sampled.token_ids.tolist()
        # Back to scheduler order, speculations verified.
        ids, lps = [], ([] if sampled.logprobs is not None else None)
        for (req, _), s in entries:
            if not s:
                continue
            r0 = first_row[req.request_id]
            drafts = spec.get(req.request_id)
            got = accept(drafts, tokens[r0:r0 + len(drafts) + 1]) if drafts else [tokens[r0]]
            ids.append(got)
            if lps is not None:
                entry = sampled.logprobs[r0:r0 + len(got)]
                lps.append(None if entry[0] is None else entry)
        return RunnerOutput(ids, lps, prompt_lps)

    # Rows of logits at a time for prompt logprobs: [rows, vocab] float32 is 25 MB for SmolLM2.
    PROMPT_LOGPROB_ROWS = 128

    def _prompt_logprobs(self, req: Request, n: int, hidden: torch.Tensor, start: int) -> list[dict[int, Logprob]]:
        """The logprob entries this step's chunk of `req` (n tokens, query rows from `start`) gives for
        the prompt tokens after those `req.prompt_logprobs` holds: position p's logits score token
        p + 1 (the last prompt position's are the first sample's, not the prompt's)."""
        computed, have = req.num_computed_tokens, len(req.prompt_logprobs)
        assert computed <= have - 1, "a prefix-cache hit went past the prompt logprobs (scheduler)"
        first = have - 1                                                 # positions [first, last)
        last = min(computed + n, req.num_prompt_tokens - 1)
        if last <= first:
            return []
        k = req.params.prompt_logprobs or 0
        entries: list[dict[int, Logprob]] = []
        for p0 in range(first, last, self.PROMPT_LOGPROB_ROWS):
            p1 = min(last, p0 + self.PROMPT_LOGPROB_ROWS)
            rows = hidden[start + p0 - computed:start + p1 - computed]
            lp = torch.log_softmax(self.model.compute_logits(rows).float(), dim=-1)      # [r, vocab]
            target = torch.tensor(req.prompt_token_ids[p0 + 1:p1 + 1], dtype=torch.int64)
            entries.extend(logprob_entries(lp, target, [k] * len(target)))
        return entries

    def _init_states(self, inits: list[tuple[int, Optional[int]]]) -> None:
        """Newly admitted requests' state slots: zeros, or a copy of a prefix-cache snapshot."""
        for slot, src in inits:
            for t in self.state_tensors:
                if src is None:
                    t[slot].zero_()
                else:
                    t[slot].copy_(t[src])

    @staticmethod
    def _state_meta(reqs: list[Request], saves: dict[str, tuple[int, int]]) -> StateMetadata:
        slots = [r.state_slot for r in reqs]
        return StateMetadata(slots=torch.tensor(slots, dtype=torch.int64), slots_list=slots,
                             saves=[saves.get(r.request_id) for r in reqs])

    @staticmethod
    def _rows(req: Request, drafts) -> list[SamplingRow]:
        """The sampling rows of a request: one, or one per verified position, each seeing the
        drafts before it as generated output (and, with structured outputs, the grammar's mask
        after them, once a thought the prompt opened has closed; with a thinking budget, the token
        forced after them)."""
        masks = req.grammar_masks(drafts)
        forced = req.forced_token_ids(drafts)
        rows = []
        for i in range(len(drafts) + 1):
            mask = masks[i] if masks is not None else None
            suppress = req.suppressed_token_ids(i)
            if suppress and mask is not None and not leaves_a_token(mask, suppress):
                suppress = ()   # min_tokens yields where the grammar allows nothing but an end
            if req.bad_words is not None:
                banned = req.banned_token_ids(drafts[:i])
                if banned and (mask is None or leaves_a_token(mask, (*suppress, *banned))):
                    suppress = (*suppress, *banned)   # (a grammar that allows only banned ids wins)
            rows.append(SamplingRow(params=req.params, prompt_token_ids=req.prompt_token_ids,
                                    output_token_ids=[*req.output_token_ids, *drafts[:i]] if i else req.output_token_ids,
                                    generator=req.generator, suppress_token_ids=suppress, token_mask=mask,
                                    forced_token_id=forced[i] if forced is not None else None))
        return rows

    def _prepare(self, scheduled: list[tuple[Request, int]], spec: Optional[dict[str, list[int]]] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        pos_parts, slot_parts = [], []
        qlens, seq_lens = [], []
        max_blocks = max(len(r.blocks) for r, _ in scheduled)
        tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        for i, (req, n) in enumerate(scheduled):
            c = req.num_computed_tokens
            if spec and req.request_id in spec:
                ids.extend(req.all_token_ids[c:])        # its last token, then the drafts
                ids.extend(spec[req.request_id])
            else:
                ids.extend(req.all_token_ids[c:c + n])
            block_ids = np.fromiter((b.block_id for b in req.blocks), dtype=np.int64, count=len(req.blocks))
            tables[i, :len(block_ids)] = block_ids
            pos = np.arange(c, c + n, dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(block_ids[pos // bs] * bs + pos % bs)
            qlens.append(n)
            seq_lens.append(c + n)
        qsl = np.zeros(len(scheduled) + 1, dtype=np.int32)
        np.cumsum(qlens, out=qsl[1:])
        num_decodes = 0
        while num_decodes < len(qlens) and qlens[num_decodes] == 1:
            num_decodes += 1
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slot_parts)),
            query_start_loc=torch.from_numpy(qsl),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.from_numpy(tables),
            num_decodes=num_decodes,
            max_query_len=max(qlens),
            max_seq_len=max(seq_lens),
            query_lens_list=qlens,
            seq_lens_list=seq_lens,
        )
        return (torch.tensor(ids, dtype=torch.int64), torch.from_numpy(np.concatenate(pos_parts)), meta)
