"""The BlockSpaceManager: block tables, sharing, copy-on-write and swapping (lessons 02, 03, 04).

It maps every sequence's logical blocks to physical blocks of the GPU pool (or of the CPU pool
while the sequence is swapped out). It only does bookkeeping: it returns which blocks must be
copied or moved, and the cache engine moves the data.
"""
from __future__ import annotations

from typing import Callable

from minipaged.block import BlockAllocator, Device, PhysicalTokenBlock
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus

BlockTable = list[PhysicalTokenBlock]


class BlockSpaceManager:
    """Manages the mapping between logical and physical token blocks.

    Args:
        block_size: tokens per block.
        num_gpu_blocks: size of the GPU pool (the one attention reads).
        num_cpu_blocks: size of the CPU pool (swap space).
        watermark: fraction of GPU blocks kept free when admitting new prompts, so that running
            sequences can still grow for a while without being preempted at once.
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 watermark: float = 0.01) -> None:
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.gpu_allocator = BlockAllocator(Device.GPU, block_size, num_gpu_blocks)
        self.cpu_allocator = BlockAllocator(Device.CPU, block_size, num_cpu_blocks)
        self.block_tables: dict[int, BlockTable] = {}  # seq_id -> its physical blocks
        self.seqs: dict[int, Sequence] = {}  # seq_id -> sequence, for snapshots
        self.seq_request: dict[int, str] = {}  # seq_id -> request id, for snapshots
        # NOTE: the memory benchmark sets this to False to measure what sharing saves. Blocks are
        # then still shared for the one step in which a prompt is computed (or a beam forked),
        # but the next ``unshare`` gives every sequence a private copy of every block, as an
        # engine without paging would hold one full KV copy per sample or beam. The tokens
        # generated are the same; only the memory differs.
        self.share_blocks = True
        self._listeners: list[Callable[[dict], None]] = []

    # -- observing ------------------------------------------------------------------------------
    def add_listener(self, fn: Callable[[dict], None]) -> None:
        """Call ``fn(event)`` after every operation (the visualizer records an event log)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[dict], None]) -> None:
        self._listeners.remove(fn)

    def _emit(self, op: str, **details) -> None:
        if self._listeners:
            event = {"op": op, **details}
            for fn in list(self._listeners):
                fn(event)

    # -- admitting a prompt ----------------------------------------------------------------------
    def prompt_layout(self, seq_group: SequenceGroup) -> tuple[list[Sequence], int, bool]:
        """How a waiting group's sequences share blocks: ``(sequences, shared_len, identical)``.

        A fresh group's sequences hold the same tokens (``identical``): one block table serves
        them all and the prompt is computed once. After a preemption by recompute they differ:
        they share the full blocks of their common prefix (at least the prompt's full blocks),
        ``shared_len`` tokens, and each has private blocks for the rest.
        """
        # NOTE: sharing is used even when share_blocks is off: the prompt is computed once into
        # shared blocks and copied at the next step (see unshare), so that both settings sample
        # from the same rows and generate the same tokens.
        seqs = seq_group.get_seqs(SequenceStatus.WAITING)
        token_lists = [s.get_token_ids() for s in seqs]
        first = token_lists[0]
        if all(t == first for t in token_lists[1:]):
            return seqs, len(first), True
        common = 0
        for column in zip(*token_lists):
            if any(t != column[0] for t in column):
                break
            common += 1
        # Each sequence's newest token is computed by its first decode after the recompute (so
        # that all of them sample in the same step); it must not sit in a shared block.
        common = min(common, min(len(t) for t in token_lists) - 1)
        return seqs, common // self.block_size * self.block_size, False

    def num_blocks_to_allocate(self, seq_group: SequenceGroup) -> int:
        seqs, shared_len, identical = self.prompt_layout(seq_group)
        if identical:
            return len(seqs[0].logical_token_blocks)
        num_shared = shared_len // self.block_size
        return num_shared + sum(len(s.logical_token_blocks) - num_shared for s in seqs)

    def can_allocate(self, seq_group: SequenceGroup) -> bool:
        """Enough free GPU blocks for the group's prompt, keeping the watermark free."""
        num_required = self.num_blocks_to_allocate(seq_group)
        return self.gpu_allocator.get_num_free_blocks() - num_required >= self.watermark_blocks

    def allocate(self, seq_group: SequenceGroup) -> None:
        """Give the group's waiting sequences their blocks.

        NOTE: the shared blocks (a fresh group's whole prompt, or a recomputed group's common
        prefix) get one reference per sequence, so copy-on-write protects them as after a fork.
        """
        seqs, shared_len, identical = self.prompt_layout(seq_group)
        num_shared = (len(seqs[0].logical_token_blocks) if identical
                      else shared_len // self.block_size)
        shared = [self.gpu_allocator.allocate() for _ in range(num_shared)]
        for block in shared:
            block.ref_count = len(seqs)
        for seq in seqs:
            own = [self.gpu_allocator.allocate()
                   for _ in seq.logical_token_blocks[num_shared:]]
            self._register(seq, seq_group, shared + own)
        self._emit("allocate", request_id=seq_group.request_id,
                   seq_ids=[s.seq_id for s in seqs],
                   blocks=[b.block_number for b in self.block_tables[seqs[0].seq_id]])

    def _register(self, seq: Sequence, seq_group: SequenceGroup, table: BlockTable) -> None:
        self.block_tables[seq.seq_id] = table
        self.seqs[seq.seq_id] = seq
        self.seq_request[seq.seq_id] = seq_group.request_id

    # -- growing by one token --------------------------------------------------------------------
    def can_append_slot(self, seq_group: SequenceGroup) -> bool:
        """Can every running sequence of the group get a slot for its next token?"""
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        return self._num_blocks_to_append(seqs) <= self.gpu_allocator.get_num_free_blocks()

    def _num_blocks_to_append(self, seqs: list[Sequence]) -> int:
        """GPU blocks that ``append_slot`` (and ``unshare``) will take for these sequences."""
        # A sequence needs a new block when its newest token opened a new logical block, or
        # when its last block is shared (copy-on-write); otherwise the slot is already there.
        num_needed = 0
        shared: dict[int, PhysicalTokenBlock] = {}
        writers: dict[int, int] = {}  # id of a shared last block -> sequences writing into it
        for seq in seqs:
            if seq.num_computed_tokens == 0:
                continue  # a prefill run: its blocks were allocated for all its tokens
            table = self.block_tables[seq.seq_id]
            if not self.share_blocks:
                shared.update((id(b), b) for b in table if b.ref_count > 1)
                num_needed += len(table) < len(seq.logical_token_blocks)
            elif len(table) < len(seq.logical_token_blocks):
                num_needed += 1
            elif table[-1].ref_count > 1:
                shared[id(table[-1])] = table[-1]
                writers[id(table[-1])] = writers.get(id(table[-1]), 0) + 1
        if not self.share_blocks:
            # unshare copies each shared block for all holders but the last; the holders of a
            # block are always sequences of this same group.
            return num_needed + sum(b.ref_count - 1 for b in shared.values())
        for key, block in shared.items():
            # Copy-on-write copies the block for each writer; if every holder writes, the last
            # one finds itself alone (ref count 1) and keeps the block.
            num_needed += writers[key] - (writers[key] == block.ref_count)
        return num_needed

    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Make room in the cache for the sequence's newest token.

        Returns ``(src, dst)`` when the last block was shared and had to be copied first
        (copy-on-write), else None.
        """
        table = self.block_tables[seq.seq_id]
        if len(table) < len(seq.logical_token_blocks):
            # The newest token opened a new logical block: give it a fresh physical block.
            block = self.gpu_allocator.allocate()
            table.append(block)
            self._emit("append", seq_id=seq.seq_id, block=block.block_number, new_block=True)
            return None
        last = table[-1]
        assert last.device is Device.GPU
        if last.ref_count == 1:
            self._emit("append", seq_id=seq.seq_id, block=last.block_number, new_block=False)
            return None
        # The last block is shared: writing into it would change the other sequences' cache.
        new_block = self.gpu_allocator.allocate()
        table[-1] = new_block
        self.gpu_allocator.free(last)
        self._emit("copy_on_write", seq_id=seq.seq_id, src=last.block_number,
                   dst=new_block.block_number)
        return last.block_number, new_block.block_number

    def unshare(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give the sequence a private copy of every shared block (only with share_blocks off).

        Returns the ``(src, dst)`` pairs to copy. The scheduler calls it before ``append_slot``.
        """
        table = self.block_tables[seq.seq_id]
        pairs = []
        for i, block in enumerate(table):
            if block.ref_count > 1:
                assert block.device is Device.GPU
                table[i] = self.gpu_allocator.allocate()
                self.gpu_allocator.free(block)
                pairs.append((block.block_number, table[i].block_number))
        if pairs:
            self._emit("unshare", seq_id=seq.seq_id, pairs=pairs)
        return pairs

    # -- sharing ---------------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child starts with the parent's block table; every block gains one reference."""
        table = list(self.block_tables[parent.seq_id])
        for block in table:
            block.ref_count += 1
        self.block_tables[child.seq_id] = table
        self.seqs[child.seq_id] = child
        self.seq_request[child.seq_id] = self.seq_request[parent.seq_id]
        self._emit("fork", parent=parent.seq_id, child=child.seq_id,
                   blocks=[b.block_number for b in table])

    # -- swapping --------------------------------------------------------------------------------
    def _physical_blocks(self, seq_group: SequenceGroup, status: SequenceStatus) -> list:
        blocks: dict[int, PhysicalTokenBlock] = {}  # shared blocks counted once
        for seq in seq_group.get_seqs(status):
            for block in self.block_tables[seq.seq_id]:
                blocks[id(block)] = block
        return list(blocks.values())

    def can_swap_in(self, seq_group: SequenceGroup) -> bool:
        """Room for the group's distinct blocks plus the blocks its next step appends, keeping
        the watermark free as on admission."""
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        num_required = len(self._physical_blocks(seq_group, SequenceStatus.SWAPPED))
        if not seq_group.pending_chunks:  # it decodes in the step that swaps it in
            num_required += self._num_blocks_to_append(seqs)
        return self.gpu_allocator.get_num_free_blocks() - num_required >= self.watermark_blocks

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        blocks = self._physical_blocks(seq_group, SequenceStatus.RUNNING)
        return len(blocks) <= self.cpu_allocator.get_num_free_blocks()

    def swap_in(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the group's CPU blocks back to the GPU. Returns {cpu block: gpu block}."""
        return self._move(seq_group, SequenceStatus.SWAPPED, self.cpu_allocator,
                          self.gpu_allocator, "swap_in")

    def swap_out(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the group's GPU blocks to the CPU pool. Returns {gpu block: cpu block}."""
        if not self.can_swap_out(seq_group):
            raise RuntimeError(
                f"out of CPU swap space: request {seq_group.request_id} needs "
                f"{len(self._physical_blocks(seq_group, SequenceStatus.RUNNING))} CPU blocks, "
                f"{self.cpu_allocator.get_num_free_blocks()} are free; raise swap_space or "
                f"use preemption_mode='recompute'")
        return self._move(seq_group, SequenceStatus.RUNNING, self.gpu_allocator,
                          self.cpu_allocator, "swap_out")

    def _move(self, seq_group, status, src_alloc: BlockAllocator, dst_alloc: BlockAllocator,
              op: str) -> dict[int, int]:
        mapping: dict[int, PhysicalTokenBlock] = {}  # src block number -> dst block
        for seq in seq_group.get_seqs(status):
            new_table = []
            for src in self.block_tables[seq.seq_id]:
                if src.block_number in mapping:
                    dst = mapping[src.block_number]
                    dst.ref_count += 1  # a block shared inside the group stays shared
                else:
                    dst = dst_alloc.allocate()
                    mapping[src.block_number] = dst
                new_table.append(dst)
                src_alloc.free(src)
            self.block_tables[seq.seq_id] = new_table
        numbers = {s: d.block_number for s, d in mapping.items()}
        self._emit(op, request_id=seq_group.request_id, mapping=numbers)
        return numbers

    # -- freeing ---------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks nobody else holds return to the free list."""
        table = self.block_tables.pop(seq.seq_id, None)
        if table is None:
            return  # never allocated, or already freed
        for block in table:
            allocator = self.gpu_allocator if block.device is Device.GPU else self.cpu_allocator
            allocator.free(block)
        self.seqs.pop(seq.seq_id, None)
        self.seq_request.pop(seq.seq_id, None)
        self._emit("free", seq_id=seq.seq_id, blocks=[b.block_number for b in table])

    def reset(self) -> None:
        for seq_id in list(self.block_tables):
            self.free(self.seqs[seq_id])

    # -- reading ---------------------------------------------------------------------------------
    def get_block_table(self, seq: Sequence) -> list[int]:
        return [block.block_number for block in self.block_tables[seq.seq_id]]

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_allocator.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.get_num_free_blocks()

    def snapshot(self) -> dict:
        """Plain data describing every table and block, for the visualizer and tests."""
        sequences = []
        owners = {Device.GPU: {}, Device.CPU: {}}
        for seq_id, table in self.block_tables.items():
            seq = self.seqs[seq_id]
            device = table[0].device if table else Device.GPU
            sequences.append({
                "seq_id": seq_id,
                "request_id": self.seq_request.get(seq_id),
                "status": seq.status.name,
                "device": device.value,
                "num_tokens": seq.get_len(),
                "logical_blocks": [
                    {"index": b.block_number, "num_filled": b.num_tokens,
                     "token_ids": list(b.token_ids)} for b in seq.logical_token_blocks],
                "block_table": [b.block_number for b in table],
            })
            for block in table:
                owners[block.device].setdefault(block.block_number, []).append(seq_id)

        def pool(allocator: BlockAllocator) -> list[dict]:
            return [{"block_number": b.block_number, "ref_count": b.ref_count,
                     "owners": owners[allocator.device].get(b.block_number, [])}
                    for b in allocator.blocks]

        return {
            "block_size": self.block_size,
            "watermark_blocks": self.watermark_blocks,
            "sequences": sequences,
            "gpu_blocks": pool(self.gpu_allocator),
            "cpu_blocks": pool(self.cpu_allocator),
            "free_gpu_blocks": self.gpu_allocator.free_block_numbers(),
            "free_cpu_blocks": self.cpu_allocator.free_block_numbers(),
        }
