"""The build track's mutation table: for each component, one-line mistakes of its reference answer
that its check must reject (the mistakes a learner makes, the issue's among them).

``MUTANTS`` lists (component, mistake, the mistake built from the answer); ``test_every_mutant_
is_rejected`` runs each through its component's check; ``test_the_table`` prints the table
(mutants per component, caught) and holds it to at least three mutants a component. The fast
tier runs one mutant per component (the first of each); the whole table is marked slow. The
mistakes the capstone must reject (a sampler without penalties passes lesson 10's check only if
the check misses them, so the capstone is the second net) are in ``CAPSTONE_MUTANTS``, slow.

Mistakes that ``test_hints_by_cause.py`` writes for its hints are reused from there (the same
objects); the others are written here, each as the answer with a line or two changed.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from minipaged.block import PhysicalTokenBlock
from minipaged.exercises import lesson16, workbench
from minipaged.exercises.answers import lesson02 as a02
from minipaged.exercises.answers import lesson03 as a03
from minipaged.exercises.answers import lesson04 as a04
from minipaged.exercises.answers import lesson07 as a07
from minipaged.exercises.answers import lesson09 as a09
from minipaged.exercises.answers import lesson10 as a10
from minipaged.exercises.answers import lesson11 as a11
from minipaged.exercises.answers.lesson06 import SOFTMAX_PHASE
from minipaged.exercises.answers import lesson18 as a18
from minipaged.exercises.answers import lesson20 as a20
import test_hints_by_cause as known  # (tests/exercises is on sys.path: pytest's rootdir mode)


@pytest.fixture(autouse=True)
def _learner_dir(tmp_path, monkeypatch):
    """Nothing is saved into the learner's folder."""
    monkeypatch.setenv(workbench.LEARNER_DIR_VARIABLE, str(tmp_path / "learner"))


changed = known.changed


# -- the mistakes written here ------------------------------------------------------------------
AllocateWithoutRefCount = changed(
    a02, "MyFreeListAllocator", ("        block.ref_count = 1\n", ""))
AppendSlotOpensABlockEarly = changed(
    a03, "MyBlockSpaceManager",
    ("        if len(table) < len(seq.logical_token_blocks):\n",
     "        if len(table) * self.block_size <= seq.get_len():\n"))
GetBlocksGivesItsOwnList = changed(
    a03, "MyBlockSpaceManager",
    ("        return list(self.tables.get(seq_id, ()))\n",
     "        return self.tables.get(seq_id, [])\n"))
SetBlocksKeepsTheOldTable = changed(
    a03, "MyBlockSpaceManager",
    ("        self.tables[seq_id] = list(blocks)\n",
     "        self.tables.setdefault(seq_id, list(blocks))\n"))
ForkedChildGetsARequestOfItsOwn = changed(
    a03, "MyBlockSpaceManager",
    ("        self.holders[child.seq_id] = (child, self.holders[parent.seq_id][1])\n",
     "        self.holders[child.seq_id] = (child, str(child.seq_id))\n"))
RecomputeToTheBack = changed(
    a04, "MyScheduler",
    ("            self.waiting.insert(0, seq_group)  # first in line again\n",
     "            self.waiting.append(seq_group)\n"))
ResumesPastTheLimit = changed(
    a04, "MyScheduler",
    ("                    or self._num_running_seqs() + num_seqs > self.config.max_num_seqs\n",
     ""))
SwapOutForgetsSwapped = changed(
    a04, "MyScheduler",
    ("                seq.status = SequenceStatus.SWAPPED\n", "                pass\n"))
IgnoresTheWindow = changed(
    a07, "Attention", ("        num_tokens = query.shape[0]\n",
                       "        num_tokens = query.shape[0]\n        self.sliding_window = None\n"))
AdmitsPastTheLimit = changed(
    a09, "admit_waiting", ("        if step.budget < needed or too_many or",
                           "        if step.budget < needed or"))
