"""Malformed inputs every compiled back-end must refuse with a Python exception (lesson 05).

A compiled op that reads a block number past its pool reads someone else's memory; one whose
error message crashes takes the notebook kernel or the server with it. So each back-end present
on a machine is called with each case of ``CASES`` and must raise ``RuntimeError`` or
``ValueError`` with a message naming the argument (``expect``, a regular expression).

The cases run in a child process per back-end (``run_table``): a crash then fails its case, and
the remaining cases run in a fresh child. ``python scripts/check_compiled_ops.py`` prints the
table; ``tests/kernels/test_malformed_inputs.py`` asserts it; ``make gpu-check`` runs it first.

Back-ends: "cpu_op" (``csrc/cpu/attention.cpp``), "cuda_on_cpu" (the ``.cu`` files built for the
CPU) and "cuda" (the real CUDA kernels; the tensors on the GPU, the block tables, lengths and
slots on the host as the engine's tests pass them, where checking them costs nothing).
"""
from __future__ import annotations

import json
import signal
import subprocess
from dataclasses import dataclass
from typing import Callable

from minipaged.child_process import python_argv

NUM_BLOCKS, BLOCK_SIZE, HEAD_SIZE, NUM_HEADS, NUM_KV_HEADS = 8, 16, 64, 4, 2


@dataclass(frozen=True)
class Case:
    """One malformed call: ``mutate(inputs)`` spoils a well-formed set of inputs in place;
    ``op`` is "paged_attention" or "reshape_and_cache"; ``expect`` must match the message."""

    name: str
    op: str
    mutate: Callable[[dict], None]
    expect: str


