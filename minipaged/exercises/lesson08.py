"""Lesson 08 exercises: the flat batch of one engine step.

``SeqView(token_ids, num_computed_tokens, block_table)``: a scheduled sequence (in any order). A sequence with ``num_computed_tokens == 0`` is a prompt run (all its tokens
are computed this step); any other computes only its newest token (a decode).

    flat_batch(seqs) -> (input_ids, positions)
        every prompt's tokens, packed one after another, then one token per decode
    sample_indices(seqs) -> list[int]
        the rows of that flat batch whose hidden state becomes a next-token distribution: the
        model computes one row per token, but only the last token of a prompt and the token of
        a decode have a next token to sample; the rows in batch order

Expected answers: ``lab.batch_inputs.prepare_inputs_for_groups`` on random steps of a real
``Scheduler``, mixing new prompts, decodes and preempted requests.
"""
from __future__ import annotations

import torch
from typing import NamedTuple

from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
from minipaged.lab.dry_run import RandomTraffic
from minipaged.lab.batch_inputs import prepare_inputs_for_groups
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
            # Any order of the groups is a valid input of prepare_inputs_for_groups: mix them
            # up, so that "prompts first" is something the answer has to do.
            groups = rng.sample(outs.scheduled_seq_groups, len(outs.scheduled_seq_groups))
            seqs = [SeqView(s.get_token_ids(), s.num_computed_tokens,
                            traffic.bm.get_block_table(s))
                    for g in groups for s in g.get_seqs(SequenceStatus.RUNNING)]
            if seqs:
                batch = prepare_inputs_for_groups(groups, traffic.bm, block_size,
                                                  torch.device("cpu"))
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
                hint = "the right tokens in the wrong order: the prompt runs come first"
            elif got[0] == expected[0]:
                hint = ("a position is where the token stands in its own sequence, as the "
                        "model saw it when the sequence was one long prompt")
            else:
                hint = ("which tokens does each sequence still need computed this step? a "
                        "prompt run has none in the cache yet; a decode has all but one")
            fail(learner.name, case, _show(seqs), got, expected, hint)
    return passed(learner, num_cases)


@exercise
def check_sample_indices(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("sample_indices", fn)
    for case, (seqs, _, batch) in enumerate(_random_batches(rng_for(seed), num_cases)):
        expected = batch.sample_indices.tolist()
        got = list(map(int, learner(list(seqs))))
        if got != expected:
            if len(got) != len(expected):
                hint = (f"one row per sequence ({len(expected)} here): a prompt's earlier tokens "
                        f"already have their next token (it is the prompt's next token)")
            elif sorted(got) == sorted(expected):
                hint = "the right rows in the wrong order: follow the flat batch's order"
            else:
                hint = ("a row number counts tokens of the flat batch: where does each "
                        "sequence's last token land once the prompts before it are packed?")
            fail(learner.name, case, _show(seqs), got, expected, hint)
    return passed(learner, num_cases)
