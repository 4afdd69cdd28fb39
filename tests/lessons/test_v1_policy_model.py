"""Lesson 17's model of vLLM V1's scheduling policy (minipaged/lab/v1_policy.py): the budget, the
pool and the recompute rule hold on random traces, and the lesson's trace gives the steps the
lesson describes."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.lab.v1_policy import (TraceRequest, minipaged_steps, v1_attention_metadata,
                                     v1_steps)

pytestmark = pytest.mark.lesson17

LESSON_TRACE = [TraceRequest("a", 10, 4), TraceRequest("b", 7, 3), TraceRequest("c", 5, 2)]


def test_the_lessons_tight_trace_preempts_b_and_recomputes_its_sampled_tokens():
    steps = v1_steps(LESSON_TRACE, token_budget=8, block_size=4, num_blocks=6)
    assert [s.num_scheduled_tokens for s in steps] == [
        {"a": 8}, {"a": 2, "b": 6}, {"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 1},
        {"b": 8}, {"b": 1, "c": 5}, {"c": 1}]
    assert steps[4].preempted == ["b"]  # b is the newest running request: it preempts itself
    assert steps[2].blocks_held == {"a": 3, "b": 2}  # c waits: it needs 2 blocks, 1 is free


def test_v1_takes_blocks_as_computed_tokens_grow_minipaged_at_admission():
    v1 = v1_steps(LESSON_TRACE, token_budget=8, block_size=4, num_blocks=16)
    here = minipaged_steps(LESSON_TRACE, token_budget=8, block_size=4, num_blocks=16)
    assert [s.num_scheduled_tokens for s in v1] == [s.num_scheduled_tokens for s in here]
    assert v1[0].blocks_held == {"a": 2} and here[0].blocks_held == {"a": 3}


def test_attention_metadata_of_a_chunk_next_to_a_new_prompt():
    steps = v1_steps(LESSON_TRACE, token_budget=8, block_size=4, num_blocks=6)
    meta = v1_attention_metadata(steps)
    assert meta[1] == {"requests": ["a", "b"], "query_start_loc": [0, 2, 8], "seq_lens": [10, 6]}
    assert meta[5] == {"requests": ["b"], "query_start_loc": [0, 8], "seq_lens": [8]}  # recompute


@pytest.mark.parametrize("kwargs, field", [
    (dict(token_budget=0, block_size=4, num_blocks=6), "token_budget"),
    (dict(token_budget=8, block_size=True, num_blocks=6), "block_size"),
    (dict(token_budget=8, block_size=4, num_blocks=2), "num_blocks"),
])
def test_bad_input_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        v1_steps(LESSON_TRACE, **kwargs)
    with pytest.raises(ValueError, match="distinct"):
        v1_steps([TraceRequest("a", 1, 1), TraceRequest("a", 2, 1)], 8, 4, 6)


traces = st.lists(st.tuples(st.integers(1, 30), st.integers(1, 8)), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(traces, st.integers(1, 16), st.sampled_from([1, 2, 4, 8]), st.integers(0, 12))
def test_v1_policy_invariants_on_random_traces(trace, budget, block_size, spare_blocks):
    requests = [TraceRequest(f"r{i}", p, m) for i, (p, m) in enumerate(trace)]
    num_blocks = max(math.ceil((p + m) / block_size) for p, m in trace) + spare_blocks
    steps = v1_steps(requests, budget, block_size, num_blocks, max_steps=2000)
    computed = {r.name: 0 for r in requests}
    sampled = {r.name: 0 for r in requests}
    finished = []
    for step in steps:
        assert 0 < sum(step.num_scheduled_tokens.values()) <= budget
        assert sum(step.blocks_held.values()) <= num_blocks
        for name in step.preempted:
            computed[name] = 0
        spec = {r.name: r for r in requests}
        for name, tokens in step.num_scheduled_tokens.items():
            assert tokens > 0
            computed[name] += tokens
            num_tokens = spec[name].prompt_len + sampled[name]
            assert computed[name] <= num_tokens  # never past what exists
            if computed[name] == num_tokens:
                sampled[name] += 1
            if name in step.blocks_held:  # blocks cover exactly the computed tokens
                assert step.blocks_held[name] == math.ceil(computed[name] / block_size)
        finished += step.finished
    assert sorted(finished) == sorted(r.name for r in requests)
    assert sampled == {r.name: r.max_tokens for r in requests}
