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


# == further mistakes, per component, as a learner makes them ====================================
# Each entry: (component, the mistake, what the hint must say, what it must not say).

# -- lesson 02: FreeListAllocator ----------------------------------------------------------------
class AllocatesFromTheFront(a02.MyFreeListAllocator):
    """The free list used as a queue: the oldest free block goes out first."""

    def allocate(self):
        if not self.stack:
            raise ValueError("no free block")
        block = self.stack.pop(0)
        block.ref_count = 1
        return block


class AcquireForgetsTheCount(a02.MyFreeListAllocator):
    def acquire(self, block):
        pass


class CountsAllocationsForTheFreeNumber(a02.MyFreeListAllocator):
    """Keeps its own counter of free blocks, and forgets to count a block freed again."""

    def __init__(self, device, block_size, num_blocks):
        super().__init__(device, block_size, num_blocks)
        self.num_free = num_blocks

    def allocate(self):
        block = super().allocate()
        self.num_free -= 1
        return block

    def get_num_free_blocks(self):
        return self.num_free


class ListsTheFreeBlocksBottomFirst(a02.MyFreeListAllocator):
    def free_block_numbers(self):
        return [block.block_number for block in self.stack]


# -- lesson 03: BlockSpaceManager ----------------------------------------------------------------
CanAllocateCountsSharedBlocksPerSequence = changed(
    a03, "MyBlockSpaceManager",
    ("            needed = len(seqs[0].logical_token_blocks)\n",
     "            needed = len(seqs) * len(seqs[0].logical_token_blocks)\n"))

CopyOnWriteKeepsTheOldReference = changed(
    a03, "MyBlockSpaceManager",
    ("        self.gpu_allocator.free(last)  # one holder fewer\n", ""))

FreeFirstBlockFirst = changed(
    a03, "MyBlockSpaceManager",
    ("        for block in table[::-1]:\n", "        for block in table:\n"))

ForkSharesTheParentsList = changed(
    a03, "MyBlockSpaceManager",
    ("        table = self.tables[parent.seq_id][:]\n",
     "        table = self.tables[parent.seq_id]\n"))


# -- lesson 04: Scheduler ------------------------------------------------------------------------
PreemptsTheOldest = changed(
    a04, "MyScheduler",
    ("                victim = queue.pop() if queue else seq_group\n",
     "                victim = queue.pop(0) if queue else seq_group\n"))

RecomputeKeepsTheBlocks = changed(
    a04, "MyScheduler",
    ("                self.block_manager.free(seq)\n", ""))

ResumesInAStepThatPreempted = changed(
    a04, "MyScheduler",
    ("        if step.preempted or step.stalled:\n", "        if step.stalled:\n"))

DecodesCostNoBudget = changed(
    a04, "MyScheduler",
    ("                step.budget -= sum(1 + seq.num_lookahead_slots for seq in seqs)\n", ""))


# -- lesson 07: Attention ------------------------------------------------------------------------
OnePromptForAll = changed(
    a07, "Attention",
    ("                                                     meta.prompt_lens, self.scale,\n",
     "                                                     [prompt_end], self.scale,\n"))

WritesOnlyTheDecodeKeys = changed(
    a07, "Attention",
    ("            ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping, scales)",
     "            ops.reshape_and_cache(k[chunk_end:], v[chunk_end:], key_cache, value_cache,\n"
     "                                  meta.slot_mapping[chunk_end:], scales)"),
    ("        prompt_end = meta.num_fresh_prompt_tokens\n"
     "        chunk_end = prompt_end + meta.num_chunk_tokens\n", ""),
    ("        key_cache = value_cache = scales = None\n",
     "        key_cache = value_cache = scales = None\n"
     "        prompt_end = meta.num_fresh_prompt_tokens\n"
     "        chunk_end = prompt_end + meta.num_chunk_tokens\n"))

ChunksReadTheDecodeTables = changed(
    a07, "Attention",
    ("                q[prompt_end:chunk_end], key_cache, value_cache, meta.chunk_block_tables,",
     "                q[prompt_end:chunk_end], key_cache, value_cache, meta.block_tables,"))


