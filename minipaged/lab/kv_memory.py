"""The KV cache, what it costs, and how much of it a naive allocator wastes (lesson 01).

Attention at position t needs the key and value vectors of every earlier token. Recomputing them
for every new token costs a full forward pass over the whole sequence; keeping them (the *KV
cache*) turns each new token into a forward pass over one token. The price is memory:

    bytes per token = 2 (K and V) x layers x kv_heads x head_size x bytes per element

This module computes that price for a few real model shapes, times generation with and without a
cache, and measures how a serving system that gives every request one contiguous reservation of
its maximum length wastes most of the cache, while paged blocks (the rest of minipaged) waste
only the unfilled tail of each sequence's last block.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field

from minipaged.model_shape import ModelShape

# ----------------------------------------------------------------------------------------------
# Bytes per token: ``kv_bytes_per_token`` and ``ModelShape`` (``minipaged/model_shape.py``), the
# same numbers the engine sizes its pool with
# ----------------------------------------------------------------------------------------------

FP16_BYTES = 2  # the published models serve in fp16 / bf16

# Real models' shapes (their published configs), as ``ModelShape.from_hf`` reads them.
MODEL_SHAPES = {
    "GPT-2": ModelShape(num_layers=12, hidden_size=768, intermediate_size=3072, num_heads=12,
                        num_kv_heads=12, head_size=64, vocab_size=50257, max_positions=1024,
                        gated_mlp=False),
    # grouped-query attention: 9 query heads share 3 kv heads, so the cache is 3x smaller
    "SmolLM2-135M": ModelShape(num_layers=30, hidden_size=576, intermediate_size=1536,
                               num_heads=9, num_kv_heads=3, head_size=64, vocab_size=49152,
                               max_positions=8192, gated_mlp=True),
    "LLaMA-7B": ModelShape(num_layers=32, hidden_size=4096, intermediate_size=11008,
                           num_heads=32, num_kv_heads=32, head_size=128, vocab_size=32000,
                           max_positions=2048, gated_mlp=True),
    "LLaMA-13B": ModelShape(num_layers=40, hidden_size=5120, intermediate_size=13824,
                            num_heads=40, num_kv_heads=40, head_size=128, vocab_size=32000,
                            max_positions=2048, gated_mlp=True),
}


def sequence_bytes(shape: ModelShape, num_tokens: int, dtype_bytes: int = FP16_BYTES) -> int:
    """Cache bytes of one sequence of ``num_tokens`` tokens.

    Args:
        shape: the model's shape.
        num_tokens: the sequence's length.
        dtype_bytes: bytes of one element of the cache.
    """
    return num_tokens * shape.kv_bytes_per_token(dtype_bytes)


# ----------------------------------------------------------------------------------------------
# With and without a cache (on a real model, through the engine's public API)
# ----------------------------------------------------------------------------------------------


def greedy_with_cache(llm, prompt_token_ids: list[int], num_new_tokens: int) -> list[int]:
    """One request: the prompt's K/V are computed once, then one token per step."""
    from minipaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=num_new_tokens, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[prompt_token_ids], sampling_params=params,
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def greedy_without_cache(llm, prompt_token_ids: list[int], num_new_tokens: int) -> list[int]:
    """Every new token is a fresh request over the whole sequence so far: all K/V recomputed."""
    from minipaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = list(prompt_token_ids)
    for _ in range(num_new_tokens):
        out = llm.generate(prompt_token_ids=[ids], sampling_params=params, use_tqdm=False)
        ids.append(out[0].outputs[0].token_ids[0])
    return ids[len(prompt_token_ids):]


def kv_vectors_computed(prompt_len: int, num_new_tokens: int, cached: bool) -> int:
    """How many tokens' K/V a layer computes to generate ``num_new_tokens`` tokens."""
    if cached:
        return prompt_len + num_new_tokens - 1  # each token once (the last one is never needed)
    return sum(prompt_len + i for i in range(num_new_tokens))  # the whole prefix every time


def time_call(fn, *args) -> tuple[float, object]:
    """(seconds, result) of one call."""
    start = time.perf_counter()
    result = fn(*args)
    return time.perf_counter() - start, result


