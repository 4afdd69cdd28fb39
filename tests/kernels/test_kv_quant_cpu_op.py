"""The C++ CPU op on an 8-bit cache (lesson 18): it writes the very bits the torch reference
writes, reads them back to the reference's attention, and refuses scales that do not fit.

slow: ~100 s on the 2-core machine when the C++ op must be built first, ~20 s after.
"""
from __future__ import annotations

import pytest
import torch

from minipaged.kernels import build, kv_quant, reference

pytestmark = [pytest.mark.lesson18, pytest.mark.slow]

KINDS = ["fp8", "int8"]


@pytest.fixture(scope="module")
def op():
    op = build.CPU_OP.load()
    if op is None:
        pytest.skip("the C++ CPU op did not build here")
    return op


def _caches(kind, num_blocks, kv_heads, head, block_size):
    dtype = kv_quant.STORAGE[kind]
    x = 16
    k = torch.zeros(num_blocks, kv_heads, head // x, block_size, x, dtype=dtype)
    v = torch.zeros(num_blocks, kv_heads, head, block_size, dtype=dtype)
    scales = tuple(torch.zeros(num_blocks, kv_heads, block_size) for _ in range(2))
    return k, v, scales


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_the_references_bits(op, kind, dtype):
    g = torch.Generator().manual_seed(1)
    key = (torch.randn(37, 3, 64, generator=g) * 3).to(dtype)
    value = torch.randn(37, 3, 64, generator=g).to(dtype)
    key[4, 1] = 0  # an all-zero vector: scale 1
    key[5, 2, 9] = 1e4  # an outlier
    slots = torch.randperm(8 * 16, generator=g)[:37]
    slots[3] = -1  # not cached
    ours, theirs = _caches(kind, 8, 3, 64, 16), _caches(kind, 8, 3, 64, 16)
    op.reshape_and_cache(key, value, ours[0], ours[1], slots, ours[2])
    reference.reshape_and_cache(key, value, theirs[0], theirs[1], slots, theirs[2])
    for a, b in zip([*ours[:2], *ours[2]], [*theirs[:2], *theirs[2]]):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_and_prefill_match_the_reference(op, kind, block_size):
    g = torch.Generator().manual_seed(2)
    kv_heads, heads, head = 3, 9, 64  # GQA 3:1, SmolLM2's shape
    num_blocks = 40
    k_cache, v_cache, scales = _caches(kind, num_blocks, kv_heads, head, block_size)
    slots = torch.randperm(num_blocks * block_size, generator=g)
    reference.reshape_and_cache(torch.randn(len(slots), kv_heads, head, generator=g),
                                torch.randn(len(slots), kv_heads, head, generator=g),
                                k_cache, v_cache, slots, scales)
    lens = torch.tensor([1, 17, 50, 33])
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in lens])
    query = torch.randn(4, heads, head, generator=g)
    got = op.paged_attention(query, k_cache, v_cache, tables, lens, 0.125, scales)
    want = reference.paged_attention(query, k_cache, v_cache, tables, lens, 0.125, scales)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    q_lens = torch.tensor([1, 5, 20, 2])
    loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)])
    rows = torch.randn(int(q_lens.sum()), heads, head, generator=g)
    got = op.paged_prefill_attention(rows, k_cache, v_cache, tables, loc, lens, 0.125, scales)
    want = reference.paged_prefill_attention(rows, k_cache, v_cache, tables, loc, lens, 0.125,
                                             scales)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_scales_that_do_not_fit_are_refused_naming_them(op):
    k_cache, v_cache, (ks, vs) = _caches("int8", 4, 2, 32, 8)
    query = torch.randn(1, 2, 32)
    tables, lens = torch.tensor([[0]]), torch.tensor([3])
    with pytest.raises(RuntimeError, match="value_scales must be"):
        op.paged_attention(query, k_cache, v_cache, tables, lens, 1.0, (ks, vs[:, :, :4]))
    with pytest.raises(RuntimeError, match="key_scales must be a contiguous float32"):
        op.paged_attention(query, k_cache, v_cache, tables, lens, 1.0, (ks.double(), vs))
    k16, v16 = torch.zeros(4, 2, 8, 8, 4), torch.zeros(4, 2, 32, 8)
    with pytest.raises(RuntimeError, match="go with an 8-bit cache"):
        op.paged_attention(query, k16, v16, tables, lens, 1.0, (ks, vs))
