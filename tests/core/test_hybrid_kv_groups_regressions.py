"""Two bugs of KV cache groups with prefix caching (``core/hybrid_block_manager.py``), each
pinned by the smallest case that showed it: the grouped engine's logprobs or tokens then
differed from the every-block engine's, far past float noise.

1. A sliding group's block named before its copy-on-write: the full group's ``append_slot``
   named every group's blocks, while the other groups' last block was still shared with a
   sibling; the sibling then wrote its own token into a block named with this sequence's
   tokens, and a later prompt (or this sequence recomputed) took the sibling's keys.
2. A cached block evicted between the groups' allocations: admitting a prompt, the full group's
   new blocks could evict a sliding group's cached block counted as a hit; that group took a
   fresh block for tokens the prompt then skipped, and its layers read stale keys there.
"""
import pytest

from minipaged import SamplingParams
from minipaged.core.hybrid_block_manager import HybridBlockManager
from minipaged.engine.llm_engine import LLMEngine
from minipaged.lab.invariants import check_block_manager
from minipaged.lab.tiny_families import save_tiny
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from tiny_models import save_tiny_model
from tp_helpers import ENGINE, workload
from workloads import run_to_end as run

BS = 4


def manager(num_gpu_blocks: int) -> HybridBlockManager:
    """A full group and a sliding group of window 8, prefix caching on."""
    return HybridBlockManager(BS, num_gpu_blocks, 0, watermark=0.0, enable_prefix_caching=True,
                              windows=(None, 8), sink_block=num_gpu_blocks)


def admit(hm: HybridBlockManager, request_id: str, prompt: list[int], n: int = 1,
          first_seq_id: int = 0) -> SequenceGroup:
    """What the scheduler does: allocate, then the prompt is computed in one step."""
    group = SequenceGroup(request_id, [Sequence(first_seq_id + i, None, prompt, BS)
                                       for i in range(n)], SamplingParams(n=n), arrival_time=0.0)
    hm.allocate(group)
    for seq in group.get_seqs(SequenceStatus.WAITING):
        seq.status = SequenceStatus.RUNNING
        hm.cache_blocks(seq, seq.get_len())
        seq.num_computed_tokens = seq.get_len()
    return group


def finish(hm: HybridBlockManager, group: SequenceGroup) -> None:
    for seq in group.get_seqs():
        seq.status = SequenceStatus.FINISHED_STOPPED
        hm.free(seq)


def test_each_group_names_its_block_after_its_own_copy_on_write():
    hm = manager(12)
    group = admit(hm, "a", [1, 2, 3], n=2)  # both sequences share one block in each group
    first, second = group.get_seqs()
    for seq, token in ((first, 7), (second, 9)):  # each fills the shared block with its token
        seq.append_token_id(token, {token: 0.0})
        hm.reserve_slot(seq)
    for index, m in enumerate([hm, *hm.groups]):
        for seq in (first, second):
            block = m.block_tables[seq.seq_id][0]
            name = hm.gpu_allocator.contents.get(block.block_number)
            # the tokens a block is named by are the tokens of the sequence writing into it
            # (a later group's names start with the group: _GroupNames)
            assert name is not None and name.token_ids[-BS:] == tuple(seq.get_token_ids()), \
                (index, seq.seq_id, name)
    assert check_block_manager(hm) == []


def test_no_group_evicts_a_block_another_group_takes_from_the_cache():
    hm = manager(6)
    finish(hm, admit(hm, "old", [1, 2, 3, 4, 50]))  # [1 2 3 4] cached in both groups: oldest
    finish(hm, admit(hm, "newer", [7, 7, 7, 7, 60], first_seq_id=1))  # cached after it
    admit(hm, "running", [33], first_seq_id=2)  # the free list is empty now
    cached = {index: m.gpu_allocator.longest_cached_prefix([1, 2, 3, 4], 1)[0].block_number
              for index, m in enumerate([hm, *hm.groups])}
    group = admit(hm, "hit", [1, 2, 3, 4, 9], first_seq_id=3)
    # every group takes its cached block (the full group's new block evicts the newer prompt's,
    # not the sliding group's hit), and the prompt skips those 4 tokens in every group
    (seq,) = group.get_seqs()
    assert {index: m.block_tables[seq.seq_id][0].block_number
            for index, m in enumerate([hm, *hm.groups])} == cached
    assert check_block_manager(hm) == []


@pytest.fixture
def cpp_matmul(monkeypatch):
    """Every matmul by the few-row loop (a row's result does not depend on the batch)."""
    monkeypatch.setenv("MINIPAGED_LINEAR_FORM", "cpp")


def outputs(engine, prompts, params):
    return [[(o.token_ids, o.cumulative_logprob) for o in r.outputs]
            for r in run(engine, prompts, params)]


def assert_same(got, want):
    for a, b in zip(got, want):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-3)


def test_copy_on_write_with_prefix_caching_qwen2_window(tmp_path, cpp_matmul):
    """Bug 1, as the tensor-parallel test drew it: Qwen2 with one full and one sliding layer,
    a seeded n = 2 request sharing a prompt's start, swapping (its second sample's tokens
    and cumulative logprob differed: -26.18 against -19.00)."""
    model = save_tiny_model("qwen2_window", tmp_path, seed=6)
    prompts, params = workload(model)
    got = outputs(LLMEngine(str(tmp_path), kv_cache_groups=True, cpu_threads=1, **ENGINE),
                  prompts, params)
    want = outputs(LLMEngine(str(tmp_path), kv_cache_groups=False, cpu_threads=1, **ENGINE),
                   prompts, params)
    assert_same(got, want)


def test_a_prompt_hit_after_evictions_gemma3(tmp_path, cpp_matmul):
    """Bug 2, as the whole-engine property drew it (shrunk): the tiny Gemma 3 of window 8,
    prompt lookup speculation, a small pool; the last prompt starts with the first one's
    block, and its logprob differed (-0.409 against -0.386)."""
    save_tiny("gemma3", str(tmp_path), seed=11, sliding_window=8)
    first = [15, 101, 121, 49]
    prompts = [first,
               [186, 232, 227, 98, 30, 117, 20, 143, 57, 41, 163, 133, 10, 28, 145, 168, 204,
                130, 221, 29, 212, 19, 212, 97, 196],
               [27, 207, 156, 180, 43, 209, 245, 142, 161, 113, 7, 252, 160, 241, 123, 40,
                170, 108, 156, 246, 30, 142, 124, 247, 164, 25, 23, 172, 226],
               first + [21, 107, 105, 139, 162, 158, 162, 141, 32, 105, 154, 107, 142, 239, 46,
                        210, 130]]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2)
              for m in (1, 2, 2, 1)]
    settings = dict(block_size=4, num_gpu_blocks=20, num_cpu_blocks=64, max_model_len=64,
                    dtype="float32", seed=0, cpu_threads=1, enable_prefix_caching=True,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    got = outputs(LLMEngine(str(tmp_path), kv_cache_groups=True, **settings), prompts, params)
    want = outputs(LLMEngine(str(tmp_path), kv_cache_groups=False, **settings), prompts, params)
    assert_same(got, want)
