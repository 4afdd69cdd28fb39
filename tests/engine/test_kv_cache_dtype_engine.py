"""The engine on an 8-bit KV cache (lesson 18): the setting is checked, the pool holds more
blocks for the same bytes, and swapping, copy-on-write, recompute, prefix caching, chunked
prefill, speculation, beam search and tensor parallelism change no token.

Each comparison runs the same 8-bit cache twice, once with room to spare and once with the
feature at work, so both read the same quantized keys. Prompts are kept only where the roomy
run's greedy path has a clear gap between its two best tokens (``_clear_prompts``).

slow: builds several tiny-model engines and runs preemption, beam search, prefix caching,
speculation and two tensor-parallel ranks on each 8-bit cache, ~70-160 s on the 2-core machine.
"""
from __future__ import annotations

import random

import pytest

from minipaged import LLM, SamplingParams
from minipaged.config import EngineConfig

pytestmark = [pytest.mark.lesson18, pytest.mark.slow]

BLOCK_SIZE = 4
MAX_TOKENS = 10
MAX_MODEL_LEN = 64
KINDS = ["fp8", "int8"]


def _llm(path, kind, **kwargs):
    kwargs.setdefault("num_gpu_blocks", 256)
    kwargs.setdefault("num_cpu_blocks", 0)
    kwargs.setdefault("max_model_len", MAX_MODEL_LEN)
    return LLM(path, kv_cache_dtype=kind, block_size=BLOCK_SIZE, **kwargs)


def _greedy(**extra):
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **extra)


def _tokens(outputs):
    return [[o.token_ids for o in r.outputs] for r in outputs]


def _run(llm, prompts, params):
    return _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                use_tqdm=False))


@pytest.fixture(scope="module", params=KINDS)
def clear(request, tiny_llama):
    """(kind, prompts, greedy tokens of a roomy run) for prompts with a clear greedy path."""
    kind, (path, _) = request.param, tiny_llama
    prompts = _clear_prompts(_llm(path, kind), count=4, seed=3)
    return kind, prompts, _run(_llm(path, kind), prompts, _greedy())


def _clear_prompts(llm, count: int, seed: int, min_gap: float = 0.05) -> list[list[int]]:
    """Prompts whose greedy tokens beat the runner-up by ``min_gap`` nats at every step, with
    a shared 8-token start (two full blocks) so that prefix caching has something to find."""
    rng = random.Random(seed)
    start = [rng.randrange(2, 256) for _ in range(8)]
    candidates = [start + [rng.randrange(2, 256) for _ in range(rng.randrange(3, 9))]
                  for _ in range(4 * count)]
    outputs = llm.generate(prompt_token_ids=candidates, sampling_params=_greedy(logprobs=2),
                           use_tqdm=False)
    keep = []
    for prompt, out in zip(candidates, outputs):
        gaps = [sorted(step.values())[-1] - sorted(step.values())[-2]
                for step in out.outputs[0].logprobs]
        if min(gaps) >= min_gap:
            keep.append(prompt)
    assert len(keep) >= count, "too few prompts with a clear greedy path"
    return keep[:count]


