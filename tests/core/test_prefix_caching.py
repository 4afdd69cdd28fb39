"""Automatic prefix caching (lesson 11): hashed full blocks, reuse, eviction, same outputs."""
from __future__ import annotations

import random

import pytest
import torch

from minipaged import LLMEngine, SamplingParams
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.prefix_caching_allocator import block_hash
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from prefix_cache_invariants import check_prefix_cache

pytestmark = pytest.mark.lesson11

BS = 4


def make_group(request_id: str, prompt: list[int], n: int = 1, first_seq_id: int = 0):
    seqs = [Sequence(first_seq_id + i, None, prompt, BS) for i in range(n)]
    return SequenceGroup(request_id, seqs, SamplingParams(n=n), arrival_time=0.0)


def admit(bm: BlockSpaceManager, group: SequenceGroup) -> dict[int, int]:
    """What the scheduler does at admission: allocate, then the chunk computes the prompt."""
    cached = bm.allocate(group)
    for seq in group.get_seqs(SequenceStatus.WAITING):
        seq.status = SequenceStatus.RUNNING
        bm.cache_blocks(seq, seq.get_len())
    return cached


def finish(bm: BlockSpaceManager, group: SequenceGroup) -> None:
    for seq in group.get_seqs():
        seq.status = SequenceStatus.FINISHED_STOPPED
        bm.free(seq)


# -- the block manager -----------------------------------------------------------------------------
def test_block_hash_chains_every_token_before_the_block():
    a, b = block_hash(None, [1, 2, 3, 4]), block_hash(None, [1, 2, 3, 5])
    assert a != b and a == block_hash(None, (1, 2, 3, 4))
    # The same tokens after a different prefix get a different name.
    assert block_hash(a, [9, 9, 9, 9]) != block_hash(b, [9, 9, 9, 9])


def test_a_second_prompt_takes_the_cached_full_blocks_and_computes_the_rest():
    bm = BlockSpaceManager(BS, 16, 0, watermark=0.0, enable_prefix_caching=True)
    system = [5, 6, 7, 8, 9, 10, 11, 12]  # two full blocks
    first = make_group("a", system + [1, 2, 3])
    assert admit(bm, first) == {0: 0}
    second = make_group("b", system + [4], first_seq_id=1)
    free_before = bm.get_num_free_gpu_blocks()
    assert bm.num_blocks_to_allocate(second) == 1  # only the private last block is new
    assert admit(bm, second) == {1: 8}
    assert bm.get_num_free_gpu_blocks() == free_before - 1
    assert bm.get_block_table(first.seqs[0])[:2] == bm.get_block_table(second.seqs[0])[:2]
    assert [b.ref_count for b in bm.block_tables[1][:2]] == [2, 2]
    assert bm.num_cached_tokens == 8
    check_prefix_cache(bm)


def test_a_fully_cached_prompt_still_computes_the_block_of_its_last_token():
    bm = BlockSpaceManager(BS, 16, 0, watermark=0.0, enable_prefix_caching=True)
    prompt = list(range(10, 18))  # exactly two blocks
    admit(bm, make_group("a", prompt))
    # The last token gives the logits to sample from; its block is never a shared one.
    assert admit(bm, make_group("b", prompt, first_seq_id=1)) == {1: 4}
    tables = bm.block_tables
    assert tables[0][0] is tables[1][0] and tables[0][1] is not tables[1][1]
    check_prefix_cache(bm)


def test_freed_cached_blocks_are_evictable_free_and_found_again():
    bm = BlockSpaceManager(BS, 6, 0, watermark=0.0, enable_prefix_caching=True)
    group = make_group("a", list(range(20, 29)))  # 2 full blocks + 1 partial
    admit(bm, group)
    finish(bm, group)
    # All blocks count as free; the two full ones stay cached (evictable), the partial one not.
    assert bm.get_num_free_gpu_blocks() == 6
    assert len(bm.gpu_allocator.evictable) == 2
    snap = bm.snapshot()
    evictable = [b for b in snap["gpu_blocks"] if b["evictable"]]
    assert len(evictable) == 2 and all(b["block_hash"] is not None for b in evictable)
    assert snap["evictable_gpu_blocks"] == snap["free_gpu_blocks"][-2:]
    again = make_group("b", list(range(20, 29)), first_seq_id=1)
    assert admit(bm, again) == {1: 8}
    assert not bm.gpu_allocator.evictable and bm.gpu_allocator.num_evictions == 0
    check_prefix_cache(bm)


