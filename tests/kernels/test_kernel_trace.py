"""Lessons 05 and 06: the real kernel's loops recorded on the CPU, and vLLM's key load.

The traced CPU builds (``cuda_on_cpu.load("traced")``, ``load("shared_load")``) compile the
kernel's MP_TRACE calls; ``kernel_trace.run_traced`` sorts the records. They are checked against
the torch reference on N(0, 1) inputs: the phase-2 logits are scale * q.k, the warps' visits
cover every KV block of a sequence exactly once, the phase-4 sums add up to the output. Both
key loads (ours, and vLLM's thread-group-shared one) give the reference's attention, and their
load counts differ exactly as lesson 05 says. The grouped kernel (version 3) loads each key and
value once per group of query heads: a decode step's K/V bytes are the per-head kernel's divided
by the group size, for SmolLM2's shape and LLaMA-3's (lesson 18). Each build compiles once
(cached on disk).

Slow: minutes on a first run (two traced builds of the kernels; `make test-all` prebuilds them),
not measured this session.
"""
import pytest
import torch

from kernel_inputs import make_inputs
from minipaged.kernels import cuda_on_cpu, reference
from minipaged.lab import kernel_trace
from minipaged.lab import emulator as emu

pytestmark = [pytest.mark.lesson06, pytest.mark.slow]


def rel_err(a, b):
    return float(torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double()))


TOL = {torch.float32: 1e-5, torch.float16: 1e-3}


@pytest.fixture(scope="module")
def traced():
    return cuda_on_cpu.load("traced")


@pytest.fixture(scope="module")
def shared():
    return cuda_on_cpu.load("shared_load")


@pytest.mark.parametrize("variant", ["traced", "shared_load"])
@pytest.mark.parametrize("head_size,block_size,dtype", [
    (64, 16, torch.float32), (80, 8, torch.float32), (128, 32, torch.float32),
    (96, 16, torch.float16), (64, 8, torch.float16), (256, 16, torch.float32)])
def test_both_key_loads_match_the_reference(variant, head_size, block_size, dtype, traced, shared):
    inputs = make_inputs(head_size, block_size, dtype)
    kernels = traced if variant == "traced" else shared
    for version in (1, 2):
        out, _ = kernel_trace.run_traced(*inputs, version=version, variant=variant,
                                         kernels=kernels)
        ref = reference.paged_attention(*inputs)
        for seq in range(out.shape[0]):
            assert rel_err(out[seq], ref[seq]) < TOL[dtype], (variant, version, seq)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_recorded_loops_match_the_reference(block_size, traced):
    inputs = make_inputs(64, block_size, lens=(37, 150, 1))
    query, key_cache, value_cache, tables, lens, scale = inputs
    out, trace = kernel_trace.run_traced(*inputs, kernels=traced)
    num_heads = query.shape[1]
    assert set(trace) == {(h, s, 0) for h in range(num_heads) for s in range(3)}
    for (head, seq, _), t in trace.items():
        n = int(lens[seq])
        blocks = -(-n // block_size)
        # visits: warp w takes blocks w, w+4, ...; together every block exactly once
        assert t["visits"] == [list(range(w, blocks, 4)) for w in range(4)]
        assert t["visits"] == [emu.warp_blocks(w, 0, n, block_size) for w in range(4)]
        visited = sorted(b for v in t["visits"] for b in v)
        assert visited == list(range(blocks))
        assert [p for v in t["physical"] for p in v] == \
            [int(tables[seq, b]) for v in t["visits"] for b in v]
        # phase 2 logits: scale * q.k of the reference, and phase 3's max and sum
        ref = kernel_trace.reference_logits(*inputs, seq=seq, head=head)
        assert t["logits"].shape == (n,) and t["first_token"] == 0
        assert rel_err(t["logits"], ref) < 1e-5
        assert t["max"] == pytest.approx(float(ref.max()), rel=1e-5, abs=1e-6)
        assert t["exp_sum"] == pytest.approx(float(torch.exp(ref - ref.max()).sum()), rel=1e-5)
        # phase 4: lane slices add up to the warp's rows, warps add up to the output
        assert torch.allclose(t["lane_sums"].sum(-1), t["warp_sums"], rtol=1e-5, atol=1e-6)
        assert torch.allclose(t["warp_sums"].sum(0), out[seq, head], rtol=1e-5, atol=1e-6)
        idle = [w for w in range(4) if not t["visits"][w]]
        assert all(not t["warp_sums"][w].any() for w in idle)


def test_v2_partitions_are_traced_each(traced):
    inputs = make_inputs(64, 16, lens=(1100,), num_heads=1, num_kv_heads=1)
    _, trace = kernel_trace.run_traced(*inputs, version=2, kernels=traced)
    assert sorted(trace) == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]
    assert [trace[(0, 0, p)]["first_token"] for p in range(3)] == [0, 512, 1024]
    assert [len(trace[(0, 0, p)]["logits"]) for p in range(3)] == [512, 512, 76]
    assert sorted(b for p in range(3) for v in trace[(0, 0, p)]["visits"] for b in v) == \
        list(range(69))
    for p in range(3):  # the loop of lesson 06's exercise 1, partition by partition
        start, end = 512 * p, min(512 * (p + 1), 1100)
        assert trace[(0, 0, p)]["visits"] == [emu.warp_blocks(w, start, end, 16) for w in range(4)]


