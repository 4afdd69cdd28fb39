"""Lesson 01: what the KV cache costs, and what a max-length reservation wastes of it."""
import pytest

from minipaged import LLM
from minipaged.lab import kv_memory as kv
from minipaged.model_shape import kv_bytes_per_token

pytestmark = pytest.mark.lesson01


def test_bytes_per_token_of_the_named_model_shapes():
    assert kv_bytes_per_token(num_layers=2, num_kv_heads=3, head_size=4, element_size=2) == 96
    shapes = kv.MODEL_SHAPES
    assert shapes["GPT-2"].kv_bytes_per_token(2) == 2 * 12 * 12 * 64 * 2
    assert shapes["LLaMA-7B"].kv_bytes_per_token(2) == 512 * 1024  # 0.5 MiB per token
    # grouped-query attention: SmolLM2's 3 kv heads make its cache smaller than GPT-2's
    assert shapes["SmolLM2-135M"].kv_bytes_per_token(2) < shapes["GPT-2"].kv_bytes_per_token(2)
    # the paper's example: one 2048-token LLaMA-13B sequence needs about 1.6 GB
    assert 1.55e9 < kv.sequence_bytes(shapes["LLaMA-13B"], 2048) < 1.7e9


def test_request_trace_is_seeded_and_within_each_requests_max_length():
    trace = kv.request_trace(100, seed=3)
    assert trace == kv.request_trace(100, seed=3) != kv.request_trace(100, seed=4)
    assert all(1 <= r.output_len and r.final_len <= r.max_len for r in trace)


def test_max_length_reservation_wastes_most_memory_paging_only_last_blocks():
    trace = kv.request_trace(200, seed=0)
    contiguous = kv.contiguous_waste(trace, capacity=16384)
    paged = kv.paged_waste(trace, capacity=16384, block_size=16)
    # the paper's measurements: 60-80 % wasted by reservation, under 4 % with paging
    assert 0.6 <= contiguous.waste_fraction <= 0.8
    assert all(contiguous.fraction(k) > 0.02 for k in ("reserved", "internal", "external"))
    assert paged.waste_fraction < 0.04
    assert paged.slot_steps["reserved"] == paged.slot_steps["external"] == 0
    # all of paging's waste sits in last blocks: each sequence's empty tail is < one block
    tails = [n for kind, n in paged.layout if kind == "internal"]
    assert tails and max(tails) < 16
    # with the same memory, paging runs more requests at once
    assert paged.max_running > contiguous.max_running


def test_smaller_blocks_waste_less():
    trace = kv.request_trace(100, seed=0)
    waste = [kv.paged_waste(trace, 8192, block_size=b).waste_fraction for b in (1, 8, 64)]
    assert waste[0] == 0 and waste[0] < waste[1] < waste[2]


def test_requests_that_cannot_fit_are_refused():
    with pytest.raises(ValueError, match="larger than the pool"):
        kv.contiguous_waste([kv.Request(10, 10, 4096)], capacity=2048)
    with pytest.raises(ValueError, match="longer than the whole pool"):
        kv.paged_waste([kv.Request(10, 3000, 4096)], capacity=2048)


def test_generation_without_a_cache_gives_the_same_tokens_with_more_work(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, num_gpu_blocks=32, num_cpu_blocks=0, max_model_len=128)
    prompt = [5, 9, 14, 20, 33]
    assert kv.greedy_with_cache(llm, prompt, 6) == kv.greedy_without_cache(llm, prompt, 6)
    assert kv.kv_vectors_computed(5, 6, cached=True) == 10
    assert kv.kv_vectors_computed(5, 6, cached=False) == 5 + 6 + 7 + 8 + 9 + 10
