"""Tensor parallelism (lesson 14) over the new families: 2 gloo workers give one process's tokens
and logprobs for Qwen2 with a sliding layer (q/k/v biases cut per rank) and Gemma 3 (per-head
q/k norms, sliding and full layers), through preemption by swapping and copy-on-write.

Slow: every engine starts worker processes."""
import pytest

from minipaged import LLM
from tiny_models import save_tiny_model
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
