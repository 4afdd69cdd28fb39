"""Lesson 11's reference answer: the prefix-caching allocator's core methods.

The learner's stub (``minipaged.exercises.lesson11.MyPrefixCachingAllocator``) inherits the
package's ``PrefixCachingAllocator`` for everything around the cache (copies, swapping, reading)
and writes the methods below. The ideas are in ``docs/`` and lesson 11: a full block is named by
a hash chain, a hit is confirmed by comparing token ids and the parent, a freed cached block is
kept as evictable (least recently used first), and eviction happens only when the free list is
empty.
"""
from __future__ import annotations

from collections.abc import Sequence

from minipaged.block import PhysicalTokenBlock
from minipaged.core.prefix_caching_allocator import BlockContents, PrefixCachingAllocator


class MyPrefixCachingAllocator(PrefixCachingAllocator):
    """The GPU pool's allocator with a cache of named full blocks (lesson 11)."""

    def allocate(self) -> PhysicalTokenBlock:
        """A block with ref count 1: a truly free one if any, else the least recently used
        evictable block, evicted first; ``ValueError`` when neither is left."""
        if not self.free_blocks and self.evictable:
            oldest = next(iter(self.evictable.values()))  # the front: freed longest ago
            self._evict(oldest)
        if not self.free_blocks:
            raise ValueError(f"out of {self.device.value.upper()} blocks: all "
                             f"{self.num_blocks} are in use")
        block = self.free_blocks.pop()  # a stack, as the free-list allocator keeps it
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

    def acquire(self, block: PhysicalTokenBlock) -> None:
        """One more table holds ``block``; an evictable block is taken back off that list."""
        if block.ref_count == 0:
            self.evictable.pop(block.block_number)
        block.ref_count += 1

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

    def _evict(self, block: PhysicalTokenBlock, counted: bool = True) -> None:
        """An evictable block loses its name and goes to the free list, to be reused
        (``counted``: for room; ``reset_prefix_cache`` evicts uncounted)."""
        self.evictable.pop(block.block_number)
        contents = self.contents.pop(block.block_number)
        del self.by_hash[contents.block_hash]
        if counted:
            self.num_evictions += 1
        self.free_blocks.append(block)
