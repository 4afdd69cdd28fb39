"""Lesson 08 as a learner answers it: lesson 02's slot arithmetic and the padding as helpers, the
flat lists built with comprehensions."""

# %%
def slot_for(block_table, position, block_size):
    """Lesson 02: the physical block of the position's logical block, then the offset in it."""
    return block_table[position // block_size] * block_size + position % block_size


# %%
def padded(tables):
    """Block tables as one int32 tensor, padded with 0: (len(tables), longest)."""
    width = max((len(t) for t in tables), default=0)
    rows = [list(t) + [0] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32).reshape(len(tables), width)


# %%
def my_prepare_inputs(seq_runs, block_size, device, drafts=None):
    if any(drafts.values() if drafts else ()):
        return package_prepare_inputs(seq_runs, block_size, device, drafts)  # lesson 12's steps
    fresh = [r for r in seq_runs if r.is_prompt and r.start == 0]
    chunks = [r for r in seq_runs if r.is_prompt and r.start > 0]
    decodes = [r for r in seq_runs if not r.is_prompt]
    batch = fresh + chunks + decodes

    token_ids = [t for r in batch for t in r.token_ids]
    positions = [p for r in batch for p in range(r.start, r.end)]
    slots = [slot_for(r.block_table, p, block_size) for r in batch for p in range(r.start, r.end)]
    rows, sample_indices, computed = [], [], []
    end = 0
    for r in batch:
        end += r.end - r.start
        if r.sample:
            rows.append(Row(r.seq_group, list(r.seq_ids), r.is_prompt))
            sample_indices.append(end - 1)
        computed.extend((r.seq_group.find(s), r.end) for s in r.seq_ids)

    chunk_starts = [0]
    for r in chunks:
        chunk_starts.append(chunk_starts[-1] + r.end - r.start)
    context_lens = [r.end for r in decodes]
    meta = InputMetadata(
        prompt_lens=[r.end - r.start for r in fresh],
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=padded([r.block_table for r in decodes]).to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        max_context_len=max(context_lens) if context_lens else 0,
        chunk_query_start_loc=torch.tensor(chunk_starts, dtype=torch.int32, device=device),
        chunk_block_tables=padded([r.block_table for r in chunks]).to(device),
        chunk_context_lens=torch.tensor([r.end for r in chunks], dtype=torch.int32,
                                        device=device),
        num_chunk_tokens=chunk_starts[-1])
    return PreparedInputs(
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        meta=meta, rows=rows,
        sample_indices=torch.tensor(sample_indices, dtype=torch.int64, device=device),
        computed=computed, chunks=fresh + chunks)
