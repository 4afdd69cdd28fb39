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

The build track's component (``workbench``): ``Scheduler``, whose step 1 (``_schedule_running``),
preemption (``_preempt``) and step 3 (``_resume_swapped``) the learner writes from the stub
``MyScheduler``; its checker runs it next to the package's scheduler on random traffic in tiny
pools (both preemption modes) and compares every step.
"""
from __future__ import annotations

import inspect
from typing import NamedTuple

from minipaged.core.lookahead import drop_lookahead, fit_lookahead
from minipaged.core.scheduler import PreemptionMode, Scheduler, SchedulerConfig
from minipaged.core.scheduler_outputs import StepPlan
from minipaged.exercises.checking import (CheckResult, Learner, exercise, fail, not_done, passed,
                                          rng_for)
from minipaged.exercises.lockstep import (_arrivals, _broken_queue_rule, _Lockstep,
                                          _squeeze_limit, _to_finish)
from minipaged.exercises.workbench import Component, register
from minipaged.lab.dry_run import RandomTraffic
from minipaged.sequence import SequenceGroup, SequenceStatus


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
        table = bm.get_blocks(seq.seq_id)
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


# -- the build track: the scheduler's step -------------------------------------------------------
class MyScheduler(Scheduler):
    """The running and swapped parts of ``schedule()``; the package keeps the rest (prefill
    chunks, admitting new requests: lesson 09).

    ``schedule()`` calls your methods in order with ``step``, the ``StepPlan`` of this step:
    ``step.budget`` (tokens left), ``step.blocks_to_swap_in`` / ``blocks_to_swap_out`` /
    ``blocks_to_copy``, ``step.preempted`` (a list of ``(request_id, mode)``),
    ``step.decode_groups`` (the groups decoding this step, in the order served) and
    ``step.stalled`` (a prompt waits for the budget). What you have: the queues
    ``self.running``, ``self.swapped``, ``self.waiting`` (lists of ``SequenceGroup``),
    ``self.config`` (``max_num_seqs``, ``enable_chunked_prefill``), ``self.forced_mode`` (a
    ``PreemptionMode`` or None), ``self.block_manager`` (lesson 03) and
    ``self._append_slots(seq_group, step.blocks_to_copy)``.
    """

    def _schedule_running(self, step: StepPlan) -> None:
        """Step 1: serve the running groups, oldest first (``arrival_time``).

        A group still prefilling (``seq_group.pending_chunks``) stays running and decodes
        nothing. Every other group needs a slot for the newest token of each running sequence
        (``self.block_manager.can_append_slot(seq_group)``); when there is no room, the newest
        group not yet served is preempted, again until it fits; if none is left, the group
        itself is preempted. A served group gets its slots (``_append_slots``), decodes this
        step and takes one token of the budget per running sequence.
        (Speculative decoding, lesson 12: call ``fit_lookahead(seqs, step.budget)`` before
        asking for room, try ``drop_lookahead(seqs)`` before preempting, and count
        ``seq.num_lookahead_slots`` more tokens; without speculation they change nothing.)
        """
        not_done()  # <- your code here

    def _preempt(self, seq_group: SequenceGroup, blocks_to_swap_out: dict) -> tuple[str, str]:
        """Take the group's GPU blocks back, by recompute or by swap; returns
        ``(request_id, mode.value)``.

        The mode: ``self.forced_mode`` if set; otherwise a group of one sequence
        (``get_max_num_running_seqs()``) is recomputed and a larger one swapped; a swap needs
        room in the CPU pool (``block_manager.can_swap_out``), else it is a recompute.
        Recompute: free each running sequence's blocks, ``seq.reset_for_recompute()``, drop
        its ``pending_chunks``, and put it first in the waiting queue. Swap: the block
        manager's ``swap_out`` (its moves go into ``blocks_to_swap_out``), the sequences become
        ``SequenceStatus.SWAPPED``, the group joins the swapped queue. Either way, tell the
        listeners: ``self.block_manager.record_preemption(seq_group, mode.value)``.
        """
        not_done()  # <- your code here

    def _resume_swapped(self, step: StepPlan) -> None:
        """Step 3: bring swapped groups back, oldest first, but not in a step that preempted
        or while a prompt waits for the budget (``step.stalled``).

        Stop at the first group that does not fit: the pool (``block_manager.can_swap_in``),
        ``max_num_seqs`` sequences running at once (``self._num_running_seqs()``), and without
        chunked prefill the budget for its decodes. A group coming back is swapped in
        (``block_manager.swap_in``: its moves go into ``step.blocks_to_swap_in``), its
        sequences run again, and unless it is still prefilling it decodes this step, as in
        step 1.
        """
        not_done()  # <- your code here


def _scheduler_state(lock: _Lockstep) -> dict:
    """The queues and the free blocks. Waiting in its own order (a group preempted by
    recompute goes to the FRONT: where it stands is part of the rule); running and swapped by
    arrival (the scheduler sorts them before it serves them)."""
    sched, bm = lock.run.scheduler, lock.bm
    by_arrival = lambda queue: [g.request_id for g in sorted(queue, key=lambda g: g.arrival_time)]
    return {"waiting": [g.request_id for g in sched.waiting],
            "running": by_arrival(sched.running), "swapped": by_arrival(sched.swapped),
            "free GPU blocks": bm.get_num_free_gpu_blocks(),
            "free CPU blocks": bm.get_num_free_cpu_blocks()}


def _step_record(lock: _Lockstep, outs) -> dict:
    """A step as the checkers of lessons 04 and 09 compare it, in the order they look."""
    return {"preempted": outs.preempted, "blocks_to_swap_out": outs.blocks_to_swap_out,
            "blocks_to_swap_in": outs.blocks_to_swap_in,
            "scheduled": [(g.request_id, "prompt" if p else "decode")
                          for g, p in zip(outs.scheduled_seq_groups, outs.prompt_run)],
            "prefill chunks": [(c.seq_group.request_id, c.start, c.end)
                               for c in outs.prefill_chunks],
            "blocks_to_copy": outs.blocks_to_copy,
            "num_batched_tokens": outs.num_batched_tokens, **_scheduler_state(lock)}


def _random_configs(rng, case: int = 0):
    """Tiny pools (so that preemption happens), either preemption mode, budgets and sequence
    limits small and large, chunked prefill on and off."""
    block_size = rng.choice([1, 2, 4])
    num_cpu = rng.choice([0, 6, 40])
    config = SchedulerConfig(
        max_num_seqs=rng.choice([256, 256, 4]),
        max_num_batched_tokens=rng.choice([4096, 4096, 5, 12]),
        preemption_mode="recompute" if num_cpu == 0 else rng.choice([None, "swap", "recompute"]),
        enable_chunked_prefill=rng.random() < 0.8)
    return block_size, rng.randint(6, 14), num_cpu, rng.choice([0.0, 0.0, 0.1]), config


def _lockstep_steps(candidate_class, rng, num_cases: int, configs=_random_configs,
                    arrivals=_arrivals, record_calls=None, squeeze: bool = False):
    """(case, description, the queues before the step, the package's run, the learner's run,
    their outputs) for every step of random traffic, the two schedulers side by side.
    ``configs(rng, case)`` draws each case's pool and scheduler settings, ``arrivals(rng,
    block_size)`` each step's new requests; ``record_calls(lock)``, if given, returns a log
    that each run keeps as ``lock.calls``; with ``squeeze``, one case in three lowers the
    sequence limit once a group is swapped out (``_squeeze_limit``)."""
    for case in range(num_cases):
        block_size, num_gpu, num_cpu, watermark, config = configs(rng, case)
        about = (f"{num_gpu} GPU / {num_cpu} CPU blocks of {block_size}, watermark {watermark}, "
                 f"preemption {config.preemption_mode or 'by group size'}, max_num_seqs "
                 f"{config.max_num_seqs}, max_num_batched_tokens "
                 f"{config.max_num_batched_tokens}, chunked prefill "
                 f"{'on' if config.enable_chunked_prefill else 'off'}")
        theirs, mine = (_Lockstep(block_size, num_gpu, num_cpu, watermark, config,
                                  scheduler_class=cls) for cls in (Scheduler, candidate_class))
        if record_calls is not None:
            for lock in (theirs, mine):
                lock.calls = record_calls(lock)
        squeezes = squeeze and case % 3 == 1
        for step in range(rng.randint(4, 24)):
            for prompt, n in arrivals(rng, block_size):
                for lock in (theirs, mine):
                    lock.arrive(prompt, n)
            before = _scheduler_state(theirs)
            squeezed = _squeeze_limit(theirs, config) if squeezes else ""  # (config: shared)
            outs = [lock.run.scheduler.schedule() for lock in (theirs, mine)]
            yield (case, f"{about}; step {step}, {squeezed}before it: {before}", before, theirs,
                   mine, outs)
            for lock, out in zip((theirs, mine), outs):
                lock.after_model(out)
            for seq_id in _to_finish(rng, theirs, block_size):
                for lock in (theirs, mine):
                    lock.run.finish(lock.run.seq(seq_id))


_SCHEDULER_HINTS = {
    "blocks_to_swap_in": "swapped groups come back, oldest first, before anything new is "
                         "admitted, as soon as the pool has room for them and the sequence "
                         "limit allows; but not in a step that preempted",
    "scheduled": "every running group that is not prefilling decodes this step, in the order "
                 "served (step.decode_groups); a group coming back from swap decodes too",
    "prefill chunks": "a group still prefilling stays running (the package takes its chunks "
                      "after your step 1); and a step that preempted or resumed differently "
                      "leaves a different budget and pool for the prompts",
    "blocks_to_copy": "each decoding sequence needs the slot for its newest token before the "
                      "model runs, whether it was running or has just come back from swap",
    "num_batched_tokens": "each decoding sequence takes one token of step.budget",
    "waiting": "a group preempted by recompute waits again, first in line, its blocks freed "
               "and its tokens to compute again",
    "running": "a group that was served or came back runs on; a preempted one does not",
    "swapped": "a group preempted by swap waits in the swapped queue until it fits again",
    "free GPU blocks": "what was freed, swapped or appended differs: compare the queues",
    "free CPU blocks": "a swap moves a group's blocks to the CPU pool, and back",
}


# the scheduler's methods the learner writes, logged call by call (nested calls too: a
# _preempt is logged before the _schedule_running that called it)
_SCHEDULER_METHODS = ("_schedule_running", "_preempt", "_resume_swapped")


def _plan_state(step: StepPlan) -> dict:
    return {"budget": step.budget, "preempted": list(step.preempted),
            "decode groups": [g.request_id for g in step.decode_groups],
            "blocks_to_swap_in": dict(step.blocks_to_swap_in),
            "blocks_to_swap_out": dict(step.blocks_to_swap_out),
            "blocks_to_copy": {k: list(v) for k, v in step.blocks_to_copy.items()}
            if isinstance(step.blocks_to_copy, dict) else list(step.blocks_to_copy)}


def _record_scheduler_calls(lock: _Lockstep) -> list[tuple]:
    """Log each call of the scheduler's own methods: (method, call in words, result, state
    after). Returns the log (a list the lockstep run fills)."""
    calls: list[tuple] = []
    sched = lock.run.scheduler

    def recorded(method: str, fn):
        signature = inspect.signature(fn)

        def call(*args, **kwargs):
            result = fn(*args, **kwargs)
            # by name: a learner may pass an argument by keyword (blocks_to_swap_out=...)
            given = signature.bind(*args, **kwargs)
            given.apply_defaults()
            bound = list(given.arguments.values())
            if method == "_preempt":
                words = f"_preempt(request {bound[0].request_id})"
                extra = {"blocks_to_swap_out": dict(bound[1])}
            else:
                words, extra = f"{method}(step)", _plan_state(bound[0])
            calls.append((method, words, result, {**_scheduler_state(lock), **extra}))
            return result
        return call

    for method in _SCHEDULER_METHODS:
        setattr(sched, method, recorded(method, getattr(sched, method)))
    return calls


def _first_wrong_scheduler_call(theirs: list[tuple], mine: list[tuple]):
    """(method, call in words, what differs, the package's result) of the learner's first call
    whose record differs from the package's; None when all agree."""
    for want, got in zip(theirs, mine):
        if got[1] != want[1]:  # another call: the caller decided differently
            caller = "_schedule_running" if "_preempt" in (got[0], want[0]) else got[0]
            return caller, got[1], "call", want[2]
        if got[2] != want[2]:
            return got[0], got[1], "result", want[2]
        if got[3] != want[3]:
            return got[0], got[1], "state", want[2]
    if len(theirs) != len(mine):
        extra = mine[len(theirs)] if len(mine) > len(theirs) else theirs[len(mine)]
        caller = "_schedule_running" if extra[0] == "_preempt" else extra[0]
        return caller, extra[1], "call", None
    return None


_STATUS_HINT = "a group coming back from swap runs again: its sequences become RUNNING"
_PREEMPT_HINTS = {
    "first in line": "a group preempted by recompute goes FIRST in the waiting queue "
                     "(waiting.insert(0, ...)): it arrived before every group waiting there",
    "recompute": "_preempt by recompute takes ALL the group's GPU blocks back: free each "
                 "running sequence's blocks (block_manager.free), reset_for_recompute(), drop "
                 "its pending_chunks, and put the group first in the waiting queue",
    "swap": "_preempt by swap: block_manager.swap_out's moves go into blocks_to_swap_out, the "
            "sequences become SequenceStatus.SWAPPED and the group joins the swapped queue",
}


def _preemption_hint(got: list, expected: list) -> str:
    if len(got) < len(expected):
        return ("when a group's next tokens do not fit (can_append_slot), memory is taken "
                "from the newest group still waiting to be served, again until it fits; "
                "with none left, the group itself is preempted")
    if [r for r, _ in got] == [r for r, _ in expected]:
        return ("the right groups, the wrong mode: a forced mode wins; otherwise one sequence "
                "is recomputed and a group of several swapped, if the CPU pool has room")
    if len(got) > len(expected):
        return "preempt only while the group's slots do not fit, and only as many as needed"
    return ("the victim is the newest group (latest arrival) not yet served, not the group "
            "that needs the room")


def _check_scheduler(candidate, rng, num_cases: int) -> int:
    """The learner's scheduler next to the package's on random traffic (parallel sampling,
    tiny pools, both preemption modes), every step compared."""
    steps = _lockstep_steps(candidate, rng, num_cases, record_calls=_record_scheduler_calls,
                            squeeze=True)
    for case, about, _, theirs, mine, (want_outs, got_outs) in steps:
        got, want = _step_record(mine, got_outs), _step_record(theirs, want_outs)
        broken = _broken_queue_rule(mine.run.scheduler)
        if got == want and broken:  # the queues agree, the sequences' statuses do not
            fail("Scheduler", case, about, broken, "each sequence in its queue's status",
                 _PREEMPT_HINTS["swap"] if "swapped queue" in broken else _STATUS_HINT)
        if got != want:
            key = next(k for k in want if got[k] != want[k])
            wrong = _first_wrong_scheduler_call(theirs.calls, mine.calls)
            if key in ("preempted", "blocks_to_swap_out"):
                hint = _preemption_hint(got["preempted"], want["preempted"])
            else:
                hint = _SCHEDULER_HINTS[key]
            if wrong is not None:
                method, words, what, expected = wrong
                about += f"; first wrong call: {words}"
                if method == "_preempt" and what == "state":  # the right mode, done wrong
                    hint = _PREEMPT_HINTS["first in line" if key == "waiting" and sorted(
                        got[key]) == sorted(want[key]) else expected[1]]
                elif method == "_preempt":
                    hint = _preemption_hint(got["preempted"], want["preempted"])
                elif method == "_resume_swapped":
                    hint = _SCHEDULER_HINTS["blocks_to_swap_in"]
            fail("Scheduler", case, about, {key: got[key]}, {key: want[key]}, hint)
        theirs.calls.clear()
        mine.calls.clear()
    return num_cases


register(Component(
    name="Scheduler", lesson="04",
    # where the engine's cache setup and the model-free DryRun build their scheduler
    slots=("minipaged.engine.cache_setup:Scheduler", "minipaged.lab.dry_run:Scheduler"),
    check=_check_scheduler,
    solution="minipaged.exercises.answers.lesson04:MyScheduler",
    preamble="from minipaged.exercises.lesson04 import *",
))
