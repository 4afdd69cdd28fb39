"""Whole workloads drawn at random: every accepted request finishes, with the tokens it gets alone.

Hypothesis draws an engine (model, block size, pool from just big enough to large, watermark,
swap space from none up, preemption mode, chunked prefill on or off with budgets from 1 token a
step, max_num_seqs, prefix caching on or off) and a workload (prompt lengths up to near
max_model_len, often starting with a shared system prompt, max_tokens, greedy / seeded / unseeded
sampling with n and best_of > n, top-p and top-k, penalties, beam search, logprobs, stop strings,
EOS on or off, requests arriving at different steps and out of order, aborts at random steps).
The workloads are sized so that most examples preempt: by recompute and by swap, groups of
several sequences and single ones. Invariants:

- a request is refused up front (ValueError) only if it could never fit the pool alone;
- every accepted request finishes: length or stop, or abort where the test aborted it; the
  engine never aborts one itself (its stall breaker is a last resort that must not fire);
- greedy, beam and seeded (and unseeded: same request id, same engine seed) outputs are
  identical to the same request run alone on a large pool: tokens, text, finish reason and
  logprobs. One difference only is allowed: float32 results differ in their last bits between
  batch shapes (a 1-token chunk against a whole prompt, 1 row against 20), so where the lone run's
  own choice was within that noise of another one (a near-tie, a uniform number next to the edge
  of its token's slice of the distribution, a top-k/top-p cut at its threshold) the engine may
  take that other token, and the two part there (see ``Reference``). In practice none does: the
  report counts the outputs that parted. (This replaces an older rule that let any sampled token
  differ by +-1 anywhere and stopped comparing there, which would also pass a sampler bug.)
- afterwards every GPU and CPU block is free, with all ref counts zero (with prefix caching:
  free or cached-evictable, and after every step the cache's own invariants hold);
- the number of steps is bounded.

The examples are derandomized: CI draws the same workloads every run. ``pytest -s`` prints how
many examples exercised what (preemptions by mode, groups, chunked prefill, ...).

Slow: ~310 s on the 2-core machine (300 workloads, measured at load ~12).
"""
from __future__ import annotations

import collections
import math
import os
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from budgets import examples
from letters_tokenizer import LETTERS, save_letters_tokenizer
from minipaged import LLMEngine, SamplingParams
from minipaged.validation import max_blocks_needed
from minipaged.worker import sampler as sampler_module
from prefix_cache_invariants import check_prefix_cache
from tiny_models import VOCAB

pytestmark = [pytest.mark.lesson04, pytest.mark.slow]

NUM_EXAMPLES = examples(int(os.environ.get("MINIPAGED_ENGINE_EXAMPLES", 300)))
# Float32 noise between batch shapes (a chunk of 1 token against a whole prompt, 1 row against
# 20) moves a logprob by up to ~2e-5 here. Where the lone run's choice was closer than this to
# another one, the engine under test may legitimately make that other choice; that is the only
# difference allowed, and the comparison of that sequence ends there.
NEAR = 1e-4

# What the examples exercised, printed at the end of the module (pytest -s).
EXERCISED: collections.Counter = collections.Counter()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The letters tokenizer (tests/helpers/letters_tokenizer.py): random tokens often spell a
    stop string."""
    return save_letters_tokenizer(tmp_path_factory.mktemp("letters_tokenizer"))


@pytest.fixture(scope="module")
def models(tiny_llama, tiny_gpt2):
    return {"llama": tiny_llama[0], "gpt2": tiny_gpt2[0]}


@pytest.fixture(scope="module", autouse=True)
def one_thread_and_a_report():
    """Tiny matmuls: a second thread only adds synchronisation. At the end, the distribution."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    yield
    torch.set_num_threads(before)
    examples = EXERCISED["examples"]
    if examples:
        print(f"\nengine property test: {examples} examples in "
              f"{time.perf_counter() - start:.1f} s")
        for name, count in sorted(EXERCISED.items()):
            print(f"  {name:<58} {count:>5}  ({100 * count / examples:5.1f} % of examples)"
                  if not name.startswith("#") else f"  {name:<58} {count:>5}")


