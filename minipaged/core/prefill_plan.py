"""Prefill work as chunks: what a group admitted to the GPU must compute (lessons 04, 09, 11).

A ``PrefillChunk`` is a piece of a prompt; ``plan_prefill`` lists the chunks of a group just
given its blocks (one chunk for a fresh group; one per sequence for a group recomputed after a
preemption, after the prefix they share). The scheduler takes chunks from the plan as its token
budget allows, splitting the first that does not fit.
"""
from __future__ import annotations

from dataclasses import dataclass

from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus


@dataclass
class PrefillChunk:
    """Tokens ``[start, end)`` of ``seq`` computed in one step.

    They attend to the tokens before ``start`` (already in the cache, or written by an earlier
    chunk of the same step) and causally to themselves. ``seq_ids`` are the sequences whose
    cache this fills (several when they share the blocks); when ``end`` is the sequence's
    length the last token's logits give each of them its next token (``sample``).
    """

    seq_group: SequenceGroup
    seq: Sequence
    start: int
    end: int
    seq_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def sample(self) -> bool:
        return self.end == self.seq.get_len()


def prefix_leader(seqs: list[Sequence]) -> Sequence:
    """The sequence of a recomputed group that computes the shared prefix: the shortest, so
    that the group's first chunk is the cheapest to admit."""
    return min(seqs, key=lambda s: s.get_len())


def plan_prefill(seq_group: SequenceGroup, shared_len: int, identical: bool,
                 cached: dict[int, int] | None = None) -> list[PrefillChunk]:
    """The chunks that compute a group just given its blocks (see ``prompt_layout``).

    ``cached`` (from ``BlockSpaceManager.allocate``) says how many first tokens of each sequence
    came from the prefix cache (lesson 11): they are not computed, a chunk starts after them.

    A fresh group is one chunk: its prompt, computed once for all its sequences, sampled. A group
    recomputed after preemption holds sequences that differ: the first computes the shared
    prefix and its own tokens, the others only their own tokens after the prefix. Each stops one
    token short, so that all of them compute their newest token, and sample, in the same decode
    step (beam search needs its beams in step; seeds then draw in the same order).
    """
    seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
    cached = cached or {}
    if identical:
        start = cached.get(seqs[0].seq_id, 0)
        for seq in seqs:
            seq.num_computed_tokens = start
        return [PrefillChunk(seq_group, seqs[0], start, seqs[0].get_len(),
                             [s.seq_id for s in seqs])]
    leader = prefix_leader(seqs)
    chunks = []
    for seq in [leader] + [s for s in seqs if s is not leader]:
        # The leader's chunk fills the shared blocks the cache did not have.
        start = cached.get(seq.seq_id, 0) if seq is leader else max(
            shared_len, cached.get(seq.seq_id, 0))
        seq.num_computed_tokens = start
        if seq.get_len() - 1 > start:
            chunks.append(PrefillChunk(seq_group, seq, start, seq.get_len() - 1, [seq.seq_id]))
    return chunks
