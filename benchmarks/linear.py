"""A linear layer's matmul on the CPU, every routine of ``models/cpu_matmul.py`` (lesson 15).

    python benchmarks/linear.py                      # SmolLM2's five weight shapes, 1-256 rows
    python benchmarks/linear.py --rows 4 12 64 --threads 1 --record

For each weight shape of the embedded SmolLM2-135M (q/k/v fused, o, gate/up fused, down, the LM
head) and each row count, every routine runs on the same input: ``xw`` (``F.linear``), ``wx``
(``(W x^T)^T``), ``onednn`` and ``cpp`` (minipaged's loop for a few rows, ``csrc/cpu/linear.cpp``,
from the C++ CPU op, built here if it is not yet). As in a decode step, the weights come from
memory, not from the cache: each call takes the next of several copies of the weight (together
larger than the caches). Each cell is the median of ``--repeats`` calls, the routines taken in
turn so that a load that drifts falls on all of them. The table gives milliseconds and GFLOP/s
(2 x rows x out x in per call); the best of each row is marked with *.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minipaged.kernels import build  # noqa: E402
from minipaged.lab.step_breakdown import cpu_capability_notes  # noqa: E402
from minipaged.models import cpu_matmul  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from machine import append_results, machine_description  # noqa: E402

# SmolLM2-135M's weights: (name, out, in)
SHAPES = [("q/k/v", 960, 576), ("o", 576, 576), ("gate/up", 3072, 576), ("down", 576, 1536),
          ("LM head", 49152, 576)]
COPIES_BYTES = 96 << 20  # the weight copies cycled through: more than any cache here


def time_cell(routines: dict, x: torch.Tensor, weights: list[torch.Tensor],
              repeats: int) -> dict[str, float]:
    """Median seconds per call of each routine, the routines in turn, each call on the next
    weight copy; a routine that raises (not in this build) is left out."""
    times: dict[str, list[float]] = {name: [] for name in routines}
    calls = 0
    for i in range(repeats + 1):  # (the first round warms up)
        for name, routine in routines.items():
            if times[name] is None:
                continue
            w = weights[calls % len(weights)]  # (the copy used longest ago)
            calls += 1
            t0 = time.perf_counter()
            try:
                routine(x, w)
            except (RuntimeError, NotImplementedError, AttributeError, TypeError):
                times[name] = None
                continue
            if i:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items() if t}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    for k in args.rows + [args.repeats]:
        if k < 1:
            ap.error(f"rows and repeats must be >= 1, got {k}")
    if args.threads is not None:
        if args.threads < 1:
            ap.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if build.CPU_OP.load() is None:
        print("the C++ CPU op could not be built here: the cpp column is left out")
    routines = dict(cpu_matmul.ROUTINES)
    machine = f"{machine_description('cpu')}; {cpu_capability_notes(torch.float32)}"
    print(machine, flush=True)
    gen = torch.Generator().manual_seed(0)
    lines = ["| weight (out x in) | rows | " + " | ".join(routines) + " | best |",
             "|---|---:|" + "---:|" * len(routines) + "---|"]
    with torch.inference_mode():
        for name, out, inp in SHAPES:
            copies = max(2, COPIES_BYTES // (out * inp * 4))
            weights = [torch.randn(out, inp, generator=gen) for _ in range(copies)]
            for rows in args.rows:
                x = torch.randn(rows, inp, generator=gen)
                t = time_cell(routines, x, weights, args.repeats)
                best = min(t, key=t.get)
                flop = 2 * rows * out * inp
                cells = [(f"{t[r] * 1e3:.2f} ms, {flop / t[r] / 1e9:.0f} GF" +
                          (" *" if r == best else "")) if r in t else "-" for r in routines]
                lines.append(f"| {name} ({out} x {inp}) | {rows} | " + " | ".join(cells) +
                             f" | {best} |")
                print(lines[-1], flush=True)
            del weights
    table = "\n".join(lines)
    if args.record:
        path = append_results(
            "A linear layer's matmul by routine: SmolLM2-135M's weights, CPU",
            [f"machine: {machine}", f"versions: torch {torch.__version__}",
             f"command: `python benchmarks/linear.py "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`",
             f"protocol: median of {args.repeats} calls per cell after one warm-up round, the "
             f"routines in turn; every call on the next of several weight copies (together "
             f"{COPIES_BYTES >> 20} MiB or more, so the weights come from memory as in a step); "
             f"float32; torch threads {torch.get_num_threads()}"], args.note, table)
        print(f"recorded in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
