"""Cost checks of the build track: is the learner's component as cheap as the package's as the
work grows? (lessons 02-11, 16).

A component can be right and still too slow for an engine: a free list that counts its free
blocks by scanning the whole pool is correct, and the engine asks for that count every step, so
at 100,000 blocks every schedule scans the pool. Correctness checks cannot see it; a stopwatch
on one machine cannot either (a slow laptop is not a slow component). What holds on any
machine is a **ratio measured in one run**: the learner's component and the package's do the
same work, one after the other, at a small and at a large size (pool size, running groups,
batch size, ...); the machine's speed cancels out. A component whose ratio to the package's
grows with the size has a cost that grows where the package's does not.

Each measurement alternates the two and keeps the best of several repeats, so that a busy
machine slows both alike rather than one of them.

    verdict = measure_cost("FreeListAllocator", MyAllocator)
    verdict.slow       # True
    verdict.message()  # "⚠ FreeListAllocator: correct, but 2581x slower than the package's at
                       #  10,000 blocks (294x at 1,000 blocks): the cost of get_num_free_blocks
                       #  grows faster with the number of blocks than the package's"

The probes (``PROBES``), each with the size that grows: the allocators and the block manager
(lessons 02, 03, 11: blocks in the pool), the ``Scheduler`` (lesson 04: running groups, a step
where each has its slot and one on a full pool that preempts the newest half), ``Attention``
(lesson 07: decode sequences, the pool growing with them), ``prepare_inputs`` (lesson 08:
sequences), ``admit_waiting`` (lesson 09: waiting groups, 64 of them admitted) and the ``Sampler``
(lesson 10: rows, with penalties, greedy and seeded draws); they are in ``cost_probes.py``.
torch runs on one thread while they are timed.

What a ratio can tell depends on the work per unit of size: where the package's own step costs
tens of microseconds of Python per group (the scheduler), a scan at C speed inside its loop (a
``max`` over the queue for each victim) stays a small factor up to thousands of groups and is
not told; a scan that calls Python per element (recounting the served groups' tokens for each
group) is.

Components without a probe here get no cost check: the kernel's phase (CUDA C++, timed by
nothing on the CPU but the sanitizers' build), the verifications (one step's few drafts: no size
grows that a learner's loop could scan), and ``LLMEngine.step``: its work is the model's forward
and the package's scheduler, sampler and output processing, which grow with the batch themselves;
a probe would run the real model for hundreds of running groups per timed unit (seconds on a CPU,
past the few seconds a check may take after every pass), and a learner's Python scan over the
groups per output would hide under the model's own growing cost.
"""
from __future__ import annotations

import gc
import importlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from minipaged.exercises.cost_probes import PROBES, Probe, Work

# The verdict's thresholds: slower by this much at the largest size, and the ratio grown by this
# much from the smallest size. A constant factor (Python written another way) is not what the
# check is about; a cost that grows with the size is.
SLOW_RATIO = 8.0
GROWTH = 4.0
# Or: at least EXPONENT_RATIO times slower at the largest size, and between the last two sizes
# the cost grows as a power of the size at least EXCESS_EXPONENT above the package's (an
# O(n^2) step where the package's is O(n) grows as n^1 more): the slope where the sizes are
# large enough for it to show.
EXPONENT_RATIO = 3.0
EXCESS_EXPONENT = 0.4
REPEATS = 9
# Each timed run lasts at least this long: short enough to fit between two interruptions of a
# busy machine's scheduler most of the time, long enough for the clock.
MIN_SECONDS = 0.0005
SWITCH = "MINIPAGED_COST_CHECKS"  # "0": no cost checks (the test suite's checker tests)
RECORD = "costs.json"  # in the learner's folder: component -> its cost verdict, when slow


@dataclass
class CostVerdict:
    """Seconds per unit of work, yours and the package's, by size and operation."""

    name: str
    probe: Probe
    rows: list[tuple[int, dict[str, tuple[float, float]]]]

    def ratio(self, i: int, operation: str) -> float:
        mine, theirs = self.rows[i][1][operation]
        return mine / theirs if theirs > 0 else float("inf")

    def exponent(self, operation: str, whose: int) -> float:
        """How the cost of ``operation`` grows between the last two sizes, as the power of the
        size (``whose``: 0 yours, 1 the package's): 1.0 linear, 2.0 quadratic."""
        (small, at_small), (big, at_big) = self.rows[-2], self.rows[-1]
        before, after = at_small[operation][whose], at_big[operation][whose]
        if before <= 0 or after <= 0:
            return 0.0
        return math.log(after / before) / math.log(big / small)

    def slow_operations(self) -> list[str]:
        """The operations slower by ``SLOW_RATIO`` at the last size, their ratio grown by
        ``GROWTH`` since the first; or slower by ``EXPONENT_RATIO`` with a cost growing as a
        power of the size ``EXCESS_EXPONENT`` above the package's."""
        if len(self.rows) < 2:
            return []
        return [op for op in self.rows[-1][1]
                if self.ratio(-1, op) >= SLOW_RATIO
                and self.ratio(-1, op) >= GROWTH * max(self.ratio(0, op), 1e-9)
                or self.ratio(-1, op) >= EXPONENT_RATIO
                and self.exponent(op, 0) >= self.exponent(op, 1) + EXCESS_EXPONENT]

    @property
    def slow(self) -> bool:
        return bool(self.slow_operations())

    def message(self) -> str:
        big = f"{self.rows[-1][0]:,} {self.probe.what}"
        small = f"{self.rows[0][0]:,} {self.probe.what}"
        slow = self.slow_operations()
        if slow:
            worst = max(slow, key=lambda op: self.ratio(-1, op))
            names = "; ".join(slow)
            return (f"⚠ {self.name}: correct, but {_times(self.ratio(-1, worst))} slower than "
                    f"the package's at {big} ({_times(self.ratio(0, worst))} at {small}): the "
                    f"cost of {names} grows faster with the number of {self.probe.what} than "
                    f"the package's (as {self.probe.what}^{self.exponent(worst, 0):.1f} against "
                    f"^{self.exponent(worst, 1):.1f}, from {self.rows[-2][0]:,} to "
                    f"{self.rows[-1][0]:,})")
        worst = max(self.rows[-1][1], key=lambda op: self.ratio(-1, op))
        return (f"  cost: at most {_times(self.ratio(-1, worst))} the package's time at {big} "
                f"({worst}), its cost grows as the package's does")


