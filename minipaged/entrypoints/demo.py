"""``make demo``: answer a handful of prompts with the embedded model and show what happened.

``make demo-gemma`` (``minipaged demo --model gemma-3-270m``) asks the same of the real Gemma 3
270M, once its package is installed (``worker/checkpoint.py``).
"""
from __future__ import annotations

import time

from minipaged.entrypoints.llm import LLM
from minipaged.sampling_params import SamplingParams
from minipaged.worker.checkpoint import EMBEDDED_MODEL
from minipaged.worker.gguf_loader import tensor_bytes

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about memory.",
    "Explain in two sentences what a KV cache is.",
    "Give me three tips for learning a new programming language.",
    "What is 12 times 12?",
]


def main(model: str | None = None, weights: str = "auto") -> int:
    """Answer QUESTIONS greedily and print the engine's numbers.

    Args:
        model: None for the embedded SmolLM2-135M-Instruct, or any model ``LLM`` takes that has a
            chat template (``"gemma-3-270m"``).
        weights: "gguf" (the packaged file's blocks as stored, ``quantization="gguf"``),
            "float32" (converted once, then cached), or "auto": gguf for a packaged model on a
            machine without a GPU, where it was measured faster with the same greedy tokens
            (benchmarks/RESULTS.md, 2026-12-07: 86 against 38 tokens/s decoding one stream of
            the embedded model, 1.06x on the 64-request trace), else float32.
    """
    weights = chosen_weights(model, weights)
    settings = {"quantization": "gguf" if weights == "gguf" else "none"}
    t0 = time.perf_counter()
    llm = LLM(model, **settings)  # float32: a packaged model converted on first use, then cached
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
    held = ("the GGUF file's blocks as stored (quantization='gguf'; --weights float32 for "
            "float32)" if weights == "gguf" else "float32")
    print(f"weights: {held}, {tensor_bytes(engine.worker.model) / 2**20:.0f} MB of tensors")
    print(f"generated {num_tokens} tokens for {len(outputs)} requests in {gen_s:.2f} s: "
          f"{num_tokens / gen_s:.1f} tokens/s, {stats.num_steps} engine steps")
    print(f"KV cache: {pool.num_gpu_blocks} blocks of {engine.block_size} tokens "
          f"({engine.block_bytes / 1024:.0f} KiB each); peak in use {stats.peak_gpu_blocks_used}, "
          f"free now {pool.num_free_gpu_blocks}; "
          f"preemptions: {stats.num_preemptions_recompute} recompute, "
          f"{stats.num_preemptions_swap} swap")
    return 0


def chosen_weights(model: str | None, weights: str) -> str:
    """``weights`` ("auto", "gguf" or "float32") made "gguf" or "float32" for ``model``."""
    if weights not in ("auto", "gguf", "float32"):
        raise ValueError(f"weights must be auto, gguf or float32, got {weights!r}")
    if weights != "auto":
        return weights
    packaged = model in (None, EMBEDDED_MODEL, "gemma-3-270m")
    return "gguf" if packaged and not _has_gpu() else "float32"


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    raise SystemExit(main())
