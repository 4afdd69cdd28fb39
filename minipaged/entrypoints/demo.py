"""``make demo``: answer a handful of prompts with the embedded model and show what happened.

``make demo-gemma`` (``minipaged demo --model gemma-3-270m``) asks the same of the real Gemma 3
270M, once its package is installed (``worker/checkpoint.py``).
"""
from __future__ import annotations

import time

from minipaged.entrypoints.llm import LLM
from minipaged.sampling_params import SamplingParams
from minipaged.worker.checkpoint import EMBEDDED_MODEL

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about memory.",
    "Explain in two sentences what a KV cache is.",
    "Give me three tips for learning a new programming language.",
    "What is 12 times 12?",
]


def main(model: str | None = None) -> int:
    """Answer QUESTIONS greedily and print the engine's numbers.

    Args:
        model: None for the embedded SmolLM2-135M-Instruct, or any model ``LLM`` takes that has a
            chat template (``"gemma-3-270m"``).
    """
    t0 = time.perf_counter()
    llm = LLM(model)  # a packaged model is converted from GGUF on first use, then cached
    load_s = time.perf_counter() - t0
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=96)
    t1 = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
    gen_s = time.perf_counter() - t1
    for question, out in zip(QUESTIONS, outputs):
        completion = out.outputs[0]
        print(f"\n### {question}\n{completion.text.strip()}\n"
              f"[{len(completion.token_ids)} tokens, finish: {completion.finish_reason}]")
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    pool, stats, shape = engine.scheduler.pool_counts(), engine.stats, engine.model_shape
    print("\n--- minipaged ---")
    print(f"model: {model or EMBEDDED_MODEL} ({shape.num_layers} layers, {shape.num_heads} heads, "
          f"{shape.num_kv_heads} kv heads, vocabulary {shape.vocab_size:,}) on {engine.device}, {engine.dtype}; "
          f"loaded in {load_s:.1f} s")
    print(f"generated {num_tokens} tokens for {len(outputs)} requests in {gen_s:.2f} s: "
          f"{num_tokens / gen_s:.1f} tokens/s, {stats.num_steps} engine steps")
    print(f"KV cache: {pool.num_gpu_blocks} blocks of {engine.block_size} tokens "
          f"({engine.block_bytes / 1024:.0f} KiB each); peak in use {stats.peak_gpu_blocks_used}, "
          f"free now {pool.num_free_gpu_blocks}; "
          f"preemptions: {stats.num_preemptions_recompute} recompute, "
          f"{stats.num_preemptions_swap} swap")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
