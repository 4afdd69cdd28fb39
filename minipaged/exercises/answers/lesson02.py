"""Lesson 02's component, answered: the free-list allocator of a KV pool (``core/allocator.py``).

Used when ``MINIPAGED_SOLUTIONS=1`` and the learner's stub is not done; written for the build
track, it behaves as ``FreeListAllocator`` under lesson 02's checker.
"""
from __future__ import annotations

from minipaged.block import Device, PhysicalTokenBlock
from minipaged.core.allocator import NoCacheAllocator


class MyFreeListAllocator(NoCacheAllocator):
    """Every block of one pool, the free ones on a stack, each with its reference count."""

    def __init__(self, device: Device, block_size: int, num_blocks: int) -> None:
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_evictions = 0  # nothing is cached, so nothing is ever evicted
        self.blocks = [PhysicalTokenBlock(device, number, block_size)
                       for number in range(num_blocks)]
        # The top of the stack is the end of the list: block 0 must come out first.
        self.stack = self.blocks[::-1]

    def allocate(self) -> PhysicalTokenBlock:
        """The block on top of the stack, now held by one table."""
        if not self.stack:
            raise ValueError(f"no free {self.device.value} block: all {self.num_blocks} are held")
        block = self.stack.pop()
        block.ref_count = 1
        return block

    def free(self, block: PhysicalTokenBlock) -> None:
        """One table lets go of ``block``; when none holds it, it goes back on the stack."""
        if block.device is not self.device:
            raise ValueError(f"{block} belongs to the other pool")
        if block.ref_count <= 0:
            raise ValueError(f"{block} is free already")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.stack.append(block)  # reused first: the freed block is on top now

    def acquire(self, block: PhysicalTokenBlock) -> None:
        """One more table holds ``block`` (a fork): one more reference."""
        block.ref_count += 1

    def get_num_free_blocks(self) -> int:
        return len(self.stack)

    def free_block_numbers(self) -> list[int]:
        """Next out first: the stack read from its top."""
        return [block.block_number for block in reversed(self.stack)]
