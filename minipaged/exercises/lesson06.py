"""Lesson 06 exercises: which KV blocks a warp visits, and V2's combination of partitions.

    warp_blocks(warp, start, end, block_size) -> [blocks]
        the KV blocks of the sequence (indices into its block table) that warp ``warp`` of a
        CUDA block covering the tokens [start, end) visits, in order (4 warps per CUDA block)
    combine_partitions(max_logits, exp_sums, outs) -> (head_size,) array
        V2's second kernel: from each partition's maximum logit, sum of exponentials and
        normalised output, the attention output over the whole context

Expected answers: ``emulator.warp_blocks`` (the loop the real kernel's recorded visits follow,
tests/kernels/test_kernel_trace.py); for the partitions, softmax over the whole context times the
values, computed in float64 by NumPy, on logits up to 1000 away from 0 (past float64's exp).
"""
from __future__ import annotations

import numpy as np

from minipaged.lab import emulator as emu
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for


@exercise
def check_warp_blocks(fn, num_cases: int = 300, seed: int | None = 0) -> CheckResult:
    learner = Learner("warp_blocks", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        block_size = rng.choice([8, 16, 32])
        partition = 512 if case % 2 else None  # V2 partitions of 512 tokens, or V1
        context_len = rng.randint(1, 1600 if partition else 300)
        if partition:
            start = rng.randrange(0, context_len, partition)
            end = min(start + partition, context_len)
        else:
            start, end = 0, context_len
        warp = rng.randrange(4)
        expected = emu.warp_blocks(warp, start, end, block_size)
        got = learner(warp, start, end, block_size)
        got = list(got) if isinstance(got, (list, tuple, range)) else got
        if got != expected:
            hint = ("the warps deal the CUDA block's KV blocks like cards, 4 players; count "
                    "the blocks from the one that holds token `start`, and round up")
            if isinstance(got, list) and expected and got and got[0] != expected[0]:
                hint = ("the first block: a V2 partition starts at token `start`, so its "
                        "blocks start at the block of the sequence that holds that token")
            fail(learner.name, case, f"warp={warp}, start={start}, end={end}, "
                 f"block_size={block_size}", got, expected, hint)
    return passed(learner, num_cases)


@exercise
def check_combine_partitions(fn, num_cases: int = 100, seed: int | None = 0) -> CheckResult:
    learner = Learner("combine_partitions", fn)
    rng = np.random.default_rng(seed)
    for case in range(num_cases):
        length, head_size, size = int(rng.integers(1, 2000)), 8, 512
        logits = rng.standard_normal(length) * float(rng.choice([1.0, 30.0]))
        if case % 4 == 3:
            # NOTE: softmax ignores a shift, float64 does not: exp(750) overflows and exp(-750)
            # is 0, so an answer that weighs partitions by exp(max_logit) without one common
            # maximum subtracted gives inf / inf or 0 / 0 here.
            logits += float(rng.choice([1.0, -1.0])) * float(rng.uniform(750.0, 1000.0))
        values = rng.standard_normal((length, head_size))
        starts = range(0, length, size)
        max_logits = np.array([logits[s:s + size].max() for s in starts])
        exp_sums = np.array([np.exp(logits[s:s + size] - m).sum()
                             for s, m in zip(starts, max_logits)])
        outs = np.stack([np.exp(logits[s:s + size] - m) / e @ values[s:s + size]
                         for s, m, e in zip(starts, max_logits, exp_sums)])
        p = np.exp(logits - logits.max())
        expected = p / p.sum() @ values
        got = learner(max_logits.copy(), exp_sums.copy(), outs.copy())
        got = np.asarray(got, dtype=np.float64) if got is not None else got
        if got is None or got.shape != expected.shape or not np.allclose(got, expected,
                                                                       rtol=1e-6, atol=1e-9):
            hint = ("each partition's output is normalised by its own sum with its own "
                    "maximum: weigh it by how much of the whole softmax it holds, measured "
                    "against one common maximum")
            if got is not None and got.shape == expected.shape and not np.isfinite(got).all():
                hint = ("NaN or overflow: exponentials of raw logits overflow; subtract the "
                        "largest maximum first")
            fail(learner.name, case, f"{len(outs)} partitions, head_size={head_size}",
                 None if got is None else np.round(got[:3], 4).tolist(),
                 np.round(expected[:3], 4).tolist(), hint)
    return passed(learner, num_cases)
