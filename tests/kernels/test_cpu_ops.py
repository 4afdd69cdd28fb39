"""Lesson 05: the C++ CPU paged attention (csrc/cpu/attention.cpp) equals the torch reference.

Inputs are N(0, 1) and errors are relative, per sequence (an all-zero output would fail). Every
slot nobody wrote holds NaN, and so does the block that padding entries of the block table point
to: a kernel that reads one token too far, or multiplies a probability 0 by a NaN, fails.

Slow (left out of `make test`): the two engine-against-transformers tests, about 160 s on the
2-core machine (measured at load ~12, so less when idle); the op-level tests are fast.
"""
import copy
import math
import warnings

import pytest
import torch

from minipaged import LLM, SamplingParams
from minipaged.kernels import build, ops, reference
from tiny_models import greedy_reference, pick_prompts

pytestmark = pytest.mark.lesson05

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def kernels():
    compiled = build.CPU_OP.load()
    if compiled is None:
        pytest.skip("the C++ CPU kernels could not be built here (see the warning)")
    return compiled


def paged_cache(lens, kv_heads, head_size, block_size, dtype, seed=0):
    """Keys/values of N(0,1) for sequences of the given lengths, in shuffled blocks.

    Returns (key_cache, value_cache, block_tables, context_lens); unwritten slots and the padding
    block (where short block tables point past their end) hold NaN.
    """
    gen = torch.Generator().manual_seed(seed)
    x = ops.key_vector_size(dtype)
    need = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(need) + 1
    key_cache = torch.full((num_blocks, kv_heads, head_size // x, block_size, x), float("nan"),
                           dtype=dtype)
    value_cache = torch.full((num_blocks, kv_heads, head_size, block_size), float("nan"),
                             dtype=dtype)
    perm = torch.randperm(num_blocks - 1, generator=gen)
    nan_block = num_blocks - 1
    tables, start = [], 0
    for n, b in zip(lens, need):
        table = perm[start:start + b]
        start += b
        pos = torch.arange(n)
        slots = table[pos // block_size] * block_size + pos % block_size  # (n,)
        k = torch.randn(n, kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(n, kv_heads, head_size, generator=gen).to(dtype)
        reference.reshape_and_cache(k, v, key_cache, value_cache, slots)
        tables.append(table.tolist())
    width = max(need)
    block_tables = torch.tensor([t + [nan_block] * (width - len(t)) for t in tables],
                                dtype=torch.int32)
    return key_cache, value_cache, block_tables, torch.tensor(lens, dtype=torch.int32)


def relative_errors(out, ref, rows):
    """Relative error of each sequence's rows (a list of slices)."""
    return [float((out[r].double() - ref[r].double()).norm() / ref[r].double().norm())
            for r in rows]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 128])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (4, 1)], ids=["MHA", "GQA", "MQA"])
def test_decode_attention_equals_the_reference(kernels, dtype, block_size, head_size, heads,
                                               kv_heads):
    lens = [1, block_size - 1, block_size, block_size + 1, 100, 2048]
    key_cache, value_cache, tables, context_lens = paged_cache(lens, kv_heads, head_size,
                                                               block_size, dtype)
    query = torch.randn(len(lens), heads, head_size).to(dtype)
    scale = head_size ** -0.5
    out = kernels.paged_attention(query, key_cache, value_cache, tables, context_lens, scale)
    ref = reference.paged_attention(query, key_cache, value_cache, tables, context_lens, scale)
    assert out.dtype == dtype and out.shape == query.shape
    errors = relative_errors(out, ref, range(len(lens)))
    assert max(errors) < TOLERANCE[dtype], errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (9, 3), (4, 1)], ids=["MHA", "GQA", "MQA"])
