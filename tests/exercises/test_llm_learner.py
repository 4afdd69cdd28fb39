"""``LLM(learner=True)``: the learner's engine in-process, built as ``serve --learner`` and the
capstone build it (exercises/served_learner.py): the saved components run during each call, every
part still the package's is named, and a component that raises is named in the error, which keeps
the outputs of the requests that had finished."""
from __future__ import annotations

import pytest

from minipaged import LLM, SamplingParams
from minipaged.engine.llm_engine import LLMEngine
from minipaged.exercises import workbench
from minipaged.exercises.answers import lesson16 as answers
from minipaged.exercises.served_learner import LearnerComponentError

pytestmark = pytest.mark.lesson16
SETTINGS = dict(num_gpu_blocks=20, block_size=4, max_model_len=64)
PROMPTS = [[3, 4, 5, 6, 7], [8, 9, 10]]


@pytest.fixture
def learner_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path))
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    return tmp_path


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def step_that_counts(self):
    self.learner_steps = getattr(self, "learner_steps", 0) + 1
    return answers.step(self)


def step_that_fails_at_step_3(self):
    if self.stats.num_steps >= 2:
        raise RuntimeError("my step lost count")
    return answers.step(self)


def test_nothing_saved_is_the_packages_engine_and_says_so(learner_dir, tiny_llama, capsys):
    llm = LLM(tiny_llama[0], learner=True, **SETTINGS)
    assert "package's: Scheduler (lesson 04: nothing saved yet)" in llm.learner_report
    assert "package's: LLMEngine.step (lesson 16: nothing saved yet)" in llm.learner_report
    assert "yours:" not in llm.learner_report
    assert llm.learner_report in capsys.readouterr().out
    expected = LLM(tiny_llama[0], **SETTINGS).generate(prompt_token_ids=PROMPTS,
                                                       sampling_params=greedy(6), use_tqdm=False)
    assert tokens(llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(6),
                               use_tqdm=False)) == tokens(expected)


def test_the_saved_components_run_during_each_call_only(learner_dir, tiny_llama):
    workbench.save_component("LLMEngine.step", step_that_counts)
    llm = LLM(tiny_llama[0], learner=True, **SETTINGS)
    assert "yours:     LLMEngine.step (lesson 16)" in llm.learner_report
    assert "package's: Scheduler (lesson 04: nothing saved yet)" in llm.learner_report
    assert LLMEngine.step.__module__ == "minipaged.engine.llm_engine"  # between calls
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(6), use_tqdm=False)
    assert llm.llm_engine.learner_steps >= 6  # the saved step ran every step
    assert LLMEngine.step.__module__ == "minipaged.engine.llm_engine"  # the package's is back
    expected = LLM(tiny_llama[0], **SETTINGS).generate(prompt_token_ids=PROMPTS,
                                                       sampling_params=greedy(6), use_tqdm=False)
    assert tokens(outputs) == tokens(expected)
    assert not hasattr(LLM(tiny_llama[0], **SETTINGS).llm_engine, "learner_steps")


def test_a_component_that_raises_is_named_and_the_finished_outputs_are_kept(learner_dir,
                                                                            tiny_llama):
    workbench.save_component("LLMEngine.step", step_that_fails_at_step_3)
    llm = LLM(tiny_llama[0], learner=True, **SETTINGS)
    params = [greedy(1), greedy(10)]  # the first finishes at step 1, the second cannot
    with pytest.raises(LearnerComponentError, match=r"your LLMEngine.step \(lesson 16\) raised "
                                                    r"RuntimeError: my step lost count") as error:
        llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    first, second = error.value.outputs
    assert second is None and first.finished
    expected = LLM(tiny_llama[0], **SETTINGS).generate(prompt_token_ids=PROMPTS[:1],
                                                       sampling_params=greedy(1), use_tqdm=False)
    assert first.outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert "1 of 2 requests had finished" in "".join(error.value.__notes__)
    assert not llm.llm_engine.has_unfinished_requests()  # the unfinished one was aborted
    assert LLMEngine.step.__module__ == "minipaged.engine.llm_engine"


def test_learner_must_be_a_bool(learner_dir, tiny_llama):
    with pytest.raises(TypeError, match="learner must be True or False"):
        LLM(tiny_llama[0], learner="yes", **SETTINGS)


def test_served_in_background_the_saved_components_run_until_the_server_stops(learner_dir,
                                                                                 tiny_llama):
    import httpx

    workbench.save_component("LLMEngine.step", step_that_counts)
    llm = LLM(tiny_llama[0], learner=True, **SETTINGS)
    server = llm.serve_in_background("mine")
    try:
        reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "mine", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        assert llm.llm_engine.learner_steps >= 4  # the server's loop ran the saved step
        assert LLMEngine.step.__module__ == "learner_LLMEngine.step"
    finally:
        server.stop()
    assert LLMEngine.step.__module__ == "minipaged.engine.llm_engine"
    server.stop()  # a second stop does nothing
    assert LLMEngine.step.__module__ == "minipaged.engine.llm_engine"
