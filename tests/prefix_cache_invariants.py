"""Invariants of the prefix cache, checked by several tests (lesson 07)."""
from __future__ import annotations

from minipaged.core.block_manager import BlockSpaceManager


def check_prefix_cache(bm: BlockSpaceManager) -> None:
    """No leak, no evictable block in use, one cached block per hash, names that tell the truth.

    - every GPU block is held (ref count > 0), or free, or cached and evictable (ref count 0);
    - an evictable block is in no block table;
    - the cache holds exactly the blocks marked cached, each under its own hash, once;
    - a named block in a table holds that sequence's tokens at that place, and follows the
      block before it: a hash hit (even a forced collision) never served another prefix.
    """
    cache = bm.prefix_cache
    in_tables = {id(b) for table in bm.block_tables.values() for b in table}
    free = {id(b) for b in bm.gpu_allocator.free_blocks}
    evictable = {id(b) for b in cache.evictable.values()}
    assert not free & evictable
    assert not evictable & in_tables, "an evictable block is referenced by a sequence"
    for block in bm.gpu_allocator.blocks:
        if block.ref_count == 0:
            assert (id(block) in free) != (id(block) in evictable), block
            if id(block) in free:
                assert not block.cached and block.content_id is None, block
            else:
                assert block.cached, block
    cached = [b for b in bm.gpu_allocator.blocks if b.cached]
    assert len(cached) == len(cache.by_hash) == len({b.block_hash for b in cached})
    for h, block in cache.by_hash.items():
        assert block.cached and block.block_hash == h
    bs = bm.block_size
    for seq_id, table in bm.block_tables.items():
        tokens = bm.seqs[seq_id].get_token_ids()
        for i, block in enumerate(table):
            if block.content_id is None:
                continue
            assert block.token_ids == tuple(tokens[i * bs:(i + 1) * bs]), (seq_id, i)
            assert block.parent_id == (table[i - 1].content_id if i else None), (seq_id, i)
