"""What the scheduler hands the worker for one step: plain data (lessons 04 and 08).

The scheduler (``core/``) decides a step; the worker (``worker/``) lays it out as one flat batch.
Neither imports the other: between them is this record, one ``SequenceRun`` per piece of work,
with the tokens to run, where they sit and the block table as plain ints (vLLM v0.1 hands its
worker ``SequenceGroupMetadata`` with ``block_tables`` the same way). The cache moves of the
step (``blocks_to_swap_in``, ``blocks_to_swap_out``, ``blocks_to_copy``) are plain dicts of ints
on ``SchedulerOutputs`` and go to ``Worker.cache_swap``.

NOTE: it sits at the top of the package, with the other data types, because both layers read
it; it imports nothing of either.
"""
from __future__ import annotations

from dataclasses import dataclass

from minipaged.sequence import SequenceGroup


@dataclass
class SequenceRun:
    """Tokens ``[start, start + len(token_ids))`` of one sequence, run in this step.

    A prefill run (``is_prompt``) is a prompt or a chunk of one: from position 0 it is a prompt
    computed from scratch, from a later position it continues a context already in the cache.
    A decode run is one token, the sequence's newest. ``seq_ids`` are the sequences whose cache
    the run fills (several when a fresh group's sequences share the prompt's blocks); when
    ``sample`` is set the last token's logits give each of them its next token.

    ``seq_group`` rides along for the sampler (the sampling parameters, the beams); the worker
    reads no blocks through it: the blocks are ``block_table``.
    """

    seq_group: SequenceGroup
    seq_ids: list[int]
    token_ids: list[int]  # the tokens to run
    start: int  # position of token_ids[0]
    block_table: list[int]  # the sequence's physical block numbers, in logical order
    sample: bool  # does the last token produce a row of logits?
    is_prompt: bool  # prefill (a prompt or a chunk of one), else a decode
    # a hybrid model's other KV cache groups (lesson 20): their block tables, in the order of
    # model_shape.kv_groups after the first (block_table's); empty for a model of one group
    other_block_tables: tuple = ()

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
