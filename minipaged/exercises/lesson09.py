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

The build track's component (``workbench``): ``admit_waiting``, step 4 of ``schedule()``
(``Scheduler._admit_waiting``: new requests under the token budget and ``max_num_seqs``, first
come first served), written from the stub of the same name; its checker runs the scheduler with
it next to the package's on random traffic and compares every step.
"""
from __future__ import annotations

from minipaged.core.prefill_plan import plan_prefill
from minipaged.core.scheduler import Scheduler, SchedulerConfig
from minipaged.core.scheduler_outputs import StepPlan
from minipaged.exercises.checking import (CheckResult, Learner, exercise, fail, not_done, passed,
                                          rng_for)
from minipaged.exercises.lockstep import _Lockstep
from minipaged.exercises.lesson04 import _lockstep_steps, _scheduler_state, _step_record
from minipaged.exercises.workbench import Component, register
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


# -- the build track: admission under the token budget -------------------------------------------
def admit_waiting(self, step: StepPlan) -> None:
    """Step 4 of ``schedule()`` (a method of ``Scheduler``): admit waiting groups, oldest first
    (``arrival_time``), while they fit; stop at the first that does not (first come, first
    served). Nothing is admitted while a group is swapped out (``self.swapped``), in a step
    that preempted (``step.preempted``), or while a prompt waits for the budget
    (``step.stalled``): they came first.

    A group fits when: the budget has room for its first chunk (with
    ``self.config.enable_chunked_prefill`` one token is enough, the prompt is cut to what is
    left; without it the whole first chunk must fit: ``self._first_chunk_len(seq_group)``
    tokens),
    its sequences (``seq_group.get_max_num_running_seqs()``) keep ``self._num_running_seqs()``
    within ``self.config.max_num_seqs``, and ``self.block_manager.can_allocate(seq_group)``.

    Admitting: ``cached = self.block_manager.allocate(seq_group)``; its waiting sequences run;
    its prompt work is ``seq_group.pending_chunks = plan_prefill(seq_group, shared_len,
    identical, cached)`` (``_, shared_len, identical = self.block_manager.prompt_layout(
    seq_group)``, asked before allocating); it joins ``self.running``, and takes what the
    budget allows: ``step.budget = self._take_chunks(seq_group, step.budget, step.chunks)``.
    A group whose chunks did not all fit spends the budget: nobody after it starts.
    """
    not_done()  # <- your code here


_ADMISSION_HINTS = {
    "swapped": "nothing new is admitted while a group is swapped out, in a step that "
               "preempted, or while a prompt waits for the budget: they came first",
    "fcfs": "first come, first served: when the oldest waiting group does not fit, nobody "
            "behind it is admitted in this step",
    "max_num_seqs": "max_num_seqs bounds the sequences running at once, and a group brings "
                    "all of its sequences",
    "fits": "a group is admitted only when the budget has room for its first chunk (one token "
            "with chunked prefill, all of it without), the sequence limit allows, and the "
            "block manager can allocate it",
    "chunks": "an admitted group's prompt work is plan_prefill's chunks, taken as far as the "
              "budget allows (_take_chunks); a group left with chunks spends the budget",
    "spent": "a group whose chunks did not all fit spends the budget: request {request} was "
             "admitted with chunks still to compute, so nobody after it starts in this step, "
             "even with budget left (its chunks come first in the next steps: first come, "
             "first served)",
}


def _admission_hint(theirs, mine, got: dict, want: dict, before_waiting: list[str]) -> str:
    admitted = lambda record: [r for r in before_waiting if r not in record["waiting"]]
    got_in, want_in = admitted(got), admitted(want)
    if len(got_in) > len(want_in):
        if theirs.run.scheduler.swapped or want["preempted"]:
            return _ADMISSION_HINTS["swapped"]
        if mine.run.scheduler._num_running_seqs() > mine.run.scheduler.config.max_num_seqs:
            return _ADMISSION_HINTS["max_num_seqs"]
        stalled = [g.request_id for g in theirs.run.scheduler.running
                   if g.pending_chunks and g.request_id in want_in]
        if stalled and got_in[:len(want_in)] == want_in:
            return _ADMISSION_HINTS["spent"].format(request=stalled[0])
    if got_in != before_waiting[:len(got_in)]:
        return _ADMISSION_HINTS["fcfs"]
    if len(got_in) != len(want_in):
        return _ADMISSION_HINTS["fits"]
    return _ADMISSION_HINTS["chunks"]


def _stalled_group_steps(candidate_class, rng, case: int):
    """One case of the rule "a group whose chunks did not all fit spends the budget", as
    ``_lockstep_steps`` yields it: without chunked prefill, a group of 2 or 3 sequences is
    preempted by recompute after a few decodes (its sequences now differ: one chunk each), and
    short prompts arrive behind it; the budget holds one of its chunks and the short prompts,
    not two of its chunks."""
    block_size = rng.choice([8, 16])
    prompt_len = rng.randint(2, block_size - 3)  # no whole block shared: equal chunks
    decodes, n = rng.randint(1, 2), rng.choice([2, 3])
    chunk = prompt_len + decodes  # each sequence's tokens but its newest
    left = rng.randint(1, chunk - 1)  # budget left after one chunk: less than another chunk
    config = SchedulerConfig(max_num_batched_tokens=chunk + left, preemption_mode="recompute",
                             enable_chunked_prefill=False)
    about = (f"64 GPU / 0 CPU blocks of {block_size}, preemption recompute, "
             f"max_num_batched_tokens {chunk + left}, chunked prefill off; request 0 "
             f"({n} sequences, a {prompt_len}-token prompt) decodes {decodes} steps and is "
             f"preempted by recompute (each of its sequences is a {chunk}-token chunk now); "
             f"then short prompts arrive")
    theirs, mine = (_Lockstep(block_size, 64, 0, 0.0, config, scheduler_class=cls)
                    for cls in (Scheduler, candidate_class))
    shorts = [[rng.randrange(1000) for _ in range(rng.randint(1, left))]
              for _ in range(rng.randint(1, 2))]
    prompt = [rng.randrange(1000) for _ in range(prompt_len)]
    for lock in (theirs, mine):
        lock.arrive(prompt, n)
    for step in range(decodes + 4):
        if step == decodes + 1:
            for lock in (theirs, mine):
                sched = lock.run.scheduler
                group = next(g for g in sched.running if g.request_id == "0")
                sched.running.remove(group)
                sched._preempt(group, {})
                for short in shorts:
                    lock.arrive(short, 1)
        before = _scheduler_state(theirs)
        outs = [lock.run.scheduler.schedule() for lock in (theirs, mine)]
        yield case, f"{about}; step {step}, before it: {before}", before, theirs, mine, outs
        for lock, out in zip((theirs, mine), outs):
            lock.after_model(out)


def _admission_steps(learner_class, rng, num_cases: int):
    """Random traffic (``_lockstep_steps``) for four fifths of the cases, then the stall rule's
    own cases (random traffic almost never reaches it)."""
    num_random = num_cases - num_cases // 5
    yield from _lockstep_steps(learner_class, rng, num_random)
    for case in range(num_random, num_cases):
        yield from _stalled_group_steps(learner_class, rng, case)


def _check_admit_waiting(candidate, rng, num_cases: int) -> int:
    """The scheduler with the learner's step 4 next to the package's on random traffic (budgets
    small and large, chunked prefill on and off, parallel sampling, preemption), and on a
    group recomputed in chunks with prompts behind it; every step compared."""
    learner_class = type("SchedulerWithYourAdmission", (Scheduler,),
                         {"_admit_waiting": candidate})
    steps = _admission_steps(learner_class, rng, num_cases)
    for case, about, before, theirs, mine, (want_outs, got_outs) in steps:
        got, want = _step_record(mine, got_outs), _step_record(theirs, want_outs)
        if got != want:
            key = next(k for k in want if got[k] != want[k])
            fail("admit_waiting", case, about, {key: got[key]}, {key: want[key]},
                 _admission_hint(theirs, mine, got, want, before["waiting"]))
    return num_cases


register(Component(
    name="admit_waiting", lesson="09",
    # a method: plugged in, the Scheduler class itself uses it (every scheduler made after)
    slots=("minipaged.core.scheduler:Scheduler._admit_waiting",),
    check=_check_admit_waiting,
    solution="minipaged.exercises.answers.lesson09:admit_waiting",
    preamble="from minipaged.exercises.lesson09 import *",
))
