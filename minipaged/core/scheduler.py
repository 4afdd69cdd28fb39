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
import logging
from dataclasses import dataclass

from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.lookahead import drop_lookahead, fit_lookahead
from minipaged.core.prefill_plan import PrefillChunk, plan_prefill, prefix_leader
from minipaged.core.scheduler_outputs import PoolCounts, SchedulerOutputs, StepPlan, queue_badge
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus
from minipaged.step_record import SequenceRun

logger = logging.getLogger("minipaged")


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


class Scheduler:
    """The three queues and the ``BlockSpaceManager``, which only the scheduler holds.

    Args:
        config: the limits of a step.
        block_manager: the block manager of the KV pools (``with_pools`` builds one).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockSpaceManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[SequenceGroup] = []
        self.running: list[SequenceGroup] = []
        self.swapped: list[SequenceGroup] = []
        self._aborted: list[SequenceGroup] = []  # given up on, not yet taken by the engine
        self.forced_mode = (PreemptionMode(config.preemption_mode)
                            if config.preemption_mode else None)

    @classmethod
    def with_pools(cls, config: SchedulerConfig, block_size: int, num_gpu_blocks: int,
                   num_cpu_blocks: int, watermark: float = 0.01,
                   enable_prefix_caching: bool = False) -> Scheduler:
        """A scheduler with a new block manager of these pools (the arguments are
        ``BlockSpaceManager``'s)."""
        return cls(config, BlockSpaceManager(block_size, num_gpu_blocks, num_cpu_blocks,
                                             watermark, enable_prefix_caching))

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

    def break_stall(self) -> str | None:
        """Nothing runs and the head of a queue can never be admitted: give up on it (as
        ``give_up``), keep the rest. Returns why, or None when the queues are empty.

        NOTE: a last resort that should never fire: ``validate_request`` refuses every request
        that cannot run alone, and a request that can always comes back. If it ever fires, the
        log says why, and the other requests still finish."""
        queue = self.swapped if self.swapped else self.waiting
        if not queue:
            return None
        where = "swapped" if queue is self.swapped else "waiting"
        pool = self.pool_counts()
        reason = (f"request {queue[0].request_id} can never be scheduled: it is {where} and "
                  f"needs more KV blocks than the pool of {pool.num_gpu_blocks} has free "
                  f"({pool.num_free_gpu_blocks}) while nothing else runs")
        logger.warning("aborting a request the scheduler can never run (an engine bug): %s",
                       reason)
        self.give_up(queue[0], reason)
        return reason

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
        pool = self.pool_counts()
        return {
            "waiting": [queue_badge(g) for g in self.waiting],
            "running": [queue_badge(g) for g in self.running],
            "swapped": [queue_badge(g) for g in self.swapped],
            "num_gpu_blocks": pool.num_gpu_blocks,
            "num_free_gpu_blocks": pool.num_free_gpu_blocks,
            "num_cpu_blocks": pool.num_cpu_blocks,
            "num_free_cpu_blocks": pool.num_free_cpu_blocks,
        }

    # -- the block manager's operations that others need -----------------------------------------
    # NOTE: only the scheduler holds the BlockSpaceManager (as in vLLM v0.1): the engine, the
    # output processor and the speculator go through these, the worker gets block tables as ints.
    def free_seq(self, seq: Sequence) -> None:
        """The sequence's blocks go back to the pool (it finished, or its beam was dropped)."""
        self.block_manager.free(seq)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares ``parent``'s blocks (beam search; copy-on-write protects them)."""
        self.block_manager.fork(parent, child)

    def rollback_slots(self, seq: Sequence) -> None:
        """Free the lookahead blocks speculative decoding did not fill (lesson 12)."""
        self.block_manager.rollback_slots(seq)

    def get_block_table(self, seq: Sequence) -> list[int]:
        """The sequence's physical block numbers, in logical order."""
        return self.block_manager.get_block_table(seq)

    def pool_counts(self) -> PoolCounts:
        """The pools' sizes and what is free in them now."""
        bm = self.block_manager
        return PoolCounts(bm.num_total_gpu_blocks, bm.get_num_free_gpu_blocks(),
                          bm.num_total_cpu_blocks, bm.get_num_free_cpu_blocks(),
                          bm.watermark_blocks, bm.num_cached_tokens, bm.num_evicted_blocks)

    def block_snapshot(self) -> dict:
        """Every block table and block as plain data (``core/block_snapshot.py``)."""
        return self.block_manager.snapshot()

    def replace_block_manager(self, block_manager: BlockSpaceManager) -> None:
        """Schedule the next requests with another, empty block manager of the same pools
        (lesson 03 and the memory benchmark measure ``lab.no_sharing.NoSharingBlockManager``
        this way, ``engine.scheduler.replace_block_manager(...)``).

        Args:
            block_manager: e.g. ``type(old).like(old)``, ``NoSharingBlockManager.like(old)``.
                NOTE: what the old manager's prefix cache knew is not carried over; the KV in
                the cache tensors is simply unnamed.

        Raises:
            ValueError: while a request is queued or running, or if the pools differ.
        """
        if self.has_unfinished_seqs():
            raise ValueError("replace_block_manager: requests are still queued or running")
        old = self.block_manager
        if (block_manager.block_size, block_manager.num_total_gpu_blocks,
                block_manager.num_total_cpu_blocks) != (
                old.block_size, old.num_total_gpu_blocks, old.num_total_cpu_blocks):
            raise ValueError("replace_block_manager: the new manager's block size and pools "
                             "must match the cache engine's")
        self.block_manager = block_manager

    # -- the decision ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutputs:
        step = StepPlan(budget=self.config.max_num_batched_tokens)
        # 1. Running groups first, oldest first; each decoding sequence takes one token.
        self._schedule_running(step)
        # 2. Prefill chunks of running groups that were admitted with more work than fit.
        for seq_group in self.running:
            if seq_group.pending_chunks and not step.stalled:
                step.budget = self._take_chunks(seq_group, step.budget, step.chunks)
                # FCFS: nothing younger may take the budget before this group is done.
                step.stalled = bool(seq_group.pending_chunks)
        # 3. Swapped groups come back before anything new is admitted.
        self._resume_swapped(step)
        # 4. New requests, while the budget and the pool last.
        self._admit_waiting(step)

        prompt_groups = list({id(c.seq_group): c.seq_group for c in step.chunks}.values())
        return SchedulerOutputs(
            scheduled_seq_groups=prompt_groups + step.decode_groups,
            prompt_run=[True] * len(prompt_groups) + [False] * len(step.decode_groups),
            num_batched_tokens=self.config.max_num_batched_tokens - step.budget,
            blocks_to_swap_in=step.blocks_to_swap_in, blocks_to_swap_out=step.blocks_to_swap_out,
            blocks_to_copy=step.blocks_to_copy, preempted=step.preempted,
            prefill_chunks=step.chunks, decode_seq_groups=step.decode_groups,
            seq_runs=self._seq_runs(step.chunks, step.decode_groups))

    def _schedule_running(self, step: StepPlan) -> None:
        """Step 1 (lesson 04): every running group that decodes gets the slots for its new
        tokens, oldest first; when the pool is full, the newest groups are preempted."""
        # NOTE: they already hold blocks and have made progress; serving them first keeps a
        # request's latency bounded and frees their memory soonest.
        self.running.sort(key=lambda g: g.arrival_time)
        running: list[SequenceGroup] = []
        while self.running:
            seq_group = self.running.pop(0)
            if seq_group.pending_chunks:  # still prefilling: no new slot, no token to decode
                running.append(seq_group)
                continue
            seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
            fit_lookahead(seqs, step.budget)  # speculative decoding's proposals (lesson 12)
            while not self.block_manager.can_append_slot(seq_group):
                if drop_lookahead(seqs):
                    continue  # without its proposals it may fit: better than preempting any
                if self.running:
                    # Take memory from the latest arrival (lowest priority).
                    victim = self.running.pop(-1)
                    step.preempted.append(self._preempt(victim, step.blocks_to_swap_out))
                else:
                    # Nothing left to take from: this group itself goes. (A request that fits
                    # the pool alone never gets here: validate_request refuses the others.)
                    step.preempted.append(self._preempt(seq_group, step.blocks_to_swap_out))
                    break
            else:
                self._append_slots(seq_group, step.blocks_to_copy)
                running.append(seq_group)
                step.decode_groups.append(seq_group)
                step.budget -= sum(1 + seq.num_lookahead_slots for seq in seqs)
        self.running = running

    def _resume_swapped(self, step: StepPlan) -> None:
        """Step 3 (lesson 04): swapped groups come back, oldest first, while they fit; not in a
        step that preempted, nor while a prompt waits for the budget."""
        self.swapped.sort(key=lambda g: g.arrival_time)
        while self.swapped and not step.preempted and not step.stalled:
            seq_group = self.swapped[0]
            if not self.block_manager.can_swap_in(seq_group):
                break
            num_new = seq_group.num_seqs(SequenceStatus.SWAPPED)
            if self._num_running_seqs() + num_new > self.config.max_num_seqs:
                break
            decodes = not seq_group.pending_chunks
            if decodes and num_new > step.budget and not self.config.enable_chunked_prefill:
                break  # (with chunking, decodes never wait for the budget)
            self.swapped.pop(0)
            step.blocks_to_swap_in.update(self.block_manager.swap_in(seq_group))
            for seq in seq_group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            self.running.append(seq_group)
            if decodes:
                self._append_slots(seq_group, step.blocks_to_copy)
                step.decode_groups.append(seq_group)
                step.budget -= num_new

    def _admit_waiting(self, step: StepPlan) -> None:
        """Step 4 (lesson 09): waiting groups, first come first served, while the budget, the
        sequence limit and the pool allow; only while nothing is swapped out, was just
        preempted, or waits for the budget."""
        if self.swapped or step.preempted or step.stalled:
            return
        self.waiting.sort(key=lambda g: g.arrival_time)
        while self.waiting:
            seq_group = self.waiting[0]
            _, shared_len, identical = self.block_manager.prompt_layout(seq_group)
            # With chunked prefill any room will do: the prompt is cut to what is left.
            if step.budget < (1 if self.config.enable_chunked_prefill
                              else self._first_chunk_len(seq_group)):
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
            step.budget = self._take_chunks(seq_group, step.budget, step.chunks)
            if seq_group.pending_chunks:
                break  # the budget is spent: younger groups wait (FCFS)

    def _seq_runs(self, chunks: list[PrefillChunk],
                  decode_groups: list[SequenceGroup]) -> list[SequenceRun]:
        """The step as the worker reads it: tokens, positions and block tables as ints."""
        # a hybrid model's other KV cache groups (core/hybrid_block_manager.py); else none
        others = getattr(self.block_manager, "other_group_tables", lambda seq: ())
        runs = [SequenceRun(c.seq_group, list(c.seq_ids), c.seq.get_token_ids()[c.start:c.end],
                            c.start, self.get_block_table(c.seq), c.sample, True,
                            others(c.seq))
                for c in chunks]
        for seq_group in decode_groups:
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                runs.append(SequenceRun(seq_group, [seq.seq_id], [seq.get_last_token_id()],
                                        seq.get_len() - 1, self.get_block_table(seq), True,
                                        False, others(seq)))
        return runs

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

    def _first_chunk_len(self, seq_group: SequenceGroup) -> int:
        """Tokens the waiting group's first prefill chunk computes: its prompt, or after a
        recompute the shortest sequence's tokens but the last (computed by its first decode);
        less the tokens found in the prefix cache (lesson 11)."""
        seqs = seq_group.get_seqs(SequenceStatus.WAITING)
        _, _, identical = self.block_manager.prompt_layout(seq_group)
        cached = self.block_manager.cached_prefix(seq_group)
        leader = seqs[0] if identical else prefix_leader(seqs)  # (the shortest)
        num_cached = len(cached[leader.seq_id]) * self.block_manager.block_size
        return leader.get_len() - (0 if identical else 1) - num_cached

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
