"""Lesson 19 exercise: a mystery engine, the package's engine with one hidden fault.

    mystery = draw_mystery(seed)           # a fault drawn by the seed, and a workload of its own
    reference = mystery.reference()        # the package's LLMEngine
    suspect = mystery.engine()             # the same, with the fault active during its calls
    workload = mystery.workload(reference.encode)
    ...                                    # the learner records both and uses the tools of
                                           # minipaged/lab/engine_diff.py and invariants.py
    check_diagnosis(diagnosis, mystery, reference_run, suspect_run)

    diagnosis() -> (component, step, cause)
        component: one of COMPONENTS, the part that is wrong
        step: the first step at which the two engines differ (what ``engine_diff.compare`` names)
        cause: the number of the line of CAUSES that says what goes wrong

A fault is a few package functions replaced, with ``unittest.mock.patch``, inside a context
manager that the suspect enters for each of its own calls and leaves after it: the reference
engine next to it never sees the fault. Which fault a seed draws is not printed anywhere.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import torch

from minipaged.core import block_manager, prefix_caching_allocator
from minipaged.core.allocator import FreeListAllocator
from minipaged.core.lookahead import num_lookahead_blocks
from minipaged.core.scheduler import Scheduler
from minipaged.engine import llm_engine, output_processor
from minipaged.exercises.checking import CheckResult, NotDone, use_solutions
from minipaged.exercises.lesson19_reported import REPORTED
from minipaged.exercises.mystery_engine import MysteryEngine
from minipaged.kernels import ops, reference as attention_reference
from minipaged.lab.engine_diff import Recording, Request, compare
from minipaged.sampling_params import SamplingParams
from minipaged.sequence import SequenceStatus

# The lesson's engine: the embedded SmolLM2 on the CPU, blocks of 4 tokens, a pool small enough
# that the workload preempts, prefix caching on.
SETTINGS = dict(block_size=4, num_gpu_blocks=13, num_cpu_blocks=16, max_model_len=40,
                watermark=0.0, device="cpu", dtype="float32", seed=0,
                cpu_threads=1)  # both engines of a comparison compute alike, whatever the load

COMPONENTS = ["FreeListAllocator", "BlockSpaceManager", "PrefixCachingAllocator", "Scheduler",
              "prepare_inputs", "paged_attention", "Sampler", "OutputProcessor"]

CAUSES = [
    "the scheduler preempts the oldest group instead of the newest",
    "free returns a block to the free list while another table still holds it",
    "a decode token's key and value are written one slot past its position",
    "a shared last block is written without copy-on-write",
    "the stop check runs before the new token is appended",
    "V2's combine of the partitions leaves out their common maximum",
    "the room check before a decode leaves out the new block a sequence's newest token opens",
    "the sampler draws every sequence of a group from one generator",
    "an abort drops the request without freeing its blocks",
    "a fork shares the parent's blocks without counting the new holder",
    "the prompt's attention is not causal: a token sees the tokens after it",
    "a decode attends to every cached token but the newest",
    "a prefix-cache hit is taken without comparing the tokens before the block",
    "swapped groups come back in the step that preempted",
] + [r.cause for r in REPORTED]


# -- the faults ------------------------------------------------------------------------------------
# Each is written anew here, as a learner's mistake would be; the package's own code is unchanged.
def _free_always(self, block):
    if block.ref_count == 0:
        raise ValueError(f"double free of {block}")
    block.ref_count -= 1
    self.free_blocks.insert(0, block)  # (to the far end: the last to be handed out again)


def _append_in_place(self, seq):
    table = self.block_tables[seq.seq_id]
    if len(table) < len(seq.logical_token_blocks):
        table.append(self.gpu_allocator.allocate())
    elif seq.get_len() % self.block_size == 0:
        self.cache_blocks(seq, seq.get_len())
    return None


def _room_for_copies_only(self, seqs):
    needed, writers, shared = 0, {}, {}
    for seq in seqs:
        if seq.num_computed_tokens == 0:
            continue
        last = self.block_tables[seq.seq_id][-1]
        if last.ref_count > 1:
            shared[id(last)] = last
            writers[id(last)] = writers.get(id(last), 0) + 1
        needed += num_lookahead_blocks(seq, self.block_size)
    return needed + sum(writers[k] - (writers[k] == b.ref_count) for k, b in shared.items())


def _fork_uncounted(self, parent, child):
    self.block_tables[child.seq_id] = list(self.block_tables[parent.seq_id])
    self.seqs[child.seq_id] = child
    self.seq_request[child.seq_id] = self.seq_request[parent.seq_id]


def _inputs_changed(change: Callable) -> Callable:
    package_prepare = llm_engine.prepare_inputs

    def prepare(seq_runs, block_size, device, drafts=None):
        inputs = package_prepare(seq_runs, block_size, device, drafts)
        num_decodes = sum(1 for r in seq_runs if not r.is_prompt)
        if num_decodes:
            change(inputs.meta, num_decodes, block_size)
        return inputs
    return prepare


def _slot_one_late(meta, num_decodes, block_size):
    slots = meta.slot_mapping[-num_decodes:]  # (D,) the decode tokens come last
    meta.slot_mapping[-num_decodes:] = slots // block_size * block_size + \
        (slots % block_size + 1) % block_size


def _context_one_short(meta, num_decodes, block_size):
    meta.context_lens -= 1  # (D,)


PARTITION = 8  # tokens per V2 partition here (vLLM: 512), so that these short contexts split


def _v2_without_common_max(query, key_cache, value_cache, block_tables, context_lens, scale,
                           max_context_len=None, kv_scales=None, window=None):  # (no window here)
    num_seqs, num_heads, head_size = query.shape
    k, v = attention_reference.gather_kv(key_cache, value_cache, block_tables, kv_scales)
    group = num_heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # (S, H, L, D)
    v = v.float().repeat_interleave(group, dim=1)  # (S, H, L, D)
    logits = torch.einsum("shd,shld->shl", query.float(), k) * scale  # (S, H, L)
    beyond = torch.arange(k.shape[2])[None, :] >= context_lens.long()[:, None]  # (S, L)
    logits = logits.masked_fill(beyond[:, None, :], float("-inf"))
    v = v.masked_fill(beyond[:, None, :, None], 0.0)
    outs, sums = [], []
    for part, values in zip(logits.split(PARTITION, -1), v.split(PARTITION, 2)):
        top = part.amax(-1, keepdim=True).clamp_min(-1e30)  # (S, H, 1) this partition's max
        e = torch.exp(part - top)  # (S, H, P)
        sums.append(e.sum(-1, keepdim=True))  # (S, H, 1)
        outs.append(torch.einsum("shp,shpd->shd", e, values) / sums[-1].clamp_min(1e-30))
    weights = torch.stack(sums)  # (partitions, S, H, 1): each against its own maximum
    out = (torch.stack(outs) * weights).sum(0) / weights.sum(0)  # (S, H, D)
    return out.to(query.dtype)


def _stop_checked_first(self, seq_group, outputs, scheduler):
    for seq_id, out in outputs.items():
        if out.parent_seq_id != seq_id:
            seq, parent = seq_group.find(seq_id), seq_group.find(out.parent_seq_id)
            scheduler.free_seq(seq)
            seq.copy_state_from(parent)
            scheduler.fork_seq(parent, seq)
    for seq_id, out in outputs.items():
        seq = seq_group.find(seq_id)
        self.check_stop(seq, seq_group.sampling_params)
        seq.append_token_id(out.token_id, out.logprobs)
        if seq.is_finished():
            scheduler.free_seq(seq)
    if seq_group.is_finished():
        self.detokenize_all(seq_group)


def _abort_without_free(self, request_id):
    for queue in (self.waiting, self.running, self.swapped):
        for seq_group in queue:
            if seq_group.request_id == request_id:
                queue.remove(seq_group)
                for seq in seq_group.get_seqs():
                    if not seq.is_finished():
                        seq.status = SequenceStatus.FINISHED_ABORTED
                return seq_group
    return None


def _tokens_only(self, block, parent, token_ids):
    return self.contents[block.block_number].token_ids == token_ids


def _named_by_own_tokens(parent_hash, token_ids):
    return prefix_caching_allocator.block_hash(None, token_ids)


def _patch(target, name: str, value):  # (an engine -> the context manager that patches)
    return lambda engine: mock.patch.object(target, name, value)


@dataclass(frozen=True)
class _Fault:
    component: str
    cause: int  # index into CAUSES
    patches: tuple  # engine -> a context manager that patches one name
    tool: str  # the question for a wrong component: what to read in the tools' evidence
    why: str  # the question for a wrong cause (never the cause in other words)
    reported: str = ""  # where the same bug was reported against a real engine, if it was


_BM = block_manager.BlockSpaceManager
_FAULTS = (
    _Fault("FreeListAllocator", 1, (_patch(FreeListAllocator, "free", _free_always),),
           "Which invariant broke first, and which component writes the state it names?",
           "What was the ref count of the block the violation names one step before, and how "
           "many tables held it then?"),
    _Fault("BlockSpaceManager", 3, (_patch(_BM, "append_slot", _append_in_place),),
           "The first field that differs is part of the schedule: which component fills it?",
           "In the players at that step, which sequences hold the block the reference's field "
           "names, and where does each one's newest token go?"),
    _Fault("BlockSpaceManager", 6, (_patch(_BM, "num_blocks_to_append", _room_for_copies_only),),
           "The line that raised is only where it was noticed: at that step, what did the "
           "reference do instead, and which check decided it?",
           "How many free blocks were there before that step, and how many did the running "
           "sequences' newest tokens need?"),
    _Fault("BlockSpaceManager", 9, (_patch(_BM, "fork", _fork_uncounted),),
           "Which invariant broke first? Which operations add a holder to a block?",
           "Which request holds the block the violation names, and what did its sequences do "
           "in that step?"),
    _Fault("prepare_inputs", 2, (_patch(llm_engine, "prepare_inputs",
                                        _inputs_changed(_slot_one_late)),),
           "The inputs differ while the schedule agrees: which function turns a schedule "
           "into inputs?",
           "For the token the comparison names, which slot does its position give through its "
           "block table, and which slot did it get?"),
    _Fault("prepare_inputs", 11, (_patch(llm_engine, "prepare_inputs",
                                         _inputs_changed(_context_one_short)),),
           "The inputs differ while the schedule agrees: which function turns a schedule "
           "into inputs?",
           "For the sequence the comparison names, how many tokens does it hold, and what "
           "number did its input carry?"),
    _Fault("paged_attention", 5, (_patch(ops, "paged_attention", _v2_without_common_max),),
           "The inputs agree and the logits differ: which part of the model reads the cache?",
           "Which rows differ, prompts or decodes, and from which context length on?"),
    _Fault("OutputProcessor", 4, (_patch(output_processor.OutputProcessor, "process",
                                         _stop_checked_first),),
           "The tokens agree and something else about the sequence does not: which "
           "component decides it after each token?",
           "How many tokens had the sequence generated at that step, and how many does its "
           "request allow?"),
    _Fault("Scheduler", 8, (_patch(Scheduler, "abort_seq_group", _abort_without_free),),
           "Which invariant broke first, for which request, and what did the workload do to "
           "that request?",
           "What happened to that request just before the step, and which blocks does it "
           "hold after it?"),
    _Fault("PrefixCachingAllocator", 12, (
        _patch(prefix_caching_allocator.PrefixCachingAllocator, "_same_contents", _tokens_only),
        lambda engine: mock.patch.object(engine.scheduler.block_manager.gpu_allocator,
                                         "hash_fn", _named_by_own_tokens)),
           "Which invariant broke first? Which component can hand one block to two requests?",
           "Do the two requests that share the block agree on every token up to its end?"),
) + tuple(_Fault(r.component, CAUSES.index(r.cause), r.patches, r.tool, r.why, r.reported)
          for r in REPORTED)  # bugs reported against vLLM, nano-vllm and mini-sglang


# -- the mystery -----------------------------------------------------------------------------------
class Mystery:
    """One drawn mystery: a hidden fault and a workload, both from ``seed``."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._fault = random.Random(f"fault {seed}").choice(_FAULTS)

    def reference(self, **settings):
        """The package's ``LLMEngine`` with the lesson's ``SETTINGS`` (and ``settings`` over
        them; tests pass a tiny model as ``model``)."""
        from minipaged.engine.llm_engine import LLMEngine

        merged = {**SETTINGS, **settings}
        with torch.random.fork_rng():
            torch.manual_seed(0)  # (a random model's weights: the same in both engines)
            return LLMEngine(merged.pop("model", None), **merged)

    def engine(self, **settings) -> MysteryEngine:
        """The same engine with the hidden fault."""
        return MysteryEngine(self.reference(**settings), self._fault)

    def workload(self, encode: Callable[[str], list[int]], block_size: int = 4) -> list[Request]:
        """Seven requests, their lengths, arrivals and seeds drawn from the seed: greedy ones,
        parallel sampling (n = 2), beam search, two prompts that start with a block of a third,
        an abort; enough to fill the pool and preempt.

        Args:
            encode: text -> token ids (``reference.encode``).
            block_size: the engine's.
        """
        rng = random.Random(f"workload {self.seed}")
        chunks = [encode(" " + p)[:block_size] for p in _PHRASES]  # (spaces between chunks)
        if any(len(c) < block_size for c in chunks) or len(set(map(tuple, chunks))) < len(chunks):
            raise ValueError(f"encode must give each phrase its own first {block_size} tokens")
        rng.shuffle(chunks)
        a, b, x, *rest = chunks
        tail = lambda: rest[rng.randrange(len(rest))][:rng.randint(1, block_size - 1)]  # noqa
        greedy = lambda m: SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)  # noqa
        return [
            Request(x + b + rest[0] + tail(), greedy(rng.randint(14, 18))),
            Request(a + rest[4] + tail(), greedy(12), abort_at_step=rng.randint(3, 4)),
            Request(rest[1] + tail(), SamplingParams(n=2, temperature=0.8, seed=rng.randrange(
                1000), max_tokens=rng.randint(7, 9), ignore_eos=True)),
            Request(a + b + tail(), greedy(rng.randint(5, 7)), 1),
            Request(rest[2] + rest[3] + tail(), SamplingParams(n=3, use_beam_search=True,
                    temperature=0, max_tokens=rng.randint(5, 7), ignore_eos=True), 1),
            Request(rest[5] + rest[6] + tail(), greedy(rng.randint(6, 9)), rng.randint(3, 4)),
            Request(rest[7] + tail(), greedy(rng.randint(6, 9)), rng.randint(5, 6)),
        ]