NoPenalties = changed(
    a10, "ReferenceSampler",
    ("            if not generated or not (params.presence_penalty or params.frequency_penalty):",
     "            if True:"))
NoTopK = changed(
    a10, "ReferenceSampler", ("        if top_k != -1 and top_k < logits.shape[-1]:",
                              "        if False:"))
NoTopLogprobs = changed(
    a10, "ReferenceSampler", ("        if num_top:\n", "        if False:\n"))
NameBlockKeepsTheSameNameBlock = changed(
    a11, "MyPrefixCachingAllocator",
    ("            self._evict(holder)  # an evictable block with another prefix under this name",
     "            pass"))
ResetCountsEvictions = changed(
    a11, "MyPrefixCachingAllocator",
    ("            self._evict(block, counted=False)", "            self._evict(block)"))
EvictsTheMostRecentlyUsed = changed(
    a11, "MyPrefixCachingAllocator",
    ("            oldest = next(iter(self.evictable.values()))",
     "            oldest = next(reversed(self.evictable.values()))"))
EvictableNotCountedFree = changed(
    a11, "MyPrefixCachingAllocator",
    ("        return len(self.free_blocks) + len(self.evictable)",
     "        return len(self.free_blocks)"))
EvictableListedFirst = changed(
    a11, "MyPrefixCachingAllocator",
    ("        return [b.block_number for b in reversed(self.free_blocks)] + list(self.evictable)",
     "        return list(self.evictable) + [b.block_number for b in reversed(self.free_blocks)]"))
ResetWithBlocksHeld = changed(
    a11, "MyPrefixCachingAllocator",
    ("        if self.get_num_free_blocks() != self.num_blocks:\n            return False\n",
     ""))
SwapInTrustsTheName = changed(
    a11, "MyPrefixCachingAllocator",
    ("        if holder is None or self.contents[holder.block_number].content_id != "
     "held.content_id:", "        if holder is None:"))
AdoptTakesTheName = changed(
    a11, "MyPrefixCachingAllocator",
    ("        self.by_hash.setdefault(held.block_hash, block)",
     "        self.by_hash[held.block_hash] = block"))
SwapCopyForgetsTheName = changed(
    a11, "MyPrefixCachingAllocator",
    ("            table[dst.block_number] = self.contents[src.block_number]", "            pass"))



# -- lesson 06's phase 3 (C++ strings): the answer with lines changed, or the kernel's own helpers
def cuda_changed(old: str, new: str) -> str:
    assert old in SOFTMAX_PHASE, old
    return SOFTMAX_PHASE.replace(old, new)


CallsTheKernelsBlockReduce = """  const float max_logit = block_reduce<NUM_WARPS, G>(qk_max, red_smem, -FLT_MAX, MaxOp());
  float exp_sum = 0.f;
  for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) {
    const float e = expf(logits[i] - max_logit);
    logits[i] = e;
    exp_sum += e;
  }
  exp_sum = block_reduce<NUM_WARPS, 1>(exp_sum, red_smem + NUM_WARPS, 0.f, SumOp());
  for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) logits[i] /= exp_sum;
  __syncthreads();
"""
CallsTheKernelsButterfly = cuda_changed(
    """  for (int mask = WARP_SIZE / 2; mask >= G; mask /= 2) {
    m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, mask));  // lane l and lane l ^ mask
  }
""", "  m = butterfly<WARP_SIZE / 2, G>(m, [](float a, float b) { return fmaxf(a, b); });\n")
MaxInsideEachWarpOnly = cuda_changed(
    """  if (lane == 0) red_smem[warp] = m;  // one maximum per warp
  __syncthreads();  // every warp's maximum (and every logit of phase 2) is written
  m = lane < NUM_WARPS ? red_smem[lane] : -FLT_MAX;
  for (int mask = NUM_WARPS / 2; mask >= 1; mask /= 2) {
    m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, mask));
  }
  const float max_logit = __shfl_sync(FULL_MASK, m, 0);  // lanes >= NUM_WARPS hold -FLT_MAX
""", "  __syncthreads();\n  const float max_logit = m;\n")
ExpLoopStridesByAWarp = cuda_changed(
    "for (int i = threadIdx.x; i < num_tokens; i += NUM_THREADS) {\n    const float e",
    "for (int i = threadIdx.x; i < num_tokens; i += WARP_SIZE) {\n    const float e")
