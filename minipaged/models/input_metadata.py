"""What the attention layers need to know about one flattened batch (lesson 07)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class InputMetadata:
    """The step's tokens are laid out in three parts, one after another:

        [prompts computed from scratch, packed] [chunks after a cached context] [one per decode]

    Args:
        prompt_lens: length of each packed prompt, in order (they attend only to themselves).
        slot_mapping: (num_tokens,) cache slot of every token (block * block_size + offset).
        block_tables: (num_decode_seqs, max_blocks) physical block numbers, padded with 0.
        context_lens: (num_decode_seqs,) tokens each decode sequence attends to (incl. its new one).
        max_context_len: the largest of ``context_lens`` (0 when there is no decode).
        chunk_query_start_loc: (num_chunks + 1,) where each chunk's tokens start in the chunk part.
        chunk_block_tables: (num_chunks, max_blocks) the block table of each chunk's sequence.
        chunk_context_lens: (num_chunks,) tokens in the cache once the chunk is written (its end).
        group_metas: a hybrid model's other KV cache groups (lesson 20), in the order of
            ``model_shape.kv_groups`` after the first: the same batch with each group's own
            ``slot_mapping``, ``block_tables`` and ``chunk_block_tables``; None for one group.
    """

    prompt_lens: list[int]
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    max_context_len: int
    chunk_query_start_loc: torch.Tensor | None = None
    chunk_block_tables: torch.Tensor | None = None
    chunk_context_lens: torch.Tensor | None = None
    num_chunk_tokens: int = 0
    group_metas: list[InputMetadata] | None = None

    def for_group(self, group: int) -> InputMetadata:
        """The metadata a layer of KV cache group ``group`` reads (this one for group 0, or
        for every layer of a model of one group)."""
        if not group or self.group_metas is None:
            return self
        return self.group_metas[group - 1]

    @property
    def num_fresh_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens computed by prefill this step: fresh prompts and chunks."""
        return sum(self.prompt_lens) + self.num_chunk_tokens

    @property
    def num_generation_tokens(self) -> int:
        return int(self.context_lens.shape[0])
