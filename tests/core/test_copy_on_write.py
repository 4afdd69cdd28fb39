"""Copy-on-write is real: it happens in the cache tensors, not only in the block tables (lesson 03).

Three levels:
- the block manager, the cache engine and ``reshape_and_cache`` driven by hand with random K/V;
- the engine running parallel sampling and beam search on a tiny model, where after every step
  each sequence's K/V, read through its own block table, must equal the K/V that transformers
  computes for that sequence's tokens;
- the same requests with sharing turned off (every sequence holds private copies) must give the
  same tokens with more blocks.
"""
from __future__ import annotations

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.kernels import ops, reference
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.lab.no_sharing import NoSharingBlockManager
from minipaged.worker.cache_engine import CacheEngine
from minipaged.engine.llm_engine import LLMEngine
from minipaged.core.scheduler import Scheduler, SchedulerConfig
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus

pytestmark = pytest.mark.lesson03

BLOCK_SIZE = 4


# -- by hand -------------------------------------------------------------------------------------
def _read_kv(cache: CacheEngine, table: list[int], length: int, layer: int = 0):
    """A sequence's keys and values as dense (kv_heads, length, head_size) tensors."""
    key_cache, value_cache = cache.gpu_cache[layer]
    k, v = reference.gather_kv(key_cache, value_cache, torch.tensor([table], dtype=torch.int32))
    return k[0, :, :length], v[0, :, :length]


def _write_kv(cache: CacheEngine, table: list[int], positions: list[int], k, v) -> None:
    slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                          for p in positions])
    for key_cache, value_cache in cache.gpu_cache:
        ops.reshape_and_cache(k, v, key_cache, value_cache, slots)


def test_fork_then_divergent_appends_copy_the_shared_last_block():
    torch.manual_seed(0)
    heads, head_size, prompt_len = 2, 8, 6  # the prompt ends half-way into its second block
    cache = CacheEngine(2, heads, head_size, BLOCK_SIZE, num_gpu_blocks=8, num_cpu_blocks=0,
                        dtype=torch.float32, device=torch.device("cpu"))
    bm = BlockSpaceManager(BLOCK_SIZE, num_gpu_blocks=8, num_cpu_blocks=0, watermark=0.0)
    scheduler = Scheduler(SchedulerConfig(), bm)
    prompt = list(range(10, 10 + prompt_len))
    parent = Sequence(0, None, prompt, BLOCK_SIZE)
    group = SequenceGroup("r", [parent], SamplingParams(), arrival_time=0.0)

    # Prefill: the parent's prompt K/V go into its blocks.
    bm.allocate(group)
    parent.status = SequenceStatus.RUNNING
    prompt_k = torch.randn(prompt_len, heads, head_size)  # (T, kv_heads, D)
    prompt_v = torch.randn(prompt_len, heads, head_size)
    _write_kv(cache, bm.get_block_table(parent), list(range(prompt_len)), prompt_k, prompt_v)
    parent.num_computed_tokens = prompt_len

    # Fork: the child shares every block, including the half-full last one.
    child = Sequence(1, None, prompt, BLOCK_SIZE)
    child.copy_state_from(parent)
    child.status = SequenceStatus.RUNNING
    bm.fork(parent, child)
    group.seqs.append(child)
    assert bm.get_block_table(child) == bm.get_block_table(parent)
    assert all(b.ref_count == 2 for b in bm.block_tables[parent.seq_id])

    # Divergent appends: each sequence gets a different token with different K/V.
    parent.append_token_id(100, {100: 0.0})
    child.append_token_id(200, {200: 0.0})
    blocks_to_copy: dict[int, list[int]] = {}
    scheduler._append_slots(group, blocks_to_copy)
    parent_table, child_table = bm.get_block_table(parent), bm.get_block_table(child)
    assert parent_table[0] == child_table[0]  # the full first block is still shared
    assert parent_table[1] != child_table[1]  # the written last block is not
    assert blocks_to_copy == {child_table[1]: [parent_table[1]]} or \
        blocks_to_copy == {parent_table[1]: [child_table[1]]}
    cache.copy(blocks_to_copy)
    new_k = torch.randn(2, heads, head_size)
    new_v = torch.randn(2, heads, head_size)
    _write_kv(cache, parent_table, [prompt_len], new_k[:1], new_v[:1])
    _write_kv(cache, child_table, [prompt_len], new_k[1:], new_v[1:])

    for seq, table, row in ((parent, parent_table, 0), (child, child_table, 1)):
        for layer in range(2):
            k, v = _read_kv(cache, table, prompt_len + 1, layer)  # (kv_heads, L, D)
            expected_k = torch.cat([prompt_k, new_k[row:row + 1]]).transpose(0, 1)
            expected_v = torch.cat([prompt_v, new_v[row:row + 1]]).transpose(0, 1)
            # Exact: the prompt is the same bytes, copied, never recomputed.
            assert torch.equal(k, expected_k), seq
            assert torch.equal(v, expected_v), seq
    assert bm.gpu_allocator.blocks[parent_table[1]].ref_count == 1
    assert bm.gpu_allocator.blocks[child_table[1]].ref_count == 1
    assert bm.gpu_allocator.blocks[parent_table[0]].ref_count == 2


