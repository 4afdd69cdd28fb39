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


_package_append_slot = block_manager.BlockSpaceManager.append_slot


def _new_block_one_token_late(self, seq):
    table = self.block_tables[seq.seq_id]
    if len(table) < len(seq.logical_token_blocks) and seq.get_len() % self.block_size == 1:
        return None  # (the boundary check counts a token the sequence has not got yet)
    return _package_append_slot(self, seq)


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
             "a sequence's new block is opened one token after the token that needs it",
             (lambda engine: mock.patch.object(block_manager.BlockSpaceManager, "append_slot",
                                               _new_block_one_token_late),),
             "The line that raised is only where it was noticed: which component should have "
             "given that token a place, and in which step?",
             "How many tokens did the sequence hold at that step, and how many blocks did its "
             "table have?",
             "nano-vllm PR #66 (GeeeekExplorer/nano-vllm: the append checks counted the "
             "upcoming token as if the sequence already held it)"),
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
