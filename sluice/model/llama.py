"""The Llama family (Llama 2/3, SmolLM, Mistral) over a flattened varlen batch and a paged KV cache.

`LlamaForCausalLM` is also the skeleton the other dense and mixture-of-experts architectures
extend: they override `_make_layer` (which attention flags, which MLP) and, where the checkpoint
spells names differently, `_RENAMES`; `forward`, `compute_logits` and `load_weights` are shared.
"""
from __future__ import annotations

import re
from typing import Iterable, Optional

import torch
from torch import nn

from sluice.attention.base import AttentionBackend, AttentionMetadata
from sluice.config import ModelConfig
from sluice.model.layers import RMSNorm, RotaryEmbedding, embedding, silu_and_mul


class LlamaAttention(nn.Module):
    """GQA attention with a fused QKV projection.

    Options cover the families built on it: `qkv_bias` / `o_bias` (Qwen2 and GLM bias q/k/v but
    not o; Llama and Qwen3 bias all four or none) and `qk_norm` (Qwen3 and GLM-4.5: RMSNorm over
    each head's q and k before the rotary embedding).
    """

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, *,
                 qkv_bias: Optional[bool] = None, o_bias: Optional[bool] = None, qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_bias = cfg.attention_bias if qkv_bias is None else qkv_bias
        o_bias = cfg.attention_bias if o_bias is None else o_bias
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
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
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    # True once gate_up_proj is a fused kernel that already returns silu(gate) * up.
    gate_up_applies_act = False

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        return self.down_proj(h if self.gate_up_applies_act else silu_and_mul(h))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: `self_attn` and `mlp` (a dense MLP or a mixture of experts) with residuals."""

    def __init__(self, cfg: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
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


# Checkpoint names -> (parameter, shard) for fused projections; shard i is the i-th row block.
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# Per-expert tensors of a mixture of experts: experts.<e>.<proj>.weight -> stacked [E, ...] tensors.
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^layers\.(\d+)\.")


class LlamaForCausalLM(nn.Module):
    """`forward` returns final hidden states [T, hidden]; `compute_logits` projects selected rows."""

    # (old, new) substrings applied to checkpoint names before matching, for families whose
    # checkpoints spell a module differently (Mixtral's block_sparse_moe.experts.<e>.w1 ...).
    _RENAMES: tuple[tuple[str, str], ...] = ()
    # The layer loop of `forward` as one compiled call, set by `use_cpu_kernels` when every layer
    # fits it (sluice/model/compiled_stack.py); None: the Python loop.
    compiled_stack = None

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        act = cfg.extra.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{cfg.architecture}: unsupported activation {act!r} (only silu)")
        self.cfg = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = self._make_rotary(cfg)
        self.layers = nn.ModuleList(self._make_layer(i, backend) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _make_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def _make_layer(self, index: int, backend: AttentionBackend) -> nn.Module:
        cfg = self.cfg
        return LlamaDecoderLayer(cfg, LlamaAttention(cfg, self.rotary, backend),
                                 LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                                     # [T, hidden]
        stack = self.compiled_stack
        if stack is not None and stack.supports(x, positions, kv_caches, meta):
            return stack(x, positions, kv_caches, meta)                      # the loop below, in C++
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv, meta)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)                                          # [N, vocab]

    # --- weights -------------------------------------------------------------------------------
    def _target(self, name: str, params: dict[str, nn.Parameter]) -> Optional[tuple[str, tuple]]:
        """Where checkpoint tensor `name` goes: (parameter name, index into it), or None to skip.

        The index is `()` for a whole parameter, a row block of a fused projection, or
        `(expert,)` / `(expert, rows)` of a stacked experts tensor.
        """
        if "rotary_emb.inv_freq" in name:
            return None
        name = name.removeprefix("model.")
        for old, new in self._RENAMES:
            name = name.replace(old, new)
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return None
        layer = _LAYER.match(name)
        first_mtp = self.cfg.num_hidden_layers
        if layer and first_mtp <= int(layer.group(1)) < first_mtp + self.cfg.extra.get("num_nextn_predict_layers", 0):
            return None  # multi-token-prediction layers after the last decoder layer: not served
        expert = _EXPERT.match(name)
        if expert:
            prefix, e, proj = expert.group(1), int(expert.group(2)), expert.group(3)
            if proj == "down_proj":
                return f"{prefix}.down_proj", (e,)
            pname = f"{prefix}.gate_up_proj"
            half = params[pname].shape[1] // 2 if pname in params else 0
            shard = _FUSED[proj][1]
            return pname, (e, slice(shard * half, (shard + 1) * half))
        fused = next((p for p in name.split(".") if p in _FUSED), None)
        if fused is None:
            return name, ()
        target, shard = _FUSED[fused]
        pname = name.replace(fused, target)
        if target == "qkv_proj":
            q, kv = self.cfg.num_attention_heads * self.cfg.head_dim, self.cfg.num_key_value_heads * self.cfg.head_dim
            start, size = [(0, q), (q, kv), (q + kv, kv)][shard]
        else:  # gate_up_proj: halves of whatever this MLP's width is (dense, shared expert)
            size = params[pname].shape[0] // 2 if pname in params else 0
            start = shard * size
        return pname, (slice(start, start + size),)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names, per-expert or fused experts) into the parameters,
        one tensor at a time, and check that every parameter element was written exactly once."""
        params = dict(self.named_parameters(remove_duplicate=False))
        written = {pname: 0 for pname in params}
        seen: set[tuple[str, str]] = set()
        for name, tensor in weights:
            target = self._target(name, params)
            if target is None:
                continue
            pname, index = target
            if pname not in params:
                raise ValueError(f"unexpected checkpoint tensor {name}")
            dest = params[pname].data[index]
            if dest.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not fit {pname}{list(index)} "
                                 f"of shape {tuple(dest.shape)}")
            key = (pname, repr(index))
            if key in seen:
                raise ValueError(f"{name}: {pname}{list(index)} is written twice")
            seen.add(key)
            dest.copy_(tensor)
            written[pname] += dest.numel()
        tied = "lm_head.weight" if self.cfg.tie_word_embeddings else None
        missing = [p for p, n in written.items() if p != tied and n != params[p].numel()]
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")
