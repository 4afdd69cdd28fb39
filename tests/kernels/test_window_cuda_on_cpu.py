"""Sliding windows in the CUDA decode kernels, run on the CPU (lessons 06 and 20).

With ``window=W`` the newest token (position context_len - 1) sees positions
context_len - W .. context_len - 1 only. Every kernel (V1; V2 with its reduce kernel or the fused
reduce, at every partition size and block order; version 3, grouped; V1 and V2 on an 8-bit
cache) starts its block loop at the window's first block and masks that block's tokens before
the window; V2 and version 3 skip the partitions wholly before it. Each is compared with
``reference.paged_attention(..., window=)`` on N(0,1) inputs, by the error relative to each
sequence's output norm.

"Never read" is checked by poison: every block wholly before a sequence's window is replaced in
its table by a block of NaN (as a block gone back to the free list may hold anything), and the
tokens of the window's first block that lie before the window are NaN too; so are the tail of
the last block and the padding. One NaN read reaches the output.

``pytest -s`` prints the worst relative error per kernel and dtype. Slow: the emulated kernels
(every CUDA thread a host thread), and the first build takes minutes.
"""
import contextlib
import math
import warnings

import pytest
import torch

from minipaged.kernels import cuda_on_cpu, kv_quant, ops, reference

pytestmark = [pytest.mark.lesson06, pytest.mark.slow]

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
SEPARATE, FUSED = 0, 1  # set_v2_reduce's modes
IN_ORDER, REVERSED, SHUFFLED = 0, 1, 2  # set_block_order's orders
NAN = float("nan")
WORST = {}  # (what, dtype) -> worst per-sequence relative error seen


@pytest.fixture(scope="module")
def kernels():
    return cuda_on_cpu.load()


@contextlib.contextmanager
def launch_mode(kernels, reduce=SEPARATE, partition_size=0, order=IN_ORDER, seed=0):
    """Every call inside runs with this reduce, partition size (0: the plan's) and block order."""
    kernels.set_v2_reduce(reduce)
    kernels.force_partition_size(partition_size)
    kernels.module.set_block_order(order, seed)
    try:
        yield
    finally:
        kernels.module.set_block_order(IN_ORDER, 0)
        kernels.force_partition_size(0)
        kernels.set_v2_reduce(SEPARATE)


def first_seen(n, window):
    """The first position the newest of n tokens sees through a window (None: no window)."""
    return max(0, n - window) if window else 0


