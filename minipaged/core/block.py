"""Logical and physical token blocks, and the allocator of a pool of physical blocks (lesson 02).

A sequence's tokens are cut into *logical* blocks of ``block_size`` tokens. Each logical block is
stored in a *physical* block of the KV cache; the sequence's block table says which. Physical
blocks are handed out by a ``BlockAllocator`` from a free list, and carry a reference count so that
several sequences can share one (lesson 03, copy-on-write). A full physical block may also carry
the name of its contents, a hash, so that later prompts starting with the same tokens can find it
(lesson 07, ``prefix_cache.py``).
"""
from __future__ import annotations

from enum import Enum


class Device(Enum):
    GPU = "gpu"  # the pool the model reads from (on a CPU-only machine it still lives in RAM)
    CPU = "cpu"  # swap space


class LogicalTokenBlock:
    """``block_size`` token slots of one sequence, filled left to right."""

    def __init__(self, block_number: int, block_size: int) -> None:
        self.block_number = block_number  # index of this block within its sequence
        self.block_size = block_size
        self.token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def is_empty(self) -> bool:
        return not self.token_ids

    def is_full(self) -> bool:
        return len(self.token_ids) == self.block_size

    def get_num_empty_slots(self) -> int:
        return self.block_size - len(self.token_ids)

    def append_tokens(self, token_ids: list[int]) -> None:
        assert len(token_ids) <= self.get_num_empty_slots()
        self.token_ids.extend(token_ids)

    def get_last_token_id(self) -> int:
        return self.token_ids[-1]

    def copy(self) -> LogicalTokenBlock:
        block = LogicalTokenBlock(self.block_number, self.block_size)
        block.token_ids = list(self.token_ids)
        return block

    def __repr__(self) -> str:
        return f"LogicalTokenBlock(#{self.block_number}, {self.num_tokens}/{self.block_size})"


class PhysicalTokenBlock:
    """One block of the KV cache pool: its number, where it lives, and how many tables hold it."""

    def __init__(self, device: Device, block_number: int, block_size: int) -> None:
        self.device = device
        self.block_number = block_number  # index into the cache tensors' first dimension
        self.block_size = block_size
        self.ref_count = 0
        # Prefix caching (lesson 07): what this full block holds, once it is full and computed.
        self.block_hash: int | None = None  # hash of (parent's hash, token ids): its name
        self.token_ids: tuple[int, ...] | None = None  # its tokens, to confirm a hash hit
        self.content_id: int | None = None  # the KV it holds: equal ids, equal prefixes
        self.parent_id: int | None = None  # content_id of the block before it in the sequence
        self.cached: bool = False  # is it the block the prefix cache hands out for its hash?

    def forget_contents(self) -> None:
        """The block is reused for other tokens: it no longer holds any prefix."""
        self.block_hash = self.token_ids = self.content_id = self.parent_id = None
        self.cached = False

    def copy_contents_from(self, other: PhysicalTokenBlock) -> None:
        """This block now holds a copy of ``other``'s KV (copy-on-write, swapping)."""
        self.block_hash, self.token_ids = other.block_hash, other.token_ids
        self.content_id, self.parent_id = other.content_id, other.parent_id

    def __repr__(self) -> str:
        return f"PhysicalTokenBlock({self.device.value}#{self.block_number}, ref={self.ref_count})"


class BlockAllocator:
    """Hands out the physical blocks of one pool (GPU or CPU) and takes them back.

    ``allocate`` pops a block from the free list with ref count 1; ``free`` drops one reference
    and returns the block to the free list when no table holds it any more.
    """

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.blocks = [PhysicalTokenBlock(device, i, block_size) for i in range(num_blocks)]
        # NOTE: a deque-like list used as a stack: the most recently freed block is reused first,
        # which keeps the picture in the lessons compact. Any order would be correct.
        self.free_blocks: list[PhysicalTokenBlock] = list(reversed(self.blocks))

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
            block.forget_contents()
            self.free_blocks.append(block)

    def get_num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def free_block_numbers(self) -> list[int]:
        """The free list, next-to-be-allocated first."""
        return [b.block_number for b in reversed(self.free_blocks)]
