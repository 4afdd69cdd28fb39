"""The rest of SamplingParams: validation, penalties, stop strings, EOS, logprobs (lesson 03).

Each behaviour is checked against an independent reference (transformers logits in float64, or
the tokenizer's own decoding), and where a plausible wrong implementation would still pass a
plain check, the test first shows that the wrong implementation gives a different answer.

Slow (left out of `make test`): the float64 penalty references and the two stop-string tests, about
130 s together on the 2-core machine (measured at load ~15).
"""
from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.worker.model_runner import Row
from minipaged.worker.sampler import apply_penalties
from minipaged.sequence import Sequence, SequenceGroup
from tiny_models import VOCAB, config_with_eos, greedy_reference, pick_prompts

pytestmark = pytest.mark.lesson03


# -- validation ----------------------------------------------------------------------------------
INVALID = [
    # (kwargs, field named first in the message, a piece of the allowed range)
    (dict(n=0), "n", ">= 1"),
    (dict(n=1.5), "n", ">= 1"),
    (dict(n=True), "n", ">= 1"),
    (dict(n="2"), "n", ">= 1"),
    (dict(n=3, best_of=2), "best_of", ">= n"),
    (dict(best_of=0), "best_of", ">= n"),
    (dict(best_of=2.0), "best_of", ">= n"),
    (dict(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
    (dict(presence_penalty=-2.01), "presence_penalty", "[-2, 2]"),
    (dict(presence_penalty=float("nan")), "presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=3), "frequency_penalty", "[-2, 2]"),
    (dict(frequency_penalty="0.1"), "frequency_penalty", "[-2, 2]"),
    (dict(temperature=-0.1), "temperature", ">= 0"),
    (dict(temperature=float("nan")), "temperature", ">= 0"),
    (dict(temperature="hot"), "temperature", ">= 0"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p=1.01), "top_p", "(0, 1]"),
    (dict(top_p=float("nan")), "top_p", "(0, 1]"),
    (dict(top_k=0), "top_k", "-1"),
    (dict(top_k=-2), "top_k", "-1"),
    (dict(top_k=2.5), "top_k", "-1"),
    (dict(max_tokens=0), "max_tokens", ">= 1"),
    (dict(max_tokens=None), "max_tokens", ">= 1"),
    (dict(logprobs=-1), "logprobs", ">= 0"),
    (dict(logprobs=1.0), "logprobs", ">= 0"),
    (dict(seed=1.5), "seed", "integer"),
    (dict(seed="42"), "seed", "integer"),
    (dict(stop=""), "stop", "non-empty string"),
    (dict(stop=["ok", ""]), "stop", "non-empty string"),
    (dict(stop=["ok", 3]), "stop", "non-empty string"),
    (dict(stop=3), "stop", "non-empty string"),
    (dict(stop=b"bytes"), "stop", "non-empty string"),
    # Beam search: deterministic, with a width of at least 2.
    (dict(use_beam_search=True, temperature=0.0), "best_of", "> 1"),
    (dict(use_beam_search=True, n=2), "temperature", "0"),
    (dict(use_beam_search=True, n=2, temperature=0.0, top_p=0.9), "top_p", "1"),
    (dict(use_beam_search=True, n=2, temperature=0.0, top_k=5), "top_k", "-1"),
    (dict(use_beam_search=True, n=3, best_of=2, temperature=0.0), "best_of", ">= n"),
]


@pytest.mark.parametrize("kwargs,field,allowed", INVALID,
                         ids=[f"{f}:{k}" for k, f, _ in INVALID])
def test_invalid_values_raise_a_value_error_naming_field_and_range(kwargs, field, allowed):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert message.startswith(f"{field} must be"), message
    assert allowed in message, message


@pytest.mark.parametrize("kwargs", [
    dict(), dict(n=3), dict(n=2, best_of=5), dict(temperature=0.0, n=3),
    dict(use_beam_search=True, n=2, temperature=0.0),
    dict(use_beam_search=True, n=1, best_of=4, temperature=0.0),
    dict(presence_penalty=-2.0, frequency_penalty=2.0), dict(top_p=1e-9, top_k=1),
    dict(stop="x"), dict(stop=("a", "bc")), dict(logprobs=0), dict(seed=0), dict(max_tokens=1),
])
def test_valid_values_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    assert params.best_of >= params.n


def test_defaults_and_stop_normalisation():
    params = SamplingParams(n=2)
    assert params.best_of == 2 and params.stop_strings == []
    assert SamplingParams(stop="END").stop_strings == ["END"]
    assert SamplingParams(stop=("a", "b")).stop_strings == ["a", "b"]


# -- penalties -----------------------------------------------------------------------------------
def _group(request_id: str, prompt: list[int], outputs: list[int], **params) -> SequenceGroup:
    seq = Sequence(int(request_id), None, prompt, block_size=4)
    for token in outputs:
        seq.append_token_id(token, {token: 0.0})
    return SequenceGroup(request_id, [seq], SamplingParams(**params), arrival_time=0.0)


def test_penalties_count_each_rows_own_generated_tokens_only():
    a = _group("1", prompt=[2, 3, 3], outputs=[5, 5, 5, 7, 3],
               frequency_penalty=0.5, presence_penalty=0.25)
    b = _group("2", prompt=[5, 7], outputs=[9], frequency_penalty=1.0, presence_penalty=1.5)
    c = _group("3", prompt=[5], outputs=[5, 9])  # no penalties
    rows = [Row(g, [g.seqs[0].seq_id], False) for g in (a, b, c)]
    logits = torch.randn(3, 12)
    out = apply_penalties(logits.clone(), rows)
    delta = out - logits
    expected = torch.zeros(3, 12)
    expected[0, 5] = -(0.5 * 3 + 0.25)
    expected[0, 7] = -(0.5 * 1 + 0.25)
    expected[0, 3] = -(0.5 * 1 + 0.25)  # generated once; its two prompt copies do not count
    expected[1, 9] = -(1.0 + 1.5)  # prompt tokens 5 and 7 are not penalised
    torch.testing.assert_close(delta, expected)


@torch.no_grad()
def penalized_greedy64(model64, prompt, steps, frequency, presence, penalize=None):
    """Greedy with penalties in float64. ``penalize(prompt, generated)`` picks the tokens that
    are counted (the right answer: the generated ones). Returns (tokens, smallest top-2 gap)."""
    penalize = penalize or (lambda p, g: g)
    generated, gap = [], math.inf
    for _ in range(steps):
        logits = model64(torch.tensor([prompt + generated])).logits[0, -1]  # (V,)
        counts = torch.bincount(torch.tensor(penalize(prompt, generated), dtype=torch.long),
                                minlength=logits.shape[0]).double()
        logits = logits - frequency * counts - presence * (counts > 0).double()
        top = torch.topk(logits, 2).values
        gap = min(gap, float(top[0] - top[1]))
        generated.append(int(torch.argmax(logits)))
    return generated, gap


def _pick_penalty_prompts(model, count, steps, frequency, presence, seed):
    """Prompts where the penalty decides the path and a wrong penalty would change it."""
    model64 = copy.deepcopy(model).double()
    rng = random.Random(seed)
    picked = []
    for _ in range(100):
        # A prompt ending in the tokens the model itself continues with: penalising the prompt
        # as well would push the path away from them.
        base = [rng.randrange(2, VOCAB) for _ in range(4)]
        prompt = base + penalized_greedy64(model64, base, 4, 0.0, 0.0)[0]
        right, gap = penalized_greedy64(model64, prompt, steps, frequency, presence)
        if gap < 1e-3:
            continue
        plain, _ = penalized_greedy64(model64, prompt, steps, 0.0, 0.0)
        with_prompt, _ = penalized_greedy64(model64, prompt, steps, frequency, presence,
                                            penalize=lambda p, g: p + g)
        if right != plain and right != with_prompt:
            picked.append((prompt, right))
            if len(picked) == count:
                return picked
    raise AssertionError("no prompt where the penalty matters")


@pytest.mark.slow
@pytest.mark.parametrize("frequency,presence", [(1.5, 0.0), (0.0, 2.0), (0.7, 0.8)])
def test_penalised_greedy_matches_a_float64_reference(tiny_llama, frequency, presence):
    path, model = tiny_llama
    steps = 10
    cases = _pick_penalty_prompts(model, 2, steps, frequency, presence, seed=int(frequency * 10))
    # Batched with an unpenalised request whose tokens would shift the others' penalties if
    # the sampler mixed up rows, and which must itself stay plain greedy.
    plain_prompt = cases[0][0][::-1]
    llm = LLM(path, block_size=4, num_cpu_blocks=0)
    penalised = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True,
                               frequency_penalty=frequency, presence_penalty=presence)
    plain = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=[p for p, _ in cases] + [plain_prompt],
                        sampling_params=[penalised] * len(cases) + [plain], use_tqdm=False)
    for (prompt, expected), out in zip(cases, outs):
        assert out.outputs[0].token_ids == expected
    assert outs[-1].outputs[0].token_ids == greedy_reference(model, plain_prompt, steps)