# -- strategies ----------------------------------------------------------------------------------
def blocks_needed(prompt_len: int, params: SamplingParams, block_size: int,
                  max_model_len: int) -> int:
    """The most blocks a request holds at once (its sequences share their prompt's full
    blocks); the engine refuses a request that needs more than the pool less the watermark."""
    total = min(prompt_len + params.max_tokens, max_model_len)
    shared = prompt_len // block_size if params.best_of > 1 else 0
    return shared + params.best_of * math.ceil((total - shared * block_size) / block_size)


def pool_holding(blocks: int, watermark: float) -> int:
    """The smallest pool whose part above the watermark holds ``blocks`` blocks."""
    pool = blocks
    while pool - int(watermark * pool) < blocks:
        pool += 1
    return pool


@st.composite
def engines(draw, pressure: bool):
    """An engine; under ``pressure`` one whose requests can run side by side (a budget of some
    tokens, many sequences at once), so that they outgrow a tight pool together."""
    block_size = draw(st.sampled_from([8, 16, 32]))
    # (at least 2 blocks, so that a sequence grows into a new block while it runs)
    max_model_len = draw(st.sampled_from([48, 64, 96] if block_size < 32 else [64, 96]))
    chunked = draw(st.sampled_from([True, True, False]))
    if chunked and pressure:
        budget = draw(st.sampled_from([None, 16, 8, 24, 5]))
    elif chunked:  # any budget, down to one token a step
        # NOTE: decodes take the budget first, so below a few tokens requests mostly run one
        # after another.
        budget = draw(st.sampled_from([1, None, 2, 3, 8]))
    else:  # a prompt runs whole in one step: the budget must hold max_model_len tokens
        budget = draw(st.sampled_from([None, max_model_len, max_model_len + 7]))
    return dict(
        kind=draw(st.sampled_from(["llama", "gpt2"])),
        block_size=block_size,
        max_model_len=max_model_len,
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.25])),
        # Swap space from none (every preemption recomputes) to plenty.
        num_cpu_blocks=draw(st.sampled_from([64, 0, 8, 64, 2, 4, 1])),
        preemption_mode=draw(st.sampled_from([None, "swap", "recompute"])),
        enable_chunked_prefill=chunked,
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.sampled_from([256, 8] if pressure else [256, 4, 3, 2])),
        enable_prefix_caching=draw(st.sampled_from([True, True, False])),
    )


@st.composite
def sampling_params(draw, max_model_len: int, width: int, pressure: bool):
    """``width``: the most sequences a request of this workload runs (best_of, beam width)."""
    style = draw(st.sampled_from(["seeded", "greedy", "seeded", "beam", "seeded", "greedy"]))
    # Under pressure, long outputs: sequences grow while they run, and the pool runs out.
    long = st.integers(max_model_len // 2, max_model_len)
    common = dict(max_tokens=draw(long if pressure else st.integers(1, max_model_len)),
                  ignore_eos=draw(st.sampled_from([True, True, True, False])),
                  logprobs=draw(st.sampled_from([None, None, 0, 1, 3])))
    stop = draw(st.sampled_from([None, None, None, "one", "two"]))
    if stop == "one":  # random text (~3 letters a token) holds one now and then
        common["stop"] = draw(st.text(LETTERS, min_size=3, max_size=4))
    elif stop == "two":
        common["stop"] = draw(st.lists(st.text(LETTERS, min_size=2, max_size=4), min_size=2,
                                       max_size=2))
    if style == "beam" and width > 1:
        beams = draw(st.integers(2, min(width, 3)))
        return SamplingParams(use_beam_search=True, temperature=0.0,
                              n=draw(st.integers(1, beams)), best_of=beams, **common)
    n = draw(st.integers(1, min(width, 3)))
    best_of = draw(st.integers(n, width))
    if style == "greedy":
        return SamplingParams(temperature=0.0, n=n, best_of=best_of, **common)
    return SamplingParams(
        n=n, best_of=best_of, temperature=draw(st.sampled_from([0.7, 1.0, 1.3])),
        top_p=draw(st.sampled_from([1.0, 1.0, 0.9, 0.5])),
        top_k=draw(st.sampled_from([-1, -1, 1, 5, 40])),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 0.0, 0.5])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, 0.0, -0.3])),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))), **common)