_PHRASES = ["A paged KV cache keeps each token", "Schedulers run every group at once",
            "Copy on write means a private block", "Blocks of four tokens hold the keys",
            "Swapping moves a group to the CPU", "Beam search keeps the best candidates",
            "Prefix caching finds the same prompt", "Samplers draw the next token",
            "Engines step the model once", "Newest requests are preempted first",
            "Attention reads the cache block by block"]


def draw_mystery(seed: int | None = None) -> Mystery:
    """A mystery engine: the fault and the workload follow from ``seed`` (None: a new seed)."""
    seed = random.SystemRandom().randrange(1, 100_000) if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer or None, got {seed!r}")
    return Mystery(seed)


# -- the check -------------------------------------------------------------------------------------
def _answer_error(answer) -> str | None:
    if not (isinstance(answer, tuple) and len(answer) == 3):
        return "return a tuple (component, step, cause), e.g. (\"Scheduler\", 7, 3)"
    component, step, cause = answer
    if component not in COMPONENTS:
        return f"the component is one of COMPONENTS: {', '.join(COMPONENTS)}; got {component!r}"
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        return f"the step is a step number (an int from 1), got {step!r}"
    if isinstance(cause, bool) or not isinstance(cause, int) or not 1 <= cause <= len(CAUSES):
        return f"the cause is the number of a line of CAUSES, 1 to {len(CAUSES)}, got {cause!r}"
    return None


