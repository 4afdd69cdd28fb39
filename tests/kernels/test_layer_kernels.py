"""csrc/layer_kernels.cu (RMSNorm with and without the residual add, the rotary embedding,
SiLU-and-multiply) built for the CPU, against the torch reference (kernels/reference.py).

Inputs are N(0,1)-sized and drawn fresh per case, and every output element is compared (one the
kernel never wrote holds whatever the allocator left there). The kernels round where torch
rounds, so fp16 and bf16 agree with the reference within two units in the last place (RMSNorm's
sum of squares is added in another order); the residual sum and SiLU's inputs exactly.
"""
from __future__ import annotations

import pytest
import torch

from minipaged.kernels import cuda_on_cpu, reference

pytestmark = pytest.mark.slow  # the CUDA-on-CPU build (minutes the first time)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels():
    return cuda_on_cpu.load()


def close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """No NaN; fp16 and bf16 at most two units in the last place apart (the norm's
    1 / sqrt and its sum round differently, which can move a normalised value by one unit, and
    the weight's multiply carries that on), fp32 a few; the relative error small on N(0,1)-sized
    data."""
    assert not torch.isnan(ours).any(), "an element was never written"
    ours, ref = ours.double(), ref.double()
    ulp = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    units = 8 if dtype == torch.float32 else 2.01
    assert ((ours - ref).abs() <= units * ulp * ref.abs().clamp(min=1e-3) + 1e-7).all(), \
        (ours - ref).abs().max()
    assert ((ours - ref).norm() / ref.norm()).item() < 4 * ulp


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 576), (33, 4096), (3, 100)])
def test_rms_norm_and_add_rms_norm(kernels, dtype, tokens, hidden):
    gen = torch.Generator().manual_seed(tokens * hidden)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    residual = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    close(kernels.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), dtype)
    out, total = kernels.add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_total = reference.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(total, ref_total)  # one rounding of one sum: exact
    close(out, ref_out, dtype)


def test_rms_norm_reads_strided_rows(kernels):
    """x as a view of every other row (the model never passes one, the binding allows it)."""
    big = torch.randn(10, 64)
    weight = torch.randn(64)
    close(kernels.rms_norm(big[::2], weight, 1e-5), reference.rms_norm(big[::2], weight, 1e-5),
          torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_size", [(9, 3, 64), (4, 4, 128), (2, 1, 80)])
def test_rotary(kernels, dtype, heads, kv_heads, head_size):
    gen = torch.Generator().manual_seed(heads * head_size)
    tokens, max_pos = 11, 300
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_size, 2).float() / head_size))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, head_size, generator=gen).to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=gen)
    q_out, k_out = kernels.rotary(positions, q, k, cos, sin)
    ref_q, ref_k = reference.rotary(positions, q, k, cos, sin)
    close(q_out, ref_q, dtype)
    close(k_out, ref_k, dtype)


def test_rotary_refuses_positions_past_the_table(kernels):
    q, k = torch.randn(2, 2, 64), torch.randn(2, 1, 64)
    cos = sin = torch.randn(16, 64)
    with pytest.raises(RuntimeError, match=r"positions must be in \[0, 16\), got 3 .. 16"):
        kernels.rotary(torch.tensor([3, 16]), q, k, cos, sin)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(kernels, dtype):
    gen = torch.Generator().manual_seed(5)
    gate = (3 * torch.randn(37, 300, generator=gen)).to(dtype)
    up = torch.randn(37, 300, generator=gen).to(dtype)
    close(kernels.silu_and_mul(gate, up), reference.silu_and_mul(gate, up), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_on_the_halves_of_one_matmul(kernels, dtype):
    """LLaMA's MLP computes gate and up as one matmul (models/parallel_layers.FusedColumns):
    the kernel reads the two halves of its output in place, rows at a stride, no copy."""
    gen = torch.Generator().manual_seed(6)
    fused = (3 * torch.randn(29, 2 * 300 + 7, generator=gen)).to(dtype)[:, 7:]  # odd offset
    gate, up = fused.split(300, dim=-1)
    assert not gate.is_contiguous() and gate.stride(0) == 607
    close(kernels.silu_and_mul(gate, up), reference.silu_and_mul(gate, up), dtype)
    three_d = fused.reshape(29, 2, 300).contiguous()  # contiguous of any shape: one row each
    close(kernels.silu_and_mul(three_d[:, 0].contiguous(), three_d[:, 1].contiguous()),
          reference.silu_and_mul(three_d[:, 0], three_d[:, 1]), dtype)
    close(kernels.silu_and_mul(gate[:1], up[:1]), reference.silu_and_mul(gate[:1], up[:1]), dtype)
    assert kernels.silu_and_mul(gate[:0], up[:0]).shape == (0, 300)  # an empty batch


def test_bad_inputs_name_what_is_wrong(kernels):
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match=r"weight must be a contiguous \[64\] tensor"):
        kernels.rms_norm(x, torch.randn(32), 1e-5)
    with pytest.raises(RuntimeError, match="must have the dtype of x"):
        kernels.add_rms_norm(x, torch.randn(3, 64, dtype=torch.float16), torch.randn(64), 1e-5)
    with pytest.raises(RuntimeError, match="one shape and dtype"):
        kernels.silu_and_mul(torch.randn(4), torch.randn(5))
    with pytest.raises(RuntimeError, match="contiguous rows"):  # a column at a stride
        kernels.module.silu_and_mul(torch.empty(4, 3), torch.randn(3, 4).t(), torch.randn(4, 3))
    with pytest.raises(RuntimeError, match="head size must be even"):
        kernels.rotary(torch.tensor([0]), torch.randn(1, 1, 3), torch.randn(1, 1, 3),
                       torch.randn(4, 3), torch.randn(4, 3))
