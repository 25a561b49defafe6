"""Recurrent-state slots for hybrid models (linear-attention layers next to paged attention).

A linear-attention layer keeps a fixed-size state per sequence instead of per-token KV. The
runner holds, per such layer, state tensors with `num_slots = num_seq_slots + num_snapshots`
rows; this pool decides which row is whose:

- **sequence slots** `0 .. num_seq_slots - 1`: one per running request, taken at admission and
  given back on finish, abort and preemption (preemption recomputes: the resumed request gets a
  fresh slot, zeroed or restored from a snapshot). `num_seq_slots = max_num_seqs`, so admission
  is bounded by the batch limit, never by slots (engine/cache_plan.py takes their memory out of
  the KV budget, or refuses a budget that cannot hold them);
- **snapshot slots** `num_seq_slots ..`: copies of some request's state exactly at a block
  boundary, keyed by the hash of the block that ends there (the chained hash covers the whole
  prefix, so a key names exactly one token prefix). A prefix-cache hit for a hybrid model is
  cut back to the deepest hit block that has a snapshot; the request's slot starts as a copy of
  it. Snapshots are reserved while scheduling, written by the model during the step, and become
  findable only once the step is done (`commit_pending`); the least recently used committed
  snapshot is reused first. Their number is `CacheConfig.max_state_snapshots` (or the plan's
  default bound); with none, a hybrid model gets no prefix-cache hits.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from sluice.engine.block_pool import BlockHash


@dataclass(frozen=True)
class StateLayout:
    num_seq_slots: int      # one per running request (= max_num_seqs)
    num_snapshots: int      # block-boundary snapshots kept for the prefix cache (LRU; 0: none)

    @property
    def num_slots(self) -> int:
        return self.num_seq_slots + self.num_snapshots


class StatePool:
    def __init__(self, layout: StateLayout) -> None:
        self.layout = layout
        self._free_seq = list(range(layout.num_seq_slots - 1, -1, -1))   # a stack: lowest id first
        self._held: set[int] = set()
        self._free_snap = list(range(layout.num_slots - 1, layout.num_seq_slots - 1, -1))
        self._snapshots: OrderedDict[BlockHash, int] = OrderedDict()    # committed, LRU first
        self._pending: dict[BlockHash, int] = {}                          # written by the coming step

    # --- sequence slots ----------------------------------------------------------------------
    @property
    def num_free_seq_slots(self) -> int:
        return len(self._free_seq)

    def allocate(self) -> int:
        if not self._free_seq:
            raise RuntimeError("no free recurrent-state slot")
        slot = self._free_seq.pop()
        self._held.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._held:
            raise RuntimeError(f"double free of state slot {slot}")
        self._held.remove(slot)
        self._free_seq.append(slot)

    # --- snapshots ---------------------------------------------------------------------------
    def lookup(self, key: BlockHash) -> Optional[int]:
        """The committed snapshot for `key` (marked most recently used), or None."""
        slot = self._snapshots.get(key)
        if slot is not None:
            self._snapshots.move_to_end(key)
        return slot

    def is_committed(self, key: BlockHash) -> bool:
        return key in self._snapshots

    def has(self, key: BlockHash) -> bool:
        return key in self._snapshots or key in self._pending

    def reserve(self, key: BlockHash) -> Optional[int]:
        """A slot for a new snapshot of `key` (evicting the least recently used committed one),
        or None when every snapshot slot is reserved by this step."""
        if self._free_snap:
            slot = self._free_snap.pop()
        elif self._snapshots:
            _, slot = self._snapshots.popitem(last=False)
        else:
            return None
        self._pending[key] = slot
        return slot

    def commit_pending(self) -> None:
        """The step that wrote the reserved snapshots is done: make them findable."""
        for key, slot in self._pending.items():
            self._snapshots[key] = slot
        self._pending.clear()

    def clear_snapshots(self) -> None:
        self._free_snap.extend(self._snapshots.values())
        self._snapshots.clear()

    # --- invariants --------------------------------------------------------------------------
    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def num_snapshots(self) -> int:
        """Snapshot slots holding a snapshot, committed or being written by the coming step."""
        return len(self._snapshots) + len(self._pending)

    def check_invariants(self, holders: list[int]) -> None:
        """`holders`: the slots running requests say they hold."""
        assert sorted(holders) == sorted(self._held), f"state slots {sorted(self._held)} held, {holders} claimed"
        assert len(self._held) + len(self._free_seq) == self.layout.num_seq_slots
        assert len(set(self._free_seq)) == len(self._free_seq)
        snaps = list(self._snapshots.values()) + list(self._pending.values()) + self._free_snap
        assert sorted(snaps) == list(range(self.layout.num_seq_slots, self.layout.num_slots)), "snapshot slots leak"
