"""Lesson 11's reference answer: the prefix-caching allocator, its state and its methods.

The learner's stub (``minipaged.exercises.lesson11.MyPrefixCachingAllocator``) says only what
each operation must do; how the cache keeps its blocks is the learner's choice. This answer keeps
a stack of free blocks, a record per named block (``BlockContents``), a dict from name to the
cached block and an ``OrderedDict`` of evictable blocks in least-recently-used order. The ideas
are in ``docs/`` and lesson 11: a full block is named by a hash chain, a hit is confirmed by
comparing token ids and the parent, a freed cached block is kept as evictable, and eviction
happens only when no block is truly free.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from minipaged.block import Device, PhysicalTokenBlock
from minipaged.core.allocator import BlockAllocator
from minipaged.core.prefix_caching_allocator import BlockContents, block_hash


class MyPrefixCachingAllocator(BlockAllocator):
    """The GPU pool's allocator with a cache of named full blocks (lesson 11)."""

    def __init__(self, device: Device, block_size: int, num_blocks: int,
                 hash_fn=block_hash) -> None:
        self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
        self.blocks = [PhysicalTokenBlock(device, i, block_size) for i in range(num_blocks)]
        self.hash_fn = hash_fn
        self.num_evictions = 0
        self.free_blocks = self.blocks[::-1]  # a stack: block 0 on top, popped first
        self.contents: dict[int, BlockContents] = {}  # block number -> what it holds
        self.swapped_contents: dict[int, BlockContents] = {}  # swap-space block -> the same
        self.by_hash: dict[int, PhysicalTokenBlock] = {}  # name -> the cached block
        self.evictable: OrderedDict[int, PhysicalTokenBlock] = OrderedDict()  # LRU first
        self._content_ids = itertools.count()  # equal ids: the same KV

    # -- handing out and taking back -------------------------------------------------------------
    def allocate(self) -> PhysicalTokenBlock:
        """A block with ref count 1: a truly free one if any, else the least recently used
        evictable block, evicted first; ``ValueError`` when neither is left."""
        if not self.free_blocks and self.evictable:
            oldest = next(iter(self.evictable.values()))  # the front: freed longest ago
            self._evict(oldest)
        if not self.free_blocks:
            raise ValueError(f"out of {self.device.value.upper()} blocks: all "
                             f"{self.num_blocks} are in use")
        block = self.free_blocks.pop()
        block.ref_count = 1
        return block

    def free(self, block: PhysicalTokenBlock) -> None:
        """Drop one reference. A cached block nobody holds any more keeps its KV and its name
        and becomes evictable (the most recently used); any other block nobody holds returns
        to the free list and forgets what it held."""
        if block.device is not self.device:
            raise ValueError(f"{block} does not belong to the {self.device.value} pool")
        if block.ref_count == 0:
            raise ValueError(f"double free of {block}")
        if block.ref_count == 1 and self.is_cached(block):
            block.ref_count = 0
            self.evictable[block.block_number] = block  # at the end: evicted last
            return
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks.append(block)
            self.contents.pop(block.block_number, None)  # its slots will hold other tokens

    def acquire(self, block: PhysicalTokenBlock) -> None:
        """One more table holds ``block``; an evictable block is taken back off that list."""
        if block.ref_count == 0:
            self.evictable.pop(block.block_number)
        block.ref_count += 1

    def get_num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)  # evictable blocks can be had

    def free_block_numbers(self) -> list[int]:
        """The truly free blocks (top of the stack first), then the evictable ones, LRU first."""
        return [b.block_number for b in reversed(self.free_blocks)] + list(self.evictable)

    def evictable_block_numbers(self) -> list[int]:
        return list(self.evictable)

    # -- finding prefixes ------------------------------------------------------------------------
    def lookup(self, parent: PhysicalTokenBlock | None,
               token_ids: tuple[int, ...]) -> PhysicalTokenBlock | None:
        """The cached block holding ``token_ids`` right after ``parent``'s prefix, or None."""
        parent_name = None if parent is None else self.block_hash_of(parent)
        candidate = self.by_hash.get(self.hash_fn(parent_name, token_ids))
        if candidate is None:
            return None
        # The name is only a hash: confirm the tokens and the parent before trusting it.
        if not self._same_contents(candidate, parent, token_ids):
            return None
        return candidate

    def longest_cached_prefix(self, token_ids: Sequence[int],
                              max_blocks: int) -> list[PhysicalTokenBlock]:
        """The cached blocks of the longest run of full blocks of ``token_ids`` from the start,
        at most ``max_blocks``; each one is looked up after the one found before it."""
        size = self.block_size
        found: list[PhysicalTokenBlock] = []
        for i in range(max_blocks):
            chunk = tuple(token_ids[i * size:(i + 1) * size])
            block = self.lookup(found[-1] if found else None, chunk)
            if block is None:
                break  # a later block only counts after every block before it
            found.append(block)
        return found

    # -- naming blocks ---------------------------------------------------------------------------
    def name_blocks(self, blocks: Sequence[PhysicalTokenBlock],
                    token_ids: Sequence[Sequence[int]]) -> None:
        """Name the full blocks of one sequence that have no name yet (they follow the named
        ones: a sequence's blocks fill up from its first)."""
        first_unnamed = len(blocks)
        while first_unnamed > 0 and blocks[first_unnamed - 1].block_number not in self.contents:
            first_unnamed -= 1
        for i in range(first_unnamed, len(blocks)):
            parent = blocks[i - 1] if i > 0 else None
            self._name_block(blocks[i], parent, tuple(token_ids[i]))

    def _name_block(self, block: PhysicalTokenBlock, parent: PhysicalTokenBlock | None,
                    token_ids: tuple[int, ...]) -> None:
        """Give ``block`` its name, and cache it unless an equal block is cached already."""
        above = None if parent is None else self.contents[parent.block_number]
        parent_name = None if above is None else above.block_hash
        parent_id = None if above is None else above.content_id
        name = self.hash_fn(parent_name, token_ids)
        holder = self.by_hash.get(name)
        if holder is not None and self._same_contents(holder, parent, token_ids):
            # The same prefix computed a second time: a private copy of the same KV.
            same_kv = self.contents[holder.block_number].content_id
            self.contents[block.block_number] = BlockContents(name, token_ids, same_kv, parent_id)
            return
        self.contents[block.block_number] = BlockContents(name, token_ids,
                                                          next(self._content_ids), parent_id)
        if holder is not None:
            if holder.ref_count > 0:
                return  # the name is taken by another prefix in use: stay private
            self._evict(holder)  # an evictable block with another prefix under this name
        self.by_hash[name] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, only when no block is held; not counted as evictions."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in list(self.evictable.values()):
            self._evict(block, counted=False)
        return True

    def _evict(self, block: PhysicalTokenBlock, counted: bool = True) -> None:
        """An evictable block loses its name and goes to the free list, to be reused
        (``counted``: for room; a reset evicts uncounted)."""
        self.evictable.pop(block.block_number)
        contents = self.contents.pop(block.block_number)
        del self.by_hash[contents.block_hash]
        if counted:
            self.num_evictions += 1
        self.free_blocks.append(block)

    # -- copies: swapping out and in -------------------------------------------------------------
    def copy_contents(self, src: PhysicalTokenBlock, dst: PhysicalTokenBlock) -> None:
        """``dst`` holds a copy of ``src``'s KV: it carries the same name (never cached)."""
        table = self.contents if dst.device is self.device else self.swapped_contents
        if src.block_number in self.contents:
            table[dst.block_number] = self.contents[src.block_number]
        else:
            table.pop(dst.block_number, None)

    def find_equal(self, copy: PhysicalTokenBlock) -> PhysicalTokenBlock | None:
        """The cached block that still holds the KV swapped out to ``copy``, or None."""
        held = self._contents_of(copy)
        if held is None:
            return None
        holder = self.by_hash.get(held.block_hash)
        if holder is None or self.contents[holder.block_number].content_id != held.content_id:
            return None  # evicted since, or the name now holds another prefix
        return holder

    def adopt(self, block: PhysicalTokenBlock, copy: PhysicalTokenBlock) -> None:
        """``block`` got ``copy``'s KV back: it takes the name, cached if the name is free."""
        held = self._contents_of(copy)
        if held is None:
            return
        self.contents[block.block_number] = held
        self.by_hash.setdefault(held.block_hash, block)

    # -- reading ---------------------------------------------------------------------------------
    def block_hash_of(self, block: PhysicalTokenBlock) -> int | None:
        held = self._contents_of(block)
        return None if held is None else held.block_hash

    def is_cached(self, block: PhysicalTokenBlock) -> bool:
        if block.device is not self.device or block.block_number not in self.contents:
            return False
        return self.by_hash.get(self.contents[block.block_number].block_hash) is block

    def _contents_of(self, block: PhysicalTokenBlock) -> BlockContents | None:
        if block.device is self.device:
            return self.contents.get(block.block_number)
        # a swap-space block holds a copy only while it is held
        return self.swapped_contents.get(block.block_number) if block.ref_count else None

    def _same_contents(self, block: PhysicalTokenBlock, parent: PhysicalTokenBlock | None,
                       token_ids: tuple[int, ...]) -> bool:
        """Does ``block`` hold ``token_ids`` right after the KV that ``parent`` holds?"""
        held = self.contents[block.block_number]
        parent_id = None if parent is None else self.contents[parent.block_number].content_id
        return held.token_ids == token_ids and held.parent_id == parent_id
