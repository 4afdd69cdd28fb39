"""Lesson 02 exercises: where a token's K/V live, and how a block table grows.

    slot_of(block_table, position, block_size) -> int
        the cache slot of the token at ``position``: physical block * block_size + offset
    grow_block_table(block_table, num_tokens, block_size, allocate) -> None
        the sequence now holds ``num_tokens`` tokens (the newest was just appended); if the
        newest token has no block yet, call ``allocate()`` and append the block number it returns

Expected answers: the ``slot_mapping`` of the flat batch (``lab.batch_inputs``) on block tables that a
real ``BlockSpaceManager`` scrambled, and the tables of ``BlockSpaceManager.append_slot``.
"""
from __future__ import annotations

import torch

from minipaged.sampling_params import SamplingParams
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
from minipaged.lab.batch_inputs import prepare_inputs_for_groups
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus


def _admit(bm, seq_id, num_tokens, block_size):
    seq = Sequence(seq_id, None, list(range(100, 100 + num_tokens)), block_size)
    group = SequenceGroup(str(seq_id), [seq], SamplingParams(), arrival_time=float(seq_id))
    bm.allocate(group)
    seq.status = SequenceStatus.RUNNING
    return seq, group


@exercise
def check_slot_of(fn, num_cases: int = 60, seed: int | None = 0) -> CheckResult:
    learner = Learner("slot_of", fn)
    rng = rng_for(seed)
    checked = 0
    for case in range(num_cases):
        block_size = rng.choice([1, 2, 4, 8, 16])
        bm = BlockSpaceManager(block_size, num_gpu_blocks=64, num_cpu_blocks=0, watermark=0.0)
        # Admit and free a few requests so the next table's blocks are scattered in the pool.
        seqs = [_admit(bm, i, rng.randint(1, 5 * block_size), block_size)[0] for i in range(4)]
        for seq in rng.sample(seqs, 2):
            bm.free(seq)
        seq, group = _admit(bm, 9, rng.randint(1, 6 * block_size), block_size)
        batch = prepare_inputs_for_groups([group], bm, block_size, torch.device("cpu"))
        table = bm.get_block_table(seq)
        for position, expected in enumerate(batch.meta.slot_mapping.tolist()):
            got = learner(list(table), position, block_size)
            checked += 1
            if got != expected:
                if got == table[position // block_size] + position % block_size:
                    hint = "a block number counts blocks, not slots: how many slots lie before it?"
                elif got == position:
                    hint = "the slot comes from the block TABLE, not from the position alone"
                else:
                    hint = ("which logical block holds the position, and where in that block? "
                            "the table says which physical block that logical block is")
                fail(learner.name, case, f"block_table={table}, position={position}, "
                     f"block_size={block_size}", got, expected, hint)
    return passed(learner, checked)


@exercise
def check_grow_block_table(fn, num_cases: int = 60, seed: int | None = 0) -> CheckResult:
    learner = Learner("grow_block_table", fn)
    rng = rng_for(seed)
    checked = 0
    for case in range(num_cases):
        block_size = rng.choice([1, 2, 3, 4, 8, 16])
        bm = BlockSpaceManager(block_size, num_gpu_blocks=128, num_cpu_blocks=0, watermark=0.0)
        seq, _ = _admit(bm, 0, rng.randint(1, 3 * block_size), block_size)
        mine = bm.get_block_table(seq)
        for _ in range(rng.randint(1, 3 * block_size + 2)):
            before = list(mine)
            seq.append_token_id(7, {7: 0.0})
            calls = []
            next_free = bm.snapshot()["free_gpu_blocks"][0]

            def allocate():
                calls.append(next_free)
                return next_free

            learner(mine, seq.get_len(), block_size, allocate)
            bm.append_slot(seq)
            expected = bm.get_block_table(seq)
            checked += 1
            if mine != expected:
                new_block = len(expected) > len(before)
                hint = ("the table grows only when the newest token does not fit in the "
                        "blocks it already has") if new_block or calls else \
                    "append the block number that allocate() returns"
                if len(calls) > 1:
                    hint = "call allocate() at most once per new token"
                fail(learner.name, case, f"block_table={before}, num_tokens={seq.get_len()}, "
                     f"block_size={block_size}", mine, expected, hint)
    return passed(learner, checked)
