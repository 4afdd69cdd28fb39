"""The flat batch of a few groups, without a scheduler: for lessons 02 and 08 and their exercises.

The engine's ``prepare_inputs`` (``worker/model_runner.py``) reads the scheduler's record of a
step (``SequenceRun``s). A lesson that builds groups by hand asks here instead: every fresh
prompt is computed whole in one run, every other running sequence decodes one token.
"""
from __future__ import annotations

import torch

from minipaged.core.block_manager import BlockSpaceManager
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.step_record import SequenceRun
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
    prompts, decodes = [], []
    for seq_group in seq_groups:
        running = seq_group.get_seqs(SequenceStatus.RUNNING)
        todo = [s for s in running if s.num_computed_tokens == 0]
        by_table: dict[tuple, list[Sequence]] = {}  # sequences sharing one table: computed once
        for seq in todo:
            by_table.setdefault(tuple(block_manager.get_block_table(seq)), []).append(seq)
        for table, seqs in by_table.items():
            prompts.append(SequenceRun(seq_group, [s.seq_id for s in seqs], seqs[0].get_token_ids(),
                                       0, list(table), True, True))
        if not todo:
            decodes += [SequenceRun(seq_group, [s.seq_id], [s.get_last_token_id()], s.get_len() - 1,
                                    block_manager.get_block_table(s), True, False)
                        for s in running]
    return prepare_inputs(prompts + decodes, block_size, device)
