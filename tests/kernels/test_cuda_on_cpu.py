"""Lesson 06: the real CUDA kernels of csrc/, run on the CPU lane by lane, against the reference.

``minipaged.kernels.cuda_on_cpu.load()`` compiles the unmodified .cu files with the host
compiler; every CUDA thread is a host thread, __syncthreads a real barrier, shuffles a real
exchange among 32 lanes, shared memory sized as on an H100 (or an A100: ``set_device(1)``).

Attention is compared per sequence (error relative to that sequence's output norm, N(0,1)
inputs), with NaN in every cache slot a sequence must not read (the tail of its last block,
unused blocks) and padding block-table entries that point at a NaN block.

The matrix: 3 dtypes x 3 block sizes x 6 head sizes x 3 head layouts (MHA, GQA, MQA) x 2 kernel
versions = 324 combinations, each with 6 context lengths (1, block - 1, block, block + 1, 300,
600). The default run takes 18 of them, pairwise (every pair of values of two factors appears in
some case), plus targeted cases (4096 tokens, both sides of the shared-memory limits, ...);
``MINIPAGED_FULL_MATRIX=1`` runs all 324 (slow). ``pytest -s`` prints the matrix size and the
worst per-sequence relative error per dtype (``test_report_worst_error_per_dtype``).

The grouped kernel (version 3: one CUDA block per kv head for its whole group of query heads)
has a matrix of its own: 3 dtypes x 3 block sizes x 2 head sizes x 5 groupings (GQA 2, 3, 4, 8
and MQA), pairwise, with the same contexts, plus contexts up to 5,000 tokens and every
partition size.

Slow: ~250 s on the 2-core machine (measured at load ~12), most of it the first compile of the
kernels (`make test-all` prebuilds them).
"""
import itertools
import math
import os

import pytest
import torch

from minipaged.kernels import cuda_on_cpu, ops, reference

pytestmark = [pytest.mark.lesson06, pytest.mark.slow]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}
BLOCK_SIZES = [8, 16, 32]
HEAD_SIZES = [64, 80, 96, 112, 128, 256]
HEADS = {"MHA": (4, 4), "GQA": (4, 2), "MQA": (4, 1)}  # (num_heads, num_kv_heads)
VERSIONS = [1, 2]
FULL = os.environ.get("MINIPAGED_FULL_MATRIX", "") not in ("", "0")
WORST = {}  # dtype -> worst per-sequence error seen (printed by test_report_worst_error_per_dtype)
CHECKED = {}  # dtype -> attention cases checked


def dtype_id(dtype):
    return str(dtype).split(".")[-1]


@pytest.fixture(scope="module")
def kernels():
    return cuda_on_cpu.load()


def pairwise(*factors):
    """A small list of cases in which every pair of values of two factors appears (greedy)."""
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(len(factors)), 2)
                 for a in range(len(factors[i])) for b in range(len(factors[j]))}
    cases = []
    candidates = list(itertools.product(*(range(len(f)) for f in factors)))
    while uncovered:
        def gain(c):
            return sum((i, c[i], j, c[j]) in uncovered
                       for i, j in itertools.combinations(range(len(c)), 2))
        best = max(candidates, key=gain)
        uncovered -= {(i, best[i], j, best[j]) for i, j in itertools.combinations(range(len(best)), 2)}
        cases.append(tuple(f[k] for f, k in zip(factors, best)))
    return cases


