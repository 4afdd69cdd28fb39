"""Lesson 16, the capstone: the learner's engine next to ``LLM()``, compared after every step.

The learner's engine *is* the package's ``LLMEngine``, built while the learner's components are
plugged in (``exercises/workbench.py``: ``plugged_in``): their ``step()``, and every component of
the earlier lessons they wrote (``workbench.collect`` finds them by name, nothing is pasted).

The capstone is one or more ``Run``s: engine settings, requests, and the learner's components
that run in them. In each, both engines get the same requests; after every step the plain data
of each (``step_state``: what ``step()`` returned, every sequence's tokens, status and computed
tokens, the block tables, the free lists and ref counts, the queues, the engine's counters, and
every ``StepSnapshot`` the observers got: its step, groups ended, queues, blocks and counters) must
be equal. At the first step where they differ, each of the learner's components is run alone in
the package's engine up to that step: the one that goes wrong first is named (``find_culprit``).

The verdict is a tick only when every component of every run is the learner's, loaded from its
saved file, ran, and agreed at every step; otherwise it says plainly which are missing, which do
not load (and why), and where the first difference is.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minipaged.exercises import capstone_speed as speed
from minipaged.exercises.capstone_coverage import in_words as _names
from minipaged.exercises.capstone_coverage import what_happened as _what_happened
from minipaged.exercises import cost, workbench
from minipaged.exercises.capstone_steps import (  # noqa: F401 (the capstone's names, in one place)
    Difference, Request, Stepped, Unfinished, counters, find_culprit, first_difference,
    learner_run, new_engine, run_steps, step_state, watched)
from minipaged.exercises.checking import CheckResult
from minipaged.sampling_params import SamplingParams


# The capstone's engine: the embedded SmolLM2-135M-Instruct on the CPU, in a pool small enough
# that the workload preempts (single sequences by recompute, groups by swap into the CPU pool),
# with chunked prefill under a small token budget (long prompts run in chunks, one behind the
# other), without prefix caching: the learner's block manager of lesson 03 (like vLLM v0.1's)
# takes no cached blocks. The prefix cache has a run of its own (run 2 in ``capstone_runs.py``),
# with the package's block manager around the learner's allocator.
CAPSTONE_SETTINGS = dict(block_size=4, num_gpu_blocks=12, num_cpu_blocks=12, max_model_len=32,
                         max_num_seqs=6, watermark=0.0, enable_prefix_caching=False, enable_chunked_prefill=True,
                         max_num_batched_tokens=16, device="cpu", dtype="float32", seed=0,
                         cpu_threads=1)  # (both engines alike, whatever else the CPU runs)


def default_workload(encode: Callable[[str], list[int]]) -> list[Request]:
    """Seven requests that leave the scheduler no easy step, and the sampler every rule.

    Five arrive together: a single greedy sequence with presence and frequency penalties and
    its top-2 logprobs, parallel sampling (``n=2``, seeded, top-k and top-p: copy-on-write
    separates their tables), beam search (``n=2``), a request aborted while it runs, and a
    greedy request that ends at a stop string, which waits: seven sequences pass the sequence
    limit (``max_num_seqs=6``). When the pool runs out, the oldest needs a block while younger
    groups run: which one gives its blocks back matters (one by recompute, a group by swap).
    Two long prompts arrive later and run in chunks under the token budget, the second waiting
    behind the first.
    """
    greedy = lambda n, m, **more: SamplingParams(n=n, temperature=0, max_tokens=m,
                                                 ignore_eos=True, **more)
    beams = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=8,
                           ignore_eos=True)
    sampled = SamplingParams(n=2, temperature=0.8, top_k=40, top_p=0.9, seed=7, max_tokens=10,
                             ignore_eos=True)
    return [
        Request(encode("A paged KV cache keeps"),
                greedy(1, 14, presence_penalty=0.5, frequency_penalty=0.5, logprobs=2)),
        Request(encode("The scheduler runs"), sampled),
        Request(encode("Beam search keeps"), beams),
        Request(encode("The quick brown fox"), greedy(1, 10), abort_at_step=2),
        Request(encode("Copy on write means"), greedy(1, 12, stop=[" version"])),
        Request(encode("Once upon a time, in a small village at the edge of a forest, there "
                       "lived"), greedy(1, 4), arrive_at_step=2),
        Request(encode("Write a short poem about memory blocks and pages that move"),
                greedy(1, 4), arrive_at_step=2),
    ]


# -- the check ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Run:
    """One run of the capstone: the learner's engine next to ``LLM()`` on the same requests.

    Args:
        title: what the run is for, as the verdict names it.
        components: the learner's components this run plugs in (those written and loaded).
        settings: engine settings over ``CAPSTONE_SETTINGS``.
        workload: ``workload(encode)`` -> the requests (default ``default_workload``).
        package: component -> why the package's own runs in its place in this run.
        note: what else the run shows, for the verdict.
    """

    title: str
    components: tuple[str, ...]
    settings: dict = field(default_factory=dict)
    workload: Callable[[Callable[[str], list[int]]], list[Request]] | None = None
    package: dict = field(default_factory=dict)
    note: str = ""  # what the run does that its events do not show (the verdict says it)


@dataclass
class RunResult:
    run: Run
    plugged: dict  # name -> the learner's object plugged in
    expected: list  # LLM()'s Stepped, every step
    mismatch: tuple | None  # (step, Difference) where the learner's engine first differs
    ran: set  # the names of the plugged-in components that ran
    yours: dict  # request id -> the learner's engine's last RequestOutput
    workload: list
    settings: dict = field(default_factory=dict)  # the engine settings of the run
    timing: speed.Speed | None = None  # both engines' time on the run's workload


def _lesson(name: str) -> str:
    try:
        return f"lesson {workbench.component(name).lesson}"
    except KeyError:
        return "its lesson"


def collect(names) -> tuple[dict, list[str], dict[str, str]]:
    """(the learner's loaded components, the names with nothing saved, name -> why its saved
    file does not load)."""
    found, missing = workbench.collect(list(names))
    absent = [m for m in missing if " (" not in m]
    broken = {m.split(" (", 1)[0]: m.split(" (", 1)[1].rstrip(")") for m in missing if " (" in m}
    return found, absent, broken


def check_capstone(names: list[str], on_step=None, workload: list[Request] | None = None,
                   settings: dict | None = None, max_steps: int = 100,
                   runs: list[Run] | None = None, notes: tuple[str, ...] = ()) -> CheckResult:
    """Your engine next to ``LLM()``: the same tokens, logprobs, block tables, free lists,
    queues, counters and observer snapshots after every step of every run.

    Your engine is the package's ``LLMEngine`` with the components you wrote plugged in
    (``workbench.collect``). A component you have not written yet, or whose saved file does not
    load, is named, and the package's runs in its place: no tick then.

    Args:
        names: the components the verdict counts (the capstone's, in lesson order).
        on_step: called as ``on_step(step, yours, llms)`` with both engines' ``StepSnapshot``
            after every step of the first run that matched (the lesson draws them).
        workload: the requests of a single run (default ``default_workload``), when ``runs``
            is not given.
        settings: engine settings over ``CAPSTONE_SETTINGS`` for that single run (tests: a tiny
            model).
        max_steps: the most steps a run may take.
        runs: the runs (default: one run of ``names`` with ``workload`` and ``settings``).
        notes: lines printed under the runs (what the capstone leaves out, and why).
    """
    if runs is None:
        fixed = workload
        runs = [Run("the capstone's run", tuple(names), dict(settings or {}),
                    None if fixed is None else (lambda encode: fixed))]
    found, missing, broken = collect(names)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: steadier on a busy CPU, and as fast for short steps
    results: list[RunResult] = []
    try:
        for number, run in enumerate(runs):
            plugged = {n: found[n] for n in run.components if n in found and n not in run.package}
            if number and not plugged:
                continue  # nothing of yours in it: the package against itself says nothing new
            results.append(_one_run(run, plugged, max_steps, on_step if number == 0 else None))
            if results[-1].mismatch is not None:
                break  # the first difference is what to look at
        # (inside: the verdict may run engines too, to find the component that went wrong)
        result = _verdict(list(names), found, missing, broken, results, notes)
    finally:
        torch.set_num_threads(threads)
    print(result)
    return result


def _one_run(run: Run, plugged: dict, max_steps: int, on_step) -> RunResult:
    """Both engines on the run's workload, each timed (``capstone_speed``): LLM()'s with the
    package's own components wrapped where the learner's are plugged in."""
    settings = {**CAPSTONE_SETTINGS, **run.settings}
    package_clock, clock = speed.ComponentClock(), speed.ComponentClock()
    with workbench.plugged_in(objects=speed.timed_package(package_clock, plugged), quiet=True):
        reference = new_engine(settings)
        package_clock.watch_model(reference)
        workload = (run.workload or default_workload)(reference.encode)
        expected = list(run_steps(reference, workload, max_steps, step=package_clock.step))
        reference.shutdown()
    mismatch, ran, yours = _compare(plugged, settings, workload, expected, max_steps, on_step,
                                    clock)
    tokens = [s.state["stats"]["num_prompt_tokens"] + s.state["stats"]["num_generation_tokens"]
              for s in expected[:1] + expected[-1:]]
    timing = speed.Speed(tokens[-1] - tokens[0] if tokens else 0, clock.steps,
                         package_clock.steps, dict(clock.own), dict(package_clock.own))
    return RunResult(run, plugged, expected, mismatch, ran, yours, workload, settings, timing)


def _compare(found, settings, workload, expected, max_steps, on_step, clock=None):
    """(the first (step, Difference) where the learner's engine differs, or None; the names of
    the learner's components that ran; the learner's engine's outputs by request id)."""
    ran: set[str] = set()
    outputs: dict = {}
    number = 0
    try:
        for stepped, ran in learner_run(found, settings, workload, max_steps, clock=clock):
            number, outputs = stepped.step, stepped.outputs
            if number > len(expected):
                return (number, Difference("steps", "the number of steps", f"a step {number}",
                                           f"all done after step {len(expected)}")), ran, outputs
            theirs = expected[number - 1]
            difference = first_difference(stepped.state, theirs.state)
            if difference:
                return (number, difference), ran, outputs
            if on_step is not None:
                on_step(number, stepped.snapshot, theirs.snapshot)
    except Exception as crash:  # the learner's engine stopped
        return (number + 1, Difference("crash", "your engine stopped",
                                       f"{type(crash).__name__}: {crash}", "no error")), ran, \
            outputs
    if number < len(expected):
        return (number, Difference("steps", "the number of steps",
                                   f"all done after step {number}",
                                   f"all done after step {len(expected)}")), ran, outputs
    return None, ran, outputs


# -- the verdict ----------------------------------------------------------------------------------
def _completions(result: RunResult, only_theirs: bool = False) -> str:
    """The learner's engine's text next to LLM()'s, completion by completion."""
    theirs = result.expected[-1].outputs if result.expected else {}
    lines = []
    for rid in sorted(theirs, key=int):
        for c in theirs[rid].outputs:
            mine = result.yours.get(rid)
            yours = (next((m for m in mine.outputs if m.index == c.index), None)
                     if mine is not None and mine.finished else None)
            label = f"    request {rid}" + (f" #{c.index}" if len(theirs[rid].outputs) > 1
                                             else "") + f" ({c.finish_reason}): "
            if only_theirs:
                lines.append(f"{label}{c.text!r}")
                continue
            if yours is not None and (yours.text, yours.finish_reason) == (c.text,
                                                                          c.finish_reason):
                lines.append(f"{label}{c.text!r}  (the same in both)")
            else:
                shown = ("(not finished when your run stopped)" if yours is None
                         else f"{yours.text!r} ({yours.finish_reason})")
                lines.append(f"{label}yours {shown}\n{' ' * len(label)}LLM() {c.text!r}")
    return "\n".join(lines)


def _verdict(names, found, missing, broken, results: list[RunResult],
             notes: tuple[str, ...] = ()) -> CheckResult:
    yours = [n for n in names if n in found]
    mismatched = next((r for r in results if r.mismatch is not None), None)
    idle = {n: r.run.title for r in results for n in r.plugged if n not in r.ran}
    problems = []
    if missing:
        problems.append("write " + _names(f"{n} ({_lesson(n)})" for n in missing))
    for name, why in broken.items():
        problems.append(f"your saved {name} ({_lesson(name)}) does not load ({why}): run "
                        f"its check in {_lesson(name)} again")
    for name, title in idle.items():
        problems.append(f"your {name} was plugged in but never ran ({title})")
    tally = f"{len(yours)} of {len(names)} are yours"
    if mismatched is not None:
        head, status = _mismatch_message(mismatched), "failed"
        if problems:
            head += f"\n  (also: {tally}; " + "; ".join(problems) + ")"
    elif broken:
        head = f"✗ capstone: {tally}; " + "; ".join(problems)
        status = "failed"
    elif not yours:
        head = (f"… capstone: not done yet: none of your components is saved (0 of "
                f"{len(names)}; missing: {_names(missing)}; each lesson's check saves yours "
                f"when it passes), so this was the package's engine against itself")
        status = "not done"
    elif problems:
        head, status = f"… capstone: not passed yet: {tally}; " + "; ".join(problems), \
            "incomplete"
    else:
        head, status = (f"✓ capstone: all {len(names)} components are yours, and your engine "
                        f"gives LLM()'s tokens, logprobs, texts, block tables, free lists, "
                        f"queues, counters and observer snapshots at every step"), "passed"
    lines = [head]
    for result in results:
        if result.mismatch is not None:
            continue
        package = [n for n in names if n not in result.plugged and (
            n in result.run.components or n in result.run.package)]
        reasons: dict[str, list[str]] = {}  # why -> the components kept for it
        for n in package:
            reason = result.run.package.get(n) or (
                "your saved file does not load" if n in broken else "not yours yet")
            reasons.setdefault(reason, []).append(n)
        why = [f"the package's {_names(kept)} ({reason})" for reason, kept in reasons.items()]
        mine = [n for n in result.plugged if n in result.ran]
        lines.append(f"  {result.run.title}: the same as LLM() at all {len(result.expected)} "
                     f"steps ({_what_happened(result)})"
                     + (f"; with your {_names(mine)}" if mine else "")
                     + ("; " + "; ".join(why) if why else ""))
    timed = results[0] if results and results[0].mismatch is None else None
    if timed is not None and timed.plugged and timed.timing is not None:
        lines.append(f"  {timed.run.title}: {timed.timing.line()}")
    # correct but slow components (their checks timed them: exercises/cost.py), by name
    lines += [f"  {line}" for line in cost.recorded(workbench.learner_dir(), yours).values()]
    lines += [f"  {note}" for note in notes]
    shown = mismatched or (results[0] if results else None)
    if shown is not None and shown.expected and not any(o.finished
                                                        for o in shown.yours.values()):
        lines.append(f"  LLM()'s completions in {shown.run.title} (yours finished none before "
                     f"your run stopped):\n" + _completions(shown, only_theirs=True))
    elif shown is not None and shown.expected:
        whose = "yours" if shown.plugged else "the package's engine (none of yours is in it)"
        lines.append(f"  completions of {shown.run.title}, {whose} next to LLM()'s:\n"
                     + _completions(shown))
    result = CheckResult("\n".join(lines), status)
    result.num_yours, result.num_components = len(yours), len(names)
    return result


def _mismatch_message(result: RunResult) -> str:
    step, difference = result.mismatch
    found, run = result.plugged, result.run
    settings = {**CAPSTONE_SETTINGS, **run.settings}
    text = (f"✗ capstone: {run.title}: step {step}: {difference.subject} differs\n"
            f"  yours:  {difference.yours!r}\n  LLM():  {difference.expected!r}")
    if len(found) > 1:
        culprit = find_culprit(found, settings, result.workload,
                               [s.state for s in result.expected], step)
        if culprit is None:
            text += (f"\n  each of your components alone agrees with LLM() up to step {step}; "
                     f"together they do not: look at what {_names(found)} hand each other")
        else:
            name, at, alone = culprit
            text += (f"\n  the first of your components to go wrong: {name} ({_lesson(name)}): "
                     f"alone in the package's engine, at step {at}, ")
            if (at, alone) == (step, difference):
                text += "it makes this same difference"
            else:
                text += (f"{alone.subject} differs (yours {alone.yours!r}, LLM() "
                         f"{alone.expected!r})")
    elif found:
        name = next(iter(found))
        text += f"\n  your only component here is {name} ({_lesson(name)})"
    return text
