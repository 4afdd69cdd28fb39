"""``make demo``: answer a handful of prompts with the embedded model and show what happened."""
from __future__ import annotations

import time

from minipaged.entrypoints.llm import LLM
from minipaged.sampling_params import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about memory.",
    "Explain in two sentences what a KV cache is.",
    "Give me three tips for learning a new programming language.",
    "What is 12 times 12?",
]


def main() -> int:
    t0 = time.perf_counter()
    llm = LLM()  # the embedded SmolLM2-135M-Instruct (converted from GGUF on first use)
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
    bm, stats, shape = engine.block_manager, engine.stats, engine.model_shape
    print("\n--- minipaged ---")
    print(f"model: SmolLM2-135M-Instruct ({shape.num_layers} layers, {shape.num_heads} heads, "
          f"{shape.num_kv_heads} kv heads) on {engine.device}, {engine.dtype}; "
          f"loaded in {load_s:.1f} s")
    print(f"generated {num_tokens} tokens for {len(outputs)} requests in {gen_s:.2f} s: "
          f"{num_tokens / gen_s:.1f} tokens/s, {stats.num_steps} engine steps")
    print(f"KV cache: {bm.num_total_gpu_blocks} blocks of {engine.block_size} tokens "
          f"({engine.block_bytes / 1024:.0f} KiB each); peak in use {stats.peak_gpu_blocks_used}, "
          f"free now {bm.get_num_free_gpu_blocks()}; "
          f"preemptions: {stats.num_preemptions_recompute} recompute, "
          f"{stats.num_preemptions_swap} swap")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
