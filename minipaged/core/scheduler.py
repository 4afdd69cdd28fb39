"""The scheduler: which sequence groups run this step, and what happens to the cache (lesson 04).

Three queues, first-come-first-served:

    waiting  -- new requests, and groups preempted by recompute (their blocks were freed)
    running  -- groups with GPU blocks, all scheduled every step
    swapped  -- groups whose blocks were moved to the CPU pool

One call to ``schedule()`` decides the step and returns the block operations that must happen
before the model runs (``blocks_to_swap_in``, ``blocks_to_swap_out``, ``blocks_to_copy``).

A step has a budget of ``max_num_batched_tokens`` tokens. The running decodes come first (one
token each, and they never wait); prompts fill what is left as ``PrefillChunk``s. With chunked
prefill (the default) a prompt longer than what is left is split, and continues in the next steps
from where it stopped, reading its earlier tokens from the cache; it samples only when its last
chunk has run.

NOTE: decodes are never skipped, even for the budget: every running sequence decodes each step,
so a budget smaller than the number of running sequences is exceeded (budget 1 with an n=2 group
decoding: 2 tokens in the step). Skipping a decode would only delay a request that already holds
its blocks; the budget bounds the prompt work added to a step, not the decodes. (vLLM V1 counts
decodes against the budget too; README lists this among the deliberate differences.)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.lookahead import drop_lookahead, fit_lookahead
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus


class PreemptionMode(enum.Enum):
    RECOMPUTE = "recompute"  # free the blocks; compute the tokens again when readmitted
    SWAP = "swap"  # move the blocks to CPU memory and back


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256  # sequences running at once
    max_num_batched_tokens: int = 4096  # tokens in one step (prompt tokens + one per decode)
    max_model_len: int = 2048
    preemption_mode: str | None = None  # None: recompute single sequences, swap groups
    # Split prompts into chunks that fill what the step's budget leaves after the decodes.
    enable_chunked_prefill: bool = True


@dataclass
class PrefillChunk:
    """Tokens ``[start, end)`` of ``seq`` computed in one step.

    They attend to the tokens before ``start`` (already in the cache, or written by an earlier
    chunk of the same step) and causally to themselves. ``seq_ids`` are the sequences whose
    cache this fills (several when they share the blocks); when ``end`` is the sequence's
    length the last token's logits give each of them its next token (``sample``).
    """

    seq_group: SequenceGroup
    seq: Sequence
    start: int
    end: int
    seq_ids: list[int]

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def sample(self) -> bool:
        return self.end == self.seq.get_len()


@dataclass
class SchedulerOutputs:
    scheduled_seq_groups: list[SequenceGroup]
    prompt_run: list[bool]  # per scheduled group: is this a prefill run (it has chunks)?
    num_batched_tokens: int
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    preempted: list[tuple[str, str]] = field(default_factory=list)  # (request_id, mode)
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    decode_seq_groups: list[SequenceGroup] = field(default_factory=list)

    def is_empty(self) -> bool:
        return (not self.scheduled_seq_groups and not self.blocks_to_swap_in
                and not self.blocks_to_swap_out and not self.blocks_to_copy)


def _prefill_progress(seq_group: SequenceGroup) -> list[int] | None:
    """[tokens computed, prompt length] of the sequence whose prefill is under way."""
    if not seq_group.pending_chunks:
        return None
    chunk = seq_group.pending_chunks[0]
    return [chunk.start, chunk.seq.get_len()]


def queue_badge(g: SequenceGroup) -> dict:
    """One group as ``Scheduler.snapshot()`` lists it in a queue (what the visualizer draws)."""
    return {"request_id": g.request_id, "num_seqs": g.num_seqs(),
            "num_unfinished": sum(not s.is_finished() for s in g.get_seqs()),
            "num_tokens": max(s.get_len() for s in g.get_seqs()),
            "seq_ids": [s.seq_id for s in g.get_seqs()],
            # (tokens in the cache, tokens to prefill) while a prompt is half done
            "prefill_progress": _prefill_progress(g)}


def prefix_leader(seqs: list[Sequence]) -> Sequence:
    """The sequence of a recomputed group that computes the shared prefix: the shortest, so
    that the group's first chunk is the cheapest to admit."""
    return min(seqs, key=lambda s: s.get_len())


