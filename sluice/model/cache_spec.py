"""What a model keeps between steps, declared per layer, for models whose layers differ.

A model without a spec (every Llama-skeleton model) gets the runner's default: one K and one V
tensor per layer, [num_blocks, block_size, num_kv_heads, head_dim]. A model with one (registered
next to its class in `registry.py`) gets, for each layer, the tensors its spec lists, in order:

- a *paged* tensor is [num_blocks, block_size, *shape]: per-token state addressed through the
  same block tables and slot mapping as every other layer (MLA latents, DSA indexer keys);
- a *state* tensor is [num_state_slots, *shape]: a fixed-size per-sequence state (a linear
  attention layer's recurrent and conv state). Slot ids come from the scheduler's `StatePool`
  (`AttentionMetadata.state`), which also holds the prefix-cache snapshots in slots past the
  running ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sluice import hugepages


@dataclass(frozen=True)
class CacheTensor:
    shape: tuple[int, ...]               # per token (paged) or per sequence (state)
    paged: bool                          # True: [num_blocks, block_size, *shape]; False: [num_slots, *shape]
    dtype: Optional[torch.dtype] = None  # None: the model dtype

    def resolve_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return self.dtype or model_dtype

    def bytes_per_entry(self, model_dtype: torch.dtype) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.finfo(self.resolve_dtype(model_dtype)).bits // 8


@dataclass(frozen=True)
class ModelCacheSpec:
    layers: tuple[tuple[CacheTensor, ...], ...]   # per layer: the tensors its forward receives

    def bytes_per_token(self, model_dtype: torch.dtype) -> int:
        """Paged bytes one token costs across all layers (what a block is sized by)."""
        return sum(t.bytes_per_entry(model_dtype) for layer in self.layers for t in layer if t.paged)

    def bytes_per_state(self, model_dtype: torch.dtype) -> int:
        """Bytes of one sequence's fixed-size state across all layers (0: no recurrent layers)."""
        return sum(t.bytes_per_entry(model_dtype) for layer in self.layers for t in layer if not t.paged)

    @property
    def has_state(self) -> bool:
        return any(not t.paged for layer in self.layers for t in layer)

    def allocate(self, num_blocks: int, block_size: int, num_state_slots: int,
                 model_dtype: torch.dtype, huge_pages: bool = False) -> list[tuple[torch.Tensor, ...]]:
        shapes = [((num_blocks, block_size, *t.shape) if t.paged else (num_state_slots, *t.shape),
                   t.resolve_dtype(model_dtype)) for layer in self.layers for t in layer]
        flat = iter(hugepages.zeros(shapes, huge_pages))
        return [tuple(next(flat) for _ in layer) for layer in self.layers]
