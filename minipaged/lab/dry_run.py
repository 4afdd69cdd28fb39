"""The engine's step without a model: the real scheduler and block manager, tokens you pick.

``LLMEngine.step`` schedules, runs the model, samples, and appends each sampled token to its
sequence. ``DryRun`` does the same around the same ``Scheduler`` and ``BlockSpaceManager``, but
the "sampled" tokens come from you (or a random generator), so lessons 02-04 and the exercise
checkers can watch block tables grow, fork and get preempted without loading a model.
"""
from __future__ import annotations

from collections.abc import Callable

from minipaged.sampling_params import SamplingParams
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.core.scheduler import Scheduler, SchedulerConfig
from minipaged.core.scheduler_outputs import SchedulerOutputs
from minipaged.sequence import Sequence, SequenceGroup, SequenceStatus


def apply_step(outs: SchedulerOutputs,
               next_token: Callable[[Sequence], int] | None = None) -> None:
    """What the engine does after the model ran: the step's chunks and decodes are now cached,
    and each sequence whose last token was computed gets its new token (by default 100 + its
    length). A chunk that stops short of a prompt's end samples nothing."""
    sampled: list[Sequence] = []
    for chunk in outs.prefill_chunks:
        for seq_id in chunk.seq_ids:
            seq = chunk.seq_group.find(seq_id)
            seq.num_computed_tokens = chunk.end
            if chunk.sample:
                sampled.append(seq)
    for seq_group in outs.decode_seq_groups:
        for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
            seq.num_computed_tokens = seq.get_len()
            sampled.append(seq)
    for seq in sampled:
        token = next_token(seq) if next_token else 100 + seq.get_len()
        seq.append_token_id(token, {token: 0.0})


class DryRun:
    """A model-free engine loop.

    Args:
        block_size, num_gpu_blocks, num_cpu_blocks, watermark: as for ``BlockSpaceManager``.
        preemption_mode: as for ``SchedulerConfig`` ("swap", "recompute" or None).
    """

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 preemption_mode: str | None = None, watermark: float = 0.0) -> None:
        self.block_size = block_size
        self.block_manager = BlockSpaceManager(block_size, num_gpu_blocks, num_cpu_blocks,
                                               watermark)
        self.scheduler = Scheduler(SchedulerConfig(preemption_mode=preemption_mode),
                                   self.block_manager)
        self.groups: dict[str, SequenceGroup] = {}
        self._next_seq_id = 0

    def add_request(self, prompt_token_ids: list[int], n: int = 1,
                    request_id: str | None = None) -> SequenceGroup:
        """A request of ``n`` sequences over one prompt (``n > 1``: parallel sampling)."""
        request_id = str(len(self.groups)) if request_id is None else request_id
        seqs = []
        for _ in range(n):
            seqs.append(Sequence(self._next_seq_id, None, prompt_token_ids, self.block_size))
            self._next_seq_id += 1
        seq_group = SequenceGroup(request_id, seqs, SamplingParams(n=n),
                                  arrival_time=float(len(self.groups)))
        self.groups[request_id] = seq_group
        self.scheduler.add_seq_group(seq_group)
        return seq_group

    def seq(self, seq_id: int) -> Sequence:
        return next(s for g in self.groups.values() for s in g.get_seqs() if s.seq_id == seq_id)

    def step(self, next_token: Callable[[Sequence], int] | None = None) -> SchedulerOutputs:
        """``schedule()``, then every scheduled sequence "samples" ``next_token(seq)``."""
        outs = self.scheduler.schedule()
        self.sampled(outs, next_token)
        return outs

    def sampled(self, outs: SchedulerOutputs,
                next_token: Callable[[Sequence], int] | None = None) -> None:
        """What the engine does after the model ran (see ``apply_step``)."""
        apply_step(outs, next_token)

    def fork(self, parent: Sequence) -> Sequence:
        """A new sequence continuing from ``parent`` (what beam search does when a beam is
        copied): it shares all of the parent's blocks."""
        seq_group = next(g for g in self.groups.values() if parent in g.get_seqs())
        child = Sequence(self._next_seq_id, None, parent.prompt_token_ids, self.block_size)
        self._next_seq_id += 1
        child.copy_state_from(parent)
        child.status = parent.status
        seq_group.seqs.append(child)
        self.block_manager.fork(parent, child)
        return child

    def finish(self, seq: Sequence) -> None:
        """The sequence stopped (length or end of text): its blocks are freed."""
        seq.status = SequenceStatus.FINISHED_LENGTH_CAPPED
        self.block_manager.free(seq)
        self.scheduler.free_finished_seq_groups()