# -- lesson 08: prepare_inputs -------------------------------------------------------------------
def _prepared(edit):
    def prepare_inputs(seq_runs, block_size, device, drafts=None):
        prepared = a08.prepare_inputs(seq_runs, block_size, device)
        edit(prepared)
        return prepared
    return prepare_inputs


def _context_without_the_new_token(p):
    p.meta.context_lens -= 1


def _tables_padded_with_minus_one(p):
    tables = p.meta.block_tables
    if tables.numel():
        tables[tables == 0] = -1


def _no_metadata(p):
    p.meta = None


ContextLensWithoutTheNewToken = _prepared(_context_without_the_new_token)
TablesPaddedWithMinusOne = _prepared(_tables_padded_with_minus_one)
ReturnsNoMetadata = _prepared(_no_metadata)


# -- lesson 09: admit_waiting --------------------------------------------------------------------
SkipsAGroupThatDoesNotFit = changed(
    a09, "admit_waiting",
    ("    while self.waiting:\n        seq_group = self.waiting[0]\n",
     "    for seq_group in list(self.waiting):\n"),
    ("            break  # first come, first served: nobody behind it goes first\n"
     "        self.waiting.pop(0)\n",
     "            continue\n        self.waiting.remove(seq_group)\n"),
    ("        if seq_group.pending_chunks:\n"
     "            break  # the budget ran out inside this prompt: the rest waits for later steps",
     "        if seq_group.pending_chunks:\n            break"))


# -- lesson 10: Sampler --------------------------------------------------------------------------
class PenalisesThePromptToo(a10.ReferenceSampler):
    @staticmethod
    def penalized(logits, rows):
        out = logits.clone()
        for i, row in enumerate(rows):
            params = row.seq_group.sampling_params
            seq = row.seq_group.find(row.seq_ids[0])
            tokens = seq.get_token_ids()  # prompt and output
            counts = torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).float()
            out[i] = (out[i] - params.frequency_penalty * counts
                      - params.presence_penalty * (counts > 0).float())
        return out


OneDrawForASharedPromptRow = changed(
    a10, "ReferenceSampler",
    ("                    for seq_id in rows[i].seq_ids:  # a shared prompt row: one draw each\n"
     "                        choices[seq_id] = (k, seq_id, draw(probs, generators[seq_id]))",
     "                    token = draw(probs, generators[rows[i].seq_ids[0]])  # one draw\n"
     "                    for seq_id in rows[i].seq_ids:\n"
     "                        choices[seq_id] = (k, seq_id, token)"))


class TokenAsATensor(a10.ReferenceSampler):
    def __call__(self, logits, rows, generators):
        results = super().__call__(logits, rows, generators)
        return {r: {s: SequenceOutput(o.parent_seq_id, torch.tensor(o.token_id), o.logprobs)
                    for s, o in outs.items()} for r, outs in results.items()}


# -- lesson 11: PrefixCachingAllocator -----------------------------------------------------------
class EvictionsUncounted(a11.MyPrefixCachingAllocator):
    def _evict(self, block):
        super()._evict(block)
        self.num_evictions -= 1


