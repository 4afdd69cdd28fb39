"""The answers to the lessons' code exercises. The checkers' tests prove each one passes; the
lessons use them only when run headless with MINIPAGED_SOLUTIONS=1. Try the exercise first!"""
from __future__ import annotations

# ---- lesson 01 -------------------------------------------------------------------------------


def bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes):
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def reservation_slots(request, num_tokens):
    return {"used": num_tokens,
            "reserved": request.final_len - num_tokens,
            "internal": request.max_len - request.final_len}


def paged_slots(num_tokens, block_size):
    num_blocks = -(-num_tokens // block_size)
    return num_blocks, num_blocks * block_size - num_tokens


# ---- lesson 02 -------------------------------------------------------------------------------


def slot_of(block_table, position, block_size):
    return block_table[position // block_size] * block_size + position % block_size


def grow_block_table(block_table, num_tokens, block_size, allocate):
    if len(block_table) < -(-num_tokens // block_size):
        block_table.append(allocate())


# ---- lesson 03 -------------------------------------------------------------------------------


def fork(parent_table, ref_counts):
    for block in parent_table:
        ref_counts[block] += 1
    return list(parent_table)


def append_action(block_table, ref_counts, needs_new_block):
    if needs_new_block:
        return "new block"
    if ref_counts[block_table[-1]] > 1:
        return "copy"
    return "in place"


# ---- lesson 04 -------------------------------------------------------------------------------


def schedule_running(running, num_free):
    queue, kept, preempted = list(running), [], []
    while queue:
        group = queue.pop(0)
        while group.needs_block and num_free == 0:
            victim = queue.pop() if queue else group
            preempted.append(victim.request_id)
            num_free += victim.blocks_held
            if victim is group:
                break
        else:
            num_free -= group.needs_block
            kept.append(group.request_id)
    return kept, preempted


def resume_and_admit(swapped, waiting, num_free):
    swapped_in, admitted = [], []
    for group in swapped:
        if num_free < group.blocks_held + group.needs_block:
            break
        num_free -= group.blocks_held + group.needs_block
        swapped_in.append(group.request_id)
    if len(swapped_in) == len(swapped):
        for group in waiting:
            if group.prompt_blocks > num_free:
                break
            num_free -= group.prompt_blocks
            admitted.append(group.request_id)
    return swapped_in, admitted


# ---- lesson 08 -------------------------------------------------------------------------------


def _flat_positions(seqs):
    prompts = [s for s in seqs if s.num_computed_tokens == 0]
    decodes = [s for s in seqs if s.num_computed_tokens > 0]
    for s in prompts:
        for pos, token in enumerate(s.token_ids):
            yield s, pos, token
    for s in decodes:
        yield s, len(s.token_ids) - 1, s.token_ids[-1]


def flat_batch(seqs):
    rows = list(_flat_positions(seqs))
    return [token for _, _, token in rows], [pos for _, pos, _ in rows]


def sample_indices(seqs):
    rows, end = [], 0
    for s, pos, _ in _flat_positions(seqs):
        end += 1
        if pos == len(s.token_ids) - 1:  # the sequence's last token: the one sampled from
            rows.append(end - 1)
    return rows


# ---- lesson 05 (prepared) --------------------------------------------------------------------


def warp_reduce(values, op):
    import numpy as np

    from minipaged.kernels.emulator import shfl_xor

    combine = np.add if op == "sum" else np.maximum
    for mask in (16, 8, 4, 2, 1):
        values = combine(values, shfl_xor(values, mask))
    return values


def key_offset(block, head, dim, slot, num_kv_heads, head_size, block_size, x):
    chunk, lane_element = divmod(dim, x)
    return ((((block * num_kv_heads + head) * (head_size // x) + chunk) * block_size + slot) * x
            + lane_element)


def lane_key_chunks(lane, head_size, block_size, x):
    G = max(32 // block_size, 1)  # lanes per token
    return lane // G, list(range(lane % G, head_size // x, G))


# ---- lesson 11 -------------------------------------------------------------------------------


def block_hash(parent_hash, token_ids):
    return hash((parent_hash, tuple(token_ids)))


def cached_tokens(prompt, cached_names, block_size):
    from minipaged.core.prefix_caching_allocator import block_hash as name_of

    parent, count = None, 0
    for i in range((len(prompt) - 1) // block_size):  # never the block of the last token
        name = name_of(parent, tuple(prompt[i * block_size:(i + 1) * block_size]))
        if name not in cached_names:
            break
        parent, count = name, count + block_size
    return count


# ---- lesson 13 -------------------------------------------------------------------------------


def stream_delta(sent, text, finished, stop_strings):
    holdback = 0 if finished else max((len(s) for s in stop_strings), default=1) - 1
    return text[len(sent):max(len(sent), len(text) - holdback)]


def metric_value(metrics_text, name):
    for line in metrics_text.splitlines():
        if line and not line.startswith("#"):
            sample, _, value = line.rpartition(" ")
            if sample == name:
                return float(value)
    return None


# ---- lesson 14 -------------------------------------------------------------------------------


def shard_weight(weight, kind, rank, world_size, parts=None):
    import torch

    dim = 0 if kind == "column" else 1
    pieces, start = [], 0
    for size in parts or [weight.shape[dim]]:
        per_rank = size // world_size
        pieces.append(weight.narrow(dim, start + rank * per_rank, per_rank))
        start += size
    return torch.cat(pieces, dim=dim)


def row_parallel(x, weight, bias, world_size):
    per_rank = x.shape[1] // world_size
    partials = [x[:, r * per_rank:(r + 1) * per_rank] @ weight[:, r * per_rank:(r + 1) * per_rank].T
                for r in range(world_size)]
    return partials, sum(partials) + bias


# ---- lesson 06 (kernel phases) -----------------------------------------------
# (answers of lesson 06's exercises go here)


# ---- lesson 07 (forward pass) ------------------------------------------------
# (answers of lesson 07's exercises go here)


# ---- lesson 09 (continuous batching) -----------------------------------------
# (answers of lesson 09's exercises go here)


# ---- lesson 10 (sampling) ----------------------------------------------------
# (answers of lesson 10's exercises go here)


# ---- lesson 12 (speculative decoding) ----------------------------------------


def greedy_verify(target_argmax_ids, draft_token_ids):
    emitted = []
    for draft, target in zip(draft_token_ids, target_argmax_ids):
        if draft != target:
            return emitted + [target]  # the target's correction
        emitted.append(draft)
    return emitted + [target_argmax_ids[len(draft_token_ids)]]  # all right: the bonus token


def residual_distribution(p, q):
    left = (p - q).clamp(min=0)  # what q did not already cover
    return left / left.sum()


# ---- lesson 15 (performance) -------------------------------------------------
# (answers of lesson 15's exercises go here)


# ---- lesson 16 (capstone) ----------------------------------------------------
# (answers of lesson 16's exercises go here)
