"""KV cache groups (issue 57, lesson 20): a request's KV bytes, and the requests a fixed pool
holds, with every layer keeping every token against one block table per group of layers.

Two parts, printed as Markdown for benchmarks/RESULTS.md:

1. from the shape, by the block manager's rules (``lab/hybrid_kv.py``): KV bytes per request
   at 1k / 4k / 16k / 32k tokens and the 4k-token requests a pool holds, for the tiny Gemma 3
   of lesson 20 and for the real Gemma 3 270M's numbers (18 layers, 15 sliding with a 512-token
   window, 3 full, 1 kv head of 256, bfloat16; its package need not be installed);
2. measured in the engine, on the tiny Gemma 3 (random weights): the blocks one request holds,
   the most requests running at once from the same memory, the preemptions, and whether the
   tokens equal the every-block engine's.

    python benchmarks/hybrid_kv.py            # about 20 s on 2 cores
    python benchmarks/hybrid_kv.py --small    # the tests' run: a few seconds
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_description  # noqa: E402

from minipaged import SamplingParams  # noqa: E402
from minipaged.engine.llm_engine import LLMEngine  # noqa: E402
from minipaged.lab.hybrid_kv import (gemma3_270m_windows, kv_bytes_per_request,  # noqa: E402
                                     requests_held)
from minipaged.lab.tiny_families import save_tiny, tiny_config  # noqa: E402
from minipaged.model_shape import ModelShape  # noqa: E402

MiB = 2 ** 20
LENGTHS = (1024, 4096, 16384, 32768)


def shape_rows(name: str, windows: tuple, kv_heads: int, head_size: int, element: int,
               pool_bytes: int, block_size: int) -> list[str]:
    args = (windows, kv_heads, head_size, element)
    rows = [f"**{name}** ({len(windows)} layers, {sum(w is not None for w in windows)} sliding "
            f"with window {max((w for w in windows if w), default=0)}, {kv_heads} kv head(s) "
            f"of {head_size}, {element} bytes an element, blocks of {block_size})", "",
            "| tokens | every layer, every token | KV cache groups | saved |",
            "|---:|---:|---:|---:|"]
    for n in LENGTHS:
        every = kv_bytes_per_request(*args, n, block_size, hybrid=False)
        hybrid = kv_bytes_per_request(*args, n, block_size, hybrid=True)
        rows.append(f"| {n:,} | {every / MiB:.2f} MiB | {hybrid / MiB:.2f} MiB | "
                    f"{every / hybrid:.2f}x |")
    held = requests_held(pool_bytes, *args, 4096, block_size)
    rows += ["", f"4,096-token requests a pool of {pool_bytes / MiB:,.0f} MiB holds: every "
             f"block {held['every block']}; KV cache groups {held['hybrid, held']} "
             f"({held['hybrid, admitted one by one']} admitted one by one, each admission "
             f"asking room for its whole prompt in every group)", ""]
    return rows


def run(engine, prompts, params) -> tuple[list, int]:
    """Run the requests to their end; their tokens and the most requests running at once."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), None, p, prompt_token_ids=prompt)
    outs, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
        most = max(most, len(engine.scheduler.running))
    return [outs[str(i)] for i in range(len(prompts))], most


def engine_rows(num_requests: int, prompt_len: int, max_tokens: int,
                num_gpu_blocks: int) -> list[str]:
    with tempfile.TemporaryDirectory() as path:
        save_tiny("gemma3", path, seed=0)
        settings = dict(block_size=16, dtype="float32", enable_prefix_caching=False,
                        num_gpu_blocks=num_gpu_blocks,
                        max_model_len=min(512, 16 * num_gpu_blocks), seed=0)
        prompts = [[3 + (i * 31 + j) % 250 for j in range(prompt_len)]
                   for i in range(num_requests)]
        params = [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                  ] * num_requests
        rows = [f"**measured: the tiny Gemma 3 engine**, {num_requests} requests of "
                f"{prompt_len} + {max_tokens} tokens, the memory of {num_gpu_blocks} blocks "
                "of 16 tokens of every layer", "",
                "| engine | pool blocks | most running at once | preemptions | seconds | "
                "tokens |", "|---|---:|---:|---:|---:|---|"]
        tokens = {}
        for groups in (False, True):
            engine = LLMEngine(path, kv_cache_groups=groups, **settings)
            start = time.perf_counter()
            tokens[groups], most = run(engine, prompts, params)
            seconds = time.perf_counter() - start
            stats = engine.stats
            same = "" if not groups else (
                "equal to every block's" if tokens[True] == tokens[False] else "DIFFER")
            rows.append(f"| {'KV cache groups' if groups else 'every block'} | "
                        f"{engine.scheduler.block_manager.num_total_gpu_blocks} | {most} | "
                        f"{stats.num_preemptions_recompute + stats.num_preemptions_swap} | "
                        f"{seconds:.1f} | {same} |")
    return rows + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a few requests: the tests' run")
    args = parser.parse_args()
    tiny = ModelShape.from_hf(tiny_config("gemma3"))
    print(f"## KV cache groups: Gemma 3, tiny and 270M (issue 57), {time.strftime('%Y-%m-%d')}")
    print(f"\n{machine_description()}\n")
    print("\n".join(shape_rows("Gemma 3 270M, from its config's numbers", gemma3_270m_windows(),
                               1, 256, 2, 1024 * MiB, 16)))
    print("\n".join(shape_rows("the tiny Gemma 3 of lesson 20, from its shape", tiny.windows,
                               tiny.num_kv_heads, tiny.head_size, 4, 64 * MiB, 16)))
    if args.small:
        print("\n".join(engine_rows(4, 60, 20, num_gpu_blocks=12)))
    else:
        print("\n".join(engine_rows(12, 200, 100, num_gpu_blocks=60)))


if __name__ == "__main__":
    main()
