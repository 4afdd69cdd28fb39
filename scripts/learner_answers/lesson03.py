"""Lesson 03 as a learner answers it: two small helpers in cells of their own, and the tables
kept as one record per sequence id: (sequence, request id, a tuple of its blocks)."""

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
    def __init__(self, block_size, num_gpu_blocks, num_cpu_blocks, watermark=0.01,
                 enable_prefix_caching=False):
        super().__init__(block_size, num_gpu_blocks, num_cpu_blocks, watermark,
                         enable_prefix_caching)
        self.records = {}  # seq id -> (seq, request id, tuple of blocks)

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
            self.records[seq.seq_id] = (seq, seq_group.request_id, tuple(common + own))
        first = self.records[seqs[0].seq_id][2]
        self._emit("allocate", request_id=seq_group.request_id,
                   seq_ids=[s.seq_id for s in seqs], blocks=numbers(first), cached=[])
        return {s.seq_id: 0 for s in seqs}

    def append_slot(self, seq):
        _, request, table = self.records[seq.seq_id]
        if len(seq.logical_token_blocks) > len(table):
            block = self.gpu_allocator.allocate()
            self.records[seq.seq_id] = (seq, request, table + (block,))
            self._emit("append", seq_id=seq.seq_id, block=block.block_number, new_block=True)
            return None
        last = table[-1]
        if last.ref_count > 1:  # shared: copy before writing
            fresh = self.gpu_allocator.allocate()
            self.gpu_allocator.free(last)
            self.records[seq.seq_id] = (seq, request, table[:-1] + (fresh,))
            self._emit("copy_on_write", seq_id=seq.seq_id, src=last.block_number,
                       dst=fresh.block_number)
            return last.block_number, fresh.block_number
        self._emit("append", seq_id=seq.seq_id, block=last.block_number, new_block=False)
        return None

    def fork(self, parent, child):
        _, request, table = self.records[parent.seq_id]
        for block in table:
            hold(self._allocator_of(block), block, 1)
        self.records[child.seq_id] = (child, request, table)  # a tuple: nobody changes it
        self._emit("fork", parent=parent.seq_id, child=child.seq_id, blocks=numbers(table))

    def free(self, seq):
        record = self.records.pop(seq.seq_id, None)
        if record is None:
            return
        for block in reversed(record[2]):
            self._allocator_of(block).free(block)
        self._emit("free", seq_id=seq.seq_id, blocks=numbers(record[2]))

    def get_blocks(self, seq_id):
        record = self.records.get(seq_id)
        return list(record[2]) if record else []

    def set_blocks(self, seq_id, blocks):
        seq, request, _ = self.records[seq_id]
        self.records[seq_id] = (seq, request, tuple(blocks))

    def held_sequences(self):
        return [(seq, request) for seq, request, _ in self.records.values()]
