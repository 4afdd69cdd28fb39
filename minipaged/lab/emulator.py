"""The kernel of ``csrc/paged_attention.cu``, run lane by lane in NumPy (lessons 05 and 06).

The emulator follows the CUDA file step by step, so the lesson can run the kernel on a laptop
and the tests can check its logic without a GPU:

- a CUDA block (one per (head, sequence)) is one call of ``_cuda_block``; its 4 warps are a loop;
- a warp is an array of 32 lanes: a value held in a register by every lane is an array of
  shape (32,) (or (32, n) for n registers per lane);
- ``__shfl_xor_sync(FULL_MASK, v, mask)`` is ``v[LANES ^ mask]`` (every lane reads its partner's
  value at once), see ``shfl_xor`` and ``butterfly_reduce``;
- shared memory is a NumPy array (``logits``, ``scratch``, ``out_smem``), filled with NaN where
  the kernel has not written yet, so a read before a write shows up in the output;
- ``__syncthreads()`` is the boundary between two phases: everything before it (every warp) is
  finished before anything after it starts.

The constants (lanes per token, chunks per lane, rows per lane, ...) carry the same names as in
the CUDA file; ``KernelShape`` computes them.

Trace records
-------------
Pass ``trace=[]`` to record every butterfly step; ``trace_filter=(seq, head)`` keeps only one
CUDA block's steps. Each record is a plain dict (JSON-serialisable):

    {"phase": "qk_dot" | "max" | "sum" | "logits_v",
     "stage": "warp" | "across_warps",   # inside one warp, or the warps' values combined
     "seq": int, "head": int, "warp": int,
     "block": int | None,   # logical KV block (qk_dot only)
     "slot": int | None,    # which of a lane's registers (logits_v: a lane owns several rows)
     "step": int,           # 0, 1, ... within this butterfly
     "mask": int,           # lane l exchanges with lane l ^ mask
     "pairs": [[lane, partner], ...],   # 32 pairs: lane reads partner's value
     "values_before": [32 floats], "values_after": [32 floats]}

``butterfly_reduce(values, op, masks, trace=...)`` appends records of the same shape (the fields
it was not told are None) so the lesson can show a butterfly on 32 numbers.

Fault injection (for tests and the lesson): ``paged_attention(..., _masks={"sum": (16, 8, 4, 2)})``
replaces the masks of one phase's in-warp butterfly; ``_partner=lambda mask: lanes`` replaces the
partner of every lane (default ``LANES ^ mask``). A broken sum, q.k or logits.V butterfly changes
the output; a broken *max* butterfly does not (softmax is unchanged by subtracting any constant
from every logit; the maximum only keeps ``exp`` from overflowing).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WARP_SIZE = 32
LANES = np.arange(WARP_SIZE)  # lane ids 0..31
FLT_MAX = np.float32(np.finfo(np.float32).max)

_OPS = {"sum": np.add, "max": np.maximum}


# ----------------------------------------------------------------------------------------------
# Warp primitives
# ----------------------------------------------------------------------------------------------
def shfl_xor(values: np.ndarray, mask: int) -> np.ndarray:
    """``__shfl_xor_sync(FULL_MASK, v, mask)``: lane l gets the value of lane l ^ mask."""
    return values[LANES ^ mask]


def butterfly_masks(first: int, last: int = 1) -> tuple[int, ...]:
    """The masks first, first/2, ..., last (empty when first < last), like the CUDA loop."""
    masks = []
    mask = first
    while mask >= last and mask > 0:
        masks.append(mask)
        mask //= 2
    return tuple(masks)


def butterfly_reduce(values, op, masks=(16, 8, 4, 2, 1), trace=None, *, partner=None, **info):
    """Reduce across lanes with XOR shuffles; every lane ends with the result of its team.

    Args:
        values: (32,) one value per lane, or (32, n): n registers per lane, reduced separately.
        op: "sum", "max" or a binary NumPy function.
        masks: the shuffle masks in order; (16, 8, 4, 2, 1) reduces all 32 lanes, (1,) pairs
            neighbours only.
        trace: a list to append one record per step (and per register) to, or None.
        partner: fault injection: ``partner(mask)`` gives the 32 lanes read (default lane ^ mask).
        info: fields copied into each trace record (phase, seq, head, warp, ...).
    """
    fn = _OPS[op] if isinstance(op, str) else op
    values = np.asarray(values, dtype=np.float32)
    assert values.shape[0] == WARP_SIZE, "one value per lane"
    for step, mask in enumerate(masks):
        lanes_read = LANES ^ mask if partner is None else np.asarray(partner(mask))
        after = fn(values, values[lanes_read]).astype(np.float32)
        if trace is not None:
            _record(trace, values, after, lanes_read, step, mask, info)
        values = after
    return values


def _record(trace, before, after, lanes_read, step, mask, info):
    pairs = [[int(lane), int(lanes_read[lane])] for lane in LANES]
    columns = [None] if before.ndim == 1 else range(before.shape[1])
    for slot in columns:
        b = before if slot is None else before[:, slot]
        a = after if slot is None else after[:, slot]
        record = {"phase": None, "stage": None, "seq": None, "head": None, "warp": None,
                  "block": None, "slot": slot}
        record.update(info)
        record.update({"step": step, "mask": int(mask), "pairs": pairs,
                       "values_before": [float(v) for v in b],
                       "values_after": [float(v) for v in a]})
        trace.append(record)


# ----------------------------------------------------------------------------------------------
# The kernel's compile-time constants
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelShape:
    """The template constants of ``paged_attention_kernel`` for one configuration."""

    head_size: int
    block_size: int
    x: int  # elements per 16-byte vector: 4 for fp32, 8 for fp16/bf16
    num_threads: int = 128

    def __post_init__(self):
        if self.num_threads % WARP_SIZE or self.num_warps & (self.num_warps - 1):
            raise ValueError("num_threads must be 32 times a power of two")
        if self.block_size > WARP_SIZE or WARP_SIZE % self.block_size:
            raise ValueError("block_size must divide 32 (one warp pass covers one KV block)")
        if self.head_size % self.x:
            raise ValueError("head_size must be a multiple of x")
        if self.block_size % self.x:
            raise ValueError("block_size must be a multiple of x (a value row is whole vectors)")

    @property
    def num_warps(self) -> int:
        return self.num_threads // WARP_SIZE

    # phase 2 (q.k)
    @property
    def G(self) -> int:  # lanes per token: one thread group per token of the block
        return max(WARP_SIZE // self.block_size, 1)

    @property
    def NUM_K_CHUNKS(self) -> int:  # 16-byte chunks in one key
        return self.head_size // self.x

    @property
    def K_CHUNKS_PER_LANE(self) -> int:
        return -(-self.NUM_K_CHUNKS // self.G)

    # phase 4 (probabilities . V)
    @property
    def V_VEC(self) -> int:  # tokens in one lane's slice of a value row: one 16-byte vector
        return self.x

    @property
    def V_VECS_PER_ROW(self) -> int:  # lanes that share a row
        return self.block_size // self.V_VEC

    @property
    def ROWS_PER_PASS(self) -> int:
        return WARP_SIZE // self.V_VECS_PER_ROW

    @property
    def ROWS_PER_LANE(self) -> int:
        return -(-self.head_size // self.ROWS_PER_PASS)


# ----------------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------------
def paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale, *,
                    num_threads=128, trace=None, trace_filter=None, _masks=None, _partner=None):
    """Single-query paged attention, computed the way the CUDA kernel computes it.

    Same arguments and result as ``minipaged.kernels.reference.paged_attention``: torch tensors or
    NumPy arrays in, the same kind, dtype and shape (num_seqs, num_heads, head_size) out. The
    math runs in float32 whatever the input dtype. ``x`` is read from ``key_cache.shape[4]``, so float32
    data laid out with x = 8 runs the fp16/bf16 variant of the kernel.
    """
    q = _as_float32(query)  # (S, H, D)
    k_cache = _as_float32(key_cache)  # (N, kv_heads, D // x, block_size, x)
    v_cache = _as_float32(value_cache)  # (N, kv_heads, D, block_size)
    tables = np.asarray(_as_numpy(block_tables), dtype=np.int64)  # (S, max_blocks)
    lens = np.asarray(_as_numpy(context_lens), dtype=np.int64)  # (S,)
    num_seqs, num_heads, head_size = q.shape
    num_kv_heads, block_size, x = k_cache.shape[1], k_cache.shape[3], k_cache.shape[4]
    if num_heads % num_kv_heads:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    shape = KernelShape(head_size, block_size, x, num_threads)
    faults = {"masks": _masks or {}, "partner": _partner}

    out = np.full(q.shape, np.nan, dtype=np.float32)  # every element must be written
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for seq in range(num_seqs):  # gridDim.y
            for head in range(num_heads):  # gridDim.x
                kv_head = head // (num_heads // num_kv_heads)
                record = trace is not None and (trace_filter is None or trace_filter == (seq, head))
                out[seq, head] = _cuda_block(
                    shape, q[seq, head], k_cache[:, kv_head], v_cache[:, kv_head], tables[seq],
                    int(lens[seq]), np.float32(scale), faults,
                    trace if record else None, {"seq": seq, "head": head},
                )
    return _like(out, query)


def key_loads_per_block(c: KernelShape, shared_group_load: bool = False) -> tuple[int, int]:
    """(load instructions one warp issues for the keys of one KV block in phase 2, bytes each
    lane loads per instruction): ours, each lane whole 16-byte chunks; vLLM's
    (``shared_group_load``, MINIPAGED_SHARED_GROUP_LOAD), the G lanes of a group 16 / G bytes
    each of every chunk (lesson 05; tests/kernels/test_kernel_trace.py counts the real kernel's)."""
    if shared_group_load:
        return c.NUM_K_CHUNKS, 16 // c.G
    return c.K_CHUNKS_PER_LANE, 16


def warp_blocks(warp: int, start: int, end: int, block_size: int, num_warps: int = 4) -> list[int]:
    """The KV blocks of the sequence (indices into its block table) that warp ``warp`` visits,
    in order, in a CUDA block that covers the tokens [start, end) (``start`` a multiple of
    ``block_size``; V1: [0, context_len), V2: one partition): the kernel's phase 2 and 4 loops."""
    first_block = start // block_size
    num_blocks = -(-(end - start) // block_size)
    return [first_block + b for b in range(warp, num_blocks, num_warps)]


def _cuda_block(c: KernelShape, q, key_cache, value_cache, block_table, context_len, scale,
                faults, trace, ids):
    """One CUDA block: one query head of one sequence. Returns the output row (head_size,)."""
    masks = faults["masks"]
    partner = faults["partner"]
    num_blocks = -(-context_len // c.block_size)

    # ---- phase 1: the query into shared memory ------------------------------------------------
    q_smem = q.astype(np.float32)  # (D,)
    # __syncthreads()

    # ---- phase 2: q.k for every token ----------------------------------------------------------
    logits = np.full(num_blocks * c.block_size, np.nan, dtype=np.float32)  # shared memory
    qk_max = np.full((c.num_warps, WARP_SIZE), -FLT_MAX, dtype=np.float32)  # a register
    token_in_block = LANES // c.G  # which token of the block each lane's group handles
    lane_in_group = LANES % c.G  # which chunks of the key the lane handles
    chunk = lane_in_group[:, None] + c.G * np.arange(c.K_CHUNKS_PER_LANE)  # (32, n)
    chunk_ok = chunk < c.NUM_K_CHUNKS  # the `if (c < NUM_K_CHUNKS)` of the unrolled loop
    chunk = np.where(chunk_ok, chunk, 0)
    q_chunks = q_smem.reshape(c.NUM_K_CHUNKS, c.x)[chunk]  # (32, n, x) each lane's q chunks
    qk_masks = masks.get("qk_dot", butterfly_masks(c.G // 2))
    for warp in range(c.num_warps):
        for b in warp_blocks(warp, 0, context_len, c.block_size, c.num_warps):
            k_block = key_cache[block_table[b]]  # (D // x, block_size, x)
            k_vals = k_block[chunk, token_in_block[:, None]]  # (32, n, x): 16-byte loads
            partial = np.where(chunk_ok, (q_chunks * k_vals).sum(-1), 0).sum(-1)  # (32,)
            # The G lanes of a group add their partial dot products (masks G/2 .. 1).
            qk = scale * butterfly_reduce(partial, "sum", qk_masks, trace, partner=partner,
                                          phase="qk_dot", stage="warp", warp=warp, block=b,
                                          **ids)
            token = b * c.block_size + token_in_block  # (32,)
            in_context = token < context_len
            writes = in_context & (lane_in_group == 0)
            logits[token[writes]] = qk[writes]
            qk_max[warp] = np.where(in_context, np.maximum(qk_max[warp], qk), qk_max[warp])

    # ---- phase 3: softmax ----------------------------------------------------------------------
    # Maximum: groups already agree, so the warp butterfly stops at mask G (16, 8, ..., G).
    max_logit = _block_reduce(c, qk_max, "max", masks.get("max", butterfly_masks(16, c.G)),
                              -FLT_MAX, partner, trace, ids)  # (warps, 32), all equal
    # (the barrier inside the reduction makes every logit visible to every thread)
    thread_of = np.arange(context_len) % c.num_threads  # thread i handles tokens i, i+128, ...
    exps = np.exp(logits[:context_len] - max_logit.reshape(-1)[thread_of])
    logits[:context_len] = exps
    padded = np.zeros(-(-context_len // c.num_threads) * c.num_threads, dtype=np.float32)
    padded[:context_len] = exps
    exp_sum = padded.reshape(-1, c.num_threads).sum(0).reshape(c.num_warps, WARP_SIZE)
    exp_sum = _block_reduce(c, exp_sum, "sum", masks.get("sum", butterfly_masks(16)),
                            np.float32(0), partner, trace, ids)  # (warps, 32), all equal
    inv_sum = np.float32(1) / exp_sum.reshape(-1)  # (threads,)
    logits[:context_len] *= inv_sum[thread_of]  # logits are now probabilities
    # __syncthreads()

    # ---- phase 4: probabilities . V ------------------------------------------------------------
    row_in_pass = LANES // c.V_VECS_PER_ROW  # (32,)
    slice_ = LANES % c.V_VECS_PER_ROW  # which V_VEC tokens of the block the lane reads
    rows = row_in_pass[:, None] + c.ROWS_PER_PASS * np.arange(c.ROWS_PER_LANE)  # (32, R)
    row_ok = rows < c.head_size
    rows = np.where(row_ok, rows, 0)
    token_offsets = slice_[:, None] * c.V_VEC + np.arange(c.V_VEC)  # (32, V_VEC) in the block
    acc = np.zeros((c.num_warps, WARP_SIZE, c.ROWS_PER_LANE), dtype=np.float32)  # registers
    for warp in range(c.num_warps):
        for b in warp_blocks(warp, 0, context_len, c.block_size, c.num_warps):
            v_block = value_cache[block_table[b]]  # (D, block_size)
            tokens = b * c.block_size + token_offsets  # (32, V_VEC)
            in_context = tokens < context_len
            probs = np.where(in_context, logits[tokens], 0)  # (32, V_VEC)
            vals = v_block[rows[:, :, None], token_offsets[:, None, :]]  # (32, R, V_VEC)
            if b == num_blocks - 1:  # the tail of the last block was never written: zero it
                vals = np.where(in_context[:, None, :], vals, 0)
            acc[warp] += np.where(row_ok, (probs[:, None, :] * vals).sum(-1), 0)

    # Lanes sharing a row add their slices (masks V_VECS_PER_ROW/2 .. 1).
    v_masks = masks.get("logits_v", butterfly_masks(c.V_VECS_PER_ROW // 2))
    out_smem = np.full((c.num_warps, c.head_size), np.nan, dtype=np.float32)  # shared memory
    for warp in range(c.num_warps):
        acc[warp] = butterfly_reduce(acc[warp], "sum", v_masks, trace, partner=partner,
                                     phase="logits_v", stage="warp", warp=warp, **ids)
        writes = (slice_ == 0)[:, None] & row_ok  # the first lane of each row team writes
        out_smem[warp, rows[writes]] = acc[warp][writes]
    # __syncthreads(); thread d adds row d over the warps
    return out_smem.sum(0)


def _block_reduce(c, values, op, warp_masks, identity, partner, trace, ids):
    """``block_reduce`` of the CUDA file: values (warps, 32) -> the result in every thread."""
    scratch = np.full(c.num_warps, np.nan, dtype=np.float32)  # red_smem
    for warp in range(c.num_warps):  # step 1: butterfly inside each warp
        v = butterfly_reduce(values[warp], op, warp_masks, trace, partner=partner, phase=op,
                             stage="warp", warp=warp, **ids)
        scratch[warp] = v[0]  # step 2: lane 0 writes the warp's result
    # __syncthreads()
    result = np.empty_like(values)
    for warp in range(c.num_warps):  # step 3: every warp combines the warps' results
        lanes = np.where(LANES < c.num_warps, scratch[np.minimum(LANES, c.num_warps - 1)],
                         identity).astype(np.float32)
        v = butterfly_reduce(lanes, op, butterfly_masks(c.num_warps // 2), trace,
                             partner=partner, phase=op, stage="across_warps", warp=warp, **ids)
        result[warp] = v[0]  # __shfl_sync(FULL_MASK, v, 0): lane 0's value to every lane
    return result


# ----------------------------------------------------------------------------------------------
# Memory addresses: which bytes one warp reads in one 16-byte load (phase 2)
# ----------------------------------------------------------------------------------------------
def warp_key_load(c: KernelShape, element_bytes: int, layout: str = "paged", load: int = 0,
                  num_kv_heads: int = 1, kv_block: int = 0, kv_head: int = 0) -> dict:
    """The byte addresses the 32 lanes read in their ``load``-th 16-byte key load of one block.

    Lane l belongs to thread group l // G (token ``l // G`` of the block) and loads the key's
    16-byte chunk ``l % G + load * G``, as in phase 2 of the kernel. ``layout`` says where that
    chunk lives, as a byte offset from the start of the key cache:

    - "paged": the kernel's layout [num_blocks, num_kv_heads, head_size / x, block_size, x]:
      chunk c of token t is at ((kv_block * num_kv_heads + kv_head) * head_size / x + c)
      * block_size + t, in 16-byte units;
    - "naive": [num_blocks, num_kv_heads, block_size, head_size], a token's key contiguous:
      ((kv_block * num_kv_heads + kv_head) * block_size + t) * head_size / x + c.

    Returns {"lane", "token", "chunk", "address"} (lists of 32, address None where the lane has
    no chunk to load), "sectors" (distinct 32-byte sectors touched: the unit a GPU moves from
    memory) and "lines" (distinct 128-byte cache lines: memory transactions of the load).
    """
    if c.x * element_bytes != 16:
        raise ValueError("x must be 16 // element_bytes")
    lanes = LANES
    token = lanes // c.G
    chunk = lanes % c.G + load * c.G
    head_base = kv_block * num_kv_heads + kv_head  # which (block, kv head) slab
    if layout == "paged":
        vector = (head_base * c.NUM_K_CHUNKS + chunk) * c.block_size + token
    elif layout == "naive":
        vector = (head_base * c.block_size + token) * c.NUM_K_CHUNKS + chunk
    else:
        raise ValueError('layout must be "paged" or "naive"')
    address = [int(v) * 16 if ch < c.NUM_K_CHUNKS else None for v, ch in zip(vector, chunk)]
    used = [a for a in address if a is not None]
    return {
        "lane": lanes.tolist(), "token": token.tolist(), "chunk": chunk.tolist(),
        "address": address,
        "sectors": len({a // 32 for a in used} | {(a + 15) // 32 for a in used}),
        "lines": len({a // 128 for a in used} | {(a + 15) // 128 for a in used}),
    }


# ----------------------------------------------------------------------------------------------
# torch / NumPy at the edges
# ----------------------------------------------------------------------------------------------
def _as_numpy(t):
    if hasattr(t, "detach"):  # a torch tensor
        return t.detach().cpu().float().numpy() if t.is_floating_point() else t.cpu().numpy()
    return np.asarray(t)


def _as_float32(t) -> np.ndarray:
    return np.asarray(_as_numpy(t), dtype=np.float32)


def _like(out: np.ndarray, query):
    """``out`` as the same kind of array as ``query`` (torch tensor or NumPy array, same dtype)."""
    if hasattr(query, "detach"):
        import torch

        return torch.from_numpy(out).to(dtype=query.dtype, device=query.device)
    return out.astype(np.asarray(query).dtype)
