"""The compiled CPU paged-attention backend ("cpu"); see paged_attention.cpp for the kernel."""
from __future__ import annotations

import logging

import torch

from sluice.attention.base import AttentionMetadata
from sluice.attention.cpu.extension import CpuAttentionUnavailable, is_available, load_extension
from sluice.attention.torch_ref import TorchPagedAttention

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128)
MAX_GROUP = 48  # query heads per kv head (kMaxRows in the kernel)


class CpuPagedAttention:
    """One extension call per layer: KV write plus attention of the whole flattened batch.

    Layouts the kernel does not cover (other dtypes, mixed dtypes, other head sizes) go to the
    torch reference, with a warning the first time.
    """

    name = "cpu"

    def __init__(self) -> None:
        load_extension()
        self._op = torch.ops.sluice.paged_attention
        self._fallback = TorchPagedAttention()
        self._warned = False

    def supports(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
        dtype = k_cache.dtype
        return (dtype in SUPPORTED_DTYPES and q.dtype == dtype and k.dtype == dtype and v.dtype == dtype
                and q.shape[-1] in SUPPORTED_HEAD_DIMS and q.shape[1] // k_cache.shape[2] <= MAX_GROUP
                and q.device.type == "cpu")

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not self.supports(q, k, v, k_cache):
            if not self._warned:
                self._warned = True
                logger.warning("cpu attention: %s q / %s cache with head_dim %d not supported, using torch",
                               q.dtype, k_cache.dtype, q.shape[-1])
            return self._fallback.forward(q, k, v, k_cache, v_cache, meta, scale)
        return self._op(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.query_start_loc, meta.seq_lens,
                        meta.block_tables, scale)


__all__ = ["CpuPagedAttention", "CpuAttentionUnavailable", "is_available", "load_extension"]