@pytest.mark.parametrize("head_size,block_size,dtype", [
    (128, 16, torch.float16), (64, 8, torch.float32), (128, 32, torch.float16),
    (80, 16, torch.float32)])
def test_key_load_counts(head_size, block_size, dtype, traced, shared):
    inputs = make_inputs(head_size, block_size, dtype, lens=(64,), num_heads=1, num_kv_heads=1)
    x = 16 // inputs[1].element_size()
    group = max(32 // block_size, 1)
    chunks = head_size // x
    ours = kernel_trace.key_load_counts(
        kernel_trace.run_traced(*inputs, kernels=traced)[1][(0, 0, 0)])
    theirs = kernel_trace.key_load_counts(
        kernel_trace.run_traced(*inputs, variant="shared_load", kernels=shared)[1][(0, 0, 0)])
    key_bytes = block_size * head_size * inputs[1].element_size()
    assert ours["bytes"] == theirs["bytes"] == key_bytes  # one KV block's keys, once
    assert ours["distinct_sectors"] == theirs["distinct_sectors"] == key_bytes // 32
    assert ours["bytes_per_load"] == 16 and theirs["bytes_per_load"] == 16 // group
    assert ours["instructions"] == -(-chunks // group) and theirs["instructions"] == chunks
    assert theirs["lane_loads"] == 32 * chunks
    shape = emu.KernelShape(head_size, block_size, x)  # the emulator's count (lesson 05)
    assert emu.key_loads_per_block(shape) == (ours["instructions"], ours["bytes_per_load"])
    assert emu.key_loads_per_block(shape, shared_group_load=True) == \
        (theirs["instructions"], theirs["bytes_per_load"])
    assert theirs["sectors"] == theirs["distinct_sectors"]  # each instruction: whole sectors


# Grouped-query attention: the K/V bytes of one decode step (one layer), per-head kernel (V1)
# against the grouped one (version 3); benchmarks/RESULTS.md keeps the numbers.
GQA_SHAPES = {"SmolLM2": (9, 3, 64), "LLaMA-3": (32, 8, 128)}  # query heads, kv heads, head


@pytest.mark.parametrize("model", list(GQA_SHAPES))
def test_the_grouped_kernel_loads_each_key_and_value_once_per_group(model, traced):
    num_heads, num_kv_heads, head_size = GQA_SHAPES[model]
    group = num_heads // num_kv_heads
    lens = (100, 37)
    inputs = make_inputs(head_size, 16, torch.float16, lens=lens, num_heads=num_heads,
                         num_kv_heads=num_kv_heads)
    key_cache = inputs[1]
    ref = reference.paged_attention(*inputs)
    out_head, per_head = kernel_trace.run_traced(*inputs, version=1, kernels=traced)
    out_group, grouped = kernel_trace.run_traced(*inputs, version=3, kernels=traced)
    for out in (out_head, out_group):
        assert rel_err(out, ref) < TOL[torch.float16]
    # the cache bytes of the step: every KV block of every sequence, keys and values, for each
    # CUDA block that reads them (whole blocks: the tail of a last block is loaded too)
    once = sum(-(-n // 16) * 16 for n in lens) * num_kv_heads * head_size * 2  # bytes
    head_bytes, group_bytes = (kernel_trace.loaded_bytes(t) for t in (per_head, grouped))
    assert group_bytes == {"key": once, "value": once, "total": 2 * once}
    assert head_bytes["total"] == group * group_bytes["total"]
    # who loaded which key: the group's query heads each (V1), one CUDA block per kv head (3)
    for (kv_head, _, _), readers in kernel_trace.key_readers(per_head, key_cache).items():
        assert {h for h, _, _ in readers} == set(range(kv_head * group, (kv_head + 1) * group))
    for (kv_head, _, _), readers in kernel_trace.key_readers(grouped, key_cache).items():
        assert {h for h, _, _ in readers} == {kv_head}
    # the grouped CUDA block computed every query head's logits of its group
    for (kv_head, seq, _), t in grouped.items():
        assert t["group_logits"].shape == (group, lens[seq])
        for h in range(group):
            want = kernel_trace.reference_logits(*inputs, seq=seq, head=kv_head * group + h)
            assert rel_err(t["group_logits"][h], want) < 1e-3


def test_untraced_build_records_nothing():
    kernels = cuda_on_cpu.load()
    inputs = make_inputs(64, 16)
    kernels.module.trace_events(True)
    try:
        kernels.paged_attention(*inputs)
    finally:
        ints, values = kernels.module.take_events()
        kernels.module.trace_events(False)
    assert ints.shape == (0, 7) and values.shape == (0,)


def test_bad_variant_is_refused():
    with pytest.raises(ValueError, match="variant"):
        cuda_on_cpu.load("nope")
    with pytest.raises(ValueError, match="variant"):
        kernel_trace.run_traced(*make_inputs(), variant="plain")
