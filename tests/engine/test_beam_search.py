"""Beam search against transformers' ``generate(num_beams=k)`` (lesson 03).

With a fixed length (``ignore_eos``, no EOS in transformers) both keep, at every step, the ``k``
best continuations of all beams by cumulative logprob, so the beams are the same. Random tiny
models have near-ties, so prompts are chosen where a float64 beam search has a clear gap at every
step between the k-th and (k+1)-th candidate and between the final beams: then the kept set and
the final order are well defined, and any correct float32 implementation must find them.

Slow (left out of `make test`): the comparison with transformers for every width and model, about
45 s on the 2-core machine (measured at load ~15).
"""
from __future__ import annotations

import pytest
import torch

from beam_prompts import NEW_TOKENS, PROMPT_LENS, pick_beam_prompts
from minipaged import LLM, SamplingParams
from tiny_models import EOS

pytestmark = pytest.mark.lesson03

WIDTHS = [2, 3, 4]


@torch.no_grad()
def hf_beams(model, prompt: list[int], width: int):
    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                         do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                         pad_token_id=EOS, length_penalty=1.0, early_stopping=True,
                         output_scores=True, return_dict_in_generate=True)
    return out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()


@pytest.fixture(scope="module")
def beam_runs(tiny_model):
    """All widths and prompts of one architecture, run together in one batch of our engine."""
    kind, path, model = tiny_model
    cases = [(width, prompt, beams) for width in WIDTHS
             for prompt, beams in pick_beam_prompts(model, width, seed=width)]
    llm = LLM(path, block_size=4, num_cpu_blocks=0)
    params = [SamplingParams(n=width, use_beam_search=True, temperature=0.0,
                             max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
              for width, _, _ in cases]
    outputs = llm.generate(prompt_token_ids=[prompt for _, prompt, _ in cases],
                           sampling_params=params, use_tqdm=False)
    bm = llm.llm_engine.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert llm.llm_engine.stats.num_blocks_copied > 0  # beams were re-forked and copied
    return kind, model, cases, outputs


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_beams_equal_transformers_generate(beam_runs, width):
    kind, model, cases, outputs = beam_runs
    checked = 0
    for (w, prompt, ref64), out in zip(cases, outputs):
        if w != width:
            continue
        ours = [o.token_ids for o in out.outputs]
        hf_tokens, hf_scores = hf_beams(model, prompt, width)
        assert len(ours) == width
        assert ours[0] == hf_tokens[0], f"{kind} k={width}: best beam differs"
        # All k beams, in order (well defined: the final beams have no near-tie).
        assert ours == hf_tokens
        assert ours == [tokens for _, tokens in ref64]
        # transformers scores a beam by its summed logprob / generated length (length_penalty 1).
        for o, score, (score64, _) in zip(out.outputs, hf_scores, ref64):
            assert o.cumulative_logprob == pytest.approx(score * NEW_TOKENS, abs=1e-3)
            assert o.cumulative_logprob == pytest.approx(score64, abs=1e-3)
        checked += 1
    assert checked == len(PROMPT_LENS)


@pytest.mark.slow
def test_beams_are_sorted_and_scored_by_their_own_tokens(beam_runs):
    _, _, cases, outputs = beam_runs
    for (width, _, _), out in zip(cases, outputs):
        scores = [o.cumulative_logprob for o in out.outputs]
        assert scores == sorted(scores, reverse=True)
        assert len({tuple(o.token_ids) for o in out.outputs}) == width  # no duplicate beams
        for o in out.outputs:
            assert len(o.token_ids) == NEW_TOKENS and o.finish_reason == "length"
            # A re-forked beam takes over its new parent's history, logprobs included.
            chosen = [lp[t] for t, lp in zip(o.token_ids, o.logprobs)]
            assert o.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-6)


def test_beam_search_returns_n_best_of_best_of(tiny_llama):
    """n < best_of: the beam width is best_of, the n best beams come back."""
    path, model = tiny_llama
    (prompt, ref64), = [pick_beam_prompts(model, 4, seed=4)[0]]
    llm = LLM(path, block_size=4, num_cpu_blocks=0)
    out = llm.generate(prompt_token_ids=[prompt], use_tqdm=False, sampling_params=SamplingParams(
        n=2, best_of=4, use_beam_search=True, temperature=0.0, max_tokens=NEW_TOKENS,
        ignore_eos=True))[0]
    assert [o.token_ids for o in out.outputs] == [tokens for _, tokens in ref64[:2]]
    assert [o.index for o in out.outputs] == [0, 1]
