"""Mixtral: Mistral attention with a softmax top-k (renormalised) mixture of experts in every layer.

Checkpoints name the block `block_sparse_moe` and the expert projections w1 (gate), w3 (up) and
w2 (down); `_RENAMES` maps them onto the fused experts layer.
"""
from __future__ import annotations

from torch import nn

from sluice.attention.base import AttentionBackend
from sluice.config import ModelConfig
from sluice.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from sluice.model.moe import FusedExperts, SparseMoeBlock, TopKRouter


class MixtralForCausalLM(LlamaForCausalLM):
    _RENAMES = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                (".w2.", ".down_proj."))

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        if cfg.extra.get("sliding_window") is not None:
            raise ValueError(f"{cfg.architecture}: sliding-window attention is not supported")
        super().__init__(cfg, backend)

    def _make_layer(self, index: int, backend: AttentionBackend) -> nn.Module:
        cfg, x = self.cfg, self.cfg.extra
        num_experts = x.get("num_local_experts", x.get("num_experts"))
        moe = SparseMoeBlock(TopKRouter(cfg.hidden_size, num_experts, x["num_experts_per_tok"], norm_topk_prob=True),
                             FusedExperts(num_experts, cfg.hidden_size, cfg.intermediate_size))
        return LlamaDecoderLayer(cfg, LlamaAttention(cfg, self.rotary, backend), moe)
