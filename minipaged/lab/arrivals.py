"""Replaying an arrival trace through the engine: continuous against static batching (lesson 09).

Requests arrive at given engine steps. With **continuous** (iteration-level) batching, each one is
handed to the engine as soon as it arrives, and joins the running batch at the next step. With
**static** batching, requests are gathered into batches of ``static_batch`` and a batch starts
only when the previous one has completely finished, as a server that batches whole requests does.
(Kinder to static batching than the real thing: here a finished request still leaves the batch at
once, instead of idling as padding until the longest one ends.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from minipaged.sampling_params import SamplingParams


@dataclass(frozen=True)
class TimedRequest:
    arrival_step: int  # the request arrives just before this engine step (1 = the first)
    prompt: str
    max_tokens: int


@dataclass
class Replay:
    snapshots: list = field(default_factory=list)  # the engine's StepSnapshot per step
    arrivals: dict[str, int] = field(default_factory=dict)  # request id -> arrival step
    arrival_time: dict[str, float] = field(default_factory=dict)  # seconds since the start
    finish_time: dict[str, float] = field(default_factory=dict)
    num_generated: int = 0
    seconds: float = 0.0

    @property
    def throughput(self) -> float:
        """Generated tokens per second of wall time."""
        return self.num_generated / self.seconds

    @property
    def mean_latency(self) -> float:
        """Seconds from a request's arrival to its last token, averaged over the requests."""
        return sum(self.finish_time[r] - self.arrival_time[r] for r in self.finish_time) \
            / len(self.finish_time)

    def blocks_in_use(self) -> list[tuple[int, int]]:
        """(engine step, GPU blocks in use after it)."""
        return [(s.step, s.scheduler["num_gpu_blocks"] - s.scheduler["num_free_gpu_blocks"])
                for s in self.snapshots]


def replay(engine, requests: list[TimedRequest], static_batch: int | None = None) -> Replay:
    """Run ``requests`` through ``engine`` (an idle ``LLMEngine``); None: continuous batching."""
    result = Replay()
    engine.add_observer(result.snapshots.append)
    first_step = engine.stats.num_steps + 1
    pending = sorted(enumerate(requests), key=lambda ir: ir[1].arrival_step)
    queue: list[tuple[str, TimedRequest]] = []  # arrived, not yet given to the engine
    start = time.perf_counter()
    try:
        while pending or queue or engine.has_unfinished_requests():
            step = engine.stats.num_steps + 1 - first_step + 1  # 1-based step of this replay
            while pending and pending[0][1].arrival_step <= step:
                i, request = pending.pop(0)
                queue.append((str(i), request))
                result.arrivals[str(i)] = engine.stats.num_steps + 1
                result.arrival_time[str(i)] = time.perf_counter() - start
            if static_batch is None or not engine.has_unfinished_requests():
                take = len(queue) if static_batch is None else static_batch
                for request_id, request in queue[:take]:
                    engine.add_request(request_id, request.prompt, SamplingParams(
                        temperature=0, max_tokens=request.max_tokens, ignore_eos=True))
                del queue[:take]
            for out in engine.step():
                if out.finished:
                    result.finish_time[out.request_id] = time.perf_counter() - start
                    result.num_generated += len(out.outputs[0].token_ids)
    finally:
        engine.remove_observer(result.snapshots.append)
    result.seconds = time.perf_counter() - start
    return result
