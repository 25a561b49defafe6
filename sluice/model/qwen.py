"""Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE: the Llama skeleton with Qwen's attention flags.

- Qwen2: q/k/v projections always carry a bias, o_proj never does.
- Qwen3: per-head RMSNorm on q and k before the rotary embedding; `attention_bias` on all four.
- Qwen3-MoE: Qwen3 attention; the MLP of layer i is a softmax top-k mixture of experts unless i
  is in `mlp_only_layers` or (i + 1) is not a multiple of `decoder_sparse_step`.
"""
from __future__ import annotations

from torch import nn

from sluice.attention.base import AttentionBackend
from sluice.config import ModelConfig
from sluice.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from sluice.model.moe import FusedExperts, SparseMoeBlock, TopKRouter


def _refuse_sliding_window(cfg: ModelConfig) -> None:
    if cfg.extra.get("use_sliding_window"):
        raise ValueError(f"{cfg.architecture}: sliding-window attention is not supported")


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        _refuse_sliding_window(cfg)
        super().__init__(cfg, backend)

    def _attention(self, backend: AttentionBackend) -> LlamaAttention:
        return LlamaAttention(self.cfg, self.rotary, backend, qkv_bias=True, o_bias=False)

    def _make_layer(self, index: int, backend: AttentionBackend) -> nn.Module:
        cfg = self.cfg
        return LlamaDecoderLayer(cfg, self._attention(backend), LlamaMLP(cfg.hidden_size, cfg.intermediate_size))


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    def _attention(self, backend: AttentionBackend) -> LlamaAttention:
        return LlamaAttention(self.cfg, self.rotary, backend, qk_norm=True)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def _make_layer(self, index: int, backend: AttentionBackend) -> nn.Module:
        cfg, x = self.cfg, self.cfg.extra
        num_experts = x.get("num_experts", x.get("num_local_experts", 0))
        sparse = (index not in (x.get("mlp_only_layers") or []) and num_experts > 0
                  and (index + 1) % x.get("decoder_sparse_step", 1) == 0)
        if sparse:
            mlp: nn.Module = SparseMoeBlock(
                TopKRouter(cfg.hidden_size, num_experts, x["num_experts_per_tok"],
                           norm_topk_prob=x.get("norm_topk_prob", False)),
                FusedExperts(num_experts, cfg.hidden_size, x["moe_intermediate_size"]))
        else:
            mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size)
        return LlamaDecoderLayer(cfg, self._attention(backend), mlp)
