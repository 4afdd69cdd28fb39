"""The throughput trace on one GGUF file: its blocks as stored against float32 (issue 58).

    python benchmarks/gguf_throughput.py              # the embedded SmolLM2, 64 requests
    python benchmarks/gguf_throughput.py --small      # 8 short requests: seconds

The same trace as ``benchmarks/throughput.py`` (``make_trace``: uniform lengths, seeded), all
requests at once, greedy, on ``LLM(quantization="gguf")`` and ``LLM(quantization="none")`` in turn
(``--repeats`` rounds, the fastest kept): the generated tokens per second, the speed-up, and
whether the two engines' greedy tokens are the same for every request.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from minipaged import LLM, SamplingParams  # noqa: E402
from machine import cpu_features, machine_description  # noqa: E402
from throughput import make_trace  # noqa: E402


def run(llm: LLM, trace) -> tuple[float, list[list[int]]]:
    """(seconds for the whole trace, each request's tokens), prompts computed every time."""
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for _, o in trace]
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=[p for p, _ in trace], sampling_params=params,
                        use_tqdm=False)
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="8 requests of a few tokens")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    num, prompt, output = ((8, (8, 24), (4, 8)) if args.small
                           else (args.num_requests, (16, 256), (16, 128)))
    settings = dict(dtype="float32", max_model_len=512, kv_cache_bytes=1 << 30)
    engines = {"gguf": LLM(quantization="gguf", **settings), "float32": LLM(quantization="none", **settings)}
    vocab = engines["float32"].llm_engine.hf_config.vocab_size
    trace = make_trace("uniform", num, prompt, output, 2048, vocab, seed=0)
    for llm in engines.values():  # (a first run: caches, threads, the routines' set-up)
        run(llm, trace[:2])
    best, tokens = {name: float("inf") for name in engines}, {}
    for _ in range(args.repeats):
        for name, llm in engines.items():  # in turn: a load that drifts falls on both
            seconds, tokens[name] = run(llm, trace)
            best[name] = min(best[name], seconds)
            print(f"  {name}: {seconds:.1f} s", flush=True)
    generated = sum(o for _, o in trace)
    print(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(f"- {machine_description()}; {', '.join(cpu_features()) or 'no vector flags'}")
    print(f"- {num} requests, prompts {prompt[0]}-{prompt[1]}, outputs {output[0]}-{output[1]} "
          f"tokens ({generated} in all), greedy, fastest of {args.repeats} rounds")
    print("| weights | seconds | generated tokens/s |\n|---|---|---|")
    for name in engines:
        print(f"| {name} | {best[name]:.2f} | {generated / best[name]:.1f} |")
    print(f"gguf / float32 tokens/s: {best['float32'] / best['gguf']:.2f}x; greedy tokens the "
          f"same for every request: {'yes' if tokens['gguf'] == tokens['float32'] else 'NO'}")


if __name__ == "__main__":
    main()