class LookupPastMaxBlocks(a11.MyPrefixCachingAllocator):
    def longest_cached_prefix(self, token_ids, max_blocks):
        return super().longest_cached_prefix(token_ids, len(token_ids) // self.block_size)


# -- lesson 12: greedy_verify, rejection_sample --------------------------------------------------
def verify_past_the_first_miss(target_argmax_ids, draft_token_ids):
    kept = [d for d, t in zip(draft_token_ids, target_argmax_ids) if d == t]
    return kept + [target_argmax_ids[len(kept)]]


def verify_with_the_draft_as_correction(target_argmax_ids, draft_token_ids):
    out = []
    for draft, target in zip(draft_token_ids, target_argmax_ids):
        out.append(draft)
        if draft != target:
            return out
    return out + [target_argmax_ids[len(draft_token_ids)]]


NoBonusToken = changed(
    a12, "rejection_sample",
    ("    emitted.append(draw(p_rows[k], generator))  # every guess kept: a bonus token\n", ""))

AcceptsWhenUBelowPOverQFlipped = changed(
    a12, "rejection_sample",
    ("        if u * q[token].item() < p[token].item():", "        if u * p[token].item() < q[token].item():"))


# == one test per further mistake: the gist its hint must have, and what it must not say ==========
FURTHER = [
    # lesson 02
    ("FreeListAllocator", AllocatesFromTheFront, "last in, first out", None),
    ("FreeListAllocator", AcquireForgetsTheCount, "one more block table holds the block", None),
    ("FreeListAllocator", CountsAllocationsForTheFreeNumber, "get_num_free_blocks() is not",
     "free() drops ONE reference"),
    ("FreeListAllocator", ListsTheFreeBlocksBottomFirst,
     "free_block_numbers() lists them in the order allocate hands them out", None),
    # lesson 03
    ("BlockSpaceManager", CanAllocateCountsSharedBlocksPerSequence,
     "a block the sequences share counts once", None),
    ("BlockSpaceManager", CopyOnWriteKeepsTheOldReference,
     "lets go of its reference to the shared one", None),
    ("BlockSpaceManager", FreeFirstBlockFirst, "last block first", None),
    ("BlockSpaceManager", ForkSharesTheParentsList, "a list of its own", "copy-on-write"),
    # lesson 04
    ("Scheduler", PreemptsTheOldest, "the victim is the newest group", None),
    ("Scheduler", RecomputeKeepsTheBlocks, "_preempt by recompute takes ALL the group's GPU "
     "blocks back", "only as many as needed"),
    ("Scheduler", ResumesInAStepThatPreempted, "not in a step that preempted", None),
    ("Scheduler", DecodesCostNoBudget, "one token of step.budget", None),
    # lesson 07
    ("Attention", OnePromptForAll, "prompt by prompt (meta.prompt_lens)", None),
    ("Attention", WritesOnlyTheDecodeKeys, "EVERY token of the step", None),
    ("Attention", ChunksReadTheDecodeTables, "the chunks' path got arguments it cannot use",
     None),
    # lesson 08
    ("prepare_inputs", ContextLensWithoutTheNewToken, "itself included (run.end)", None),
    ("prepare_inputs", TablesPaddedWithMinusOne, "padded with 0", None),
    ("prepare_inputs", ReturnsNoMetadata, "meta must be an InputMetadata", None),
    # lesson 09
    ("admit_waiting", SkipsAGroupThatDoesNotFit, "first come, first served", None),
    # lesson 10
    ("Sampler", PenalisesThePromptToo, "generated tokens only", None),
    ("Sampler", OneDrawForASharedPromptRow, "each of its sequences draws its own token", None),
    ("Sampler", TokenAsATensor, "must be plain ints", None),
    # lesson 11
    ("PrefixCachingAllocator", EvictionsUncounted, "num_evictions counts each time", None),
    ("PrefixCachingAllocator", LookupPastMaxBlocks, "at most max_blocks", "a hash hit"),
    # lesson 12
    ("greedy_verify", verify_past_the_first_miss, "stop at the first draft the target "
     "disagrees with", None),
    ("greedy_verify", verify_with_the_draft_as_correction, "not a draft", None),
    ("rejection_sample", NoBonusToken, "the bonus token is drawn from the last row", None),
    ("rejection_sample", AcceptsWhenUBelowPOverQFlipped, "min(1, p(d)/q(d))", "residual"),
]


@pytest.mark.parametrize("name, mistake, gist, not_said", FURTHER,
                         ids=[m[1].__name__ for m in FURTHER])
def test_a_further_mistake_gets_a_hint_about_its_cause(name, mistake, gist, not_said):
    result = check(name, mistake)
    assert f"✗ {name}: case " in result and "your code raised" not in result, result
    assert gist in hint_of(result), result
    if not_said:
        assert not_said not in hint_of(result), result
