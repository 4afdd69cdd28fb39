"""Lesson 04 exercises: one scheduler step, on plain numbers.

A group here is one sequence. ``GroupState(request_id, blocks_held, needs_block)``: the blocks it
holds, and whether its newest token needs one more block. ``WaitingGroup(request_id,
prompt_blocks)``: a new request and the blocks its prompt needs. Lists are oldest first.

    schedule_running(running, num_free) -> (kept, preempted)
        step 1 of ``Scheduler.schedule``: serve the running groups oldest first; when a group's
        block does not fit, preempt (swap out) the NEWEST running group, freeing its blocks, and
        try again; if it is the only one left, it is preempted itself
    resume_and_admit(swapped, waiting, num_free) -> (swapped_in, admitted)
        steps 2 and 3, called only when step 1 preempted nobody: bring swapped groups back
        oldest first while the blocks it holds, plus one if ``needs_block`` (its next token
        opens a new block), are free. Admit waiting groups oldest
        first while their prompt fits, but only if no group is left swapped out.

Expected answers: the decisions of the real ``Scheduler`` (preemption by swap, no watermark) on
random traffic.
"""
from __future__ import annotations

from typing import NamedTuple

from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
from minipaged.lab.dry_run import RandomTraffic


class GroupState(NamedTuple):
    request_id: str
    blocks_held: int
    needs_block: bool


class WaitingGroup(NamedTuple):
    request_id: str
    prompt_blocks: int


def _state(traffic: RandomTraffic):
    bm, sched = traffic.bm, traffic.scheduler

    def group_state(group):
        [seq] = group.get_seqs()
        table = bm.block_tables[seq.seq_id]
        return GroupState(group.request_id, len(table),
                          len(table) < len(seq.logical_token_blocks))

    by_arrival = lambda gs: sorted(gs, key=lambda g: g.arrival_time)
    running = [group_state(g) for g in by_arrival(sched.running)]
    swapped = [group_state(g) for g in by_arrival(sched.swapped)]
    waiting = [WaitingGroup(g.request_id, len(g.get_seqs()[0].logical_token_blocks))
               for g in by_arrival(sched.waiting)]
    return running, swapped, waiting, bm.get_num_free_gpu_blocks()


def _random_steps(rng, num_cases):
    """(state before schedule(), the scheduler's outputs) for random steps of random traffic."""
    cases = 0
    while cases < num_cases:
        traffic = RandomTraffic(rng, rng.choice([1, 2, 4]), rng.randint(4, 14))
        for _ in range(rng.randint(5, 25)):
            traffic.arrive(rng.choice([0, 0, 1, 2]))
            state = _state(traffic)
            outs = traffic.scheduler.schedule()
            yield state, outs
            cases += 1
            traffic.after_model(outs)


@exercise
def check_schedule_running(fn, num_cases: int = 300, seed: int | None = 0) -> CheckResult:
    learner = Learner("schedule_running", fn)
    for case, ((running, _, _, num_free), outs) in enumerate(_random_steps(rng_for(seed),
                                                                              num_cases)):
        preempted = [rid for rid, _ in outs.preempted]
        expected = ([g.request_id for g in running if g.request_id not in preempted], preempted)
        got = learner(list(running), num_free)
        got = (list(got[0]), list(got[1]))
        if got != expected:
            if sorted(got[1]) == sorted(expected[1]):
                hint = "the right groups, in the wrong order: list them in the order decided"
            elif any(rid != running[-1 - k].request_id for k, rid in enumerate(got[1])):
                hint = ("the victim is always the newest group still running (the end of the "
                        "list), not the one that needs the block")
            else:
                hint = ("count the free blocks as you go: who takes one, and what does a "
                        "preempted victim give back?")
            fail(learner.name, case, f"running={running}, num_free={num_free}", got, expected,
                 hint)
    return passed(learner, num_cases)


@exercise
def check_resume_and_admit(fn, num_cases: int = 300, seed: int | None = 0) -> CheckResult:
    learner = Learner("resume_and_admit", fn)
    checked = 0
    for (running, swapped, waiting, num_free), outs in _random_steps(rng_for(seed), 3 * num_cases):
        if outs.preempted or checked == num_cases:
            continue
        num_free -= sum(g.needs_block for g in running)  # what step 1 took
        was_swapped = {g.request_id for g in swapped}
        scheduled = [g.request_id for g in outs.scheduled_seq_groups]
        expected = ([r for r, p in zip(scheduled, outs.prompt_run) if not p and r in was_swapped],
                    [r for r, p in zip(scheduled, outs.prompt_run) if p])
        got = learner(list(swapped), list(waiting), num_free)
        got = (list(got[0]), list(got[1]))
        if got != expected:
            if got[1] and len(expected[0]) < len(swapped):
                hint = ("while any group is still swapped out, nothing new is admitted: the "
                        "swapped groups came first and must get their memory back first")
            elif got[0] != expected[0]:
                hint = ("a swapped group comes back with everything it held, and its newest "
                        "token may need one more; first come, first served: nobody overtakes")
            else:
                hint = ("first come, first served for the waiting queue too; and the blocks "
                        "the swapped-in groups took are no longer free")
            fail(learner.name, checked, f"swapped={swapped}, waiting={waiting}, "
                 f"num_free={num_free}", got, expected, hint)
        checked += 1
    return passed(learner, checked)
