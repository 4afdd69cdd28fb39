"""Hints follow the cause: realistic mistakes in the build track's components, each run through
its checker; the hint must name the operation that first went wrong (allocate, free, acquire;
the cache write or the read; ...), not the field where the difference happened to show.

Each mistake is written as a learner writes it (the reference answer with a line or two
changed, or a subclass with one method changed), and each test asserts the gist of its hint.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from minipaged.exercises import workbench
from minipaged.exercises.answers import lesson02 as a02
from minipaged.exercises.answers import lesson03 as a03
from minipaged.exercises.answers import lesson04 as a04
from minipaged.exercises.answers import lesson07 as a07
from minipaged.exercises.answers import lesson08 as a08
from minipaged.exercises.answers import lesson09 as a09
from minipaged.exercises.answers import lesson10 as a10
from minipaged.exercises.answers import lesson11 as a11
from minipaged.exercises.answers import lesson12 as a12
from minipaged.worker.sampler import SequenceOutput


@pytest.fixture(autouse=True)
def _learner_dir(tmp_path, monkeypatch):
    """Nothing is saved into the learner's folder."""
    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path / "learner"))


def check(name, candidate, num_cases=None):
    result = workbench.check_component(name, candidate, num_cases=num_cases, save=False)
    assert result.status == "failed", result
    return str(result)


def hint_of(result: str) -> str:
    return result.split("hint: ", 1)[1]


def changed(module, name: str, *edits: tuple[str, str]):
    """``module``'s ``name`` with a few lines of its source changed (a mistake in one place)."""
    source = inspect.getsource(module)
    for old, new in edits:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    namespace: dict = {}
    exec(compile(source, f"<learner's {name}>", "exec"), namespace)
    return namespace[name]


# == the mistakes the issue names ================================================================
# lesson 03: allocate forgets the other sequences' references to the blocks they share
AllocateWithoutTheOthersReferences = changed(
    a03, "MyBlockSpaceManager",
    ("                self.gpu_allocator.acquire(block)  # and one for each of the others",
     "                pass"))


def test_allocate_that_forgets_the_other_sequences_references_gets_the_allocate_hint():
    result = check("BlockSpaceManager", AllocateWithoutTheOthersReferences)
    assert "first wrong call: allocate(" in result
    assert "held once per sequence" in hint_of(result)
    assert "who else holds" not in hint_of(result)  # not the copy-on-write hint


# lesson 07: the three paths first, the cache written last (it ends up right; the reads are not)
ReadsTheCacheBeforeWriting = changed(
    a07, "Attention",
    ("            ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, scales)\n",
     ""),
    ("        return out.view(num_tokens, self.num_heads * self.head_size)\n",
     "        if kv_cache is not None:\n"
     "            ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, scales)\n"
     "        return out.view(num_tokens, self.num_heads * self.head_size)\n"))


def test_attention_that_reads_the_cache_before_writing_it_gets_the_write_first_hint():
    result = check("Attention", ReadsTheCacheBeforeWriting)
    assert "as it was BEFORE the step" in hint_of(result)
    assert "written before it is read" in hint_of(result)
    assert "come after the fresh prompts" not in hint_of(result)  # not a slicing hint


# lesson 11: free sends a cached block to the free list (it forgets it was cached)
class FreeForgetsTheCache(a11.MyPrefixCachingAllocator):
    def free(self, block):
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks.append(block)
            self.contents.pop(block.block_number, None)


# lesson 11: acquire adds the reference but leaves the block on the evictable list
class AcquireLeavesTheBlockEvictable(a11.MyPrefixCachingAllocator):
    def acquire(self, block):
        block.ref_count += 1


def test_a_free_that_forgets_the_cache_gets_the_free_hint():
    result = check("PrefixCachingAllocator", FreeForgetsTheCache)
    assert "after free" in result or "free s" in result
    assert hint_of(result).startswith("free ")
    assert "name is hash_fn" not in hint_of(result)  # not the naming hint


def test_an_acquire_that_leaves_the_block_evictable_gets_the_acquire_hint():
    result = check("PrefixCachingAllocator", AcquireLeavesTheBlockEvictable)
    assert hint_of(result).startswith("acquire ")
    assert "taken off evictable" in hint_of(result)


# lesson 10: __call__ returns beam search's choices as they are, not as SequenceOutput
class ReturnsTheChoicesAsTheyAre(a10.ReferenceSampler):
    def __call__(self, logits, rows, generators):
        results = super().__call__(logits, rows, generators)
        return {request_id: {seq_id: (0, out.parent_seq_id, out.token_id)
                             for seq_id, out in outs.items()}
                for request_id, outs in results.items()}


def test_a_malformed_return_value_is_named_with_its_case():
    result = check("Sampler", ReturnsTheChoicesAsTheyAre)
    assert "✗ Sampler: case 0 fails" in result
    assert "your code raised" not in result
    assert "your `__call__` returned {'req0': {0: (0, 0, " in result
    assert "each value must be a SequenceOutput" in hint_of(result)


# lesson 09: a group whose chunks did not all fit does not stop the groups behind it
AdmitsPastAGroupWithChunksLeft = changed(
    a09, "admit_waiting",
    ("        if seq_group.pending_chunks:\n"
     "            break  # the budget ran out inside this prompt: the rest waits for later steps",
     "        pass"))


def test_admission_past_a_group_with_chunks_left_is_caught_with_the_spent_budget_rule():
    result = check("admit_waiting", AdmitsPastAGroupWithChunksLeft)
    assert "spends the budget" in hint_of(result)
