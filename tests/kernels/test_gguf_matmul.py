"""csrc/gguf_matmul.cu (x W^T with W as GGUF blocks, dequantized inside the dot product) built for
the CPU, against ``kernels/gguf_blocks.py``'s dequantization and a float64 matmul.

N(0,1) rows of x and random blocks (codes at random, float16 scales of a weight's size) of every
format, at shapes whose rows are not a multiple of the kernel's 4 rows of x or 4 weight rows per
CUDA block; the error is measured against the size of the products summed (sum |x| |w|). A
one-hot row of x gives back a row of the dequantized weights bit for bit: each weight is computed
with the reference's operations and roundings. Bad arguments raise a RuntimeError naming them.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from budgets import examples
from gguf_random import random_blocks
from minipaged.kernels import cuda_on_cpu
from minipaged.kernels.gguf_blocks import FORMATS, dequantize
from minipaged.models import gguf_linear
from minipaged.models.gguf_linear import GGUFWeight

pytestmark = pytest.mark.slow  # the CUDA-on-CPU build (minutes the first time)

NAMES = sorted(FORMATS)
ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


@pytest.fixture(scope="module")
def kernels():
    return cuda_on_cpu.load()


def blocks_of(name: str, out: int, blocks: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(name, out, blocks, seed))


def check_product(got: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, name: str) -> None:
    """got = x W^T within float rounding: float32 sums (a few units of 2^-23 of the products'
    size), then one rounding to x's dtype (half a unit of it, relative to the output)."""
    w = dequantize(blocks, FORMATS[name]).double()  # (out, in)
    reference = x.double() @ w.t()
    size = x.double().abs() @ w.abs().t()
    assert got.shape == reference.shape and got.dtype == x.dtype
    assert not torch.isnan(got).any(), "an output was never written"
    bound = 64 * ULP[torch.float32] * size + ULP[x.dtype] * reference.abs() + 1e-30
    assert ((got.double() - reference).abs() <= bound).all(), \
        ((got.double() - reference).abs() / bound).max()


@settings(max_examples=examples(12), deadline=None)
@given(name=st.sampled_from(NAMES), out=st.sampled_from([1, 5, 13]), blocks=st.integers(1, 3),
       rows=st.sampled_from([1, 3, 6, 9]), seed=st.integers(0, 2**16))