def test_copy_blocks_copies_every_layer_and_only_the_named_blocks():
    torch.manual_seed(1)
    cache = CacheEngine(3, 2, 8, BLOCK_SIZE, num_gpu_blocks=6, num_cpu_blocks=0,
                        dtype=torch.float32, device=torch.device("cpu"))
    for k, v in cache.gpu_cache:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in cache.gpu_cache]
    cache.copy({1: [3, 4], 2: [5]})
    for (k, v), (k0, v0) in zip(cache.gpu_cache, before):
        for src, dst in ((1, 3), (1, 4), (2, 5)):
            assert torch.equal(k[dst], k0[src]) and torch.equal(v[dst], v0[src])
        for untouched in (0, 1, 2):
            assert torch.equal(k[untouched], k0[untouched])
            assert torch.equal(v[untouched], v0[untouched])


# -- in the engine -------------------------------------------------------------------------------
@torch.no_grad()
def _reference_kv(model, token_ids: list[int]):
    """transformers' per-layer keys and values for these tokens: (kv_heads, L, D) each."""
    cache = model(torch.tensor([token_ids]), use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def _engine_kv(engine: LLMEngine, seq: Sequence, length: int):
    table = engine.block_manager.get_block_table(seq)
    tables = torch.tensor([table], dtype=torch.int32)
    result = []
    for key_cache, value_cache in engine.worker.cache_engine.gpu_cache:
        k, v = reference.gather_kv(key_cache, value_cache, tables)  # (1, kv_heads, L', D)
        result.append((k[0, :, :length], v[0, :, :length]))
    return result


def _check_every_running_sequence(engine: LLMEngine, model, group: SequenceGroup) -> int:
    checked = 0
    for seq in group.get_seqs(SequenceStatus.RUNNING):
        n = seq.num_computed_tokens  # the newest token is sampled, not yet in the cache
        ours = _engine_kv(engine, seq, n)
        ref = _reference_kv(model, seq.get_token_ids()[:n])
        for (k, v), (rk, rv) in zip(ours, ref):
            torch.testing.assert_close(k, rk, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(v, rv, atol=1e-4, rtol=1e-4)
        checked += 1
    return checked


def test_parallel_sampling_copies_the_prompts_last_block_and_keeps_the_original(tiny_llama):
    path, model = tiny_llama
    engine = LLMEngine(path, block_size=BLOCK_SIZE, num_gpu_blocks=32, num_cpu_blocks=0,
                       max_model_len=128)
    snapshots = []
    engine.add_observer(snapshots.append)
    prompt = [5, 17, 33, 60, 91, 120]  # 6 tokens: the last block is half full and shared
    params = SamplingParams(n=2, temperature=1.5, seed=3, max_tokens=6, ignore_eos=True)
    engine.add_request("a", None, params, prompt_token_ids=prompt)
    group = engine.scheduler.waiting[0]
    seq_a, seq_b = group.seqs

    engine.step()  # prefill: one prompt computation, shared blocks
    assert engine.stats.num_prompt_tokens == len(prompt)
    shared = engine.block_manager.get_block_table(seq_a)
    assert shared == engine.block_manager.get_block_table(seq_b)
    prompt_kv = [(k.clone(), v.clone()) for k, v in _engine_kv(engine, seq_a, len(prompt))]
    assert seq_a.output_token_ids != seq_b.output_token_ids, "pick a seed where samples differ"

    engine.step()  # first decode: the shared last block is written by both -> one copy
    table_a = engine.block_manager.get_block_table(seq_a)
    table_b = engine.block_manager.get_block_table(seq_b)
    assert table_a[0] == table_b[0] == shared[0]  # the full first block stays shared
    assert shared[1] in (table_a[1], table_b[1]) and table_a[1] != table_b[1]
    copy = table_a[1] if table_a[1] != shared[1] else table_b[1]
    assert snapshots[-1].blocks_to_copy == {shared[1]: [copy]}
    assert engine.stats.num_blocks_copied == 1

    for seq in (seq_a, seq_b):
        # The prompt's K/V are unchanged bytes in both (the copy is exact, nothing recomputed).
        for (k, v), (k0, v0) in zip(_engine_kv(engine, seq, len(prompt)), prompt_kv):
            assert torch.equal(k, k0) and torch.equal(v, v0)
    # Each sequence's own new token went into its own block.
    assert _check_every_running_sequence(engine, model, group) == 2
    slot = len(prompt) % BLOCK_SIZE
    key_cache = engine.worker.cache_engine.gpu_cache[0][0]
    assert not torch.equal(key_cache[table_a[1], :, :, slot], key_cache[table_b[1], :, :, slot])

    while engine.has_unfinished_requests():
        engine.step()
        if engine.has_unfinished_requests():
            _check_every_running_sequence(engine, model, group)
    assert engine.block_manager.get_num_free_gpu_blocks() == 32


@pytest.mark.parametrize("width", [3])
def test_beam_search_forks_keep_every_beams_cache_exact(tiny_model, width):
    kind, path, model = tiny_model
    engine = LLMEngine(path, block_size=BLOCK_SIZE, num_gpu_blocks=64, num_cpu_blocks=0)
    params = SamplingParams(n=width, use_beam_search=True, temperature=0.0, max_tokens=10,
                            ignore_eos=True)
    engine.add_request("beam", None, params, prompt_token_ids=[7, 8, 9, 10, 11])
    group = engine.scheduler.waiting[0]
    events = []
    engine.block_manager.add_listener(lambda e: events.append(e["op"]))
    while engine.has_unfinished_requests():
        engine.step()
        if engine.has_unfinished_requests():
            assert _check_every_running_sequence(engine, model, group) == width
    forks = events.count("fork")
    assert forks > 0, "this prompt never re-forked a beam; the test would prove nothing"
    assert events.count("copy_on_write") > 0
    assert engine.block_manager.get_num_free_gpu_blocks() == 64


# -- sharing off: same tokens, more memory ------------------------------------------------------
def _run(llm: LLM, prompts, params, share: bool):
    engine = llm.llm_engine
    manager_class = BlockSpaceManager if share else NoSharingBlockManager
    engine.scheduler.replace_block_manager(manager_class.like(engine.block_manager))
    assert type(engine.block_manager) is manager_class
    llm.llm_engine.stats.peak_gpu_blocks_used = 0
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return ([[(o.token_ids, o.cumulative_logprob) for o in r.outputs] for r in outs],
            llm.llm_engine.stats.peak_gpu_blocks_used)


@pytest.mark.parametrize("params", [
    SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True),
    SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=12, ignore_eos=True),
], ids=["parallel", "beam"])
def test_without_sharing_the_tokens_are_the_same_and_the_blocks_more(tiny_llama, params):
    path, _ = tiny_llama
    llm = LLM(path, block_size=BLOCK_SIZE, num_gpu_blocks=128, num_cpu_blocks=0)
    prompts = [[3 + i for i in range(9)], [40 + 2 * i for i in range(13)]]
    shared_out, shared_peak = _run(llm, prompts, params, share=True)
    private_out, private_peak = _run(llm, prompts, params, share=False)
    # The copies are real data copies: were one wrong, the private run would sample differently.
    # (The same tokens; the log-probabilities to float rounding: without sharing the prompt
    # steps hold more rows, which the CPU's matmul may add up in another order.)
    assert [[ids for ids, _ in r] for r in private_out] == [[ids for ids, _ in r]
                                                             for r in shared_out]
    assert [lp for r in private_out for _, lp in r] == pytest.approx(
        [lp for r in shared_out for _, lp in r], abs=1e-3)
    assert private_peak > shared_peak
    bm = llm.llm_engine.block_manager
    assert bm.get_num_free_gpu_blocks() == 128


def test_the_block_manager_is_replaced_only_while_no_request_is_queued(tiny_llama):
    path, _ = tiny_llama
    engine = LLMEngine(path, block_size=BLOCK_SIZE, num_gpu_blocks=32, num_cpu_blocks=0,
                       max_model_len=64)
    old = engine.block_manager
    engine.add_request("r", None, SamplingParams(max_tokens=2), prompt_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="queued"):
        engine.scheduler.replace_block_manager(NoSharingBlockManager.like(old))
    assert engine.block_manager is old and engine.scheduler.block_manager is old
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="pools"):
        engine.scheduler.replace_block_manager(NoSharingBlockManager(BLOCK_SIZE, 16, 0))
    assert engine.block_manager is old and engine.scheduler.block_manager is old
    new = NoSharingBlockManager.like(old)
    engine.scheduler.replace_block_manager(new)
    assert engine.block_manager is new and engine.scheduler.block_manager is new
