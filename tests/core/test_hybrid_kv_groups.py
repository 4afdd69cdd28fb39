"""KV cache groups for a hybrid model (``core/hybrid_block_manager.py``, lesson 20): the tiny
Gemma 3 (five sliding layers of window 16 in six) on prompts longer than its window gives
transformers' greedy tokens and the every-block engine's tokens and logprobs, while its sliding
groups hold only their window; the same memory admits more requests; the settings the groups
do not run with keep every block."""
import pytest
import torch

from minipaged import SamplingParams
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.hybrid_block_manager import HybridBlockManager
from minipaged.engine.llm_engine import LLMEngine
from minipaged.lab.invariants import check_block_manager
from minipaged.lab.tiny_families import save_tiny, tiny_config
from minipaged.model_shape import KVGroup, ModelShape, kv_groups, layer_kv_groups
from tiny_models import greedy_reference, pick_prompts
from workloads import run_to_end as run

SETTINGS = dict(block_size=4, dtype="float32", enable_prefix_caching=False, max_model_len=128)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_hybrid")
    return str(path), save_tiny("gemma3", path, seed=5)


def test_kv_groups_cut_each_kind_into_groups_of_equal_size():
    # the tiny Gemma 3: five sliding, one full -> six groups of one layer, full first
    tiny = ModelShape.from_hf(tiny_config("gemma3")).windows
    assert kv_groups(tiny) == (KVGroup(None, (5,)),) + tuple(KVGroup(16, (i,)) for i in range(5))
    assert layer_kv_groups(tiny) == ((1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (0, 0))
    # Gemma 3 270M: 15 sliding (window 512), 3 full -> one full group and five sliding of 3
    real = tuple(None if i % 6 == 5 else 512 for i in range(18))
    groups = kv_groups(real)
    assert [g.window for g in groups] == [None] + [512] * 5
    assert groups[0].layers == (5, 11, 17) and groups[1].layers == (0, 1, 2)
    assert {len(g.layers) for g in groups} == {3}
    assert sorted(layer for g in groups for layer in g.layers) == list(range(18))
    assert {place for _, place in layer_kv_groups(real)} == {0, 1, 2}  # three cache tensors
    # one kind of layer: one group
    assert kv_groups((None, None)) == (KVGroup(None, (0, 1)),)
    assert kv_groups((8, 8)) == (KVGroup(8, (0, 1)),)


def test_hybrid_manager_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="first KV cache group must be a full"):
        HybridBlockManager(4, 10, 0, windows=(8, None), sink_block=10)


@pytest.mark.slow  # (about 35 s on 2 cores: picking prompts with clear greedy paths)
def test_greedy_tokens_equal_transformers_and_the_every_block_engine(gemma3):
    path, hf = gemma3
    prompts = pick_prompts(hf, [40, 23, 57], 24, seed=1)  # longer than the window of 16
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)] * 3
    hybrid = LLMEngine(path, num_gpu_blocks=64, kv_cache_groups=True, **SETTINGS)
    keeping = LLMEngine(path, num_gpu_blocks=64, kv_cache_groups=False, **SETTINGS)
    manager = hybrid.scheduler.block_manager
    assert isinstance(manager, HybridBlockManager) and len(manager.groups) == 5
    assert type(keeping.scheduler.block_manager) is BlockSpaceManager
    # the same memory: 64 blocks of six layers are 384 blocks of one layer
    assert manager.num_total_gpu_blocks == 64 * 6
    got, want = run(hybrid, prompts, params), run(keeping, prompts, params)
    with torch.no_grad():
        reference = [greedy_reference(hf, p, 24) for p in prompts]
    for a, b, ref in zip(got, want, reference):
        assert a.outputs[0].token_ids == ref == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(
            b.outputs[0].cumulative_logprob, abs=1e-4)
    assert manager.get_num_free_gpu_blocks() == manager.num_total_gpu_blocks
    assert check_block_manager(manager) == []