def test_evictable_blocks_are_evicted_least_recently_used_first_and_only_when_needed():
    bm = BlockSpaceManager(BS, 4, 0, watermark=0.0, enable_prefix_caching=True)
    old, new = make_group("old", list(range(30, 35))), make_group("new", list(range(40, 45)),
                                                                  first_seq_id=1)
    admit(bm, old)
    admit(bm, new)  # 4 blocks used: each holds 1 full (cached) + 1 partial block
    finish(bm, old)
    finish(bm, new)
    assert bm.gpu_allocator.num_evictions == 0  # two free blocks: nothing evicted yet
    cache = bm.gpu_allocator

    def tokens_of(block):
        contents = cache.contents.get(block.block_number)
        return contents.token_ids if contents is not None else None

    old_block = next(b for b in cache.blocks if tokens_of(b) == (30, 31, 32, 33))
    # A 3-block prompt needs the 2 free blocks and one evictable: the older one goes.
    admit(bm, make_group("c", list(range(50, 61)), first_seq_id=2))
    assert bm.gpu_allocator.num_evictions == 1
    assert tokens_of(old_block) == (50, 51, 52, 53) or tokens_of(old_block) is None
    assert bm.gpu_allocator.lookup(None, (40, 41, 42, 43)) is not None  # the newer one stays
    assert bm.gpu_allocator.lookup(None, (30, 31, 32, 33)) is None
    check_prefix_cache(bm)


def test_a_hash_collision_is_caught_by_the_token_ids():
    bm = BlockSpaceManager(BS, 16, 0, watermark=0.0, enable_prefix_caching=True)
    bm.gpu_allocator.hash_fn = lambda parent_hash, token_ids: 7  # every block has the same name
    admit(bm, make_group("a", [1, 2, 3, 4, 5]))
    assert admit(bm, make_group("b", [9, 9, 9, 9, 5], first_seq_id=1)) == {1: 0}
    # Same first block, but the second block follows another parent: no hit past the first.
    admit(bm, make_group("c", [1, 2, 3, 4, 6, 6, 6, 6, 1], first_seq_id=2))
    assert bm.block_tables[2][0] is bm.block_tables[0][0]
    check_prefix_cache(bm)


def test_a_swapped_in_block_is_found_again_by_hash_instead_of_copied():
    bm = BlockSpaceManager(BS, 16, 16, watermark=0.0, enable_prefix_caching=True)
    system = list(range(60, 68))
    keeper = make_group("keep", system + [1])
    admit(bm, keeper)
    group = make_group("swap", system + [2, 3], n=2, first_seq_id=1)
    admit(bm, group)
    assert len(bm.swap_out(group)) == 3  # 2 cached blocks (still held by "keep") + 1 private
    for seq in group.get_seqs():
        seq.status = SequenceStatus.SWAPPED
    mapping = bm.swap_in(group)
    assert len(mapping) == 1  # only the private block moves back; the prefix is on the GPU
    assert bm.block_tables[1][:2] == bm.block_tables[0][:2]
    check_prefix_cache(bm)


# -- the engine ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def shared_prefix_prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(2, 256) for _ in range(37)]
    prompts = [system + [rng.randrange(2, 256) for _ in range(rng.randrange(1, 12))]
               for _ in range(5)]
    prompts += [system[:32], system[:32], system[:20] + [7, 7, 7]]  # full hits, partial blocks
    return prompts


