"""Lesson 06: V2's fused reduce, run on the CPU (the real kernels, CUDA on the CPU).

With ``set_v2_reduce(1)`` no reduce kernel runs after V2's partitions: each partition's CUDA
block counts itself done on its (sequence, head)'s counter (version 3: its (sequence, kv head)'s)
and the block that finishes last combines the partitions (csrc/paged_attention.cu, "The fused
reduce"). These tests check it against the torch reference (error relative to each sequence's
output norm, N(0,1) inputs) and against the separate reduce kernel, which runs the same combine
code on the same partition results, so the two must agree bit for bit.

A GPU runs blocks in no promised order, and the last block to finish is the one that combines:
the CUDA-on-CPU runtime runs the blocks in blockIdx order, reversed (partition 0 finishes last)
or shuffled (``set_block_order``). Every cache slot a sequence must not read is NaN, and the
output starts as NaN, so an unread slot that is read, or a row nobody writes, shows up.

Slow: the emulated kernels, ~65 s on the 2-core machine once built (the first build takes
minutes).
"""
import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from budgets import examples
from minipaged.kernels import cuda_on_cpu, kv_quant, reference

pytestmark = [pytest.mark.lesson06, pytest.mark.slow]

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
SEPARATE, FUSED = 0, 1  # set_v2_reduce's modes
IN_ORDER, REVERSED, SHUFFLED = 0, 1, 2  # set_block_order's orders


@pytest.fixture(scope="module")
def kernels():
    return cuda_on_cpu.load()


@contextlib.contextmanager
def reduce_mode(kernels, mode, partition_size=0, order=IN_ORDER, seed=0):
    """Every call inside runs with this reduce, partition size (0: the plan's) and block order."""
    kernels.set_v2_reduce(mode)
    kernels.force_partition_size(partition_size)
    kernels.module.set_block_order(order, seed)
    try:
        yield
    finally:
        kernels.module.set_block_order(IN_ORDER, 0)
        kernels.force_partition_size(0)
        kernels.set_v2_reduce(SEPARATE)


def make_batch(lens, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
               dtype=torch.float32, seed=0):
    """N(0,1) inputs with shuffled blocks, and the reference output of each sequence.

    Returns (inputs, ref): inputs = (query, key_cache, value_cache, block_tables, context_lens,
    scale), in which every slot no sequence may read is NaN (the tail of a last block, and the
    spare block that pads the block tables); ref is reference.paged_attention on the same
    inputs before the NaN went in (NaN for an empty context).
    """
    g = torch.Generator().manual_seed(seed)
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    blocks = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks) + 1
    pad = num_blocks - 1  # the padding target
    pool = torch.randperm(pad, generator=g).tolist()
    tables = torch.full((len(lens), max(blocks) + 1), pad, dtype=torch.int32)  # (S, width)
    used = 0
    for seq, n in enumerate(blocks):
        tables[seq, :n] = torch.tensor(pool[used:used + n], dtype=torch.int32)
        used += n
    key_cache = torch.randn(num_blocks, num_kv_heads, head_size // x, block_size, x,
                            generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, num_kv_heads, head_size, block_size,
                              generator=g).to(dtype)
    query = torch.randn(len(lens), num_heads, head_size, generator=g).to(dtype)  # (S, H, D)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_size ** -0.5
    ref = reference.paged_attention(query, key_cache, value_cache, tables, context_lens, scale)
    key_cache[pad] = float("nan")
    value_cache[pad] = float("nan")
    for seq, n in enumerate(lens):
        if n % block_size:
            last = int(tables[seq, blocks[seq] - 1])
            key_cache[last, :, :, n % block_size:, :] = float("nan")
            value_cache[last, :, :, n % block_size:] = float("nan")
    return (query, key_cache, value_cache, tables, context_lens, scale), ref


def run(kernels, inputs, version, max_context_len=None, kv_scales=None):
    """One kernel call into a NaN-filled output, the lengths unchecked on the host (as on a GPU,
    so that empty contexts reach the kernel)."""
    query, key_cache, value_cache, tables, lens, scale = inputs
    out = torch.full(query.shape, float("nan"), dtype=query.dtype)
    longest = int(lens.max()) if max_context_len is None else max_context_len
    kernels.module.set_host_checks(False)
    try:
        if kv_scales is None:
            kernels.module.paged_attention(out, query, key_cache, value_cache, tables, lens,
                                           scale, longest, version)
        else:
            kernels.module.paged_attention_8bit(out, query, key_cache, value_cache, *kv_scales,
                                                tables, lens, scale, longest, version)
    finally:
        kernels.module.set_host_checks(True)
    return out


