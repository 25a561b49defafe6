"""GLM-5.3 (`Glm5NextForConditionalGeneration`, text model `glm5_next_text`), text only.

A hybrid decoder over a flattened varlen batch (see attention/base.py for the batch layout):

- `linear_attention` layers are Kimi Delta Attention (KDA): q/k/v projections, a causal
  depthwise conv (kernel `linear_conv_kernel_dim`, float32 weights) with silu, a per-channel
  forget gate and a per-head beta, and the gated delta rule over a float32 recurrent state
  [heads, d_k, d_v] per sequence; prefill chunks use the chunked form (carrying the state in),
  decodes one recurrent step. Output: gated RMSNorm (sigmoid gate) and o_proj. Per sequence
  the layer keeps a conv state [3 * heads * head_dim, kernel - 1] and the recurrent state, in
  state slots (see model/cache_spec.py).
- `indexed_attention` layers are MLA with NoPE (`qk_rope_head_dim` must be 0): q through the
  `q_lora_rank` bottleneck, k/v from a normalised `kv_lora_rank` latent that is what the paged
  cache holds (one vector per token), expanded through `kv_b_proj` when attended. Attention is
  sparse: a DSA indexer (`indexer_types[i] == "full"`) scores k-pools of `index_kpool` tokens
  (the pool key is a learned softmax-weighted mean of the tokens' indexer keys), each query
  keeps its best `index_topk / index_kpool` complete pools whose last token it can see, plus
  its own incomplete tail pool; a `"shared"` layer reuses the selection of the layer right
  before it. The indexer's per-token key and pool gate score are paged like the latent.
- Every block is wrapped in manifold hyper-connections: the residual is `hc_mult` streams
  [T, hc_mult, hidden]; each block reads a sigmoid-weighted sum of the streams and writes its
  output back into every stream, mixed with the old streams through a Sinkhorn-normalised
  (doubly stochastic) matrix; the final norm reads the mean of the streams.
- MLPs per `mlp_layer_types`: dense or a GLM-4.5 style mixture (sigmoid, correction bias,
  grouped top-k, shared experts), both with the `swiglu_limit` clamp on gate and up.

The vision tower is not built; its checkpoint tensors are skipped.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sluice.attention.base import AttentionBackend, AttentionMetadata
from sluice.config import ModelConfig
from sluice.model.cache_spec import CacheTensor, ModelCacheSpec
from sluice.model.layers import RMSNorm, embedding
from sluice.model.llama import LlamaForCausalLM
from sluice.model.glm4_moe import glm_router
from sluice.model.moe import FusedExperts, SparseMoeBlock, swiglu


def _layer_types(x: dict) -> list[str]:
    n = x["num_hidden_layers"]
    types = x.get("layer_types") or ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(n)]
    return ["indexed_attention" if t == "full_attention" else t for t in types]


def _indexer_types(x: dict) -> list[str]:
    if x.get("indexer_types"):
        return list(x["indexer_types"])
    raise ValueError("glm5_next: config.json must spell out indexer_types")


def cache_spec(cfg: ModelConfig) -> ModelCacheSpec:
    """KDA layers: conv state [3 * heads * head_dim, kernel - 1] (model dtype) and recurrent state
    [heads, head_dim, head_dim] (float32) per sequence. MLA layers: the latent [kv_lora_rank] per
    token, plus [2 * index_head_dim] (indexer key, pool gate score) per token on full-indexer
    layers."""
    x = cfg.extra
    layers = []
    for i, kind in enumerate(_layer_types(x)):
        if kind == "linear_attention":
            d, h = x["linear_head_dim"], x["linear_num_heads"]
            layers.append((CacheTensor((3 * h * d, x["linear_conv_kernel_dim"] - 1), paged=False),
                           CacheTensor((h, d, d), paged=False, dtype=torch.float32)))
        else:
            latent = CacheTensor((x["kv_lora_rank"],), paged=True)
            if _indexer_types(x)[i] == "full":
                layers.append((latent, CacheTensor((2 * x["index_head_dim"],), paged=True)))
            else:
                layers.append((latent,))
    return ModelCacheSpec(tuple(layers))


def _context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.int64)
    return block_table[pos // block_size].to(torch.int64) * block_size + pos % block_size


# --- hyper-connections ------------------------------------------------------------------------
class HyperConnection(nn.Module):
    """Pre/post/comb weights from the flattened streams (checkpoint: `hc_attn_*` / `hc_ffn_*`)."""

    def __init__(self, hidden_size: int, hc: int, iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        n = (2 + hc) * hc
        self.fn = nn.Parameter(torch.empty(n, hc * hidden_size))
        self.base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, iters, hc_eps, norm_eps

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, hc, H] -> post [T, hc], comb [T, hc, hc] (float32), collapsed [T, H]."""
        hc = self.hc
        flat = streams.reshape(streams.shape[0], -1).float()                       # [T, hc * H]
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        mixed = F.linear(flat, self.fn.float())                                   # [T, (2 + hc) * hc]
        pre_w, post_w, comb_w = mixed.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps                  # [T, hc]
        post = 2 * torch.sigmoid(post_w * post_s + post_b)                        # [T, hc]
        comb = torch.softmax(comb_w.view(-1, hc, hc) * comb_s + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)   # [T, H]
        return post, comb, collapsed