ShflDownWithoutABroadcast = cuda_changed(
    "m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, mask));",
    "m = fmaxf(m, __shfl_down_sync(FULL_MASK, m, mask));").replace(
    "const float max_logit = __shfl_sync(FULL_MASK, m, 0);", "const float max_logit = m;")
NoBarrierBetweenTheWarps = cuda_changed(
    "  __syncthreads();  // every warp's maximum (and every logit of phase 2) is written\n", "")


# -- the table: (component, mistake, the mutant) ---------------------------------------------------
MUTANTS = [
    ("FreeListAllocator", "allocate without ref_count = 1", AllocateWithoutRefCount),
    ("FreeListAllocator", "allocates from the bottom of the stack", known.AllocatesFromTheFront),
    ("FreeListAllocator", "acquire forgets the count", known.AcquireForgetsTheCount),
    ("FreeListAllocator", "a free counter of its own", known.CountsAllocationsForTheFreeNumber),
    ("FreeListAllocator", "free blocks listed bottom first", known.ListsTheFreeBlocksBottomFirst),
    ("BlockSpaceManager", "allocate forgets the others' references",
     known.AllocateWithoutTheOthersReferences),
    ("BlockSpaceManager", "append_slot opens a block one token early", AppendSlotOpensABlockEarly),
    ("BlockSpaceManager", "can_allocate counts shared blocks per sequence",
     known.CanAllocateCountsSharedBlocksPerSequence),
    ("BlockSpaceManager", "copy-on-write keeps the old reference",
     known.CopyOnWriteKeepsTheOldReference),
    ("BlockSpaceManager", "free releases the first block first", known.FreeFirstBlockFirst),
    ("BlockSpaceManager", "fork shares the parent's list", known.ForkSharesTheParentsList),
    ("BlockSpaceManager", "get_blocks gives the list it keeps", GetBlocksGivesItsOwnList),
    ("BlockSpaceManager", "set_blocks keeps the old table (swapping)",
     SetBlocksKeepsTheOldTable),
    ("BlockSpaceManager", "a forked child's request is its own",
     ForkedChildGetsARequestOfItsOwn),
    ("Scheduler", "a recomputed group goes to the back of waiting", RecomputeToTheBack),
    ("Scheduler", "resume ignores max_num_seqs", ResumesPastTheLimit),
    ("Scheduler", "swap-out forgets SWAPPED", SwapOutForgetsSwapped),
    ("Scheduler", "preempts the oldest", known.PreemptsTheOldest),
    ("Scheduler", "recompute keeps the blocks", known.RecomputeKeepsTheBlocks),
    ("Scheduler", "resumes in a step that preempted", known.ResumesInAStepThatPreempted),
    ("Scheduler", "decodes cost no budget", known.DecodesCostNoBudget),
    ("Attention", "ignores sliding_window", IgnoresTheWindow),
    ("Attention", "reads the cache before writing it", known.ReadsTheCacheBeforeWriting),
    ("Attention", "one prompt for all", known.OnePromptForAll),
    ("Attention", "writes only the decode keys", known.WritesOnlyTheDecodeKeys),
    ("Attention", "chunks read the decode tables", known.ChunksReadTheDecodeTables),
    ("prepare_inputs", "context lens without the new token", known.ContextLensWithoutTheNewToken),
    ("prepare_inputs", "tables padded with -1", known.TablesPaddedWithMinusOne),
    ("prepare_inputs", "no metadata", known.ReturnsNoMetadata),
    ("admit_waiting", "admits past max_num_seqs", AdmitsPastTheLimit),
    ("admit_waiting", "admits past a group with chunks left", known.AdmitsPastAGroupWithChunksLeft),
    ("admit_waiting", "skips a group that does not fit", known.SkipsAGroupThatDoesNotFit),
    ("Sampler", "ignores presence and frequency penalties", NoPenalties),
    ("Sampler", "ignores top-k", NoTopK),
    ("Sampler", "reports no top logprobs", NoTopLogprobs),
    ("Sampler", "penalises the prompt too", known.PenalisesThePromptToo),
    ("Sampler", "one draw for a shared prompt row", known.OneDrawForASharedPromptRow),
    ("Sampler", "a token as a tensor", known.TokenAsATensor),
    ("PrefixCachingAllocator", "a reset counted as evictions", ResetCountsEvictions),
    ("PrefixCachingAllocator", "evicts the most recently used", EvictsTheMostRecentlyUsed),
    ("PrefixCachingAllocator", "evictable blocks not counted free", EvictableNotCountedFree),
    ("PrefixCachingAllocator", "evictable blocks listed before the truly free",
     EvictableListedFirst),
    ("PrefixCachingAllocator", "reset with blocks held", ResetWithBlocksHeld),
    ("PrefixCachingAllocator", "swap-in trusts the name", SwapInTrustsTheName),
    ("PrefixCachingAllocator", "adopt takes the name from a cached block", AdoptTakesTheName),
    ("PrefixCachingAllocator", "a swapped-out copy has no name", SwapCopyForgetsTheName),
    ("PrefixCachingAllocator", "_name_block keeps the same-name block",
     NameBlockKeepsTheSameNameBlock),
    ("PrefixCachingAllocator", "free forgets the cache", known.FreeForgetsTheCache),
    ("PrefixCachingAllocator", "acquire leaves the block evictable",
     known.AcquireLeavesTheBlockEvictable),
    ("PrefixCachingAllocator", "evictions uncounted", known.EvictionsUncounted),
    ("PrefixCachingAllocator", "lookup past max_blocks", known.LookupPastMaxBlocks),
    ("greedy_verify", "verifies past the first miss", known.verify_past_the_first_miss),
    ("greedy_verify", "the draft as the correction", known.verify_with_the_draft_as_correction),
    ("rejection_sample", "no bonus token", known.NoBonusToken),
    ("rejection_sample", "acceptance flipped", known.AcceptsWhenUBelowPOverQFlipped),
    ("softmax_phase_cuda", "calls the kernel's block_reduce", CallsTheKernelsBlockReduce),
    ("softmax_phase_cuda", "calls the kernel's butterfly", CallsTheKernelsButterfly),
    ("softmax_phase_cuda", "a max reduced inside each warp only", MaxInsideEachWarpOnly),
    ("softmax_phase_cuda", "the exp loop strides by WARP_SIZE", ExpLoopStridesByAWarp),
    ("softmax_phase_cuda", "__shfl_down_sync without a broadcast", ShflDownWithoutABroadcast),
    ("softmax_phase_cuda", "no barrier between the warps", NoBarrierBetweenTheWarps),
] + [("LLMEngine.step", what, lesson16.wrong_step(what)) for what in lesson16.WRONG_STEPS]

