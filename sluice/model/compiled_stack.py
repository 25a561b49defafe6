"""A Llama model's decoder layers in one compiled call (`torch.ops.sluice.decoder_stack`).

`LlamaForCausalLM.forward` loops over its layers in Python: on the CPU kernels that is ~10 module
calls and ~8 op dispatches per layer, 4-6 ms per step for a 30-layer model at any batch size,
a third of a single sequence's decode step. `decoder_stack` (sluice/attention/cpu/stack.cpp) runs
the same kernels in the same order on the same tensors from C++, so its output is bit-identical.

`use_cpu_kernels` attaches a `CompiledDecoderStack` to a model whose every layer has exactly the
shape the op covers (`unsupported_reason` says why not otherwise); the Python loop stays the
reference and the path for everything else (mixtures of experts, other dtypes, recurrent state).
Biases on the projections (Qwen2's q/k/v, Llama's attention_bias and mlp_bias) and Qwen3's per-head
q/k norms are covered: the op adds the biases where the packed kernels do and runs the norms as
RMSNorm's torch ops.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sluice.attention.base import AttentionMetadata


def unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why `model`'s layers cannot run as one decoder_stack call, or None if they can."""
    from sluice.attention.cpu import MAX_GROUP, SUPPORTED_HEAD_DIMS
    from sluice.model.layers import RMSNorm, RotaryEmbedding
    from sluice.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
    from sluice.model.packed_linear import PackedLinear

    if not isinstance(model, LlamaForCausalLM) or type(model).forward is not LlamaForCausalLM.forward:
        return f"{type(model).__name__} has its own forward"
    def fused_norm(norm: nn.Module) -> bool:  # what sluice::rms_norm takes, with the model's eps
        return (isinstance(norm, RMSNorm) and norm.fused and norm.weight.dtype == torch.bfloat16
                and norm.eps == model.norm.eps)

    if not fused_norm(model.norm):
        return "final norm is not the fused kernel"
    for i, layer in enumerate(model.layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(layer) is not LlamaDecoderLayer or type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
            return f"layer {i} is not a plain Llama layer"
        if attn.q_norm is not None and not all(
                isinstance(n, RMSNorm) and n.weight.dtype == torch.bfloat16 and n.eps == model.norm.eps
                for n in (attn.q_norm, attn.k_norm)):
            return f"layer {i}'s q/k norms are not bfloat16 RMSNorms with the model's eps"
        if (attn.q_norm is None) != (model.layers[0].self_attn.q_norm is None):
            return f"layer {i} differs from the first in normalizing q/k"
        if getattr(attn.backend, "name", None) != "cpu":
            return f"layer {i} does not use the cpu attention backend"
        if attn.head_dim not in SUPPORTED_HEAD_DIMS or attn.num_heads // attn.num_kv_heads > MAX_GROUP:
            return f"layer {i}'s head shape is not one the attention kernel covers"
        if not (isinstance(attn.rotary, RotaryEmbedding) and attn.rotary.fused):
            return f"layer {i}'s rotary embedding is not the fused kernel"
        if not (fused_norm(layer.input_layernorm) and fused_norm(layer.post_attention_layernorm)):
            return f"layer {i}'s norms are not fused bfloat16 norms with the model's eps"
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if not all(type(p) is PackedLinear for p in linears):
            return f"layer {i} has unpacked projections"
        if not mlp.gate_up_proj.silu_mul:  # (pack_linear_layers fuses no other projection)
            return f"layer {i}'s MLP is not a fused gate/up projection"
        if attn.rotary is not model.layers[0].self_attn.rotary or attn.scale != model.layers[0].self_attn.scale:
            return f"layer {i} has its own rotary table or scale"
    return None


class CompiledDecoderStack:
    """Holds the per-layer tensors `decoder_stack` takes (the modules' own tensors, not copies)."""

    def __init__(self, model: nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"decoder_stack cannot run this model: {reason}")
        layers = list(model.layers)
        attn0 = layers[0].self_attn
        self.input_norms = [l.input_layernorm.weight for l in layers]
        self.qkv = [l.self_attn.qkv_proj.packed for l in layers]
        self.o_proj = [l.self_attn.o_proj.packed for l in layers]
        self.post_norms = [l.post_attention_layernorm.weight for l in layers]
        self.gate_up = [l.mlp.gate_up_proj.packed for l in layers]
        self.down = [l.mlp.down_proj.packed for l in layers]
        self.final_norm = model.norm.weight
        # per projection: no biases at all ([]), or each layer's (None where it has none)
        self.qkv_bias, self.o_bias, self.gate_up_bias, self.down_bias = (
            self._biases([l.get_submodule(part).bias for l in layers]) for part in
            ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
        qk_norm = attn0.q_norm is not None
        self.q_norms = [l.self_attn.q_norm.weight for l in layers] if qk_norm else []
        self.k_norms = [l.self_attn.k_norm.weight for l in layers] if qk_norm else []
        self.rotary = attn0.rotary
        self.num_heads, self.head_dim = attn0.num_heads, attn0.head_dim
        self.intermediate_size = layers[0].mlp.gate_up_proj.out_features // 2
        self.eps, self.scale = model.norm.eps, attn0.scale
        self._op = torch.ops.sluice.decoder_stack

    def supports(self, x: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata) -> bool:
        """Whether this step's inputs are what the op covers (else the caller runs the Python loop)."""
        k_cache = kv_caches[0][0]
        return (meta.state is None and x.dtype == torch.bfloat16 and positions.dtype == torch.int64
                and k_cache.dtype == torch.bfloat16 and k_cache.device.type == "cpu")

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, hidden] embeddings -> [T, hidden] final-normed hidden states
        return self._op(x, positions, self.input_norms, self.qkv, self.o_proj, self.post_norms, self.gate_up,
                        self.down, [kv[0] for kv in kv_caches], [kv[1] for kv in kv_caches], meta.slot_mapping,
                        meta.query_start_loc, meta.seq_lens, meta.block_tables, self.rotary.cos, self.rotary.sin,
                        self.final_norm, self.qkv_bias, self.o_bias, self.gate_up_bias, self.down_bias,
                        self.q_norms, self.k_norms, self.num_heads, self.head_dim, self.intermediate_size, self.eps, self.scale)

    @staticmethod
    def _biases(biases: list[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
        return [] if all(b is None for b in biases) else biases
