"""Logical and physical token blocks, and the allocator of a pool of physical blocks (lesson 02).

A sequence's tokens are cut into *logical* blocks of ``block_size`` tokens. Each logical block is
stored in a *physical* block of the KV cache; the sequence's block table says which. Physical
blocks are handed out by an allocator (``core/allocator.py``) and carry a reference count so that
several sequences can share one (lesson 03, copy-on-write). What a block's tokens are called for
prefix caching (lesson 11) is the prefix-caching allocator's business, not the block's.
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

    def __repr__(self) -> str:
        return f"PhysicalTokenBlock({self.device.value}#{self.block_number}, ref={self.ref_count})"

