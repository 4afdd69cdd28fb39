"""Lesson 01 exercises: the bytes of a token's cache, and what a contiguous reservation wastes.

    bytes_per_token(num_layers, num_kv_heads, head_size, dtype_bytes) -> int
    reservation_slots(request, num_tokens) -> {"used": .., "reserved": .., "internal": ..}
    paged_slots(num_tokens, block_size) -> (blocks held, empty slots in them)

The expected answers come from ``kv_bytes_per_token`` (``minipaged/model_shape.py``), from
replaying the request through ``kv_memory.contiguous_waste``, and from a real
``BlockSpaceManager``.
"""
from __future__ import annotations

from collections import Counter

from minipaged.sampling_params import SamplingParams
from minipaged.lab import kv_memory
from minipaged.core.block_manager import BlockSpaceManager
from minipaged.exercises.checking import CheckResult, Learner, exercise, fail, passed, rng_for
from minipaged.model_shape import kv_bytes_per_token
from minipaged.sequence import Sequence, SequenceGroup


@exercise
def check_bytes_per_token(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("bytes_per_token", fn)
    rng = rng_for(seed)
    shapes = [(s.num_layers, s.num_kv_heads, s.head_size, kv_memory.FP16_BYTES)
              for s in kv_memory.MODEL_SHAPES.values()]
    shapes += [(rng.randint(1, 96), rng.randint(1, 64), rng.choice([32, 64, 80, 96, 128, 256]),
                rng.choice([1, 2, 4])) for _ in range(num_cases - len(shapes))]
    for i, args in enumerate(shapes):
        expected = kv_bytes_per_token(*args)
        got = learner(*args)
        if got != expected:
            hint = ("you are off by a factor of 2: every token stores a key AND a value vector"
                    if got * 2 == expected else
                    "count what one token leaves behind in every layer: for each kv head, "
                    "vectors of head_size elements, each dtype_bytes long")
            fail(learner.name, i, "num_layers=%d, num_kv_heads=%d, head_size=%d, dtype_bytes=%d"
                 % args, got, expected, hint)
    return passed(learner, len(shapes))


def _contiguous_kinds(request: kv_memory.Request, step: int) -> dict[str, int]:
    """What the package's contiguous allocator holds for ``request`` alone, ``step`` steps in."""
    report = kv_memory.contiguous_waste([request], capacity=request.max_len, layout_step=step)
    counts = Counter()
    for kind, n in report.layout:
        counts[kind] += n
    return {kind: counts.get(kind, 0) for kind in ("used", "reserved", "internal")}


@exercise
def check_reservation_slots(fn, num_cases: int = 150, seed: int | None = 0) -> CheckResult:
    learner = Learner("reservation_slots", fn)
    rng = rng_for(seed)
    trace = kv_memory.request_trace(num_cases, seed=rng.randrange(1 << 30),
                                   max_lens=(16, 64, 512, 2048))
    for i, request in enumerate(trace):
        step = rng.randrange(request.output_len)
        num_tokens = request.prompt_len + 1 + step  # the first step holds prompt + one token
        expected = _contiguous_kinds(request, step)
        got = learner(request, num_tokens)
        if got != expected:
            hint = "used: tokens stored now; reserved: tokens it will still generate; "\
                   "internal: slots up to max_len it will never reach"
            if isinstance(got, dict) and sum(got.values()) != request.max_len:
                hint = ("the three counts must add up to the whole reservation, max_len = "
                        f"{request.max_len} slots")
            fail(learner.name, i, f"request={request}, num_tokens={num_tokens}", got, expected,
                 hint)
    return passed(learner, len(trace))


def _paged_expected(num_tokens: int, block_size: int) -> tuple[int, int]:
    bm = BlockSpaceManager(block_size, num_gpu_blocks=num_tokens // block_size + 2,
                           num_cpu_blocks=0, watermark=0.0)
    seq = Sequence(0, None, list(range(num_tokens)), block_size)
    bm.allocate(SequenceGroup("0", [seq], SamplingParams(), arrival_time=0.0))
    held = len(bm.get_block_table(seq))
    return held, held * block_size - num_tokens


@exercise
def check_paged_slots(fn, num_cases: int = 200, seed: int | None = 0) -> CheckResult:
    learner = Learner("paged_slots", fn)
    rng = rng_for(seed)
    cases = [(16, 16), (17, 16), (1, 1), (1, 16)]
    cases += [(rng.randint(1, 300), rng.choice([1, 2, 4, 8, 16, 32]))
              for _ in range(num_cases - len(cases))]
    for i, (num_tokens, block_size) in enumerate(cases):
        expected = _paged_expected(num_tokens, block_size)
        got = learner(num_tokens, block_size)
        if tuple(got) != expected:
            hint = ("a block is held as soon as one token is in it: a full last block needs "
                    "no extra block, and one more token opens a new one")
            fail(learner.name, i, f"num_tokens={num_tokens}, block_size={block_size}",
                 got, expected, hint)
    return passed(learner, len(cases))
