"""Lesson 09's component, answered: admission of waiting requests under the step's token
budget (``Scheduler._admit_waiting`` in ``core/scheduler.py``).

Used when ``MINIPAGED_SOLUTIONS=1`` and the learner's stub is not done; written for the build
track, it behaves as the package's method under lesson 09's checker.
"""
from __future__ import annotations

from minipaged.core.prefill_plan import plan_prefill
from minipaged.core.scheduler_outputs import StepPlan
from minipaged.sequence import SequenceStatus


def admit_waiting(self, step: StepPlan) -> None:
    """Admit waiting groups oldest first while they fit (a method of ``Scheduler``)."""
    if self.swapped or step.preempted or step.stalled:
        return  # older work comes first: swapped groups, the preempted, a half-done prompt
    self.waiting.sort(key=lambda g: g.arrival_time)
    while self.waiting:
        seq_group = self.waiting[0]
        _, shared_len, identical = self.block_manager.prompt_layout(seq_group)
        # With chunked prefill any room will do (the prompt is cut to what is left); without,
        # its whole first chunk must fit now.
        needed = 1 if self.config.enable_chunked_prefill else self._first_chunk_len(seq_group)
        too_many = (self._num_running_seqs() + seq_group.get_max_num_running_seqs()
                    > self.config.max_num_seqs)
        if step.budget < needed or too_many or not self.block_manager.can_allocate(seq_group):
            break  # first come, first served: nobody behind it goes first
        self.waiting.pop(0)
        cached = self.block_manager.allocate(seq_group)
        for seq in seq_group.get_seqs(SequenceStatus.WAITING):
            seq.status = SequenceStatus.RUNNING
        seq_group.pending_chunks = plan_prefill(seq_group, shared_len, identical, cached)
        self.running.append(seq_group)
        step.budget = self._take_chunks(seq_group, step.budget, step.chunks)
        if seq_group.pending_chunks:
            break  # the budget ran out inside this prompt: the rest waits for later steps