# lesson 18: a GGUF Q4_1 block's 32 weights
Q4_1NibblesSwapped = changed(
    a18, "dequantize_q4_1", ("torch.cat([codes & 0x0F, codes >> 4], dim=1)",
                             "torch.cat([codes >> 4, codes & 0x0F], dim=1)"))
Q4_1MinBeforeTheScale = changed(a18, "dequantize_q4_1", ("return d * q + m", "return d * (q + m)"))
Q4_1BlockOf18Bytes = changed(a18, "dequantize_q4_1", ("codes = blocks[:, 4:]",
                                                      "codes = blocks[:, 2:]"))
Q4_1NeighboursInAByte = changed(
    a18, "dequantize_q4_1", ("torch.cat([codes & 0x0F, codes >> 4], dim=1)",
                             "torch.stack([codes & 0x0F, codes >> 4], dim=2).reshape(-1, 32)"))
Q4_1ShiftsTheBlocksInPlace = changed(  # right for this call; the model's weights are changed
    a18, "dequantize_q4_1", ("    q = torch.cat([codes & 0x0F, codes >> 4], dim=1)",
                             "    low = codes & 0x0F\n    codes >>= 4\n"
                             "    q = torch.cat([low, codes], dim=1)"))
MUTANTS += [
    ("dequantize_q4_1", "nibble order swapped", Q4_1NibblesSwapped),
    ("dequantize_q4_1", "the codes shifted in place (the blocks given change)",
     Q4_1ShiftsTheBlocksInPlace),
    ("dequantize_q4_1", "the min added before the scale", Q4_1MinBeforeTheScale),
    ("dequantize_q4_1", "a block taken for 18 bytes (codes from byte 2)", Q4_1BlockOf18Bytes),
    ("dequantize_q4_1", "a byte's two codes as neighbours", Q4_1NeighboursInAByte),
]

