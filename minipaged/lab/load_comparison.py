"""Lesson 05's load comparison: our key load against vLLM's, run and counted on the CPU.

``compare_key_loads(variants, shapes)`` runs each traced CPU build of the kernel
(``cuda_on_cpu.load("traced")``: ours, ``load("shared_load")``: vLLM's) on one sequence of each
shape, checks its output against the torch reference, and counts what one warp asks of memory
for one KV block (``kernel_trace.key_load_counts``)::

    rows, traces = compare_key_loads({"ours": traced, "vLLM's": shared_load},
                                     [(torch.float16, 128, 16)])
    rows[0]["instructions"], rows[0]["sectors"]   # one row per (shape, variant)
    traces[("float16", 128, 16, "ours")]          # that run's trace of CUDA block (0, 0, 0)
"""
from __future__ import annotations

import time

import torch

from minipaged.kernels.reference import paged_attention as paged_attention_ref
from minipaged.lab import kernel_trace

# which traced build each variant of the comparison is (``kernel_trace.run_traced``'s variant)
VARIANT_BUILDS = {"ours": "traced", "vLLM's": "shared_load"}


def one_sequence(head_size: int, block_size: int, dtype: torch.dtype, tokens: int = 64,
                 seed: int = 0) -> tuple:
    """N(0, 1) inputs of ``paged_attention``: one sequence, one head, its blocks in reverse order
    in the pool. ``tokens`` must be a positive multiple of ``block_size``."""
    if block_size <= 0 or tokens <= 0 or tokens % block_size:
        raise ValueError(f"tokens ({tokens}) must be a positive multiple of block_size "
                         f"({block_size})")
    gen = torch.Generator().manual_seed(seed)
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    if head_size <= 0 or head_size % x:
        raise ValueError(f"head_size ({head_size}) must be a positive multiple of x = {x}")
    blocks = tokens // block_size
    key_cache = torch.randn(blocks, 1, head_size // x, block_size, x, generator=gen).to(dtype)
    value_cache = torch.randn(blocks, 1, head_size, block_size, generator=gen).to(dtype)
    query = torch.randn(1, 1, head_size, generator=gen).to(dtype)
    table = torch.arange(blocks - 1, -1, -1, dtype=torch.int32)[None]
    return (query, key_cache, value_cache, table, torch.tensor([tokens], dtype=torch.int32),
            head_size ** -0.5)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The relative error ||out - ref|| / ||ref|| (in float64)."""
    return float(torch.linalg.norm(out.double() - ref.double()) / torch.linalg.norm(ref.double()))


def compare_key_loads(variants: dict, shapes: list[tuple]) -> tuple[list[dict], dict]:
    """Each variant (a name of ``VARIANT_BUILDS`` -> its loaded kernels) run on each shape
    ``(dtype, head_size, block_size)``: one row per run (the shape, G, the key load counts, the
    relative error against the reference, the CPU milliseconds) and each run's trace of CUDA
    block (0, 0, 0). Raises AssertionError when a variant's output is off the reference."""
    unknown = set(variants) - set(VARIANT_BUILDS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}: expected {list(VARIANT_BUILDS)}")
    rows, traces = [], {}
    for dtype, head_size, block_size in shapes:
        inputs = one_sequence(head_size, block_size, dtype)
        reference = paged_attention_ref(*inputs)
        for name, kernels in variants.items():
            start = time.perf_counter()
            out, trace = kernel_trace.run_traced(*inputs, variant=VARIANT_BUILDS[name],
                                                 kernels=kernels)
            seconds = time.perf_counter() - start
            error = rel_err(out, reference)
            assert error < 1e-3, f"{name}'s output is off the reference by {error:.1e}"
            dtype_name = str(dtype).removeprefix("torch.")
            traces[(dtype_name, head_size, block_size, name)] = trace[(0, 0, 0)]
            rows.append({"dtype": dtype_name, "head_size": head_size, "block_size": block_size,
                         "G": max(32 // block_size, 1), "load": name, "rel_err": error,
                         "ms": seconds * 1e3, **kernel_trace.key_load_counts(trace[(0, 0, 0)])})
    return rows, traces


def markdown_table(rows: list[dict]) -> str:
    """``compare_key_loads``'s rows as the lesson's Markdown table."""
    lines = ["| dtype, head, block | G | load | bytes / lane load | load instructions | lane loads "
             "| bytes | sectors | lines | rel. error | CPU time |", "|---" * 11 + "|"]
    for r in rows:
        lines.append(f"| {r['dtype']}, {r['head_size']}, {r['block_size']} | {r['G']} "
                     f"| {r['load']} | {r['bytes_per_load']} | {r['instructions']} "
                     f"| {r['lane_loads']} | {r['bytes']} | {r['sectors']} | {r['lines']} "
                     f"| {r['rel_err']:.1e} | {r['ms']:.0f} ms |")
    return "\n".join(lines)
