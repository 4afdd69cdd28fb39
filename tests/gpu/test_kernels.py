"""Lesson 06 on a GPU: our CUDA kernels against the torch reference, minipaged.kernels.reference.

Attention is compared by relative error (N(0,1) inputs, the reference computed in fp32 on the
CPU from the very same low-precision inputs); the output is filled with NaN before each run so an
element the kernel forgot to write fails the test. The cache kernels move bits, so they must be
exact.
"""
import contextlib
import math

import pytest

torch = pytest.importorskip("torch")

from minipaged.kernels import ops, reference  # noqa: E402

pytestmark = pytest.mark.lesson06

DEVICE = "cuda"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
DTYPES = list(TOLERANCE)
GQA = [(8, 2), (4, 4), (6, 1)]  # (num_heads, num_kv_heads)


def x_of(dtype):
    return 16 // torch.tensor([], dtype=dtype).element_size()


def make_inputs(head_size, block_size, dtype, num_heads, num_kv_heads, context_lens, seed=0,
                spare_blocks=5):
    """N(0,1) query and caches on DEVICE; each sequence's blocks scattered over a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    x = x_of(dtype)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for seq, n in enumerate(blocks_per_seq):
        block_tables[seq, :n] = pool[start:start + n]
        start += n
    key_cache = torch.randn(num_blocks, num_kv_heads, head_size // x, block_size, x, generator=gen)
    value_cache = torch.randn(num_blocks, num_kv_heads, head_size, block_size, generator=gen)
    query = torch.randn(len(context_lens), num_heads, head_size, generator=gen)
    return {
        "query": query.to(dtype).to(DEVICE),
        "key_cache": key_cache.to(dtype).to(DEVICE),
        "value_cache": value_cache.to(dtype).to(DEVICE),
        "block_tables": block_tables.to(DEVICE),
        "context_lens": torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        "scale": head_size ** -0.5,
    }


def expected(inputs):
    """The torch reference on the CPU (no TF32, no GPU library differences)."""
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return reference.paged_attention(**cpu)


def run_kernel(kernels, inputs, max_context_len=None, version=0):
    out = torch.full_like(inputs["query"], float("nan"))  # poison: every element must be written
    if max_context_len is None:
        max_context_len = int(inputs["context_lens"].max())
    result = kernels.paged_attention(**inputs, max_context_len=max_context_len, out=out,
                                     version=version)
    assert result is out
    torch.cuda.synchronize()
    return out.cpu()


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


# ----------------------------------------------------------------------------------------------
# paged_attention
# ----------------------------------------------------------------------------------------------
def per_sequence_err(out, ref):
    """The worst sequence's error relative to its own output norm."""
    out, ref = out.double().flatten(1), ref.double().flatten(1)
    return ((out - ref).norm(dim=1) / ref.norm(dim=1)).max().item()


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA, ids=lambda v: str(v))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_paged_attention_matches_reference(kernels, dtype, head_size, block_size, num_heads,
                                           num_kv_heads, version):
    lens = [1, block_size - 1, block_size, block_size + 1, 300, 1000, 4096]
    inputs = make_inputs(head_size, block_size, dtype, num_heads, num_kv_heads, lens,
                         seed=head_size * block_size)
    out = run_kernel(kernels, inputs, version=version)
    ref = expected(inputs)
    assert not torch.isnan(out).any(), "some output elements were never written"
    assert per_sequence_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("version", [0, 1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_long_context_uses_more_than_48k_of_shared_memory(kernels, dtype, version):
    # 16384 fp32 logits = 64 KiB of dynamic shared memory: V1 must opt in; V2 needs none.
    inputs = make_inputs(128, 16, dtype, 8, 2, [16384, 3000], seed=1)
    out = run_kernel(kernels, inputs, version=version)
    assert per_sequence_err(out, expected(inputs)) < TOLERANCE[dtype]


def test_v1_just_over_48k_of_static_plus_dynamic_shared_memory(kernels):
    """Contexts whose logits fit in 48 KiB but not together with the static shared memory
    (about 11.6k to 12.3k tokens at head size 128, fp32) must opt in too."""
    static_bytes, _ = kernels.v1_limits(128, 16, torch.float32)
    n = (48 * 1024 - static_bytes) // 4 // 16 * 16 + 16
    inputs = make_inputs(128, 16, torch.float32, 2, 1, [n], seed=8)
    assert per_sequence_err(run_kernel(kernels, inputs, version=1), expected(inputs)) < 1e-5


def test_v2_takes_over_by_context_length(kernels):
    assert kernels.paged_attention_plan(4, 8, 128, 64)[0] == 1
    assert kernels.paged_attention_plan(4, 8, 128, 65)[0] == 2
    assert kernels.paged_attention_plan(64, 8, 128, 8192)[0] == 1
    assert kernels.paged_attention_plan(64, 8, 128, 8193)[0] == 2


def test_small_batches_get_shorter_partitions_until_the_gpu_is_full(kernels):
    """4 CUDA blocks per SM wanted: batch 1 of 32 heads at 4,096 tokens gets 128-token ones on
    an H100 or H200 (132 SMs); a batch that fills the GPU keeps 512."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    version, _, size = kernels.paged_attention_plan(1, 32, 128, 4096)
    assert version == 2
    assert 32 * (4096 // size) >= 4 * sms or size == 64
    assert size == 64 or 32 * (4096 // (2 * size)) < 4 * sms  # the longest that fills it
    assert kernels.paged_attention_plan(64, 8, 128, 8193)[2] == 512


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("size", [0, 64, 128, 256, 512])
def test_every_partition_size_matches_the_reference(kernels, dtype, size):
    """0: the automatic plan; else forced. Contexts end inside partitions and on their edges."""
    inputs = make_inputs(128, 16, dtype, 8, 2, [4096, 64, 65, 1000, 1, 2049], seed=size + 3)
    try:
        kernels.force_partition_size(size)
        out = run_kernel(kernels, inputs, version=0 if size == 0 else 2)
    finally:
        kernels.force_partition_size(0)
    assert per_sequence_err(out, expected(inputs)) < TOLERANCE[dtype]


# ----------------------------------------------------------------------------------------------
# The grouped kernel (version 3): one CUDA block per kv head for all the query heads it serves
# ----------------------------------------------------------------------------------------------
GROUPS = [(4, 2), (9, 3), (8, 2), (16, 2), (6, 1)]  # GQA 2, 3, 4, 8 and MQA (6 per kv head)


@pytest.mark.parametrize("num_heads,num_kv_heads", GROUPS, ids=lambda v: str(v))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_grouped_kernel_matches_reference(kernels, dtype, head_size, block_size, num_heads,
                                          num_kv_heads):
    lens = [1, block_size - 1, block_size, block_size + 1, 300, 1000, 5000]
    inputs = make_inputs(head_size, block_size, dtype, num_heads, num_kv_heads, lens,
                         seed=head_size + block_size + num_heads)
    ref = expected(inputs)
    for version in (3, 0):  # forced (512-token partitions), and chosen by the plan
        out = run_kernel(kernels, inputs, version=version)
        assert not torch.isnan(out).any(), "some output elements were never written"
        assert per_sequence_err(out, ref) < TOLERANCE[dtype], version


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_grouped_kernel_with_one_partition_writes_the_output_itself(kernels, dtype):
    """Every context within one partition: no workspace, no reduce kernel."""
    inputs = make_inputs(128, 16, dtype, 32, 8, [500, 1, 17, 64], seed=9)
    assert kernels.paged_attention_plan(4, 32, 128, 500, 3, num_kv_heads=8) == (3, 0, 512)
    assert per_sequence_err(run_kernel(kernels, inputs, version=3), expected(inputs)) < \
        TOLERANCE[dtype]


@pytest.mark.parametrize("size", [64, 128, 256, 512])
def test_grouped_kernel_at_every_partition_size(kernels, size):
    inputs = make_inputs(64, 16, torch.float16, 9, 3, [4096, 64, 65, 1000, 1, 2049], seed=size)
    try:
        kernels.force_partition_size(size)
        out = run_kernel(kernels, inputs, version=3)
    finally:
        kernels.force_partition_size(0)
    assert per_sequence_err(out, expected(inputs)) < TOLERANCE[torch.float16]


def test_the_plan_picks_the_grouped_kernel_for_gqa(kernels):
    plan = kernels.paged_attention_plan
    assert plan(64, 32, 128, 2048, num_kv_heads=8)[0] == 3
    assert plan(64, 9, 64, 2048, num_kv_heads=3)[0] == 3
    assert plan(64, 32, 128, 2048)[0] == 1  # no sharing
    assert plan(64, 32, 128, 2048, num_kv_heads=2)[0] == 1  # 16 per kv head: not built
    with pytest.raises(RuntimeError, match="version 3"):
        inputs = make_inputs(80, 16, torch.float16, 8, 2, [20])
        run_kernel(kernels, inputs, version=3)


# ----------------------------------------------------------------------------------------------
# V2's fused reduce (set_v2_reduce(1)): the partitions' last CUDA block combines them, no reduce
# kernel. The CPU runs the same cases in tests/kernels/test_fused_reduce.py (CUDA on the CPU,
# blocks in several orders); here real blocks race for the counters.
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def fused_reduce(kernels, partition_size=0):
    """Every call inside combines its partitions in their last CUDA block."""
    kernels.set_v2_reduce(1)
    kernels.force_partition_size(partition_size)
    try:
        yield
    finally:
        kernels.force_partition_size(0)
        kernels.set_v2_reduce(0)


# 0 and 1 token, exactly one and two 64-token partitions, a multiple of every partition size
# (1024), and contexts of 1 to 64 partitions side by side in one launch
FUSED_LENS = [0, 1, 64, 128, 700, 1024, 1100, 4096]


def check_fused(out, ref, lens, dtype):
    """Empty contexts give zeros; every other sequence is within tolerance of the reference."""
    empty = [s for s, n in enumerate(lens) if n == 0]
    full = [s for s, n in enumerate(lens) if n > 0]
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert not torch.isnan(out[full]).any(), "some output elements were never written"
    assert per_sequence_err(out[full], ref[full]) < TOLERANCE[dtype]


@pytest.mark.parametrize("version,heads", [(2, (8, 8)), (3, (8, 2))], ids=["V2", "V3-GQA4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_fused_reduce_matches_the_reference_and_the_reduce_kernel(kernels, dtype, version, heads):
    """Every partition size forced, then the automatic plan (version 0, which picks `version`
    for these heads); the contexts of FUSED_LENS, an empty one among them, in one launch."""
    inputs = make_inputs(128, 16, dtype, *heads, FUSED_LENS, seed=version)
    ref = expected(inputs)  # once: the reference is the slow part
    full = [s for s, n in enumerate(FUSED_LENS) if n > 0]
    for size in (64, 128, 256, 512, 0):
        chosen = version if size else 0
        try:
            kernels.force_partition_size(size)
            separate = run_kernel(kernels, inputs, version=chosen)
        finally:
            kernels.force_partition_size(0)
        with fused_reduce(kernels, size):
            fused = run_kernel(kernels, inputs, version=chosen)
        check_fused(fused, ref, FUSED_LENS, dtype)
        assert per_sequence_err(fused[full], separate[full]) < TOLERANCE[dtype], size


@pytest.mark.parametrize("version,heads", [(2, (4, 4)), (3, (6, 1))], ids=["V2", "V3-MQA"])
def test_fused_reduce_twice_gives_the_same_bits(kernels, version, heads):
    """The counters are zeroed before each call and back at 0 after it: a second call agrees
    with the first bit for bit, whichever blocks finished last."""
    lens = [4096, 650, 64, 0, 200]
    inputs = make_inputs(64, 8, torch.float32, *heads, lens, seed=12)
    with fused_reduce(kernels, 64):
        first = run_kernel(kernels, inputs, version=version)
        second = run_kernel(kernels, inputs, version=version)
    check_fused(first, expected(inputs), lens, torch.float32)
    assert torch.equal(first, second)


@pytest.mark.parametrize("version", [2, 3])
def test_fused_reduce_writes_empty_and_broken_contexts(kernels, version):
    """Zeros for an empty context, NaN for a negative one and for one with more partitions
    than max_context_len allows, as the reduce kernel writes them; the rest are right."""
    lens = [40, 0, 600, 7, 300]
    inputs = make_inputs(64, 16, torch.float32, 4, 2 if version == 2 else 1, lens, seed=13)
    ref = expected(inputs)
    inputs["context_lens"][3] = -5
    with fused_reduce(kernels, 128):  # 4 partitions for max_context_len 512; 600 tokens need 5
        out = run_kernel(kernels, inputs, max_context_len=512, version=version)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isnan(out[2]).all() and torch.isnan(out[3]).all()
    assert per_sequence_err(out[[0, 4]], ref[[0, 4]]) < 1e-5


def test_fused_reduce_replays_from_a_cuda_graph(kernels):
    """The counters' memset is captured as a graph node before the kernel: every replay
    starts from zeroed counters and gives the eager call's output."""
    lens = [4096, 700, 1]
    inputs = make_inputs(128, 16, torch.float16, 8, 8, lens, seed=21)
    with fused_reduce(kernels, 64):
        eager = run_kernel(kernels, inputs, max_context_len=4096)
        out = torch.empty_like(inputs["query"])
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as before a capture
            kernels.paged_attention(**inputs, max_context_len=4096, out=out)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            kernels.paged_attention(**inputs, max_context_len=4096, out=out)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), eager)
    check_fused(eager, expected(inputs), lens, torch.float16)


