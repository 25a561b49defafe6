"""A snapshot of the engine's state, read by /metrics and /load."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class EngineStats:
    num_running: int            # requests scheduled in the current batch
    num_waiting: int            # accepted requests not yet running (including preempted)
    num_waiting_tokens: int     # prompt tokens of waiting requests still to compute
    kv_blocks_total: int
    kv_blocks_used: int         # referenced by running or waiting requests
    kv_blocks_retained: int     # pinned for a workflow's next call (TTL not expired)
    kv_blocks_evictable: int    # cached, unreferenced, reclaimable
    kv_blocks_free: int         # empty
    prefix_cache_queries: int   # prompt tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int      # of which served from the cache (cumulative)
    num_preemptions: int        # cumulative
    spec_drafts_total: int      # speculative verifications with drafts (cumulative)
    spec_draft_tokens_total: int     # draft tokens proposed and verified
    spec_accepted_tokens_total: int  # of which accepted
    prompt_tokens_total: int    # computed prompt tokens (cumulative)
    generation_tokens_total: int
    num_workflows: int          # workflows with state in the engine
    admissible_workflows: int   # how many new workflows are welcome now (admission control)
    decode_yield_steps: int = 0  # steps whose running decodes sat out for prompts (cumulative)
    active_workflows: int = 0    # in flight: a call running or waiting, or KV retained for the next
    active_workflow_ids: frozenset[str] = frozenset()   # their ids (`GET /load?pending=`)
    max_active_workflows: Optional[int] = None   # the bound on active_workflows `/load` keeps
    engine_overhead: Optional[float] = None      # the auto bound's signal (engine/admission.py)
    engine_step_ratio: Optional[float] = None    # its cap's: a step against a call's own prompt
    engine_stalls: int = 0       # times the stall guard failed unfinished requests (cumulative)
    # Hybrid models' recurrent-state slots (all 0 for models without recurrent layers).
    state_slots_total: int = 0       # sequence slots (= max_num_seqs)
    state_slots_used: int = 0        # held by running requests
    state_snapshots_total: int = 0   # snapshot slots for the prefix cache
    state_snapshots_used: int = 0    # holding a snapshot (committed or being written)

    @property
    def accepting(self) -> bool:
        return self.admissible_workflows > 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / max(1, self.kv_blocks_total)