def check(out, ref, lens, dtype):
    """Empty contexts give zeros; every other sequence is within tolerance of the reference."""
    lens = list(lens)
    empty = [s for s, n in enumerate(lens) if n == 0]
    full = [s for s, n in enumerate(lens) if n > 0]
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert not out[full].isnan().any(), "NaN reached the output (unread slot, or unwritten)"
    a, b = out[full].double().flatten(1), ref[full].double().flatten(1)
    err = ((a - b).norm(dim=1) / b.norm(dim=1)).max().item()
    assert err < TOLERANCE[dtype], f"per-sequence relative error {err:.2e}"


def separate_and_fused(kernels, inputs, version, partition_size, order, seed=0, **kw):
    """The output with the reduce kernel (blocks in order) and with the fused reduce."""
    with reduce_mode(kernels, SEPARATE, partition_size):
        separate = run(kernels, inputs, version, **kw)
    with reduce_mode(kernels, FUSED, partition_size, order, seed):
        fused = run(kernels, inputs, version, **kw)
    return separate, fused


# 0 and 1 token, exactly one and two 64-token partitions, every partition size's multiple
# (1024), and contexts of 1 to 18 partitions side by side in one launch
MIXED = [0, 1, 64, 128, 700, 1024, 1100]


@pytest.mark.parametrize("version,heads", [(2, (4, 2)), (3, (9, 3))], ids=["V2", "V3-GQA3"])
@pytest.mark.parametrize("partition_size,order", [(64, SHUFFLED), (128, REVERSED),
                                                  (256, IN_ORDER), (512, SHUFFLED)])
def test_fused_reduce_matches_the_reference_and_the_reduce_kernel(kernels, partition_size,
                                                                  order, version, heads):
    inputs, ref = make_batch(MIXED, *heads, seed=partition_size + version)
    separate, fused = separate_and_fused(kernels, inputs, version, partition_size, order,
                                         seed=partition_size)
    check(fused, ref, MIXED, torch.float32)
    assert torch.equal(fused, separate)  # the same combine on the same partition results


