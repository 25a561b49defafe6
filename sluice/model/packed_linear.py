"""Linear layers on the compiled CPU kernel (sluice/attention/cpu/linear.cpp).

After the weights are loaded, `pack_linear_layers` replaces every bfloat16 `nn.Linear` whose shape
the kernel covers with a `PackedLinear` holding the weight in the kernel's packed layout (the
original is dropped: the packed copy is the only one, so memory does not grow), and gives each
`LlamaMLP` a gate/up projection that applies silu(gate) * up in the same pass. Weights shared with
another module (a tied LM head) are packed into a copy and the original stays with its other user.

The kernel streams each weight once per step at any row count; the measurements that made it the
default are in docs/benchmarks.md ("Linear layers").
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import nn

from sluice import hugepages

logger = logging.getLogger(__name__)

GROUP = 64  # output columns per packed group (kGroupCols in linear.cpp)


def can_pack(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n % 16 == 0 and k % 2 == 0


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the kernel's layout: per group of 64 output columns (the last may be 16, 32 or
    48), per k pair, each column's (W[n][k], W[n][k+1]); flat, N * K elements."""
    n, k = weight.shape
    if not can_pack(weight):
        raise ValueError(f"cannot pack a {tuple(weight.shape)} {weight.dtype} weight")
    full = n // GROUP
    parts = []
    if full:
        parts.append(weight[:full * GROUP].reshape(full, GROUP, k // 2, 2).permute(0, 2, 1, 3).reshape(-1))
    if n % GROUP:
        parts.append(weight[full * GROUP:].reshape(n % GROUP, k // 2, 2).permute(1, 0, 2).reshape(-1))
    return torch.cat(parts).contiguous()


def q4_1_values(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 blocks [N, K / 32, 20] (uint8: fp16 d, fp16 m, 16 bytes of 4-bit q: k 0-15 in the
    low nibbles, 16-31 in the high ones) -> d [N, K / 32] and m (fp16), q [N, K] (uint8, 0-15)."""
    n, kb, width = blocks.shape
    if blocks.dtype != torch.uint8 or width != 20:
        raise ValueError(f"Q4_1 blocks must be uint8 [N, K / 32, 20], not {blocks.dtype} {tuple(blocks.shape)}")
    blocks = blocks.contiguous()
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).reshape(n, kb)
    m = blocks[:, :, 2:4].contiguous().view(torch.float16).reshape(n, kb)
    qs = blocks[:, :, 4:20]
    q = torch.stack((qs & 0xF, qs >> 4), dim=2).reshape(n, kb * 32)
    return d, m, q


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks [N, K / 32, 20] -> float32 [N, K], as gguf computes it: d * q + m in float32."""
    d, m, q = q4_1_values(blocks)
    n, kb = d.shape
    w = d.float().reshape(n, kb, 1) * q.reshape(n, kb, 32).float() + m.float().reshape(n, kb, 1)
    return w.reshape(n, kb * 32)


def pack_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks [N, K / 32, 20] of a weight [N, K] -> the kernel's packed Q4_1 layout (uint8, flat;
    linear_common.h): per 16-column vector, per block of 32 k, the 16 columns' d and m, then per k
    pair 16 bytes whose low nibbles are columns 0-7's (k, k + 1) pairs and high nibbles 8-15's."""
    d, m, q = q4_1_values(blocks)
    n, kb = d.shape
    if n % 16:
        raise ValueError(f"cannot pack {n} rows as Q4_1 (a multiple of 16 needed)")
    v = n // 16
    # q[n, k] -> [vector, column in vector, block, k pair in block, parity]
    q5 = q.reshape(v, 16, kb, 16, 2)
    lo = q5[:, :8].permute(0, 2, 3, 1, 4).reshape(v, kb, 16, 16)   # [vector, block, pair, lane]
    hi = q5[:, 8:].permute(0, 2, 3, 1, 4).reshape(v, kb, 16, 16)
    nibbles = (lo | (hi << 4)).reshape(v, kb, 256)
    scales = [t.reshape(v, 16, kb).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(v, kb, 32) for t in (d, m)]
    return torch.cat([scales[0], scales[1], nibbles], dim=2).reshape(-1).contiguous()


def gate_up_order(n: int) -> torch.Tensor:
    """Row order of a [gate; up] projection (each n / 2 rows) for the fused kernel: every packed
    group holds 32 gate rows then the 32 matching up rows (16 and 16 in a last, narrower group)."""
    half = n // 2
    idx = []
    for start in range(0, half, GROUP // 2):
        width = min(GROUP // 2, half - start)
        idx.extend(range(start, start + width))
        idx.extend(range(half + start, half + start + width))
    return torch.tensor(idx, dtype=torch.int64)


class PackedLinear(nn.Module):
    """`y = x @ W^T + b` for bfloat16 `x` of any leading shape, through the packed kernel.

    With `silu_mul`, W is a [gate; up] projection of 2 I rows and the output is silu(gate) * up,
    I wide (what `silu_and_mul(linear(x))` computes, with both halves rounded to bf16 first).
    """

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], silu_mul: bool = False,
                 q4_1: Optional[torch.Tensor] = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.silu_mul = silu_mul
        if silu_mul:
            if self.out_features % 32:
                raise ValueError("a fused gate/up projection needs a multiple of 32 rows")
            order = gate_up_order(self.out_features)
            weight = weight[order]
            bias = bias[order] if bias is not None else None
            q4_1 = q4_1[order] if q4_1 is not None else None
        packed = pack_weight(weight.detach())
        self.format = "bf16"
        if q4_1 is not None:
            q4 = pack_q4_1(q4_1)
            # Only where the kernel's dequantization gives these very weights, bit for bit.
            unpacked = torch.ops.sluice.linear_q4_unpack(q4, self.out_features, self.in_features)
            if torch.equal(unpacked.view(torch.int16), packed.view(torch.int16)):
                packed, self.format = q4, "q4_1"
            else:
                logger.warning("Q4_1 blocks of a %s linear do not dequantize to its bf16 weight; kept bf16",
                               tuple(weight.shape))
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)
        self._op = torch.ops.sluice.linear_bf16_silu_mul if silu_mul else torch.ops.sluice.linear_bf16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = self._op(x2, self.packed, self.out_features, self.bias)
        return y.reshape(*lead, y.shape[-1])

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, silu_mul={self.silu_mul}, "
                f"format={self.format}")


def use_cpu_kernels(model: nn.Module, huge_pages: bool = False) -> int:
    """Move a bfloat16 model onto the compiled CPU kernels: packed linears (below), fused RMSNorm
    and rotary, and, when every layer fits it, the whole decoder stack as one call
    (sluice/model/compiled_stack.py). Needs the cpu backend's extension, already loaded. Returns
    the linears packed."""
    from sluice.model.compiled_stack import CompiledDecoderStack, unsupported_reason
    from sluice.model.layers import RMSNorm, RotaryEmbedding

    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding)):
            module.fused = True
    swapped = pack_linear_layers(model)
    if huge_pages:  # before the compiled stack takes references to the packed weights
        hugepages.move_module(model)
    reason = unsupported_reason(model)
    if reason is None:
        model.compiled_stack = CompiledDecoderStack(model)
        logger.info("decoder layers run as one compiled call")
    else:
        logger.info("decoder layers run in Python: %s", reason)
    return swapped


def pack_linear_layers(model: nn.Module) -> int:
    """Swap the model's packable bfloat16 linears for PackedLinear; returns how many were swapped.

    Needs `torch.ops.sluice.linear_bf16` (the cpu backend's extension, already loaded)."""
    from sluice.model.llama import LlamaMLP

    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or not can_pack(child.weight):
                continue
            fuse = isinstance(parent, LlamaMLP) and name == "gate_up_proj" and child.out_features % 32 == 0
            # A GGUF's Q4_1 blocks of this weight, where the loader kept them (loader._attach_q4_1).
            q4_1 = getattr(child, "q4_1", None)
            setattr(parent, name, PackedLinear(child.weight, child.bias, silu_mul=fuse, q4_1=q4_1))
            if fuse:
                parent.gate_up_applies_act = True
            swapped += 1
    q4 = sum(1 for m in model.modules() if isinstance(m, PackedLinear) and m.format == "q4_1")
    logger.info("packed %d linear layers for the cpu kernel (%d from Q4_1 blocks)", swapped, q4)
    return swapped
