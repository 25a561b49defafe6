"""Pure-torch paged attention: the reference every other backend is tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.attention.base import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    nb, bs, kvh, d = k_cache.shape
    k_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, kvh, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(length, dtype=torch.int64)
    return block_table[pos // block_size].to(torch.int64) * block_size + pos % block_size


class TorchPagedAttention:
    """Gathers each sequence's K/V through its block table and calls SDPA.

    Decodes are batched into one padded SDPA call; prefill chunks run one sequence at a time
    with a causal mask offset by the sequence's already-computed context.
    """

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        nb, bs, kvh, d = k_cache.shape
        k_flat = k_cache.view(nb * bs, kvh, d)
        v_flat = v_cache.view(nb * bs, kvh, d)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            lens = meta.seq_lens[:nd].to(torch.int64)                      # [B]
            max_len = max(meta.seq_lens_list[:nd])
            pos = torch.arange(max_len, dtype=torch.int64)                 # [L]
            tables = meta.block_tables[:nd].to(torch.int64)                # [B, max_blocks]
            blk = torch.gather(tables, 1, (pos // bs).expand(nd, -1).clamp(max=tables.shape[1] - 1))
            slots = blk * bs + pos % bs                                    # [B, L]
            valid = pos.unsqueeze(0) < lens.unsqueeze(1)                   # [B, L]
            kk = k_flat[slots].transpose(1, 2)                             # [B, kvh, L, d]
            vv = v_flat[slots].transpose(1, 2)
            qq = q[:nd].unsqueeze(2)                                       # [B, H, 1, d]
            o = F.scaled_dot_product_attention(
                qq, kk.to(q.dtype), vv.to(q.dtype), attn_mask=valid[:, None, None, :],
                scale=scale, enable_gqa=True,
            )
            out[:nd] = o.squeeze(2)
        starts = meta.query_start_loc.tolist()
        for i in range(nd, meta.num_seqs):
            s, e = starts[i], starts[i + 1]
            qlen, seq_len = e - s, meta.seq_lens_list[i]
            slots = _context_slots(meta.block_tables[i], seq_len, bs)
            kk = k_flat[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)    # [1, kvh, L, d]
            vv = v_flat[slots].transpose(0, 1).unsqueeze(0).to(q.dtype)
            qq = q[s:e].transpose(0, 1).unsqueeze(0)                      # [1, H, qlen, d]
            ctx = seq_len - qlen
            mask = torch.arange(seq_len).unsqueeze(0) <= (torch.arange(qlen).unsqueeze(1) + ctx)
            o = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale, enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)
        return out
