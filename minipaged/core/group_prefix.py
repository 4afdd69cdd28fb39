"""Prefix caching per KV cache group (lesson 20): how many cached blocks of a prompt each group
of a hybrid model can serve, full groups from the left, sliding groups by the sliding rule.

A prompt whose first ``h`` blocks are taken from the cache computes its tokens from position
``h * block_size`` on. A full-attention layer reads every position before, so a full group
serves ``h`` blocks only if it holds all of them: it scans from the left. A sliding layer of
window W reads, from any position ``p >= h * block_size``, positions ``p - W + 1`` on; so a
sliding group serves ``h`` blocks if it holds the blocks covering positions
``h * block_size - W + 1`` to ``h * block_size - 1`` (the block where that range starts may be
cut by it: it is needed whole), and at least block ``h - 1`` (the chain of names goes on from
it). The blocks before are null entries of the sequence's table (the dropped marker of
``core/sliding_window.py``): never read, and they hold no block of the pool. They may have
left the window, been evicted or never been kept; the hit still counts. The prompt takes the
longest ``h`` that every group can serve (``HybridBlockManager.cached_prefix``); as always the
block holding the last prompt token is never a hit (that token is computed).

A sliding group finds a block after a missing one by its name alone: the name is the hash
chain over every token from the start (``prefix_caching_allocator.block_hash``), computed from
the prompt's tokens, and the block found must hold the same tokens. From there on each block
must follow the one found before it, as in a scan from the left; a scan from the left also
confirms the first block's parent, which a block after a gap cannot (its parent is gone).
"""
from __future__ import annotations

from minipaged.block import Device, PhysicalTokenBlock
from minipaged.core.allocator import BlockAllocator
from minipaged.core.sliding_window import SlidingWindowBlockManager
from minipaged.sequence import SequenceGroup


def first_block_read(num_hit_blocks: int, block_size: int, window: int | None) -> int:
    """The first of a prompt's ``num_hit_blocks`` cached blocks that a group of this window
    must hold (0 for a full group, ``window`` None): the block of position
    ``num_hit_blocks * block_size - window + 1``, and never past the last hit block."""
    if window is None or num_hit_blocks == 0:
        return 0
    oldest_read = max(0, num_hit_blocks * block_size - window + 1)
    return min(num_hit_blocks - 1, oldest_read // block_size)


class GroupNames:
    """One group's view of the shared prefix-caching allocator (every other call goes to it):
    the group is part of the tokens its blocks are named by, and ``cap`` (prompt tokens ->
    blocks), while set, cuts the prefix a prompt finds to what every group found.

    Args:
        allocator: the pool's ``PrefixCachingAllocator``.
        group: the group's index (its blocks' names start with it).
        window: the group's sliding window, None for a full group.
        marker: a sliding group's dropped marker (``SlidingWindowBlockManager.dropped``), the
            null entry its hits hold before the blocks they need.
    """

    def __init__(self, allocator: BlockAllocator, group: int, window: int | None = None,
                 marker: PhysicalTokenBlock | None = None) -> None:
        self._allocator = allocator
        self._tag = ("kv cache group", group)
        self.window = window
        self.marker = marker
        self.cap: dict[tuple[int, ...], int] | None = None

    def __getattr__(self, name: str):
        return getattr(self._allocator, name)

    def lookup(self, parent: PhysicalTokenBlock | None, token_ids) -> PhysicalTokenBlock | None:
        return self._allocator.lookup(parent, (self._tag, *token_ids))

    def name_blocks(self, blocks, token_ids) -> None:
        self._allocator.name_blocks(blocks, [(self._tag, *t) for t in token_ids])

    def acquire(self, block: PhysicalTokenBlock) -> None:
        if block is not self.marker:  # (a null entry: no block of the pool, nothing to count)
            self._allocator.acquire(block)

    def servable(self, token_ids, max_blocks: int) -> list[bool]:
        """``ok[h]`` for h = 0 ... max_blocks: can this group serve the prompt's first h blocks
        from the cache (a full group all of them, a sliding group its window's)?"""
        if self.window is None:
            num = len(self._from_left(token_ids, max_blocks))
            return [h <= num for h in range(max_blocks + 1)]
        found, linked = self._by_name(token_ids, max_blocks)
        ok, run_start = [True], 0  # the first block of the run of found blocks ending here
        for i in range(max_blocks):
            if found[i] is None:
                run_start = i + 1
            elif i > 0 and not linked[i]:
                run_start = i  # found by its name alone: a run starts here
            first = first_block_read(i + 1, self.block_size, self.window)
            ok.append(found[i] is not None and run_start <= first and (first > 0 or linked[0]))
        return ok

    def longest_cached_prefix(self, token_ids, max_blocks: int) -> list[PhysicalTokenBlock]:
        """The hits of the longest prefix this group serves (at most ``cap``'s): a sliding
        group's start with null entries (its marker) before the blocks it must hold."""
        if self.cap is not None:
            max_blocks = min(max_blocks, self.cap.get(tuple(token_ids), max_blocks))
        if self.window is None:
            return self._from_left(token_ids, max_blocks)
        ok = self.servable(token_ids, max_blocks)
        num = max(h for h in range(max_blocks + 1) if ok[h])
        first = first_block_read(num, self.block_size, self.window)
        found, _ = self._by_name(token_ids, num)
        return [self.marker] * first + found[first:num]

    def _from_left(self, token_ids, max_blocks: int) -> list[PhysicalTokenBlock]:
        # NOTE: the allocator's own loop, run on this view: its lookups take this group's names
        return type(self._allocator).longest_cached_prefix(self, token_ids, max_blocks)

    def _by_name(self, token_ids, max_blocks: int) -> tuple[list, list[bool]]:
        """Per block of the prompt: the cached block found by its name, or None; and whether
        it follows the block found before it (for the first block: it has no parent)."""
        alloc, size = self._allocator, self.block_size
        found: list[PhysicalTokenBlock | None] = []
        linked: list[bool] = []
        name, before = None, None  # the name and contents of the block before
        for i in range(max_blocks):
            tokens = (self._tag, *token_ids[i * size:(i + 1) * size])
            name = alloc.hash_fn(name, tokens)
            block = alloc.by_hash.get(name)
            contents = alloc.contents.get(block.block_number) if block is not None else None
            if contents is None or contents.token_ids != tokens:
                block = contents = None  # not cached, or a collision caught by the tokens
            found.append(block)
            if i == 0:
                linked.append(contents is not None and contents.parent_id is None)
            else:
                linked.append(contents is not None and before is not None
                              and contents.parent_id == before.content_id)
            before = contents
        return found, linked


class SlidingPrefixGroup(SlidingWindowBlockManager):
    """A hybrid model's sliding group with prefix caching: its hits hold null entries before
    the blocks its window needs (``GroupNames.longest_cached_prefix``)."""

    def num_blocks_to_allocate(self, seq_group: SequenceGroup) -> int:
        # NOTE: the marker among the hits is no block of the pool, and its ref count is 0:
        # BlockSpaceManager's count took it for one cached block taken back (counted once)
        marker = self.dropped[Device.GPU]
        counted = any(b is marker for hits in self.cached_prefix(seq_group).values()
                      for b in hits)
        return super().num_blocks_to_allocate(seq_group) - counted