def test_prefill_attention_after_a_cached_context_equals_the_reference(kernels, dtype, block_size,
                                                                        heads, kv_heads):
    head_size = 64
    # (tokens already cached, new tokens): a whole prompt, a chunk after a prefix, decodes,
    # rows that end inside a block and rows that span many tiles of the kernel's work split.
    cases = [(0, 1), (0, 37), (2 * block_size, block_size + 3), (5, 1), (1000, 48), (2047, 1)]
    lens = [c + n for c, n in cases]
    key_cache, value_cache, tables, context_lens = paged_cache(lens, kv_heads, head_size,
                                                               block_size, dtype, seed=1)
    loc = torch.tensor([0] + [n for _, n in cases]).cumsum(0).to(torch.int32)
    query = torch.randn(int(loc[-1]), heads, head_size).to(dtype)
    scale = head_size ** -0.5
    out = kernels.paged_prefill_attention(query, key_cache, value_cache, tables, loc,
                                          context_lens, scale)
    ref = reference.paged_prefill_attention(query, key_cache, value_cache, tables, loc,
                                          context_lens, scale)
    rows = [slice(int(loc[s]), int(loc[s + 1])) for s in range(len(cases))]
    errors = relative_errors(out, ref, rows)
    assert max(errors) < TOLERANCE[dtype], errors


