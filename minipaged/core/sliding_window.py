"""A block manager for models whose every layer slides a window over the context (Mistral):
the blocks that have left the window go back to the free list.

A layer with window W lets the token at position p read positions p - W + 1 ... p only. Once a
sequence's newest token is at position p, no later token reads a block whose last position is
below p - W + 1: every layer has stopped reading it, so its memory can serve others. A
sequence then holds at most ``ceil((W - 1) / block_size) + 1`` blocks while it decodes (5 for a
16-token window in blocks of 4), however long it grows.

The block table keeps its length (a token's block is still ``table[position // block_size]``);
a block that left the window is replaced by a *dropped* marker, one per pool, that no allocator
owns: its references cost nothing, it is never copied, swapped or named, and the worker sees
it as the *sink* (``sink_block``: one block past the pool, which the engine adds to the cache
for it; block 0 where there is none), which the attention never reads because it lies outside
every window (``reference.paged_attention``'s mask; the snapshot shows it as -1).

**A long prompt holds only its last window's blocks.** A prompt computed from scratch in one
step attends to its own keys and values in flight, not to the cache; only the keys its first
decode will read must be stored. So it is admitted with markers before that window, and the
prompt step writes those positions into the sink, where nothing reads them: a 160-token prompt
of a 16-token window in blocks of 4 holds 5 blocks, not 40. Admitting it still asks for room for
the whole prompt (as vLLM V1 allocates a prompt scheduled whole), which the blocks not taken
leave free for everyone else. If the scheduler cuts the prompt into chunks (a later chunk reads
the earlier ones from the cache), the markers are turned into blocks at once, in the same
scheduling pass. With prefix caching a prompt takes all its blocks: a block's name chains
through every block before it, and a later prompt finds its blocks only if all were stored
(the ones that leave the window stay cached, and count as free).

With prefix caching (lesson 11) a block's name is a hash over the blocks before it: a block
leaves only once the block after it is named, and naming starts at the first block still held
(whose name carries the chain). A block that left is cached like any freed block: a later
prompt with the same start still finds it, until it is evicted.

Not used (the plain ``BlockSpaceManager`` keeps every block, which is always right) when some
layers see the whole context (Gemma 3) or with a draft model (whose layers may not slide).
"""
from __future__ import annotations

from minipaged.block import Device, PhysicalTokenBlock
from minipaged.core.allocator import BlockAllocator
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.sequence import Sequence, SequenceGroup

DROPPED_NUMBER = -1  # the marker's number in snapshots; the worker reads the sink (or block 0)


def blocks_out_of_window(num_tokens: int, window: int, block_size: int,
                         block_table: list[int]) -> list[int]:
    """The entries of a sequence's block table whose blocks can go back to the pool.

    Args:
        num_tokens: the sequence's length, its newest token (at position ``num_tokens - 1``,
            about to be computed) included; it reads positions ``num_tokens - window`` on.
        window: the layers' sliding window, in tokens.
        block_size: tokens per block; entry ``i`` holds positions ``i * block_size`` to
            ``(i + 1) * block_size - 1``.
        block_table: the block numbers, ``DROPPED_NUMBER`` (-1) where a block already left.

    Returns:
        The indices, in increasing order, of the entries that are not yet dropped, whose every
        position lies before the newest token's window, and that are not the table's last
        entry (the newest block stays, whatever the window).
    """
    oldest_read = num_tokens - window  # the newest token reads from here on
    num_gone = max(0, oldest_read) // block_size  # blocks wholly before it
    return [i for i in range(min(num_gone, len(block_table) - 1))
            if block_table[i] != DROPPED_NUMBER]


class _DroppedMarkers:
    """Acquiring and freeing a dropped marker: nothing to count (no allocator owns it)."""

    def acquire(self, block: PhysicalTokenBlock) -> None:
        pass

    def free(self, block: PhysicalTokenBlock) -> None:
        pass


