"""A model whose every layer slides its window gives back the blocks that have left it
(``core/sliding_window.py``): a 160-token sequence of a 16-token window in blocks of 4 never
holds more than 6 blocks, and its tokens stay transformers'."""
import pytest
import torch

from minipaged import SamplingParams
from minipaged.core.sliding_window import SlidingWindowBlockManager
from minipaged.engine.llm_engine import LLMEngine
from minipaged.lab.invariants import check_block_manager
from tiny_models import greedy_reference, pick_prompts, save_tiny_model


@pytest.fixture(scope="module")
def mistral_16(tmp_path_factory):
    """A tiny Mistral whose every layer slides a 16-token window."""
    path = tmp_path_factory.mktemp("mistral_16")
    return str(path), save_tiny_model("mistral", path, seed=8, sliding_window=16)


def held_blocks_per_step(engine, prompt, max_tokens):
    """Run one request step by step. Per step, once the scheduler has placed its new token (the
    blocks the step runs with): the sequence's length, the blocks it holds, the free blocks."""
    manager = engine.scheduler.block_manager
    held = []
    append_slot = manager.append_slot

    def spy(seq):  # the scheduler's call for each decode token
        out = append_slot(seq)
        held.append((seq.get_len(), manager.num_held_blocks(seq),
                     manager.get_num_free_gpu_blocks()))
        # the invariants of lab/invariants.py hold with dropped markers in the table
        assert check_block_manager(manager) == [], check_block_manager(manager)
        return out

    manager.append_slot = spy
    engine.add_request("r", None, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                 ignore_eos=True), prompt_token_ids=prompt)
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    return held, tokens


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_160_token_sequence_never_holds_more_than_6_blocks(mistral_16, prefix_caching):
    path, hf = mistral_16
    # NOTE: the pool must hold a whole prompt of max_model_len tokens (a prompt takes all its
    # blocks when admitted), so it has the 40 blocks; the sequence holds at most 6 of them
    engine = LLMEngine(path, block_size=4, num_gpu_blocks=40, max_model_len=160,
                       dtype="float32", enable_prefix_caching=prefix_caching)
    manager = engine.scheduler.block_manager
    assert isinstance(manager, SlidingWindowBlockManager) and manager.window == 16
    (prompt,) = pick_prompts(hf, [4], 0)  # any 4 tokens: the comparison below is exact
    held, tokens = held_blocks_per_step(engine, prompt, 156)
    lengths = [n for n, _, _ in held]
    # each decode step: 5 tokens (the prompt's and the first sampled), ..., 159 (the step that
    # computes token 159 samples the 160th and finishes)
    assert lengths == list(range(5, 160))
    counts = [c for _, c, _ in held]
    print("tokens -> blocks held:", [(n, c) for n, c, _ in held[::8]])
    assert max(counts) <= 6  # 16 / 4 + 2
    # past the window: its 16 tokens, in 4 blocks when they start a block, else 5
    assert set(counts[20:]) == {4, 5}
    assert min(free for _, _, free in held) >= 40 - 6  # the pool saw no more taken
    assert manager.num_dropped_blocks == 40 - 5  # all but the last window's blocks came back
    assert manager.get_num_free_gpu_blocks() == 40  # (cached ones count as free)
    # and its tokens are transformers' (which keeps the whole context and masks it)
    with torch.no_grad():
        want = greedy_reference(hf, prompt, 156)
    assert tokens == want
