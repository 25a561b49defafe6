"""Turns one step's logits into sampled tokens (and logprobs), vectorised over the batch.

Order of operations, as in vLLM's sampler:
1. logprobs, when any row asks, from the raw model distribution `log_softmax(logits)`
   (vLLM 0.x's default): penalties, suppression, temperature and truncation do not change them.
   The rank is the 1-based rank of the sampled token in that distribution.
2. logit_bias (OpenAI's: added to the logits), then penalties: repetition penalty over prompt +
   output tokens (HF/vLLM: a positive logit is divided by it, a negative one multiplied), then
   OpenAI's frequency and presence penalties over output tokens:
   `logit -= frequency_penalty * count + presence_penalty * (count > 0)`.
3. suppression of `suppress_token_ids` (logit -inf), then `allowed_token_ids` and structured
   outputs' token masks (a disallowed token's logit -inf).
4. greedy rows take the argmax of the result; the other rows go through temperature, top-k,
   top-p and min-p, then sample with an exponential race `argmax(probs / q)`, q ~ Exp(1).
5. a row with a forced token (thinking_token_budget's end of a thought) yields it instead, as
   vLLM's thinking budget does after sampling's other processors; its logprobs are the raw ones.

A row with a generator draws its q from that generator alone, on a [V] tensor of its own, so its
tokens depend only on its generator's state, its params and its logits, never on the rest of the
batch. Rows without one share the device's default generator.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from sluice.engine.structured_output import apply_token_masks
from sluice.outputs import Logprob
from sluice.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """One sequence that samples a token this step, built by the engine."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]           # tokens generated so far by this sequence
    generator: Optional[torch.Generator]      # seeded from params.seed, on the logits' device; or None
    suppress_token_ids: Sequence[int] = ()    # ids not to sample now (EOS/stop ids before min_tokens)
    token_mask: Optional[torch.Tensor] = None  # structured outputs: [ceil(V / 32)] int32 bitmask of allowed ids
    forced_token_id: Optional[int] = None     # the token this row yields whatever it samples (a thought's forced end)


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                   # [B] int64, on the logits' device
    # Per row: {token_id: Logprob} with the sampled token first, then the top `params.logprobs`
    # tokens of the raw distribution; None for rows that did not ask (the list is None if none did).
    logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


class Sampler:
    def __init__(self, argmax: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        # Row-wise argmax of [B, V] logits (first maximum, as torch.argmax); a compiled one is
        # much faster on CPU, where torch's is a scalar loop over the vocabulary.
        self.argmax = argmax or _torch_argmax

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """Sample one token per row from `logits` [B, V] (any float dtype; left unmodified)."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        plain = [_is_plain_greedy(r) for r in rows]
        if all(plain):
            return SamplerOutput(token_ids=self.argmax(logits))
        if not any(plain):
            return self._general(logits, rows)
        # Only the rows that need the general path pay for it (a float32 copy of their [R, V]
        # logits and the transforms); plain greedy rows keep the compiled argmax.
        easy = torch.tensor([i for i, p in enumerate(plain) if p], device=logits.device)
        rest = [i for i, p in enumerate(plain) if not p]
        hard = torch.tensor(rest, device=logits.device)
        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        token_ids[easy] = self.argmax(logits.index_select(0, easy))
        sub = self._general(logits.index_select(0, hard), [rows[i] for i in rest])
        token_ids[hard] = sub.token_ids
        logprobs = None
        if sub.logprobs is not None:
            logprobs = [None] * len(rows)
            for j, i in enumerate(rest):
                logprobs[i] = sub.logprobs[j]
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _general(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        logits = logits.to(torch.float32, copy=True)  # [B, V]
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None  # [B, V]
        apply_logit_bias(logits, rows)
        apply_penalties(logits, rows)
        apply_suppression(logits, rows)
        apply_allowed(logits, rows)
        apply_masks(logits, rows)

        device = logits.device
        token_ids = torch.empty(len(rows), dtype=torch.long, device=device)  # [B]
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        random = [i for i, r in enumerate(rows) if not r.params.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=device)
            token_ids[idx] = self.argmax(logits[idx])
        if random:
            idx = torch.tensor(random, device=device)
            token_ids[idx] = _sample(logits[idx], [rows[i] for i in random])
        for i, r in enumerate(rows):
            if r.forced_token_id is not None:
                token_ids[i] = r.forced_token_id

        logprobs = _gather_logprobs(raw_logprobs, token_ids, rows) if raw_logprobs is not None else None
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _is_plain_greedy(row: SamplingRow) -> bool:
    p = row.params
    return (p.greedy and p.logprobs is None and not row.suppress_token_ids and row.token_mask is None
            and not _has_penalties(p) and not p.logit_bias and p.allowed_token_ids is None
            and row.forced_token_id is None)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Add each row's `logit_bias` to its logits [B, V] in place; ids >= V are ignored."""
    vocab = logits.shape[1]
    entries = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items() if t < vocab]
    if not entries:
        return
    index = torch.tensor([(i, t) for i, t, _ in entries], dtype=torch.long, device=logits.device)  # [N, 2]
    bias = torch.tensor([b for _, _, b in entries], dtype=logits.dtype, device=logits.device)
    logits.index_put_((index[:, 0], index[:, 1]), bias, accumulate=True)