def _hc_expand(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Block output [T, H] written into every stream, plus the old streams mixed: [T, hc, H]."""
    dtype = residual.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), residual)


# --- MLPs -------------------------------------------------------------------------------------
class ClampedMLP(nn.Module):
    """SwiGLU with GLM-5.3's clamp: gate <= limit, up in [-limit, limit]."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: Optional[float]) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x), self.limit))


# --- Kimi delta attention -----------------------------------------------------------------------
def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def kda_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule for one sequence (transformers' `chunk_kimi_delta_attention`).

    q, k, v [n, H, D] (q, k not yet l2-normalised); g [n, H, D] log decay (float32); beta [n, H];
    state [H, D, D] float32. Returns (out [n, H, D] float32, final state [H, D, D] float32).
    """
    n = q.shape[0]
    q, k, v, beta, g = (t.transpose(0, 1).float() for t in (q, k, v, beta, g))   # [H, n, ...]
    q, k = _l2norm(q) * q.shape[-1] ** -0.5, _l2norm(k)
    pad = (chunk_size - n % chunk_size) % chunk_size
    q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
    beta = F.pad(beta, (0, pad))
    h, d = k.shape[0], k.shape[-1]
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, v, g, k_beta, v_beta = (t.reshape(h, -1, chunk_size, d) for t in (q, k, v, g, k_beta, v_beta))
    g = g.cumsum(dim=-2)                                                         # [H, C, L, D]
    mask = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool), diagonal=0)
    strict = torch.triu(torch.ones(chunk_size, chunk_size, dtype=torch.bool), diagonal=1)
    decay = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict[..., None], float("-inf")).exp()
    attn = -(k_beta.unsqueeze(-2) * k.unsqueeze(-3) * decay).sum(dim=-1).masked_fill(mask, 0)
    for i in range(1, chunk_size):
        row = attn[..., i, :i].clone()
        sub = attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    attn = attn + torch.eye(chunk_size)
    v = attn @ v_beta
    k_cumdecay = attn @ (k_beta * g.exp())
    out = torch.zeros_like(v)
    for i in range(v.shape[1]):
        q_i, k_i, v_i, g_i = q[:, i], k[:, i], v[:, i], g[:, i]
        inter = (q_i * g_i.exp()) @ state
        intra = (q_i.unsqueeze(-2) * k_i.unsqueeze(-3) * decay[:, i]).sum(dim=-1).masked_fill(strict, 0)
        v_new = v_i - k_cumdecay[:, i] @ state
        out[:, i] = inter + intra @ v_new
        state = state * g_i[:, -1].exp().unsqueeze(-1) + (k_i * (g_i[:, -1:] - g_i).exp()).transpose(-1, -2) @ v_new
    return out.reshape(h, -1, d)[:, :n].transpose(0, 1), state


def kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step for B sequences: q, k, v, g [B, H, D]; beta [B, H]; state [B, H, D, D]."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    q, k = _l2norm(q) * q.shape[-1] ** -0.5, _l2norm(k)
    state = state * g.exp().unsqueeze(-1)
    delta = (v - (state * k.unsqueeze(-1)).sum(dim=-2)) * beta.unsqueeze(-1)      # [B, H, D]
    state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(dim=-2), state


class _Weight(nn.Module):
    """Holds one parameter named `weight` (so checkpoint names such as `q_conv1d.weight` match)."""

    def __init__(self, *shape: int, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype))


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        x = cfg.extra
        hidden = cfg.hidden_size
        self.num_heads, self.head_dim = x["linear_num_heads"], x["linear_head_dim"]
        self.kernel = x["linear_conv_kernel_dim"]
        dim = self.num_heads * self.head_dim
        self.dim = dim
        self.q_proj = nn.Linear(hidden, dim, bias=False)
        self.k_proj = nn.Linear(hidden, dim, bias=False)
        self.v_proj = nn.Linear(hidden, dim, bias=False)
        self.q_conv1d = _Weight(dim, 1, self.kernel, dtype=torch.float32)
        self.k_conv1d = _Weight(dim, 1, self.kernel, dtype=torch.float32)
        self.v_conv1d = _Weight(dim, 1, self.kernel, dtype=torch.float32)
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(dim, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.lower_bound = x.get("linear_lower_bound", -5.0)
        self.b_proj = nn.Linear(hidden, self.num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.g_b_proj = nn.Linear(self.head_dim, dim, bias=False)
        self.o_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(dim, hidden, bias=False)

    def _forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """Log decay per channel, float32 [T, H, D]."""
        g = (self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()).view(-1, self.num_heads, self.head_dim)
        rate = self.A_log.float().exp().view(1, self.num_heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * g)
        return -rate * torch.where(g > 20.0, g, torch.log1p(torch.exp(g)))

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        conv_cache, ssm_cache = cache          # [slots, 3D, K-1] model dtype; [slots, H, D, D] float32
        st = meta.state
        t, dt = x.shape[0], x.dtype
        h, d = self.num_heads, self.head_dim
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)   # [T, 3D]
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight]).squeeze(1)  # [3D, K]
        g = self._forget_gate(x)                                                     # [T, H, D]
        beta = torch.sigmoid(self.b_proj(x))                                         # [T, H]
        core = torch.empty(t, h, d, dtype=dt)
        nd = meta.num_decodes
        if nd:
            slots = st.slots[:nd]
            window = torch.cat([conv_cache[slots], mixed[:nd, :, None].to(conv_cache.dtype)], dim=-1)  # [B, 3D, K]
            conv_cache[slots] = window[..., 1:]
            qkv = F.silu((window.float() * w).sum(-1)).to(dt).view(nd, 3, h, d)
            o, new = kda_step(qkv[:, 0], qkv[:, 1], qkv[:, 2], g[:nd], beta[:nd], ssm_cache[slots])
            ssm_cache[slots] = new
            core[:nd] = o.to(dt)
            for i in range(nd):
                if st.saves[i] is not None:
                    self._save(conv_cache, ssm_cache, st.slots_list[i], st.saves[i][1])
        starts = meta.query_start_loc.tolist()
        for i in range(nd, meta.num_seqs):
            s, e = starts[i], starts[i + 1]
            n, slot = e - s, st.slots_list[i]
            padded = torch.cat([conv_cache[slot], mixed[s:e].T.to(conv_cache.dtype)], dim=-1)  # [3D, K-1+n]
            qkv = F.silu(F.conv1d(padded.float()[None], w[:, None, :], groups=w.shape[0])[0]).to(dt)  # [3D, n]
            qkv = qkv.T.reshape(n, 3, h, d)
            save = st.saves[i]
            cut = save[0] if save is not None else n
            state = ssm_cache[slot]
            outs = []
            for a, b in ((0, cut), (cut, n)):
                if a == b:
                    continue
                o, state = kda_chunk(qkv[a:b, 0], qkv[a:b, 1], qkv[a:b, 2], g[s + a:s + b], beta[s + a:s + b], state)
                outs.append(o)
                if save is not None and b == cut:
                    conv_cache[save[1]] = padded[:, cut:cut + self.kernel - 1]
                    ssm_cache[save[1]] = state
            conv_cache[slot] = padded[:, n:]
            ssm_cache[slot] = state
            core[s:e] = torch.cat(outs).to(dt)
        gate = self.g_b_proj(self.g_a_proj(x)).view(t, h, d)
        o = self.o_norm(core.float()) * torch.sigmoid(gate.float())
        return self.o_proj(o.to(dt).reshape(t, h * d))

    @staticmethod
    def _save(conv_cache: torch.Tensor, ssm_cache: torch.Tensor, slot: int, snapshot: int) -> None:
        conv_cache[snapshot] = conv_cache[slot]
        ssm_cache[snapshot] = ssm_cache[slot]


# --- MLA with the DSA indexer -----------------------------------------------------------------
class DsaIndexer(nn.Module):
    """Chooses, per query, the context positions sparse attention reads (see the module doc)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        x = cfg.extra
        self.n_heads, self.head_dim = x["index_n_heads"], x["index_head_dim"]
        self.topk, self.kpool = x["index_topk"], x.get("index_kpool", 16)
        self.select_tail = x.get("index_kpool_always_select_tail", True)
        self.wq_b = nn.Linear(x["q_lora_rank"], self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(self.kpool, self.head_dim))
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(self.head_dim, cfg.hidden_size))

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token cache entry [T, 2 * head_dim]: the indexer key and the pool gate score."""
        return torch.cat([self.k_norm(self.wk(x)), F.linear(x, self.index_kpool_compress_gate)], dim=-1)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, packed: torch.Tensor, first_pos: int) -> torch.Tensor:
        """Boolean [q, L] mask of the positions each of one sequence's queries attends.

        x [q, hidden] and q_resid [q, q_lora_rank] are the queries' inputs, at positions
        first_pos .. first_pos + q - 1; packed [L, 2 * head_dim] is the sequence's cache entries.
        """
        nq, length, kp = x.shape[0], packed.shape[0], self.kpool
        pos = first_pos + torch.arange(nq)                                           # [q]
        mask = torch.zeros(nq, length, dtype=torch.bool)
        num_pools = length // kp
        if num_pools:
            keys, gates = packed[:num_pools * kp].view(num_pools, kp, 2, self.head_dim).unbind(2)  # [P, kp, d]
            probs = (gates.float() + self.index_kpool_compress_ape.float()).softmax(dim=1).to(keys.dtype)
            pool_keys = (probs * keys).sum(dim=1)                                    # [P, d]
            q = self.wq_b(q_resid).view(nq, self.n_heads, self.head_dim)
            scores = F.relu(torch.matmul(q.float(), pool_keys.float().T) * self.head_dim ** -0.5)  # [q, nh, P]
            weights = self.weights_proj(x).float() * self.n_heads ** -0.5            # [q, nh]
            index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)   # [q, P]
            pool_end = torch.arange(1, num_pools + 1) * kp - 1                       # [P]
            valid = pool_end[None, :] <= pos[:, None]                                # [q, P]
            index_scores = index_scores.masked_fill(~valid, torch.finfo(index_scores.dtype).min)
            chosen = index_scores.topk(min(self.topk // kp, num_pools), dim=-1).indices   # [q, k]
            chosen_ok = valid.gather(-1, chosen)                                     # [q, k]
            pools = torch.zeros(nq, num_pools, dtype=torch.bool)
            pools.scatter_(1, chosen, chosen_ok)
            mask[:, :num_pools * kp] = pools.repeat_interleave(kp, dim=1)
        if self.select_tail and kp > 1:
            ctx = torch.arange(length)
            tail_start = (pos + 1) - (pos + 1) % kp                                  # [q]
            mask |= (ctx[None, :] >= tail_start[:, None]) & (ctx[None, :] <= pos[:, None])
        return mask


class MlaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, with_indexer: bool) -> None:
        super().__init__()
        x = cfg.extra
        if x.get("qk_rope_head_dim", 0):
            raise ValueError("glm5_next: MLA layers are NoPE; qk_rope_head_dim must be 0")
        self.num_heads = cfg.num_attention_heads
        self.kv_lora_rank = x["kv_lora_rank"]
        self.nope_dim, self.v_dim = x["qk_nope_head_dim"], x["v_head_dim"]
        bias = cfg.attention_bias
        hidden = cfg.hidden_size
        self.q_a_proj = nn.Linear(hidden, x["q_lora_rank"], bias=bias)
        self.q_a_layernorm = RMSNorm(x["q_lora_rank"], cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(x["q_lora_rank"], self.num_heads * self.nope_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.indexer = DsaIndexer(cfg) if with_indexer else None
        self.scale = self.nope_dim ** -0.5

    def forward(self, x: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata,
                prev_masks: Optional[list[torch.Tensor]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the output [T, hidden] and each sequence's attended-positions mask [q_i, L_i]."""
        t = x.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x))                               # [T, q_lora]
        q = self.q_b_proj(q_resid).view(t, self.num_heads, self.nope_dim)
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x))                     # [T, r]
        nb, bs, r = cache[0].shape
        flat_latent = cache[0].view(nb * bs, r)
        flat_latent.index_copy_(0, meta.slot_mapping, latent.to(cache[0].dtype))
        flat_index = None
        if self.indexer is not None:
            flat_index = cache[1].view(nb * bs, -1)
            flat_index.index_copy_(0, meta.slot_mapping, self.indexer.keys(x).to(cache[1].dtype))
        elif prev_masks is None:
            raise ValueError("glm5_next: a shared-indexer layer must follow a full-indexer MLA layer")
        out = torch.empty(t, self.num_heads, self.v_dim, dtype=x.dtype)
        masks = []
        starts = meta.query_start_loc.tolist()
        for i in range(meta.num_seqs):
            s, e = starts[i], starts[i + 1]
            length = meta.seq_lens_list[i]
            slots = _context_slots(meta.block_tables[i], length, bs)
            if self.indexer is not None:
                mask = self.indexer.select(x[s:e], q_resid[s:e], flat_index[slots], length - (e - s))
            else:
                mask = prev_masks[i]
            masks.append(mask)
            kv = self.kv_b_proj(flat_latent[slots].to(x.dtype)).view(length, self.num_heads, -1)
            k, v = kv.split([self.nope_dim, self.v_dim], dim=-1)                     # [L, H, d]
            o = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], attn_mask=mask[None, None],
                                               scale=self.scale)                     # [1, H, q, dv]
            out[s:e] = o[0].transpose(0, 1)
        return self.o_proj(out.reshape(t, -1)), masks


