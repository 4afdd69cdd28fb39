"""Lesson 05's load comparison (minipaged/lab/load_comparison.py): the inputs, the table, and the
two traced builds' counts (G times as many load instructions with vLLM's, the same bytes)."""
import pytest
import torch

from minipaged.kernels.reference import paged_attention as paged_attention_ref
from minipaged.lab import load_comparison

pytestmark = pytest.mark.lesson05


@pytest.mark.parametrize("dtype, x", [(torch.float16, 8), (torch.float32, 4)])
def test_one_sequence_is_one_head_over_blocks_in_reverse_order(dtype, x):
    query, key_cache, value_cache, table, lens, scale = load_comparison.one_sequence(
        128, 16, dtype, tokens=64)
    assert key_cache.shape == (4, 1, 128 // x, 16, x) and key_cache.dtype == dtype
    assert value_cache.shape == (4, 1, 128, 16) and query.shape == (1, 1, 128)
    assert table.tolist() == [[3, 2, 1, 0]] and lens.tolist() == [64]
    assert scale == 128 ** -0.5
    out = paged_attention_ref(query, key_cache, value_cache, table, lens, scale)
    assert load_comparison.rel_err(out, out) == 0.0


@pytest.mark.parametrize("head_size, block_size, tokens", [(128, 16, 60), (128, 0, 64),
                                                            (100, 16, 64), (128, 16, 0)])
def test_bad_shapes_are_named(head_size, block_size, tokens):
    with pytest.raises(ValueError, match="must be a positive multiple"):
        load_comparison.one_sequence(head_size, block_size, torch.float16, tokens=tokens)


def test_unknown_variant_is_named():
    with pytest.raises(ValueError, match="unknown variants"):
        load_comparison.compare_key_loads({"mine": None}, [(torch.float16, 128, 16)])


def test_markdown_table_has_one_line_per_row():
    row = {"dtype": "float16", "head_size": 128, "block_size": 16, "G": 2, "load": "ours",
           "bytes_per_load": 16, "instructions": 4, "lane_loads": 128, "bytes": 2048,
           "sectors": 64, "lines": 16, "rel_err": 1e-4, "ms": 12.0}
    lines = load_comparison.markdown_table([row, {**row, "load": "vLLM's"}]).split("\n")
    assert len(lines) == 4 and lines[0].count("|") == lines[2].count("|") == 12
    assert "| float16, 128, 16 | 2 | ours | 16 | 4 | 128 | 2048 | 64 | 16 | 1.0e-04 | 12 ms |" \
        == lines[2]


@pytest.mark.slow
def test_vllms_load_issues_g_times_the_instructions_for_the_same_bytes():
    from minipaged.kernels import cuda_on_cpu

    variants = {"ours": cuda_on_cpu.load("traced"), "vLLM's": cuda_on_cpu.load("shared_load")}
    rows, traces = load_comparison.compare_key_loads(variants, [(torch.float16, 128, 16)])
    ours, theirs = rows
    assert (ours["load"], theirs["load"]) == ("ours", "vLLM's")
    assert theirs["instructions"] == ours["G"] * ours["instructions"]
    assert theirs["bytes"] == ours["bytes"] and theirs["sectors"] == ours["sectors"]
    assert set(traces) == {("float16", 128, 16, "ours"), ("float16", 128, 16, "vLLM's")}