def test_sliding_groups_hold_only_their_window(gemma3):
    """A 40-token prompt decoding to 100 tokens: the full group holds every block, each
    sliding group at most 16 / 4 + 2 blocks, and the invariants hold at every step."""
    path, _ = gemma3
    engine = LLMEngine(path, num_gpu_blocks=64, kv_cache_groups=True, **SETTINGS)
    manager = engine.scheduler.block_manager
    engine.add_request("r", None, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                       prompt_token_ids=list(range(3, 43)))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        for seq_id, table in manager.block_tables.items():
            sliding = [g.num_held_blocks(g.seqs[seq_id]) for g in manager.groups]
            held.append((len(table), max(sliding)))
            tables = manager.other_group_tables(manager.seqs[seq_id])
            assert all(t[0] == manager.sink_block for t in tables)  # left the window: sink
        assert check_block_manager(manager) == []
    assert max(full for full, _ in held) == 25  # 99 tokens computed + the newest: 25 blocks
    assert max(sliding for _, sliding in held) <= 6
    # a request holds 25 + 5 x 6 = 55 one-layer blocks at most, not 6 x 25 = 150
    assert manager.get_num_free_gpu_blocks() == manager.num_total_gpu_blocks


def test_the_same_memory_runs_more_requests_at_once(gemma3):
    """Eight 40-token prompts decoding 40 tokens each in the memory of 64 blocks of every
    layer: the every-block engine preempts, the hybrid one runs them side by side."""
    path, _ = gemma3
    prompts = [[3 + (i * 7 + j) % 250 for j in range(40)] for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 8
    hybrid = LLMEngine(path, num_gpu_blocks=64, kv_cache_groups=True, **SETTINGS)
    keeping = LLMEngine(path, num_gpu_blocks=64, kv_cache_groups=False, **SETTINGS)
    got, want = run(hybrid, prompts, params), run(keeping, prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert keeping.stats.num_preemptions_recompute > 0
    assert hybrid.stats.num_preemptions_recompute == 0


def test_a_lone_request_of_the_whole_pool_runs(gemma3):
    """The bound of one request: admitting it asks room for its whole prompt in every group
    (as many bytes as keeping every block), so max_model_len is what the every-block engine
    allows from the same memory, and a request that long runs alone."""
    path, _ = gemma3
    settings = dict(SETTINGS, max_model_len=121, num_gpu_blocks=30)
    for groups in (True, False):  # neither holds 121 tokens in 30 blocks of 4 tokens
        with pytest.raises(ValueError, match="pass max_model_len=120"):
            LLMEngine(path, kv_cache_groups=groups, **settings)
    settings["max_model_len"] = 120
    hybrid = LLMEngine(path, kv_cache_groups=True, **settings)
    keeping = LLMEngine(path, kv_cache_groups=False, **settings)
    prompt = [3 + j % 250 for j in range(100)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)]
    got, want = run(hybrid, [prompt], params), run(keeping, [prompt], params)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    with pytest.raises(ValueError):  # 121 tokens: past the pool
        hybrid.add_request("long", None, SamplingParams(max_tokens=1),
                           prompt_token_ids=prompt + prompt[:21])


@pytest.mark.parametrize("settings", [
    dict(kv_cache_groups=False),
])
def test_settings_the_groups_do_not_run_with_keep_every_block(gemma3, settings):
    path, _ = gemma3
    engine = LLMEngine(path, **{**SETTINGS, "kv_cache_groups": True, "num_gpu_blocks": 64, **settings})
    assert type(engine.scheduler.block_manager) is BlockSpaceManager
    assert engine.scheduler.block_manager.num_total_gpu_blocks == 64


def test_a_model_of_one_kind_keeps_todays_path(tmp_path):
    save_tiny("llama", tmp_path, seed=1)
    engine = LLMEngine(str(tmp_path), num_gpu_blocks=40, kv_cache_groups=True, **SETTINGS)
    assert type(engine.scheduler.block_manager) is BlockSpaceManager
    cache = engine.worker.cache_engine
    assert cache.layer_places is None and cache.gpu_cache is cache.gpu_tensors
    assert all(layer.self_attn.kv_group == 0 for layer in engine.worker.model.layers)


def test_snapshot_names_every_group_as_owner(gemma3):
    """Every held block of the pool has its owners and its group in the snapshot (the
    visualizer's data), whichever group's table holds it."""
    path, _ = gemma3
    engine = LLMEngine(path, num_gpu_blocks=64, kv_cache_groups=True, **SETTINGS)
    engine.add_request("r", None, SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=8,
                                                 ignore_eos=True),
                       prompt_token_ids=list(range(3, 43)))
    for _ in range(3):
        engine.step()
    snap = engine.scheduler.block_snapshot()
    held = [b for b in snap["gpu_blocks"] if b["ref_count"]]
    assert held and all(len(b["owners"]) == b["ref_count"] for b in held)
    assert {b["kv_group"] for b in held} == set(range(6))
    assert len(snap["kv_groups"]) == 5 and all(g["window"] == 16 for g in snap["kv_groups"])
    assert all(t[0] == -1 for g in snap["kv_groups"] for t in g["block_tables"].values())
    engine.abort_request("r")
    manager = engine.scheduler.block_manager
    assert manager.get_num_free_gpu_blocks() == manager.num_total_gpu_blocks
    assert all(not g.block_tables for g in manager.groups)


