"""Lesson 16, the capstone's machinery: an engine's plain data after each step, compared.

``step_state`` is what must be equal in the learner's engine and ``LLM()``'s after a step (what
``step()`` returned, every sequence's tokens, status and computed tokens, the block tables, the
free lists and ref counts, the queues, the engine's counters, and every snapshot the observers
got, field by field); ``first_difference`` finds the first
thing that differs; ``run_steps`` adds a workload's requests as they arrive (and aborts those that
ask for it) and steps an engine to the end; ``learner_run`` does so with the learner's components
plugged in (``workbench.plugged_in``), seeing which of them ran; ``find_culprit`` runs each alone
to name the one that goes wrong first. ``capstone.py`` builds the check and its verdict on these;
lesson 16's check of ``LLMEngine.step`` uses them too.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from minipaged.exercises import workbench
from minipaged.sampling_params import SamplingParams


class Request(NamedTuple):
    prompt_token_ids: list[int]
    params: SamplingParams
    arrive_at_step: int = 0  # added before step arrive_at_step + 1
    abort_at_step: int | None = None  # aborted (abort_request) before step abort_at_step + 1


# -- the plain data of an engine after one step ---------------------------------------------------
def counters(stats) -> dict:
    """The engine's counters that both engines must agree on: all but the times, which differ
    from run to run; the model's time must only have grown once the model ran."""
    values = {k: v for k, v in stats.as_dict().items() if not k.startswith("time_")}
    model_ran = stats.num_prompt_tokens + stats.num_generation_tokens > 0
    values["time_model > 0"] = (stats.time_model > 0 if model_ran
                                else "(no model tokens counted yet)")
    return values


class Near(float):
    """A float equal to another within 1e-4 (relative past 1): logprobs that two ways of
    computing a log-softmax give."""

    def __eq__(self, other) -> bool:
        if not isinstance(other, (int, float)):
            return NotImplemented
        return abs(self - other) <= 1e-4 * max(1.0, abs(other))

    def __ne__(self, other) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = float.__hash__

    def __repr__(self) -> str:
        return f"{float(self):.4f}"


def _logprobs(logprobs) -> list | None:
    """A completion's logprobs (token id -> logprob, per token) with ``Near`` values."""
    if logprobs is None:
        return None
    return [{token: Near(value) for token, value in step.items()} for step in logprobs]


def _returned(returned):
    if not isinstance(returned, list):
        return returned
    return sorted(((o.request_id, o.finished,
                    [(list(c.token_ids), c.text, c.finish_reason, _logprobs(c.logprobs))
                     for c in o.outputs]) for o in returned), key=lambda r: r[0])


def observed(snapshot) -> dict:
    """An observer's ``StepSnapshot`` as plain data, all of it but the times (they differ from
    run to run): the step, what was scheduled, moved and preempted, the groups that ended, the
    blocks, the queues and the counters."""
    data = dataclasses.asdict(snapshot)
    data["stats"] = {k: v for k, v in data["stats"].items() if not k.startswith("time_")}
    for clock in ("times", "arrival_times"):  # the step's clock readings, the requests' arrivals
        data.pop(clock, None)
    return data


def step_state(engine, groups: dict, returned, snapshots: list) -> dict:
    """What must be equal in both engines after a step.

    Args:
        engine: an ``LLMEngine``.
        groups: request id -> its ``SequenceGroup``, for every request added so far.
        returned: what ``step()`` returned.
        snapshots: the ``StepSnapshot``s the engine's observers got in the step.
    """
    scheduler = engine.scheduler
    blocks = scheduler.block_snapshot()
    return {
        "observers": [observed(s) for s in snapshots],
        "returned": _returned(returned),
        "sequences": {seq.seq_id: {"request": rid, "status": seq.status.name,
                                   "token_ids": list(seq.get_token_ids()),
                                   "num_computed_tokens": seq.num_computed_tokens}
                      for rid, group in groups.items() for seq in group.get_seqs()},
        "block_tables": {s["seq_id"]: s["block_table"] for s in blocks["sequences"]},
        "ref_counts": {b["block_number"]: b["ref_count"] for b in blocks["gpu_blocks"]
                       if b["ref_count"]},
        "free_gpu_blocks": blocks["free_gpu_blocks"],
        "free_cpu_blocks": blocks["free_cpu_blocks"],
        "queues": {name: [g.request_id for g in getattr(scheduler, name)]
                   for name in ("waiting", "running", "swapped")},
        "unfinished_requests": sorted(engine._requests),
        "stats": counters(engine.stats),
    }


