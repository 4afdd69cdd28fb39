"""The real kernel's loops, recorded while it runs on the CPU (lessons 05 and 06).

The traced CPU builds of ``csrc/paged_attention.cu`` (``cuda_on_cpu.load("traced")`` and
``load("shared_load")``) compile its ``MP_TRACE(kind, a, b, value)`` calls into calls of the CPU
runtime's recorder; every other build compiles them to nothing. ``run_traced`` runs the kernel
with the recorder on and sorts what each CUDA thread recorded into one dict per CUDA block::

    out, trace = run_traced(query, key_cache, value_cache, block_tables, context_lens, scale)
    t = trace[(head, seq, partition)]          # blockIdx (x, y, z); partition 0 in V1; in the
                                               # grouped kernel (version 3) x is the kv head
    t["visits"][w]        # phase 2: the sequence's KV blocks warp w visits, in its order
    t["physical"][w]      #          the same visits as physical block numbers
    t["logits"]           # phase 2: float32 [tokens of the CUDA block], scale * q.k, unnormalised
    t["group_logits"]     #          float32 [query heads of the CUDA block, tokens]: version 3
                          #          computes the logits of every query head of the kv head
    t["max"], t["exp_sum"]  # phase 3: the CUDA block's maximum logit and sum of exponentials
                          #          (of its first query head, in version 3)
    t["lane_sums"]        # phase 4: float32 [warps, head_size, slices]: each lane's part of a
                          #          row (its slice of the block's tokens) before any shuffle
    t["warp_sums"]        # phase 4: float32 [warps, head_size]: each warp's rows after its
                          #          butterfly; summed over warps, the output row (V1)
    t["key_loads"]        # phase 2: per warp, per lane, [(byte offset in key_cache, bytes)]
    t["value_loads"]      # phase 4: the same for value_cache

``visit_loads`` cuts one warp's ``key_loads`` to one KV block; ``key_load_counts`` turns them
into what a GPU's memory system sees: load instructions, bytes, 32-byte sectors and 128-byte
cache lines. ``loaded_bytes`` adds up a whole launch's loads (the cache bytes a decode step
reads) and ``key_readers`` says which CUDA blocks loaded each key: lesson 18 compares the
per-head kernels with the grouped one (version 3), which loads each key once per group.
"""
from __future__ import annotations

WARP_SIZE, NUM_WARPS = 32, 4  # the kernel's 128 threads per CUDA block
SECTOR_BYTES, LINE_BYTES = 32, 128
# MP_TRACE kinds: the TraceKind enum of csrc/paged_attention_common.cuh
VISIT, KEY_LOAD, LOGIT, MAX, EXP_SUM, LANE_SUM, WARP_SUM, VALUE_LOAD = range(1, 9)


def run_traced(query, key_cache, value_cache, block_tables, context_lens, scale, version=1,
               variant="traced", kernels=None):
    """Run the real kernel with its loops recorded; returns ``(out, trace)`` (see the module).

    ``variant`` is the build ("traced", or "shared_load" for vLLM's key load); ``version`` 1
    (one CUDA block per head and sequence), 2 (partitions of 512 tokens) or 3 (one CUDA block
    per kv head and partition for its group of query heads; it always loads keys our way).
    """
    import torch

    from minipaged.kernels import cuda_on_cpu

    if variant not in ("traced", "shared_load"):
        raise ValueError(f"variant must be 'traced' or 'shared_load', not {variant!r}")
    kernels = kernels or cuda_on_cpu.load(variant)
    module = kernels.module
    module.trace_events(True)
    try:
        out = kernels.paged_attention(query, key_cache, value_cache, block_tables, context_lens,
                                      scale, version=version)
    finally:
        ints, values = module.take_events()
        module.trace_events(False)
    head_size = query.shape[-1]
    x = 16 // key_cache.element_size()
    slices = key_cache.shape[3] // x  # V_VECS_PER_ROW: lanes that share a value row
    base, value_base = key_cache.data_ptr(), value_cache.data_ptr()
    trace: dict[tuple, dict] = {}
    for row, value in zip(ints.tolist(), values.tolist()):
        kind, bx, by, bz, thread, a, b = row
        t = trace.get((bx, by, bz))
        if t is None:
            t = trace[(bx, by, bz)] = _empty_block_trace(head_size, slices)
        warp, lane = divmod(thread, WARP_SIZE)
        if kind == VISIT and lane == 0:
            t["visits"][warp].append(a)
            t["physical"][warp].append(b)
        elif kind == KEY_LOAD:
            t["key_loads"][warp][lane].append((a - base, b))
        elif kind == VALUE_LOAD:
            t["value_loads"][warp][lane].append((a - value_base, b))
        elif kind == LOGIT:  # (token, query head of the group, logit)
            t["_logits"].setdefault(b, {})[a] = value
        elif kind == MAX and thread == 0 and a == 0:
            t["max"] = value
        elif kind == EXP_SUM and thread == 0 and a == 0:
            t["exp_sum"] = value
        elif kind == LANE_SUM and a < head_size:
            t["lane_sums"][warp, a, b] = value
        elif kind == WARP_SUM:
            t["warp_sums"][warp, a] = value
    for t in trace.values():
        per_head = t.pop("_logits") or {0: {}}
        first = min(per_head[0], default=0)
        t["first_token"] = first
        t["group_logits"] = torch.tensor(
            [[logits[i] for i in range(first, first + len(logits))]
             for _, logits in sorted(per_head.items())], dtype=torch.float32)
        t["logits"] = t["group_logits"][0]
    return out, trace


