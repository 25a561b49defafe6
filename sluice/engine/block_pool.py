"""The pool of KV-cache blocks: reference counts, the prefix-cache hash map and LRU eviction.

Every block is in exactly one of three states:
- free: ref_cnt == 0 and no hash; in the free queue;
- cached-unreferenced (evictable): ref_cnt == 0 with a hash; in the free queue, still findable by
  hash until it is reused (LRU: the head of the queue is reused first);
- referenced: ref_cnt > 0 (by running/waiting requests or by a workflow's retention); not in the
  free queue; may also carry a hash (then it is shared by the prefix cache).

`free` appends blocks to the tail of the queue in the order given, so callers pass a request's
blocks tail-first: its last blocks, least likely to be shared, are evicted first.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional

BlockHash = bytes   # 128-bit digest of (parent digest, the block's token ids)


def hash_block(parent: Optional[bytes], token_ids: tuple[int, ...]) -> tuple[bytes, BlockHash]:
    """Hash of a full block chained on its parent's (BLAKE2b-128 over the parent digest and the
    tokens as int64): two different token prefixes share a key only with probability ~2^-128,
    so a cache hit always holds exactly the KV of the same tokens. Returns (value, key); the
    value is what the next block chains on (here the same digest)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", token_ids).tobytes())
    digest = h.digest()
    return digest, digest


def salted_root(salt: Optional[str]) -> Optional[bytes]:
    """The parent digest a request's first block chains on: none, or one derived from its
    `cache_salt`, so requests of different salts (or one salted, one not) share no block hash."""
    if salt is None:
        return None
    return hashlib.blake2b(b"sluice-cache-salt\0" + salt.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    hash_key: Optional[BlockHash] = None   # set while the block is in the prefix cache
    hash_value: Optional[bytes] = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, Block] = {}
        self._num_evictable = 0   # blocks in the free queue that carry a hash (kept incrementally)

    # --- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty or evictable)."""
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        return self._num_evictable

    def lookup(self, key: BlockHash) -> Optional[Block]:
        return self._cached.get(key) if self.enable_caching else None

    # --- mutations -----------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[Block]:
        """Take n blocks from the head of the free queue (evicting cached ones), ref_cnt = 1."""
        if n > len(self._free):
            raise RuntimeError(f"cannot allocate {n} blocks: only {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.hash_key is not None:
                self._num_evictable -= 1
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found in the prefix cache (removing them from the queue)."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free[b.block_id]
                if b.hash_key is not None:
                    self._num_evictable -= 1
            b.ref_cnt += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; unreferenced ones go to the queue tail, in order."""
        for b in blocks:
            if b.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {b.block_id}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if not self.enable_caching:
                    self._evict(b)
                elif b.hash_key is not None:
                    self._num_evictable += 1
                self._free[b.block_id] = b

    def cache(self, block: Block, value: bytes, key: BlockHash) -> None:
        """Register a full, computed block in the prefix cache (first writer wins)."""
        if not self.enable_caching or block.hash_key is not None:
            return
        if key in self._cached:
            return  # an identical block is already cached; this one stays private
        block.hash_key, block.hash_value = key, value
        self._cached[key] = block
        if block.ref_cnt == 0:  # already in the free queue: it becomes evictable
            self._num_evictable += 1

    def evict_all_cached(self) -> int:
        """Drop every unreferenced cached block from the prefix cache (e.g. /reset)."""
        n = 0
        for b in self._free.values():
            if b.hash_key is not None:
                self._evict(b)
                n += 1
        self._num_evictable -= n
        return n

    def _evict(self, block: Block) -> None:
        if block.hash_key is not None:
            if self._cached.get(block.hash_key) is block:
                del self._cached[block.hash_key]
            block.hash_key = block.hash_value = None

    # --- invariants ----------------------------------------------------------------------
    def check_invariants(self) -> None:
        in_queue = set(self._free)
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"block {b.block_id} has ref_cnt {b.ref_cnt}"
            assert (b.ref_cnt == 0) == (b.block_id in in_queue), f"block {b.block_id} queue state wrong"
            if b.hash_key is not None:
                assert self._cached.get(b.hash_key) is b, f"block {b.block_id} hash not indexed"
        for key, b in self._cached.items():
            assert b.hash_key == key
        assert self._num_evictable == sum(1 for b in self._free.values() if b.hash_key is not None)

    def all_unreferenced(self) -> bool:
        return all(b.ref_cnt == 0 for b in self.blocks) and len(self._free) == self.num_blocks
