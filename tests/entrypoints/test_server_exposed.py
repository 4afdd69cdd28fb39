"""A server that can be exposed (lesson 13): the API key, each request limit and its 4xx, the
bounded waiting queue (503 + Retry-After), tokenizing off the event loop, and validation left to
the engine. Servers run in this process on a free 127.0.0.1 port, with a tiny random LLaMA."""
import threading
import time

import httpx
import openai
import pytest

from minipaged.entrypoints import cli
from minipaged.entrypoints.api_server import ServerOptions
from minipaged.entrypoints.auth import same_key
from minipaged.entrypoints.limits import ServerLimits, longest_token_chars
from serving_helpers import (read_metrics, save_tiny_model_with_tokenizer, served_in_process,
                             wait_for_metrics)

pytestmark = pytest.mark.lesson13
MODEL, KEY = "tiny", "sk-test-0123456789"
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_exposed")
    save_tiny_model_with_tokenizer(path)
    return str(path)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# -- the API key -------------------------------------------------------------------------------
def test_same_key_compares_whole_keys():
    assert same_key(KEY.encode(), KEY)
    for wrong in (b"", KEY[:-1].encode(), (KEY + "x").encode(), KEY.upper().encode()):
        assert not same_key(wrong, KEY)


def test_the_key_guards_v1_and_metrics_and_the_openai_client_passes_with_it(tiny_dir):
    with served_in_process(tiny_dir, MODEL, ServerOptions(api_key=KEY),
                           num_gpu_blocks=32) as (server, _):
        url = server.url
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [MODEL]
        reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3,
                                          extra_body=IGNORE_EOS)
        assert reply.usage.completion_tokens == 3
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            wrong.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
        assert refused.value.body["code"] == "invalid_api_key"
        assert KEY not in str(refused.value) and "sk-wrong" not in str(refused.value)

        no_key = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        assert "no API key" in error_of(no_key, 401)["message"]
        assert no_key.headers["www-authenticate"] == "Bearer"
        for header in (f"Bearer {KEY}x", f"Basic {KEY}", KEY, f"Bearer  {KEY[:-1]}"):
            response = httpx.get(url + "/v1/models", headers={"Authorization": header})
            assert error_of(response, 401)["code"] == "invalid_api_key"
        # without the key nothing under /v1 is told apart, not even a route that does not exist
        error_of(httpx.get(url + "/v1/nothing"), 401)
        error_of(httpx.get(url + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}), 404)
        # refused before the body is read: a 50 MB body without the key is answered at once
        start = time.monotonic()
        error_of(httpx.post(url + "/v1/completions", content=b"x" * 50_000_000, timeout=30), 401)
        assert time.monotonic() - start < 2
        assert httpx.get(url + "/health").json() == {"status": "ok"}  # open for probes
        error_of(httpx.get(url + "/metrics"), 401)
        metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert "minipaged_gpu_blocks_total 32" in metrics.text


def test_metrics_public_opens_metrics_only(tiny_dir):
    options = ServerOptions(api_key=KEY, metrics_public=True)
    with served_in_process(tiny_dir, MODEL, options, num_gpu_blocks=16) as (server, _):
        assert "minipaged_engine_healthy 1" in httpx.get(server.url + "/metrics").text
        error_of(httpx.get(server.url + "/v1/models"), 401)