class SlidingWindowBlockManager(BlockSpaceManager):
    """``BlockSpaceManager`` that frees the blocks a sequence's window has left.

    Args:
        window: the sliding window of every layer, in tokens.
        sink_block: the number of a cache block outside the pool (``num_gpu_blocks``: the
            engine allocates one more) that dropped markers stand for in the worker's block
            tables; None: block 0, and every prompt takes all its blocks.
        The others: ``BlockSpaceManager``'s.
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 watermark: float = 0.01, enable_prefix_caching: bool = False, *,
                 window: int, sink_block: int | None = None) -> None:
        if window < 1:
            raise ValueError(f"window must be a positive number of tokens, got {window}")
        if sink_block is not None and sink_block < num_gpu_blocks:
            raise ValueError(f"sink_block {sink_block} is a block of the pool (0 to "
                             f"{num_gpu_blocks - 1}): it must lie past it")
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark,
                         enable_prefix_caching)
        self.window = window
        self.sink_block = sink_block
        # the first seq_id of a prompt admitted with its last window only and not yet scheduled
        # -> (the seq_ids sharing its table, the markers at its start)
        self._prompt_markers: dict[int, tuple[list[int], int]] = {}
        self.dropped = {device: PhysicalTokenBlock(device, DROPPED_NUMBER, block_size)
                        for device in (Device.GPU, Device.CPU)}
        self._markers = _DroppedMarkers()
        self.num_dropped_blocks = 0  # block references let go because they left the window

    @classmethod
    def like(cls, other: SlidingWindowBlockManager) -> SlidingWindowBlockManager:
        return cls(other.block_size, other.num_total_gpu_blocks, other.num_total_cpu_blocks,
                   other.watermark, other.enable_prefix_caching, window=other.window,
                   sink_block=other.sink_block)

    def _is_dropped(self, block: PhysicalTokenBlock) -> bool:
        return block is self.dropped[block.device]

    def _allocator_of(self, block: PhysicalTokenBlock) -> BlockAllocator:
        if self._is_dropped(block):
            return self._markers  # type: ignore[return-value]  (acquire and free only)
        return super()._allocator_of(block)

    # -- admitting a prompt: only its last window's blocks -------------------------------------
    def num_blocks_before_window(self, seq_group: SequenceGroup) -> int:
        """How many of a waiting group's first blocks it is admitted without: those wholly
        before the positions its first decode reads. 0 without a sink, with prefix caching, or
        for a group whose sequences differ (a recompute after preemption)."""
        if self.sink_block is None or self.enable_prefix_caching:
            return 0
        seqs, _, identical = self.prompt_layout(seq_group)
        if not identical:
            return 0
        # the first decode computes position get_len() and reads get_len() - window + 1 on
        num_before = max(0, seqs[0].get_len() + 1 - self.window) // self.block_size
        return min(num_before, len(seqs[0].logical_token_blocks) - 1)  # (the newest stays)

    def allocate(self, seq_group: SequenceGroup) -> dict[int, int]:
        """``BlockSpaceManager.allocate``, but a prompt admitted whole holds only the blocks of
        its last window, markers before them (``can_allocate`` still asks room for them all:
        a prompt cut into chunks takes them in ``cache_blocks``)."""
        num_before = self.num_blocks_before_window(seq_group)
        if not num_before:
            return super().allocate(seq_group)
        seqs, _, _ = self.prompt_layout(seq_group)
        held = [self.gpu_allocator.allocate() for _ in seqs[0].logical_token_blocks[num_before:]]
        for block in held:
            for _ in seqs[1:]:  # one reference per sequence, as BlockSpaceManager.allocate
                self.gpu_allocator.acquire(block)
        seq_ids = [s.seq_id for s in seqs]
        for seq in seqs:
            self._register(seq, seq_group, [self.dropped[Device.GPU]] * num_before + held)
        self._prompt_markers[seqs[0].seq_id] = (seq_ids, num_before)  # (its chunk's sequence)
        self._emit("allocate", request_id=seq_group.request_id, seq_ids=seq_ids,
                   blocks=[b.block_number for b in self.block_tables[seqs[0].seq_id]], cached=[])
        return {seq_id: 0 for seq_id in seq_ids}

    def _take_prompt_markers(self, seq: Sequence, num_tokens: int) -> None:
        """The scheduler takes a prompt admitted with markers: computed whole, they stay;
        cut into chunks, they become blocks (the admission counted them free)."""
        seq_ids, num_before = self._prompt_markers.pop(seq.seq_id, ([], 0))
        if num_tokens >= seq.get_len() or not num_before:
            return
        for i in range(num_before):
            block = self.gpu_allocator.allocate()
            for n, seq_id in enumerate(seq_ids):
                if n:
                    self.gpu_allocator.acquire(block)
                self.block_tables[seq_id][i] = block
        self._emit("allocate", request_id=self.seq_request[seq.seq_id], seq_ids=seq_ids,
                   blocks=[b.block_number for b in self.block_tables[seq.seq_id]], cached=[])

    # -- the window ------------------------------------------------------------------------------
    def append_slot(self, seq: Sequence) -> tuple[int, int] | None:
        """Let go of the blocks the newest token's window has left, then make room for it."""
        self.drop_out_of_window(seq)
        return super().append_slot(seq)

    def drop_out_of_window(self, seq: Sequence) -> list[int]:
        """Replace the sequence's blocks that no token from its newest on reads by the marker
        (which: ``blocks_out_of_window``, lesson 20's exercise); returns their numbers (a block shared with another sequence just loses a reference).

        Args:
            seq: a running sequence whose newest token (position ``get_len() - 1``) is about
                to be computed: every later query is at that position or after.
        """
        table = self.block_tables[seq.seq_id]
        let_go = []
        for i in blocks_out_of_window(seq.get_len(), self.window, self.block_size,
                                      [b.block_number for b in table]):
            block = table[i]
            if self.enable_prefix_caching and self.gpu_allocator.block_hash_of(
                    table[i + 1]) is None:
                break  # the next block's name will need this one's: it stays until then
            table[i] = self.dropped[block.device]
            self._allocator_of(block).free(block)
            let_go.append(block.block_number)
        if let_go:
            self.num_dropped_blocks += len(let_go)
            self._emit("window", seq_id=seq.seq_id, blocks=let_go)
        return let_go

    def num_held_blocks(self, seq: Sequence) -> int:
        """The blocks the sequence holds (its table without the dropped markers)."""
        return sum(not self._is_dropped(b) for b in self.block_tables[seq.seq_id])

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Name the sequence's full blocks among its first ``num_tokens`` tokens, from the
        first block it still holds (the chain's names before it are known). The scheduler
        calls it for every prefill chunk it takes: see ``_take_prompt_markers``."""
        if self._prompt_markers:
            self._take_prompt_markers(seq, num_tokens)
        table = self.block_tables[seq.seq_id]
        first = next((i for i, b in enumerate(table) if not self._is_dropped(b)), len(table))
        num_full = num_tokens // self.block_size
        if first < num_full:
            self.gpu_allocator.name_blocks(
                table[first:num_full],
                [b.token_ids for b in seq.logical_token_blocks[first:num_full]])

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self._prompt_markers.pop(seq.seq_id, None)

    # -- swapping: a marker stays a marker -------------------------------------------------------
    def _swap_out_block(self, gpu_block: PhysicalTokenBlock) -> tuple[PhysicalTokenBlock, bool]:
        if self._is_dropped(gpu_block):
            return self.dropped[Device.CPU], False
        return super()._swap_out_block(gpu_block)

    def _swap_in_block(self, cpu_block: PhysicalTokenBlock) -> tuple[PhysicalTokenBlock, bool]:
        if self._is_dropped(cpu_block):
            return self.dropped[Device.GPU], False
        return super()._swap_in_block(cpu_block)

    def _physical_blocks(self, seq_group, status) -> list:
        return [b for b in super()._physical_blocks(seq_group, status) if not self._is_dropped(b)]

    # -- reading ---------------------------------------------------------------------------------
    def get_block_table(self, seq: Sequence) -> list[int]:
        # NOTE: the sink (or block 0) for a dropped block: a real block, so every back-end's
        # checks pass, never read, as it lies outside the window of every query; only a prompt
        # step writes into it, and only the sink, which belongs to no sequence
        sink = 0 if self.sink_block is None else self.sink_block
        return [sink if self._is_dropped(b) else b.block_number
                for b in self.block_tables[seq.seq_id]]

    def snapshot(self) -> dict:
        return {**super().snapshot(), "window": self.window}