@dataclass
class Difference:
    """The first thing that differs after a step: ``kind`` is a key of ``step_state``."""

    kind: str
    subject: str
    yours: object
    expected: object
    field: str = ""  # for "observers": the snapshot's field that differs ("" for their number)


def _snapshot_difference(mine: list[dict], ref: list[dict]) -> Difference | None:
    """The first difference in what the observers got: how many snapshots, then each one's
    fields in order (a dict field by its first key that differs)."""
    if len(mine) != len(ref):
        return Difference("observers", "the number of snapshots the observers got in this step",
                          len(mine), len(ref))
    for yours, theirs in zip(mine, ref):
        for key, expected in theirs.items():
            got = yours.get(key)
            if got == expected:
                continue
            if isinstance(got, dict) and isinstance(expected, dict):
                sub = next(k for k in list(expected) + list(got)
                           if got.get(k) != expected.get(k))
                return Difference("observers", f"the observers' StepSnapshot: its {key}[{sub!r}]",
                                  got.get(sub), expected.get(sub), key)
            return Difference("observers", f"the observers' StepSnapshot: its {key}", got,
                              expected, key)
    return None


def first_difference(mine: dict, ref: dict) -> Difference | None:
    """The first difference between two ``step_state``s, in the order a step makes them; the
    observers' snapshots last (a snapshot of a wrong state shows the state's own difference)."""
    for seq_id, expected in ref["sequences"].items():
        yours = mine["sequences"].get(seq_id)
        if yours != expected:
            return Difference("sequences", f"sequence {seq_id} (request {expected['request']})",
                              yours, expected)
    for kind in ("block_tables", "ref_counts"):
        for key in sorted(set(mine[kind]) | set(ref[kind])):
            if mine[kind].get(key) != ref[kind].get(key):
                what = "the block table of sequence" if kind == "block_tables" else \
                    "the ref count of GPU block"
                return Difference(kind, f"{what} {key}", mine[kind].get(key),
                                  ref[kind].get(key))
    for kind, subject in (("free_gpu_blocks", "the GPU free list"),
                          ("free_cpu_blocks", "the CPU free list"),
                          ("queues", "the queues"),
                          ("unfinished_requests", "the requests the engine still holds"),
                          ("returned", "what step() returned (request id, finished, and per "
                                       "completion its tokens, text, finish reason and "
                                       "logprobs)")):
        if mine[kind] != ref[kind]:
            return Difference(kind, subject, mine[kind], ref[kind])
    mine_stats, ref_stats = mine.get("stats", {}), ref.get("stats", {})
    differ = [k for k in ref_stats if mine_stats.get(k) != ref_stats[k]]
    if differ:
        return Difference("stats", f"self.stats ({', '.join(differ)})",
                          {k: mine_stats.get(k) for k in differ},
                          {k: ref_stats[k] for k in differ})
    return _snapshot_difference(mine["observers"], ref["observers"])


# -- running an engine step by step ---------------------------------------------------------------
class Unfinished(RuntimeError):
    """Requests are still unfinished after the most steps a run may take."""


class Stepped(NamedTuple):
    step: int
    state: dict
    snapshot: object  # the observers' StepSnapshot (None if they got none)
    outputs: dict  # request id -> its latest RequestOutput (from step() or abort_request)


