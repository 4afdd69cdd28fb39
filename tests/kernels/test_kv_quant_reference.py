"""The 8-bit KV cache in the torch reference: the quantizer's error bounds, and the ops on an
8-bit cache computing attention over exactly the values the cache holds (lesson 18)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minipaged.kernels import kv_quant, reference
from minipaged.worker.cache_engine import CacheEngine, cache_block_bytes

pytestmark = pytest.mark.lesson18

FORMATS = [torch.float8_e4m3fn, torch.int8]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), log_magnitude=st.floats(-12, 12),
       dtype=st.sampled_from(FORMATS))
def test_quantizer_error_is_within_half_a_step_of_each_code(seed, log_magnitude, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 3, 64, generator=g) * math.exp(log_magnitude)  # (T, kv_heads, D)
    x[0, 0, 7] *= 40  # an outlier in one vector
    codes, scale = kv_quant.quantize(x, dtype)
    assert codes.dtype == dtype and scale.shape == (5, 3) and scale.dtype == torch.float32
    back = kv_quant.dequantize(codes, scale)
    y = x / scale[..., None]  # (T, kv_heads, D) in code units
    # the largest magnitude of each vector lands on the largest code
    assert torch.allclose(codes.float().abs().amax(-1), torch.tensor(kv_quant.QMAX[dtype]))
    err = ((back - x) / scale[..., None]).abs()  # in code units
    if dtype == torch.int8:
        bound = torch.full_like(y, 0.5)  # one step is 1
    else:  # e4m3: 3 mantissa bits; a step is 2^(e-3) for normals, 2^-9 below 2^-6
        exponent = torch.floor(torch.log2(y.abs().clamp_min(2.0**-6)))
        bound = 2.0 ** (exponent - 4)
    assert bool((err <= bound * (1 + 1e-5) + 1e-30).all())


def test_an_all_zero_vector_gets_scale_one_and_zero_codes():
    codes, scale = kv_quant.quantize(torch.zeros(2, 1, 16), torch.int8)
    assert scale.tolist() == [[1.0], [1.0]] and not codes.any()


def test_fp8_codes_are_torchs_own_e4m3_rounding():
    x = torch.randn(64, 2, 32)
    codes, scale = kv_quant.quantize(x, torch.float8_e4m3fn)
    expected = (x / scale[..., None]).to(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), expected.view(torch.uint8))


def test_unknown_kv_cache_dtype_is_refused_listing_the_accepted_values():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'fp8', 'int8'"):
        kv_quant.check_kv_cache_dtype("fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheEngine(1, 2, 16, 4, 4, 0, torch.float32, torch.device("cpu"), "e5m2")


def test_the_block_bytes_count_one_byte_a_number_plus_the_scales():
    layers, kv_heads, head, bs = 30, 3, 64, 16
    fp32 = cache_block_bytes(bs, layers, kv_heads, head, torch.float32)
    fp16 = cache_block_bytes(bs, layers, kv_heads, head, torch.float16)
    for kind in ("fp8", "int8"):
        q = cache_block_bytes(bs, layers, kv_heads, head, torch.float32, kind)
        assert q == 2 * layers * kv_heads * bs * (head + 4)
        assert q == cache_block_bytes(bs, layers, kv_heads, head, torch.float16, kind)
    assert fp32 == 4 * 2 * layers * kv_heads * bs * head and fp16 * 2 == fp32


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_cache_engine_allocates_what_the_formula_counts(kind):
    cache = CacheEngine(2, 3, 32, 4, 5, 2, torch.float32, torch.device("cpu"), kind)
    for layer in cache.gpu_cache + cache.cpu_cache:
        assert len(layer) == 4 and layer[0].dtype == kv_quant.STORAGE[kind]
        assert layer[2].shape[1:] == (3, 4) and layer[2].dtype == torch.float32
    allocated = sum(t.numel() * t.element_size() for layer in cache.gpu_cache for t in layer)
    assert allocated == 5 * cache_block_bytes(4, 2, 3, 32, torch.float32, kind)


def _filled_cache(kind, num_blocks=6, kv_heads=2, head=32, block_size=4, seed=0):
    """An 8-bit CacheEngine with three sequences' tokens written; their dense K and V too."""
    g = torch.Generator().manual_seed(seed)
    cache = CacheEngine(1, kv_heads, head, block_size, num_blocks, num_blocks, torch.float32,
                        torch.device("cpu"), kind)
    tables = torch.tensor([[3, 0], [5, 1], [2, 4]])  # (S, 2 blocks)
    lens = torch.tensor([7, 2, 8])
    keys, values, slots = [], [], []
    for s in range(3):
        n = int(lens[s])
        keys.append(torch.randn(n, kv_heads, head, generator=g))
        values.append(torch.randn(n, kv_heads, head, generator=g))
        slots += [int(tables[s, p // block_size]) * block_size + p % block_size for p in range(n)]
    k_cache, v_cache, *scales = cache.gpu_cache[0]
    reference.reshape_and_cache(torch.cat(keys), torch.cat(values), k_cache, v_cache,
                                torch.tensor(slots), tuple(scales))
    return cache, tables, lens, keys, values


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_decode_attends_to_exactly_the_dequantized_values(kind):
    cache, tables, lens, keys, values = _filled_cache(kind)
    k_cache, v_cache, *scales = cache.gpu_cache[0]
    dtype = kv_quant.STORAGE[kind]
    heads, head = 6, 32  # GQA 3:1
    query = torch.randn(3, heads, head)
    out = reference.paged_attention(query, k_cache, v_cache, tables, lens, head**-0.5,
                                    tuple(scales))
    for s in range(3):
        k = kv_quant.round_trip(keys[s], dtype).repeat_interleave(3, dim=1)  # (n, heads, D)
        v = kv_quant.round_trip(values[s], dtype).repeat_interleave(3, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", query[s], k) * head**-0.5, -1)
        expected = torch.einsum("hn,nhd->hd", p, v)  # (heads, D)
        torch.testing.assert_close(out[s], expected, rtol=1e-5, atol=1e-5)
    # and the quantization is visible: the unquantized keys give another answer
    k = keys[2].repeat_interleave(3, dim=1)
    v = values[2].repeat_interleave(3, dim=1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", query[2], k) * head**-0.5, -1)
    assert (out[2] - torch.einsum("hn,nhd->hd", p, v)).abs().max() > 1e-4


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_paged_prefill_reads_the_same_values_as_decode(kind):
    cache, tables, lens, _, _ = _filled_cache(kind)
    k_cache, v_cache, *scales = cache.gpu_cache[0]
    query = torch.randn(3, 4, 32)  # one new token per sequence: the decode case
    loc = torch.tensor([0, 1, 2, 3])
    a = reference.paged_prefill_attention(query, k_cache, v_cache, tables, loc, lens, 0.2,
                                          tuple(scales))
    b = reference.paged_attention(query, k_cache, v_cache, tables, lens, 0.2, tuple(scales))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_copy_and_swap_move_the_scales_with_the_codes(kind):
    cache, *_ = _filled_cache(kind)
    before = [t.clone() for t in cache.gpu_cache[0]]
    cache.copy({3: [1]})  # block 1 becomes a copy of block 3
    for t, old in zip(cache.gpu_cache[0], before):  # codes and scales, keys and values
        assert torch.equal(_bits(t[1]), _bits(old[3]))
    cache.swap_out({5: 0})
    for t in cache.gpu_cache[0]:
        t[5].zero_()
    cache.swap_in({0: 5})
    for t, old in zip(cache.gpu_cache[0], before):
        assert torch.equal(_bits(t[5]), _bits(old[5]))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t
