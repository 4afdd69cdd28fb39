"""Sliding windows in the attention ops (Mistral, Gemma 3's sliding layers): the C++ CPU op
equals the torch reference, decode and prefill over a cached prefix, and neither reads a block
before the window (those table entries point at a block of NaN here, as a freed block may hold
anything); ``ops`` sends a window only to an op that reads it."""
import math

import pytest
import torch

from minipaged.kernels import build, ops, reference

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def kernels():
    compiled = build.CPU_OP.load()
    if compiled is None:
        pytest.skip("the C++ CPU kernels could not be built here (see the warning)")
    return compiled


def windowed_cache(lens, q_lens, window, block_size, dtype, kv_heads=2, head_size=32, seed=0):
    """Sequences of the given lengths in shuffled blocks; every block wholly before the window
    of a sequence's first new row is replaced in its table by a block of NaN (freed)."""
    gen = torch.Generator().manual_seed(seed)
    x = ops.key_vector_size(dtype)
    need = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(need) + 1
    nan = float("nan")
    key_cache = torch.full((num_blocks, kv_heads, head_size // x, block_size, x), nan, dtype=dtype)
    value_cache = torch.full((num_blocks, kv_heads, head_size, block_size), nan, dtype=dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen)
    nan_block = num_blocks - 1
    tables, start = [], 0
    for n, q_len, b in zip(lens, q_lens, need):
        table = perm[start:start + b].clone()
        start += b
        pos = torch.arange(n)
        slots = table[pos // block_size] * block_size + pos % block_size
        k = torch.randn(n, kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_size, generator=gen).to(dtype)
        reference.reshape_and_cache(k, v, key_cache, value_cache, slots)
        first_seen = max(0, n - q_len - window + 1)  # the first new row's oldest position
        table[:first_seen // block_size] = nan_block  # gone: never to be read
        tables.append(table.tolist())
    width = max(need)
    tables = torch.tensor([t + [nan_block] * (width - len(t)) for t in tables], dtype=torch.int32)
    return key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_cpu_op_reads_the_window_as_the_reference(kernels, dtype, block_size, window):
    lens, q_lens = [3, 40, 77, 16], [1, 9, 20, 16]  # decode rows, a chunk, a whole prompt
    kc, vc, tables, ctx = windowed_cache(lens, q_lens, window, block_size, dtype)
    gen = torch.Generator().manual_seed(1)
    heads, D = 4, kc.shape[2] * kc.shape[4]
    # prefill rows over the cached context
    loc = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    query = torch.randn(int(loc[-1]), heads, D, generator=gen).to(dtype)
    want = reference.paged_prefill_attention(query, kc, vc, tables, loc, ctx, D ** -0.5,
                                              window=window)
    got = kernels.paged_prefill_attention(query, kc, vc, tables, loc, ctx, D ** -0.5,
                                          window=window)
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # decode: one row per sequence (its tables' gone blocks are those of q_len = 1)
    kc, vc, tables, ctx = windowed_cache(lens, [1] * len(lens), window, block_size, dtype)
    query = torch.randn(len(lens), heads, D, generator=gen).to(dtype)
    want = reference.paged_attention(query, kc, vc, tables, ctx, D ** -0.5, window=window)
    got = kernels.paged_attention(query, kc, vc, tables, ctx, D ** -0.5, window=window)
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_a_window_longer_than_the_context_is_no_window(kernels):
    kc, vc, tables, ctx = windowed_cache([30, 7], [1, 1], 1000, 4, torch.float32)
    query = torch.randn(2, 4, 32)
    torch.testing.assert_close(kernels.paged_attention(query, kc, vc, tables, ctx, 0.2,
                                                       window=1000),
                               kernels.paged_attention(query, kc, vc, tables, ctx, 0.2))


def test_prefill_of_fresh_prompts_with_a_window():
    """The packed prefill: row p sees p - W + 1 .. p (a dense mask, checked by hand)."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(23, 4, 16, generator=gen) for _ in range(3))
    k, v = k[:, :2], v[:, :2]  # 2 kv heads
    got = reference.prefill_attention(q, k, v, [15, 8], 0.25, window=6)
    for start, n in [(0, 15), (15, 8)]:
        for p in range(n):
            lo = max(0, p - 5)
            kk = k[start + lo:start + p + 1].repeat_interleave(2, dim=1)  # (len, 4, 16)
            vv = v[start + lo:start + p + 1].repeat_interleave(2, dim=1)
            logits = torch.einsum("hd,thd->ht", q[start + p], kk) * 0.25
            want = torch.einsum("ht,thd->hd", logits.softmax(-1), vv)
            torch.testing.assert_close(got[start + p], want, atol=1e-5, rtol=1e-5)


def test_the_cpu_op_runs_windows_and_the_engine_counts_it(kernels):
    kc, vc, tables, ctx = windowed_cache([30], [1], 8, 4, torch.float32)
    before = ops.calls["paged_attention", "cpu"]
    ops.paged_attention(torch.randn(1, 4, 32), kc, vc, tables, ctx, 0.2, window=8)
    assert ops.calls["paged_attention", "cpu"] == before + 1


def test_an_op_that_reads_no_window_is_passed_by(monkeypatch):
    """A compiled op without ``supports_window`` (as the CUDA kernels were before they read
    windows) never gets a window call: the reference answers, counted as such, and a warning
    says so once."""

    class NoWindowOp:  # stands for a compiled op that reads whole contexts only
        supports_8bit_cache = True

        def paged_attention(self, *args, **kwargs):
            raise AssertionError("a window call reached an op that reads no window")

        paged_prefill_attention = paged_attention

    monkeypatch.setattr(build.CPU_OP, "load", lambda: NoWindowOp())
    monkeypatch.setattr(ops, "_warned_windows", set())
    kc, vc, tables, ctx = windowed_cache([30], [1], 8, 4, torch.float32)
    query = torch.randn(1, 4, 32)
    before = ops.calls["paged_attention", "reference"]
    with pytest.warns(RuntimeWarning, match="reads no sliding window"):
        got = ops.paged_attention(query, kc, vc, tables, ctx, 0.2, window=8)
    assert ops.calls["paged_attention", "reference"] == before + 1
    torch.testing.assert_close(got, reference.paged_attention(query, kc, vc, tables, ctx, 0.2,
                                                              window=8))
    loc = torch.tensor([0, 1], dtype=torch.int32)
    ops.paged_prefill_attention(query, kc, vc, tables, loc, ctx, 0.2, window=8)  # no raise
