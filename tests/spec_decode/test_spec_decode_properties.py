"""Random workloads with speculative decoding on, against the same requests without it (lesson 12).

Hypothesis draws an engine (block size, a pool from tight to roomy, preemption mode, swap space,
chunked prefill with small budgets, prefix caching on or off, max_num_seqs) and a speculative
config (n-gram with random lookup lengths and k, or a one-layer draft model), and a workload of
greedy requests (n up to 2, max_tokens, penalties, prompts that repeat themselves or not). The
outputs must be those of an engine without speculation: the same tokens, logprobs within 1e-4;
afterwards every GPU and CPU block is free. Tiny models and few examples: about a minute.

Slow: ~115 s on the 2-core machine with the full budget (measured at load ~9).
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from budgets import examples
from minipaged import LLMEngine, SamplingParams
from tiny_models import VOCAB, save_tiny_model

pytestmark = [pytest.mark.lesson12, pytest.mark.slow]

NUM_EXAMPLES = examples(int(os.environ.get("MINIPAGED_SPEC_EXAMPLES", 40)))


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_llama):
    draft = tmp_path_factory.mktemp("spec_prop_draft")
    save_tiny_model("llama", draft, seed=2, num_hidden_layers=1)
    return tiny_llama[0], str(draft)


@st.composite
def engines(draw):
    block_size = draw(st.sampled_from([2, 4, 8]))
    max_model_len = 48
    need = -(-max_model_len // block_size)
    chunked = draw(st.booleans())
    return dict(
        block_size=block_size, max_model_len=max_model_len,
        num_gpu_blocks=draw(st.sampled_from([need, need + 2, need + 4, 4 * need])),
        num_cpu_blocks=draw(st.sampled_from([0, 2 * need])),
        preemption_mode=draw(st.sampled_from([None, "recompute", "swap"])),
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=draw(st.sampled_from([None, 3, 7])) if chunked else None,
        enable_prefix_caching=draw(st.booleans()),
        max_num_seqs=draw(st.sampled_from([3, 256, 256])),
        watermark=0.0,
    )


@st.composite
def spec_configs(draw):
    k = draw(st.integers(1, 5))
    if draw(st.booleans()):
        low = draw(st.integers(1, 3))
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": low,
                "prompt_lookup_max": draw(st.integers(low, 4))}
    return {"model": draw(st.sampled_from(["draft", "target"])), "num_speculative_tokens": k}


@st.composite
def workloads(draw):
    reqs = []
    for _ in range(draw(st.integers(1, 5))):
        length = draw(st.integers(2, 14))
        # mostly a prompt that repeats itself: prompt lookup finds matches
        if draw(st.sampled_from([True, True, False])):
            unit = draw(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=4))
            prompt = (unit * length)[:length]
        else:
            prompt = draw(st.lists(st.integers(2, VOCAB - 1), min_size=length, max_size=length))
        params = SamplingParams(
            temperature=0.0, n=draw(st.integers(1, 2)),
            max_tokens=draw(st.one_of(st.integers(8, 32), st.integers(1, 32))),
            ignore_eos=True, logprobs=draw(st.sampled_from([None, 1])),
            presence_penalty=draw(st.sampled_from([0.0, 0.0, 0.4])))
        reqs.append((prompt, params))
    return reqs


def run(engine: LLMEngine, reqs) -> dict:
    done = {}
    for i, (prompt, params) in enumerate(reqs):
        try:
            engine.add_request(str(i), None, params, prompt_token_ids=prompt)
        except ValueError:  # can never fit the pool: refused alike with or without speculation
            done[str(i)] = "refused"
    for _ in range(3000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.logprobs) for c in out.outputs]
    assert not engine.has_unfinished_requests(), "the engine did not finish"
    bm = engine.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    return done


@settings(max_examples=NUM_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(engine=engines(), spec=spec_configs(), reqs=workloads())
def test_speculation_changes_nothing_but_the_speed(models, engine, spec, reqs):
    target, draft = models
    if "model" in spec:  # a one-layer draft, or the target itself (it accepts a lot)
        spec = {**spec, "model": draft if spec["model"] == "draft" else target}
    expected = run(LLMEngine(target, dtype="float32", **engine), reqs)
    spec_engine = LLMEngine(target, dtype="float32", speculative_config=spec, **engine)
    got = run(spec_engine, reqs)
    assert expected.keys() == got.keys()
    for rid in expected:
        if expected[rid] == "refused":
            assert got[rid] == "refused"
            continue
        for (tokens_a, lps_a), (tokens_b, lps_b) in zip(expected[rid], got[rid]):
            assert tokens_a == tokens_b
            if lps_a is not None:
                for a, b in zip(lps_a, lps_b):
                    assert a.keys() == b.keys()
                    assert all(abs(a[t] - b[t]) < 1e-4 for t in a)
    stats = spec_engine.stats
    num_preempted = stats.num_preemptions_recompute + stats.num_preemptions_swap
    event(f"preempted: {num_preempted > 0}")
    event(f"drafts accepted: {stats.num_spec_accepted_tokens > 0}")
    event(f"method: {spec.get('method', 'draft')}")
    event(f"verifications: {stats.num_spec_verifications > 0}")
    assert stats.num_spec_emitted_tokens == (stats.num_spec_accepted_tokens
                                             + stats.num_spec_verifications)
    assert stats.num_spec_accepted_tokens <= stats.num_spec_proposed_tokens
