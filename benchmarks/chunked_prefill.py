"""Chunked prefill: do running decodes stall while long prompts are prefilled?

A few requests with short prompts decode steadily; long prompts (1-2k tokens) arrive while they
do. Without chunks, each long prompt runs whole in one step and every decode waits for it: the
time between two tokens of a running request jumps to a whole prefill. With chunked prefill the
step budget (``--budget`` tokens) goes to the decodes first and the prompts fill what is left, so
no step is much longer than the budget.

    python benchmarks/chunked_prefill.py                 # embedded SmolLM2-135M-Instruct
    python benchmarks/chunked_prefill.py --record        # also append to benchmarks/RESULTS.md

It prints time per output token (TPOT, the gaps between a decode request's tokens) at p50/p99,
time to first token (TTFT) of the long prompts, and output tokens/s, for chunking off and on.
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import machine_description  # noqa: E402
from minipaged import LLM, SamplingParams  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run(llm: LLM, args, rng_seed: int) -> dict:
    """Decoders first; a long prompt joins every ``--every`` steps. Times per token."""
    engine = llm.llm_engine
    rng = random.Random(rng_seed)
    vocab = engine.model_shape.vocab_size
    decode_params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    long_params = SamplingParams(temperature=0, max_tokens=args.long_tokens, ignore_eos=True)
    for i in range(args.num_decoders):
        engine.add_request(f"d{i}", None, decode_params,
                           [rng.randrange(3, vocab) for _ in range(args.short_len)])
    longs = [[rng.randrange(3, vocab) for _ in range(rng.randint(*args.long_len))]
             for _ in range(args.num_long)]
    token_times: dict[str, list[float]] = {}
    arrivals: dict[str, float] = {}
    step = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests() or longs:
        if longs and step >= args.warmup and (step - args.warmup) % args.every == 0:
            request_id = f"long{args.num_long - len(longs)}"
            engine.add_request(request_id, None, long_params, longs.pop(0))
            arrivals[request_id] = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            times = token_times.setdefault(out.request_id, [])
            times += [now] * (len(out.outputs[0].token_ids) - len(times))
        step += 1
    total = time.perf_counter() - start
    gaps = [b - a for rid, t in token_times.items() if rid.startswith("d")
            for a, b in zip(t, t[1:])]
    ttft = [token_times[rid][0] - arrivals[rid] for rid in arrivals]
    tokens = sum(len(t) for t in token_times.values())
    return {"tpot_p50": percentile(gaps, 50), "tpot_p99": percentile(gaps, 99),
            "ttft_p50": percentile(ttft, 50), "ttft_max": max(ttft), "time": total,
            "tokens_per_s": tokens / total, "steps": engine.stats.num_steps}


def format_table(rows: list[tuple[str, dict]]) -> str:
    lines = ["| prefill | TPOT p50 (ms) | TPOT p99 (ms) | TTFT p50 (s) | TTFT max (s) | "
             "time (s) | output tokens/s | steps |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in rows:
        lines.append(f"| {name} | {1000 * r['tpot_p50']:.0f} | {1000 * r['tpot_p99']:.0f} | "
                     f"{r['ttft_p50']:.2f} | {r['ttft_max']:.2f} | {r['time']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {r['steps']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens with chunks")
    ap.add_argument("--num-decoders", type=int, default=8)
    ap.add_argument("--short-len", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--num-long", type=int, default=4)
    ap.add_argument("--long-len", type=int, nargs=2, default=[1024, 2048])
    ap.add_argument("--long-tokens", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4, help="decode steps before the first long")
    ap.add_argument("--every", type=int, default=12, help="steps between long prompts")
    ap.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    args = ap.parse_args(argv)

    print(f"{machine_description('cpu')}; CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    rows = []
    for name, kwargs in (("whole prompts", dict(enable_chunked_prefill=False)),
                         (f"chunked, budget {args.budget}",
                          dict(enable_chunked_prefill=True, max_num_batched_tokens=args.budget))):
        llm = LLM(args.model, max_model_len=max(4096, args.long_len[1] + args.long_tokens),
                  **kwargs)
        run(llm, argparse.Namespace(**{**vars(args), "num_long": 1, "num_decoders": 2,
                                       "decode_tokens": 4, "long_len": [64, 64]}), 1)  # warm up
        llm.llm_engine.stats.reset()  # count the measured run only
        rows.append((name, run(llm, args, 0)))
        print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    table = format_table(rows)
    off, on = rows[0][1], rows[1][1]
    print()
    print(table)
    summary = (f"p99 TPOT {off['tpot_p99'] / on['tpot_p99']:.2f}x lower with chunks; "
               f"throughput {100 * (on['tokens_per_s'] / off['tokens_per_s'] - 1):+.1f} %")
    print(summary)
    if args.record:
        path = os.path.join(os.path.dirname(__file__), "RESULTS.md")
        header = (f"\n## Chunked prefill: {args.model or 'SmolLM2-135M-Instruct'}, CPU "
                  f"({datetime.date.today().isoformat()})\n\n"
                  f"- machine: {machine_description('cpu')}, capability "
                  f"{torch.backends.cpu.get_cpu_capability()}\n"
                  f"- workload: {args.num_decoders} decoders ({args.short_len}-token prompts, "
                  f"{args.decode_tokens} tokens), {args.num_long} long prompts of "
                  f"{args.long_len[0]}-{args.long_len[1]} tokens ({args.long_tokens} tokens "
                  f"each), one every {args.every} steps; greedy, float32\n"
                  f"- command: `python benchmarks/chunked_prefill.py "
                  f"{' '.join(sys.argv[1:])}`\n\n")
        with open(path, "a") as f:
            f.write(header + table + "\n\n" + summary + "\n")
        print(f"recorded in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
