"""The learner's engine, served (``minipaged serve --learner``, lesson 16): built from the saved
components as the capstone builds it, every part still the package's named, and a component that
raises named in the engine loop's error, which the server, /health and the live page report."""
from __future__ import annotations

import json

import httpx
import pytest

from minipaged import SamplingParams
from minipaged.engine.async_llm_engine import AsyncLLMEngine
from minipaged.engine.llm_engine import LLMEngine
from minipaged.entrypoints.api_server import BackgroundServer, build_app
from minipaged.exercises import workbench
from minipaged.exercises.answers import lesson16 as answers
from minipaged.exercises.served_learner import LearnerComponentError, learner_engine

pytestmark = pytest.mark.lesson16
SETTINGS = dict(num_gpu_blocks=20, block_size=4, max_model_len=64)


@pytest.fixture
def learner_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path))
    monkeypatch.delenv("MINIPAGED_SOLUTIONS", raising=False)
    return tmp_path


def greedy(engine) -> list[int]:
    engine.add_request("a", None, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       [3, 4, 5, 6, 7])
    while engine.has_unfinished_requests():
        out = engine.step()
    return out[0].outputs[0].token_ids


def broken_step(self):
    return 1 / 0  # a learner's step that fails


def test_the_saved_step_serves_and_the_rest_is_named_as_the_packages(learner_dir, tiny_llama):
    workbench.save_component("LLMEngine.step", answers.step)
    with learner_engine(tiny_llama[0], **SETTINGS) as (engine, report):
        assert "yours:     LLMEngine.step (lesson 16)" in report
        assert "package's: Scheduler (lesson 04: nothing saved yet)" in report
        assert "package's: softmax_phase_cuda" in report  # left out, and why
        assert LLMEngine.step.__module__ == "learner_LLMEngine.step"  # the saved one runs
        tokens = greedy(engine)
    assert LLMEngine.step.__module__ == "minipaged.engine.llm_engine"  # the package's is back
    assert tokens == greedy(LLMEngine(tiny_llama[0], **SETTINGS))


def test_serve_learner_serves_it_and_prints_what_is_whose(learner_dir, tiny_llama, monkeypatch,
                                                          capsys):
    import minipaged.entrypoints.api_server
    from minipaged.entrypoints import cli

    workbench.save_component("LLMEngine.step", answers.step)
    served = {}

    def fake_serve(async_engine, name, *args):  # (where the server would start)
        served.update(step=LLMEngine.step.__module__, blocks=async_engine.engine.block_size)

    monkeypatch.setattr(minipaged.entrypoints.api_server, "serve", fake_serve)
    code = cli.main(["serve", tiny_llama[0], "--learner", "--num-gpu-blocks", "20",
                     "--block-size", "4", "--max-model-len", "64"])
    assert code == 0
    assert served == {"step": "learner_LLMEngine.step", "blocks": 4}
    out = capsys.readouterr().out
    assert "yours:     LLMEngine.step" in out and "package's: Scheduler" in out


def test_a_component_that_raises_is_named_by_the_server(learner_dir, tiny_llama):
    workbench.save_component("LLMEngine.step", broken_step)
    with learner_engine(tiny_llama[0], **SETTINGS) as (engine, _):
        with pytest.raises(LearnerComponentError, match=r"your LLMEngine.step \(lesson 16\) "
                                                        r"raised ZeroDivisionError"):
            engine.step()
        with BackgroundServer(build_app(AsyncLLMEngine(engine), "learner")) as server:
            reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "model": "learner", "prompt": [3, 4, 5], "max_tokens": 2})
            assert "your LLMEngine.step (lesson 16) raised ZeroDivisionError" in reply.text
            health = httpx.get(server.url + "/health")
            assert health.status_code == 500 and "your LLMEngine.step" in health.text
            with httpx.stream("GET", server.url + "/live/events", timeout=30) as events:
                lines = list(events.iter_lines())  # an error event, then the stream ends
            assert "event: error" in lines
            assert "your LLMEngine.step" in json.loads(lines[lines.index("event: error") + 1][5:])
