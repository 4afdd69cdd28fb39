"""Lesson 04's component, answered: the scheduler's step, its running and swapped parts
(``core/scheduler.py``).

Used when ``MINIPAGED_SOLUTIONS=1`` and the learner's stub is not done; written for the build
track, it behaves as the package's ``Scheduler`` under lesson 04's checker.
"""
from __future__ import annotations

from minipaged.core.lookahead import drop_lookahead, fit_lookahead
from minipaged.core.scheduler import PreemptionMode, Scheduler
from minipaged.core.scheduler_outputs import StepPlan
from minipaged.sequence import SequenceGroup, SequenceStatus


class MyScheduler(Scheduler):
    """Serves the running groups (preempting the newest when the pool is full) and brings
    swapped groups back; admission (lesson 09) and prefill chunks stay the package's."""

    def _schedule_running(self, step: StepPlan) -> None:
        self.running.sort(key=lambda g: g.arrival_time)  # oldest first
        queue, self.running = self.running, []
        while queue:
            seq_group = queue.pop(0)
            if seq_group.pending_chunks:  # a prompt still being computed decodes nothing
                self.running.append(seq_group)
                continue
            seqs = seq_group.get_seqs(SequenceStatus.RUNNING)
            fit_lookahead(seqs, step.budget)  # (lesson 12; nothing without speculation)
            served = True
            while not self.block_manager.can_append_slot(seq_group):
                if drop_lookahead(seqs):
                    continue
                # The newest group still waiting for its turn gives its memory back; when
                # none is left, this group itself is preempted.
                victim = queue.pop() if queue else seq_group
                step.preempted.append(self._preempt(victim, step.blocks_to_swap_out))
                if victim is seq_group:
                    served = False
                    break
            if served:
                self._append_slots(seq_group, step.blocks_to_copy)
                self.running.append(seq_group)
                step.decode_groups.append(seq_group)
                step.budget -= sum(1 + seq.num_lookahead_slots for seq in seqs)

    def _preempt(self, seq_group: SequenceGroup, blocks_to_swap_out: dict) -> tuple[str, str]:
        if self.forced_mode is not None:
            mode = self.forced_mode
        elif seq_group.get_max_num_running_seqs() == 1:
            mode = PreemptionMode.RECOMPUTE  # one sequence: cheap to compute again
        else:
            mode = PreemptionMode.SWAP  # several: keep what they share
        if mode is PreemptionMode.SWAP and not self.block_manager.can_swap_out(seq_group):
            mode = PreemptionMode.RECOMPUTE  # no room in the CPU pool
        if mode is PreemptionMode.SWAP:
            blocks_to_swap_out.update(self.block_manager.swap_out(seq_group))
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq_group)
        else:
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                self.block_manager.free(seq)
                seq.reset_for_recompute()  # its tokens so far become its prompt
            seq_group.pending_chunks = []
            self.waiting.insert(0, seq_group)  # first in line again
        self.block_manager.record_preemption(seq_group, mode.value)
        return seq_group.request_id, mode.value

    def _resume_swapped(self, step: StepPlan) -> None:
        if step.preempted or step.stalled:
            return  # memory is short, or the budget is promised to a prompt
        self.swapped.sort(key=lambda g: g.arrival_time)
        while self.swapped:
            seq_group = self.swapped[0]
            num_seqs = seq_group.num_seqs(SequenceStatus.SWAPPED)
            decodes = not seq_group.pending_chunks
            if (not self.block_manager.can_swap_in(seq_group)
                    or self._num_running_seqs() + num_seqs > self.config.max_num_seqs
                    or (decodes and num_seqs > step.budget
                        and not self.config.enable_chunked_prefill)):
                break  # first come, first served: nobody overtakes the oldest
            self.swapped.pop(0)
            step.blocks_to_swap_in.update(self.block_manager.swap_in(seq_group))
            for seq in seq_group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            self.running.append(seq_group)
            if decodes:
                self._append_slots(seq_group, step.blocks_to_copy)
                step.decode_groups.append(seq_group)
                step.budget -= num_seqs