def make_inputs(head_size, block_size, dtype, num_heads, num_kv_heads, context_lens, seed=0):
    """N(0,1) inputs; the query is a strided view (rows of a fused qkv tensor); blocks shuffled.

    Returns (clean, poisoned): the same tensors, except that in ``poisoned`` every cache slot
    the kernel must not read is NaN and padding block-table entries point at a NaN block.
    """
    gen = torch.Generator().manual_seed(seed)
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 2  # + an unused block and the padding target
    pool = torch.randperm(num_blocks - 1, generator=gen)
    nan_block = num_blocks - 1
    width = max(blocks_per_seq) + 1  # one more column than the longest needs: padding
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    start = 0
    for seq, n in enumerate(blocks_per_seq):
        tables[seq, :n] = pool[start:start + n]
        start += n
    key_cache = torch.randn(num_blocks, num_kv_heads, head_size // x, block_size, x,
                            generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, num_kv_heads, head_size, block_size,
                              generator=gen).to(dtype)
    qkv = torch.randn(len(context_lens), 3 * num_heads * head_size, generator=gen).to(dtype)
    query = qkv[:, :num_heads * head_size].view(len(context_lens), num_heads, head_size)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    clean = (query, key_cache, value_cache, tables, lens, head_size ** -0.5)

    key_p, value_p, tables_p = key_cache.clone(), value_cache.clone(), tables.clone()
    used = set()
    for seq, n in enumerate(context_lens):
        blocks = tables[seq, :blocks_per_seq[seq]].tolist()
        used.update(blocks)
        if n % block_size:
            key_p[blocks[-1], :, :, n % block_size:, :] = float("nan")
            value_p[blocks[-1], :, :, n % block_size:] = float("nan")
        tables_p[seq, blocks_per_seq[seq]:] = nan_block
    for block in set(range(num_blocks)) - used:
        key_p[block] = float("nan")
        value_p[block] = float("nan")
    return clean, (query, key_p, value_p, tables_p, lens, head_size ** -0.5)


def per_sequence_error(out, ref):
    """max over sequences of |out - ref| / |ref|, each sequence over all heads and dims."""
    out, ref = out.double().flatten(1), ref.double().flatten(1)
    return ((out - ref).norm(dim=1) / ref.norm(dim=1)).max().item()


def check(kernels, head_size, block_size, dtype, num_heads, num_kv_heads, lens, version, seed=0):
    clean, poisoned = make_inputs(head_size, block_size, dtype, num_heads, num_kv_heads, lens,
                                  seed)
    ref = reference.paged_attention(*clean)
    out = torch.full(clean[0].shape, float("nan"), dtype=dtype)  # every element must be written
    kernels.paged_attention(*poisoned, out=out, version=version)
    assert not out.isnan().any(), "NaN reached the output (unused slot, padding, or unwritten)"
    err = per_sequence_error(out, ref)
    WORST[dtype] = max(WORST.get(dtype, 0.0), err)
    CHECKED[dtype] = CHECKED.get(dtype, 0) + 1
    assert err < TOLERANCE[dtype], f"per-sequence relative error {err:.2e}"
    return out


# ----------------------------------------------------------------------------------------------
# The matrix
# ----------------------------------------------------------------------------------------------
MATRIX = (list(itertools.product(DTYPES, BLOCK_SIZES, HEAD_SIZES, HEADS, VERSIONS)) if FULL
          else pairwise(DTYPES, HEAD_SIZES, BLOCK_SIZES, list(HEADS), VERSIONS))


@pytest.mark.parametrize("dtype,head_size,block_size,heads,version", [
    (d, h, b, n, v) for d, h, b, n, v in (
        [(c[0], c[2], c[1], c[3], c[4]) for c in MATRIX] if FULL else MATRIX)
], ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else str(v))
def test_paged_attention_matches_reference(kernels, dtype, head_size, block_size, heads, version):
    # 1 token, one short of a block, exactly a block, one into the next, several hundred
    # (two V2 partitions past 512)
    lens = [1, block_size - 1, block_size, block_size + 1, 300, 600]
    num_heads, num_kv_heads = HEADS[heads]
    check(kernels, head_size, block_size, dtype, num_heads, num_kv_heads, lens, version,
          seed=head_size * block_size + version)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_4096_token_context(kernels, dtype, version):
    check(kernels, 128, 16, dtype, 2, 1, [4096, 5], version, seed=7)


def test_v2_takes_over_from_v1_by_context_length(kernels):
    plan = kernels.paged_attention_plan
    # a small batch (num_seqs * num_heads < 512 CUDA blocks): V1 only while one shortest
    # partition (64 tokens) holds the context, V2 after that
    assert plan(4, 8, 128, 64)[0] == 1
    assert plan(4, 8, 128, 65)[0] == 2
    # a batch that fills the GPU: V1 up to 8192 tokens, then V2
    assert plan(64, 8, 128, 8192)[0] == 1
    assert plan(64, 8, 128, 8193)[0] == 2
    assert plan(4, 8, 128, 100, 2)[0] == 2  # forced