def test_query_may_be_a_strided_view(kernels):
    """The model hands over q as a view of the fused qkv projection (rows longer than q)."""
    key_cache, value_cache, tables, context_lens = paged_cache([5, 40], 2, 64, 16, torch.float32)
    qkv = torch.randn(2, 3 * 4 * 64)
    query = qkv[:, :4 * 64].view(2, 4, 64)  # (S, heads, D), row stride 768
    out = kernels.paged_attention(query, key_cache, value_cache, tables, context_lens, 0.125)
    ref = reference.paged_attention(query.contiguous(), key_cache, value_cache, tables,
                                  context_lens, 0.125)
    assert max(relative_errors(out, ref, range(2))) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_reshape_and_cache_writes_the_same_slots_as_the_reference(kernels, dtype, block_size):
    kv_heads, head_size, num_blocks = 3, 80, 12
    x = ops.key_vector_size(dtype)
    fused = torch.randn(20, 2, kv_heads, head_size).to(dtype)  # keys and values side by side
    key, value = fused[:, 0], fused[:, 1]  # strided views, as the model passes them
    slots = torch.randperm(num_blocks * block_size)[:20]
    slots[[3, 7]] = -1  # padding tokens: not cached
    caches = []
    for write in (kernels.reshape_and_cache, reference.reshape_and_cache):
        key_cache = torch.zeros(num_blocks, kv_heads, head_size // x, block_size, x, dtype=dtype)
        value_cache = torch.zeros(num_blocks, kv_heads, head_size, block_size, dtype=dtype)
        write(key, value, key_cache, value_cache, slots)
        caches.append((key_cache, value_cache))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert int((caches[0][1] != 0).sum()) == 18 * kv_heads * head_size


def test_ops_dispatch_to_cpp_and_the_switch_forces_the_reference(kernels, monkeypatch):
    key_cache, value_cache, tables, context_lens = paged_cache([30], 2, 64, 16, torch.float32)
    query = torch.randn(1, 4, 64)
    before = ops.calls.copy()
    assert ops.backend(key_cache) == "cpu"
    ops.paged_attention(query, key_cache, value_cache, tables, context_lens, 0.125)
    assert ops.calls["paged_attention", "cpu"] == before["paged_attention", "cpu"] + 1
    monkeypatch.setenv("MINIPAGED_CPU_OP", "0")
    assert ops.backend(key_cache) == "reference"
    ops.paged_attention(query, key_cache, value_cache, tables, context_lens, 0.125)
    assert ops.calls["paged_attention", "cpu"] == before["paged_attention", "cpu"] + 1
    assert ops.calls["paged_attention", "reference"] == before["paged_attention", "reference"] + 1
    monkeypatch.setenv("MINIPAGED_CPU_OP", "1")  # any value but "0" means on
    assert ops.backend(key_cache) == "cpu"


def test_a_failed_build_warns_once_and_the_reference_runs(monkeypatch):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    # A fresh, not yet tried build for this test; the real one comes back afterwards.
    real = build.CPU_OP
    monkeypatch.setattr(build, "CPU_OP", build.JitBuild(real.what, real.duration, real.make,
                                                        switch=real.switch))
    key_cache, value_cache, tables, context_lens = paged_cache([30], 2, 64, 16, torch.float32)
    query = torch.randn(1, 4, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = ops.paged_attention(query, key_cache, value_cache, tables, context_lens, 0.125)
        ops.paged_attention(query, key_cache, value_cache, tables, context_lens, 0.125)
    messages = [str(w.message) for w in caught if "C++ CPU attention" in str(w.message)]
    assert len(messages) == 1 and "no C++ compiler" in messages[0]
    ref = reference.paged_attention(query, key_cache, value_cache, tables, context_lens, 0.125)
    assert torch.equal(out, ref)


# ----------------------------------------------------------------------------------------------
# Bad arguments raise a clear error (in this process: a crash would take pytest down with it)
# ----------------------------------------------------------------------------------------------
def bad_attention_case(problem):
    """(operation, args) of a decode or prefill call with one thing wrong; 3 sequences of
    5, 20 and 40 tokens, block size 16, a pool of 4 blocks, 4 heads over 2 kv heads."""
    x = 4
    key_cache, value_cache = torch.randn(4, 2, 64 // x, 16, x), torch.randn(4, 2, 64, 16)
    query = torch.randn(3, 4, 64)
    tables = torch.tensor([[0, 1, 2]] * 3, dtype=torch.int32)
    lens = torch.tensor([5, 20, 40], dtype=torch.int32)
    loc = None
    if problem == "one_table_row":
        tables = tables[:1]
    elif problem == "block_past_the_pool":
        tables[0, 0] = 1000
    elif problem == "negative_block":
        tables[2, 1] = -3
    elif problem == "table_too_narrow":
        tables = tables[:, :1]
    elif problem == "empty_context":
        lens[1] = 0
    elif problem == "negative_context":
        lens[1] = -2
    elif problem == "fewer_queries_than_seqs":
        query = query[:2]
    elif problem == "heads_not_a_multiple":
        query = torch.randn(3, 3, 64)
    elif problem == "head_size":
        query = torch.randn(3, 4, 32)
    elif problem == "query_dtype":
        query = query.double()
    elif problem == "wrong_x":
        query, key_cache, value_cache = query.half(), key_cache.half(), value_cache.half()
    elif problem == "value_cache_heads":
        value_cache = value_cache[:, :1].contiguous()
    elif problem == "value_cache_block_size":
        value_cache = torch.randn(4, 2, 64, 8)
    elif problem == "decreasing_query_start_loc":
        loc = torch.tensor([0, 2, 1, 3], dtype=torch.int32)
    elif problem == "query_start_loc_past_the_rows":
        loc = torch.tensor([0, 1, 2, 5], dtype=torch.int32)
    elif problem == "more_rows_than_context":
        loc = torch.tensor([0, 0, 1, 3], dtype=torch.int32)
        lens = torch.tensor([0, 20, 1], dtype=torch.int32)
    if loc is None:
        return "paged_attention", (query, key_cache, value_cache, tables, lens, 0.125)
    return "paged_prefill_attention", (query, key_cache, value_cache, tables, loc, lens, 0.125)


@pytest.mark.parametrize("problem,message", [
    ("one_table_row", "block_tables has 1 rows for 3 sequences"),
    ("block_past_the_pool", r"block_tables\[0, 0\] = 1000 is not a block of the cache: block "
                            r"numbers are in \[0, 4\)"),
    ("negative_block", r"block_tables\[2, 1\] = -3 is not a block"),
    ("table_too_narrow", "context_lens.1. = 20 needs 2 blocks of 16 tokens but block_tables has "
                         "only 1 columns"),
    ("empty_context", r"context_lens\[1\] = 0 .*an empty context"),
    ("negative_context", r"context_lens\[1\] = -2 is negative"),
    ("fewer_queries_than_seqs", "query .2, 4, 64. but context_lens has 3 entries"),
    ("heads_not_a_multiple", "num_heads = 3 .* multiple of num_kv_heads = 2"),
    ("head_size", "query has head size 32 but the caches hold head size 64"),
    ("query_dtype", "query is Double but the caches are Float"),
    ("wrong_x", "x = 16 / element size = 8 for Half, got 4"),
    ("value_cache_heads", r"value_cache \[4, 1, 64, 16\] does not match key_cache"),
    ("value_cache_block_size", r"value_cache \[4, 2, 64, 8\] does not match"),
    ("decreasing_query_start_loc", "query_start_loc must not decrease"),
    ("query_start_loc_past_the_rows", r"query_start_loc\[3\] = 5 but query has 3 rows"),
    ("more_rows_than_context", r"context_lens\[2\] = 1 but sequence 2 has 2 query row"),
])
def test_bad_attention_arguments_raise_a_clear_error(kernels, problem, message):
    op, args = bad_attention_case(problem)
    with pytest.raises(RuntimeError, match=message):
        getattr(kernels, op)(*args)


def test_checks_read_only_the_blocks_in_use(kernels):
    """Padding past a sequence's blocks may hold anything (the engine pads with 0, vLLM too);
    a query-less sequence in prefill reads nothing at all."""
    key_cache, value_cache, tables, lens = paged_cache([5, 40], 2, 64, 16, torch.float32)
    tables = torch.cat([tables, torch.full((2, 3), -7, dtype=torch.int32)], dim=1)
    tables[0, 1] = 10**6  # past sequence 0's one block
    query = torch.randn(2, 4, 64)
    out = kernels.paged_attention(query, key_cache, value_cache, tables, lens, 0.125)
    ref = reference.paged_attention(query, key_cache, value_cache, tables.clamp(0, 3), lens, 0.125)
    assert max(relative_errors(out, ref, range(2))) < 1e-5
    loc = torch.tensor([0, 0, 1], dtype=torch.int32)  # sequence 0: no new rows
    lens0 = torch.tensor([0, 40], dtype=torch.int32)
    out = kernels.paged_prefill_attention(query[1:], key_cache, value_cache, tables, loc, lens0,
                                          0.125)
    assert max(relative_errors(out, ref[1:], [slice(0, 1)])) < 1e-5


@pytest.mark.parametrize("problem,message", [
    ("kv_heads", "key and value have 4 kv heads but the caches hold 1"),
    ("slot_far_past_the_pool", r"slot_mapping\[1\] = 10000000 is outside the cache's slots "
                               r"\[0, 32\) \(2 blocks of 16 tokens\)"),
    ("slot_just_past_the_pool", r"slot_mapping\[1\] = 32 is outside"),
    ("slot_minus_two", r"slot_mapping\[1\] = -2 is outside .* -1 marks a token that is not"),
    ("fewer_slots_than_tokens", "slot_mapping has 1 slots for 2 tokens"),
    ("value_shape", r"key \[2, 1, 64\] and value \[2, 1, 32\] must both be"),
    ("head_size", "key and value have head size 32 but the caches hold head size 64"),
    ("dtype", "key is Half and value is Half but the caches are Float"),
    ("caches_disagree", r"value_cache \[3, 1, 64, 16\] does not match key_cache"),
])
def test_bad_reshape_and_cache_arguments_raise_a_clear_error(kernels, problem, message):
    key_cache, value_cache = torch.zeros(2, 1, 16, 16, 4), torch.zeros(2, 1, 64, 16)
    key, value = torch.randn(2, 1, 64), torch.randn(2, 1, 64)
    slots = torch.tensor([3, 31])
    if problem == "kv_heads":
        key, value = torch.randn(2, 4, 64), torch.randn(2, 4, 64)
    elif problem == "slot_far_past_the_pool":
        slots[1] = 10**7
    elif problem == "slot_just_past_the_pool":
        slots[1] = 32
    elif problem == "slot_minus_two":
        slots[1] = -2
    elif problem == "fewer_slots_than_tokens":
        slots = slots[:1]
    elif problem == "value_shape":
        value = torch.randn(2, 1, 32)
    elif problem == "head_size":
        key, value = torch.randn(2, 1, 32), torch.randn(2, 1, 32)
    elif problem == "dtype":
        key, value = key.half(), value.half()
    elif problem == "caches_disagree":
        value_cache = torch.zeros(3, 1, 64, 16)
    before = key_cache.clone(), value_cache.clone()
    with pytest.raises(RuntimeError, match=message):
        kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    # refused before anything was written
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


def test_reshape_and_cache_skips_slot_minus_one_only(kernels):
    """-1 is the padding slot (vLLM's convention): not cached. The last slot of the pool is."""
    key_cache, value_cache = torch.zeros(2, 1, 16, 16, 4), torch.zeros(2, 1, 64, 16)
    key, value = torch.randn(2, 1, 64), torch.randn(2, 1, 64)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([-1, 31]))
    assert torch.equal(value_cache[1, 0, :, 15], value[1, 0])
    assert int(value_cache.count_nonzero()) == 64
    with pytest.raises(ValueError, match="slot_mapping holds -2"):  # the reference agrees
        reference.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([-2, 31]))


# ----------------------------------------------------------------------------------------------
# The engine with the C++ op in use
# ----------------------------------------------------------------------------------------------
LENGTHS = [1, 17, 53, 70]  # one token, a block + 1, several blocks
MAX_NEW = [24, 24, 20, 24]


def greedy(path, prompts, **kwargs):
    llm = LLM(path, block_size=16, num_gpu_blocks=64, **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_NEW]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts_and_refs(tiny_llama, tiny_gpt2):
    out = {}
    for kind, (path, hf) in (("llama", tiny_llama), ("gpt2", tiny_gpt2)):
        prompts = pick_prompts(hf, LENGTHS, max(MAX_NEW), seed=5)
        out[kind] = (path, hf, prompts,
                     [greedy_reference(hf, p, n) for p, n in zip(prompts, MAX_NEW)])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_engine_matches_transformers_with_the_cpp_op_in_use(kernels, prompts_and_refs, kind):
    path, _, prompts, refs = prompts_and_refs[kind]
    before = ops.calls.copy()
    assert greedy(path, prompts) == refs
    assert ops.calls["paged_attention", "cpu"] > before["paged_attention", "cpu"]
    assert ops.calls["reshape_and_cache", "cpu"] > before["reshape_and_cache", "cpu"]


def agreement(tokens, refs):
    """(tokens equal to the reference at the same place, first place each sequence differs)."""
    same = sum(a == b for t, r in zip(tokens, refs) for a, b in zip(t, r))
    first = [next((i for i, (a, b) in enumerate(zip(t, r)) if a != b), len(r))
             for t, r in zip(tokens, refs)]
    return same, first


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_bfloat16_engine_follows_float32_as_closely_as_transformers_in_bfloat16(
        kernels, prompts_and_refs, kind):
    """bf16 end to end (weights, activations, KV cache read by the C++ op).

    bf16 keeps 8 bits of mantissa, so a greedy path branches off where two logits are closer
    than its rounding; the yardstick is transformers itself in bf16 on the same prompts. The
    agreement with float32 is printed (``pytest -s``).
    """
    path, hf, prompts, refs = prompts_and_refs[kind]
    before = ops.calls["paged_attention", "cpu"]
    ours, ours_first = agreement(greedy(path, prompts, dtype="bfloat16"), refs)
    assert ops.calls["paged_attention", "cpu"] > before
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    theirs, theirs_first = agreement(
        [greedy_reference(hf16, p, n) for p, n in zip(prompts, MAX_NEW)], refs)
    total = sum(MAX_NEW)
    print(f"\nbf16 vs float32 greedy tokens ({kind}): minipaged {ours}/{total} agree, first "
          f"difference at {ours_first}; transformers bf16 {theirs}/{total}, {theirs_first}")
    assert min(ours_first) >= 1, "bf16 should agree with float32 on the first token"
    assert ours >= theirs / 2