# -- logprobs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_logprobs", [0, 3])
def test_logprobs_match_transformers_log_softmax(tiny_model, num_logprobs):
    kind, path, model = tiny_model
    steps = 8
    prompts = pick_prompts(model, [5, 9], steps, seed=31)
    llm = LLM(path, block_size=4, num_cpu_blocks=0)
    outs = llm.generate(prompt_token_ids=prompts, use_tqdm=False, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=num_logprobs))
    for prompt, out in zip(prompts, outs):
        o = out.outputs[0]
        assert o.token_ids == greedy_reference(model, prompt, steps)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + o.token_ids])).logits[0]  # (L, V)
        reference = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)  # (steps, V)
        assert len(o.logprobs) == steps
        for step, (token, step_logprobs) in enumerate(zip(o.token_ids, o.logprobs)):
            ref = reference[step]
            assert token in step_logprobs
            assert len(step_logprobs) == max(num_logprobs, 1)  # greedy: chosen is the top one
            for t, lp in step_logprobs.items():
                assert lp == pytest.approx(float(ref[t]), abs=1e-4), (kind, step, t)
            if num_logprobs:
                kth_best = float(torch.topk(ref, num_logprobs).values[-1])
                assert min(step_logprobs.values()) >= kth_best - 1e-4  # they are the top k
        chosen = [lp[t] for t, lp in zip(o.token_ids, o.logprobs)]
        assert o.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-6)
        assert o.cumulative_logprob == pytest.approx(
            float(reference.gather(1, torch.tensor(o.token_ids)[:, None]).sum()), abs=1e-3)


