"""Lesson 04's measurement: what one preemption costs on this machine, by recompute and by swap.

    measure(llm, length) -> (recompute seconds, swap seconds)
        recompute: the engine's own model time for a prefill of ``length`` tokens (all computed:
        the ``LLM`` must run without prefix caching); swap: the worker's ``swap_out`` and
        ``swap_in`` of that many tokens' blocks (both pools are in RAM on a CPU: a memory copy)
    measure_lengths(llm, lengths, runs=3) -> {length: (recompute s, swap s)}
        after one warm-up, the fastest of ``runs`` runs at each length (the least disturbed by
        other programs)
    curves(measured, num_params, block_size, shape) -> {label: [(tokens, ms)]}
        the two measured curves and ``lab/preemption_cost.py``'s GPU model of each
    growth_line(measured), cheaper_lines(measured, num_params, block_size, shape)
        how each measured cost grew from the shortest length to the longest, in words; which way
        is cheaper, measured and in the GPU model, and whether the curves cross
"""
from __future__ import annotations

import time

from minipaged.lab import preemption_cost
from minipaged.sampling_params import SamplingParams

_ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def measure(llm, length: int) -> tuple[float, float]:
    engine = llm.llm_engine
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be a positive number of tokens, got {length!r}")
    vocab = engine.model_shape.vocab_size
    ids = [(100 + (17 * i) % 4000) % vocab for i in range(length)]
    prompt_before, time_before = engine.stats.num_prompt_tokens, engine.stats.time_model
    llm.generate(prompt_token_ids=[ids], sampling_params=_ONE_TOKEN, use_tqdm=False)
    recompute = engine.stats.time_model - time_before
    if engine.stats.num_prompt_tokens - prompt_before != length:
        raise ValueError("the prefill took cached tokens: measure on an LLM without prefix "
                         "caching")
    blocks = {b: b for b in range(-(-length // engine.block_size))}
    start = time.perf_counter()
    engine.worker.swap_out(blocks)
    engine.worker.swap_in(blocks)
    return recompute, time.perf_counter() - start


def measure_lengths(llm, lengths: list[int], runs: int = 3) -> dict[int, tuple[float, float]]:
    measure(llm, min(8, min(lengths)))  # warm-up
    measured = {}
    for length in lengths:
        times = [measure(llm, length) for _ in range(runs)]
        measured[length] = (min(t[0] for t in times), min(t[1] for t in times))
    return measured


def curves(measured: dict, num_params: int, block_size: int, shape) -> dict[str, list]:
    lengths = sorted(measured)
    return {
        "recompute, measured (this CPU)": [(n, measured[n][0] * 1e3) for n in lengths],
        "swap, measured (RAM copy here)": [(n, measured[n][1] * 1e3) for n in lengths],
        "recompute, GPU model": [(n, preemption_cost.recompute_seconds(n, num_params) * 1e3)
                                 for n in lengths],
        "swap, PCIe model": [(n, preemption_cost.swap_seconds(n, block_size, shape) * 1e3)
                             for n in lengths],
    }


def growth_line(measured: dict) -> str:
    lengths = sorted(measured)
    more = lengths[-1] / lengths[0]
    parts = []
    for i, kind in enumerate(("recompute", "swap")):
        ratio = measured[lengths[-1]][i] / measured[lengths[0]][i]
        words = ("less than in proportion" if ratio < 0.75 * more else
                 "more than in proportion" if ratio > 1.25 * more else "about in proportion")
        parts.append(f"{kind} {ratio:.1f}x ({words})")
    return f"{lengths[-1] // lengths[0]}x the tokens took: " + ", ".join(parts)


def _cheaper(recompute_s: float, swap_s: float) -> str:
    return "swap" if swap_s < recompute_s else "recompute"


def cheaper_lines(measured: dict, num_params: int, block_size: int, shape) -> list[str]:
    on_cpu = {_cheaper(*measured[n]) for n in measured}
    on_gpu = {_cheaper(preemption_cost.recompute_seconds(n, num_params),
                       preemption_cost.swap_seconds(n, block_size, shape)) for n in measured}
    return [f"measured here: {' or '.join(sorted(on_cpu))} is cheaper"
            + (" at every length: the measured curves do not cross" if len(on_cpu) == 1 else
               ", depending on the length: the measured curves cross"),
            f"GPU model, blocks of {block_size}: {' or '.join(sorted(on_gpu))} is cheaper"
            + (" at every length: the model's curves do not cross either" if len(on_gpu) == 1
               else ", depending on the length")]
