"""lab/invariants.py (lesson 19): the invariants of blocks and queues, after every step or on
demand.

The package's engine keeps every invariant after every step of random workloads (Hypothesis,
the same workloads as test_engine_diff.py's); a block manager and a scheduler broken by hand get
the invariant named with the block or sequence that breaks it; the observer can stop the step.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings

from budgets import examples
from minipaged import SamplingParams
from minipaged.block import Device
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.scheduler import Scheduler, SchedulerConfig
from minipaged.lab.engine_diff import record
from minipaged.lab.invariants import (INVARIANTS, InvariantError, InvariantObserver,
                                      check_block_manager, check_engine, check_scheduler)
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from test_engine_diff import WORKLOAD, fits, new_engine, workloads  # noqa: F401 (fixture)

pytestmark = pytest.mark.lesson19


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@settings(max_examples=examples(12), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=workloads())
def test_the_package_engine_keeps_every_invariant_after_every_step(tiny_llama, case):
    workload, engine_settings = case
    engine = new_engine(tiny_llama[0], **engine_settings)
    assume(fits(engine, workload))
    watch = InvariantObserver(engine, stop=True)
    engine.add_observer(watch)
    run = record(engine, workload)
    assert run.error is None and watch.first is None
    assert watch.steps_checked == len(run.steps) and check_engine(engine) == []


def admitted_pair():
    """A block manager holding one group of two sequences that share their 6-token prompt."""
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=4, watermark=0.0)
    group = SequenceGroup("7", [Sequence(i, None, [5, 6, 7, 8, 9, 10], 4) for i in range(2)],
                          SamplingParams(n=2, temperature=1.0), 0.0)
    bm.allocate(group)
    for seq in group.get_seqs():
        seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, 6
    return bm, group


def names(violations):
    return [v.invariant for v in violations]


def test_a_sound_block_manager_has_no_violation():
    bm, _ = admitted_pair()
    assert check_block_manager(bm) == []


def test_a_stray_free_is_a_ref_count_below_its_tables():
    bm, _ = admitted_pair()
    bm.gpu_allocator.free(bm.block_tables[0][-1])
    [v] = check_block_manager(bm)
    assert v.invariant == "ref count = tables holding it" and v.subject == "GPU block 1"
    assert "ref count 1, held by 2 tables (sequence 0 (request 7), sequence 1 (request 7))" \
        in v.detail


def test_a_held_block_on_the_free_list_and_twice_there():
    bm, _ = admitted_pair()
    held = bm.block_tables[1][0]
    bm.gpu_allocator.free_blocks += [held, held]
    found = check_block_manager(bm)
    assert names(found)[:2] == ["free list lists a block once", "no block both free and held"]
    assert "free + held = pool" in names(found)
    assert all(v.subject in ("GPU block 0", "the GPU pool") for v in found)


def test_a_leaked_block_and_a_finished_sequence_holding_blocks():
    bm, group = admitted_pair()
    bm.gpu_allocator.free_blocks.pop()  # block 2 out of the free list: held by nobody
    group.seqs[1].status = SequenceStatus.FINISHED_ABORTED
    found = {v.invariant: v for v in check_block_manager(bm)}
    assert found["every block is free or held"].subject == "GPU block 2"
    assert "FINISHED_ABORTED and still holds blocks [0, 1]" in \
        found["only live sequences hold blocks"].detail


def test_a_shared_block_whose_holders_computed_different_tokens():
    bm, group = admitted_pair()
    for seq, token in zip(group.seqs, (40, 41)):  # both wrote their token into the shared block
        seq.append_token_id(token, {token: 0.0})
        seq.num_computed_tokens = 7
    [v] = check_block_manager(bm)
    assert v.invariant == "a shared block holds the same tokens" and v.subject == "GPU block 1"
    assert "differ at position 6 ([40, 41])" in v.detail


def test_tables_on_the_wrong_device_or_too_short():
    bm, group = admitted_pair()
    group.seqs[0].status = SequenceStatus.SWAPPED
    group.seqs[1].num_computed_tokens = 9  # more computed tokens than its 2 blocks hold
    found = {v.invariant: v for v in check_block_manager(bm)}
    assert "SWAPPED, yet holds gpu#0, gpu#1" in found["blocks on the sequence's device"].detail
    assert "2 blocks for 9 computed of 6 tokens" in found["block table covers the tokens"].detail


def test_queue_invariants_name_the_request():
    bm, group = admitted_pair()
    scheduler = Scheduler(SchedulerConfig(), bm)
    scheduler.running.append(group)
    assert check_scheduler(scheduler) == []
    scheduler.swapped.append(group)
    found = {v.invariant: v for v in check_scheduler(scheduler)}
    assert found["a group is in one queue"].detail == "in running and in swapped"
    assert "RUNNING in the swapped queue" in found["queue matches status"].detail
    bm.free(group.seqs[0])
    scheduler.swapped.clear()
    [v] = check_scheduler(scheduler)
    assert v.invariant == "live sequences hold blocks" and "request 7" in v.subject
    assert set(INVARIANTS) >= {x.invariant for x in check_scheduler(scheduler)}


def test_the_observer_can_stop_the_step_that_broke_an_invariant(tiny_llama):
    engine = new_engine(tiny_llama[0])
    watch = InvariantObserver(engine, stop=True)
    engine.add_observer(watch)
    allocator = engine.block_manager.gpu_allocator
    real_free = allocator.free
    # a free that also puts the block at the far end of the free list: the allocator's own
    # assertion would fire only when that end is reached, steps later
    allocator.free = lambda block: (real_free(block), allocator.free_blocks.insert(0, block))
    run = record(engine, WORKLOAD)
    assert run.error.startswith("InvariantError: after step ")
    assert watch.first.invariant in ("free list lists a block once",
                                     "no block both free and held", "every block is free or held")
    assert watch.first.step == len(run.steps) and isinstance(watch.first.subject, str)
    assert issubclass(InvariantError, AssertionError) and Device.GPU.value == "gpu"
