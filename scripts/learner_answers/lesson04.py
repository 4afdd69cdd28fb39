"""Lesson 04 as a learner answers it: the order and the preemption mode as helpers."""

# %%
def by_arrival(groups):
    """Oldest first."""
    return sorted(groups, key=lambda g: g.arrival_time)


# %%
def preemption_mode(scheduler, seq_group):
    if scheduler.forced_mode is not None:
        mode = scheduler.forced_mode
    elif seq_group.get_max_num_running_seqs() > 1:
        mode = PreemptionMode.SWAP
    else:
        mode = PreemptionMode.RECOMPUTE
    if mode == PreemptionMode.SWAP and not scheduler.block_manager.can_swap_out(seq_group):
        mode = PreemptionMode.RECOMPUTE  # the CPU pool is full
    return mode


# %%
class MyScheduler(Scheduler):
    def _schedule_running(self, step):
        queue = by_arrival(self.running)
        self.running = []
        while queue:
            group = queue.pop(0)
            if group.pending_chunks:
                self.running.append(group)
                continue
            seqs = group.get_seqs(SequenceStatus.RUNNING)
            fit_lookahead(seqs, step.budget)
            gave_up = False
            while not self.block_manager.can_append_slot(group):
                if drop_lookahead(seqs):
                    continue
                victim = queue.pop() if queue else group  # the newest one not served yet
                swap_out = step.blocks_to_swap_out
                step.preempted.append(self._preempt(victim, blocks_to_swap_out=swap_out))
                if victim is group:
                    gave_up = True
                    break
            if gave_up:
                continue
            self._append_slots(group, step.blocks_to_copy)
            self.running.append(group)
            step.decode_groups.append(group)
            step.budget -= sum(1 + s.num_lookahead_slots for s in seqs)

    def _preempt(self, seq_group, blocks_to_swap_out):
        mode = preemption_mode(self, seq_group)
        if mode == PreemptionMode.RECOMPUTE:
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                self.block_manager.free(seq)
                seq.reset_for_recompute()
            seq_group.pending_chunks = []
            self.waiting.insert(0, seq_group)
        else:
            blocks_to_swap_out.update(self.block_manager.swap_out(seq_group))
            for seq in seq_group.get_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq_group)
        self.block_manager.record_preemption(seq_group, mode.value)
        return seq_group.request_id, mode.value

    def _resume_swapped(self, step):
        if step.preempted or step.stalled:
            return
        self.swapped = by_arrival(self.swapped)
        for group in list(self.swapped):
            n = group.num_seqs(SequenceStatus.SWAPPED)
            decodes = not group.pending_chunks
            if not self.block_manager.can_swap_in(group):
                break
            if self._num_running_seqs() + n > self.config.max_num_seqs:
                break
            if decodes and not self.config.enable_chunked_prefill and n > step.budget:
                break
            self.swapped.remove(group)
            step.blocks_to_swap_in.update(self.block_manager.swap_in(group))
            for seq in group.get_seqs(SequenceStatus.SWAPPED):
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            if decodes:
                self._append_slots(group, step.blocks_to_copy)
                step.decode_groups.append(group)
                step.budget -= n
