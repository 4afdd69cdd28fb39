"""Prefix caching: prompt tokens computed and wall time, with caching on and off, in one run.

    python benchmarks/prefix_caching.py            # embedded SmolLM2-135M-Instruct on the CPU
    python benchmarks/prefix_caching.py --record   # and append the table to RESULTS.md

Two traces, each run with ``enable_prefix_caching`` on and off on the same engine settings:
  * shared system prompt: ``--num-requests`` requests (64) sharing a ``--system-len``-token
    (512) system prompt, each with its own ``--question-len``-token (64) question, all queued at
    once;
  * multi-turn chat: ``--num-chats`` conversations of ``--num-turns`` turns; each turn's prompt
    is the whole conversation so far (system prompt, earlier questions and answers) plus a new
    question, sent when the previous turn's answer is back.
Greedy, ``ignore_eos``; the outputs of both runs are checked to be the same.
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minipaged import LLM, SamplingParams  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from machine import machine_description  # noqa: E402


def shared_prompt_trace(args, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(vocab) for _ in range(args.system_len)]
    return [system + [rng.randrange(vocab) for _ in range(args.question_len)]
            for _ in range(args.num_requests)]


def run_shared(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_chat(llm: LLM, args, vocab: int, params) -> list[list[int]]:
    """Every conversation sends its next turn when its previous answer is back."""
    rng = random.Random(args.seed + 1)
    system = [rng.randrange(vocab) for _ in range(args.system_len)]
    history = {c: list(system) for c in range(args.num_chats)}
    questions = {c: [[rng.randrange(vocab) for _ in range(args.question_len)]
                     for _ in range(args.num_turns)] for c in range(args.num_chats)}
    engine = llm.llm_engine
    answers: list[list[int]] = []
    turn = dict.fromkeys(history, 0)
    for c in history:
        history[c] += questions[c][0]
        engine.add_request(f"{c}/0", None, params, history[c])
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            c = int(out.request_id.split("/")[0])
            answer = out.outputs[0].token_ids
            answers.append(answer)
            turn[c] += 1
            if turn[c] < args.num_turns:
                history[c] += answer + questions[c][turn[c]]
                engine.add_request(f"{c}/{turn[c]}", None, params, history[c])
    return answers


def measure(llm: LLM, fn) -> dict:
    stats = llm.llm_engine.stats
    before = (stats.num_prompt_tokens, stats.num_cached_prompt_tokens)
    t0 = time.perf_counter()
    tokens = fn()
    wall = time.perf_counter() - t0
    return dict(tokens=tokens, wall=wall, computed=stats.num_prompt_tokens - before[0],
                cached=stats.num_cached_prompt_tokens - before[1],
                evicted=stats.num_evicted_blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--num-chats", type=int, default=8)
    ap.add_argument("--num-turns", type=int, default=4)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--record", action="store_true", help="append the table to RESULTS.md")
    args = ap.parse_args()

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    results = {}
    for trace in ("shared system prompt", "multi-turn chat"):
        for caching in (False, True):
            llm = LLM(kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
                      enable_prefix_caching=caching)
            vocab = llm.llm_engine.model_shape.vocab_size
            if trace == "shared system prompt":
                prompts = shared_prompt_trace(args, vocab)
                r = measure(llm, lambda: run_shared(llm, prompts, params))
            else:
                r = measure(llm, lambda: run_chat(llm, args, vocab, params))
            results[(trace, caching)] = r
            print(f"{trace}, caching {'on' if caching else 'off'}: {r['computed']} prompt "
                  f"tokens computed, {r['cached']} from the cache, {r['wall']:.1f} s", flush=True)
            del llm
        off, on = results[(trace, False)], results[(trace, True)]
        assert on["tokens"] == off["tokens"], f"{trace}: outputs differ with caching on and off"
        rows.append(f"| {trace} | {off['computed']:,} | {on['computed']:,} | "
                    f"{off['computed'] / on['computed']:.1f}x | {on['cached']:,} | "
                    f"{off['wall']:.1f} | {on['wall']:.1f} | {off['wall'] / on['wall']:.2f}x | "
                    f"{on['evicted']} |")

    table = "\n".join([
        "| trace | prompt tokens computed, off | on | fewer | from the cache | time off (s) "
        "| time on (s) | faster | blocks evicted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|", *rows])
    print(table)
    if args.record:
        command = "python benchmarks/prefix_caching.py " + " ".join(sys.argv[1:])
        text = (f"\n## Prefix caching: SmolLM2-135M-Instruct ({datetime.date.today()})\n\n"
                f"- machine: {machine_description()}\n"
                f"- versions: torch {torch.__version__}\n"
                f"- shared system prompt: {args.num_requests} requests, {args.system_len}-token "
                f"system prompt + {args.question_len}-token question each, all queued at once\n"
                f"- multi-turn chat: {args.num_chats} conversations x {args.num_turns} turns "
                f"(prompt = the conversation so far + a {args.question_len}-token question)\n"
                f"- {args.output_len} new tokens per request (greedy, ignore_eos); outputs "
                f"identical with caching on and off\n"
                f"- command: `{command.strip()}`\n\n{table}\n")
        with open(os.path.join(os.path.dirname(__file__), "RESULTS.md"), "a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
