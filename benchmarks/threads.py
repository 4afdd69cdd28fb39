"""Small batches by thread count, on a quiet machine and with cores kept busy (issue 45).

    python benchmarks/threads.py                  # batches 1, 4, 16; quiet, then one core busy
    python benchmarks/threads.py --busy 0 1 2 --record

The same greedy requests of the embedded SmolLM2 go through one ``LLM()`` three ways: with the
engine's own choice of threads per step (``cpu_threads=None``, worker/cpu_threads.py), pinned to
one thread, and pinned to every core. Each load (``--busy K``: K processes that each keep a core
busy, started here and stopped after) times every batch size and setting, the settings in turn
so that a load that drifts falls on all of them, and takes the median of ``--repeats`` runs.
The table gives the times, the choice's time over the best pinned one, and which thread counts
the engine chose for the steps of that batch.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from minipaged import LLM, SamplingParams  # noqa: E402
from minipaged.lab.step_breakdown import cpu_capability_notes  # noqa: E402
from minipaged.worker.cpu_threads import usable_cores  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from machine import append_results, machine_description  # noqa: E402

PROMPT = "The block manager of a paged KV cache"


def _keep_a_core_busy() -> None:  # another program's work, until terminated
    x = 0
    while True:
        x = (x * 1103515245 + 12345) % 2147483648


def time_batch(llm: LLM, setting: int | None, batch: int, max_tokens: int) -> tuple[float, dict]:
    """Seconds for ``batch`` greedy requests of ``max_tokens`` tokens with the worker's threads
    set to ``setting`` (None: chosen per step), and the counts it chose."""
    chooser = llm.llm_engine.worker.threads
    chooser.setting = setting
    chooser.steps_by_threads.clear()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [f"{PROMPT} ({i})" for i in range(batch)]
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, dict(chooser.steps_by_threads)


def run_load(llm: LLM, busy: int, batches: list[int], max_tokens: int, repeats: int,
             cores: int) -> list[dict]:
    workers = [multiprocessing.Process(target=_keep_a_core_busy, daemon=True)
               for _ in range(busy)]
    for w in workers:
        w.start()
    settings = [None, 1] + ([cores] if cores > 1 else [])
    try:
        time.sleep(1.0)  # the engine reads the load over the last half second
        rows = []
        for batch in batches:
            times = {s: [] for s in settings}
            chosen: dict = {}
            for _ in range(repeats):
                for s in settings:
                    t, counts = time_batch(llm, s, batch, max_tokens)
                    times[s].append(t)
                    if s is None:
                        for k, v in counts.items():
                            chosen[k] = chosen.get(k, 0) + v
            med = {s: statistics.median(v) for s, v in times.items()}
            best = min(med[s] for s in settings if s is not None)
            rows.append(dict(busy=busy, batch=batch, med=med, best=best, chosen=chosen))
            print(f"  busy {busy}, batch {batch}: " + ", ".join(
                f"{'chosen' if s is None else f'{s} thread(s)'} {med[s]:.2f} s"
                for s in settings), flush=True)
        return rows
    finally:
        for w in workers:
            w.terminate()
            w.join()


def format_table(rows: list[dict], cores: int, max_tokens: int) -> str:
    pinned = [1] + ([cores] if cores > 1 else [])
    head = ("| cores kept busy | requests | chosen per step (s) | "
            + " | ".join(f"{p} thread{'s' if p > 1 else ''} (s)" for p in pinned)
            + " | chosen / best pinned | threads the engine chose (steps) |")
    lines = [head, "|" + "---:|" * (4 + len(pinned)) + "---|"]
    for r in rows:
        chosen = ", ".join(f"{k}: {v}" for k, v in sorted(r["chosen"].items()))
        lines.append(f"| {r['busy']} | {r['batch']} | {r['med'][None]:.2f} | "
                     + " | ".join(f"{r['med'][p]:.2f}" for p in pinned)
                     + f" | {r['med'][None] / r['best']:.2f}x | {chosen} |")
    return "\n".join(lines) + f"\n\n(each request: {max_tokens} greedy tokens)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1],
                    help="loads to time under: this many cores kept busy by other processes")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    for k in args.batches + args.busy + [args.max_tokens, args.repeats]:
        if k < 0:
            ap.error(f"counts must be >= 0, got {k}")
    cores = usable_cores()
    llm = LLM(device="cpu", dtype="float32")
    llm.generate([PROMPT], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    machine = f"{machine_description('cpu')}; {cpu_capability_notes(torch.float32)}"
    print(machine, flush=True)
    rows = []
    for busy in args.busy:
        rows += run_load(llm, busy, args.batches, args.max_tokens, args.repeats, cores)
    table = format_table(rows, cores, args.max_tokens)
    print(table)
    if args.record:
        path = append_results(
            "Small batches by thread count: SmolLM2-135M-Instruct, CPU",
            [f"machine: {machine}", f"versions: torch {torch.__version__}",
             f"command: `python benchmarks/threads.py "
             f"{' '.join(argv if argv is not None else sys.argv[1:])}`",
             f"protocol: median of {args.repeats} runs per cell, the settings taken in turn; "
             f"busy cores are processes started by the benchmark"], args.note, table)
        print(f"recorded in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
