"""The kernel grid of benchmarks/kernel.py (``--grid``): what can be checked without a GPU.

Its cases, the input copies each is timed on warm and cold for a given L2, the K/V bytes each
kernel must read (a grouped kernel reads each kv head once), the time budget against gpu-check's
stage limit, and ``--grid`` on a machine without CUDA.
"""
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from repo_paths import ROOT

_spec = importlib.util.spec_from_file_location(
    "kernel_benchmark", os.path.join(ROOT, "benchmarks", "kernel.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

H100_L2 = 50 * 2**20
H200_L2 = 60 * 2**20  # as torch reports it; the spec sheets say 50 and 60 MB


def test_the_grid_has_both_shapes_both_dtypes_three_batches_and_three_contexts():
    cases = bench.grid_cases()
    assert len(cases) == 2 * 2 * 3 * 3
    shapes = {(name, kv_heads, versions) for name, kv_heads, versions, *_ in cases}
    # grouped: the grouped kernel (3) and the automatic plan (0); MHA: the automatic plan
    assert shapes == {("GQA 32/8", 8, (3, 0)), ("MHA 32/32", 32, (0,))}
    for name, kv_heads, versions in shapes:
        rows = [(d, b, c) for n, _, _, d, b, c in cases if n == name]
        assert sorted(rows, key=str) == sorted(
            [(d, b, c) for d in (torch.float16, torch.bfloat16) for b in (1, 8, 64)
             for c in (1024, 4096, 16384)], key=str)
    assert bench.NUM_HEADS == 32 and bench.HEAD_SIZE == 128 and bench.BLOCK_SIZE == 16


def test_a_kernel_must_read_each_kv_head_once():
    # 32 query heads on 8 kv heads read a quarter of what 32 on 32 read
    gqa = bench.grid_kv_bytes(8, 4096, 8, torch.float16)
    assert gqa == 8 * 4096 * 8 * 128 * 2 * 2  # tokens x kv heads x head size x (K, V) x 2 bytes
    assert bench.grid_kv_bytes(8, 4096, 32, torch.float16) == 4 * gqa
    assert bench.grid_kv_bytes(8, 4096, 8, torch.bfloat16) == gqa  # 2 bytes too
    # the largest case, one copy of it: 16,384 tokens x 64 sequences of MHA fp16, 17 GB
    assert bench.grid_kv_bytes(64, 16384, 32, torch.float16) == 16384 * 64 * 32 * 128 * 2 * 2
    # the table's K/V column for the main table is the same rule
    assert bench.kv_bytes(8, 4096) == bench.grid_kv_bytes(8, 4096, bench.NUM_KV_HEADS,
                                                          bench.DTYPE)


@pytest.mark.parametrize("l2", [H100_L2, H200_L2, 50 * 10**6, 96 * 2**20])
def test_warm_is_one_copy_and_cold_passes_four_l2s_with_no_copy_to_spare(l2):
    big = 0
    for _, kv_heads, _, dtype, batch, context in bench.grid_cases():
        nbytes = bench.grid_kv_bytes(batch, context, kv_heads, dtype)
        warm, cold, warning = bench.grid_copies(nbytes, l2)
        assert warm == 1 and warning is None  # the memory cap never binds in the grid
        assert cold * nbytes > 4 * l2  # one cold pass touches more than 4 x L2
        assert cold == 1 or (cold - 1) * nbytes <= 4 * l2  # and no more copies than needed
        big += cold == 1
    assert big > 0  # the big cases: warm and cold are one measurement


@given(per_copy=st.integers(1, 2**36), l2=st.integers(2**20, 2**30))
def test_cold_copies_for_any_case_and_l2(per_copy, l2):
    """Any K/V size and L2: cold passes 4 x L2 with no copy to spare, unless the memory cap
    binds, and then a warning says the case may be partly served from L2."""
    warm, cold, warning = bench.grid_copies(per_copy, l2)
    assert warm == 1 and cold >= 1
    if warning is None:
        assert cold * per_copy > 4 * l2 and (cold - 1) * per_copy <= 4 * l2
        assert cold == 1 or cold * per_copy <= bench.MAX_ROTATION_BYTES
    else:
        assert cold * per_copy <= bench.MAX_ROTATION_BYTES < (cold + 1) * per_copy
        assert "L2" in warning


def test_copies_for_an_h100_by_case():
    def cold(batch, context, kv_heads):
        return bench.grid_copies(bench.grid_kv_bytes(batch, context, kv_heads, torch.float16),
                                 H100_L2)[1]

    # GQA batch 1 at 1,024 tokens reads 4 MiB: 51 copies pass 4 x 50 MiB (50 would not)
    assert cold(1, 1024, 8) == 51
    assert cold(1, 1024, 32) == 13 and cold(8, 4096, 8) == 2
    assert cold(1, 16384, 32) == 1 and cold(64, 16384, 32) == 1  # 256 MiB, 16 GiB: one copy


def test_the_grid_fits_its_gpu_check_stage_and_ninety_seconds():
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    limit = int(re.search(r"^kernel-grid\|(\d+)\|python3 benchmarks/kernel.py --grid$", script,
                          re.M).group(1))
    for l2 in (H100_L2, H200_L2):
        estimate = bench.grid_time_estimate(l2)
        assert 10 < estimate <= limit <= 90
        # the estimate grows with the calls' time: a card half as fast costs more
        assert bench.grid_time_estimate(l2, bandwidth=bench.GRID_BANDWIDTH / 2) > estimate
    # the largest calls are replayed fewer times, the rest the usual 15
    assert bench.grid_rounds(bench.grid_kv_bytes(64, 16384, 32, torch.float16)) == 5
    assert bench.grid_rounds(bench.grid_kv_bytes(1, 1024, 8, torch.float16)) == 15


@pytest.mark.slow  # (a fresh interpreter importing torch: 6 s)
def test_grid_without_cuda_says_so_and_exits_0():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: --grid would time it")
    proc = subprocess.run([sys.executable, "benchmarks/kernel.py", "--grid"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "CUDA is required" in proc.stdout
    help_text = subprocess.run([sys.executable, "benchmarks/kernel.py", "--help"], cwd=ROOT,
                               capture_output=True, text=True, timeout=120).stdout
    assert "--grid" in help_text
