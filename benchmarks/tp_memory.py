"""Tensor parallelism: the weights and KV pool each rank holds, at N = 1, 2, 3 (lesson 14).

    python benchmarks/tp_memory.py            # the embedded SmolLM2-135M-Instruct on the CPU
    python benchmarks/tp_memory.py --record   # and append the table to RESULTS.md

Measured on the tensors (``Worker.memory_per_rank``, ``minipaged/worker/worker.py``): N = 1 runs
the model in this process; N > 1 starts the worker processes and asks each rank for its own bytes. A size that does
not divide the heads is refused by the engine, and the table says so. Each N > 1 is run twice:
with the same number of blocks as N = 1 (the memory per rank shrinks) and with the default KV
budget per rank (the pool holds N times the blocks).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minipaged import LLM  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from machine import machine_description  # noqa: E402

MiB = 1 << 20


def measure(model, size: int, num_gpu_blocks: int | None) -> dict:
    """One engine of tensor_parallel_size ``size``: what its largest rank holds."""
    kwargs = {} if num_gpu_blocks is None else {"num_gpu_blocks": num_gpu_blocks}
    start = time.perf_counter()
    llm = LLM(model, tensor_parallel_size=size, swap_space=0.01, **kwargs)
    started = time.perf_counter() - start
    engine = llm.llm_engine
    ranks = engine.worker.memory_per_rank()
    row = {"weights": max(r["weights"] for r in ranks), "kv": max(r["kv_cache"] for r in ranks),
           "blocks": engine.block_manager.num_total_gpu_blocks,
           "per_token": engine.block_bytes // engine.block_size, "started": started}
    engine.shutdown()  # stops the workers of N > 1
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--record", action="store_true", help="append to RESULTS.md")
    args = parser.parse_args()

    rows = []  # (N, pool, row or the refusal)
    base = measure(args.model, 1, None)
    for size in args.sizes:
        if size == 1:
            rows.append((1, "default budget", base))
            continue
        for pool, blocks in (("same blocks as N = 1", base["blocks"]), ("default budget", None)):
            try:
                rows.append((size, pool, measure(args.model, size, blocks)))
            except ValueError as e:
                rows.append((size, "refused", str(e)))
                break

    lines = ["| N | KV pool | weights per rank | KV bytes per token per rank | KV pool per rank "
             "(blocks) | weights + KV per rank | start (s) |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    refusals = []
    for size, pool, row in rows:
        if isinstance(row, str):
            lines.append(f"| {size} | refused | - | - | - | - | - |")
            refusals.append(f"N = {size} is refused: {row}")
            continue
        lines.append(
            f"| {size} | {pool} | {row['weights'] / MiB:,.1f} MiB | {row['per_token']:,} B | "
            f"{row['kv'] / MiB:,.1f} MiB ({row['blocks']:,}) | "
            f"{(row['weights'] + row['kv']) / MiB:,.1f} MiB | {row['started']:.1f} |")
    table = "\n".join(lines + [""] + refusals)
    print(table)
    if args.record:
        import torch
        header = (f"\n## Tensor parallel: memory per rank, "
                  f"{args.model or 'SmolLM2-135M-Instruct'} ({datetime.date.today()})\n\n"
                  f"- machine: {machine_description()}\n"
                  f"- versions: torch {torch.__version__}; float32, block size 16, CPU swap "
                  f"pool 0.01 GiB (not counted)\n"
                  f"- command: `python benchmarks/tp_memory.py --record`\n\n")
        path = os.path.join(os.path.dirname(__file__), "RESULTS.md")
        with open(path, "a") as f:
            f.write(header + table + "\n")


if __name__ == "__main__":
    main()
