"""Per-request block tables over the BlockPool, with automatic prefix caching."""
from __future__ import annotations

from typing import Optional

from sluice.engine.block_pool import Block, BlockPool, hash_block, salted_root
from sluice.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.prefix_queries = 0   # prompt tokens looked up (cumulative)
        self.prefix_hits = 0      # of which found in the cache

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, req: Request) -> None:
        """Extend req.block_hashes to cover every full block of its known tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        parent = hashes[-1][0] if hashes else salted_root(req.params.cache_salt)
        for i in range(len(hashes), req.num_tokens // bs):
            value, key = hash_block(parent, tuple(req.all_token_ids[i * bs:(i + 1) * bs]))
            hashes.append((value, key))
            parent = value

    def get_computed_blocks(self, req: Request) -> list[Block]:
        """Longest run of cached leading blocks. At least one token is always left to compute,
        since its logits are needed."""
        if not self.pool.enable_caching:
            return []
        self.update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for value, key in req.block_hashes[:max_blocks]:
            b = self.pool.lookup(key)
            if b is None:
                break
            hits.append(b)
        return hits

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    def can_fit(self, req: Request, num_new_tokens: int, computed: list[Block] = (), tail_tokens: int = 0) -> bool:
        need = self._num_new_blocks(req, num_new_tokens, computed, tail_tokens)
        reusable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        return need <= self.pool.num_free_blocks - reusable_hits

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[Block] = (),
                       tail: Optional[tuple[Block, int]] = None) -> bool:
        """Give `req` blocks for `num_new_tokens` more tokens (after taking `computed` prefix
        hits and, with `tail` = (block, n), a partly filled block whose first n slots hold the KV
        of the tokens after the hits; the caller hands over its reference on that block).
        All or nothing: returns False and changes nothing when the pool is short."""
        tail_tokens = tail[1] if tail is not None else 0
        if not self.can_fit(req, num_new_tokens, computed, tail_tokens):
            return False
        need = self._num_new_blocks(req, num_new_tokens, computed, tail_tokens)
        if computed:
            self.pool.touch(computed)
            req.blocks.extend(computed)
            req.num_cached_blocks = len(req.blocks)
        if tail is not None:
            assert tail[0].ref_cnt == 1 and tail[0].hash_key is None, "a tail block is private"
            req.blocks.append(tail[0])
        if need > 0:
            req.blocks.extend(self.pool.allocate(need))
        return True

    def num_free_slots(self, req: Request) -> int:
        """Token slots left in the blocks the request holds, past its computed tokens."""
        return len(req.blocks) * self.block_size - req.num_computed_tokens

    def _num_new_blocks(self, req: Request, num_new_tokens: int, computed, tail_tokens: int = 0) -> int:
        total = req.num_computed_tokens + len(computed) * self.block_size + tail_tokens + num_new_tokens
        return self.blocks_for(total) - len(req.blocks) - len(computed) - (1 if tail_tokens else 0)

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.pool.enable_caching:
            return
        n_full = req.num_computed_tokens // self.block_size
        if n_full <= req.num_cached_blocks:
            return
        self.update_block_hashes(req)
        for i in range(req.num_cached_blocks, n_full):
            value, key = req.block_hashes[i]
            self.pool.cache(req.blocks[i], value, key)
        req.num_cached_blocks = n_full

    def trim(self, req: Request) -> None:
        """Free blocks past what the request's tokens need (slots of rejected speculative drafts)."""
        keep = self.blocks_for(req.num_tokens)
        if len(req.blocks) > keep:
            tail, req.blocks = req.blocks[keep:], req.blocks[:keep]
            self.pool.free(reversed(tail))

    def free(self, req: Request) -> None:
        """Release the request's blocks tail-first, so its tail is evicted before its prefix."""
        self.pool.free(reversed(req.blocks))
        req.blocks = []
        req.num_cached_blocks = 0

    def take_blocks(self, req: Request) -> list[Block]:
        """Detach the request's blocks without freeing them (the caller now owns the refs)."""
        blocks, req.blocks = req.blocks, []
        req.num_cached_blocks = 0
        return blocks
