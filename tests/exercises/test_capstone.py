"""Lesson 16: the engine assembled from plug-ins makes the same choices as ``LLM()``.

With the answers plugged in, ``AssembledEngine`` must give the same tokens and the same block
tables as ``LLMEngine`` after every step, on random workloads that preempt and fork; a wrong
plug-in is caught, and the message names the step and the plug-in. The exercises' checkers pass
with the answers, fail with wrong ones, and say "not done yet".
"""
from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budgets import examples
from minipaged import SamplingParams
from minipaged.exercises import lesson16 as ex
from minipaged.exercises import not_done, solutions
from minipaged.lab.assembled_engine import PLUGINS, AssembledEngine

pytestmark = pytest.mark.lesson16


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def counts(message: str) -> tuple[int, int]:
    found = re.search(r"(\d+) preemptions, (\d+) copy-on-write copies", message)
    assert found, message
    return int(found.group(1)), int(found.group(2))


def test_the_answers_match_llm_on_the_default_workload_with_preemption_and_forks():
    result = ex.check_engine()
    assert result.passed, result
    preemptions, copies = counts(result)
    assert preemptions >= 1 and copies >= 1


def fits(prompt_len, max_tokens, n, num_gpu_blocks, block_size=4):
    """Does one request of n sequences fit the pool alone (what LLM() accepts)?"""
    shared = prompt_len // block_size if n > 1 else 0
    per_seq = -(-(prompt_len + max_tokens - shared * block_size) // block_size)
    return shared + n * per_seq <= num_gpu_blocks


@st.composite
def workloads(draw):
    num_gpu_blocks = draw(st.integers(10, 16))
    requests = []
    for i in range(draw(st.integers(2, 5))):
        prompt = draw(st.lists(st.integers(3, 255), min_size=1, max_size=10))
        max_tokens = draw(st.integers(1, 9))
        n = draw(st.integers(1, 3))
        if not fits(len(prompt), max_tokens, n, num_gpu_blocks):
            n = 1
        if draw(st.booleans()):  # greedy, n sequences (they stay alike: same tokens)
            params = SamplingParams(n=n, temperature=0,
                                    max_tokens=max_tokens, ignore_eos=draw(st.booleans()))
        else:  # top-p sampling, seeded
            params = SamplingParams(temperature=draw(st.sampled_from([0.7, 1.0])),
                                    top_p=draw(st.sampled_from([0.5, 0.9, 1.0])),
                                    max_tokens=max_tokens, seed=draw(st.integers(0, 99)))
        requests.append(ex.Request(prompt, params, draw(st.integers(0, 4))))
    return requests, num_gpu_blocks


@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=workloads())
def test_the_answers_match_llm_step_by_step_on_random_workloads(case):
    workload, num_gpu_blocks = case
    result = ex.check_engine(workload=workload, num_gpu_blocks=num_gpu_blocks)
    assert result.passed, result


def test_random_workloads_in_a_tiny_pool_preempt_and_copy_and_still_match():
    rng = __import__("random").Random(7)
    total_preemptions = total_copies = 0
    for _ in range(3):
        workload = []
        for _ in range(5):
            prompt = [rng.randrange(3, 256) for _ in range(rng.randint(3, 9))]
            max_tokens, n = rng.randint(4, 9), rng.choice([1, 2, 3])
            n = n if fits(len(prompt), max_tokens, n, 10) else 1
            workload.append(ex.Request(prompt, SamplingParams(
                n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True), rng.randint(0, 2)))
        result = ex.check_engine(workload=workload, num_gpu_blocks=10)
        assert result.passed, result
        preemptions, copies = counts(result)
        total_preemptions += preemptions
        total_copies += copies
    assert total_preemptions > 0 and total_copies > 0


def cow_never_copies(block_table, ref_counts, needs_new_block):
    return "new block" if needs_new_block else "in place"


def slot_of_off_by_one(block_table, position, block_size):
    return solutions.slot_of(block_table, position, block_size) + 1


def oldest_is_the_victim(running, num_free):
    kept, preempted = solutions.pick_victims(list(reversed(running)), num_free)
    return list(reversed(kept)), preempted


def never_grows(block_table, num_tokens, block_size, allocate):
    pass