def test_an_8bit_cache_runs_with_groups(gemma3):
    """int8 K/V (lesson 18): the scales share the groups' tensors too; the same tokens as the
    every-block engine with the same cache."""
    path, _ = gemma3
    prompts = [[3 + (i * 5 + j) % 250 for j in range(30)] for i in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)] * 3
    settings = dict(SETTINGS, num_gpu_blocks=64, kv_cache_dtype="int8")
    got = run(LLMEngine(path, kv_cache_groups=True, **settings), prompts, params)
    want = run(LLMEngine(path, kv_cache_groups=False, **settings), prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want):  # (1e-3: the measured matmul routine may sum in another
        # order, and an 8-bit cache can turn that into a quantization step: -5.8212 vs -5.8205)
        assert a.outputs[0].cumulative_logprob == pytest.approx(
            b.outputs[0].cumulative_logprob, abs=1e-3)


def test_one_table_for_every_layer_is_refused_on_a_grouped_cache(gemma3):
    """Code that drives the model by hand with one block table would write the groups' K/V
    over each other: the layers refuse a step without each group's tables."""
    from paged_forward import prefill_meta

    path, _ = gemma3
    engine = LLMEngine(path, num_gpu_blocks=64, kv_cache_groups=True, **SETTINGS)
    meta = prefill_meta([4], [0, 1, 2, 3])
    with pytest.raises(ValueError, match="group_metas"):
        engine.worker.model(torch.tensor([5, 6, 7, 8]), torch.arange(4),
                            engine.worker.cache_engine.gpu_cache, meta)


def test_cuda_keeps_every_block(gemma3):
    """Without starting ranks or a GPU: the decision alone (engine/cache_setup.py); tensor
    parallel and a draft model have the groups (tests/models/test_families_tensor_parallel.py,
    test_draft_model_speculation_runs_with_groups)."""
    from types import SimpleNamespace

    from minipaged.config import EngineConfig
    from minipaged.engine.cache_setup import hybrid_groups

    path, hf = gemma3
    shape = ModelShape.from_hf(hf.config)
    on_cpu = SimpleNamespace(device=torch.device("cpu"))
    assert len(hybrid_groups(EngineConfig.from_settings(path, kv_cache_groups=True), shape,
                             on_cpu)) == 6
    assert len(hybrid_groups(EngineConfig.from_settings(path), shape, on_cpu)) == 6  # default
    assert hybrid_groups(EngineConfig.from_settings(path, kv_cache_groups=False), shape,
                         on_cpu) is None
    assert hybrid_groups(EngineConfig.from_settings(path, kv_cache_groups=True,
                                                    tensor_parallel_size=2), shape,
                         on_cpu) is not None
    assert hybrid_groups(EngineConfig.from_settings(path, kv_cache_groups=True), shape,
                         SimpleNamespace(device=torch.device("cuda"))) is None
    draft = {"method": "draft", "model": path, "num_speculative_tokens": 2}
    assert hybrid_groups(EngineConfig.from_settings(path, kv_cache_groups=True,
                                                    speculative_config=draft), shape,
                         on_cpu) is not None


