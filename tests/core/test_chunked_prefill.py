"""Chunked prefill (lesson 09): a token budget per step that decodes never wait for, and prompts
split across steps, with exactly the tokens of whole-prompt prefill and of transformers.

Slow (left out of `make test`): every test on the module's transformers references, about 300 s
together on the 2-core machine (measured at load ~12, so less when idle); the scheduler-only test
is fast.
"""
from __future__ import annotations

import pytest

from minipaged import LLM, SamplingParams
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.lab.dry_run import apply_step
from minipaged.core.scheduler import Scheduler, SchedulerConfig
from minipaged.sequence import Sequence, SequenceGroup
from tiny_models import greedy_reference, pick_prompts

pytestmark = pytest.mark.lesson09

LENGTHS = [1, 7, 33, 61, 16]
NEW = 12


@pytest.fixture(scope="module")
def cases(tiny_llama, tiny_gpt2):
    out = {}
    for kind, (path, hf) in (("llama", tiny_llama), ("gpt2", tiny_gpt2)):
        prompts = pick_prompts(hf, LENGTHS, NEW, seed=5)
        out[kind] = (path, prompts, [greedy_reference(hf, p, NEW) for p in prompts])
    return out


def _run(path, prompts, **kwargs):
    llm = LLM(path, block_size=8, max_model_len=80, **kwargs)
    snapshots = []
    llm.llm_engine.add_observer(snapshots.append)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs], snapshots