def test_unknown_kv_cache_dtype_is_refused_listing_the_accepted_values(tiny_llama):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'fp8', 'int8'"):
        LLM(tiny_llama[0], kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(tiny_llama[0], kv_cache_dtype=None)
    assert EngineConfig.__dataclass_fields__["kv_cache_dtype"].default == "auto"


def test_a_head_size_the_8bit_layout_cannot_hold_is_refused_up_front(tmp_path):
    from tiny_models import save_tiny_model

    save_tiny_model("llama", tmp_path, hidden_size=32, num_attention_heads=4,
                    num_key_value_heads=2)  # head size 8: a 16-byte key vector is 16 numbers
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        LLM(str(tmp_path), kv_cache_dtype="int8", num_gpu_blocks=8, max_model_len=32)


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_budget_holds_more_blocks(tiny_llama, kind):
    path = tiny_llama[0]
    budget = 1 << 20
    full = LLM(path, kv_cache_bytes=budget, block_size=16, num_cpu_blocks=0)
    small = LLM(path, kv_cache_bytes=budget, block_size=16, num_cpu_blocks=0,
                kv_cache_dtype=kind)
    # 2 layers, 2 kv heads, head size 16, 16 tokens: fp32 is 64 bytes a token and head, 8-bit
    # is 16 bytes of codes and a 4-byte scale
    assert full.llm_engine.block_bytes == 2 * 2 * 2 * 16 * 64
    assert small.llm_engine.block_bytes == 2 * 2 * 2 * 16 * 20
    blocks = small.llm_engine.block_manager.num_total_gpu_blocks
    assert blocks == budget // small.llm_engine.block_bytes
    assert blocks * 20 // 64 >= full.llm_engine.block_manager.num_total_gpu_blocks - 1
    assert small.llm_engine.worker.memory_per_rank()[0]["kv_cache"] == (
        blocks * small.llm_engine.block_bytes)


def test_int8_follows_the_unquantized_greedy_path_here(tiny_llama, clear):
    kind, prompts, tokens = clear
    if kind != "int8":
        pytest.skip("fp8's 3 mantissa bits move this random model's logits more")
    assert _run(_llm(tiny_llama[0], "auto"), prompts, _greedy()) == tokens


def test_recompute_preemption_changes_no_token(tiny_llama, clear):
    kind, prompts, tokens = clear
    llm = _llm(tiny_llama[0], kind, num_gpu_blocks=12, preemption_mode="recompute",
               max_model_len=32)
    assert _run(llm, prompts, _greedy()) == tokens
    assert llm.llm_engine.stats.num_preemptions_recompute > 0


def test_prefix_caching_and_chunked_prefill_change_no_token(tiny_llama, clear):
    kind, prompts, tokens = clear
    llm = _llm(tiny_llama[0], kind, enable_prefix_caching=True, max_num_batched_tokens=8)
    assert _run(llm, prompts, _greedy()) == tokens
    assert _run(llm, prompts, _greedy()) == tokens  # now every prompt starts cached
    off = _llm(tiny_llama[0], kind, enable_prefix_caching=False)
    assert _run(off, prompts, _greedy()) == tokens


def test_ngram_speculation_changes_no_token(tiny_llama, clear):
    kind, prompts, tokens = clear
    llm = _llm(tiny_llama[0], kind, speculative_config={"method": "ngram",
                                                       "num_speculative_tokens": 3})
    assert _run(llm, prompts, _greedy()) == tokens


@pytest.mark.parametrize("use_beam_search", [False, True])
def test_swapping_and_copy_on_write_change_no_token(tiny_llama, clear, use_beam_search):
    kind, prompts, _ = clear
    params = (SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=MAX_TOKENS,
                             ignore_eos=True) if use_beam_search else
              SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
                             ignore_eos=True))
    roomy = _run(_llm(tiny_llama[0], kind), prompts[:2], params)
    llm = _llm(tiny_llama[0], kind, num_gpu_blocks=14, num_cpu_blocks=64, max_model_len=40,
               enable_prefix_caching=False)  # one group fits, two do not
    assert _run(llm, prompts[:2], params) == roomy
    stats = llm.llm_engine.stats
    assert stats.num_preemptions_swap > 0 and stats.num_blocks_copied > 0


@pytest.mark.slow
def test_tensor_parallel_ranks_hold_8bit_caches_and_agree(tiny_llama, clear):
    kind, prompts, tokens = clear
    if kind != "int8":
        pytest.skip("one kind is enough to check the setting reaches the ranks")
    llm = _llm(tiny_llama[0], kind, tensor_parallel_size=2)
    try:
        assert _run(llm, prompts, _greedy()) == tokens
        per_rank = llm.llm_engine.worker.memory_per_rank()
        assert [r["kv_cache"] for r in per_rank] == [256 * llm.llm_engine.block_bytes] * 2
    finally:
        llm.llm_engine.worker.shutdown()