def well_formed(device: str):
    """Inputs of both ops that every back-end accepts: fp32, 2 sequences of 20 and 5 tokens."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = 16 // 4  # fp32

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)

    return {
        "query": randn(2, NUM_HEADS, HEAD_SIZE),
        "key_cache": randn(NUM_BLOCKS, NUM_KV_HEADS, HEAD_SIZE // x, BLOCK_SIZE, x),
        "value_cache": randn(NUM_BLOCKS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE),
        "block_tables": torch.tensor([[3, 1], [5, 0]], dtype=torch.int32),
        "context_lens": torch.tensor([20, 5], dtype=torch.int32),
        "key": randn(3, NUM_KV_HEADS, HEAD_SIZE),
        "value": randn(3, NUM_KV_HEADS, HEAD_SIZE),
        "slot_mapping": torch.tensor([0, 17, 40], dtype=torch.long),
    }


def _set(name, value_of):
    def mutate(inputs):
        inputs[name] = value_of(inputs)
    return mutate


def _put(name, index, value):
    def mutate(inputs):
        inputs[name][index] = value
    return mutate


CASES = [
    Case("a block number past the pool", "paged_attention",
         _put("block_tables", (1, 0), NUM_BLOCKS), r"block_tables\[1, 0\] = 8\b"),
    Case("a negative block number", "paged_attention",
         _put("block_tables", (0, 1), -3), r"block_tables\[0, 1\] = -3\b"),
    Case("a context longer than its blocks", "paged_attention",
         _put("context_lens", 0, 40), r"block_tables has 2 columns|context_lens\[0\] = 40"),
    Case("a context of no tokens", "paged_attention",
         _put("context_lens", 1, 0), r"context_lens\[1\] = 0"),
    Case("heads that kv heads do not divide", "paged_attention",
         _set("query", lambda i: i["query"][:, :3].contiguous()), r"num_heads\D+3\b"),
    Case("a value cache of another head size", "paged_attention",
         _set("value_cache", lambda i: i["value_cache"][:, :, :32].contiguous()),
         r"value_cache.*(32|head size)"),
    Case("a float64 query", "paged_attention",
         _set("query", lambda i: i["query"].double()), r"query.*(float64|Double)"),
    Case("a key cache with the wrong x", "paged_attention",
         _set("key_cache", lambda i: i["key_cache"].reshape(NUM_BLOCKS, NUM_KV_HEADS,
                                                            HEAD_SIZE // 8, BLOCK_SIZE, 8)),
         r"key_cache's last dimension must be x = 16 / element size = 4"),
    Case("a slot past the pool", "reshape_and_cache",
         _put("slot_mapping", 2, NUM_BLOCKS * BLOCK_SIZE), r"slot_mapping\[2\] = 128\b"),
]


def load_backend(backend: str):
    """The kernels object of a back-end, and the device its tensors live on."""
    if backend == "cpu_op":
        from minipaged.kernels import build
        return build.CPU_OP.load(), "cpu"
    if backend == "cuda_on_cpu":
        from minipaged.kernels import cuda_on_cpu
        return cuda_on_cpu.load(), "cpu"
    if backend == "cuda":
        from minipaged.kernels import build
        return build.CUDA_OP.load(), "cuda"
    raise ValueError(f"backend must be 'cpu_op', 'cuda_on_cpu' or 'cuda', not {backend!r}")


def call_case(kernels, device: str, case: Case) -> tuple[str, str]:
    """Run one case: ("raised", "<Type>: message") or ("returned", "")."""
    import math

    inputs = well_formed(device)
    case.mutate(inputs)
    try:
        if case.op == "paged_attention":
            kernels.paged_attention(inputs["query"], inputs["key_cache"], inputs["value_cache"],
                                    inputs["block_tables"], inputs["context_lens"],
                                    1 / math.sqrt(HEAD_SIZE))
        else:
            kernels.reshape_and_cache(inputs["key"], inputs["value"], inputs["key_cache"],
                                      inputs["value_cache"], inputs["slot_mapping"])
    except (RuntimeError, ValueError) as error:
        return "raised", f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return "returned", ""


def _child(backend: str, first: int) -> None:
    """Run cases ``first...`` and print one JSON line per case as soon as it is done."""
    kernels, device = load_backend(backend)
    if kernels is None:
        print(json.dumps({"unavailable": True}), flush=True)
        return
    for index in range(first, len(CASES)):
        outcome, message = call_case(kernels, device, CASES[index])
        print(json.dumps({"index": index, "outcome": outcome, "message": message}), flush=True)


def run_table(backend: str, timeout: float = 900) -> list[dict] | None:
    """Every case against ``backend``, in child processes; None when the back-end is not
    available here. Each row: name, outcome ("raised", "returned", "crashed: SIGSEGV", ...),
    message, ok (raised with a message matching the case's ``expect``)."""
    import re

    rows: list[dict] = []
    while len(rows) < len(CASES):
        child = subprocess.run(
            python_argv("from minipaged.kernels.malformed import _child; "
                        "_child(sys.argv[1], int(sys.argv[2]))", backend, len(rows)),
            capture_output=True, text=True, timeout=timeout)
        for line in child.stdout.splitlines():
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if record.get("unavailable"):
                return None
            case = CASES[record["index"]]
            rows.append({"name": case.name, "outcome": record["outcome"],
                         "message": record["message"],
                         "ok": record["outcome"] == "raised"
                         and re.search(case.expect, record["message"]) is not None})
        if len(rows) < len(CASES) and child.returncode != 0:
            # NOTE: the child died inside the next case (or before any): that case failed, and
            # the rest run in a fresh child.
            died = (signal.Signals(-child.returncode).name if child.returncode < 0
                    else f"exit {child.returncode}: {child.stderr.strip().splitlines()[-1:]}")
            rows.append({"name": CASES[len(rows)].name, "outcome": f"crashed: {died}",
                         "message": "", "ok": False})
        elif len(rows) < len(CASES):
            raise RuntimeError(f"the {backend} child stopped early: {child.stderr[-2000:]}")
    return rows


def format_table(backend: str, rows: list[dict]) -> str:
    """The rows as a Markdown table for the check script and the closing notes."""
    lines = [f"| {backend}: case | outcome | message |", "|---|---|---|"]
    for row in rows:
        mark = "ok" if row["ok"] else "FAIL"
        lines.append(f"| {row['name']} | {mark}, {row['outcome']} | {row['message'][:150]} |")
    return "\n".join(lines)
