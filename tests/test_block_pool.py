"""BlockPool: reference counts, the free queue's LRU order, the prefix-cache map and eviction."""
from __future__ import annotations

import pytest

from sluice.engine.block_pool import BlockPool, hash_block


class CheckedPool(BlockPool):
    """The real pool, with its invariants asserted after every mutation."""

    def allocate(self, n):
        out = super().allocate(n)
        self.check_invariants()
        return out

    def touch(self, blocks):
        super().touch(blocks)
        self.check_invariants()

    def free(self, blocks):
        try:
            super().free(blocks)
        finally:
            self.check_invariants()

    def cache(self, block, value, key):
        super().cache(block, value, key)
        self.check_invariants()

    def evict_all_cached(self):
        n = super().evict_all_cached()
        self.check_invariants()
        return n


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def cache_block(pool: BlockPool, block, tokens: tuple[int, ...], parent=None):
    value, key = hash_block(parent, tokens)
    pool.cache(block, value, key)
    return value, key


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_touch_free_ref_counts():
    pool = CheckedPool(4)
    assert pool.num_free_blocks == 4 and pool.all_unreferenced()
    a, b = pool.allocate(2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1)
    assert pool.num_free_blocks == 2 and not pool.all_unreferenced()

    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2   # still held: not back in the queue
    pool.free([a, b])
    assert (a.ref_cnt, b.ref_cnt) == (0, 0)
    assert pool.num_free_blocks == 4 and pool.all_unreferenced()


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = CheckedPool(3)
    pool.allocate(2)
    assert pool.can_allocate(1) and not pool.can_allocate(2)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_double_free_raises():
    pool = CheckedPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a])
    assert a.ref_cnt == 0 and pool.num_free_blocks == 2


def test_free_of_never_allocated_block_raises():
    pool = CheckedPool(2)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([pool.blocks[1]])


def test_free_order_is_reuse_order():
    """Freed blocks join the queue tail in the order given; the head is reused first."""
    pool = CheckedPool(4)
    blocks = pool.allocate(4)
    assert ids(blocks) == [0, 1, 2, 3]
    pool.free(reversed(blocks))      # a request frees tail-first
    assert ids(pool.allocate(4)) == [3, 2, 1, 0]


def test_untouched_blocks_are_used_before_freed_ones():
    pool = CheckedPool(4)
    a, b = pool.allocate(2)
    pool.free([b, a])
    assert ids(pool.allocate(4)) == [2, 3, 1, 0]


def test_cached_block_stays_findable_until_reused():
    pool = CheckedPool(2)
    (a,) = pool.allocate(1)
    _, key = cache_block(pool, a, (1, 2, 3, 4))
    assert pool.lookup(key) is a
    pool.free([a])
    assert pool.lookup(key) is a                       # cached, unreferenced: evictable
    assert pool.num_evictable_blocks == 1 and pool.num_free_blocks == 2

    pool.touch([a])                                    # a prefix hit takes it back
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1 and pool.num_evictable_blocks == 0
    pool.free([a])

    pool.allocate(2)                                   # pressure: the cached block is reused
    assert pool.lookup(key) is None
    assert a.hash_key is None and a.hash_value is None


def test_lru_eviction_order():
    """The least recently freed cached block is evicted first; a touch refreshes a block."""
    pool = CheckedPool(3)
    a, b, c = pool.allocate(3)
    keys = [cache_block(pool, blk, (i,))[1] for i, blk in enumerate((a, b, c))]
    pool.free([a, b, c])
    pool.touch([a])
    pool.free([a])                        # a is now the most recently used

    (x,) = pool.allocate(1)
    assert x is b
    assert pool.lookup(keys[1]) is None
    assert pool.lookup(keys[0]) is a and pool.lookup(keys[2]) is c
    (y,) = pool.allocate(1)
    assert y is c and pool.lookup(keys[2]) is None
    assert pool.lookup(keys[0]) is a


def test_touch_of_shared_cached_block():
    pool = CheckedPool(2)
    (a,) = pool.allocate(1)
    _, key = cache_block(pool, a, (5, 6))
    pool.touch([a])                        # a second request shares it
    assert a.ref_cnt == 2
    pool.free([a])
    assert a.ref_cnt == 1 and pool.num_evictable_blocks == 0
    pool.free([a])
    assert pool.lookup(key) is a and pool.num_evictable_blocks == 1


def test_first_writer_wins():
    pool = CheckedPool(3)
    a, b = pool.allocate(2)
    value, key = cache_block(pool, a, (9, 9))
    pool.cache(b, value, key)             # an identical block computed elsewhere stays private
    assert pool.lookup(key) is a and b.hash_key is None
    pool.cache(a, *hash_block(None, (1, 1)))   # an already cached block keeps its hash
    assert a.hash_key == key
    pool.free([a, b])
    assert pool.num_evictable_blocks == 1


def test_hash_chains_on_parent():
    v1, k1 = hash_block(None, (1, 2))
    v2, k2 = hash_block(v1, (3, 4))
    v3, k3 = hash_block(None, (3, 4))
    assert k2 != k3
    assert hash_block(v1, (3, 4)) == (v2, k2)


def test_evict_all_cached_spares_referenced_blocks():
    pool = CheckedPool(3)
    a, b = pool.allocate(2)
    _, ka = cache_block(pool, a, (1,))
    _, kb = cache_block(pool, b, (2,))
    pool.free([a])
    assert pool.evict_all_cached() == 1
    assert pool.lookup(ka) is None and pool.lookup(kb) is b
    pool.free([b])
    assert pool.all_unreferenced()


def test_caching_disabled():
    pool = CheckedPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    value, key = hash_block(None, (1, 2))
    pool.cache(a, value, key)
    assert a.hash_key is None and pool.lookup(key) is None
    pool.free([a])
    assert pool.num_evictable_blocks == 0 and pool.all_unreferenced()


def test_check_invariants_detects_corruption():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    a.ref_cnt = 0                          # unreferenced but missing from the free queue
    with pytest.raises(AssertionError):
        pool.check_invariants()
