"""The sliding rule of prefix caching per KV cache group (``core/group_prefix.py``): a full
group serves the blocks it holds from the left, a sliding group only needs the blocks its
window reads from the prompt's first computed token; the blocks before are null entries."""
import pytest

from minipaged import SamplingParams
from minipaged.block import Device
from minipaged.core.group_prefix import first_block_read
from minipaged.core.hybrid_block_manager import HybridBlockManager
from minipaged.engine.llm_engine import LLMEngine
from minipaged.lab.invariants import InvariantObserver, check_block_manager
from minipaged.lab.tiny_families import save_tiny
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from workloads import run_to_end as run

BS, WINDOW = 4, 8


def manager(num_gpu_blocks: int = 40) -> HybridBlockManager:
    """A full group and a sliding group of window 8, blocks of 4, prefix caching on."""
    return HybridBlockManager(BS, num_gpu_blocks, 16, watermark=0.0, enable_prefix_caching=True,
                              windows=(None, WINDOW), sink_block=num_gpu_blocks)


def admit(hm: HybridBlockManager, request_id: str, prompt: list[int],
          first_seq_id: int = 0) -> tuple[SequenceGroup, int]:
    """Allocate and compute the prompt (one step); returns the group and its cached tokens."""
    group = SequenceGroup(request_id, [Sequence(first_seq_id, None, prompt, BS)],
                          SamplingParams(), arrival_time=0.0)
    cached = hm.allocate(group)[first_seq_id]
    (seq,) = group.get_seqs()
    seq.status = SequenceStatus.RUNNING
    hm.cache_blocks(seq, seq.get_len())
    seq.num_computed_tokens = seq.get_len()
    return group, cached


def decode(hm: HybridBlockManager, seq: Sequence, tokens: list[int]) -> None:
    for token in tokens:
        seq.append_token_id(token, {token: 0.0})
        hm.reserve_slot(seq)
        seq.num_computed_tokens = seq.get_len()


def fork_child(hm: HybridBlockManager, group: SequenceGroup) -> tuple[Sequence, Sequence]:
    """The group's one sequence forked (sequence 3, as n = 2 sampling does after a prompt)."""
    (seq,) = group.get_seqs()
    child = Sequence(3, None, seq.get_token_ids(), BS)
    child.status = SequenceStatus.RUNNING
    child.num_computed_tokens = seq.num_computed_tokens
    group.seqs.append(child)
    hm.fork(seq, child)
    return seq, child


def finish(hm: HybridBlockManager, group: SequenceGroup) -> None:
    for seq in group.get_seqs():
        seq.status = SequenceStatus.FINISHED_STOPPED
        hm.free(seq)


def test_the_first_block_a_window_reads():
    # a hit of h blocks computes from position 4h; a window of 8 reads from 4h - 7 on
    assert [first_block_read(h, BS, WINDOW) for h in range(7)] == [0, 0, 0, 1, 2, 3, 4]
    assert first_block_read(5, BS, 10) == 2  # from position 11, the last of block 2: all of it
    assert first_block_read(5, BS, 1) == 4  # the last hit block stays (the chain goes on)
    assert first_block_read(5, BS, None) == 0  # a full group: every block from the left


def evict_early_sliding_blocks(hm: HybridBlockManager, prompt: list[int]) -> None:
    """The prompt computed, then decoded until its first sliding blocks left the window (they
    go back first), then finished; a busy request then takes every truly free block and
    evicts the least recently used cached ones: those sliding blocks."""
    group, _ = admit(hm, "a", prompt)
    decode(hm, group.get_seqs()[0], [5, 6, 7, 8, 9, 10, 11, 12])
    dropped = [i for i, b in enumerate(hm.groups[0].block_tables[0]) if b.block_number < 0]
    assert dropped == [0, 1, 2, 3, 4, 5]
    finish(hm, group)
    free = len(hm.gpu_allocator.free_blocks)
    assert free % 2 == 0
    busy_blocks = (free + 2) // 2  # in each group: two cached blocks evicted
    admit(hm, "busy", [200 + i for i in range(4 * busy_blocks)], first_seq_id=1)
    assert hm.gpu_allocator.num_evictions == 2


def test_a_prompt_hits_after_its_early_sliding_blocks_were_evicted():
    hm = manager()
    prompt = list(range(100, 124))  # 6 blocks
    evict_early_sliding_blocks(hm, prompt)
    # the sliding group lost blocks 0 and 1: a scan from the left found nothing; the window
    # of the first computed token (position 20, reading 13 on) needs blocks 3 and 4 only
    _, cached = admit(hm, "again", prompt[:20] + [1, 2, 3], first_seq_id=2)
    assert cached == 20
    table = hm.groups[0].block_tables[2]
    assert [b.block_number < 0 for b in table] == [True] * 3 + [False] * 3
    assert hm.groups[0].get_block_table(hm.seqs[2])[:3] == [hm.sink_block] * 3
    assert check_block_manager(hm) == []


