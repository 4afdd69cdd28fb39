"""AsyncLLMEngine in-process: requests join a running batch, aborts free blocks, a bad request
or a dead engine never leaves a client hanging (lesson 13)."""
import asyncio

import httpx
import pytest

from minipaged import LLM, SamplingParams
from minipaged.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, PromptRequest, TextStreamer
from minipaged.engine.llm_engine import LLMEngine
from minipaged.outputs import CompletionOutput
from minipaged.entrypoints.api_server import BackgroundServer, build_app

pytestmark = pytest.mark.lesson13

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture
def async_engine(tiny_llama):
    engine = AsyncLLMEngine(LLMEngine(tiny_llama[0], num_gpu_blocks=32, num_cpu_blocks=8))
    engine.start()
    yield engine
    engine.shutdown()


async def _collect(async_engine, request_ids, outputs):
    final = {}
    async for request_id, output in async_engine.stream_outputs(request_ids, outputs):
        final[request_id] = output
    return final


def test_a_request_added_mid_run_joins_the_running_batch(async_engine, tiny_llama):
    steps = []
    async_engine.engine.add_observer(lambda snap: steps.append(set(snap.scheduled)))
    prompt_a, prompt_b = [5, 6, 7, 8, 9], [20, 21, 22]
    params = SamplingParams(max_tokens=40, **GREEDY)

    async def run():
        outputs = asyncio.Queue()
        await async_engine.add_requests(["a"], [PromptRequest(None, params, prompt_a)], outputs)
        while True:  # wait until "a" is decoding
            _, output = await outputs.get()
            if len(output.outputs[0].token_ids) >= 3:
                break
        await async_engine.add_requests(["b"], [PromptRequest(None, params, prompt_b)], outputs)
        return await _collect(async_engine, ["a", "b"], outputs)

    final = asyncio.run(run())
    first_b = next(i for i, s in enumerate(steps) if "b" in s)
    assert "a" in steps[first_b] and first_b >= 3  # b's prefill ran in a's batch, mid-run
    offline = LLM(tiny_llama[0], num_gpu_blocks=32).generate(
        prompt_token_ids=[prompt_a, prompt_b], sampling_params=params, use_tqdm=False)
    assert final["a"].outputs[0].token_ids == offline[0].outputs[0].token_ids
    assert final["b"].outputs[0].token_ids == offline[1].outputs[0].token_ids


def test_abort_ends_the_stream_and_frees_blocks(async_engine):
    params = SamplingParams(max_tokens=200, **GREEDY)

    async def run():
        outputs = asyncio.Queue()
        await async_engine.add_requests(["x"], [PromptRequest(None, params, [3, 4, 5])], outputs)
        seen = []
        async for _, output in async_engine.stream_outputs(["x"], outputs):
            seen.append(output)
            if len(seen) == 2:
                async_engine.abort("x")
        return seen

    seen = asyncio.run(run())
    assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
    assert len(seen[-1].outputs[0].token_ids) < 200
    metrics = async_engine.metrics
    assert metrics["gpu_blocks_used"] == 0 and metrics["num_requests_running"] == 0
    assert metrics["requests_finished"]["abort"] == 1


def test_a_bad_request_is_refused_whole_and_others_keep_running(async_engine):
    good = PromptRequest(None, SamplingParams(max_tokens=20, **GREEDY), [3, 4, 5])

    async def run():
        outputs = asyncio.Queue()
        await async_engine.add_requests(["ok"], [good], outputs)
        too_long = PromptRequest(None, SamplingParams(max_tokens=4), list(range(2, 300)))
        with pytest.raises(ValueError, match="maximum length"):
            # all or nothing: "fine" must not stay queued when its neighbour is refused
            await async_engine.add_requests(["fine", "bad"], [good, too_long], asyncio.Queue())
        return await _collect(async_engine, ["ok"], outputs)

    final = asyncio.run(run())
    assert len(final["ok"].outputs[0].token_ids) == 20
    assert async_engine.metrics["num_requests_waiting"] == 0
    assert async_engine.metrics["gpu_blocks_used"] == 0


def test_a_dead_engine_fails_requests_instead_of_hanging(tiny_llama):
    engine = LLMEngine(tiny_llama[0], num_gpu_blocks=32)
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    engine.step = failing_step
    async_engine = AsyncLLMEngine(engine)
    params = SamplingParams(max_tokens=50, **GREEDY)
    with BackgroundServer(build_app(async_engine, "tiny")) as server:
        assert httpx.get(server.url + "/health").status_code == 200

        async def run():
            outputs = asyncio.Queue()
            await async_engine.add_requests(["r"], [PromptRequest(None, params, [3, 4])], outputs)
            with pytest.raises(EngineDeadError, match="simulated kernel failure"):
                await asyncio.wait_for(_collect(async_engine, ["r"], outputs), 30)
            with pytest.raises(EngineDeadError):
                await async_engine.add_requests(["s"], [PromptRequest(None, params, [3])],
                                                asyncio.Queue())

        asyncio.run(run())
        health = httpx.get(server.url + "/health")
        assert health.status_code == 500 and "simulated" in health.json()["error"]["message"]
        response = httpx.post(server.url + "/v1/completions", timeout=30,
                              json={"model": "tiny", "prompt": [3, 4], "max_tokens": 4})
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error"
        assert "minipaged_engine_healthy 0" in httpx.get(server.url + "/metrics").text


def test_text_streamer_holds_back_what_may_start_a_stop_string():
    streamer = TextStreamer(["STOP!"])

    def out(text, ids, reason=None):
        return CompletionOutput(0, text, ids, 0.0, None, reason)

    assert streamer.update(out("Hello ST", [1, 2, 3])) == ("Hell", [1, 2, 3], None)
    assert streamer.update(out("Hello STO", [1, 2, 3, 4]))[0] == "o"  # "STO" may be "STOP!"
    # the engine cut the stop string off and finished: the held-back space is released
    assert streamer.update(out("Hello ", [1, 2, 3, 4, 5], "stop")) == (" ", [5], None)
    assert TextStreamer([]).update(out("abc", [1]))[0] == "abc"  # no stop strings: no delay