def test_fused_reduce_adds_its_counters_to_the_plan(kernels):
    plan = kernels.paged_attention_plan
    with fused_reduce(kernels, 64):
        separate = (2, 1 * 32 * 64 * (2 + 128) * 4, 64)
        assert plan(1, 32, 128, 4096, 2) == (separate[0], separate[1] + 32 * 4, 64)
        assert plan(1, 4, 64, 64 * 513, 2)[1] == 4 * 513 * (2 + 64) * 4  # too many: no counters
    assert plan(1, 32, 128, 4096, 2)[1] == 1 * 32 * 8 * (2 + 128) * 4  # 512 tokens again


def test_ops_dispatches_to_the_kernel(kernels):
    inputs = make_inputs(64, 16, torch.float16, 4, 2, [7, 90], seed=2)
    before = ops.calls.copy()
    assert ops.backend(inputs["key_cache"]) == "cuda"
    via_ops = ops.paged_attention(**inputs)
    assert ops.calls["paged_attention", "cuda"] == before["paged_attention", "cuda"] + 1
    direct = kernels.paged_attention(**inputs, max_context_len=90)
    assert torch.equal(via_ops, direct)


def test_strided_query_view(kernels):
    """The query may be a view into a fused qkv projection (rows not contiguous)."""
    inputs = make_inputs(128, 16, torch.float16, 4, 4, [33, 64], seed=3)
    qkv = torch.randn(2, 3 * 4 * 128, device=DEVICE, dtype=torch.float16)
    qkv[:, : 4 * 128] = inputs["query"].reshape(2, -1)
    inputs["query"] = qkv[:, : 4 * 128].view(2, 4, 128)
    assert not inputs["query"].is_contiguous()
    assert rel_err(run_kernel(kernels, inputs), expected(inputs)) < 2e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_garbage_past_the_context_is_never_read(kernels, dtype):
    """NaN in the tail of each last block and in unused blocks must not reach the output."""
    block_size, lens = 16, [3, 17, 40, 200]
    inputs = make_inputs(128, block_size, dtype, 8, 2, lens, seed=4)
    ref = expected(inputs)  # on the clean caches
    used = set()
    for seq, n in enumerate(lens):
        blocks = inputs["block_tables"][seq, : math.ceil(n / block_size)].tolist()
        used.update(blocks)
        if n % block_size:
            inputs["key_cache"][blocks[-1], :, :, n % block_size:, :] = float("nan")
            inputs["value_cache"][blocks[-1], :, :, n % block_size:] = float("nan")
    for block in set(range(inputs["key_cache"].shape[0])) - used:
        inputs["key_cache"][block] = float("nan")
        inputs["value_cache"][block] = float("nan")
    out = run_kernel(kernels, inputs)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOLERANCE[dtype]


