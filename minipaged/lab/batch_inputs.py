"""The flat batch of a few groups, without a scheduler: for lessons 02 and 08 and their exercises.

The engine's ``prepare_inputs`` (``worker/model_runner.py``) reads the scheduler's outputs. A
lesson that builds groups by hand asks here instead: every fresh prompt is computed whole in one
chunk, every other running sequence decodes one token.
"""
from __future__ import annotations

import torch

from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.scheduler import PrefillChunk, SchedulerOutputs
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.worker.model_runner import PreparedInputs, prepare_inputs


def prepare_inputs_for_groups(seq_groups: list[SequenceGroup], block_manager: BlockSpaceManager,
                              block_size: int, device: torch.device) -> PreparedInputs:
    """``prepare_inputs`` on groups whose blocks are allocated but not scheduled.

    Args:
        seq_groups: the groups of the step, in any order.
        block_manager: holds their block tables.
        block_size: tokens per block.
        device: where the tensors go.
    """
    chunks, decode_groups = [], []
    for group in seq_groups:
        todo = [s for s in group.get_seqs(SequenceStatus.RUNNING) if s.num_computed_tokens == 0]
        if not todo:
            decode_groups.append(group)
            continue
        by_table: dict[tuple, list[Sequence]] = {}  # sequences sharing one table: computed once
        for seq in todo:
            key = tuple(block_manager.get_block_table(seq))
            by_table.setdefault(key, []).append(seq)
        for seqs in by_table.values():
            chunks.append(PrefillChunk(group, seqs[0], 0, seqs[0].get_len(),
                                       [s.seq_id for s in seqs]))
    step = SchedulerOutputs(list(seq_groups), [g not in decode_groups for g in seq_groups],
                            sum(c.num_tokens for c in chunks)
                            + sum(g.num_seqs(SequenceStatus.RUNNING) for g in decode_groups),
                            prefill_chunks=chunks, decode_seq_groups=decode_groups)
    return prepare_inputs(step, block_manager, block_size, device)
