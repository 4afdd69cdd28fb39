"""Small helpers of the lessons' measuring cells (lessons 04, 09, 12, 13 and 18): the clock and
the run loop, kept out of the cells so that a cell reads as what it measures.

Each helper does one thing a cell did inline before; none of them is something a lesson asks the
learner to write.
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Awaitable, Callable


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(what ``fn()`` returned, the seconds it took): one call, wall-clock time."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def mean_ms(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Milliseconds per call of ``fn()``: one call to warm up, then the mean of ``repeats``."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def median(values) -> float:
    """The middle value (the upper one of the two middles for an even count)."""
    values = sorted(values)
    if not values:
        raise ValueError("median of no values")
    return values[len(values) // 2]


def run_observed(engine) -> list:
    """Step ``engine`` until it has no unfinished request; [the StepSnapshot of every step]."""
    snapshots = []
    engine.add_observer(snapshots.append)
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.remove_observer(snapshots.append)
    return snapshots


def timed_steps(llm, chat, sampling) -> list:
    """[(seconds, StepSnapshot)] of every step of one ``llm.chat(chat, sampling)`` request: an
    observer notes the clock after each step."""
    marks = []

    def note(snap):
        marks.append((time.perf_counter(), snap))

    llm.llm_engine.add_observer(note)
    start = time.perf_counter()
    try:
        llm.chat(chat, sampling, use_tqdm=False)
    finally:
        llm.llm_engine.remove_observer(note)
    times = [start] + [t for t, _ in marks]
    return [(b - a, snap) for a, (b, snap) in zip(times, marks)]


def run_coroutine(make: Callable[[], Awaitable[Any]]) -> Any:
    """What the coroutine ``make()`` returns, run to its end on an event loop of its own.

    NOTE: Jupyter already runs an event loop in the cell's thread, where ``asyncio.run`` refuses
    to start another; the coroutine runs in a helper thread instead, and its error is raised here.
    """
    box: dict[str, Any] = {}

    def run():
        try:
            box["result"] = asyncio.run(make())
        except BaseException as error:  # handed to the caller's thread
            box["error"] = error

    runner = threading.Thread(target=run)
    runner.start()
    runner.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
