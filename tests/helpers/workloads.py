"""Whole workloads run through an engine, for the properties that compare two engines on the
same random requests (the sliding window's and the KV cache groups')."""
from minipaged import SamplingParams


def run_to_end(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Add one request per prompt (ids "0", "1", ...), step until all finish; their final
    ``RequestOutput``s in the prompts' order."""
    try:
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), None, p, prompt_token_ids=prompt)
    except ValueError:
        # a refused request: take back the ones added before it, so that the engine (shared
        # by a property's examples) holds no request "0" when the next workload comes
        for j in range(i):
            engine.abort_request(str(j))
        raise
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return [outs[str(i)] for i in range(len(prompts))]


def fitted(engine, prompt: list[int], params: SamplingParams) -> SamplingParams:
    """``params`` with ``max_tokens`` lowered until the request fits the engine's KV pool
    (``validation.max_blocks_needed``): a random workload's n = 2 request with a long prompt
    may otherwise need more blocks than a small pool has, and the engine refuses it."""
    from dataclasses import replace

    from minipaged.validation import max_blocks_needed

    room = engine.limits.num_gpu_blocks - engine.limits.watermark_blocks
    while params.max_tokens > 1 and max_blocks_needed(len(prompt), params, engine.limits) > room:
        params = replace(params, max_tokens=params.max_tokens - 1)
    return params


def params_of_kind(kind: str, seed: int, max_tokens: int) -> SamplingParams:
    """A request of one kind: "greedy" (with logprobs); "sampled", n = 2 seeded sampling (the
    prompt's blocks shared, copy-on-write); "beam", beam search of width 2 (forks)."""
    if kind == "sampled":
        return SamplingParams(n=2, temperature=0.8, seed=seed, max_tokens=max_tokens,
                              ignore_eos=True, logprobs=2)
    if kind == "beam":
        return SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=max_tokens,
                              ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def request_kinds():
    """The Hypothesis strategy of ``params_of_kind``'s kinds."""
    from hypothesis import strategies as st

    return st.sampled_from(["greedy", "sampled", "beam"])