def windowed_batch(lens, window, num_heads=4, num_kv_heads=2, head_size=64, block_size=16,
                   dtype=torch.float32, seed=0):
    """N(0,1) inputs in shuffled blocks, the reference with ``window``, then the poison.

    Returns (inputs, ref): inputs = (query, key_cache, value_cache, block_tables, context_lens,
    scale) in which every slot the window hides is NaN: blocks wholly before the window are
    the NaN block in the tables, the first block's tokens before the window are NaN, as are the
    tail of the last block and the padding.
    """
    g = torch.Generator().manual_seed(seed)
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    blocks = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(blocks) + 1
    nan_block = num_blocks - 1
    pool = torch.randperm(nan_block, generator=g).tolist()
    tables = torch.full((len(lens), max(blocks) + 1), nan_block, dtype=torch.int32)  # (S, width)
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
    ref = reference.paged_attention(query, key_cache, value_cache, tables, context_lens, scale,
                                    window=window)
    key_cache[nan_block] = NAN
    value_cache[nan_block] = NAN
    for seq, n in enumerate(lens):
        if n % block_size:  # the tail of the last block was never written
            last = int(tables[seq, blocks[seq] - 1])
            key_cache[last, :, :, n % block_size:, :] = NAN
            value_cache[last, :, :, n % block_size:] = NAN
        lo = first_seen(n, window)
        tables[seq, :lo // block_size] = nan_block  # left the window: freed, never read
        if lo % block_size:  # the window's first block: its tokens before the window
            first = int(tables[seq, lo // block_size])
            key_cache[first, :, :, :lo % block_size, :] = NAN
            value_cache[first, :, :, :lo % block_size] = NAN
    return (query, key_cache, value_cache, tables, context_lens, scale), ref


def run(kernels, inputs, version, window, kv_scales=None):
    """One call through ``CudaKernels.paged_attention`` into a NaN-filled output."""
    query = inputs[0]
    out = torch.full(query.shape, NAN, dtype=query.dtype)
    return kernels.paged_attention(*inputs, out=out, version=version, window=window,
                                   kv_scales=kv_scales)


def check(out, ref, dtype, what):
    """No NaN (no hidden slot was read, every row written) and each sequence within tolerance."""
    assert not out.isnan().any(), "NaN reached the output: a slot outside the window was read"
    a, b = out.double().flatten(1), ref.double().flatten(1)
    err = ((a - b).norm(dim=1) / b.norm(dim=1)).max().item()
    key = (what, str(dtype).split(".")[-1])
    WORST[key] = max(WORST.get(key, 0.0), err)
    assert err < TOLERANCE[dtype], f"{what}: per-sequence relative error {err:.2e}"
    return err


# contexts of 1 token to a few hundred; windows shorter than a block (1, 5), equal to one (16),
# spanning blocks (37, 100), equal to some contexts (17, 300) and longer than all (1000)
LENS = [1, 7, 16, 17, 100, 300]
WINDOWS = [1, 5, 16, 17, 37, 100, 300, 1000]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("version", [1, 2, 3])
def test_every_version_reads_the_window_as_the_reference(kernels, version, dtype):
    """V1, V2 (512-token partitions) and version 3 (GQA 2) over every window."""
    for window in WINDOWS:
        inputs, ref = windowed_batch(LENS, window, dtype=dtype, seed=window)
        check(run(kernels, inputs, version, window), ref, dtype, f"V{version}")


@pytest.mark.parametrize("block_size", [8, 32])
@pytest.mark.parametrize("version,heads,head_size", [(1, (4, 4), 80), (2, (4, 1), 128),
                                                     (3, (8, 1), 128)],
                         ids=["V1-MHA-80", "V2-MQA-128", "V3-MQA8-128"])
def test_other_block_and_head_sizes(kernels, block_size, version, heads, head_size):
    for window in [3, block_size, block_size + 5, 90]:
        inputs, ref = windowed_batch([1, block_size + 1, 90, 200], window, *heads,
                                     head_size=head_size, block_size=block_size, seed=window)
        check(run(kernels, inputs, version, window), ref, torch.float32, f"V{version}")


@pytest.mark.parametrize("version", [2, 3], ids=["V2", "V3"])
@pytest.mark.parametrize("partition_size,order", [(64, SHUFFLED), (128, REVERSED),
                                                  (256, IN_ORDER), (512, SHUFFLED)])
def test_partitions_before_the_window_are_skipped_by_both_reduces(kernels, version,
                                                                  partition_size, order):
    """Several partitions wholly before the window (64-token partitions of a 700-token context
    with a 20-token window: 10 of 11), the window starting inside a partition and on its first
    token; the fused reduce, in any block order, equals the reduce kernel bit for bit."""
    lens = [1, 64, 65, 200, 700]
    for window in [1, 20, 64, 130, 700, 5000]:
        inputs, ref = windowed_batch(lens, window, seed=window)
        with launch_mode(kernels, SEPARATE, partition_size):
            separate = run(kernels, inputs, version, window)
        with launch_mode(kernels, FUSED, partition_size, order, seed=window):
            fused = run(kernels, inputs, version, window)
        check(separate, ref, torch.float32, f"V{version} p{partition_size}")
        check(fused, ref, torch.float32, f"V{version} p{partition_size} fused")
        assert torch.equal(fused, separate)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_fused_reduce_with_a_window_in_16_bit_dtypes(kernels, dtype):
    inputs, ref = windowed_batch([3, 150, 400], 90, dtype=dtype, seed=1)
    for version in (2, 3):
        with launch_mode(kernels, FUSED, 64, SHUFFLED, seed=version):
            check(run(kernels, inputs, version, 90), ref, dtype, f"V{version} fused")


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("version", [1, 2])
def test_an_8bit_cache_reads_the_window(kernels, kind, version):
    """An 8-bit cache (lesson 18) runs `attend` too. Blocks before the window point at a block of
    zero codes whose scales are NaN: reading it would show."""
    g = torch.Generator().manual_seed(5)
    lens, block_size, num_kv_heads, head, window = [5, 70, 300], 16, 2, 64, 40
    num_blocks = sum(math.ceil(n / block_size) for n in lens) + 1
    dtype = kv_quant.STORAGE[kind]
    key_cache = torch.zeros(num_blocks, num_kv_heads, head // 16, block_size, 16, dtype=dtype)
    value_cache = torch.zeros(num_blocks, num_kv_heads, head, block_size, dtype=dtype)
    scales = tuple(torch.zeros(num_blocks, num_kv_heads, block_size) for _ in range(2))
    slots = torch.arange((num_blocks - 1) * block_size)
    kernels.reshape_and_cache(torch.randn(len(slots), num_kv_heads, head, generator=g),
                              torch.randn(len(slots), num_kv_heads, head, generator=g),
                              key_cache, value_cache, slots, kv_scales=scales)
    width = max(math.ceil(n / block_size) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for seq, n in enumerate(lens):
        n_blocks = math.ceil(n / block_size)
        tables[seq, :n_blocks] = torch.arange(used, used + n_blocks)
        used += n_blocks
    query = torch.randn(len(lens), 4, head, generator=g)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    inputs = (query, key_cache, value_cache, tables, context_lens, head ** -0.5)
    ref = reference.paged_attention(*inputs, kv_scales=scales, window=window)
    for s in scales:
        s[num_blocks - 1] = NAN
    for seq, n in enumerate(lens):
        tables[seq, :first_seen(n, window) // block_size] = num_blocks - 1
    with launch_mode(kernels, SEPARATE, 64):
        check(run(kernels, inputs, version, window, kv_scales=scales), ref, torch.float32,
              f"V{version} {kind}")


def test_no_window_and_window_0_are_the_whole_context(kernels):
    inputs, ref = windowed_batch([1, 40, 300], None, seed=3)
    for version in (1, 2, 3):
        whole = run(kernels, inputs, version, None)
        check(whole, ref, torch.float32, f"V{version}")
        assert torch.equal(run(kernels, inputs, version, 0), whole)
        assert torch.equal(run(kernels, inputs, version, 300), whole)  # = the longest context


def test_a_bad_window_is_refused(kernels):
    inputs, _ = windowed_batch([10], None)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="window must be None or a number of tokens"):
            run(kernels, inputs, 1, bad)
    out = torch.empty_like(inputs[0])
    with pytest.raises(RuntimeError, match="window must be a number of tokens >= 0"):
        kernels.module.paged_attention(out, *inputs, 10, 1, window=-3)


def test_ops_sends_windows_to_the_cuda_kernels(kernels, monkeypatch):
    """The dispatch of ``ops.paged_attention`` as on a GPU, with this CPU build as the CUDA op:
    a window call runs the kernel (``supports_window``), with no warning."""
    monkeypatch.setattr(ops, "_pick", lambda tensor: ("cuda", kernels))
    monkeypatch.setattr(ops, "_warned_windows", set())
    inputs, ref = windowed_batch([1, 40, 300], 24, seed=4)
    before = ops.calls["paged_attention", "cuda"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ops.paged_attention(*inputs, window=24)
    assert ops.calls["paged_attention", "cuda"] == before + 1
    check(out, ref, torch.float32, "ops -> cuda")


def test_report_worst_error():
    """``pytest -s``: the worst per-sequence relative error of each kernel and dtype."""
    for (what, dtype), err in sorted(WORST.items()):
        print(f"window: {what:>22} {dtype:>8}: worst relative error {err:.2e}")
