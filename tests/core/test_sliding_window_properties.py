"""Freeing the blocks that left the window changes nothing a request sees: whole random
workloads on a tiny all-sliding Mistral (window 8, blocks of 4) give the same tokens and
logprobs with ``SlidingWindowBlockManager`` as with the ``BlockSpaceManager`` that keeps every
block, through copy-on-write (n = 2 sampling, beam search's forks), swapping or recompute (small
pools), chunked prefill, prefix caching (shared prompt starts), speculative decoding by prompt
lookup and multi-step decode; without prefix caching, prompts admitted with only their last
window's blocks."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minipaged import SamplingParams
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.sliding_window import SlidingWindowBlockManager
from minipaged.engine.llm_engine import LLMEngine
from budgets import examples
from tiny_models import save_tiny_model
from workloads import params_of_kind, request_kinds, run_to_end as run

pytestmark = pytest.mark.slow

MODES = [  # engine settings a workload runs under
    dict(preemption_mode="swap", num_gpu_blocks=26),
    dict(preemption_mode="recompute", num_gpu_blocks=26),
    dict(preemption_mode="swap", num_gpu_blocks=26, enable_prefix_caching=False),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=6, num_gpu_blocks=26),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3},
         num_gpu_blocks=32),
    dict(num_scheduler_steps=4, num_gpu_blocks=32),
    # without prefix caching a prompt is admitted with its last window's blocks only: whole,
    # cut into chunks (its markers become blocks), recomputed, verified by speculation
    dict(enable_chunked_prefill=True, max_num_batched_tokens=6, num_gpu_blocks=26,
         enable_prefix_caching=False),
    dict(preemption_mode="recompute", num_gpu_blocks=26, enable_prefix_caching=False),
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3},
         num_gpu_blocks=32, enable_prefix_caching=False),
]
SINGLE_SEQUENCE_ONLY = (4, 8)  # the modes that run neither n = 2 nor beam search


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("mistral_8")
    save_tiny_model("mistral", path, seed=9)  # sliding_window=8 on both layers
    return str(path)


@pytest.fixture(scope="module")
def engines(mistral_dir):
    """Per mode: (the engine that frees, the engine that keeps every block), made once."""
    made = {}

    def get(mode: int):
        if mode not in made:
            settings_ = dict(block_size=4, num_cpu_blocks=64, max_model_len=64,
                             dtype="float32", seed=0, **MODES[mode])
            freeing = LLMEngine(mistral_dir, **settings_)
            keeping = LLMEngine(mistral_dir, **settings_)
            keeping.scheduler.replace_block_manager(
                BlockSpaceManager.like(keeping.scheduler.block_manager))
            assert isinstance(freeing.scheduler.block_manager, SlidingWindowBlockManager)
            made[mode] = freeing, keeping
        return made[mode]

    return get


token = st.integers(2, 255)
request = st.fixed_dictionaries({
    "prefix_of": st.none() | st.integers(0, 3),  # start with an earlier prompt's tokens
    "tokens": st.lists(token, min_size=1, max_size=26),
    "max_tokens": st.integers(1, 16), "kind": request_kinds()})


@given(mode=st.integers(0, len(MODES) - 1), reqs=st.lists(request, min_size=1, max_size=4))
@settings(max_examples=examples(40), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_freeing_out_of_window_blocks_changes_no_output(engines, mode, reqs):
    freeing, keeping = engines(mode)
    prompts, params = [], []
    for i, r in enumerate(reqs):
        start = prompts[r["prefix_of"]][:12] if r["prefix_of"] is not None and \
            r["prefix_of"] < i else []
        prompts.append((start + r["tokens"])[:30])  # (n = 2 of 46 tokens fits the pool)
        kind = "greedy" if mode in SINGLE_SEQUENCE_ONLY else r["kind"]
        params.append(params_of_kind(kind, i, r["max_tokens"]))
    got = run(freeing, prompts, params)
    want = run(keeping, prompts, params)
    for a, b in zip(got, want):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        for x, y in zip(a.outputs, b.outputs):
            assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)
    manager = freeing.scheduler.block_manager
    assert manager.get_num_free_gpu_blocks() == manager.num_total_gpu_blocks  # all came back


def test_long_workload_does_free(engines):
    """One workload long past the window: blocks did leave (the property is not vacuous)."""
    freeing, keeping = engines(1)
    before = freeing.scheduler.block_manager.num_dropped_blocks
    prompts = [list(range(3, 30)), list(range(3, 20)) + [7, 9], list(range(40, 66))]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)]
    got, want = run(freeing, prompts, params), run(keeping, prompts, params)
    assert [[o.token_ids for o in r.outputs] for r in got] == \
        [[o.token_ids for o in r.outputs] for r in want]
    assert freeing.scheduler.block_manager.num_dropped_blocks > before
    # the pool of 26 blocks was too small for the engine that keeps every block
    assert keeping.stats.num_preemptions_recompute > 0