def test_v2_partitions_shrink_until_the_grid_fills_the_gpu(kernels):
    """The emulated H100 has 132 SMs: the plan wants 4 CUDA blocks per SM (528)."""
    plan = kernels.paged_attention_plan
    # batch 1, 32 heads, 4,096 tokens: 512-token partitions give 256 CUDA blocks, 256 give 512
    # (still short), 128 give 1,024
    assert plan(1, 32, 128, 4096) == (2, 1 * 32 * 32 * (2 + 128) * 4, 128)
    # 1,024 tokens: 64-token partitions (512 CUDA blocks, the most the plan makes)
    assert plan(1, 32, 128, 1024)[2] == 64
    # 16,384 tokens: 512-token partitions already give 1,024
    assert plan(1, 32, 128, 16384)[2] == 512
    # a batch that already fills the GPU keeps 512-token partitions
    assert plan(64, 8, 128, 8193) == (2, 64 * 8 * 17 * (2 + 128) * 4, 512)
    # 8 sequences of 32 heads, 4,096 tokens: 512-token partitions give 2,048 CUDA blocks
    assert plan(8, 32, 128, 4096)[2] == 512
    # 4 sequences: 4 * 32 * 4 = 512 at 512 tokens, 1,024 at 256
    assert plan(4, 32, 128, 2048)[2] == 256
    # a forced V2 keeps the textbook 512 tokens (lesson 06)
    assert plan(1, 32, 128, 4096, 2) == (2, 1 * 32 * 8 * (2 + 128) * 4, 512)


def test_forced_partition_size_is_used_and_checked(kernels):
    try:
        kernels.force_partition_size(128)
        assert kernels.paged_attention_plan(1, 32, 128, 4096)[2] == 128
        assert kernels.paged_attention_plan(1, 32, 128, 4096, 2)[2] == 128
        for bad in (32, 100, 1024, -64):
            with pytest.raises(RuntimeError, match="power of two from 64 to 512"):
                kernels.force_partition_size(bad)
    finally:
        kernels.force_partition_size(0)
    assert kernels.paged_attention_plan(1, 32, 128, 4096)[2] == 128


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_automatic_plan_with_short_partitions_matches_the_reference(kernels, dtype):
    """Version 0 on a small batch: 64-token partitions (64 of them for 4,096 tokens)."""
    assert kernels.paged_attention_plan(2, 2, 128, 4096)[2] == 64
    check(kernels, 128, 16, dtype, 2, 1, [4096, 5], 0, seed=11)


@pytest.mark.parametrize("version,heads", [(2, (4, 2)), (3, (9, 3))])  # 3: the grouped kernel
@pytest.mark.parametrize("partition_size", [64, 128, 256, 512])
def test_every_partition_size_matches_the_reference(kernels, partition_size, version, heads):
    """Several sequences, GQA, contexts that end inside a partition and on its edge."""
    try:
        kernels.force_partition_size(partition_size)
        check(kernels, 64, 16, DTYPES[0], *heads, [1, 63, 64, 65, 700, 1024, 1100], version,
              seed=partition_size)
    finally:
        kernels.force_partition_size(0)


# ----------------------------------------------------------------------------------------------
# Shared memory: both sides of every limit
# ----------------------------------------------------------------------------------------------
def test_v1_above_48k_of_shared_memory_opts_in(kernels):
    """Head size 128, fp32: the old launcher opted in only when the *dynamic* logits passed
    48 KiB, so contexts whose logits plus static shared memory passed 48 KiB (about 11.6k to
    12.3k tokens) failed to launch."""
    static_bytes, _ = kernels.v1_limits(128, 16, torch.float32)
    below = (48 * 1024 - static_bytes) // 4 // 16 * 16  # the longest context under 48 KiB
    for n in (below, below + 16):  # under 48 KiB, and just over it (opt-in needed)
        check(kernels, 128, 16, torch.float32, 1, 1, [n], version=1, seed=n)


