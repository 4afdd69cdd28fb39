"""Automatic prefix caching: full blocks named by a hash chain, kept after use, evicted by LRU
(lesson 07).

Chat requests repeat the same system prompt. Its KV is the same in every request, so the blocks
that hold it can be computed once and shared, exactly as a fork shares a prompt (lesson 03), but
across requests:

- A *full* block is named by ``block_hash(parent_hash, token_ids)``: the hash of the block before
  it and its own tokens, so the name covers every token from the start of the sequence.
- ``PrefixCache`` maps names to physical blocks. A prompt walks its blocks from the first and
  takes the longest run found there (ref count + 1); only the rest is computed.
- A hash hit is *confirmed*: the cached block must hold the same token ids and follow the same
  parent block (``content_id``), so a collision can never serve another prefix's KV.
- A cached block whose ref count drops to zero is *evictable*: it still holds its KV and can be
  found again, but counts as free. An allocation that finds the free list empty evicts the least
  recently used one (its hash is dropped, its slots reused).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Callable, Sequence

from minipaged.core.block import BlockAllocator, Device, PhysicalTokenBlock

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


class PrefixCache:
    """The GPU pool's allocator with a cache of named full blocks.

    It keeps ``BlockAllocator``'s interface: ``allocate`` takes a truly free block first and
    evicts the least recently used evictable block only when there is none; ``free`` keeps a
    cached block as evictable instead of forgetting it; ``get_num_free_blocks`` counts both.

    Args:
        allocator: the plain allocator of the pool whose blocks are cached.
        hash_fn: ``hash_fn(parent_hash, token_ids) -> int``; tests pass a colliding one.
    """

    def __init__(self, allocator: BlockAllocator, hash_fn: HashFn = block_hash) -> None:
        self.allocator = allocator
        self.hash_fn = hash_fn
        self.by_hash: dict[int, PhysicalTokenBlock] = {}  # name -> the block handed out for it
        # Cached blocks nobody holds, least recently used first: the next to be evicted.
        self.evictable: OrderedDict[int, PhysicalTokenBlock] = OrderedDict()
        self._content_ids = itertools.count()
        self.num_evictions = 0

    # -- BlockAllocator's interface --------------------------------------------------------------
    @property
    def device(self) -> Device:
        return self.allocator.device

    @property
    def blocks(self) -> list[PhysicalTokenBlock]:
        return self.allocator.blocks

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def free_blocks(self) -> list[PhysicalTokenBlock]:
        return self.allocator.free_blocks

    def allocate(self) -> PhysicalTokenBlock:
        if not self.allocator.free_blocks and self.evictable:
            _, victim = self.evictable.popitem(last=False)  # least recently used
            self._uncache(victim)
            self.num_evictions += 1
            self.allocator.free_blocks.append(victim)
        return self.allocator.allocate()

    def free(self, block: PhysicalTokenBlock) -> None:
        if block.ref_count == 1 and block.cached:
            # NOTE: the KV stays in the block; a later prompt with the same prefix takes it back.
            block.ref_count = 0
            self.evictable[block.block_number] = block  # most recently used: evicted last
        else:
            self.allocator.free(block)

    def get_num_free_blocks(self) -> int:
        return self.allocator.get_num_free_blocks() + len(self.evictable)

    def free_block_numbers(self) -> list[int]:
        """Next to be allocated first: the free list, then the evictable blocks in LRU order."""
        return self.allocator.free_block_numbers() + list(self.evictable)

    # -- finding prefixes ------------------------------------------------------------------------
    def lookup(self, parent: PhysicalTokenBlock | None,
               token_ids: tuple[int, ...]) -> PhysicalTokenBlock | None:
        """The cached block holding ``token_ids`` right after ``parent``'s prefix, or None."""
        parent_hash = parent.block_hash if parent is not None else None
        block = self.by_hash.get(self.hash_fn(parent_hash, token_ids))
        if block is None or not self._same_contents(block, parent, token_ids):
            return None  # a miss, or a hash collision caught by the comparison
        return block

    def longest_cached_prefix(self, token_ids: list[int], max_blocks: int,
                              block_size: int) -> list[PhysicalTokenBlock]:
        """The cached blocks of the longest run of full blocks of ``token_ids`` from the start."""
        found: list[PhysicalTokenBlock] = []
        parent = None
        for i in range(max_blocks):
            block = self.lookup(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
            if block is None:
                break
            found.append(block)
            parent = block
        return found

    def acquire(self, block: PhysicalTokenBlock) -> None:
        """One more table holds this cached block (an evictable one is taken back)."""
        if block.ref_count == 0:
            del self.evictable[block.block_number]
        block.ref_count += 1

    # -- naming blocks ---------------------------------------------------------------------------
    def name_block(self, block: PhysicalTokenBlock, parent: PhysicalTokenBlock | None,
                   token_ids: tuple[int, ...]) -> None:
        """``block`` now holds (or will hold by the end of this step) ``token_ids`` after
        ``parent``'s prefix: give it its name, and cache it unless an equal block already is."""
        parent_hash = parent.block_hash if parent is not None else None
        block.block_hash = self.hash_fn(parent_hash, token_ids)
        block.token_ids = token_ids
        block.parent_id = parent.content_id if parent is not None else None
        holder = self.by_hash.get(block.block_hash)
        if holder is not None and self._same_contents(holder, parent, token_ids):
            # The same prefix computed twice (e.g. two prompts admitted before either was
            # cached): this copy stays private, and is known to hold the same KV.
            block.content_id = holder.content_id
            return
        block.content_id = next(self._content_ids)
        if holder is not None:
            if holder.ref_count > 0:
                return  # a collision with a block in use: this one stays private
            # A collision with (or a stale child of an evicted parent in) an evictable block.
            del self.evictable[holder.block_number]
            self._uncache(holder)
            self.num_evictions += 1
            self.allocator.free_blocks.append(holder)
        block.cached = True
        self.by_hash[block.block_hash] = block

    def adopt(self, block: PhysicalTokenBlock) -> None:
        """A named block came back from swap space: cache it, if its name is not taken."""
        if block.content_id is not None and block.block_hash not in self.by_hash:
            block.cached = True
            self.by_hash[block.block_hash] = block

    def find_equal(self, block: PhysicalTokenBlock) -> PhysicalTokenBlock | None:
        """A cached block holding the same KV as ``block`` (a swapped-out copy), or None."""
        if block.content_id is None:
            return None
        holder = self.by_hash.get(block.block_hash)
        if holder is not None and holder.content_id == block.content_id:
            return holder
        return None

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _same_contents(block: PhysicalTokenBlock, parent: PhysicalTokenBlock | None,
                       token_ids: tuple[int, ...]) -> bool:
        parent_id = parent.content_id if parent is not None else None
        return block.token_ids == token_ids and block.parent_id == parent_id

    def _uncache(self, block: PhysicalTokenBlock) -> None:
        del self.by_hash[block.block_hash]
        block.forget_contents()