# lesson 20: which entries of a sliding group's table go back to the pool
WindowFirstTokenFreed = changed(
    a20, "blocks_out_of_window", ("first_read = num_tokens - window  #",
                                  "first_read = num_tokens - window + 1  #"))
PartlyInTheWindowFreed = changed(
    a20, "blocks_out_of_window", ("if (i + 1) * block_size <= first_read",
                                  "if i * block_size < first_read"))
DroppedEntriesFreedAgain = changed(a20, "blocks_out_of_window", (" and number != -1:", ":"))
LastEntryFreed = changed(a20, "blocks_out_of_window", ("enumerate(block_table[:-1])",
                                                       "enumerate(block_table)"))
BlockNumbersReturned = changed(a20, "blocks_out_of_window", ("freed.append(i)",
                                                             "freed.append(number)"))
MUTANTS += [
    ("blocks_out_of_window", "the window's first token taken as out of it", WindowFirstTokenFreed),
    ("blocks_out_of_window", "a block partly in the window freed", PartlyInTheWindowFreed),
    ("blocks_out_of_window", "dropped entries freed again", DroppedEntriesFreedAgain),
    ("blocks_out_of_window", "the table's last entry freed", LastEntryFreed),
    ("blocks_out_of_window", "block numbers returned, not indices", BlockNumbersReturned),
]

# Right results, inputs changed: the engine reads the same lists and runs again afterwards.
def verify_popping_the_drafts(target_argmax_ids, draft_token_ids):
    """A learner's loop that consumes the drafts (the acceptance counts then see none)."""
    out, position = [], 0
    while draft_token_ids:
        draft = draft_token_ids.pop(0)
        if draft != target_argmax_ids[position]:
            return out + [target_argmax_ids[position]]
        out.append(draft)
        position += 1
    return out + [target_argmax_ids[position]]


def rejection_sample_residual_in_place(target_probs, draft_token_ids, draft_probs, generator):
    """The residual max(0, p - q) made in the target's own rows, after the right answer."""
    from minipaged.exercises.answers.lesson12 import rejection_sample

    emitted = rejection_sample(target_probs, draft_token_ids, draft_probs, generator)
    if draft_probs is not None:
        target_probs[:len(draft_token_ids)].sub_(draft_probs).clamp_(min=0)
    return emitted


def prepare_inputs_padding_the_tables(seq_runs, block_size, device):
    """A padded table for the tensor, padded in the runs themselves."""
    from minipaged.exercises.answers.lesson08 import prepare_inputs

    longest = max(len(run.block_table) for run in seq_runs)
    for run in seq_runs:
        run.block_table += [0] * (longest - len(run.block_table))
    return prepare_inputs(seq_runs, block_size, device)


