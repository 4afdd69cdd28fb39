"""An 8-bit KV cache on the embedded SmolLM2 (lesson 18): scales, blocks, accuracy, throughput.

Four tables, printed as Markdown for benchmarks/RESULTS.md:

1. scale choice: the relative error of one scale per tensor against one per token and kv head,
   on the keys and values SmolLM2 wrote for the text set (layer 0 and the last layer);
2. blocks per budget: the pool each ``kv_cache_dtype`` gets from the same ``kv_cache_bytes``;
3. accuracy: greedy agreement with the unquantized engine, and the mean |logprob difference|
   under teacher forcing (the unquantized engine's greedy text, scored by each cache);
4. throughput at the same KV budget: a trace of requests that overfills the 16/32-bit pool.

    python benchmarks/kv_quant.py            # about 3-5 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_description  # noqa: E402

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.lab.kv_quant_accuracy import (cached_vectors, greedy_agreement,  # noqa: E402
                                             scale_choice_error, teacher_forced_logprobs)

TEXTS = [  # a fixed small text set: plain prose, a list, code, numbers
    "The history of the printing press begins in",
    "Three things to pack for a week of hiking in the mountains are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Photosynthesis is the process by which plants",
    "The capital of France is Paris, the capital of Italy is",
    "Once upon a time, in a small village by the sea,",
    "To compute the area of a circle of radius 3, we",
    "The main differences between a CPU and a GPU are",
]
KINDS = ("auto", "fp8", "int8")


def scale_table(llm) -> list[str]:
    rows = ["| tensor | format | one scale per tensor | one per token and kv head |",
            "|---|---|---:|---:|"]
    last = llm.llm_engine.model_shape.num_layers - 1
    for layer in (0, last):
        keys, values = cached_vectors(llm, layer, num_blocks=64)
        for name, x in (("keys", keys), ("values", values)):
            for fmt, dtype in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
                e = scale_choice_error(x, dtype)
                rows.append(f"| layer {layer} {name} | {fmt} | {e['per tensor']:.2%} | "
                            f"{e['per token and head']:.2%} |")
    return rows


def accuracy_table(engines: dict, max_tokens: int) -> list[str]:
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = {k: [o.outputs[0].token_ids for o in llm.generate(TEXTS, greedy, use_tqdm=False)]
            for k, llm in engines.items()}
    tok = engines["auto"].get_tokenizer()
    forced = [tok.encode(t) + o for t, o in zip(TEXTS, outs["auto"])]
    base = [teacher_forced_logprobs(engines["auto"], ids) for ids in forced]
    rows = ["| kv_cache_dtype | identical greedy outputs | tokens before the first difference "
            "(mean) | mean abs logprob difference (teacher forcing) | max |",
            "|---|---:|---:|---:|---:|"]
    for kind in KINDS[1:]:
        same = [greedy_agreement(a, b) for a, b in zip(outs["auto"], outs[kind])]
        diffs = torch.cat([(teacher_forced_logprobs(engines[kind], ids) - b).abs()
                           for ids, b in zip(forced, base)])
        rows.append(f"| {kind} | {sum(n == max_tokens for n in same)} / {len(TEXTS)} | "
                    f"{sum(same) / len(same):.1f} of {max_tokens} | {diffs.mean():.4f} | "
                    f"{diffs.max():.3f} |")
    return rows, outs


def throughput_table(budget: int, num_requests: int, max_tokens: int) -> list[str]:
    rows = ["| kv_cache_dtype | blocks | time (s) | output tokens/s | preemptions |",
            "|---|---:|---:|---:|---:|"]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [TEXTS[i % len(TEXTS)] + f" (request {i})" for i in range(num_requests)]
    for kind in KINDS:
        llm = LLM(kv_cache_bytes=budget, kv_cache_dtype=kind, max_model_len=128,
                  num_cpu_blocks=0)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
        stats = llm.llm_engine.stats
        before = stats.num_preemptions_recompute + stats.num_preemptions_swap
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        preempted = stats.num_preemptions_recompute + stats.num_preemptions_swap - before
        rows.append(f"| {kind} | {llm.llm_engine.block_manager.num_total_gpu_blocks} | "
                    f"{elapsed:.1f} | {tokens / elapsed:.1f} | {preempted} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--budget-mib", type=float, default=6.0,
                        help="KV budget of table 4 (6 MiB: 128 tokens of the float32 cache)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--throughput-only", action="store_true", help="table 4 alone")
    args = parser.parse_args()
    t0 = time.perf_counter()
    print(f"- date: {time.strftime('%Y-%m-%d')}; machine: {machine_description()}; "
          f"torch {torch.__version__}")
    if args.throughput_only:
        print("\n" + "\n".join(throughput_table(int(args.budget_mib * (1 << 20)), args.requests,
                                                args.max_tokens * 2)))
        return
    engines = {k: LLM(kv_cache_dtype=k, max_model_len=512, kv_cache_bytes=64 << 20,
                      num_cpu_blocks=0) for k in KINDS}
    budget = 256 << 20
    print("\n" + "\n".join(["| kv_cache_dtype | bytes per block (16 tokens, 30 layers) | "
                            f"blocks in {budget >> 20} MiB |", "|---|---:|---:|"] + [
        f"| {k} | {e.llm_engine.block_bytes} | {budget // e.llm_engine.block_bytes} |"
        for k, e in engines.items()]))
    rows, outs = accuracy_table(engines, args.max_tokens)
    print("\n" + "\n".join(rows))
    tok = engines["auto"].get_tokenizer()
    print("\nfirst text, greedy:")
    for kind in KINDS:
        print(f"  {kind:>4}: {tok.decode(outs[kind][0])!r}")
    print("\n" + "\n".join(scale_table(engines["auto"])))
    del engines
    print("\n" + "\n".join(throughput_table(int(args.budget_mib * (1 << 20)), args.requests,
                                            args.max_tokens * 2)))
    print(f"\n(the whole run took {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