def run_steps(engine, workload: list[Request], max_steps: int = 200,
              step: Callable | None = None) -> Iterator[Stepped]:
    """Add ``workload``'s requests as they arrive, abort those that ask for it, and step
    ``engine`` until it is done.

    ``step(engine)`` runs one step (default ``engine.step()``). Raises ``Unfinished`` when
    requests are still unfinished after ``max_steps``.
    """
    snapshots: list = []
    observer = snapshots.append
    engine.add_observer(observer)
    try:
        yield from _steps(engine, workload, max_steps, step, snapshots)
    finally:
        engine.remove_observer(observer)  # (the caller's engine keeps no observer of ours)


def _steps(engine, workload, max_steps, step, snapshots) -> Iterator[Stepped]:
    groups: dict = {}
    outputs: dict = {}
    for number in range(1, max_steps + 1):
        for i, request in enumerate(workload):
            if request.arrive_at_step == number - 1:
                rid = engine.add_request(str(i), None, request.params, arrival_time=float(i),
                                         prompt_token_ids=request.prompt_token_ids)
                groups[rid] = engine.scheduler.waiting[-1]
        for i, request in enumerate(workload):
            if request.abort_at_step == number - 1:
                aborted = engine.abort_request(str(i))
                if aborted is not None:
                    outputs[aborted.request_id] = aborted
        if not engine.has_unfinished_requests() and all(r.arrive_at_step < number
                                                        for r in workload):
            return
        del snapshots[:]
        returned = step(engine) if step is not None else engine.step()
        for output in returned if isinstance(returned, list) else ():
            if hasattr(output, "request_id"):
                outputs[output.request_id] = output
        yield Stepped(number, step_state(engine, groups, returned, list(snapshots)),
                      snapshots[-1] if snapshots else None, dict(outputs))
    raise Unfinished(f"requests still unfinished after {max_steps} steps")


# -- the components that ran ----------------------------------------------------------------------
@contextlib.contextmanager
def watched(objects: dict[str, object]) -> Iterator[tuple[dict[str, object], set[str]]]:
    """(objects to plug in instead, the names of those that ran): a function is wrapped so that
    a call is seen; a class sees its instances made (its ``__init__``, for the block)."""
    ran: set[str] = set()
    wrapped: dict[str, object] = {}
    patched: list[tuple[type, object]] = []

    def seen(name, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            ran.add(name)
            return fn(*args, **kwargs)
        return call

    def seen_init(name, cls, own):
        def init(self, *args, **kwargs):
            ran.add(name)
            if own is not None:
                own(self, *args, **kwargs)
            else:
                super(cls, self).__init__(*args, **kwargs)
        return init

    try:
        for name, obj in objects.items():
            if isinstance(obj, type):
                own = obj.__dict__.get("__init__")
                patched.append((obj, own))
                obj.__init__ = seen_init(name, obj, own)
                wrapped[name] = obj
            elif callable(obj):
                wrapped[name] = seen(name, obj)
            else:  # source text (lesson 06's phase 3): ``in_the_kernel`` sees it run
                wrapped[name] = obj
        yield wrapped, ran
    finally:
        for cls, own in reversed(patched):  # (a class under two names: the first's is its own)
            if own is None:
                del cls.__init__
            else:
                cls.__init__ = own


PHASE3 = "softmax_phase_cuda"  # lesson 06's component: C++ source, run by ``in_the_kernel``
KERNEL_TOLERANCE = 1e-4  # float32: the kernel's sums run in another order than the reference's


class KernelDiffers(RuntimeError):
    """The learner's phase 3 gave a decode attention unlike the torch reference's."""


@contextlib.contextmanager
def in_the_kernel(code: str | None, ran: set[str]) -> Iterator[None]:
    """Inside the block, the engine's decode attention on the CPU is the V1 CUDA kernel with the
    learner's phase 3 ``code``, built for the CPU (``kernel_exercise.ExerciseKernel``); its
    first call adds ``PHASE3`` to ``ran``. Each call's output is compared with the torch
    reference: ``KernelDiffers`` past ``KERNEL_TOLERANCE``. Nothing changes when ``code`` is
    None."""
    if code is None:
        yield
        return
    from minipaged.kernels import ops
    from minipaged.lab import kernel_exercise

    from minipaged.kernels import reference

    kernel = kernel_exercise.ExerciseKernel(code)

    def attention(query, key_cache, value_cache, block_tables, context_lens, scale, *more):
        ran.add(PHASE3)
        out = kernel.paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                     scale, *more)
        # NOTE: tokens alone say little of a kernel (a softmax 10% off still picks the same
        # greedy tokens here): every call's output is held to the torch reference as well
        expected = reference.paged_attention(query, key_cache, value_cache, block_tables,
                                             context_lens, scale)
        error = float((out - expected).abs().max() / expected.abs().max().clamp(min=1e-30))
        if not error <= KERNEL_TOLERANCE:
            raise KernelDiffers(
                f"the decode attention of your phase 3's kernel differs from the torch "
                f"reference: relative error {error:.1e} (at most {KERNEL_TOLERANCE:.0e}), "
                f"context_lens={context_lens.tolist()}")
        return out

    before, ops.DECODE_STAND_IN = ops.DECODE_STAND_IN, attention
    try:
        yield
    finally:
        ops.DECODE_STAND_IN = before


