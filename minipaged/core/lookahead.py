"""Lookahead slots: room for proposed tokens before they are verified (lesson 12).

With speculative decoding a running sequence decodes its newest token *and* ``k`` proposed
tokens in one step, so the scheduler reserves ``k`` slots after the newest token
(``Sequence.num_lookahead_slots``). The block manager gives them blocks like any slot
(``BlockSpaceManager.reserve_slot``), and takes back the blocks that hold no token once the
rejected proposals are dropped (``BlockSpaceManager.rollback_slots``).
"""
from __future__ import annotations

from minipaged.sequence import Sequence


def num_lookahead_blocks(seq: Sequence, block_size: int) -> int:
    """Blocks the lookahead slots need beyond those of the sequence's tokens."""
    num_slots = seq.get_len() + seq.num_lookahead_slots
    return -(-num_slots // block_size) - len(seq.logical_token_blocks)


def fit_lookahead(seqs: list[Sequence], budget: int) -> None:
    """Lower the lookahead of ``seqs`` (one group's) so that their tokens, one each plus their
    lookahead, fit ``budget``: a verification of ``k + 1`` tokens counts ``k + 1`` tokens.
    NOTE: the newest token of each sequence runs whatever the budget (decodes never wait)."""
    room = budget - len(seqs)
    for seq in seqs:
        seq.num_lookahead_slots = max(0, min(seq.num_lookahead_slots, room))
        room -= seq.num_lookahead_slots


def drop_lookahead(seqs: list[Sequence]) -> bool:
    """No lookahead for ``seqs`` this step (their group does not fit otherwise); returns
    whether there was any to drop."""
    had = any(seq.num_lookahead_slots for seq in seqs)
    for seq in seqs:
        seq.num_lookahead_slots = 0
    return had
