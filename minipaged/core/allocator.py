"""Block allocators: who hands out the physical blocks of a pool (lesson 02; caching: lesson 11).

``BlockAllocator`` is the one interface the block manager talks to. It has two implementations:

- ``FreeListAllocator`` (here): a free list and nothing else. Its caching operations are
  documented no-ops (``NoCacheAllocator``), so a block manager over it behaves as if no block
  were ever cached.
- ``PrefixCachingAllocator`` (``prefix_caching_allocator.py``): the same free list, plus full
  blocks named by their tokens that later prompts can take back (lesson 11).

The block manager picks one of them once, when it is built, and never asks which it holds.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from minipaged.block import Device, PhysicalTokenBlock


class BlockAllocator(ABC):
    """Hands out the physical blocks of one pool (GPU or CPU) and takes them back.

    Attributes:
        device, block_size, num_blocks: the pool.
        blocks: every block of the pool, indexed by block number.
        num_evictions: cached blocks given up for room so far (always 0 without a cache).
    """

    device: Device
    block_size: int
    num_blocks: int
    blocks: list[PhysicalTokenBlock]
    num_evictions: int

    # -- handing out and taking back -------------------------------------------------------------
    @abstractmethod
    def allocate(self) -> PhysicalTokenBlock:
        """A free block with ref count 1; ``ValueError`` when none is left."""

    @abstractmethod
    def free(self, block: PhysicalTokenBlock) -> None:
        """Drop one reference; a block nobody holds becomes free again.

        Args:
            block: a block of this pool with ref count > 0 (``ValueError`` otherwise).
        """

    @abstractmethod
    def get_num_free_blocks(self) -> int:
        """Blocks ``allocate`` can still hand out."""

    @abstractmethod
    def free_block_numbers(self) -> list[int]:
        """The free blocks, next-to-be-allocated first."""

    # -- prefix caching (lesson 11) --------------------------------------------------------------
    @abstractmethod
    def longest_cached_prefix(self, token_ids: Sequence[int],
                              max_blocks: int) -> list[PhysicalTokenBlock]:
        """The cached blocks holding the longest run of full blocks of ``token_ids`` from the
        start (at most ``max_blocks``). They are not taken: see ``acquire``.

        Args:
            token_ids: a sequence's tokens from its first.
            max_blocks: how many of its full blocks may come from the cache.
        """

    @abstractmethod
    def acquire(self, block: PhysicalTokenBlock) -> None:
        """One more block table holds ``block`` (a block found by ``longest_cached_prefix`` or
        ``find_equal``, or one shared by a fork): its ref count grows by one.

        NOTE: the allocators are the only writers of ``ref_count``; the block manager asks."""

    @abstractmethod
    def name_blocks(self, blocks: Sequence[PhysicalTokenBlock],
                    token_ids: Sequence[Sequence[int]]) -> None:
        """``blocks[i]`` holds the full block of tokens ``token_ids[i]``, right after
        ``blocks[i - 1]`` (the blocks of one sequence from its first): name those not named yet,
        so that later prompts starting with the same tokens can find them.

        Args:
            blocks: a prefix of a sequence's block table, all of it full and computed.
            token_ids: the tokens of each of those blocks.
        """

    @abstractmethod
    def copy_contents(self, src: PhysicalTokenBlock, dst: PhysicalTokenBlock) -> None:
        """``dst`` now holds a copy of the KV of ``src`` (a block of this pool): a private copy
        in this pool, or the copy swapped out to swap space. It carries the same name; only
        ``src`` stays the one the cache hands out."""

    @abstractmethod
    def find_equal(self, copy: PhysicalTokenBlock) -> PhysicalTokenBlock | None:
        """A cached block of this pool that still holds the same KV as ``copy`` (a block that
        ``copy_contents`` swapped out), or None. Swapping in takes it instead of copying."""

    @abstractmethod
    def adopt(self, block: PhysicalTokenBlock, copy: PhysicalTokenBlock) -> None:
        """``block`` (of this pool) received the KV swapped out to ``copy``: it takes that name
        back, and is cached unless another block holds the name by now."""

    # -- reading ---------------------------------------------------------------------------------
    @abstractmethod
    def block_hash_of(self, block: PhysicalTokenBlock) -> int | None:
        """The name of what ``block`` holds (of this pool, or a swapped-out copy), or None."""

    @abstractmethod
    def is_cached(self, block: PhysicalTokenBlock) -> bool:
        """Is ``block`` the one the cache hands out for its name?"""

    @abstractmethod
    def evictable_block_numbers(self) -> list[int]:
        """Cached blocks nobody holds (they count as free), next to be evicted first."""


class NoCacheAllocator(BlockAllocator):
    """The caching operations of a pool without a prefix cache: nothing is ever found, named or
    evicted, so a block manager over it behaves as if no block were ever cached. What is left
    to write is the free list itself (``FreeListAllocator``; the learner's own in lesson 02)."""

    def longest_cached_prefix(self, token_ids, max_blocks) -> list[PhysicalTokenBlock]:
        return []  # nothing is cached

    def name_blocks(self, blocks, token_ids) -> None:
        pass  # no names: nothing will be looked up

    def copy_contents(self, src, dst) -> None:
        pass  # no names to carry

    def find_equal(self, copy) -> PhysicalTokenBlock | None:
        return None  # swapping in always copies

    def adopt(self, block, copy) -> None:
        pass  # no names to take back

    def block_hash_of(self, block) -> int | None:
        return None

    def is_cached(self, block) -> bool:
        return False

    def evictable_block_numbers(self) -> list[int]:
        return []


class FreeListAllocator(NoCacheAllocator):
    """A pool's blocks on a free list (lesson 02); no cache.

    ``allocate`` pops a block from the free list with ref count 1; ``free`` drops one reference
    and returns the block to the free list when no table holds it any more.

    Args:
        device: the pool's device.
        block_size: tokens per block.
        num_blocks: blocks in the pool.
    """

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks = [PhysicalTokenBlock(device, i, block_size) for i in range(num_blocks)]
        # NOTE: a list used as a stack: the most recently freed block is reused first, which
        # keeps the picture in the lessons compact. Any order would be correct.
        self.free_blocks: list[PhysicalTokenBlock] = list(reversed(self.blocks))
        self.num_evictions = 0

    def allocate(self) -> PhysicalTokenBlock:
        if not self.free_blocks:
            raise ValueError(f"out of {self.device.value.upper()} blocks: all "
                             f"{self.num_blocks} are in use")
        block = self.free_blocks.pop()
        assert block.ref_count == 0
        block.ref_count = 1
        return block

    def free(self, block: PhysicalTokenBlock) -> None:
        if block.device is not self.device:
            raise ValueError(f"{block} does not belong to the {self.device.value} pool")
        if block.ref_count == 0:
            raise ValueError(f"double free of {block}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks.append(block)

    def acquire(self, block: PhysicalTokenBlock) -> None:
        block.ref_count += 1

    def get_num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def free_block_numbers(self) -> list[int]:
        return [b.block_number for b in reversed(self.free_blocks)]