@pytest.mark.parametrize("version,heads", [(2, (4, 2)), (3, (8, 2))], ids=["V2", "V3-GQA4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d).split(".")[-1])
def test_fused_reduce_in_every_dtype(kernels, dtype, version, heads):
    lens = [300, 0, 129, 1, 900]
    inputs, ref = make_batch(lens, *heads, head_size=128, block_size=32, dtype=dtype, seed=3)
    separate, fused = separate_and_fused(kernels, inputs, version, 128, SHUFFLED, seed=1)
    check(fused, ref, lens, dtype)
    assert torch.equal(fused, separate)


@pytest.mark.parametrize("version,heads", [(2, (4, 4)), (3, (6, 1))], ids=["V2", "V3-MQA"])
def test_a_second_call_resets_nothing_it_needs(kernels, version, heads):
    """The counters are back at 0 after a call (and zeroed before each): a second call, its
    blocks in another order, gives the first call's output bit for bit."""
    lens = [650, 64, 0, 200]
    inputs, ref = make_batch(lens, *heads, block_size=8, seed=9)
    with reduce_mode(kernels, FUSED, 64, SHUFFLED, seed=1):
        first = run(kernels, inputs, version)
        kernels.module.set_block_order(REVERSED, 0)
        second = run(kernels, inputs, version)
    check(first, ref, lens, torch.float32)
    assert torch.equal(first, second)


@pytest.mark.parametrize("version", [2, 3])
def test_empty_and_broken_contexts_as_with_the_reduce_kernel(kernels, version):
    """No reduce kernel writes their rows, so partition 0's block does: zeros for an empty
    context, NaN for a negative one and for one with more partitions than max_context_len
    allows; the other sequences are right."""
    lens = [40, 0, 600, 7, 300]
    inputs, ref = make_batch(lens, 4, 2 if version == 2 else 1, seed=11)
    inputs[4][3] = -5  # negative
    for order in (IN_ORDER, REVERSED):
        with reduce_mode(kernels, FUSED, 128, order):  # 4 partitions for max_context_len 512
            out = run(kernels, inputs, version, max_context_len=512)  # 600 tokens: 5, too many
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        assert out[2].isnan().all() and out[3].isnan().all()
        check(out[[0, 4]], ref[[0, 4]], [40, 300], torch.float32)


def test_the_fused_reduce_is_one_launch(kernels):
    """V2 and version 3 with several partitions: one launch instead of two."""
    for version, heads in ((2, (4, 2)), (3, (4, 2))):
        inputs, _ = make_batch([600, 5], *heads, seed=2)
        for mode, launches in ((SEPARATE, 2), (FUSED, 1)):
            with reduce_mode(kernels, mode):
                before = kernels.module.counters()[0]
                run(kernels, inputs, version)
                assert kernels.module.counters()[0] - before == launches, (version, mode)


def test_the_plan_adds_the_counters_to_the_workspace_and_checks_the_mode(kernels):
    plan = kernels.paged_attention_plan
    separate = plan(1, 32, 128, 4096)  # 32 partitions of 128 tokens
    with reduce_mode(kernels, FUSED):
        assert plan(1, 32, 128, 4096) == (2, separate[1] + 32 * 4, 128)  # one int per head
        # version 3: one counter per (sequence, kv head) used, num_seqs * num_heads slots kept
        assert plan(2, 9, 64, 600, 3, num_kv_heads=3) == (3, 2 * 9 * 2 * (2 + 64) * 4
                                                          + 2 * 9 * 4, 512)
        # one partition: version 3 writes the outputs, no workspace at all
        assert plan(2, 9, 64, 300, 3, num_kv_heads=3) == (3, 0, 512)
        # more partitions than the logits buffer holds weights for: the reduce kernel
        kernels.force_partition_size(64)
        assert plan(1, 4, 64, 64 * 513, 2)[1] == 4 * 513 * (2 + 64) * 4
        assert plan(1, 4, 64, 64 * 512, 2)[1] == 4 * 512 * (2 + 64) * 4 + 4 * 4
        for bad in (2, -1):
            with pytest.raises(RuntimeError, match="reduce mode must be 0"):
                kernels.set_v2_reduce(bad)
    assert plan(1, 32, 128, 4096) == separate


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_fused_reduce_on_an_8bit_cache(kernels, kind):
    """An 8-bit cache (lesson 18) takes V2's launch, so the fused reduce too."""
    g = torch.Generator().manual_seed(4)
    lens, block_size, num_kv_heads, head = [500, 0, 70], 16, 2, 64
    num_blocks = sum(math.ceil(n / block_size) for n in lens)
    dtype = kv_quant.STORAGE[kind]
    key_cache = torch.zeros(num_blocks, num_kv_heads, head // 16, block_size, 16, dtype=dtype)
    value_cache = torch.zeros(num_blocks, num_kv_heads, head, block_size, dtype=dtype)
    scales = tuple(torch.zeros(num_blocks, num_kv_heads, block_size) for _ in range(2))
    slots = torch.arange(num_blocks * block_size)
    kernels.reshape_and_cache(torch.randn(len(slots), num_kv_heads, head, generator=g),
                              torch.randn(len(slots), num_kv_heads, head, generator=g),
                              key_cache, value_cache, slots, kv_scales=scales)
    tables = torch.zeros(len(lens), max(math.ceil(n / block_size) for n in lens),
                         dtype=torch.int32)
    used = 0
    for seq, n in enumerate(lens):
        n_blocks = math.ceil(n / block_size)
        tables[seq, :n_blocks] = torch.arange(used, used + n_blocks)
        used += n_blocks
    query = torch.randn(len(lens), 4, head, generator=g)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    inputs = (query, key_cache, value_cache, tables, context_lens, head ** -0.5)
    ref = reference.paged_attention(*inputs, kv_scales=scales)
    separate, fused = separate_and_fused(kernels, inputs, 2, 64, SHUFFLED, kv_scales=scales)
    check(fused, ref, lens, torch.float32)
    assert torch.equal(fused, separate)


@settings(max_examples=examples(6), deadline=None)
@given(lens=st.lists(st.integers(0, 300), min_size=1, max_size=4).filter(any),
       partition_size=st.sampled_from([64, 128]), version=st.sampled_from([2, 3]),
       order=st.sampled_from([IN_ORDER, REVERSED, SHUFFLED]), seed=st.integers(0, 2**16))
def test_any_batch_fused_equals_the_reduce_kernel(kernels, lens, partition_size, version, order,
                                                  seed):
    inputs, ref = make_batch(lens, 4, 2, block_size=16, seed=seed)
    separate, fused = separate_and_fused(kernels, inputs, version, partition_size, order, seed)
    check(fused, ref, lens, torch.float32)
    assert torch.equal(fused, separate)
