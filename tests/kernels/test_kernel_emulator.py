"""Lesson 06: the NumPy emulator of the CUDA kernel agrees with the torch reference.

The emulator runs csrc/paged_attention.cu's algorithm lane by lane (warps, thread groups,
butterflies, shared memory), so these tests check the kernel's *logic* on any machine; the GPU
tests in tests/gpu check the compiled kernel itself.
"""
import json
import math

import numpy as np
import pytest
import torch

from minipaged.lab import emulator as emu
from minipaged.kernels import reference

pytestmark = pytest.mark.lesson05

GQA = [(8, 2), (4, 4), (6, 1)]  # (num_heads, num_kv_heads)


def make_inputs(head_size, block_size, x, num_heads, num_kv_heads, context_lens, seed=0,
                dtype=torch.float32, spare_blocks=3):
    """N(0,1) query and caches; every sequence's blocks are scattered over a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = torch.randperm(num_blocks, generator=gen)  # physical blocks in random order
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int32)
    start = 0
    for seq, n in enumerate(blocks_per_seq):
        block_tables[seq, :n] = pool[start:start + n]
        start += n
    key_cache = torch.randn(num_blocks, num_kv_heads, head_size // x, block_size, x,
                            generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, num_kv_heads, head_size, block_size,
                              generator=gen).to(dtype)
    query = torch.randn(len(context_lens), num_heads, head_size, generator=gen).to(dtype)
    context_lens = torch.tensor(context_lens, dtype=torch.int32)
    return query, key_cache, value_cache, block_tables, context_lens, head_size ** -0.5


def rel_err(out, ref):
    out, ref = torch.as_tensor(out).double(), torch.as_tensor(ref).double()
    return ((out - ref).norm() / ref.norm()).item()


# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA, ids=lambda v: str(v))
@pytest.mark.parametrize("x", [4, 8], ids=["x4_fp32_kernel", "x8_fp16_kernel"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 96, 128])
def test_emulator_matches_reference(head_size, block_size, x, num_heads, num_kv_heads):
    # Context lengths: a single token, exactly one block, one token into a second block, and
    # a long context spread over many scattered blocks (and over all four warps).
    lens = [1, block_size, block_size + 1, 300]
    args = make_inputs(head_size, block_size, x, num_heads, num_kv_heads, lens,
                       seed=head_size + block_size + x)
    out = emu.paged_attention(*args)
    ref = reference.paged_attention(*args)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel_err(out, ref) < 1e-5


def test_emulator_long_context():
    args = make_inputs(128, 16, 8, 8, 2, [1000, 517], seed=7)
    assert rel_err(emu.paged_attention(*args), reference.paged_attention(*args)) < 1e-5


def test_emulator_keeps_input_kind_and_dtype():
    args = make_inputs(64, 16, 8, 4, 2, [5, 40], dtype=torch.float16)
    out = emu.paged_attention(*args)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    assert rel_err(out, reference.paged_attention(*args)) < 2e-3  # both rounded to fp16 at the end

    as_numpy = [a.numpy() if isinstance(a, torch.Tensor) else a for a in args]
    out_np = emu.paged_attention(*as_numpy)
    assert isinstance(out_np, np.ndarray) and out_np.dtype == np.float16
    np.testing.assert_array_equal(out_np, out.numpy())


def test_garbage_past_the_context_is_never_read():
    """NaN in the unwritten tail of each last block, and in unused blocks, must not leak out."""
    block_size = 16
    lens = [3, 17, 40]
    args = make_inputs(64, block_size, 4, 4, 2, lens, seed=3)
    query, key_cache, value_cache, block_tables, context_lens, scale = args
    ref = reference.paged_attention(*args)  # computed on the clean caches

    used = set()
    for seq, n in enumerate(lens):
        blocks = block_tables[seq, : math.ceil(n / block_size)].tolist()
        used.update(blocks)
        tail = n % block_size
        if tail:
            key_cache[blocks[-1], :, :, tail:, :] = float("nan")
            value_cache[blocks[-1], :, :, tail:] = float("nan")
    for block in set(range(key_cache.shape[0])) - used:
        key_cache[block] = float("nan")
        value_cache[block] = float("nan")

    out = emu.paged_attention(query, key_cache, value_cache, block_tables, context_lens, scale)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("num_threads", [32, 64, 256])
def test_number_of_warps_does_not_change_the_result(num_threads):
    args = make_inputs(96, 8, 4, 6, 2, [1, 77, 300], seed=11)
    assert rel_err(emu.paged_attention(*args, num_threads=num_threads),
                   reference.paged_attention(*args)) < 1e-5


def test_unsupported_block_size_is_rejected():
    args = make_inputs(64, 64, 4, 2, 2, [10])
    with pytest.raises(ValueError, match="block_size"):
        emu.paged_attention(*args)


# ----------------------------------------------------------------------------------------------
# The butterfly itself
# ----------------------------------------------------------------------------------------------
def test_butterfly_gives_every_lane_the_total():
    values = np.random.default_rng(0).standard_normal(32).astype(np.float32)
    trace = []
    total = emu.butterfly_reduce(values, "sum", (16, 8, 4, 2, 1), trace=trace)
    np.testing.assert_allclose(total, np.full(32, values.sum()), rtol=1e-5)
    np.testing.assert_array_equal(emu.butterfly_reduce(values, "max"), np.full(32, values.max()))

    assert [r["mask"] for r in trace] == [16, 8, 4, 2, 1]
    for step, record in enumerate(trace):
        assert record["pairs"] == [[lane, lane ^ record["mask"]] for lane in range(32)]
        # after step k every lane holds the sum over its team of 2^(k+1) lanes
        team = 32 >> (step + 1)  # lanes that agree after this step differ only in bits >= team
        expected = [values[[o for o in range(32) if o % team == lane % team]].sum()
                    for lane in range(32)]
        np.testing.assert_allclose(record["values_after"], expected, rtol=1e-5)
        assert record["values_before"] == (trace[step - 1]["values_after"] if step else
                                           [float(v) for v in values])


def test_partial_masks_reduce_within_teams():
    """masks (1,) adds neighbours only: the thread-group reduction of block size 16."""
    values = np.arange(32, dtype=np.float32)
    pairs = emu.butterfly_reduce(values, "sum", (1,))
    np.testing.assert_array_equal(pairs, np.repeat(values[0::2] + values[1::2], 2))


def test_trace_records_one_cuda_block_in_plain_data():
    args = make_inputs(64, 16, 4, 4, 2, [5, 70], seed=5)
    trace = []
    emu.paged_attention(*args, trace=trace, trace_filter=(1, 2))
    assert trace and all(r["seq"] == 1 and r["head"] == 2 for r in trace)
    json.dumps(trace)  # plain data only: the visualizer may ship it to the browser
    phases = {(r["phase"], r["stage"]) for r in trace}
    assert phases == {("qk_dot", "warp"), ("max", "warp"), ("max", "across_warps"),
                      ("sum", "warp"), ("sum", "across_warps"), ("logits_v", "warp")}
    # block size 16 -> 2 lanes per token -> one qk_dot step (mask 1) per KV block
    qk = [r for r in trace if r["phase"] == "qk_dot"]
    assert sorted(r["block"] for r in qk) == list(range(math.ceil(70 / 16)))
    assert {r["mask"] for r in qk} == {1}
    # the max butterfly stops at mask G = 2: lanes of one group already agree
    assert [r["mask"] for r in trace if r["phase"] == "max" and r["stage"] == "warp"
            and r["warp"] == 0] == [16, 8, 4, 2]
    for r in trace:
        assert len(r["values_before"]) == len(r["values_after"]) == len(r["pairs"]) == 32

    assert emu.paged_attention(*args, trace=None) is not None  # and no trace without a list


# ----------------------------------------------------------------------------------------------
# A broken butterfly is caught
# ----------------------------------------------------------------------------------------------
def _wrong_partner(mask):
    return ((np.arange(32) ^ mask) + 1) % 32  # off by one lane


@pytest.mark.parametrize(
    "fault",
    [
        {"_masks": {"sum": (16, 8, 4, 2)}},  # the exp-sum butterfly stops one step early
        {"_masks": {"sum": (8, 4, 2, 1)}},  # ... or starts one step late
        {"_masks": {"qk_dot": ()}},  # the two lanes of a token never add their halves
        {"_masks": {"logits_v": (1,)}},  # four lanes share a value row, only pairs are added
        {"_partner": _wrong_partner},  # every shuffle reads the wrong lane
    ],
    ids=["sum_stops_early", "sum_starts_late", "no_group_reduction", "half_row_reduction",
         "wrong_lanes"],
)
def test_broken_butterfly_is_detected(fault):
    # fp32 layout, block size 16: G = 2 lanes per token, V_VECS_PER_ROW = 4 lanes per row
    args = make_inputs(128, 16, 4, 4, 2, [300, 250], seed=2)
    ref = reference.paged_attention(*args)
    assert rel_err(emu.paged_attention(*args), ref) < 1e-5
    assert rel_err(emu.paged_attention(*args, **fault), ref) > 0.1


def test_broken_max_butterfly_is_harmless():
    """Softmax is unchanged by subtracting any constant: the max only prevents overflow."""
    args = make_inputs(128, 16, 4, 4, 2, [300, 250], seed=2)
    out = emu.paged_attention(*args, _masks={"max": (16,)})
    assert rel_err(out, reference.paged_attention(*args)) < 1e-5


# ----------------------------------------------------------------------------------------------
# Memory addresses of one warp's 16-byte key loads (lesson 05)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_key_layout_makes_a_warp_read_512_contiguous_bytes(block_size):
    shape = emu.KernelShape(128, block_size, 8)
    paged = emu.warp_key_load(shape, 2, "paged", kv_block=3)
    addresses = sorted(paged["address"])
    assert addresses == list(range(addresses[0], addresses[0] + 512, 16))  # coalesced
    assert (paged["sectors"], paged["lines"]) == (16, 4)
    naive = emu.warp_key_load(shape, 2, "naive", kv_block=3)
    assert naive["lines"] == {8: 8, 16: 16, 32: 32}[block_size]  # one line per token (or two)
    assert naive["sectors"] >= paged["sectors"]


def test_warp_key_load_follows_the_kernels_lane_to_chunk_mapping():
    shape = emu.KernelShape(64, 16, 4)  # G = 2, 16 chunks, 8 loads per lane
    load = emu.warp_key_load(shape, 4, "paged", load=1)
    assert load["token"][:4] == [0, 0, 1, 1] and load["chunk"][:4] == [2, 3, 2, 3]
    assert load["address"][3] == (3 * 16 + 1) * 16  # chunk 3 of token 1