# --- the decoder ------------------------------------------------------------------------------
class Glm5NextDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        x = cfg.extra
        self.kind = _layer_types(x)[index]
        indexers = _indexer_types(x)
        if self.kind == "linear_attention":
            self.self_attn = KimiDeltaAttention(cfg)
            self.returns_masks = False
        else:
            full = indexers[index] == "full"
            self.self_attn = MlaAttention(cfg, with_indexer=full)
            # transformers hands a selection only to the very next layer, and only when it is shared.
            self.returns_masks = full and indexers[min(index + 1, len(indexers) - 1)] == "shared"
        limit = x.get("swiglu_limit")
        if x["mlp_layer_types"][index] == "sparse":
            num_experts, width = x["n_routed_experts"], x["moe_intermediate_size"]
            gate = glm_router(cfg)
            shared = x.get("n_shared_experts") or 0
            self.mlp = SparseMoeBlock(gate, FusedExperts(num_experts, cfg.hidden_size, width, limit),
                                      ClampedMLP(cfg.hidden_size, width * shared, limit) if shared else None)
        else:
            self.mlp = ClampedMLP(cfg.hidden_size, cfg.intermediate_size, limit)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc = (cfg.hidden_size, x.get("hc_mult", 4), x.get("hc_sinkhorn_iters", 20), x.get("hc_eps", 1e-6),
              cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(self, streams: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata,
                prev_masks: Optional[list[torch.Tensor]]) -> tuple[torch.Tensor, Optional[list[torch.Tensor]]]:
        post, comb, h = self.attn_hc(streams)
        h = self.input_layernorm(h)
        masks = None
        if self.kind == "linear_attention":
            h = self.self_attn(h, cache, meta)
        else:
            h, masks = self.self_attn(h, cache, meta, prev_masks)
        streams = _hc_expand(post, comb, h, streams)
        post, comb, h = self.ffn_hc(streams)
        h = self.mlp(self.post_attention_layernorm(h))
        return _hc_expand(post, comb, h, streams), (masks if self.returns_masks else None)


_VISION = re.compile(r"^(model\.)?(visual|vision_tower|vision_model)\.")
_LAYER = re.compile(r"^layers\.(\d+)\.")


class Glm5NextForCausalLM(LlamaForCausalLM):
    """The text decoder of `Glm5NextForConditionalGeneration`; weight loading is Llama's (fused
    dense/shared-expert gate_up, per-expert or fused experts, every element written once)."""

    _RENAMES = (("hc_attn_", "attn_hc."), ("hc_ffn_", "ffn_hc."))

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        nn.Module.__init__(self)
        x = cfg.extra
        if x.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"{cfg.architecture}: unsupported activation {x['hidden_act']!r} (only silu)")
        if len(_layer_types(x)) != cfg.num_hidden_layers:
            raise ValueError("glm5_next: layer_types must name every layer")
        self.cfg = cfg
        self.hc_mult = x.get("hc_mult", 4)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Glm5NextDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)                                             # [T, hidden]
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()          # [T, hc, hidden]
        masks = None
        for layer, cache in zip(self.layers, kv_caches):
            streams, masks = layer(streams, cache, meta, masks)
        return self.norm(streams.mean(dim=1))

    def _target(self, name: str, params: dict[str, nn.Parameter]) -> Optional[tuple[str, tuple]]:
        if _VISION.match(name) or "shared_head" in name:
            return None
        name = name.removeprefix("model.language_model.").removeprefix("language_model.").removeprefix("model.")
        for old, new in self._RENAMES:
            name = name.replace(old, new)
        layer = _LAYER.match(name)
        if layer and int(layer.group(1)) >= self.cfg.num_hidden_layers:
            return None  # multi-token-prediction layers: not served
        if name in params:
            return name, ()
        return super()._target(name, params)