def test_prompt_lookup_speculation_runs_with_groups(gemma3):
    """n-gram drafts: lookahead slots reserved and rolled back in every group; the tokens are
    the every-block engine's, and drafts were accepted (the path ran)."""
    path, _ = gemma3
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    settings = dict(SETTINGS, num_gpu_blocks=64, speculative_config=spec)
    prompts = [[5, 6, 7, 8] * 9, [9, 10, 11] * 10]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 2
    hybrid = LLMEngine(path, kv_cache_groups=True, **settings)
    assert isinstance(hybrid.scheduler.block_manager, HybridBlockManager)
    got = run(hybrid, prompts, params)
    want = run(LLMEngine(path, kv_cache_groups=False, **settings), prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert hybrid.stats.num_spec_accepted_tokens > 0
    manager = hybrid.scheduler.block_manager
    assert manager.get_num_free_gpu_blocks() == manager.num_total_gpu_blocks


@pytest.mark.parametrize("num_gpu_blocks", [64, 20])  # 20: preempted by recompute
def test_draft_model_speculation_runs_with_groups(gemma3, tmp_path, num_gpu_blocks):
    """A draft model (another tiny Gemma 3) reads its own KV through the full group's table,
    which keeps every block; the lookahead slots are reserved and rolled back in every group.
    Prompts past the window of 16, a prefix hit, greedy requests (and in the roomy pool an
    n = 2 sampled one): the tokens and logprobs are the every-block engine's, drafts were accepted
    (and, in the roomy pool, rejected), the tight pool preempted.

    NOTE: sampling only where the pool is roomy: a tight pool lowers a sequence's lookahead
    by what is free, which differs between the two engines' pools, and a seeded draw after
    another number of drafts is another draw (the property tests run speculation greedy)."""
    path, _ = gemma3
    save_tiny("gemma3", tmp_path, seed=9)  # the draft: same vocabulary, other weights
    spec = {"method": "draft", "model": str(tmp_path), "num_speculative_tokens": 3}
    settings = dict(SETTINGS, num_gpu_blocks=num_gpu_blocks, speculative_config=spec,
                    enable_prefix_caching=True, preemption_mode="recompute", seed=0,
                    max_model_len=64)
    start = list(range(30, 54))
    prompts = [start + [3, 4], list(range(60, 79)), start + [7]]
    prompts.append(list(range(90, 115)))
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=30, ignore_eos=True,
                             logprobs=2)
    params = [greedy, sampled if num_gpu_blocks == 64 else greedy, greedy, greedy]
    hybrid = LLMEngine(path, kv_cache_groups=True, **settings)
    assert isinstance(hybrid.scheduler.block_manager, HybridBlockManager)
    got = run(hybrid, prompts, params)
    want = run(LLMEngine(path, kv_cache_groups=False, **settings), prompts, params)
    for a, b in zip(got, want):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        for x, y in zip(a.outputs, b.outputs):
            assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)
    stats = hybrid.stats
    assert stats.num_spec_accepted_tokens > 0
    if num_gpu_blocks == 64:  # (the greedy paths of these random models agree throughout)
        assert stats.num_spec_accepted_tokens < stats.num_spec_proposed_tokens
    else:
        assert stats.num_preemptions_recompute > 0
    manager = hybrid.scheduler.block_manager
    assert all(g.num_dropped_blocks > 0 for g in manager.groups)
    assert manager.get_num_free_gpu_blocks() == manager.num_total_gpu_blocks


def test_multi_step_decode_runs_with_groups(gemma3):
    """num_scheduler_steps = 4: the later steps' slots laid out from every group's table (the
    lookahead reserved in each), prompts past the window of 16 and a prefix hit; the tokens and
    logprobs are the every-block engine's, several steps ran per schedule, and every block came
    back."""
    path, _ = gemma3
    settings = dict(SETTINGS, num_gpu_blocks=64, num_scheduler_steps=4,
                    enable_prefix_caching=True)
    start = list(range(30, 54))
    prompts = [start + [3, 4], list(range(60, 79)), start + [7]]  # the third hits the first's
    params = [SamplingParams(temperature=0, max_tokens=27, ignore_eos=True, logprobs=2)] * 3
    hybrid = LLMEngine(path, kv_cache_groups=True, **settings)
    assert isinstance(hybrid.scheduler.block_manager, HybridBlockManager)
    got = run(hybrid, prompts, params)
    want = run(LLMEngine(path, kv_cache_groups=False, **settings), prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want):
        assert a.outputs[0].cumulative_logprob == pytest.approx(
            b.outputs[0].cumulative_logprob, abs=1e-4)
    assert hybrid.multi_step.num_later_steps > 0
    manager = hybrid.scheduler.block_manager
    assert all(g.num_dropped_blocks > 0 for g in manager.groups)
    assert manager.get_num_free_gpu_blocks() == manager.num_total_gpu_blocks


def test_a_block_in_two_groups_tables_is_named(gemma3):
    """lab/invariants.py: a block held by two groups' tables breaks "a block serves one KV
    cache group" (and its ref count)."""
    path, _ = gemma3
    engine = LLMEngine(path, num_gpu_blocks=64, kv_cache_groups=True, **SETTINGS)
    engine.add_request("r", None, SamplingParams(max_tokens=4, ignore_eos=True),
                       prompt_token_ids=list(range(3, 23)))
    engine.step()
    manager = engine.scheduler.block_manager
    (seq_id,) = manager.block_tables
    manager.groups[0].block_tables[seq_id][-1] = manager.block_tables[seq_id][0]
    found = {v.invariant for v in check_block_manager(manager)}
    assert "a block serves one KV cache group" in found
    assert "ref count = tables holding it" in found