@pytest.mark.parametrize("device,name", [(0, "sm_90"), (1, "sm_80")])
def test_v1_at_the_opt_in_limit_and_v2_past_it(kernels, device, name):
    kernels.module.set_device(device)
    try:
        static_bytes, longest = kernels.v1_limits(64, 32, torch.float16)
        optin = {0: 227 * 1024, 1: 163 * 1024}[device]
        assert static_bytes + 4 * longest <= optin < static_bytes + 4 * (longest + 32)
        check(kernels, 64, 32, torch.float16, 1, 1, [longest], version=1, seed=1)
        clean, _ = make_inputs(64, 32, torch.float16, 1, 1, [longest + 1])
        with pytest.raises(RuntimeError, match=f"V1 takes at most {longest} tokens"):
            kernels.paged_attention(*clean, version=1)
        check(kernels, 64, 32, torch.float16, 1, 1, [longest + 1], version=0, seed=2)  # V2
    finally:
        kernels.module.set_device(0)


# ----------------------------------------------------------------------------------------------
# What the CPU build runs is the real thing
# ----------------------------------------------------------------------------------------------
def test_every_cuda_thread_meets_the_barriers_and_shuffles(kernels):
    before = kernels.module.counters()
    check(kernels, 64, 16, torch.float16, 2, 2, [20, 33], version=1)
    launches, blocks, barriers, exchanges = (a - b for a, b in
                                             zip(kernels.module.counters(), before))
    assert (launches, blocks) == (1, 4)
    # V1: 5 __syncthreads per thread (query, max, sum, probabilities, warp outputs)
    assert barriers == 4 * 128 * 5
    assert exchanges > 0


# ----------------------------------------------------------------------------------------------
# Inputs the kernel must accept, and inputs it must refuse clearly
# ----------------------------------------------------------------------------------------------
def test_value_cache_with_its_own_strides(kernels):
    """Caches that are views (e.g. some kv heads of a bigger pool): key and value strides
    differ, and each must be used for its own cache."""
    clean, _ = make_inputs(64, 16, torch.float32, 2, 1, [40, 7])
    query, key_cache, value_cache, tables, lens, scale = clean
    big = torch.randn(value_cache.shape[0], 3, 64, 16)
    big[:, 1:2] = value_cache
    value_view = big[:, 1:2]
    assert value_view.stride(0) != key_cache.stride(0)
    ref = reference.paged_attention(query, key_cache, value_cache, tables, lens, scale)
    for version in VERSIONS:
        out = kernels.paged_attention(query, key_cache, value_view, tables, lens, scale,
                                      version=version)
        assert per_sequence_error(out, ref) < 1e-5


@pytest.mark.parametrize("problem,message", [
    ("heads", "multiple of num_kv_heads"),
    ("misaligned", "16-byte"),
    ("narrow_table", "columns"),
    ("empty_context", r"context_lens\[1\] = 0"),
    ("longer_than_max", "outside"),
    ("bad_block", "not a block"),
    ("too_many_seqs", "65535"),
])
def test_bad_inputs_raise_clear_errors(kernels, problem, message):
    clean, _ = make_inputs(64, 16, torch.float16, 4, 2, [20, 9])
    query, key_cache, value_cache, tables, lens, scale = clean
    max_len = None
    if problem == "heads":
        query = torch.randn(2, 3, 64).to(torch.float16)
    elif problem == "misaligned":
        flat = torch.empty(key_cache.numel() + 1, dtype=torch.float16)
        key_cache = flat[1:].view(key_cache.shape)  # 2 bytes off a 16-byte boundary
    elif problem == "narrow_table":
        tables = tables[:, :1].contiguous()
    elif problem == "empty_context":
        lens = torch.tensor([20, 0], dtype=torch.int32)
    elif problem == "longer_than_max":
        max_len = 10
    elif problem == "bad_block":
        tables = tables.clone()
        tables[0, 0] = 10_000
    elif problem == "too_many_seqs":
        n = 65536
        query = torch.randn(n, 4, 64).to(torch.float16)
        tables = tables[:1].expand(n, -1).contiguous()
        lens = torch.full((n,), 5, dtype=torch.int32)
    # (the Python wrapper refuses an empty context in host lengths itself: a ValueError)
    with pytest.raises((RuntimeError, ValueError), match=message):
        kernels.paged_attention(query, key_cache, value_cache, tables, lens, scale,
                                max_context_len=max_len)


