"""Lessons 02 and 05: the torch reference ops are plainly right (they are the kernels' oracle)."""
import math

import pytest
import torch

from minipaged.kernels import ops

pytestmark = pytest.mark.lesson05


def naive_attention(q, keys, values, scale):
    """One query over a dense list of keys/values, float64, GQA expanded by hand."""
    heads, kv_heads = q.shape[0], keys.shape[1]
    group = heads // kv_heads
    out = torch.empty(heads, q.shape[1], dtype=torch.float64)
    for h in range(heads):
        k = keys[:, h // group].double()  # (L, D)
        v = values[:, h // group].double()
        w = torch.softmax((k @ q[h].double()) * scale, dim=0)
        out[h] = w @ v
    return out


def write_random_sequences(lens, key_cache, value_cache):
    """N(0,1) keys and values of sequences of these lengths, written through random block
    tables. Returns (tables, [(keys, values)] per sequence)."""
    num_blocks, kv_heads, block_size = key_cache.shape[0], key_cache.shape[1], key_cache.shape[3]
    head_size, dtype = value_cache.shape[2], key_cache.dtype
    perm = torch.randperm(num_blocks).tolist()
    tables, dense = [], []
    for n in lens:
        table = [perm.pop() for _ in range(math.ceil(n / block_size))]
        k = torch.randn(n, kv_heads, head_size).to(dtype)
        v = torch.randn(n, kv_heads, head_size).to(dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size
                              for p in range(n)])
        ops.reshape_and_cache(k, v, key_cache, value_cache, slots)
        tables.append(table)
        dense.append((k, v))
    return tables, dense


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size, heads, kv_heads", [(16, 8, 2), (8, 4, 4), (32, 6, 1)])
def test_paged_attention_equals_dense_attention_over_the_block_table(dtype, block_size, heads,
                                                                     kv_heads):
    torch.manual_seed(0)
    D, num_blocks = 64, 40
    x = ops.key_vector_size(dtype)
    assert x == 16 // torch.tensor([], dtype=dtype).element_size()
    key_cache = torch.zeros(num_blocks, kv_heads, D // x, block_size, x, dtype=dtype)
    value_cache = torch.zeros(num_blocks, kv_heads, D, block_size, dtype=dtype)
    lens = [1, block_size, block_size + 1, 5 * block_size - 3]
    tables, dense = write_random_sequences(lens, key_cache, value_cache)
    # Garbage (NaN) everywhere nobody wrote must not leak into the result.
    written = torch.zeros(num_blocks, dtype=torch.bool)
    written[[b for t in tables for b in t]] = True
    key_cache[~written] = float("nan")
    value_cache[~written] = float("nan")
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables],
                                dtype=torch.int32)
    q = torch.randn(len(lens), heads, D).to(dtype)
    scale = D ** -0.5
    out = ops.paged_attention(q, key_cache, value_cache, block_tables,
                              torch.tensor(lens, dtype=torch.int32), scale)
    for i, (k, v) in enumerate(dense):
        ref = naive_attention(q[i], k, v, scale)
        err = (out[i].double() - ref).norm() / ref.norm()
        assert err < (1e-6 if dtype == torch.float32 else 2e-3), err


def test_reshape_and_cache_writes_exactly_the_given_slots_in_the_layout():
    torch.manual_seed(1)
    kv_heads, D, bs, x = 2, 16, 4, 4
    key_cache = torch.zeros(5, kv_heads, D // x, bs, x)
    value_cache = torch.zeros(5, kv_heads, D, bs)
    k, v = torch.randn(3, kv_heads, D), torch.randn(3, kv_heads, D)
    ops.reshape_and_cache(k, v, key_cache, value_cache, torch.tensor([9, -1, 2]))
    # slot 9 = block 2, offset 1; slot 2 = block 0, offset 2; -1 is skipped
    assert torch.equal(key_cache[2, :, :, 1, :].reshape(kv_heads, D), k[0])
    assert torch.equal(value_cache[2, :, :, 1], v[0])
    assert torch.equal(key_cache[0, :, :, 2, :].reshape(kv_heads, D), k[2])
    assert int((key_cache != 0).sum()) == 2 * kv_heads * D


def test_prefill_attention_keeps_packed_prompts_apart():
    torch.manual_seed(2)
    heads, kv_heads, D = 4, 2, 16
    lens = [3, 1, 6]
    q = torch.randn(sum(lens), heads, D)
    k = torch.randn(sum(lens), kv_heads, D)
    v = torch.randn(sum(lens), kv_heads, D)
    out = ops.prefill_attention(q, k, v, lens, 0.25)
    start = 0
    for n in lens:
        for t in range(n):  # token t of this prompt sees tokens 0..t of the same prompt only
            ref = naive_attention(q[start + t], k[start:start + t + 1], v[start:start + t + 1],
                                  0.25)
            torch.testing.assert_close(out[start + t].double(), ref, atol=1e-5, rtol=1e-5)
        start += n


def test_copy_and_swap_blocks_move_whole_blocks():
    key = torch.randn(6, 2, 4, 4, 4)
    value = torch.randn(6, 2, 16, 4)
    k0, v0 = key.clone(), value.clone()
    ops.copy_blocks([key], [value], {1: [3, 5]})
    assert torch.equal(key[3], k0[1]) and torch.equal(key[5], k0[1])
    assert torch.equal(value[5], v0[1]) and torch.equal(key[0], k0[0])
    cpu = torch.zeros(4, 2, 4, 4, 4)
    ops.swap_blocks(key, cpu, {2: 0, 4: 3})
    assert torch.equal(cpu[0], key[2]) and torch.equal(cpu[3], key[4])
    assert int((cpu[1] != 0).sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, heads, kv_heads", [(16, 8, 2), (8, 4, 4), (32, 6, 1)])
def test_paged_prefill_attention_equals_causal_attention_over_the_whole_sequence(
        dtype, block_size, heads, kv_heads):
    """New tokens after a cached context see the context plus themselves, causally."""
    torch.manual_seed(1)
    D, num_blocks = 64, 64
    x = ops.key_vector_size(dtype)
    key_cache = torch.full((num_blocks, kv_heads, D // x, block_size, x), float("nan"), dtype=dtype)
    value_cache = torch.full((num_blocks, kv_heads, D, block_size), float("nan"), dtype=dtype)
    # (context already cached, new tokens): a decode, a chunk after a prefix, a whole prompt
    cases = [(9, 1), (2 * block_size, block_size + 3), (0, 2 * block_size - 1), (5, 1)]
    tables, dense = write_random_sequences([c + n for c, n in cases], key_cache, value_cache)
    qs = [torch.randn(new, heads, D).to(dtype) for _, new in cases]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [t[0]] * (width - len(t)) for t in tables],
                                dtype=torch.int32)
    loc = torch.tensor([0] + [new for _, new in cases]).cumsum(0).to(torch.int32)
    lens = torch.tensor([c + n for c, n in cases], dtype=torch.int32)
    scale = D ** -0.5
    out = ops.paged_prefill_attention(torch.cat(qs), key_cache, value_cache, block_tables, loc,
                                      lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for s, ((cached, new), (k, v)) in enumerate(zip(cases, dense)):
        for i in range(new):
            ref = naive_attention(qs[s][i], k[:cached + i + 1], v[:cached + i + 1], scale)
            got = out[loc[s] + i].double()
            assert torch.linalg.norm(got - ref) / torch.linalg.norm(ref) < tol