def apply_allowed(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """-inf in logits [B, V] outside each row's `allowed_token_ids` (rows without the list: untouched)."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        allowed = r.params.allowed_token_ids
        if allowed is None:
            continue
        keep = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
        keep[torch.tensor([t for t in allowed if t < vocab], dtype=torch.long, device=logits.device)] = True
        logits[i].masked_fill_(~keep, float("-inf"))


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Repetition, then frequency and presence penalties, in place on float32 logits [B, V].

    Token counts come from one scatter-add over the concatenated id lists of the rows that use
    the penalty; the other rows contribute no ids, so the work scales with the rows that ask.
    """
    batch, vocab = logits.shape
    device = logits.device
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        ids = [
            (*r.prompt_token_ids, *r.output_token_ids) if r.params.repetition_penalty != 1.0 else ()
            for r in rows
        ]
        seen = token_counts(ids, batch, vocab, device) > 0  # [B, V]
        penalty = torch.tensor(
            [r.params.repetition_penalty for r in rows], dtype=torch.float32, device=device
        ).unsqueeze(1)  # [B, 1]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)  # [B, V]
        logits.copy_(torch.where(seen, penalised, logits))
    if any(r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0 for r in rows):
        ids = [
            r.output_token_ids
            if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
            else ()
            for r in rows
        ]
        counts = token_counts(ids, batch, vocab, device)  # [B, V]
        freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=torch.float32, device=device)
        pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=torch.float32, device=device)
        logits -= freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0)