# ----------------------------------------------------------------------------------------------
# A trace of requests
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    prompt_len: int
    output_len: int  # tokens it really generates before it stops
    max_len: int  # prompt + the most tokens it was allowed to generate

    @property
    def final_len(self) -> int:
        return self.prompt_len + self.output_len


def request_trace(num_requests: int = 200, seed: int = 0,
                  max_lens: tuple[int, ...] = (512, 1024, 2048)) -> list[Request]:
    """Seeded request lengths shaped like chat traffic: short prompts, outputs of a few hundred
    tokens, each request capped at one of ``max_lens`` (its maximum length)."""
    rng = random.Random(seed)
    trace = []
    for _ in range(num_requests):
        max_len = rng.choice(max_lens)
        prompt_len = min(max(4, int(rng.lognormvariate(4.5, 0.8))), max_len // 2)  # median ~90
        output_len = min(max(1, int(rng.lognormvariate(5.3, 0.8))), max_len - prompt_len)
        trace.append(Request(prompt_len, output_len, max_len))
    return trace


# ----------------------------------------------------------------------------------------------
# Waste accounting
# ----------------------------------------------------------------------------------------------
# Both allocators serve the same trace on a pool of the same size, first come first served; every
# running request gains one token per step. At every step each slot of the pool is one of:
#
#   used      holds a token's K/V
#   reserved  allocated to a request for a token it will generate later
#   internal  allocated to a request but beyond the length it will ever reach
#             (contiguous: up to its max length; paged: the empty tail of its last block)
#   external  free, but stranded: a request is waiting and no free hole is big enough for it
#   free      free while nobody waits (idle, not waste)
#
# Counts are summed over the steps ("slot-steps"), so a fraction is a time average.

KINDS = ("used", "reserved", "internal", "external")


@dataclass
class WasteReport:
    scheme: str  # "contiguous" or "paged"
    capacity: int  # slots in the pool
    block_size: int | None
    slot_steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    num_steps: int = 0
    max_running: int = 0  # most requests running at once
    # The pool at step ``layout_step`` as runs of (kind, slots): in address order for the
    # contiguous scheme; for paging, each request's blocks side by side (wherever they really are).
    layout: list[tuple[str, int]] = field(default_factory=list)
    layout_step: int = 0
    counted_by: str = ""  # what produced the numbers, when not this module's model

    @property
    def allocated(self) -> int:
        return sum(self.slot_steps.values())

    def fraction(self, kind: str) -> float:
        return self.slot_steps[kind] / self.allocated if self.allocated else 0.0

    @property
    def waste_fraction(self) -> float:
        """Everything that is not a token's K/V, over the memory the scheme ties up."""
        return 1.0 - self.fraction("used")

    def summary(self) -> str:
        parts = ", ".join(f"{k} {100 * self.fraction(k):.1f}%" for k in KINDS)
        return f"{self.scheme}: waste {100 * self.waste_fraction:.1f}% ({parts})"


def _merge_layout(cells: list[str]) -> list[tuple[str, int]]:
    runs: list[tuple[str, int]] = []
    for kind in cells:
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1] + 1)
        else:
            runs.append((kind, 1))
    return runs


def contiguous_waste(trace: list[Request], capacity: int,
                     layout_step: int | None = None) -> WasteReport:
    """Each request reserves ``max_len`` contiguous slots (first fit) for its whole life."""
    if any(r.max_len > capacity for r in trace):
        raise ValueError(f"a request's max length is larger than the pool ({capacity} slots)")
    report = WasteReport("contiguous", capacity, None)
    if layout_step is None:
        layout_step = _steady_step(trace)
    waiting = list(trace)
    running: dict[int, list] = {}  # start slot -> [request, tokens so far]
    step = 0
    while waiting or running:
        # Admit in order while the head of the queue finds a hole (first fit).
        while waiting:
            start = _first_fit(running, capacity, waiting[0].max_len)
            if start is None:
                break
            request = waiting.pop(0)
            running[start] = [request, request.prompt_len + 1]  # prompt + its first new token
        _count_contiguous(report, running, capacity, blocked=bool(waiting), step=step,
                          record_layout=(step == layout_step))
        report.max_running = max(report.max_running, len(running))
        for start in list(running):  # one token each; finished requests give back their slots
            entry = running[start]
            if entry[1] == entry[0].final_len:
                del running[start]
            else:
                entry[1] += 1
        step += 1
    report.num_steps = step
    return report


