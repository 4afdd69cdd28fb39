"""`minipaged serve` (a subprocess, tiny random LLaMA) under load and under hostile bodies
(lesson 13).

The load: 256 requests from 32 concurrent asyncio clients, streamed or not, a quarter of them
given up by their client part-way, then a burst of 64 at once, over what may wait. Every request
completes, is given up by its client, or is refused with 503 + Retry-After; at the end every KV
block is free and nothing waits or runs. The hostile bodies (50 MB, deep nesting, invalid UTF-8,
100,000 stop strings, ...) are each answered with a 4xx within a second while /health stays
quick. Throughout, the server's resident memory stays within MEMORY_BOUND of what it held warm.
Run with ``-s`` to see the tables.

Slow: ~25 s on the 2-core machine (measured at load ~9).
"""
import asyncio
import json
import random
import statistics
import threading
import time

import httpx
import pytest

from serving_helpers import (MemorySampler, read_metrics, running_server_process,
                             save_tiny_model_with_tokenizer, wait_for_metrics)

pytestmark = [pytest.mark.lesson13, pytest.mark.slow]
MODEL = "tiny"
MAX_NUM_SEQS, MAX_WAITING, MAX_TOKENS = 8, 24, 8
CLIENTS, REQUESTS, BURST = 32, 256, 64
MiB = 1024 * 1024
MEMORY_BOUND = 256 * MiB  # resident memory over the warmed-up server's, at any moment


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, pid, resident bytes once warm) of a server with a small waiting queue."""
    path = tmp_path_factory.mktemp("tiny_loaded")
    save_tiny_model_with_tokenizer(path)
    log = tmp_path_factory.mktemp("logs") / "server.log"
    with running_server_process(str(path), "--num-gpu-blocks", "128", "--max-num-seqs",
                                str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
                                name=MODEL, log_path=log) as (url, proc):
        # warm, untimed: the first requests allocate for good, and the first step may build
        # (or wait for another process building) the C++ CPU attention
        for stream in (False, True, False):
            httpx.post(url + "/v1/completions", timeout=600, json=_body("warm up", stream))
        yield url, proc.pid, MemorySampler(proc.pid).now()


def _body(prompt: str, stream: bool) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": stream}


async def _complete(client: httpx.AsyncClient, prompt: str, stream: bool) -> str:
    """'completed', 'rejected' (503 with Retry-After) or what went wrong."""
    if not stream:
        response = await client.post("/v1/completions", json=_body(prompt, False))
        if response.status_code == 503 and response.headers.get("retry-after"):
            return "rejected"
        if response.status_code != 200:
            return f"status {response.status_code}: {response.text[:200]}"
        choice = response.json()["choices"][0]
        tokens = response.json()["usage"]["completion_tokens"]
        return "completed" if (choice["finish_reason"], tokens) == ("length", MAX_TOKENS) else \
            f"incomplete: {response.text[:200]}"
    async with client.stream("POST", "/v1/completions", json=_body(prompt, True)) as response:
        if response.status_code == 503 and response.headers.get("retry-after"):
            return "rejected"
        if response.status_code != 200:
            return f"status {response.status_code}: {(await response.aread())[:200]!r}"
        reason, done = None, False
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                for choice in json.loads(line[6:]).get("choices", []):
                    reason = choice["finish_reason"] or reason
        return "completed" if (done, reason) == (True, "length") else f"incomplete: {reason}"


async def _one(client, rng: random.Random, records: list, phase: str, give_up: bool) -> None:
    prompt = " ".join(rng.choice(["the", "sky", "once", "upon", "a", "time"])
                      for _ in range(rng.randint(1, 12)))
    stream = rng.random() < 0.5
    patience = rng.uniform(0.01, 0.3) if give_up else None
    start = time.monotonic()
    try:
        outcome = await asyncio.wait_for(_complete(client, prompt, stream), patience)
    except asyncio.TimeoutError:
        outcome = "aborted"  # the client gave up: its connection is closed mid-request
    records.append((phase, outcome, time.monotonic() - start))


async def _load(url: str) -> list[tuple[str, str, float]]:
    rng = random.Random(0)
    records: list = []
    jobs = [rng.random() < 0.25 for _ in range(REQUESTS)]  # True: this client gives up
    limits = httpx.Limits(max_connections=2 * BURST)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def worker(mine: list[bool]) -> None:
            for give_up in mine:
                await _one(client, rng, records, "load", give_up)

        await asyncio.gather(*(worker(jobs[i::CLIENTS]) for i in range(CLIENTS)))
        await asyncio.gather(*(_one(client, rng, records, "burst", False)
                               for _ in range(BURST)))
    return records


def _finished(metrics: dict) -> dict[str, float]:
    return {reason: metrics[f'minipaged_requests_finished_total{{finish_reason="{reason}"}}']
            for reason in ("stop", "length", "abort")}


def test_load_with_disconnects_and_a_burst_frees_every_block_within_memory(server):
    url, pid, warm = server
    before = _finished(read_metrics(url))
    start = time.monotonic()
    with MemorySampler(pid) as memory:
        records = asyncio.run(_load(url))
        after = wait_for_metrics(url, lambda m: m["minipaged_gpu_blocks_used"] == 0
                                 and m["minipaged_num_requests_running"] == 0
                                 and m["minipaged_num_requests_waiting"] == 0)
    wall = time.monotonic() - start
    outcomes = {(phase, outcome): sum(1 for p, o, _ in records if (p, o) == (phase, outcome))
                for phase, outcome, _ in records}
    failed = [(p, o) for p, o, _ in records if o not in ("completed", "aborted", "rejected")]
    latencies = sorted(t for _, o, t in records if o == "completed")
    p50, p99 = statistics.median(latencies), latencies[int(0.99 * (len(latencies) - 1))]
    print(f"\nload: {len(records)} requests in {wall:.1f} s from {CLIENTS} clients, then a "
          f"burst of {BURST}")
    print("| phase | requests | completed | aborted by client | 503 |")
    for phase in ("load", "burst"):
        count = sum(1 for p, _, _ in records if p == phase)
        print(f"| {phase} | {count} | {outcomes.get((phase, 'completed'), 0)} | "
              f"{outcomes.get((phase, 'aborted'), 0)} | {outcomes.get((phase, 'rejected'), 0)} |")
    print(f"completed latency p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms; resident "
          f"memory warm {warm / MiB:.0f} MiB, peak {memory.peak / MiB:.0f} MiB "
          f"(+{(memory.peak - warm) / MiB:.0f} MiB, bound +{MEMORY_BOUND / MiB:.0f})")

    assert failed == [] and len(records) == REQUESTS + BURST
    assert outcomes.get(("burst", "rejected"), 0) > 0  # more than may wait: refused
    assert outcomes.get(("burst", "completed"), 0) >= MAX_WAITING  # and the rest served
    assert outcomes.get(("load", "aborted"), 0) > 20 and outcomes[("load", "completed")] > 150
    # every request the engine accepted finished -- run to its length, or aborted because its
    # client gave up -- and nothing is left (blocks free, queues empty: checked above)
    finished = {k: after_k - before[k] for k, after_k in _finished(after).items()}
    completed = sum(1 for _, o, _ in records if o == "completed")
    aborted = sum(1 for _, o, _ in records if o == "aborted")
    assert finished["stop"] == 0
    assert completed <= finished["length"] <= completed + aborted  # (a give-up may come late)
    assert finished["abort"] <= aborted
    assert memory.peak - warm < MEMORY_BOUND


def _deep(levels: int) -> bytes:
    return b'{"model": "tiny", "prompt": ' + b"[" * levels + b"]" * levels + b"}"


def _chunks(data: bytes, size: int = 1 * MiB):
    for i in range(0, len(data), size):
        yield data[i:i + size]


HOSTILE = [
    # (what, path, body (bytes, or a function giving an iterator of chunks), status)
    ("50 MB body, Content-Length given", "completions",
     b'{"model": "tiny", "prompt": "' + b"x" * 50_000_000 + b'"}', 413),
    ("50 MB body, chunked", "completions",
     lambda: _chunks(b'{"model": "tiny", "prompt": "' + b"x" * 50_000_000 + b'"}'), 413),
    ("deep nesting, 100,000 levels", "completions", _deep(100_000), 400),
    ("invalid UTF-8", "completions", b'{"model": "tiny", "prompt": "\xff\xfe\xc3("}', 400),
    ("100,000 stop strings", "completions", json.dumps(
        {"model": MODEL, "prompt": "x", "stop": ["s"] * 100_000}).encode(), 400),
    ("a 1.9 MB prompt", "completions",
     json.dumps({"model": MODEL, "prompt": "word " * 380_000}).encode(), 400),
    ("100,000 prompts", "completions",
     json.dumps({"model": MODEL, "prompt": ["a"] * 100_000}).encode(), 400),
    ("50,000 chat messages", "chat/completions", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 50_000}).encode(),
     400),
    ("max_tokens 10**30", "completions",
     json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10 ** 30}).encode(), 400),
]


def test_hostile_bodies_are_refused_within_a_second_each_and_health_stays_quick(server):
    url, pid, warm = server
    health: list[float] = []
    stop = threading.Event()

    def probe() -> None:  # another client, meanwhile
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                start = time.monotonic()
                assert client.get(url + "/health").status_code == 200
                health.append(time.monotonic() - start)
                time.sleep(0.05)

    prober = threading.Thread(target=probe, daemon=True)
    rows = []
    with MemorySampler(pid) as memory:
        prober.start()
        for what, path, body, status in HOSTILE:
            content = body() if callable(body) else body
            start = time.monotonic()
            response = httpx.post(f"{url}/v1/{path}", content=content, timeout=30,
                                  headers={"Content-Type": "application/json"})
            elapsed = time.monotonic() - start
            rows.append((what, response.status_code, elapsed, response.json()["error"]))
        stop.set()
        prober.join(10)
    after = MemorySampler(pid).now()
    print("\n| hostile body | status | seconds | message |")
    for what, code, elapsed, error in rows:
        print(f"| {what} | {code} | {elapsed:.3f} | {error['message'][:70]} |")
    print(f"/health meanwhile: {len(health)} probes, slowest {max(health) * 1000:.0f} ms; "
          f"resident memory warm {warm / MiB:.0f} MiB, peak {memory.peak / MiB:.0f} MiB, "
          f"after {after / MiB:.0f} MiB")
    assert [(what, code) for what, code, _, _ in rows] == [(h[0], h[3]) for h in HOSTILE]
    assert all(elapsed < 1.0 for _, _, elapsed, _ in rows), rows
    assert len(health) > 5 and max(health) < 1.0
    assert memory.peak - warm < MEMORY_BOUND and after - warm < MEMORY_BOUND
    ok = httpx.post(url + "/v1/completions", json=_body("still here", False), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == MAX_TOKENS
