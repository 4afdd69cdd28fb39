"""Serving throughput with the live page open and drawing, and without it (`minipaged serve`).

    python benchmarks/live_page.py                  # embedded SmolLM2, 16 requests x 64 tokens
    python benchmarks/live_page.py --small          # a tiny random LLaMA: seconds, for checks
    python benchmarks/live_page.py --rounds 7 --page browser --record

The server runs in its own process, as in production. Each run sends the same requests at once
(streamed completions of random token ids, ``ignore_eos``) and measures output tokens/s from
the first request to the last answer. A run "with the page" first opens ``--pages`` pages:
``--page browser`` the page itself at the server's root in a headless Chromium (Debian's, driven
by Playwright), which draws every frame it gets, as a person watching does; ``--page stream``
only its event stream (``/live/events``), each read and parsed as the page would, for machines
without Chromium; ``auto`` (the default) the browser where there is one. The runs are
interleaved in rounds, (without, with), (without, with), ..., so that a machine getting busier or
quieter affects both; the table gives every round, the median of each column, and the ratio of
the medians, under the CPU and the date. The issue's bar: within 10 %.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_model(path: str) -> None:
    """A random LLaMA small enough to serve in a second (no tokenizer: prompts are token ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, port: int, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "minipaged", "serve", *([model] if model else []),
           "--port", str(port), "--served-model-name", "bench", "--log-level", "warning",
           "--max-live-streams", "16", *extra]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the server did not start")
        time.sleep(0.3)


async def one_request(http: httpx.AsyncClient, url: str, prompt: list[int],
                      max_tokens: int) -> int:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    tokens = 0
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                tokens += len(json.loads(line[6:])["choices"])
    return tokens


async def read_page(http: httpx.AsyncClient, url: str, frames: list) -> None:
    """One page's event stream, read and parsed until cancelled."""
    async with http.stream("GET", url + "/live/events") as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                frames.append(json.loads(line[5:])["step"])


async def one_run(url: str, prompts: list[list[int]], max_tokens: int, streams: int) -> dict:
    """The requests at once, ``streams`` event streams read meanwhile (``--page stream``)."""
    frames: list = []
    async with httpx.AsyncClient(timeout=600) as http:
        readers = [asyncio.create_task(read_page(http, url, frames)) for _ in range(streams)]
        if streams:
            while len(frames) < streams:  # every stream has its first frame
                await asyncio.sleep(0.05)
        frames.clear()
        start = time.perf_counter()
        counts = await asyncio.gather(*(one_request(http, url, p, max_tokens) for p in prompts))
        elapsed = time.perf_counter() - start
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    return {"tokens_per_s": len(prompts) * max_tokens / elapsed, "chunks": sum(counts),
            "frames": len(frames), "seconds": elapsed}