# State in the class body: one list or dict for every instance (every pool, every manager).
class StackInTheClassBody(a02.MyFreeListAllocator):
    stack: list = []

    def __init__(self, device, block_size, num_blocks):
        self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
        self.num_evictions = 0
        self.blocks = [PhysicalTokenBlock(device, n, block_size) for n in range(num_blocks)]
        self.stack.extend(self.blocks[::-1])


TablesInTheClassBody = changed(
    a03, "MyBlockSpaceManager",
    ("        self.tables: dict[int, list] = {}  # seq_id -> its blocks, in logical order\n", ""),
    ("    def __init__(self, block_size: int,", "    tables: dict = {}\n\n"
                                                 "    def __init__(self, block_size: int,"))

MUTANTS += [
    ("FreeListAllocator", "the free stack made in the class body", StackInTheClassBody),
    ("BlockSpaceManager", "the tables made in the class body", TablesInTheClassBody),
    ("greedy_verify", "the drafts popped from the list given", verify_popping_the_drafts),
    ("rejection_sample", "the residual made in target_probs", rejection_sample_residual_in_place),
    ("prepare_inputs", "the runs' tables padded in place", prepare_inputs_padding_the_tables),
]

_FIRST_OF_EACH = {}
for _row in MUTANTS:
    _FIRST_OF_EACH.setdefault(_row[0], _row)
FAST = list(_FIRST_OF_EACH.values())  # one mutant per component: the fast tier


def rejected(name: str, mutant) -> bool:
    """Does ``name``'s check reject ``mutant`` (a failing case, not a pass)?"""
    result = workbench.check_component(name, mutant, save=False)
    return result.status == "failed"


def _ids(rows):
    return [f"{name}: {what}" for name, what, _ in rows]


@pytest.mark.parametrize("name, what, mutant", FAST, ids=_ids(FAST))
def test_one_mutant_of_each_component_is_rejected(name, what, mutant):
    assert rejected(name, mutant), (name, what)


@pytest.mark.slow
@pytest.mark.parametrize("name, what, mutant", MUTANTS, ids=_ids(MUTANTS))
def test_every_mutant_is_rejected(name, what, mutant):
    """The whole table (about a minute on two cores)."""
    assert rejected(name, mutant), (name, what)


def test_the_table(capsys):
    """Every component the build track registers has mutants here (at least three each but
    two)."""
    counts = Counter(name for name, _, _ in MUTANTS)
    with capsys.disabled():
        print("\nthe mutation table (mutants per component):")
        for name, count in counts.items():
            print(f"  {name:24} {count}")
        print(f"  {'total':24} {sum(counts.values())}")
    registered = set(workbench.components())
    assert registered <= set(counts), registered - set(counts)
    assert min(counts.values()) >= 2, counts
    assert sum(c >= 3 for c in counts.values()) >= len(counts) - 2, counts


# -- the capstone's net: mistakes its run must reject -------------------------------------------
CAPSTONE_MUTANTS = [("Sampler", "ignores presence and frequency penalties", NoPenalties),
                    ("Sampler", "reports no top logprobs", NoTopLogprobs),
                    ("LLMEngine.step", "the observers are told before the finished groups are "
                     "freed", lesson16.wrong_step("the observers are told before the finished "
                                                   "groups are freed"))]


@pytest.mark.slow
@pytest.mark.parametrize("name, what, mutant", CAPSTONE_MUTANTS, ids=_ids(CAPSTONE_MUTANTS))
def test_the_capstone_rejects_a_mutant_its_workload_reaches(name, what, mutant):
    """The capstone's first run with the one mutant plugged in, next to LLM() (about 20 s
    each): it differs at some step."""
    from minipaged.exercises import capstone

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = capstone._one_run(capstone.Run("run 1, the engine", (name,)), {name: mutant},
                                   max_steps=100, on_step=None)
    finally:
        torch.set_num_threads(threads)
    assert result.mismatch is not None, (name, what)
    assert name in result.ran


