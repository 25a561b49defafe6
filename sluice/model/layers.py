"""Building blocks shared by the model architectures."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like transformers; `forward(x, residual)` fuses the residual add.

    With `fused` set (by `use_cpu_kernels`), bfloat16 [T, H] inputs go through one compiled op
    (`torch.ops.sluice.rms_norm`) that rounds exactly where this torch code does."""

    fused = False

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused and x.dim() == 2 and x.dtype == torch.bfloat16 and self.weight.dtype == torch.bfloat16:
            out, s = torch.ops.sluice.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, s)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] -> [T, I]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def embedding(num_embeddings: int, dim: int) -> nn.Embedding:
    """An `nn.Embedding` without its random init: the checkpoint fills it. Models are built on the
    meta device, where `normal_` goes through torch's reference ops and imports torch._dynamo
    (~3 s of every server start)."""
    return nn.Embedding(num_embeddings, dim, _weight=torch.empty(num_embeddings, dim))


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half, as transformers' Llama) with a cos/sin table.

    With `fused` set (by `use_cpu_kernels`), bfloat16 q/k are rotated in place by one compiled op
    (`torch.ops.sluice.rotary_`)."""

    fused = False

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: Optional[dict] = None, rotary_dim: Optional[int] = None) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        # The tables are computed on the CPU even when the model is built on the meta device (where
        # these ops would import torch._dynamo, ~3 s); to_empty() then replaces them (see loader).
        inv_freq = 1.0 / (theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device="cpu").float()
                                    / self.rotary_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            max_position = int(max_position)
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {rope_type!r}")
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)                                   # [P, rotary_dim / 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, H, D], k: [T, KVH, D]
        if self.fused and q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16 and positions.dtype == torch.int64:
            torch.ops.sluice.rotary_(q, k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)                             # [T, 1, rotary_dim / 2]
        sin = self.sin[positions].unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        xr = x[..., :rd].float()
        x1, x2 = xr.chunk(2, dim=-1)
        rot = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        if rd == x.shape[-1]:
            return rot
        return torch.cat((rot, x[..., rd:]), dim=-1)
