"""Serving benchmark: clients arrive at random (Poisson) times and stream from `minipaged serve`.

    python benchmarks/serving.py                               # embedded SmolLM2, rates 1 2 4
    python benchmarks/serving.py --rates 0.5 1 --num-requests 24 --record

For each request rate the same seeded set of requests is sent: arrival gaps drawn from an
exponential distribution (a Poisson process), prompts of random token ids, a fixed number of new
tokens (``ignore_eos``), each request streamed over HTTP with ``stream: true``. Measured per rate:

    requests/s, output tokens/s       over the time from the first arrival to the last answer
    TTFT (time to first token)        arrival -> first streamed token: queueing + prefill
    TPOT (time per output token)      (last token - first token) / (new tokens - 1)

at the 50th and 99th percentiles. The server runs in its own process (as in production), started
here unless ``--url`` points at one already running. ``--record`` appends the table to
benchmarks/RESULTS.md with the date and the machine.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def one_request(http: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    return {"start": start, "ttft": first - start, "end": end, "tokens": tokens,
            "tpot": (end - first) / max(tokens - 1, 1)}


async def run_rate(url: str, model: str, requests: list[list[int]], max_tokens: int,
                   rate: float, seed: int) -> dict:
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=None) as http:
        tasks = []
        for prompt in requests:
            tasks.append(asyncio.create_task(one_request(http, url, model, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
    elapsed = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results]
    return {"rate": rate, "requests": len(results), "elapsed": elapsed,
            "req_s": len(results) / elapsed, "tok_s": tokens / elapsed,
            "ttft50": percentile(ttft, 50), "ttft99": percentile(ttft, 99),
            "tpot50": percentile(tpot, 50), "tpot99": percentile(tpot, 99)}


def format_table(rows: list[dict]) -> str:
    lines = ["| request rate (req/s) | requests | time (s) | requests/s | output tokens/s | "
             "TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | TPOT p99 (ms) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['rate']:g} | {r['requests']} | {r['elapsed']:.1f} | "
                     f"{r['req_s']:.2f} | {r['tok_s']:.1f} | {r['ttft50'] * 1e3:.0f} | "
                     f"{r['ttft99'] * 1e3:.0f} | {r['tpot50'] * 1e3:.0f} | "
                     f"{r['tpot99'] * 1e3:.0f} |")
    return "\n".join(lines)


def start_server(model: str | None, name: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "minipaged", "serve"] + ([model] if model else []) + [
        "--port", str(port), "--served-model-name", name, "--log-level", "warning", *extra]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise SystemExit("the server did not start in 300 s")
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--url", default=None, help="benchmark a server already running here")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128])
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-args", default="", help="extra flags for `minipaged serve`")
    ap.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    args = ap.parse_args()

    name = "bench"
    proc = None
    if args.url:
        url = args.url.rstrip("/")
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    else:
        proc, url = start_server(args.model, name, args.server_args.split())
    try:
        vocab_top = 1000  # ids every tokenizer in use here knows
        rng = random.Random(args.seed)
        requests = [[rng.randrange(10, vocab_top)
                     for _ in range(rng.randint(*args.prompt_len))]
                    for _ in range(args.num_requests)]
        asyncio.run(run_rate(url, name, requests[:2], 2, 10.0, args.seed))  # warm-up
        rows = []
        for rate in args.rates:
            rows.append(asyncio.run(run_rate(url, name, requests, args.output_len, rate,
                                             args.seed)))
            print(f"rate {rate:g} req/s done", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    table = format_table(rows)
    print(table)
    if args.record:
        record(table, args, name if args.url else (args.model or "SmolLM2-135M-Instruct"))


def record(table: str, args, model_name: str) -> None:
    import torch

    from machine import machine_description

    path = os.path.join(os.path.dirname(__file__), "RESULTS.md")
    today = datetime.date.today().isoformat()
    header = (f"\n## Serving: {model_name} over HTTP ({today})\n\n"
              f"- machine: {machine_description('cpu')} (server and clients on the same machine)\n"
              f"- versions: torch {torch.__version__}\n"
              f"- requests: {args.num_requests} per rate, Poisson arrivals (seed {args.seed}), "
              f"prompts of {args.prompt_len[0]}-{args.prompt_len[1]} random token ids, "
              f"{args.output_len} new tokens each (greedy, ignore_eos), streamed over SSE\n"
              f"- command: `python benchmarks/serving.py {' '.join(sys.argv[1:])}`\n\n")
    with open(path, "a") as f:
        f.write(header + table + "\n")
    print(f"recorded in {path}")


if __name__ == "__main__":
    main()