def test_an_empty_context_in_host_lengths_is_refused_by_wrapper_and_binding(kernels):
    clean, _ = make_inputs(64, 16, torch.float16, 4, 2, [20, 9])
    query, key_cache, value_cache, tables, _, scale = clean
    lens = torch.tensor([20, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"context_lens\[1\] = 0: every sequence's context"):
        kernels.paged_attention(query, key_cache, value_cache, tables, lens, scale)
    out = torch.empty(query.shape, dtype=query.dtype)
    with pytest.raises(RuntimeError, match=r"context_lens\[1\] = 0 is outside \[1, "):
        kernels.module.paged_attention(out, query, key_cache, value_cache, tables, lens, scale,
                                       20, 0)


@pytest.mark.parametrize("version", [*VERSIONS, 3])
def test_without_host_checks_empty_contexts_give_zeros_and_broken_promises_nan(kernels,
                                                                              version):
    """What the kernels do on a GPU, where the binding does not read the lengths back (the CPU
    build's host checks switched off): an empty context gives zeros (vLLM's answer; not
    0 / 0 = NaN), a negative one or one longer than the max_context_len the caller promised
    gives NaN, loudly, and every other sequence of the batch is right."""
    lens, max_len, too_long = ([40, 0, 30, 7], 32, 0) if version == 1 else ([40, 0, 600, 7],
                                                                              512, 2)
    clean, poisoned = make_inputs(64, 16, torch.float32, 4, 2, lens, seed=11)
    ref = reference.paged_attention(*clean)
    query, key_cache, value_cache, tables, lens_t, scale = poisoned
    lens_t = lens_t.clone()
    lens_t[3] = -5  # negative: NaN too
    out = torch.full(query.shape, 7.0)
    kernels.module.set_host_checks(False)
    try:
        kernels.module.paged_attention(out, query, key_cache, value_cache, tables, lens_t, scale,
                                       max_len, version)
    finally:
        kernels.module.set_host_checks(True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert out[too_long].isnan().all() and out[3].isnan().all()
    fine = [s for s in range(4) if s not in (1, 3, too_long)]
    assert per_sequence_error(out[fine], ref[fine]) < 1e-5


# ----------------------------------------------------------------------------------------------
# The grouped kernel (version 3): each kv head read once for all the query heads that share it
# ----------------------------------------------------------------------------------------------
GROUPS = {"GQA2": (4, 2), "GQA3": (9, 3), "GQA4": (8, 2), "GQA8": (16, 2), "MQA": (6, 1)}
GROUPED_MATRIX = pairwise(DTYPES, [64, 128], BLOCK_SIZES, list(GROUPS))


@pytest.mark.parametrize("dtype,head_size,block_size,heads", GROUPED_MATRIX,
                         ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else str(v))
def test_grouped_kernel_matches_reference(kernels, dtype, head_size, block_size, heads):
    # the contexts of the main matrix; 600 tokens are two 512-token partitions
    lens = [1, block_size - 1, block_size, block_size + 1, 300, 600]
    num_heads, num_kv_heads = GROUPS[heads]
    assert kernels.paged_attention_plan(len(lens), num_heads, head_size, 600, 3,
                                        num_kv_heads=num_kv_heads)[:1] == (3,)
    check(kernels, head_size, block_size, dtype, num_heads, num_kv_heads, lens, 3,
          seed=head_size + block_size + num_heads)


@pytest.mark.parametrize("version", [0, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_grouped_kernel_up_to_5000_tokens(kernels, dtype, version):
    """Ten 512-token partitions (a forced 3), or the plan's short ones (0: 64 tokens for two
    sequences of 2 kv heads), next to one-token and one-block contexts."""
    check(kernels, 128, 16, dtype, 8, 2, [5000, 1, 16, 2049], version, seed=5)


def test_grouped_kernel_with_one_partition_needs_no_workspace(kernels):
    """Every context in one partition: the grouped kernel writes the outputs itself, one launch
    and one CUDA block per (kv head, sequence), no reduce kernel."""
    assert kernels.paged_attention_plan(2, 9, 64, 300, 3, num_kv_heads=3) == (3, 0, 512)
    before = kernels.module.counters()
    check(kernels, 64, 16, torch.float16, 9, 3, [300, 17], version=3)
    launches, blocks, _, _ = (a - b for a, b in zip(kernels.module.counters(), before))
    assert (launches, blocks) == (1, 3 * 2)
    # two partitions: the partitions' CUDA blocks, then V2's reduce kernel per query head
    before = kernels.module.counters()
    check(kernels, 64, 16, torch.float16, 9, 3, [600, 17], version=3)
    launches, blocks, _, _ = (a - b for a, b in zip(kernels.module.counters(), before))
    assert (launches, blocks) == (2, 3 * 2 * 2 + 9 * 2)


def test_the_plan_picks_the_grouped_kernel_where_it_is_built(kernels):
    plan = kernels.paged_attention_plan
    assert plan(4, 9, 64, 64, num_kv_heads=3)[0] == 3  # SmolLM2: 3 query heads per kv head
    assert plan(64, 32, 128, 8192, num_kv_heads=8)[0] == 3  # LLaMA-3 8B: 4 per kv head
    assert plan(64, 32, 128, 8192)[0] == 1  # no sharing: V1 as before
    assert plan(4, 16, 128, 64, num_kv_heads=1)[0] == 1  # 16 per kv head: more than 8
    assert plan(4, 8, 80, 64, num_kv_heads=2)[0] == 1  # head size 80: not built
    assert plan(4, 8, 128, 64, num_kv_heads=2, cache_8bit=True)[0] == 1  # 8-bit cache
    # the grid it must fill has one row per (sequence, kv head): batch 1 of LLaMA-3 at 4,096
    # tokens has 8 rows, so 64-token partitions (512 CUDA blocks, the most the plan makes)
    assert plan(1, 32, 128, 4096, num_kv_heads=8) == (3, 32 * 64 * (2 + 128) * 4, 64)
    # 8 sequences: 64 rows; 256-token partitions give 1,024 CUDA blocks at 4,096 tokens (one
    # CUDA block per query head keeps 512 tokens: test_v2_partitions_shrink_...)
    assert plan(8, 32, 128, 4096, num_kv_heads=8)[2] == 256
    assert plan(1, 32, 128, 4096, 3, num_kv_heads=8)[2] == 512  # forced: 512 tokens


@pytest.mark.parametrize("heads,head_size,match", [
    ((16, 1), 64, "at most 8 query heads per kv head"),
    ((8, 2), 80, "head sizes 64 and 128"),
])
def test_a_forced_grouped_kernel_is_refused_where_it_is_not_built(kernels, heads, head_size,
                                                                  match):
    clean, _ = make_inputs(head_size, 16, torch.float32, *heads, [20])
    with pytest.raises(RuntimeError, match=match):
        kernels.paged_attention(*clean, version=3)
    check(kernels, head_size, 16, torch.float32, *heads, [20], version=0)  # 0 runs V1


def test_the_kernel_refuses_a_head_size_it_was_not_built_for(kernels):
    clean, _ = make_inputs(32, 16, torch.float32, 2, 2, [20])
    with pytest.raises(ValueError, match=r"built for head sizes \(64, .*not head size 32"):
        kernels.paged_attention(*clean)


def test_ops_sends_the_kernel_its_shapes_and_the_reference_the_others(kernels, monkeypatch):
    """The dispatch of ``ops.paged_attention`` as on a GPU, with this CPU build as the CUDA op:
    head size 64 runs the kernel; head size 32 (no template instance) warns once and runs the
    torch reference."""
    monkeypatch.setattr(ops, "_pick", lambda tensor: ("cuda", kernels))
    monkeypatch.setattr(ops, "_warned_shapes", set())
    supported, _ = make_inputs(64, 16, torch.float32, 2, 2, [20])
    before = ops.calls.copy()
    out = ops.paged_attention(*supported)
    assert ops.calls["paged_attention", "cuda"] == before["paged_attention", "cuda"] + 1
    assert per_sequence_error(out, reference.paged_attention(*supported)) < 1e-5
    unsupported, _ = make_inputs(32, 16, torch.float32, 2, 2, [20])
    with pytest.warns(RuntimeWarning, match="head size 32, block size 16.*torch reference"):
        out = ops.paged_attention(*unsupported)
    assert ops.calls["paged_attention", "cuda"] == before["paged_attention", "cuda"] + 1
    assert ops.calls["paged_attention", "reference"] == before["paged_attention", "reference"] + 1
    assert torch.equal(out, reference.paged_attention(*unsupported))


# ----------------------------------------------------------------------------------------------
# The cache kernels move bits: exact
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,head_size,block_size",
                         pairwise(DTYPES, HEAD_SIZES, BLOCK_SIZES),
                         ids=lambda v: dtype_id(v) if isinstance(v, torch.dtype) else str(v))
def test_reshape_and_cache_is_exact(kernels, dtype, head_size, block_size):
    gen = torch.Generator().manual_seed(head_size + block_size)
    num_tokens, num_heads, num_kv_heads, num_blocks = 9, 4, 2, 3
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen)
    qkv = qkv.to(dtype)
    kv_width = num_kv_heads * head_size
    key = qkv[:, num_heads * head_size:][:, :kv_width].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, -kv_width:].view(num_tokens, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::4] = -1  # padding tokens are skipped
    key_cache = torch.randn(num_blocks, num_kv_heads, head_size // x, block_size, x,
                            generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, num_kv_heads, head_size, block_size,
                              generator=gen).to(dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), expected_v.view(torch.uint8))


