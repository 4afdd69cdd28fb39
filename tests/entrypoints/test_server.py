"""`minipaged serve` in a subprocess with a tiny random LLaMA, driven by the official openai client
(lesson 13): completions and chat, streamed and not, 32 concurrent clients, bad input.

Slow: ~45 s on the 2-core machine (measured at load ~9): a server subprocess and 32 clients.
"""
import asyncio

import httpx
import openai
import pytest

from minipaged import LLM, SamplingParams
from serving_helpers import read_metrics, running_server, save_tiny_model_with_tokenizer
from tiny_models import greedy_reference, pick_prompts

pytestmark = [pytest.mark.lesson13, pytest.mark.slow]
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
    ("a bool among token ids", '{"model": "tiny", "prompt": [[1, true]]}', 400, "prompt"),
    ("a number for a prompt", '{"model": "tiny", "prompt": 5}', 400, "prompt"),
    ("a number for stop", '{"model": "tiny", "prompt": "x", "stop": 5}', 400, "stop"),
    ("max_tokens past the context",
     '{"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 254}', 400, "prompt"),
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


BAD_CHAT_BODIES = [
    # (what, messages or extra fields, param, words in the message)
    ("a number for content", {"messages": [{"role": "user", "content": 5}]},
     "messages.0.content", "a string or a list of text parts"),
    ("an image part", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content", "a string or a list of text parts"),
    ("a list of numbers for stop",
     {"messages": [{"role": "user", "content": "x"}], "stop": [1, 2]}, "stop",
     "a string or a list of strings"),
]


@pytest.mark.parametrize("what,fields,param,words", BAD_CHAT_BODIES,
                         ids=[b[0] for b in BAD_CHAT_BODIES])
def test_a_field_of_several_types_is_named_itself_with_the_forms_it_accepts(url, what, fields,
                                                                             param, words):
    response = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, **fields},
                          timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param  # not "messages.0.content.str"
    assert error["message"].startswith(param + ": must be") and words in error["message"]
    if param == "prompt":
        return
    response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [[1, True]]},
                          timeout=30)
    assert response.json()["error"]["message"] == (
        "prompt: must be a string, a list of strings, a list of token ids (integers) or a list "
        "of lists of token ids")


# -- logprobs --------------------------------------------------------------------------------------
SAMPLED = dict(temperature=1.5, seed=11, max_tokens=12, extra_body=IGNORE_EOS)


def _chat_logprobs(client, top: int, **sampling):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], logprobs=True,
        top_logprobs=top, **sampling)
    return reply.choices[0].logprobs.content


@pytest.mark.parametrize("sampling", [SAMPLED, dict(SAMPLED, temperature=0)],
                         ids=["temperature 1.5", "greedy"])
def test_chat_top_logprobs_are_exactly_the_n_likeliest_tokens(client, sampling):
    # logprobs do not change sampling: the same seed gives the same tokens with any N, so the
    # top 8 of one request tell what the top N of another must be
    wide = _chat_logprobs(client, 8, **sampling)
    outside = 0
    for n in (0, 1, 2, 5):
        narrow = _chat_logprobs(client, n, **sampling)
        assert [t.token for t in narrow] == [t.token for t in wide]
        for token, reference in zip(narrow, wide):
            assert token.logprob == pytest.approx(reference.logprob, abs=1e-5)
            assert len(token.top_logprobs) == n
            assert [e.token for e in token.top_logprobs] == \
                [e.token for e in reference.top_logprobs[:n]]
            assert [e.logprob for e in token.top_logprobs] == pytest.approx(
                [e.logprob for e in reference.top_logprobs[:n]], abs=1e-5)
            if n and token.logprob < token.top_logprobs[-1].logprob:
                outside += 1  # sampled outside the top N: still only N entries
    if sampling["temperature"]:
        assert outside > 0  # the case the old filter got wrong (N + 1 entries) did occur
    else:
        assert all(t.top_logprobs[0].token == t.token for t in wide)  # greedy: top 1 is chosen


def test_completion_logprobs_are_the_top_n_plus_the_sampled_token_when_not_among_them(client):
    def logprobs(n, sampling):
        reply = client.completions.create(model=MODEL, prompt="Once upon a time", logprobs=n,
                                          **sampling)
        return reply.choices[0].logprobs

    sizes = set()
    for sampling in (SAMPLED, dict(SAMPLED, temperature=0)):
        wide = logprobs(8, sampling)
        for n in (0, 1, 2):
            lp = logprobs(n, sampling)
            assert lp.tokens == wide.tokens
            for token, chosen, top, reference in zip(lp.tokens, lp.token_logprobs,
                                                     lp.top_logprobs, wide.top_logprobs):
                expected = dict(list(reference.items())[:n])  # the top n, most likely first
                if token not in expected:  # OpenAI: the sampled token is always there too
                    expected[token] = chosen
                assert list(top) == list(expected)
                assert list(top.values()) == pytest.approx(list(expected.values()), abs=1e-5)
                sizes.add((n, len(top)))
    # both cases occurred: the sampled token among the top n (greedy), and outside it, with
    # one more entry for it (temperature 1.5)
    assert sizes == {(0, 1), (1, 1), (1, 2), (2, 2), (2, 3)}


