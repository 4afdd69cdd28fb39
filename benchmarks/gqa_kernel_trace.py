"""The CUDA kernel's K/V bytes per decode step, with and without group reads (lesson 18).

No GPU needed: the traced CPU build of ``csrc/paged_attention.cu`` (``cuda_on_cpu.load("traced")``,
every CUDA thread a host thread) records each global load of a key or a value, and
``minipaged.lab.kernel_trace.loaded_bytes`` adds them up over all CUDA blocks of one launch: one
decode step of one layer. Two kernels on the same inputs: V1, one CUDA block per (query head,
sequence), which loads a kv head's keys and values once per query head, and the grouped kernel
(version 3), one CUDA block per (kv head, sequence) for the whole group. Shapes: SmolLM2-135M
(9 query heads on 3 kv heads, head size 64) and LLaMA-3 8B (32 on 8, head size 128); fp16,
blocks of 16 tokens. Each output is checked against the torch reference.

    python benchmarks/gqa_kernel_trace.py [--seqs 4] [--context 512]   # a few minutes on 2 cores
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from machine import machine_description  # noqa: E402

SHAPES = {"SmolLM2-135M": (9, 3, 64), "LLaMA-3 8B": (32, 8, 128)}  # heads, kv heads, head size
BLOCK_SIZE = 16


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=4)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args(argv)

    import torch

    from minipaged.kernels import cuda_on_cpu, reference
    from minipaged.lab import kernel_trace

    kernels = cuda_on_cpu.load("traced")
    print(f"- date: {time.strftime('%Y-%m-%d')}; machine: {machine_description()}, emulated "
          f"(the traced CUDA-on-CPU build)")
    print(f"- one decode step of one layer: {args.seqs} sequences x {args.context} tokens, fp16, "
          f"block size {BLOCK_SIZE}\n")
    print("| model | query / kv heads | per-head kernel (V1): K/V bytes | grouped kernel (V3): "
          "K/V bytes | ratio | worst relative error (V1, V3) |")
    print("|---|---|---:|---:|---:|---|")
    for model, (heads, kv_heads, head) in SHAPES.items():
        g = torch.Generator().manual_seed(0)
        blocks = args.seqs * -(-args.context // BLOCK_SIZE)
        key_cache = torch.randn(blocks, kv_heads, head // 8, BLOCK_SIZE, 8, generator=g).half()
        value_cache = torch.randn(blocks, kv_heads, head, BLOCK_SIZE, generator=g).half()
        tables = torch.randperm(blocks, generator=g).to(torch.int32).view(args.seqs, -1)
        lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
        query = torch.randn(args.seqs, heads, head, generator=g).half()
        inputs = (query, key_cache, value_cache, tables, lens, head ** -0.5)
        ref = reference.paged_attention(*inputs).double()
        loaded, errors = {}, []
        for version in (1, 3):
            out, trace = kernel_trace.run_traced(*inputs, version=version, kernels=kernels)
            loaded[version] = kernel_trace.loaded_bytes(trace)["total"]
            errors.append(float((out.double() - ref).norm() / ref.norm()))
        print(f"| {model} | {heads} / {kv_heads} | {loaded[1]:,} | {loaded[3]:,} | "
              f"{loaded[1] / loaded[3]:g} | {errors[0]:.1e}, {errors[1]:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
