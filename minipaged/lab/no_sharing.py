"""A block manager that never shares a block past one step: the baseline of lesson 03's
measurement and of ``benchmarks/memory_sharing.py``.

An engine without paging holds one whole KV copy per sample or beam. ``NoSharingBlockManager``
behaves like that while generating exactly the same tokens as the real manager: a prompt is
still computed once into shared blocks (and a beam is still forked by sharing), so that both
sample from the same rows, but the next ``reserve_slot`` gives every sequence a private copy of
every block it shares (real copies through ``blocks_to_copy``). Only the memory differs.

    engine.scheduler.replace_block_manager(NoSharingBlockManager.like(engine.block_manager))
"""
from __future__ import annotations

from minipaged.block import Device, PhysicalTokenBlock
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.sequence import Sequence


class NoSharingBlockManager(BlockSpaceManager):
    """``BlockSpaceManager`` whose sequences copy every shared block before their next token.

    Args: as for ``BlockSpaceManager``.
    """

    def reserve_slot(self, seq: Sequence) -> list[tuple[int, int]]:
        """Unshare every block of the sequence, then make room for its newest token.

        Args:
            seq: a running sequence whose newest token is not in the cache yet.
        """
        return self.unshare(seq) + super().reserve_slot(seq)

    def num_blocks_to_append(self, seqs: list[Sequence]) -> int:
        """GPU blocks that ``reserve_slot`` will take: one per new logical block, and a copy of
        each shared block for all its holders but the last.

        Args:
            seqs: the running sequences of one group, about to decode.
        """
        num_needed = 0
        shared: dict[int, PhysicalTokenBlock] = {}
        for seq in seqs:
            if seq.num_computed_tokens == 0:
                continue  # a prefill run: its blocks were allocated for all its tokens
            table = self.block_tables[seq.seq_id]
            shared.update((id(b), b) for b in table if b.ref_count > 1)
            num_needed += len(table) < len(seq.logical_token_blocks)
        # unshare copies each shared block for all holders but the last; the holders of a block
        # are always sequences of this same group.
        return num_needed + sum(b.ref_count - 1 for b in shared.values())

    def unshare(self, seq: Sequence) -> list[tuple[int, int]]:
        """Give the sequence a private copy of every shared block.

        Returns the ``(src, dst)`` pairs to copy.
        """
        table = self.block_tables[seq.seq_id]
        pairs = []
        for i, block in enumerate(table):
            if block.ref_count > 1:
                assert block.device is Device.GPU
                table[i] = self.gpu_allocator.allocate()
                self.gpu_allocator.copy_contents(block, table[i])  # the same KV, privately
                self.gpu_allocator.free(block)
                pairs.append((block.block_number, table[i].block_number))
        if pairs:
            self._emit("unshare", seq_id=seq.seq_id, pairs=pairs)
        return pairs


def peak_blocks(llm, prompt: str, params, manager_class) -> tuple[int, list[str]]:
    """(the most GPU blocks in use at any step, the texts of its samples) of one request run
    with a fresh ``manager_class`` in ``llm``'s engine: the same pool, nothing shared with an
    earlier run. Lesson 03 compares the package's (or the learner's) manager with this file's.

    Args:
        llm: an ``LLM`` whose engine runs nothing else.
        prompt: the request's text.
        params: its ``SamplingParams`` (``n`` samples or beams).
        manager_class: a ``BlockSpaceManager`` class with ``like``.
    """
    engine = llm.llm_engine
    engine.scheduler.replace_block_manager(manager_class.like(engine.block_manager))
    in_use: list[int] = []

    def observer(snap) -> None:
        in_use.append(snap.scheduler["num_gpu_blocks"] - snap.scheduler["num_free_gpu_blocks"])

    engine.add_observer(observer)
    try:
        [out] = llm.generate([prompt], params, use_tqdm=False)
    finally:
        engine.remove_observer(observer)
    return max(in_use), [c.text for c in out.outputs]
