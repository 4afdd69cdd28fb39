"""How many threads a step on the CPU runs with: chosen per step by its size and the machine's load
(lesson 15).

torch (and the C++ attention op, through ``at::parallel_for``) splits each operation over its
threads, and every operation ends at a barrier where the threads wait for each other. Two facts
decide the count:

- **The step's size.** A step of a tiny model is a chain of very small operations: a second
  thread saves little of each and adds a barrier to every one. SmolLM2's steps, even of one
  sequence, have work enough to share (quiet, two threads ran 1, 4 and 16 requests as fast as
  one or faster here: ``MIN_ELEMENTS_PER_THREAD`` below).
- **What else the machine runs.** When another program keeps a core busy, a thread of ours that
  shares that core runs at half speed, and at every barrier the others wait for it: on two cores
  with one busy, two threads ran a 4-request ``generate`` three times slower than one thread.
  So a step takes no more threads than there are cores that nobody else is using.

The load is read from ``/proc/stat`` (the busy time of the cores this process may run on, less
this process's own CPU time), over the last half second or more; where there is no
``/proc/stat`` the machine counts as quiet. torch's thread count is changed only when the choice
has stood for a few steps before it takes more threads (a change rebuilds the thread pools, which
costs milliseconds); it takes fewer at once.

``EngineConfig.cpu_threads`` pins a count instead (None: choose).
"""
from __future__ import annotations

import os
import time
from collections import Counter, deque

import torch

# Elements of one activation (tokens x hidden size) worth a thread of their own: every step of a
# 576-wide model (576 for one token) may take two threads, a tiny test model's (64 wide) decode
# of 3 sequences stays on one. On the 2-core AMD EPYC of 2026-11-29, quiet, two threads ran 1,
# 4 and 16 greedy requests as fast as one or faster (3.42/3.55 s, 5.29/6.08 s, 10.04/11.37 s:
# benchmarks/threads.py); what keeps a step off a busy core is the load, below.
MIN_ELEMENTS_PER_THREAD = 256
# A busy core is one that other programs kept at least this busy over the window.
BUSY_FRACTION = 0.5
WINDOW_S = 0.5  # the load is averaged over at least this long
STEPS_BEFORE_CHANGE = 3  # a new choice must stand this many steps before torch's count changes


def usable_cores() -> int:
    """The cores this process may run on (its affinity; ``os.cpu_count()`` where unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class CpuLoad:
    """How many of this process's cores other programs keep busy, from ``/proc/stat``.

    Args:
        stat_path: the file to read (tests give a fake one).
        clock: the wall clock and this process's CPU time, in seconds (tests give fake ones).
    """

    def __init__(self, stat_path: str = "/proc/stat", clock=time.monotonic,
                 own_cpu=time.process_time) -> None:
        self.stat_path = stat_path
        self.clock, self.own_cpu = clock, own_cpu
        try:
            self.cpus = {f"cpu{c}" for c in os.sched_getaffinity(0)}
        except (AttributeError, OSError):
            self.cpus = None  # every cpuN line
        self.ticks_per_s = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=64)
        self._others = 0.0

    def _busy_seconds(self) -> float | None:
        """Seconds the usable cores spent busy (anyone's work, and time stolen by the host)."""
        try:
            with open(self.stat_path) as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        busy = 0
        found = False
        for line in lines:
            name, *values = line.split()
            if not name.startswith("cpu") or name == "cpu":
                continue
            if self.cpus is not None and name not in self.cpus:
                continue
            # user nice system idle iowait irq softirq steal guest guest_nice
            ticks = [int(v) for v in values[:8]] + [0] * (8 - len(values[:8]))
            busy += sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
            found = True
        return busy / self.ticks_per_s if found else None

    def others(self) -> float:
        """Cores' worth of CPU other programs used over the last ``WINDOW_S`` or more (0 where
        the load cannot be read); cheap enough to call every step."""
        clock = self.clock()
        if self._samples and clock - self._samples[-1][0] < WINDOW_S / 10:
            return self._others  # NOTE: short steps read /proc/stat at most 20 times a second
        busy = self._busy_seconds()
        if busy is None:
            return 0.0
        now = (clock, busy, self.own_cpu())
        self._samples.append(now)
        while len(self._samples) > 2 and now[0] - self._samples[1][0] >= WINDOW_S:
            self._samples.popleft()  # keep the newest sample at least WINDOW_S old
        start = self._samples[0]
        elapsed = now[0] - start[0]
        if elapsed >= WINDOW_S:
            others = (now[1] - start[1]) - (now[2] - start[2])
            self._others = max(0.0, others / elapsed)
        return self._others


class ThreadChooser:
    """Sets torch's threads before each step on the CPU.

    Args:
        setting: ``EngineConfig.cpu_threads``: None chooses per step, an integer pins it.
        hidden_size: the model's hidden size (a step's activations are tokens x hidden).
        load: where the machine's load is read (default ``CpuLoad()``).
        cores: the cores to use at most (default: this process's).
    """

    def __init__(self, setting: int | None, hidden_size: int, load: CpuLoad | None = None,
                 cores: int | None = None) -> None:
        self.setting = setting
        self.hidden_size = hidden_size
        self.load = load or CpuLoad()
        self.cores = cores or usable_cores()
        self.steps_by_threads: Counter[int] = Counter()  # what was chosen, for the curious
        self._pending: tuple[int, int] | None = None  # (a new choice, steps it has stood)
        self._current: int | None = None
        self.load.others()  # the first sample: by the first step the window has begun

    def wanted(self, num_tokens: int) -> int:
        """The threads a step of ``num_tokens`` tokens should get now."""
        if self.setting is not None:
            return self.setting
        by_work = max(1, num_tokens * self.hidden_size // MIN_ELEMENTS_PER_THREAD)
        busy = self.load.others()
        free = self.cores - int(busy + (1 - BUSY_FRACTION))  # cores nobody else keeps busy
        return max(1, min(by_work, free, self.cores))

    def before_step(self, num_tokens: int) -> int:
        """Choose and apply the threads for a step of ``num_tokens`` tokens; returns them."""
        want = self.wanted(num_tokens)
        current = torch.get_num_threads()
        if self.setting is not None or current != self._current or want < current:
            # NOTE: fewer threads at once: a thread too many on a busy core costs several times
            # the step, one too few at most the share it would have done. Also at once: a pinned
            # count, the first step, and a count someone else set since our last step.
            chosen = want
        elif want == current:
            self._pending = None
            chosen = current
        else:
            seen = self._pending[1] + 1 if self._pending and self._pending[0] == want else 1
            self._pending = (want, seen)
            chosen = want if seen >= STEPS_BEFORE_CHANGE else current
        if chosen != current:
            torch.set_num_threads(chosen)
            self._pending = None
        self._current = chosen
        self.steps_by_threads[chosen] += 1
        return chosen