def test_serve_flags_and_the_environment_reach_the_server_options(monkeypatch, tiny_dir):
    import minipaged.entrypoints.api_server

    served = {}
    monkeypatch.setattr(minipaged.entrypoints.api_server, "serve",
                        lambda async_engine, name, *args: served.update(options=args[-1]))
    monkeypatch.setenv("MINIPAGED_API_KEY", "from-the-environment")
    assert cli.main(["serve", tiny_dir, "--num-gpu-blocks", "16", "--max-body-bytes", "5000",
                     "--max-stop-strings", "3", "--max-waiting-requests", "7",
                     "--metrics-public"]) == 0
    options = served["options"]
    assert (options.api_key, options.metrics_public) == ("from-the-environment", True)
    assert options.limits == ServerLimits(max_body_bytes=5000, max_stop_strings=3,
                                          max_waiting_requests=7)
    assert cli.main(["serve", tiny_dir, "--num-gpu-blocks", "16", "--api-key", KEY]) == 0
    assert served["options"].api_key == KEY and served["options"].limits == ServerLimits()
    monkeypatch.delenv("MINIPAGED_API_KEY")
    assert cli.main(["serve", tiny_dir, "--num-gpu-blocks", "16"]) == 0
    assert served["options"].api_key is None
    served.clear()
    assert cli.main(["serve", tiny_dir, "--max-n", "0"]) == 2  # refused before loading
    assert served == {}


# -- the limits ----------------------------------------------------------------------------------
LIMITS = ServerLimits(max_body_bytes=4096, max_prompt_chars=100, max_stop_strings=2,
                      max_stop_chars=5, max_n=3, max_logprobs=2, max_waiting_requests=4)
OVER_LIMITS = [
    # (what, path, fields, param, words in the message)
    ("a prompt over max_prompt_chars", "completions", {"prompt": "x" * 101}, "prompt",
     "101 characters"),
    ("prompts over max_prompt_chars together", "completions", {"prompt": ["x" * 60] * 2},
     "prompt", "120 characters"),
    ("chat messages over max_prompt_chars", "chat/completions",
     {"messages": [{"role": "user", "content": "y" * 101}]}, "messages", "101 characters"),
    ("more prompts than may wait", "completions", {"prompt": ["a"] * 5}, "prompt", "5 prompts"),
    ("too many stop strings", "completions", {"prompt": "x", "stop": ["a", "b", "c"]}, "stop",
     "3 strings"),
    ("a stop string too long", "chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "stop": "abcdef"}, "stop",
     "at most 5 characters"),
    ("n over max_n", "completions", {"prompt": "x", "n": 4}, "n", "at most 3"),
    ("best_of over max_n", "completions", {"prompt": "x", "best_of": 4}, "best_of", "at most 3"),
    ("logprobs over max_logprobs", "completions", {"prompt": "x", "logprobs": 3}, "logprobs",
     "[0, 2]"),
    ("top_logprobs over max_logprobs", "chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 3},
     "top_logprobs", "[0, 2]"),
]


@pytest.fixture(scope="module")
def limited(tiny_dir):
    """(server, engine, tokenized texts) with LIMITS; the texts its tokenizer was asked for."""
    with served_in_process(tiny_dir, MODEL, ServerOptions(limits=LIMITS),
                           num_gpu_blocks=32) as (server, engine):
        tokenized = []
        real_encode = engine.tokenizer.encode

        def encode(text, *args, **kwargs):
            tokenized.append(text)
            return real_encode(text, *args, **kwargs)

        engine.tokenizer.encode = encode
        yield server, engine, tokenized


@pytest.mark.parametrize("what,path,fields,param,words", OVER_LIMITS,
                         ids=[c[0] for c in OVER_LIMITS])
def test_each_limit_answers_400_naming_the_field_before_tokenizing(limited, what, path, fields,
                                                                    param, words):
    server, _, tokenized = limited
    tokenized.clear()
    response = httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL, **fields}, timeout=30)
    error = error_of(response, 400)
    assert error["param"] == param and words in error["message"], error
    assert tokenized == []  # refused before any tokenizing