def new_engine(settings: dict):
    """A fresh ``LLMEngine`` of the embedded model with ``settings`` (seeded weights, for
    ``hf_config`` settings of a random model)."""
    from minipaged.entrypoints.llm import LLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LLM(settings.get("model"), **{k: v for k, v in settings.items()
                                              if k != "model"}).llm_engine


def learner_run(objects: dict[str, object], settings: dict, workload: list[Request],
                max_steps: int, until: int | None = None,
                clock=None) -> Iterator[tuple[Stepped, set[str]]]:
    """The package's engine with ``objects`` (component name -> object) plugged in: each step
    and the names of the components that have run so far. Stops after step ``until``. A
    ``capstone_speed.ComponentClock`` times the steps and each component's own code."""
    with watched(objects) as (wrapped, ran), in_the_kernel(objects.get(PHASE3), ran):
        if clock is not None:
            from minipaged.exercises.capstone_speed import timed_learners

            wrapped = timed_learners(clock, wrapped)
        with workbench.plugged_in(objects=wrapped, quiet=True):
            yield from _learner_steps(settings, workload, max_steps, until, clock, ran)


def _learner_steps(settings, workload, max_steps, until, clock, ran):
    engine = new_engine(settings)
    if clock is not None:
        clock.watch_model(engine)
    try:
        for stepped in run_steps(engine, workload, max_steps,
                                 step=None if clock is None else clock.step):
            yield stepped, ran
            if until is not None and stepped.step >= until:
                return
    finally:
        engine.shutdown()


def find_culprit(objects: dict[str, object], settings: dict, workload: list[Request],
                 ref_states: list[dict], step: int) -> tuple[str, int, Difference] | None:
    """Run each component alone in the package's engine up to ``step``: (the name of the one
    that differs from ``LLM()`` first, its step, what differs), or None if each alone agrees."""
    first = None
    for name, obj in objects.items():
        try:
            for stepped, _ in learner_run({name: obj}, settings, workload, step, until=step):
                found = first_difference(stepped.state, ref_states[stepped.step - 1])
                if found:
                    if first is None or stepped.step < first[1]:
                        first = (name, stepped.step, found)
                    break
        except Exception as crash:  # alone, it stops the engine: that is its difference
            found = Difference("crash", "the engine stopped", f"{type(crash).__name__}: "
                               f"{crash}", "no error")
            if first is None:
                first = (name, step, found)
    return first
