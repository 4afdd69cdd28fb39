"""Lesson 06 exercises: the flat batch of one engine step.

``SeqView(token_ids, num_computed_tokens, block_table)``: a scheduled sequence (in any order). A sequence with ``num_computed_tokens == 0`` is a prompt run (all its tokens
are computed this step); any other computes only its newest token (a decode).

    flat_batch(seqs) -> (input_ids, positions)
        every prompt's tokens, packed one after another, then one token per decode
    slot_mapping(seqs, block_size) -> list[int]
        for each token of that flat batch, the cache slot its key and value are written to

Expected answers: ``model_runner.prepare_inputs`` on random steps of a real ``Scheduler``, mixing
new prompts, decodes and preempted requests.
"""
from __future__ import annotations

import torch
from typing import NamedTuple

from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
from minipaged.lab.dry_run import RandomTraffic
from minipaged.worker.model_runner import prepare_inputs
from minipaged.sequence import SequenceStatus


class SeqView(NamedTuple):
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]


def _random_batches(rng, num_cases):
    """(seq views, block size, the package's PreparedInputs) for random mixed steps."""
    cases = 0
    while cases < num_cases:
        block_size = rng.choice([1, 2, 4, 8])
        traffic = RandomTraffic(rng, block_size, rng.randint(6, 24),
                                preemption_mode=rng.choice(["swap", "recompute"]))
        for _ in range(rng.randint(4, 20)):
            traffic.arrive(rng.choice([0, 1, 1, 2]))
            outs = traffic.scheduler.schedule()
            # Any order of the groups is a valid input of prepare_inputs: mix them up, so that
            # "prompts first" is something the answer has to do.
            groups = rng.sample(outs.scheduled_seq_groups, len(outs.scheduled_seq_groups))
            seqs = [SeqView(s.get_token_ids(), s.num_computed_tokens,
                            traffic.bm.get_block_table(s))
                    for g in groups for s in g.get_seqs(SequenceStatus.RUNNING)]
            if seqs:
                batch = prepare_inputs(groups, traffic.bm, block_size, torch.device("cpu"))
                yield seqs, block_size, batch
                cases += 1
            traffic.after_model(outs)


def _show(seqs) -> str:
    return "[" + ", ".join(f"SeqView({len(s.token_ids)} tokens ..{s.token_ids[-3:]}, computed "
                           f"{s.num_computed_tokens}, table {s.block_table})" for s in seqs) + "]"


@exercise
def check_flat_batch(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("flat_batch", fn)
    for case, (seqs, _, batch) in enumerate(_random_batches(rng_for(seed), num_cases)):
        expected = (batch.input_ids.tolist(), batch.positions.tolist())
        got = learner(list(seqs))
        got = (list(map(int, got[0])), list(map(int, got[1])))
        if got != expected:
            if sorted(got[0]) == sorted(expected[0]) and got[0] != expected[0]:
                hint = "all prompt tokens come first, then one token per decoding sequence"
            elif got[0] == expected[0]:
                hint = ("positions count from 0 inside each sequence; a decode's newest token "
                        "sits at position len(token_ids) - 1")
            else:
                hint = ("a prompt run (num_computed_tokens == 0) puts ALL its tokens in the "
                        "batch; a decode puts only its newest token")
            fail(learner.name, case, _show(seqs), got, expected, hint)
    return passed(learner, num_cases)


@exercise
def check_slot_mapping(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("slot_mapping", fn)
    for case, (seqs, block_size, batch) in enumerate(_random_batches(rng_for(seed), num_cases)):
        expected = batch.meta.slot_mapping.tolist()
        got = list(map(int, learner(list(seqs), block_size)))
        if got != expected:
            if len(got) != len(expected):
                hint = (f"one slot per token of the flat batch: {len(expected)} here (all tokens "
                        f"of each prompt, one per decode)")
            else:
                hint = ("slot = block_table[pos // block_size] * block_size + pos % block_size, "
                        "with pos the token's position (lesson 02); prompts first")
            fail(learner.name, case, f"{_show(seqs)}, block_size={block_size}", got, expected,
                 hint)
    return passed(learner, num_cases)
