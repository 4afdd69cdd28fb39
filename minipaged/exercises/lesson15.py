"""Lesson 15 exercises: the arithmetic intensity of a decode step, and the largest batch a memory
budget allows.

    decode_intensity(dims, batch_size, context_len, dtype_bytes) -> float
        FLOPs per byte moved of one decode step of ``batch_size`` sequences, each attending to
        ``context_len`` tokens, with weights and KV of ``dtype_bytes`` bytes per number:
            FLOPs = batch_size x (2 x dims.weight_params
                                  + 4 x num_layers x num_heads x head_size x context_len)
            bytes = dims.weight_params x dtype_bytes                  (read once, for the batch)
                    + batch_size x context_len x dims.kv_bytes_per_token(dtype_bytes)
    max_batch_size(kv_budget_bytes, kv_bytes_per_token, block_size, seq_len) -> int
        how many sequences of ``seq_len`` tokens fit a KV pool of ``kv_budget_bytes``: the pool
        holds whole blocks of ``block_size`` tokens, and a sequence needs whole blocks too.
    later_steps(start, block_table, num_steps, block_size) -> list[(position, slot, context_len)]
        multi-step decode: the inputs of each of a decode run's ``num_steps`` steps when step 0
        runs the token at position ``start``.

Expected answers: ``roofline.decode_step(...).intensity``, ``roofline.max_batch_size`` and
``engine.multi_step.later_steps``.
"""
from __future__ import annotations

import math

from minipaged.engine.multi_step import later_steps
from minipaged.exercises import checking
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
from minipaged.lab import roofline
from minipaged.model_shape import ModelShape


def random_dims(rng) -> ModelShape:
    heads = rng.choice([4, 8, 9, 12, 32])
    head_size = rng.choice([32, 64, 128])
    return ModelShape(num_layers=rng.randint(1, 40), hidden_size=heads * head_size,
                      intermediate_size=rng.choice([2, 3, 4]) * heads * head_size,
                      num_heads=heads, num_kv_heads=rng.choice([h for h in (1, 2, 3, 4, 8, heads)
                                                                if heads % h == 0]),
                      head_size=head_size, vocab_size=rng.choice([256, 32000, 50257]),
                      max_positions=rng.choice([1024, 2048, 8192]),
                      gated_mlp=rng.random() < 0.5)


def _close(a, b) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isclose(
        a, b, rel_tol=1e-9)


@exercise
def check_decode_intensity(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("decode_intensity", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        dims = random_dims(rng)
        b, ctx, nbytes = rng.choice([1, 2, 8, 64, 256]), rng.randint(1, 4096), rng.choice([2, 4])
        expected = roofline.decode_step(dims, b, ctx, nbytes).intensity
        got = learner(dims, b, ctx, nbytes)
        if not _close(got, expected):
            weights = dims.weight_params * nbytes
            kv = b * ctx * dims.kv_bytes_per_token(nbytes)
            flops = roofline.decode_step(dims, b, ctx, nbytes).flops
            hint = "FLOPs over bytes, each counted as the exercise text says"
            if _close(got, flops / weights):
                hint = "the KV cache is read too: every sequence reads its context's K and V"
            elif _close(got, flops / (b * weights + kv)):
                hint = ("the weights are read once per step, whatever the batch size: all the "
                        "sequences of the batch share that read")
            elif _close(got, 2 * b * dims.weight_params / (weights + kv)):
                hint = "attention does FLOPs too: q.k and p.V over the context, in every layer"
            fail(learner.name, case, f"dims={dims}, batch_size={b}, context_len={ctx}, "
                 f"dtype_bytes={nbytes}", got, expected, hint)
    return passed(learner, num_cases)


@exercise
def check_max_batch_size(fn, num_cases: int = 300, seed: int | None = 0) -> CheckResult:
    learner = Learner("max_batch_size", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        per_token = rng.choice([1, 6, 4096, 46080, 524288])
        block_size, seq_len = rng.choice([1, 8, 16, 32]), rng.randint(1, 2048)
        budget = rng.randint(0, 200 * seq_len * per_token)
        if case % 4 == 0:  # exactly on a boundary
            budget = math.ceil(seq_len / block_size) * block_size * per_token * rng.randint(0, 9)
        expected = roofline.max_batch_size(budget, per_token, block_size, seq_len)
        got = learner(budget, per_token, block_size, seq_len)
        if got != expected or isinstance(got, bool):
            hint = "count whole blocks: the pool's, then each sequence's"
            if got == budget // (per_token * seq_len):
                hint = ("a sequence takes whole blocks: its last block is allocated whole, "
                        "even when only partly filled")
            elif isinstance(got, float) or got == budget / (per_token * seq_len):
                hint = "a batch is a whole number of sequences"
            elif got == expected + 1:
                hint = "the pool holds whole blocks only: the bytes left over hold no block"
            fail(learner.name, case, f"kv_budget_bytes={budget}, kv_bytes_per_token="
                 f"{per_token}, block_size={block_size}, seq_len={seq_len}", got, expected, hint)
    return passed(learner, num_cases)


@exercise
def check_later_steps(fn, num_cases: int = 300, seed: int | None = 0) -> CheckResult:
    learner = Learner("later_steps", fn)
    rng = rng_for(seed)
    for case in range(num_cases):
        block_size = rng.choice([1, 2, 4, 8, 16, 32])
        num_steps, start = rng.randint(1, 16), rng.randint(0, 300)
        num_blocks = -(-(start + num_steps) // block_size) + rng.randint(0, 2)  # + lookahead
        table = rng.sample(range(4 * num_blocks + 8), num_blocks)  # blocks anywhere in the pool
        expected = later_steps(start, table, num_steps, block_size)
        got = learner(start, list(table), num_steps, block_size)
        got = [tuple(x) for x in got] if isinstance(got, (list, tuple)) else got
        if got != expected:
            hint = "each step: its position, the slot of that position, the context length"
            if not isinstance(got, list) or len(got) != num_steps:
                hint = "a list with one (position, slot, context_len) per step: num_steps of them"
            elif got[0][0] == start + 1:
                hint = "step 0 runs the token at start itself; step j the one j positions on"
            elif [g[2] for g in got] == [e[0] for e in expected]:
                hint = "the context a token attends to includes the token itself"
            elif [g[1] for g in got] == [table[0] * block_size + e[0] for e in expected]:
                hint = ("the blocks are anywhere in the pool: look up each position's own "
                        "block, block_table[position // block_size]")
            fail(learner.name, case, f"start={start}, block_table={table}, num_steps={num_steps}"
                 f", block_size={block_size}", got, expected, hint)
    return passed(learner, num_cases)


def usable_max_batch_size(fn):
    """``fn`` once its check passed; until then the package's ``roofline.max_batch_size``."""
    return checking.usable("max_batch_size", fn, roofline.max_batch_size)


__all__ = ["check_decode_intensity", "check_max_batch_size", "check_later_steps",
           "usable_max_batch_size"]
