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


def greedy_tokens(engine, prompt, max_tokens):
    """One greedy request run to its end: its tokens."""
    engine.add_request("r", None, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                 ignore_eos=True), prompt_token_ids=prompt)
    tokens = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    return tokens


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
    return held, greedy_tokens(engine, prompt, max_tokens)


@pytest.mark.parametrize("prefix_caching", [pytest.param(True, marks=pytest.mark.slow), False])
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


def spy_held_blocks(engine):
    """After every scheduling pass: (the largest table a sequence holds, the free blocks)."""
    manager = engine.scheduler.block_manager
    seen = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        held = [manager.num_held_blocks(s) for s in manager.seqs.values()
                if s.seq_id in manager.block_tables]
        seen.append((max(held, default=0), manager.get_num_free_gpu_blocks()))
        assert check_block_manager(manager) == [], check_block_manager(manager)
        return out

    engine.scheduler.schedule = spy
    return seen


@pytest.mark.parametrize("settings", [
    dict(enable_prefix_caching=False),  # chunked prefill on: a prompt that fits goes whole
    dict(enable_chunked_prefill=False, enable_prefix_caching=False),
])
def test_a_160_token_prompt_holds_only_its_last_window(mistral_16, settings):
    """A prompt of 150 tokens is admitted with the 5 blocks of its last window (the others are
    markers; the prompt step writes them into the sink), decodes to 160 tokens on at most 6,
    and gives transformers' tokens: the prompt attends to itself in flight."""
    path, hf = mistral_16
    engine = LLMEngine(path, block_size=4, num_gpu_blocks=40, max_model_len=160,
                       dtype="float32", **settings)
    manager = engine.scheduler.block_manager
    assert manager.sink_block == 40  # one block past the pool
    assert engine.worker.cache_engine.num_gpu_blocks == 41
    seen = spy_held_blocks(engine)
    (prompt,) = pick_prompts(hf, [150], 10)
    tokens = greedy_tokens(engine, prompt, 10)
    print("held, free after each scheduling pass:", seen)
    # the prompt step: positions 135 ... 149 are what the first decode (150) reads: blocks
    # 33-37, and 33 to 37 is 5 blocks
    assert seen[0] == (5, 35)
    assert max(h for h, _ in seen) <= 6
    with torch.no_grad():
        want = greedy_reference(hf, prompt, 10)
    assert tokens == want
    assert manager.get_num_free_gpu_blocks() == 40


def test_a_prompt_cut_into_chunks_takes_its_blocks_and_gives_transformers_tokens(mistral_16):
    """With chunks of 32 tokens, later chunks read the earlier ones from the cache: the markers
    become blocks in the scheduling pass that admits the prompt, and leave as the window moves."""
    path, hf = mistral_16
    engine = LLMEngine(path, block_size=4, num_gpu_blocks=40, max_model_len=160,
                       dtype="float32", max_num_batched_tokens=32, enable_prefix_caching=False)
    seen = spy_held_blocks(engine)
    (prompt,) = pick_prompts(hf, [100], 8, seed=3)
    tokens = greedy_tokens(engine, prompt, 8)
    assert seen[0][0] == 25  # all 100 tokens' blocks: the prompt is cut
    assert max(h for h, _ in seen[-6:]) <= 6  # decoding: the window's blocks only
    with torch.no_grad():
        assert tokens == greedy_reference(hf, prompt, 8)


def test_with_prefix_caching_a_long_prompt_takes_all_its_blocks(mistral_16):
    """A block's name chains through every block before it: with prefix caching a prompt
    stores all its blocks, so the same prompt again finds them (and gets the same tokens)."""
    path, hf = mistral_16
    engine = LLMEngine(path, block_size=4, num_gpu_blocks=40, max_model_len=160,
                       dtype="float32")
    seen = spy_held_blocks(engine)
    (prompt,) = pick_prompts(hf, [60], 6, seed=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = []
    for i in range(2):
        engine.add_request(str(i), None, params, prompt_token_ids=prompt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs.append(out.outputs[0].token_ids)
    assert seen[0][0] == 15  # all 60 tokens' blocks
    with torch.no_grad():
        assert outs == [greedy_reference(hf, prompt, 6)] * 2
    assert engine.scheduler.block_manager.num_cached_tokens == 56  # all but the last block


def test_the_sink_must_lie_past_the_pool():
    with pytest.raises(ValueError, match="sink_block 3 is a block of the pool .0 to 9.: it "
                                         "must lie past it"):
        SlidingWindowBlockManager(4, 10, 0, window=8, sink_block=3)