@pytest.mark.parametrize("name, wrong", [
    ("append_action", cow_never_copies),
    ("slot_of", slot_of_off_by_one),
    ("pick_victims", oldest_is_the_victim),
    ("grow_block_table", never_grows),
])
def test_a_wrong_plug_in_is_caught_and_named_with_its_step(name, wrong):
    result = ex.check_engine(ex.assemble(**{name: wrong}))
    assert result.status == "failed", result
    assert re.search(r"step \d+", result)
    assert f"the first plug-in that disagreed with its answer: {name}, in step" in result
    assert len(result.splitlines()) <= 12


def test_a_table_difference_names_the_sequence_and_both_tables():
    result = ex.check_engine(ex.assemble(append_action=cow_never_copies))
    assert "block table of sequence" in result or "tokens of sequence" in result
    assert "yours:" in result and "LLM():" in result


def test_unanswered_plug_ins_fall_back_to_the_answers_and_the_check_says_so():
    def slot_of(block_table, position, block_size):
        not_done()

    def fork(parent_table, ref_counts):
        return solutions.fork(parent_table, ref_counts)

    result = ex.check_engine(ex.assemble(slot_of=slot_of, fork=fork))
    assert result.passed, result
    assert "your plug-ins: fork" in result
    assert "the others are the answers from solutions.py" in result


def test_every_plug_in_the_learners_own_and_right():
    answers = ex.package_plugins()
    own = {name: (lambda f: lambda *args: f(*args))(answers[name]) for name in PLUGINS}
    result = ex.check_engine(ex.assemble(**own))
    assert result.passed, result
    assert f"your plug-ins: {', '.join(sorted(PLUGINS))}" in result
    assert "the others" not in result


def test_a_request_the_pool_cannot_hold_is_a_clear_error():
    too_big = ex.Request(list(range(3, 40)), SamplingParams(n=3, temperature=0, max_tokens=9))
    with pytest.raises(ValueError, match="workload: request 0"):
        ex.check_engine(workload=[too_big], num_gpu_blocks=10)


def test_a_plug_in_left_out_of_the_dict_is_its_answer():
    result = ex.check_engine({"append_action": cow_never_copies})
    assert result.status == "failed" and "append_action" in result
    assert ex.check_engine({"fork": solutions.fork}).passed


def test_assemble_refuses_unknown_names():
    with pytest.raises(ValueError, match="unknown plug-ins"):
        ex.assemble(slot_off=solutions.slot_of)


def test_the_engine_refuses_missing_plug_ins_and_unsupported_sampling():
    llm = ex.tiny_llm()
    with pytest.raises(ValueError, match="plugins: missing"):
        AssembledEngine(llm.llm_engine.worker.model, {}, 4, 8, (2, 2, 16), 32)
    engine = ex.engine_like(llm, ex.package_plugins())
    with pytest.raises(ValueError, match="params"):
        engine.add_request("0", [5, 6], SamplingParams(top_k=3), 0.0)
    assert set(ex.package_plugins()) == set(PLUGINS)


def test_top_p_plug_in_equals_the_package_filter():
    logits = torch.randn(50)
    top_p = ex.package_plugins()["top_p_filter"]
    from minipaged.worker.sampler import top_k_top_p_filter
    assert torch.equal(top_p(logits, 0.8), top_k_top_p_filter(logits, -1, 0.8))


# -- the exercises' checkers ---------------------------------------------------------------------
def test_check_pick_victims():
    assert ex.check_pick_victims(solutions.pick_victims).passed
    result = ex.check_pick_victims(oldest_is_the_victim)
    assert result.status == "failed" and "hint" in result and len(result.splitlines()) == 5

    def never_preempts(running, num_free):
        return [g.request_id for g in running], []

    assert ex.check_pick_victims(never_preempts).status == "failed"

    def unanswered(running, num_free):
        not_done()

    assert ex.check_pick_victims(unanswered).status == "not done"


def test_check_step_slot_mapping():
    assert ex.check_step_slot_mapping(solutions.step_slot_mapping).passed

    def decodes_first(seqs, block_size, slot_of):
        decodes = [s for s in seqs if s.num_computed_tokens > 0]
        prompts = [s for s in seqs if s.num_computed_tokens == 0]
        return (solutions.step_slot_mapping(decodes, block_size, slot_of)
                + solutions.step_slot_mapping(prompts, block_size, slot_of))

    result = ex.check_step_slot_mapping(decodes_first)
    assert result.status == "failed" and "prompt runs come first" in result

    def unanswered(seqs, block_size, slot_of):
        not_done()

    assert ex.check_step_slot_mapping(unanswered).status == "not done"
