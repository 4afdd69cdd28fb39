"""Lesson 09 as a learner answers it: the three conditions of "fits" as helpers."""

# %%
def first_chunk_fits(scheduler, seq_group, budget):
    """With chunked prefill one token of budget is enough; without, the whole first chunk."""
    if scheduler.config.enable_chunked_prefill:
        return budget >= 1
    return budget >= scheduler._first_chunk_len(seq_group)


# %%
def seats_left(scheduler, seq_group):
    """Would its sequences keep the running ones within max_num_seqs?"""
    total = scheduler._num_running_seqs() + seq_group.get_max_num_running_seqs()
    return total <= scheduler.config.max_num_seqs


# %%
def admit_waiting(self, step):
    if self.swapped or step.preempted or step.stalled:
        return
    self.waiting.sort(key=lambda g: g.arrival_time)
    while self.waiting:
        group = self.waiting[0]
        _, shared_len, identical = self.block_manager.prompt_layout(group)
        if not (first_chunk_fits(self, group, step.budget) and seats_left(self, group)
                and self.block_manager.can_allocate(group)):
            return  # first come, first served
        self.waiting.remove(group)
        cached = self.block_manager.allocate(group)
        for seq in group.get_seqs(SequenceStatus.WAITING):
            seq.status = SequenceStatus.RUNNING
        group.pending_chunks = plan_prefill(group, shared_len, identical, cached)
        self.running.append(group)
        step.budget = self._take_chunks(group, step.budget, step.chunks)
        if group.pending_chunks:
            return  # its chunks did not all fit: it spends the budget