def check_diagnosis(fn: Callable[[], tuple], mystery: Mystery, reference_run: Recording,
                    suspect_run: Recording) -> CheckResult:
    """Check ``fn()`` = (component, first step, cause number) against ``mystery``'s fault.

    Args:
        fn: the learner's function.
        mystery: the mystery drawn (``draw_mystery``).
        reference_run, suspect_run: ``engine_diff.record`` of the reference and of the suspect
            on ``mystery.workload(...)``; the first step is the first difference between them.
    """
    fault = mystery._fault
    found = compare(reference_run, suspect_run)
    step = found.step if found is not None else None
    try:
        result = _verdict(fn(), fault, step)
    except NotDone:
        if use_solutions():
            result = CheckResult(f"diagnosis: not done yet, so the solution was used: "
                                 f"{_reveal((fault.component, step, fault.cause + 1))}",
                                 "solution used")
        else:
            result = CheckResult("… diagnosis: not done yet. Return (component, step, cause) in "
                                 "place of not_done(), then run the cell again.", "not done")
    print(result)
    return result


def _reveal(answer) -> str:
    return f"{answer[0]}, step {answer[1]}: {CAUSES[answer[2] - 1]}"


def _verdict(answer, fault: _Fault, step: int | None) -> CheckResult:
    problem = _answer_error(answer)
    if problem is not None:
        return CheckResult(f"✗ diagnosis: {problem}", "failed")
    component, their_step, cause = answer
    if step is None:
        return CheckResult("✗ diagnosis: these two recordings do not differ: record the "
                           "reference and the suspect on the mystery's workload", "failed")
    if component != fault.component:
        return CheckResult(f"✗ diagnosis: the fault is not in {component}. Hint: {fault.tool}",
                           "failed")
    if their_step != step:
        return CheckResult(f"✗ diagnosis: {component} is right; step {their_step} is not the "
                           f"first step at which the engines differ: "
                           f"compare(reference_run, suspect_run) names it", "failed")
    if cause != fault.cause + 1:
        return CheckResult(f"✗ diagnosis: {component} and step {step} are right; cause {cause} "
                           f"is not what goes wrong. Hint: {fault.why}", "failed")
    seen = f" (the same bug was reported: {fault.reported})" if fault.reported else ""
    return CheckResult(f"✓ diagnosis: {_reveal(answer)}{seen}", "passed")


__all__ = ["CAUSES", "COMPONENTS", "SETTINGS", "Mystery", "MysteryEngine", "check_diagnosis",
           "draw_mystery"]
