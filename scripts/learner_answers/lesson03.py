"""Lesson 03 as a learner answers it: two small helpers in cells of their own."""

# %%
def numbers(blocks):
    """The block numbers of a block table (what the events carry)."""
    return [b.block_number for b in blocks]


# %%
def hold(allocator, block, times):
    """``times`` more block tables hold ``block``."""
    for _ in range(times):
        allocator.acquire(block)


# %%
class MyBlockSpaceManager(BlockSpaceManager):
    def _num_shared(self, seqs, shared_len, identical):
        return len(seqs[0].logical_token_blocks) if identical else shared_len // self.block_size

    def can_allocate(self, seq_group):
        seqs, shared_len, identical = self.prompt_layout(seq_group)
        n_shared = self._num_shared(seqs, shared_len, identical)
        total = n_shared + sum(len(s.logical_token_blocks) - n_shared for s in seqs)
        return self.gpu_allocator.get_num_free_blocks() >= total + self.watermark_blocks

    def allocate(self, seq_group):
        seqs, shared_len, identical = self.prompt_layout(seq_group)
        n_shared = self._num_shared(seqs, shared_len, identical)
        common = []
        for _ in range(n_shared):
            block = self.gpu_allocator.allocate()
            hold(self.gpu_allocator, block, len(seqs) - 1)
            common.append(block)
        for seq in seqs:
            own = [self.gpu_allocator.allocate()
                   for _ in range(len(seq.logical_token_blocks) - n_shared)]
            self.block_tables[seq.seq_id] = common + own
            self.seqs[seq.seq_id] = seq
            self.seq_request[seq.seq_id] = seq_group.request_id
        first = self.block_tables[seqs[0].seq_id]
        self._emit("allocate", request_id=seq_group.request_id,
                   seq_ids=[s.seq_id for s in seqs], blocks=numbers(first), cached=[])
        return {s.seq_id: 0 for s in seqs}

    def append_slot(self, seq):
        table = self.block_tables[seq.seq_id]
        if len(seq.logical_token_blocks) > len(table):
            block = self.gpu_allocator.allocate()
            table.append(block)
            self._emit("append", seq_id=seq.seq_id, block=block.block_number, new_block=True)
            return None
        last = table[-1]
        if last.ref_count > 1:  # shared: copy before writing
            fresh = self.gpu_allocator.allocate()
            self.gpu_allocator.free(last)
            table[-1] = fresh
            self._emit("copy_on_write", seq_id=seq.seq_id, src=last.block_number,
                       dst=fresh.block_number)
            return last.block_number, fresh.block_number
        self._emit("append", seq_id=seq.seq_id, block=last.block_number, new_block=False)
        return None

    def fork(self, parent, child):
        table = list(self.block_tables[parent.seq_id])
        for block in table:
            hold(self._allocator_of(block), block, 1)
        self.block_tables[child.seq_id] = table
        self.seqs[child.seq_id] = child
        self.seq_request[child.seq_id] = self.seq_request[parent.seq_id]
        self._emit("fork", parent=parent.seq_id, child=child.seq_id, blocks=numbers(table))

    def free(self, seq):
        table = self.block_tables.pop(seq.seq_id, None)
        if table is None:
            return
        for block in reversed(table):
            self._allocator_of(block).free(block)
        self.seqs.pop(seq.seq_id, None)
        self.seq_request.pop(seq.seq_id, None)
        self._emit("free", seq_id=seq.seq_id, blocks=numbers(table))