def run(path, prompts, params, hash_fn=None, **kwargs):
    # max_model_len: what the small pools (16 blocks of 8 tokens) hold, not the model's 256.
    engine = LLMEngine(path, block_size=8, max_model_len=128, **kwargs)
    if hash_fn is not None:
        engine.block_manager.gpu_allocator.hash_fn = hash_fn
    # Some requests arrive after the first ones have run, when their prefix is cached.
    late = prompts[len(prompts) // 2:]
    for i, prompt in enumerate(prompts[:len(prompts) // 2]):
        engine.add_request(str(i), None, params, prompt)
    outs = {}
    steps = 0
    while engine.has_unfinished_requests() or late:
        if steps == 2:
            for i, prompt in enumerate(late, len(prompts) // 2):
                engine.add_request(str(i), None, params, prompt)
            late = []
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = [(o.token_ids, o.finish_reason) for o in out.outputs]
        if engine.block_manager.enable_prefix_caching:
            check_prefix_cache(engine.block_manager)
        steps += 1
    bm = engine.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert all(b.ref_count == 0 for b in bm.gpu_allocator.blocks)
    return outs, engine.stats


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    "seeded n=3": SamplingParams(temperature=1.0, n=3, seed=11, max_tokens=10, ignore_eos=True),
    "beam": SamplingParams(use_beam_search=True, n=2, temperature=0.0, max_tokens=8,
                           ignore_eos=True),
}
POOLS = {
    "roomy": dict(num_gpu_blocks=64),
    "recompute": dict(num_gpu_blocks=16, preemption_mode="recompute", num_cpu_blocks=0),
    "swap": dict(num_gpu_blocks=16, preemption_mode="swap", num_cpu_blocks=64),
}


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("style", list(PARAMS))
def test_outputs_are_the_same_with_and_without_prefix_caching(tiny_model, style, pool):
    _, path, _ = tiny_model
    prompts = shared_prefix_prompts()
    off, stats_off = run(path, prompts, PARAMS[style], enable_prefix_caching=False,
                         **POOLS[pool])
    on, stats_on = run(path, prompts, PARAMS[style], **POOLS[pool])
    assert on == off
    assert stats_off.num_cached_prompt_tokens == 0
    assert stats_on.num_cached_prompt_tokens > 0
    assert stats_on.num_prompt_tokens < stats_off.num_prompt_tokens
    if pool != "roomy":
        assert stats_on.num_preemptions_recompute + stats_on.num_preemptions_swap > 0


def test_forced_hash_collisions_never_change_the_outputs(tiny_llama):
    path, _ = tiny_llama
    prompts = shared_prefix_prompts(seed=1)
    params = PARAMS["greedy"]
    off, _ = run(path, prompts, params, enable_prefix_caching=False, num_gpu_blocks=16)
    on, stats = run(path, prompts, params, hash_fn=lambda parent, tokens: tokens[0] % 2,
                    num_gpu_blocks=16)
    assert on == off and stats.num_cached_prompt_tokens > 0


def test_stats_count_cached_prompt_tokens_and_evictions(tiny_llama):
    path, _ = tiny_llama
    system = list(range(100, 132))  # 4 blocks of 8
    engine = LLMEngine(path, block_size=8, num_gpu_blocks=8, num_cpu_blocks=0, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(3):  # one after another: each finds the system prompt cached
        engine.add_request(str(i), None, params, system + [i + 2, i + 3])
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.stats.num_cached_prompt_tokens == 2 * 32
    assert engine.stats.num_prompt_tokens == 34 + 2 * 2
    # A long unrelated prompt needs the evictable blocks back.
    engine.add_request("other", None, params, list(range(150, 200)))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats.num_evicted_blocks > 0
    check_prefix_cache(engine.block_manager)


def test_enable_prefix_caching_must_be_a_bool(tiny_llama):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLMEngine(tiny_llama[0], enable_prefix_caching="yes")


def test_reset_prefix_cache_forgets_cached_blocks_once_nothing_holds_them(tiny_llama):
    """vLLM's ``reset_prefix_cache``: after it a prompt is computed again (same tokens); while a
    request holds blocks it refuses and forgets nothing; without prefix caching it is a no-op."""
    from minipaged import LLM, SamplingParams

    path, _ = tiny_llama
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, enable_prefix_caching=True)
    manager = llm.llm_engine.block_manager
    prompt = list(range(3, 23))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    first = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    assert manager.num_cached_tokens == 16  # the second found 4 blocks
    engine = llm.llm_engine
    engine.add_request("held", None, params, prompt_token_ids=prompt)
    engine.step()
    assert llm.reset_prefix_cache() is False  # a request holds blocks: nothing forgotten
    while engine.has_unfinished_requests():
        engine.step()
    assert manager.num_cached_tokens == 32
    assert llm.reset_prefix_cache() is True
    assert manager.gpu_allocator.evictable_block_numbers() == []
    assert manager.get_num_free_gpu_blocks() == manager.num_total_gpu_blocks
    again = llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    assert manager.num_cached_tokens == 32  # computed in full
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    plain = LLM(path, device="cpu", dtype="float32", block_size=4, enable_prefix_caching=False)
    assert plain.reset_prefix_cache() is True


def test_the_throughput_benchmark_computes_every_prompt_every_run(tiny_llama):
    """--pairs runs the same trace again: no run may find the earlier one's blocks."""
    import sys

    from minipaged import LLM
    from repo_paths import ROOT

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput import make_trace, run_minipaged

    path, _ = tiny_llama
    llm = LLM(path, device="cpu", dtype="float32", block_size=4, enable_prefix_caching=True)
    trace = make_trace("uniform", 6, (8, 20), (2, 5), 64, 256, 0)
    for _ in range(2):
        run_minipaged(llm, trace)
        assert llm.llm_engine.block_manager.num_cached_tokens == 0