def test_a_hit_needs_every_block_its_window_reads():
    hm = manager()
    prompt = list(range(100, 124))
    evict_early_sliding_blocks(hm, prompt)
    # the sliding group loses its block 4 as well: a hit of 6 blocks reads positions 17 on
    # (blocks 4, 5), one of 5 blocks 13 on (3, 4); one of 4 blocks reads 9 on (2, 3): found
    pool = hm.gpu_allocator
    (fifth,) = [b for b in pool.evictable.values() if pool.contents[b.block_number].token_ids
                == (("kv cache group", 1), *prompt[16:20])]
    pool._evict(fifth)
    _, cached = admit(hm, "again", prompt + [1], first_seq_id=2)
    assert cached == 16
    assert [b.block_number < 0 for b in hm.groups[0].block_tables[2]] == \
        [True] * 2 + [False] * 5
    assert check_block_manager(hm) == []


def test_null_entries_survive_fork_swap_and_free():
    hm = manager()
    prompt = list(range(100, 124))
    evict_early_sliding_blocks(hm, prompt)
    group, cached = admit(hm, "again", prompt[:20] + [1, 2, 3], first_seq_id=2)
    assert cached == 20
    seq, child = fork_child(hm, group)
    decode(hm, seq, [40])  # copy-on-write of the shared last block, in every group
    decode(hm, child, [41])
    assert check_block_manager(hm) == []
    hm.swap_out(group)
    for s in group.get_seqs():
        s.status = SequenceStatus.SWAPPED
    assert all(b.device is Device.CPU for b in hm.groups[0].block_tables[3])
    hm.swap_in(group)
    for s in group.get_seqs():
        s.status = SequenceStatus.RUNNING
    assert [b.block_number < 0 for b in hm.groups[0].block_tables[3][:3]] == [True] * 3
    assert check_block_manager(hm) == []
    finish(hm, group)
    hm.reset()
    assert hm.get_num_free_gpu_blocks() == hm.num_total_gpu_blocks
    assert hm.get_num_free_cpu_blocks() == hm.num_total_cpu_blocks


@pytest.mark.slow
def test_the_engine_hits_a_repeated_prompt_whose_early_sliding_blocks_were_evicted(
        tmp_path, monkeypatch):
    """The tiny Gemma 3 (five sliding layers of window 8 in six), blocks of 4, the memory of
    17 blocks of every layer: a 25-token prompt decodes 12 tokens (its sliding groups' first
    blocks leave the window and go back first), a 40-token prompt then evicts them, and the
    first prompt's 24-token start comes again. A scan from the left in every group found
    nothing (0 tokens); the sliding rule serves the 24, as the every-block engine does, and
    both engines give the same tokens and logprobs."""
    monkeypatch.setenv("MINIPAGED_LINEAR_FORM", "cpp")  # (a row's result: not the batch's)
    save_tiny("gemma3", str(tmp_path), seed=11, sliding_window=8)
    start = list(range(50, 74))
    prompts = [start + [7], list(range(120, 160)), start + [9, 10]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
              for m in (12, 4, 6)]
    settings = dict(block_size=4, num_gpu_blocks=17, num_cpu_blocks=64, max_model_len=64,
                    dtype="float32", seed=0, cpu_threads=1, enable_prefix_caching=True)
    results = {}
    for groups in (True, False):
        engine = LLMEngine(str(tmp_path), kv_cache_groups=groups, **settings)
        watch = InvariantObserver(engine)
        engine.add_observer(watch)
        manager, hits, outs = engine.scheduler.block_manager, [], []
        for prompt, param in zip(prompts, params):
            before = manager.num_cached_tokens
            (result,) = run(engine, [prompt], [param])
            hits.append(manager.num_cached_tokens - before)
            outs.append([(o.token_ids, o.cumulative_logprob) for o in result.outputs])
        assert watch.first is None, watch.first
        results[groups] = hits, outs, manager.num_evicted_blocks
    (hits, outs, evicted), (every_hits, every_outs, _) = results[True], results[False]
    assert evicted > 0 and hits == every_hits == [0, 0, 24]
    for got, want in zip(outs, every_outs):
        assert [t for t, _ in got] == [t for t, _ in want]
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-3)


def test_a_recomputed_group_takes_hits_only_inside_its_shared_blocks():
    """Two sequences that differ after 24 shared tokens, preempted by recompute: both take the
    same hits, none past the blocks they share (past them, one sequence's window could need
    a block that the other's hits hold as a null entry)."""
    hm = manager()
    prompt = list(range(100, 124))
    evict_early_sliding_blocks(hm, prompt)
    hm.free(hm.seqs[1])  # the busy request is done: room to grow
    group, cached = admit(hm, "again", prompt + [1, 2, 3], first_seq_id=2)
    assert cached == 24
    seq, child = fork_child(hm, group)
    for token in range(8):  # each fills its own blocks, named as they fill
        decode(hm, seq, [40 + token])
        decode(hm, child, [60 + token])
    for s in group.get_seqs():
        hm.free(s)
        s.reset_for_recompute()
    assert hm.prompt_layout(group)[1] == 24  # the shared tokens: six full blocks
    own = hm.gpu_allocator.longest_cached_prefix(seq.get_token_ids(), 8)  # the full group's
    assert len(own) == 8  # (its own blocks 6 and 7 are still cached)
    got = hm.allocate(group)
    assert got == {2: 24, 3: 24}
    for s in group.get_seqs():
        s.status = SequenceStatus.RUNNING
    tables = [hm.groups[0].block_tables[s] for s in (2, 3)]
    assert [b.block_number for b in tables[0][:6]] == [b.block_number for b in tables[1][:6]]
    assert check_block_manager(hm) == []
