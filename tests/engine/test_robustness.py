"""An accepted request always finishes (lesson 04): preemption of groups, swap-in accounting,
seeds that mean the same tokens everywhere, and validation before anything is queued.

Slow (left out of `make test`): the five tests that run whole preempted workloads twice, about 90 s
together on the 2-core machine (measured at load ~15).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minipaged import LLM, LLMEngine, SamplingParams
from tiny_models import greedy_reference, pick_prompts

pytestmark = pytest.mark.lesson04

BLOCK = 4


def _generate(path, prompts, params, **engine_kwargs):
    llm = LLM(path, block_size=BLOCK, max_model_len=64, **engine_kwargs)
    snapshots = []
    llm.llm_engine.add_observer(snapshots.append)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return llm, outs, snapshots


def _tokens(outs):
    return [[o.token_ids for o in r.outputs] for r in outs]


def _all_free(llm):
    bm = llm.llm_engine.block_manager
    return (bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
            and bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
            and all(b.ref_count == 0 for b in bm.gpu_allocator.blocks + bm.cpu_allocator.blocks))


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    _, model = tiny_llama
    return pick_prompts(model, [9, 6, 11], 20, seed=3)


# -- preemption of groups ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_seeded_groups_preempted_either_way_give_the_tokens_of_a_roomy_pool(tiny_llama, prompts,
                                                                             mode):
    path, _ = tiny_llama
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=20, ignore_eos=True)
    _, roomy, _ = _generate(path, prompts, params, num_gpu_blocks=256)
    # 24 blocks of 4 tokens: one group (3 samples of up to 31 tokens, 20 blocks) fits, three
    # do not.
    llm, tight, _ = _generate(path, prompts, params, num_gpu_blocks=24, num_cpu_blocks=64,
                              watermark=0.0, preemption_mode=mode)
    stats = llm.llm_engine.stats
    preemptions = (stats.num_preemptions_recompute if mode == "recompute"
                   else stats.num_preemptions_swap)
    assert preemptions > 0
    assert stats.num_aborted_by_engine == 0
    assert _tokens(tight) == _tokens(roomy)
    assert _all_free(llm)


@pytest.mark.slow
def test_a_recomputed_group_computes_its_shared_prompt_once_and_shares_its_blocks_again(
        tiny_llama, prompts):
    path, _ = tiny_llama
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=20, ignore_eos=True)
    llm = LLM(path, block_size=BLOCK, max_model_len=64, num_gpu_blocks=24, watermark=0.0,
              preemption_mode="recompute")
    bm = llm.llm_engine.block_manager
    admissions: dict[str, int] = {}
    readmitted = []

    def on_event(event):
        if event["op"] != "allocate":
            return
        request_id = event["request_id"]
        admissions[request_id] = admissions.get(request_id, 0) + 1
        if admissions[request_id] > 1:  # back after a preemption by recompute
            seqs = [bm.seqs[i] for i in event["seq_ids"]]
            tables = [bm.block_tables[s.seq_id] for s in seqs]
            full = seqs[0].get_prompt_len() // BLOCK
            assert all(t[:full] == tables[0][:full] for t in tables)  # the very same blocks
            assert all(b.ref_count == len(seqs) for b in tables[0][:full])
            readmitted.append(request_id)

    bm.add_listener(on_event)
    prompt_tokens_before = 0
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    stats = llm.llm_engine.stats
    assert stats.num_preemptions_recompute > 0 and readmitted
    _, roomy, _ = _generate(path, prompts, params, num_gpu_blocks=256)
    assert _tokens(outs) == _tokens(roomy)
    # Each re-admission computed the shared prompt once, not once per sample.
    per_sample = sum(3 * (len(p) + 20) for p in prompts)
    assert stats.num_prompt_tokens - prompt_tokens_before < per_sample * (1 + len(readmitted))
    assert _all_free(llm)


@pytest.mark.slow
def test_beam_search_preempted_by_recompute_keeps_its_beams(tiny_llama):
    path, model = tiny_llama
    from beam_prompts import pick_beam_prompts

    beam_prompts = [p for p, _ in pick_beam_prompts(model, 3, seed=21, lengths=(6, 5, 7),
                                                    steps=12)]
    params = SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=12,
                            ignore_eos=True)
    _, roomy, _ = _generate(path, beam_prompts, params, num_gpu_blocks=256)
    llm, tight, _ = _generate(path, beam_prompts, params, num_gpu_blocks=16, num_cpu_blocks=0,
                              watermark=0.0)
    assert llm.llm_engine.stats.num_preemptions_recompute > 0
    assert _tokens(tight) == _tokens(roomy)
    assert _all_free(llm)


def test_a_single_sequence_forced_to_swap_with_a_watermark_comes_back(tiny_llama, prompts):
    path, model = tiny_llama
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # 20 blocks with 2 kept free: three sequences of up to 8 blocks cannot all run at once.
    llm, outs, _ = _generate(path, prompts, params, num_gpu_blocks=20, num_cpu_blocks=64,
                             watermark=0.1, preemption_mode="swap")
    stats = llm.llm_engine.stats
    assert stats.num_preemptions_swap > 0 and stats.num_aborted_by_engine == 0
    assert _tokens(outs) == [[greedy_reference(model, p, 20)] for p in prompts]
    assert _all_free(llm)


# -- seeds ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_seeded_samples_do_not_depend_on_pool_mode_batch_or_admission_step(tiny_gpt2, prompts):
    path, _ = tiny_gpt2
    seeded = SamplingParams(n=2, temperature=1.0, seed=2024, max_tokens=16, ignore_eos=True)
    alone = _tokens(_generate(path, [prompts[0]], seeded, num_gpu_blocks=256)[1])[0]
    others = SamplingParams(n=2, temperature=0.8, max_tokens=16, ignore_eos=True)
    for kwargs in (dict(num_gpu_blocks=16, preemption_mode="recompute", watermark=0.0),
                   dict(num_gpu_blocks=16, preemption_mode="swap", watermark=0.0),
                   dict(num_gpu_blocks=64)):
        llm = LLM(path, block_size=BLOCK, max_model_len=64, **kwargs)
        engine = llm.llm_engine
        engine.add_request("other-1", None, others, prompts[1])
        engine.add_request("other-2", None, others, prompts[2])
        for _ in range(3):  # admitted at a later step, into a busy batch
            engine.step()
        engine.add_request("seeded", None, seeded, prompts[0])
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "seeded" and out.finished:
                    final = out
        assert [o.token_ids for o in final.outputs] == alone, kwargs
    # The two samples of one request differ (each sequence has its own generator).
    assert alone[0] != alone[1]


# -- validation before anything is queued --------------------------------------------------------
@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=math.inf), "temperature"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=True), "temperature"), (dict(top_p=True), "top_p"),
    (dict(presence_penalty=False), "presence_penalty"), (dict(seed=2**64), "seed"),
    (dict(seed=-(2**63) - 1), "seed"), (dict(seed=True), "seed"),
    (dict(ignore_eos="yes"), "ignore_eos"), (dict(use_beam_search=1), "use_beam_search"),
    (dict(max_tokens=True), "max_tokens"), (dict(top_p=math.inf), "top_p"),
])
def test_bad_sampling_values_name_the_parameter_and_the_value(kwargs, name):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert message.startswith(f"{name} must be"), message
    assert repr(next(iter(kwargs.values()))) in message, message


@pytest.mark.slow
def test_tiny_temperatures_are_greedy_and_tiny_top_p_keeps_the_top_token(tiny_llama, prompts):
    path, model = tiny_llama
    llm = LLM(path, block_size=BLOCK, num_gpu_blocks=64)
    refs = [greedy_reference(model, p, 8) for p in prompts]
    for params in (SamplingParams(temperature=1e-50, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=1e-6, max_tokens=8, ignore_eos=True),
                   SamplingParams(top_p=1e-300, max_tokens=8, ignore_eos=True, seed=1)):
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs, params


@pytest.mark.parametrize("kwargs, name", [
    (dict(num_cpu_blocks=-1), "num_cpu_blocks"), (dict(num_gpu_blocks=0), "num_gpu_blocks"),
    (dict(num_gpu_blocks=2.5), "num_gpu_blocks"), (dict(swap_space=-1), "swap_space"),
    (dict(kv_cache_bytes=-5), "kv_cache_bytes"), (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=True), "max_num_batched_tokens"),
    (dict(watermark=1.5), "watermark"), (dict(max_model_len=1), "max_model_len"),
    (dict(seed="s"), "seed"), (dict(block_size=True), "block_size"),
])
def test_bad_engine_settings_name_the_setting_and_the_value(tiny_gpt2, kwargs, name):
    with pytest.raises(ValueError) as err:
        LLM(tiny_gpt2[0], **kwargs)
    assert str(err.value).startswith(f"{name} must be"), str(err.value)
    assert repr(next(iter(kwargs.values()))) in str(err.value)


def test_a_configuration_that_cannot_run_one_max_model_len_request_is_refused(tiny_gpt2):
    path, _ = tiny_gpt2
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) is smaller than "
                                         r"max_model_len \(128\)"):
        LLM(path, max_model_len=128, max_num_batched_tokens=64, enable_chunked_prefill=False)
    # With chunked prefill the budget limits a step, not a prompt.
    assert LLM(path, max_model_len=128, max_num_batched_tokens=64).llm_engine.max_model_len == 128
    with pytest.raises(ValueError, match=r"needs 8 blocks of 16 tokens, the pool has 8 blocks "
                                         r"of which 7 are usable"):
        LLM(path, max_model_len=128, num_gpu_blocks=8, watermark=0.2)


def test_bad_arrival_times_and_duplicate_ids_queue_nothing(tiny_gpt2):
    path, _ = tiny_gpt2
    engine = LLMEngine(path, num_gpu_blocks=64)
    for bad in ("soon", math.nan, [1.0], True):
        with pytest.raises(ValueError, match="arrival_time must be a finite number"):
            engine.add_request("a", None, SamplingParams(), [3, 4], arrival_time=bad)
    with pytest.raises(ValueError, match="request_id must be a non-empty string"):
        engine.add_request(7, None, SamplingParams(), [3, 4])
    assert not engine.has_unfinished_requests()
    engine.add_request("a", None, SamplingParams(), [3, 4])
    with pytest.raises(ValueError, match="'a' is already in use"):
        engine.add_request("a", None, SamplingParams(), [5])
    assert engine.get_num_unfinished_requests() == 1


def test_generate_queues_nothing_when_any_request_is_bad(tiny_gpt2):
    path, _ = tiny_gpt2
    llm = LLM(path, num_gpu_blocks=64)
    engine = llm.llm_engine
    engine.add_request("0", None, SamplingParams(max_tokens=2), [3])  # an id generate would pick
    good = SamplingParams(max_tokens=3, ignore_eos=True)
    for bad in ([good, good, "not params"], [good, good, SamplingParams(logprobs=10**6)]):
        with pytest.raises(ValueError, match="prompt 2"):
            llm.generate(prompt_token_ids=[[5], [6], [7]], sampling_params=bad, use_tqdm=False)
        assert engine.get_num_unfinished_requests() == 1
    with pytest.raises(ValueError, match="prompt 1: prompt token ids must be integers"):
        llm.generate(prompt_token_ids=[[5], [6.0]], use_tqdm=False)
    outs = llm.generate(prompt_token_ids=[[5], [6]], sampling_params=good, use_tqdm=False)
    assert all(o.finished for o in outs)
    assert "0" not in [o.request_id for o in outs]  # the id in use was skipped


def test_numpy_arrays_and_torch_tensors_of_token_ids(tiny_gpt2):
    path, _ = tiny_gpt2
    llm = LLM(path, num_gpu_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = _tokens(llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9, 10]],
                                    sampling_params=params, use_tqdm=False))
    for ids in (np.array([[5, 6, 7], [8, 9, 10]]), torch.tensor([[5, 6, 7], [8, 9, 10]]),
                [np.array([5, 6, 7], dtype=np.int32), torch.tensor([8, 9, 10])],
                [[np.int64(5), np.int64(6), np.int64(7)], (8, 9, 10)]):
        outs = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
        assert _tokens(outs) == expected
    with pytest.raises(ValueError, match="must hold integers, got an array of float"):
        llm.generate(prompt_token_ids=np.array([[5.0, 6.0]]), use_tqdm=False)
    with pytest.raises(ValueError, match="1-D .one prompt. or 2-D"):
        llm.generate(prompt_token_ids=torch.zeros(1, 1, 2, dtype=torch.long), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
