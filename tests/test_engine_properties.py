"""Whole workloads drawn at random: every accepted request finishes, with the tokens it gets alone.

Hypothesis draws an engine (model, block size, pool from just big enough to roomy, watermark,
swap space, preemption mode, step budget, max_num_seqs, prefix caching on or off) and a workload
(prompt lengths up to near max_model_len, often starting with a shared system prompt, max_tokens,
greedy / seeded sampling with n and best_of / beam search, EOS on or off, requests arriving at
different steps, aborts at random steps). Invariants:

- a request is refused up front (ValueError) only if it could never fit the pool alone;
- every accepted request finishes: length or stop, or abort where the test aborted it; the
  engine never aborts one itself (its stall breaker is a last resort that must not fire);
- greedy, beam and seeded outputs equal the same request run alone on a large pool;
- afterwards every GPU and CPU block is free, with all ref counts zero (with prefix caching:
  free or cached-evictable, and after every step the cache's own invariants hold);
- the number of steps is bounded.

The examples are derandomized: CI draws the same workloads every run.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minipaged import LLMEngine, SamplingParams
from prefix_cache_invariants import check_prefix_cache
from tiny_models import VOCAB

pytestmark = pytest.mark.lesson04

NUM_EXAMPLES = int(os.environ.get("MINIPAGED_ENGINE_EXAMPLES", 300))
# Greedy and beam outputs are compared up to the first step whose reference top-2 logprobs are
# this close: there float32 noise between batch shapes may legitimately pick either token.
NEAR_TIE = 1e-4


@pytest.fixture(scope="module")
def models(tiny_llama, tiny_gpt2):
    return {"llama": tiny_llama[0], "gpt2": tiny_gpt2[0]}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls: a second thread only adds synchronisation."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@st.composite
def engines(draw):
    block_size = draw(st.sampled_from([8, 16, 32]))
    max_model_len = draw(st.sampled_from([24, 40]))
    watermark = draw(st.sampled_from([0.0, 0.0, 0.1]))
    need = math.ceil(max_model_len / block_size)
    smallest = need  # the smallest pool whose usable part holds one max_model_len sequence
    while smallest - int(watermark * smallest) < need:
        smallest += 1
    # Mostly tight pools, where requests must take turns and preemption happens.
    num_gpu_blocks = smallest + draw(st.sampled_from([0, 0, 0, 1, 2, need]))
    return dict(
        kind=draw(st.sampled_from(["llama", "gpt2"])),
        block_size=block_size,
        max_model_len=max_model_len,
        watermark=watermark,
        num_gpu_blocks=num_gpu_blocks,
        num_cpu_blocks=draw(st.sampled_from([0, 2, 64])),
        preemption_mode=draw(st.sampled_from([None, "recompute", "swap"])),
        **draw(st.sampled_from([
            # whole prompts in one step: the budget must hold max_model_len tokens
            dict(enable_chunked_prefill=False, max_num_batched_tokens=None),
            dict(enable_chunked_prefill=False, max_num_batched_tokens=max_model_len),
            # chunked prefill: any budget, down to one token per step
            dict(enable_chunked_prefill=True, max_num_batched_tokens=None),
            dict(enable_chunked_prefill=True, max_num_batched_tokens=1),
            dict(enable_chunked_prefill=True, max_num_batched_tokens=5),
            dict(enable_chunked_prefill=True, max_num_batched_tokens=max_model_len // 2),
        ])),
        max_num_seqs=draw(st.sampled_from([3, 8, 256])),
        enable_prefix_caching=draw(st.sampled_from([True, True, False])),
    )


@st.composite
def requests(draw, max_model_len: int, system: list[int]):
    prompt_len = draw(st.integers(1, max_model_len - 1))
    prompt = draw(st.lists(st.integers(2, VOCAB - 1), min_size=prompt_len, max_size=prompt_len))
    num_system = draw(st.sampled_from([0, len(system) // 2, len(system), len(system)]))
    prompt[:num_system] = system[:min(num_system, prompt_len)]  # a shared prefix, often
    style = draw(st.sampled_from(["greedy", "greedy", "seeded", "seeded", "beam"]))
    common = dict(max_tokens=draw(st.integers(1, 24)), ignore_eos=draw(st.booleans()))
    if style == "greedy":
        params = SamplingParams(temperature=0.0, n=draw(st.integers(1, 2)), **common)
    elif style == "seeded":
        # NOTE: best_of == n and no top-k, so that output i is sequence i and a float-noise
        # flip of one draw lands on the next token id (see _same_draws).
        params = SamplingParams(temperature=draw(st.sampled_from([0.7, 1.0])),
                                n=draw(st.integers(1, 3)), seed=draw(st.integers(0, 2**32)),
                                **common)
    else:
        params = SamplingParams(use_beam_search=True, temperature=0.0,
                                n=draw(st.integers(2, 3)), **common)
    return dict(prompt=prompt, params=params,
                arrive_at=draw(st.sampled_from([0, 0, 0, 1, 3, 6])),
                abort_at=draw(st.sampled_from([None, None, None, None, 2, 5])))


@st.composite
def workloads(draw):
    engine = draw(engines())
    system = draw(st.lists(st.integers(2, VOCAB - 1), min_size=engine["max_model_len"] - 8,
                           max_size=engine["max_model_len"] - 8))
    reqs = draw(st.lists(requests(engine["max_model_len"], system), min_size=2, max_size=8))
    return engine, reqs


_alone_cache: dict = {}
_alone_engines: dict = {}


def run_alone(models, kind, max_model_len, prompt, params):
    """The request alone on a large pool: its tokens and, per step, its top-2 logprob gap."""
    key = (kind, max_model_len, tuple(prompt), repr(params))
    if key not in _alone_cache:
        engine_key = (kind, max_model_len)
        if engine_key not in _alone_engines:
            _alone_engines[engine_key] = LLMEngine(models[kind], block_size=16,
                                                   num_gpu_blocks=256,
                                                   max_model_len=max_model_len,
                                                   enable_prefix_caching=False)
        engine = _alone_engines[engine_key]
        probe = SamplingParams(**{**_fields(params), "logprobs": 2})
        engine.add_request("alone", None, probe, prompt)
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        _alone_cache[key] = [(o.token_ids, _gaps(o.logprobs, o.token_ids))
                             for o in final.outputs]
    return _alone_cache[key]


def _fields(params: SamplingParams) -> dict:
    names = ["n", "best_of", "temperature", "top_p", "top_k", "use_beam_search", "stop",
             "ignore_eos", "max_tokens", "logprobs", "seed"]
    return {name: getattr(params, name) for name in names}


def _gaps(logprobs, tokens) -> list[float]:
    gaps = []
    for step, token in zip(logprobs, tokens):
        top = sorted(step.values(), reverse=True)
        gaps.append(top[0] - top[1] if len(top) > 1 else math.inf)
    return gaps


def _clear_prefix(tokens, gaps) -> int:
    """How many tokens of a greedy/beam reference lie before its first near-tie."""
    for i, gap in enumerate(gaps):
        if gap < NEAR_TIE:
            return i + 1  # the tied token itself may differ; everything before must match
    return len(tokens)


def _same_draws(got: list[int], ref: list[int]) -> None:
    """The same random numbers drew the same tokens.

    Logits of one row differ in their last bits between batch shapes (float32 matmuls), so a
    uniform number within ~1e-6 of a cumulative-probability boundary may pick the neighbouring
    token id instead. That is the only difference allowed, and the sequences part there.
    """
    assert len(got) == len(ref) or got[:len(ref)] != ref[:len(got)], (got, ref)
    for k, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            assert abs(a - b) == 1, f"token {k} differs: {got} vs {ref}"
            return
    assert got == ref


@settings(max_examples=NUM_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_every_accepted_request_finishes_with_the_tokens_it_gets_alone(models, workload):
    cfg, reqs = workload
    engine = LLMEngine(models[cfg["kind"]], **{k: v for k, v in cfg.items() if k != "kind"})
    bm = engine.block_manager
    accepted: dict[str, dict] = {}
    finals: dict[str, object] = {}
    pending = sorted(enumerate(reqs), key=lambda item: item[1]["arrive_at"])
    step = 0
    budget = cfg["max_num_batched_tokens"] or cfg["max_model_len"]
    bound = 50 + 4 * sum(math.ceil(len(r["prompt"]) / min(budget, len(r["prompt"])))
                         * r["params"].best_of + len(r["prompt"]) + r["params"].max_tokens
                         for r in reqs)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1]["arrive_at"] <= step:
            i, req = pending.pop(0)
            try:
                engine.add_request(str(i), None, req["params"], req["prompt"])
                accepted[str(i)] = req
            except ValueError as err:
                # Refused only when it could never run alone, and told with numbers.
                sched = engine.scheduler_config
                if str(err).startswith("best_of"):
                    limit = sched.max_num_seqs if sched.enable_chunked_prefill else min(
                        sched.max_num_seqs, sched.max_num_batched_tokens)
                    assert req["params"].best_of > limit
                else:
                    assert "can never fit" in str(err), err
                    need = engine.max_blocks_needed(len(req["prompt"]), req["params"])
                    assert need > bm.num_total_gpu_blocks - bm.watermark_blocks
        for request_id, req in accepted.items():
            if req["abort_at"] == step and request_id not in finals:
                out = engine.abort_request(request_id)
                if out is not None:
                    finals[request_id] = out
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if bm.prefix_cache is not None:
            check_prefix_cache(bm)
        step += 1
        assert step <= bound, "the engine made no progress"

    assert engine.stats.num_aborted_by_engine == 0
    stats = engine.stats
    event(f"preempted: recompute {stats.num_preemptions_recompute > 0}, "
          f"swap {stats.num_preemptions_swap > 0}")
    event(f"chunked prefill {cfg['enable_chunked_prefill']}")
    multi = [r for r in accepted.values() if r["params"].best_of > 1]
    if multi and stats.num_preemptions_recompute:
        event("a group of several sequences in an engine that recomputed")
    if stats.num_cached_prompt_tokens:
        event("prompt tokens taken from the prefix cache")
    if stats.num_evicted_blocks:
        event("cached blocks evicted")
    assert set(finals) == set(accepted)
    for request_id, req in accepted.items():
        out = finals[request_id]
        assert out.finished and out.error is None
        params = req["params"]
        reasons = {o.finish_reason for o in out.outputs}
        if any(r == "abort" for r in reasons):
            assert req["abort_at"] is not None
            continue
        assert reasons <= {"length", "stop"}
        alone = run_alone(models, cfg["kind"], cfg["max_model_len"], req["prompt"], params)
        for got, (ref_tokens, gaps) in zip(out.outputs, alone):
            if params.temperature == 0.0:  # greedy and beam: exact up to a near-tie
                upto = _clear_prefix(ref_tokens, gaps)
                if params.use_beam_search and upto < len(ref_tokens):
                    continue  # a tie among beams reorders them: nothing more to compare
                assert got.token_ids[:upto] == ref_tokens[:upto]
                if upto == len(ref_tokens):
                    assert got.token_ids == ref_tokens
            else:  # seeded sampling: one draw per sequence per step, whatever the batch
                _same_draws(got.token_ids, ref_tokens)

    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    assert not bm.block_tables
    assert all(b.ref_count == 0 for b in bm.gpu_allocator.blocks + bm.cpu_allocator.blocks)
