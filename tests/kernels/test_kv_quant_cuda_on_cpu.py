"""The CUDA kernels on an 8-bit cache, run on the CPU through the CUDA-on-CPU build (lesson 18):
``reshape_and_cache_8bit`` rounds every fp8 code and every tie exactly as
``torch.float8_e4m3fn`` (and int8 as ``torch.round``), and ``paged_attention_8bit`` (V1 and V2)
agrees with the torch reference."""
from __future__ import annotations

import pytest
import torch

from minipaged.kernels import kv_quant, reference

pytestmark = [pytest.mark.lesson18, pytest.mark.slow]

KINDS = ["fp8", "int8"]


@pytest.fixture(scope="module")
def kernels():
    from minipaged.kernels import cuda_on_cpu

    return cuda_on_cpu.load()


def _caches(kind, num_blocks, kv_heads, head, block_size):
    dtype = kv_quant.STORAGE[kind]
    k = torch.zeros(num_blocks, kv_heads, head // 16, block_size, 16, dtype=dtype)
    v = torch.zeros(num_blocks, kv_heads, head, block_size, dtype=dtype)
    return k, v, tuple(torch.zeros(num_blocks, kv_heads, block_size) for _ in range(2))


def _bits(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _write_both(kernels, kind, key, value, num_blocks=8, block_size=16):
    ours = _caches(kind, num_blocks, key.shape[1], key.shape[2], block_size)
    theirs = _caches(kind, num_blocks, key.shape[1], key.shape[2], block_size)
    slots = torch.arange(key.shape[0])
    kernels.reshape_and_cache(key, value, ours[0], ours[1], slots, kv_scales=ours[2])
    reference.reshape_and_cache(key, value, theirs[0], theirs[1], slots, theirs[2])
    return ours, theirs


def _every_code_and_tie(kind) -> torch.Tensor:
    """Vectors whose largest magnitude is the format's largest code (so the scale is 1 and x / 1
    is x): every code's value, and every midpoint between neighbouring codes (a tie)."""
    if kind == "fp8":
        codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        codes = codes[codes.isfinite()].unique()  # (253,) sorted, -448 .. 448
    else:
        codes = torch.arange(-127, 128).float()
    values = torch.cat([codes, (codes[1:] + codes[:-1]) / 2])  # codes and ties
    per_vector = 63  # plus the pinned largest code at element 0
    n = -(-len(values) // per_vector)
    padded = torch.zeros(n * per_vector)
    padded[:len(values)] = values
    vectors = torch.cat([torch.full((n, 1), kv_quant.QMAX[kv_quant.STORAGE[kind]]),
                         padded.view(n, per_vector)], dim=1)  # (n, 64)
    return vectors


@pytest.mark.parametrize("kind", KINDS)
def test_every_code_and_every_tie_rounds_as_torch(kernels, kind):
    vectors = _every_code_and_tie(kind)  # (n, 64)
    key = vectors[:, None, :]  # (n tokens, 1 kv head, 64)
    ours, theirs = _write_both(kernels, kind, key, -key)
    assert torch.equal(ours[2][0], theirs[2][0]) and bool((ours[2][0][0, 0, :1] == 1).all())
    for a, b in zip(ours[:2], theirs[:2]):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_keys_of_every_magnitude_write_the_references_bits(kernels, kind, dtype):
    g = torch.Generator().manual_seed(3)
    scale = torch.logspace(-6, 3, 100)[:, None, None]  # (T, 1, 1): 1e-6 .. 1e3
    key = (torch.randn(100, 2, 64, generator=g) * scale).to(dtype)
    value = (torch.randn(100, 2, 64, generator=g) * scale).to(dtype)
    ours, theirs = _write_both(kernels, kind, key, value)
    for a, b in zip([*ours[:2], *ours[2]], [*theirs[:2], *theirs[2]]):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("version", [0, 1, 2])
def test_paged_attention_8bit_matches_the_reference(kernels, kind, version):
    # (version 0 with 3 query heads per kv head: the grouped kernel is not built for 8-bit
    # codes, so the plan falls back to one CUDA block per query head)
    g = torch.Generator().manual_seed(4)
    kv_heads, heads, head, block_size, num_blocks = 2, 6, 64, 16, 48
    k_cache, v_cache, scales = _caches(kind, num_blocks, kv_heads, head, block_size)
    slots = torch.arange(num_blocks * block_size)
    reference.reshape_and_cache(torch.randn(len(slots), kv_heads, head, generator=g),
                                torch.randn(len(slots), kv_heads, head, generator=g),
                                k_cache, v_cache, slots, scales)
    lens = torch.tensor([5, 600, 33], dtype=torch.int32)  # 600: two V2 partitions
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:38] for _ in lens])
    tables = tables.to(torch.int32)
    query = torch.randn(3, heads, head, generator=g)
    got = kernels.paged_attention(query, k_cache, v_cache, tables, lens, 0.125, version=version,
                                  kv_scales=scales)
    want = reference.paged_attention(query, k_cache, v_cache, tables, lens, 0.125, scales)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_unsupported_8bit_shapes_are_refused_by_name(kernels):
    k_cache, v_cache, scales = _caches("int8", 4, 1, 64, 16)
    query = torch.randn(1, 1, 64)
    with pytest.raises(RuntimeError, match="value_scales must be contiguous float32"):
        kernels.paged_attention(query, k_cache, v_cache, torch.zeros(1, 1, dtype=torch.int32),
                                torch.tensor([3], dtype=torch.int32), 1.0,
                                kv_scales=(scales[0], scales[1][:, :, :8]))


def test_the_grouped_kernel_is_refused_on_an_8bit_cache(kernels):
    k_cache, v_cache, scales = _caches("int8", 4, 2, 64, 16)
    query = torch.randn(1, 6, 64)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="version 3.*16- or 32-bit cache"):
        kernels.paged_attention(query, k_cache, v_cache, tables, lens, 1.0, version=3,
                                kv_scales=scales)
    out = torch.empty_like(query)
    chosen = kernels.module.paged_attention_8bit(out, query, k_cache, v_cache, *scales, tables,
                                                 lens, 1.0, 3, 0)
    assert chosen == 1
