"""How the KV memory budget is split between paged blocks and recurrent-state slots.

A model without recurrent layers gets exactly `CacheConfig.resolve_num_blocks`: the budget
(`num_blocks`, `kv_cache_tokens` or `kv_cache_gib`, 1 GiB by default) is all paged blocks.

A hybrid model (a `ModelCacheSpec` with state tensors) also needs, per layer, one state row per
running request (`max_num_seqs` sequence slots) and one per prefix-cache snapshot (see
state_pool.py). Every row of every state tensor costs `bytes_per_state`, so:

- with a byte budget (`kv_cache_gib`, or the 1 GiB default) the budget covers everything:
  `num_blocks * block_bytes + (num_seq_slots + num_snapshots) * bytes_per_state <= budget`.
  The sequence slots and one `max_model_len` context are required: a budget that cannot hold
  them (plus an explicit `max_state_snapshots`) is refused with a ValueError naming the
  settings to change. The blocks get what the slots leave;
- with a token budget (`kv_cache_tokens`, `num_blocks`) the tokens size the paged blocks and
  the state slots come on top of them (a token count says nothing about state bytes).

Snapshots: `max_state_snapshots` when given (0 disables them: a hybrid model then gets no
prefix-cache hits), none without prefix caching, and by default
`min(max_num_seqs, SNAPSHOT_SHARE of the memory left for the paged cache)`, never so many that
a byte budget's blocks could not hold one `max_model_len` context.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sluice.config import CacheConfig, EngineConfig, SchedulerConfig
from sluice.engine.model_runner import kv_bytes_per_token
from sluice.engine.state_pool import StateLayout
from sluice.model.registry import model_cache_spec

SNAPSHOT_SHARE = 0.25   # default bound on snapshot memory: this share of the paged cache's room
_MIB = 1 << 20


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int
    block_bytes: int                 # paged bytes of one block, all layers
    state: Optional[StateLayout]     # None: no recurrent layers
    bytes_per_state: int = 0         # one state slot, all layers

    @property
    def paged_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def state_bytes(self) -> int:
        return self.state.num_slots * self.bytes_per_state if self.state else 0

    @property
    def total_bytes(self) -> int:
        return self.paged_bytes + self.state_bytes


def plan_cache(cache: CacheConfig, sched: SchedulerConfig, bytes_per_token: int,
               bytes_per_state: int) -> CachePlan:
    """The plan for a model whose tokens cost `bytes_per_token` paged bytes and whose sequences
    cost `bytes_per_state` state bytes (0: no recurrent layers), all layers together."""
    block_bytes = bytes_per_token * cache.block_size
    if bytes_per_state <= 0:
        return CachePlan(cache.resolve_num_blocks(bytes_per_token), block_bytes, None)
    seq = sched.max_num_seqs
    explicit = cache.max_state_snapshots
    if not cache.enable_prefix_caching:
        explicit = 0
    if cache.num_blocks or cache.kv_cache_tokens is not None:
        num_blocks = cache.resolve_num_blocks(bytes_per_token)
        room = num_blocks * block_bytes
        snaps = explicit if explicit is not None else min(seq, int(SNAPSHOT_SHARE * room) // bytes_per_state)
        return CachePlan(num_blocks, block_bytes, StateLayout(seq, snaps), bytes_per_state)

    gib = cache.kv_cache_gib if cache.kv_cache_gib is not None else 1.0
    budget = int(gib * (1 << 30))
    context = -(-sched.max_model_len // cache.block_size) * block_bytes
    required = (seq + (explicit or 0)) * bytes_per_state + context
    if required > budget:
        raise ValueError(_budget_error(gib, budget, seq, explicit, bytes_per_state, sched.max_model_len, context,
                                       required))
    room = budget - seq * bytes_per_state          # what the paged cache and the snapshots share
    if explicit is not None:
        snaps = explicit
    else:
        snaps = min(seq, int(SNAPSHOT_SHARE * room) // bytes_per_state, (room - context) // bytes_per_state)
    num_blocks = (room - snaps * bytes_per_state) // block_bytes
    return CachePlan(num_blocks, block_bytes, StateLayout(seq, snaps), bytes_per_state)


def _budget_error(gib: float, budget: int, seq: int, snaps: Optional[int], slot: int, max_model_len: int,
                  context: int, required: int) -> str:
    parts = f"{seq} recurrent-state slots of {slot / _MIB:.1f} MiB (--max-num-seqs {seq})"
    if snaps:
        parts += f", {snaps} snapshot slots (--max-state-snapshots {snaps})"
    fit = (budget - context - (snaps or 0) * slot) // slot
    hints = ["raise --kv-cache-gib"]
    if fit >= 1:
        hints.append(f"lower --max-num-seqs (at most {fit} fit)")
    if snaps:
        hints.append("lower --max-state-snapshots")
    hints.append("lower --max-model-len")
    return (f"the KV cache budget of {gib:g} GiB cannot hold {parts} plus one max_model_len context of "
            f"{max_model_len} tokens ({context / _MIB:.1f} MiB): {required / (1 << 30):.2f} GiB are needed; "
            f"{', '.join(hints[:-1])} or {hints[-1]}")


def plan_for(config: EngineConfig) -> CachePlan:
    spec = model_cache_spec(config.model)
    per_state = spec.bytes_per_state(config.dtype) if spec is not None else 0
    return plan_cache(config.cache, config.scheduler, kv_bytes_per_token(config), per_state)
