"""Parallel sampling: ``n`` / ``best_of`` sequences share one prompt computation (lesson 03).

Slow (left out of `make test`): the batch-independence test, about 20 s on the 2-core machine
(measured at load ~15).
"""
from __future__ import annotations

import pytest
import torch

from minipaged import LLM, SamplingParams
from tiny_models import greedy_reference, pick_prompts

pytestmark = pytest.mark.lesson03

BLOCK_SIZE = 4
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def llm(tiny_llama):
    path, _ = tiny_llama
    return LLM(path, block_size=BLOCK_SIZE, num_cpu_blocks=0)


def _tokens(outputs):
    return [[o.token_ids for o in r.outputs] for r in outputs]


def _generate(llm, prompts, params):
    return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)


PROMPT = [12, 40, 41, 99, 7, 150, 3]


@pytest.mark.slow
def test_seeded_parallel_sampling_is_reproducible_in_any_batch(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=1234, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    alone = _generate(llm, [PROMPT], params)
    again = _generate(llm, [PROMPT], params)
    assert _tokens(again) == _tokens(alone)
    # In a batch with other requests (sampled from their own generators) and in another place.
    other = SamplingParams(n=3, temperature=1.3, seed=9, max_tokens=MAX_TOKENS + 3,
                           ignore_eos=True)
    batch = _generate(llm, [[5, 6, 7], PROMPT, [200] * 9], [other, params, other])
    assert _tokens(batch)[1] == _tokens(alone)[0]
    assert [o.cumulative_logprob for o in batch[1].outputs] == pytest.approx(
        [o.cumulative_logprob for o in alone[0].outputs], abs=1e-4)
    # A different seed samples something else.
    reseeded = _generate(llm, [PROMPT], SamplingParams(n=4, temperature=1.0, seed=4321,
                                                       max_tokens=MAX_TOKENS, ignore_eos=True))
    assert _tokens(reseeded) != _tokens(alone)


def test_the_n_samples_differ_and_share_one_prompt_computation(llm):
    engine = llm.llm_engine
    stats = engine.stats
    before = stats.num_prompt_tokens + stats.num_cached_prompt_tokens
    out = _generate(llm, [PROMPT], SamplingParams(n=4, temperature=1.0, seed=7,
                                                   max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    # Computed (or, with prefix caching, taken from the cache) once, not 4 times.
    assert stats.num_prompt_tokens + stats.num_cached_prompt_tokens - before == len(PROMPT)
    samples = [tuple(o.token_ids) for o in out.outputs]
    assert len(samples) == 4 and len(set(samples)) == 4
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(s) == MAX_TOKENS for s in samples)
    bm = engine.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks


def test_temperature_zero_gives_n_copies_of_the_greedy_output(tiny_llama, llm):
    _, model = tiny_llama
    prompts = pick_prompts(model, [6, 13], MAX_TOKENS, seed=5)
    out = _generate(llm, prompts, SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS,
                                                  ignore_eos=True))
    for prompt, r in zip(prompts, out):
        expected = greedy_reference(model, prompt, MAX_TOKENS)
        assert [o.token_ids for o in r.outputs] == [expected] * 3


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=1, temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2),
    SamplingParams(top_p=1e-6, temperature=0.7, max_tokens=MAX_TOKENS, ignore_eos=True, n=2),
], ids=["top_k=1", "top_p~0"])
def test_a_filter_that_keeps_one_token_samples_greedily(tiny_llama, llm, params):
    _, model = tiny_llama
    prompt, = pick_prompts(model, [8], MAX_TOKENS, seed=6)
    out = _generate(llm, [prompt], params)[0]
    assert [o.token_ids for o in out.outputs] == [greedy_reference(model, prompt, MAX_TOKENS)] * 2


def test_best_of_returns_the_n_most_likely_samples(llm):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    out = _generate(llm, [PROMPT], params)[0]
    assert len(out.outputs) == 2
    scores = [o.cumulative_logprob for o in out.outputs]
    assert scores == sorted(scores, reverse=True)
    # Same seed, n = best_of = 5: the same five samples; ours are the two most likely of them.
    every = _generate(llm, [PROMPT], SamplingParams(n=5, temperature=1.0, seed=3,
                                                    max_tokens=MAX_TOKENS, ignore_eos=True))[0]
    ranked = sorted(every.outputs, key=lambda o: o.cumulative_logprob, reverse=True)
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in ranked[:2]]


def test_samples_follow_the_models_distribution(tiny_llama, llm):
    """Many one-token samples of one prompt: their frequencies match softmax(logits), not a
    sharper or flatter version of it."""
    _, model = tiny_llama
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1]  # (V,)
    n = 250
    out = _generate(llm, [PROMPT], SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=1,
                                                   ignore_eos=True))[0]
    freq = torch.zeros_like(logits)
    for o in out.outputs:
        freq[o.token_ids[0]] += 1.0 / n

    def tv(temperature: float) -> float:  # total variation distance
        return 0.5 * float((freq - torch.softmax(logits / temperature, dim=-1)).abs().sum())

    assert tv(1.0) < 0.6 * min(tv(0.5), tv(2.0))


def test_sampled_logprobs_are_those_of_the_temperature_scaled_distribution(tiny_llama, llm):
    _, model = tiny_llama
    temperature = 2.0
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, -1]  # (V,)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    out = _generate(llm, [PROMPT], SamplingParams(n=5, temperature=temperature, seed=0,
                                                   max_tokens=1, ignore_eos=True))[0]
    for o in out.outputs:
        token = o.token_ids[0]
        assert o.cumulative_logprob == pytest.approx(float(logprobs[token]), abs=1e-4)