def apply_suppression(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Set each row's `suppress_token_ids` to -inf in logits [B, V]; ids >= V are ignored."""
    vocab = logits.shape[1]
    pairs = [(i, t) for i, r in enumerate(rows) for t in r.suppress_token_ids if 0 <= t < vocab]
    if not pairs:
        return
    index = torch.tensor(pairs, dtype=torch.long, device=logits.device)  # [N, 2]
    logits[index[:, 0], index[:, 1]] = float("-inf")


def apply_masks(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Structured outputs: -inf in logits [B, V] for every token a row's bitmask disallows."""
    masked = [i for i, r in enumerate(rows) if r.token_mask is not None]
    if not masked:
        return
    index = torch.tensor(masked, dtype=torch.long, device=logits.device)
    sub = logits.index_select(0, index)
    apply_token_masks(sub, torch.stack([rows[i].token_mask for i in masked]).to(logits.device))
    logits.index_copy_(0, index, sub)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """Mask logits [R, V] in place outside each row's top-k (k = V: off) and top-p (p = 1: off).

    Top-k keeps every token tied with the k-th largest logit. Top-p then keeps the smallest set
    of most likely remaining tokens whose probability reaches p, and always the most likely one.
    """
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending, [R, V]
    kth_largest = sorted_logits.gather(1, (vocab - top_k).unsqueeze(1))  # [R, 1]
    sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
    drop = cum_probs <= (1.0 - top_p).unsqueeze(1)  # [R, V]
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> None:
    """Zero probs [R, V] below min_p [R] times the row's largest probability, in place."""
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [R, 1]
    probs.masked_fill_(probs < threshold, 0.0)


def token_counts(
    token_lists: Sequence[Sequence[int]], batch: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """How often each token id occurs in each row's list: [B, V] float32, via one scatter-add."""
    counts = torch.zeros(batch, vocab, dtype=torch.float32, device=device)
    lengths = [len(t) for t in token_lists]
    if sum(lengths) == 0:
        return counts
    flat = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long, device=device)  # [N]
    row_of = torch.repeat_interleave(
        torch.arange(batch, device=device), torch.tensor(lengths, device=device)
    )  # [N]
    counts.index_put_((row_of, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, then the exponential race; logits [R, V] -> [R]."""
    num_rows, vocab = logits.shape
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=device)
    logits.div_(temperature.unsqueeze(1))

    top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        apply_top_k_top_p(
            logits,
            torch.tensor(top_k, dtype=torch.long, device=device),
            torch.tensor(top_p, dtype=torch.float32, device=device),
        )
    probs = logits.softmax(dim=-1)  # [R, V]
    if any(r.params.min_p > 0.0 for r in rows):
        apply_min_p(probs, torch.tensor([r.params.min_p for r in rows], dtype=torch.float32, device=device))

    q = torch.empty_like(probs)  # [R, V]
    seeded = [i for i, r in enumerate(rows) if r.generator is not None]
    if len(seeded) < num_rows:
        q.exponential_()
    for i in seeded:
        q[i].exponential_(generator=rows[i].generator)
    # exponential_ may return exactly 0; a tiny floor keeps masked tokens at 0 / q = 0, not NaN.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


def _gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, rows: Sequence[SamplingRow]
) -> list[Optional[dict[int, Logprob]]]:
    """Sampled token's logprob and 1-based rank, plus the top `params.logprobs`, per asking row."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    idx = torch.tensor(wanted, device=logprobs.device)
    entries = logprob_entries(logprobs[idx], token_ids[idx], [rows[i].params.logprobs or 0 for i in wanted],
                              [rows[i].params.logprob_token_ids for i in wanted])
    out: list[Optional[dict[int, Logprob]]] = [None] * len(rows)
    for i, entry in zip(wanted, entries):
        out[i] = entry
    return out


def logprob_entries(lp: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int],
                    listed: Optional[Sequence[Optional[Sequence[int]]]] = None) -> list[dict[int, Logprob]]:
    """Per row of log-probabilities `lp` [W, V]: {token: Logprob} with `token_ids[w]`'s logprob and
    1-based rank first, then the top `num_top[w]` (sampled tokens here; the prompt's own tokens in
    model_runner's prompt logprobs), or, where `listed[w]` names tokens, those tokens instead."""
    chosen = token_ids.unsqueeze(1)  # [W, 1]
    chosen_lp = lp.gather(1, chosen)  # [W, 1]
    chosen_rank = (lp > chosen_lp).sum(dim=-1) + 1  # [W]
    listed = listed or [None] * len(num_top)
    k_max = max((k for k, ids in zip(num_top, listed) if ids is None), default=0)
    top_lp, top_ids = lp.topk(k_max, dim=-1)  # [W, k]
    out = []
    for w, (tid, value, rank, ids, values, k) in enumerate(zip(
            chosen.squeeze(1).tolist(), chosen_lp.squeeze(1).tolist(), chosen_rank.tolist(), top_ids.tolist(),
            top_lp.tolist(), num_top)):
        entry = {tid: Logprob(tid, value, rank)}
        if listed[w] is not None:
            named = torch.tensor(listed[w], dtype=torch.long, device=lp.device)
            named_lp = lp[w].index_select(0, named)                               # [n]
            named_rank = (lp[w].unsqueeze(0) > named_lp.unsqueeze(1)).sum(dim=-1) + 1
            for t, v, r in zip(listed[w], named_lp.tolist(), named_rank.tolist()):
                entry.setdefault(t, Logprob(t, v, r))
        else:
            for r, (t, v) in enumerate(zip(ids[:k], values[:k]), start=1):
                entry.setdefault(t, Logprob(t, v, r))
        out.append(entry)
    return out
