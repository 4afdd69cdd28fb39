"""Lesson 06's phase 3 in CUDA C++: what its check says about a learner's string, by cause.

    helpers_called(code) -> [(name, file)]
        the kernel file's own device functions and functors (``block_reduce``, ``butterfly``,
        ``MaxOp``, ...) that ``code`` calls, comments left out: the exercise asks for the
        reductions written by the learner, so calling them is refused (``refusal``)
    disagreement(values) -> (what the threads hold, hint)
        threads that end phase 3 with different values: every warp agreeing but the warps not
        is a reduction that never crossed the warps; lane 0 alone right is a reduction that was
        not broadcast; the threads listed are ones that differ
    race_hint(code, report)
        ThreadSanitizer's race: two accesses inside one loop of the learner's (no barrier can
        order them) is two threads owning the same token, a stride problem; else a barrier is
        missing between a write and another warp's read
"""
from __future__ import annotations

import functools
import re

import torch

from minipaged.kernels.build import CSRC
from minipaged.lab import kernel_exercise

WARP_SIZE = 32
_REDUCTIONS = {"block_reduce", "butterfly", "MaxOp", "SumOp"}


@functools.cache
def _kernel_helpers() -> dict[str, str]:
    """Every device function and functor the exercise build's files define, by name: its file."""
    helpers: dict[str, str] = {}
    for path in sorted(CSRC.glob("*.cuh")) + [kernel_exercise.KERNEL]:
        text = path.read_text()
        for name in re.findall(r"__device__[^;{()]*?\b(\w+)\s*\(", text):
            if name != "operator":
                helpers.setdefault(name, f"csrc/{path.name}")
        for name in re.findall(r"struct\s+(\w+)\s*\{\s*__device__", text):
            helpers.setdefault(name, f"csrc/{path.name}")
    return helpers


def _without_comments(code: str) -> str:
    code = re.sub(r"/\*.*?\*/", " ", code, flags=re.S)
    return re.sub(r"//[^\n]*", "", code)


def helpers_called(code: str) -> list[tuple[str, str]]:
    """The kernel file's helpers that ``code`` names as a call or a template (in order)."""
    code = _without_comments(code)
    found = []
    for name, where in _kernel_helpers().items():
        match = re.search(rf"\b{name}\s*[<(]", code)
        if match:
            found.append((match.start(), name, where))
    return [(name, where) for _, name, where in sorted(found)]


def refusal(called: list[tuple[str, str]]) -> str:
    """What was called, and (a hint) what to write instead."""
    names = ", ".join(f"{name} ({where})" for name, where in called)
    if any(name in _REDUCTIONS for name, _ in called):
        instead = ("this exercise asks for the two reductions written by you: inside each "
                   "warp a butterfly of __shfl_xor_sync, between the warps one red_smem slot "
                   "per warp, a barrier, and the NUM_WARPS values combined so that every "
                   "thread holds the result")
    else:
        instead = ("phase 3 is yours to write from CUDA's own functions (__shfl_xor_sync, "
                   "__shfl_sync, __syncthreads, expf, fmaxf) and the names phase 2 left you")
    return f"your phase 3 calls the kernel file's own {names}\n  hint: {instead}"


def _listed(values: torch.Tensor) -> str:
    """The first thread of each different value (up to six): threads that differ."""
    shown: list[tuple[int, float]] = []
    for thread, value in enumerate(values.tolist()):
        if all(value != v for _, v in shown):
            shown.append((thread, value))
        if len(shown) == 6:
            break
    return ", ".join(f"thread {t}: {v:.6g}" for t, v in shown)


def disagreement(values: torch.Tensor, name: str, want: float) -> tuple[str, str]:
    """What to show and the hint, for threads that end phase 3 with different ``name``."""
    warps = values.reshape(-1, WARP_SIZE)
    if bool((warps == warps[:, :1]).all()):
        held = ", ".join(f"warp {w}: {float(v):.6g}" for w, v in enumerate(warps[:, 0]))
        return (f"each warp's threads agree on {name}, the warps do not ({held})",
                "a butterfly inside a warp gives that warp's result only: the CUDA block's "
                "result needs the step across warps (each warp's value into a red_smem slot, "
                "a barrier, then every thread combines the NUM_WARPS values)")
    what = f"the threads end phase 3 with different {name}: {_listed(values)}"
    if abs(float(values[0]) - want) <= 1e-4 * max(1.0, abs(want)):  # lane 0 holds it
        return what, ("every thread needs the block's result: after a butterfly of "
                      "__shfl_xor_sync every lane holds it, a __shfl_down_sync reduction "
                      "leaves it in lane 0 only")
    return what, ("every thread needs the CUDA block's one result: look for a thread that "
                  "skips part of a reduction, or reads a red_smem slot no warp wrote")


def _loops(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) line numbers, from 1, of every for loop in the learner's lines."""
    loops = []
    for start, line in enumerate(lines, 1):
        if not re.match(r"\s*for\s*\(", line):
            continue
        depth, opened, end = 0, False, start
        for end in range(start, len(lines) + 1):
            for char in lines[end - 1]:
                depth += char == "{"
                depth -= char == "}"
                opened = opened or char == "{"
            if not opened and lines[end - 1].rstrip().endswith(";") or opened and depth <= 0:
                break
        loops.append((start, end))
    return loops


def _race_lines(report: str) -> list[int | None]:
    """The learner's line of each of the race's two accesses (None: not the learner's)."""
    frames = re.findall(r"^\s*#0 .*$", report, flags=re.M)[:2]
    named = [re.search(re.escape(kernel_exercise.LEARNER_FILE) + r":(\d+)", f) for f in frames]
    return [int(m.group(1)) if m else None for m in named]


def race_hint(code: str, report: str) -> str:
    lines = _without_comments(code).split("\n")
    first, second = (_race_lines(report) + [None, None])[:2]
    if first is not None and second is not None:
        for start, end in _loops(lines):
            body = "\n".join(lines[start - 1:end])
            if start <= first <= end and start <= second <= end and "__syncthreads" not in body:
                return ("both accesses are in one loop of yours, where no barrier can order "
                        "them: two threads reach the same logit. Each of the num_tokens logits "
                        "belongs to one thread only: the loop's stride is the number of threads "
                        "that share the tokens (every thread of the CUDA block, not one warp)")
    return ("threads meet through shared memory: a barrier (__syncthreads()) must separate "
            "one warp's writes to red_smem or logits from another warp's reads of them")
