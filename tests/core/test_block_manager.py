"""Lesson 02: the allocator's free list and ref counts, and the block manager's tables."""
import pytest

from minipaged.core.allocator import FreeListAllocator
from minipaged.block import Device, LogicalTokenBlock
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus

pytestmark = pytest.mark.lesson02


def make_group(request_id, seq_id, num_tokens, block_size=4, best_of=1):
    params = SamplingParams(n=1, best_of=best_of, temperature=1.0)
    seqs = [Sequence(seq_id + i, None, list(range(num_tokens)), block_size)
            for i in range(best_of)]
    return SequenceGroup(request_id, seqs, params, arrival_time=float(seq_id))


def test_allocator_hands_out_each_block_once_and_takes_it_back():
    alloc = FreeListAllocator(Device.GPU, block_size=4, num_blocks=3)
    blocks = [alloc.allocate() for _ in range(3)]
    assert sorted(b.block_number for b in blocks) == [0, 1, 2]
    assert all(b.ref_count == 1 for b in blocks)
    assert alloc.get_num_free_blocks() == 0
    with pytest.raises(ValueError, match="out of GPU blocks"):
        alloc.allocate()
    alloc.free(blocks[1])
    assert alloc.get_num_free_blocks() == 1
    assert alloc.allocate() is blocks[1]  # the freed block is reused


def test_allocator_double_free_raises():
    alloc = FreeListAllocator(Device.GPU, block_size=4, num_blocks=2)
    block = alloc.allocate()
    alloc.free(block)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(block)
    assert alloc.get_num_free_blocks() == 2  # the bad free changed nothing


def test_shared_block_returns_to_free_list_only_at_ref_count_zero():
    alloc = FreeListAllocator(Device.GPU, block_size=4, num_blocks=2)
    block = alloc.allocate()
    block.ref_count += 1  # a second table holds it
    alloc.free(block)
    assert alloc.get_num_free_blocks() == 1 and block.ref_count == 1
    alloc.free(block)
    assert alloc.get_num_free_blocks() == 2


def test_logical_blocks_fill_left_to_right():
    seq = Sequence(0, None, list(range(9)), block_size=4)
    assert [b.num_tokens for b in seq.logical_token_blocks] == [4, 4, 1]
    assert seq.logical_token_blocks[2].token_ids == [8]
    block = LogicalTokenBlock(0, 4)
    block.append_tokens([1, 2])
    assert block.get_num_empty_slots() == 2 and not block.is_full()


def test_allocate_gives_one_block_per_logical_block():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    group = make_group("a", 0, num_tokens=9)
    assert bm.can_allocate(group)
    bm.allocate(group)
    table = bm.get_block_table(group.seqs[0])
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.get_num_free_gpu_blocks() == 5


def test_append_across_a_block_boundary_allocates_exactly_one_new_block():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    group = make_group("a", 0, num_tokens=7)
    bm.allocate(group)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = 7
    seq.append_token_id(100, {100: 0.0})  # token 8 fills block 1: no new block
    assert bm.append_slot(seq) is None
    assert len(bm.get_block_table(seq)) == 2 and bm.get_num_free_gpu_blocks() == 6
    seq.append_token_id(101, {101: 0.0})  # token 9 opens logical block 2
    assert bm.append_slot(seq) is None
    assert len(bm.get_block_table(seq)) == 3 and bm.get_num_free_gpu_blocks() == 5


def test_free_returns_all_blocks_and_is_idempotent():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    group = make_group("a", 0, num_tokens=12)
    bm.allocate(group)
    bm.free(group.seqs[0])
    assert bm.get_num_free_gpu_blocks() == 8
    bm.free(group.seqs[0])  # a second free of the same sequence is a no-op
    assert bm.get_num_free_gpu_blocks() == 8


def test_watermark_keeps_blocks_free_for_running_sequences():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=100, num_cpu_blocks=0, watermark=0.05)
    assert bm.watermark_blocks == 5
    fits = make_group("a", 0, num_tokens=4 * 95)  # 95 blocks: leaves exactly the watermark
    too_big = make_group("b", 1, num_tokens=4 * 96)  # would eat into the watermark
    assert bm.can_allocate(fits)
    assert not bm.can_allocate(too_big)


def test_shared_prompt_is_allocated_once_with_ref_counts():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    group = make_group("a", 0, num_tokens=6, best_of=3)
    bm.allocate(group)
    tables = [bm.get_block_table(s) for s in group.seqs]
    assert tables[0] == tables[1] == tables[2]
    assert bm.get_num_free_gpu_blocks() == 6
    snap = bm.snapshot()
    refs = {b["block_number"]: b["ref_count"] for b in snap["gpu_blocks"]}
    assert all(refs[b] == 3 for b in tables[0])
    for seq in group.seqs:
        bm.free(seq)
    assert bm.get_num_free_gpu_blocks() == 8


def test_can_append_slot_counts_only_sequences_that_need_a_block():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=2, num_cpu_blocks=0, watermark=0.0)
    group = make_group("a", 0, num_tokens=5)  # 2 blocks, second has 3 free slots
    bm.allocate(group)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    seq.num_computed_tokens = 5
    seq.append_token_id(7, {7: 0.0})
    assert bm.can_append_slot(group)  # the slot exists already, no free block needed
    bm.append_slot(seq)
    for t in (8, 9, 10):
        seq.append_token_id(t, {t: 0.0})
    assert not bm.can_append_slot(group)  # token 9 needs a third block; the pool is empty


def test_snapshot_is_plain_data_describing_tables_and_free_list():
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=4, num_cpu_blocks=2, watermark=0.0)
    group = make_group("r", 0, num_tokens=5)
    bm.allocate(group)
    snap = bm.snapshot()
    (seq,) = snap["sequences"]
    assert seq["request_id"] == "r" and seq["num_tokens"] == 5
    assert [b["num_filled"] for b in seq["logical_blocks"]] == [4, 1]
    assert len(snap["free_gpu_blocks"]) == 2 and len(snap["free_cpu_blocks"]) == 2
    assert set(snap["free_gpu_blocks"]).isdisjoint(seq["block_table"])


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_reset_frees_every_table_as_vllm_v01_does(prefix_caching):
    """vLLM v0.1's ``BlockSpaceManager.reset()``: every sequence's blocks freed, shared, forked
    and swapped ones included; the manager serves new requests as a fresh one would."""
    manager = BlockSpaceManager(block_size=4, num_gpu_blocks=12, num_cpu_blocks=8,
                                watermark=0.0, enable_prefix_caching=prefix_caching)
    parallel = make_group("a", 0, 6, best_of=2)  # 2 sequences share the prompt's 2 blocks
    single = make_group("b", 10, 9)
    swapped = make_group("c", 20, 5)
    for group in (parallel, single, swapped):
        manager.allocate(group)
        for seq in group.get_seqs():
            seq.status = SequenceStatus.RUNNING
    child = Sequence(30, None, list(range(9)), 4)
    manager.fork(single.get_seqs()[0], child)
    manager.swap_out(swapped)
    for seq in swapped.get_seqs():
        seq.status = SequenceStatus.SWAPPED
    assert manager.get_num_free_gpu_blocks() < 12 and manager.get_num_free_cpu_blocks() < 8

    manager.reset()

    assert manager.block_tables == {}
    assert manager.get_num_free_gpu_blocks() == 12
    assert manager.get_num_free_cpu_blocks() == 8
    manager.reset()  # twice: nothing left to free, nothing raised
    again = make_group("d", 40, 16)
    assert manager.can_allocate(again)
    manager.allocate(again)
    assert len(manager.get_block_table(again.get_seqs()[0])) == 4
