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
(lesson 10: rows, with penalties, greedy and seeded draws). torch runs on one thread while they
are timed.

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
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The verdict's thresholds: slower by this much at the largest size, and the ratio grown by this
# much from the smallest size. A constant factor (Python written another way) is not what the
# check is about; a cost that grows with the size is.
SLOW_RATIO = 8.0
GROWTH = 4.0
REPEATS = 9
# Each timed run lasts at least this long: short enough to fit between two interruptions of a
# busy machine's scheduler most of the time, long enough for the clock.
MIN_SECONDS = 0.0005
SWITCH = "MINIPAGED_COST_CHECKS"  # "0": no cost checks (the test suite's checker tests)
RECORD = "costs.json"  # in the learner's folder: component -> its cost verdict, when slow

Work = Callable[[int], None]  # work(times): one unit of an operation, ``times`` times


@dataclass(frozen=True)
class Probe:
    """How to load a component with work of a given size.

    Args:
        what: the size's unit, for the verdict ("blocks").
        sizes: small to large.
        prepare: ``prepare(component, size)`` builds what the work needs (untimed) and returns
            {operation: work}; each work leaves the state as it found it.
        package: where the package's own component is (``module:name``).
    """

    what: str
    sizes: tuple[int, ...]
    prepare: Callable[[object, int], dict[str, Work]]
    package: str  # "module:name" of the package's own component, the yardstick


@dataclass
class CostVerdict:
    """Seconds per unit of work, yours and the package's, by size and operation."""

    name: str
    probe: Probe
    rows: list[tuple[int, dict[str, tuple[float, float]]]]

    def ratio(self, i: int, operation: str) -> float:
        mine, theirs = self.rows[i][1][operation]
        return mine / theirs if theirs > 0 else float("inf")

    def slow_operations(self) -> list[str]:
        """The operations slower by ``SLOW_RATIO`` at the last size, their ratio grown by
        ``GROWTH`` since the first."""
        if len(self.rows) < 2:
            return []
        return [op for op in self.rows[-1][1]
                if self.ratio(-1, op) >= SLOW_RATIO
                and self.ratio(-1, op) >= GROWTH * max(self.ratio(0, op), 1e-9)]

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
            return (f"⚠ {self.name}: correct, but {self.ratio(-1, worst):.0f}x slower than the "
                    f"package's at {big} ({self.ratio(0, worst):.1f}x at {small}): the cost of "
                    f"{names} grows faster with the number of {self.probe.what} than the "
                    f"package's")
        worst = max(self.rows[-1][1], key=lambda op: self.ratio(-1, op))
        return (f"  cost: at most {self.ratio(-1, worst):.1f}x the package's time at {big} "
                f"({worst}), its cost grows as the package's does")


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
                    for s in (probe.sizes[0], size)])
                if again.slow:
                    break
                for i, (_, times) in zip((0, -1), again.rows):  # noise: keep the best of both
                    verdict.rows[i] = (verdict.rows[i][0], {
                        op: tuple(map(min, verdict.rows[i][1][op], times[op])) for op in times})
    finally:
        if gc_was:
            gc.enable()
        if threads is not None:
            torch.set_num_threads(threads)
    return verdict


