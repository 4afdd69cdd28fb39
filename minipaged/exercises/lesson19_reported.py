"""Lesson 19's faults that reproduce bugs reported against real engines, written anew for our
block manager and prefix cache (the same mistake, our names; none of their code).

Each entry: the component, the cause as ``CAUSES`` words it, the patches, the questions a wrong
diagnosis gets (``tool`` for a wrong component, ``why`` for a wrong cause), and where the bug
was reported.
"""
from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

from minipaged.core import block_manager, prefix_caching_allocator

_PCA = prefix_caching_allocator.PrefixCachingAllocator


def _evict_keeping_name(self, block, counted: bool = True) -> None:
    # The block goes to the free list for other tokens, yet its name still finds it.
    del self.evictable[block.block_number]
    self.num_evictions += counted
    self.free_blocks.append(block)


def _swap_in_without_next_blocks(self, seq_group) -> bool:
    from minipaged.sequence import SequenceStatus

    num_required = len(self._physical_blocks(seq_group, SequenceStatus.SWAPPED))
    return self.gpu_allocator.get_num_free_blocks() - num_required >= self.watermark_blocks


def _acquire_uncounted_if_evictable(self, block) -> None:
    if block.ref_count == 0:
        del self.evictable[block.block_number]  # taken back from the cache ...
        return  # ... and no holder counted
    block.ref_count += 1


@dataclass(frozen=True)
class Reported:
    component: str
    cause: str
    patches: tuple
    tool: str
    why: str
    reported: str  # where the same bug was reported


REPORTED = (
    Reported("PrefixCachingAllocator",
             "an evicted block keeps its name, so a later prompt finds it though it now holds "
             "other tokens",
             (lambda engine: mock.patch.object(_PCA, "_evict", _evict_keeping_name),),
             "Which invariant broke first, and which component can hand one block to two "
             "requests?",
             "When was the block the violation names last in the free list, and what did the "
             "prefix cache know about it after that?",
             "nano-vllm issue #163 (GeeeekExplorer/nano-vllm: a reused block's old hash still "
             "maps to it); vLLM PR #4761 (vllm-project/vllm: a block popped from the evictor "
             "stayed in the cached-blocks table)"),
    Reported("BlockSpaceManager",
             "the room check before a swap-in leaves out the blocks the group's next step "
             "appends",
             (lambda engine: mock.patch.object(block_manager.BlockSpaceManager, "can_swap_in",
                                               _swap_in_without_next_blocks),),
             "At the step where the suspect crashed, what did the reference do with the swapped "
             "group instead, and which check decided it?",
             "How many free blocks were there when the group came back, and how many did its "
             "sequences need in that same step?",
             "vLLM PR #8824 (vllm-project/vllm, block manager v2: whether a group can be "
             "swapped in did not count the tokens it had not yet got blocks for)"),
    Reported("PrefixCachingAllocator",
             "a block taken back from the evictable list is not counted as held",
             (lambda engine: mock.patch.object(_PCA, "acquire",
                                               _acquire_uncounted_if_evictable),),
             "Which invariant broke first, for which block, and where did that block come from "
             "in that step?",
             "What was that block's ref count before the step, and how many tables held it "
             "after?",
             "mini-sglang PR #52 (sgl-project/mini-sglang: a prefix match locked the matched "
             "node's ancestors but not the node itself, so it could be evicted while in use)"),
)
