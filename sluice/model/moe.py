"""Mixture-of-experts layers: top-k routers and a fused experts layer over stacked weights.

The experts layer holds every expert's gate/up and down projections in two stacked tensors,
`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (the layout of transformers 5, so fused
checkpoints load by name and per-expert checkpoints load expert by expert into slices). One
step's computation, whatever the number of tokens or experts:

1. flatten the (token, k) assignments and sort them by expert (a stable argsort), so each
   expert's rows are contiguous; expert e owns rows `offsets[e-1]:offsets[e]`;
2. gather the token rows in that order and run two grouped matmuls over the groups (gate/up,
   then down), with silu(gate) * up in between (clamped first where the model sets a
   `swiglu_limit`);
3. scale each row by its routing weight, scatter back to (token, k) order and sum over k.

The grouped matmul is `torch._grouped_mm` where the platform has it (one kernel over all
groups; CPU and recent CUDA), else one batched matmul over the experts that received tokens,
with their rows padded to the largest group. No Python loop over experts or tokens.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sluice.model.layers import silu_and_mul

# (device type, dtype) -> whether torch._grouped_mm runs there; probed once per pair.
_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


def _grouped_mm_available(x: torch.Tensor, w: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    # Its kernels want 16-byte aligned strides on both operands (w may be a transposed view).
    if any(n * x.element_size() % 16 for n in w.shape[1:]):
        return False
    key = (x.device.type, x.dtype)
    if key not in _GROUPED_MM_OK:
        try:
            a = torch.zeros(4, 8, dtype=x.dtype, device=x.device)
            b = torch.zeros(2, 8, 8, dtype=x.dtype, device=x.device)
            torch._grouped_mm(a, b, offs=torch.tensor([2, 4], dtype=torch.int32, device=x.device))
            _GROUPED_MM_OK[key] = True
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM_OK[key] = False
    return _GROUPED_MM_OK[key]


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *, use_kernel: Optional[bool] = None
               ) -> torch.Tensor:
    """Rows of `x` [M, K] grouped by expert times that expert's matrix `w` [E, K, N] -> [M, N].

    `offsets` [E] int32 holds the cumulative group sizes: expert e owns rows
    `offsets[e-1]:offsets[e]` (empty groups allowed). `use_kernel` forces (True) or avoids
    (False) `torch._grouped_mm`; None picks it where available.
    """
    if use_kernel is None:
        use_kernel = _grouped_mm_available(x, w)
    if use_kernel:
        return torch._grouped_mm(x, w, offs=offsets)
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).to(torch.int64)   # [E]
    hit = counts.nonzero().squeeze(1)                                            # [G] experts with rows
    counts = counts[hit]
    group = torch.repeat_interleave(torch.arange(len(hit), device=x.device), counts)  # [M]
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(x.shape[0], device=x.device) - starts[group]                 # [M] row within group
    padded = x.new_zeros(len(hit), int(counts.max()) if len(hit) else 0, x.shape[1])  # [G, C, K]
    padded[group, slot] = x
    return torch.bmm(padded, w[hit])[group, slot]                                    # [M, N]


def swiglu(gate_up: torch.Tensor, limit: Optional[float] = None) -> torch.Tensor:
    """[T, 2 * I] -> [T, I]: silu(gate) * up; with `limit` (GLM-5.3's `swiglu_limit`), gate is
    clamped to at most `limit` and up to [-limit, limit] first."""
    if limit is None:
        return silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, *, use_kernel: Optional[bool] = None,
                  swiglu_limit: Optional[float] = None) -> torch.Tensor:
    """sum_k weight[t, k] * expert_{ids[t, k]}(x[t]) for every token, as grouped matmuls.

    x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; topk_ids [T, K] int; topk_weights [T, K].
    """
    t, k = topk_ids.shape
    num_experts = gate_up.shape[0]
    flat = topk_ids.reshape(-1)                                                   # [T*K]
    order = torch.argsort(flat, stable=True)                                      # assignments by expert
    offsets = torch.cumsum(torch.bincount(flat, minlength=num_experts), 0).to(torch.int32)  # [E]
    rows = x[order // k]                                                          # [T*K, H]
    h = grouped_mm(rows, gate_up.transpose(1, 2), offsets, use_kernel=use_kernel)  # [T*K, 2I]
    h = grouped_mm(swiglu(h, swiglu_limit), down.transpose(1, 2), offsets, use_kernel=use_kernel)  # [T*K, H]
    h = h * topk_weights.reshape(-1)[order, None].to(h.dtype)
    out = torch.empty_like(h)
    out[order] = h                                                                # back to (token, k) order
    return out.view(t, k, -1).sum(dim=1)                                          # [T, H]


class FusedExperts(nn.Module):
    """E SwiGLU experts in stacked tensors; `forward(x, topk_ids, topk_weights)`."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 swiglu_limit: Optional[float] = None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights,
                             swiglu_limit=self.swiglu_limit)


class TopKRouter(nn.Module):
    """Scores every expert for every token and picks `top_k` of them.

    - `scoring`: "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (GLM-4.5, DeepSeek-V3);
    - `correction_bias`: an `e_score_correction_bias` [E] added to the scores for choosing only;
      the weights are the unbiased scores of the chosen experts;
    - `n_group` / `topk_group`: experts form `n_group` equal groups, each scored by the sum of
      its two best (biased) scores; only experts of the best `topk_group` groups are eligible;
    - `norm_topk_prob`: renormalise the chosen weights to sum to one;
    - `routed_scaling_factor`: multiply the final weights.
    `fp32` keeps the router weight in float32 and scores in float32 (GLM's checkpoints and
    transformers do); otherwise the logits are computed in the model dtype, scores in float32.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *, scoring: str = "softmax",
                 norm_topk_prob: bool = True, correction_bias: bool = False, n_group: int = 1,
                 topk_group: int = 1, routed_scaling_factor: float = 1.0, fp32: bool = False) -> None:
        super().__init__()
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported expert scoring function {scoring!r}")
        if num_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"{num_experts} experts cannot form {n_group} groups choosing {topk_group}")
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32 if fp32 else None))
        self.e_score_correction_bias = (nn.Parameter(torch.empty(num_experts, dtype=torch.float32))
                                        if correction_bias else None)
        self.top_k = top_k
        self.scoring = scoring
        self.norm_topk_prob = norm_topk_prob
        self.n_group = n_group
        self.topk_group = topk_group
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, K] int64, topk_weights [T, K] float32)."""
        logits = F.linear(x.to(self.weight.dtype), self.weight).float()            # [T, E]
        scores = logits.softmax(dim=-1) if self.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.n_group > 1:
            t, e = choice.shape
            grouped = choice.view(t, self.n_group, e // self.n_group)              # [T, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)               # [T, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)
        ids = choice.topk(self.top_k, dim=-1).indices                              # [T, K]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor


class SparseMoeBlock(nn.Module):
    """Router + fused experts (+ optional always-on shared experts, summed in)."""

    def __init__(self, gate: TopKRouter, experts: FusedExperts, shared_experts: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)                                        # [T, H]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