@pytest.mark.slow
@pytest.mark.parametrize("caching", [True, False], ids=["prefix caching", "no caching"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("budget", [1, 7, 32])
def test_chunked_prompts_give_transformers_tokens_for_any_budget(cases, kind, budget, caching):
    path, prompts, refs = cases[kind]
    llm, tokens, snapshots = _run(path, prompts, max_num_batched_tokens=budget,
                                  num_gpu_blocks=128, enable_prefix_caching=caching)
    assert tokens == refs
    engine = llm.llm_engine
    if caching:
        # The same prompts again: their full blocks come from the cache, and the chunks after
        # them attend to cached KV. Still the tokens of transformers.
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        again = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == refs
        assert engine.stats.num_cached_prompt_tokens > 0
    else:
        assert not engine.block_manager.enable_prefix_caching
        assert engine.stats.num_cached_prompt_tokens == 0
    # Prompts longer than the budget were split: more prefill steps than prompts.
    prefill_steps = sum(any(s.prompt_run) for s in snapshots)
    assert prefill_steps >= sum(-(-n // budget) for n in LENGTHS) // len(LENGTHS)
    assert all(s.num_batched_tokens <= max(budget, len(s.scheduler["running"]) * 3)
               for s in snapshots)
    assert engine.block_manager.get_num_free_gpu_blocks() == 128


@pytest.mark.slow
def test_the_snapshot_shows_prefill_progress_advancing_chunk_by_chunk(cases):
    """A 33-token prompt with a budget of 7 tokens a step: the scheduler snapshot after each step
    says how many of its tokens are in the cache, 7 more each step, until it samples."""
    path, prompts, refs = cases["llama"]
    prompt = prompts[LENGTHS.index(33)]
    llm, tokens, snapshots = _run(path, [prompt], max_num_batched_tokens=7, num_gpu_blocks=64,
                                  enable_prefix_caching=False)
    assert tokens == [refs[LENGTHS.index(33)]]
    progress = [s.scheduler["running"][0]["prefill_progress"] if s.scheduler["running"]
                else None for s in snapshots]
    # After steps 1-4: 7, 14, 21, 28 of 33 tokens; step 5 runs the last 5 and samples.
    assert progress[:5] == [[7, 33], [14, 33], [21, 33], [28, 33], None]
    assert all(p is None for p in progress[5:])
    assert [s.num_batched_tokens for s in snapshots[:6]] == [7, 7, 7, 7, 5, 1]
    assert [s.prompt_run for s in snapshots[:6]] == [[True]] * 5 + [[False]]


@pytest.mark.slow
def test_a_budget_below_the_running_sequences_is_exceeded_by_their_decodes(cases):
    """Decodes are never skipped (README: differences from vLLM): with a budget of 1 token, an
    n=2 group decodes both its sequences each step, 2 tokens."""
    path, prompts, _ = cases["gpt2"]
    llm = LLM(path, block_size=8, max_model_len=80, num_gpu_blocks=64,
              max_num_batched_tokens=1)
    snapshots = []
    llm.llm_engine.add_observer(snapshots.append)
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=4, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[prompts[1]], sampling_params=params, use_tqdm=False)
    assert [len(o.token_ids) for o in out[0].outputs] == [4, 4]
    # 7 prompt tokens one at a time (the 7th samples both), then 3 steps of 2 decodes.
    assert [s.num_batched_tokens for s in snapshots] == [1] * 7 + [2] * 3


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_chunked_prefill_with_preemption_changes_nothing(cases, mode):
    path, prompts, refs = cases["llama"]
    # 12 blocks of 8 tokens cannot hold all five requests: they are preempted, and prompts (and
    # the recompute of preempted ones) go through chunks of 16 tokens.
    llm, tokens, _ = _run(path, prompts, max_num_batched_tokens=16, num_gpu_blocks=12,
                          num_cpu_blocks=64, watermark=0.0, preemption_mode=mode)
    stats = llm.llm_engine.stats
    assert (stats.num_preemptions_recompute if mode == "recompute"
            else stats.num_preemptions_swap) > 0
    assert tokens == refs


@pytest.mark.slow
def test_chunking_on_and_off_agree_on_seeded_groups(cases):
    path, prompts, _ = cases["gpt2"]
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=NEW, ignore_eos=True)
    results = []
    for kwargs in (dict(enable_chunked_prefill=False), dict(max_num_batched_tokens=5)):
        llm = LLM(path, block_size=8, max_model_len=80, num_gpu_blocks=128, **kwargs)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        results.append([[o.token_ids for o in r.outputs] for r in outs])
    assert results[0] == results[1]


def _group(request_id, length, arrival, seq_id):
    seqs = [Sequence(seq_id, None, list(range(2, 2 + length)), 4)]
    return SequenceGroup(request_id, seqs, SamplingParams(max_tokens=50), arrival)


def _advance(outs):
    apply_step(outs, lambda seq: 9)


@pytest.mark.parametrize("chunked", [True, False])
def test_decodes_never_wait_for_a_long_prompt_and_prompts_fill_the_rest(chunked):
    bm = BlockSpaceManager(block_size=4, num_gpu_blocks=64, num_cpu_blocks=0, watermark=0.0)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=10, max_model_len=100,
                                      enable_chunked_prefill=chunked), bm)
    for i in range(3):
        sched.add_seq_group(_group(f"short{i}", 2, float(i), i))
    _advance(sched.schedule())  # three short prompts (6 tokens) in one step
    sched.add_seq_group(_group("long", 9 if not chunked else 30, 10.0, 10))
    sched.add_seq_group(_group("late", 3, 11.0, 11))
    steps = []
    for _ in range(6):
        outs = sched.schedule()
        steps.append(outs)
        # Every running short request decodes in every step, whatever the prompts do.
        decoding = {g.request_id for g in outs.decode_seq_groups}
        assert {f"short{i}" for i in range(3)} <= decoding
        assert outs.num_batched_tokens <= 10
        _advance(outs)
    chunk_tokens = [sum(c.num_tokens for c in o.prefill_chunks) for o in steps]
    if chunked:
        # 3 decodes leave 7 tokens a step: the 30-token prompt runs as chunks of 7, and the
        # request behind it starts in the step where the long one finishes (FCFS).
        assert chunk_tokens[:4] == [7, 7, 7, 7]
        progress = [o for o in steps[0].prefill_chunks]
        assert progress[0].start == 0 and progress[0].end == 7 and not progress[0].sample
        assert sched.snapshot()["running"][3]["request_id"] == "long"
    else:
        # Without chunks a 9-token prompt must wait until the decodes leave room for it whole:
        # 3 decodes + 9 > 10, so it never runs while the short requests decode.
        assert chunk_tokens == [0] * 6
        assert [g["request_id"] for g in sched.snapshot()["waiting"]] == ["long", "late"]
