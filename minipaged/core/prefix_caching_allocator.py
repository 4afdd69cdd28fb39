"""Automatic prefix caching: full blocks named by a hash chain, kept after use, evicted by LRU
(lesson 11).

Chat requests repeat the same system prompt. Its KV is the same in every request, so the blocks
that hold it can be computed once and shared, exactly as a fork shares a prompt (lesson 03), but
across requests:

- A *full* block is named by ``block_hash(parent_hash, token_ids)``: the hash of the block before
  it and its own tokens, so the name covers every token from the start of the sequence.
- ``PrefixCachingAllocator`` maps names to physical blocks. A prompt walks its blocks from the
  first and takes the longest run found there (ref count + 1); only the rest is computed.
- A hash hit is *confirmed*: the cached block must hold the same token ids and follow the same
  parent block (``content_id``), so a collision can never serve another prefix's KV.
- A cached block whose ref count drops to zero is *evictable*: it still holds its KV and can be
  found again, but counts as free. An allocation that finds the free list empty evicts the least
  recently used one (its name is dropped, its slots reused).

What a block holds is kept here, in ``contents`` (by block number), never on the block itself.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from minipaged.core.allocator import FreeListAllocator
from minipaged.block import Device, PhysicalTokenBlock

HashFn = Callable[[int | None, tuple[int, ...]], int]


def block_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """The name of a full block: its parent's name and its own tokens, hashed together.

    Two blocks get the same name only if every token from the start of the sequence matches (or
    the hash collides, which the cache catches by comparing token ids).
    """
    # NOTE: Python's hash of a tuple of ints is deterministic (no per-process salt) and fast.
    # If anything else ever changed a block's KV (a LoRA adapter, another model), it would go
    # into this tuple too.
    return hash((parent_hash, tuple(token_ids)))


@dataclass(frozen=True)
class BlockContents:
    """What a full block holds, once it is full and computed."""

    block_hash: int  # hash of (parent's hash, token ids): its name
    token_ids: tuple[int, ...]  # its tokens, to confirm a hash hit
    content_id: int  # the KV it holds: equal ids, equal prefixes
    parent_id: int | None  # content_id of the block before it in the sequence


class PrefixCachingAllocator(FreeListAllocator):
    """The GPU pool's allocator with a cache of named full blocks.

    ``allocate`` takes a truly free block first and evicts the least recently used evictable
    block only when there is none; ``free`` keeps a cached block as evictable instead of
    forgetting it; ``get_num_free_blocks`` counts both.

    Args:
        device, block_size, num_blocks: the pool, as for ``FreeListAllocator``.
        hash_fn: ``hash_fn(parent_hash, token_ids) -> int``; tests pass a colliding one.
    """

    def __init__(self, device: Device, block_size: int, num_blocks: int,
                 hash_fn: HashFn = block_hash) -> None:
        super().__init__(device, block_size, num_blocks)
        self.hash_fn = hash_fn
        self.contents: dict[int, BlockContents] = {}  # block number -> what the block holds
        # Swap-space block number -> what the block swapped out there held. NOTE: a swap-space
        # block's entry is rewritten by every swap-out into it, and ignored while it is free.
        self.swapped_contents: dict[int, BlockContents] = {}
        self.by_hash: dict[int, PhysicalTokenBlock] = {}  # name -> the block handed out for it
        # Cached blocks nobody holds, least recently used first: the next to be evicted.
        self.evictable: OrderedDict[int, PhysicalTokenBlock] = OrderedDict()
        self._content_ids = itertools.count()

    # -- the allocator's interface ---------------------------------------------------------------
    def allocate(self) -> PhysicalTokenBlock:
        if not self.free_blocks and self.evictable:
            self._evict(next(iter(self.evictable.values())))  # least recently used
        return super().allocate()

    def free(self, block: PhysicalTokenBlock) -> None:
        if block.ref_count == 1 and self.is_cached(block):
            # NOTE: the KV stays in the block; a later prompt with the same prefix takes it back.
            block.ref_count = 0
            self.evictable[block.block_number] = block  # most recently used: evicted last
            return
        super().free(block)
        if block.ref_count == 0:
            self.contents.pop(block.block_number, None)  # reused for other tokens

    def get_num_free_blocks(self) -> int:
        return super().get_num_free_blocks() + len(self.evictable)

    def free_block_numbers(self) -> list[int]:
        """Next to be allocated first: the free list, then the evictable blocks in LRU order."""
        return super().free_block_numbers() + list(self.evictable)

    # -- finding prefixes ------------------------------------------------------------------------
    def lookup(self, parent: PhysicalTokenBlock | None,
               token_ids: tuple[int, ...]) -> PhysicalTokenBlock | None:
        """The cached block holding ``token_ids`` right after ``parent``'s prefix, or None."""
        parent_hash = self.block_hash_of(parent) if parent is not None else None
        block = self.by_hash.get(self.hash_fn(parent_hash, token_ids))
        if block is None or not self._same_contents(block, parent, token_ids):
            return None  # a miss, or a hash collision caught by the comparison
        return block

    def longest_cached_prefix(self, token_ids: Sequence[int],
                              max_blocks: int) -> list[PhysicalTokenBlock]:
        """The cached blocks of the longest run of full blocks of ``token_ids`` from the start
        (at most ``max_blocks``): each found by its name, after the one found before it."""
        found: list[PhysicalTokenBlock] = []
        parent, size = None, self.block_size
        for i in range(max_blocks):
            block = self.lookup(parent, tuple(token_ids[i * size:(i + 1) * size]))
            if block is None:
                break
            found.append(block)
            parent = block
        return found

    def acquire(self, block: PhysicalTokenBlock) -> None:
        if block.ref_count == 0:
            del self.evictable[block.block_number]  # an evictable block is taken back
        block.ref_count += 1

    # -- naming blocks ---------------------------------------------------------------------------
    def name_blocks(self, blocks: Sequence[PhysicalTokenBlock],
                    token_ids: Sequence[Sequence[int]]) -> None:
        first = len(blocks)  # the blocks before it already have a name
        while first > 0 and blocks[first - 1].block_number not in self.contents:
            first -= 1
        for i in range(first, len(blocks)):
            self._name_block(blocks[i], blocks[i - 1] if i else None, tuple(token_ids[i]))

    def _name_block(self, block: PhysicalTokenBlock, parent: PhysicalTokenBlock | None,
                    token_ids: tuple[int, ...]) -> None:
        """``block`` holds (or will hold by the end of this step) ``token_ids`` after
        ``parent``'s prefix: give it its name, and cache it unless an equal block already is."""
        parent_contents = self.contents[parent.block_number] if parent is not None else None
        parent_hash = parent_contents.block_hash if parent_contents else None
        parent_id = parent_contents.content_id if parent_contents else None
        name = self.hash_fn(parent_hash, token_ids)
        holder = self.by_hash.get(name)
        if holder is not None and self._same_contents(holder, parent, token_ids):
            # The same prefix computed twice (e.g. two prompts admitted before either was
            # cached): this copy stays private, and is known to hold the same KV.
            content_id = self.contents[holder.block_number].content_id
            self.contents[block.block_number] = BlockContents(name, token_ids, content_id,
                                                              parent_id)
            return
        self.contents[block.block_number] = BlockContents(name, token_ids,
                                                          next(self._content_ids), parent_id)
        if holder is not None:
            if holder.ref_count > 0:
                return  # a collision with a block in use: this one stays private
            # A collision with (or a stale child of an evicted parent in) an evictable block.
            self._evict(holder)
        self.by_hash[name] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's name): all must be free, none held by a request;
        returns whether it could. Benchmarks call it so that a trace run twice computes its
        prompts twice."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in list(self.evictable.values()):
            self._evict(block, counted=False)
        return True

    # -- copies: copy-on-write and swapping ------------------------------------------------------
    def copy_contents(self, src: PhysicalTokenBlock, dst: PhysicalTokenBlock) -> None:
        table = self.contents if dst.device is self.device else self.swapped_contents
        contents = self.contents.get(src.block_number)
        if contents is None:
            table.pop(dst.block_number, None)
        else:
            table[dst.block_number] = contents

    def find_equal(self, copy: PhysicalTokenBlock) -> PhysicalTokenBlock | None:
        contents = self._contents_of(copy)
        if contents is None:
            return None
        holder = self.by_hash.get(contents.block_hash)
        if holder is not None and self.contents[holder.block_number].content_id == \
                contents.content_id:
            return holder
        return None

    def adopt(self, block: PhysicalTokenBlock, copy: PhysicalTokenBlock) -> None:
        contents = self._contents_of(copy)
        if contents is None:
            return
        self.contents[block.block_number] = contents
        if contents.block_hash not in self.by_hash:
            self.by_hash[contents.block_hash] = block

    # -- reading ---------------------------------------------------------------------------------
    def block_hash_of(self, block: PhysicalTokenBlock) -> int | None:
        contents = self._contents_of(block)
        return contents.block_hash if contents is not None else None

    def is_cached(self, block: PhysicalTokenBlock) -> bool:
        contents = self.contents.get(block.block_number) if block.device is self.device else None
        return contents is not None and self.by_hash.get(contents.block_hash) is block

    def evictable_block_numbers(self) -> list[int]:
        return list(self.evictable)

    # -- helpers ---------------------------------------------------------------------------------
    def _contents_of(self, block: PhysicalTokenBlock) -> BlockContents | None:
        if block.device is self.device:
            return self.contents.get(block.block_number)
        if block.ref_count == 0:
            return None  # a free swap-space block holds nothing
        return self.swapped_contents.get(block.block_number)

    def _same_contents(self, block: PhysicalTokenBlock, parent: PhysicalTokenBlock | None,
                       token_ids: tuple[int, ...]) -> bool:
        contents = self.contents[block.block_number]
        parent_id = self.contents[parent.block_number].content_id if parent is not None else None
        return contents.token_ids == token_ids and contents.parent_id == parent_id

    def _evict(self, block: PhysicalTokenBlock, counted: bool = True) -> None:
        """An evictable block loses its name and goes to the free list, to be reused
        (``counted``: an eviction for room, not a reset)."""
        del self.evictable[block.block_number]
        del self.by_hash[self.contents.pop(block.block_number).block_hash]
        self.num_evictions += counted
        self.free_blocks.append(block)