def test_no_logprobs_unless_asked(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, num_cpu_blocks=0)
    o = llm.generate(prompt_token_ids=[[3, 4, 5]], use_tqdm=False,
                     sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert o.logprobs is None and math.isfinite(o.cumulative_logprob)


def test_logprobs_up_to_the_vocabulary_return_them_all_and_beyond_it_raise(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(path, block_size=4, num_cpu_blocks=0)
    out = llm.generate(prompt_token_ids=[[3, 4, 5], [6, 7]], use_tqdm=False,
                       sampling_params=SamplingParams(max_tokens=2, ignore_eos=True,
                                                      logprobs=VOCAB))
    for r in out:
        assert all(len(step) == VOCAB for step in r.outputs[0].logprobs)
        assert all(math.isclose(sum(math.exp(v) for v in step.values()), 1.0, rel_tol=1e-4)
                   for step in r.outputs[0].logprobs)
    with pytest.raises(ValueError, match=f"logprobs must be at most the vocabulary size "
                                         f".{VOCAB}., got {VOCAB + 10}"):
        llm.generate(prompt_token_ids=[[3, 4, 5]], use_tqdm=False,
                     sampling_params=SamplingParams(logprobs=VOCAB + 10))
    assert not llm.llm_engine.has_unfinished_requests()


# -- EOS and max_tokens --------------------------------------------------------------------------
def test_eos_stops_unless_ignored_and_max_tokens_caps(tiny_llama):
    path, model = tiny_llama
    prompt, = pick_prompts(model, [7], 12, seed=41)
    greedy = greedy_reference(model, prompt, 12)
    # Pretend the 4th greedy token is the end-of-sequence token (it must not occur earlier).
    eos = greedy[3]
    assert eos not in greedy[:3]
    llm = LLM(path, hf_config=config_with_eos(path, eos), block_size=4, num_cpu_blocks=0)
    assert llm.llm_engine.eos_token_ids == {eos}

    def run(**kw):
        return llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                            sampling_params=SamplingParams(temperature=0.0, **kw))[0].outputs[0]

    stopped = run(max_tokens=12)
    assert stopped.token_ids == greedy[:4] and stopped.finish_reason == "stop"
    ignored = run(max_tokens=12, ignore_eos=True)
    assert ignored.token_ids == greedy and ignored.finish_reason == "length"
    capped = run(max_tokens=2)
    assert capped.token_ids == greedy[:2] and capped.finish_reason == "length"
    bm = llm.llm_engine.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks


# -- stop strings (needs a real tokenizer) -------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_llm(tmp_path_factory):
    """A tiny random LLaMA that speaks the embedded model's tokenizer (49152 tokens)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from minipaged.worker.checkpoint import embedded_model_dir

    try:
        tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    except (OSError, FileNotFoundError) as e:  # the embedded model is not installed
        pytest.skip(f"no tokenizer available: {e}")
    path = tmp_path_factory.mktemp("tiny_llama_tokenizer")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, initializer_range=0.3,
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return LLM(str(path), block_size=4, num_cpu_blocks=0), tokenizer


PROMPTS = ["The quick brown fox", "Hello, my name is", "Once upon a time"]


def _greedy_texts(llm, max_tokens=24):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True), use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _stop_spanning_a_token_boundary(tokenizer, token_ids, start_token=4):
    """A 4-character stop string whose first half ends one token and second half starts the
    next; returns (stop string, number of tokens needed to complete it)."""
    for j in range(start_token, len(token_ids) - 1):
        before = tokenizer.decode(token_ids[:j], skip_special_tokens=True)
        after = tokenizer.decode(token_ids[:j + 1], skip_special_tokens=True)
        candidate = after[len(before) - 2:len(before) + 2]
        full = tokenizer.decode(token_ids, skip_special_tokens=True)
        if (len(candidate) == 4 and candidate.isascii() and candidate.strip() == candidate
                and full.find(candidate) == len(before) - 2 and len(after) >= len(before) + 2):
            return candidate, j + 1
    raise AssertionError("no usable token boundary")


@pytest.mark.slow
def test_stop_string_ends_generation_and_is_not_returned(tokenizer_llm):
    llm, tokenizer = tokenizer_llm
    for prompt, full in zip(PROMPTS, _greedy_texts(llm)):
        stop, needed = _stop_spanning_a_token_boundary(tokenizer, full.token_ids)
        o = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert o.finish_reason == "stop"
        assert o.text == full.text[:full.text.index(stop)]
        assert stop not in o.text
        # Generation ended with the token that completed the stop string, not later.
        assert o.token_ids == full.token_ids[:needed]


@pytest.mark.slow
def test_the_earliest_of_several_stop_strings_wins(tokenizer_llm):
    llm, tokenizer = tokenizer_llm
    full = _greedy_texts(llm)[1]
    early, _ = _stop_spanning_a_token_boundary(tokenizer, full.token_ids, start_token=3)
    late, _ = _stop_spanning_a_token_boundary(tokenizer, full.token_ids, start_token=10)
    assert full.text.index(early) < full.text.index(late)
    o = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                stop=[late, early]), use_tqdm=False)[0].outputs[0]
    assert o.text == full.text[:full.text.index(early)]


def test_no_stop_string_leaks_into_any_sample_or_beam(tokenizer_llm):
    llm, tokenizer = tokenizer_llm
    stops = [" ", "e"]  # common enough that most sequences hit one
    for params in (SamplingParams(n=4, temperature=1.0, seed=2, max_tokens=16, stop=stops,
                                  ignore_eos=True),
                   SamplingParams(n=3, use_beam_search=True, temperature=0.0, max_tokens=16,
                                  stop=stops, ignore_eos=True)):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        hits = 0
        for out in outs:
            for o in out.outputs:
                full = tokenizer.decode(o.token_ids, skip_special_tokens=True)
                assert not any(s in o.text for s in stops), o.text
                if o.finish_reason == "stop":
                    hits += 1
                    cut = min(i for s in stops if (i := full.find(s)) != -1)
                    assert o.text == full[:cut]
                    # It stopped at the first token that completed a stop string.
                    shorter = tokenizer.decode(o.token_ids[:-1], skip_special_tokens=True)
                    assert not any(s in shorter for s in stops)
                else:
                    assert o.text == full and len(o.token_ids) == 16
        assert hits > 0