class RandomTraffic(DryRun):
    """Requests of one sequence arriving at random, stopping at random (for the checkers)."""

    def __init__(self, rng, block_size: int, num_gpu_blocks: int, preemption_mode="swap",
                 max_prompt_blocks: int = 3) -> None:
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks=4 * num_gpu_blocks,
                         preemption_mode=preemption_mode)
        self.rng = rng
        self.bm = self.block_manager
        self.max_prompt_len = max_prompt_blocks * block_size

    def arrive(self, count: int) -> None:
        for _ in range(count):
            length = self.rng.randint(1, self.max_prompt_len)
            self.add_request([self.rng.randrange(1000) for _ in range(length)])

    def after_model(self, outs: SchedulerOutputs) -> None:
        self.sampled(outs, lambda seq: self.rng.randrange(1000))
        for seq_group in outs.scheduled_seq_groups:
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                if self.rng.random() < 0.12:
                    self.finish(seq)


def replay_trace_paged(trace, capacity: int, block_size: int = 16,
                       layout_step: int | None = None):
    """Lesson 01's trace served by the real scheduler and ``BlockSpaceManager`` (no model).

    Returns a ``kv_memory.WasteReport`` counted from the block tables at every step: slots holding
    a token's K/V ("used") and the empty tail of each sequence's last block ("internal").
    Requests run to their ``final_len``; when the pool runs out the scheduler preempts by
    recompute, as ``kv_memory.paged_waste`` assumes. The report's memory map is the block tables
    at ``layout_step`` (by default the same busy step as ``kv_memory.paged_waste`` draws).
    """
    from minipaged.lab.kv_memory import WasteReport, _merge_layout, _steady_step

    run = DryRun(block_size, capacity // block_size, preemption_mode="recompute")
    final_len = {run.add_request([1] * r.prompt_len).request_id: r.final_len for r in trace}
    report = WasteReport("paged", (capacity // block_size) * block_size, block_size,
                         counted_by="BlockSpaceManager")
    if layout_step is None:
        layout_step = _steady_step(trace)
    bm = run.block_manager
    while run.scheduler.has_unfinished_seqs():
        outs = run.scheduler.schedule()  # every running sequence now has a slot for its tokens
        running = [s for g in run.scheduler.running for s in g.get_seqs(SequenceStatus.RUNNING)]
        cells: list[str] = []
        for seq in running:
            used = seq.get_len()
            tail = len(bm.get_blocks(seq.seq_id)) * block_size - used
            report.slot_steps["used"] += used
            report.slot_steps["internal"] += tail
            if report.num_steps == layout_step:
                cells += ["used"] * used + ["internal"] * tail
        if report.num_steps == layout_step:  # each sequence's blocks side by side, then free
            cells += ["free"] * (report.capacity - len(cells))
            report.layout, report.layout_step = _merge_layout(cells), layout_step
        report.max_running = max(report.max_running, len(running))
        report.num_steps += 1
        run.sampled(outs)
        for seq_group in outs.scheduled_seq_groups:
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                if seq.get_len() > final_len[seq_group.request_id]:
                    run.finish(seq)
    return report