# -- hints by cause: the mis-hinted mistakes (and this table's own), each with its gist -
HINTS = [
    ("FreeListAllocator", AllocateWithoutRefCount, "its ref count is not 1", "is a stack"),
    ("BlockSpaceManager", AppendSlotOpensABlockEarly, "opens a new block only when",
     "who else holds"),
    ("Scheduler", known.ResumesInAStepThatPreempted, "not in a step that preempted",
     "reset_for_recompute"),
    ("Scheduler", RecomputeToTheBack, "FIRST in the waiting queue", None),
    ("Scheduler", SwapOutForgetsSwapped, "SequenceStatus.SWAPPED", "your code raised"),
    ("Scheduler", ResumesPastTheLimit, "the sequence limit", None),
    ("Attention", IgnoresTheWindow, "window=self.sliding_window", None),
    ("Sampler", NoPenalties, "penalties come first", None),
    ("Sampler", NoTopLogprobs, "most likely tokens", "penalties"),
    ("PrefixCachingAllocator", NameBlockKeepsTheSameNameBlock,
     "an evictable block holding another prefix under the same name is evicted", "hash_fn"),
    ("PrefixCachingAllocator", ResetCountsEvictions, "a reset is not an eviction for room", None),
    ("PrefixCachingAllocator", SwapInTrustsTheName, "find_equal(copy) gives the cached block",
     None),
    ("softmax_phase_cuda", CallsTheKernelsBlockReduce, "the two reductions written by you",
     None),
    pytest.param("softmax_phase_cuda", MaxInsideEachWarpOnly, "the step across warps",
                 "lane 0", marks=pytest.mark.slow),
    pytest.param("softmax_phase_cuda", ExpLoopStridesByAWarp, "the loop's stride", "a barrier (",
                 marks=pytest.mark.slow),
    ("LLMEngine.step", lesson16.wrong_step("the observers are told before the finished groups "
                                           "are freed"), "the observers see the step as it ends",
     None),
]


HINTS += [
    ("dequantize_q4_1", Q4_1NibblesSwapped, "the halves the other way round", None),
    ("dequantize_q4_1", Q4_1MinBeforeTheScale, "the min is added after the scale", None),
    ("dequantize_q4_1", Q4_1BlockOf18Bytes, "a Q4_1 block is 20 bytes", None),
    ("dequantize_q4_1", Q4_1NeighboursInAByte, "byte i holds weights i and i + 16", None),
    ("dequantize_q4_1", Q4_1ShiftsTheBlocksInPlace, "changed the blocks it was given", None),
    ("FreeListAllocator", StackInTheClassBody, "stack (a list) is made once, in the class body",
     None),
    ("BlockSpaceManager", TablesInTheClassBody, "tables (a dict) is made once, in the class body",
     None),
    ("greedy_verify", verify_popping_the_drafts, "changed the draft_token_ids it was given",
     None),
    ("rejection_sample", rejection_sample_residual_in_place,
     "changed the target_probs it was given", None),
    ("prepare_inputs", prepare_inputs_padding_the_tables, "changed the step it was given", None),
]

HINTS += [
    ("blocks_out_of_window", WindowFirstTokenFreed, "is the first position of the window",
     None),
    ("blocks_out_of_window", PartlyInTheWindowFreed, "are still in the window", None),
    ("blocks_out_of_window", DroppedEntriesFreedAgain, "frees it twice", None),
    ("blocks_out_of_window", LastEntryFreed, "the newest block the sequence holds stays", None),
    ("blocks_out_of_window", BlockNumbersReturned, "return their indices", None),
]


@pytest.mark.parametrize("name, mutant, gist, not_said", HINTS,
                         ids=[f"{v[0]}: {v[2][:30]}"
                              for v in (getattr(h, "values", h) for h in HINTS)])
def test_the_hint_names_the_cause(name, mutant, gist, not_said):
    result = str(workbench.check_component(name, mutant, save=False))
    hint = result.split("hint: ", 1)[1]
    assert gist in hint, result
    if not_said:
        assert not_said not in hint, result
