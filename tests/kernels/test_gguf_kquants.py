"""The C++ op for GGUF's 256-weight blocks (``csrc/cpu/gguf_kquants.cpp``, Q4_K and Q6_K): a one-hot
input row gives back the weights the ``gguf`` package dequantizes, bit for bit; N(0,1) inputs give
the dequantized matmul up to float rounding (relative error), for one row and for batches, odd
numbers of weight rows included; bad arguments are refused by name."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from budgets import examples
from gguf_random import random_blocks
from minipaged.kernels.gguf_blocks import FORMATS

gguf = pytest.importorskip("gguf")

def matmul(cpu_op, x: torch.Tensor, raw: np.ndarray, name: str) -> torch.Tensor:
    return cpu_op.module.gguf_kquant_linear(x, torch.from_numpy(raw), FORMATS[name].ggml_type)


@settings(max_examples=examples(12), deadline=None)
@given(name=st.sampled_from(["Q4_K", "Q6_K"]), out=st.sampled_from([1, 3, 17]),
       blocks=st.integers(1, 2), seed=st.integers(0, 2**32 - 1))
def test_one_hot_rows_give_the_gguf_package_s_weights_bit_for_bit(cpu_op, name, out, blocks,
                                                                  seed):
    raw = random_blocks(name, out, blocks, seed)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])  # (out, in)
    inputs = want.shape[1]
    got = matmul(cpu_op, torch.eye(inputs), raw, name)  # row i: every weight row's weight i
    assert np.array_equal(got.numpy(), want.T)


@settings(max_examples=examples(30), deadline=None)
@given(name=st.sampled_from(["Q4_K", "Q6_K"]), out=st.sampled_from([1, 5, 33, 67]),
       blocks=st.integers(1, 3), rows=st.sampled_from([1, 3, 4, 5, 9]),
       seed=st.integers(0, 2**32 - 1))
def test_n01_inputs_give_the_dequantized_matmul(cpu_op, name, out, blocks, rows, seed):
    raw = random_blocks(name, out, blocks, seed)
    weights = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name]))
    x = torch.randn(rows, weights.shape[1], generator=torch.Generator().manual_seed(seed % 2**31))
    reference = x.double() @ weights.double().t()
    size = (x.double().abs() @ weights.double().abs().t()).max()  # the products' size
    got = matmul(cpu_op, x, raw, name)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    assert ((got.double() - reference).abs().max() / size).item() < 1e-5
    # and each row alone, as a decode step, gives the batch's row exactly
    for i in range(rows):
        assert torch.equal(matmul(cpu_op, x[i:i + 1], raw, name)[0], got[i])


def test_strided_rows_of_x_are_read_where_they_are(cpu_op):
    raw = random_blocks("Q4_K", 6, 1, 0)
    wide = torch.randn(3, 512)
    assert torch.equal(matmul(cpu_op, wide[:, :256], raw, "Q4_K"),
                       matmul(cpu_op, wide[:, :256].contiguous(), raw, "Q4_K"))


def test_bad_arguments_are_refused_by_name(cpu_op):
    op = cpu_op.module.gguf_kquant_linear
    x, blocks = torch.randn(2, 256), torch.zeros(3, 144, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="block format 3 is not one this op reads"):
        op(x, blocks, 3)
    with pytest.raises(RuntimeError, match="256 features need 210 bytes of blocks per row, "
                                           "got 144"):
        op(x, blocks, 14)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        op(torch.randn(2, 32), blocks, 12)
    with pytest.raises(RuntimeError, match="x must be float32"):
        op(x.double(), blocks, 12)
    with pytest.raises(RuntimeError, match="blocks must be uint8"):
        op(x, blocks.float(), 12)
