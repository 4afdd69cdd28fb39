"""Lesson 16, the capstone: the learner's engine next to ``LLM()``, compared after every step.

The learner's engine *is* the package's ``LLMEngine``, built while the learner's components are
plugged in (``exercises/workbench.py``: ``plugged_in``): their ``step()``, and every component of
the earlier lessons they wrote (``workbench.collect`` finds them by name, nothing is pasted). A
component they never wrote stays the package's, and the check says so by name.

Both engines get the same requests; after every step the plain data of each (``step_state``: what
``step()`` returned, every sequence's tokens, status and computed tokens, the block tables, the
free lists and ref counts, the queues) must be equal. At the first step where they differ, each of
the learner's components is run alone in the package's engine up to that step: the one that goes
wrong first is named (``find_culprit``).
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from minipaged.exercises import workbench
from minipaged.exercises.checking import CheckResult
from minipaged.sampling_params import SamplingParams


class Request(NamedTuple):
    prompt_token_ids: list[int]
    params: SamplingParams
    arrive_at_step: int = 0  # added before step arrive_at_step + 1


# The capstone's engine: the embedded SmolLM2-135M-Instruct on the CPU, in a pool small enough
# that the workload preempts (single sequences by recompute, groups by swap into the CPU pool),
# without prefix caching: the learner's block manager of lesson 03 (like vLLM v0.1's) takes no
# cached blocks, so with the cache on its tables would rightly differ from LLM()'s. Lesson 11 runs
# the learner's PrefixCachingAllocator in an engine of its own.
CAPSTONE_SETTINGS = dict(block_size=4, num_gpu_blocks=14, num_cpu_blocks=12, max_model_len=32,
                         watermark=0.0, enable_prefix_caching=False, enable_chunked_prefill=False,
                         device="cpu", dtype="float32", seed=0)


def default_workload(encode: Callable[[str], list[int]]) -> list[Request]:
    """Five requests, three of them with a common prompt prefix, with parallel
    sampling (``n`` = 2 and 3, greedy: the sequences stay alike and copy-on-write separates their
    tables) and seeded top-p sampling; two arrive later, when the pool is full."""
    greedy = lambda n, m: SamplingParams(n=n, temperature=0, max_tokens=m, ignore_eos=True)
    top_p = lambda m, s: SamplingParams(temperature=0.8, top_p=0.9, max_tokens=m, seed=s,
                                        ignore_eos=True)
    prefix = "A paged KV cache keeps"
    return [Request(encode(prefix + " each token's keys"), greedy(1, 8)),
            Request(encode("The scheduler runs"), greedy(2, 7)),
            Request(encode(prefix + " blocks of sixteen"), top_p(8, 1)),
            Request(encode("Copy on write means"), greedy(3, 5), arrive_at_step=2),
            Request(encode(prefix + " each token's values"), greedy(1, 6), arrive_at_step=3)]


# -- the plain data of an engine after one step ---------------------------------------------------
def step_state(engine, groups: dict, returned, num_snapshots: int) -> dict:
    """What must be equal in both engines after a step.

    Args:
        engine: an ``LLMEngine``.
        groups: request id -> its ``SequenceGroup``, for every request added so far.
        returned: what ``step()`` returned.
        num_snapshots: how many snapshots the engine's observers got in the step.
    """
    scheduler = engine.scheduler
    blocks = scheduler.block_snapshot()
    outputs = (sorted((o.request_id, o.finished, [list(c.token_ids) for c in o.outputs])
                      for o in returned) if isinstance(returned, list) else returned)
    return {
        "observers": num_snapshots,
        "returned": outputs,
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
    }


@dataclass
class Difference:
    """The first thing that differs after a step: ``kind`` is a key of ``step_state``."""

    kind: str
    subject: str
    yours: object
    expected: object


def first_difference(mine: dict, ref: dict) -> Difference | None:
    """The first difference between two ``step_state``s, in the order a step makes them."""
    if mine["observers"] != ref["observers"]:
        return Difference("observers", "the snapshots the observers got in this step",
                          mine["observers"], ref["observers"])
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
                          ("returned", "what step() returned (request id, finished, tokens)")):
        if mine[kind] != ref[kind]:
            return Difference(kind, subject, mine[kind], ref[kind])
    return None


# -- running an engine step by step ---------------------------------------------------------------
class Unfinished(RuntimeError):
    """Requests are still unfinished after the most steps a run may take."""


class Stepped(NamedTuple):
    step: int
    state: dict
    snapshot: object  # the observers' StepSnapshot (None if they got none)


def run_steps(engine, workload: list[Request], max_steps: int = 200,
              step: Callable | None = None) -> Iterator[Stepped]:
    """Add ``workload``'s requests as they arrive and step ``engine`` until it is done.

    ``step(engine)`` runs one step (default ``engine.step()``). Raises ``Unfinished`` when
    requests are still unfinished after ``max_steps``.
    """
    snapshots: list = []
    engine.add_observer(snapshots.append)
    groups: dict = {}
    for number in range(1, max_steps + 1):
        for i, request in enumerate(workload):
            if request.arrive_at_step == number - 1:
                rid = engine.add_request(str(i), None, request.params, arrival_time=float(i),
                                         prompt_token_ids=request.prompt_token_ids)
                groups[rid] = engine.scheduler.waiting[-1]
        if not engine.has_unfinished_requests() and all(r.arrive_at_step < number
                                                        for r in workload):
            return
        del snapshots[:]
        returned = step(engine) if step is not None else engine.step()
        yield Stepped(number, step_state(engine, groups, returned, len(snapshots)),
                      snapshots[-1] if snapshots else None)
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
            else:
                wrapped[name] = seen(name, obj)
        yield wrapped, ran
    finally:
        for cls, own in patched:
            if own is None:
                del cls.__init__
            else:
                cls.__init__ = own


def new_engine(settings: dict):
    """A fresh ``LLMEngine`` of the embedded model with ``settings`` (seeded weights, for
    ``hf_config`` settings of a random model)."""
    from minipaged.entrypoints.llm import LLM

    with torch.random.fork_rng():
        torch.manual_seed(0)
        return LLM(settings.get("model"), **{k: v for k, v in settings.items()
                                              if k != "model"}).llm_engine


def learner_run(objects: dict[str, object], settings: dict, workload: list[Request],
                max_steps: int, until: int | None = None) -> Iterator[tuple[Stepped, set[str]]]:
    """The package's engine with ``objects`` (component name -> object) plugged in: each step
    and the names of the components that have run so far. Stops after step ``until``."""
    with watched(objects) as (wrapped, ran), workbench.plugged_in(objects=wrapped, quiet=True):
        engine = new_engine(settings)
        try:
            for stepped in run_steps(engine, workload, max_steps):
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


# -- the check ------------------------------------------------------------------------------------
def _count(number: int, thing: str) -> str:
    plural = thing[:-1] + "ies" if thing.endswith("y") else thing + "s"
    return f"{number} {thing if number == 1 else plural}"


def _names(names) -> str:
    names = list(names)
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else "".join(names)


def check_capstone(names: list[str], on_step=None, workload: list[Request] | None = None,
                   settings: dict | None = None, max_steps: int = 100):
    """Your engine next to ``LLM()``: the same tokens and block tables after every step.

    Your engine is the package's ``LLMEngine`` with every component you wrote plugged in
    (``workbench.collect``); a component you have not written yet is named, and the package's
    runs in its place.

    Args:
        on_step: called as ``on_step(step, yours, llms)`` with both engines' ``StepSnapshot``
            after every step that matched (the lesson draws them).
        workload: the requests (default ``default_workload``).
        settings: engine settings over ``CAPSTONE_SETTINGS`` (tests: a tiny model).
        names: the components to collect.
    """
    found, missing = workbench.collect(names)
    settings = {**CAPSTONE_SETTINGS, **(settings or {})}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: steadier on a busy CPU, and as fast for short steps
    try:
        reference = new_engine(settings)
        if workload is None:
            workload = default_workload(reference.encode)
        expected = list(run_steps(reference, workload, max_steps))
        reference.shutdown()
        mismatch, ran = _compare(found, settings, workload, expected, max_steps, on_step)
    finally:
        torch.set_num_threads(threads)
    if mismatch is not None:
        result = _mismatch_message(mismatch, found, settings, workload, expected)
    else:
        result = _match_message(found, missing, ran, expected)
    print(result)
    return result


def _compare(found, settings, workload, expected, max_steps, on_step):
    """(the first (step, Difference) where the learner's engine differs, or None; the names of
    the learner's components that ran)."""
    ran: set[str] = set()
    number = 0
    try:
        for stepped, ran in learner_run(found, settings, workload, max_steps):
            number = stepped.step
            if number > len(expected):
                return (number, Difference("steps", "the number of steps", f"a step {number}",
                                           f"all done after step {len(expected)}")), ran
            theirs = expected[number - 1]
            difference = first_difference(stepped.state, theirs.state)
            if difference:
                return (number, difference), ran
            if on_step is not None:
                on_step(number, stepped.snapshot, theirs.snapshot)
    except Exception as crash:  # the learner's engine stopped
        return (number + 1, Difference("crash", "your engine stopped",
                                       f"{type(crash).__name__}: {crash}", "no error")), ran
    if number < len(expected):
        return (number, Difference("steps", "the number of steps",
                                   f"all done after step {number}",
                                   f"all done after step {len(expected)}")), ran
    return None, ran


def _mismatch_message(mismatch, found, settings, workload, expected) -> CheckResult:
    step, difference = mismatch
    text = (f"✗ capstone: step {step}: {difference.subject} differs\n"
            f"  yours:  {difference.yours!r}\n  LLM():  {difference.expected!r}")
    if len(found) > 1:
        culprit = find_culprit(found, settings, workload, [s.state for s in expected], step)
        if culprit is None:
            text += (f"\n  each of your components alone agrees with LLM() up to step {step}; "
                     f"together they do not: look at what {_names(found)} hand each other")
        else:
            name, at, alone = culprit
            lesson = workbench.component(name).lesson
            text += (f"\n  the first of your components to go wrong: {name} (lesson {lesson}): "
                     f"alone in the package's engine, at step {at}, {alone.subject} differs "
                     f"(yours {alone.yours!r}, LLM() {alone.expected!r})")
    elif found:
        name = next(iter(found))
        text += f"\n  your only component here is {name} (lesson " \
                f"{workbench.component(name).lesson})"
    return CheckResult(text, "failed")


def _match_message(found, missing, ran, expected) -> CheckResult:
    snapshots = [s.snapshot for s in expected]
    modes = [mode for snap in snapshots for _, mode in snap.preempted]
    copies = sum(len(d) for snap in snapshots for d in snap.blocks_to_copy.values())
    cached = snapshots[-1].stats.get("num_cached_prompt_tokens", 0) if snapshots else 0
    counts = (f"{_count(len(modes), 'preemption')} ({modes.count('recompute')} by recompute, "
              f"{modes.count('swap')} by swap), {_count(copies, 'copy-on-write copy')}"
              + (f", {cached} prompt tokens from the prefix cache" if cached else ""))
    same = f"the same tokens and block tables as LLM() at all {len(expected)} steps ({counts})"
    mine = [n for n in found if n in ran]
    idle = [n for n in found if n not in ran]
    missing_names = [m.split(" (")[0] for m in missing]
    if not found:
        return CheckResult(
            f"… capstone: not done yet: none of your components is saved (missing: "
            f"{_names(missing_names)}; each lesson's check saves yours when it passes), so this "
            f"was the package's engine against itself: {same}", "not done")
    text = f"✓ capstone: your engine gives {same}, with your {_names(mine) or 'nothing'}"
    if idle:
        were = "were" if len(idle) > 1 else "was"
        text += f"; your {_names(idle)} {were} plugged in but never ran"
    if missing:
        text += (f"; the package's {_names(missing_names)} because "
                 f"{'they are' if len(missing) > 1 else 'it is'} missing"
                 + "".join(f"\n  {m}" for m in missing if " (" in m))
        return CheckResult(text, "incomplete")
    return CheckResult(text, "passed")
