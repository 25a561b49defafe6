"""The Llama family (Llama 2/3, SmolLM, Mistral) over a flattened varlen batch and a paged KV cache."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from sluice.attention.base import AttentionBackend, AttentionMetadata
from sluice.config import ModelConfig
from sluice.model.layers import RMSNorm, RotaryEmbedding, silu_and_mul


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.rotary = rotary
        self.backend = backend
        self.scale = self.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)                                              # [T, q + 2 kv]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, backend)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, x, residual, kv_cache, meta):
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """`forward` returns final hidden states [T, hidden]; `compute_logits` projects selected rows."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, self.rotary, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                                     # [T, hidden]
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)                                          # [N, vocab]

    # Checkpoint names -> (parameter, shard index) for fused projections.
    _FUSED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters, one tensor at a time."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        q_size = self.cfg.num_attention_heads * self.cfg.head_dim
        kv_size = self.cfg.num_key_value_heads * self.cfg.head_dim
        inter = self.cfg.intermediate_size
        shard_ranges = {
            "qkv_proj": [(0, q_size), (q_size, kv_size), (q_size + kv_size, kv_size)],
            "gate_up_proj": [(0, inter), (inter, inter)],
        }
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            parts = name.split(".")
            fused = next((p for p in parts if p in self._FUSED), None)
            if fused is not None:
                target, shard = self._FUSED[fused]
                pname = name.replace(fused, target)
                start, size = shard_ranges[target][shard]
                param = params[pname]
                if tensor.shape[0] != size or tensor.shape[1:] != param.shape[1:]:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {pname}")
                param.data[start:start + size].copy_(tensor)
                loaded.add(f"{pname}#{shard}")
                continue
            if name not in params:
                raise ValueError(f"unexpected checkpoint tensor {name}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
            params[name].data.copy_(tensor)
            loaded.add(name)
        expected = set()
        for pname in params:
            base = pname.rsplit(".", 1)[0].rsplit(".", 1)[-1]
            if base in shard_ranges and pname.endswith(".weight"):
                expected.update(f"{pname}#{i}" for i in range(len(shard_ranges[base])))
            elif base in shard_ranges:  # fused biases
                expected.update(f"{pname}#{i}" for i in range(len(shard_ranges[base])))
            elif not (pname == "lm_head.weight" and self.cfg.tie_word_embeddings):
                expected.add(pname)
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")
