"""Lesson 05 exercises: a butterfly, the address of a key element, a lane's loads, load counts.

    warp_reduce(values, op) -> (32,) array
        reduce 32 lane values with XOR shuffles (``emulator.shfl_xor``), so that every
        lane ends with the result, as the kernel's butterflies do
    key_offset(block, head, dim, slot, num_kv_heads, head_size, block_size, x) -> int
        the element offset of key element ``dim`` of the token in ``slot`` of physical block
        ``block``, kv head ``head``, in the key cache laid out as
        [num_blocks, num_kv_heads, head_size // x, block_size, x]
    lane_key_chunks(lane, head_size, block_size, x) -> (token, [chunks])
        in phase 2, which token of the KV block lane ``lane`` works on, and which 16-byte chunks
        of that token's key it loads, in the order of its loads
    key_loads(head_size, block_size, x, shared) -> (instructions, bytes)
        for one KV block in phase 2: the load instructions one warp issues for the keys, and the
        bytes each lane loads per instruction, with our load (``shared=False``) or vLLM's
        thread-group-shared one (``shared=True``)

Expected answers: ``emulator.butterfly_reduce``; the shape of the cache engine's key
blocks (``CacheEngine.key_block_shape``), flattened by NumPy; the lanes' loads of
``emulator.warp_key_load``, load after load; ``emulator.key_loads_per_block`` (which
tests/kernels/test_kernel_trace.py checks against the real kernel's recorded loads).
"""
from __future__ import annotations

import numpy as np
import torch

from minipaged.lab import emulator as emu
from minipaged.worker.cache_engine import CacheEngine
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for


@exercise
def check_warp_reduce(fn, num_cases: int = 100, seed: int | None = 0) -> CheckResult:
    learner = Learner("warp_reduce", fn)
    rng = np.random.default_rng(seed)
    for case in range(num_cases):
        op = ("sum", "max")[case % 2]
        values = rng.standard_normal(emu.WARP_SIZE).astype(np.float32)
        expected = emu.butterfly_reduce(values, op)
        got = np.asarray(learner(values.copy(), op), dtype=np.float32)
        if got.shape != expected.shape or not np.allclose(got, expected, rtol=1e-5, atol=1e-5):
            hint = ("every lane must end with the result of all 32 lanes: each butterfly "
                    "step should double how many lanes a value has met")
            if got.shape == expected.shape and len(set(np.round(got, 4))) > 1:
                hint = ("the lanes disagree at the end: some lanes never met; how many "
                        "doublings cover 32 lanes?")
            fail(learner.name, case, f"values=<32 floats>, op={op!r}", got.tolist()[:4],
                 expected.tolist()[:4], hint)
    return passed(learner, num_cases)


@exercise
def check_key_offset(fn, num_cases: int = 300, seed: int | None = 0) -> CheckResult:
    learner = Learner("key_offset", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        dtype = rng.choice([torch.float16, torch.float32])
        x = 16 // torch.tensor([], dtype=dtype).element_size()
        num_kv_heads, head_size = rng.randint(1, 4), rng.choice([32, 64, 128])
        block_size, num_blocks = rng.choice([1, 8, 16, 32]), rng.randint(1, 6)
        shape = (num_blocks, *CacheEngine(1, num_kv_heads, head_size, block_size, 0, 0, dtype,
                                          torch.device("cpu")).key_block_shape())
        block, head = rng.randrange(num_blocks), rng.randrange(num_kv_heads)
        dim, slot = rng.randrange(head_size), rng.randrange(block_size)
        expected = int(np.ravel_multi_index((block, head, dim // x, slot, dim % x), shape))
        args = (block, head, dim, slot, num_kv_heads, head_size, block_size, x)
        got = learner(*args)
        if got != expected:
            hint = ("walk the key cache's shape from the outermost dimension in: the head "
                    "dimension is split in two (which chunk, and where in it), and the slot "
                    "sits BETWEEN the two parts, so one token's x elements are contiguous")
            fail(learner.name, case, "block=%d, head=%d, dim=%d, slot=%d, num_kv_heads=%d, "
                 "head_size=%d, block_size=%d, x=%d" % args, got, expected, hint)
    return passed(learner, num_cases)


def _expected_lane_chunks(shape: emu.KernelShape, lane: int) -> tuple[int, list[int]]:
    """Lane ``lane``'s token and chunks, read off ``warp_key_load`` one load at a time."""
    element_bytes = 16 // shape.x
    loads = [emu.warp_key_load(shape, element_bytes, load=k)
             for k in range(shape.K_CHUNKS_PER_LANE)]
    token = loads[0]["token"][lane]
    return token, [load["chunk"][lane] for load in loads if load["address"][lane] is not None]


@exercise
def check_lane_key_chunks(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("lane_key_chunks", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        x = rng.choice([4, 8])
        block_size = rng.choice([b for b in (4, 8, 16, 32) if b % x == 0])
        head_size = rng.choice([h for h in (32, 48, 64, 80, 96, 128, 256) if h % x == 0])
        shape = emu.KernelShape(head_size, block_size, x)
        lane = rng.randrange(emu.WARP_SIZE)
        expected = _expected_lane_chunks(shape, lane)
        got = learner(lane, head_size, block_size, x)
        got = (got[0], list(got[1])) if isinstance(got, (tuple, list)) and len(got) == 2 else got
        if got != expected:
            G, n = shape.G, shape.NUM_K_CHUNKS
            hint = (f"G = {G} neighbouring lanes share a token and deal its {n} chunks "
                    f"among themselves like cards, one round of G chunks per load")
            if isinstance(got, tuple) and got[0] != expected[0]:
                hint = (f"the token: a warp covers one KV block, with a group of G = {G} "
                        f"neighbouring lanes per token")
            elif isinstance(got, tuple) and sorted(got[1]) == expected[1] and got[1] != expected[1]:
                hint = ("the right chunks in the wrong order: list them in the order the "
                        "lane loads them, one per round")
            elif isinstance(got, tuple) and len(got[1]) != len(expected[1]):
                hint = (f"count the chunks: the key has {n} chunks of x = {x} elements; a lane "
                        f"whose next chunk would be {n} or more has no load left (the kernel's "
                        f"`if (c < NUM_K_CHUNKS)`)")
            fail(learner.name, case, f"lane={lane}, head_size={head_size}, "
                 f"block_size={block_size}, x={x}", got, expected, hint)
    return passed(learner, num_cases)


@exercise
def check_key_loads(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("key_loads", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        x = rng.choice([4, 8])
        block_size = rng.choice([8, 16, 32])
        head_size = rng.choice([h for h in (64, 80, 96, 112, 128, 256) if h % x == 0])
        shared = case % 2 == 1
        shape = emu.KernelShape(head_size, block_size, x)
        expected = emu.key_loads_per_block(shape, shared_group_load=shared)
        got = learner(head_size, block_size, x, shared)
        got = tuple(got) if isinstance(got, (tuple, list)) else got
        if got != expected:
            hint = ("ours: the lanes of a thread group deal the key's whole chunks among "
                    "themselves, so a warp needs one round per G chunks (a last, partial round "
                    "counts too)")
            if shared:
                hint = ("vLLM's: every lane of a group takes part in every chunk, so the group "
                        "splits each 16 bytes G ways and walks the chunks one by one")
            fail(learner.name, case, f"head_size={head_size}, block_size={block_size}, x={x}, "
                 f"shared={shared}", got, expected, hint)
    return passed(learner, num_cases)