@pytest.mark.parametrize("slot,message", [(32, r"slot_mapping\[1\] = 32 is outside"),
                                          (-2, r"slot_mapping\[1\] = -2 is outside")])
def test_reshape_and_cache_refuses_a_slot_outside_the_pool(kernels, slot, message):
    key_cache, value_cache = torch.zeros(2, 1, 16, 16, 4), torch.zeros(2, 1, 64, 16)
    key, value = torch.randn(2, 1, 64), torch.randn(2, 1, 64)
    with pytest.raises(RuntimeError, match=message):
        kernels.reshape_and_cache(key, value, key_cache, value_cache, torch.tensor([-1, slot]))
    assert key_cache.count_nonzero() == 0 and value_cache.count_nonzero() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_copy_and_swap_blocks_are_exact(kernels, dtype):
    gen = torch.Generator().manual_seed(3)
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    keys = [torch.randn(6, 2, 64 // x, 16, x, generator=gen).to(dtype) for _ in range(2)]
    values = [torch.randn(6, 2, 64, 16, generator=gen).to(dtype) for _ in range(2)]
    expected_k = [k.clone() for k in keys]
    expected_v = [v.clone() for v in values]
    mapping = {0: [3, 5], 2: [1]}
    for src, dsts in mapping.items():
        for dst in dsts:
            for k, v in zip(expected_k, expected_v):
                k[dst], v[dst] = k[src], v[src]
    kernels.copy_blocks(keys, values, mapping)
    for got, want in zip(keys + values, expected_k + expected_v):
        assert torch.equal(got, want)

    cpu_pool = torch.zeros(4, *keys[0].shape[1:], dtype=dtype)
    kernels.swap_blocks(keys[0], cpu_pool, {1: 0, 4: 3})
    assert torch.equal(cpu_pool[0], keys[0][1]) and torch.equal(cpu_pool[3], keys[0][4])
    assert cpu_pool[1:3].count_nonzero() == 0


def test_copy_blocks_past_the_grid_limit_of_65535_pairs(kernels):
    """The pairs sit on gridDim.y (at most 65535): more are copied in several launches."""
    n = 65535 + 2
    keys = [torch.zeros(2 * n, 1, 1, 1, 4)]  # one 16-byte key block: quick to emulate
    values = [torch.zeros(2 * n, 1, 4, 1)]
    keys[0][:n] = torch.arange(n, dtype=torch.float32)[:, None, None, None, None] + 1
    values[0][:n] = -keys[0][:n].view(n, 1, 4, 1)
    before = kernels.module.counters()[0]
    kernels.copy_blocks(keys, values, {i: [n + i] for i in range(n)})
    assert kernels.module.counters()[0] - before == 2  # 65535 pairs, then 2
    assert torch.equal(keys[0][n:], keys[0][:n]) and torch.equal(values[0][n:], values[0][:n])


def test_report_worst_error_per_dtype():
    """Not a check: prints the matrix size and the worst per-sequence error per dtype of the
    cases run before it (``pytest -s`` shows it)."""
    total = len(DTYPES) * len(BLOCK_SIZES) * len(HEAD_SIZES) * len(HEADS) * len(VERSIONS)
    mode = "full" if FULL else "pairwise (MINIPAGED_FULL_MATRIX=1 runs all)"
    print(f"\nCUDA-on-CPU attention matrix: {len(MATRIX)} of {total} combinations, {mode}; "
          f"{sum(CHECKED.values())} attention cases checked with the targeted ones")
    for dtype in DTYPES:
        if dtype in WORST:
            print(f"worst per-sequence relative error {dtype_id(dtype):>8}: {WORST[dtype]:.2e} "
                  f"over {CHECKED[dtype]} cases (tolerance {TOLERANCE[dtype]:.0e})")


def test_recorded_shuffles_of_one_warp_match_the_emulator(kernels):
    """The real kernel's warp 0 (head 0, sequence 1) exchanges, lane by lane, the values the
    emulator's butterflies say it does: the same masks, the same values within fp32 rounding."""
    import numpy as np

    from minipaged.lab import emulator as emu
    from visualizer import butterfly_steps

    gen = torch.Generator().manual_seed(0)
    head_size, block_size, x = 64, 16, 4
    key_cache = torch.randn(16, 2, head_size // x, block_size, x, generator=gen)
    value_cache = torch.randn(16, 2, head_size, block_size, generator=gen)
    query = torch.randn(2, 4, head_size, generator=gen)
    pool = torch.randperm(16, generator=gen)
    tables = torch.stack([pool[:10], pool[6:16]]).int()  # scattered, partly shared
    lens = torch.tensor([37, 150], dtype=torch.int32)
    inputs = (query, key_cache, value_cache, tables, lens, head_size ** -0.5)
    trace = []
    emu.paged_attention(*inputs, trace=trace, trace_filter=(1, 0))
    # version 1: one CUDA block per query head, as the emulator (version 0 would run the grouped
    # kernel for these 2 query heads per kv head)
    out, steps = cuda_on_cpu.trace_shuffles(
        kernels, lambda: kernels.paged_attention(*inputs, version=1), block=(0, 1, 0), warp=0)
    assert torch.allclose(out, reference.paged_attention(*inputs), rtol=1e-4, atol=1e-5)
    assert steps and all(len(s["src_lanes"]) == 32 for s in steps)
    for phase, index in (("max", 0), ("sum", 1)):
        real = cuda_on_cpu.butterfly_runs(steps, phase, first_mask=16)[index]
        emulated = butterfly_steps(trace, phase=phase, stage="warp", warp=0)
        assert [r["mask"] for r in real] == [r["mask"] for r in emulated]
        for r, e in zip(real, emulated):
            assert r["pairs"] == e["pairs"]
            np.testing.assert_allclose(r["values_before"], e["values_before"], rtol=1e-5,
                                       atol=1e-6)
            np.testing.assert_allclose(r["values_after"], e["values_after"], rtol=1e-5,
                                       atol=1e-6)
    # Disarmed afterwards: another launch records nothing.
    _, again = cuda_on_cpu.trace_shuffles(kernels, lambda: None, block=(0, 1, 0), warp=0)
    assert again == []