@st.composite
def requests(draw, max_model_len: int, system: list[int], width: int, pressure: bool):
    # Under pressure, short prompts that all arrive at once: they are admitted together, then
    # grow. Otherwise prompts up to near max_model_len, arriving over several steps.
    short = st.integers(1, 10)
    prompt_len = draw(short if pressure else st.one_of(short, st.integers(1, max_model_len - 1)))
    prompt = draw(st.lists(st.integers(2, VOCAB - 1), min_size=prompt_len, max_size=prompt_len))
    num_system = draw(st.sampled_from([0, 0, len(system) // 2, len(system)]))
    prompt[:num_system] = system[:min(num_system, prompt_len)]  # a shared prefix, often
    return dict(prompt=prompt, params=draw(sampling_params(max_model_len, width, pressure)),
                arrive_at=draw(st.sampled_from([0, 0, 1] if pressure else [0, 1, 3, 6, 12])),
                # An explicit arrival time puts a request before those that came earlier.
                arrival_time=draw(st.sampled_from([None, None, None, 1.0, 2.0, 3.0])),
                abort_at=draw(st.sampled_from([None] * (30 if pressure else 10)
                                              + [0, 2, 5, 9, 17, 30])))


@st.composite
def workloads(draw):
    # Two examples in three put the pool under pressure: most of those preempt.
    pressure = draw(st.sampled_from([True, True, False]))
    engine = draw(engines(pressure))
    max_model_len, block_size = engine["max_model_len"], engine["block_size"]
    system = draw(st.lists(st.integers(2, VOCAB - 1), min_size=max_model_len // 2,
                           max_size=max_model_len // 2))
    # Requests of one workload are alike in width, so that several fit the pool at once.
    width = draw(st.sampled_from([1, 2, 3, 5]))
    reqs = draw(st.lists(requests(max_model_len, system, width, pressure), min_size=3,
                         max_size=8))
    smallest = pool_holding(math.ceil(max_model_len / block_size), engine["watermark"])
    largest = max(blocks_needed(len(r["prompt"]), r["params"], block_size, max_model_len)
                  for r in reqs)
    demand = sum(blocks_needed(len(r["prompt"]), r["params"], block_size, max_model_len)
                 for r in reqs)
    fits_each = max(smallest, pool_holding(largest, engine["watermark"]))
    # (A group's sequences share their prompt's blocks until they first write.)
    first_prompts = sum(math.ceil(len(r["prompt"]) / block_size) for r in reqs
                        if r["arrive_at"] == 0)
    # The pool, from just big enough to large:
    #   fits one    holds one max_model_len sequence (larger requests are refused);
    #   fits each   every request fits alone, but they do not fit together;
    #   admits all  the prompts that arrive first are admitted together, then outgrow it;
    #   a half      half of what all requests would hold at their longest;
    #   large       all of it twice.
    fit = draw(st.sampled_from(["admits all", "fits each"] if pressure else
                               ["fits each", "fits one", "a half", "large"]))
    pool = {"fits one": smallest, "fits each": fits_each,
            "admits all": max(fits_each, pool_holding(first_prompts, engine["watermark"])),
            "a half": max(fits_each, demand // 2),
            "large": max(fits_each, 2 * demand)}[fit]
    engine["num_gpu_blocks"] = pool + draw(st.sampled_from([0, 0, 0, 1, 2]))
    engine["pool"] = f"{fit}{', under pressure' if pressure else ''}"  # (for the report)
    return engine, reqs


# -- the reference: each request alone on a large pool --------------------------------------------
ANY = -1  # a close choice after which any token may follow (a top-k / top-p cut that was close)


@dataclass
class Reference:
    """A request's sequences when it runs alone on a large pool, in sequence order (ranked, for
    beam search), and for each of their tokens the choice that float32 noise could have made
    instead, if there was one: ``close[i][k]`` is None, or the other token (``ANY``: any).

    Close are: a greedy choice whose runner-up logprob is within ``NEAR`` (the runner-up may be
    chosen); a random draw whose uniform number lies within ``NEAR`` of an edge of the chosen
    token's slice of the cumulative distribution (the token across that edge); a top-k or top-p
    cut within ``NEAR`` of its threshold (any token: the distribution itself changes). For beam
    search, ``beams_close`` says whether any choice of surviving candidates was close.
    """

    tokens: list[list[int]]
    texts: list[str]
    logprobs: list[list[dict[int, float]]]
    cumulative: list[float]
    reasons: list[str]
    close: list[list[int | None]]
    beams_close: bool = False
    greedy: bool = False

    def any_close(self) -> bool:
        return self.beams_close or any(c is not None for seq in self.close for c in seq)


_alone_engines: dict = {}
_alone_cache: dict = {}


class _DrawProbe:
    """Records, during a lone run, which random draws, top-k/top-p cuts and beam choices were
    close (see ``Reference``), by wrapping the sampler's functions."""

    def __init__(self, generator_index: dict[int, int], close: list[list[int | None]]):
        self.generator_index = generator_index
        self.close = close
        self.beams_close = False
        self.cut_close = False
        self.filter, self.draw = sampler_module.top_k_top_p_filter, sampler_module.draw
        self.beam_search = sampler_module.Sampler._beam_search

    def __enter__(self):
        sampler_module.top_k_top_p_filter = self.probe_filter
        sampler_module.draw = self.probe_draw
        sampler_module.Sampler._beam_search = staticmethod(self.probe_beam_search)
        return self

    def __exit__(self, *exc):
        sampler_module.top_k_top_p_filter, sampler_module.draw = self.filter, self.draw
        sampler_module.Sampler._beam_search = staticmethod(self.beam_search)

    def probe_filter(self, logits, top_k, top_p):
        margin = math.inf
        if top_k != -1 and top_k < logits.shape[-1]:
            values = torch.topk(logits, top_k + 1).values
            margin = float(values[top_k - 1] - values[top_k])
        if top_p < 1.0:
            after_k = self.filter(logits, top_k, 1.0)
            probs = torch.softmax(torch.sort(after_k, descending=True).values, dim=-1)
            before = (torch.cumsum(probs, dim=-1) - probs).tolist()  # mass ahead of each token
            # The first token dropped (the mass ahead of it reaches top_p) and the last kept.
            cut = next((j for j in range(1, len(before)) if before[j] >= top_p), None)
            if cut is not None:
                margin = min(margin, before[cut] - top_p, top_p - before[cut - 1])
        self.cut_close = margin < NEAR
        return self.filter(logits, top_k, top_p)

    def probe_draw(self, probs, generator):
        state = generator.get_state()
        token = self.draw(probs, generator)
        replay = torch.Generator(device="cpu")
        replay.set_state(state)
        cdf = torch.cumsum(probs.double(), dim=0)
        total = float(cdf[-1])
        u = float(torch.rand((), generator=replay, dtype=torch.float64) * cdf[-1])
        low = float(cdf[token - 1]) if token > 0 else 0.0
        possible = torch.nonzero(probs > 0).flatten().tolist()
        below = [t for t in possible if t < token]
        above = [t for t in possible if t > token]
        other = None  # the token across an edge that u is close to
        if below and (u - low) / total < NEAR:
            other = below[-1]
        elif above and (float(cdf[token]) - u) / total < NEAR:
            other = above[0]
        if self.cut_close:
            other = ANY
        self.close[self.generator_index[id(generator)]].append(other)
        return token

    def probe_beam_search(self, group, rows, logprobs):
        """Close: the last candidate kept and the first dropped score within NEAR."""
        width = sum(len(row.seq_ids) for row in rows)
        if len(rows) == 1 and len(rows[0].seq_ids) > 1:
            scores = logprobs[0]
        else:
            cum = torch.tensor([group.find(r.seq_ids[0]).cumulative_logprob for r in rows],
                               dtype=logprobs.dtype)
            scores = (cum[:, None] + logprobs).flatten()
        top = torch.topk(scores, width + 1).values
        self.beams_close |= float(top[width - 1] - top[width]) < NEAR
        return self.beam_search(group, rows, logprobs)


def run_alone(models, tokenizer, kind, max_model_len, request_id, prompt, params) -> Reference:
    """The request alone on a large pool, all ``best_of`` sequences returned.

    The same request id as in the workload, in an engine of the same seed: a request without a
    seed of its own draws from the same generators too."""
    key = (kind, max_model_len, tuple(prompt), repr(params),
           request_id if params.seed is None else None)
    if key in _alone_cache:
        return _alone_cache[key]
    engine_key = (kind, max_model_len)
    if engine_key not in _alone_engines:
        _alone_engines[engine_key] = LLMEngine(models[kind], tokenizer=tokenizer, block_size=16,
                                               num_gpu_blocks=256, max_model_len=max_model_len,
                                               enable_prefix_caching=False)
    engine = _alone_engines[engine_key]
    # Every sequence (n = best_of: in sequence order, or ranked for beams), with the logprobs
    # that show how close each greedy choice was.
    fields = {name: getattr(params, name) for name in (
        "best_of", "presence_penalty", "frequency_penalty", "temperature", "top_p", "top_k",
        "use_beam_search", "stop", "ignore_eos", "max_tokens", "seed")}
    probe = SamplingParams(**fields, n=params.best_of, logprobs=max(params.logprobs or 0, 2))
    engine.add_request(request_id, None, probe, prompt)
    group = engine._requests[request_id]
    generator_index = {id(engine._generators[s.seq_id]): i for i, s in enumerate(group.seqs)}
    close: list[list[int | None]] = [[] for _ in group.seqs]
    final = None
    with _DrawProbe(generator_index, close) as probe_:
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
    outputs = final.outputs
    if params.temperature == 0:  # greedy and beam: close where the runner-up was near
        close = []
        for o in outputs:
            close.append([])
            for step, token in zip(o.logprobs, o.token_ids):
                ranked = sorted(step.items(), key=lambda kv: kv[1], reverse=True)
                runner_up = next(t for t, _ in ranked if t != token)
                close[-1].append(runner_up if step[token] - step[runner_up] < NEAR else None)
    ref = Reference([o.token_ids for o in outputs], [o.text for o in outputs],
                    [o.logprobs for o in outputs], [o.cumulative_logprob for o in outputs],
                    [o.finish_reason for o in outputs], close, probe_.beams_close,
                    params.temperature == 0)
    _alone_cache[key] = ref
    return ref


def _matches(got, ref: Reference, i: int, asked_logprobs: int | None) -> str | None:
    """Output ``got`` is sequence i of the lone run: identical (tokens, text, finish reason,
    logprobs), or identical up to a token where the lone run's choice was close and ``got``
    took the other choice there; after that the two may differ. Returns None if not, else
    "identical" or how they parted."""
    tokens, close = ref.tokens[i], ref.close[i]
    upto, verdict = len(tokens), "identical"
    for k, (mine, theirs) in enumerate(zip(got.token_ids, tokens)):
        if mine != theirs:
            if ref.beams_close:
                verdict = "after a close choice of beams"
            elif k < len(close) and close[k] == ANY:
                verdict = "at a close top-k/top-p cut"
            elif k < len(close) and close[k] == mine:
                verdict = f"at a close {'greedy choice' if ref.greedy else 'random draw'}"
            else:
                return None
            upto = k  # a legitimate parting: compare no further
            break
    else:
        if got.token_ids != tokens or got.text != ref.texts[i] \
                or got.finish_reason != ref.reasons[i]:
            return None
    if asked_logprobs is None:
        return verdict if got.logprobs is None else None
    for mine, theirs, token in zip(got.logprobs[:upto], ref.logprobs[i][:upto], tokens):
        if token not in mine or not asked_logprobs <= len(mine) <= asked_logprobs + 1:
            return None
        if any(abs(v - theirs[t]) > 1e-3 for t, v in mine.items() if t in theirs):
            return None
    return verdict


def check_against_alone(out, params: SamplingParams, ref: Reference) -> None:
    verdicts = []
    if params.best_of == params.n and not params.use_beam_search:  # output j is sequence j
        for j, got in enumerate(out.outputs):
            verdicts.append(_matches(got, ref, j, params.logprobs))
            assert verdicts[-1], (j, got.token_ids, ref.tokens[j], ref.close[j])
        _count(verdicts)
        return
    # best_of > n, or beams: the n sequences of highest cumulative logprob, among the same
    # best_of (the lone run returned them all, ranked for beams, in order otherwise).
    order = sorted(range(len(ref.tokens)), key=lambda i: ref.cumulative[i], reverse=True)
    ranked = [ref.cumulative[i] for i in order]
    ties = any(abs(a - b) < 1e-2 and ref.tokens[order[k]] != ref.tokens[order[k + 1]]
               for k, (a, b) in enumerate(zip(ranked, ranked[1:])))
    if not ref.any_close() and not ties:
        for j, got in enumerate(out.outputs):
            verdicts.append(_matches(got, ref, order[j], params.logprobs))
            assert verdicts[-1], (j, got.token_ids, ref.tokens)
    else:  # each output is one of the lone run's sequences (which ones may change)
        for got in out.outputs:
            found = [v for i in range(len(ref.tokens))
                     if (v := _matches(got, ref, i, params.logprobs))]
            assert found, (got.token_ids, ref.tokens, ref.close)
            verdicts.append("identical" if "identical" in found else found[0])
    _count(verdicts)


def _count(verdicts: list[str]) -> None:
    for verdict in verdicts:
        EXERCISED["#outputs compared: identical to the lone run" if verdict == "identical"
                  else f"#outputs compared: parted {verdict}"] += 1


# -- the test ------------------------------------------------------------------------------------
def _step_bound(cfg, reqs) -> int:
    """Far more steps than any valid run needs, far fewer than an engine that stopped moving."""
    work = sum(r["params"].best_of * (len(r["prompt"]) + r["params"].max_tokens) for r in reqs)
    return 100 + 10 * work


@settings(max_examples=NUM_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(workload=workloads())
def test_every_accepted_request_finishes_with_the_tokens_it_gets_alone(models, tokenizer_dir,
                                                                       workload):
    cfg, reqs = workload
    engine = LLMEngine(models[cfg["kind"]], tokenizer=tokenizer_dir,
                       **{k: v for k, v in cfg.items() if k not in ("kind", "pool")})
    bm = engine.block_manager
    preempted: list[tuple[str, str]] = []
    bm.add_listener(lambda e: preempted.append((e["request_id"], e["mode"]))
                    if e["op"] == "preempt" else None)
    accepted: dict[str, dict] = {}
    finals: dict[str, object] = {}
    pending = sorted(enumerate(reqs), key=lambda item: item[1]["arrive_at"])
    step = 0
    bound = _step_bound(cfg, reqs)
    aborted_by_test = set()
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1]["arrive_at"] <= step:
            i, req = pending.pop(0)
            try:
                engine.add_request(str(i), None, req["params"], req["prompt"],
                                   arrival_time=req["arrival_time"])
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
                    need = max_blocks_needed(len(req["prompt"]), req["params"], engine.limits)
                    assert need > bm.num_total_gpu_blocks - bm.watermark_blocks
                EXERCISED["#requests refused: best_of above what runs at once"
                          if str(err).startswith("best_of")
                          else "#requests refused: can never fit the pool"] += 1
        for request_id, req in accepted.items():
            if req["abort_at"] == step and request_id not in finals:
                out = engine.abort_request(request_id)
                if out is not None:
                    finals[request_id] = out
                    aborted_by_test.add(request_id)
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if bm.enable_prefix_caching:
            check_prefix_cache(bm)
        step += 1
        assert step <= bound, "the engine made no progress"

    assert engine.stats.num_aborted_by_engine == 0
    _record(engine, cfg, accepted, preempted, aborted_by_test, finals)
    assert set(finals) == set(accepted)
    for request_id, req in accepted.items():
        out = finals[request_id]
        assert out.finished and out.error is None
        params = req["params"]
        reasons = {o.finish_reason for o in out.outputs}
        if request_id in aborted_by_test:
            continue
        assert reasons <= {"length", "stop"}
        ref = run_alone(models, tokenizer_dir, cfg["kind"], cfg["max_model_len"], request_id,
                        req["prompt"], params)
        check_against_alone(out, params, ref)

    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    assert not bm.block_tables
    assert all(b.ref_count == 0 for b in bm.gpu_allocator.blocks + bm.cpu_allocator.blocks)


def _record(engine, cfg, accepted, preempted, aborted_by_test, finals) -> None:
    """Count what this example exercised (hypothesis events, and the module's report)."""
    stats = engine.stats
    multi = {r for r, req in accepted.items() if req["params"].best_of > 1}
    seen = set()
    for request_id, mode in preempted:
        seen.add(f"preempted by {mode}: a group of several sequences" if request_id in multi
                 else f"preempted by {mode}: a single sequence")
    if stats.num_preemptions_recompute or stats.num_preemptions_swap:
        seen.add("preempted (any)")
    if stats.num_preemptions_recompute:
        seen.add("preempted by recompute (any)")
    if stats.num_preemptions_swap:
        seen.add("preempted by swap (any)")
    if stats.num_preemptions_recompute and stats.num_preemptions_swap:
        seen.add("preempted both ways in one example")
    if not preempted:
        seen.add("nothing preempted")
    if cfg["num_cpu_blocks"] == 0 and stats.num_preemptions_recompute:
        seen.add("preempted with no swap space at all")
    params = [req["params"] for req in accepted.values()]
    for label, hit in (
            ("chunked prefill on", cfg["enable_chunked_prefill"]),
            ("chunked prefill, budget < 4 tokens a step",
             cfg["enable_chunked_prefill"] and (cfg["max_num_batched_tokens"] or 99) < 4),
            ("prefix caching on", cfg["enable_prefix_caching"]),
            ("prompt tokens taken from the prefix cache", stats.num_cached_prompt_tokens > 0),
            ("cached blocks evicted", stats.num_evicted_blocks > 0),
            ("blocks copied (copy-on-write)", stats.num_blocks_copied > 0),
            ("a request with best_of > n", any(p.best_of > p.n and not p.use_beam_search
                                               for p in params)),
            ("beam search", any(p.use_beam_search for p in params)),
            ("seeded or unseeded random sampling", any(p.temperature > 0 for p in params)),
            ("top_p < 1 or top_k", any(p.top_p < 1 or p.top_k != -1 for p in params)),
            ("logprobs asked", any(p.logprobs is not None for p in params)),
            ("stop strings", any(p.stop_strings for p in params)),
            ("an output ended by a stop string or EOS",
             any(o.finish_reason == "stop" for r in finals.values() for o in r.outputs)),
            ("a request aborted by the test", bool(aborted_by_test)),
            ("a request with an explicit earlier arrival_time",
             any(req["arrival_time"] is not None for req in accepted.values())),
            ("gpt2", cfg["kind"] == "gpt2"),
            ("llama", cfg["kind"] == "llama"),
            (f"block size {cfg['block_size']}", True),
            (f"pool: {cfg['pool']}", True),
            (f"pool: {cfg['pool']}, preempted", bool(preempted)),
            ("pool just big enough for one max_model_len sequence",
             cfg["num_gpu_blocks"] - int(cfg["watermark"] * cfg["num_gpu_blocks"])
             == math.ceil(cfg["max_model_len"] / cfg["block_size"]))):
        if hit:
            seen.add(label)
    for label in seen:
        event(label)
        EXERCISED[label] += 1
    EXERCISED["examples"] += 1
    EXERCISED["#preemptions by recompute (total)"] += stats.num_preemptions_recompute
    EXERCISED["#preemptions by swap (total)"] += stats.num_preemptions_swap
    EXERCISED["#requests accepted"] += len(accepted)
    EXERCISED["#engine steps"] += stats.num_steps