def test_v1_past_its_shared_memory_raises_and_v2_runs(kernels):
    _, longest = kernels.v1_limits(64, 16, torch.float16)
    inputs = make_inputs(64, 16, torch.float16, 2, 2, [longest + 16], seed=5)
    with pytest.raises(RuntimeError, match=f"V1 takes at most {longest} tokens"):
        kernels.paged_attention(**inputs, version=1)
    out = run_kernel(kernels, inputs)  # V2 chosen
    assert per_sequence_err(out, expected(inputs)) < TOLERANCE[torch.float16]


def test_context_longer_than_max_context_len_gives_nan_not_corruption(kernels):
    inputs = make_inputs(64, 16, torch.float32, 2, 2, [100, 10], seed=6)
    out = run_kernel(kernels, inputs, max_context_len=10, version=1)
    assert torch.isnan(out[0]).all()  # the sequence that does not fit is marked, loudly
    assert rel_err(out[1], expected(inputs)[1]) < 1e-5  # the one that fits is right


@pytest.mark.parametrize("version", [1, 2])
def test_empty_context_gives_zeros_on_the_gpu_and_is_refused_in_host_lengths(kernels, version):
    """Lengths on the GPU are not read back (a synchronisation per call): the kernel writes
    zeros for an empty context, as vLLM's does. Lengths on the host are checked for free."""
    lens = [40, 0, 600 if version == 2 else 30]
    inputs = make_inputs(64, 16, torch.float32, 4, 2, lens, seed=9)
    out = run_kernel(kernels, inputs, version=version)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert per_sequence_err(out[[0, 2]], expected(inputs)[[0, 2]]) < 1e-5
    inputs["context_lens"] = inputs["context_lens"].cpu()
    with pytest.raises(ValueError, match=r"context_lens\[1\] = 0"):
        kernels.paged_attention(**inputs, version=version)


