"""The answers to the lessons' code exercises. The checkers' tests prove each one passes; the
lessons use them only when run headless with MINIPAGED_SOLUTIONS=1. Try the exercise first!"""
from __future__ import annotations

# ---- lesson 01 -------------------------------------------------------------------------------


def bytes_per_token(num_layers, num_kv_heads, head_size, dtype_bytes):
    return 2 * num_layers * num_kv_heads * head_size * dtype_bytes


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


# ---- lesson 05 ----------------------------------------------------------------------------


def warp_reduce(values, op):
    import numpy as np

    from minipaged.lab.emulator import shfl_xor

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


def key_loads(head_size, block_size, x, shared):
    G = max(32 // block_size, 1)  # lanes per token
    chunks = head_size // x  # 16-byte chunks in one key
    return (chunks, 16 // G) if shared else (-(-chunks // G), 16)


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


def warp_blocks(warp, start, end, block_size):
    first_block = start // block_size
    num_blocks = -(-(end - start) // block_size)
    return [first_block + b for b in range(warp, num_blocks, 4)]


def combine_partitions(max_logits, exp_sums, outs):
    import numpy as np

    weights = exp_sums * np.exp(max_logits - max_logits.max())  # each partition's share
    return weights @ outs / weights.sum()


# ---- lesson 07 (forward pass) ------------------------------------------------


def chunk_mask(context_len, num_new):
    import torch

    first = context_len - num_new  # position of the chunk's first token
    rows = torch.arange(first, context_len)[:, None]  # (num_new, 1): each new token's position
    cols = torch.arange(context_len)[None, :]  # (1, context_len)
    return cols <= rows


def rotate(vec, position, inv_freq):
    import torch

    half = vec.shape[0] // 2
    angle = position * inv_freq  # (D/2,)
    x, y = vec[:half], vec[half:]
    return torch.cat((x * angle.cos() - y * angle.sin(), x * angle.sin() + y * angle.cos()))


# ---- lesson 09 (continuous batching) -----------------------------------------


def prefill_chunks(budget, num_decodes, tokens_left):
    left = budget - num_decodes  # the decodes come first, and may even exceed the budget
    taken = []
    for need in tokens_left:
        take = max(0, min(need, left))
        taken.append(take)
        left -= take
    return taken


def first_token_steps(budget, num_decodes, prompt_lens):
    left = list(prompt_lens)
    steps = [0] * len(left)
    step = 0
    while not all(steps):
        step += 1
        todo = [i for i, s in enumerate(steps) if not s]
        for i, take in zip(todo, prefill_chunks(budget, num_decodes, [left[i] for i in todo])):
            left[i] -= take
            if left[i] == 0:
                steps[i] = step
                num_decodes += 1  # from the next step on it decodes
    return steps


# ---- lesson 10 (sampling) ----------------------------------------------------


def top_p_filter(logits, top_p):
    import torch

    if top_p >= 1.0:
        return logits.clone()
    sorted_logits, order = torch.sort(logits, descending=True)  # (V,) most likely first
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens before each one
    drop_sorted = before >= top_p
    drop_sorted[0] = False  # the most likely token always stays
    drop = torch.zeros_like(drop_sorted)
    drop[order] = drop_sorted
    return logits.masked_fill(drop, float("-inf"))


def beam_step(cum_logprobs, logprobs, width):
    import torch

    scores = torch.tensor(cum_logprobs, dtype=logprobs.dtype)[:, None] + logprobs  # (B, V)
    best = torch.topk(scores.flatten(), width).indices.tolist()  # best first
    vocab = logprobs.shape[-1]
    return [(i // vocab, i % vocab) for i in best]


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


def decode_intensity(dims, batch_size, context_len, dtype_bytes):
    attention = 4 * dims.num_layers * dims.num_heads * dims.head_size * context_len
    flops = batch_size * (2 * dims.weight_params + attention)
    moved = (dims.weight_params * dtype_bytes
             + batch_size * context_len * dims.kv_bytes_per_token(dtype_bytes))
    return flops / moved


def max_batch_size(kv_budget_bytes, kv_bytes_per_token, block_size, seq_len):
    num_blocks = kv_budget_bytes // (block_size * kv_bytes_per_token)
    return num_blocks // -(-seq_len // block_size)  # ceil(seq_len / block_size) blocks each


def later_steps(start, block_table, num_steps, block_size):
    steps = []
    for position in range(start, start + num_steps):
        block = block_table[position // block_size]
        steps.append((position, block * block_size + position % block_size, position + 1))
    return steps


# ---- lesson 16 (capstone) ----------------------------------------------------


def pick_victims(running, num_free):
    queue, kept, preempted = list(running), [], []
    while queue:
        group = queue.pop(0)
        while group.blocks_needed > num_free:
            victim = queue.pop() if queue else group
            preempted.append(victim.request_id)
            num_free += victim.blocks_held
            if victim is group:
                break
        else:
            num_free -= group.blocks_needed
            kept.append(group.request_id)
    return kept, preempted


def step_slot_mapping(seqs, block_size, slot_of):
    prompts = [s for s in seqs if s.num_computed_tokens == 0]
    decodes = [s for s in seqs if s.num_computed_tokens > 0]
    slots = [slot_of(s.block_table, pos, block_size)
             for s in prompts for pos in range(len(s.token_ids))]
    return slots + [slot_of(s.block_table, len(s.token_ids) - 1, block_size) for s in decodes]


# ---- lesson 17 -------------------------------------------------------------------------------


def v1_names():
    return {"SequenceGroup": "Request",
            "Sequence.num_computed_tokens": "Request.num_computed_tokens",
            "SchedulerOutputs": "SchedulerOutput",
            "BlockSpaceManager": "KVCacheManager",
            "FreeListAllocator": "BlockPool",
            "PhysicalTokenBlock": "KVCacheBlock",
            "PhysicalTokenBlock.ref_count": "KVCacheBlock.ref_cnt",
            "prepare_inputs": "GPUModelRunner._prepare_inputs",
            "InputMetadata": "FlashAttentionMetadata",
            "LLMEngine.step": "EngineCore.step",
            "blocks_to_swap_out": None,  # V1 preempts by recompute only
            "blocks_to_copy": None}  # no copy-on-write: n > 1 shares through prefix caching


def predict_v1_steps():
    # a: 10 + 4 tokens, b: 7 + 3, c: 5 + 2; budget 8, blocks of 4, a pool of 6.
    return [{"a": 8},  # a's prompt cut to a chunk of 8
            {"a": 2, "b": 6},  # a's last 2 prompt tokens (samples), b's first chunk
            {"a": 1, "b": 1},  # c needs 2 blocks, 1 is free: it waits
            {"a": 1, "b": 1},
            {"a": 1},  # a takes the last free block; b needs one more: b is preempted
            {"b": 8},  # b recomputes its 7 prompt + 2 sampled tokens: 8 fit the budget
            {"b": 1, "c": 5},
            {"c": 1}]


# ---- lesson 18 (KV cache quantization) ---------------------------------------


def quantize_vector(x, fmt):
    import torch

    dtype, largest = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}[fmt]
    amax = float(x.float().abs().max())
    scale = torch.tensor(amax, dtype=torch.float32) / largest if amax > 0 else torch.tensor(1.0)
    y = (x.float() / scale).clamp(-largest, largest)
    if fmt == "int8":
        y = torch.round(y)
    return y.to(dtype), float(scale)


from minipaged.exercises.answers.lesson18 import dequantize_q4_1  # noqa: E402


# ---- lesson 20 (a new model is a diff) ---------------------------------------

from minipaged.exercises.answers.lesson20 import qwen3_queries_keys  # noqa: E402
