"""Swapping whole sequence groups to CPU blocks and back (lesson 04).

A GPU pool too small for all requests at once forces the scheduler to preempt. Groups of several
sequences (beam search, parallel sampling) are swapped out by default; preemption by recompute
and by swap can be forced. Whatever happens, the tokens must be those of a run with room to
spare, and afterwards every GPU and CPU block must be free again.

Slow (left out of `make test`): the swap-out-and-in test over beams and samples, about 20 s on the
2-core machine (measured at load ~15).
"""
from __future__ import annotations

import pytest

from beam_prompts import pick_beam_prompts
from minipaged import LLM, SamplingParams

pytestmark = pytest.mark.lesson04

BLOCK_SIZE = 4
MAX_TOKENS = 12
WIDTH = 3
# A beam group of a 6-token prompt + 12 tokens can hold up to 1 + 3 * 4 = 13 blocks of 4 tokens:
# one group fits in 16 blocks, two do not.
SMALL_POOL = 16
# The most tokens one sequence may reach: what the small pool holds (not the model's 256).
MAX_MODEL_LEN = SMALL_POOL * BLOCK_SIZE


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    _, model = tiny_llama
    return [p for p, _ in pick_beam_prompts(model, WIDTH, seed=21, lengths=(6, 5, 7),
                                            steps=MAX_TOKENS)]


def _beam():
    return SamplingParams(n=WIDTH, use_beam_search=True, temperature=0.0,
                          max_tokens=MAX_TOKENS, ignore_eos=True)


def _sample():
    return SamplingParams(n=WIDTH, temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
                          ignore_eos=True)


def _run(path, prompts, params, **engine_kwargs):
    llm = LLM(path, block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, **engine_kwargs)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return llm, outputs


def _tokens(outputs):
    return [[o.token_ids for o in r.outputs] for r in outputs]


def _assert_all_blocks_free(llm):
    bm = llm.llm_engine.block_manager
    assert bm.get_num_free_gpu_blocks() == bm.num_total_gpu_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    assert not bm.block_tables


@pytest.fixture(scope="module")
def roomy(tiny_llama, prompts):
    """The reference: a pool large enough that nothing is ever preempted."""
    path, _ = tiny_llama
    results = {}
    for name, params in (("beam", _beam()), ("sample", _sample())):
        llm, outputs = _run(path, prompts, params, num_gpu_blocks=256, num_cpu_blocks=0)
        stats = llm.llm_engine.stats
        assert stats.num_preemptions_swap == stats.num_preemptions_recompute == 0
        results[name] = outputs
    return results


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["beam", "sample"])
def test_swapping_groups_out_and_in_changes_no_token(tiny_llama, prompts, roomy, kind):
    path, _ = tiny_llama
    params = _beam() if kind == "beam" else _sample()
    llm, outputs = _run(path, prompts, params, num_gpu_blocks=SMALL_POOL, num_cpu_blocks=64)
    stats = llm.llm_engine.stats
    assert stats.num_preemptions_swap > 0
    assert stats.num_preemptions_recompute == 0  # groups are swapped, not recomputed
    assert stats.num_blocks_swapped_out > 0 and stats.num_blocks_swapped_in > 0
    assert stats.peak_gpu_blocks_used <= SMALL_POOL
    assert _tokens(outputs) == _tokens(roomy[kind])
    for ours, ref in zip(outputs, roomy[kind]):
        assert [o.cumulative_logprob for o in ours.outputs] == pytest.approx(
            [o.cumulative_logprob for o in ref.outputs], abs=1e-4)
        assert all(o.finish_reason == "length" for o in ours.outputs)
    _assert_all_blocks_free(llm)


def test_forced_recompute_and_forced_swap_give_the_same_beams(tiny_llama, prompts, roomy):
    path, _ = tiny_llama
    by_mode = {}
    for mode in ("recompute", "swap"):
        llm, outputs = _run(path, prompts, _beam(), num_gpu_blocks=SMALL_POOL,
                            num_cpu_blocks=64, preemption_mode=mode)
        stats = llm.llm_engine.stats
        if mode == "recompute":
            assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap == 0
        else:
            assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute == 0
        _assert_all_blocks_free(llm)
        by_mode[mode] = _tokens(outputs)
    assert by_mode["recompute"] == by_mode["swap"] == _tokens(roomy["beam"])


def test_a_group_that_does_not_fit_in_swap_space_falls_back_to_recompute(tiny_llama, prompts,
                                                                         roomy):
    path, _ = tiny_llama
    llm, outputs = _run(path, prompts, _beam(), num_gpu_blocks=SMALL_POOL, num_cpu_blocks=2)
    stats = llm.llm_engine.stats
    assert stats.num_preemptions_recompute > 0
    assert _tokens(outputs) == _tokens(roomy["beam"])
    _assert_all_blocks_free(llm)


def test_running_out_of_swap_space_with_swap_forced_recomputes_and_loses_nothing(
        tiny_llama, prompts, roomy):
    """Even with preemption_mode="swap", a group that does not fit the swap space is
    recomputed instead: an accepted request is never dropped."""
    path, _ = tiny_llama
    llm, outputs = _run(path, prompts, _beam(), num_gpu_blocks=SMALL_POOL, num_cpu_blocks=2,
                        preemption_mode="swap")
    stats = llm.llm_engine.stats
    assert stats.num_preemptions_recompute > 0, "the pool was meant to overflow swap space"
    assert stats.num_aborted_by_engine == 0
    assert all(r.error is None and r.finished for r in outputs)
    assert _tokens(outputs) == _tokens(roomy["beam"])
    assert all(o.finish_reason == "length" for r in outputs for o in r.outputs)
    _assert_all_blocks_free(llm)


def test_nothing_new_is_admitted_while_a_group_is_swapped_out(tiny_llama, prompts, roomy):
    """Swapped groups come back before waiting ones are admitted (FCFS, no starvation)."""
    path, _ = tiny_llama
    # Three beam groups run at once at most, so the others wait in the queue.
    llm = LLM(path, block_size=BLOCK_SIZE, num_gpu_blocks=SMALL_POOL, num_cpu_blocks=64,
              max_num_seqs=3 * WIDTH, max_model_len=MAX_MODEL_LEN)
    snapshots = []
    llm.llm_engine.add_observer(snapshots.append)
    # Twice the prompts: while the first ones are swapped out, the later ones wait.
    outputs = llm.generate(prompt_token_ids=prompts + prompts, sampling_params=_beam(),
                           use_tqdm=False)
    assert _tokens(outputs) == _tokens(roomy["beam"]) * 2
    waited_behind_swapped = False
    for snap in snapshots:
        if any(snap.prompt_run):
            assert not snap.scheduler["swapped"] and not snap.preempted, snap.step
        if snap.scheduler["swapped"] and snap.scheduler["waiting"]:
            waited_behind_swapped = True
    assert waited_behind_swapped, "the pool was meant to make requests wait behind a swap"
    _assert_all_blocks_free(llm)
