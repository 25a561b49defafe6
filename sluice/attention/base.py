"""The attention backend interface: one call per layer that writes new K/V into the paged cache
and attends every query token to its sequence's context.

Layout of a step's batch (built by the model runner):
- tokens of all scheduled sequences are flattened into one dimension T, sequence by sequence;
- the first `num_decodes` sequences have exactly one query token (decodes), the rest are
  prefill chunks (one or more tokens, possibly following a cached or earlier-computed prefix);
- sequence i's queries are the positions `seq_lens[i] - query_len[i] .. seq_lens[i] - 1` of its
  context, and attend causally to positions `0 .. own position` read through `block_tables[i]`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch


@dataclass
class StateMetadata:
    """Recurrent-state slots of a step's sequences (hybrid models only; see model/cache_spec.py).

    Sequence i reads and updates state slot `slots[i]`. `saves[i]`, when set, is
    (offset, snapshot_slot): after its first `offset` tokens of this step (1 <= offset <= query
    length), sequence i's state is also copied into `snapshot_slot`, a block-boundary snapshot
    for the prefix cache.
    """

    slots: torch.Tensor                              # [S] int64
    slots_list: list[int]
    saves: list[Optional[tuple[int, int]]]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [T] int64: flat cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor   # [S + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor          # [S] int32: context length of each sequence after this step
    block_tables: torch.Tensor      # [S, max_blocks_per_seq] int32, padded with 0
    num_decodes: int                # the first num_decodes sequences have query length 1
    max_query_len: int
    max_seq_len: int
    query_lens_list: list[int]      # host copies, to avoid device syncs in loops
    seq_lens_list: list[int]
    state: Optional[StateMetadata] = None   # hybrid models with recurrent layers only

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,        # [T, num_heads, head_dim]
        k: torch.Tensor,        # [T, num_kv_heads, head_dim]
        v: torch.Tensor,        # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:          # [T, num_heads, head_dim]
        ...
