"""Tensor parallelism (lesson 14) over the new families: 2 gloo workers give one process's tokens
and logprobs for Qwen2 with a sliding layer (q/k/v biases cut per rank) and Gemma 3 (per-head
q/k norms, sliding and full layers), through preemption by swapping and copy-on-write; and
with KV cache groups (lesson 20: each rank lays out its layers by group, the driver's per-group
block tables serve all ranks), the every-block engine's tokens and logprobs.

Slow: every engine starts worker processes."""
import pytest

from minipaged import LLM, SamplingParams
from minipaged.core.hybrid_block_manager import HybridBlockManager
from tiny_models import pick_prompts, save_tiny_model
from tp_helpers import ENGINE, assert_same_outputs, one_rank_and_n_ranks

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["qwen2_window", "gemma3"])
def test_two_ranks_give_one_rank_s_outputs(tmp_path, kind):
    model = save_tiny_model(kind, tmp_path, seed=6)
    # prompts of 6 to 13 tokens + 10 new: past the window
    reference, outputs, stats = one_rank_and_n_ranks(str(tmp_path), model, 2)
    assert_same_outputs(reference, outputs)
    assert stats.num_preemptions_swap > 0 and stats.num_blocks_swapped_in > 0


def test_kv_heads_that_do_not_split_are_refused(tmp_path):
    save_tiny_model("qwen3", tmp_path, seed=6)  # 2 kv heads
    with pytest.raises(Exception, match="key/value heads"):
        LLM(str(tmp_path), tensor_parallel_size=4, **ENGINE)


@pytest.mark.parametrize("mode", [dict(preemption_mode="swap"),
                                  dict(preemption_mode="recompute", enable_prefix_caching=True),
                                  # greedy batches 3 steps a schedule, on the ranks
                                  dict(preemption_mode="recompute", num_scheduler_steps=3)])
def test_two_ranks_with_kv_cache_groups_give_every_block_outputs(tmp_path, mode):
    """Gemma 3 (sliding and full layers) on 2 ranks with KV cache groups: prompts past the
    window (8), shared prompt starts, n = 2 sampling and beam search, a pool small enough to
    preempt; the tokens and logprobs of one rank keeping every block in one table."""
    model = save_tiny_model("gemma3", tmp_path, seed=6)
    prompts = pick_prompts(model, [13, 11, 9], 10)
    prompts += [prompts[0][:9] + prompts[2][:3], prompts[1][:10]]  # prefix hits, past window
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    params = [greedy, greedy, greedy,
              SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=10, ignore_eos=True,
                             logprobs=3),
              SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=8, logprobs=3,
                             ignore_eos=True)]
    engine = {**ENGINE, **mode}
    reference = LLM(str(tmp_path), kv_cache_groups=False, **engine).generate(
        prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    grouped = LLM(str(tmp_path), tensor_parallel_size=2, **engine)
    try:
        assert isinstance(grouped.llm_engine.scheduler.block_manager, HybridBlockManager)
        outputs = grouped.generate(prompt_token_ids=prompts, sampling_params=params,
                                   use_tqdm=False)
    finally:
        grouped.llm_engine.shutdown()
    assert_same_outputs(reference, outputs)
    stats = grouped.llm_engine.stats
    assert stats.num_preemptions_swap + stats.num_preemptions_recompute > 0
    groups = grouped.llm_engine.scheduler.block_manager.groups
    assert all(g.num_dropped_blocks > 0 for g in groups)  # blocks left the window
    if "num_scheduler_steps" in mode:
        assert grouped.llm_engine.multi_step.num_later_steps > 0