# -- the probes --------------------------------------------------------------------------------
def _allocator_work(cls, size: int) -> dict[str, Work]:
    """A pool of ``size`` blocks, half of them held (the free list and the held blocks both
    grow with the pool)."""
    from minipaged.block import Device

    allocator = cls(Device.GPU, 16, size)
    held = [allocator.allocate() for _ in range(size // 2)]
    shared = held[len(held) // 2]

    def allocate_free(times: int) -> None:
        for _ in range(times):
            block = allocator.allocate()
            allocator.free(block)

    def acquire_free(times: int) -> None:
        for _ in range(times):
            allocator.acquire(shared)
            allocator.free(shared)

    def count(times: int) -> None:
        for _ in range(times):
            allocator.get_num_free_blocks()

    return {"allocate + free": allocate_free, "acquire + free": acquire_free,
            "get_num_free_blocks": count}


def _block_manager_work(cls, size: int) -> dict[str, Work]:
    """A manager of ``size`` GPU blocks with ``size // 8`` running sequences of 2 blocks."""
    from minipaged.sampling_params import SamplingParams
    from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus

    block_size = 4
    manager = cls(block_size, size, 64, watermark=0.0)
    params = SamplingParams()
    seqs = []
    for i in range(size // 8):
        seq = Sequence(i, None, [1, 2, 3, 4, 5, 6], block_size)
        manager.allocate(SequenceGroup(str(i), [seq], params, arrival_time=float(i)))
        seq.status = SequenceStatus.RUNNING
        seqs.append(seq)
    ids = iter(range(size, 1 << 62))

    def new_seq():
        number = next(ids)
        seq = Sequence(number, None, [1, 2, 3, 4, 5, 6, 7], block_size)
        return seq, SequenceGroup(str(number), [seq], params, arrival_time=float(number))

    def fresh():  # a running sequence to append to and fork from
        seq, group = new_seq()
        manager.allocate(group)
        seq.status = SequenceStatus.RUNNING
        return seq
    state = {"growing": fresh()}

    def allocate_free(times: int) -> None:
        for _ in range(times):
            seq, group = new_seq()
            manager.can_allocate(group)
            manager.allocate(group)
            seq.status = SequenceStatus.RUNNING
            manager.free(seq)

    def append(times: int) -> None:  # one sequence grows: a new block every 4 tokens
        for _ in range(times):
            growing = state["growing"]
            if growing.get_len() >= 64:  # (once in 57 appends: back to a short sequence)
                manager.free(growing)
                growing = state["growing"] = fresh()
            growing.append_token_id(8, {8: 0.0})
            manager.append_slot(growing)

    def fork_free(times: int) -> None:
        for _ in range(times):
            child, _ = new_seq()
            child.copy_state_from(state["growing"])
            child.status = SequenceStatus.RUNNING
            manager.fork(state["growing"], child)
            manager.free(child)

    def count(times: int) -> None:
        for _ in range(times):
            manager.get_num_free_gpu_blocks()

    return {"allocate + free": allocate_free, "append_slot": append, "fork + free": fork_free,
            "get_num_free_gpu_blocks": count}


def _prepare_inputs_work(fn, size: int) -> dict[str, Work]:
    """A decode step of ``size`` sequences, each with a context of 60 to 68 tokens in blocks of
    16 scattered over the pool, and one prompt of 32 tokens."""
    import torch

    from minipaged.sampling_params import SamplingParams
    from minipaged.sequence import Sequence, SequenceGroup
    from minipaged.step_record import SequenceRun

    block_size, runs = 16, []
    for i in range(size + 1):
        length = 32 if i == size else 60 + i % 9
        seq = Sequence(i, None, [7] * length, block_size)
        group = SequenceGroup(str(i), [seq], SamplingParams(), arrival_time=float(i))
        table = [(i * 7919 + k * 104729) % (8 * (size + 1)) for k in range(-(-length // 16))]
        start = 0 if i == size else length - 1
        runs.append(SequenceRun(group, [i], [7] * (length - start), start, table, True,
                                i == size))
    device = torch.device("cpu")

    def prepare(times: int) -> None:
        for _ in range(times):
            fn(runs, block_size, device)

    return {"prepare_inputs": prepare}


def _running_groups(manager, size: int, length: int, num_computed: int) -> list:
    """``size`` running single-sequence groups of ``length`` tokens, ``num_computed`` of them in
    the cache, oldest first, their prompts' blocks allocated in ``manager``."""
    from minipaged.sampling_params import SamplingParams
    from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus

    params, groups = SamplingParams(), []
    for i in range(size):
        seq = Sequence(i, None, [7] * num_computed, manager.block_size)
        group = SequenceGroup(str(i), [seq], params, arrival_time=float(i))
        manager.allocate(group)
        for _ in range(length - num_computed):  # decoded, not yet in the cache
            seq.append_token_id(8, {8: 0.0})
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = num_computed
        groups.append(group)
    return groups


def _scheduler_work(cls, size: int) -> dict[str, Work]:
    """``size`` running groups decoding, as the package's engine builds its scheduler
    (``cls(config, block_manager)``): a step where every group has its slot, and a step on a
    full pool where each group needs a new block, so that the newest half is preempted."""
    from minipaged.core.block_manager import BlockSpaceManager
    from minipaged.core.scheduler import SchedulerConfig
    from minipaged.sequence import SequenceStatus

    config = SchedulerConfig(max_num_seqs=size, max_num_batched_tokens=4 * size)
    # Every group's newest token goes into a block it holds: the step changes nothing.
    roomy = cls(config, BlockSpaceManager(16, 2 * size, 0, watermark=0.0))
    roomy.running = _running_groups(roomy.block_manager, size, 20, 19)
    # Every group's newest token opens a new block, and no block is free.
    full = cls(config, BlockSpaceManager(16, size, 0, watermark=0.0))
    groups = _running_groups(full.block_manager, size, 17, 16)
    full.running = list(groups)
    manager = full.block_manager

    def decode(times: int) -> None:
        for _ in range(times):
            roomy.schedule()

    def preempt(times: int) -> None:
        for _ in range(times):
            full.schedule()
            # The step undone, through the package's block manager: the same work for both.
            for group in full.running:  # served: give its new block back
                manager.gpu_allocator.free(manager.block_tables[group.seqs[0].seq_id].pop())
            for group in full.waiting:  # preempted by recompute: its block again
                seq = group.seqs[0]
                seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, 16
                manager._register(seq, group, [manager.gpu_allocator.allocate()])  # (as allocate)
            full.waiting.clear()
            full.running = list(groups)

    return {"schedule": decode, "schedule with preemption": preempt}


def _admission_work(fn, size: int) -> dict[str, Work]:
    """``size`` waiting groups of 8-token prompts; a step whose budget admits the oldest 64 (the
    scheduler's step 4 alone, ``fn`` as the ``Scheduler``'s ``_admit_waiting``), then undone."""
    from minipaged.core.block_manager import BlockSpaceManager
    from minipaged.core.scheduler import Scheduler, SchedulerConfig
    from minipaged.core.scheduler_outputs import StepPlan
    from minipaged.sampling_params import SamplingParams
    from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus

    admitted = 64
    cls = type("SchedulerWithThisAdmission", (Scheduler,), {"_admit_waiting": fn})
    scheduler = cls(SchedulerConfig(max_num_seqs=size, max_num_batched_tokens=8 * admitted),
                    BlockSpaceManager(16, 2 * admitted, 0, watermark=0.0))
    params = SamplingParams()
    waiting = [SequenceGroup(str(i), [Sequence(i, None, [7] * 8, 16)], params,
                             arrival_time=float(i)) for i in range(size)]
    scheduler.waiting = list(waiting)

    def admit(times: int) -> None:
        for _ in range(times):
            scheduler._admit_waiting(StepPlan(budget=8 * admitted))
            for group in scheduler.running:  # undone: back to waiting, the blocks freed
                scheduler.block_manager.free(group.seqs[0])
                group.seqs[0].status = SequenceStatus.WAITING
                group.pending_chunks = []
            scheduler.running.clear()
            scheduler.waiting[:] = waiting

    return {"_admit_waiting": admit}


def _sampler_work(cls, size: int) -> dict[str, Work]:
    """A decode step of ``size`` single-sequence requests over a vocabulary of 2,048 tokens:
    half greedy, half seeded draws at temperature 0.8 with top-k 50, every one with presence
    and frequency penalties over its 16 generated tokens and its 2 best tokens' logprobs."""
    import torch

    from minipaged.sampling_params import SamplingParams
    from minipaged.sequence import Sequence, SequenceGroup
    from minipaged.worker.model_runner import Row
    from minipaged.worker.sampler import sequence_generators

    vocab, rows, generators = 2048, [], {}
    for i in range(size):
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=-1 if i % 2 else 50,
                                presence_penalty=0.5, frequency_penalty=0.3, logprobs=2,
                                seed=None if i % 2 else i)
        seq = Sequence(i, None, [1, 2, 3], 16)
        seq.output_token_ids = [(i * 31 + k * 97) % vocab for k in range(16)]
        group = SequenceGroup(f"req{i}", [seq], params, arrival_time=float(i))
        rows.append(Row(group, [i], False))
        generators.update(sequence_generators(i if i % 2 == 0 else f"engine/req{i}", [i]))
    logits = torch.randn(size, vocab, generator=torch.Generator().manual_seed(size))  # (R, V)
    sampler = cls()

    def sample(times: int) -> None:  # (the generators advance: the work stays the same)
        for _ in range(times):
            sampler(logits.clone(), rows, generators)

    return {"__call__": sample}


def _attention_work(cls, size: int) -> dict[str, Work]:
    """A decode step of ``size`` sequences with contexts of 48 to 63 tokens in blocks of 16, the
    pool just large enough for them (it grows with the batch), GPT-2 shapes: 4 heads of 32."""
    import torch

    from minipaged.kernels import ops
    from minipaged.sampling_params import SamplingParams
    from minipaged.sequence import Sequence, SequenceGroup
    from minipaged.step_record import SequenceRun
    from minipaged.worker.model_runner import prepare_inputs

    block_size, num_heads, head_size, runs = 16, 4, 32, []
    num_blocks = 4 * size
    for i in range(size):
        length = 48 + i % 16
        seq = Sequence(i, None, [7] * length, block_size)
        group = SequenceGroup(str(i), [seq], SamplingParams(), arrival_time=float(i))
        table = [(i + k * size) % num_blocks for k in range(-(-length // block_size))]
        runs.append(SequenceRun(group, [i], [7], length - 1, table, True, False))
    meta = prepare_inputs(runs, block_size, torch.device("cpu")).meta
    g = torch.Generator().manual_seed(size)
    query = torch.randn(size, num_heads * head_size, generator=g)  # (T, H * D)
    key = torch.randn(size, num_heads * head_size, generator=g)
    value = torch.randn(size, num_heads * head_size, generator=g)
    x = ops.key_vector_size(torch.float32)
    kv_cache = (torch.randn(num_blocks, num_heads, head_size // x, block_size, x, generator=g),
                torch.randn(num_blocks, num_heads, head_size, block_size, generator=g))
    attention = cls(num_heads, head_size, head_size ** -0.5)

    def forward(times: int) -> None:  # (it writes the same keys into the same slots each time)
        with torch.inference_mode():
            for _ in range(times):
                attention(query, key, value, kv_cache, meta)

    return {"forward": forward}


PROBES: dict[str, Probe] = {
    "prepare_inputs": Probe("sequences", (16, 128, 1024), _prepare_inputs_work,
                            "minipaged.worker.model_runner:prepare_inputs"),
    "FreeListAllocator": Probe("blocks", (1_000, 10_000, 100_000), _allocator_work,
                               "minipaged.core.allocator:FreeListAllocator"),
    "PrefixCachingAllocator": Probe("blocks", (1_000, 10_000, 100_000), _allocator_work,
                                    "minipaged.core.prefix_caching_allocator:"
                                    "PrefixCachingAllocator"),
    "BlockSpaceManager": Probe("blocks", (800, 8_000, 80_000), _block_manager_work,
                               "minipaged.core.block_manager:BlockSpaceManager"),
    "Scheduler": Probe("running groups", (16, 128, 1024), _scheduler_work,
                       "minipaged.engine.cache_setup:Scheduler"),
    "admit_waiting": Probe("waiting groups", (128, 2048, 32768), _admission_work,
                           "minipaged.core.scheduler:Scheduler._admit_waiting"),
    "Sampler": Probe("rows", (4, 32, 256), _sampler_work, "minipaged.engine.llm_engine:Sampler"),
    "Attention": Probe("sequences", (4, 32, 256), _attention_work,
                       "minipaged.models.gpt2:PagedAttention"),
}


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