def _times(ratio: float) -> str:
    """A ratio as the verdict writes it: "294x", "1.7x"."""
    return f"{ratio:.0f}x" if ratio >= 10 else f"{ratio:.1f}x"


def _seconds(work: Work, times: int) -> float:
    start = time.perf_counter()
    work(times)
    return time.perf_counter() - start


def _per_unit(work: Work) -> tuple[float, int]:
    """(seconds per unit of work, units per timed run): the units double until a run lasts
    ``MIN_SECONDS`` (a slow component's single unit may already last longer)."""
    times = 1
    while True:
        seconds = _seconds(work, times)
        if seconds >= MIN_SECONDS or times >= 1 << 16:
            return seconds / times, times
        times *= 2


def _time_size(probe: Probe, candidate, package, size: int,
               repeats: int) -> dict[str, tuple[float, float]]:
    """{operation: (yours, the package's) seconds per unit} at ``size``: the two alternate, the
    best of ``repeats`` runs each."""
    theirs_work, mine_work = probe.prepare(package, size), probe.prepare(candidate, size)
    times = {}
    for op in theirs_work:
        theirs, their_times = _per_unit(theirs_work[op])
        mine, my_times = _per_unit(mine_work[op])
        for _ in range(repeats):
            theirs = min(theirs, _seconds(theirs_work[op], their_times) / their_times)
            # NOTE: a run of half a second or more says enough by itself; more would only make
            # the check slow.
            if mine * my_times < 0.5:
                mine = min(mine, _seconds(mine_work[op], my_times) / my_times)
        times[op] = (mine, theirs)
    return times


def measure(name: str, probe: Probe, candidate, package, repeats: int = REPEATS) -> CostVerdict:
    """Time ``candidate`` against ``package`` at each of ``probe.sizes``. Stops at the first size
    that already shows a cost growing where the package's does not; such a finding is measured a
    second time (the smallest size and that one) and stands only if the second measurement says
    the same: a busy machine must not raise a false alarm."""
    verdict = CostVerdict(name, probe, [])
    gc_was = gc.isenabled()
    gc.disable()  # NOTE: a collection inside one run and not the other would read as cost
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    if torch is not None:
        # NOTE: one thread: torch's worker threads on a busy machine wait for a core in one run
        # and not in the other; one thread is slowed alike in both.
        torch.set_num_threads(1)
    try:
        for size in probe.sizes:
            verdict.rows.append((size, _time_size(probe, candidate, package, size, repeats)))
            if verdict.slow:
                again = CostVerdict(name, probe, [
                    (s, _time_size(probe, candidate, package, s, repeats))
                    for s in probe.sizes[:len(verdict.rows)]])
                if again.slow:
                    verdict.rows = again.rows
                    break
                # noise: the second measurement, which says "not slow", stands (best times
                # taken side by side could pair one run's slow with the other's fast)
                verdict.rows = again.rows
    finally:
        if gc_was:
            gc.enable()
        if threads is not None:
            torch.set_num_threads(threads)
    return verdict


def measure_cost(name: str, candidate, package=None) -> CostVerdict | None:
    """The cost verdict of component ``name`` (None where the build track has no probe for it).

    Args:
        name: a component's name (``workbench.component(name)``).
        candidate: the learner's class or function.
        package: what to compare with (default: the package's own component).
    """
    probe = PROBES.get(name)
    if probe is None:
        return None
    if package is None:
        module, _, attribute = probe.package.partition(":")
        package = importlib.import_module(module)
        for part in attribute.split("."):  # (a method: "Scheduler._admit_waiting")
            package = getattr(package, part)
    return measure(name, probe, candidate, package)


def check_and_record(name: str, candidate, folder: Path) -> str:
    """After a component passed its check: its cost verdict as lines to add to the check's
    message ("" without a probe), kept in ``folder/costs.json`` when slow (the capstone reads
    it) and taken out of it when not."""
    if os.environ.get(SWITCH, "") == "0":
        return ""
    try:
        verdict = measure_cost(name, candidate)
    except Exception as error:  # noqa: BLE001 - the check passed; the probe's own use failed
        return (f"\n  (the cost check could not run your {name}: {type(error).__name__}: "
                f"{error})")
    if verdict is None:
        return ""
    path = Path(folder) / RECORD
    kept = recorded(folder)
    kept.pop(name, None)
    if verdict.slow:
        kept[name] = verdict.message()
    if kept or path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(kept, indent=1))
    return "\n" + verdict.message()


def recorded(folder: Path, names=None) -> dict[str, str]:
    """The kept verdicts of slow components (of ``names`` only, when given)."""
    try:
        kept = json.loads((Path(folder) / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in kept.items() if names is None or k in names}
