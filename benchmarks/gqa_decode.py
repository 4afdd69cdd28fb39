"""The C++ CPU op's decode step at grouped-query attention 3:1, read once per group (lesson 18).

SmolLM2's shape: 9 query heads on 3 kv heads, head size 64, blocks of 16 tokens. The C++ op
(``csrc/cpu/attention.cpp``) gives one task to each (sequence, kv head) and computes all the
query heads of the group in it, so each key and value is read once per group. The comparison
row reads them once per *query head*: the same 9 query heads over a cache whose 3 kv heads are
repeated to 9 (what a kernel that gives each query head its own pass reads). Then the same
step on an 8-bit cache (a quarter of the fp32 bytes, plus the scales).

    python benchmarks/gqa_decode.py          # about a minute on 2 cores
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_description  # noqa: E402

from minipaged.kernels import build, kv_quant, reference  # noqa: E402


def cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line.split(":", 1)[1].split() for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile")
                    if f in flags) or "none of avx2/fma/avx512"


def make_cache(kv_heads, head, block_size, num_blocks, kind, g):
    dtype = torch.float32 if kind == "auto" else kv_quant.STORAGE[kind]
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    k = torch.zeros(num_blocks, kv_heads, head // x, block_size, x, dtype=dtype)
    v = torch.zeros(num_blocks, kv_heads, head, block_size, dtype=dtype)
    scales = None
    if kind != "auto":
        scales = tuple(torch.zeros(num_blocks, kv_heads, block_size) for _ in range(2))
    slots = torch.arange(num_blocks * block_size)
    reference.reshape_and_cache(torch.randn(len(slots), kv_heads, head, generator=g),
                                torch.randn(len(slots), kv_heads, head, generator=g), k, v,
                                slots, scales)
    return k, v, scales


def time_step(op, query, cache, tables, lens, repeats) -> float:
    k, v, scales = cache
    extra = {} if scales is None else {"kv_scales": scales}
    op.paged_attention(query, k, v, tables, lens, 0.125, **extra)  # warm up
    t = time.perf_counter()
    for _ in range(repeats):
        op.paged_attention(query, k, v, tables, lens, 0.125, **extra)
    return (time.perf_counter() - t) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    op = build.CPU_OP.load()
    if op is None:
        sys.exit("the C++ CPU op did not build here")
    g = torch.Generator().manual_seed(0)
    heads, head, bs = 9, 64, 16
    blocks_per_seq = args.context // bs
    num_blocks = args.seqs * blocks_per_seq
    tables = torch.arange(num_blocks, dtype=torch.int32).view(args.seqs, blocks_per_seq)
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    query = torch.randn(args.seqs, heads, head, generator=g)
    print(f"- date: {time.strftime('%Y-%m-%d')}; machine: {machine_description()}; "
          f"CPU flags: {cpu_flags()}; torch {torch.__version__}")
    print(f"- one decode step of one layer: {args.seqs} sequences x {args.context} tokens, "
          f"{heads} query heads, head size {head}, block size {bs}; mean of {args.repeats}\n")
    print("| cache | kv heads read | KV bytes read per step | time (ms) | GB/s |")
    print("|---|---:|---:|---:|---:|")
    rows = [("fp32, GQA 3:1, read once per group", 3, "auto"),
            ("fp32, each query head reads its own copy (9 kv heads)", 9, "auto"),
            ("int8, GQA 3:1, read once per group", 3, "int8"),
            ("fp8, GQA 3:1, read once per group", 3, "fp8")]
    for name, kv_heads, kind in rows:
        cache = make_cache(kv_heads, head, bs, num_blocks, kind, g)
        seconds = time_step(op, query, cache, tables, lens, args.repeats)
        per_token = kv_quant.bytes_per_token_per_head(head, kind, torch.float32)
        read = 2 * args.seqs * args.context * kv_heads * per_token
        print(f"| {name} | {kv_heads} | {read / 2**20:.1f} MiB | {seconds * 1e3:.2f} | "
              f"{read / seconds / 1e9:.1f} |")


if __name__ == "__main__":
    main()
