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


# GGUF block formats the kernels compute from: bytes of a 32-weight block in the file, and the
# packed tensor's dtype (linear_common.h).
BLOCK_FORMATS = {"q4_1": (20, torch.uint8), "q8_0": (34, torch.int8)}


def _check_blocks(kind: str, blocks: torch.Tensor) -> None:
    if kind not in BLOCK_FORMATS:
        raise ValueError(f"unknown block format {kind!r} (known: {sorted(BLOCK_FORMATS)})")
    width = BLOCK_FORMATS[kind][0]
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != width:
        raise ValueError(f"{kind} blocks must be uint8 [N, K / 32, {width}], not {blocks.dtype} {tuple(blocks.shape)}")


def block_values(kind: str, blocks: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """GGUF blocks [N, K / 32, bytes] (uint8) -> d [N, K / 32] (fp16), m (fp16; Q4_1 only, else
    None) and q [N, K]: Q4_1 uint8 0-15 (k 0-15 of a block in its bytes' low nibbles, 16-31 in the
    high ones), Q8_0 int8."""
    _check_blocks(kind, blocks)
    n, kb, _ = blocks.shape
    blocks = blocks.contiguous()
    d = blocks[:, :, 0:2].contiguous().view(torch.float16).reshape(n, kb)
    if kind == "q8_0":
        return d, None, blocks[:, :, 2:34].contiguous().view(torch.int8).reshape(n, kb * 32)
    m = blocks[:, :, 2:4].contiguous().view(torch.float16).reshape(n, kb)
    qs = blocks[:, :, 4:20]
    return d, m, torch.stack((qs & 0xF, qs >> 4), dim=2).reshape(n, kb * 32)


def pack_blocks(kind: str, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks [N, K / 32, bytes] of a weight [N, K] -> the kernel's packed layout
    (linear_common.h; flat, uint8 for Q4_1, int8 for Q8_0): per 16-column vector, per block of 32
    k, the 16 columns' d (and Q4_1's m), then per k pair the q of the bf16 layout's 32 lanes (column
    i / 2, parity i % 2): Q4_1 lanes 0-15 in low nibbles and 16-31 in high ones, Q8_0 a byte each."""
    d, m, q = block_values(kind, blocks)
    n, kb = d.shape
    if n % 16:
        raise ValueError(f"cannot pack {n} rows of {kind} blocks (a multiple of 16 needed)")
    v = n // 16
    # q[n, k] -> [vector, block, k pair in block, lane]: lane 2 c + parity for column c of the vector
    lanes = q.reshape(v, 16, kb, 16, 2).permute(0, 2, 3, 1, 4).reshape(v, kb, 16, 32)
    if kind == "q4_1":
        qbytes = (lanes[..., :16] | (lanes[..., 16:] << 4)).reshape(v, kb, 256)
    else:
        qbytes = lanes.contiguous().view(torch.uint8).reshape(v, kb, 512)
    scales = [t.reshape(v, 16, kb).permute(0, 2, 1).contiguous().view(torch.uint8).reshape(v, kb, 32)
              for t in ((d, m) if m is not None else (d,))]
    return torch.cat([*scales, qbytes], dim=2).reshape(-1).contiguous().view(BLOCK_FORMATS[kind][1])


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
                 blocks: Optional[tuple[str, torch.Tensor]] = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.silu_mul = silu_mul
        if silu_mul:
            if self.out_features % 32:
                raise ValueError("a fused gate/up projection needs a multiple of 32 rows")
            order = gate_up_order(self.out_features)
            weight = weight[order]
            bias = bias[order] if bias is not None else None
            blocks = (blocks[0], blocks[1][order]) if blocks is not None else None
        packed = pack_weight(weight.detach())
        self.format = "bf16"
        if blocks is not None:
            kind, raw = blocks
            quantized = pack_blocks(kind, raw)
            # Only where the kernel's dequantization gives these very weights, bit for bit.
            unpacked = torch.ops.sluice.linear_unpack_blocks(quantized, self.out_features, self.in_features)
            if torch.equal(unpacked.view(torch.int16), packed.view(torch.int16)):
                packed, self.format = quantized, kind
            else:
                logger.warning("%s blocks of a %s linear do not dequantize to its bf16 weight; kept bf16",
                               kind, tuple(weight.shape))
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
            # A GGUF's blocks of this weight, where the loader kept them (loader._attach_blocks).
            blocks = getattr(child, "gguf_blocks", None)
            setattr(parent, name, PackedLinear(child.weight, child.bias, silu_mul=fuse, blocks=blocks))
            if fuse:
                parent.gate_up_applies_act = True
            swapped += 1
    formats = [m.format for m in model.modules() if isinstance(m, PackedLinear)]
    logger.info("packed %d linear layers for the cpu kernel (%s)", swapped,
                ", ".join(f"{formats.count(f)} {f}" for f in sorted(set(formats))))
    return swapped
