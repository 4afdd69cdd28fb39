"""`minipaged serve` with the embedded SmolLM2-135M-Instruct: the same text as offline generation,
and clients that disconnect (mid-stream or while waiting) free their KV blocks (lesson 13).

Slow: ~75 s on the 2-core machine (measured at load ~9).
"""
import threading

import httpx
import openai
import pytest

from minipaged import LLM, SamplingParams
from serving_helpers import read_metrics, running_server, wait_for_metrics

pytestmark = [pytest.mark.lesson13, pytest.mark.slow]
MODEL = "smollm2"
LONG = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True,
        "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "server.log"
    # two sequences at most, so that a third request waits in the queue
    with running_server(None, "--num-gpu-blocks", "128", "--max-num-seqs", "2",
                        "--max-model-len", "512", name=MODEL, log_path=log) as base_url:
        yield base_url


def test_streamed_and_whole_answers_equal_offline_llm(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    llm = LLM(num_gpu_blocks=64, max_model_len=1024)  # (64 blocks of 16 tokens)
    params = SamplingParams(temperature=0, max_tokens=10)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    offline_chat = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    offline_text = llm.generate("The capital of France is", params, use_tqdm=False)[0] \
        .outputs[0].text
    assert "Paris" in offline_chat

    chat = dict(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert client.chat.completions.create(**chat).choices[0].message.content == offline_chat
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**chat, stream=True) if c.choices)
    assert streamed == offline_chat
    text = dict(model=MODEL, prompt="The capital of France is", max_tokens=10, temperature=0)
    assert client.completions.create(**text).choices[0].text == offline_text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**text, stream=True))
    assert streamed == offline_text


def _read_events(response, count: int):
    """Read ``count`` events; return the line iterator, which the caller must keep alive
    (httpx closes the connection when it is garbage collected)."""
    lines = response.iter_lines()
    seen = 0
    while seen < count:
        if next(lines).startswith("data: "):
            seen += 1
    return lines


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(url):
    before = read_metrics(url)
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", url + "/v1/completions", json=LONG) as response:
            assert response.status_code == 200
            lines = _read_events(response, 3)
            during = read_metrics(url)
            assert during["minipaged_gpu_blocks_used"] > 0
            assert during["minipaged_num_requests_running"] == 1
            del lines
    # the connection is closed: within a few steps the request is aborted, its blocks free
    after = wait_for_metrics(url, lambda m: m["minipaged_gpu_blocks_used"] == 0, timeout=20)
    assert after["minipaged_num_requests_running"] == 0
    aborted = 'minipaged_requests_finished_total{finish_reason="abort"}'
    assert after[aborted] == before[aborted] + 1
    generated = (after["minipaged_generation_tokens_total"]
                 - before["minipaged_generation_tokens_total"])
    assert generated < 200  # it did not run on to its 400 tokens


def test_a_client_that_disconnects_while_waiting_leaves_the_queue(url):
    # two long streams fill max_num_seqs = 2; a third request has to wait
    stop = threading.Event()
    streams_started = threading.Barrier(3)

    def long_stream():
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", url + "/v1/completions", json=LONG) as response:
                lines = _read_events(response, 2)
                streams_started.wait()
                stop.wait(60)  # hold the connection open, then drop it
                del lines

    threads = [threading.Thread(target=long_stream) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        streams_started.wait(60)
        waiter = dict(LONG, stream=False, max_tokens=8)
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed request, given up on
            httpx.post(url + "/v1/completions", json=waiter, timeout=3)
        after = wait_for_metrics(url, lambda m: m["minipaged_num_requests_waiting"] == 0,
                                 timeout=20)
        assert after["minipaged_num_requests_running"] == 2  # the other two are untouched
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    wait_for_metrics(url, lambda m: m["minipaged_gpu_blocks_used"] == 0
                     and m["minipaged_num_requests_running"] == 0, timeout=20)


def test_the_default_chat_length_fits_three_sequences_in_the_default_pool():
    """The default server (1 GiB of KV blocks on the CPU) and a chat request with n = 3 and no
    max_tokens: "what the context leaves" (8,000+ tokens each) would never fit the pool."""
    from dataclasses import replace

    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.entrypoints.prompts import chat_prompt_ids, max_tokens_for

    engine = LLMEngine()
    ids = chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": "Hi!"}])
    params = SamplingParams(n=3, temperature=0.7)
    left = engine.max_model_len - len(ids)
    with pytest.raises(ValueError, match="can never fit in the KV pool"):
        engine.validate_request(ids, replace(params, max_tokens=left))
    max_tokens = max_tokens_for(engine, None, None, ids, params, "messages")
    assert left // 2 < max_tokens < left
    engine.validate_request(ids, replace(params, max_tokens=max_tokens))  # accepted
    with pytest.raises(ValueError, match="can never fit in the KV pool"):
        engine.validate_request(ids, replace(params, max_tokens=max_tokens + 1))  # the most
    assert max_tokens_for(engine, None, None, ids, SamplingParams(), "messages") == left