def plan_prefill(seq_group: SequenceGroup, shared_len: int, identical: bool,
                 cached: dict[int, int] | None = None) -> list[PrefillChunk]:
    """The chunks that compute a group just given its blocks (see ``prompt_layout``).

    ``cached`` (from ``BlockSpaceManager.allocate``) says how many first tokens of each sequence
    came from the prefix cache (lesson 11): they are not computed, a chunk starts after them.

    A fresh group is one chunk: its prompt, computed once for all its sequences, sampled. A group
    recomputed after preemption holds sequences that differ: the first computes the shared
    prefix and its own tokens, the others only their own tokens after the prefix. Each stops one
    token short, so that all of them compute their newest token, and sample, in the same decode
    step (beam search needs its beams in step; seeds then draw in the same order).
    """
    seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
    cached = cached or {}
    if identical:
        start = cached.get(seqs[0].seq_id, 0)
        for seq in seqs:
            seq.num_computed_tokens = start
        return [PrefillChunk(seq_group, seqs[0], start, seqs[0].get_len(),
                             [s.seq_id for s in seqs])]
    leader = prefix_leader(seqs)
    chunks = []
    for seq in [leader] + [s for s in seqs if s is not leader]:
        # The leader's chunk fills the shared blocks the cache did not have.
        start = cached.get(seq.seq_id, 0) if seq is leader else max(
            shared_len, cached.get(seq.seq_id, 0))
        seq.num_computed_tokens = start
        if seq.get_len() - 1 > start:
            chunks.append(PrefillChunk(seq_group, seq, start, seq.get_len() - 1, [seq.seq_id]))
    return chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockSpaceManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self._aborted: list[SequenceGroup] = []  # given up on, not yet taken by the engine
        self.forced_mode = (PreemptionMode(config.preemption_mode)
                            if config.preemption_mode else None)

    # -- queues ----------------------------------------------------------------------------------
    def add_seq_group(self, seq_group: SequenceGroup) -> None:
        self.waiting.append(seq_group)

    def abort_seq_group(self, request_id: str) -> SequenceGroup | None:
        for queue in (self.waiting, self.running, self.swapped):
            for seq_group in queue:
                if seq_group.request_id == request_id:
                    queue.remove(seq_group)
                    for seq in seq_group.get_seqs():
                        if not seq.is_finished():
                            seq.status = SequenceStatus.FINISHED_ABORTED
                        self.block_manager.free(seq)
                    return seq_group
        return None

    def give_up(self, seq_group: SequenceGroup, reason: str) -> None:
        """Abort a group that can never run: free its blocks, record ``reason`` as its error,
        and hand it out by the next ``take_aborted()``.

        Args:
            seq_group: a group in one of the queues.
            reason: why it can never run (the request's error message).
        """
        seq_group.error = reason
        self.abort_seq_group(seq_group.request_id)
        self._aborted.append(seq_group)

    def take_aborted(self) -> list[SequenceGroup]:
        """Groups the scheduler gave up on since the last call."""
        aborted, self._aborted = self._aborted, []
        return aborted

    def has_unfinished_seqs(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get_num_unfinished_seq_groups(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def free_finished_seq_groups(self) -> list[SequenceGroup]:
        finished = [g for g in self.running if g.is_finished()]
        self.running = [g for g in self.running if not g.is_finished()]
        return finished

    def snapshot(self) -> dict:
        bm = self.block_manager
        return {
            "waiting": [queue_badge(g) for g in self.waiting],
            "running": [queue_badge(g) for g in self.running],
            "swapped": [queue_badge(g) for g in self.swapped],
            "num_gpu_blocks": bm.num_total_gpu_blocks,
            "num_free_gpu_blocks": bm.get_num_free_gpu_blocks(),
            "num_cpu_blocks": bm.num_total_cpu_blocks,
            "num_free_cpu_blocks": bm.get_num_free_cpu_blocks(),
        }

    # -- the decision ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutputs:
        blocks_to_swap_in: dict[int, int] = {}
        blocks_to_swap_out: dict[int, int] = {}
        blocks_to_copy: dict[int, list[int]] = {}
        preempted_log: list[tuple[str, str]] = []
        budget = self.config.max_num_batched_tokens  # tokens this step may still take

        # 1. Running groups first, oldest first; each decoding sequence takes one token.
        # NOTE: they already hold blocks and have made progress; serving them first keeps a
        # request's latency bounded and frees their memory soonest.
        self.running.sort(key=lambda g: g.arrival_time)
        running: list[SequenceGroup] = []
        decode_groups: list[SequenceGroup] = []
        while self.running:
            seq_group = self.running.pop(0)
            if seq_group.pending_chunks:  # still prefilling: no new slot, no token to decode
                running.append(seq_group)
                continue
            seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
            fit_lookahead(seqs, budget)  # speculative decoding's proposals (lesson 12)
            while not self.block_manager.can_append_slot(seq_group):
                if drop_lookahead(seqs):
                    continue  # without its proposals it may fit: better than preempting any
                if self.running:
                    # Take memory from the latest arrival (lowest priority).
                    victim = self.running.pop(-1)
                    preempted_log.append(self._preempt(victim, blocks_to_swap_out))
                else:
                    # Nothing left to take from: this group itself goes. (A request that fits
                    # the pool alone never gets here: validate_request refuses the others.)
                    preempted_log.append(self._preempt(seq_group, blocks_to_swap_out))
                    break
            else:
                self._append_slots(seq_group, blocks_to_copy)
                running.append(seq_group)
                decode_groups.append(seq_group)
                budget -= sum(1 + seq.num_lookahead_slots for seq in seqs)
        self.running = running
        preempted = bool(preempted_log)

        # 2. Prefill chunks of running groups that were admitted with more work than fit.
        chunks: list[PrefillChunk] = []
        stalled = False
        for seq_group in self.running:
            if seq_group.pending_chunks and not stalled:
                budget = self._take_chunks(seq_group, budget, chunks)
                # FCFS: nothing younger may take the budget before this group is done.
                stalled = bool(seq_group.pending_chunks)

        # 3. Swapped groups come back before anything new is admitted.
        self.swapped.sort(key=lambda g: g.arrival_time)
        while self.swapped and not preempted and not stalled:
            seq_group = self.swapped[0]
            if not self.block_manager.can_swap_in(seq_group):
                break
            num_new = seq_group.num_seqs(SequenceStatus.SWAPPED)
            if self._num_running_seqs() + num_new > self.config.max_num_seqs:
                break
            decodes = not seq_group.pending_chunks
            if decodes and num_new > budget and not self.config.enable_chunked_prefill:
                break  # (with chunking, decodes never wait for the budget)
            self.swapped.pop(0)
            blocks_to_swap_in.update(self.block_manager.swap_in(seq_group))
            for seq in seq_group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            self.running.append(seq_group)
            if decodes:
                self._append_slots(seq_group, blocks_to_copy)
                decode_groups.append(seq_group)
                budget -= num_new

        # 4. Admit waiting groups, only while nothing is swapped out, was just preempted, or
        # waits for the budget.
        if not self.swapped and not preempted and not stalled:
            self.waiting.sort(key=lambda g: g.arrival_time)
            while self.waiting:
                seq_group = self.waiting[0]
                _, shared_len, identical = self.block_manager.prompt_layout(seq_group)
                first_chunk = (seq_group.get_seqs(SequenceStatus.WAITING)[0].get_len()
                               if identical else self._shortest_waiting_len(seq_group) - 1)
                if first_chunk > budget:
                    # Tokens found in the prefix cache are not computed (lesson 11).
                    first_chunk -= self._num_cached_first_chunk(seq_group, identical)
                if budget < (1 if self.config.enable_chunked_prefill else first_chunk):
                    break
                num_new = seq_group.get_max_num_running_seqs()
                if self._num_running_seqs() + num_new > self.config.max_num_seqs:
                    break
                if not self.block_manager.can_allocate(seq_group):
                    break
                self.waiting.pop(0)
                cached = self.block_manager.allocate(seq_group)
                for seq in seq_group.get_seqs(SequenceStatus.WAITING):
                    seq.status = SequenceStatus.RUNNING
                seq_group.pending_chunks = plan_prefill(seq_group, shared_len, identical, cached)
                self.running.append(seq_group)
                budget = self._take_chunks(seq_group, budget, chunks)
                if seq_group.pending_chunks:
                    break  # the budget is spent: younger groups wait (FCFS)

        prompt_groups = list({id(c.seq_group): c.seq_group for c in chunks}.values())
        return SchedulerOutputs(
            scheduled_seq_groups=prompt_groups + decode_groups,
            prompt_run=[True] * len(prompt_groups) + [False] * len(decode_groups),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            blocks_to_swap_in=blocks_to_swap_in,
            blocks_to_swap_out=blocks_to_swap_out,
            blocks_to_copy=blocks_to_copy,
            preempted=preempted_log,
            prefill_chunks=chunks,
            decode_seq_groups=decode_groups,
        )

    def _take_chunks(self, seq_group: SequenceGroup, budget: int,
                     chunks: list[PrefillChunk]) -> int:
        """Move the group's pending chunks that fit the budget into ``chunks``.

        With chunked prefill, the first chunk that does not fit is split: its first ``budget``
        tokens run now, the rest waits for the next step. Returns the budget left.
        """
        while seq_group.pending_chunks and budget > 0:
            chunk = seq_group.pending_chunks[0]
            if chunk.num_tokens <= budget:
                budget -= self._take_chunk(seq_group, chunks)
            elif self.config.enable_chunked_prefill:
                split = chunk.start + budget
                seq_group.pending_chunks.insert(0, PrefillChunk(seq_group, chunk.seq, chunk.start,
                                                                split, chunk.seq_ids))
                chunk.start = split
                budget -= self._take_chunk(seq_group, chunks)
            else:
                break
        return budget

    def _num_running_seqs(self) -> int:
        return sum(g.num_seqs(SequenceStatus.RUNNING) for g in self.running)

    def _take_chunk(self, seq_group: SequenceGroup, chunks: list[PrefillChunk]) -> int:
        """Schedule the group's next prefill chunk in this step; returns its number of tokens."""
        chunk = seq_group.pending_chunks.pop(0)
        chunks.append(chunk)
        self.block_manager.cache_blocks(chunk.seq, chunk.end)  # computed in this step
        return chunk.num_tokens

    def _num_cached_first_chunk(self, seq_group: SequenceGroup, identical: bool) -> int:
        """How many tokens of the group's first chunk the prefix cache already holds."""
        cached = self.block_manager.cached_prefix(seq_group)
        if identical:
            return len(next(iter(cached.values()))) * self.block_manager.block_size
        leader = prefix_leader(seq_group.get_seqs(SequenceStatus.WAITING))
        return len(cached[leader.seq_id]) * self.block_manager.block_size

    @staticmethod
    def _shortest_waiting_len(seq_group: SequenceGroup) -> int:
        return min(s.get_len() for s in seq_group.get_seqs(SequenceStatus.WAITING))

    def _append_slots(self, seq_group: SequenceGroup, blocks_to_copy: dict) -> None:
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            if seq.num_computed_tokens == 0:
                continue  # a prefill run: its blocks were allocated for all its tokens
            for src, dst in self.block_manager.reserve_slot(seq):
                blocks_to_copy.setdefault(src, []).append(dst)

    # -- preemption ------------------------------------------------------------------------------
    def _preempt(self, seq_group: SequenceGroup, blocks_to_swap_out: dict) -> tuple[str, str]:
        mode = self.forced_mode
        if mode is None:
            # NOTE: a single sequence is cheap to recompute (its prompt and outputs become one
            # prompt); a group of sequences would compute their shared prefix once and each its
            # own tokens again, so it is swapped instead when there is room.
            if seq_group.get_max_num_running_seqs() == 1:
                mode = PreemptionMode.RECOMPUTE
            else:
                mode = PreemptionMode.SWAP
        if mode is PreemptionMode.SWAP and not self.block_manager.can_swap_out(seq_group):
            # NOTE: out of swap space: recomputing needs no room anywhere, so it always works.
            mode = PreemptionMode.RECOMPUTE
        if mode is PreemptionMode.RECOMPUTE:
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                self.block_manager.free(seq)
                seq.reset_for_recompute()
            seq_group.pending_chunks = []
            # Back to the front of the waiting queue (its arrival time keeps it first in line).
            self.waiting.insert(0, seq_group)
        else:
            blocks_to_swap_out.update(self.block_manager.swap_out(seq_group))
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq_group)
        self.block_manager.record_preemption(seq_group, mode.value)
        return seq_group.request_id, mode.value