def test_every_format_gives_the_dequantized_matmul(kernels, name, out, blocks, rows, seed):
    w = blocks_of(name, out, blocks, seed)
    x = torch.randn(rows, blocks * FORMATS[name].weights,
                    generator=torch.Generator().manual_seed(seed))
    check_product(kernels.gguf_linear(x, w, FORMATS[name].ggml_type), x, w, name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_half_inputs_sum_in_float32_and_round_once(kernels, name, dtype):
    w = blocks_of(name, 7, 2, 5)
    x = torch.randn(5, 2 * FORMATS[name].weights, generator=torch.Generator().manual_seed(1))
    check_product(kernels.gguf_linear(x.to(dtype), w, FORMATS[name].ggml_type), x.to(dtype),
                  w, name)


@pytest.mark.parametrize("name", NAMES)
def test_one_hot_rows_give_the_weights_bit_for_bit(kernels, name):
    fmt = FORMATS[name]
    w = blocks_of(name, 6, 2 if fmt.weights == 32 else 1, 11)
    width = w.shape[1] // fmt.bytes * fmt.weights
    # every column of the first block and a few of the others, in a ragged number of rows
    columns = torch.tensor(sorted(set(range(fmt.weights)) | {width - 1, width // 2 + 3}))
    x = torch.eye(width)[columns]  # (rows, in), row i the one-hot of column columns[i]
    got = kernels.gguf_linear(x, w, fmt.ggml_type)
    assert torch.equal(got, dequantize(w, fmt).t()[columns])
    # in float16: the weight rounded once to float16
    half = kernels.gguf_linear(x.half(), w, fmt.ggml_type)
    assert torch.equal(half, dequantize(w, fmt).t()[columns].half())


def test_strided_rows_empty_inputs_and_more_dimensions(kernels):
    w = blocks_of("Q8_0", 9, 2, 3)
    big = torch.randn(10, 64)
    check_product(kernels.gguf_linear(big[::3], w, 8), big[::3], w, "Q8_0")  # rows 3 apart
    assert kernels.gguf_linear(torch.zeros(0, 64), w, 8).shape == (0, 9)
    x = torch.randn(2, 3, 64)
    got = kernels.gguf_linear(x, w, 8)
    assert got.shape == (2, 3, 9)
    check_product(got.reshape(6, 9), x.reshape(6, 64), w, "Q8_0")


BAD = [
    ("a format it does not read", lambda x, w: (x, w, 7),
     r"GGUF block format 7 is not supported: the kernel reads Q8_0 \(8\), Q4_1 \(3\)"),
    ("float64 x", lambda x, w: (x.double(), w, 3), r"unsupported dtype Double"),
    ("int x", lambda x, w: (x.int(), w, 3), r"unsupported dtype Int"),
    ("float blocks", lambda x, w: (x, w.float(), 3), r"weight must be a contiguous uint8"),
    ("strided blocks", lambda x, w: (x, w.t().contiguous().t(), 3),
     r"\(not contiguous\)"),
    ("a row of x too short", lambda x, w: (x[:, :32], w, 3),
     r"weight rows hold 40 bytes, but 32 inputs of Q4_1 take 20 \(1 blocks of 20\)"),
    ("in not a whole block", lambda x, w: (x[:, :40].contiguous(), w, 3),
     r"in_features = 40 is not a multiple of Q4_1's 32 weights per block"),
    ("a vector", lambda x, w: (x[0], w, 3), r"x must be \[rows, in_features\]"),
    ("the last dimension strided", lambda x, w: (x.t().contiguous().t(), w, 3),
     r"contiguous last dimension"),
    ("x on another device", lambda x, w: (x.to("meta"), w, 3),
     r"x must be a CPU \(the CUDA-on-CPU build\) tensor, got meta"),
    ("blocks on another device", lambda x, w: (x, w.to("meta"), 3),
     r"weight must be a CPU \(the CUDA-on-CPU build\) tensor, got meta"),
    ("blocks at an odd address", lambda x, w: (x, torch.zeros(1 + w.numel(), dtype=torch.uint8)
                                               [1:].view(w.shape), 3), r"even address"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_arguments_raise_naming_them(kernels, case):
    _, make, expect = case
    x, w = torch.randn(3, 64), blocks_of("Q4_1", 4, 2, 0)
    with pytest.raises(RuntimeError, match=expect):
        kernels.module.gguf_linear(*make(x, w))


def test_the_weight_s_cuda_routine_is_this_kernel(kernels, monkeypatch):
    """``GGUFWeight``'s ``cuda`` routine (the kernels faked as present on this device) calls it:
    one row and a step of several, every format."""
    monkeypatch.setattr(gguf_linear, "_cuda_op", lambda device: kernels)
    monkeypatch.setattr(gguf_linear, "row_choices", {})
    for name in NAMES:
        weight = GGUFWeight(blocks_of(name, 5, 1, 2), FORMATS[name])
        assert weight.runs("cuda") and not weight.runs("cuda", torch.zeros(1, 8))
        x = torch.randn(3, weight.shape[1])
        check_product(weight.linear(x, "cuda"), x, weight.blocks, name)
        check_product(weight.linear(x[:1], "cuda"), x[:1], weight.blocks, name)


def test_a_model_whose_matmuls_all_run_this_kernel(kernels, monkeypatch, tmp_path):
    """A tiny random LLaMA written as GGUF (Q4_1 layers, Q8_0 embedding and head), every matmul
    forced to ``cuda`` (the kernels faked as present on this device): its teacher-forced logits
    equal those of the CPU's routines within float tolerance. (tests/gpu/test_gguf_gpu.py runs
    the same on a GPU, and greedy tokens against transformers'.)"""
    from minipaged.engine.llm_engine import LLMEngine
    from minipaged.lab.tiny_gguf import save_tiny_gguf
    from minipaged.worker import checkpoint
    from minipaged.worker.gguf_loader import quantized_weights
    from paged_forward import teacher_forced_logits

    pytest.importorskip("gguf")
    monkeypatch.setattr(checkpoint, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(gguf_linear, "choices", {})
    monkeypatch.setattr(gguf_linear, "row_choices", {})
    path, _ = save_tiny_gguf(str(tmp_path), seed=3)
    settings = dict(block_size=16, num_gpu_blocks=16, max_model_len=64, dtype="float32")
    on_cpu = LLMEngine(path, quantization="gguf", **settings)
    monkeypatch.setattr(gguf_linear, "_cuda_op", lambda device: kernels)
    monkeypatch.setenv("MINIPAGED_GGUF_ROUTINE", "cuda")
    ours = LLMEngine(path, quantization="gguf", **settings)
    assert {w.routine for w in quantized_weights(ours.worker.model)} == {"cuda"}
    launches = kernels.module.counters()[0]
    prompts = [[5, 17, 200, 3, 64, 9, 31, 77]]  # a prompt of 6, then 2 decode steps
    got = teacher_forced_logits(ours, prompts, num_prefill=6, block_size=16)
    assert kernels.module.counters()[0] > launches
    expected = teacher_forced_logits(on_cpu, prompts, num_prefill=6, block_size=16)
    for a, b in zip(got, expected):
        assert b.abs().max() > 1.0
        torch.testing.assert_close(a, b, atol=5e-4, rtol=1e-3)