def test_streamed_completion_text_offsets_count_from_the_start_of_the_text(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", logprobs=1, **SAMPLED)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    tokens, offsets = [], []
    chunks = list(client.completions.create(**kwargs, stream=True))
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                offsets += choice.logprobs.text_offset
    assert len(chunks) > 3
    assert tokens == whole.tokens
    assert offsets == whole.text_offset
    assert offsets == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert offsets[-1] > 0


# -- max_tokens and usage --------------------------------------------------------------------------
def test_without_max_tokens_the_default_fits_the_pool_for_all_sequences(client):
    """n sequences of "what the context leaves" may not fit the pool: the default is capped."""
    n, pool, block, context = 12, 96, 16, 256  # the server's --num-gpu-blocks 96, the model's
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], n=n, temperature=1.0,
        seed=1, extra_body=IGNORE_EOS)
    prompt = reply.usage.prompt_tokens
    # the longest sequence for which n of them fit: the prompt's full blocks shared, the rest
    # of each sequence in blocks of its own
    shared = prompt // block
    longest = min(shared * block + (pool - shared) // n * block, context)
    assert longest < context  # (so the pool, not the context, sets the default here)
    assert len(reply.choices) == n
    assert all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == n * (longest - prompt)
    # one sequence fits the whole context: the default is what the context leaves
    one = client.completions.create(model=MODEL, prompt=[5] * 200, extra_body=IGNORE_EOS)
    assert one.usage.completion_tokens == 16  # the completions default, as OpenAI
    left = client.completions.create(model=MODEL, prompt=[5] * 250, extra_body=IGNORE_EOS)
    assert left.usage.completion_tokens == context - 250


def test_a_max_tokens_past_the_context_is_refused_with_the_lengths(client):
    messages = [{"role": "user", "content": "Hello"}]
    prompt = client.chat.completions.create(model=MODEL, messages=messages,
                                            max_tokens=1).usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=256)
    error = refused.value.body
    assert error["message"] == (
        f"This model's maximum context length is 256 tokens. However, you requested "
        f"{prompt + 256} tokens ({prompt} in the messages, 256 in the completion). Please "
        f"reduce the length of the messages or completion.")
    assert (error["param"], error["code"]) == ("messages", "context_length_exceeded")
    # exactly the context is fine, and runs to it
    ok = client.chat.completions.create(model=MODEL, messages=messages,
                                        max_tokens=256 - prompt, extra_body=IGNORE_EOS)
    assert ok.usage.total_tokens == 256
    with pytest.raises(openai.BadRequestError, match=r"\(3 in the prompt, 254 in the comp"):
        client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=254)


def test_usage_counts_the_returned_choices_not_the_best_of_candidates(client, url):
    before = read_metrics(url)["minipaged_generation_tokens_total"]
    reply = client.completions.create(model=MODEL, prompt=["Once", "The sky is"], n=2,
                                      best_of=3, max_tokens=5, temperature=1.0, seed=3,
                                      extra_body=IGNORE_EOS)
    generated = read_metrics(url)["minipaged_generation_tokens_total"] - before
    assert len(reply.choices) == 4 and all(c.finish_reason == "length" for c in reply.choices)
    assert reply.usage.completion_tokens == 4 * 5  # 2 prompts x n = 2 choices x 5 tokens
    # the engine ran best_of = 3 sequences per prompt, and the counter counts all they sampled
    assert generated == 2 * 3 * 5
    prompt_tokens = sum(client.completions.create(model=MODEL, prompt=p, max_tokens=1)
                        .usage.prompt_tokens for p in ("Once", "The sky is"))
    assert reply.usage.prompt_tokens == prompt_tokens  # each prompt once, whatever n is
    assert reply.usage.total_tokens == prompt_tokens + 20


# -- unexpected errors ---------------------------------------------------------------------------
def test_an_unexpected_exception_is_a_json_500_and_the_server_keeps_serving(tiny, monkeypatch):
    from minipaged.engine.async_llm_engine import AsyncLLMEngine
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.entrypoints.api_server import BackgroundServer, build_app

    engine = LLMEngine(tiny[0], num_gpu_blocks=32, max_model_len=256)
    real_encode = engine.tokenizer.encode

    def encode(text, *args, **kwargs):
        if "boom" in text:
            raise RuntimeError("the tokenizer broke")
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    with BackgroundServer(build_app(AsyncLLMEngine(engine), MODEL)) as server:
        bodies = [("/v1/completions", {"prompt": "boom"}),
                  ("/v1/completions", {"prompt": ["fine", "boom"], "stream": True}),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "boom"}]})]
        for path, body in bodies:
            response = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=30)
            assert response.status_code == 500
            assert response.headers["content-type"] == "application/json"
            assert response.json() == {"error": {
                "message": "internal error while handling the request: RuntimeError: the "
                           "tokenizer broke", "type": "server_error", "param": None,
                "code": "internal_error"}}
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="tokenizer broke"):
            client.completions.create(model=MODEL, prompt="boom")
        ok = client.completions.create(model=MODEL, prompt="fine", max_tokens=3,
                                       extra_body=IGNORE_EOS)
        assert ok.usage.completion_tokens == 3
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        assert engine.get_num_unfinished_requests() == 0