def load(run) -> dict:
    """Run the coroutine ``run`` in a thread of its own (Playwright's sync API keeps an event
    loop in this one) and return its result."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, run).result()


# Counts the frames a tab drew: the page sets <body data-step> at each (static/live.js).
COUNT_FRAMES = """() => { window.framesDrawn = 0;
  new MutationObserver(() => { window.framesDrawn++; })
    .observe(document.body, {attributes: true, attributeFilter: ["data-step"]}); }"""


class Browser:
    """A headless Chromium (Debian's, as the browser test drives it) whose tabs show the page."""

    def __init__(self) -> None:
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        self._browser = process_helpers().launch_chromium(self._playwright)

    def run(self, url: str, prompts, max_tokens: int, tabs: int) -> dict:
        """One run with ``tabs`` tabs open on the page, each drawing from its first frame on."""
        context = self._browser.new_context(viewport={"width": 1400, "height": 1000})
        try:
            pages = [context.new_page() for _ in range(tabs)]
            for page in pages:
                page.goto(url + "/")
                page.wait_for_function("() => document.body.dataset.step !== undefined",
                                       timeout=60_000)
                page.evaluate(COUNT_FRAMES)
            result = load(one_run(url, prompts, max_tokens, 0))
            result["frames"] = sum(page.evaluate("() => window.framesDrawn") for page in pages)
        finally:
            context.close()
        return result

    def close(self) -> None:
        self._browser.close()
        self._playwright.stop()


def process_helpers():
    """The tests' ``process_helpers``: Chromium found and started as the browser test does."""
    import importlib

    helpers = os.path.join(ROOT, "tests", "helpers")
    if helpers not in sys.path:
        sys.path.insert(0, helpers)
    return importlib.import_module("process_helpers")


def chromium_available() -> bool:
    import importlib.util

    return (process_helpers().chromium_path() is not None
            and importlib.util.find_spec("playwright") is not None)


def table(rows: list[tuple[dict, dict]]) -> tuple[str, float]:
    """The rounds' table and the ratio of the medians (with / without)."""
    # (frames come at most every interval, spaced so that the page costs the engine at most
    # live_feed.SHARE of its time: a short run may see none)
    lines = ["| round | without the page (tok/s) | with the page (tok/s) | frames while it ran |",
             "|---|---|---|---|"]
    for i, (a, b) in enumerate(rows, 1):
        lines.append(f"| {i} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
                     f"{b['frames']} |")
    without = statistics.median(a["tokens_per_s"] for a, _ in rows)
    with_page = statistics.median(b["tokens_per_s"] for _, b in rows)
    lines.append(f"| median | {without:.1f} | {with_page:.1f} | |")
    return "\n".join(lines), with_page / without


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--small", action="store_true",
                    help="a tiny random LLaMA, 8 x 32 tokens, 2 rounds: seconds")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--page", choices=("auto", "browser", "stream"), default="auto",
                    help="what is open in 'with' runs: the page in Chromium, or its event stream")
    ap.add_argument("--pages", type=int, default=1, help="tabs (or streams) open in 'with' runs")
    ap.add_argument("--rounds", type=int, default=None, help="(without, with) rounds")
    ap.add_argument("--port", type=int, default=None, help="default: a free port")
    ap.add_argument("--record", action="store_true", help="append the table to RESULTS.md")
    args = ap.parse_args()
    num_requests = args.num_requests or (8 if args.small else 16)
    max_tokens = args.max_tokens or (32 if args.small else 64)
    rounds = args.rounds or (2 if args.small else 5)
    mode = args.page
    if mode == "auto":
        mode = "browser" if chromium_available() else "stream"
    elif mode == "browser" and not chromium_available():
        sys.exit("--page browser: Debian's chromium or the playwright package is not installed")

    import datetime
    import random

    rng = random.Random(0)
    vocab = 512 if args.small else 49152
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(num_requests)]
    port = args.port or free_port()
    browser = None
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.small:
            tiny_model(tmp)
            model = tmp
        proc = start_server(model, port, ["--kv-cache-bytes", str(64 << 20)]
                            if args.small else [])
        try:
            url = f"http://127.0.0.1:{port}"
            load(one_run(url, prompts[:2], 2, 0))  # warm-up (the first step compiles)
            if mode == "browser":
                browser = Browser()
            rows = []
            for number in range(1, rounds + 1):
                without = load(one_run(url, prompts, max_tokens, 0))
                if browser is not None:
                    with_page = browser.run(url, prompts, max_tokens, args.pages)
                else:
                    with_page = load(one_run(url, prompts, max_tokens, args.pages))
                rows.append((without, with_page))
                print(f"round {number}/{rounds}: {without['tokens_per_s']:.1f} tok/s without, "
                      f"{with_page['tokens_per_s']:.1f} with", file=sys.stderr, flush=True)
        finally:
            if browser is not None:
                browser.close()
            proc.terminate()
            proc.wait(30)

    from machine import append_results, machine_description

    body, ratio = table(rows)
    what = (f"{args.pages} tab(s) of the page in a headless Chromium" if mode == "browser"
            else f"{args.pages} event stream(s) of the page, read and parsed")
    facts = [f"model: {'tiny random LLaMA' if args.small else model or 'embedded SmolLM2'}",
             f"{num_requests} requests x {max_tokens} tokens at once, {rounds} rounds",
             f"with the page: {what}", machine_description(),
             f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"]
    summary = f"with / without the page (medians): {ratio:.3f} (the issue's bar: 0.900 or more)"
    print("\n".join(facts) + f"\n\n{body}\n\n{summary}")
    if args.record:
        print(append_results("Live page: serving with and without the page open", facts, "",
                             body + "\n\n" + summary))


if __name__ == "__main__":
    main()
