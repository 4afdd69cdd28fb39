"""The HTTP layer fuzzed from the app's own OpenAPI schema with schemathesis (lesson 13).

Every route gets generated requests, ones that fit the schema and ones that do not: none is
answered with a 5xx or takes long, every error is OpenAI's error body, no request is left in the
engine, and the engine still answers a normal request afterwards. Run with ``-s`` to see the
counts per route, kind and status.

Slow: ~60 s on the 2-core machine (measured at load ~9).
"""
import collections
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from budgets import examples
from minipaged.entrypoints.api_server import ServerOptions
from serving_helpers import save_tiny_model_with_tokenizer, served_in_process, wait_for_metrics

pytestmark = [pytest.mark.lesson13, pytest.mark.slow]
MODEL, KEY = "tiny", "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = {"POST": 50, "GET": 5}  # per generation mode
SLOW = 10.0  # seconds: an answer slower than this counts as a hang


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_fuzzed")
    save_tiny_model_with_tokenizer(path)
    return str(path)


def fuzzable_schema(url: str, model: str):
    """The server's own OpenAPI schema (``/openapi.json``), with ``model`` narrowed to the
    served name.

    NOTE: left as "any string", nearly every generated body would stop at the 404 for an
    unknown model; narrowed, they reach the limits, the engine's checks and the engine."""
    raw = httpx.get(url + "/openapi.json", timeout=30).json()
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        raw["components"]["schemas"][name]["properties"]["model"] = {"type": "string",
                                                                     "enum": [model]}
    return schemathesis.openapi.from_dict(raw)


def test_every_route_from_the_openapi_schema_answers_without_5xx_or_hang(tiny_dir):
    counts: collections.Counter = collections.Counter()
    slowest = 0.0
    options = ServerOptions(api_key=KEY, metrics_public=True)
    with served_in_process(tiny_dir, MODEL, options, num_gpu_blocks=64,
                           max_num_seqs=8) as (server, _):
        schema = fuzzable_schema(server.url, MODEL)
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.label for op in operations} == {
            "GET /health", "GET /metrics", "GET /v1/models", "POST /v1/completions",
            "POST /v1/chat/completions"}
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
                    continue  # (no parameters or body: nothing that can be made invalid)

                @settings(max_examples=examples(EXAMPLES[operation.method.upper()]), deadline=None,
                          database=None, derandomize=True, phases=[Phase.generate],
                          suppress_health_check=list(HealthCheck))
                @given(case=operation.as_strategy(generation_mode=mode))
                def call(case):
                    nonlocal slowest
                    start = time.monotonic()
                    response = case.call(base_url=server.url, headers=AUTH, timeout=SLOW * 3)
                    elapsed = time.monotonic() - start
                    slowest = max(slowest, elapsed)
                    counts[(operation.label, mode.value, response.status_code)] += 1
                    assert response.status_code < 500, (case.body, response.text)
                    assert elapsed < SLOW, (case.body, elapsed)
                    if response.status_code >= 400:
                        error = response.json()["error"]
                        assert set(error) == {"message", "type", "param", "code"}, error

                call()
        wait_for_metrics(server.url, lambda m: m["minipaged_gpu_blocks_used"] == 0
                         and m["minipaged_num_requests_running"] == 0
                         and m["minipaged_num_requests_waiting"] == 0)
        ok = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=30, json={
            "model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 5
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    print(f"\nschemathesis: {sum(counts.values())} requests, slowest answer {slowest:.2f} s")
    for (label, mode, status), count in sorted(counts.items()):
        print(f"  {label:28} {mode:8} {status}: {count}")
    statuses = {status for (_, _, status) in counts}
    assert 200 in statuses and 400 in statuses  # both kinds of answer were reached
    served = sum(c for (label, _, status), c in counts.items()
                 if status == 200 and label.startswith("POST"))
    assert served >= 5, counts  # generated bodies did reach the engine
