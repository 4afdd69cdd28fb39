"""Lesson 03's component, answered: the block manager's own methods (``core/block_manager.py``).

Used when ``MINIPAGED_SOLUTIONS=1`` and the learner's stub is not done; written for the build
track, it behaves as the package's ``BlockSpaceManager`` (without prefix caching) under lesson
03's checker. Swapping, snapshots and the prefix cache stay the package's.
"""
from __future__ import annotations

from minipaged.block import Device
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.sequence import Sequence, SequenceGroup


class MyBlockSpaceManager(BlockSpaceManager):
    """Block tables over a pool without a prefix cache: sharing by reference counts, and a
    private copy of a shared block before the first write into it. A table is a list per
    sequence id, found by the id at once; each sequence is kept with its request id."""

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 watermark: float = 0.01, enable_prefix_caching: bool = False) -> None:
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark,
                         enable_prefix_caching)
        self.tables: dict[int, list] = {}  # seq_id -> its blocks, in logical order
        self.holders: dict[int, tuple[Sequence, str]] = {}  # seq_id -> (sequence, request)

    def can_allocate(self, seq_group: SequenceGroup) -> bool:
        """Room for the group's prompt blocks, with ``watermark_blocks`` still free after."""
        seqs, shared_len, identical = self.prompt_layout(seq_group)
        if identical:  # one table serves every sequence of a fresh group
            needed = len(seqs[0].logical_token_blocks)
        else:  # after a recompute: the common full blocks once, the rest per sequence
            num_shared = shared_len // self.block_size
            needed = num_shared + sum(len(s.logical_token_blocks) - num_shared for s in seqs)
        return self.gpu_allocator.get_num_free_blocks() - needed >= self.watermark_blocks

    def allocate(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Block tables for the group's waiting sequences; nothing comes from a cache, so every
        sequence starts computing at its first token."""
        seqs, shared_len, identical = self.prompt_layout(seq_group)
        num_shared = (len(seqs[0].logical_token_blocks) if identical
                      else shared_len // self.block_size)
        shared = []
        for _ in range(num_shared):
            block = self.gpu_allocator.allocate()  # the first sequence's reference
            for _ in seqs[1:]:
                self.gpu_allocator.acquire(block)  # and one for each of the others
            shared.append(block)
        for seq in seqs:
            private = [self.gpu_allocator.allocate()
                       for _ in seq.logical_token_blocks[num_shared:]]
            self.tables[seq.seq_id] = shared + private
            self.holders[seq.seq_id] = (seq, seq_group.request_id)
        self._emit("allocate", request_id=seq_group.request_id,
                   seq_ids=[s.seq_id for s in seqs],
                   blocks=self.get_block_table(seqs[0]), cached=[])
        return {seq.seq_id: 0 for seq in seqs}

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """A slot for the newest token: a fresh block if it opens a logical block, else the
        last block, copied first when another table holds it too. Returns ``(src, dst)`` for
        a copy, else None."""
        table = self.tables[seq.seq_id]
        if len(table) < len(seq.logical_token_blocks):
            fresh = self.gpu_allocator.allocate()
            table.append(fresh)
            self._emit("append", seq_id=seq.seq_id, block=fresh.block_number, new_block=True)
            return None
        last = table[-1]
        if last.ref_count == 1:  # ours alone: write in place
            self._emit("append", seq_id=seq.seq_id, block=last.block_number, new_block=False)
            return None
        # Shared: this sequence moves to a copy; the others keep the original untouched.
        copy = self.gpu_allocator.allocate()
        table[-1] = copy
        self.gpu_allocator.free(last)  # one holder fewer
        self._emit("copy_on_write", seq_id=seq.seq_id, src=last.block_number,
                   dst=copy.block_number)
        return last.block_number, copy.block_number

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child gets its own table listing the parent's blocks, each held once more."""
        table = self.tables[parent.seq_id][:]
        for block in table:
            self._allocator_of(block).acquire(block)
        self.tables[child.seq_id] = table
        self.holders[child.seq_id] = (child, self.holders[parent.seq_id][1])
        self._emit("fork", parent=parent.seq_id, child=child.seq_id,
                   blocks=[block.block_number for block in table])

    def free(self, seq: Sequence) -> None:
        """The sequence lets go of its blocks, last first; its table is gone."""
        if seq.seq_id not in self.tables:
            return  # never given blocks, or freed already
        table = self.tables.pop(seq.seq_id)
        for block in table[::-1]:
            allocator = self.gpu_allocator if block.device is Device.GPU else self.cpu_allocator
            allocator.free(block)
        del self.holders[seq.seq_id]
        self._emit("free", seq_id=seq.seq_id, blocks=[block.block_number for block in table])

    def get_blocks(self, seq_id: int) -> list:
        """A copy of the sequence's table ([] when it holds none)."""
        return list(self.tables.get(seq_id, ()))

    def set_blocks(self, seq_id: int, blocks: list) -> None:
        """The sequence's table is now (a copy of) ``blocks``."""
        self.tables[seq_id] = list(blocks)

    def held_sequences(self) -> list:
        """Every sequence holding blocks, with its request id."""
        return list(self.holders.values())
