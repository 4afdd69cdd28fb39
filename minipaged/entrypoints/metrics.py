"""``GET /metrics``: the engine's queues, KV blocks and counters as Prometheus text (lesson 13).

The numbers are the ones ``AsyncLLMEngine`` republishes after every step, so reading them never
touches the engine from the HTTP thread.
"""
from __future__ import annotations

_GAUGES = [
    ("num_requests_running", "Requests in the running queue."),
    ("num_requests_waiting", "Requests waiting for their prompt to be scheduled."),
    ("num_requests_swapped", "Requests whose KV blocks were swapped out to the CPU pool."),
    ("gpu_blocks_used", "KV cache blocks in use in the GPU pool."),
    ("gpu_blocks_total", "KV cache blocks in the GPU pool."),
    ("cpu_blocks_used", "KV cache blocks in use in the CPU swap pool."),
    ("cpu_blocks_total", "KV cache blocks in the CPU swap pool."),
    ("spec_acceptance_rate", "Speculative decoding: accepted / proposed draft tokens."),
    ("spec_mean_accepted_length", "Speculative decoding: tokens emitted per verification."),
]
_COUNTERS = [
    ("prompt_tokens", "Prompt tokens computed (again after a preemption by recompute)."),
    ("generation_tokens", "Tokens generated (sampled), every sequence of best_of and every "
                          "beam counted."),
    ("num_steps", "Engine steps run."),
    ("spec_proposed_tokens", "Speculative decoding: draft tokens proposed."),
    ("spec_accepted_tokens", "Speculative decoding: draft tokens accepted."),
    ("spec_emitted_tokens", "Speculative decoding: tokens emitted by verifications."),
]


def prometheus_text(async_engine) -> str:
    """The Prometheus text exposition of ``async_engine.metrics`` and its health.

    Args:
        async_engine: an ``AsyncLLMEngine`` (or anything with its ``metrics``, ``error`` and
            ``is_running``).
    """
    m = async_engine.metrics
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP minipaged_{name} {help_text}", f"# TYPE minipaged_{name} {kind}"])
        lines.extend(f"minipaged_{name}{labels} {value}" for labels, value in samples)

    for key, help_text in _GAUGES:
        metric(key, "gauge", help_text, [("", m[key])])
    for key, help_text in _COUNTERS:
        metric(f"{key}_total", "counter", help_text, [("", m[key])])
    metric("preemptions_total", "counter", "Requests preempted to free KV blocks.",
           [('{mode="recompute"}', m["preemptions_recompute"]),
            ('{mode="swap"}', m["preemptions_swap"])])
    metric("requests_finished_total", "counter", "Requests finished, by finish reason.",
           [(f'{{finish_reason="{k}"}}', v) for k, v in sorted(m["requests_finished"].items())])
    metric("engine_healthy", "gauge", "1 while the engine loop runs, 0 once it has died.",
           [("", int(async_engine.error is None and async_engine.is_running))])
    return "\n".join(lines) + "\n"
