"""Whole workloads run through an engine, for the properties that compare two engines on the
same random requests (the sliding window's and the KV cache groups')."""
from minipaged import SamplingParams


def run_to_end(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Add one request per prompt (ids "0", "1", ...), step until all finish; their final
    ``RequestOutput``s in the prompts' order."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), None, p, prompt_token_ids=prompt)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    return [outs[str(i)] for i in range(len(prompts))]


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
