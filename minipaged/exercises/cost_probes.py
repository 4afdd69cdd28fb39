"""The cost checks' probes: the work each build-track component does at a given size
(lessons 02-04, 07-11; ``cost.py`` times it, the learner's component against the package's):
each times the methods the learner wrote (the prefix cache's lookups and its
least-recently-used order, not only what it inherits).

A probe builds, untimed, a component loaded to a size (blocks in the pool, running or waiting
groups, sequences, rows) and returns its operations as ``work(times)``, each of which leaves the
state as it found it, so that one unit of work costs the same every time it is run.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


# -- the probes --------------------------------------------------------------------------------
def _allocator_work(cls, size: int) -> dict[str, Work]:
    """A pool of ``size`` blocks, half of them held (the free list and the held blocks both
    grow with the pool)."""
    from minipaged.block import Device

    allocator = cls(Device.GPU, 16, size)
    held = [allocator.allocate() for _ in range(size // 2)]
    return _allocator_ops(allocator, held[len(held) // 2])


def _allocator_ops(allocator, shared) -> dict[str, Work]:
    """An allocator's own operations: a block handed out and freed, ``shared`` held once more
    and let go, the free blocks counted."""

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


def _prefix_cache_work(cls, size: int) -> dict[str, Work]:
    """A prefix cache filled with ``size`` cached blocks (chains of 8 blocks of 4 tokens, each
    freed: evictable, least recently used first), 64 more blocks held; then the allocator's
    own work (``_allocator_work``), a prompt's lookup (``longest_cached_prefix`` of a chain,
    and one ``lookup``), a cached block taken back and freed again (its place in the
    least-recently-used order moves), and evictions (no block is truly free: an allocation
    evicts the least recently used block, which is named anew and freed)."""
    from minipaged.block import Device

    cache = cls(Device.GPU, 4, size + 64)
    chains = []
    for chain in range(size // 8):
        token_ids = [[chain, k, 0, 0] for k in range(8)]
        blocks = [cache.allocate() for _ in token_ids]
        cache.name_blocks(blocks, token_ids)
        chains.append((blocks, token_ids))
        for block in reversed(blocks):
            cache.free(block)
    blocks, token_ids = chains[len(chains) // 2]
    prompt = [t for tokens in token_ids for t in tokens] + [1]
    # Every truly free block held: allocate evicts (after a first eviction, allocate + free
    # reuses the block it freed).
    held = [cache.allocate() for _ in range(64)]

    def longest(times: int) -> None:
        for _ in range(times):
            cache.longest_cached_prefix(prompt, 8)

    def lookup(times: int) -> None:
        for _ in range(times):
            cache.lookup(blocks[2], tuple(token_ids[3]))

    def take_back(times: int) -> None:  # an evictable block held again, then freed again
        for _ in range(times):
            cache.acquire(blocks[0])
            cache.free(blocks[0])

    names = iter(range(1 << 20, 1 << 62))

    def evict(times: int) -> None:  # the LRU block evicted, named anew, freed (now the MRU)
        for _ in range(times):
            block = cache.allocate()
            cache.name_blocks([block], [[next(names), 0, 0, 0]])
            cache.free(block)

    return {**_allocator_ops(cache, held[0]), "longest_cached_prefix": longest,
            "lookup": lookup, "acquire + free of a cached block": take_back,
            "evict + name + free": evict}


def _block_manager_work(cls, size: int) -> dict[str, Work]:
    """A manager of ``size`` GPU blocks with ``size // 8`` running sequences of 2 blocks and one
    of ``size // 16`` blocks (many sequences, and a long table: lesson 03 leaves the structure
    to the learner). Timed: admitting and freeing, a growing sequence's appends, forks, a
    table looked up as the scheduler does at every step (``get_block_table`` reads the
    learner's ``get_blocks``), and the long sequence forked and its child freed."""
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
    long_seq = Sequence(size // 8, None, [9] * (size // 16 * block_size), block_size)
    manager.allocate(SequenceGroup("long", [long_seq], params, arrival_time=-1.0))
    long_seq.status = SequenceStatus.RUNNING
    middle = seqs[len(seqs) // 2]
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

    def look_up(times: int) -> None:
        for _ in range(times):
            manager.get_block_table(middle)

    def fork_free_long(times: int) -> None:
        for _ in range(times):
            child, _ = new_seq()
            child.copy_state_from(long_seq)
            child.status = SequenceStatus.RUNNING
            manager.fork(long_seq, child)
            manager.free(child)

    return {"allocate + free": allocate_free, "append_slot": append, "fork + free": fork_free,
            "get_num_free_gpu_blocks": count, "get_block_table (get_blocks)": look_up,
            "fork + free of a long table": fork_free_long}


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
    "PrefixCachingAllocator": Probe("cached blocks", (800, 8_000, 50_000), _prefix_cache_work,
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