def test_unsupported_head_size_falls_back_to_the_reference(kernels):
    inputs = make_inputs(32, 16, torch.float32, 2, 2, [20], seed=7)  # no kernel for head size 32
    with pytest.raises(ValueError, match="not head size 32"):
        kernels.paged_attention(**inputs)
    before = ops.calls.copy()
    with pytest.warns(RuntimeWarning, match="torch reference"):
        out = ops.paged_attention(**inputs)
    assert ops.calls["paged_attention", "reference"] == before["paged_attention", "reference"] + 1
    assert ops.calls["paged_attention", "cuda"] == before["paged_attention", "cuda"]
    assert rel_err(out.cpu(), expected(inputs)) < 1e-5


# ----------------------------------------------------------------------------------------------
# reshape_and_cache
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 112, 128, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_reshape_and_cache_is_exact(kernels, dtype, head_size, block_size):
    gen = torch.Generator().manual_seed(head_size + block_size)
    num_tokens, num_heads, num_kv_heads, num_blocks = 37, 4, 2, 12
    x = x_of(dtype)
    # key and value as views into a fused qkv projection, like a model produces them
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=gen)
    qkv = qkv.to(dtype).to(DEVICE)
    kv_width = num_kv_heads * head_size
    key = qkv[:, num_heads * head_size:][:, :kv_width].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, -kv_width:].view(num_tokens, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1  # padding tokens are skipped
    slot_mapping = slots.to(DEVICE)
    key_cache = torch.randn(num_blocks, num_kv_heads, head_size // x, block_size, x,
                            generator=gen).to(dtype).to(DEVICE)
    value_cache = torch.randn(num_blocks, num_kv_heads, head_size, block_size,
                              generator=gen).to(dtype).to(DEVICE)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slot_mapping)

    kernels.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    torch.cuda.synchronize()
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


