"""lab/engine_diff.py (lesson 19): two engines on one workload, the first step and field that
differ.

Two package engines agree at every step on random workloads (Hypothesis: prompts with shared
prefixes, greedy, seeded, parallel sampling and beam search, arrivals, aborts, pools that preempt,
prefix caching and chunked prefill on or off); an engine changed on purpose is named at the step
and field its change acts first (its inputs, its logits, a crash, a sequence's status); bad input
is refused by name.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from budgets import examples
from minipaged import LLMEngine, SamplingParams
from minipaged.engine import llm_engine
from minipaged.lab.engine_diff import Request, compare, diff_engines, record

pytestmark = pytest.mark.lesson19


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def new_engine(path, **settings):
    base = dict(block_size=4, num_gpu_blocks=16, num_cpu_blocks=16, max_model_len=32,
                watermark=0.0, device="cpu", dtype="float32", seed=0)
    return LLMEngine(path, **{**base, **settings})


def greedy(m):
    return SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)


WORKLOAD = [Request([5, 6, 7, 8, 9, 10, 11], greedy(6)),
            Request([5, 6, 7, 8, 20, 21], SamplingParams(n=2, temperature=0.9, seed=3,
                                                         max_tokens=5, ignore_eos=True), 1),
            Request([30, 31, 32], greedy(4), 2, abort_at_step=3)]


@st.composite
def workloads(draw):
    system = draw(st.lists(st.integers(2, 255), min_size=0, max_size=8))
    requests = []
    for _ in range(draw(st.integers(1, 5))):
        own = draw(st.lists(st.integers(2, 255), min_size=1, max_size=10))
        prompt = (system if draw(st.booleans()) else []) + own
        kind = draw(st.sampled_from(["greedy", "seeded", "parallel", "beam"]))
        m = draw(st.integers(1, 8))
        params = {"greedy": lambda: greedy(m),
                  "seeded": lambda: SamplingParams(temperature=0.8, top_p=0.9, max_tokens=m,
                                                   seed=draw(st.integers(0, 99)), ignore_eos=True),
                  "parallel": lambda: SamplingParams(n=2, temperature=1.0, max_tokens=m,
                                                     ignore_eos=True),
                  "beam": lambda: SamplingParams(n=2, use_beam_search=True, temperature=0,
                                                 max_tokens=m, ignore_eos=True)}[kind]()
        arrive = draw(st.integers(0, 4))
        abort = draw(st.one_of(st.none(), st.integers(arrive, arrive + 5)))
        requests.append(Request(prompt, params, arrive, abort))
    engine = dict(num_gpu_blocks=draw(st.integers(12, 24)),
                  enable_prefix_caching=draw(st.booleans()),
                  enable_chunked_prefill=draw(st.booleans()))
    if engine["enable_chunked_prefill"]:
        engine["max_num_batched_tokens"] = draw(st.sampled_from([4, 8, 64]))
    return requests, engine


def fits(engine, workload) -> bool:
    try:
        for r in workload:
            engine.validate_request(r.prompt_token_ids, r.params)
    except ValueError:
        return False
    return True


@settings(max_examples=examples(12), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=workloads())
def test_two_package_engines_agree_at_every_step(tiny_llama, case):
    workload, engine_settings = case
    reference, suspect = (new_engine(tiny_llama[0], **engine_settings) for _ in range(2))
    assume(fits(reference, workload))
    found, run_a, run_b = diff_engines(reference, suspect, workload)
    assert found is None, str(found)
    assert run_a.error is None and len(run_a.steps) == len(run_b.steps)
    assert set(run_a.outputs) == {str(i) for i in range(len(workload))}
    assert all(out.finished for out in run_a.outputs.values())


def test_a_recording_keeps_each_step_and_the_outputs(tiny_llama):
    run = record(new_engine(tiny_llama[0]), WORKLOAD)
    assert run.error is None and [s.step for s in run.steps] == list(range(1, len(run.steps) + 1))
    first = run.steps[0]
    assert list(first.fields) == ["error", "schedule", "inputs", "sequences", "blocks", "queues",
                                  "outputs"]
    assert first.fields["inputs"]["input_ids"] == WORKLOAD[0].prompt_token_ids
    rows, logits = first.logits[0]
    assert rows == ["request 0 sequence 0"] and logits.shape[0] == 1
    assert run.outputs["2"].outputs[0].finish_reason == "abort"
    assert len(run.outputs["1"].outputs[0].token_ids) == 5
    assert run.free_gpu_blocks()[-1] == (len(run.steps), 16)
    assert len(run.snapshots) == len(run.steps) and run.snapshots_around(2, 1, 0)[0].step == 1


def _slots_shifted(seq_runs, block_size, device, drafts=None):
    inputs = model_prepare(seq_runs, block_size, device, drafts)
    decodes = sum(1 for r in seq_runs if not r.is_prompt)
    if decodes:
        inputs.meta.slot_mapping[-decodes:] += 1  # one slot late (a learner's off-by-one)
    return inputs


model_prepare = llm_engine.prepare_inputs


def test_changed_inputs_are_named_at_their_first_step_and_token(tiny_llama):
    reference = record(new_engine(tiny_llama[0]), WORKLOAD)
    with mock.patch.object(llm_engine, "prepare_inputs", _slots_shifted):
        suspect = record(new_engine(tiny_llama[0]), WORKLOAD)
    found = compare(reference, suspect)
    assert (found.step, found.field) == (2, "inputs.slot_mapping[2]")  # after a 2-token chunk
    assert found.suspect == found.reference + 1
    assert "position 7" in found.note and "step 2: inputs.slot_mapping[2] differs" in str(found)


def test_changed_logits_and_a_crash_are_named(tiny_llama):
    reference = record(new_engine(tiny_llama[0]), WORKLOAD)
    engine = new_engine(tiny_llama[0])
    real = engine.worker.execute_model

    def noisy(inputs):
        logits = real(inputs).clone()
        if inputs.meta.num_generation_tokens:  # decode rows only: the model's fault
            logits[-1, 3] += 0.5
        return logits

    engine.worker.execute_model = noisy
    found = compare(reference, record(engine, WORKLOAD))
    assert found.step == 2 and found.field.startswith("logits.row ")
    assert "largest |difference| 0.5" in found.note

    engine = new_engine(tiny_llama[0])
    step = engine.step
    engine.step = lambda: step() if engine.stats.num_steps < 3 else 1 / 0
    crashed = record(engine, WORKLOAD)
    assert crashed.error.startswith("ZeroDivisionError: division by zero (raised in ")
    found = compare(reference, crashed)
    assert (found.step, found.field, found.reference) == (4, "error.crash", "no error")


def test_a_status_that_differs_with_the_same_tokens_is_named(tiny_llama):
    reference = record(new_engine(tiny_llama[0]), WORKLOAD)
    longer = [r._replace(params=greedy(7)) if i == 0 else r for i, r in enumerate(WORKLOAD)]
    with pytest.raises(ValueError, match="different workloads"):
        compare(reference, record(new_engine(tiny_llama[0]), longer))
    engine = new_engine(tiny_llama[0])
    engine.output_processor.check_stop = lambda seq, params: None  # never stops
    suspect = record(engine, WORKLOAD, max_steps=12)
    found = compare(reference, suspect)
    assert found.field == "sequences.request 2 sequence 0.status" or \
        found.field.endswith("sequence 0.status"), str(found)
    assert found.reference.startswith("FINISHED") and found.suspect == "RUNNING"
    assert suspect.error == "requests still unfinished after 12 steps"


def test_bad_workloads_are_refused(tiny_llama):
    with pytest.raises(ValueError, match="workload must be a list of engine_diff.Request"):
        record(new_engine(tiny_llama[0]), [([1, 2], greedy(2))])


def test_a_difference_names_the_blocks_held_differently():
    from minipaged.lab.block_evidence import blocks_that_differ
    from minipaged.lab.engine_diff import Difference

    ours = {"block_tables": {"request 0 sequence 0": ["gpu", [3, 4]],
                             "request 0 sequence 1": ["gpu", [3, 5]],
                             "request 1 sequence 0": ["cpu", [0]]},
            "gpu_ref_counts": {3: 2, 4: 1, 5: 1}}
    theirs = {"block_tables": {"request 0 sequence 0": ["gpu", [3, 4]],
                               "request 0 sequence 1": ["gpu", [3, 4]]},
              "gpu_ref_counts": {3: 2, 4: 1}}
    found = blocks_that_differ(ours, theirs)
    assert found == {
        4: ("ref 1, held by request 0 sequence 0",
            "ref 1, held by request 0 sequence 0, request 0 sequence 1"),
        5: ("ref 1, held by request 0 sequence 1", "ref 0, held by none")}
    text = str(Difference(3, "blocks.gpu_ref_counts", {}, {}, blocks=found))
    assert "GPU block 4: reference ref 1, held by request 0 sequence 0; suspect ref 1" in text
    assert blocks_that_differ(ours, ours) == {}
