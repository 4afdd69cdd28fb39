"""What the scheduler reports (lesson 04): a step's decisions, the pools in numbers, the queues.

``SchedulerOutputs`` is one step: the groups scheduled, the cache moves the worker makes before
the model runs, the preemptions, and ``seq_runs``, the step as plain data for the worker
(``step_record.py``); ``StepPlan`` is the same step while ``schedule()`` decides it.
``PoolCounts`` and ``queue_badge`` are what stats, checks and the visualizer read of the pools
and of the queues.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from minipaged.core.prefill_plan import PrefillChunk
from minipaged.sequence import SequenceGroup
from minipaged.step_record import SequenceRun


@dataclass
class SchedulerOutputs:
    """One step as the scheduler decided it (``Scheduler.schedule()``)."""

    scheduled_seq_groups: list[SequenceGroup]
    prompt_run: list[bool]  # per scheduled group: is this a prefill run (it has chunks)?
    num_batched_tokens: int
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)
    preempted: list[tuple[str, str]] = field(default_factory=list)  # (request_id, mode)
    prefill_chunks: list[PrefillChunk] = field(default_factory=list)
    decode_seq_groups: list[SequenceGroup] = field(default_factory=list)
    # What the worker runs, as plain data (``step_record.py``): the chunks, then the decodes.
    seq_runs: list[SequenceRun] = field(default_factory=list)

    def is_empty(self) -> bool:
        return (not self.scheduled_seq_groups and not self.blocks_to_swap_in
                and not self.blocks_to_swap_out and not self.blocks_to_copy)


@dataclass
class StepPlan:
    """A step while ``Scheduler.schedule()`` decides it: the budget left and what is taken."""

    budget: int  # tokens the step may still take
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: dict[int, list[int]] = field(default_factory=dict)  # src -> its copies
    preempted: list[tuple[str, str]] = field(default_factory=list)  # (request_id, mode)
    chunks: list[PrefillChunk] = field(default_factory=list)  # prompt work, in order
    decode_groups: list[SequenceGroup] = field(default_factory=list)
    stalled: bool = False  # a prompt's chunks wait for the budget: nothing younger starts


@dataclass(frozen=True)
class PoolCounts:
    """The KV pools in numbers (``Scheduler.pool_counts()``): for stats, checks and messages."""

    num_gpu_blocks: int
    num_free_gpu_blocks: int
    num_cpu_blocks: int
    num_free_cpu_blocks: int
    watermark_blocks: int  # GPU blocks kept free when admitting prompts
    num_cached_tokens: int  # prompt tokens taken from the prefix cache so far (lesson 11)
    num_evicted_blocks: int  # cached blocks evicted for room so far


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
