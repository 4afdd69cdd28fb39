"""`minipaged serve` in a subprocess with a tiny random LLaMA, driven by the official openai client
(lesson 08): completions and chat, streamed and not, 32 concurrent clients, bad input."""
import asyncio

import httpx
import openai
import pytest

from minipaged import LLM, SamplingParams
from serving_helpers import read_metrics, running_server, save_tiny_model_with_tokenizer
from tiny_models import greedy_reference, pick_prompts

pytestmark = pytest.mark.lesson08
MODEL = "tiny"
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, transformers model, tokenizer)."""
    path = tmp_path_factory.mktemp("tiny_served")
    model, tokenizer = save_tiny_model_with_tokenizer(path)
    return str(path), model, tokenizer


@pytest.fixture(scope="module")
def url(tiny, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server(tiny[0], "--num-gpu-blocks", "96", "--max-num-seqs", "16",
                        name=MODEL, log_path=log) as base_url:
        yield base_url


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def streamed_text(stream) -> tuple[str, str, list]:
    """(text, finish_reason, chunks) of a streamed single-choice completion or chat."""
    chunks = list(stream)
    text, reason = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else choice.delta.content
            text += piece or ""
            reason = choice.finish_reason or reason
    return text, reason, chunks


def test_models_health_and_metrics_endpoints(url, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    metrics = read_metrics(url)
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped",
                 "gpu_blocks_used", "prompt_tokens_total", "generation_tokens_total"):
        assert f"minipaged_{name}" in metrics
    assert metrics["minipaged_gpu_blocks_total"] == 96
    assert 'minipaged_preemptions_total{mode="recompute"}' in metrics


def test_completion_streamed_equals_non_streamed_equals_transformers_greedy(client, tiny):
    path, model, tokenizer = tiny
    for prompt in pick_prompts(model, [7], 12):
        expected = tokenizer.decode(greedy_reference(model, prompt, 12), skip_special_tokens=True)
        kwargs = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                      extra_body=IGNORE_EOS)
        whole = client.completions.create(**kwargs)
        assert whole.choices[0].text == expected
        assert whole.choices[0].finish_reason == "length"
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(prompt), 12)
        text, reason, chunks = streamed_text(client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}))
        assert (text, reason) == (expected, "length")
        assert len(chunks) > 3  # streamed piece by piece, not in one go
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_chat_streamed_equals_non_streamed_equals_offline_llm_chat(client, tiny):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three colours."}]
    offline = LLM(tiny[0], num_gpu_blocks=32).chat(
        messages, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    kwargs = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                  extra_body=IGNORE_EOS)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.content == offline[0].outputs[0].text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(offline[0].prompt_token_ids)
    text, reason, chunks = streamed_text(client.chat.completions.create(**kwargs, stream=True))
    assert (text, reason) == (whole.choices[0].message.content, "length")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_32_concurrent_clients_are_each_answered_correctly(url, tiny):
    prompts = [[(7 * k + 3 * i) % 250 + 2 for i in range(3 + 2 * k)] for k in range(8)]
    # the oracle: the same engine offline, all prompts in one batch (the test above checks the
    # engine against transformers); the server must give each client the same answer whatever
    # else arrives around it
    offline = LLM(tiny[0], num_gpu_blocks=64).generate(
        prompt_token_ids=prompts, use_tqdm=False,
        sampling_params=SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    expected = [o.outputs[0].text for o in offline]
    jobs = [(i % len(prompts), i % 2 == 0) for i in range(32)]  # half of them stream

    async def one(client, k, stream):
        kwargs = dict(model=MODEL, prompt=prompts[k], max_tokens=10, temperature=0,
                      extra_body=IGNORE_EOS)
        if not stream:
            return (await client.completions.create(**kwargs)).choices[0].text
        text = ""
        async for chunk in await client.completions.create(**kwargs, stream=True):
            text += "".join(c.text for c in chunk.choices)
        return text

    async def run():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, k, s) for k, s in jobs))

    answers = asyncio.run(run())
    assert answers == [expected[k] for k, _ in jobs]
    metrics = read_metrics(url)
    assert metrics["minipaged_gpu_blocks_used"] == 0
    assert metrics["minipaged_num_requests_running"] == 0


def test_parallel_sampling_several_prompts_seed_and_logprobs(client):
    kwargs = dict(model=MODEL, prompt=["Once upon", "The sky"], n=2, temperature=0.9, seed=7,
                  max_tokens=6, logprobs=2, extra_body=IGNORE_EOS)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded
    assert first.usage.completion_tokens == 4 * 6
    for choice in first.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
        assert all(v <= 0 for v in lp.token_logprobs)
        assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)  # top 2, plus the chosen one
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3, extra_body=IGNORE_EOS)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 3 for t in content)


def test_stop_string_cuts_the_text_streamed_or_not(client):
    kwargs = dict(model=MODEL, prompt="A list of words:", max_tokens=16, temperature=0,
                  extra_body=IGNORE_EOS)
    full = client.completions.create(**kwargs).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full[:full.find(stop)]
    whole = client.completions.create(**kwargs, stop=[stop]).choices[0]
    assert (whole.text, whole.finish_reason) == (cut, "stop")
    text, reason, _ = streamed_text(client.completions.create(**kwargs, stop=[stop], stream=True))
    assert (text, reason) == (cut, "stop")


BAD_BODIES = [
    # (what, raw body, status, param)
    ("malformed JSON", '{"model": "tiny", "prompt": "x"', 400, None),
    ("not an object", '["tiny"]', 400, None),
    ("a string for a number", '{"model": "tiny", "prompt": "x", "temperature": "hot"}', 400,
     "temperature"),
    ("a float for an integer", '{"model": "tiny", "prompt": "x", "max_tokens": 2.5}', 400,
     "max_tokens"),
    ("an unknown field", '{"model": "tiny", "prompt": "x", "temprature": 0}', 400, "temprature"),
    ("a missing prompt", '{"model": "tiny"}', 400, "prompt"),
    ("top_p out of range", '{"model": "tiny", "prompt": "x", "top_p": 2}', 400, "top_p"),
    ("negative max_tokens", '{"model": "tiny", "prompt": "x", "max_tokens": -1}', 400,
     "max_tokens"),
    ("logprobs too many", '{"model": "tiny", "prompt": "x", "logprobs": 99}', 400, "logprobs"),
    ("an empty prompt", '{"model": "tiny", "prompt": ""}', 400, "prompt"),
    ("token ids out of the vocabulary", '{"model": "tiny", "prompt": [1, -5]}', 400, "prompt"),
    ("a prompt longer than the model allows",
     '{"model": "tiny", "prompt": [' + ", ".join(["7"] * 300) + "]}", 400, "prompt"),
    ("n over max_num_seqs", '{"model": "tiny", "prompt": "x", "n": 40}', 400, "best_of"),
    ("streaming best_of > n", '{"model": "tiny", "prompt": "x", "best_of": 3, "stream": true}',
     400, "stream"),
    ("an unknown model", '{"model": "gpt-5", "prompt": "x"}', 404, "model"),
]


@pytest.mark.parametrize("what,body,status,param", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_completion_requests_get_an_openai_error_body(url, what, body, status, param):
    response = httpx.post(url + "/v1/completions", content=body, timeout=30,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_bad_chat_requests_raise_in_the_openai_client_and_the_server_keeps_serving(client, url):
    for messages in ([], [{"role": "wizard", "content": "hi"}], [{"content": "no role"}]):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert httpx.get(url + "/v2/nothing").json()["error"]["type"] == "not_found_error"
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                        max_tokens=3, extra_body=IGNORE_EOS)
    assert ok.usage.completion_tokens == 3
    assert read_metrics(url)["minipaged_engine_healthy"] == 1