def _empty_block_trace(head_size: int, slices: int) -> dict:
    import torch

    return {"visits": [[] for _ in range(NUM_WARPS)], "physical": [[] for _ in range(NUM_WARPS)],
            "_logits": {}, "max": float("nan"), "exp_sum": float("nan"),
            "lane_sums": torch.zeros(NUM_WARPS, head_size, slices),
            "warp_sums": torch.zeros(NUM_WARPS, head_size),
            "key_loads": [[[] for _ in range(WARP_SIZE)] for _ in range(NUM_WARPS)],
            "value_loads": [[[] for _ in range(WARP_SIZE)] for _ in range(NUM_WARPS)]}


def visit_loads(block_trace: dict, warp: int = 0, visit: int = 0) -> list[list[tuple]]:
    """Per lane, the (byte offset, bytes) key loads of warp ``warp`` in its ``visit``-th KV
    block, in the lane's order (the i-th load of every lane is the warp's i-th instruction)."""
    visits = len(block_trace["visits"][warp])
    if not 0 <= visit < visits:
        raise ValueError(f"warp {warp} visited {visits} KV blocks, so visit {visit} is not one")
    lanes = block_trace["key_loads"][warp]
    per_lane = [len(loads) // visits for loads in lanes]  # a lane loads alike in every visit
    return [loads[visit * n:(visit + 1) * n] for loads, n in zip(lanes, per_lane)]


def key_load_counts(block_trace: dict, warp: int = 0) -> dict:
    """What one warp's phase-2 key loads ask of memory in one KV block (every visit is alike).

    The warp issues one load *instruction* per iteration of the load loop (all lanes at once),
    and the memory system serves it in the 32-byte sectors and 128-byte lines its lanes' bytes
    fall into. Returns ``instructions``, ``lane_loads``, ``bytes_per_load``, ``bytes``,
    ``sectors`` and ``lines`` (summed over the instructions) and ``distinct_sectors`` (the
    sectors of the block's keys that were read at all).
    """
    lanes = visit_loads(block_trace, warp)
    instructions = max(len(loads) for loads in lanes)
    sectors = lines = 0
    all_sectors = set()
    for i in range(instructions):
        touched = [loads[i] for loads in lanes if i < len(loads)]
        s = {sector for addr, size in touched
             for sector in range(addr // SECTOR_BYTES, (addr + size - 1) // SECTOR_BYTES + 1)}
        sectors += len(s)
        lines += len({sector * SECTOR_BYTES // LINE_BYTES for sector in s})
        all_sectors |= s
    return {"instructions": instructions, "lane_loads": sum(len(loads) for loads in lanes),
            "bytes_per_load": max(size for loads in lanes for _, size in loads),
            "bytes": sum(size for loads in lanes for _, size in loads),
            "sectors": sectors, "lines": lines, "distinct_sectors": len(all_sectors)}


def loaded_bytes(trace: dict) -> dict:
    """The bytes of key_cache and of value_cache a traced launch loaded, over all its CUDA
    blocks: {"key": ..., "value": ..., "total": ...}. A decode step reads these from memory."""
    key = sum(size for t in trace.values() for warp in t["key_loads"] for lane in warp
              for _, size in lane)
    value = sum(size for t in trace.values() for warp in t["value_loads"] for lane in warp
                for _, size in lane)
    return {"key": key, "value": value, "total": key + value}


def key_readers(trace: dict, key_cache) -> dict:
    """{(kv head, physical block, slot in the block): the CUDA blocks (blockIdx) that loaded
    some of that token's key}. key_cache [num_blocks, num_kv_heads, head_size / x, block_size,
    x] gives the layout that turns a load's byte offset back into its token."""
    size = key_cache.element_size()
    block_stride, head_stride = key_cache.stride(0), key_cache.stride(1)
    block_size, x = key_cache.shape[3], key_cache.shape[4]
    readers: dict[tuple, set] = {}
    for cuda_block, t in trace.items():
        for warp in t["key_loads"]:
            for lane in warp:
                for offset, _ in lane:
                    element = offset // size
                    physical, rest = divmod(element, block_stride)
                    kv_head, within = divmod(rest, head_stride)
                    slot = within // x % block_size
                    readers.setdefault((kv_head, physical, slot), set()).add(cuda_block)
    return readers


def reference_logits(query, key_cache, value_cache, block_tables, context_lens, scale,
                     seq: int, head: int):
    """float32 [context_lens[seq]]: scale * q.k of every token of ``seq`` for query ``head``,
    from the torch reference's gather of the cache (what phase 2 must compute)."""
    from minipaged.kernels.reference import gather_kv

    num_heads, num_kv_heads = query.shape[1], key_cache.shape[1]
    keys, _ = gather_kv(key_cache, value_cache, block_tables[seq:seq + 1])  # (1, kv, L, D)
    kv_head = head // (num_heads // num_kv_heads)
    k = keys[0, kv_head, :int(context_lens[seq])].float()  # (tokens, head_size)
    return (k @ query[seq, head].float()) * scale  # (tokens,)
