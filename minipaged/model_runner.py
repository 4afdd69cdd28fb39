"""Turning a scheduled step into one flat batch and running the model on it (lesson 06).

All the step's tokens go into one sequence of tokens: first every prompt that is computed this
step (packed one after another), then one token per decoding sequence. Alongside them:
``positions``, ``slot_mapping`` (where each token's K/V go), and for the decode tokens their
``block_tables`` and ``context_lens``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minipaged.block_manager import BlockSpaceManager
from minipaged.input_metadata import InputMetadata
from minipaged.sequence import SequenceGroup, SequenceStatus


@dataclass
class Row:
    """One row of the step's logits: the next-token distribution of some sequences."""

    seq_group: SequenceGroup
    seq_ids: list[int]  # several when a fresh group's sequences share one prompt computation
    is_prompt: bool


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: InputMetadata
    rows: list[Row]
    sample_indices: torch.Tensor  # (R,) which of the T tokens produce a next-token distribution


def prepare_inputs(seq_groups: list[SequenceGroup], block_manager: BlockSpaceManager,
                   block_size: int, device: torch.device) -> PreparedInputs:
    input_ids: list[int] = []
    positions: list[torch.Tensor] = []  # pieces, concatenated once at the end
    slots: list[torch.Tensor] = []
    prompt_lens: list[int] = []
    rows: list[Row] = []
    sample_indices: list[int] = []

    # 1. Prompts: every sequence whose tokens are not in the cache yet.
    for group in seq_groups:
        todo = [s for s in group.get_seqs(SequenceStatus.RUNNING) if s.num_computed_tokens == 0]
        if not todo:
            continue
        tables = [block_manager.block_tables[s.seq_id] for s in todo]
        shared = all(t is tables[0] or t == tables[0] for t in tables[1:])
        # NOTE: sequences that share one block table hold the same tokens: compute them once.
        groups_of_seqs = [todo] if shared else [[s] for s in todo]
        for seqs in groups_of_seqs:
            seq = seqs[0]
            tokens = seq.get_token_ids()
            table = torch.tensor(block_manager.get_block_table(seq))  # (num_blocks,)
            pos = torch.arange(len(tokens))  # (n,)
            input_ids += tokens
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)  # (n,)
            prompt_lens.append(len(tokens))
            sample_indices.append(len(input_ids) - 1)
            rows.append(Row(group, [s.seq_id for s in seqs], True))

    # 2. Decodes: one new token per running sequence whose earlier tokens are cached.
    block_tables: list[list[int]] = []
    context_lens: list[int] = []
    decode_positions: list[int] = []
    decode_slots: list[int] = []
    for group in seq_groups:
        for seq in group.get_seqs(SequenceStatus.RUNNING):
            if seq.num_computed_tokens == 0:
                continue
            pos = seq.get_len() - 1
            table = block_manager.get_block_table(seq)
            input_ids.append(seq.get_last_token_id())
            decode_positions.append(pos)
            decode_slots.append(table[pos // block_size] * block_size + pos % block_size)
            block_tables.append(table)
            context_lens.append(seq.get_len())
            sample_indices.append(len(input_ids) - 1)
            rows.append(Row(group, [seq.seq_id], False))

    max_blocks = max((len(t) for t in block_tables), default=0)
    padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]

    positions.append(torch.tensor(decode_positions, dtype=torch.long))
    slots.append(torch.tensor(decode_slots, dtype=torch.long))

    def to_device(t: torch.Tensor) -> torch.Tensor:
        # Built on the host, copied once per tensor; pinned memory lets the copy run async.
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t

    meta = InputMetadata(
        prompt_lens=prompt_lens,
        slot_mapping=to_device(torch.cat(slots).long()),
        block_tables=to_device(torch.tensor(padded, dtype=torch.int32).view(len(padded),
                                                                            max_blocks)),
        context_lens=to_device(torch.tensor(context_lens, dtype=torch.int32)),
        max_context_len=max(context_lens, default=0),
    )
    return PreparedInputs(to_device(torch.tensor(input_ids, dtype=torch.long)),
                          to_device(torch.cat(positions).long()), meta, rows,
                          to_device(torch.tensor(sample_indices, dtype=torch.long)))


class ModelRunner:
    def __init__(self, model: torch.nn.Module, block_size: int, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device

    @torch.inference_mode()
    def execute_model(self, inputs: PreparedInputs, kv_caches) -> torch.Tensor:
        """Logits (R, vocab) in float32, one row per ``inputs.rows`` entry."""
        hidden = self.model(inputs.input_ids, inputs.positions, kv_caches, inputs.meta)  # (T, C)
        hidden = hidden.index_select(0, inputs.sample_indices)  # (R, C)
        return self.model.compute_logits(hidden).float()  # (R, vocab)