def _first_fit(running: dict[int, list], capacity: int, size: int) -> int | None:
    cursor = 0
    for start in sorted(running):
        if start - cursor >= size:
            return cursor
        cursor = start + running[start][0].max_len
    return cursor if capacity - cursor >= size else None


def _count_contiguous(report, running, capacity, blocked, step, record_layout):
    cells = ["external" if blocked else "free"] * capacity if record_layout else None
    allocated = 0
    for start, (request, num_tokens) in running.items():
        counts = {"used": num_tokens, "reserved": request.final_len - num_tokens,
                  "internal": request.max_len - request.final_len}
        for kind, n in counts.items():
            report.slot_steps[kind] += n
        allocated += request.max_len
        if record_layout:
            pos = start
            for kind, n in counts.items():
                cells[pos:pos + n] = [kind] * n
                pos += n
    if blocked:
        report.slot_steps["external"] += capacity - allocated
    if record_layout:
        report.layout, report.layout_step = _merge_layout(cells), step


def _steady_step(trace: list[Request]) -> int:
    """A step in the busy middle of the run, for the memory-map picture."""
    mean_output = sum(r.output_len for r in trace) / len(trace)
    return int(mean_output)


def paged_waste(trace: list[Request], capacity: int, block_size: int = 16,
                layout_step: int | None = None) -> WasteReport:
    """Blocks of ``block_size`` slots handed out one at a time, as a sequence grows.

    A request is admitted when its prompt's blocks are free; when a running request needs a new
    block and none is free, the latest-admitted request is preempted (its blocks freed, back to
    the front of the queue, recomputed later), as minipaged's scheduler does.
    """
    num_blocks = capacity // block_size
    if any(r.final_len > num_blocks * block_size for r in trace):
        raise ValueError(f"a request is longer than the whole pool ({capacity} slots)")
    report = WasteReport("paged", num_blocks * block_size, block_size)
    if layout_step is None:
        layout_step = _steady_step(trace)
    waiting = list(trace)
    running: list[list] = []  # [request, tokens so far], in admission order
    free_blocks = num_blocks
    step = 0
    while waiting or running:
        while waiting and math.ceil((waiting[0].prompt_len + 1) / block_size) <= free_blocks:
            request = waiting.pop(0)
            running.append([request, request.prompt_len + 1])
            free_blocks -= math.ceil(running[-1][1] / block_size)
        cells: list[str] = []
        for _, num_tokens in running:
            tail = math.ceil(num_tokens / block_size) * block_size - num_tokens
            report.slot_steps["used"] += num_tokens
            report.slot_steps["internal"] += tail
            if step == layout_step:
                cells += ["used"] * num_tokens + ["internal"] * tail
        if step == layout_step:
            cells += ["free"] * (num_blocks * block_size - len(cells))
            report.layout, report.layout_step = _merge_layout(cells), step
        report.max_running = max(report.max_running, len(running))
        # Grow: every request that continues writes one more token, maybe into a new block.
        still = []
        for entry in running:
            request, num_tokens = entry
            if num_tokens == request.final_len:
                free_blocks += math.ceil(num_tokens / block_size)
            else:
                still.append(entry)
        running = still
        i = 0
        while i < len(running):
            entry = running[i]
            if entry[1] % block_size == 0:  # the next token opens a new block
                if free_blocks == 0:
                    # The latest admitted goes back to the queue; its tokens so far become its
                    # prompt when it is readmitted (preemption by recompute).
                    (request, num_tokens) = running.pop()
                    free_blocks += math.ceil(num_tokens / block_size)
                    waiting.insert(0, Request(num_tokens, request.final_len - num_tokens,
                                              request.max_len))
                    continue
                free_blocks -= 1
            entry[1] += 1
            i += 1
        step += 1
    report.num_steps = step
    return report
