"""Serving throughput with and without the live page's event stream open (`minipaged serve`).

    python benchmarks/live_page.py                  # embedded SmolLM2, 16 requests x 64 tokens
    python benchmarks/live_page.py --small          # a tiny random LLaMA: seconds, for checks
    python benchmarks/live_page.py --pages 2 --pairs 3 --record

The server runs in its own process, as in production. Each run sends the same requests at once
(streamed completions of random token ids, ``ignore_eos``) and measures output tokens/s from
the first request to the last answer; a run "with the page" also keeps ``--pages`` event
streams open (``/live/events``), each read and parsed as a browser would. Runs alternate
(without, with, without, with, ...) so that a machine getting busier or quieter affects both;
the table gives each pair's ratio and the median. The issue's bar: within 10 %.
"""
from __future__ import annotations

import argparse
import asyncio
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


async def one_run(url: str, prompts: list[list[int]], max_tokens: int, pages: int) -> dict:
    frames: list = []
    async with httpx.AsyncClient(timeout=600) as http:
        readers = [asyncio.create_task(read_page(http, url, frames)) for _ in range(pages)]
        if pages:
            while len(frames) < pages:  # every page has its first frame
                await asyncio.sleep(0.05)
        start = time.perf_counter()
        counts = await asyncio.gather(*(one_request(http, url, p, max_tokens) for p in prompts))
        elapsed = time.perf_counter() - start
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    return {"tokens_per_s": len(prompts) * max_tokens / elapsed, "chunks": sum(counts),
            "frames": len(frames), "seconds": elapsed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--small", action="store_true", help="a tiny random LLaMA, 16 x 160 tokens")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--pages", type=int, default=1, help="event streams open in 'with' runs")
    ap.add_argument("--pairs", type=int, default=None, help="(without, with) pairs")
    ap.add_argument("--port", type=int, default=None, help="default: a free port")
    ap.add_argument("--record", action="store_true", help="append the table to RESULTS.md")
    args = ap.parse_args()
    num_requests = args.num_requests or 16
    max_tokens = args.max_tokens or (160 if args.small else 64)
    pairs = args.pairs or 3

    import random

    rng = random.Random(0)
    vocab = 512 if args.small else 49152
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(num_requests)]
    port = args.port or free_port()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.small:
            tiny_model(tmp)
            model = tmp
        proc = start_server(model, port, ["--kv-cache-bytes", str(64 << 20)]
                            if args.small else [])
        try:
            url = f"http://127.0.0.1:{port}"
            asyncio.run(one_run(url, prompts[:2], 2, 0))  # warm-up (the first step compiles)
            rows = []
            for _ in range(pairs):
                without = asyncio.run(one_run(url, prompts, max_tokens, 0))
                with_page = asyncio.run(one_run(url, prompts, max_tokens, args.pages))
                rows.append((without, with_page))
        finally:
            proc.terminate()
            proc.wait(30)

    from machine import append_results, machine_description

    lines = ["| pair | without page (tok/s) | with page (tok/s) | with / without | frames seen |",
             "|---|---|---|---|---|"]
    ratios = []
    for i, (a, b) in enumerate(rows, 1):
        ratios.append(b["tokens_per_s"] / a["tokens_per_s"])
        lines.append(f"| {i} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | "
                     f"{ratios[-1]:.3f} | {b['frames']} |")
    table = "\n".join(lines)
    summary = f"median with / without: {statistics.median(ratios):.3f}"
    print(f"{num_requests} requests x {max_tokens} tokens, {args.pages} page(s) open in 'with' "
          f"runs, {machine_description()}\n\n{table}\n\n{summary}")
    if args.record:
        print(append_results(
            "Live page: serving with and without its event stream",
            [f"model: {'tiny random LLaMA' if args.small else model or 'embedded SmolLM2'}",
             f"{num_requests} requests x {max_tokens} tokens at once, {args.pages} page(s)",
             machine_description()], "", table + "\n\n" + summary))


if __name__ == "__main__":
    main()
