"""The OpenAI server over a multi-step engine (``num_scheduler_steps``): streamed and whole
completions and chats carry the tokens, text, logprobs and stops that single steps give, while
each engine step hands the stream several tokens at once."""
import openai
import pytest

from minipaged import LLM, SamplingParams
from serving_helpers import save_tiny_model_with_tokenizer, served_in_process

MODEL = "multi-step-model"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_multi_step_served")
    save_tiny_model_with_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def served(tiny_dir):
    with served_in_process(tiny_dir, MODEL, num_gpu_blocks=96, max_num_seqs=16,
                           num_scheduler_steps=4) as (server, engine):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        yield client, engine


def single_step_text(tiny_dir, prompt: str, **params) -> tuple[str, str]:
    llm = LLM(tiny_dir, num_gpu_blocks=96, max_num_seqs=16)
    out = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    llm.shutdown()
    return out.text, out.finish_reason


def test_completions_streamed_and_whole_equal_single_steps(served, tiny_dir):
    client, engine = served
    runs_before = engine.multi_step.num_runs
    kwargs = dict(model=MODEL, prompt="hello world", max_tokens=13, temperature=0)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(**kwargs, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    want = single_step_text(tiny_dir, "hello world", max_tokens=13, temperature=0)
    assert (whole.text, whole.finish_reason) == want
    assert (streamed, reason) == want
    assert engine.multi_step.num_runs > runs_before  # the requests ran k steps per schedule


def test_logprobs_and_a_stop_string(served, tiny_dir):
    client, _ = served
    text, _ = single_step_text(tiny_dir, "the cat", max_tokens=20, temperature=0)
    stop = text.strip()[3:6] or text[:2]
    out = client.completions.create(model=MODEL, prompt="the cat", max_tokens=20,
                                    temperature=0, logprobs=2, stop=[stop]).choices[0]
    want = single_step_text(tiny_dir, "the cat", max_tokens=20, temperature=0, stop=[stop])
    assert (out.text, out.finish_reason) == want and want[1] == "stop"
    assert all(len(top) >= 2 for top in out.logprobs.top_logprobs)
