"""Lesson 09 exercises: one step's token budget under chunked prefill, and what it means for the
time to a prompt's first token.

    prefill_chunks(budget, num_decodes, tokens_left) -> list[int]
        the prompt tokens each prompt computes this step: the decodes take one token each of the
        budget first (never skipped, even past the budget); then the prompts, in arrival order,
        each take what they still need or what is left, whichever is smaller; one entry per
        prompt, 0 for a prompt that waits
    first_token_steps(budget, num_decodes, prompt_lens) -> list[int]
        the prompts arrive together next to ``num_decodes`` sequences that keep decoding; the
        step (1 = the first) in which each prompt computes its last token and samples its first
        one; from the step after, it decodes too (one token of the budget each step)

Expected answers: the real ``Scheduler`` (``max_num_batched_tokens=budget``, chunked prefill on,
a pool large enough for every request) on random traffic; a request of ``n`` sequences (parallel
sampling) computes its prompt once and then decodes ``n`` tokens a step.
"""
from __future__ import annotations

from minipaged.core.scheduler import Scheduler, SchedulerConfig
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
from minipaged.lab.dry_run import DryRun
from minipaged.sequence import SequenceStatus


def _dry_run(budget: int) -> DryRun:
    run = DryRun(block_size=4, num_gpu_blocks=1024)
    run.scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), run.block_manager)
    return run


def _queue_before_step(run: DryRun):
    """(number of decoding sequences, [(group, tokens it still has to prefill)]) in the order
    the scheduler serves them: the half-prefilled group first, then the waiting ones."""
    sched = run.scheduler
    running = sorted(sched.running, key=lambda g: g.arrival_time)
    decodes = sum(g.num_seqs(SequenceStatus.RUNNING) for g in running if not g.pending_chunks)
    left = [(g, sum(c.num_tokens for c in g.pending_chunks)) for g in running if g.pending_chunks]
    left += [(g, g.get_seqs()[0].get_len())
             for g in sorted(sched.waiting, key=lambda g: g.arrival_time)]
    return decodes, left


def _random_steps(rng, num_cases):
    """(budget, num_decodes, tokens_left, expected) for steps of random traffic."""
    cases = 0
    while cases < num_cases:
        budget = rng.choice([rng.randint(1, 4), rng.randint(5, 24)])  # small: decodes overspend
        run = _dry_run(budget)
        for _ in range(rng.randint(3, 25)):
            for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
                run.add_request([rng.randrange(1000) for _ in range(rng.randint(1, 40))],
                                n=rng.choice([1, 1, 1, 2, 3]))  # n > 1: one prompt, n decodes
            decodes, left = _queue_before_step(run)
            outs = run.scheduler.schedule()
            done = {id(g): 0 for g, _ in left}
            for chunk in outs.prefill_chunks:
                done[id(chunk.seq_group)] += chunk.num_tokens
            if left:
                yield budget, decodes, [n for _, n in left], [done[id(g)] for g, _ in left]
                cases += 1
                if cases == num_cases:
                    return
            run.sampled(outs, lambda seq: rng.randrange(1000))
            for group in outs.decode_seq_groups:  # a few decoding sequences stop
                for seq in group.get_seqs(SequenceStatus.RUNNING):
                    if rng.random() < 0.1:
                        run.finish(seq)


@exercise
def check_prefill_chunks(fn, num_cases: int = 300, seed: int | None = 0) -> CheckResult:
    learner = Learner("prefill_chunks", fn)
    for case, (budget, decodes, left, expected) in enumerate(_random_steps(rng_for(seed),
                                                                           num_cases)):
        got = list(map(int, learner(budget, decodes, list(left))))
        if got != expected:
            if len(got) != len(expected):
                hint = "one entry per prompt in tokens_left, 0 for a prompt that waits"
            elif sum(got) + decodes > budget and sum(got) > 0:
                hint = "the decodes are served first: what do they leave of the budget?"
            elif decodes >= budget:
                hint = "when the decodes use up the budget (or more), what is left for prompts?"
            else:
                hint = ("first come, first served: the oldest prompt takes what it can, the next "
                        "one only what the first left over")
            fail(learner.name, case, f"budget={budget}, num_decodes={decodes}, "
                 f"tokens_left={left}", got, expected, hint)
    return passed(learner, num_cases)


def first_token_steps_of_scheduler(budget: int, num_decodes: int,
                                   prompt_lens: list[int]) -> list[int]:
    """The package's answer: the real scheduler, step by step."""
    run = _dry_run(budget)
    for _ in range(num_decodes):  # sequences already decoding (their one-token prompts ran)
        run.add_request([7])
    run.step()
    groups = [run.add_request([5] * n) for n in prompt_lens]
    first = {}
    step = 0
    while len(first) < len(groups):
        step += 1
        outs = run.scheduler.schedule()
        for chunk in outs.prefill_chunks:
            if chunk.sample:  # (asked before the sampled token makes the sequence longer)
                first.setdefault(id(chunk.seq_group), step)
        run.sampled(outs)
        if step > 10_000:
            raise RuntimeError("the scheduler made no progress")
    return [first[id(g)] for g in groups]


@exercise
def check_first_token_steps(fn, num_cases: int = 150, seed: int | None = 0) -> CheckResult:
    learner = Learner("first_token_steps", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        num_prompts = rng.randint(1, 5)
        decodes = rng.randint(0, 6)
        budget = rng.randint(decodes + num_prompts + 1, decodes + num_prompts + 16)
        lens = [rng.randint(1, 40) for _ in range(num_prompts)]
        expected = first_token_steps_of_scheduler(budget, decodes, lens)
        got = list(map(int, learner(budget, decodes, list(lens))))
        if got != expected:
            if len(got) == len(expected) and got[0] != expected[0]:
                hint = ("the first prompt gets budget - num_decodes tokens a step: how many steps "
                        "until its last token has run?")
            else:
                hint = ("once a prompt samples its first token it decodes in every later step: "
                        "it takes one token of the budget the prompts after it had")
            fail(learner.name, case, f"budget={budget}, num_decodes={decodes}, "
                 f"prompt_lens={lens}", got, expected, hint)
    return passed(learner, num_cases)
