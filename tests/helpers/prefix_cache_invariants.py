"""Invariants of the prefix cache, checked by several tests (lesson 11)."""
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
    cache = bm.gpu_allocator  # a PrefixCachingAllocator
    in_tables = {id(b) for table in bm.block_tables.values() for b in table}
    free = {id(b) for b in cache.free_blocks}
    evictable = {id(b) for b in cache.evictable.values()}
    assert not free & evictable
    assert not evictable & in_tables, "an evictable block is referenced by a sequence"
    for block in cache.blocks:
        if block.ref_count == 0:
            assert (id(block) in free) != (id(block) in evictable), block
            if id(block) in free:
                assert not cache.is_cached(block), block
                assert block.block_number not in cache.contents, block
            else:
                assert cache.is_cached(block), block
    # Only blocks of the pool are named, each by its own contents.
    assert all(0 <= n < cache.num_blocks for n in cache.contents)
    cached = [b for b in cache.blocks if cache.is_cached(b)]
    assert len(cached) == len(cache.by_hash) == len({cache.block_hash_of(b) for b in cached})
    for h, block in cache.by_hash.items():
        assert cache.is_cached(block) and cache.block_hash_of(block) == h
        assert cache.contents[block.block_number].block_hash == h
    bs = bm.block_size

    def contents_of(block):  # what the cache says a held block (or its swapped-out copy) holds
        names = cache.contents if block.device is cache.device else cache.swapped_contents
        return names.get(block.block_number)

    for seq_id, table in bm.block_tables.items():
        tokens = bm.seqs[seq_id].get_token_ids()
        for i, block in enumerate(table):
            contents = contents_of(block)
            if contents is None:
                continue
            assert contents.token_ids == tuple(tokens[i * bs:(i + 1) * bs]), (seq_id, i)
            parent = contents_of(table[i - 1]) if i else None
            assert contents.parent_id == (parent.content_id if parent else None), (seq_id, i)
