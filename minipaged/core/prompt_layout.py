"""How a waiting group's sequences share blocks when it is admitted (lessons 03, 09, 11):
``BlockSpaceManager.prompt_layout`` and everything that counts a prompt's blocks read it here."""
from __future__ import annotations

from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus


def prompt_layout(seq_group: SequenceGroup, block_size: int) -> tuple[list[Sequence], int, bool]:
    """``(sequences, shared_len, identical)`` of a waiting group.

    A fresh group's sequences hold the same tokens (``identical``): one block table serves
    them all and the prompt is computed once. After a preemption by recompute they differ:
    they share the full blocks of their common prefix (at least the prompt's full blocks),
    ``shared_len`` tokens, and each has private blocks for the rest.
    """
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
    return seqs, common // block_size * block_size, False
