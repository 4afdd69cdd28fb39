"""What the attention layers need to know about one flattened batch (lesson 06)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class InputMetadata:
    """The step's tokens are laid out as [all prompt tokens, packed] + [one token per decode].

    Args:
        prompt_lens: length of each packed prompt, in order.
        slot_mapping: (num_tokens,) cache slot of every token (block * block_size + offset).
        block_tables: (num_decode_seqs, max_blocks) physical block numbers, padded with 0.
        context_lens: (num_decode_seqs,) tokens each decode sequence attends to (incl. its new one).
        max_context_len: the largest of ``context_lens`` (0 when there is no decode).
    """

    prompt_lens: list[int]
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    max_context_len: int

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def num_generation_tokens(self) -> int:
        return int(self.context_lens.shape[0])