def test_a_body_over_the_limit_is_413_declared_or_streamed_and_within_limits_is_served(limited):
    server, _, _ = limited
    big = b'{"model": "tiny", "prompt": "' + b"x" * 5000 + b'"}'
    declared = httpx.post(server.url + "/v1/completions", content=big,
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert error_of(declared, 413)["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    streamed = httpx.post(server.url + "/v1/completions", content=chunks(),
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert error_of(streamed, 413)["code"] == "request_too_large"
    ok = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": ["x" * 50] * 2, "stop": ["abcde", "z"], "n": 3, "best_of": 3,
        "logprobs": 2, "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["choices"]) == 6


def test_the_default_prompt_limit_is_the_context_times_the_longest_token(tiny_dir):
    from transformers import AutoTokenizer

    from minipaged.engine.llm_engine import LLMEngine

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    longest = longest_token_chars(tokenizer)
    # no token stands for more text than its vocabulary string has
    assert all(len(tokenizer.decode([i])) <= longest for i in range(len(tokenizer)))
    engine = LLMEngine(tiny_dir, num_gpu_blocks=16, max_num_seqs=5)
    resolved = ServerLimits().resolve(engine)
    assert resolved.max_prompt_chars == engine.max_model_len * longest
    assert resolved.max_waiting_requests == 4 * 5
    with pytest.raises(ValueError, match="max_n must be an integer >= 1"):
        ServerLimits(max_n=0)


# -- the engine decides what it can run -----------------------------------------------------------
def test_the_server_asks_the_engines_validate_request(limited, monkeypatch):
    server, engine, _ = limited
    seen = []

    def validate_request(prompt_token_ids, params):
        seen.append((list(prompt_token_ids), params.max_tokens))
        raise ValueError("temperature is refused by this test's engine")

    monkeypatch.setattr(engine, "validate_request", validate_request)
    response = httpx.post(server.url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4})
    error = error_of(response, 400)
    assert (error["message"], error["param"]) == (
        "temperature is refused by this test's engine", "temperature")
    assert seen[-1] == ([5, 6, 7], 4)


# -- back-pressure and a free event loop ---------------------------------------------------------
def test_a_full_waiting_queue_answers_503_and_a_client_that_gives_up_frees_its_place(tiny_dir):
    long = {"model": MODEL, "prompt": "Once", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    limits = ServerLimits(max_waiting_requests=1)
    # one sequence runs at a time, slowly: the second request waits, the third finds no room
    with served_in_process(tiny_dir, MODEL, ServerOptions(limits=limits), step_delay=0.02,
                           num_gpu_blocks=64, max_num_seqs=1) as (server, _), \
            httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=long) as running:
            assert running.status_code == 200
            lines = running.iter_lines()  # (kept: httpx closes a collected iterator's stream)
            next(lines)  # it runs
            with http.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200
                wait_for_metrics(server.url, lambda m: m["minipaged_num_requests_waiting"] == 1)
                busy = http.post("/v1/completions", json=dict(long, stream=False))
                assert error_of(busy, 503)["code"] == "server_busy"
                assert busy.headers["retry-after"] == "1"
            # the waiting client hung up: its place is free again
            wait_for_metrics(server.url, lambda m: m["minipaged_num_requests_waiting"] == 0)
            with http.stream("POST", "/v1/completions", json=long) as again:
                assert again.status_code == 200
        wait_for_metrics(server.url, lambda m: m["minipaged_gpu_blocks_used"] == 0
                         and m["minipaged_num_requests_running"] == 0)
        assert read_metrics(server.url)["minipaged_num_requests_waiting"] == 0


def test_tokenizing_a_prompt_never_stalls_other_clients(limited, monkeypatch):
    server, engine, _ = limited
    real_encode = engine.tokenizer.encode

    def slow_encode(text, *args, **kwargs):
        if text.startswith("slow"):
            time.sleep(1.5)
        return real_encode(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", slow_encode)
    answer = {}
    thread = threading.Thread(target=lambda: answer.update(response=httpx.post(
        server.url + "/v1/completions", timeout=30,
        json={"model": MODEL, "prompt": "slow prompt", "max_tokens": 2})))
    start = time.monotonic()
    thread.start()
    time.sleep(0.2)
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 200 and time.monotonic() - start < 1.0
    thread.join(30)
    assert answer["response"].status_code == 200
    assert time.monotonic() - start >= 1.5  # (the slow tokenizer did run meanwhile)