def test_reshape_and_cache_accepts_int32_slots(kernels):
    key = torch.randn(3, 2, 64, device=DEVICE)
    value = torch.randn(3, 2, 64, device=DEVICE)
    key_cache = torch.zeros(2, 2, 16, 16, 4, device=DEVICE)
    value_cache = torch.zeros(2, 2, 64, 16, device=DEVICE)
    slots = torch.tensor([17, -1, 0], dtype=torch.int32, device=DEVICE)
    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    torch.cuda.synchronize()
    assert torch.equal(value_cache[1, :, :, 1], value[0])
    assert torch.equal(value_cache[0, :, :, 0], value[2])
    assert torch.equal(key_cache[1, :, :, 1, :].reshape(2, 64), key[0])
    assert value_cache.count_nonzero() == 2 * 2 * 64


# ----------------------------------------------------------------------------------------------
# copy_blocks and swap_blocks
# ----------------------------------------------------------------------------------------------
def make_layer_caches(num_layers, num_blocks, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = x_of(dtype)
    keys = [torch.randn(num_blocks, 2, 64 // x, 16, x, generator=gen).to(dtype).to(device)
            for _ in range(num_layers)]
    values = [torch.randn(num_blocks, 2, 64, 16, generator=gen).to(dtype).to(device)
              for _ in range(num_layers)]
    return keys, values


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_copy_blocks_is_exact(kernels, dtype):
    keys, values = make_layer_caches(3, 10, dtype, DEVICE)
    mapping = {0: [5, 7], 2: [9], 4: [1]}
    expected_keys = [k.clone() for k in keys]
    expected_values = [v.clone() for v in values]
    for src, dsts in mapping.items():
        for dst in dsts:
            for k, v in zip(expected_keys, expected_values, strict=True):
                k[dst] = k[src]
                v[dst] = v[src]
    kernels.copy_blocks(keys, values, mapping)
    torch.cuda.synchronize()
    for got, want in zip(keys + values, expected_keys + expected_values, strict=True):
        assert torch.equal(got, want)


def test_copy_blocks_past_the_grid_limit_of_65535_pairs(kernels):
    """The pairs sit on gridDim.y (at most 65535): more are copied in several launches."""
    n = 65535 + 7
    keys, values = make_layer_caches(2, 2 * n, torch.float16, DEVICE, seed=4)
    kernels.copy_blocks(keys, values, {i: [n + i] for i in range(n)})
    torch.cuda.synchronize()
    for cache in keys + values:
        assert torch.equal(cache[n:], cache[:n])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_swap_out_and_in_through_pinned_memory_is_exact(kernels, dtype):
    (gpu_key,), (gpu_value,) = make_layer_caches(1, 8, dtype, DEVICE, seed=1)
    cpu_key = torch.zeros(gpu_key.shape[0] + 2, *gpu_key.shape[1:], dtype=dtype).pin_memory()
    cpu_value = torch.zeros(gpu_value.shape[0] + 2, *gpu_value.shape[1:], dtype=dtype).pin_memory()
    swap_out = {1: 0, 6: 9, 3: 4}  # gpu block -> cpu block
    kernels.swap_blocks(gpu_key, cpu_key, swap_out)
    kernels.swap_blocks(gpu_value, cpu_value, swap_out)
    torch.cuda.synchronize()  # the copies are asynchronous
    for g, c in swap_out.items():
        assert torch.equal(cpu_key[c], gpu_key[g].cpu())
        assert torch.equal(cpu_value[c], gpu_value[g].cpu())
    untouched = [b for b in range(cpu_key.shape[0]) if b not in swap_out.values()]
    assert cpu_key[untouched].count_nonzero() == 0

    swap_in = {9: 2, 0: 7}  # cpu block -> gpu block
    before = gpu_key.clone()
    kernels.swap_blocks(cpu_key, gpu_key, swap_in)
    kernels.swap_blocks(cpu_value, gpu_value, swap_in)
    torch.cuda.synchronize()
    assert torch.equal(gpu_key[2], before[6]) and torch.equal(gpu_key[7], before[1])
    others = [b for b in range(gpu_key.shape[0]) if b not in swap_in.values()]
    assert torch.equal(gpu_key[others], before[others])


def test_swap_from_pageable_memory_and_gpu_to_gpu(kernels):
    (gpu_key,), _ = make_layer_caches(1, 4, torch.float16, DEVICE, seed=2)
    cpu_key = torch.randn(4, *gpu_key.shape[1:]).to(torch.float16)  # not pinned: still correct
    kernels.swap_blocks(cpu_key, gpu_key, {3: 0})
    other = torch.zeros_like(gpu_key)
    kernels.swap_blocks(gpu_key, other, {0: 1})
    torch.cuda.synchronize()
    assert torch.equal(gpu_key[0].cpu(), cpu_key[3])
    assert torch.equal(other[1], gpu_key[0])
