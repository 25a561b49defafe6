"""GLM-4.5 / GLM-4.6 (`Glm4MoeForCausalLM`).

- Attention: `attention_bias` on q/k/v only (o_proj has none), optional per-head q/k RMSNorm
  (`use_qk_norm`), and a partial rotary embedding: only the first
  `head_dim * partial_rotary_factor` dims of each head rotate, neox style (rotate_half over
  that slice, as transformers' `apply_rotary_pos_emb`), the rest pass through.
- MLP: the first `first_k_dense_replace` layers are dense; the others are a DeepSeek-V3 style
  mixture: sigmoid scores, `e_score_correction_bias` for choosing, grouped top-k (`n_group`,
  `topk_group`), `norm_topk_prob`, `routed_scaling_factor`, plus `n_shared_experts` always-on
  experts fused into one MLP of width `n_shared_experts * moe_intermediate_size`.
- The router weight and correction bias stay float32 whatever the model dtype.
- Checkpoints carry `num_nextn_predict_layers` multi-token-prediction layers after the last
  decoder layer; the loader skips them.
"""
from __future__ import annotations

from torch import nn

from sluice.attention.base import AttentionBackend
from sluice.config import ModelConfig
from sluice.model.layers import RotaryEmbedding
from sluice.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from sluice.model.moe import FusedExperts, SparseMoeBlock, TopKRouter


def partial_rotary_factor(cfg: ModelConfig) -> float:
    rope = cfg.extra.get("rope_parameters") or {}
    return float(rope.get("partial_rotary_factor", cfg.extra.get("partial_rotary_factor", 0.5)))


def glm_router(cfg: ModelConfig) -> TopKRouter:
    """The GLM MoE router (GLM-4.5/4.6 and GLM-5.3): sigmoid scores with a correction bias,
    grouped top-k, in float32, from the checkpoint config."""
    x = cfg.extra
    return TopKRouter(cfg.hidden_size, x["n_routed_experts"], x["num_experts_per_tok"], scoring="sigmoid",
                      norm_topk_prob=x.get("norm_topk_prob", True), correction_bias=True,
                      n_group=x.get("n_group", 1), topk_group=x.get("topk_group", 1),
                      routed_scaling_factor=x.get("routed_scaling_factor", 1.0), fp32=True)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    def _make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        rotary_dim = int(cfg.head_dim * partial_rotary_factor(cfg))
        return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                               rotary_dim=rotary_dim)

    def _make_layer(self, index: int, backend: AttentionBackend) -> nn.Module:
        cfg, x = self.cfg, self.cfg.extra
        attn = LlamaAttention(cfg, self.rotary, backend, qkv_bias=cfg.attention_bias, o_bias=False,
                              qk_norm=bool(x.get("use_qk_norm", False)))
        if index < x.get("first_k_dense_replace", 0):
            return LlamaDecoderLayer(cfg, attn, LlamaMLP(cfg.hidden_size, cfg.intermediate_size))
        num_experts, width = x["n_routed_experts"], x["moe_intermediate_size"]
        gate = glm_router(cfg)
        shared = x.get("n_shared_experts") or 0
        moe = SparseMoeBlock(gate, FusedExperts(num_experts, cfg.hidden_size, width),
                             LlamaMLP(cfg.hidden_size, width * shared) if shared else None)
        return LlamaDecoderLayer(cfg, attn, moe)
