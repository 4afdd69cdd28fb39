"""KV cache groups for hybrid models (Gemma 3: five sliding layers in six, lesson 20): one block
table per group of layers, all drawn from one shared pool.

A full-attention layer reads a sequence's whole context; a sliding layer only its last window.
When every layer keeps every block, a sliding layer holds as much as a full one. Here the
layers are cut into groups of one kind and equal size (``model_shape.kv_groups``), and each
sequence has one block table per group:

    full group     [ 7  8  9 10 11 12 13 14 15 16]   grows with the sequence
    sliding group  [ -  -  -  -  -  - 21 22 23 24]   blocks that left the window went back
    sliding group  [ -  -  -  -  -  - 31 32 33 34]   (- : the dropped marker, read as the sink)

A block of the pool is the K and V of ``block_size`` tokens for as many layers as a group has;
the worker's cache holds one tensor per place in a group (the i-th layer of every group shares
tensor i), and a block number belongs to one group at a time, so the groups never overwrite
each other. Every count (admission, growth, swapping) is the sum over the groups, against
the one pool: a lone long request can use all of it.

The first group is full attention and is this manager itself (its tables are
``block_tables``, what readers of a ``BlockSpaceManager`` see); every other group is a
``BlockSpaceManager`` (another full group) or a ``SlidingWindowBlockManager`` that shares this
one's allocators. Each operation the scheduler calls runs on every group.

With prefix caching (lesson 11) every group finds its own cached blocks, in the one pool:
a group's blocks are named with the group in their tokens (``core/group_prefix.py``), so two
groups' blocks of the same tokens never stand for each other, and a prompt skips the longest
prefix every group can serve: a full group holds all its blocks (found from the left), a
sliding group only those its window reads from the first computed token (the blocks before
are null entries in its table, whether they left the window, were evicted or never kept).
A sliding group keeps a prompt's blocks named as they leave its window, as
``core/sliding_window.py`` does, so that later prompts find them. Two rules keep
the names true (``tests/core/test_hybrid_kv_groups_regressions.py``): every group's cached
blocks for a prompt are held before any group takes a new block (which may evict one), and
each group names a growing block only after its own copy-on-write.

Admitting a prompt asks room for its whole length in every group (a sliding group's prompt cut
into chunks takes all its blocks: ``core/sliding_window.py``), so a lone request needs as many
bytes at admission as with every block kept, never more; the room comes back as the window
slides. Not used on CUDA yet (the engine keeps every block in one table there:
``engine/cache_setup.hybrid_groups``).
"""
from __future__ import annotations

from contextlib import contextmanager

from minipaged.block import Device, PhysicalTokenBlock
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.group_prefix import GroupNames, SlidingPrefixGroup
from minipaged.core.sliding_window import SlidingWindowBlockManager
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus


class HybridBlockManager(BlockSpaceManager):
    """One block table per KV cache group, one shared pool.

    Args:
        windows: each group's window, in ``model_shape.kv_groups``'s order; the first must be
            None (a full-attention group: this manager's own tables).
        sink_block: the cache block past the pool that a sliding group's dropped markers stand
            for (``num_gpu_blocks``: the engine allocates one more).
        The others: ``BlockSpaceManager``'s; ``num_gpu_blocks`` counts the shared pool's blocks
        (each of one group's layers). The watermark is kept as whole blocks of every group:
        ``len(windows)`` times that of a pool of ``num_gpu_blocks // len(windows)``, so that
        the request checks can count in tokens' blocks (``token_blocks``).
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 watermark: float = 0.01, enable_prefix_caching: bool = False, *,
                 windows: tuple, sink_block: int) -> None:
        windows = tuple(windows)
        if not windows or windows[0] is not None:
            raise ValueError(f"windows {windows}: the first KV cache group must be a full-"
                             "attention group (None)")
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark,
                         enable_prefix_caching)
        self.windows = windows
        self.sink_block = sink_block
        num = len(windows)
        self.watermark_blocks = num * int(watermark * (num_gpu_blocks // num))
        self.groups: list[BlockSpaceManager] = []  # the groups after the first
        for index, window in enumerate(windows[1:], start=1):
            sliding = SlidingPrefixGroup if enable_prefix_caching else SlidingWindowBlockManager
            group = (BlockSpaceManager(block_size, 0, 0, 0.0, enable_prefix_caching)
                     if window is None else
                     sliding(block_size, 0, 0, 0.0, enable_prefix_caching, window=window,
                             sink_block=sink_block))
            # NOTE: one pool: every group takes and gives back the same allocators' blocks
            group.gpu_allocator = (GroupNames(self.gpu_allocator, index, window,
                                              getattr(group, "dropped", {}).get(Device.GPU))
                                   if enable_prefix_caching else self.gpu_allocator)
            group.cpu_allocator = self.cpu_allocator
            self.groups.append(group)

    @classmethod
    def like(cls, other: HybridBlockManager) -> HybridBlockManager:
        return cls(other.block_size, other.num_total_gpu_blocks, other.num_total_cpu_blocks,
                   other.watermark, other.enable_prefix_caching, windows=other.windows,
                   sink_block=other.sink_block)

    def token_blocks(self, num_blocks: int) -> int:
        """A number of the pool's blocks, counted in blocks of every group (one block of
        tokens for the whole model), as the request checks and ``max_model_len`` count."""
        return num_blocks // len(self.windows)

    # -- admitting a prompt ----------------------------------------------------------------------
    def cached_prefix(self, seq_group: SequenceGroup) -> dict[int, list[PhysicalTokenBlock]]:
        """The first group's cached blocks for each waiting sequence, cut to the longest prefix
        every group can serve: the first group's from the left, every other group's by its
        own rule (a sliding group needs only its window's blocks: ``core/group_prefix.py``).

        NOTE: after a recompute the sequences differ: they take hits only inside the blocks
        they share (the same prefix for all, its hits then the same). Past those, one
        sequence's window could need a shared block another's hits hold as a null entry."""
        found = super().cached_prefix(seq_group)
        if not self.enable_prefix_caching:
            return found
        seqs, shared_len, identical = self.prompt_layout(seq_group)
        first = seqs[0]
        limit = len(found[first.seq_id])
        if not identical:
            limit = min(limit, shared_len // self.block_size)
        ok = [True] * (limit + 1)
        for group in self.groups:
            served = group.gpu_allocator.servable(first.get_token_ids(), limit)
            ok = [a and b for a, b in zip(ok, served)]
        num = max(h for h, yes in enumerate(ok) if yes)
        return {s.seq_id: found[s.seq_id][:num] for s in seqs}

    @contextmanager
    def _capped(self, seq_group: SequenceGroup):
        """Within it, every group after the first finds for each waiting sequence only as many
        cached blocks as every group found (``cached_prefix``)."""
        if not self.enable_prefix_caching:
            yield
            return
        hits = self.cached_prefix(seq_group)
        caps = {tuple(s.get_token_ids()): len(hits[s.seq_id])
                for s in seq_group.get_seqs(SequenceStatus.WAITING)}
        for group in self.groups:
            group.gpu_allocator.cap = caps
        try:
            yield
        finally:
            for group in self.groups:
                group.gpu_allocator.cap = None

    def _every_group(self, seq_group: SequenceGroup, call) -> list:
        """``call(manager)`` for every group's manager, the other groups' prefix hits cut to
        this group's (``cached_prefix``)."""
        with self._capped(seq_group):
            return [call(super())] + [call(group) for group in self.groups]

    def num_blocks_to_allocate(self, seq_group: SequenceGroup) -> int:
        return sum(self._every_group(seq_group, lambda m: m.num_blocks_to_allocate(seq_group)))

    def allocate(self, seq_group: SequenceGroup) -> dict[int, int]:
        """Every group's tables for the group's prompt. With prefix caching, every group's
        cached blocks are held first, then the groups take theirs and new blocks.

        NOTE: a group's new block may evict an evictable cached block: held first, no group
        evicts a block another group is about to take. (Not held, the first group's new
        blocks evicted a sliding group's cached block counted as a hit; that group then took
        a fresh block for tokens the prompt skipped, and its layers read stale keys there.)
        """
        with self._capped(seq_group):
            # (self.cached_prefix: the first group's, cut to every group's)
            held = {id(b): b for m in [self, *self.groups]
                    for hits in m.cached_prefix(seq_group).values() for b in hits
                    if b.block_number >= 0}  # (not a sliding group's null entry)
            for block in held.values():
                self.gpu_allocator.acquire(block)
            try:
                return [m.allocate(seq_group) for m in [super(), *self.groups]][0]
            finally:
                for block in held.values():
                    self.gpu_allocator.free(block)

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        # NOTE: without prefix caching nothing is named; a sliding group turns a chunked
        # prompt's markers into blocks here (core/sliding_window.py)
        super().cache_blocks(seq, num_tokens)
        for group in self.groups:
            group.cache_blocks(seq, num_tokens)

    def _name_own_blocks(self, seq: Sequence, num_tokens: int) -> None:
        # NOTE: the first group's table only: every other group names its blocks in its own
        # append_slot, after its copy-on-write; named here, before, a block still shared with a
        # sibling got this sequence's tokens as its name while the sibling wrote its own token
        # into it, and a later prompt found the sibling's keys under this sequence's name
        BlockSpaceManager.cache_blocks(self, seq, num_tokens)

    # -- growing ---------------------------------------------------------------------------------
    def num_blocks_to_append(self, seqs: list[Sequence]) -> int:
        # (a sliding group's blocks that leave the window are not counted back: an upper bound)
        return (super().num_blocks_to_append(seqs)
                + sum(g.num_blocks_to_append(seqs) for g in self.groups))

    def reserve_slot(self, seq: Sequence) -> list[tuple[int, int]]:
        copies = super().reserve_slot(seq)
        for group in self.groups:
            copies += group.reserve_slot(seq)  # block numbers of the one pool: no clash
        return copies

    def rollback_slots(self, seq: Sequence) -> None:
        super().rollback_slots(seq)
        for group in self.groups:
            group.rollback_slots(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        super().fork(parent, child)
        for group in self.groups:
            group.fork(parent, child)

    # -- swapping --------------------------------------------------------------------------------
    def _physical_blocks(self, seq_group: SequenceGroup, status: SequenceStatus) -> list:
        blocks = super()._physical_blocks(seq_group, status)
        for group in self.groups:
            blocks += group._physical_blocks(seq_group, status)
        return blocks

    def swap_in(self, seq_group: SequenceGroup) -> dict[int, int]:
        moves = super().swap_in(seq_group)
        for group in self.groups:
            moves.update(group._move(seq_group, SequenceStatus.SWAPPED, group._swap_in_block,
                                     "swap_in"))
        return moves

    def swap_out(self, seq_group: SequenceGroup) -> dict[int, int]:
        moves = super().swap_out(seq_group)  # (checks the CPU room of every group's blocks)
        for group in self.groups:
            moves.update(group._move(seq_group, SequenceStatus.RUNNING, group._swap_out_block,
                                     "swap_out"))
        return moves

    # -- freeing and reading ---------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        super().free(seq)
        for group in self.groups:
            group.free(seq)

    def other_group_tables(self, seq: Sequence) -> tuple[list[int], ...]:
        """The sequence's block tables in the groups after the first (``get_block_table``
        gives the first's), as the worker reads them: a dropped marker is the sink."""
        return tuple(g.get_block_table(seq) for g in self.groups)

    def snapshot(self) -> dict:
        """``BlockSpaceManager.snapshot`` with every group's tables: ``kv_groups`` (per group
        after the first, its window and tables, -1 for a dropped marker), and each block's
        ``owners`` and ``kv_group`` (0: the first group's) counting every group."""
        snap = super().snapshot()
        pools = {device: {b["block_number"]: b for b in snap[f"{device}_blocks"]}
                 for device in ("gpu", "cpu")}
        for entries in pools.values():
            for entry in entries.values():
                entry["kv_group"] = 0 if entry["owners"] else None
        groups = []
        for index, (window, group) in enumerate(zip(self.windows[1:], self.groups), start=1):
            for seq_id, table in group.block_tables.items():
                for block in table:
                    if block.block_number >= 0:  # (not a dropped marker)
                        entry = pools[block.device.value][block.block_number]
                        entry["owners"].append(seq_id)
                        entry["kv_group"] = index
            groups.append({"window": window, "block_tables": {
                seq_id: [b.block_number for b in table]
                for seq_id, table in group.block_tables.items()}})
        return {**snap, "kv_groups": groups}
