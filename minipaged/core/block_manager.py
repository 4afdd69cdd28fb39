"""The BlockSpaceManager: block tables, sharing, copy-on-write and swapping (lessons 02, 03, 04),
and prefix caching (lesson 11: prompts take the cached blocks their tokens start with).

It maps every sequence's logical blocks to physical blocks of the GPU pool (or of the CPU pool
while the sequence is swapped out). It only does bookkeeping: it returns which blocks must be
copied or moved, and the cache engine moves the data.
"""
from __future__ import annotations

from typing import Callable

from minipaged.core.allocator import BlockAllocator, FreeListAllocator
from minipaged.block import Device, PhysicalTokenBlock
from minipaged.core.block_snapshot import snapshot_pools
from minipaged.core.lookahead import num_lookahead_blocks
from minipaged.core.prefix_caching_allocator import PrefixCachingAllocator
from minipaged.core.prompt_layout import prompt_layout
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
        enable_prefix_caching: keep full computed blocks named by their hash chain for prompts
            that start with the same tokens (lesson 11): the GPU pool gets a
            ``PrefixCachingAllocator``. Nothing else here depends on which allocator it is.
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 watermark: float = 0.01, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.num_total_gpu_blocks = num_gpu_blocks
        self.num_total_cpu_blocks = num_cpu_blocks
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        gpu_allocator_class = (PrefixCachingAllocator if enable_prefix_caching
                               else FreeListAllocator)
        self.gpu_allocator: BlockAllocator = gpu_allocator_class(Device.GPU, block_size,
                                                                 num_gpu_blocks)
        self.cpu_allocator: BlockAllocator = FreeListAllocator(Device.CPU, block_size,
                                                               num_cpu_blocks)
        self.num_cached_tokens = 0  # prompt tokens taken from the cache instead of computed
        self.block_tables: dict[int, BlockTable] = {}  # seq_id -> its physical blocks
        self.seqs: dict[int, Sequence] = {}  # seq_id -> sequence, for snapshots
        self.seq_request: dict[int, str] = {}  # seq_id -> request id, for snapshots
        self._listeners: list[Callable[[dict], None]] = []

    # -- observing ------------------------------------------------------------------------------
    def add_listener(self, fn: Callable[[dict], None]) -> None:
        """Call ``fn(event)`` after every operation (the visualizer records an event log)."""
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[dict], None]) -> None:
        self._listeners.remove(fn)

    def record_preemption(self, seq_group: SequenceGroup, mode: str) -> None:
        """Tell the listeners that the scheduler preempted ``seq_group`` ("recompute" or
        "swap"); its blocks were already freed or swapped out through this manager."""
        self._emit("preempt", request_id=seq_group.request_id, mode=mode)

    def _emit(self, op: str, **details) -> None:
        for fn in list(self._listeners):
            fn({"op": op, **details})

    @classmethod
    def like(cls, other: BlockSpaceManager) -> BlockSpaceManager:
        """A new, empty manager of this class with ``other``'s pools and settings."""
        return cls(other.block_size, other.num_total_gpu_blocks, other.num_total_cpu_blocks,
                   other.watermark, other.enable_prefix_caching)

    # -- admitting a prompt ----------------------------------------------------------------------
    def prompt_layout(self, seq_group: SequenceGroup) -> tuple[list[Sequence], int, bool]:
        """How a waiting group's sequences share blocks: ``(sequences, shared_len, identical)``
        (``prompt_layout.py``)."""
        return prompt_layout(seq_group, self.block_size)

    def cached_prefix(self, seq_group: SequenceGroup) -> dict[int, list[PhysicalTokenBlock]]:
        """For each waiting sequence, the cached blocks its tokens start with (lesson 11)."""
        seqs, _, identical = self.prompt_layout(seq_group)
        # NOTE: the block holding a sequence's last token is never taken from the cache: that
        # token is always computed (a fresh prompt samples from its logits; a recomputed group
        # computes it in its first decode), and its K/V must not be written into a shared block.
        found = {}
        for seq in seqs if not identical else seqs[:1]:
            found[seq.seq_id] = self.gpu_allocator.longest_cached_prefix(
                seq.get_token_ids(), (seq.get_len() - 1) // self.block_size)
        return {s.seq_id: found[seqs[0].seq_id] if identical else found[s.seq_id] for s in seqs}

    def num_blocks_to_allocate(self, seq_group: SequenceGroup) -> int:
        """How many free GPU blocks admitting the group uses up (an evictable cached block
        taken back counts: it was free)."""
        seqs, shared_len, identical = self.prompt_layout(seq_group)
        cached = self.cached_prefix(seq_group)
        taken_back = len({id(b) for hits in cached.values() for b in hits if b.ref_count == 0})
        if identical:
            return len(seqs[0].logical_token_blocks) - len(cached[seqs[0].seq_id]) + taken_back
        num_shared = shared_len // self.block_size
        shared_hits = min(len(cached[seqs[0].seq_id]), num_shared)
        return (num_shared - shared_hits + taken_back
                + sum(len(s.logical_token_blocks) - max(num_shared, len(cached[s.seq_id]))
                      for s in seqs))

    def can_allocate(self, seq_group: SequenceGroup) -> bool:
        """Enough free GPU blocks for the group's prompt, keeping the watermark free."""
        num_required = self.num_blocks_to_allocate(seq_group)
        return self.gpu_allocator.get_num_free_blocks() - num_required >= self.watermark_blocks

    def allocate(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Give the group's waiting sequences their blocks.

        Returns, per sequence id, how many of its first tokens are already in the cache (the
        cached blocks it took, lesson 11): its computation starts there.

        NOTE: the shared blocks (a fresh group's whole prompt, or a recomputed group's common
        prefix) get one reference per sequence, so copy-on-write protects them as after a fork.
        """
        seqs, shared_len, identical = self.prompt_layout(seq_group)
        num_shared = (len(seqs[0].logical_token_blocks) if identical
                      else shared_len // self.block_size)
        cached = self.cached_prefix(seq_group)
        shared_hits = cached[seqs[0].seq_id][:num_shared]
        own_hits = {s.seq_id: cached[s.seq_id][num_shared:] for s in seqs}
        # Cached blocks are taken first: a new allocation may evict an evictable block.
        for block in shared_hits:
            for _ in seqs:
                self.gpu_allocator.acquire(block)
        for hits in own_hits.values():
            for block in hits:
                self.gpu_allocator.acquire(block)
        shared = shared_hits + [self.gpu_allocator.allocate()
                                for _ in range(num_shared - len(shared_hits))]
        for block in shared[len(shared_hits):]:
            for _ in seqs[1:]:  # one reference per sequence (allocate gave the first)
                self.gpu_allocator.acquire(block)
        for seq in seqs:
            own = own_hits[seq.seq_id] + [
                self.gpu_allocator.allocate()
                for _ in seq.logical_token_blocks[num_shared + len(own_hits[seq.seq_id]):]]
            self._register(seq, seq_group, shared + own)
        num_hit_blocks = len(shared_hits) + sum(len(h) for h in own_hits.values())
        self.num_cached_tokens += num_hit_blocks * self.block_size
        self._emit("allocate", request_id=seq_group.request_id,
                   seq_ids=[s.seq_id for s in seqs],
                   blocks=[b.block_number for b in self.block_tables[seqs[0].seq_id]],
                   cached=[b.block_number for b in shared_hits])
        return {s.seq_id: len(cached[s.seq_id]) * self.block_size for s in seqs}

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """The K/V of the sequence's first ``num_tokens`` tokens will be in the cache once this
        step has run: name its full blocks among them, so later prompts can find them.

        The scheduler calls it for every prefill chunk it schedules; ``append_slot`` for the
        decode that fills a block. NOTE: a block is named in the step that computes it, never
        earlier, so a block found by hash is always computed before (or, in the same step, in
        the same layer as) anyone reads it: every layer writes all K/V before attending.
        """
        num_full = num_tokens // self.block_size
        self.gpu_allocator.name_blocks(self.get_blocks(seq.seq_id)[:num_full],
                                       [b.token_ids for b in seq.logical_token_blocks[:num_full]])

    def _name_own_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """``cache_blocks`` of this table only, as it grows (``HybridBlockManager`` has more)."""
        self.cache_blocks(seq, num_tokens)

    def _register(self, seq: Sequence, seq_group: SequenceGroup, table: BlockTable) -> None:
        self.block_tables[seq.seq_id] = table
        self.seqs[seq.seq_id] = seq
        self.seq_request[seq.seq_id] = seq_group.request_id

    # -- growing by one token --------------------------------------------------------------------
    def can_append_slot(self, seq_group: SequenceGroup) -> bool:
        """Can every running sequence of the group get slots for its next token and lookahead?"""
        seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
        return self.num_blocks_to_append(seqs) <= self.gpu_allocator.get_num_free_blocks()

    def num_blocks_to_append(self, seqs: list[Sequence]) -> int:
        """GPU blocks that ``reserve_slot`` will take for ``seqs``, the running sequences of one
        group, about to decode."""
        # A sequence needs a new block when its newest token opened a new logical block, or
        # when its last block is shared (copy-on-write); otherwise the slot is already there.
        num_needed = 0
        shared: dict[int, PhysicalTokenBlock] = {}
        writers: dict[int, int] = {}  # id of a shared last block -> sequences writing into it
        for seq in seqs:
            if seq.num_computed_tokens == 0:
                continue  # a prefill run: its blocks were allocated for all its tokens
            table = self.get_blocks(seq.seq_id)
            if len(table) < len(seq.logical_token_blocks):
                num_needed += 1
            elif table[-1].ref_count > 1:
                shared[id(table[-1])] = table[-1]
                writers[id(table[-1])] = writers.get(id(table[-1]), 0) + 1
            num_needed += num_lookahead_blocks(seq, self.block_size)  # (lesson 12)
        for key, block in shared.items():
            # Copy-on-write copies the block for each writer; if every holder writes, the last
            # one finds itself alone (ref count 1) and keeps the block.
            num_needed += writers[key] - (writers[key] == block.ref_count)
        return num_needed

    def reserve_slot(self, seq: Sequence) -> list[tuple[int, int]]:
        """Make room for the sequence's newest token and lookahead; returns the ``(src, dst)``
        block copies the cache engine must make before the model writes (``blocks_to_copy``).

        Args:
            seq: a running sequence whose newest token is not in the cache yet.
        """
        cow = self.append_slot(seq)
        # Speculative decoding (lesson 12): fresh blocks for the lookahead slots. (A shared last
        # block was copied by append_slot already, so no write goes into a shared block.)
        new = [self.gpu_allocator.allocate()
               for _ in range(num_lookahead_blocks(seq, self.block_size))]
        if new:
            self.set_blocks(seq.seq_id, self.get_blocks(seq.seq_id) + new)
        if seq.num_lookahead_slots:
            self._emit("lookahead", seq_id=seq.seq_id, num_slots=seq.num_lookahead_slots,
                       blocks=[b.block_number for b in new])
        return [cow] if cow is not None else []

    def rollback_slots(self, seq: Sequence) -> None:
        """Speculative decoding dropped rejected proposals (lesson 12): free the blocks after the
        sequence's last token, which hold no token now, and name the full blocks of computed
        (accepted) tokens for the prefix cache."""
        table = self.get_blocks(seq.seq_id)
        if not table:
            return  # finished (and freed) in the step
        freed = table[len(seq.logical_token_blocks):]
        self.set_blocks(seq.seq_id, table[:len(seq.logical_token_blocks)])
        for block in reversed(freed):
            self.gpu_allocator.free(block)
        self._name_own_blocks(seq, seq.num_computed_tokens)
        self._emit("rollback", seq_id=seq.seq_id, num_tokens=seq.get_len(),
                   blocks=[b.block_number for b in freed])

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
        copied = None
        if last.ref_count == 1:
            self._emit("append", seq_id=seq.seq_id, block=last.block_number, new_block=False)
        else:
            # The last block is shared: writing into it would change the other sequences' cache.
            new_block = self.gpu_allocator.allocate()
            table[-1] = new_block
            self.gpu_allocator.free(last)
            self._emit("copy_on_write", seq_id=seq.seq_id, src=last.block_number,
                       dst=new_block.block_number)
            copied = last.block_number, new_block.block_number
        if seq.get_len() % self.block_size == 0:  # this token fills the block
            self._name_own_blocks(seq, seq.get_len())
        return copied

    # -- sharing ---------------------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child starts with the parent's block table; every block gains one reference."""
        table = list(self.block_tables[parent.seq_id])
        for block in table:
            self._allocator_of(block).acquire(block)
        self.block_tables[child.seq_id] = table
        self.seqs[child.seq_id] = child
        self.seq_request[child.seq_id] = self.seq_request[parent.seq_id]
        self._emit("fork", parent=parent.seq_id, child=child.seq_id,
                   blocks=[b.block_number for b in table])

    # -- swapping --------------------------------------------------------------------------------
    def _physical_blocks(self, seq_group: SequenceGroup, status: SequenceStatus) -> list:
        blocks: dict[int, PhysicalTokenBlock] = {}  # shared blocks counted once
        for seq in seq_group.get_seqs(status):
            for block in self.get_blocks(seq.seq_id):
                blocks[id(block)] = block
        return list(blocks.values())

    def can_swap_in(self, seq_group: SequenceGroup) -> bool:
        """Room for the group's distinct blocks plus the blocks its next step appends, keeping
        the watermark free as on admission."""
        seqs = seq_group.get_seqs(SequenceStatus.SWAPPED)
        num_required = len(self._physical_blocks(seq_group, SequenceStatus.SWAPPED))
        if not seq_group.pending_chunks:  # it decodes in the step that swaps it in
            num_required += self.num_blocks_to_append(seqs)
        return self.gpu_allocator.get_num_free_blocks() - num_required >= self.watermark_blocks

    def can_swap_out(self, seq_group: SequenceGroup) -> bool:
        blocks = self._physical_blocks(seq_group, SequenceStatus.RUNNING)
        return len(blocks) <= self.cpu_allocator.get_num_free_blocks()

    def swap_in(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the group's CPU blocks back to the GPU. Returns {cpu block: gpu block}.

        With prefix caching, a block whose KV is still cached on the GPU (found by its name) is
        taken from there and left out of the returned moves."""
        return self._move(seq_group, SequenceStatus.SWAPPED, self._swap_in_block, "swap_in")

    def swap_out(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Move the group's GPU blocks to the CPU pool. Returns {gpu block: cpu block}."""
        if not self.can_swap_out(seq_group):
            raise RuntimeError(
                f"out of CPU swap space: request {seq_group.request_id} needs "
                f"{len(self._physical_blocks(seq_group, SequenceStatus.RUNNING))} CPU blocks, "
                f"{self.cpu_allocator.get_num_free_blocks()} are free; raise swap_space or "
                f"use preemption_mode='recompute'")
        return self._move(seq_group, SequenceStatus.RUNNING, self._swap_out_block, "swap_out")

    def _swap_out_block(self, gpu_block: PhysicalTokenBlock) -> tuple[PhysicalTokenBlock, bool]:
        """A CPU block for ``gpu_block``'s KV, and True: its data must be moved."""
        cpu_block = self.cpu_allocator.allocate()
        self.gpu_allocator.copy_contents(gpu_block, cpu_block)
        return cpu_block, True

    def _swap_in_block(self, cpu_block: PhysicalTokenBlock) -> tuple[PhysicalTokenBlock, bool]:
        """A GPU block for ``cpu_block``'s KV, and whether its data must be moved (not when the
        prefix cache still holds the same KV on the GPU: that block is taken instead)."""
        gpu_block = self.gpu_allocator.find_equal(cpu_block)
        if gpu_block is not None:
            self.gpu_allocator.acquire(gpu_block)
            return gpu_block, False
        gpu_block = self.gpu_allocator.allocate()
        self.gpu_allocator.adopt(gpu_block, cpu_block)
        return gpu_block, True

    def _move(self, seq_group: SequenceGroup, status: SequenceStatus,
              new_block: Callable[[PhysicalTokenBlock], tuple[PhysicalTokenBlock, bool]],
              op: str) -> dict[int, int]:
        mapping: dict[int, PhysicalTokenBlock] = {}  # src block number -> dst block
        numbers: dict[int, int] = {}  # the blocks whose data must move
        for seq in seq_group.get_seqs(status):
            new_table = []
            for src in self.get_blocks(seq.seq_id):
                if src.block_number in mapping:
                    dst = mapping[src.block_number]
                    self._allocator_of(dst).acquire(dst)  # shared inside the group: stays so
                else:
                    dst, moves = new_block(src)
                    if moves:
                        numbers[src.block_number] = dst.block_number
                    mapping[src.block_number] = dst
                new_table.append(dst)
                self._allocator_of(src).free(src)
            self.set_blocks(seq.seq_id, new_table)
        self._emit(op, request_id=seq_group.request_id, mapping=numbers)
        return numbers

    def _allocator_of(self, block: PhysicalTokenBlock) -> BlockAllocator:
        return self.gpu_allocator if block.device is Device.GPU else self.cpu_allocator

    # -- freeing ---------------------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks nobody else holds return to the free list."""
        table = self.block_tables.pop(seq.seq_id, None)
        if table is None:
            return  # never allocated, or already freed
        # NOTE: last block first: with prefix caching a tail is evicted before a shared prefix
        for block in reversed(table):
            self._allocator_of(block).free(block)
        self.seqs.pop(seq.seq_id, None)
        self.seq_request.pop(seq.seq_id, None)
        self._emit("free", seq_id=seq.seq_id, blocks=[b.block_number for b in table])

    def reset(self) -> None:
        """Free every sequence's blocks (vLLM v0.1's name; cached blocks stay cached)."""
        for seq, _ in self.held_sequences():
            self.free(seq)

    # -- the tables as the rest of the package reads them (a subclass may keep them any way) -----
    def get_blocks(self, seq_id: int) -> BlockTable:
        """Sequence ``seq_id``'s physical blocks in logical order, as a new list (changing it
        changes nothing here); [] for a sequence that holds none."""
        return list(self.block_tables.get(seq_id, ()))

    def set_blocks(self, seq_id: int, blocks: BlockTable) -> None:
        """Sequence ``seq_id``, which holds blocks, holds ``blocks`` now, in this order (swapping,
        lookahead; the caller keeps the ref counts)."""
        self.block_tables[seq_id] = list(blocks)

    def held_sequences(self) -> list[tuple[Sequence, str]]:
        """Every sequence that holds blocks, with its request id, in no particular order."""
        return [(self.seqs[seq_id], self.seq_request[seq_id]) for seq_id in self.block_tables]

    def get_block_table(self, seq: Sequence) -> list[int]:
        return [block.block_number for block in self.get_blocks(seq.seq_id)]

    def get_num_free_gpu_blocks(self) -> int:
        return self.gpu_allocator.get_num_free_blocks()

    def get_num_free_cpu_blocks(self) -> int:
        return self.cpu_allocator.get_num_free_blocks()

    @property
    def num_evicted_blocks(self) -> int:
        """Cached blocks evicted for room so far (lesson 11; 0 without prefix caching)."""
        return self.gpu_allocator.num_evictions

    def snapshot(self) -> dict:
        """Every table and block as plain data, for the visualizer and tests (block_snapshot.py)."""
        return {"block_size": self.block_size, "watermark_blocks": self.watermark_blocks,
                **snapshot_pools([(seq, request_id, self.get_blocks(seq.seq_id))
                                  for seq, request_id in self.held_sequences()],
                                 self.gpu_allocator, self.cpu_allocator),
                "prefix_caching": self.enable_prefix_caching}
